"""`meshkeeper data prepare INPUT... --tokenizer T --out DIR` and `meshkeeper data verify DIR`
(docs/data.md, "Preparing a dataset"). The work is the dataset package's; it needs the `data`
extra (numpy, tokenizers, pyarrow), imported only when one of these commands runs."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

EXTRA = "numpy", "tokenizers", "pyarrow"


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="prepare a token dataset from text, or verify one")
    data = p.add_subparsers(dest="data_cmd", required=True, metavar="COMMAND")
    q = data.add_parser(
        "prepare",
        help="tokenize .txt/.jsonl/.jsonl.gz/.parquet files into a dataset directory",
        description="Re-running with the same inputs, tokenizer and options does nothing.",
    )
    q.add_argument("inputs", nargs="+", metavar="INPUT", help="files, directories, globs")
    q.add_argument("--tokenizer", type=Path, required=True, help="a tokenizer.json or its dir")
    q.add_argument("--out", type=Path, required=True, help="the dataset directory to write")
    q.add_argument("--text-field", default="text", help="JSONL field / Parquet column")
    q.add_argument(
        "--split-on-blank-lines", action="store_true", help=".txt: a document per paragraph"
    )
    q.add_argument("--skip-bad-records", action="store_true", help="count them, do not fail")
    q.add_argument("--eos-id", type=int, help="ends each document (default: the tokenizer's EOS)")
    q.add_argument("--shard-tokens", type=int, help="ids per shard file (default 2**26)")
    val = q.add_mutually_exclusive_group()
    val.add_argument("--val-fraction", type=float, help="share of documents held out (0.01)")
    val.add_argument("--val-docs", type=int, help="hold out this many documents instead")
    q.add_argument("--split-seed", type=int, default=0, help="seeds the per-document hash")
    q.add_argument("--workers", type=int, help="tokenizing processes (default min(CPUs, 8))")
    q.add_argument("--quiet", action="store_true", help="no progress bar")
    q.set_defaults(fn=cmd_prepare)
    v = data.add_parser("verify", help="check every file of a dataset against its manifest")
    v.add_argument("dir", type=Path)
    v.add_argument("--quiet", action="store_true", help="no progress bar")
    v.set_defaults(fn=cmd_verify)


def _need(*modules: str) -> str | None:
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            return f"{name} is not installed; pip install 'meshkeeper[data]'"
    return None


def _fail(message: str, code: int = 1) -> int:
    print(f"meshkeeper: {message}", file=sys.stderr)
    return code


def _progress(quiet: bool, counts: bool) -> Progress:
    """On stderr: stdout keeps the summary and the spec lines, for scripts."""
    columns = [TextColumn("{task.description}"), BarColumn()]
    if counts:
        columns.append(TextColumn("{task.fields[docs]:,} docs {task.fields[tokens]:,} tokens"))
    columns += [TransferSpeedColumn(), TimeRemainingColumn()]
    return Progress(*columns, console=Console(stderr=True), disable=quiet)


def cmd_prepare(args: argparse.Namespace) -> int:
    if problem := _need(*EXTRA):
        return _fail(problem)
    from dataset.format import DatasetError, SplitRule
    from dataset.prepare import DEFAULT_SHARD_TOKENS, DEFAULT_VAL_FRACTION, PrepareOptions
    from dataset.prepare import prepare as run
    from dataset.readers import ReadOptions

    if args.val_docs is None and args.val_fraction is None:
        args.val_fraction = DEFAULT_VAL_FRACTION
    try:
        split = SplitRule(seed=args.split_seed, fraction=args.val_fraction, docs=args.val_docs)
    except ValueError:
        return _fail("--val-fraction is between 0 and 1; --val-docs and --split-seed are >= 0")
    opts = PrepareOptions(
        inputs=args.inputs,
        tokenizer=args.tokenizer,
        out=args.out,
        read=ReadOptions(args.text_field, args.split_on_blank_lines),
        skip_bad_records=args.skip_bad_records,
        eos_id=args.eos_id,
        shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS,
        split=split,
        **({"workers": args.workers} if args.workers is not None else {}),
    )
    if opts.eos_id is not None and opts.eos_id < 0:
        return _fail("--eos-id is an id: 0 or more")
    # SIGTERM as Ctrl-C: the workers stop and the note below is printed
    before = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with _progress(args.quiet, counts=True) as progress:
            result = run(opts, progress)
    except DatasetError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        return _fail(f"interrupted before {args.out}/manifest.json was written; run it again", 130)
    except BrokenProcessPool:
        return _fail(
            "a tokenizing process died (killed, or out of memory); no manifest was written: "
            "run it again, with fewer --workers if memory is short"
        )
    except OSError as e:
        return _fail(
            f"{_os_problem(e, args.out)}; no manifest was written: fix that and run it again"
        )
    finally:
        signal.signal(signal.SIGTERM, before)
    m = result.manifest
    if result.unchanged:
        print(f"{args.out} already holds this dataset (same inputs, tokenizer and options)")
    _summary(m)
    print(f"end of document: id {m.eos_id} ({result.eos_from})")
    print(
        f'data: {{source: "dataset:{args.out.resolve()}"}}\n'
        f"model: {{vocab: {m.tokenizer.vocab_size}}}  # at least this many ids\n"
        "# a job reads it only under a data root (--data-root; meshkeeper up: RUN_DIR/data)"
    )
    return 0


def _os_problem(e: OSError, where: Path) -> str:
    """One line for a file that cannot be read or written (a full disk, a read-only mount, no
    permission): the file and what the system said. A failed write() names no file: `where`,
    the directory being written, stands in."""
    return f"{e.filename if e.filename is not None else where}: {e.strerror or e}"


def _summary(m) -> None:
    for split, entry in m.splits.items():
        shards = len(entry.shards)
        print(
            f"{split}: {entry.documents:,} documents, {entry.tokens:,} tokens "
            f"({m.dtype}) in {shards} shard{'s' if shards != 1 else ''}"
        )
    print(f"inputs: {len(m.inputs)} file(s), {m.skipped:,} bad record(s) skipped")
    print(
        f"tokenizer: {m.tokenizer.source} (sha256 {m.tokenizer.sha256[:12]}, "
        f"{m.tokenizer.vocab_size} ids)"
    )


def cmd_verify(args: argparse.Namespace) -> int:
    if problem := _need("numpy"):
        return _fail(problem)
    from dataset.format import DatasetError
    from dataset.verify import verify

    try:
        with _progress(args.quiet, counts=False) as progress:
            m = verify(args.dir, progress)
    except DatasetError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(_os_problem(e, args.dir))
    print(f"{args.dir}: every file matches its manifest")
    _summary(m)
    return 0

"""`meshkeeper data prepare` with 2 worker processes against a plain single-process
`tokenizers` loop (read JSONL, encode_batch, write the ids), on the same corpus.

The corpus is real text nobody here wrote: the Python standard library's docstrings
(tests/corpus.py), repeated to --mb MB of JSONL; the tokenizer is a BPE of 8192 ids trained
on it. The loop runs twice: with tokenizers' thread pool off (one core, as each prepare worker
is) and on (every core). The arms take turns, --trials times; each one's best time counts, as
other work on the machine only ever slows a run down. Prints MB/s of document text for each,
the ratios, and the machine's load.

    python bench/data_prepare.py [--mb 24] [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ENV, ROOT  # noqa: E402
from tests.corpus import bpe_tokenizer, stdlib_docstrings  # noqa: E402

# The baseline: what one would write by hand with no care for memory, splits or checks.
LOOP = """
import sys, numpy as np, orjson
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
eos = tok.token_to_id("<|endoftext|>")
with open(sys.argv[2], "rb") as src, open(sys.argv[3], "wb") as dst:
    batch = []
    for line in src:
        batch.append(orjson.loads(line)["text"])
        if len(batch) == 512:
            for e in tok.encode_batch(batch):
                np.asarray(e.ids + [eos], dtype=np.uint16).tofile(dst)
            batch = []
    for e in tok.encode_batch(batch):
        np.asarray(e.ids + [eos], dtype=np.uint16).tofile(dst)
"""


def timed(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"benchmark run failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--mb",
        type=float,
        default=24,
        help="MB of JSONL to prepare (both sides pay about 1 s of start-up: imports, and "
        "prepare's worker processes)",
    )
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    docs = stdlib_docstrings(4 << 20)
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        tok = bpe_tokenizer(docs, 8192, d / "tokenizer.json")
        corpus, text_bytes, rounds = d / "corpus.jsonl", 0, 0
        with corpus.open("w") as f:
            while corpus.stat().st_size < args.mb * 1e6:
                for doc in docs:  # each round differs: no document repeats exactly
                    text = f"{rounds}: {doc}"
                    f.write(json.dumps({"text": text}) + "\n")
                    text_bytes += len(text.encode())
                f.flush()
                rounds += 1
        mb = text_bytes / 1e6
        print(
            f"corpus: {len(docs) * rounds} documents, {mb:.1f} MB of text, "
            f"{corpus.stat().st_size / 1e6:.1f} MB of JSONL, BPE of 8192 ids"
        )
        one = {**ENV, "TOKENIZERS_PARALLELISM": "false"}
        loop = [sys.executable, "-c", LOOP, str(tok), str(corpus), str(d / "ids.bin")]
        prep = [sys.executable, "-m", "cli", "data", "prepare", str(corpus)]
        prep += ["--tokenizer", str(tok), "--workers", "2", "--quiet", "--out"]
        arms = {
            "base": lambda trial: (loop, one),
            "threaded": lambda trial: (loop, {**ENV, "TOKENIZERS_PARALLELISM": "true"}),
            # a fresh directory each time: over its own output, prepare has nothing to do
            "ours": lambda trial: ([*prep, str(d / f"ds{trial}")], ENV),
        }
        best = {name: float("inf") for name in arms}
        for trial in range(args.trials):  # the arms take turns: a burst of load hits each alike
            for name, arm in arms.items():
                best[name] = min(best[name], timed(*arm(trial)))
        base, threaded, ours = best["base"], best["threaded"], best["ours"]
        print(f"plain loop, 1 thread:               {mb / base:7.2f} MB/s ({base:.1f} s)")
        print(f"plain loop, tokenizers' threads:    {mb / threaded:7.2f} MB/s ({threaded:.1f} s)")
        print(f"meshkeeper data prepare, 2 workers: {mb / ours:7.2f} MB/s ({ours:.1f} s)")
        print(f"prepare / 1-thread loop ratio:      {base / ours:.2f}")
        print(f"prepare / threaded loop ratio:      {threaded / ours:.2f}")
        print(
            f"({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; best of "
            f"{args.trials} each)"
        )


if __name__ == "__main__":
    main()

"""The peak memory of importing a Hugging Face checkpoint (`model.hf`, worker/hf/weights.py),
per rank, at dp2 x tp2 (zero 3: FSDP's _StridedShard over TP's Shard) on 4 gloo ranks on CPU.

A random Llama saved by `transformers` itself (fp32; by default hidden 2048, 8 layers, 16
heads, 4 KV heads, MLP 2816, vocab 32000, untied: 1.41 GB in one file) under /tmp, deleted
after, is imported twice, each time by 4 fresh ranks under torchrun: by `load_into` (each rank
reads only its slices of each tensor) and by the whole-tensor read it replaced (kept here
only, as the baseline: `whole_tensor_load`, the previous `load_into` line for line: every
tensor read whole through one mapping per file kept for the whole import, converted, and
this rank's shard kept). Each rank builds its model first (the trainer's, with no weights:
its shards are allocated, not yet touched), resets its peak RSS (`/proc/self/clear_refs`),
imports, and reads VmHWM: the import's peak RSS increase, which counts the checkpoint's pages
mapped into the rank as well as its own memory, set against the rank's shard bytes and the
largest tensor of the checkpoint.

    python bench/hf_import_peak.py [--hidden 2048] [--layers 8] [--heads 16] [--kv-heads 4]
        [--ffn 2816] [--vocab 32000]

Summary lines (stable):
    `hf import peak RSS, sliced (dp2 x tp2, X.XX GB): +P MB max rank = shards S MB + E MB
     (R.RRx its largest read, B MB; T.TTx the largest tensor, L MB)`
    `hf import peak RSS, whole tensors (dp2 x tp2, X.XX GB): ...` (the same fields)
    `hf import peak RSS, sliced / whole tensors (dp2 x tp2): X.XXx (max over ranks)`
    `hf import bytes read per rank, sliced / whole tensors (dp2 x tp2): X.XXx (max over
     ranks)`
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import spec_file, torchrun  # noqa: E402

PARALLEL = {"dp": 2, "tp": 2, "zero": 3}
LAYOUT = "dp2 x tp2"
MB = 1e6


def job(directory: Path) -> dict:
    return {
        "name": "bench-hf-import",
        "model": {"hf": str(directory), "seq_len": 256},
        "data": {"source": "synthetic", "seed": 7},
        "parallel": PARALLEL,
        "train": {"steps": 1, "global_batch": 4, "lr": 1e-4},
    }


def save(directory: Path, a: argparse.Namespace) -> tuple[int, int]:
    """A random Llama saved with save_pretrained: (checkpoint bytes, largest tensor bytes)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.ffn,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    model.save_pretrained(directory)
    del model
    return sum(sizes), max(sizes)


def _status(*fields: str) -> dict[str, int]:
    """Fields of /proc/self/status, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            out[key] = int(value.split()[0]) * 1024
    return out


def whole_tensor_load(parts, cfg, directory) -> tuple[int, int]:
    """The import before slicing (worker/hf/weights.py's previous `load_into`): each tensor
    read whole through the file's mapping (kept open for the whole import), converted, and
    this rank's shard of it kept. (The bytes it read, the most in one read.)"""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
    from torch.distributed.tensor import DTensor

    from worker.hf import llama
    from worker.hf.weights import SafetensorsDir, verify
    from worker.trainer.shards import local_shard

    weights = SafetensorsDir(directory)
    verify(weights, cfg)
    read, largest = 0, 0
    with torch.no_grad():
        for part in parts:
            for name, p in part.named_parameters():
                name = name.replace(_CHECKPOINT_PREFIX, "")
                tensor = weights.read(llama.hf_name(name))
                read += tensor.numel() * tensor.element_size()
                largest = max(largest, tensor.numel() * tensor.element_size())
                full = llama.from_hf(name, tensor.float(), cfg)
                local = p.to_local() if isinstance(p, DTensor) else p
                local.copy_(local_shard(full.to(local.device), p))
                del full, tensor
            part.init_buffers()
    return read, largest


def ranks(mode: str, spec_path: str, out: str) -> None:
    """One rank: build the model, import it (`mode`: sliced or whole), and write what it
    measured to out/rank-N.json."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from services.spec import load_spec
    from worker.hf.weights import load_into
    from worker.trainer.distributed import init_distributed, shutdown_distributed
    from worker.trainer.parallel import ParallelDims, RankContext
    from worker.trainer.step import Trainer

    torch.set_num_threads(1)
    spec = load_spec(spec_path)
    rank, _, device = init_distributed(timeout_s=300)
    try:
        dims = ParallelDims(spec.parallel, device.type)
        trainer = Trainer(spec, RankContext(dims, dims.build_mesh(), rank, device), weights=False)
        shards = sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
            for part in trainer.parts
            for p in part.parameters()
        )
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status("VmRSS", "RssAnon")
        t0 = time.perf_counter()
        if mode == "sliced":
            imported = load_into(trainer.parts, spec.model, spec.model.hf)
            read, largest = imported.read_bytes, imported.largest_read
        else:
            read, largest = whole_tensor_load(trainer.parts, spec.model, spec.model.hf)
        seconds = time.perf_counter() - t0
        after = _status("VmHWM", "RssAnon")
        dist.barrier()
        line = {
            "mode": mode,
            "rank": rank,
            "peak": after["VmHWM"] - before["VmRSS"],
            "anon": after["RssAnon"] - before["RssAnon"],
            "shards": shards,
            "read": read,
            "largest_read": largest,
            "seconds": seconds,
        }
        (Path(out) / f"rank-{rank}.json").write_text(json.dumps(line))
    finally:
        shutdown_distributed()


def run(mode: str, spec_path: Path) -> list[dict]:
    """Each rank's measurements, in rank order, from 4 fresh ranks."""
    with tempfile.TemporaryDirectory() as out:
        torchrun(4, [str(Path(__file__).resolve()), "--ranks", mode, str(spec_path), out])
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank-*.json"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ranks", nargs=3, metavar=("MODE", "SPEC", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.ranks:
        ranks(*a.ranks)
        return
    with tempfile.TemporaryDirectory(prefix="hf-import-peak-", dir="/tmp") as d:
        directory = Path(d) / "model"
        total, largest = save(directory, a)
        on_disk = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        path = spec_file(job(directory), Path(d))
        results = {mode: run(mode, path) for mode in ("sliced", "whole")}
    size = f"{LAYOUT}, {on_disk / 1e9:.2f} GB"
    print(
        f"checkpoint: Llama fp32, hidden {a.hidden}, {a.layers} layers, heads {a.heads}/"
        f"{a.kv_heads}, MLP {a.ffn}, vocab {a.vocab}: {total / MB:.1f} MB of tensors, "
        f"largest {largest / MB:.1f} MB; 4 gloo ranks, {PARALLEL}"
    )
    for mode, rows in results.items():
        for r in rows:
            print(
                f"  {mode:6} rank {r['rank']}: peak RSS +{r['peak'] / MB:.1f} MB (anonymous "
                f"+{r['anon'] / MB:.1f} MB after), shards {r['shards'] / MB:.1f} MB, read "
                f"{r['read'] / MB:.1f} MB (at most {r['largest_read'] / MB:.1f} MB at once), "
                f"{r['seconds']:.1f} s"
            )
    labels = {"sliced": "sliced", "whole": "whole tensors"}
    for mode, rows in results.items():
        top = max(rows, key=lambda r: r["peak"])
        extra = top["peak"] - top["shards"]
        print(
            f"hf import peak RSS, {labels[mode]} ({size}): +{top['peak'] / MB:.1f} MB max rank "
            f"= shards {top['shards'] / MB:.1f} MB + {extra / MB:.1f} MB "
            f"({extra / top['largest_read']:.2f}x its largest read, "
            f"{top['largest_read'] / MB:.1f} MB; {extra / largest:.2f}x the largest tensor, "
            f"{largest / MB:.1f} MB)"
        )
    peak = {mode: max(r["peak"] for r in rows) for mode, rows in results.items()}
    read = {mode: max(r["read"] for r in rows) for mode, rows in results.items()}
    print(
        f"hf import peak RSS, sliced / whole tensors ({LAYOUT}): "
        f"{peak['sliced'] / peak['whole']:.2f}x (max over ranks)"
    )
    print(
        f"hf import bytes read per rank, sliced / whole tensors ({LAYOUT}): "
        f"{read['sliced'] / read['whole']:.2f}x (max over ranks)"
    )


if __name__ == "__main__":
    main()

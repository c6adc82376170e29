"""A committed checkpoint, written as a Hugging Face model directory:
`meshkeeper export-hf CHECKPOINT_DIR OUT_DIR [--dtype bf16]` (cli/export.py runs this module).

CHECKPOINT_DIR is one committed step directory, of any layout (DCP stores every tensor
whole, whatever the mesh that saved it). The export
1. verifies every file against the checkpoint's manifest (worker/ckpt_store.py), and reads
   the architecture from it (the trainer records `model` there);
2. streams: each tensor is read alone from the DCP files, converted (`llama.to_hf`; a stack
   of experts into one tensor per expert, `mixtral.to_hf`), cast, and written straight into
   its place in a safetensors shard, whose header was written first from the DCP metadata.
   Memory is bounded by the largest tensor, not the model;
3. writes at most 5 GB per shard with `model.safetensors.index.json`, `config.json` (the
   source directory's where the job started from `model.hf`, else one made from the spec),
   `generation_config.json`, and the source directory's tokenizer files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from services.model_spec import ModelSpec
from worker.ckpt_store import MANIFEST, Committed, DamagedCheckpoint, check_files
from worker.hf import llama, mixtral
from worker.hf.weights import INDEX, expected

SHARD_BYTES = 5 * 10**9
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16"}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


class ExportError(ValueError):
    """What is wrong, naming the file and the fix."""


def committed(step_dir: Path) -> tuple[Committed, ModelSpec]:
    """The checkpoint at `step_dir`, its files verified, and the model it holds."""
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
    except FileNotFoundError:
        raise ExportError(
            f"{step_dir}: no {MANIFEST}, so not a committed checkpoint; give a step directory "
            "(the path `meshkeeper status JOB` prints as the last checkpoint)"
        ) from None
    except (OSError, ValueError) as e:
        raise ExportError(f"{step_dir / MANIFEST}: unreadable ({e})") from None
    ckpt = Committed(manifest.get("step", 0), step_dir, manifest)
    try:
        check_files(ckpt, list(manifest.get("files", {})))
    except DamagedCheckpoint as e:
        raise ExportError(f"the checkpoint does not match its manifest: {e}") from None
    if "model" not in manifest:
        raise ExportError(
            f"{step_dir / MANIFEST} records no model (a checkpoint from before exports); "
            "resume it once to write a new checkpoint, then export that"
        )
    return ckpt, ModelSpec(**manifest["model"])


def plan_shards(sizes: dict[str, int]) -> list[list[str]]:
    """Tensor names in shards of at most SHARD_BYTES each (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes.items():
        if shards[-1] and used + nbytes > SHARD_BYTES:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def _header(entries: list[tuple[str, str, list[int], int]]) -> bytes:
    """A safetensors header for (key, dtype, shape, bytes) in file order, padded to 8 bytes
    (the format: a little-endian u64 length, then the JSON)."""
    meta: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, dtype, shape, nbytes in entries:
        meta[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def export(step_dir: Path, out: Path, dtype: str | None, say=print) -> dict:
    """Write the HF directory; returns a summary (tensors, bytes, shards, seconds)."""
    t0 = time.monotonic()
    ckpt, cfg = committed(step_dir)
    md = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    stored = {k.removeprefix("model."): v for k, v in md.items() if k.startswith("model.")}
    # HF key -> (meshkeeper name, shape), in parameter order: a stacked experts weight gives
    # one key per expert (Mixtral's hub form, worker/hf/mixtral.py), consecutively
    want = expected(cfg)
    missing = sorted({name for name, _ in want.values()} - stored.keys())
    if missing:
        raise ExportError(f"{step_dir}: the checkpoint lacks {', '.join(missing[:5])}")
    if cfg.experts and cfg.capacity_factor:
        say(
            f"export: note: model.capacity_factor is {cfg.capacity_factor}; transformers' "
            "Mixtral routes every choice (dropless), so it computes what this model computed "
            "only where no choice was dropped"
        )
    cast = DTYPES[dtype] if dtype else None
    plan = {}
    for key, (name, shape) in want.items():
        src = stored[name].properties.dtype
        to = cast or src
        if to not in SAFETENSORS_DTYPE:
            raise ExportError(f"{name} is {src}; export with --dtype fp32 or bf16")
        plan[key] = (to, shape, torch.Size(shape).numel() * to.itemsize)
    out.mkdir(parents=True, exist_ok=True)
    shards = plan_shards({k: p[2] for k, p in plan.items()})
    weight_map, total = {}, 0
    held: tuple[str, dict[str, torch.Tensor]] = ("", {})  # the last parameter read, converted
    for i, keys in enumerate(shards, 1):
        file = (
            "model.safetensors"
            if len(shards) == 1
            else (f"model-{i:05d}-of-{len(shards):05d}.safetensors")
        )
        entries = [(k, SAFETENSORS_DTYPE[plan[k][0]], plan[k][1], plan[k][2]) for k in keys]
        with open(out / file, "wb") as f:
            f.write(_header(entries))
            for k in keys:
                name = want[k][0]
                if held[0] != name:
                    held = ("", {})  # freed before the next one is read
                    held = (name, _converted(step_dir, name, stored[name], cfg))
                data = held[1][k].to(plan[k][0]).contiguous()
                f.write(data.view(torch.uint8).numpy().tobytes())
                weight_map[k] = file
                total += plan[k][2]
        say(f"export: {file}: {len(keys)} tensors, {sum(e[3] for e in entries) / 1e9:.2f} GB")
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    _configs(cfg, out, cast or torch.float32)
    return {
        "tensors": len(want),
        "bytes": total,
        "shards": len(shards),
        "seconds": round(time.monotonic() - t0, 1),
    }


def _converted(step_dir: Path, name: str, meta, cfg: ModelSpec) -> dict[str, torch.Tensor]:
    """HF key -> tensor of meshkeeper parameter `name`, read alone from the DCP files."""
    tensor = torch.empty(list(meta.size), dtype=meta.properties.dtype)
    # no_dist: the export reads alone, also in a trainer whose peers have left
    dcp.load({"model": {name: tensor}}, checkpoint_id=str(step_dir), no_dist=True)
    if mixtral.owns(name):
        return mixtral.to_hf(name, tensor)
    return {llama.hf_name(name): llama.to_hf(name, tensor, cfg)}


def export_in_place(step_dir: Path, out: Path, say=print) -> dict:
    """`export` in the training dtype into `out`, replacing a directory already there whole:
    written beside it first and renamed into place, so a crash mid-way leaves the previous
    export (or none), never half of one. A job's `checkpoint.export_hf` (the trainer's rank 0,
    worker/trainer/main.py)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial, old = out.with_name(f".{out.name}.partial"), out.with_name(f".{out.name}.old")
    for leftover in (partial, old):  # an earlier attempt's
        shutil.rmtree(leftover, ignore_errors=True)
    done = export(step_dir, partial, None, say)
    if out.exists():
        out.rename(old)
    partial.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return done


def _configs(cfg: ModelSpec, out: Path, dtype: torch.dtype) -> None:
    """config.json, generation_config.json and the tokenizer's files."""
    source = Path(cfg.hf) if cfg.hf else None
    if source is not None and (source / "config.json").is_file():
        config = json.loads((source / "config.json").read_text())
    else:
        config = hf_config(cfg)
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"_from_model_config": True}
    for name in ("generation_config.json", *TOKENIZER_FILES):
        if source is not None and (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    if not (out / "generation_config.json").exists():
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def hf_config(cfg: ModelSpec) -> dict:
    """A config.json for a model meshkeeper built from its own fields (no model.hf)."""
    arch = llama.architecture_name(cfg)
    config = {
        "architectures": [arch],
        "model_type": {"LlamaForCausalLM": "llama"}.get(
            arch, arch.removesuffix("ForCausalLM").lower()
        ),
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.key_value_heads,
        "head_dim": cfg.head_size,
        "vocab_size": cfg.vocab,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": (
            {"rope_type": "llama3", **cfg.rope_scaling.model_dump(exclude={"type"})}
            if cfg.rope_scaling
            else None
        ),
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    if cfg.experts:
        config.update(mixtral.architecture_fields(cfg))
    return config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="meshkeeper export-hf", description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", type=Path, help="a committed checkpoint step directory")
    ap.add_argument("out", type=Path, help="the Hugging Face model directory to write")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="default: the training dtype")
    args = ap.parse_args(argv)
    try:
        done = export(args.checkpoint, args.out, args.dtype)
    except (ExportError, OSError) as e:
        print(f"meshkeeper export-hf: {e}", file=sys.stderr)
        return 2
    print(
        f"export: {done['tensors']} tensors, {done['bytes'] / 1e9:.2f} GB in {done['shards']} "
        f"shard(s) to {args.out} in {done['seconds']}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

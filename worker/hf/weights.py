"""A Hugging Face model directory's weights, read into this rank's parameters.

Every rank first checks the directory against the whole model (`verify`: every tensor the
architecture needs is there with its shape and a floating dtype, and nothing is left over),
from the safetensors headers alone, before any step. Then it reads, one tensor at a time,
only the tensors of the parameters it holds: a tensor is read whole (safetensors maps the
file, so only its pages are touched), converted (`llama.from_hf`), and only this rank's
shard of it is kept (`worker/trainer/shards.py`, `local_shard`). No rank holds more than its
shards plus one full tensor and its fp32 copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor

from services.model_spec import ModelSpec
from worker.hf import llama
from worker.trainer.model import Transformer
from worker.trainer.shards import local_shard

INDEX = "model.safetensors.index.json"
FLOATS = ("F64", "F32", "F16", "BF16")


class WeightsError(ValueError):
    """The model directory does not hold the weights the architecture needs; the message
    names the file or tensor and the fix."""


class SafetensorsDir:
    """Which file of `directory` holds each tensor: the index of a sharded checkpoint, or
    the headers of its *.safetensors files."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        index = self.dir / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise WeightsError(f"{index}: not a safetensors index ({e})") from None
            self.files = {key: self.dir / name for key, name in weight_map.items()}
        else:
            found = sorted(self.dir.glob("*.safetensors"))
            if not found:
                raise WeightsError(
                    f"{self.dir}: no *.safetensors files and no {INDEX}; save the model with "
                    "safetensors (save_pretrained's default)"
                )
            self.files = {key: path for path in found for key in self._open(path).keys()}
        self._handles: dict[Path, object] = {}

    def _open(self, path: Path):
        try:
            return safe_open(str(path), framework="pt")
        except FileNotFoundError:
            raise WeightsError(
                f"{path}: missing (the index names it); copy the whole model"
            ) from None
        except Exception as e:  # safetensors raises its own error type for a damaged file
            raise WeightsError(f"{path}: not a readable safetensors file ({e})") from None

    def _handle(self, key: str):
        path = self.files[key]
        if path not in self._handles:
            self._handles[path] = self._open(path)
        return self._handles[path]

    def header(self, key: str) -> tuple[list[int], str]:
        """(shape, safetensors dtype) of `key`, from its file's header."""
        sliced = self._handle(key).get_slice(key)
        return list(sliced.get_shape()), sliced.get_dtype()

    def read(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)


def expected(cfg: ModelSpec) -> dict[str, tuple[str, list[int]]]:
    """Hugging Face key -> (meshkeeper name, shape) of every parameter of the whole model."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {llama.hf_name(n): (n, list(p.shape)) for n, p in model.named_parameters()}


def verify(weights: SafetensorsDir, cfg: ModelSpec) -> None:
    """WeightsError naming the first problems: a tensor missing, of another shape, not a
    floating-point tensor, or one the architecture has no place for."""
    want = expected(cfg)
    have = {k for k in weights.files if not llama.IGNORED_HF.search(k)}
    if cfg.tie_embeddings:
        have.discard("lm_head.weight")  # some tied checkpoints store the shared tensor twice
    problems = [f"{k} is missing" for k in sorted(want.keys() - have)]
    problems += [
        f"{k} is not part of this architecture (is model.hf's config.json the one saved with "
        "these weights?)"
        for k in sorted(have - want.keys())
    ]
    for key in sorted(want.keys() & have):
        shape, dtype = weights.header(key)
        if shape != want[key][1]:
            problems.append(f"{key} has shape {shape}, the config implies {want[key][1]}")
        elif dtype not in FLOATS:
            problems.append(f"{key} is {dtype}; weights must be floating point")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise WeightsError(f"{weights.dir}: " + "; ".join(problems[:5]) + more)


@torch.no_grad()
def load_into(parts: list[nn.Module], cfg: ModelSpec, directory: str | Path) -> None:
    """Write every parameter this rank holds from the checkpoint in `directory` (checked
    first), and the RoPE tables."""
    weights = SafetensorsDir(directory)
    verify(weights, cfg)
    for part in parts:
        for name, p in part.named_parameters():
            name = name.replace(_CHECKPOINT_PREFIX, "")  # the unwrapped model's name
            full = llama.from_hf(name, weights.read(llama.hf_name(name)).float(), cfg)
            local = p.to_local() if isinstance(p, DTensor) else p
            local.copy_(local_shard(full.to(local.device), p))
            del full
        part.init_buffers()

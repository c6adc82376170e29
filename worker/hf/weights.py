"""A Hugging Face model directory's weights, read into this rank's parameters.

Every rank first checks the directory against the whole model (`verify`: every tensor the
architecture needs is there with its shape and a floating dtype, and nothing is left over),
from the safetensors headers alone, before any step. Then it reads, one parameter at a time,
only the part of each checkpoint tensor that its own shard holds (safetensors' lazy slices,
`get_slice(key)[rows, cols]`), straight into the shard, at any layout (dp, zero, pp, tp, ep):

- The shard's region is the DTensor's own: along each dimension, the indices of the full
  tensor its local piece holds (worker/trainer/init_rng.py `_held`: the layout's
  redistribution, `worker/trainer/shards.py` `piece`, applied to a small index probe), which
  covers TP's Shard, FSDP's Shard and its _StridedShard over TP, uneven splits (a rank may
  hold nothing) and a plain or replicated tensor (all of it). This is the same function the
  whole-tensor read kept a shard with (`local_shard`), so both give the same bits.
- `llama.from_hf` only moves whole rows (RoPE's permutation of q and k rows within each
  head; nothing for every other tensor). Applied to the row numbers themselves it gives, for
  each row of meshkeeper's layout, the checkpoint row it comes from; the rank reads the rows
  its shard needs and gathers them into place.
- A rank reads the box that spans those indices: exactly its shard where they are contiguous
  (every layout meshkeeper builds), and the whole tensor at worst.

Beyond its shards a rank holds one tensor's box at a time: the checkpoint file is mapped only
while that box is copied into the shard, so the pages it touched leave the rank's memory
with the mapping. That is its slice for a tensor split by rows, and up to the whole tensor
for one split by columns (the pages along each row are mapped whole); a box that must be
gathered (q and k rows, or a shard that is not contiguous) is copied once more first
(docs/models.md, "Peak memory of the import"; bench/hf_import_peak.py measures it).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor

from services.model_spec import ModelSpec
from worker.hf import llama, mixtral
from worker.trainer.init_rng import _held
from worker.trainer.model import Transformer
from worker.trainer.shards import local_shard

INDEX = "model.safetensors.index.json"
FLOATS = ("F64", "F32", "F16", "BF16")
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


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
        """`key` whole."""
        return self._handle(key).get_tensor(key)

    @contextlib.contextmanager
    def box(self, key: str, index: tuple[slice, ...]) -> Iterator[torch.Tensor]:
        """The elements of `key` in `index` (one slice per dimension), for use inside the
        `with` only: they are a view of the file mapped for this read alone (safetensors maps
        it; only the pages under the box are read), and the pages leave this process's
        memory when the mapping closes."""
        with self._open(self.files[key]) as f:
            yield f.get_slice(key)[index]


@dataclass
class Imported:
    """What one rank's `load_into` took from the checkpoint, per Hugging Face key: the bytes
    it read (in the checkpoint's dtype) and the bytes of the whole tensor."""

    read: dict[str, int] = field(default_factory=dict)
    whole: dict[str, int] = field(default_factory=dict)

    @property
    def read_bytes(self) -> int:
        return sum(self.read.values())

    @property
    def largest_read(self) -> int:
        return max(self.read.values(), default=0)


def expected(cfg: ModelSpec, form: str = mixtral.HUB) -> dict[str, tuple[str, list[int]]]:
    """Hugging Face key -> (meshkeeper name, the key's shape) of every tensor of the whole
    model, in parameter order; a mixture of experts' in Mixtral's `form` (worker/hf/mixtral.py:
    one parameter may come from many keys, one key may feed two parameters)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    out: dict[str, tuple[str, list[int]]] = {}
    for n, p in model.named_parameters():
        if mixtral.owns(n):
            out.update(mixtral.hf_keys(n, list(p.shape), form))
        else:
            out[llama.hf_name(n)] = (n, list(p.shape))
    return out


def verify(weights: SafetensorsDir, cfg: ModelSpec) -> None:
    """WeightsError naming the first problems: a tensor missing, of another shape, not a
    floating-point tensor, or one the architecture has no place for."""
    want = expected(cfg, mixtral.form(weights.files))
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


def source_rows(name: str, shape: list[int] | torch.Size, cfg: ModelSpec) -> torch.Tensor | None:
    """For each row (index along dim 0) of parameter `name` in meshkeeper's layout, the row
    of the checkpoint tensor it comes from; None where `llama.from_hf` does more than move
    whole rows, and the tensor must be read whole.

    `from_hf` changes a tensor only by moving rows, each row as a whole (RoPE: q's and k's
    rows, biases and norm gains permuted within each head; every other tensor unchanged), so
    applying it to the row numbers, one column wide, gives the source of every row. The
    permutation stays within a head: a shard of whole heads (rows [h*d, h'*d)) reads exactly
    the same rows of the checkpoint, and a shard that starts or ends inside a head (FSDP's
    even split of k's rows, say) reads at most the rest of those two heads as well."""
    probe = torch.arange(shape[0]).view(-1, *[1] * (len(shape) - 1))
    rows = llama.from_hf(name, probe, cfg)
    if rows.shape != probe.shape or not torch.equal(rows.flatten().sort().values, probe.flatten()):
        return None  # not a permutation of rows: no slice of the checkpoint maps onto a shard's
    return rows.flatten()


def _load(weights: SafetensorsDir, key: str, name: str, p: torch.Tensor, cfg: ModelSpec) -> int:
    """Write this rank's piece of parameter `p` (meshkeeper's `name`, the checkpoint's `key`)
    from the checkpoint; the bytes it read."""
    local = p.to_local() if isinstance(p, DTensor) else p
    if local.numel() == 0:  # an uneven split left this rank none of it
        return 0
    rows = source_rows(name, p.shape, cfg)
    if rows is None:  # a layout no slice maps onto: the whole tensor, converted, then cut
        with weights.box(key, (slice(None),) * p.dim()) as whole:
            read = whole.numel() * whole.element_size()
            full = llama.from_hf(name, whole.float(), cfg)
            local.copy_(local_shard(full.to(local.device), p))
            del whole, full
        return read
    held = [_held(p, d).cpu() for d in range(p.dim())]  # full-tensor indices, local order
    held[0] = rows[held[0]]  # the checkpoint rows they come from
    # the box spanning them: the shard itself where its indices are contiguous (Shard, and
    # FSDP's _StridedShard over TP's Shard of the same dim: FSDP splits TP's piece); one
    # whose indices are not (a _StridedShard no meshkeeper layout builds) reads the span,
    # at worst the whole tensor, and gathers from it below
    index = tuple(slice(int(h.min()), int(h.max()) + 1) for h in held)
    with weights.box(key, index) as part:
        read = part.numel() * part.element_size()
        for d, (h, span) in enumerate(zip(held, index, strict=True)):
            at = h - span.start
            if not torch.equal(at, torch.arange(len(at))):  # not the box in order: gather
                part = part.index_select(d, at)
        local.copy_(part)
        del part
    return read


@torch.no_grad()
def load_into(parts: list[nn.Module], cfg: ModelSpec, directory: str | Path) -> Imported:
    """Write every parameter this rank holds from the checkpoint in `directory` (checked
    first), and the RoPE tables; what was read, per tensor."""
    weights = SafetensorsDir(directory)
    verify(weights, cfg)
    form = mixtral.form(weights.files)
    imported = Imported()
    for part in parts:
        for name, p in part.named_parameters():
            name = name.replace(_CHECKPOINT_PREFIX, "")  # the unwrapped model's name
            if mixtral.owns(name):  # a router or experts: worker/hf/mixtral.py reads them
                for key, n in mixtral.load(weights, name, p, form).items():
                    shape, dtype = weights.header(key)
                    imported.whole[key] = math.prod(shape) * ITEM_BYTES[dtype]
                    imported.read[key] = imported.read.get(key, 0) + n
                continue
            key = llama.hf_name(name)
            imported.whole[key] = p.numel() * ITEM_BYTES[weights.header(key)[1]]
            imported.read[key] = _load(weights, key, name, p, cfg)
        part.init_buffers()
    return imported

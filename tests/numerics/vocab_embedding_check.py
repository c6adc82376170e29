"""Run as 2 ranks (tests/rankrun.py): the vocab-parallel embedding
(worker/trainer/vocab_embedding.py) against torch's `RowwiseParallel` embedding, for both
layouts of the residual stream (replicated; sequence shards). An odd vocabulary, so the two
ranks hold unequal slices. Prints one JSON line per layout and rank."""

import copy
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from worker.trainer.vocab_embedding import VocabParallelEmbedding

VOCAB, DIM = 1001, 24


def compare(mesh, layout) -> dict:
    torch.manual_seed(0)
    whole = nn.Module()
    whole.embed = nn.Embedding(VOCAB, DIM)
    ours = VocabParallelEmbedding.shard(copy.deepcopy(whole.embed), mesh, layout)
    parallelize_module(
        whole, mesh, {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=layout)}
    )
    tokens = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(1))
    tokens[0, :4] = torch.tensor([0, VOCAB - 1, VOCAB // 2, VOCAB // 2 + 1])  # both edges
    g = torch.Generator().manual_seed(2)
    upstream = torch.randn(3, 16 if layout == Replicate() else 8, DIM, generator=g)
    out_torch, out_ours = whole.embed(tokens), ours(tokens)
    (out_torch * upstream).sum().backward()
    (out_ours * upstream).sum().backward()
    grad_torch, grad_ours = whole.embed.weight.grad, ours.weight.grad
    return {
        "layout": str(layout),
        "rank": dist.get_rank(),
        "same_output": torch.equal(torch.as_tensor(out_torch), out_ours),
        "torch_grad_placements": str(grad_torch.placements),
        "grad_placements": str(grad_ours.placements),
        "grad_rows": grad_ours.to_local().shape[0],
        "weight_rows": ours.weight.to_local().shape[0],
        "same_grad": torch.equal(grad_torch.full_tensor(), grad_ours.full_tensor()),
    }


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    for layout in (Replicate(), Shard(1)):
        print(json.dumps(compare(mesh, layout)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

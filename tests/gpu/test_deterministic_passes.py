"""Why the spot check pins its kernels (worker/trainer/spot_check.py `_deterministic`): the
same forward and input-gradient backward, repeated on a healthy GPU, compared bit for bit.
Under the check's settings every repeat agrees; under the defaults (warnings only, SDPA free
to pick flash attention, whose backward accumulates with atomics) the count of repeats that
differ from the first goes to the summary, as the evidence of what the settings prevent."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from services.spec import parse_spec
from worker.trainer.model import build_model
from worker.trainer.spot_check import _deterministic

pytestmark = pytest.mark.gpu

REPEATS = 20


def repeats_that_differ(setting, dtype: torch.dtype) -> int:
    spec = parse_spec(
        {
            "name": "det",
            "model": {"preset": "small", "layers": 4, "seq_len": 1024},
            "train": {"steps": 1, "global_batch": 8},
        }
    )
    device = torch.device("cuda", 0)
    model = build_model(spec.model, seed=0, device=device).to(dtype)
    gen = torch.Generator(device).manual_seed(1)
    x = torch.randint(spec.model.vocab, (8, spec.model.seq_len), device=device, generator=gen)
    captured: list[torch.Tensor] = []
    model.embed.register_forward_hook(lambda _m, _i, out: captured.append(out))

    def one_pass() -> list[torch.Tensor]:
        captured.clear()
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x.flatten())
        (grad,) = torch.autograd.grad(loss, captured)
        return [loss.detach(), logits.detach(), grad]

    with setting(device):
        first = one_pass()
        return sum(
            not all(torch.equal(a, b) for a, b in zip(first, one_pass(), strict=True))
            for _ in range(REPEATS)
        )


@contextlib.contextmanager
def defaults(_device):
    torch.use_deterministic_algorithms(True, warn_only=True)  # what the check used to run
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_checked_passes_repeat_bit_for_bit(dtype, measured):
    name = str(dtype).removeprefix("torch.")
    measured(f"repeats_differing_under_defaults_{name}", repeats_that_differ(defaults, dtype))
    checked = repeats_that_differ(_deterministic, dtype)
    measured(f"repeats_differing_under_spot_check_{name}", checked)
    assert checked == 0

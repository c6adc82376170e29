"""The agent exports a MoE job's router load from rank 0's step records (issue 17): tokens
per expert and routed and dropped choices as counters (the drop rate is their ratio), the
balance loss as a gauge, all removed when the agent moves to another job."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.records import ExpertLoad, StepRecord
from worker.agent.metrics_endpoint import AgentMetrics


def record(step: int, load: ExpertLoad | None) -> StepRecord:
    return StepRecord(
        step=step,
        loss=2.0,
        tokens_per_s=1.0,
        step_s=0.1,
        compute_s=0.1,
        wait_s=0.0,
        lr=1e-3,
        rank=0,
        time=0.0,
        experts=load,
    )


def samples(m: AgentMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(m.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("meshkeeper_moe_")
    }


def test_router_load_is_exported_per_expert_with_drops_and_balance():
    m = AgentMetrics(peak_flops=1e12)
    m.observe("j1", record(1, ExpertLoad(tokens=[5, 3, 0, 2], dropped=2, balance_loss=1.25)))
    m.observe("j1", record(2, ExpertLoad(tokens=[1, 1, 1, 1], dropped=0, balance_loss=1.0)))
    m.observe("j1", record(3, None))  # another rank's record: no routing of its own
    got = samples(m)
    tokens = {
        dict(labels)["expert"]: v
        for (name, labels), v in got.items()
        if name == "meshkeeper_moe_expert_tokens_total"
    }
    assert tokens == {"0": 6, "1": 4, "2": 1, "3": 3}
    job = (("job_id", "j1"),)
    assert got[("meshkeeper_moe_routed_tokens_total", job)] == 16
    assert got[("meshkeeper_moe_dropped_tokens_total", job)] == 2
    assert got[("meshkeeper_moe_balance_loss", job)] == 1.0  # the latest step's
    assert ExpertLoad(tokens=[5, 3, 0, 2], dropped=2, balance_loss=1.0).drop_rate == 2 / 12


def test_router_load_of_a_job_no_longer_served_is_removed():
    m = AgentMetrics(peak_flops=1e12)
    m.observe("j1", record(1, ExpertLoad(tokens=[1, 1], dropped=0, balance_loss=1.0)))
    m.follow("j2")
    assert not any(dict(labels).get("job_id") == "j1" for _, labels in samples(m))

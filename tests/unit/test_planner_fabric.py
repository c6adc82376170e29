"""The fabric between hosts (services/planner/hardware.py, docs/planner.md "Fabrics"): tcp
slows cross-host links only, lengthens the steps whose traffic crosses hosts, and moves the
planner's choice off them; an unknown name is refused naming the choices. An agent says which
its host has at its join, and the pool is costed over the slowest."""

from __future__ import annotations

import json

import pytest
import yaml

from cli.main import main
from controller.admission import PoolWorker, pool_cluster
from services.planner import FABRICS, Layout, cluster, evaluate, fabric, search
from services.registration import problems
from services.spec import JobSpec, parse_spec
from worker.__main__ import host_fabric

IB, TCP = FABRICS["infiniband"], FABRICS["tcp"]


def spec(model: dict, batch: int) -> JobSpec:
    return parse_spec(
        {
            "name": "fabric",
            "model": model,
            "parallel": {"precision": "bf16"},
            "train": {"steps": 1, "global_batch": batch},
        }
    )


# ~35B parameters (the 70b preset's shape, 40 layers): its weights, gradients and Adam moments
# (560 GB) do not fit one host of 8 H100s, so every plan crosses the hosts on some axis
MODEL_35B = spec({"preset": "70b", "layers": 40, "seq_len": 4096}, batch=32)


def test_tcp_slows_only_the_cross_host_link_and_leaves_cpu_as_measured():
    ib, tcp = cluster("h100-80gb", 2, 8), cluster("h100-80gb", 2, 8, fabric=TCP)
    assert ib.link(16) == (50e9, 20e-6)  # the profile's own NDR InfiniBand figures
    assert tcp.link(16) == (6e9 / 8, 45e-6)  # the host's 6 GB/s shared by its 8 GPUs
    assert tcp.link(8) == ib.link(8)  # NVLink inside a host either way
    cpu_ib, cpu_tcp = cluster("cpu", 2, 2, 2**30), cluster("cpu", 2, 2, 2**30, fabric=TCP)
    assert cpu_tcp.link(4) == cpu_ib.link(4)  # gloo is already slower than tcp's share


def test_a_layout_with_dp_across_hosts_takes_longer_over_tcp_and_one_inside_a_host_does_not():
    across = Layout(2, 1, 8, 3, 8, 1, False, "1f1b")  # TP8 in each host, DP2 across them
    ib = evaluate(MODEL_35B, across, cluster("h100-80gb", 2, 8))
    tcp = evaluate(MODEL_35B, across, cluster("h100-80gb", 2, 8, fabric=TCP))
    assert tcp.cost.dp_s > ib.cost.dp_s and tcp.cost.step_time_s > ib.cost.step_time_s
    assert tcp.cost.compute_s == ib.cost.compute_s

    small = spec({"preset": "1b", "seq_len": 2048}, batch=16)
    inside = Layout(8, 1, 1, 2, 2, 1, False, "1f1b")  # 8 ranks: one host
    assert (
        evaluate(small, inside, cluster("h100-80gb", 2, 8, fabric=TCP)).cost
        == evaluate(small, inside, cluster("h100-80gb", 2, 8)).cost
    )


def test_over_tcp_the_best_plan_keeps_tp_in_a_host_and_moves_pp_instead_of_dp_across():
    ib = search(MODEL_35B, cluster("h100-80gb", 2, 8))[0]
    tcp = search(MODEL_35B, cluster("h100-80gb", 2, 8, fabric=TCP))[0]
    print(f"infiniband: {ib.layout.label()} {ib.cost.step_time_s:.2f} s")
    print(f"tcp: {tcp.layout.label()} {tcp.cost.step_time_s:.2f} s")
    # DP across the hosts: each host holds one whole replica (TP and PP inside it)
    assert ib.layout.dp == 2 and ib.layout.pp * ib.layout.tp == 8, ib.layout.label()
    assert (tcp.layout.dp, tcp.layout.pp, tcp.layout.tp) == (1, 2, 8)  # one send per microbatch
    assert tcp.cost.step_time_s > ib.cost.step_time_s


def test_over_tcp_a_model_that_fits_one_host_stays_in_it():
    s = spec({"preset": "8b", "seq_len": 4096}, batch=64)
    ib = search(s, cluster("h100-80gb", 2, 8))[0]
    tcp = search(s, cluster("h100-80gb", 2, 8, fabric=TCP))[0]
    assert ib.layout.world == 16 and tcp.layout.world <= 8


def test_an_unknown_fabric_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="unknown fabric 'roce'; choose one of infiniband, tcp"):
        fabric("roce")


def test_the_command_line_plans_over_tcp_and_says_so(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(MODEL_35B.model_dump(mode="json")))
    args = ["plan", str(path), "--workers", "2", "--devices-per-worker", "8"]
    args += ["--device", "h100-80gb", "--fabric", "tcp", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fabric"] == "tcp"
    assert (out["plans"][0]["dp"], out["plans"][0]["pp"], out["plans"][0]["tp"]) == (1, 2, 8)


def test_the_command_line_refuses_an_unknown_fabric_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", str(tmp_path / "spec.yaml"), "--workers", "2", "--fabric", "roce"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == (
        "meshkeeper plan: error: argument --fabric: invalid choice: 'roce' "
        "(choose from 'infiniband', 'tcp')"
    )


def test_an_agent_reports_tcp_unless_the_kernel_lists_an_rdma_device(tmp_path):
    sysfs = tmp_path / "infiniband"
    assert host_fabric("auto", sysfs) == "tcp"  # no RDMA stack at all
    sysfs.mkdir()
    assert host_fabric("auto", sysfs) == "tcp"  # the class, no device
    (sysfs / "mlx5_0").mkdir()
    assert host_fabric("auto", sysfs) == "infiniband"
    assert host_fabric("tcp", sysfs) == "tcp"  # said, not guessed


def gpus(*fabrics: str) -> list[PoolWorker]:
    return [PoolWorker(f"w{i}", 8, 80 * 10**9, "cuda", f) for i, f in enumerate(fabrics)]


def test_the_pool_is_costed_over_the_slowest_fabric_a_worker_joined_with():
    assert pool_cluster(gpus("infiniband", "infiniband")).fabric == IB
    assert pool_cluster(gpus("infiniband", "tcp")).fabric == TCP
    assert pool_cluster(gpus("tcp", "tcp"), fabric=IB).fabric == IB  # asked


def test_a_registration_with_an_unknown_fabric_is_malformed():
    assert problems({"fabric": "roce"}) == {"fabric": "not one of infiniband, tcp"}
    assert problems({"fabric": "tcp"}) == {}

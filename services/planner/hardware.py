"""Hardware profiles the planner costs a layout against (docs/planner.md, "Hardware profiles").

Each figure of the GPU profiles comes from the vendor's datasheet (sources in docs/planner.md);
`cpu` was measured on the build machine with bench/cpu_profile.py (one process per core,
OMP_NUM_THREADS=1, gloo over loopback), the way the local stack runs trainers. Bandwidths are
per device and per direction: what one rank can push through its link tier at once. The
network between hosts is a `Fabric`, apart from the device (docs/planner.md, "Fabrics").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

GB = 10**9
GiB = 2**30


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    memory_bytes: int  # per device, as the datasheet states it (decimal GB)
    # dense peak FLOP/s per matmul precision (ParallelSpec.matmul_precision): fp32 without
    # TF32, tf32 (fp32 on TF32 tensor cores), bf16
    flops: dict[str, float]
    # fraction of peak a large transformer GEMM reaches (matmul efficiency, not MFU)
    gemm_efficiency: float
    memory_bw: float  # device memory bytes/s (the roofline's slope for small GEMMs)
    intra_host_bw: float  # bytes/s per device per direction within a host (NVLink)
    inter_host_bw: float  # bytes/s per device per direction across hosts (InfiniBand)
    intra_host_latency_s: float  # one collective step within a host
    inter_host_latency_s: float  # one collective step across hosts
    # what a trainer process holds before any model byte: CUDA context, NCCL and allocator
    # reserve on GPU; the interpreter, torch and gloo on CPU (measured)
    runtime_bytes: int
    op_overhead_s: float  # fixed cost of one op (dispatch, autograd, kernel launch)
    # share of DP traffic that can run behind compute: NCCL on its own streams overlaps;
    # gloo on a CPU rank competes with the compute for the same core
    comm_overlap: float
    # share of device memory a plan may use: the rest is left for allocator fragmentation
    usable_fraction: float


# Measured on the 2-core build machine (bench/cpu_profile.py; docs/planner.md has the run).
CPU = DeviceProfile(
    name="cpu",
    memory_bytes=0,  # host RAM / devices, from the pool (or --memory-per-device)
    # one thread; this CPU has AMX for bf16, and a CPU has no TF32: its fp32 figure
    flops={"fp32": 7.0e10, "tf32": 7.0e10, "bf16": 3.7e11},
    gemm_efficiency=1.0,  # the measured figure already is what a GEMM reaches
    memory_bw=5.0e9,
    intra_host_bw=9.0e8,  # gloo over loopback
    inter_host_bw=9.0e8,
    intra_host_latency_s=8.5e-5,
    inter_host_latency_s=8.5e-5,
    # the process's own peak pages (worker/peak_rss.py high_water_mark, as peak_mem_bytes
    # counts a rank's) after importing the trainer and joining gloo: bench/cpu_profile.py
    # read 249405440 (238 MiB); raw VmHWM / ru_maxrss, which count the pages shared with the
    # parent's torch, read 314-330 MiB
    runtime_bytes=238 * 2**20,
    op_overhead_s=6e-6,
    comm_overlap=0.0,
    usable_fraction=1.0,
)

A100_80GB = DeviceProfile(
    name="a100-80gb",
    memory_bytes=80 * GB,
    flops={"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12},
    gemm_efficiency=0.7,
    memory_bw=2.039e12,
    intra_host_bw=300 * GB,  # NVLink 3: 600 GB/s bidirectional
    inter_host_bw=25 * GB,  # one HDR 200 Gb/s InfiniBand port per GPU (DGX A100)
    intra_host_latency_s=10e-6,
    inter_host_latency_s=20e-6,
    runtime_bytes=2 * GiB,
    op_overhead_s=5e-6,
    comm_overlap=1.0,
    usable_fraction=0.9,
)

# Hopper's compute, memory and links; latencies, runtime and overlap as the A100's
H100_80GB = replace(
    A100_80GB,
    name="h100-80gb",
    flops={"fp32": 67e12, "tf32": 494.7e12, "bf16": 989e12},
    gemm_efficiency=0.6,
    memory_bw=3.35e12,
    intra_host_bw=450 * GB,  # NVLink 4: 900 GB/s bidirectional
    inter_host_bw=50 * GB,  # one NDR 400 Gb/s InfiniBand port per GPU (DGX H100)
)

# the H100's compute and links with more, faster memory (HBM3e)
H200_141GB = replace(H100_80GB, name="h200-141gb", memory_bytes=141 * GB, memory_bw=4.8e12)

PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (CPU, A100_80GB, H100_80GB, H200_141GB)}


# the profile of each GPU model, by what its name (torch, NVML) contains
BY_DEVICE_NAME = {"H100": "h100-80gb", "H200": "h200-141gb", "A100": "a100-80gb"}


def profile_of_device(device_name: str) -> str | None:
    """The profile name for a device that torch or NVML calls `device_name` (e.g. "NVIDIA
    H100 80GB HBM3"); None for a model the planner has no figures for."""
    return next((p for key, p in BY_DEVICE_NAME.items() if key in device_name), None)


def profile(name: str) -> DeviceProfile:
    """The profile called `name`; a ValueError naming the known ones otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; choose one of {', '.join(PROFILES)}") from None


@dataclass(frozen=True)
class Fabric:
    """The network between hosts. It can only slow a device's cross-host link: a rank gets the
    slower of its profile's figure and its share of the host's link over this fabric."""

    name: str
    host_bw: float  # bytes/s per direction one host reaches across, shared by its devices
    latency_s: float  # one collective step across hosts


# The GPU profiles' cross-host figures are InfiniBand's (one port per GPU): nothing to limit.
INFINIBAND = Fabric("infiniband", host_bw=math.inf, latency_s=0.0)
# NCCL's socket transport over one 100 Gb/s Ethernet NIC per host (no RDMA). nccl-tests
# all_reduce_perf measured ~6 GB/s bus bandwidth for 16 ranks on two 8-GPU hosts with 100 Gb/s
# networking (NVIDIA/nccl#398, AWS p3dn) and 4.5-5.2 GB/s at 8-16 MB on another 100 Gb/s TCP
# network (NVIDIA/nccl#450): about half the 12.5 GB/s line rate. An 8-byte broadcast between
# two hosts took 38-46 us (NVIDIA/nccl-tests#82), against the 20 us per step taken for IB.
TCP = Fabric("tcp", host_bw=6 * GB, latency_s=45e-6)

FABRICS: dict[str, Fabric] = {f.name: f for f in (INFINIBAND, TCP)}


def fabric(name: str) -> Fabric:
    """The fabric called `name`; a ValueError naming the known ones otherwise."""
    try:
        return FABRICS[name]
    except KeyError:
        raise ValueError(f"unknown fabric {name!r}; choose one of {', '.join(FABRICS)}") from None


def cross_host_link(
    device: DeviceProfile, fabric: Fabric, devices_per_host: int
) -> tuple[float, float]:
    """(bandwidth B/s, latency s) of one device's cross-host link over `fabric`: every device of
    the host sends across at once (as the profiles' per-device figures assume), so each gets
    its share of the host's link. The cpu profile's gloo figures are slower than tcp's for a
    few devices per host, so it keeps them."""
    return (
        min(device.inter_host_bw, fabric.host_bw / devices_per_host),
        max(device.inter_host_latency_s, fabric.latency_s),
    )


def host_memory_per_device(devices: int) -> int:
    """Host RAM (MemTotal) shared by `devices`: what a CPU device holds; 0 when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 // max(1, devices)
    except (OSError, ValueError, IndexError):
        pass
    return 0

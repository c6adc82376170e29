"""Measure the `cpu` hardware profile of the planner (services/planner/hardware.py).

One trainer process per core with OMP_NUM_THREADS=1, as the local stack runs them:
  - matmul FLOP/s: fp32 GEMMs of transformer-like shapes, one thread;
  - memory bandwidth: a large tensor copy (bytes read + written per second);
  - gloo: all-reduce time between 2 local processes for a small tensor (latency) and a
    large one (bus bandwidth, 2(n-1)/n of the bytes per rank);
  - runtime: the peak of a process's own resident pages (worker/peak_rss.py
    `high_water_mark`: VmHWM less the pages it shares, as the trainer's `peak_mem_bytes`
    reads it) after it imported the trainer and joined a gloo group.

    OMP_NUM_THREADS=1 .venv/bin/python bench/cpu_profile.py
"""

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def best_of(fn, n: int = 5) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_flops(dtype: torch.dtype) -> float:
    a, b = torch.randn(512, 256, dtype=dtype), torch.randn(256, 1024, dtype=dtype)
    t = best_of(lambda: [a @ b for _ in range(20)])
    return 20 * 2 * 512 * 256 * 1024 / t


def op_overhead() -> float:
    """Seconds per tiny op with autograd (dispatch, not arithmetic): forward + backward."""
    x = torch.randn(8, requires_grad=True)

    def chain():
        y = x
        for _ in range(200):
            y = y * 1.0001
        y.sum().backward()

    return best_of(chain) / 200


def copy_bandwidth() -> float:
    x = torch.randn(16 * 2**20)  # 64 MiB
    y = torch.empty_like(x)
    t = best_of(lambda: y.copy_(x))
    return 2 * x.numel() * 4 / t


def _gloo(rank: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    small, big = torch.zeros(1), torch.zeros(8 * 2**20)  # 4 B, 32 MiB
    for x in (small, big):
        dist.all_reduce(x)
    lat = best_of(lambda: [dist.all_reduce(small) for _ in range(50)]) / 50
    t = best_of(lambda: dist.all_reduce(big), 3)
    if rank == 0:
        out.put((lat, big.numel() * 4 / t))  # ring: 2(n-1)/n = 1 of the bytes per rank at n=2
    dist.destroy_process_group()


def gloo() -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(_gloo, args=(q,), nprocs=2, start_method="spawn")
    return q.get()


def _runtime(_rank: int, out) -> None:
    import worker.trainer.main  # noqa: F401  (the trainer's own imports)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29542")
    dist.init_process_group("gloo", rank=0, world_size=1)
    dist.destroy_process_group()
    from worker.peak_rss import high_water_mark

    # Not ru_maxrss: Linux carries it across execve, so a spawned child reports its parent's
    # peak; and it counts the pages the child shares with its parent (torch's libraries).
    out.put(high_water_mark() or 0)


def runtime_bytes() -> int:
    """Bytes, in a fresh process (this one's peak already holds the tensors measured above):
    its own peak resident pages, as `peak_mem_bytes` counts a trainer's."""
    q = mp.get_context("spawn").Queue()
    mp.start_processes(_runtime, args=(q,), nprocs=1, start_method="spawn")
    return q.get()


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(f"matmul fp32 FLOP/s (1 thread): {matmul_flops(torch.float32):.3e}")
    print(f"matmul bf16 FLOP/s (1 thread): {matmul_flops(torch.bfloat16):.3e}")
    print(f"op overhead s (fwd + bwd):     {op_overhead():.2e}")
    print(f"copy bandwidth B/s:            {copy_bandwidth():.3e}")
    lat, bw = gloo()
    print(f"gloo all-reduce latency s:     {lat:.2e}")
    print(f"gloo all-reduce bus B/s:       {bw:.3e}")
    print(f"runtime own peak bytes:        {runtime_bytes()}")

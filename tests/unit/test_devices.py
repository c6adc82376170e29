"""GPU discovery as CUDA numbers devices (worker/devices.py): CUDA_VISIBLE_DEVICES in its
index and UUID forms, read exactly as torch.cuda.device_count() reads it; and no NVML, the
CPU path."""

from __future__ import annotations

import pytest

from worker.devices import discover, visible_ordinals

# Four GPUs as NVML lists them (its index order), with made-up but well-formed UUIDs.
UUIDS = [
    "GPU-8f3c1a22-0000-0000-0000-000000000000",
    "GPU-8f3c1b33-0000-0000-0000-000000000000",
    "GPU-1d2e3f44-0000-0000-0000-000000000000",
    "GPU-aa55aa55-0000-0000-0000-000000000000",
]


def test_unset_shows_every_gpu_in_nvml_order():
    assert visible_ordinals(None, UUIDS) == [0, 1, 2, 3]


def test_empty_shows_no_gpu():
    assert visible_ordinals("", UUIDS) == []


def test_indices_are_renumbered_in_the_listed_order():
    # cuda:0 is NVML's GPU 2, cuda:1 its GPU 0
    assert visible_ordinals("2,0", UUIDS) == [2, 0]


def test_indices_are_read_like_strtoul():
    assert visible_ordinals(" 1gpu,3", UUIDS) == [1, 3]


def test_an_index_past_the_hosts_gpus_ends_the_list():
    assert visible_ordinals("1,7,2", UUIDS) == [1]


def test_a_non_index_entry_ends_the_list():
    assert visible_ordinals("3,x,0", UUIDS) == [3]


def test_a_gpu_listed_twice_shows_none():
    assert visible_ordinals("0,1,0", UUIDS) == []


def test_full_uuids_name_their_gpus():
    assert visible_ordinals(f"{UUIDS[3]},{UUIDS[1]}", UUIDS) == [3, 1]


def test_a_unique_uuid_prefix_names_its_gpu():
    assert visible_ordinals("GPU-1d2e,GPU-aa5", UUIDS) == [2, 3]


def test_an_ambiguous_uuid_prefix_ends_the_list():
    # GPU-8f3c1 starts the UUIDs of GPUs 0 and 1
    assert visible_ordinals("GPU-aa55,GPU-8f3c1,GPU-1d2e", UUIDS) == [3]


def test_an_index_among_uuids_ends_the_list():
    assert visible_ordinals("GPU-1d2e,0", UUIDS) == [2]


def test_the_same_gpu_by_two_prefixes_shows_none():
    assert visible_ordinals("GPU-1d2e,GPU-1d2e3f", UUIDS) == []


def test_mig_instances_show_no_gpu():
    assert visible_ordinals("MIG-4b2f6c1e-0000-0000-0000-000000000000", UUIDS) == []


def test_without_nvml_a_worker_has_no_gpu():
    # Only where NVML cannot start (no library or no driver, as on CI): the CPU path.
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this host has NVML and a driver: the CPU path is not what it runs")
    except pynvml.NVMLError:
        pass
    assert discover({"CUDA_VISIBLE_DEVICES": "0"}) == []

"""Re-running is a no-op; a changed input or option prepares again; a killed or interrupted
run leaves no manifest, and the next run finishes the job."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.data.conftest import write_jsonl
from tests.launch import ROOT


def stamps(directory):
    return {p: p.stat().st_mtime_ns for p in sorted(directory.rglob("*"))}


def test_rerun_is_a_no_op_until_something_changes(tmp_path, prepare, docs):
    data = write_jsonl(tmp_path / "a.jsonl", docs[:50])
    out = tmp_path / "ds"
    assert prepare([data], out).rc == 0
    before = stamps(out)
    again = prepare([data], out)
    assert again.rc == 0 and "already holds this dataset" in again.out
    assert stamps(out) == before

    changed = prepare([data], out, "--shard-tokens", 1000)  # an option
    assert changed.rc == 0 and "already holds" not in changed.out
    assert len(list((out / "train").glob("shard-*.bin"))) > 1
    write_jsonl(data, docs[:49] + [docs[49] + "!"])  # an input's content, same name
    changed = prepare([data], out, "--shard-tokens", 1000)
    assert changed.rc == 0 and "already holds" not in changed.out
    (out / "train" / "shard-00000.bin").unlink()  # a file gone: prepared again
    assert "already holds" not in prepare([data], out, "--shard-tokens", 1000).out
    assert (out / "train" / "shard-00000.bin").exists()


@pytest.fixture(scope="module")
def big(tmp_path_factory, docs):
    """Enough text for a run of some seconds with one worker."""
    path = tmp_path_factory.mktemp("big") / "big.jsonl"
    return write_jsonl(path, [f"{i} {d}" for i in range(40) for d in docs])


def start(big, out, tokenizer_file):
    cmd = [
        sys.executable,
        "-m",
        "cli",
        "data",
        "prepare",
        str(big),
        "--tokenizer",
        str(tokenizer_file),
        "--out",
        str(out),
        "--workers",
        "1",
        "--shard-tokens",
        "20000",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A suite started in the background (`make test &`) runs with SIGINT ignored, which
        # every child inherits, and Python then never turns Ctrl-C into KeyboardInterrupt:
        # the run below would finish as if the signal had not come. A terminal's Ctrl-C is
        # what this test is about.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    # the second shard (a first may be an earlier dataset's): most of the input is still
    # ahead (after the third, a fast machine finished the run before the signal landed)
    while not (out / "train" / "shard-00001.bin").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return proc


def test_a_killed_run_leaves_no_manifest(tmp_path, prepare, cli, big, docs, tokenizer_file):
    out = tmp_path / "ds"
    assert prepare([write_jsonl(tmp_path / "small.jsonl", docs[:20])], out).rc == 0
    proc = start(big, out, tokenizer_file)  # another dataset into the same directory
    workers = psutil.Process(proc.pid).children()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists()  # the small dataset's is gone too
    # the orphaned workers notice their parent is gone and exit
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert workers and not alive
    r = prepare([big], out, "--shard-tokens", 20000)
    assert r.rc == 0, r.err
    assert cli("data", "verify", out, "--quiet").rc == 0


def test_ctrl_c_leaves_no_manifest_and_no_traceback(tmp_path, big, tokenizer_file):
    proc = start(big, tmp_path / "ds", tokenizer_file)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith("meshkeeper: interrupted before")
    assert "Traceback" not in err and not (tmp_path / "ds" / "manifest.json").exists()

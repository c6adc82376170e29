"""Local process plumbing shared by the agent (trainers) and `meshkeeper up` (the stack).

Children run in their own process groups, die with their parent (Linux PR_SET_PDEATHSIG),
and stop in bounded time: SIGTERM to the group, SIGKILL after a grace period to the group and
every process below it (psutil).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

import psutil

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def die_with_parent(sig: int = signal.SIGKILL, parent: int = 0) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux only).

    Usable as a `preexec_fn` of a single-threaded parent, or first thing in a child. The
    signal follows the parent *thread*: spawn from the main thread."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):
        return  # not Linux: process-group stops still apply
    if parent and os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def write_output_to(path: str) -> None:
    """This process's stdout and stderr from now on: appended to `path` (what Python has
    buffered goes to the old place first)."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def fork_call(fn: Callable[[], int | None]) -> int:
    """Fork; the child runs `fn` and exits with what an interpreter running it would: its
    return value (None: 0), a `sys.exit` code, or 1 after printing any other exception's
    traceback. The child never returns; the parent gets its pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = int(fn() or 0)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def become_subreaper() -> bool:
    """Adopt this process's orphaned descendants (Linux PR_SET_CHILD_SUBREAPER): a process
    forked by a child of ours and left by it becomes our child, to reap and watch (`Child`).
    False where the kernel cannot."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) == 0
    except (OSError, AttributeError):
        return False


class Child:
    """A child process known by its pid alone (one this process adopted or forked itself),
    with the part of `subprocess.Popen` that the callers of `stop_all` use: `pid`, `poll`,
    `wait`, `returncode`, `stdin` (None). Only this object may reap it (never `os.wait()`),
    so its pid cannot be reused while it is not reaped."""

    stdin = None

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None
        self.args = [str(pid)]

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: gone, with its code unknown
                self.returncode = 1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


KILL_WAIT_S = 5.0  # after SIGKILL: a process still there is stuck in the kernel (state D)


def _tree(procs: list[subprocess.Popen]) -> list[psutil.Process]:
    """Every process below the running ones in `procs`, as of now."""
    out = []
    for p in procs:
        if p.poll() is None:  # still ours: its pid cannot have been reused
            try:
                out += psutil.Process(p.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
    return out


def _wait(procs: list[subprocess.Popen], timeout_s: float) -> list[subprocess.Popen]:
    """Reap each of `procs` within `timeout_s` in all; the ones still running."""
    deadline, running = time.monotonic() + timeout_s, []
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            running.append(p)
    return running


def stop_all(
    procs: list[subprocess.Popen], grace_s: float, kill_wait_s: float = KILL_WAIT_S
) -> list[subprocess.Popen]:
    """SIGTERM every process group, SIGKILL whatever still runs after `grace_s` (the groups
    and every process that was below them), reap all.

    The tree is taken before anything is signalled: a leader that exits takes the way to its
    children with it (they are reparented), and torchrun's ranks sit in sessions of their own
    that no group signal reaches. psutil refuses to signal a pid that was reused meanwhile.

    Every wait is bounded: a process in uninterruptible sleep (D: a hung NFS read, a stuck
    device) ignores even SIGKILL until the kernel lets go, and an unbounded wait would freeze
    the caller (an agent's loop, while its heartbeat thread keeps it looking alive). Returns
    the processes that had not exited `kill_wait_s` after SIGKILL; the kill stays pending and
    a later `poll()` reaps them."""
    below = _tree(procs)
    for p in procs:
        signal_group(p, signal.SIGTERM)
        if p.stdin and not p.stdin.closed:
            p.stdin.close()  # a child waiting on stdin exits on EOF too
    _wait(procs, grace_s)
    for p in procs:
        signal_group(p, signal.SIGKILL)  # also reaches children of a leader that exited
    for c in below:
        try:
            c.kill()
        except psutil.NoSuchProcess:
            pass
    return _wait(procs, kill_wait_s)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its ranks in sessions of their own, so a
    process group does not reach them)."""
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []

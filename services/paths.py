"""Paths a job spec names (`data.source`, `model.hf`, `checkpoint.root` and `.export_hf`),
confined to roots.

A path is taken only when it is absolute, has no `..`, lies under one of the configured
roots, and no component on the way is a symlink whose target leaves that root. A path outside
every root is refused before anything is looked up, with one message, so a refusal never
tells whether something exists there. Inside a root the refusal says what is wrong (missing,
a directory, unreadable, a link that leads out): that tree is the user's own, and a link is
judged by where it points, never by whether its target exists.

The controller checks at submission without requiring the file (it may not mount the data
volume); the agent checks again on its host, requiring a regular file, and hands its trainers
the resolved path (`confine_spec`). Torch-free: the controller imports it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from dataset.format import MANIFEST
from services.spec_types import FILE_SOURCES, Problem, SpecError

# Where agents keep hot recovery's in-memory snapshots by default (their --snapshot-dir): host
# memory on Linux. Here, not in worker/, so `meshkeeper up` (cli/) can give each stack its own.
SNAPSHOT_ROOT = Path("/dev/shm/meshkeeper")


class PathRefused(ValueError):
    pass


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def confine(path: str, roots: Sequence[Path], *, must_exist: bool) -> Path:
    """`path` resolved under one of `roots`, or PathRefused. `must_exist`: a regular file."""
    if not roots:
        raise PathRefused("no roots are configured here, so no path is allowed")
    shown = ", ".join(str(r) for r in roots)
    if not os.path.isabs(path):
        raise PathRefused(f"{path!r} is relative; give an absolute path under {shown}")
    if ".." in Path(path).parts:
        raise PathRefused(f"{path!r} contains '..'; give a plain absolute path under {shown}")
    lexical = Path(os.path.normpath(path))  # folds '.' and '//' ('..' is refused above)
    for root in roots:
        real_root = Path(os.path.realpath(root))
        for base in (Path(os.path.abspath(root)), real_root):  # a root may itself be a link
            if _within(lexical, base):
                return _walk(path, real_root, lexical.relative_to(base).parts, must_exist)
    # nothing looked up: the same words whether or not it exists
    raise PathRefused(f"{path!r} is not inside the allowed roots ({shown}); use a path inside one")


def _walk(path: str, root: Path, parts: tuple[str, ...], must_exist: bool) -> Path:
    """Follow `parts` from `root` one component at a time; any link must stay in the root.
    `must_exist` (the agent, on its host): the end is a readable regular file."""
    cur = root
    for i, part in enumerate(parts):
        nxt = cur / part
        try:
            mode = os.lstat(nxt).st_mode
        except FileNotFoundError:  # the rest cannot be links
            if must_exist:
                raise PathRefused(f"{path!r} does not exist ({nxt} is missing)") from None
            return nxt.joinpath(*parts[i + 1 :])
        except OSError as e:
            raise PathRefused(f"{path!r} cannot be looked up ({nxt}: {e.strerror})") from None
        if stat.S_ISLNK(mode):
            target = Path(os.path.realpath(nxt))
            if not _within(target, root):
                raise PathRefused(
                    f"{path!r} passes through {nxt}, a link that leads out of the allowed root "
                    f"{root}; copy the data into the root instead of linking to it"
                )
            nxt = target
        cur = nxt
    if must_exist:
        if not stat.S_ISREG(os.stat(cur).st_mode):
            raise PathRefused(f"{path!r} is a directory or special file, not a regular file")
        if not os.access(cur, os.R_OK):
            raise PathRefused(f"{path!r} cannot be read by this process (its permissions)")
    return cur


def confine_spec(
    spec: dict, data_roots: Sequence[Path], checkpoint_roots: Sequence[Path], *, on_host: bool
) -> dict:
    """The spec (JSON form) with `model.hf`, `data.source`, `checkpoint.root` and
    `checkpoint.export_hf` checked against the roots; `on_host` (the agent): the model
    directory and the data file must exist, and all come back resolved. SpecError names each
    refused field and its fix."""
    data, ckpt = dict(spec.get("data") or {}), dict(spec.get("checkpoint") or {})
    model = dict(spec.get("model") or {})
    problems = []
    if model.get("hf"):  # a model directory is data: the same roots, the same refusals
        try:
            # its config.json, which every reader opens first, must lie under a root too
            config = confine(str(Path(model["hf"]) / "config.json"), data_roots, must_exist=on_host)
            model["hf"] = str(config.parent)
        except PathRefused as e:
            fix = (
                "add a data root (controller and agent flag --data-root)"
                if not data_roots
                else ("move the model directory under a data root")
            )
            problems.append(Problem("model.hf", f"{e}; {fix}"))
    kind, _, path = str(data.get("source", "synthetic")).partition(":")
    if kind in FILE_SOURCES:
        try:
            if kind == "dataset":  # its manifest, which every reader opens first
                where = confine(str(Path(path) / MANIFEST), data_roots, must_exist=on_host).parent
            else:
                where = confine(path, data_roots, must_exist=on_host)
            data["source"] = f"{kind}:{where}"
        except PathRefused as e:
            fix = (
                "add a data root (controller and agent flag --data-root) or use "
                "data.source: synthetic"
                if not data_roots
                else "move the file under a data root"
            )
            problems.append(Problem("data.source", f"{e}; {fix}"))
    if ckpt.get("root"):
        try:
            ckpt["root"] = str(confine(ckpt["root"], checkpoint_roots, must_exist=False))
        except PathRefused as e:
            problems.append(
                Problem(
                    "checkpoint.root",
                    f"{e}; leave checkpoint.root out (checkpoints "
                    "then go under the workers' own checkpoint root) or use a "
                    "directory under --checkpoint-root-allow",
                )
            )
    if ckpt.get("export_hf"):  # written, like checkpoints: the same roots
        try:
            ckpt["export_hf"] = str(confine(ckpt["export_hf"], checkpoint_roots, must_exist=False))
        except PathRefused as e:
            problems.append(
                Problem("checkpoint.export_hf", f"{e}; export under a checkpoint root instead")
            )
    if problems:
        raise SpecError(problems)
    return {**spec, "model": model, "data": data, "checkpoint": ckpt}

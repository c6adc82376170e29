"""Priority classes (docs/control-plane.md, "Priorities and preemption"): a job's
`priority.class` names one; the queue places higher values first (backfill and the
reservation bound apply within a value), and a class that preempts may stop lower-valued
running jobs to run (controller/preempting.py).

The built-in classes are low (0), default (100) and high (1000, preempts); an operator
replaces them with `--priority-classes FILE`, a YAML list of `{name, value, preempts,
submitters}` that must hold a class named `default` (the class of a spec that names none).

Who may submit into a class: an admin always; a listed `submitters` token name; and, where a
class lists none, anyone for a class that does not preempt. A class that stops other people's
jobs is a privilege, so without a list it is the admins' only (the built-in `high` too).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from controller.auth import Principal
from controller.chaos_gate import Refusal
from services.spec import JobSpec, Problem

DEFAULT = "default"


@dataclass(frozen=True)
class PriorityClass:
    name: str
    value: int
    preempts: bool = False
    submitters: tuple[str, ...] | None = None  # token names besides admins; None: see above

    def __str__(self) -> str:
        return f"{self.name} ({self.value}{', preempts' if self.preempts else ''})"

    def open_to(self, who: Principal) -> bool:
        if who.admin:
            return True
        if self.submitters is not None:
            return who.name in self.submitters
        return not self.preempts


@dataclass(frozen=True)
class PriorityClasses:
    classes: tuple[PriorityClass, ...] = (
        PriorityClass("low", 0),
        PriorityClass(DEFAULT, 100),
        PriorityClass("high", 1000, preempts=True),
    )

    def of(self, spec: JobSpec) -> PriorityClass:
        """The class of an admitted job; one whose class the operator removed since counts
        as the lowest there is, and never preempts."""
        found = {c.name: c for c in self.classes}.get(spec.priority.class_)
        return found or PriorityClass(spec.priority.class_, min(c.value for c in self.classes))

    def refusal(self, spec: JobSpec, who: Principal) -> Refusal | None:
        """403 when the spec's class (a known one: `problems` reports the rest) is not open
        to `who`."""
        found = {c.name: c for c in self.classes}.get(spec.priority.class_)
        if found is None or found.open_to(who):
            return None
        open_to = [c.name for c in self.classes if c.open_to(who)]
        return Refusal(
            403,
            f"token {who.name!r} (role {who.role}) may not submit into priority class "
            f"{found.name!r}",
            Problem(
                "priority.class",
                f"class {found} is open to "
                + (f"admins and {', '.join(found.submitters)}" if found.submitters else "admins")
                + f"; use one of {', '.join(open_to)}, or ask an operator to list this token "
                "in the class's submitters (--priority-classes)",
            ),
        )

    def problems(self, spec: JobSpec) -> list[Problem]:
        if spec.priority.class_ in {c.name for c in self.classes}:
            return []
        known = ", ".join(str(c) for c in sorted(self.classes, key=lambda c: c.value))
        return [
            Problem(
                "priority.class",
                f"unknown priority class {spec.priority.class_!r}; this pool has: {known}",
            )
        ]


def load(path: Path) -> PriorityClasses:
    """`--priority-classes FILE`; ValueError naming the file, the entry and the fix."""
    try:
        entries = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read it: {e}") from None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a YAML list of {{name, value, preempts, submitters}}")
    out: list[PriorityClass] = []
    for i, e in enumerate(entries):
        where = f"{path}: entry {i + 1}"
        if not isinstance(e, dict) or set(e) - {"name", "value", "preempts", "submitters"}:
            raise ValueError(f"{where}: expected {{name, value, preempts, submitters}}, got {e!r}")
        name, value, preempts = e.get("name"), e.get("value"), e.get("preempts", False)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: name must be a non-empty string")
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{where} ({name}): value must be an integer")
        if not isinstance(preempts, bool):
            raise ValueError(f"{where} ({name}): preempts must be true or false")
        submitters = e.get("submitters")
        if submitters is not None and (
            not isinstance(submitters, list) or not all(isinstance(t, str) for t in submitters)
        ):
            raise ValueError(f"{where} ({name}): submitters must be a list of token names")
        if name in {c.name for c in out}:
            raise ValueError(f"{where}: class {name!r} is listed twice")
        listed = tuple(submitters) if submitters is not None else None
        out.append(PriorityClass(name, value, preempts, listed))
    if DEFAULT not in {c.name for c in out}:
        raise ValueError(f"{path}: no class named {DEFAULT!r} (the class of a spec without one)")
    return PriorityClasses(tuple(out))

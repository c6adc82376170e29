"""What every section of the job spec is built from: strict pydantic models and printable
paths (services/spec.py, services/model_spec.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


class Strict(BaseModel):
    # strict: numbers must be numbers (no `true` for 1, no "5" for 5); int is accepted where
    # a float is expected. allow_inf_nan=False: Infinity and NaN are refused everywhere.
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False
    )


def printable_path(text: str) -> str:
    """`text` if it holds no NUL or other control character: a path with one cannot name a
    file (the OS stops at NUL) and would reach logs and the mesh page as it is."""
    bad = [c for c in text if ord(c) < 32 or ord(c) == 127]
    if bad:
        raise ValueError(
            f"holds a control character ({bad[0]!r}); a path is printable text, give it "
            "without NUL, newline or escape characters"
        )
    return text


PathText = Annotated[str, AfterValidator(printable_path)]

# `data.source` kinds that name a path: the data roots confine them (services/paths.py)
FILE_SOURCES = ("text", "tokens", "dataset")


@dataclass(frozen=True)
class Problem:
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class SpecError(ValueError):
    """An invalid spec; `problems` names each field and its fix."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("invalid job spec:\n" + "\n".join(f"  - {p}" for p in problems))

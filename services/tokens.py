"""API tokens and the controller's auth file (docs/security.md).

Shared by the controller (verifies), the CLI and `meshkeeper up` (generate, read). A token is an
opaque random string; the auth file holds only its sha256, so a leaked auth file grants nothing.

Auth file (JSON, mode 0600):
    {"tokens": [{"name": "admin", "role": "admin", "sha256": "<hex>"}, ...],
     "join_sha256": "<hex>"}
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.secrets import write_secret

# viewer reads; submitter also submits and cancels its own jobs; admin does everything;
# scrape reads only /metrics and the Prometheus service discovery.
ROLES = ("viewer", "submitter", "admin", "scrape")


class TokenError(ValueError):
    """A token or auth file that cannot be used; the message names the file or variable."""


@dataclass(frozen=True)
class TokenEntry:
    name: str
    role: str
    sha256: str


@dataclass(frozen=True)
class AuthFile:
    tokens: tuple[TokenEntry, ...]
    join_sha256: str | None = None


def new_token() -> str:
    return secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def write_auth_file(
    path: str | Path, tokens: Iterable[tuple[str, str, str]], join_token: str | None = None
) -> Path:
    """Write (name, role, plaintext) tokens as hashes; the file is created 0600 (never
    world-readable, not even for an instant)."""
    entries = []
    for name, role, plaintext in tokens:
        _check_role(role, f"token {name!r}")
        entries.append({"name": name, "role": role, "sha256": hash_token(plaintext)})
    body: dict = {"tokens": entries}
    if join_token:
        body["join_sha256"] = hash_token(join_token)
    return write_secret(Path(path), json.dumps(body, indent=2))


def read_auth_file(path: str | Path) -> AuthFile:
    where = f"auth file {path}"
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise TokenError(
            f"cannot read {where}: {e.strerror}; pass --auth-file with the "
            "auth.json that `meshkeeper up` writes under its run dir's secrets/"
        ) from None
    except json.JSONDecodeError as e:
        raise TokenError(f"{where} is not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("tokens", []), list):
        raise TokenError(
            f'{where} must be {{"tokens": [{{"name", "role", "sha256"}}, ...], '
            '"join_sha256": "<hex>"}'
        )
    entries = []
    for i, t in enumerate(raw.get("tokens", [])):
        field = f"{where}: tokens[{i}]"
        if not isinstance(t, dict) or not all(
            isinstance(t.get(k), str) and t.get(k) for k in ("name", "role", "sha256")
        ):
            raise TokenError(f'{field} needs string fields "name", "role" and "sha256"')
        _check_role(t["role"], field)
        entries.append(TokenEntry(t["name"], t["role"], _check_hex(t["sha256"], f"{field}.sha256")))
    join = raw.get("join_sha256")
    if join is not None:
        join = _check_hex(join, f"{where}: join_sha256")
    return AuthFile(tuple(entries), join)


def read_token(env: Mapping[str, str] | None = None, var: str = "MESHKEEPER_TOKEN") -> str | None:
    """The token in `var`, else in the file `var`_FILE names (surrounding whitespace dropped),
    else None. Also reads the agents' MESHKEEPER_JOIN_TOKEN(_FILE) with `var=`."""
    env = os.environ if env is None else env
    if env.get(var):
        return env[var].strip()
    path = env.get(f"{var}_FILE")
    if not path:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise TokenError(f"{var}_FILE={path}: cannot read it ({e.strerror})") from None
    if not token:
        raise TokenError(f"{var}_FILE={path} is empty")
    return token


def _check_role(role: str, where: str) -> None:
    if role not in ROLES:
        raise TokenError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")


def _check_hex(value, where: str) -> str:
    if (
        not isinstance(value, str)
        or len(value) != 64
        or any(c not in "0123456789abcdef" for c in value.lower())
    ):
        raise TokenError(f"{where} must be 64 hex digits (sha256 of the token)")
    return value.lower()

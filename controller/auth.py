"""Bearer-token authentication and roles of the REST API (docs/security.md).

The controller holds only sha256 hashes of tokens (an auth file, or plaintext env tokens hashed
at load) and compares them with `hmac.compare_digest`, against every stored hash, so neither a
leaked auth file nor response timing reveals a token.

Roles: viewer reads; submitter also submits and cancels its own jobs; admin does everything;
scrape reads only /metrics and the Prometheus service discovery.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.tokens import TokenEntry, hash_token, read_auth_file

log = logging.getLogger("meshkeeper.auth")

# who may call what (a role is a set of permissions, not a rank: scrape is no viewer)
READ = ("viewer", "submitter", "admin")
SUBMIT = ("submitter", "admin")
ADMIN = ("admin",)
METRICS = ("viewer", "submitter", "admin", "scrape")

JOIN_HOW_TO = (
    "POST /v1/agents/join needs the agents' join token as a bearer token "
    "(agent flags --join-token-file or env MESHKEEPER_JOIN_TOKEN[_FILE]; "
    "`meshkeeper up` writes {run-dir}/secrets/join-token)"
)
HOW_TO = (
    "send `Authorization: Bearer TOKEN` (the CLI reads MESHKEEPER_TOKEN or "
    "MESHKEEPER_TOKEN_FILE; `meshkeeper up` writes tokens under its run dir's secrets/)"
)
# plaintext tokens some deployments pass through the environment: (variable, name, role)
ENV_TOKENS = (
    ("MESHKEEPER_API_TOKEN", "admin", "admin"),
    ("MESHKEEPER_SCRAPE_TOKEN", "prometheus", "scrape"),
)

bearer = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="an API token; roles viewer, submitter, admin, scrape",
)


@dataclass(frozen=True)
class Principal:
    name: str
    role: str

    @property
    def admin(self) -> bool:
        return self.role == "admin"


class Denied(Exception):
    """401 (no valid token) or 403 (valid token, wrong role or not the job's owner)."""

    def __init__(self, status: int, detail: str, challenge: str | None = None):
        self.status, self.detail, self.challenge = status, detail, challenge


class Auth:
    def __init__(
        self, tokens: Iterable[TokenEntry], join_hashes: Iterable[str] = (), insecure: bool = False
    ):
        self.tokens = tuple(tokens)
        self.join_hashes = tuple(join_hashes)
        self.insecure = insecure

    @classmethod
    def load(
        cls, auth_file: str | Path | None, env: Mapping[str, str], insecure: bool = False
    ) -> Auth:
        """Tokens of the auth file plus the env tokens. Raises TokenError (a bad auth file)."""
        tokens, joins = [], []
        if auth_file:
            f = read_auth_file(auth_file)
            tokens += f.tokens
            joins += [f.join_sha256] if f.join_sha256 else []
        for var, name, role in ENV_TOKENS:
            if env.get(var):
                tokens.append(TokenEntry(name, role, hash_token(env[var].strip())))
        if env.get("MESHKEEPER_JOIN_TOKEN"):
            joins.append(hash_token(env["MESHKEEPER_JOIN_TOKEN"].strip()))
        return cls(tokens, joins, insecure)

    @property
    def has_admin(self) -> bool:
        return any(t.role == "admin" for t in self.tokens)

    def identify(self, token: str | None) -> Principal | None:
        """The token's owner, or None. Every stored hash is compared (no early exit)."""
        if self.insecure:
            return Principal("anonymous", "admin")
        if not token:
            return None
        digest = hashlib.sha256(token.encode()).hexdigest()
        found = None
        for t in self.tokens:
            if hmac.compare_digest(digest, t.sha256):
                found = found or Principal(t.name, t.role)
        return found

    def join_ok(self, token: str | None) -> bool:
        """Whether `token` is the agents' join token (for POST /v1/agents/join)."""
        if not token:
            return False
        digest = hashlib.sha256(token.encode()).hexdigest()
        return sum(hmac.compare_digest(digest, h) for h in self.join_hashes) > 0

    def authenticate(self, what: str, token: str | None) -> Principal:
        """The caller of `what` ("METHOD /path") by its bearer token; Denied 401 without one,
        or with one nobody here issued."""
        if token is None and not self.insecure:
            raise Denied(401, f"{what} needs a bearer token; {HOW_TO}", 'Bearer realm="meshkeeper"')
        who = self.identify(token)
        if who is None:
            raise Denied(
                401,
                f"the bearer token is not valid (unknown or revoked); {HOW_TO}",
                'Bearer realm="meshkeeper", error="invalid_token"',
            )
        return who

    def require(self, roles: tuple[str, ...]) -> Callable[..., Principal]:
        """A FastAPI dependency: the caller's Principal if its role is one of `roles`."""

        def dependency(
            request: Request, cred: HTTPAuthorizationCredentials | None = Security(bearer)
        ) -> Principal:
            what = f"{request.method} {request.url.path}"
            who = self.authenticate(what, cred.credentials if cred else None)
            request.state.principal = who  # the audit log names who asked (controller/app.py)
            if who.role not in roles:
                raise Denied(
                    403,
                    f"token {who.name!r} has role {who.role}; {what} needs {' or '.join(roles)}",
                )
            return who

        return dependency


def may_cancel(who: Principal, job_id: str, owner: str | None) -> None:
    """Admins cancel (or suspend, or resume) any job; a submitter only the jobs its token
    submitted."""
    if not who.admin and owner != who.name:
        raise Denied(
            403,
            f"job {job_id} belongs to {owner or 'nobody recorded'}; token "
            f"{who.name!r} (role {who.role}) may cancel, suspend or resume only its own jobs",
        )


def refuse_without_admin(auth: Auth) -> str | None:
    """Why this controller must not start (None: it may). Logs the insecure mode loudly."""
    if auth.insecure:
        log.warning(
            "*** --insecure-no-auth: EVERY request is admin, with no token. Only for "
            "throwaway experiments on a trusted machine. ***"
        )
        return None
    if auth.has_admin:
        return None
    return (
        "no admin token is configured: pass --auth-file PATH (env MESHKEEPER_AUTH_FILE; "
        "`meshkeeper up` generates {run-dir}/secrets/auth.json) or set MESHKEEPER_API_TOKEN; "
        "--insecure-no-auth runs without authentication (throwaway experiments only)"
    )

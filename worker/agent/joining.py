"""How an agent becomes a worker and stays one (docs/security.md, "Joining"): the join through
the controller (POST /v1/agents/join with the join token), the credential it keeps to prove a
restart is the same agent, and joining again when Redis refuses its password.

A worker id is bound to the agent holding it while that agent beats, so a join with the token
alone cannot take over a live worker (409). The agent keeps the Redis password of its last
join in `{run_dir}/credential` (0600) and presents it at its next join: a restarted agent
gets its id back at once. When Redis refuses the password (WRONGPASS: Redis lost its users, or
an operator deleted this one), the agent joins again instead of retrying it forever, and every
connection it opens from then on authenticates with the new one.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx
import redis

from services.secrets import write_secret
from worker.agent.retry import Outage

log = logging.getLogger("meshkeeper.agent")
REJOIN_EVERY_S = 5.0  # at most one re-join in this long: every connection fails at once


class JoinNotAnswered(Exception):
    """An answer a retry may fix: a 5xx, a 429, or 409 (a live agent still holds the id)."""


class Credentials(redis.CredentialProvider):
    """The agent user and password every connection of the agent authenticates with: one
    object shared by all its Stores, so a re-join's password reaches every reconnect."""

    def __init__(self, url: str):
        self.set(url)

    def set(self, url: str) -> None:
        u = urlsplit(url)
        self._pair = (unquote(u.username or ""), unquote(u.password or ""))

    def get_credentials(self) -> tuple[str, str]:
        return self._pair


@dataclass
class Joiner:
    controller: str
    token: str
    body: dict  # the agent's description (controller/agents_api.py `JoinRequest`)
    verify: object  # httpx's `verify`: True, or an SSL context trusting --ca-file
    kept: Path  # where the credential lives between joins
    redis_address: str | None = None  # reach Redis here instead of where the answer says

    def once(self) -> tuple[str, str]:
        """One join; (redis_url, prefix). A refused token or description exits: retrying
        cannot fix configuration."""
        credential = self.kept.read_text().strip() if self.kept.is_file() else ""
        r = httpx.post(
            self.controller.rstrip("/") + "/v1/agents/join",
            json={**self.body, **({"credential": credential} if credential else {})},
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=10.0,
            verify=self.verify,
        )
        if r.status_code in (401, 403, 422):
            raise SystemExit(
                f"agent: the controller refused the join ({r.status_code}): {detail(r)}"
            )
        if r.status_code != 200:
            raise JoinNotAnswered(f"it answered {r.status_code}: {detail(r)}")
        answer = r.json()
        self.kept.parent.mkdir(parents=True, exist_ok=True)
        write_secret(self.kept, unquote(urlsplit(answer["redis_url"]).password or ""))
        log.info("joined %s as worker %s", self.controller, self.body["id"])
        return via(answer["redis_url"], self.redis_address), answer["prefix"]

    def until_joined(self, stop: threading.Event) -> tuple[str, str] | None:
        """Join, retrying while the controller cannot answer or the id is still held; None
        if stopped first."""
        return Outage(
            (httpx.HTTPError, JoinNotAnswered),
            5.0,
            stop,
            down=f"cannot join through the controller {self.controller} (%s); retrying",
            back=f"the controller {self.controller} answers again",
        ).call(self.once)


class Rejoin:
    """Called with each failed Redis call of the agent's loop: on a refused password, join
    again (at most every REJOIN_EVERY_S) and hand every connection the new credentials."""

    def __init__(self, joiner: Joiner, credentials: Credentials):
        self.joiner, self.credentials = joiner, credentials
        self._last = float("-inf")

    def __call__(self, error: BaseException) -> None:
        if not isinstance(error, redis.AuthenticationError):
            return
        if time.monotonic() - self._last < REJOIN_EVERY_S:
            return
        self._last = time.monotonic()
        log.warning("Redis refused this agent's password (%s): joining again", error)
        try:
            url, _ = self.joiner.once()
        except (httpx.HTTPError, JoinNotAnswered) as e:
            log.warning("the re-join failed (%s); trying again at the next refusal", e)
            return
        self.credentials.set(url)


def detail(r: httpx.Response) -> str:
    try:
        return str(r.json().get("detail", r.text[:200]))
    except ValueError:
        return r.text[:200]


def via(url: str, address: str | None) -> str:
    """`url` with its host and port replaced by `address` (credentials kept)."""
    if not address:
        return url
    u = urlsplit(url)
    creds = u.netloc.rpartition("@")[0]
    return urlunsplit(
        (u.scheme, f"{creds}@{address}" if creds else address, u.path, u.query, u.fragment)
    )

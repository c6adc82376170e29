"""Where each agent's Prometheus endpoint is: the contract behind the controller's HTTP SD
(docs/architecture.md, "Redis keys" and "Observability").

`worker:{wid}:metrics` is a string "host:port" the agent writes with a TTL and refreshes
from its own thread, so an agent that vanished drops out by itself, and a Redis restart or
a re-registration (which rewrites `worker:{wid}`) never loses it for long. The controller
lists only workers whose heartbeat is fresh, in Prometheus' http_sd format.
"""

from __future__ import annotations

from services.store import Store

TTL_S = 60.0
REFRESH_S = 15.0
WILDCARDS = ("", "0.0.0.0", "::")


def key(store: Store, wid: str) -> str:
    return f"{store.keys.prefix}worker:{wid}:metrics"


def advertise(store: Store, wid: str, target: str, ttl_s: float = TTL_S) -> None:
    store.r.set(key(store, wid), target, px=int(ttl_s * 1000))


def targets(store: Store, wids: list[str]) -> dict[str, str]:
    """wid -> "host:port" for the workers that advertise an endpoint."""
    if not wids:
        return {}
    return {
        w: t for w, t in zip(wids, store.r.mget([key(store, w) for w in wids]), strict=True) if t
    }


def target_for(bind_host: str, port: int, address: str) -> str:
    """What others scrape: the bound interface, or the agent's own address when bound to all."""
    host = address if bind_host in WILDCARDS else bind_host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

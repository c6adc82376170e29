"""Prometheus HTTP service discovery of the worker agents' metrics endpoints.

Answers in Prometheus' http_sd format: one target group per live worker that advertises an
endpoint (services/discovery.py), labelled with the worker id and its host, so Prometheus
follows the pool as it grows, shrinks and replaces pods without a config change.
"""

from __future__ import annotations

from controller.placement import natural_key
from services import discovery
from services.store import Store, loads


def worker_targets(store: Store, alive_s: float) -> list[dict]:
    wids = sorted(store.alive_workers(alive_s), key=natural_key)
    endpoints = discovery.targets(store, wids)
    infos = store.workers(list(endpoints))
    out = []
    for wid, target in endpoints.items():
        info = infos[wid]
        host = loads(info.get("labels"), {}).get("host") or info.get("host", "")
        out.append({"targets": [target], "labels": {"worker": wid, "host": host}})
    return out

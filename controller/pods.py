"""The controller's worker actions on Kubernetes (`WorkerActions`, controller/passes.py): when
a recovery moves a blamed worker out of its job, its pod is deleted, so the pool's Deployment
starts a fresh one that joins as a spare, and the TrainingJob gets an Event saying so
(controller/k8s.py does the API calls; docs/deploy.md).

The calls run on one background thread: a pass hands them over and goes on, so a slow or
unreachable API server never delays a recovery. Enabled only where a cluster is there to act
on (`from_environment`), which also keeps the `kubernetes` package (the operator extra) out of
controllers that run anywhere else.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from services.store import Store, loads

log = logging.getLogger("meshkeeper.k8s")


class PodReplacer:
    def __init__(self, k8s, store: Store):
        """`k8s`: a controller.k8s.KubernetesActions."""
        self.k8s, self.store = k8s, store
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k8s")

    @classmethod
    def from_environment(
        cls, store: Store, env: Mapping[str, str] = os.environ
    ) -> PodReplacer | None:
        if not (env.get("KUBERNETES_SERVICE_HOST") or env.get("MESHKEEPER_KUBECONFIG")):
            return None
        from controller.k8s import KubernetesActions  # the operator extra: in the image

        k8s = KubernetesActions.from_environment(env)
        return cls(k8s, store) if k8s is not None else None

    def worker_left(self, wid: str, job_id: str, why: str) -> Future:
        # the registration (host, labels) now: the worker's keys may be gone by the time the
        # thread runs (retention, a rejoin)
        info = self.store.workers([wid])[wid]
        worker = {"id": wid, "host": info.get("host"), "labels": loads(info.get("labels"), {})}
        return self._pool.submit(self._replace, worker, job_id, why)

    def _replace(self, worker: dict, job_id: str, why: str) -> None:
        try:
            self.k8s.replace_worker(worker, job_id, why)
        except Exception:  # the API's own errors are logged inside; anything else here too
            log.exception("replacing the pod of worker %s failed", worker["id"])

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)

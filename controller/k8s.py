"""The controller's Kubernetes actions: replace a failed worker's pod, and record Events on
the TrainingJob that submitted a job (called through controller/pods.py).

`KubernetesActions.from_environment()` is None unless the controller runs in a pod
(KUBERNETES_SERVICE_HOST) or has a kubeconfig (MESHKEEPER_KUBECONFIG), with
MESHKEEPER_K8S_WORKER_SELECTOR naming its worker pool (the Helm chart and deploy/k8s set
both). The recovery calls `replace_worker` after it has moved a blamed worker out: the pool's
Deployment then starts a fresh pod, which registers and becomes the new spare. Every method
logs and swallows API errors: recovery never waits on, or fails because of, the Kubernetes
API.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from collections.abc import Mapping
from typing import Any

import kubernetes
from kubernetes.client import ApiException

GROUP, VERSION, PLURAL, KIND = "meshkeeper.io", "v1alpha1", "trainingjobs", "TrainingJob"
SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

log = logging.getLogger("meshkeeper.k8s")


def parse_selector(text: str) -> dict[str, str]:
    """An equality label selector, `k=v,k2=v2` (the only form the chart writes)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key or value.startswith("="):
            raise ValueError(f"label selector {text!r}: use key=value[,key=value] (got {part!r})")
        out[key.strip()] = value.strip()
    if not out:
        raise ValueError("an empty worker selector would match every pod in the namespace")
    return out


class KubernetesActions:
    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        namespace: str,
        worker_selector: str,
        delete_grace_s: int = 10,
        instance: str = "",
    ):
        self.core = kubernetes.client.CoreV1Api(api)
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.namespace = namespace
        self.selector = parse_selector(worker_selector)
        self.grace_s = delete_grace_s
        self.instance = instance  # this controller's pod, for the Events' reportingInstance

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ) -> KubernetesActions | None:
        """In a pod (KUBERNETES_SERVICE_HOST, the service account), or outside the cluster
        with MESHKEEPER_KUBECONFIG (a kubeconfig file) and MESHKEEPER_NAMESPACE; in both cases
        only with MESHKEEPER_K8S_WORKER_SELECTOR naming the worker pool."""
        selector = env.get("MESHKEEPER_K8S_WORKER_SELECTOR")
        kubeconfig = env.get("MESHKEEPER_KUBECONFIG")
        if not selector or not (env.get("KUBERNETES_SERVICE_HOST") or kubeconfig):
            return None
        if kubeconfig:
            namespace = env.get("MESHKEEPER_NAMESPACE")
            if not namespace:
                raise ValueError("MESHKEEPER_KUBECONFIG needs MESHKEEPER_NAMESPACE (the pool's)")
            api = kubernetes.config.new_client_from_config(config_file=kubeconfig)
        else:
            kubernetes.config.load_incluster_config()
            namespace = env.get("MESHKEEPER_NAMESPACE") or open(SA_NAMESPACE).read().strip()
            api = kubernetes.client.ApiClient()
        return cls(
            api,
            namespace,
            selector,
            int(env.get("MESHKEEPER_K8S_DELETE_GRACE_S", "10")),
            env.get("MESHKEEPER_POD_NAME", ""),
        )

    # -- pods --------------------------------------------------------------------------
    @staticmethod
    def pod_name(worker: Mapping[str, Any]) -> str | None:
        """The worker's pod: its k8s.pod label (the chart sets it), else its host name
        (a pod's hostname is its name)."""
        return (worker.get("labels") or {}).get("k8s.pod") or worker.get("host")

    def delete_worker_pod(self, worker: Mapping[str, Any]) -> str | None:
        """Delete the worker's pod if it belongs to our pool; returns its name, or None."""
        name = self.pod_name(worker)
        if not name:
            log.warning("worker %s names no pod; nothing to delete", worker.get("id"))
            return None
        try:
            pod = self.core.read_namespaced_pod(name, self.namespace)
            labels = pod.metadata.labels or {}
            # RBAC grants delete on every pod of the namespace: the pool check is ours.
            if any(labels.get(k) != v for k, v in self.selector.items()):
                log.warning(
                    "pod %s is not in the worker pool (%s); not deleting it", name, self.selector
                )
                return None
            self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=self.grace_s)
        except ApiException as e:
            log.warning(
                "could not delete pod %s of worker %s: %s %s",
                name,
                worker.get("id"),
                e.status,
                e.reason,
            )
            return None
        log.info("deleted pod %s of worker %s", name, worker.get("id"))
        return name

    # -- events ------------------------------------------------------------------------
    def training_job(self, job_id: str) -> dict | None:
        """The TrainingJob whose status.jobID is this job (None for jobs submitted by REST)."""
        try:
            items = self.custom.list_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL
            )["items"]
        except ApiException as e:
            log.warning("cannot list TrainingJobs: %s %s", e.status, e.reason)
            return None
        return next((tj for tj in items if (tj.get("status") or {}).get("jobID") == job_id), None)

    def record_event(self, job_id: str, reason: str, message: str, type_: str = "Normal") -> bool:
        tj = self.training_job(job_id)
        if tj is None:
            return False
        meta = tj["metadata"]
        now = dt.datetime.now(dt.UTC)
        event = kubernetes.client.CoreV1Event(
            metadata=kubernetes.client.V1ObjectMeta(
                generate_name=f"{meta['name']}.", namespace=self.namespace
            ),
            involved_object=kubernetes.client.V1ObjectReference(
                api_version=f"{GROUP}/{VERSION}",
                kind=KIND,
                name=meta["name"],
                namespace=self.namespace,
                uid=meta.get("uid"),
            ),
            reason=reason,
            message=message[:1024],
            type=type_,
            count=1,
            first_timestamp=now,
            last_timestamp=now,
            source=kubernetes.client.V1EventSource(component="meshkeeper-controller"),
            reporting_component="meshkeeper.io/controller",
            reporting_instance=self.instance or None,
        )
        try:
            self.core.create_namespaced_event(self.namespace, event)
        except ApiException as e:
            log.warning(
                "could not record event %s on %s: %s %s", reason, meta["name"], e.status, e.reason
            )
            return False
        return True

    # -- what the recovery loop calls ------------------------------------------------------
    def replace_worker(self, worker: Mapping[str, Any], job_id: str | None, why: str) -> str | None:
        """Delete a dead or straggling worker's pod (the pool replaces it) and say so on the
        job's TrainingJob. `worker` is a /v1/workers entry (id, host, labels)."""
        pod = self.delete_worker_pod(worker)
        if pod and job_id:
            self.record_event(
                job_id,
                "WorkerReplaced",
                f"deleted pod {pod} of worker {worker.get('id')} ({why}); "
                "the pool starts a fresh pod, which joins as a spare",
                "Warning",
            )
        return pod

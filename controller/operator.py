"""`python -m controller.operator`: TrainingJob custom resources -> meshkeeper jobs (kopf).

create/resume  submit .spec to the controller (once: the job id is kept in status.jobID)
timer          mirror the job's status into .status (conditions, phase, restarts, step,
               lastCheckpoint) and post an Event on every phase change and recovery; and
               follow .spec.suspend (the field Kueue sets): suspend or resume the job
delete         cancel the job; a finalizer holds the object until then, and gives up after
               a bounded number of tries so that an unreachable controller never leaves the
               resource stuck

The operator talks to the controller only through services.client, and to Kubernetes only
through kopf (in-cluster service account, or kubeconfig outside a cluster).
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import sys
import time
from typing import Any

import kopf

from services.client import DEFAULT_URL, ApiError, Client
from services.tokens import TokenError, read_token

GROUP, VERSION, PLURAL = "meshkeeper.io", "v1alpha1", "trainingjobs"
FINALIZER = f"{GROUP}/cancel-job"
TERMINAL = ("Succeeded", "Failed", "Cancelled")
CANCEL_TRIES = 5  # then the finalizer goes anyway (with a Warning event)
RETRY_DELAY_S = 3.0

log = logging.getLogger("meshkeeper.operator")


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(
    type_: str,
    status: str,
    reason: str,
    message: str,
    generation: int | None,
    when: float | None = None,
) -> dict:
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": _iso(when if when is not None else time.time()),
        "observedGeneration": generation,
    }


def job_spec(name: str, spec: dict) -> dict:
    """The controller's job spec from a TrainingJob: name defaults to the object's name."""
    return {"name": name, **spec}


def status_from_job(job: Any, generation: int | None) -> dict:
    """A controller JobStatus (services.api) as TrainingJob .status fields."""
    ckpt = job.last_checkpoint
    return {
        "jobID": job.id,
        "phase": job.phase,
        "observedGeneration": generation,
        "meshGeneration": job.generation,
        "restarts": job.restarts,
        "step": job.step,
        "lastCheckpoint": (
            {"step": ckpt.step, "path": ckpt.path or "", "time": _iso(ckpt.time)} if ckpt else None
        ),
        "conditions": [
            _condition(c.type, c.status, c.reason, c.message, generation, c.lastTransitionTime)
            for c in job.conditions
        ],
    }


# --- handlers (sync: kopf runs them in its thread pool, and the client is sync httpx) ------


def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    # Handler progress in annotations, not in .status: the CRD's status schema is strict.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # The chart's RBAC is a namespaced Role: no cluster-wide scans of namespaces or CRDs
    # (the CRD is installed before the operator starts, and the namespaces are given).
    settings.scanning.disabled = True
    # Events are posted explicitly (kopf.event, which this level does not filter);
    # log lines stay logs.
    settings.posting.level = logging.WARNING


def submit(
    body: kopf.Body,
    meta: kopf.Meta,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    logger: logging.Logger,
    **_: Any,
) -> None:
    if status.get("jobID") or status.get("phase") in TERMINAL:
        return  # submitted before an operator restart (the timer follows it), or refused
    gen = meta.get("generation")
    spec = job_spec(body["spec"].get("name") or meta["name"], dict(body["spec"]))
    try:
        # the object's UID names the submission: an operator that died before it wrote
        # status.jobID gets the same job back instead of a second one
        job_id = memo.client.submit(spec, idempotency_key=meta.get("uid")).id
    except ApiError as e:
        if e.status == 422:  # the spec is wrong: say which field, never retry
            why = "; ".join(f"{p.field}: {p.message}" for p in e.problems) or str(e)
            patch.status.update(
                phase="Failed",
                observedGeneration=gen,
                conditions=[_condition("Admitted", "False", "InvalidSpec", why, gen)],
            )
            kopf.event(body, type="Warning", reason="InvalidSpec", message=why)
            return
        patch.status["conditions"] = [
            _condition("Admitted", "Unknown", "ControllerUnavailable", str(e), gen)
        ]
        raise kopf.TemporaryError(f"controller: {e}", delay=RETRY_DELAY_S) from e
    patch.status.update(
        jobID=job_id,
        phase="Pending",
        observedGeneration=gen,
        conditions=[
            _condition(
                "Admitted", "True", "Submitted", f"submitted to the controller as job {job_id}", gen
            )
        ],
    )
    kopf.event(
        body, type="Normal", reason="Submitted", message=f"job {job_id} submitted to the controller"
    )
    logger.info("submitted %s as job %s", meta["name"], job_id)


def mirror(
    body: kopf.Body,
    meta: kopf.Meta,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    job_id = status.get("jobID")
    if not job_id or meta.get("deletionTimestamp"):
        return
    gen = meta.get("generation")
    try:
        job = memo.client.job(job_id)
    except ApiError as e:
        if e.status == 404:  # Redis lost the job: say so, once
            patch.status.update(
                phase="Failed",
                conditions=[
                    _condition(
                        "Failed",
                        "True",
                        "JobLost",
                        f"the controller no longer knows job {job_id}",
                        gen,
                    )
                ],
            )
            kopf.event(
                body,
                type="Warning",
                reason="JobLost",
                message=f"the controller no longer knows job {job_id}",
            )
            return
        raise kopf.TemporaryError(f"controller: {e}", delay=RETRY_DELAY_S) from e
    follow_suspend(body, job, memo.client)
    new = status_from_job(job, gen)
    old = {k: status.get(k) for k in new}
    if new == old:
        return
    patch.status.update(new)
    if new["restarts"] > (old["restarts"] or 0):
        why = next((c["message"] for c in new["conditions"] if c["type"] == "Recovering"), "")
        kopf.event(
            body,
            type="Warning",
            reason="Recovering",
            message=f"restart {new['restarts']} (generation {new['meshGeneration']}): {why}".rstrip(
                ": "
            ),
        )
    if new["phase"] != old["phase"]:
        kind = "Warning" if new["phase"] in ("Failed", "Recovering") else "Normal"
        kopf.event(body, type=kind, reason=new["phase"], message=f"job {job_id} is {new['phase']}")


def follow_suspend(body: kopf.Body, job: Any, client: Client) -> None:
    """Bring the job to the object's `.spec.suspend`: the only field of a TrainingJob's spec
    that may change (a queue admits and evicts by it). A 409 means the job is there already
    (or ended): nothing to do."""
    want = bool(body["spec"].get("suspend", False))
    if job.phase in TERMINAL or want == job.suspend_requested:
        return
    try:
        (client.suspend if want else client.resume)(job.id)
    except ApiError as e:
        if e.status == 409:
            return
        raise kopf.TemporaryError(f"controller: {e}", delay=RETRY_DELAY_S) from e
    verb = "Suspending" if want else "Resuming"
    kopf.event(body, type="Normal", reason=verb, message=f"spec.suspend is {str(want).lower()}")


def cancel(
    status: kopf.Status,
    memo: kopf.Memo,
    body: kopf.Body,
    retry: int,
    logger: logging.Logger,
    **_: Any,
) -> None:
    job_id = status.get("jobID")
    if not job_id or status.get("phase") in TERMINAL:
        return
    try:
        memo.client.cancel(job_id)
    except ApiError as e:
        if e.status in (404, 409):  # gone, or already finished: nothing to cancel
            return
        if retry + 1 < CANCEL_TRIES:
            raise kopf.TemporaryError(f"cancel {job_id}: {e}", delay=RETRY_DELAY_S) from e
        logger.warning("giving up cancelling job %s after %d tries: %s", job_id, CANCEL_TRIES, e)
        kopf.event(
            body, type="Warning", reason="CancelFailed", message=f"job {job_id} may still run: {e}"
        )
        return
    logger.info("cancelled job %s", job_id)


def build_registry(
    poll_s: float = 2.0, login: Any = kopf.login_via_client
) -> kopf.OperatorRegistry:
    """Every handler on a fresh registry. The default login is the kubernetes client's:
    the in-cluster service account, else the kubeconfig."""
    registry = kopf.OperatorRegistry()
    on = dict(registry=registry)
    kopf.on.login(**on)(login)
    kopf.on.startup(**on)(configure)
    kopf.on.create(GROUP, VERSION, PLURAL, id="submit", **on)(submit)
    kopf.on.resume(GROUP, VERSION, PLURAL, id="submit-on-resume", **on)(submit)
    kopf.timer(
        GROUP,
        VERSION,
        PLURAL,
        id="mirror",
        interval=poll_s,
        sharp=True,
        when=lambda status, **_: status.get("phase") not in TERMINAL,
        **on,
    )(mirror)
    kopf.on.delete(GROUP, VERSION, PLURAL, id="cancel", **on)(cancel)
    return registry


def make_client(url: str, token: str | None) -> Client:
    """The operator's client: it submits and cancels, so its token needs the submitter or
    admin role."""
    return Client(url, token)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    ap = argparse.ArgumentParser(
        prog="python -m controller.operator", description="meshkeeper TrainingJob operator (kopf)"
    )
    ap.add_argument("--controller-url", default=env("MESHKEEPER_URL", DEFAULT_URL))
    where = ap.add_mutually_exclusive_group()
    where.add_argument(
        "--namespace",
        action="append",
        default=None,
        help="namespace to watch (repeatable; default $MESHKEEPER_NAMESPACE)",
    )
    where.add_argument(
        "--all-namespaces",
        action="store_true",
        help="watch every namespace (needs a ClusterRole; the chart grants a Role)",
    )
    ap.add_argument(
        "--liveness-port", type=int, default=8081, help="/healthz for the kubelet (0: none)"
    )
    ap.add_argument(
        "--poll-interval", type=float, default=2.0, help="status mirror period, seconds"
    )
    ap.add_argument("--log-level", default=env("MESHKEEPER_LOG_LEVEL", "info"))
    args = ap.parse_args(argv)
    if not args.all_namespaces and not args.namespace:
        if not env("MESHKEEPER_NAMESPACE"):
            ap.error("give --namespace NS (or set MESHKEEPER_NAMESPACE), or --all-namespaces")
        args.namespace = [env("MESHKEEPER_NAMESPACE")]
    if args.poll_interval <= 0:
        ap.error("--poll-interval must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.log_level.lower() != "debug":  # kopf logs every timer tick at INFO
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    try:  # the chart passes the admin token from its Secret
        token = read_token(var="MESHKEEPER_API_TOKEN")
    except TokenError as e:
        print(f"operator: {e}", file=sys.stderr)
        return 2
    if token is None:
        print(
            "operator: set MESHKEEPER_API_TOKEN (or MESHKEEPER_API_TOKEN_FILE) to a controller "
            "token with the submitter or admin role",
            file=sys.stderr,
        )
        return 2
    client = make_client(args.controller_url, token)
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    try:
        kopf.run(
            registry=build_registry(args.poll_interval),
            standalone=True,
            clusterwide=args.all_namespaces,
            namespaces=args.namespace or (),
            liveness_endpoint=liveness,
            memo=kopf.Memo(client=client),
        )
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

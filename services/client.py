"""Typed client of the controller's REST API (httpx). Every failure is an `ApiError` whose
message is one line a user can act on."""

from __future__ import annotations

import ssl
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from services import api

DEFAULT_URL = "http://127.0.0.1:8765"
M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    def __init__(
        self, message: str, status: int | None = None, problems: list[api.Problem] | None = None
    ):
        super().__init__(message)
        self.status, self.problems = status, problems or []


class Client:
    """`token`: the bearer token sent on every request (docs/security.md); None sends none,
    which only /healthz and /readyz accept. `verify`: for HTTPS, an SSL context that trusts
    the controller's certificate (default: the system CAs, or the file SSL_CERT_FILE names)."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        token: str | None = None,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        verify: ssl.SSLContext | bool = True,
    ):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(
            base_url=self.base_url,
            timeout=timeout,
            transport=transport,
            headers=headers,
            verify=verify,
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call(self, method: str, path: str, model: type[M], **kw: Any) -> M:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.ConnectError:
            raise ApiError(
                f"cannot reach the controller at {self.base_url}; is it running "
                "(meshkeeper up)? Set --url or MESHKEEPER_URL"
            ) from None
        except httpx.TimeoutException:
            raise ApiError(f"the controller at {self.base_url} did not answer in time") from None
        except httpx.HTTPError as e:
            raise ApiError(f"request to {self.base_url}{path} failed: {e}") from None
        if r.status_code >= 400:
            try:
                err = api.Error.model_validate(r.json())
            except (ValueError, ValidationError):
                raise ApiError(
                    f"HTTP {r.status_code} from {path}: {r.text[:200]}", r.status_code
                ) from None
            if r.status_code == 401 and "Authorization" not in self.http.headers:
                raise ApiError(f"{err.detail} (no token was sent)", r.status_code, err.problems)
            raise ApiError(err.detail, r.status_code, err.problems)
        try:
            return model.model_validate(r.json())
        except (ValueError, ValidationError) as e:
            raise ApiError(f"unexpected answer from {path}: {e}", r.status_code) from None

    def submit(self, spec: dict, idempotency_key: str | None = None) -> api.Submitted:
        """`idempotency_key`: a retry with the same key returns the job the first call made."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._call("POST", "/v1/jobs", api.Submitted, json=spec, headers=headers)

    def jobs(self, phase: str | None = None, limit: int = 100) -> list[api.JobSummary]:
        params = {"limit": limit, **({"phase": phase} if phase else {})}
        return self._call("GET", "/v1/jobs", api.JobList, params=params).jobs

    def job(self, job_id: str) -> api.JobStatus:
        return self._call("GET", f"/v1/jobs/{job_id}", api.JobStatus)

    def cancel(self, job_id: str) -> api.CancelAccepted:
        return self._call("DELETE", f"/v1/jobs/{job_id}", api.CancelAccepted)

    def suspend(self, job_id: str) -> api.SuspendAccepted:
        return self._call("POST", f"/v1/jobs/{job_id}/suspend", api.SuspendAccepted)

    def resume(self, job_id: str) -> api.SuspendAccepted:
        return self._call("POST", f"/v1/jobs/{job_id}/resume", api.SuspendAccepted)

    def events(self, job_id: str, after: str = "-", limit: int = 100) -> list[api.Event]:
        return self._call(
            "GET",
            f"/v1/jobs/{job_id}/events",
            api.EventList,
            params={"after": after, "limit": limit},
        ).events

    def logs(
        self, job_id: str, after: str = "-", limit: int = 100, rank: int | None = None, newest=False
    ) -> list[api.LogLine]:
        params = {"after": after, "limit": limit, "newest": newest}
        if rank is not None:
            params["rank"] = rank
        return self._call("GET", f"/v1/jobs/{job_id}/logs", api.LogList, params=params).lines

    def workers(self) -> list[api.Worker]:
        return self._call("GET", "/v1/workers", api.WorkerList).workers

    def ready(self) -> bool:
        try:
            self.http.get("/readyz").raise_for_status()
            return True
        except httpx.HTTPError:
            return False

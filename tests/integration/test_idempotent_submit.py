"""`POST /v1/jobs` with an Idempotency-Key (controller/jobs.py `submit`): a retry returns the
job the first submission made, per token owner; a malformed key is refused naming the header.
A real redis-server and controller, no agents."""

from __future__ import annotations

import httpx
import pytest

from services.client import Client
from tests.stack import ApiStack, tiny_spec


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    s = ApiStack(tmp_path_factory.mktemp("idem"))
    yield s
    s.close()


def post(api, token: str, key: str) -> httpx.Response:
    return httpx.post(
        f"{api.url}/v1/jobs",
        json=tiny_spec("idem"),
        headers={"Authorization": f"Bearer {token}", "Idempotency-Key": key},
        timeout=10,
    )


def test_a_retry_with_the_same_key_returns_the_first_job(api):
    first = post(api, api.secrets.submitter_token, "uid-1")
    again = post(api, api.secrets.submitter_token, "uid-1")
    assert (first.status_code, again.status_code) == (201, 200), (first.text, again.text)
    assert again.json()["id"] == first.json()["id"]
    with Client(api.url, api.secrets.admin_token) as c:
        assert [j.id for j in c.jobs() if j.name == "idem"] == [first.json()["id"]]


def test_keys_are_per_owner_and_per_key(api):
    mine = post(api, api.secrets.submitter_token, "uid-2").json()["id"]
    other_key = post(api, api.secrets.submitter_token, "uid-3").json()["id"]
    other_owner = post(api, api.secrets.admin_token, "uid-2").json()["id"]
    assert len({mine, other_key, other_owner}) == 3


def test_a_malformed_key_is_refused_naming_the_header(api):
    r = post(api, api.secrets.submitter_token, "no spaces allowed")
    assert r.status_code == 422
    assert r.json()["problems"][0]["field"] == "header.Idempotency-Key"

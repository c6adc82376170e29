"""Hostile HTTP input against a real controller process: a cross-site form post, deep JSON,
bodies past the limit (declared or streamed), malformed cursors, and the page's security
headers. Each gets its 4xx with the usual error document, never a 500 or a 503."""

from __future__ import annotations

import json
import re
import socket

import httpx
import pytest

from controller.app import MAX_BODY, MAX_DEPTH
from tests.stack import tiny_spec

JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def http(api) -> httpx.Client:
    with api.controller.client() as c:  # admin: every refusal below is about the input
        yield c.http


def refused(r: httpx.Response, status: int, words: str) -> dict:
    assert r.status_code == status, r.text
    doc = r.json()
    assert set(doc) == {"detail", "problems"} and words in doc["detail"], doc
    return doc


def test_a_cross_site_text_plain_post_gets_415(api, http):
    """What an HTML form on another site can send without a CORS preflight: text/plain (or a
    form encoding) carrying JSON. Even with a token it is refused, and no job appears."""
    body = json.dumps(tiny_spec("csrf"))
    before = len(http.get("/v1/jobs").json()["jobs"])
    for ctype in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ):
        r = http.post(
            "/v1/jobs",
            content=body,
            headers={"Content-Type": ctype, "Origin": "https://evil.example"},
        )
        doc = refused(r, 415, "Content-Type: application/json")
        assert doc["problems"][0]["field"] == "header.content-type"
    r = http.post("/v1/jobs", content=body, headers={"Content-Type": ""})
    refused(r, 415, "application/json")
    # the browser's form post carries no bearer token at all: refused before the body is read
    assert (
        httpx.post(
            api.url + "/v1/jobs", content=body, headers={"Content-Type": "text/plain"}
        ).status_code
        == 401
    )
    assert len(http.get("/v1/jobs").json()["jobs"]) == before


def test_json_with_a_charset_is_json(http):
    r = http.post(
        "/v1/jobs",
        content=json.dumps(tiny_spec("charset")).encode(),
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert r.status_code == 201, r.text
    assert http.delete(f"/v1/jobs/{r.json()['id']}").status_code == 202


def nest(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    "body",
    [
        nest(MAX_DEPTH + 1),
        nest(10_000),
        nest(200_000),
        '{"name": "deep", "model": ' + '{"a": ' * MAX_DEPTH + "1" + "}" * MAX_DEPTH + "}",
    ],
    ids=["limit+1", "10k", "200k", "in-a-spec"],
)
def test_nested_json_gets_422(http, body):
    """Past MAX_DEPTH, and far past the parser's own recursion limit (which used to be a 500)."""
    doc = refused(
        http.post("/v1/jobs", content=body, headers=JSON), 422, f"deeper than {MAX_DEPTH}"
    )
    assert doc["problems"][0]["field"] == "(body)"


def test_a_spec_at_the_depth_limit_is_judged_as_a_spec(http):
    shallow = {
        **tiny_spec("shallow"),
        "colour": json.loads("[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1)),
    }
    doc = refused(http.post("/v1/jobs", json=shallow), 422, "invalid job spec")
    assert [p["field"] for p in doc["problems"]] == ["colour"]


def headers_only(api, path: str, length: int, extra: str = "") -> bytes:
    """POST `path` promising `length` bytes of body and sending none: the answer, read until
    its JSON ends (or the connection closes; a socket timeout means no answer came)."""
    host, port = api.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"{extra}Content-Length: {length}\r\n\r\n".encode()
        )
        answer = b""
        while not answer.endswith(b"}") and (chunk := sock.recv(65536)):
            answer += chunk
    return answer


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/agents/join", "/v1/plan"])
def test_a_declared_oversized_body_is_refused_unread(api, path):
    """Only the headers are sent, with no token (50 MB promised): the answer comes without
    waiting for the promised bytes, on every route that takes a body."""
    answer = headers_only(api, path, 50 * MAX_BODY)
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert f"limit is {MAX_BODY}".encode() in answer


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/agents/join", "/v1/plan"])
def test_a_streamed_oversized_body_is_cut_off(http, path):
    """Chunked, with no Content-Length: the limit holds while the body streams in."""

    def chunks():
        for _ in range(4 * MAX_BODY // 65536):
            yield b" " * 65536

    refused(http.post(path, content=chunks(), headers=JSON), 413, "over the limit")


def test_an_unauthenticated_join_learns_nothing_of_the_schema(api):
    """The token is checked before the body is validated: 401, not 422 with the fields."""
    r = httpx.post(api.url + "/v1/agents/join", json={"id": "x"}, timeout=10)
    assert r.status_code == 401, r.text
    assert "devices" not in r.text and "memory_bytes" not in r.text, r.text


@pytest.fixture(scope="module")
def job(http) -> str:
    jid = http.post("/v1/jobs", json=tiny_spec("cursor")).json()["id"]
    yield jid
    http.delete(f"/v1/jobs/{jid}")


@pytest.mark.parametrize(
    "after", ["9" * 40 + "-0", "1-" + "9" * 21, "yesterday", "", "1-2-3", "-1-0", "１-0"]
)
def test_bad_event_cursors_get_422(http, job, after):
    doc = refused(
        http.get(f"/v1/jobs/{job}/events", params={"after": after}), 422, "is not an event id"
    )
    assert [p["field"] for p in doc["problems"]] == ["query.after"]


@pytest.mark.parametrize(
    "after",
    [
        f"{(1 << 64) - 1}-{(1 << 64) - 1}",
        "18446744073709551616-0",
        "99999999999999999999-99999999999999999999",
    ],
)
def test_cursors_past_the_last_possible_event_id_see_nothing(http, job, after):
    """Well-formed, but at or past 2^64-1 - 2^64-1, which Redis refuses as a bound (it was a
    503)."""
    assert http.get(f"/v1/jobs/{job}/events", params={"after": after}).json() == {"events": []}
    first = http.get(f"/v1/jobs/{job}/events").json()["events"][0]["id"]
    assert (
        http.get(f"/v1/jobs/{job}/events", params={"after": "0-0"}).json()["events"][0]["id"]
        == first
    )


def test_the_page_has_security_headers(api):
    for path in ("/ui/", "/ui/mesh.js"):
        h = httpx.get(api.url + path).headers
        csp = h["Content-Security-Policy"]
        assert (
            "default-src 'self'" in csp
            and "frame-ancestors 'none'" in csp
            and "unsafe-inline" not in csp
        )
        assert h["X-Content-Type-Options"] == "nosniff" and h["X-Frame-Options"] == "DENY"
    assert httpx.get(api.url + "/healthz").headers["X-Content-Type-Options"] == "nosniff"


@pytest.mark.parametrize("preset", [{}, [], ["tiny"], 7])
def test_a_preset_of_the_wrong_type_gets_422(http, preset):
    """Found by schemathesis: an unhashable preset was looked up in the preset table (a 500)."""
    doc = refused(
        http.post("/v1/jobs", json={**tiny_spec("preset"), "model": {"preset": preset}}),
        422,
        "invalid job spec",
    )
    assert "model.preset" in [p["field"] for p in doc["problems"]], doc


@pytest.mark.parametrize(
    ("section", "field"),
    [
        # `$` matched before a trailing newline: no call, not even admin's, could reach it after
        ({"name": "nl\n"}, "name"),
        ({"data": {"source": "text:/data/a\x00b"}}, "data.source"),  # a NUL gave a 500
        ({"checkpoint": {"root": "/ckpt/\x1b[2J"}}, "checkpoint.root"),
    ],
)
def test_names_and_paths_with_control_characters_get_422(http, section, field):
    doc = refused(http.post("/v1/jobs", json={**tiny_spec("ctl"), **section}), 422, "invalid")
    assert field in [p["field"] for p in doc["problems"]], doc


def test_the_api_docs_load_nothing_from_outside_the_controller(api):
    """Swagger UI at /docs takes its script, style and icon from the controller itself, and its
    CSP refuses any other origin; ReDoc, which only exists on a CDN, is gone."""
    page = httpx.get(api.url + "/docs")
    assert page.status_code == 200 and "swagger-ui" in page.text
    assets = re.findall(r'(?:src|href)=["\']([^"\']+)', page.text)
    assert assets and all(a.startswith("/docs/static/") for a in assets), assets
    for asset in assets:
        r = httpx.get(api.url + asset)
        assert r.status_code == 200 and len(r.content) > 0, asset
    csp = page.headers["Content-Security-Policy"]
    assert "default-src 'self'" in csp and "script-src 'self' 'unsafe-inline'" in csp
    assert "http" not in csp  # no origin but the controller's own
    assert httpx.get(api.url + "/redoc").status_code == 404
    assert httpx.get(api.url + "/openapi.json").json()["info"]["title"] == "meshkeeper controller"


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/agents/join", "/v1/plan"])
@pytest.mark.parametrize("token", [None, "not-a-token"])
def test_an_unauthenticated_body_is_refused_unread(api, path, token):
    """A body under the limit is promised and never sent: without a valid token the answer is
    401 from the headers alone, instead of the controller waiting for (and buffering) it."""
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    answer = headers_only(api, path, MAX_BODY // 2, auth)
    assert answer.startswith(b"HTTP/1.1 401"), answer
    assert b'www-authenticate: bearer realm="meshkeeper"' in answer.lower(), answer

"""TLS end to end with a self-signed certificate (docs/security.md, "TLS"): redis-server serving
only TLS (rediss://), a controller on HTTPS (uvicorn --tls-cert/--tls-key) talking rediss:// to
it, and an agent that joins over HTTPS (--ca-file) and then beats over rediss:// with the URL
the join gave it. Plaintext and unverified connections are refused. Real openssl, real
redis-server, real processes."""

from __future__ import annotations

import ssl

import httpx
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.client import Client
from services.procs import free_port, stop_all
from tests.stack import (
    Proc,
    RedisServer,
    TestSecrets,
    agent_argv,
    controller_argv,
    self_signed_cert,
    wait_until,
)


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    work = tmp_path_factory.mktemp("tls")
    cert, key = self_signed_cert(work)
    secrets = TestSecrets.create(work / "secrets")
    server = RedisServer(work / "redis", secrets, tls=(cert, key))
    server.start()
    port = free_port()
    ctl = Proc(
        "controller",
        controller_argv(
            port,
            server,
            secrets.auth_file.parent,
            *("--auth-file", str(secrets.auth_file), "--tls-cert", str(cert)),
            *("--tls-key", str(key)),
        ),
        work / "logs",
    )
    url = f"https://127.0.0.1:{port}"
    trust = ssl.create_default_context(cafile=str(cert))
    client = Client(url, secrets.admin_token, timeout=5, verify=trust)
    wait_until(lambda: client.ready() or not ctl.alive(), 30, "the HTTPS controller to be ready")
    assert ctl.alive(), ctl.tail()
    yield work, cert, server, url, client, secrets
    client.close()
    stop_all([ctl.p], 5)
    server.proc.stop(5)


def test_redis_over_tls_refuses_plaintext_and_unverified_clients(tls):
    _, _, server, _, _, _ = tls
    assert server.url.startswith("rediss://admin:")
    assert redis.Redis.from_url(server.url).ping()
    plain = server.url.replace("rediss://", "redis://").split("?")[0]
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(plain, socket_timeout=2, retry=Retry(NoBackoff(), 0)).ping()
    unverified = server.url.split("?")[0]  # no CA: the self-signed certificate is not trusted
    with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        redis.Redis.from_url(unverified, retry=Retry(NoBackoff(), 0)).ping()


def test_an_agent_joins_over_https_and_beats_over_rediss(tls):
    work, cert, server, url, client, secrets = tls
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(url + "/healthz", timeout=5)  # a client that does not trust the certificate
    agent = Proc(
        "agent-t1",
        [*agent_argv(url, secrets, "t1", work), "--warm", "0", "--ca-file", str(cert)],
        work / "logs",
    )
    try:
        wait_until(
            lambda: any(w.id == "t1" and w.alive for w in client.workers()),
            60,
            "agent t1 to join over HTTPS and beat over rediss://",
        )
        assert "joined https://127.0.0.1" in agent.tail()
        info = redis.Redis.from_url(server.url, decode_responses=True).client_list()
        assert any(c["user"] == "agent-t1" for c in info), (
            info
        )  # it holds a TLS connection of its own
    finally:
        agent.stop(10)

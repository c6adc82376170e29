"""Which host an agent says it is on (`--host-name`): on Kubernetes the node, not the pod,
so placement keeps a TP group on one node and buddy copies on another."""

from __future__ import annotations

import socket

import pytest

from worker.__main__ import parse_args


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, socket.gethostname()),
        ({"MESHKEEPER_NODE_NAME": "gpu-node-7"}, "gpu-node-7"),  # the chart's downward API
        ({"MESHKEEPER_NODE_NAME": "gpu-node-7", "MESHKEEPER_HOST_NAME": "rack3-n7"}, "rack3-n7"),
    ],
)
def test_the_host_is_the_node_on_kubernetes(monkeypatch, env, want):
    for var in ("MESHKEEPER_NODE_NAME", "MESHKEEPER_HOST_NAME"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert parse_args(["--insecure-direct-redis", "redis://127.0.0.1:1/0"]).host_name == want

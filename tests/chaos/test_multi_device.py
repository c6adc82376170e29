"""One agent per node, holding several ranks (`--devices 4`), as on a GPU node: a killed
trainer restarts its ranks in place and every rank restores from host memory
(docs/architecture.md, "Failure handling"); a lost node's ranks move whole to another node
and restore from the copies their buddies hold on the surviving one. The nodes of the
two-node test are hosts with a network of their own too (tests/netns.py): every byte between
them crosses a bridge, none a shared loopback."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

import pytest

from services.assignment import Assignment
from tests.chaos.chaos import (
    assert_curve,
    at_step,
    completed,
    gone,
    kill,
    mesh_spec,
    metrics_path,
    rank,
    start,
    succeeded,
    wait_record,
)
from tests.chaos.test_chaos import KILL_AT
from tests.stack import Stack, wait_until

pytestmark = pytest.mark.slow

DEVICES = 4
# 8 trainers beside three agents and their zygotes on a shared 2-core machine: generous waits
WAIT_S = 300


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """One agent holding 4 ranks: a dp2 x tp2 job fills it, and no other worker has room."""
    s = Stack(tmp_path_factory.mktemp("node"), workers=1, devices=DEVICES)
    yield s
    s.close()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Three 4-rank agents, each a host of its own with memory and a network namespace of its
    own (its agent's --address is its address there): a dp2 x pp2 x tp2 job fills two, one
    replica each, and the third is its spare."""
    s = Stack(tmp_path_factory.mktemp("nodes"), workers=3, devices=DEVICES, hosts=True, netns=True)
    yield s
    s.close()


def killed_in_place(stack: Stack, w, j1, victim: int):
    """SIGKILL rank `victim`'s trainer mid-run; the job once that recovery completed: a
    `restart` with no worker moved or quarantined, every rank (the killed one too: its
    snapshot outlives its process) restored from its own host memory, at most one step
    redone."""
    wait_record(metrics_path(stack, j1, victim), at_step(KILL_AT), WAIT_S, f"rank {victim} trains")
    killed = rank(j1, victim)
    kill(killed.pid)
    j = w.until(
        lambda j: j.recoveries and j.recoveries[0].completed_at is not None,
        WAIT_S,
        "the recovery from the kill to complete",
    )
    rec = j.recoveries[0]
    assert (rec.cause, rec.action) == ("TrainerKilled", "restart"), rec
    assert [(f.rank, f.worker) for f in rec.faults] == [(victim, killed.worker)], rec.faults
    assert rec.replaced == [] and not rec.quarantined, rec
    completed(rec)
    world = len(j1.mesh.ranks)
    assert rec.restored_from == {str(r): "memory" for r in range(world)}, rec
    assert {(r.rank, r.worker) for r in j.mesh.ranks} == {(r.rank, r.worker) for r in j1.mesh.ranks}
    # the job's store, which rank 0's agent hosts, served the new generation too
    assert (j.mesh.generation, j.mesh.rendezvous) == (j1.mesh.generation + 1, j1.mesh.rendezvous)
    assert gone(killed.pid)
    return j


def listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def test_killed_rank_on_a_one_node_job_restarts_in_place_from_memory(node, uninterrupted):
    spec = mesh_spec("node-kill", parallel={"dp": 2, "tp": 2}, spares=0)
    want = uninterrupted(spec)
    w, j1 = start(node, spec)
    # rank 0: before the job's store, its trainer hosted the rendezvous, which went with it
    killed_in_place(node, w, j1, victim=0)
    j = w.finish()
    succeeded(node, j)
    host, port = j.mesh.rendezvous.split(":")
    wait_until(lambda: not listening(host, int(port)), 30, "the job's store to stop with the job")
    assert len(j.recoveries) == 1, j.recoveries
    assert_curve(node, j, want, exact=True)


def test_two_node_job_restarts_a_killed_rank_in_place_and_restores_a_lost_node_from_the_other(
    nodes, uninterrupted
):
    """dp2 x pp2 x tp2, one replica per node, each node a network namespace of its own: a
    killed trainer restarts in place; then the whole node of replica 1 dies, its four ranks
    move together to the spare node, and each restores from the copy its buddy on replica 0's
    node holds (sent over the network between the namespaces: no node reads another's memory).
    The loss curve is an uninterrupted run's, bit for bit."""
    net = nodes.net

    def joined() -> dict | None:
        live = {w.id: w for w in nodes.client.workers() if w.alive}
        return live if len(live) == len(nodes.agents) else None

    workers = wait_until(joined, WAIT_S, "the three agents to join")
    assert {w: (workers[w].host, workers[w].address) for w in workers} == {
        w: (f"host-{w}", a) for w, a in nodes.addresses.items()
    }, workers
    assert set(nodes.addresses.values()) == set(net.addresses()), net.hosts
    assert all(ipaddress.ip_address(a) in net.subnet for a in net.addresses()), net.hosts
    spec = mesh_spec("nodes", steps=20, parallel={"dp": 2, "pp": 2, "tp": 2, "microbatches": 2})
    want = uninterrupted(spec)
    w, j1 = start(nodes, spec)
    lost = rank(j1, 4).worker
    kept = rank(j1, 0).worker
    on_lost = sorted(r.rank for r in j1.mesh.ranks if r.worker == lost)
    assert on_lost == [4, 5, 6, 7], j1.mesh.ranks
    spare = j1.mesh.spares[0]
    crosses_the_bridge(nodes, j1, kept, lost)
    buddies_on_the_other_host(nodes, j1.id, 1)
    j2 = killed_in_place(nodes, w, j1, victim=5)
    held = wait_record(
        metrics_path(nodes, j2, 0),
        lambda r: r.get("event") == "snapshot" and "4" in r.get("held", {}),
        WAIT_S,
        "rank 0 to hold a copy of rank 4 in generation 2",
    )
    assert held["held_via"] == {"4": "network"}, held
    buddies_on_the_other_host(nodes, j2.id, 2)
    nodes.kill_host(lost)
    j = w.finish(timeout=2 * WAIT_S)
    succeeded(nodes, j)
    assert [(r.cause, r.action) for r in j.recoveries] == [
        ("TrainerKilled", "restart"),
        ("WorkerDead", "replace"),
    ], j.recoveries
    rec = j.recoveries[1]
    assert rec.replaced == [{"old": lost, "new": spare}], rec
    completed(rec)
    assert rec.restored_from == {str(r): "peer" if r in on_lost else "memory" for r in range(8)}
    g3 = buddies_on_the_other_host(nodes, j.id, 3)
    # each moved rank restored from the worker that held its copy: its buddy of generation 2,
    # on the surviving host; the others from their own
    assert g3.restore_generation == 2, g3
    assert g3.restore_sources == {r: r - 4 if r in on_lost else r for r in range(8)}, g3
    assert {r.worker for r in j.mesh.ranks} == {kept, spare}, j.mesh.ranks
    assert j.mesh.rendezvous.rpartition(":")[0] == nodes.addresses[kept], j.mesh
    assert_curve(nodes, j, want, exact=True)


def crosses_the_bridge(stack: Stack, j, kept: str, lost: str) -> None:
    """The job's traffic runs between the hosts' network namespaces: the rendezvous is rank
    0's host address, each trainer runs in its host's namespace (the two hosts' differ, and
    differ from this one's), rank 0's host has TCP connections open to the other host's
    address (gloo's), and each agent reaches Redis from its own address."""
    addr = stack.addresses
    assert j.mesh.rendezvous.rpartition(":")[0] == addr[kept], j.mesh
    ns = {r.rank: os.readlink(f"/proc/{r.pid}/ns/net") for r in j.mesh.ranks}
    for r in j.mesh.ranks:
        assert ns[r.rank] == os.readlink(f"/proc/{stack.agents[r.worker].pid}/ns/net"), r
    assert len({ns[0], ns[4]} - {os.readlink("/proc/self/ns/net")}) == 2, ns
    peers = established_peers(rank(j, 0).pid)
    assert addr[lost] in peers, (peers, addr)
    clients = {c["addr"].rpartition(":")[0] for c in stack.store.r.client_list()}
    assert set(addr.values()) <= clients, (clients, addr)


def buddies_on_the_other_host(stack: Stack, jid: str, generation: int) -> Assignment:
    """The job's assignment of `generation` (its current one); every rank's buddy, the rank
    that holds its snapshot copy, runs on another host than the rank itself."""
    asg = Assignment.from_fields(stack.store.job_assignment(jid))
    assert asg is not None and asg.generation == generation, asg
    host = {w.id: w.host for w in stack.client.workers()}
    on = {r.rank: host[r.wid] for r in asg.ranks}
    assert sorted(asg.buddies) == list(range(8)), asg.buddies
    assert all(on[r] != on[b] for r, b in asg.buddies.items()), (asg.buddies, on)
    return asg


def established_peers(pid: int) -> set[str]:
    """The remote addresses of every established TCP connection in `pid`'s network namespace
    (its /proc/PID/net/tcp and tcp6: the namespace's tables, not this one's)."""
    peers = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            remote, state = line.split()[2:4]
            if state != "01":  # TCP_ESTABLISHED
                continue
            raw = bytes.fromhex(remote.split(":")[0])
            # the kernel prints each 32-bit word in host (little-endian) order
            ip = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            a = ipaddress.ip_address(ip)
            peers.add(str(a.ipv4_mapped or a) if a.version == 6 else str(a))
    return peers

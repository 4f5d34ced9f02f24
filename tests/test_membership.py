"""Membership on a real DHT: a backbone, volunteers and observers as real processes with real p2pd."""

import asyncio
import json
import random
import signal
import time

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTID, DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import P2P
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from run_observer import RunObserver
from commands import ravnest
from ravnest_swarm.membership.announcer import PeerAnnouncer
from ravnest_swarm.membership.capabilities import Capabilities
from ravnest_swarm.membership.reader import read_peers
from ravnest_swarm.membership.records import make_validators, peers_key, start_peer_node
from ravnest_swarm.net.node import parse_maddrs, peer_id_of, start_node, stop_node

RUN = "test-run"
VOLUNTEERS = {
    "alice": {"--ram-gb": "8", "--gflops": "50", "--bandwidth-mbps": "100"},
    "bob": {"--ram-gb": "16", "--gflops": "120", "--bandwidth-mbps": "40"},
    # carol measures its bandwidth for real, over P2P to the backbone's probe handler
    "carol": {"--ram-gb": "2.5", "--gflops": "7"},
}


def join_args(maddr, name, overrides, heartbeat=1.0):
    args = ["join", "--initial-peers", maddr, "--run", RUN, "--name", name, "--no-dashboard",
            "--heartbeat", str(heartbeat), "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    for flag, value in overrides.items():
        args += [flag, value]
    return args


def status_json(maddr, run=RUN):
    result = ravnest("status", "--initial-peers", maddr, "--run", run, "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def observer(backbone):
    watcher = RunObserver(backbone, RUN)
    try:
        yield watcher
    finally:
        watcher.close()


@pytest.mark.timeout(150)
def test_three_volunteers_with_their_capabilities_are_read_back_by_status(processes, backbone):
    for name, overrides in VOLUNTEERS.items():
        processes.start(join_args(backbone, name, overrides), name)
    for process in processes.processes[1:]:
        process.wait_for_output(r"sees 3 peer", 90, stream="stderr")
        # its first line comes after its first read, which holds at least its own record: a joiner said "sees 0
        # peer(s)" before that read while the run's peers were live
        assert "sees 0 peer(s)" not in process.stderr(), process.stderr()

    document = status_json(backbone)
    assert document["run"] == RUN
    by_name = {peer["name"]: peer for peer in document["peers"]}
    assert sorted(by_name) == ["alice", "bob", "carol"]
    for name, overrides in VOLUNTEERS.items():
        peer = by_name[name]
        assert peer["state"] == "standby"
        assert peer["ram_gb"] == float(overrides["--ram-gb"])
        assert peer["gflops"] == float(overrides["--gflops"])
        assert peer["reachability"] == "direct"  # the backbone dialled each of them back on 127.0.0.1
        assert peer["peer_id"].startswith("12D3") or peer["peer_id"].startswith("Qm")
    assert by_name["alice"]["bandwidth_mbps"] == 100.0 and by_name["bob"]["bandwidth_mbps"] == 40.0
    assert by_name["carol"]["bandwidth_mbps"] > 1.0  # measured over P2P, not overridden


@pytest.mark.timeout(120)
def test_sigkilled_volunteer_vanishes_within_three_heartbeats(processes, backbone, observer):
    heartbeat = 2.0
    volunteer = processes.start(join_args(backbone, "doomed", VOLUNTEERS["alice"], heartbeat), "doomed")
    observer.wait_for(lambda peers: "doomed" in peers, 60)
    killed_at = time.monotonic()
    volunteer.kill_group()
    observer.wait_for(lambda peers: "doomed" not in peers, 3 * heartbeat + 2)
    assert time.monotonic() - killed_at <= 3 * heartbeat + 2  # the poll itself takes part of the margin


@pytest.mark.timeout(120)
def test_graceful_stop_shows_leaving_then_exits_zero(processes, backbone, observer):
    heartbeat = 2.0
    volunteer = processes.start(join_args(backbone, "polite", VOLUNTEERS["bob"], heartbeat), "polite")
    observer.wait_for(lambda peers: peers.get("polite", {}).get("state") == "standby", 60)
    volunteer.signal(signal.SIGTERM)
    observer.wait_for(lambda peers: peers.get("polite", {}).get("state") == "leaving", 10, period=0.1)
    assert volunteer.wait(30) == 0
    observer.wait_for(lambda peers: "polite" not in peers, 3 * heartbeat + 2)


@pytest.mark.timeout(150)
def test_a_peer_restarted_with_its_identity_is_one_peer_again_and_its_leaving_removes_it_at_once(
        processes, backbone, observer, tmp_path):
    heartbeat = 2.0
    args = join_args(backbone, "phoenix", VOLUNTEERS["alice"], heartbeat) + ["--identity", str(tmp_path / "id.key")]
    first = processes.start(args, "phoenix")
    before = observer.wait_for(lambda peers: peers.get("phoenix", {}).get("state") == "standby", 60)["phoenix"]
    first.kill_group()  # no leaving: its record stays until it expires
    killed_at = time.time()  # records' time is the writer's clock, this machine's: nothing of the first comes later
    second = processes.start(args, "phoenix-again")
    # back with the same identity, under a new record key (a new process): one peer, shown by its newest record
    after = observer.wait_for(lambda peers: peers.get("phoenix", {}).get("time", 0) > killed_at, 60,
                              "the restarted peer's record")["phoenix"]
    assert after["peer_id"] == before["peer_id"]
    assert [p["peer_id"] for p in observer.call(read_peers(observer.node, RUN))].count(before["peer_id"]) == 1
    observer.wait_for(lambda peers: peers["phoenix"]["state"] == "standby", 30)
    second.signal(signal.SIGTERM)
    observer.wait_for(lambda peers: peers.get("phoenix", {}).get("state") == "leaving", 10, period=0.1)
    assert second.wait(30) == 0
    observer.wait_for(lambda peers: "phoenix" not in peers, 3 * heartbeat + 2)


async def _attack(maddr, victim_subkey, honest_value):
    """Write straight into the DHT as a non-project client: one forged record and several malformed ones.

    The attacker signs with an RSA key of its own (so signatures are well formed) but has no schema.
    Returns what each store call reported: True only if some node accepted the record.
    """
    attacker_signature = RSASignatureValidator(RSAPrivateKey())
    attacker = await start_node(parse_maddrs([maddr]), record_validators=[attacker_signature], client_mode=True)
    expiration = get_dht_time() + 30
    key = peers_key(RUN)
    outcomes = {
        # another peer's subkey: the attacker cannot produce the owner's signature
        "forged": await attacker.store(key, dict(honest_value, name="mallory", ram_gb=4000.0), expiration,
                                       subkey=victim_subkey),
    }
    malformed = {
        "wrong_type": dict(honest_value, ram_gb="lots"),
        "out_of_range": dict(honest_value, ram_gb=-5.0),
        "nan": dict(honest_value, gflops=float("nan")),
        "huge_name": dict(honest_value, name="x" * 10_000),
        "missing_field": {k: v for k, v in honest_value.items() if k != "peer_id"},
        "not_a_dict": [1, 2, 3],
        "raw_bytes": b"\x00\xff garbage",
    }
    for label, value in malformed.items():
        outcomes[label] = await attacker.store(key, value, expiration, subkey=attacker_signature.local_public_key)
    # a valid-looking record in a subkey without any public key: unsigned, so the schema refuses it
    outcomes["unsigned_subkey"] = await attacker.store(key, dict(honest_value, name="anon"), expiration,
                                                       subkey=b"anonymous")
    await stop_node(attacker)
    return outcomes


@pytest.mark.timeout(150)
def test_forged_and_malformed_records_are_refused_while_honest_records_stay(processes):
    backbone = processes.start(["backbone", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run", RUN], "backbone")
    maddr = backbone.maddrs()[0]
    processes.start(join_args(maddr, "honest", VOLUNTEERS["alice"], heartbeat=2.0), "honest")
    observer = RunObserver(maddr, RUN)
    try:
        observer.wait_for(lambda peers: "honest" in peers, 60)
        found = observer.call(observer.node.get(peers_key(RUN), latest=True))
        [(victim_subkey, item)] = list(found.value.items())
        honest_value = dict(item.value)

        outcomes = observer.call(_attack(maddr, victim_subkey, honest_value))
        assert not any(outcomes.values()), f"an honest node accepted an attacker's record: {outcomes}"

        time.sleep(1.0)
        peers = observer.peers()
        assert list(peers) == ["honest"]
        assert peers["honest"]["ram_gb"] == 8.0 and peers["honest"]["peer_id"] == honest_value["peer_id"]
    finally:
        observer.close()
    document = status_json(maddr)
    assert [(p["name"], p["ram_gb"]) for p in document["peers"]] == [("honest", 8.0)]


@pytest.mark.timeout(120)
def test_a_record_outlives_every_volunteer_nearest_its_key(backbone):
    """hivemind keeps a record only on the nodes nearest its key. Six DHT nodes are placed nearer to
    ``{run}_peers`` than the backbone, a volunteer publishes its record, then all of them leave: the
    backbone, which got a copy of its own, still serves the record until it expires."""
    key_id = DHTID.generate(source=peers_key(RUN))

    async def publish_then_leave():
        volunteer = await start_peer_node(parse_maddrs([backbone]), RUN, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        holders = []
        try:
            backbone_id = volunteer.protocol.routing_table.get(peer_id=peer_id_of(parse_maddrs([backbone])[0]))
            backbone_distance = key_id.xor_distance(backbone_id)
            for offset in {random.randrange(backbone_distance) for _ in range(6)}:
                p2p = await P2P.create(initial_peers=[backbone], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
                holders.append(await DHTNode.create(p2p=p2p, node_id=DHTID(key_id ^ offset), initial_peers=[backbone],
                                                    record_validator=CompositeValidator(make_validators(RUN))))
            announcer = PeerAnnouncer(volunteer, RUN, "lasting", Capabilities(ram_gb=3.0, gflops=9.0,
                                                                            bandwidth_mbps=50.0))
            assert await announcer.publish(lifetime=60)
            # the record went to the nearest nodes, none of which is the backbone
            assert sum(bool(holder.protocol.storage.get(key_id)) for holder in holders) >= 4
        finally:
            for node in [*holders, volunteer]:
                await stop_node(node)

    asyncio.run(publish_then_leave())
    reader = RunObserver(backbone, RUN)
    try:
        assert list(reader.peers()) == ["lasting"]
    finally:
        reader.close()

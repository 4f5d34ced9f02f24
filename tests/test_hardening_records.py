"""Hostile DHT clients: forged and malformed records for every key of a run, written straight into the DHT.

The attacker is a plain hivemind client with a signature validator of its own (well-formed signatures,
its own RSA key) and no schema, so nothing on its side stops what it writes. Honest nodes run the
run's validators (``records.make_validators``); the readers the project uses (``status``, the
planner's round reads, the pipeline's endpoint resolution, the run spec) must never see its values.
"""

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import asdict
from types import SimpleNamespace

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from ravnest_swarm.membership.announcer import PeerAnnouncer
from ravnest_swarm.membership.capabilities import Capabilities
from ravnest_swarm.membership.reader import read_adopted_plan, read_peers
from ravnest_swarm.membership.records import (PeerRecord, PlanRecord, RoundProposal, RunAddress, StageEndpoint,
                                              make_validators, peers_key, plan_key, plan_subkey_prefix, round_key, spec_key,
                                              stage_subkey_prefix, stages_key)
from ravnest_swarm.pipeline.endpoints import read_endpoints
from ravnest_swarm.planning.round import PlanningRounds
from ravnest_swarm.membership.owner import fingerprint
from ravnest_swarm.swarm.spec import RunSpec, read_spec
from ravnest_swarm.net.identity import open_identity
from ravnest_swarm.net.node import start_node, stop_node

RUN = "hardening"
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
NOW = time.time()
HONEST = open_identity(None)  # the honest writer: its p2pd and its records under one key
HONEST_ID = HONEST.peer_id
PEER = PeerRecord(peer_id=HONEST_ID, name="honest", state="training", ram_gb=8.0, bandwidth_mbps=100.0,
                  gflops=50.0, reachability="direct", maddrs=[], version="0.1.0", time=NOW, cluster=0, stage=0,
                  layers=[0, 2], step=10, plan_round=1).dict()
STAGE = StageEndpoint(peer_id=HONEST_ID, maddrs=[], model="mlp-digits", layers=[0, 2], version=3,
                      time=NOW).dict()
PROPOSAL = RoundProposal(round=1, deadline=get_dht_time() + 600, peer_id=HONEST_ID, ram_gb=8.0, gflops=50.0,
                         bandwidth_mbps=100.0, fitness=2.0, clusters=[[HONEST_ID]], time=NOW).dict()
PLAN = PlanRecord(round=1, time=NOW, clusters=[[dict(peer_id=HONEST_ID, layers=[0, 2])]]).dict()
OWNER = RSAPrivateKey()  # the run owner's key: only specs it signed count
OWNER_FINGERPRINT = fingerprint(OWNER.get_public_key().to_bytes())
SPEC = RunSpec("mlp-digits", microbatch_size=16, max_in_flight=4, averaging_period=10).record(OWNER, RUN)
# a well-formed spec signed by a stranger, created earlier (the old rule, "earliest created wins", made it the run's)
HIJACK = dict(RunSpec("mlp-digits", lr=9.0).record(RSAPrivateKey(), RUN), created=NOW - 3600)
HUGE = "x" * 100_000
GARBAGE = b"\x00\xff raw bytes, not a record"


OWN, OWN_STAGE, OWN_PLAN, NO_SUBKEY = "own", "own stage", "own plan", "none"  # the attacker's signed subkeys, or none


def nested_tuples(depth):
    value = 0
    for _ in range(depth):
        value = (value,)
    return value


def malformed_values():
    """(key, subkey, value, label) for every key of the run; bytes and ints are literal subkeys."""
    return [
        (peers_key(RUN), OWN, dict(PEER, ram_gb="lots"), "peers: wrong type"),
        (peers_key(RUN), OWN, dict(PEER, ram_gb=1e9), "peers: out of range"),
        (peers_key(RUN), OWN, dict(PEER, gflops=float("nan")), "peers: NaN"),
        (peers_key(RUN), OWN, dict(PEER, loss=float("inf")), "peers: Inf"),
        (peers_key(RUN), OWN, dict(PEER, name=HUGE), "peers: huge string"),
        (peers_key(RUN), OWN, dict(PEER, name="clear\x1b[2Jscreen"), "peers: terminal escape in the name"),
        (peers_key(RUN), OWN, dict(PEER, name="two\nlines"), "peers: newline in the name"),
        (peers_key(RUN), OWN, dict(PEER, maddrs=["/ip4/1.2.3.4"] * 1000), "peers: huge list"),
        (peers_key(RUN), OWN, dict(PEER, step=2**60), "peers: huge int"),
        (peers_key(RUN), OWN, [1, 2, 3], "peers: not a dict"),
        (peers_key(RUN), OWN, dict(PEER, maddrs=["/ip4/1.2.3.4/tcp/x"]), "peers: an address that is no multiaddr"),
        # 1 KB that overflowed the C stack of the node decoding it (SIGSEGV): net/serializer.py
        (peers_key(RUN), OWN, nested_tuples(300), "peers: tuples nested 300 deep"),
        (peers_key(RUN), OWN, GARBAGE, "peers: raw bytes"),
        (peers_key(RUN), b"anonymous", PEER, "peers: unsigned subkey"),
        # the honest peer's record copied under the attacker's own key, newer and leaving: it names a peer that is
        # not its writer (records are bound to their writer's identity, membership/identity.py)
        (peers_key(RUN), OWN, dict(PEER, state="leaving", time=NOW + 60), "peers: the honest peer's, leaving"),
        (peers_key(RUN), OWN, dict(PEER, state="standby", time=NOW + 60), "peers: the honest peer's, standby"),
        (stages_key(RUN, 0), OWN_STAGE, dict(STAGE, maddrs=["/ip4/6.6.6.6/tcp/1"]), "stages: the honest peer's"),
        (round_key(RUN), OWN, dict(PROPOSAL, fitness=1e11), "round: the honest peer's"),
        (stages_key(RUN, 0), OWN_STAGE, dict(STAGE, layers=[0, 1, 2]), "stages: wrong shape"),
        (stages_key(RUN, 0), OWN_STAGE, dict(STAGE, time=float("nan")), "stages: NaN"),
        (stages_key(RUN, 0), OWN_STAGE, dict(STAGE, model=HUGE), "stages: huge string"),
        (stages_key(RUN, 0), OWN_STAGE, dict(STAGE, maddrs=["/garbage"]), "stages: an address that is no multiaddr"),
        (stages_key(RUN, 0), OWN_STAGE, GARBAGE, "stages: raw bytes"),
        (stages_key(RUN, 0), b"0.0", STAGE, "stages: unsigned subkey"),
        (round_key(RUN), OWN, dict(PROPOSAL, fitness=float("inf")), "round: Inf"),
        (round_key(RUN), OWN, dict(PROPOSAL, fitness=-1.0), "round: out of range"),
        (round_key(RUN), OWN, dict(PROPOSAL, clusters=[["p"]] * 1000), "round: huge list"),
        (round_key(RUN), OWN, dict(PROPOSAL, clusters=[["p"] * 64] * 5), "round: more peers than a round has"),
        (round_key(RUN), OWN, dict(PROPOSAL, deadline=1e11), "round: a deadline ages away"),
        (round_key(RUN), OWN, "a proposal", "round: not a dict"),
        (plan_key(RUN), b"1.", PLAN, "plan: unsigned subkey"),
        (plan_key(RUN), OWN_PLAN, dict(PLAN, round="2"), "plan: wrong type"),
        (plan_key(RUN), OWN_PLAN, dict(PLAN, time=float("nan")), "plan: NaN"),
        (plan_key(RUN), OWN_PLAN, dict(PLAN, clusters=[[dict(peer_id="p", layers=[0, 1])] * 64] * 100), "plan: oversize"),
        (plan_key(RUN), OWN_PLAN, dict(PLAN, clusters=[[dict(peer_id="p", layers=[0, 1])] * 64] * 5),
         "plan: more stages than a round places"),
        (plan_key(RUN), OWN_PLAN, dict(PLAN, clusters=[[dict(peer_id="p", layers=[-1, 1])]]), "plan: negative layer"),
        (plan_key(RUN), OWN_PLAN, dict(PLAN, clusters=[[dict(peer_id="id\u202egnol", layers=[0, 1])]]), "plan: bidi override"),
        (plan_key(RUN), OWN_PLAN, GARBAGE, "plan: raw bytes"),
        (spec_key(RUN), NO_SUBKEY, dict(SPEC, lr=float("nan")), "spec: NaN"),
        (spec_key(RUN), NO_SUBKEY, dict(SPEC, optimizer="pickle"), "spec: unknown optimizer"),
        (spec_key(RUN), NO_SUBKEY, dict(SPEC, pipeline_compression="quantile8"), "spec: unknown compression"),
        (spec_key(RUN), NO_SUBKEY, dict(SPEC, model=HUGE), "spec: huge string"),
        (spec_key(RUN), NO_SUBKEY, [SPEC], "spec: not a dict"),
        (spec_key(RUN), OWN, dict(SPEC, lr=9.0), "spec: the owner's, altered"),
        (spec_key(RUN), OWN, HIJACK, "spec: a stranger's, created earlier"),
        (spec_key(RUN), OWN, dict(HIJACK, owner=SPEC["owner"]), "spec: a stranger's, naming the owner"),
        (spec_key(RUN), NO_SUBKEY, GARBAGE, "spec: raw bytes"),
    ]


async def write_as_attacker(attacker, signature, victim_subkeys):
    """Every malformed value, then a well-formed value under each honest writer's own signed subkey.

    Returns label -> whether any node reported storing it.
    """
    expiration = get_dht_time() + 300  # later than the honest records': it would win if it were stored

    async def attacker_store(*args, **kwargs):
        # what the other nodes said: hivemind also stores on the writer itself (a client too, validating nothing
        # here), and that True stood whenever the storage node's reply came late on a loaded machine
        return await attacker.store(*args, exclude_self=True, **kwargs)
    own = signature.local_public_key
    outcomes = {}
    for key, subkey, value, label in malformed_values():
        if subkey == NO_SUBKEY:
            outcomes[label] = await attacker_store(key, value, expiration)
            continue
        subkey = {OWN: own, OWN_STAGE: stage_subkey_prefix(0, 0) + own, OWN_PLAN: plan_subkey_prefix(2) + own}.get(
            subkey, subkey)
        outcomes[label] = await attacker_store(key, value, expiration, subkey=subkey)
    forged = {peers_key(RUN): dict(PEER, name="mallory", ram_gb=4000.0),
              stages_key(RUN, 0): dict(STAGE, peer_id="12D3KooWMallory"),
              round_key(RUN): dict(PROPOSAL, peer_id="12D3KooWMallory", fitness=1e11),
              plan_key(RUN): dict(PLAN, clusters=[[dict(peer_id="12D3KooWMallory", layers=[0, 2])]])}
    for key, value in forged.items():
        outcomes[f"forged {key}"] = await attacker_store(key, value, expiration, subkey=victim_subkeys[key])
    # well-formed plans under the attacker's own signed subkey: storable, since whether a plan counts depends on
    # the live peer records, which the readers check; the first one stopped planning for good before (issue #19)
    for round_number, clusters in ((10**15, PLAN["clusters"]), (2, [[dict(peer_id="12D3KooWMallory", layers=[0, 2])]])):
        await attacker_store(plan_key(RUN), dict(PLAN, round=round_number, clusters=clusters), expiration,
                             subkey=plan_subkey_prefix(round_number) + own)
    return outcomes


async def honest_view(node):
    """What each project reader makes of the run's records (the planner's reads need its node, run and announcer:
    a peer reads the run's records at the bucket counts its announcer knows)."""
    announcer = PeerAnnouncer(node, RUN, "honest", Capabilities(ram_gb=1.0, gflops=1.0, bandwidth_mbps=10.0))
    # rounds of 600 s, as the honest proposal's deadline is: the planner reads no deadline further ahead
    rounds = SimpleNamespace(node=node, run=RUN, names={}, announcer=announcer,
                             options=SimpleNamespace(round_seconds=600.0))
    spec = await read_spec(node, RunAddress(RUN, OWNER_FINGERPRINT))
    return dict(
        peers=await read_peers(node, RUN),
        stages=await read_endpoints(node, RUN, 0),
        proposals=await PlanningRounds.read_proposals(rounds, 1),
        alive=sorted(await PlanningRounds.read_alive(rounds, get_dht_time())),
        plan=await read_adopted_plan(node, RUN),
        spec=None if spec is None else asdict(spec),
    )


def check_only_honest(view, spec):
    assert [(p["name"], p["ram_gb"]) for p in view["peers"]] == [("honest", 8.0)]
    assert view["stages"] == {(0, 0): STAGE}
    assert view["proposals"] == [PROPOSAL]
    assert view["alive"] == [HONEST_ID]
    assert view["plan"] == PLAN
    assert view["spec"] == spec


async def status_json(maddr: str) -> dict:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ravnest_swarm", "status", "--initial-peers", maddr, "--run", RUN, "--json",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    finally:
        if process.returncode is None:
            process.kill()
    assert process.returncode == 0, stderr.decode()[-2000:]
    return json.loads(stdout.decode().strip().splitlines()[-1])


@pytest.mark.timeout(150)
def test_forged_and_malformed_records_of_every_key_are_refused_and_never_read():
    """Attack: a non-project client writes, for every key of the run (peers, stages, round, plan, spec),
    values of the wrong type, huge strings and lists, NaN/Inf, out-of-range numbers, non-dicts, raw bytes,
    unsigned subkeys, and well-formed values under another peer's signed subkey (with a later expiration,
    so they would replace the honest ones). First the only storage node is honest: it must refuse every
    write. Then a lax node that validates nothing (another run's backbone, other software) joins and
    stores them anyway: honest readers (status, planner, endpoint resolution, spec) must still drop them
    when they fetch, and see exactly the honest records.
    """

    async def scenario():
        # the storage node and the honest reader know the run's address, owner included (backbone --run name@owner)
        server = await start_node(record_validators=make_validators(RUN, OWNER_FINGERPRINT), host_maddrs=LOCAL)
        maddrs = await server.get_visible_maddrs()
        honest = await start_node(maddrs, record_validators=make_validators(RUN, OWNER_FINGERPRINT,
                                                                            signing_key=HONEST.key),
                                  host_maddrs=LOCAL, client_mode=True, identity=HONEST)
        signature = RSASignatureValidator(RSAPrivateKey())
        attacker = await start_node(maddrs, record_validators=[signature], host_maddrs=LOCAL, client_mode=True)
        lax = None
        try:
            own = RSASignatureValidator(HONEST.key).local_public_key  # the honest writer's identity
            expiration = get_dht_time() + 120
            victim_subkeys = {peers_key(RUN): own, stages_key(RUN, 0): stage_subkey_prefix(0, 0) + own,
                              round_key(RUN): own, plan_key(RUN): plan_subkey_prefix(1) + own}
            for key, value in [(peers_key(RUN), PEER), (stages_key(RUN, 0), STAGE), (round_key(RUN), PROPOSAL)]:
                assert await honest.store(key, value, expiration, subkey=victim_subkeys[key])
            assert await honest.store(plan_key(RUN), PLAN, expiration, subkey=plan_subkey_prefix(1) + own)
            assert await honest.store(spec_key(RUN), SPEC, expiration, subkey=own)
            spec = asdict(RunSpec.from_record(SPEC))

            outcomes = await write_as_attacker(attacker, signature, victim_subkeys)
            assert not any(outcomes.values()), [label for label, stored in outcomes.items() if stored]
            check_only_honest(await honest_view(honest), spec)

            lax = await start_node(maddrs, host_maddrs=LOCAL)
            for _ in range(5):  # the attacker finds the lax node a moment after it joins (a CI run wrote too soon)
                outcomes = await write_as_attacker(attacker, signature, victim_subkeys)
                if any(outcomes.values()):
                    break
                await asyncio.sleep(1.0)
            assert any(outcomes.values())  # the lax node took them: now the readers are the guard
            check_only_honest(await honest_view(honest), spec)
            document = await status_json(str(maddrs[0]))
            assert [(p["name"], p["ram_gb"]) for p in document["peers"]] == [("honest", 8.0)]
            assert document["summary"]["peers"] == 1 and document["summary"]["states"] == {"training": 1}
        finally:
            for node in (attacker, honest, lax, server):
                if node is not None:
                    await stop_node(node)

    asyncio.run(scenario())

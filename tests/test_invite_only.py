"""Invite-only runs (issue #34): admission tickets signed by the run's owner, against one run of real `join`
processes.

The module starts one invite-only run: a backbone, the owner's volunteer v0 (`join --invite-only`, which admits
itself with a ticket it signs) and v1, a volunteer holding a ticket bound to its peer id (`ravnest-swarm invite
--peer`). The tests show who is refused (tickets that do not admit, a joiner without one, a stranger's messages
and endpoint record) and that a revoked ticket's peer is dropped. Tests run in file order; keep the revocation last.
"""

import asyncio
import base64
import os
import re
import subprocess
import sys
import time

import msgpack

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from commands import ravnest
from run_observer import RunObserver
from ravnest_swarm.averaging.wire import RING_HANDLER
from ravnest_swarm.membership.owner import OWNER_KEYS_ENV, fingerprint, load_or_create_owner_key
from ravnest_swarm.membership.records import start_peer_node
from ravnest_swarm.membership.tickets import Admission, issue_ticket
from ravnest_swarm.models import get_model
from ravnest_swarm.net.node import parse_maddrs, stop_node
from ravnest_swarm.pipeline import wire
from ravnest_swarm.pipeline.endpoints import read_endpoints
from ravnest_swarm.processes import ProcessGroup
from ravnest_swarm.swarm.placement import model_workload
from ravnest_swarm.swarm.spec import RunSpec, read_specs
from test_attacks import send_as, send_ring_messages, serve_a_hostile_endpoint

RUN = "invited"
MODEL_GB = model_workload(get_model("mlp-digits"), RunSpec("mlp-digits"), 8)[0].model_gb
NOT_ADMITTED = f"not admitted to invite-only run {RUN}"


class InvitedRun:
    """The invite-only run: its backbone's multiaddr, address, owner key and environment, processes and observer."""

    def __init__(self, processes: ProcessGroup, maddr: str, address: str, key: RSAPrivateKey, owner_env: dict,
                 guest_env: dict, observer: RunObserver):
        self.processes, self.maddr, self.address, self.key = processes, maddr, address, key
        self.owner_env, self.guest_env, self.observer = owner_env, guest_env, observer
        self.volunteers = {}

    def join_args(self, name: str, ram_fraction: float = 0.6, extra=()):
        """``join``'s arguments for a volunteer; at 0.6 of the model's memory two of them form a cluster of two."""
        return ["join", "--initial-peers", self.maddr, "--run", self.address, "--name", name, "--no-dashboard",
                "--model", "mlp-digits", "--steps", "100000", "--averaging-period", "20", "--heartbeat", "2",
                "--round-seconds", "6", "--min-peers", "2", "--ram-gb", f"{MODEL_GB * ram_fraction:.9f}",
                "--gflops", "20", "--bandwidth-mbps", "100", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *extra]

    def join(self, name: str, env: dict, ram_fraction: float = 0.6, extra=()):
        self.volunteers[name] = self.processes.start(self.join_args(name, ram_fraction, extra), name, env=env)
        return self.volunteers[name]

    def invite(self, *args: str):
        """``ravnest-swarm invite`` as the owner: (token, ticket id)."""
        result = ravnest("invite", "--run", self.address, *args, timeout=60, env=self.owner_env)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip(), re.search(r"ticket ([0-9a-f]{16})", result.stderr).group(1)

    def training(self):
        return {name: p for name, p in self.observer.peers().items()
                if p["state"] == "training" and p.get("cluster") is not None and p["cluster"] >= 0}

    def keeps_training(self, names=("v0", "v1"), steps: int = 5, timeout: float = 90):
        before = {name: (self.training().get(name) or {}).get("step") or 0 for name in names}
        return self.observer.wait_for(lambda peers: all(
            peers.get(name, {}).get("state") == "training" and (peers[name].get("step") or 0) >= before[name] + steps
            for name in names), timeout, f"{', '.join(names)} train {steps} more steps", period=1.0)


@pytest.fixture(scope="module")
def invited_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("invited")
    processes = ProcessGroup(str(folder))
    owner_env = {OWNER_KEYS_ENV: str(folder / "owners")}
    guest_env = {OWNER_KEYS_ENV: str(folder / "guests")}  # a volunteer's machine: no owner key there
    key = load_or_create_owner_key(os.path.join(owner_env[OWNER_KEYS_ENV], f"{RUN}.key"))
    address = f"{RUN}@{fingerprint(key.get_public_key().to_bytes())}"
    identity = str(folder / "v1.identity")  # v1's peer id is known before it joins: its ticket names it
    P2P.generate_identity(identity)
    with open(identity, "rb") as f:
        v1_peer_id = PeerID.from_identity(f.read()).to_base58()
    observer = None
    try:
        backbone = processes.start(["backbone", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run", address],
                                   "backbone")
        maddr = backbone.maddrs()[0]
        observer = RunObserver(maddr, RUN)
        run = InvitedRun(processes, maddr, address, key, owner_env, guest_env, observer)
        ticket, _ = run.invite("--peer", v1_peer_id, "--expires", "2h")
        run.join("v0", owner_env, extra=["--invite-only"])
        run.join("v1", guest_env, extra=["--identity", identity, "--ticket", ticket])
        observer.wait_for(lambda peers: {"v0", "v1"} <= set(run.training()) and
                          all((p.get("step") or 0) > 0 for p in run.training().values()),
                          150, "v0 and v1 placed in one cluster and training", period=1.0)
        yield run
    finally:
        if observer is not None:
            observer.close()
        processes.stop_all()


@pytest.mark.timeout(60)
def test_admission_counts_only_records_whose_ticket_admits_their_peer_id():
    """The rule every peer of an invite-only run applies, without a network: a bound ticket admits its own peer id
    only, an any-peer ticket any; an expired, forged, foreign or revoked ticket admits nobody; an admitted peer's
    messages pass the gate until its record expires or its ticket is revoked (one line, dropping it); an open run
    admits everyone."""
    key, stranger_key, now = RSAPrivateKey(), RSAPrivateKey(), time.time()
    ours, anyone = "QmVhJVRSYHNSHgR9dJNbDxu6G7GPPqJAeiJoVRvcexGNf9", "QmXZQ6jtyt8oZHGuNPBiJ4HFBGsm2bkdh9fNCnWu5A8RZt"
    bound, bound_ticket = issue_ticket(key, RUN, ours, now + 600)
    bearer, bearer_ticket = issue_ticket(key, RUN, None, now + 600)
    said = []
    admission = Admission(RUN, key.get_public_key().to_bytes().decode(), True, say=said.append)
    records = [dict(peer_id=ours, ticket=bound, expires_in=6.0), dict(peer_id=anyone, ticket=bound, expires_in=6.0),
               dict(peer_id=anyone, ticket=bearer, expires_in=6.0), dict(peer_id="QmNone", expires_in=6.0),
               dict(peer_id="QmOld", ticket=issue_ticket(key, RUN, None, now - 1)[0], expires_in=6.0),
               dict(peer_id="QmForged", ticket=issue_ticket(stranger_key, RUN, None, now + 600)[0], expires_in=6.0),
               dict(peer_id="QmElsewhere", ticket=issue_ticket(key, "elsewhere", None, now + 600)[0], expires_in=6.0)]
    assert [(r["peer_id"], r.get("ticket")) for r in admission.admitted(records)] == [(ours, bound), (anyone, bearer)]
    # said once each: the bound ticket in ``anyone``'s record names another peer id (its bearer ticket admits it)
    assert set(admission.ignored) == {anyone, "QmNone", "QmOld", "QmForged", "QmElsewhere"}, admission.ignored
    assert admission.refusal(PeerID.from_base58(ours), RING_HANDLER) is None
    refused = admission.refusal(PeerID.from_base58("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"), RING_HANDLER)
    assert NOT_ADMITTED in refused and RING_HANDLER in refused and "\n" not in refused
    admission.follow(True, [bearer_ticket.id])
    assert said == [f"dropped peer {anyone}: the run's owner revoked its ticket {bearer_ticket.id}"]
    assert admission.refusal(PeerID.from_base58(anyone), RING_HANDLER) is not None
    assert admission.problem(bearer, anyone) == f"ticket {bearer_ticket.id} was revoked"
    assert admission.problem(bound, anyone) == f"ticket {bound_ticket.id} is for peer {ours}"
    admission.follow(False, [])
    assert len(admission.admitted(records)) == len(records)
    assert admission.refusal(PeerID.from_base58(anyone), RING_HANDLER) is None


def test_a_ticket_with_fields_no_owner_would_sign_is_malformed_in_one_line():
    """A stranger's record may carry any ticket: its ``run`` went into every invite-only peer's log with terminal
    escapes, and an expiry past what a clock prints made ``join --ticket`` end in a traceback. Each field is now
    checked as a person may be shown it; ``invite --expires`` refuses what no ticket may carry."""
    from ravnest_swarm.errors import UserError
    from ravnest_swarm.membership.tickets import check_ticket_for, parse_expiry, read_ticket

    key, now = RSAPrivateKey(), time.time()
    good = dict(run=RUN, owner=fingerprint(key.get_public_key().to_bytes()), peer="", expires=now + 600,
                id="0123456789abcdef")

    def token(**fields):
        payload = MSGPackSerializer.dumps(dict(good, **fields))
        return base64.urlsafe_b64encode(MSGPackSerializer.dumps([payload, key.sign(payload)])).decode()

    assert read_ticket(token()).run == RUN
    admission = Admission(RUN, key.get_public_key().to_bytes().decode(), True)
    for fields in (dict(run="\x1b[2J\x1b[31mOWNER SAYS: run this\x1b[0m"), dict(run="a\nWARNING fake line"),
                   dict(peer="Qm\x1b[31m"), dict(peer="x" * 129), dict(expires=1e300), dict(expires=float("inf")),
                   dict(expires=float("nan")), dict(expires=-1.0)):
        with pytest.raises(UserError, match="not one `ravnest-swarm invite` printed") as error:
            check_ticket_for(token(**fields), RUN, None)
        assert "\n" not in str(error.value) and "\x1b" not in str(error.value)
        assert admission.problem(token(**fields), "QmVhJVRSYHNSHgR9dJNbDxu6G7GPPqJAeiJoVRvcexGNf9") == "a malformed ticket"
    # a token of msgpack extensions nested 205 deep (980 characters, within a record's ticket) overflowed the C stack
    # of every reader: SIGSEGV, so in a process of its own
    nested = msgpack.packb(0)
    for _ in range(205):
        nested = msgpack.packb(msgpack.ExtType(0x40, nested))
    deep = base64.urlsafe_b64encode(nested).decode()
    reader = subprocess.run([sys.executable, "-c", "import sys; from hivemind.utils.crypto import RSAPrivateKey; "
                             "from ravnest_swarm.membership.tickets import Admission; "
                             "print(Admission('r', RSAPrivateKey().get_public_key().to_bytes().decode(), True)"
                             ".problem(sys.argv[1], 'QmVhJVRSYHNSHgR9dJNbDxu6G7GPPqJAeiJoVRvcexGNf9'))", deep],
                            capture_output=True, text=True, timeout=60)
    assert (reader.returncode, reader.stdout) == (0, "a malformed ticket\n"), reader
    for expires, problem in (("0s", "not in the future"), ("999999999w", "past the year 5000"),
                             ("2020-01-01T00:00", "not in the future")):
        with pytest.raises(UserError, match=problem):
            parse_expiry(expires, now)
    assert parse_expiry("7d", now) == now + 7 * 86400


def expect_one_line_refusal(result, pattern: str) -> None:
    assert result.returncode != 0, (result.stdout, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(pattern, errors[0]), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(180)
def test_tickets_that_do_not_admit_are_refused_in_one_line_before_joining(invited_run, tmp_path):
    """Garbage, a ticket of another run name, an expired one and one signed by another owner key of the same run
    name: each `join --ticket` exits at once (before any network) with one line and a non-zero exit, as does garbage
    in a file given as the ticket. `invite` by a key that is not the run's owner's, or for a peer id that is none, is one
    line too."""
    other_key, now = RSAPrivateKey(), time.time()
    other_owner = fingerprint(other_key.get_public_key().to_bytes())
    cases = {
        "garbage": ("not-a-ticket!", r"not one `ravnest-swarm invite` printed"),
        "another run": (issue_ticket(invited_run.key, "elsewhere", None, now + 600)[0], r"for run elsewhere@"),
        "expired": (issue_ticket(invited_run.key, RUN, None, now - 1)[0], r"expired"),
        "another owner": (issue_ticket(other_key, RUN, None, now + 600)[0],
                          rf"for run {RUN}@{other_owner}, not {invited_run.address}"),
    }
    file = tmp_path / "garbage.ticket"
    file.write_text(cases["garbage"][0] + "\n")
    for what, (ticket, pattern) in dict(cases, file=(str(file), cases["garbage"][1])).items():
        started = time.monotonic()
        result = ravnest(*invited_run.join_args("refused", extra=["--ticket", ticket]), timeout=60,
                         env=invited_run.guest_env)
        expect_one_line_refusal(result, pattern)
        assert time.monotonic() - started < 20, what  # refused before starting a node
    expect_one_line_refusal(ravnest("invite", "--run", invited_run.address, timeout=60, env=invited_run.guest_env),
                            "no run owner key")
    expect_one_line_refusal(ravnest("invite", "--run", invited_run.address, "--peer", "Qm123", timeout=60,
                                    env=invited_run.owner_env), "is not a peer id")
    expect_one_line_refusal(ravnest("invite", "--run", invited_run.address, "--expires", "soon", timeout=60,
                                    env=invited_run.owner_env), "--expires 'soon'")


@pytest.mark.timeout(240)
def test_a_joiner_without_a_valid_ticket_is_refused_and_the_ticket_holder_trains(invited_run):
    """A joiner of the invite-only run without a ticket, and one whose ticket names the owner's fingerprint but is
    signed by another key (a forgery only the run's spec can tell), each exit with one line once they read the
    spec, and never appear as admitted peers; meanwhile v1, admitted by its bound ticket, trains beside the owner's
    v0, and both records carry their tickets."""
    forged_key = RSAPrivateKey()
    payload = MSGPackSerializer.dumps(dict(run=RUN, owner=invited_run.address.split("@")[1], peer="",
                                           expires=time.time() + 600, id="0123456789abcdef"))
    forged = base64.urlsafe_b64encode(MSGPackSerializer.dumps([payload, forged_key.sign(payload)])).decode()
    refused = {name: invited_run.processes.start(invited_run.join_args(name, extra=extra), name,
                                                 env=invited_run.guest_env)
               for name, extra in (("no-ticket", []), ("forged", ["--ticket", forged]))}
    codes = {name: process.wait(120) for name, process in refused.items()}
    assert all(code != 0 for code in codes.values()), codes
    outcome = {name: subprocess.CompletedProcess(name, code, process.stdout(), process.stderr())
               for (name, process), code in zip(refused.items(), codes.values())}
    expect_one_line_refusal(outcome["no-ticket"], rf"run {invited_run.address} is invite-only: ask its owner for a "
                                                  rf"ticket")
    expect_one_line_refusal(outcome["forged"], r"does not admit you .*: ticket 0123456789abcdef not signed by the "
                                               r"run's owner")
    peers = invited_run.keeps_training()
    assert peers["v0"].get("ticket") and peers["v1"].get("ticket")
    for name in ("v0", "v1"):  # the volunteers' own views never held the refused joiners as members
        log = invited_run.volunteers[name].stdout() + invited_run.volunteers[name].stderr()
        seen = re.findall(r"sees \d+ peer\(s\): (.*)", log)
        assert seen and not any("no-ticket:" in line or "forged:" in line for line in seen), seen


def stage_peer(run: InvitedRun, stage: int) -> dict:
    return next(p for p in run.training().values() if p.get("stage") == stage)


def wait_for_refusals(run: InvitedRun, victim: dict, count: int, stranger: str) -> dict:
    """Wait until ``victim``'s record counts ``count`` more refusals and its note names ``stranger``."""
    before = victim.get("rejected") or 0
    return run.observer.wait_for(lambda peers: (peers[victim["name"]].get("rejected") or 0) >= before + count
                                 and stranger in (peers[victim["name"]].get("note") or ""), 60,
                                 f"{victim['name']}'s record counts {count} refusals of {stranger}",
                                 period=1.0)[victim["name"]]


@pytest.mark.timeout(240)
def test_a_strangers_forward_backward_and_ring_messages_are_refused(invited_run):
    """A stranger (a stock hivemind P2P with no ticket) sends the last stage a forward, stage 0 a gradient and each
    volunteer a ring note, each addressed as a member would: every one is refused in one line naming the invite-only
    run, before its handler reads it; each victim's record counts them and its note names the stranger; the run
    trains on."""
    first, last = stage_peer(invited_run, 0), stage_peer(invited_run, 1)
    (width,) = get_model("mlp-digits").layers[last["layers"][0]].input_shape

    async def pipeline_attack():
        stranger = await P2P.create(initial_peers=last["maddrs"] + first["maddrs"],
                                    host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            forward = dict(run=RUN, cluster=last["cluster"], stage=1, microbatch=10**6, sample_ids=list(range(4)),
                           version=last["step"])
            backward = dict(run=RUN, cluster=first["cluster"], stage=0, microbatch=1, version=first["step"])
            replies = [await send_as(stranger, last, wire.FORWARD, forward,
                                     [torch.randn(4, width), torch.zeros(4, dtype=torch.long)]),
                       await send_as(stranger, first, wire.BACKWARD, backward, [torch.randn(16, 64)])]
            return stranger.peer_id.to_base58(), replies
        finally:
            await stranger.shutdown()

    stranger, replies = asyncio.run(pipeline_attack())
    assert all(NOT_ADMITTED in reply and "\n" not in reply for reply in replies), replies
    wait_for_refusals(invited_run, last, 1, stranger[-8:])
    wait_for_refusals(invited_run, first, 1, stranger[-8:])

    note = dict(run=RUN, step=((first.get("step") or 0) // 20 + 1) * 20, ring=0, phase="abort", position=0,
                attempt=[], failure="ended by a stranger")
    for victim in (first, last):
        stranger, replies = asyncio.run(send_ring_messages(victim, [(note, [])]))
        assert replies and all(NOT_ADMITTED in reply and RING_HANDLER in reply for reply in replies), replies
        wait_for_refusals(invited_run, victim, 1, stranger[-8:])
    invited_run.keeps_training()


@pytest.mark.timeout(240)
def test_a_strangers_endpoint_record_does_not_count(invited_run):
    """A stranger's DHT node writes a well-formed endpoint record of its own for the slot of stage 1, dated far
    ahead: the newest of the slot, which a read without a plan's names would take. Read with the run's admission
    (what every peer of the run installs: ``membership/tickets.py``), the record does not count at all; the real
    stage 1 is the slot's endpoint, and no forward reaches the stranger while the run trains on."""
    second = stage_peer(invited_run, 1)
    slot = (second["cluster"], 1)
    spec = invited_run.observer.call(read_specs(invited_run.observer.node, RUN))[invited_run.address.split("@")[1]]
    records = list(invited_run.observer.peers().values())  # with their tickets, as a peer of the run reads them

    async def attack():
        # its own identity signs the record, which names it: records bound to their writer store it (it speaks
        # for itself); only the run's admission keeps it from counting
        node = await start_peer_node(parse_maddrs([invited_run.maddr]), RUN, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            stored, caught = await serve_a_hostile_endpoint(node, RUN, slot, second)
            unchecked = (await read_endpoints(node, RUN, slot[0])).get(slot)
            node.admission = Admission(RUN, spec["owner"], spec["invite_only"], spec["revoked"])
            node.admission.admitted(records)
            admitted = (await read_endpoints(node, RUN, slot[0])).get(slot)
            await asyncio.sleep(10)  # the run trains on meanwhile; the stranger listens
            return node.peer_id.to_base58(), stored, unchecked, admitted, caught
        finally:
            await stop_node(node)

    stranger, stored, unchecked, admitted, caught = asyncio.run(attack())
    assert stored and unchecked["peer_id"] == stranger  # the hostile record stands, the newest of its slot
    assert admitted is not None and admitted["peer_id"] == second["peer_id"]
    assert caught == []
    invited_run.keeps_training()


@pytest.mark.timeout(240)
def test_a_revoked_tickets_peer_is_dropped_within_a_heartbeat_or_two(invited_run):
    """v2 joins with a ticket for any peer (as a standby: it holds too little to be placed) and is admitted by
    v0 and v1. The owner revokes its ticket (`update-spec --revoke ID`): within a heartbeat or two (2 s here) v0 and
    v1 each say they dropped it, and v2 leaves with one line and a non-zero exit. The run trains on."""
    ticket, ticket_id = invited_run.invite("--expires", "1h")
    v2 = invited_run.join("v2", invited_run.guest_env, ram_fraction=0.1, extra=["--ticket", ticket])
    for name in ("v0", "v1"):
        invited_run.volunteers[name].wait_for_output(r"sees 3 peer\(s\): .*v2:", 90, stream="stderr")
    v2_id = invited_run.observer.peers()["v2"]["peer_id"]

    result = ravnest("update-spec", "--initial-peers", invited_run.maddr, "--run", invited_run.address,
                     "--revoke", ticket_id, "--revoke", ticket_id, timeout=60, env=invited_run.owner_env)
    # given twice, revoked and said once
    assert result.returncode == 0 and result.stdout.count(f"ticket {ticket_id} revoked") == 1, result
    published = time.monotonic()
    for name in ("v0", "v1"):
        invited_run.volunteers[name].wait_for_output(
            rf"dropped peer {v2_id}: the run's owner revoked its ticket {ticket_id}", 30, stream="stderr")
    assert v2.wait(30) != 0
    assert time.monotonic() - published < 4 * 2 + 10  # a heartbeat or two, on a loaded 2-core machine
    errors = [line for line in v2.stderr().splitlines() if line.startswith("error:")]
    assert errors == [f"error: leaving run {invited_run.address}: ticket {ticket_id} was revoked (the owner's spec "
                      f"version 2)"], v2.stderr()
    assert "Traceback" not in v2.stderr()
    invited_run.keeps_training()

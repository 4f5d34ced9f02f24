"""Light peers (``bench/light.py``): six real membership peers, three to a process, as ``bench membership`` runs a
hundred: their views converge; a killed peer stays in every view until its record expires, then leaves them all;
a host stopped with SIGTERM makes its peers leave (``leaving`` at once) and stops every p2pd it started."""

import signal
import time

import pytest

from process_tree import alive
from run_observer import RunObserver
from waiting import wait_until
from ravnest_swarm.bench.light import LightHosts
from ravnest_swarm.membership.backbone import BackboneOptions, run_backbone_process

RUN = "light"
HEARTBEAT = 2.0  # records live 3 heartbeats (membership/view.py)


def _views(hosts: LightHosts):
    hosts.poll()
    return {name: peer.view for name, peer in hosts.peers.items()}


@pytest.mark.timeout(150)
def test_light_peers_converge_a_killed_one_expires_and_a_stopped_host_leaves_and_stops_its_p2pd(processes):
    backbone = processes.start_library(run_backbone_process, BackboneOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                                                             runs=[RUN]), "backbone")
    maddr = backbone.maddrs()[0]
    hosts = LightHosts(processes, [maddr], RUN, HEARTBEAT, report_period=0.5)
    first, second = hosts.start_host(["a0", "a1", "a2"]), hosts.start_host(["b0", "b1", "b2"])
    everyone = {"a0", "a1", "a2", "b0", "b1", "b2"}
    wait_until(lambda: all(view == everyone for view in _views(hosts).values()), 60,
               "every light peer's view lists all six")
    p2pd = {name: peer.p2pd_pid for name, peer in hosts.peers.items()}
    assert None not in p2pd.values() and len(set(p2pd.values())) == 6, f"one p2pd per light peer: {p2pd}"

    hosts.kill_peer("a1")
    killed_at = time.time()
    last_publish, lifetime = wait_until(lambda: _views(hosts) and hosts.killed.get("a1"), 10, "the host's kill report")
    assert lifetime == pytest.approx(3 * HEARTBEAT)
    wait_until(lambda: not alive([p2pd["a1"]]), 10, "the killed peer's p2pd stopped")
    expiry = last_publish + lifetime
    # no 'leaving' record: until its record expires, the others still list it (a report a second before expiry)
    seen_after_kill = []
    while time.time() < expiry - 1.0:
        seen_after_kill.append(all("a1" in view for view in _views(hosts).values()))
        time.sleep(0.2)
    assert seen_after_kill and all(seen_after_kill), "a killed peer left a view before its record expired"
    gone = everyone - {"a1"}
    wait_until(lambda: all(view == gone for view in _views(hosts).values()), expiry - time.time() + 2 * HEARTBEAT + 5,
               "every view drops the killed peer once its record expired")
    assert time.time() - killed_at < 3 * HEARTBEAT + 2 * HEARTBEAT + 10

    observer = RunObserver(maddr, RUN, period=0.1)
    try:
        second.signal(signal.SIGTERM)
        # each of its peers says 'leaving' (which the others' views drop), then the host stops its p2pd and exits
        observer.wait_for(lambda peers: all(peers.get(name, {}).get("state") == "leaving" for name in
                                            ("b0", "b1", "b2")), 10, "'leaving' for every peer of the stopped host")
        assert second.wait(30) == 0
        left_at = time.time()
        wait_until(lambda: all(_views(hosts)[name] == {"a0", "a2"} and hosts.peers[name].view_time > left_at
                               for name in ("a0", "a2")), 3 * HEARTBEAT + 5, "the leavers out of the other views")
    finally:
        observer.close()
    assert not alive([p2pd[name] for name in ("b0", "b1", "b2")]), "the stopped host left a p2pd running"
    assert '"left"' in second.stdout()

    processes.stop_all()
    assert not alive([first.pid, second.pid, backbone.pid, *p2pd.values()])

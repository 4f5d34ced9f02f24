"""Issue 29's lab run, as a test: a public backbone, two public volunteers and two behind two different NATs, at
100 Mbit/s, ``--model mlp-digits --steps 3000``, every peer able to hold the whole model. The first joiner trains
alone; then a round makes 4 clusters of one stage, three of them downloading the layers while the holder trains
on. Before issue 29 two clusters diverged (the lr x 4 of the linear scaling rule), their records failed every
renewal, and every volunteer exited on an unexpected error. Now every peer trains to the run's length, and every
cluster completes most of its averaging rounds."""

import json
import math
import re
import time

import pytest

from ravnest_swarm.bench.natlab import NatLab

pytestmark = pytest.mark.netns
RUN = "labrun"
# Issue 29's 3000 steps. A CI run placed home0 at the end of the run, with no averaging round left for it: it saw
# round 2 late, its record having gone out seconds before its planning rounds began, and a third round placed it;
# a joiner now says `joining` until its rounds begin and no round opens for it before (planning/round.py). At 6000
# steps (tried to leave room for that late placement) two of two CI runs had a cluster diverge after step 3700,
# right after applying a compressed round (microbatch losses 11-16; the guard restored it): open, not this test's subject
STEPS = 3000
# microbatches of 128 samples, not 32: on a free core the first joiner alone trains 3000 steps of 32 in seconds
MICROBATCH = 128


@pytest.mark.timeout(420)
def test_four_volunteers_two_behind_nat_train_to_the_end_without_diverging(processes, tmp_path):
    lab = NatLab(3, 2, mbps=100).__enter__()
    try:
        backbone = processes.start(["backbone", "--host-maddrs", lab.public_maddr(0)], "backbone",
                                   lab_host=lab.public_host(0)).maddrs()[0]

        def join(name, maddr, lab_host, min_peers):
            return processes.start(["join", "--initial-peers", backbone, "--run", RUN, "--name", name,
                                    "--no-dashboard", "--model", "mlp-digits", "--steps", str(STEPS), "--microbatch-size",
                                    str(MICROBATCH), "--min-peers",
                                    str(min_peers), "--heartbeat", "2", "--round-seconds", "6", "--ram-gb", "8",
                                    "--gflops", "20", "--bandwidth-mbps", "100", "--host-maddrs", maddr], name,
                                   lab_host=lab_host)

        def peers():
            status = processes.start(["status", "--json", "--run", RUN, "--initial-peers", backbone],
                                     f"status{len(processes.processes)}", lab_host=lab.public_host(1))
            assert status.wait(90) == 0, status.stderr()[-2000:]
            return {p["name"]: p for p in json.loads(status.stdout().strip().splitlines()[-1])["peers"]}

        worst_loss = 0.0

        def watch(check, what, timeout):
            nonlocal worst_loss
            deadline = time.monotonic() + timeout
            while True:
                seen = peers()
                worst_loss = max([worst_loss] + [p["loss"] for p in seen.values() if p.get("loss") is not None])
                if check(seen):
                    return seen
                assert time.monotonic() < deadline, f"never saw {what}: {seen}"
                time.sleep(2.0)

        volunteers = {"first": join("first", lab.public_maddr(1), lab.public_host(1), 1)}
        # the others start once the first has opened its round of one: it is placed alone, they come a round later
        volunteers["first"].wait_for_output(r"round 1 opened \(1 live peers\)", 150, stream="stderr")
        volunteers["public"] = join("public", lab.public_maddr(2), lab.public_host(2), 4)
        volunteers["home0"] = join("home0", lab.home_maddr(0), lab.home_host(0), 4)
        volunteers["home1"] = join("home1", lab.home_maddr(1), lab.home_host(1), 4)
        final = watch(lambda seen: len(seen) == 4 and all(p["state"] == "done" for p in seen.values()),
                      "every volunteer done", 330)

        logs = {name: volunteer.stderr() for name, volunteer in volunteers.items()}
        # round 1 places the first joiner: alone, or with a joiner quick enough to answer within its deadline
        assert re.search(r"adopted plan round 1 fitness \S+ hash \S+ clusters [12] members (\S+,)?first(,\S+)?\n",
                         logs["first"])
        assert any(re.search(r"adopted plan round \d+ fitness \S+ hash \S+ clusters 4 ", log) for log in logs.values())
        assert {p["reachability"] for n, p in final.items() if n.startswith("home")} == {"relay"}
        rounds = {name: (record.get("averaging_rounds") or 0, record.get("averaging_failures") or 0)
                  for name, record in final.items()}
        for name, (done, failed) in rounds.items():
            print(f"{name}: cluster {final[name]['cluster']}, {done} of {done + failed} averaging rounds completed")
        for name, record in final.items():
            assert record["step"] == STEPS, record
            # every cluster averages: most of its rounds complete. Rings in which the two NAT peers are neighbours
            # (two of every three runs, by the clusters' order) go through the backbone's forwarding; until a
            # sender kept within the backbone's slots for it, every one of those rounds failed (0 of 55)
            done, failed = rounds[name]
            assert done >= 1 and done > failed, record
            # joiners placed in one round fetch their layers while the first of them to finish already counts as a
            # second holder; neither holder has an averaged copy: a later joiner kept its seeded weights, the first
            # round averaged them in and the first peer's divergence guard restored (2 of 8 runs). It now takes
            # the live weights of the holder at the agreed step (state_transfer.fill_layer)
            assert not record.get("out_of_range") and not record.get("divergences"), record
        assert worst_loss <= 1e3 and math.isfinite(worst_loss)
        for name, log in logs.items():
            assert volunteers[name].popen.poll() is None, f"{name} exited: {log[-3000:]}"
            # a renewal that the retry a second later mends is a warning (a joiner's first store, as its connections
            # formed, on a loaded lab); renewals failing for a heartbeat are the error this run once had
            assert not re.search(r"unexpected|Traceback|could not be renewed|ERROR .*renewing our peer record failed",
                                 log), f"{name}: {log[-3000:]}"
    finally:
        processes.stop_all()
        lab.close()

"""Write ``swarm_recording.json``: 16 snapshots of a made-up 30-peer run, for the dashboard tests.

Run ``python tests/data/make_swarm_recording.py`` to regenerate it (deterministic). The story, one
snapshot every 10 s: 4 clusters of 32 layers train with a few standby spares; the pipeline's last
stages report a falling loss; every fourth snapshot the clusters average (and the last snapshot is in
the middle of one); a newcomer joins; a peer leaves gracefully and a spare takes its slot; another
peer vanishes without a word; one averaging fails; planning round 4 moves a spare into cluster 2.
Every record passes ``PeerRecord`` validation, like the ones ``read_peers`` returns.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random

from ravnest_swarm.membership.records import PeerRecord, PlanRecord

START = 1_790_000_000.0
PERIOD = 10.0
SNAPSHOTS = 16
NUM_LAYERS = 32
CLUSTERS = [
    ["oslo-rtx3060", "ana-macbook", "kth-lab-07", "berlin-gtx1080", "mumbai-desktop", "lyon-ryzen9"],
    ["sf-dgx-spare", "kiev-gtx1660", "nairobi-pc", "turin-quadro", "seoul-3080ti", "austin-homelab",
     "delft-lab-12", "quito-laptop"],
    ["sao-paulo-pc", "helsinki-nuc", "cairo-rtx2070", "perth-workstn", "riga-thinkpad"],
    ["boston-a4000", "pune-gaming", "zurich-eth-3", "lagos-desktop", "montreal-m2", "krakow-rx6800"],
]
SPARES = ["porto-desktop", "lisbon-nuc", "hanoi-laptop", "bogota-pc", "vienna-imac"]
NEWCOMER = "tokyo-rtx4090"


def peer_id(name: str) -> str:
    return "12D3KooW" + hashlib.sha256(name.encode()).hexdigest()[:44]


def split_layers(count: int, rng: random.Random):
    """Stage layer ranges [a, b) over NUM_LAYERS, uneven like a water-filled plan."""
    weights = [rng.uniform(0.6, 1.6) for _ in range(count)]
    cuts, total, acc = [0], sum(weights), 0.0
    for w in weights[:-1]:
        acc += w
        cuts.append(max(cuts[-1] + 1, round(NUM_LAYERS * acc / total)))
    cuts.append(NUM_LAYERS)
    return [[cuts[i], cuts[i + 1]] for i in range(count)]


def base_record(name: str, rng: random.Random) -> dict:
    return dict(
        peer_id=peer_id(name), name=name, state="standby",
        ram_gb=round(rng.choice([8.0, 12.0, 16.0, 24.0, 32.0, 64.0]) * rng.uniform(0.6, 0.9), 1),
        bandwidth_mbps=round(rng.uniform(20, 900), 0), gflops=round(rng.uniform(150, 9000), 1),
        reachability=rng.choice(["direct", "direct", "relay"]), maddrs=[], version="0.1.0", time=START,
        cluster=None, stage=None, layers=None, step=None, loss=None, samples_per_s=None,
        plan_round=None, averaging_rounds=0, averaging_failures=0, rejected=0, note=None,
    )


def main() -> None:
    rng = random.Random(6)
    clusters = [list(c) for c in CLUSTERS]
    records = {name: base_record(name, rng) for name in [n for c in clusters for n in c] + SPARES + [NEWCOMER]}
    layers = {k: split_layers(len(c), rng) for k, c in enumerate(clusters)}
    rates = [rng.uniform(30, 90) for _ in clusters]
    plan_round = 3
    live = set(records) - {NEWCOMER}
    snapshots = []
    for i in range(SNAPSHOTS):
        at = START + i * PERIOD
        if i == 4:
            live.add(NEWCOMER)  # joins, measuring
        if i == 6:
            records["kiev-gtx1660"]["state"] = "leaving"  # Ctrl-C on a volunteer
        if i == 7:
            live.discard("kiev-gtx1660")
        if i == 8:
            clusters[1][1] = "porto-desktop"  # a spare takes the vacant stage
        if i == 10:
            live.discard("hanoi-laptop")  # crashed: its record just expires
        if i == 13:
            plan_round = 4
            clusters[2].append("lisbon-nuc")
            layers[2] = split_layers(len(clusters[2]), rng)
        averaging = i % 4 == 3 or i == SNAPSHOTS - 1
        placed = {name: (k, s) for k, c in enumerate(clusters) for s, name in enumerate(c)}
        for name in sorted(live):
            record = records[name]
            record["time"] = at - rng.uniform(0, 4)
            record["plan_round"] = plan_round if name in placed or name in SPARES else None
            if name == NEWCOMER:
                record["state"] = "joining" if i == 4 else "standby"
            if name not in placed:
                continue
            k, s = placed[name]
            record.update(cluster=k, stage=s, layers=layers[k][s])
            if record["state"] != "leaving":
                record["state"] = "averaging" if averaging else "training"
            rate = rates[k] * rng.uniform(0.93, 1.07)
            record["step"] = int(at - START) * int(rates[k]) // 3 + 40 * k
            record["samples_per_s"] = round(rate, 1)
            last = s == len(clusters[k]) - 1
            record["loss"] = round(1.6 + 2.9 * math.exp(-i / 6) + rng.uniform(-0.08, 0.08) + 0.05 * k, 4) \
                if last else None
            if i % 4 == 0 and i > 0:
                record["averaging_rounds"] += 1
            if i == 9 and name == "sao-paulo-pc":
                record["averaging_failures"] += 1
                record["note"] = "averaging step 2880: ring 1 timeout: 9f3kQz1c did not reach round 2880 within 20s"
            if i == 12 and name == "sao-paulo-pc":
                record["rejected"] += 1
                record["note"] = "refused in ring 1 at step 3840 the contribution of 9f3kQz1c: reduce chunk 0 holds NaN or Inf"
        plan = PlanRecord(round=plan_round, time=START, clusters=[
            [dict(peer_id=peer_id(name), layers=layers[k][s]) for s, name in enumerate(c)]
            for k, c in enumerate(clusters)]).dict()
        peers = []
        for name in sorted(live):
            record = PeerRecord.parse_obj(records[name]).dict()
            record["expires_in"] = round(10.0 - (at - record["time"]), 1)
            peers.append(record)
        snapshots.append(dict(at=at, peers=peers, plan=plan))
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "swarm_recording.json")
    with open(path, "w") as f:
        json.dump(dict(run="demo", snapshots=snapshots), f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {path}: {len(snapshots)} snapshots, {len(snapshots[-1]['peers'])} peers at the end")


if __name__ == "__main__":
    main()

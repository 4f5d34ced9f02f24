"""A volunteer's graceful leave: it serves the layers it trained until another peer holds them at its step.

It says ``leaving`` at once (with its layers and step), so the planners replace it at their next poll and the
replacement downloads from it (``Volunteer._fill_layers`` counts a leaving holder too). Bounded by
``handover_timeout`` and by a second Ctrl-C; nothing to wait for when no live peer is left to take them. If nobody
took them, a checkpoint keeps them, and it says how to resume. Where a standby may take our place, it also waits for
the stage's optimizer state to be taken (``stage_state.py``): another cluster that holds our layers has its own; once
the plan made since we left is in force and puts nobody new on our layers (:func:`new_takers`), it waits no more.
A layer that no other cluster of the plan we left trains (:func:`only_held_here`) counts as taken only once a copy of
it went out whole from us: a taker whose download failed trains on from its own weights and still says it
holds the layers at our step (it keeps in step with its cluster), and we would have gone with the run's only copy.
A stage that averages with other clusters took one last round before it stopped (``Volunteer._train_to_round``):
the partners that kept that round hold our work whatever their own step (:func:`took_last_round`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import time
from typing import Awaitable, Callable, Dict, List, Optional, Set, Tuple

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn

from ravnest_swarm.lifecycle import until_set
from ravnest_swarm.membership.announcer import PeerAnnouncer
from ravnest_swarm.pipeline.stage import StageWorker
from ravnest_swarm.swarm.placement import holders_of, staying
from ravnest_swarm.swarm.stage_averaging import LastRound

logger = logging.getLogger(__name__)

# where a leave that nobody took the layers from keeps them, when the volunteer has no --checkpoint-dir
LEAVE_CHECKPOINT_DIR = os.path.join(os.path.expanduser("~"), ".local", "share", "ravnest-swarm")


def only_held_here(plan: Optional[dict], start: int, end: int, own_id: str) -> Set[int]:
    """The layers of ``start:end`` that no other peer of ``plan`` trains (the plan we left: read from it, not from
    records, where the taker soon says it holds them whether its download worked or not)."""
    others = [stage["layers"] for cluster in (plan or {}).get("clusters", []) for stage in cluster
              if stage["peer_id"] != own_id]
    return {layer for layer in range(start, end) if not any(first <= layer < last for first, last in others)}


def new_takers(plan: dict, layers: Tuple[int, int], peers: List[Dict], own_id: str) -> List[str]:
    """The peers ``plan`` puts on ``layers`` that did not train them already (by their ``peers`` records): who may yet
    take a leaver's optimizer state. A standby placed there downloads first; its record names the place only later."""
    trained = {p["peer_id"] for p in peers if p["state"] in ("training", "averaging", "done")
               and p.get("layers") == list(layers)}
    return [stage["peer_id"] for cluster in plan["clusters"] for stage in cluster
            if tuple(stage["layers"]) == tuple(layers) and stage["peer_id"] not in trained | {own_id}]


def took_last_round(record: Dict, last_round: Optional[LastRound]) -> bool:
    """Whether a partner's ``record`` took a leaver's ``last_round`` into its stage: it keeps that round's average
    (said only where every ring of its own averaged) of the layers the round's plan gave it, and is not leaving
    after that round itself (two partners that left together each counted the other, and both went)."""
    if last_round is None or record["peer_id"] not in last_round.partners:
        return False
    return (last_round.label in (record.get("kept_rounds") or []) and record.get("leaving_after_round") is None
            and tuple(record.get("layers") or ()) == last_round.partners[record["peer_id"]])


async def hand_over(announcer: PeerAnnouncer, worker: StageWorker, name: str, console: Console, timeout: float,
                    leave_now: asyncio.Event, checkpoint_path: Optional[str],
                    save: Callable[[StageWorker, str], bool], address: str,
                    state_awaited: Optional[Callable[[List[Dict], Optional[Set[str]]], Awaitable[bool]]] = None,
                    served: Optional[Callable[[], Dict[Tuple[str, int], int]]] = None,
                    ours_alone: Set[int] = frozenset(),
                    planned: Optional[Callable[[], Awaitable[Set[str]]]] = None,
                    last_round: Optional[LastRound] = None) -> None:
    """Keep serving ``worker``'s layers until another peer's record holds them at its step, for up to ``timeout``
    seconds or until ``leave_now``; else keep them in ``checkpoint_path`` (already written by the volunteer; None
    where that write failed), or write one with ``save`` (whether it could) under :data:`LEAVE_CHECKPOINT_DIR`, and
    say how to resume (``address``: the run's,
    ``name@owner``, as a joiner gives it). ``await state_awaited(peers, placed)``: whether to wait on, the layers
    held, for a peer to take the stage's optimizer state (a standby that the next plan may put in our place; in a run of
    several clusters another cluster holds our layers at once, and our AdamW moments and outer state would go
    with us). ``served()``: how many times each layer went out whole from our state server, by (requester, layer);
    ``ours_alone``: the layers nobody else held (:func:`only_held_here`), taken only once each went out whole.
    ``await planned()``: the peers a plan places (the one we left, the one in force): only they take our layers, and
    only their downloads and fetches of the optimizer state count (``placed``, read once a look). A stranger's own
    record can claim any layers at any step, and its download goes out whole like anyone's: one took a leave over,
    and the leaver went with the run's only copy (a hostile review). ``last_round``: the round our leave took
    (``Volunteer._train_to_round``), where it averaged: a partner of it whose record keeps that round on the layers
    the plan gave it (:func:`took_last_round`) holds our work in its average, whatever its own step (another
    cluster counts its own steps)."""
    say = lambda text: console.print(text, markup=False, highlight=False, soft_wrap=True)  # noqa: E731
    start, end, step = worker.start_layer, worker.end_layer, worker.version
    announcer.update(state="leaving", cluster=-1, stage=None, layers=[start, end], step=step, samples_per_s=None)
    await announcer.renew()
    # the bar below shows only on a terminal; logs get this line
    say(f"{name}: handing over layers {start}:{end} (step {step}): waiting for a peer to take them "
        f"(Ctrl-C again to leave now)")
    taker: Optional[List[str]] = None
    served_before = dict(served()) if served is not None else {}
    started = time.monotonic()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[left]}"),
                  console=console, transient=True) as progress:
        task = progress.add_task(f"{escape(name)}: handing over", total=timeout, left="")
        while not leave_now.is_set():
            elapsed = time.monotonic() - started
            if elapsed >= timeout:
                break
            progress.update(task, completed=elapsed, left=f"{timeout - elapsed:.0f}s left")
            try:
                peers = [p for p in await announcer.read_peers() if p["peer_id"] != announcer.peer_id]
            except Exception as e:  # a DHT hiccup: look again, the timeout still bounds the wait
                logger.warning(f"reading the peer records while handing over failed: {e}")
                peers = None
            placed = None
            if peers is not None and planned is not None:
                try:
                    placed = await planned()
                except Exception as e:  # no plan read: look again
                    logger.warning(f"reading the plan while handing over failed: {e}")
                    peers = None
            if peers is not None:
                taker = holders_of([dict(p, step=max(p.get("step") or 0, step)) if took_last_round(p, last_round)
                                    else p for p in peers if placed is None or p["peer_id"] in placed],
                                   start, end, step)
                if taker is not None and served is not None and any(
                        _went_out(served(), layer, placed) <= _went_out(served_before, layer, placed)
                        for layer in ours_alone):
                    taker = None  # their records say they hold our layers, but none of ours alone went out whole
                awaited = taker is not None and state_awaited is not None and await state_awaited(peers, placed)
                # a peer training on to its last round before it leaves takes nothing either: counted as staying,
                # it kept every hand-over of a whole swarm stopped at once waiting
                if (taker is not None and not awaited) or not any(staying(p) for p in peers):
                    break  # handed over, or nobody is left who could take them
            await until_set(leave_now.wait(), leave_now, timeout=1.0)
    if taker is not None:
        say(f"{name}: layers {start}:{end} handed over at step {step} to {', '.join(taker)}")
        return
    path = checkpoint_path
    if path is None:
        path = os.path.join(LEAVE_CHECKPOINT_DIR, f"{announcer.run}-{name}.safetensors")
        if not save(worker, path):
            say(f"{name}: nobody took layers {start}:{end} (step {step}), and they could not be saved (said above)")
            return
    say(f"{name}: nobody took layers {start}:{end} (step {step}); they are saved in {path}: bring them back with "
        f"`ravnest-swarm join ... --run {address} --name {shlex.quote(name)} --checkpoint-dir "
        f"{shlex.quote(os.path.dirname(path))} --resume`")


def _went_out(served: Dict[Tuple[str, int], int], layer: int, placed: Optional[Set[str]]) -> int:
    """How many times ``layer`` went out whole to the peers in ``placed`` (to anyone where None)."""
    return sum(count for (requester, served_layer), count in served.items()
               if served_layer == layer and (placed is None or requester in placed))

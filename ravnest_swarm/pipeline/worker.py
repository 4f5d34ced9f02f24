"""The stage worker: one stage of one cluster's pipeline, from start to shutdown.

It puts together the parts a stage is made of: its compute (``compute.py``: layers, optimizer, the one
compute thread), its scheduling (``scheduler.py``: queues, microbatches in flight, the loop), its
messaging (``messaging.py``: handlers in, sends out), and its endpoint in the DHT (``endpoints.py``),
renewed every heartbeat so neighbours can find it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Dict, List, Optional

from hivemind.dht.node import DHTNode

from ravnest_swarm.models import ShardedSampler, load_model
from ravnest_swarm.pipeline.compute import StageCompute
from ravnest_swarm.pipeline.config import Neighbours, StageConfig, check_config
from ravnest_swarm.pipeline.endpoints import publish_endpoint
from ravnest_swarm.pipeline.messaging import Inbox, Outbox
from ravnest_swarm.pipeline.counters import BusyTime, Counters, WallTime
from ravnest_swarm.pipeline.scheduler import Scheduler

logger = logging.getLogger(__name__)


class StageFailed(RuntimeError):
    """A stage worker's loop, heartbeat or watchdog ended on an exception."""


class StageWorker:
    """Serves one stage: P2P handlers, a forward and a backward queue, one compute thread, background sends.

    :param config: the stage's settings
    :param node: a started DHT node with the run's validators
    :param wall_time: where the stage's compute, sends and waits for its neighbours are charged (a volunteer's, which
        outlives its workers); by default one of its own
    """

    def __init__(self, config: StageConfig, node: DHTNode, wall_time: Optional[WallTime] = None):
        check_config(config)
        self.config, self.node = config, node
        self.spec = load_model(config.model, config.model_config, config.data)
        self.start_layer, self.end_layer = config.layers
        self.compute = StageCompute(config, self.spec)
        # what others read of the compute: a volunteer loads and averages the module's weights in place
        self.module, self.optimizer, self.device = self.compute.module, self.compute.optimizer, self.compute.device
        self.autocast_dtype, self.precision_note = self.compute.autocast_dtype, self.compute.precision_note
        dataset = self.spec.dataset()
        sampler = ShardedSampler(dataset.size, config.cluster, config.clusters, config.microbatch_size, config.seed)
        self.counters = Counters()
        busy = self.busy = BusyTime(self.counters, wall_time)
        self.outbox = Outbox(config, node, self.counters, busy)
        self.scheduler = Scheduler(config, self.compute, self.counters, busy, self.outbox.send,
                                   dataset if config.stage == 0 else None, sampler)
        self.inbox = Inbox(config, self.scheduler, self.spec.layers[self.start_layer], dataset.targets)
        self.pending, self.finished = self.scheduler.pending, self.scheduler.finished
        self.resumed_at = 0  # the step this worker started from (resume_at)
        self.clusters_since = 0  # the step from which it has trained among config.clusters (resume_at, follow_clusters)
        self._tasks: List[asyncio.Task] = []
        # what ended one of its tasks (a bug, or a user model's hook that raised): the stage trains no more, and
        # its volunteer raises it rather than stand still in the run with a live record
        self.failure: Optional[StageFailed] = None

    @property
    def version(self) -> int:
        """Optimizer steps this stage has taken (counted from where it resumed, or from its cluster's step)."""
        return self.compute.version

    @property
    def between_steps(self) -> Optional[Callable[[int], Awaitable[None]]]:
        """Awaited with the step whenever the weights changed, while no compute runs (see Scheduler)."""
        return self.scheduler.between_steps

    @between_steps.setter
    def between_steps(self, hook: Optional[Callable[[int], Awaitable[None]]]) -> None:
        self.scheduler.between_steps = hook

    @property
    def print_progress(self) -> bool:
        return self.scheduler.print_progress

    @print_progress.setter
    def print_progress(self, value: bool) -> None:
        self.scheduler.print_progress = value

    async def start(self) -> None:
        self.mark_restore_point("the layers it started from")  # loaded by now: what a divergence goes back to first
        await self.inbox.add_handlers(self.node)
        await self._publish()
        self._tasks = [asyncio.create_task(coroutine) for coroutine in
                       (self._heartbeat(), self.scheduler.run(), self.scheduler.watchdog())]
        for task in self._tasks:
            task.add_done_callback(self._task_ended)

    def _task_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            error = task.exception()
            self.failure = StageFailed(f"stage {self.config.stage} (layers {self.start_layer}:{self.end_layer}) "
                                       f"stopped on {type(error).__name__}: {' '.join(str(error).split())}")
            logger.debug(str(self.failure), exc_info=error)  # the traceback for --verbose; the volunteer says the line

    def resume_at(self, step: int) -> None:
        """Continue a run at optimizer step ``step`` (weights loaded by the caller): stage 0 goes on with the
        data stream where that step left it and injects only the microbatches still to train."""
        self.resumed_at = self.clusters_since = self.compute.version = self.scheduler.hooked_version = step
        if self.config.stage == 0:
            self.counters.injected = min(step, self.config.microbatches)

    def mark_restore_point(self, source: str) -> None:
        """What a divergence restores from now on: the layers as they are (``StageCompute.mark_restore_point``).
        Called while no compute runs: before the start, or from the ``between_steps`` hook."""
        self.compute.mark_restore_point(source)

    def follow_neighbours(self, neighbours: Neighbours) -> None:
        """Take messages from, and send to, the peers a new plan puts beside this stage (a standby that replaced
        a dead neighbour): the handlers and the endpoint resolution read them at every message."""
        if neighbours == self.config.neighbours:
            return
        logger.info(f"stage {self.config.stage}: neighbours now {neighbours.previous} (before) and "
                    f"{neighbours.next} (after)")
        before, self.config.neighbours = self.config.neighbours, neighbours
        if neighbours.previous != before.previous:
            self.scheduler.sender_replaced()
        if neighbours.next != before.next:
            self.scheduler.receiver_replaced()

    async def follow_clusters(self, cluster: int, clusters: int) -> None:
        """Go on as cluster ``cluster`` of ``clusters`` (a new plan added, dropped or renumbered clusters and kept
        this stage in place): stage 0 draws that cluster's share of the data from the next microbatch it injects,
        and the volunteer's lr rule reads ``config.clusters`` at the next optimizer step. A new number is our
        endpoint's key from now on, published at once; messages naming the old one are still taken (a neighbour
        adopts the plan a moment later, and its messages in flight name it), and ours name the new one (one that
        has not adopted it yet refuses them, and our sends retry)."""
        config = self.config
        if clusters != config.clusters:
            self.clusters_since = self.version
        renumbered = cluster != config.cluster
        if renumbered:
            logger.info(f"stage {config.stage}: cluster {config.cluster} is cluster {cluster} now")
            config.previous_cluster, config.cluster = config.cluster, cluster
            self.outbox.resolver.cluster = cluster
        if renumbered or clusters != config.clusters:
            config.clusters, sampler = clusters, self.scheduler.sampler
            self.scheduler.sampler = ShardedSampler(sampler.size, cluster, clusters, sampler.microbatch_size,
                                                    sampler.seed)
        if renumbered and self._tasks:  # started: neighbours that resolve us again find us under the new number
            try:
                await self._publish()
            except Exception as e:  # the heartbeat publishes it again
                logger.warning(f"publishing the stage endpoint under cluster {cluster} failed: {e}")

    async def shutdown(self) -> None:
        # inbound streams outlive their handler's removal: left open, a sender's long-lived stream would go
        # on delivering into this stopped worker (the volunteer starts another worker on the same peer when a
        # plan moves it); closed, the sender re-resolves the stage and resends
        self.inbox.stopped = True
        tasks = self._tasks + list(self.scheduler.sends) + list(self.inbox.serving)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.outbox.aclose()
        await self.inbox.remove_handlers(self.node)
        self.compute.close()

    async def _publish(self) -> None:
        config = self.config
        if not await publish_endpoint(self.node, config.run, config.cluster, config.stage, config.model,
                                      config.layers, self.version, 3 * config.heartbeat):
            logger.warning("no DHT node accepted our stage endpoint; retrying next heartbeat")

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat)
            try:
                await self._publish()
            except Exception as e:  # a transient DHT error must not stop the renewals
                logger.warning(f"renewing the stage endpoint failed: {e}")

    def status(self) -> Dict:
        """The counters the ``status`` handler answers with."""
        return self.inbox.status().as_metadata()

    def report(self) -> Dict:
        c, traffic = self.counters, self.node.routes.traffic
        return dict(self.status(), layers=list(self.config.layers), schedule=self.config.schedule,
                    mode=self.config.mode, microbatch_size=self.config.microbatch_size, losses=c.losses,
                    routes=dict(self.node.routes.counts), bytes_sent=dict(c.bytes_sent), codec=self.config.compression,
                    codecs={handler.rsplit(".", 1)[-1]: link.current for handler, link in self.outbox.codecs.items()},
                    codec_switches=c.codec_switches, time_shares=self.busy.wall_time.shares(),
                    traffic=dict(sent=dict(traffic.sent), received=dict(traffic.received)),
                    inject_times=c.inject_times, complete_times=c.complete_times, busy=c.busy,
                    compute=c.compute, trace=c.trace)

    def save(self, path: str) -> None:
        """The stage's parameters as safetensors, named by their layer index in the whole model."""
        self.compute.save(path)

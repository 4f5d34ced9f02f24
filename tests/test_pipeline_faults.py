"""Bad input to a real stage's handlers, and a neighbour that disappears mid-run."""

import asyncio
import dataclasses
import logging
import time

import pytest
import torch
from hivemind.p2p import P2P, P2PHandlerError
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.proto.runtime_pb2 import CompressionType
from hivemind.utils.streaming import split_for_streaming
from hivemind.utils.timed_storage import get_dht_time

from pipeline_helpers import read_report, start_stages, wait_all
from waiting import wait_until_async
from ravnest_swarm.codecs import blockwise
from ravnest_swarm.membership.records import (StageEndpoint, make_validators, signing_validator, stage_subkey_prefix,
                                              stages_key, start_peer_node)
from ravnest_swarm.pipeline import wire
from ravnest_swarm.pipeline.config import Neighbours
from ravnest_swarm.pipeline.endpoints import EndpointResolver
from ravnest_swarm.pipeline.stage import StageConfig, StageWorker
from ravnest_swarm.net.node import parse_maddrs, start_node, stop_node
from ravnest_swarm.net.transport import make_request, unpack_metadata

RUN = "faults"
MLP_RANGES = [(0, 3), (3, 6), (6, 9)]


async def call(node, peer_id, handler, metadata, tensors=(), frames=None):
    frames = frames or wire.encode(metadata, list(tensors))
    response = await node.p2p.call_protobuf_handler(peer_id, handler, wire.as_stream(frames), runtime_pb2.ExpertResponse)
    return unpack_metadata(response.metadata)


def framed(metadata, parts):
    """A message's frames as ``wire.encode`` makes them: the metadata and the first chunk, then a chunk a frame."""
    return [make_request(metadata, parts[:1])] + [runtime_pb2.ExpertRequest(tensors=[part]) for part in parts[1:]]


async def raw_call(node, peer_id, handler, payload: bytes):
    """Write raw bytes to the handler's stream and read its one reply frame."""
    _, reader, writer = await node.p2p.call_binary_stream_handler(peer_id, handler)
    writer.write(payload)
    try:
        await writer.drain()
    except ConnectionError:
        pass  # the stage may answer and close before our last byte is out; its answer is still there
    response, error = await asyncio.wait_for(P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader), 20)
    writer.close()
    return error.message if error is not None else unpack_metadata(response.metadata)


async def status(node, peer_id):
    response = await node.p2p.call_protobuf_handler(peer_id, wire.STATUS, make_request({}), runtime_pb2.ExpertResponse)
    return unpack_metadata(response.metadata)


def forward_metadata(microbatch=1, count=4, stage=1, **overrides):
    return dict(dict(run=RUN, cluster=0, stage=stage, microbatch=microbatch, sample_ids=list(range(count)),
                     version=0), **overrides)


def backward_metadata(microbatch, stage=1):
    return dict(run=RUN, cluster=0, stage=stage, microbatch=microbatch, version=0)


@pytest.mark.timeout(200)
def test_bad_input_gets_a_clear_error_and_the_stage_keeps_serving(processes, backbone, tmp_path):
    # stage 1 of 3 alone: we play stage 0, and stage 2 never exists
    stage = start_stages(processes, backbone, "mlp-digits", MLP_RANGES, str(tmp_path), run=RUN, skip=(0, 2),
                         extra=["--max-message-mb", "1", "--send-timeout", "3"])[1]
    stage.wait_for_output(r"serving layers", 120)

    async def scenario():
        node = await start_node(parse_maddrs([backbone]), record_validators=make_validators(RUN),
                                host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            peer = await EndpointResolver(node, RUN, 0).resolve(1)
            good_x, targets = torch.randn(4, 64), torch.zeros(4, dtype=torch.long)
            errors = {}
            for label, metadata, tensors in [
                ("shape", forward_metadata(), [torch.randn(4, 7), targets]),
                ("dtype", forward_metadata(), [good_x.double(), targets]),
                ("address", forward_metadata(stage=2), [good_x, targets]),
                ("ids", forward_metadata(sample_ids="nope"), [good_x, targets]),
                ("size", forward_metadata(), [torch.randn(4, 100_000), targets]),
                ("metadata size", forward_metadata(padding="x" * 70_000), [good_x, targets]),
            ]:
                with pytest.raises(P2PHandlerError) as caught:
                    await call(node, peer, wire.FORWARD, metadata, tensors)
                errors[label] = str(caught.value)
            with pytest.raises(P2PHandlerError) as caught:
                await call(node, peer, wire.BACKWARD, backward_metadata(999), [torch.randn(4, 64)])
            errors["unknown id"] = str(caught.value)
            # an 8-bit codec's lookup table is the sender's to choose: refused, as is a codec on the integer targets
            for label, x_codec, targets_codec in [("8-bit", CompressionType.UNIFORM_8BIT, CompressionType.NONE),
                                                  ("int codec", CompressionType.NONE, CompressionType.FLOAT16)]:
                tensors = [serialize_torch_tensor(good_x, x_codec), serialize_torch_tensor(targets)]
                tensors[1].compression = targets_codec  # hivemind itself would not compress integers
                parts = [part for tensor in tensors for part in split_for_streaming(tensor, wire.CHUNK_BYTES)]
                with pytest.raises(P2PHandlerError) as caught:
                    await call(node, peer, wire.FORWARD, None, frames=framed(forward_metadata(), parts))
                errors[label] = str(caught.value)
            # a blockwise codec's payload whose count, length or scales lie (codecs/blockwise.py): refused, counted
            good_payload = blockwise.quantize(good_x, 4)
            lying_count, nan_scale = good_payload.clone(), good_payload.clone()
            lying_count[:4] = torch.tensor(list((10 ** 6).to_bytes(4, "little")), dtype=torch.uint8)
            nan_scale[4:6] = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8)
            for label, payload in [("int4 count", lying_count), ("int4 scale", nan_scale),
                                   ("int4 length", good_payload[:-1]), ("int4 as int8", blockwise.quantize(good_x, 8))]:
                parts = [part for tensor in (payload, targets)
                         for part in split_for_streaming(serialize_torch_tensor(tensor), wire.CHUNK_BYTES)]
                with pytest.raises(P2PHandlerError) as caught:
                    await call(node, peer, wire.FORWARD, None, frames=framed(forward_metadata(codec="int4"), parts))
                errors[label] = str(caught.value)
            errors["garbage marker"] = await raw_call(node, peer, wire.FORWARD, b"\x07 this is not a frame at all")
            errors["garbage frame"] = await raw_call(node, peer, wire.BACKWARD, b"\x00" + (9).to_bytes(8, "big") + b"\xff" * 9)
            bad_msgpack = runtime_pb2.ExpertRequest(metadata=b"\xc1\xc1garbage").SerializeToString()
            end_of_stream = P2P.ERROR_MARKER + (0).to_bytes(8, "big")
            errors["garbage metadata"] = await raw_call(
                node, peer, wire.FORWARD, b"\x00" + len(bad_msgpack).to_bytes(8, "big") + bad_msgpack + end_of_stream)
            # a message that never ends is refused after the stage's timeout, not waited on forever (its metadata
            # passes: one that does not is refused as it arrives, before the rest is read)
            opening = make_request(forward_metadata(microbatch=6)).SerializeToString()
            errors["no end"] = await raw_call(node, peer, wire.FORWARD, b"\x00" + len(opening).to_bytes(8, "big") + opening)

            assert "activations has shape [4, 7]" in errors["shape"]
            assert "float64" in errors["dtype"] and "expected [4, 64] float32" in errors["dtype"]
            assert "this is run 'faults' cluster 0 stage 1" in errors["address"]
            assert "sample_ids" in errors["ids"]
            assert "exceeds the 1048576-byte limit" in errors["size"]
            assert "exceeds the 65536-byte limit" in errors["metadata size"]
            assert "unknown microbatch id 999" in errors["unknown id"]
            assert "compressed as UNIFORM_8BIT; expected [4, 64] float32 compressed as NONE" in errors["8-bit"]
            assert "compressed as FLOAT16; expected [4] uint8 or int16 or int32 or int64 compressed as NONE" in errors["int codec"]
            assert "says it holds 1000000 values" in errors["int4 count"]
            assert "scale that is negative, NaN or infinite" in errors["int4 scale"]
            assert "expected [140] uint8" in errors["int4 length"] and "expected [140] uint8" in errors["int4 as int8"]
            assert "frame marker" in errors["garbage marker"]
            assert "not an ExpertRequest protobuf" in errors["garbage frame"]
            assert "not valid msgpack" in errors["garbage metadata"]
            assert "no end of stream" in errors["no end"]

            # still serving: a well-formed microbatch is accepted ...
            assert (await call(node, peer, wire.FORWARD, forward_metadata(microbatch=5), [good_x, targets]))["ok"]
            # ... and, with no stage 2 anywhere, explicitly dropped and counted once its send gives up
            for _ in range(60):
                counters = await status(node, peer)
                if counters["dropped"]:
                    break
                await asyncio.sleep(0.5)
            # refused for where or when they came (the address, an unknown id, no end), not for what they hold
            assert counters["turned_away"] == 3 and counters["rejected"] == len(errors) - 3
            assert counters["forwards"] == 1 and counters["dropped"] == 1
        finally:
            await stop_node(node)

    asyncio.run(scenario())
    log = stage.stderr()
    assert log.count("rejected") >= 13 and "dropped microbatch 5" in log


@pytest.mark.timeout(240)
def test_a_replaced_neighbour_is_re_resolved_and_nothing_is_lost_silently(processes, backbone, tmp_path):
    # enough that stage 0 is still training when the test first looks: an idle machine ran 150 in about a second
    total = 1500
    ranges = [(0, 5), (5, 9)]
    common = ["--microbatches", str(total), "--microbatch-size", "8", "--max-in-flight", "2",
              "--microbatch-timeout", "4", "--send-timeout", "60"]
    stages = start_stages(processes, backbone, "mlp-digits", ranges, str(tmp_path), run=RUN, extra=common)
    first = stages[0]
    for process in stages.values():
        process.wait_for_output(r"serving layers", 120)

    async def progress():
        node = await start_node(parse_maddrs([backbone]), record_validators=make_validators(RUN),
                                host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True)
        try:
            resolver, deadline = EndpointResolver(node, RUN, 0), time.monotonic() + 30
            while True:
                try:
                    peer = await resolver.resolve(0)
                    break
                except LookupError:  # a DHT node too busy to answer in time leaves the record out of that read
                    assert time.monotonic() < deadline, "stage 0's endpoint was never found in the DHT"
                    await asyncio.sleep(0.5)
            for _ in range(240):
                counters = await status(node, peer)
                if counters["completed"] >= 10:
                    return counters
                await asyncio.sleep(0.25)
            raise AssertionError(f"stage 0 made no progress: {counters}")
        finally:
            await stop_node(node)

    before = asyncio.run(progress())
    stages[1].kill_group()  # the neighbour disappears without a word
    replacement = start_stages(processes, backbone, "mlp-digits", ranges, str(tmp_path), run=RUN, skip=(0,),
                               extra=common)
    wait_all({0: first, 1: replacement[1]}, 120)
    report = read_report(str(tmp_path), 0)
    assert before["completed"] < total
    # every microbatch is accounted for: it completed, or it was dropped with a count and a log line, and another
    # took its place: the run still takes all its steps
    assert report["completed"] == total and report["injected"] == total + report["dropped"]
    assert report["completed"] > before["completed"] and report["resends"] >= 1
    assert read_report(str(tmp_path), 1)["forwards"] >= 1
    log = first.stderr()
    assert "re-resolving the endpoint" in log and "stage 1 moved to" in log
    assert log.count("dropped microbatch") == report["dropped"]


@pytest.mark.timeout(180)
def test_a_stage_that_moved_refuses_as_misaddressed_and_the_sender_resends_to_its_successor(backbone, caplog):
    """A volunteer moved to another slot by a new plan keeps its peer id but refuses messages meant for
    its old stage. Its former neighbour, still holding the old endpoint, re-resolves on that refusal and
    resends instead of dropping the microbatch; once the stage's new peer publishes, traffic goes there.
    Only the microbatches the moved worker held when it stopped are dropped (counted, and replaced)."""
    run, total, in_flight = "moved", 120, 2
    ranges = [(0, 5), (5, 9)]

    def config(cluster, stage):
        return StageConfig(run=run, cluster=cluster, clusters=2, stage=stage, stages=2, model="mlp-digits",
                           layers=ranges[stage], microbatches=total, microbatch_size=8, max_in_flight=in_flight,
                           microbatch_timeout=4, send_timeout=60, heartbeat=5)

    async def scenario():
        nodes = [await start_peer_node(parse_maddrs([backbone]), run, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
                 for _ in range(3)]
        workers = []
        try:
            first, moving = StageWorker(config(0, 0), nodes[0]), StageWorker(config(0, 1), nodes[1])
            workers += [first, moving]
            for worker in workers:
                await worker.start()
            await wait_until_async(lambda: first.counters.completed >= 10, 60, "no progress before the move")
            # a new plan moves peer 1 to stage 1 of cluster 1; a third peer takes cluster 0's stage 1 later
            await moving.shutdown()
            workers.remove(moving)
            moved = StageWorker(config(1, 1), nodes[1])
            workers.append(moved)
            await moved.start()
            await wait_until_async(lambda: moved.counters.turned_away >= 1, 30, "the moved stage turned nothing away")
            successor = StageWorker(config(0, 1), nodes[2])
            workers.append(successor)
            await successor.start()
            await asyncio.wait_for(first.finished.wait(), 120)
            return first.counters, moved.counters, successor.counters
        finally:
            await shutdown(workers, nodes)

    torch.set_num_threads(1)
    with caplog.at_level(logging.WARNING, logger="ravnest_swarm.pipeline"):
        first, moved, successor = asyncio.run(scenario())
    assert first.completed == total and first.injected == total + first.dropped and successor.forwards >= 1
    assert first.dropped <= in_flight  # the misaddressed messages were resent, not dropped
    assert first.resends >= moved.turned_away >= 1
    assert moved.rejected == 0  # a message for the slot it left is no malformed input
    assert any("but this is run 'moved' cluster 1 stage 1" in r.message and "re-resolving the endpoint" in r.message
               for r in caplog.records)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage1_step", [10, 40], ids=["behind", "ahead"])
def test_a_stage_resumed_at_another_step_counts_steps_as_stage_0_and_ends_with_it(backbone, stage1_step):
    """Stages checkpoint separately, so a resumed cluster's stages can start from different steps. Stage 0
    resumes at step 30 of 50, stage 1 at ``stage1_step``: stage 1 takes stage 0's count from its first
    microbatch, so both train the same 20 steps and end at step 50 (before, stage 1 ended at 50 + the
    difference, or short of 50)."""
    run, total, resumed_at = "resumed", 50, 30

    def config(stage):
        return StageConfig(run=run, stage=stage, stages=2, model="mlp-digits", layers=[(0, 5), (5, 9)][stage],
                           microbatches=total, microbatch_size=8, max_in_flight=2, send_timeout=30, heartbeat=5)

    def resume(workers):
        workers[0].resume_at(resumed_at)
        workers[1].resume_at(stage1_step)

    torch.set_num_threads(1)
    (first_version, first), (second_version, second) = asyncio.run(train_two_stages(backbone, run, config, resume))
    assert first.injected == total and first.completed == total - resumed_at and first.dropped == 0
    assert second.backwards == total - resumed_at
    assert first_version == second_version == total


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pausing", ["stage 1", "both stages"])
def test_a_run_reaches_its_length_in_steps_whatever_stage_0_drops(backbone, caplog, pausing):
    """A volunteer averages between steps, and an averaging round can wait half a minute for a slower cluster.
    Here stage 1 (or both stages, as when both average at the same step) pauses at step 10 for longer than stage
    0's ``microbatch_timeout``. Stage 1 alone: stage 0 drops the microbatches it has in flight, stage 1 still
    steps on them when it resumes (their gradients are then refused), stage 0 draws others in their place, and
    both stages end at the run's length, stage 1 at stage 0's count (before, every drop was a step the run never
    took: a volunteer run ended a step short and was never finished; test_run_length saw it). Both: stage 0's
    wait for a gradient resumes with it, and nothing is dropped."""
    run, total, pause_at, pause_seconds = "steps", 40, 10, 5.0

    def config(stage):
        return StageConfig(run=run, stage=stage, stages=2, model="mlp-digits", layers=[(0, 5), (5, 9)][stage],
                           microbatches=total, microbatch_size=8, max_in_flight=2, microbatch_timeout=2,
                           send_timeout=30, heartbeat=5)

    async def pause_between_steps(step):
        if step == pause_at:
            await asyncio.sleep(pause_seconds)

    def pause(workers):
        for worker in workers[1:] if pausing == "stage 1" else workers:
            worker.between_steps = pause_between_steps

    torch.set_num_threads(1)
    with caplog.at_level(logging.INFO, logger="ravnest_swarm.pipeline"):
        (first_version, first), (second_version, second) = asyncio.run(train_two_stages(backbone, run, config, pause))
    assert first_version == second_version == total and first.completed == total
    assert first.injected == total + first.dropped
    said = [r.message for r in caplog.records if f"ends at step {total}, as stage 0 counts" in r.message]
    if pausing == "stage 1":
        assert first.dropped >= 1 and second.backwards > total, (first.dropped, second.backwards)
        assert said == [f"stage 1: ends at step {total}, as stage 0 counts (its own count was {second.backwards})"]
    else:
        assert first.dropped == 0 and second.backwards == total and said == []


@pytest.mark.timeout(120)
def test_a_hook_that_raises_ends_the_stage_with_one_line_that_names_it(backbone):
    """A user model without parameters in a layer once made the averaging hook raise at step 1: the scheduler's task
    ended without a word, the stage stood still in the run with a live record, and the run said "nothing else
    failed". Now the worker keeps what ended it, one line naming the stage and the error, for its volunteer to
    raise (``Volunteer.run_until``)."""
    run, total = "hook", 40

    def config(stage):
        return StageConfig(run=run, stage=stage, stages=2, model="mlp-digits", layers=[(0, 5), (5, 9)][stage],
                           microbatches=total, microbatch_size=8, max_in_flight=2, send_timeout=30, heartbeat=5)

    async def raise_at_step(step):
        if step == 3:
            raise ValueError("layer sizes must be positive,\ngot 0")

    async def scenario():
        nodes = [await start_peer_node(parse_maddrs([backbone]), run, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
                 for _ in range(2)]
        workers = [StageWorker(config(0), nodes[0]), StageWorker(config(1), nodes[1])]
        try:
            workers[1].between_steps = raise_at_step
            for worker in workers:
                await worker.start()
            await wait_until_async(lambda: workers[1].failure is not None, 60, "stage 1 failed")
            return [worker.failure for worker in workers], workers[1].version
        finally:
            await shutdown(workers, nodes)

    torch.set_num_threads(1)
    (first, second), version = asyncio.run(scenario())
    assert first is None and version == 3
    assert str(second) == "stage 1 (layers 5:9) stopped on ValueError: layer sizes must be positive, got 0"


async def train_two_stages(backbone, run, config, prepare):
    """Stage 0 and stage 1 of ``run`` (``config(stage)``), each on a DHT node of its own, until the run ends;
    ``prepare(workers)`` sets them up before they start. Each stage's final step and counters."""
    nodes = [await start_peer_node(parse_maddrs([backbone]), run, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
             for _ in range(2)]
    workers = [StageWorker(config(0), nodes[0]), StageWorker(config(1), nodes[1])]
    try:
        prepare(workers)
        for worker in workers:
            await worker.start()
        await asyncio.wait_for(workers[0].finished.wait(), 90)
        await asyncio.wait_for(workers[1].finished.wait(), 30)
        return [(worker.version, worker.counters) for worker in workers]
    finally:
        await shutdown(workers, nodes)


async def shutdown(workers, nodes):
    """Stop in-process stage workers, then their DHT nodes (and p2pd)."""
    for worker in workers:
        await worker.shutdown()
    for node in nodes:
        await stop_node(node)


# ---- without a network: who a stage takes messages from, and microbatches whose compute fails -------------------


def peer_ids(directory, count):
    """``count`` libp2p peer ids of fresh identities (hivemind writes a new key file), without starting p2pd."""
    from hivemind.p2p import PeerID

    ids = []
    for index in range(count):
        path = str(directory / f"identity{index}.key")
        P2P.generate_identity(path)
        with open(path, "rb") as f:
            ids.append(PeerID.from_identity(f.read()))
    return ids


def test_a_plan_names_each_stages_neighbours_and_a_stage_takes_messages_only_from_them(tmp_path):
    """``neighbours_in`` reads a stage's two neighbours from the plan (none before stage 0 or after the last);
    the inbox refuses a forward from anyone but the previous one and a gradient from anyone but the next one,
    in one line naming who it takes them from, and a stage that names no neighbours takes any sender. A refused
    peer of the run (one of us follows a plan the other has not adopted yet) is counted as turned away, a stranger
    as hostile input."""
    from ravnest_swarm.pipeline.config import Neighbours
    from ravnest_swarm.pipeline.messaging import NOT_A_NEIGHBOUR, NOT_YET
    from ravnest_swarm.pipeline.wire import MessageError
    from ravnest_swarm.swarm.placement import neighbours_in

    a, b, c, stranger = peer_ids(tmp_path, 4)
    plan = dict(round=3, clusters=[[dict(peer_id=a.to_base58(), layers=[0, 3]), dict(peer_id=b.to_base58(), layers=[3, 6]),
                                    dict(peer_id=c.to_base58(), layers=[6, 9])]])
    assert neighbours_in(plan, 0, 0) == Neighbours(previous=None, next=b.to_base58())
    assert neighbours_in(plan, 0, 1) == Neighbours(previous=a.to_base58(), next=c.to_base58())
    assert neighbours_in(plan, 0, 2) == Neighbours(previous=b.to_base58(), next=None)

    known = {peer.to_base58() for peer in (a, b, c)}  # the records the volunteer's planning rounds read
    worker = StageWorker(StageConfig(run=RUN, stage=1, stages=3, model="mlp-digits", layers=(3, 6),
                                     neighbours=neighbours_in(plan, 0, 1, known)), node=None)
    inbox = worker.inbox
    inbox._check_sender(wire.FORWARD, a)
    inbox._check_sender(wire.BACKWARD, c)
    for handler, sender in [(wire.FORWARD, stranger), (wire.FORWARD, c), (wire.BACKWARD, stranger),
                            (wire.BACKWARD, a)]:
        with pytest.raises(MessageError) as refused:
            inbox._check_sender(handler, sender)
        expected = a if handler == wire.FORWARD else c
        assert NOT_A_NEIGHBOUR in str(refused.value) and expected.to_base58() in str(refused.value)
        assert "\n" not in str(refused.value)
        assert (NOT_YET in str(refused.value)) == (sender != stranger)
        inbox._refused(handler, sender, str(refused.value))
    assert (worker.counters.turned_away, worker.counters.rejected) == (2, 2)
    # a new plan puts a standby at stage 2: its gradients count from now on, the old peer's no longer
    worker.follow_neighbours(Neighbours(previous=a.to_base58(), next=stranger.to_base58()))
    inbox._check_sender(wire.BACKWARD, stranger)
    with pytest.raises(MessageError):
        inbox._check_sender(wire.BACKWARD, c)
    worker.follow_neighbours(Neighbours(named=False))
    inbox._check_sender(wire.FORWARD, stranger)
    worker.compute.close()


def test_a_forward_that_comes_again_after_its_microbatch_was_dropped_is_trained_again():
    """A new plan restarts both stages of a cluster: stage 1 computed microbatch m from the old stage 0, whose
    successor refuses its gradient (it has not sent m yet), so stage 1 drops m. When the new stage 0 sends m,
    stage 1 must train it, not acknowledge it as a resend, or the run ends a step short (test_run_length saw it)."""
    worker = StageWorker(StageConfig(run=RUN, stage=1, stages=2, model="mlp-digits", layers=(5, 9)), node=None)
    scheduler = worker.scheduler
    x, targets = torch.randn(4, 64), torch.zeros(4, dtype=torch.long)
    try:
        scheduler.queue_forward(7, [0, 1, 2, 3], x, targets, 0)
        assert 7 in scheduler.seen_forward  # a resend now would only be acknowledged
        scheduler.drop(7, "backward of microbatch 7 to stage 0 refused")
        assert 7 not in scheduler.seen_forward  # the new stage 0's forward of it will be trained
    finally:
        worker.compute.close()


def test_a_step_past_the_runs_length_from_the_stage_before_is_not_followed():
    """The stage before us named 2**53 in its first forward: we counted our steps from it, and our averaging rounds
    went past our partners' window (a review). A run of 500 steps counts from a step of it, never past it."""
    for named, counted, final in ((2 ** 53, 0, None), (120, 120, 120)):
        worker = StageWorker(StageConfig(run=RUN, stage=1, stages=2, model="mlp-digits", layers=(5, 9),
                                         microbatches=500), node=None)
        try:
            worker.scheduler.queue_forward(1, [0, 1, 2, 3], torch.randn(4, 64), torch.zeros(4, dtype=torch.long),
                                           named)
            worker.scheduler.receive_finish(named)
            assert (worker.compute.version, worker.scheduler.final_step) == (counted, final)
        finally:
            worker.compute.close()


def test_a_replaced_neighbour_drops_what_only_the_old_one_could_answer(tmp_path):
    """A middle stage whose previous neighbour a new plan replaces drops the old sender's queued and pending
    microbatches (their gradients would go to a stage 0 that never sent them, or that sends the same ids anew)
    and counts steps from the new sender's first microbatch. One whose next neighbour is replaced drops the
    microbatches the old one took (it takes gradients only from the new one) at once, not after the timeout,
    and keeps one whose send is still retrying: that one goes to the new neighbour."""
    from ravnest_swarm.pipeline.compute import Pending

    a, b, c, d = (peer.to_base58() for peer in peer_ids(tmp_path, 4))
    worker = StageWorker(StageConfig(run=RUN, stage=1, stages=3, model="mlp-digits", layers=(3, 6),
                                     neighbours=Neighbours(previous=a, next=c)), node=None)
    scheduler = worker.scheduler
    x, targets = torch.randn(4, 32), torch.zeros(4, dtype=torch.long)

    def pending(since):
        return Pending(x, x, [4, 32], None, since, 0)

    try:
        scheduler.queue_forward(7, [0, 1, 2, 3], x, targets, 100)
        scheduler.queue_forward(8, [0, 1, 2, 3], x, targets, 100)
        scheduler.pending[5], scheduler.pending[6] = pending(since=time.time()), pending(since=None)
        assert worker.version == 100  # counting from the first sender's step
        worker.follow_neighbours(Neighbours(previous=b, next=c))
        assert not scheduler.forward_queue and not scheduler.pending and not scheduler.seen_forward
        assert worker.counters.dropped == 4
        scheduler.queue_forward(7, [0, 1, 2, 3], x, targets, 90)  # the new stage 0 resumed at step 90
        assert worker.version == 90 and list(scheduler.queued_forward) == [7]

        scheduler.pending[5], scheduler.pending[6] = pending(since=time.time()), pending(since=None)
        worker.follow_neighbours(Neighbours(previous=b, next=d))
        assert list(scheduler.pending) == [6] and worker.counters.dropped == 5
        assert list(scheduler.queued_forward) == [7]  # the sender stayed: its microbatch is still to train
        worker.follow_neighbours(Neighbours(previous=b, next=d))  # the same plan again changes nothing
        assert list(scheduler.pending) == [6] and worker.counters.dropped == 5
    finally:
        worker.compute.close()


@pytest.mark.timeout(60)
def test_a_gradient_computed_while_the_stage_before_was_replaced_is_dropped_not_sent(tmp_path):
    """A new plan replaces the stage before us while our backward computes: the microbatch was out of ``pending``,
    so nothing dropped it, and its gradient went to the successor, whose own microbatch of that id (it counts from
    the same step) could take it. It is dropped when its compute ends, and nothing is sent (the compute is slowed
    so that the plan comes during it)."""
    from ravnest_swarm.pipeline.compute import Pending

    a, b, c = (peer.to_base58() for peer in peer_ids(tmp_path, 3))
    worker = StageWorker(StageConfig(run=RUN, stage=1, stages=3, model="mlp-digits", layers=(3, 6),
                                     neighbours=Neighbours(previous=a, next=c)), node=None)
    scheduler, x = worker.scheduler, torch.randn(4, 32)

    async def slow_backward(function, *args):
        await asyncio.sleep(0.3)
        return torch.zeros(4, 32)

    async def scenario():
        worker.compute.run = slow_backward
        scheduler.pending[5] = Pending(x, x, [4, 32], None, time.time(), 0)
        backward = asyncio.create_task(scheduler.run_backward(5, torch.zeros(4, 32)))
        await asyncio.sleep(0.1)
        worker.follow_neighbours(Neighbours(previous=b, next=c))  # the plan that replaced a
        await backward
        return list(scheduler.sends)

    try:
        sends = asyncio.run(scenario())
    finally:
        worker.compute.close()
    assert sends == [] and worker.counters.dropped == 1 and worker.counters.backwards == 1


@pytest.mark.timeout(60)
def test_a_microbatch_whose_compute_fails_is_counted_named_and_dropped_and_the_stage_goes_on():
    """The last stage gets a microbatch with targets outside the model's 10 classes, one whose loss raises,
    and honest ones. Each bad one is dropped and counted (``failed``, ``dropped``), the last named in
    ``last_failed``; the honest ones before and after train and their gradients go back (before, the first
    exception ended the stage's scheduler without a word and the stage never trained again); the bad ones go back
    as ``dropped``, so the stage before drops them at once instead of waiting for their gradients."""
    from ravnest_swarm.pipeline.compute import check_targets

    worker = StageWorker(StageConfig(run=RUN, stage=1, stages=2, model="mlp-digits", layers=(5, 9)), node=None)
    scheduler = worker.scheduler
    sent = []

    async def send(handler, stage, message, tensors, microbatch, to=None):
        sent.append((handler, microbatch, getattr(message, "dropped", None)))
        return None

    scheduler.send = send
    honest_loss = worker.spec.loss

    def loss(outputs, targets):
        if int(targets[0]) == 7:  # the microbatch whose loss fails, in lines (as CUDA's and many models' errors do)
            raise RuntimeError("the loss broke\nCUDA kernel errors might be asynchronously reported")
        return honest_loss(outputs, targets)

    worker.compute.spec = dataclasses.replace(worker.spec, loss=loss)
    x = torch.randn(4, 64)
    good, out_of_range = torch.zeros(4, dtype=torch.long), torch.tensor([0, 1, 10**9, 2])

    async def scenario():
        runner = asyncio.create_task(scheduler.run())
        scheduler.queue_forward(1, [0, 1, 2, 3], x, good, 0)
        scheduler.queue_forward(2, [0, 1, 2, 3], x, out_of_range, 0)
        scheduler.queue_forward(3, [0, 1, 2, 3], x, torch.full((4,), 7, dtype=torch.long), 0)
        scheduler.queue_forward(5, [0, 1, 2, 3], x, torch.full((4,), -100, dtype=torch.long), 0)  # all ignored
        scheduler.queue_forward(4, [0, 1, 2, 3], x, good, 0)
        scheduler.receive_finish(2)  # stage 0's step: microbatches 1 and 4 made one each
        await asyncio.wait_for(runner, 30)

    try:
        asyncio.run(scenario())
    finally:
        worker.compute.close()
    counters = worker.counters
    # a microbatch whose targets are all cross-entropy's ignore index fails (its loss would be NaN: no divergence)
    assert counters.failed == 3 and counters.dropped == 3 and counters.forwards == 2 and worker.version == 2
    assert counters.divergences == 0
    backward = {microbatch: dropped for handler, microbatch, dropped in sent if handler == wire.BACKWARD}
    assert sorted(backward) == [1, 2, 3, 4, 5] and backward[1] is None and backward[4] is None
    assert "target(s) out of range" in backward[2] and "every target is -100" in backward[5]
    # said on one line: the schema refused the text with its newline, and that error ended the scheduler
    assert backward[3] == "the loss broke CUDA kernel errors might be asynchronously reported"
    assert counters.last_failed.startswith("microbatch 5 at stage 1: its forward failed: ValueError: every target")
    with pytest.raises(ValueError, match=r"1 target\(s\) out of range \(e.g. 1000000000\).*\[0, 10\)"):
        check_targets(out_of_range, 10)
    check_targets(torch.tensor([0, 9, -100]), 10)  # cross-entropy's ignore_index is no error
    check_targets(torch.tensor([0.5, 99.0]), 10)  # float targets are the loss's to judge


@pytest.mark.timeout(180)
def test_stages_that_name_their_neighbours_follow_a_replacement_and_never_resolve_to_a_stranger(backbone, caplog):
    """Stage 0 and stage 1 name each other, as a plan names them. A stranger writes a newer endpoint record
    for stage 1's slot (the old rule, newest ``time`` wins, sent stage 0 there on every re-resolve). Stage 1
    then dies; the next plan puts a standby in its slot, and stage 0 follows that plan's neighbours. Every
    re-resolve finds only the peer named for the slot: the stranger gets nothing, the standby takes the
    traffic, and the run takes all its steps, each microbatch dropped on the way counted and replaced."""
    run, total, in_flight = "named", 120, 2
    ranges = [(0, 5), (5, 9)]

    def config(stage, neighbours):
        return StageConfig(run=run, stage=stage, stages=2, model="mlp-digits", layers=ranges[stage],
                           microbatches=total, microbatch_size=8, max_in_flight=in_flight, microbatch_timeout=4,
                           send_timeout=60, heartbeat=5, neighbours=neighbours)

    async def scenario():
        # every node here, the stranger's too, writes under its own identity: a record naming itself
        nodes, workers, caught = [], [], []

        async def catch(info, reader, writer):
            caught.append(info.peer_id.to_base58())
            writer.close()

        try:
            for index in range(4):
                nodes.append(await start_peer_node(parse_maddrs([backbone]), run,
                                                   host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
            first_id, dying_id, standby_id, stranger_id = (node.peer_id.to_base58() for node in nodes)
            await nodes[3].p2p.add_binary_stream_handler(wire.FORWARD, catch)
            # the stranger's endpoint for stage 1, newer than any honest renewal, for as long as the test runs
            record = StageEndpoint(peer_id=stranger_id, model="mlp-digits", layers=list(ranges[1]), version=0,
                                   maddrs=[str(m) for m in await nodes[3].p2p.get_visible_maddrs()],
                                   time=time.time() + 10**6).dict()
            assert await nodes[3].store(stages_key(run, 0), record, get_dht_time() + 600,
                                        subkey=stage_subkey_prefix(0, 1) + signing_validator(nodes[3]).local_public_key)
            first = StageWorker(config(0, Neighbours(next=dying_id)), nodes[0])
            dying = StageWorker(config(1, Neighbours(previous=first_id)), nodes[1])
            workers += [first, dying]
            await dying.start()
            await first.start()
            await wait_until_async(lambda: first.counters.completed >= 10, 60, "no progress before stage 1 died")
            await dying.shutdown()
            workers.remove(dying)
            standby = StageWorker(config(1, Neighbours(previous=first_id)), nodes[2])
            workers.append(standby)
            await standby.start()
            first.follow_neighbours(Neighbours(next=standby_id))  # the plan that placed the standby
            await asyncio.wait_for(first.finished.wait(), 120)
            return first.counters, standby.counters, caught, stranger_id
        finally:
            await shutdown(workers, nodes)

    torch.set_num_threads(1)
    with caplog.at_level(logging.WARNING, logger="ravnest_swarm.pipeline"):
        first, standby, caught, stranger = asyncio.run(scenario())
    assert caught == [] and first.rejected == 0 and standby.rejected == 0
    assert first.completed == total and first.injected == total + first.dropped and standby.forwards >= 1
    assert first.dropped <= 2 * in_flight
    assert not any(stranger in record.message for record in caplog.records)


@pytest.mark.timeout(90)
def test_a_gradient_for_a_dead_stage_is_dropped_not_sent_to_the_stage_that_replaced_it(backbone, caplog):
    """Stage 1 sends a gradient to a stage 0 that has died and retries; the plan then puts a standby at stage 0.
    The gradient belongs to the dead peer, which sent the forward: it is dropped, said so, and never sent to the
    standby. Before, it went there on the next retry and the standby refused an id it never sent (a walkthrough's
    stage 1 tried 29 times, then sent it)."""
    run = "replaced-sender"

    def config(stage, neighbours):
        return StageConfig(run=run, stage=stage, stages=2, model="mlp-digits", layers=[(0, 5), (5, 9)][stage],
                           microbatches=100_000, microbatch_size=8, send_timeout=60, heartbeat=5,
                           neighbours=neighbours)

    async def scenario():
        nodes, workers = [], []
        try:
            for _ in range(3):
                nodes.append(await start_peer_node(parse_maddrs([backbone]), run,
                                                   host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
            dying_id, second_id, standby_id = (node.peer_id.to_base58() for node in nodes)
            dying = StageWorker(config(0, Neighbours(next=second_id)), nodes[0])
            await dying.start()
            await dying.shutdown()  # its endpoint record outlives it: sends to it fail and retry
            second = StageWorker(config(1, Neighbours(previous=dying_id)), nodes[1])
            workers.append(second)
            await second.start()
            second.scheduler._backward_to((second.scheduler.senders_replaced, dying_id), 4919, torch.zeros(8, 64))
            await wait_until_async(lambda: second.counters.resends >= 2, 30, "the gradient was not retried")
            standby = StageWorker(config(0, Neighbours(next=second_id)), nodes[2])
            workers.append(standby)
            await standby.start()
            second.follow_neighbours(Neighbours(previous=standby_id))  # the plan that placed the standby
            await wait_until_async(lambda: second.counters.dropped >= 1, 30, "the gradient was not dropped")
            await asyncio.sleep(1.0)
            return second.counters, standby.counters
        finally:
            await shutdown(workers, nodes)

    with caplog.at_level(logging.INFO, logger="ravnest_swarm.pipeline"):
        second, standby = asyncio.run(scenario())
    said = [r.message for r in caplog.records if "turned away" in r.message or "dropped" in r.message]
    assert second.dropped == 1 and standby.turned_away == 0 and standby.rejected == 0, said
    assert any("dropped microbatch 4919: backward of microbatch 4919 to stage 0: the plan put another peer at stage 0 "
               "than the one that sent its forward" in record.message for record in caplog.records)

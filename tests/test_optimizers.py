"""A stage's inner optimizer (sgd, momentum, adamw) and its schedule, its state in checkpoints, the planner's memory
for it, and the outer optimizer that turns an averaging round's mean into the stage's parameters (issue 30)."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from safetensors.torch import save

from ravnest_swarm.checkpoint import (OUTER_STATE_KEYS, load_optimizer_state, load_outer_state, optimizer_tensors,
                                      read_stage, save_stage, take_optimizer_state, write_atomically)
from ravnest_swarm.errors import UserError
from ravnest_swarm.models import get_model
from ravnest_swarm.optimizers.inner import FINAL_LR_FRACTION, make_inner_optimizer, scheduled_lr
from ravnest_swarm.optimizers.outer import OuterOptimizer
from ravnest_swarm.pipeline.compute import StageCompute
from ravnest_swarm.pipeline.config import StageConfig
from ravnest_swarm.planning.cost import Peer
from ravnest_swarm.planning.plan import plan_swarm
from ravnest_swarm.swarm.placement import model_workload, place_taken_over
from ravnest_swarm.swarm.hand_over import new_takers
from ravnest_swarm.swarm.spec import RunSpec
from ravnest_swarm.swarm.stage_state import stage_giver
from process_tree import signal_session
from run_observer import RunObserver


@pytest.mark.parametrize("name, kind, buffers", [("sgd", torch.optim.SGD, set()),
                                                  ("momentum", torch.optim.SGD, {"momentum_buffer"}),
                                                  ("adamw", torch.optim.AdamW, {"exp_avg", "exp_avg_sq"})])
def test_a_stage_steps_with_the_runs_inner_optimizer(name, kind, buffers):
    model = get_model("mlp-digits")
    compute = StageCompute(StageConfig(run="r", stage=0, stages=1, model="mlp-digits", layers=(0, len(model.layers)),
                                       optimizer=name, lr=0.01 if name == "adamw" else 0.05), model)
    assert isinstance(compute.optimizer, kind)
    losses = [compute.forward_backward_last(*model.dataset().get(range(32 * i, 32 * i + 32)))[0] for i in range(30)]
    assert sum(losses[-5:]) < sum(losses[:5])
    state = compute.optimizer.state_dict()["state"]
    assert all(buffers <= set(per_parameter) for per_parameter in state.values()) and (bool(state) or not buffers)


def test_the_schedule_warms_up_and_decays_along_a_cosine_to_a_tenth():
    assert [scheduled_lr(1.0, s, 1000, "constant", 100) for s in (0, 49, 99, 500)] == pytest.approx([0.01, 0.5, 1, 1])
    cosine = [scheduled_lr(1.0, s, 1000, "cosine", 100) for s in (0, 99, 550, 1000, 5000)]
    assert cosine == pytest.approx([0.01, 1.0, 0.55, FINAL_LR_FRACTION, FINAL_LR_FRACTION])
    assert scheduled_lr(0.05, 10, 1000, "constant") == 0.05


# today's scheme: no inner optimizer state, no outer state (the defaults carry both)
PLAIN = dict(optimizer="sgd", outer_optimizer="average", averaging_compression="none")


def test_the_planner_counts_the_optimizers_state():
    model = get_model("mlp-digits")
    memory = {name: model_workload(model, RunSpec("mlp-digits", **dict(PLAIN, optimizer=name)), 8)[0].model_gb
              for name in ("sgd", "momentum", "adamw")}
    parameters_gb = sum(layer.param_bytes for layer in model.layers) / 1e9
    assert memory["momentum"] - memory["sgd"] == pytest.approx(parameters_gb)
    assert memory["adamw"] - memory["sgd"] == pytest.approx(2 * parameters_gb)
    # the outer state: an anchor (nesterov, or any compression), nesterov's momentum, compression's error feedback
    outer = {(name, compression): model_workload(model, RunSpec("mlp-digits", **dict(
                 PLAIN, outer_optimizer=name, averaging_compression=compression)), 8)[0].model_gb
             - memory["sgd"] for name in ("average", "nesterov") for compression in ("none", "int8")}
    assert outer == pytest.approx({("average", "none"): 0, ("average", "int8"): 2 * parameters_gb,
                                   ("nesterov", "none"): 2 * parameters_gb, ("nesterov", "int8"): 3 * parameters_gb})


@pytest.mark.parametrize("ram, spec, stages", [
    (1.2, {}, [1, 1, 1, 1]),
    (1.2, {"optimizer": "adamw"}, [2, 2]),  # AdamW's moments: the model no longer fits one peer
    (1.5, {"optimizer": "adamw"}, [1, 1, 1, 1]),
    (1.5, {"optimizer": "adamw", "outer_optimizer": "nesterov", "averaging_compression": "int8"}, [2, 2])])
def test_where_memory_is_tight_the_optimizers_state_changes_the_plan(ram, spec, stages):
    """Four equal peers that each offer ``ram`` times what a stage of plain SGD needs for the whole model: with the
    optimizers' state counted, AdamW (and then the outer state on top of it) no longer fits one peer, and the
    planner splits the model into two-stage clusters."""
    model = get_model("mlp-digits")
    sgd_gb = model_workload(model, RunSpec("mlp-digits", **PLAIN), 8)[0].model_gb
    workload, profile = model_workload(model, RunSpec("mlp-digits", **dict(PLAIN, **spec)), 8)
    peers = [Peer(f"p{index}", ram * sgd_gb, 20.0, 100.0) for index in range(4)]
    plan = plan_swarm(peers, workload, seed=0, time_limit=2, layer_profile=profile)
    assert sorted(len(cluster) for _, cluster in plan.clusters) == stages
    for _, cluster in plan.clusters:
        assert all(sum(profile[0][slice(*stage.layers)]) <= ram * sgd_gb * (1 + 1e-9) for stage in cluster)


def test_adamw_state_goes_into_the_checkpoint_and_comes_back_exactly(tmp_path):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    optimizer = make_inner_optimizer(module.parameters(), "adamw", 1e-2, weight_decay=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        module(torch.randn(8, 6)).square().sum().backward()
        optimizer.step()
    path = str(tmp_path / "stage.safetensors")
    save_stage(path, module, optimizer, {"step": 3, "layers": [0, 3]})
    restored = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    restored.load_state_dict(module.state_dict())
    again = make_inner_optimizer(restored.parameters(), "adamw", 1e-2, weight_decay=0.1)
    assert load_optimizer_state(path, again)
    batch = torch.randn(8, 6)
    for m, o in ((module, optimizer), (restored, again)):
        o.zero_grad()
        m(batch).square().sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), restored.parameters()))
    plain = make_inner_optimizer(torch.nn.Linear(6, 4).parameters(), "sgd", 0.1)
    save_stage(path, torch.nn.Linear(6, 4), plain, {"step": 0, "layers": [0, 1]})
    assert not load_optimizer_state(path, make_inner_optimizer(torch.nn.Linear(6, 4).parameters(), "adamw", 0.1))


def test_a_copy_of_some_layers_state_is_theirs_numbered_from_their_first_parameter():
    """What a training stage gives a new cluster's stage for some of its layers (``live`` stage state): the state of
    exactly those layers' parameters, numbered from 0, which the taker's optimizer loads onto its own layers."""
    from ravnest_swarm.swarm.stage_state import parameter_indices
    torch.manual_seed(0)
    stage = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = make_inner_optimizer(stage.parameters(), "adamw", 1e-2)
    stage(torch.randn(8, 6)).square().sum().backward()
    optimizer.step()
    # the stage's first layer is layer 5: layers 7:9 are its last two Linears, parameters 2 to 5
    parameters = parameter_indices(stage, 5, (7, 9))
    assert parameters == range(2, 6)
    tensors, scalars = optimizer_tensors(optimizer, parameters=parameters)
    held = optimizer.state_dict()["state"]
    assert sorted(tensors) == sorted(f"optim.{i}.{key}" for i in range(4) for key in ("exp_avg", "exp_avg_sq"))
    assert all(torch.equal(tensors[f"optim.{i}.exp_avg"], held[i + 2]["exp_avg"]) for i in range(4))
    assert scalars == {str(i): {"step": 1.0} for i in range(4)}
    taker = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    taken = make_inner_optimizer(taker.parameters(), "adamw", 1e-2)
    assert take_optimizer_state(tensors, {"optimizer_scalars": scalars}, taken)
    assert all(torch.equal(taken.state_dict()["state"][i]["exp_avg_sq"], held[i + 2]["exp_avg_sq"]) for i in range(4))


def test_optimizer_state_that_is_not_finite_or_does_not_fit_the_layers_is_not_taken():
    """What a checkpoint or a stopped stage's peer (``swarm/stage_state.py``) gives is numbers for our parameters:
    a NaN moment, a moment of another shape, a negative or non-numeric step count, a malformed name, and the
    optimizer keeps its own state."""
    module = torch.nn.Linear(6, 4)
    giver = make_inner_optimizer(module.parameters(), "adamw", 1e-2)
    module(torch.randn(8, 6)).square().sum().backward()
    giver.step()
    tensors, scalars = optimizer_tensors(giver)
    metadata = {"optimizer_scalars": scalars}
    taker = make_inner_optimizer(torch.nn.Linear(6, 4).parameters(), "adamw", 1e-2)
    assert take_optimizer_state(tensors, metadata, taker)
    assert torch.equal(taker.state_dict()["state"][0]["exp_avg"], giver.state_dict()["state"][0]["exp_avg"])
    damaged = [
        (dict(tensors, **{"optim.0.exp_avg": torch.full((4, 6), math.nan)}), metadata),
        (dict(tensors, **{"optim.0.exp_avg": torch.zeros(6, 4)}), metadata),
        (dict(tensors, **{"optim.x.exp_avg": torch.zeros(4, 6)}), metadata),
        (dict(tensors, **{"optim.0": torch.zeros(4, 6)}), metadata),
        (tensors, {"optimizer_scalars": {"0": {"step": -1.0}}}),
        (tensors, {"optimizer_scalars": {"0": {"step": "many"}}}),
        (tensors, {"optimizer_scalars": {"0": {"step": math.inf}}}),
        # numbers, never structure: a state that lacks a moment or its step, or whose moments are scalars, failed
        # every step of the stage that took it (each microbatch dropped)
        ({k: v for k, v in tensors.items() if not k.endswith("exp_avg_sq")}, metadata),
        (tensors, {"optimizer_scalars": {}}),
        ({}, metadata),
        ({k: torch.tensor(0.5) for k in tensors}, metadata),
        (dict(tensors, **{"optim.0.momentum_buffer": torch.zeros(4, 6)}), metadata),
    ]
    for bad_tensors, bad_metadata in damaged:
        fresh = make_inner_optimizer(torch.nn.Linear(6, 4).parameters(), "adamw", 1e-2)
        assert not take_optimizer_state(bad_tensors, bad_metadata, fresh)
        assert not fresh.state_dict()["state"]


def test_momentum_state_goes_to_a_momentum_optimizer_only():
    module = torch.nn.Linear(6, 4)
    giver = make_inner_optimizer(module.parameters(), "momentum", 0.1)
    module(torch.randn(8, 6)).square().sum().backward()
    giver.step()
    tensors, scalars = optimizer_tensors(giver)
    metadata = {"optimizer_scalars": scalars}
    assert take_optimizer_state(tensors, metadata, make_inner_optimizer(torch.nn.Linear(6, 4).parameters(), "momentum",
                                                                        0.1))
    for kind in ("sgd", "adamw"):
        assert not take_optimizer_state(tensors, metadata,
                                        make_inner_optimizer(torch.nn.Linear(6, 4).parameters(), kind, 0.1))


def test_the_giver_of_a_stages_optimizer_state_stopped_training_exactly_its_layers():
    """The state goes with a stage's place: from a peer leaving with exactly our layers, else one a plan moved off
    them (its ``held``); never from a peer that trains them still (its error feedback is its own), nor from one
    that held other layers."""
    me = {"peer_id": "me", "state": "standby"}
    trainer = {"peer_id": "t", "name": "t", "state": "training", "layers": [0, 9], "held": None}
    moved = {"peer_id": "m", "name": "m", "state": "training", "layers": [9, 12], "held": [0, 9, 400]}
    leaver = {"peer_id": "l", "name": "l", "state": "leaving", "layers": [0, 9], "held": [0, 9, 420]}
    partial = {"peer_id": "p", "name": "p", "state": "leaving", "layers": [0, 5]}
    assert stage_giver([me, trainer, moved, leaver, partial], "me", (0, 9)) is leaver
    assert stage_giver([me, trainer, moved, partial], "me", (0, 9)) is moved
    assert stage_giver([me, trainer, partial], "me", (0, 9)) is None
    assert stage_giver([dict(leaver, peer_id="me")], "me", (0, 9)) is None
    # a plan put the peer that trained them on standby: its record offers them as its layers, and it holds the state
    standby = {"peer_id": "s", "name": "s", "state": "standby", "layers": [0, 9], "step": 400, "held": [0, 9, 400]}
    assert stage_giver([me, trainer, standby], "me", (0, 9)) is standby
    # of two leavers with our layers, the one whose place we take (place_taken_over)
    other = dict(leaver, peer_id="o", name="o")
    assert stage_giver([me, other, leaver], "me", (0, 9)) is other
    assert stage_giver([me, other, leaver], "me", (0, 9), preferred="l") is leaver


def _plan(*clusters):
    return {"round": 2, "clusters": [[{"peer_id": peer, "layers": list(layers)} for peer, layers in cluster]
                                     for cluster in clusters]}


def test_a_taker_in_a_cluster_that_trains_on_takes_the_place_of_the_leaver_at_its_stage():
    """A walkthrough's taker of a leaver's stage, in a cluster whose other stages trained on, downloaded the freshest
    copy (the other cluster's live weights, 20,000 steps on) with the leaver's AdamW moments: its layers come from
    the leaver whose place it takes. A new or re-formed cluster, or a leaver that is not leaving, names none."""
    before = _plan([("a0", (0, 2)), ("a1", (2, 4))], [("b0", (0, 2)), ("b1", (2, 4))])
    after = _plan([("a0", (0, 2)), ("t", (2, 4))], [("b0", (0, 2)), ("b1", (2, 4))])
    leaving = [{"peer_id": "a1", "state": "leaving", "layers": [2, 4]},
               {"peer_id": "b1", "state": "training", "layers": [2, 4]}]
    assert place_taken_over(leaving, before, after, "t") == "a1"
    # the leaver of the other cluster's stage is not the one whose place we take
    assert place_taken_over([dict(leaving[0], peer_id="b1"), dict(leaving[1], peer_id="a1", state="training")],
                            before, after, "t") is None
    # a peer gone without a word (SIGKILL): no leaver to take from
    assert place_taken_over([dict(leaving[0], state="training")], before, after, "t") is None
    assert place_taken_over(leaving[1:], before, after, "t") is None
    # a re-formed cluster: its first stage moved in from the other cluster, so it takes one round for all stages
    reformed = _plan([("b0", (0, 2)), ("t", (2, 4))], [("a0", (0, 2)), ("b1", (2, 4))])
    assert place_taken_over(leaving, before, reformed, "t") is None
    # a cluster of one stage: the leaver of the whole model whose cluster we are now
    alone = _plan([("a", (0, 4))], [("b", (0, 4))])
    assert place_taken_over([{"peer_id": "b", "state": "leaving", "layers": [0, 4]}], alone,
                            _plan([("a", (0, 4))], [("t", (0, 4))]), "t") == "b"
    # a peer a plan moved here from another cluster brings a step of its own; a standby places nowhere; no plan before
    assert place_taken_over(leaving, before, _plan([("a0", (0, 2)), ("b1", (2, 4))], [("b0", (0, 4))]), "b1") is None
    assert place_taken_over(leaving, before, after, "x") is None
    assert place_taken_over(leaving, None, after, "t") is None
    # a one-stage cluster's place taken by a peer the plan moved there from another cluster: its own layers and step
    moved = _plan([("a", (0, 4))], [("b", (0, 4))], [("c", (0, 4))])
    assert place_taken_over([{"peer_id": "b", "state": "leaving", "layers": [0, 4]}], moved,
                            _plan([("a", (0, 4))], [("c", (0, 4))]), "c") is None
    # two one-stage clusters whose peers both leave: each taker the leaver of its cluster's number
    both = [{"peer_id": peer, "state": "leaving", "layers": [0, 4]} for peer in ("b", "c")]
    replaced = _plan([("a", (0, 4))], [("t1", (0, 4))], [("t2", (0, 4))])
    assert [place_taken_over(both, moved, replaced, taker) for taker in ("t1", "t2")] == ["b", "c"]


@pytest.mark.timeout(60)
def test_the_takers_of_a_split_stage_take_each_their_layers_adamw_state_from_the_peer_that_stopped_it():
    """A leaver's stage that a new plan splits between two takers: each asks the leaver for the inner state of its
    own layers (``live``), never the stopped range; the stopped stage answers, where it answered only for a stage
    the peer still trained (the leaver's AdamW moments were lost). Real P2P nodes on 127.0.0.1."""
    import asyncio

    from hivemind.p2p import P2P

    from ravnest_swarm.net.routes import Routes
    from ravnest_swarm.swarm.stage_state import (StageStateServer, StoppedStage, carry_layer_states,
                                                 parameter_indices)

    torch.manual_seed(0)
    model = get_model("mlp-digits")
    stopped_module = model.build_stage(0, 3)  # the leaver trained layers 0:3
    optimizer = make_inner_optimizer(stopped_module.parameters(), "adamw", 1e-2)
    stopped_module(torch.randn(8, 64)).square().sum().backward()
    optimizer.step()
    held = optimizer.state_dict()["state"]
    stopped = StoppedStage((0, 3), 40, optimizer, {}, stopped_module)

    async def scenario():
        leaver = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        taker = await P2P.create(initial_peers=await leaver.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            await StageStateServer(Routes(leaver, []), "split", lambda: stopped).start()

            async def reach(_):
                return "direct"

            taken = {}
            for start, end in ((0, 1), (1, 3)):  # the two takers' stages
                module = model.build_stage(start, end)
                mine = make_inner_optimizer(module.parameters(), "adamw", 1e-2)
                state, givers = await carry_layer_states(
                    Routes(taker, []), "split", module, start, mine,
                    {layer: [leaver.peer_id] for layer in range(start, end)}, 10.0, reach)
                assert set(givers) == set(range(start, end)) and state, (start, end, givers)
                taken[(start, end)] = (state, parameter_indices(stopped_module, 0, (start, end)))
            return taken
        finally:
            await taker.shutdown()
            await leaver.shutdown()

    for (start, end), (state, indices) in asyncio.run(scenario()).items():
        assert sorted(state) == list(range(len(indices))), (start, end, sorted(state))
        for index, held_index in enumerate(indices):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[index][key], held[held_index][key]), (start, end, index, key)


def test_bench_diloco_re_forms_a_cluster_with_its_inner_state_reset_or_carried_from_the_cluster_it_downloads_from():
    from ravnest_swarm.bench.diloco import reformed
    replicas = [torch.nn.Linear(3, 2) for _ in range(3)]
    optimizers = [make_inner_optimizer(r.parameters(), "adamw", 0.01) for r in replicas]
    for replica, optimizer in zip(replicas, optimizers):
        replica(torch.randn(4, 3)).square().sum().backward()
        optimizer.step()
    assert reformed(replicas, optimizers, 1, "adamw", 0.01, "reset").state_dict()["state"] == {}
    carried = reformed(replicas, optimizers, 1, "adamw", 0.01, "carry")
    # the next cluster's moments, on cluster 1's own parameters (a copy: the giver's state is not shared)
    given = optimizers[2].state_dict()["state"]
    assert carried.param_groups[0]["params"] == list(replicas[1].parameters())
    for index, state in carried.state_dict()["state"].items():
        assert all(torch.equal(state[key], given[index][key]) for key in ("exp_avg", "exp_avg_sq"))
        assert state["exp_avg"].data_ptr() != given[index]["exp_avg"].data_ptr()


@pytest.mark.timeout(120)
def test_bench_diloco_trains_the_synchronous_reference_of_each_k_on_k_times_the_microbatch():
    """``bench diloco --synchronous``: beside K = 4, one replica on 4 x the microbatch for the same samples (what
    no averaging period can beat); a malformed ``--configurations`` is a one-line error."""
    done = subprocess.run([sys.executable, "-m", "ravnest_swarm", "bench", "diloco", "--samples", "640",
                           "--configurations", "adamw:0.008:average", "--synchronous", "--json"],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])["results"]
    shapes = [(r["clusters"], r["synchronous_of"], r["microbatch_size"], r["curve"][-1][0]) for r in results]
    assert shapes == [(1, None, 32, 640), (4, None, 32, 640), (1, 4, 128, 640)], shapes
    assert results[0]["samples_to_target"] == 640 and results[0]["loss_vs_target"] == 1.0
    refused = subprocess.run([sys.executable, "-m", "ravnest_swarm", "bench", "diloco", "--configurations",
                              "adamw:fast:average"], capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == \
        "error: --configurations: the lr of 'adamw:fast:average' must be a positive number", refused.stderr


def test_members_with_one_history_end_an_outer_step_with_the_same_parameters_bit_for_bit():
    torch.manual_seed(1)
    members = [OuterOptimizer("nesterov", 0.7, 0.9) for _ in range(3)]
    start = torch.randn(1000)
    for member in members:
        assert torch.equal(member.step(start.clone()), start)  # the first round takes the mean: the anchor
    for _ in range(4):
        mean = start + 0.01 * torch.randn(1000)  # what the ring gave every member
        after = [member.step(mean.clone()) for member in members]
        assert all(torch.equal(after[0], other) for other in after[1:])
    assert not torch.equal(after[0], mean)  # an outer step, not the plain mean


def test_the_outer_step_is_nesterov_on_the_averaged_pseudo_gradient_and_average_takes_the_mean():
    outer = OuterOptimizer("nesterov", 0.5, 0.9)
    anchor = torch.tensor([1.0, 2.0])
    outer.step(anchor)
    mean = torch.tensor([0.8, 2.4])
    delta = anchor - mean
    expected = anchor - 0.5 * (delta + 0.9 * delta)  # momentum starts at zero: m = delta
    assert torch.allclose(outer.step(mean), expected)
    plain = OuterOptimizer("average")
    plain.step(anchor)
    assert torch.equal(plain.step(mean), mean)
    assert torch.allclose(OuterOptimizer("nesterov", 1.0, 0.0, anchor.clone(), torch.zeros(2)).step(mean), mean)
    outer.forget()
    assert torch.equal(outer.step(mean), mean) and math.isclose(float(outer.momentum.abs().sum()), 0.0)


def outer_after_rounds(name: str, size: int, rounds: int = 3) -> OuterOptimizer:
    """An outer optimizer after ``rounds`` compressed rounds of a stage of ``size`` parameters: anchor, error and
    (nesterov) momentum all set."""
    torch.manual_seed(2)
    outer, parameters = OuterOptimizer(name, 0.7, 0.9), torch.randn(size)
    for _ in range(rounds):
        local = parameters - 0.01 * torch.randn(size)
        pseudo_gradient = outer.pseudo_gradient(local) if outer.has_anchor(local) else local
        parameters = outer.step_segments(local, pseudo_gradient, [(0, size)], 0.001 * torch.randn(size))
    return outer


@pytest.mark.parametrize("name", ["nesterov", "average"])
def test_the_outer_state_goes_into_the_checkpoint_and_comes_back_exactly(tmp_path, name):
    """Anchor, momentum and error are written beside the layers and read back bit for bit: the restored stage tells
    its ring the same digest (so it compresses at once) and takes the same outer step as the one it was saved from."""
    module = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    size = sum(parameter.numel() for parameter in module.parameters())
    outer = outer_after_rounds(name, size)
    kept = {"anchor", "momentum", "error"} if name == "nesterov" else {"anchor", "error"}
    assert set(outer.state_tensors()) == kept
    assert set(outer.state_tensors()) <= set(OUTER_STATE_KEYS)
    path = str(tmp_path / "stage.safetensors")
    save_stage(path, module, make_inner_optimizer(module.parameters(), "sgd", 0.1), {"step": 60, "layers": [0, 3]},
               outer=outer.state_tensors())
    restored = OuterOptimizer(name, 0.7, 0.9)
    assert restored.restore(load_outer_state(path, size))
    assert restored.digest(0, size) == outer.digest(0, size) and restored.digest(0, 7) == outer.digest(0, 7)
    local, mean, residual = torch.randn(size), 0.01 * torch.randn(size), 0.001 * torch.randn(size)
    assert torch.equal(restored.pseudo_gradient(local.clone()), outer.pseudo_gradient(local.clone()))
    after = [o.step_segments(local.clone(), mean, [(0, size)], residual) for o in (outer, restored)]
    assert torch.equal(after[0], after[1]) and torch.equal(outer.anchor, restored.anchor)
    # a stage that has no outer state yet keeps none, and one of the other outer optimizer is not taken
    save_stage(path, module, make_inner_optimizer(module.parameters(), "sgd", 0.1), {"step": 0, "layers": [0, 3]},
               outer=OuterOptimizer(name).state_tensors())
    assert load_outer_state(path, size) == {}
    other = OuterOptimizer("average" if name == "nesterov" else "nesterov")
    assert not other.restore(outer.state_tensors()) and other.anchor is None


@pytest.mark.parametrize("damage, problem", [
    ("short", r"anchor is torch.float32 \[10\], not float32 \[38\]"),
    ("float64", r"momentum is torch.float64 \[38\], not float32 \[38\]"),
    ("nan", "error is not finite"),
    ("unknown", "velocity is not one of anchor, momentum, error"),
    ("no anchor", "it has no anchor")])
def test_a_corrupt_outer_state_in_a_checkpoint_is_a_one_line_error(tmp_path, damage, problem):
    module = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    size = sum(parameter.numel() for parameter in module.parameters())
    assert size == 38
    path = str(tmp_path / "stage.safetensors")
    save_stage(path, module, make_inner_optimizer(module.parameters(), "sgd", 0.1), {"step": 60, "layers": [0, 3]},
               outer=outer_after_rounds("nesterov", size).state_tensors())
    tensors, metadata = read_stage(path)
    if damage == "short":
        tensors["outer.anchor"] = tensors["outer.anchor"][:10].clone()
    elif damage == "float64":
        tensors["outer.momentum"] = tensors["outer.momentum"].double()
    elif damage == "nan":
        tensors["outer.error"] = tensors["outer.error"].clone().index_fill_(0, torch.tensor([3]), math.nan)
    elif damage == "unknown":
        tensors["outer.velocity"] = tensors.pop("outer.momentum")
    else:
        del tensors["outer.anchor"]
    write_atomically(path, save(tensors, metadata={"ravnest": json.dumps(metadata)}))  # the read maps the old file
    with pytest.raises(UserError, match=problem) as refused:
        load_outer_state(path, size)
    assert "\n" not in str(refused.value) and "corrupt outer optimizer state" in str(refused.value)


@pytest.mark.timeout(300)
def test_a_sigkilled_adamw_volunteer_resumes_its_optimizer_state_and_its_loss(tmp_path, processes, backbone):
    """A real ``join`` training with AdamW is SIGKILLed (its whole session, p2pd included) and started again with
    ``--resume``: it says it took its AdamW state from the checkpoint, and its loss goes on from where it was, not
    from the start (cross-entropy on the digits starts near ln 10 = 2.3)."""
    run, checkpoints = "adamw-resume", str(tmp_path / "checkpoints")

    def join(*extra):
        return processes.start(["join", "--initial-peers", backbone, "--run", run, "--name", "solo", "--no-dashboard",
                                "--model", "mlp-digits", "--optimizer", "adamw", "--lr", "0.002", "--steps", "100000",
                                "--min-peers", "1", "--round-seconds", "3", "--heartbeat", "2", "--checkpoint-dir",
                                checkpoints, "--checkpoint-every", "50", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                *extra], f"solo{len(processes.processes)}")

    first = join()
    observer = RunObserver(backbone, run, period=1.0)
    try:
        before = observer.wait_for(lambda peers: (peers.get("solo", {}).get("step") or 0) >= 400, 150,
                                   "past step 400")["solo"]
        first.kill_group()
        _, metadata = read_stage(os.path.join(checkpoints, f"{run}-solo.safetensors"))
        saved = metadata["info"]["step"]
        assert saved >= 350 and metadata["optimizer_scalars"], metadata  # AdamW's step counts went in too
        second = join("--resume")
        second.wait_for_output(rf"solo: adamw state resumed from the checkpoint of step {saved}", 120,
                               stream="stderr")
        after = observer.wait_for(lambda peers: peers.get("solo", {}).get("state") == "training" and
                                  (peers["solo"].get("step") or 0) > saved and peers["solo"].get("loss") is not None,
                                  120, "training again after the resume")["solo"]
    finally:
        observer.close()
    assert before["loss"] < 1.0 and after["loss"] < 1.0, (before, after)
    assert "unexpected" not in second.stderr() and "Traceback" not in second.stderr()


COMPRESSED_ROUND = re.compile(r"averaging step (\d+): 1/1 segments averaged in \S+ "
                              r"\(1 as compressed pseudo-gradients\)")
ANY_ROUND = re.compile(r"averaging step (\d+): (\d+)/(\d+) segments averaged")


@pytest.mark.timeout(300)
def test_two_sigkilled_clusters_resume_their_outer_state_and_compress_from_their_first_round(tmp_path, processes,
                                                                                            backbone):
    """Two real ``join`` peers, a cluster of one stage each, average int8 pseudo-gradients with nesterov; both are
    frozen and SIGKILLed (their whole sessions, p2pd included) and started again with ``--resume``. Each says it
    took its outer state from its checkpoint, and the first round each logs after the resume averages compressed
    pseudo-gradients: its anchor digest matched the other's, no float32 re-sync was needed.

    ``--max-stages 1``: mlp-digits is compute-bound, so one cluster of two stages is as fast as two clusters of one,
    and the re-plan after the resume may pick either (the move estimate does not count a standby's checkpointed
    layers, which makes the one-cluster plan look cheaper): only two clusters of one stage keep each peer's layers
    and the outer state of its checkpoint."""
    run, checkpoints = "outer-resume", tmp_path / "checkpoints"

    def join(name, *extra):
        return processes.start(["join", "--initial-peers", backbone, "--run", run, "--name", name, "--no-dashboard",
                                "--model", "mlp-digits", "--steps", "100000", "--min-peers", "2", "--ram-gb", "1",
                                "--gflops", "20", "--averaging-period", "20", "--checkpoint-every", "20",
                                "--averaging-compression", "int8", "--outer-optimizer", "nesterov",
                                "--round-seconds", "3", "--max-stages", "1", "--heartbeat", "2",
                                "--checkpoint-dir", str(checkpoints), "--no-averaging-overlap",
                                "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *extra], f"{name}-{len(processes.processes)}")

    # --no-averaging-overlap: each round holds both clusters at its step, so both checkpoint one step after one
    # round (with rounds beside training a cluster ahead trains on, and the checkpoints would hold different rounds'
    # anchors). A resumed peer placed after the other trained on downloads its layers and keeps its outer state.
    def read_checkpoints():
        """Each first peer's checkpoint (tensors, metadata) and the step it saved."""
        stages = {name: read_stage(str(checkpoints / f"{run}-{name}.safetensors")) for name in first}
        return stages, {name: metadata["info"]["step"] for name, (_, metadata) in stages.items()}

    first = {name: join(name) for name in ("p0", "p1")}
    observer = RunObserver(backbone, run, period=1.0)
    try:
        peers = observer.wait_for(lambda peers: all((peers.get(n, {}).get("averaging_rounds") or 0) >= 3
                                                    for n in first), 200, "three averaging rounds each")
        assert {peers[n]["cluster"] for n in first} == {0, 1}, peers
        # freeze both (neither sees the other go and fails a round meanwhile) at a moment when both checkpoints are
        # of one step and keep the same round's outer anchor: one may write its checkpoint a moment before the
        # other, or be a checkpoint ahead (rounds are on the run's count: a cluster ahead is not held), and is let go
        for attempt in range(60):
            for peer in first.values():
                signal_session(peer, signal.SIGSTOP)
            stages, saved = read_checkpoints()
            if len(set(saved.values())) > 1:
                # the one a checkpoint behind runs alone a moment: it writes the checkpoint of the round both ended,
                # and cannot pass the next round without the other (a loaded CI froze them a checkpoint apart in
                # all 60 tries, twice)
                behind = first[min(saved, key=saved.get)]
                signal_session(behind, signal.SIGCONT)
                time.sleep(0.3)
                signal_session(behind, signal.SIGSTOP)
                stages, saved = read_checkpoints()
            anchors = [tensors.get("outer.anchor") for tensors, _ in stages.values()]
            same_round = len(set(saved.values())) == 1 and all(a is not None for a in anchors) and \
                torch.equal(anchors[0], anchors[1])
            if same_round:
                break
            for peer in first.values():
                signal_session(peer, signal.SIGCONT)
            time.sleep(0.5)
        for peer in first.values():
            peer.kill_group()
        assert same_round, saved  # both checkpointed the same step after the same round
        for name in first:
            tensors = read_stage(str(checkpoints / f"{run}-{name}.safetensors"))[0]
            assert {"outer.anchor", "outer.momentum", "outer.error"} <= set(tensors), sorted(tensors)
        second = {name: join(name, "--resume") for name in first}
        for name, peer in second.items():
            peer.wait_for_output(rf"^{name}: outer state \(anchor, momentum, error\) resumed from the checkpoint of "
                                 rf"step {saved[name]}", 120, stream="stderr")
        for name, peer in second.items():
            peer.wait_for_output(ANY_ROUND.pattern, 120, stream="stderr")
        after = observer.wait_for(lambda peers: all(peers.get(n, {}).get("state") == "training" for n in second), 60,
                                  "both training again")
    finally:
        observer.close()
    for name, peer in second.items():
        log = peer.stderr()
        first_round = ANY_ROUND.search(log)
        assert COMPRESSED_ROUND.match(log, first_round.start()), (name, first_round.group(0))
        assert int(first_round.group(1)) > 0  # a round on the run's count (not the step: a cluster may run ahead)
        assert "unexpected" not in log and "Traceback" not in log, log[-3000:]
    assert all(after[n]["loss"] is None or after[n]["loss"] < 1.0 for n in second), after  # on from where it was


def test_a_leaver_waits_for_a_standby_only_where_the_plan_since_its_leave_puts_one_on_its_layers():
    """``hand_over.new_takers``: who the plan made for a leave puts on the leaver's layers that did not train them."""
    def record(peer_id, state, layers=None):
        return dict(peer_id=peer_id, name=peer_id, state=state, layers=layers)

    plan = dict(round=3, clusters=[[dict(peer_id="p0", layers=[0, 4])], [dict(peer_id="p2", layers=[0, 4])]])
    peers = [record("p0", "training", [0, 4]), record("p2", "standby")]
    assert new_takers(plan, (0, 4), peers, "p1") == ["p2"]  # the standby placed in our place downloads first
    assert new_takers(dict(round=3, clusters=plan["clusters"][:1]), (0, 4), peers, "p1") == []  # left a standby
    assert new_takers(plan, (0, 2), peers, "p1") == []  # nobody on exactly our layers
    assert new_takers(plan, (0, 4), [record("p0", "training", [0, 4]), record("p2", "training", [0, 4])], "p1") == []


@pytest.mark.timeout(300)
def test_a_leave_that_the_next_plan_gives_no_standby_waits_for_that_plan_not_the_hand_over_timeout(tmp_path, processes,
                                                                                                  backbone):
    """Two clusters of one stage (AdamW) and a standby far too slow to be worth a place: p1's Ctrl-C once waited the
    whole hand-over timeout (90 s, a walkthrough) for its AdamW state to be taken by the standby, which the plan
    made for the leave left on standby. It now leaves once that plan is in force: well within the timeout, its
    layers handed over to p0, and the standby still standing by."""
    run = "leave-slow-standby"

    def join(name, gflops):
        return processes.start(["join", "--initial-peers", backbone, "--run", run, "--name", name, "--no-dashboard",
                                "--model", "mlp-digits", "--steps", "100000", "--min-peers", "2", "--ram-gb", "1",
                                "--gflops", gflops, "--bandwidth-mbps", "100", "--optimizer", "adamw",
                                "--lr", "0.002", "--round-seconds", "4", "--max-stages", "1", "--heartbeat", "2",
                                "--handover-timeout", "90", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], name)

    peers = {name: join(name, "20") for name in ("p0", "p1")}
    observer = RunObserver(backbone, run, period=1.0)
    try:
        observer.wait_for(lambda seen: all((seen.get(n, {}).get("averaging_rounds") or 0) >= 2 for n in peers), 200,
                          "two clusters that averaged twice")
        peers["p2"] = join("p2", "0.5")
        peers["p0"].wait_for_output(r"standby p2 opened no round", 90, stream="stderr")
        started = time.monotonic()
        os.killpg(peers["p1"].pid, signal.SIGINT)
        peers["p1"].wait_for_output(r"^p1: layers \d+:\d+ handed over at step \d+ to p0$", 80, stream="stderr")
        assert peers["p1"].wait(30) == 0
        assert time.monotonic() - started < 60, "the leave waited for a standby the plan did not place"
        after = observer.wait_for(lambda seen: "p1" not in seen and seen.get("p2", {}).get("state") == "standby" and
                                  seen.get("p0", {}).get("state") == "training", 60, "p0 training, p2 standing by")
    finally:
        observer.close()
    assert after["p2"]["cluster"] == -1, after["p2"]
    for name in ("p0", "p1", "p2"):
        assert "unexpected" not in peers[name].stderr() and "Traceback" not in peers[name].stderr(), name


@pytest.mark.timeout(300)
def test_a_graceful_leave_hands_its_adamw_and_outer_state_to_the_standby_that_takes_its_place(tmp_path, processes,
                                                                                             backbone):
    """Two real ``join`` peers, a cluster of one stage each (AdamW inside, nesterov on int8 pseudo-gradients
    outside), and a standby that joined after them: a third cluster would not pay back its move within the run's
    25 s horizon, a replacement does. p1 leaves by Ctrl-C. The other cluster holds its layers at once, so p1 once
    left at once and its state went with it; now it waits until the standby that takes its place has its AdamW
    moments and outer state. The standby says it took both from p1, with p1's layers at p1's step, it averages compressed pseudo-gradients with
    p0, at least 90 % of its rounds from its first on complete (a cluster re-formed by a re-plan meets the run),
    and its loss goes on from where p1's was, not from the start. (Its first round may be a float32 one: p0's
    round during the leave had no partner, and p0 starts its outer state anew after such a round.)

    ``--round-seconds 6``: with 3, a loaded machine's p0 saw the standby's round as its proposals froze, the round
    was planned without it (p2 alone, p0 standby), and the next two rounds moved p2 out and in again."""
    run = "state-hand-over"

    def join(name):
        return processes.start(["join", "--initial-peers", backbone, "--run", run, "--name", name, "--no-dashboard",
                                "--model", "mlp-digits", "--steps", "100000", "--min-peers", "2", "--ram-gb", "1",
                                "--gflops", "20", "--bandwidth-mbps", "100", "--averaging-period", "20",
                                "--optimizer", "adamw", "--lr", "0.002", "--outer-optimizer", "nesterov",
                                "--averaging-compression", "int8", "--move-horizon", "25", "--round-seconds", "6",
                                "--max-stages", "1", "--heartbeat", "2", "--checkpoint-dir", str(tmp_path),
                                "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], name)

    peers = {name: join(name) for name in ("p0", "p1")}
    observer = RunObserver(backbone, run, period=1.0)
    try:
        before = observer.wait_for(lambda seen: all((seen.get(n, {}).get("averaging_rounds") or 0) >= 3
                                                    for n in peers), 200, "three averaging rounds each")
        assert {before[n]["cluster"] for n in peers} == {0, 1}, before
        peers["p2"] = join("p2")
        peers["p0"].wait_for_output(r"standby p2 opened no round", 90, stream="stderr")
        os.killpg(peers["p1"].pid, signal.SIGINT)
        took = peers["p2"].wait_for_output(r"^p2: adamw state resumed from p1, which stopped training them at step "
                                           r"(\d+)$", 120, stream="stderr")
        peers["p2"].wait_for_output(rf"^p2: outer state \(anchor, momentum, error\) resumed from p1, which stopped "
                                    rf"training them at step {took.group(1)}$", 10, stream="stderr")
        # the layers that go with that state: p1's own, at its step, not p0's live weights at p0's
        peers["p2"].wait_for_output(rf"^p2: training cluster \d+ stage 0/1 layers \d+:\d+ from step \d+ on cpu; its "
                                    rf"layers are live weights of step {took.group(1)} of p1, whose place it takes$",
                                    30, stream="stderr")
        peers["p1"].wait_for_output(r"^p1: layers \d+:\d+ handed over at step \d+ to ", 60, stream="stderr")
        assert peers["p1"].wait(30) == 0
        peers["p2"].wait_for_output(COMPRESSED_ROUND.pattern, 120, stream="stderr")
        # a cluster re-formed by a re-plan that moved a peer meets the run from its first round (issue 30)
        after = observer.wait_for(lambda seen: seen.get("p2", {}).get("state") == "training" and
                                  seen["p2"].get("loss") is not None and
                                  (seen["p2"].get("averaging_rounds") or 0) +
                                  (seen["p2"].get("averaging_failures") or 0) >= 10, 90, "p2's first 10 rounds")
    finally:
        observer.close()
    done, failed = after["p2"].get("averaging_rounds") or 0, after["p2"].get("averaging_failures") or 0
    assert done / (done + failed) >= 0.9, after["p2"]
    log = peers["p2"].stderr()
    assert "starts afresh" not in log and "it starts at the stage's first round" not in log
    assert after["p2"]["loss"] < 1.0, after["p2"]  # cross-entropy on the digits starts near ln 10 = 2.3
    for name in ("p1", "p2"):
        assert "unexpected" not in peers[name].stderr() and "Traceback" not in peers[name].stderr(), name

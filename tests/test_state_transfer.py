"""Layer downloads between real P2P nodes, and whom a joiner believes.

A stream cut short is retried; a holder that keeps cutting it is reported and the layer keeps its local
weights. Hostile holders (raw libp2p peers serving ``ravnest.layer_state``) are not trusted: one outside
the plan that claims a huge step with altered tensors is never asked while a holder the plan names
offers the layer; where two or more holders count, the layer is loaded only when two serve the same
averaged copy, and the step is the median of their claims. Holders keep the last rounds' copies, so the stages of a
new cluster can all take one round's, and two holders a round apart agree on the earlier one.
"""

import asyncio
import copy
from types import SimpleNamespace
import time
from typing import List, Optional

import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2P, PeerID

from ravnest_swarm.models import get_model
from ravnest_swarm.net.routes import Routes
from ravnest_swarm.swarm.state_transfer import (KEPT_ROUNDS, LayerOffer, LayerStateServer, agreed_step,
                                                content_digest, counted_offers, fill_again, fill_layer, offered_layers,
                                                offers_of, seeded_only)

RUN = "transfer"
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
HUGE_STEP = 10**15


def trained_stage(shift: float) -> torch.nn.Sequential:
    """Layers 0:3 of mlp-digits moved away from the seeded weights by ``shift``."""
    stage = get_model("mlp-digits").build_stage(0, 3)
    with torch.no_grad():
        for parameter in stage.parameters():
            parameter.add_(shift)
    return stage


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(tensor, b.state_dict()[name]) for name, tensor in a.state_dict().items())


# ---- whom to believe: pure rules ----------------------------------------------------------------------

PEERS = [PeerID.from_base58(text) for text in ("QmXoypizjW3WknFiJnKLwHCnL72vedxjQkDDP1mXWo6uco",
                                                "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
                                                "QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z")]


def test_the_step_is_the_median_of_the_planned_holders_claims_never_the_highest():
    honest = [LayerOffer(PEERS[0], 100, True), LayerOffer(PEERS[1], 104, True)]
    stranger = LayerOffer(PEERS[2], HUGE_STEP, False)
    assert counted_offers(honest + [stranger]) == honest and agreed_step(counted_offers(honest + [stranger])) == 100
    # a holder the plan names can lie too: one claim among three moves nothing
    assert agreed_step([honest[0], LayerOffer(PEERS[2], HUGE_STEP, True), honest[1]]) == 104
    assert agreed_step([honest[0], LayerOffer(PEERS[2], 0, True), honest[1]]) == 100
    # where the plan names no holder (a leaver handing over), the others count
    assert counted_offers([stranger]) == [stranger]
    # two records naming one peer make one witness, at the lower claim
    assert counted_offers([honest[0], LayerOffer(PEERS[0], HUGE_STEP, True)]) == [honest[0]]


def test_a_layer_is_not_fetched_only_where_every_holder_that_counts_offers_it_at_step_0():
    """Holders at step 0 serve the seeded weights every peer has; one trained holder among them is fetched from,
    though the median of two trained claims and two at 0 is 0 (a record a heartbeat old, or a lie)."""
    untrained = [LayerOffer(PEERS[0], 0, True), LayerOffer(PEERS[1], 0, True)]
    assert seeded_only(untrained) and not seeded_only([])
    mixed = [LayerOffer(PEERS[0], 0, True), LayerOffer(PEERS[1], 0, True), LayerOffer(PEERS[2], 120, True)]
    assert agreed_step(counted_offers(mixed)) == 0 and not seeded_only(mixed)
    # a stranger's claim of step 0 beside planned holders at 0 changes nothing; its trained claim outside the plan
    # is no witness either
    assert seeded_only(untrained + [LayerOffer(PEERS[2], 500, False)])


def test_offers_come_from_the_records_layers_and_held_ranges_and_are_marked_by_the_plan():
    records = [dict(peer_id=PEERS[0].to_base58(), layers=[0, 4], step=30, held=None),
               dict(peer_id=PEERS[1].to_base58(), layers=None, step=None, held=[2, 6, 50]),
               dict(peer_id=PEERS[2].to_base58(), layers=[4, 6], step=HUGE_STEP, held=None)]
    plan = {"clusters": [[{"peer_id": PEERS[0].to_base58(), "layers": [0, 4]}]]}
    assert offers_of(records, plan, 3) == [LayerOffer(PEERS[0], 30, True), LayerOffer(PEERS[1], 50, False)]
    assert offers_of(records, None, 5) == [LayerOffer(PEERS[1], 50, False), LayerOffer(PEERS[2], HUGE_STEP, False)]


def test_a_leaving_trainer_outweighs_the_stale_copies_of_standbys_the_new_plan_places():
    """A walkthrough: one cluster trained while standbys kept copies of an old place; its peer left (Ctrl-C) and the
    next plan placed the standbys, which took their own copies, 17,000 steps old. The leaver's record says it is
    leaving the layers the plan before gave it: it counts, and alone, while it serves them."""
    leaver, standby, other = (p.to_base58() for p in PEERS)
    before = {"clusters": [[{"peer_id": leaver, "layers": [0, 4]}]]}
    after = {"clusters": [[{"peer_id": standby, "layers": [0, 4]}]]}
    records = [dict(peer_id=leaver, state="leaving", layers=[0, 4], step=18_000, held=None),
               dict(peer_id=standby, state="standby", layers=[0, 4], step=1_000, held=None)]
    offers = offers_of(records, after, 2, before)
    assert offers == [LayerOffer(PEERS[0], 18_000, True, True, True), LayerOffer(PEERS[1], 1_000, True)]
    assert counted_offers(offers) == [offers[0]] and agreed_step(counted_offers(offers)) == 18_000
    stale = [LayerOffer(PEERS[1], 1_000, True)]
    # without the plan before (nothing to tell trainers by), the plans vouch for the standby only, as before
    assert counted_offers(offers_of(records, after, 2)) == stale
    # a record that says leaving is not enough: the plan before must have placed it on the layer
    liar = dict(peer_id=other, state="leaving", layers=[0, 4], step=HUGE_STEP, held=None)
    assert counted_offers(offers_of(records[1:] + [liar], after, 2, before)) == stale
    # nor is having been placed: a trainer the new plan drops whose record still says training (it was killed, its
    # record not yet expired) is no witness, nor are layers the plan before gave it elsewhere
    killed = dict(records[0], state="training")
    assert counted_offers(offers_of([killed, records[1]], after, 2, before)) == stale
    elsewhere = {"clusters": [[{"peer_id": leaver, "layers": [4, 8]}]]}
    assert counted_offers(offers_of(records, after, 2, elsewhere)) == stale
    # a trainer the new plan keeps (another cluster) counts, the leaver then not (it may be gone already, and the
    # kept one holds its last round), nor the stale standby
    kept = dict(peer_id=other, state="training", layers=[0, 4], step=18_010, held=None)
    both = {"clusters": before["clusters"] + [[{"peer_id": other, "layers": [0, 4]}]]}
    again = {"clusters": after["clusters"] + [[{"peer_id": other, "layers": [0, 4]}]]}
    assert counted_offers(offers_of(records + [kept], again, 2, both)) == [LayerOffer(PEERS[2], 18_010, True, True)]
    # a peer the plan before placed on the layer that never started (its record still a standby's, a copy of an
    # older place) is no trainer: the leaver counts
    unstarted = dict(kept, state="standby", step=500)
    assert counted_offers(offers_of(records + [unstarted], again, 2, both)) == [offers[0]]


def test_the_content_digest_changes_with_any_value_name_or_dtype():
    state = {"weight": torch.ones(3, 2), "bias": torch.zeros(2)}
    assert content_digest(state) == content_digest({name: t.clone() for name, t in reversed(state.items())})
    nudged = {"weight": state["weight"].clone(), "bias": state["bias"]}
    nudged["weight"][2, 1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert content_digest(nudged) != content_digest(state)
    assert content_digest({"weight2": state["weight"], "bias": state["bias"]}) != content_digest(state)
    assert content_digest({"weight": state["weight"].double(), "bias": state["bias"]}) != content_digest(state)


# ---- downloads between real nodes ---------------------------------------------------------------------

class CutShortServer(LayerStateServer):
    """Ends its first ``cuts`` streams after their first message, as a relay that resets the connection
    does (hivemind's stream then ends without an error)."""

    def __init__(self, *args, cuts: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.cuts = cuts

    async def rpc_layer_state(self, request, context):
        responses = super().rpc_layer_state(request, context)
        if self.cuts > 0:
            self.cuts -= 1
            yield await responses.__anext__()
            await responses.aclose()
            return
        async for response in responses:
            yield response


class OverflowingServer(LayerStateServer):
    """Announces its first tensor in one part and sends 8 more with it (a holder that would fill our memory: its
    parts were taken until the stream ended), in a frame within the bound of one part's."""

    async def rpc_layer_state(self, request, context):
        async for response in super().rpc_layer_state(request, context):
            response.tensors.extend(serialize_torch_tensor(torch.zeros(1 << 12)) for _ in range(8))
            yield response
            return


class HugeFrameServer(LayerStateServer):
    """Answers with a frame whose header declares 1 TiB and then waits (hivemind's reader would wait for that
    many bytes, holding what comes, until the joiner's timeout)."""

    async def _serve_layer_state(self, info, reader, writer):
        writer.write(P2P.MESSAGE_MARKER + (1 << 40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\0" * 1024)
        await writer.drain()
        await asyncio.sleep(60)


class CountingServer(LayerStateServer):
    """Counts the requests it is asked (a holder that must never be asked shows it was not)."""

    asked = 0

    def _snapshot(self, *args):
        self.asked += 1
        return super()._snapshot(*args)


def fill(holders: List[dict], fresh: torch.nn.Sequential, round_step: Optional[int] = None):
    """Start one P2P per holder (``server``: a LayerStateServer subclass and its kwargs; ``live``/``averaged``:
    the stage it serves and at which step, ``rounds``: more averaged copies (stage, step) it keeps, older first;
    ``step``, ``planned``: its offer) and fill ``fresh``'s layers from them as a joiner does (taking the round of
    ``round_step``, if given); returns each layer's LayerFill and the servers."""

    async def scenario():
        nodes = [await P2P.create(host_maddrs=LOCAL)]
        nodes += [await P2P.create(initial_peers=await nodes[0].get_visible_maddrs(), host_maddrs=LOCAL)
                  for _ in holders]
        joiner, holder_nodes = nodes[0], nodes[1:]
        try:
            servers = []
            for node, holder in zip(holder_nodes, holders):
                cls, kwargs = holder.get("server", (LayerStateServer, {}))
                live, live_step = holder["live"]
                server = cls(Routes(node, []), RUN, lambda live=live, step=live_step: offered_layers(0, live, step),
                             **kwargs)
                for kept in holder.get("rounds", []) + ([holder["averaged"]] if "averaged" in holder else []):
                    server.keep_averaged(offered_layers(0, *kept))
                await server.start()
                servers.append(server)
            offers = [LayerOffer(node.peer_id, holder["step"], holder.get("planned", True))
                      for node, holder in zip(holder_nodes, holders)]
            filled = [await fill_layer(Routes(joiner, []), RUN, fresh[layer], layer, offers, 30.0,
                                       round_step=round_step) for layer in range(len(fresh))]
            return filled, servers
        finally:
            for node in nodes:
                await node.shutdown()

    return asyncio.run(scenario())


def test_a_stream_cut_short_is_asked_again_and_the_layer_arrives_whole():
    held, fresh = trained_stage(1.0), get_model("mlp-digits").build_stage(0, 3)
    filled, _ = fill([dict(live=(held, 7), step=7, server=(CutShortServer, dict(cuts=1)))], fresh)
    assert all(f.loaded and f.step == 7 for f in filled), filled
    assert same_weights(held, fresh)


def test_a_holder_that_keeps_cutting_its_stream_is_named_and_the_layer_keeps_its_weights():
    fresh = get_model("mlp-digits").build_stage(0, 3)
    before = copy.deepcopy(fresh)
    filled, _ = fill([dict(live=(trained_stage(1.0), 7), step=7, server=(CutShortServer, dict(cuts=100)))], fresh)
    assert not filled[0].loaded and "sent ['linear.weight'] of layer 0" in filled[0].problem, filled[0]
    assert filled[0].step == 7  # the step still follows the holder's, so the stage stays in step with its cluster
    assert same_weights(before, fresh)


def test_a_holder_that_streams_more_than_the_layer_takes_is_cut_off_at_its_size():
    fresh = get_model("mlp-digits").build_stage(0, 3)
    before = copy.deepcopy(fresh)
    filled, _ = fill([dict(live=(trained_stage(1.0), 7), step=7, server=(OverflowingServer, {}))], fresh)
    assert not filled[0].loaded and "sent more than" in filled[0].problem and "announced 1" in filled[0].problem, \
        filled[0]
    assert same_weights(before, fresh)


def test_a_holder_that_declares_a_frame_over_a_part_is_refused_from_its_header():
    fresh = get_model("mlp-digits").build_stage(0, 3)
    before = copy.deepcopy(fresh)
    started = time.monotonic()
    filled, _ = fill([dict(live=(trained_stage(1.0), 7), step=7, server=(HugeFrameServer, {}))], fresh)
    assert not filled[0].loaded and f"sent a reply of {1 << 40} bytes, over the" in filled[0].problem, filled[0]
    assert time.monotonic() - started < 20  # refused at once, not at the 30 s timeout of each of its layers
    assert same_weights(before, fresh)


def test_a_holder_outside_the_plan_claiming_a_huge_step_with_altered_tensors_is_never_asked():
    """Attack: a raw libp2p peer, not in the plan, offers every layer at step 10^15 and serves altered
    tensors. Beside a holder the plan names it is not asked at all: the joiner gets the planned holder's
    weights at its step."""
    honest = trained_stage(1.0)
    hostile = dict(live=(trained_stage(500.0), HUGE_STEP), step=HUGE_STEP, planned=False,
                   server=(CountingServer, {}))
    fresh = get_model("mlp-digits").build_stage(0, 3)
    filled, servers = fill([hostile, dict(live=(honest, 7), step=7)], fresh)
    assert all(f.loaded and f.step == 7 for f in filled), filled
    assert same_weights(honest, fresh) and servers[0].asked == 0


def test_two_holders_must_serve_the_same_averaged_copy_and_a_third_is_asked_when_they_differ():
    """Attack: a holder the plan names (a Sybil volunteer) serves an altered averaged copy; its claim is as
    close to the median as an honest holder's, so it is asked second. It disagrees with the first, so a
    third is asked; the two honest ones agree, and their averaged copy is loaded at the median step, never
    the live weights of either."""
    averaged = trained_stage(1.0)
    hostile = dict(live=(trained_stage(500.0), 21), averaged=(trained_stage(500.0), 20), step=21)
    honest = [dict(live=(trained_stage(2.0), 23), averaged=(averaged, 20), step=23),
              dict(live=(trained_stage(3.0), 22), averaged=(averaged, 20), step=22)]
    fresh = get_model("mlp-digits").build_stage(0, 3)
    filled, servers = fill([hostile, *honest], fresh)
    assert all(f.loaded and f.step == 22 for f in filled), filled
    assert same_weights(averaged, fresh)
    # whose copy it is, as an export's model.json says it (served_by): the two honest holders, at their copy's step
    honest_ids = {server.p2p.peer_id.to_base58() for server in servers[1:]}
    assert all(set(f.holders) == honest_ids and f.copy_step == 20 for f in filled), filled


def test_two_holders_that_disagree_with_no_third_leave_the_local_weights_and_say_so():
    """Attack: of the two holders the plan names for each layer, one serves altered tensors and claims a huge
    step. With nobody to break the tie, the joiner keeps its own weights, says why, and takes the lower of
    the two claims as the step."""
    averaged = trained_stage(1.0)
    holders = [dict(live=(averaged, 20), averaged=(averaged, 20), step=20),
               dict(live=(trained_stage(500.0), HUGE_STEP), averaged=(trained_stage(500.0), HUGE_STEP), step=HUGE_STEP)]
    fresh = get_model("mlp-digits").build_stage(0, 3)
    before = copy.deepcopy(fresh)
    filled, _ = fill(holders, fresh)
    assert all(not f.loaded and f.step == 20 for f in filled), filled
    assert "no two of its 2 holders serve the same averaged copy (2 different ones)" in filled[0].problem
    assert same_weights(before, fresh)


def test_holders_without_an_averaged_copy_give_the_live_weights_of_the_one_at_the_agreed_step():
    """Two holders that have not averaged yet (the run's first clusters: one trained alone, the other took its
    layers a moment ago) have no copy in common: the joiner takes the live weights of the holder at the agreed
    (median) step, and says so, rather than keep its seeded ones and undo the run's training at its first
    averaging round (seen in the NAT lab run: the first peer's divergence guard then restored)."""
    first = trained_stage(1.0)
    holders = [dict(live=(first, 5), step=5), dict(live=(trained_stage(2.0), 6), step=6)]
    fresh = get_model("mlp-digits").build_stage(0, 3)
    filled, _ = fill(holders, fresh)
    assert all(f.loaded and f.step == 5 for f in filled), filled
    assert "no two of its 2 holders serve the same averaged copy (0 different ones): took the live weights of" \
        in filled[0].problem, filled[0]
    assert same_weights(first, fresh)


def test_a_holder_that_serves_its_live_weights_at_a_made_up_step_does_not_move_ours():
    """A hostile review: of holders with no averaged copy, the first asked (its record claims the agreed step) served
    its live weights saying step 2**53, and the joiner's stage counted from there (its averaging windows and the
    run's length with it). The served step counts only within the holders' claims."""
    first = trained_stage(1.0)
    holders = [dict(live=(first, HUGE_STEP), step=5), dict(live=(trained_stage(2.0), 6), step=6)]
    fresh = get_model("mlp-digits").build_stage(0, 3)
    filled, _ = fill(holders, fresh)
    assert all(f.loaded and f.step == 6 for f in filled), filled  # the highest claim of the two holders
    assert f"(served at step {HUGE_STEP}) at step 6, within the holders' claims" in filled[0].problem, filled[0]


def test_two_holders_a_round_apart_agree_on_the_round_both_keep():
    """One holder has finished the round of step 40, the other not yet: their last copies differ, so the joiner
    asks both for the earlier round, which both keep, and loads it (before, it kept its seeded weights)."""
    earlier, later = trained_stage(1.0), trained_stage(2.0)
    holders = [dict(live=(later, 41), rounds=[(earlier, 20)], averaged=(later, 40), step=41),
               dict(live=(earlier, 39), averaged=(earlier, 20), step=39)]
    fresh = get_model("mlp-digits").build_stage(0, 3)
    filled, _ = fill(holders, fresh)
    assert all(f.loaded and f.averaged and f.copy_step == 20 for f in filled), filled
    assert same_weights(earlier, fresh)


def test_the_round_a_new_clusters_first_stage_took_is_taken_and_one_nobody_keeps_is_not():
    """A later stage of a new cluster asks for the round its first stage took: two holders that keep it serve it,
    though both have averaged since; a round nobody keeps any more gives their last one, which says its step."""
    taken, since = trained_stage(1.0), trained_stage(2.0)
    holders = [dict(live=(since, 61), rounds=[(taken, 20)], averaged=(since, 40), step=61) for _ in range(2)]
    fresh = get_model("mlp-digits").build_stage(0, 3)
    filled, _ = fill(holders, fresh, round_step=20)
    assert all(f.loaded and f.averaged and f.copy_step == 20 for f in filled), filled
    assert same_weights(taken, fresh)
    filled, _ = fill(holders, fresh, round_step=0)
    assert all(f.loaded and f.averaged and f.copy_step == 40 for f in filled), filled
    assert same_weights(since, fresh)


def test_a_holder_keeps_the_last_rounds_only():
    server = LayerStateServer(SimpleNamespace(p2p=None), RUN, dict)
    for step in range(0, 200, 20):
        server.keep_averaged(offered_layers(0, trained_stage(step), step))
    assert sorted(server.averaged_rounds) == [step for step in range(0, 200, 20)][-KEPT_ROUNDS:]
    assert {step for _, step in server.averaged().values()} == {180}
    assert server.averaged(20) == {}
    # what its record says it keeps (kept_rounds): rounds of which every layer of its stage is kept
    layers = len(trained_stage(0))
    assert server.kept_rounds(0, layers) == [step for step in range(0, 200, 20)][-KEPT_ROUNDS:]
    assert server.kept_rounds(0, layers + 1) == []


class OtherRoundServer(LayerStateServer):
    """Hostile: whatever round is named, serves its last copy, altered (its header says that copy's step)."""

    def averaged(self, round_step=None):
        return super().averaged(None)


def test_a_holder_that_serves_another_round_for_a_named_one_is_not_believed():
    """Attack: asked for the round a new cluster's first stage took, a planned holder serves an altered copy of
    another round. Its copy is not counted (the step it says is not the round asked for): the two honest holders
    that keep the round agree on it."""
    taken = trained_stage(1.0)
    # it claims the median step, so it is asked first
    hostile = dict(server=(OtherRoundServer, {}), live=(trained_stage(500.0), 61), averaged=(trained_stage(500.0), 40),
                   step=61)
    honest = [dict(live=(trained_stage(2.0), step), rounds=[(taken, 20)], averaged=(trained_stage(2.0), 40), step=step)
              for step in (60, 62)]
    fresh = get_model("mlp-digits").build_stage(0, 3)
    filled, servers = fill([hostile, *honest], fresh, round_step=20)
    assert all(f.loaded and f.averaged and f.copy_step == 20 for f in filled), filled
    hostile_id = servers[0].p2p.peer_id.to_base58()
    assert all(hostile_id not in f.holders for f in filled), filled
    assert same_weights(taken, fresh)


# ---- a holder gone since the records were read ---------------------------------------------------------


def fill_after_a_leave(taker_planned: bool, taker_appears: bool):
    """A leaver's layers 0:3 at step 30: it left once another peer held them at its step (hand_over), but the
    joiner's first read named only the leaver. The joiner fills from that read, then (``fill_again``) from fresh
    reads, which name the other holder (``taker_planned``: whether the plan names it) if ``taker_appears``. Returns
    the first fills, the last, the other holder's stage, and the looks taken."""
    held = trained_stage(3.0)

    async def scenario():
        joiner = await P2P.create(host_maddrs=LOCAL)
        leaver = await P2P.create(initial_peers=await joiner.get_visible_maddrs(), host_maddrs=LOCAL)
        other = await P2P.create(initial_peers=await joiner.get_visible_maddrs(), host_maddrs=LOCAL)
        leaver_id = leaver.peer_id
        await leaver.shutdown()  # gone: its record still says it holds the layers
        try:
            server = LayerStateServer(Routes(other, []), RUN, lambda: offered_layers(0, held, 30))
            await server.start()
            fresh, routes = get_model("mlp-digits").build_stage(0, 3), Routes(joiner, [])
            stale = [LayerOffer(leaver_id, 30, False)]
            first = {layer: await fill_layer(routes, RUN, fresh[layer], layer, stale, 10.0) for layer in range(3)}
            looks = []

            async def read_offers():
                looks.append(time.monotonic())
                now = stale + ([LayerOffer(other.peer_id, 30 if taker_planned else HUGE_STEP, taker_planned)]
                               if taker_appears else [])
                return lambda layer: now

            last = await fill_again(routes, RUN, fresh, 0, first, read_offers, 10.0, lookups=3, pause=0.1)
            return first, last, fresh, len(looks)
        finally:
            await joiner.shutdown()
            await other.shutdown()

    first, last, fresh, looks = asyncio.run(scenario())
    return first, last, fresh, held, looks


def test_a_layer_whose_only_holder_left_is_asked_of_the_holder_fresh_records_name():
    """The walkthrough's taker: offered only a leaver that had gone, it kept the seeded weights of every layer and
    fresh AdamW state. Now the layers the leaver did not answer for are asked of the holder a fresh read names,
    at one look."""
    first, last, fresh, held, looks = fill_after_a_leave(taker_planned=True, taker_appears=True)
    assert all(not f.loaded and len(f.unanswered) == 1 for f in first.values()), first
    assert all(f.loaded and f.step == 30 for f in last.values()), last
    assert same_weights(held, fresh) and looks == 1


def test_a_holder_outside_the_plan_gives_its_weights_but_not_its_step_when_the_plans_holder_is_gone():
    first, last, fresh, held, looks = fill_after_a_leave(taker_planned=False, taker_appears=True)
    assert all(f.loaded and f.step == 30 and "outside the plan, at step 30" in f.problem for f in last.values()), last
    assert same_weights(held, fresh)


def test_with_no_other_holder_the_layers_keep_their_weights_after_a_bounded_number_of_looks():
    first, last, fresh, held, looks = fill_after_a_leave(taker_planned=True, taker_appears=False)
    assert all(not f.loaded and f.step == 30 for f in last.values()), last
    assert looks == 3  # for all three layers together, not three a layer
    assert same_weights(get_model("mlp-digits").build_stage(0, 3), fresh)


def test_asks_for_layers_we_do_not_hold_copy_nothing_and_copies_are_few():
    """A hostile review: each ask for a layer we do not hold made a copy of all we hold (kept a minute) before it was
    refused, one per requester, and peer ids cost nothing to make: a stage's memory per made-up id. The ask is refused
    before anything is copied, and at most MAX_HELD_COPIES requesters hold a copy (the oldest goes)."""
    from ravnest_swarm.net.transport import make_request
    from ravnest_swarm.swarm.state_transfer import MAX_HELD_COPIES, LayerStateRequest

    provided = {0: ({"weight": torch.ones(4)}, 5), 1: ({"weight": torch.zeros(4)}, 5)}
    server = LayerStateServer(SimpleNamespace(p2p=None), "r", lambda: provided)
    requesters = [PeerID(bytes([0x12, 0x20]) + bytes([i]) * 32) for i in range(10)]
    for requester in requesters:
        request = make_request(LayerStateRequest(run="r", layers=[4095]).as_metadata())
        try:
            server._snapshot(request, LayerStateRequest, "layer_state", requester)
            raise AssertionError("a layer we do not hold was served")
        except ValueError as e:
            assert "does not hold layers [4095]" in str(e)
    assert server._copies == {}
    for requester in requesters:
        request = make_request(LayerStateRequest(run="r", layers=[1]).as_metadata())
        ((layer, tensors, step),) = server._snapshot(request, LayerStateRequest, "layer_state", requester)
        assert (layer, step) == (1, 5) and torch.equal(tensors["weight"], torch.zeros(4))
        assert tensors["weight"].data_ptr() != provided[1][0]["weight"].data_ptr()  # a copy: training goes on
    assert set(server._copies) == set(requesters[-MAX_HELD_COPIES:])

"""Layer downloads between two real P2P nodes: a stream cut short is retried; a holder that keeps
cutting it is reported and the layer keeps its local weights."""

import asyncio
import copy

import torch
from hivemind.p2p import P2P

from ravnest_swarm.net.routes import Routes

from ravnest_swarm.models import get_model
from ravnest_swarm.swarm.state_transfer import LayerStateServer, StateTransferError, download_layers, offered_layers

RUN = "transfer"
LOCAL = ["/ip4/127.0.0.1/tcp/0"]


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


def download(cuts: int):
    """A holder of layers 0:3 at step 7 (its weights moved away from the seeded ones), a fresh peer that
    downloads them; returns both modules, the fresh one's weights before, the step and any error."""

    async def scenario():
        spec = get_model("mlp-digits")
        held = spec.build_stage(0, 3)
        with torch.no_grad():
            for parameter in held.parameters():
                parameter.add_(1.0)
        server_p2p = await P2P.create(host_maddrs=LOCAL)
        client_p2p = await P2P.create(initial_peers=await server_p2p.get_visible_maddrs(), host_maddrs=LOCAL)
        try:
            await CutShortServer(Routes(server_p2p, []), RUN, lambda: offered_layers(0, held, 7), cuts=cuts).start()
            fresh = spec.build_stage(0, 3)
            before = copy.deepcopy(fresh.state_dict())
            holders = {layer: [server_p2p.peer_id] for layer in range(3)}
            try:
                return held, fresh, before, await download_layers(Routes(client_p2p, []), RUN, fresh, 0, holders, 30.0), None
            except StateTransferError as e:
                return held, fresh, before, None, e
        finally:
            await client_p2p.shutdown()
            await server_p2p.shutdown()

    return asyncio.run(scenario())


def test_a_stream_cut_short_is_asked_again_and_the_layer_arrives_whole():
    held, fresh, _, step, error = download(cuts=1)
    assert error is None and step == 7
    for name, tensor in held.state_dict().items():
        assert torch.equal(tensor, fresh.state_dict()[name]), name


def test_a_holder_that_keeps_cutting_its_stream_is_named_and_the_layer_keeps_its_weights():
    _, fresh, before, _, error = download(cuts=100)
    assert "no holder could give layer 0" in str(error) and "sent ['linear.weight'] of layer 0" in str(error)
    for name, tensor in before.items():
        assert torch.equal(tensor, fresh.state_dict()[name]), name

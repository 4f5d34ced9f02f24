"""The codecs activations, gradients and ring chunks travel in (``codecs/``), without a network: each round trip
within its stated error, and every header, count or scale that lies refused."""

import asyncio
import math

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto.runtime_pb2 import CompressionType

from ravnest_swarm.codecs import blockwise
from ravnest_swarm.codecs.codec import CODECS, INTEGERS, RAW, BlockwiseCodec, CodecError, codec, raw_tensor
from ravnest_swarm.pipeline.link_codec import LinkCodec
from stream_helpers import END_OF_STREAM, frames_bytes

BLOCKWISE = [name for name, each in CODECS.items() if isinstance(each, BlockwiseCodec)]


def activations(shape=(4, 64, 96), seed=0):
    """A transformer-like residual stream: unit noise, a few channels twenty times larger."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    if x.shape[-1] > 7:
        x[..., 7] *= 20
    return x


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packing_round_trips_every_code(bits):
    codes = torch.randint(0, 2 ** bits, (blockwise.BLOCK * 5,), dtype=torch.int64).to(torch.uint8)
    packed = blockwise.pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == codes.numel() * bits // 8
    assert torch.equal(blockwise.unpack(packed, bits, codes.numel()), codes)


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("shape", [(4, 64, 96), (3, 5), (1,), (0, 8)])
def test_every_codec_round_trips_within_its_stated_error(name, shape):
    each = CODECS[name]
    x = activations(shape)
    serialized = each.encode(x)
    decoded = each.decode(serialized, "activations", list(shape), torch.float32)
    assert decoded.shape == x.shape and decoded.dtype == torch.float32
    if isinstance(each, BlockwiseCodec):
        # half a step of the block's grid; its scale is at most (1 + 2**-7)(1 + 2**-8) times its largest value
        flat = torch.nn.functional.pad(x.reshape(-1), (0, -x.numel() % blockwise.BLOCK)).view(-1, blockwise.BLOCK)
        bound = flat.abs().amax(dim=1) * (1 + 2 ** -6) / (2 ** each.bits - 1)
        error = torch.nn.functional.pad((decoded - x).reshape(-1).abs(), (0, -x.numel() % blockwise.BLOCK))
        assert (error.view(-1, blockwise.BLOCK) <= bound.unsqueeze(1) * 1.0001 + 1e-6).all()
        assert serialized.ByteSize() <= blockwise.packed_bytes(x.numel(), each.bits) + 16
    elif name == "none":
        assert torch.equal(decoded, x)
    else:
        assert torch.allclose(decoded, x, rtol=2e-3, atol=2e-2)


@pytest.mark.parametrize("name", ["int8", "int4", "int3"])
def test_bytes_per_value_is_the_bits_plus_a_scale_per_block(name):
    x = activations((64, 64, 128))
    per_value = CODECS[name].encode(x).ByteSize() / x.numel()
    assert per_value == pytest.approx(CODECS[name].bytes_per_value, rel=0.01)
    assert 4.0 / per_value >= {"int8": 3.8, "int4": 7.5, "int3": 9.8}[name]


def test_a_flat_part_of_any_length_decodes_with_its_own_count():
    for length in (1, 63, 64, 65, 1000):
        x = torch.randn(length)
        for name in ("none", "float16", "int4"):
            assert CODECS[name].decode(CODECS[name].encode(x), "ring chunk", None).numel() == length


@pytest.mark.parametrize("values, narrow", [([0, 255], "uint8"), ([-100, 255], "int16"), ([0, 70000], "int32"),
                                            ([-1, 2 ** 40], "int64")])
def test_integers_go_exactly_in_the_narrowest_dtype_that_holds_them(values, narrow):
    ids = torch.tensor(values * 3).view(2, 3)
    serialized = INTEGERS.encode(ids)
    assert serialized.dtype == narrow
    decoded = INTEGERS.decode(serialized, "targets", [2, 3], torch.int64)
    assert decoded.dtype == torch.int64 and torch.equal(decoded, ids)
    with pytest.raises(CodecError, match="expected"):  # floats are not targets, nor is a wider dtype than expected
        INTEGERS.decode(RAW.encode(ids.float()), "targets", [2, 3], torch.int64)
    with pytest.raises(CodecError, match="expected"):
        INTEGERS.decode(INTEGERS.encode(torch.tensor([2 ** 40] * 6).view(2, 3)), "targets", [2, 3], torch.int32)


def test_an_unknown_codec_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown codec 'zip': one of none, float16"):
        codec("zip")


def tampered(serialized, **fields):
    copy = type(serialized)()
    copy.CopyFrom(serialized)
    for key, value in fields.items():
        if key == "size":
            del copy.size[:]
            copy.size.extend(value)
        else:
            setattr(copy, key, value)
    return copy


def test_headers_that_lie_are_refused_before_anything_is_decoded():
    x = activations((2, 64, 96))
    int4, shape = CODECS["int4"], [2, 64, 96]
    good = int4.encode(x)
    payload_bytes = blockwise.packed_bytes(x.numel(), 4)
    for bad, expected in [
        (tampered(good, size=[payload_bytes + 1]), "expected"),  # says one byte more than it holds
        (tampered(good, size=[2 ** 31 - 1]), "expected"),  # a huge size claimed, nothing allocated for it
        (tampered(good, dtype="float32"), "expected"),
        (tampered(good, compression=CompressionType.FLOAT16), "expected"),
        (tampered(good, compression=77), "compressed as 77"),  # not even hivemind's
        (tampered(good, buffer=good.buffer[:-3]), "could not be decoded"),  # the buffer is shorter than its header
        (CODECS["int8"].encode(x), "expected"),  # another codec's bytes
        (int4.encode(x[:1]), "expected"),  # another shape's
    ]:
        with pytest.raises(CodecError, match=expected):
            int4.decode(bad, "activations", shape)
    with pytest.raises(CodecError, match="expected"):
        CODECS["float16"].decode(serialize_torch_tensor(x, CompressionType.UNIFORM_8BIT), "activations", shape)


@pytest.mark.parametrize("name", ["none", "float16", "meanstd16"])
def test_a_part_that_asks_for_autograd_decodes_as_plain_values(name):
    """hivemind's deserializer obeys the sender's ``requires_grad``; a ring part with it set made the reduce's
    in-place sum raise and, averaged into a stage's anchor, failed every later round of that stage."""
    part = CODECS[name].encode(torch.linspace(-1, 1, 64))
    part.requires_grad = True
    decoded = CODECS[name].decode(part, "a ring part", None)
    assert not decoded.requires_grad
    total = torch.zeros(64)
    torch.add(total, decoded, out=total)  # the ring's reduce: raised "don't support automatic differentiation"
    assert torch.allclose(total, torch.linspace(-1, 1, 64), atol=0.05)


def test_a_count_or_scale_that_lies_is_refused():
    x = activations((2, 64))
    int4 = CODECS["int4"]
    payload = blockwise.quantize(x, 4)
    lying_count = payload.clone()
    lying_count[:4] = torch.tensor(list((x.numel() - 1).to_bytes(4, "little")), dtype=torch.uint8)
    with pytest.raises(CodecError, match="says it holds 127 values"):
        int4.decode(serialize_torch_tensor(lying_count), "activations", [2, 64])
    lying_count[:4] = torch.tensor(list((10 * x.numel()).to_bytes(4, "little")), dtype=torch.uint8)
    with pytest.raises(CodecError, match="says it holds 1280 values in 72 bytes"):  # a ring's part: its bytes say
        int4.decode(serialize_torch_tensor(lying_count), "ring chunk", None)
    for poison in (float("nan"), float("inf"), -1.0):
        bad = payload.clone()
        bad[4:6] = torch.tensor([poison], dtype=torch.bfloat16).view(torch.uint8)
        with pytest.raises(CodecError, match="scale that is negative, NaN or infinite"):
            int4.decode(serialize_torch_tensor(bad), "gradient", [2, 64])


def test_scales_keep_float32_range():
    x = torch.tensor([3e5, -1e-30, 0.0] * 30)  # beyond float16's 65504, and below its smallest
    decoded = CODECS["int8"].decode(CODECS["int8"].encode(x), "activations", [90])
    assert torch.isfinite(decoded).all()
    assert decoded[0].item() == pytest.approx(3e5, rel=math.ldexp(1, -6))


def test_a_link_slower_than_the_compute_switches_to_the_strong_codec_and_back_once_the_run_s_would_fit():
    link = LinkCodec("int8", "int4", window=5.0)
    assert link.observe(0.0, 0.0, 0.0) is None and link.current == "int8"
    assert link.observe(4.0, 3.0, 1.0) is None  # not a whole window yet
    # 3.6 s of messages on the link for 3 s of compute: each hop takes longer than computing the microbatch
    assert link.observe(5.0, 3.6, 3.0) == "int4" and link.link_per_compute == pytest.approx(1.2)
    assert link.observe(10.0, 3.6 + 1.0, 3.0 + 2.5) is None  # 0.4 at int4 would be ~0.78 at int8: stays
    assert link.current == "int4"
    assert link.observe(15.0, 4.6 + 0.5, 5.5 + 2.5) == "int8"  # 0.2 at int4 is ~0.39 at int8: below the 0.6 line
    assert link.observe(20.0, 5.1 + 2.0, 8.0 + 4.0) is None  # 0.5 at int8: compute is the bottleneck, stays
    assert link.observe(30.0, 7.1 + 1.0, 12.0) is None  # nothing computed in the window: nothing to weigh


def test_a_link_that_is_mostly_idle_is_not_the_bottleneck_whatever_the_ratio():
    link = LinkCodec("none", "int4", window=5.0)
    link.observe(0.0, 0.0, 0.0)
    assert link.observe(5.0, 0.5, 0.1) is None and link.link_per_compute == pytest.approx(5.0)  # 10 % of the window
    assert link.observe(10.0, 0.5 + 1.5, 0.1 + 1.0) == "int4"  # 30 %, and longer than the compute


def test_a_link_without_a_strong_codec_never_switches_and_a_total_that_goes_back_counts_afresh():
    for never in (LinkCodec("none"), LinkCodec("int8", "int8")):  # no strong codec, or the run's own
        assert all(never.observe(t, 10 * t, t) is None for t in (0.0, 10.0, 20.0)) and never.current == never.base
    link = LinkCodec("none", "int8", window=1.0)
    link.observe(0.0, 50.0, 10.0)
    assert link.observe(2.0, 0.5, 0.1) is None  # a new count starts at zero again
    assert link.observe(3.0, 1.5, 0.2) == "int8"


@pytest.mark.parametrize("name", ["float16", "meanstd16"])
def test_a_bfloat16_tensor_goes_as_it_is_in_a_16_bit_codec(name):
    """A user model's bfloat16 boundary under a 16-bit codec: hivemind's refuse bfloat16, and every send of such a
    stage failed to encode. It is 16 bits already, so it goes as it is, and decodes exactly."""
    tensor = torch.randn(3, 5).to(torch.bfloat16)
    serialized = CODECS[name].encode(tensor)
    assert serialized.compression == CompressionType.NONE and serialized.dtype == "bfloat16"
    assert torch.equal(CODECS[name].decode(serialized, "activations", [3, 5], torch.bfloat16), tensor)
    with pytest.raises(CodecError):  # a float32 tensor still goes compressed, and a raw one is refused
        CODECS[name].decode(RAW.encode(torch.randn(3, 5)), "activations", [3, 5], torch.float32)


def test_targets_go_exactly_whatever_the_activations_codec():
    """A regression's float targets travelled in the activations' codec (int3: 0..100 came back as 14.4, 14.4, ...,
    101.0), which the receiver, decoding targets as they are, refused. Only the first tensor takes the codec."""
    from ravnest_swarm.pipeline import wire

    activations, targets = torch.randn(8, 16), torch.linspace(0, 100, 8)
    frames = wire.encode({"microbatch": 0}, [activations, targets], "int3")
    _, (sent_activations, sent_targets) = asyncio.run(read_back(frames))
    assert torch.equal(wire.decode_tensor(sent_targets, "targets", [8], torch.float32), targets)
    assert sent_activations.dtype == "uint8"  # the activations are int3's


async def read_back(frames):
    from ravnest_swarm.pipeline import wire

    reader = asyncio.StreamReader()
    reader.feed_data(frames_bytes(frames) + END_OF_STREAM)
    return await wire.read_message(reader, wire.DEFAULT_MAX_MESSAGE_BYTES)


def test_a_raw_tensor_is_refused_by_its_header_before_it_is_decoded(monkeypatch):
    """A holder's layer or optimizer state: 17 MB of float16 declared complex128 decoded to 136 MB before a check of
    its shape refused it. The header is checked first: only uncompressed tensors, of the expected shape and dtype."""
    from hivemind.proto import runtime_pb2

    import ravnest_swarm.codecs.codec as codecs_module

    decoded = []
    monkeypatch.setattr(codecs_module, "deserialize_torch_tensor",
                        lambda serialized: decoded.append(serialized) or torch.zeros(0))
    bomb = runtime_pb2.Tensor(buffer=b"\x00" * 64, size=[32], dtype="complex128", compression=CompressionType.FLOAT16)
    for shape, dtype in ((None, None), ([32], None), ([4, 4], torch.float32)):
        with pytest.raises(CodecError, match="uncompressed"):
            raw_tensor(bomb, "weight", shape, dtype)
    with pytest.raises(CodecError, match=r"expected \[4, 4\] float32"):
        raw_tensor(serialize_torch_tensor(torch.zeros(4, 4, dtype=torch.float64)), "weight", [4, 4], torch.float32)
    assert decoded == []
    monkeypatch.undo()
    for tensor in (torch.ones(4, 4), torch.tensor(7), torch.ones(3, dtype=torch.bfloat16)):
        assert torch.equal(raw_tensor(serialize_torch_tensor(tensor), "t", tensor.shape, tensor.dtype), tensor)
    # a dtype the sender spelled (numpy's error quoted it; a getattr on torch could import a submodule): refused
    # without quoting it, and without asking torch or numpy what it is
    for spelled in ("shares no ring", "onnx", "object"):
        spoofed = serialize_torch_tensor(torch.ones(4))
        spoofed.dtype = spelled
        with pytest.raises(CodecError) as refusal:
            raw_tensor(spoofed, "weight")
        assert spelled not in str(refusal.value), refusal.value

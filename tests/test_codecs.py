"""Codecs: error bounds on awkward sizes and extreme values, byte counts, rejection of malformed
input and payloads, and error feedback's convergence."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from diloco import cache_chunks
from diloco.codecs import (CODEC_NAMES, DEFAULT_BLOCK, SCALE_BYTES, TENSOR_HEADER_BYTES, Encoded, ErrorFeedback,
                           compiled, get_codec)
from diloco.errors import DilocoError

BLOCK_CODECS = ("int8", "int4", "fp4")
LEVELS = {"int8": 127, "int4": 7}
SHAPES = [(0,), (1,), (63,), (64,), (65,), (1000,), (4097,), (3, 5, 7), (2, 0, 3), (17, 31)]
FLT_MAX = torch.finfo(torch.float32).max
SUBNORMAL_STEP = 2.0**-149


@pytest.fixture(autouse=True, params=["torch", "compiled"])
def codec_loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test twice: with the codecs' torch ops, and with their compiled loops at any size."""
    if request.param == "compiled":
        pytest.importorskip("numba")
        monkeypatch.setattr(compiled, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(compiled, "_enabled", request.param == "compiled")
    return request.param


def _normal(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * 1e-3


def _huge(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=gen) * 1e30
    flat = x.view(-1)
    flat[:1] = FLT_MAX
    flat[1:2] = -FLT_MAX
    return x


def _subnormal(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * 1e-40


def _zeros(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    x = torch.zeros(shape)
    x.view(-1)[::3] = -0.0
    return x


def _wide(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Magnitudes from 1e-38 to 1e38 side by side in a block."""
    exponents = torch.rand(shape, generator=gen) * 76 - 38
    return torch.randn(shape, generator=gen).sign() * torch.pow(10.0, exponents)


KINDS = {"normal": _normal, "huge": _huge, "subnormal": _subnormal, "zeros": _zeros, "wide": _wide}


def make(kind: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return KINDS[kind](shape, torch.Generator().manual_seed(seed))


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block absmax, by a route independent of the codecs'."""
    flat = x.reshape(-1).double()
    padded = torch.cat((flat, flat.new_zeros(-flat.numel() % block)))
    return padded.view(-1, block).abs().amax(1).repeat_interleave(block)[:flat.numel()]


def roundtrip(name: str, x: torch.Tensor, block: int = DEFAULT_BLOCK) -> tuple[Encoded, torch.Tensor]:
    codec = get_codec(name, block)
    encoded = codec.encode(x)
    decoded = codec.decode(encoded)
    assert decoded.dtype == torch.float32 and decoded.shape == x.shape
    return encoded, decoded


def error_bound(name: str, x: torch.Tensor, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Per-element bound on |decoded − x| that each codec documents, with float rounding slack."""
    flat = x.reshape(-1).double()
    if name == "fp32":
        return torch.zeros_like(flat)
    if name == "bf16":
        return flat.abs() * 2.0**-8 + 2.0**-134
    s = block_absmax(x, block)
    if name in LEVELS:
        return s * (0.5 / LEVELS[name] + 1e-6) + SUBNORMAL_STEP
    return torch.maximum(flat.abs() * (math.sqrt(2) - 1), s * 2**-6.5) * (1 + 1e-5) + SUBNORMAL_STEP


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_error_within_documented_bound(name, shape, kind):
    x = make(kind, shape)
    original = x.clone()
    _, decoded = roundtrip(name, x)
    assert torch.equal(x.view(torch.int32), original.view(torch.int32))  # the input is left alone
    error = (decoded.reshape(-1).double() - x.reshape(-1).double()).abs()
    assert torch.isfinite(decoded).all()
    assert (error <= error_bound(name, x)).all()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fp32_is_bit_exact(kind):
    x = make(kind, (4097,))
    _, decoded = roundtrip("fp32", x)
    assert torch.equal(decoded.view(torch.int32), x.view(torch.int32))  # negative zero included


@pytest.mark.parametrize("block", [1, 7, 128, 5000])
@pytest.mark.parametrize("name", BLOCK_CODECS)
def test_any_block_size(name, block):
    x = make("normal", (1000,))
    encoded, decoded = roundtrip(name, x, block)
    assert encoded.block == block
    assert ((decoded - x).double().abs() <= error_bound(name, x, block)).all()


@pytest.mark.parametrize("block", [7, 64])
@pytest.mark.parametrize("name", BLOCK_CODECS)
def test_chunks_do_not_change_the_result(name, block, monkeypatch):
    codec = get_codec(name, block)
    x = make("wide", (4097,))
    encoded = codec.encode(x)
    decoded = codec.decode(encoded)
    monkeypatch.setattr(cache_chunks, "CPU_CHUNK_ELEMENTS", 100)
    assert codec.encode(x) == encoded
    assert torch.equal(codec.decode(encoded), decoded)


@pytest.mark.parametrize("chunk", [None, 100])
@pytest.mark.parametrize("block", [7, 64])
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_fused_difference_and_sum_are_the_separate_passes_bit_for_bit(name, block, chunk, monkeypatch):
    """encode_difference and decode_onto (what a lossy downlink publishes) take their difference and sum
    a chunk at a time in cache: the same values as the separate passes, in every chunking."""
    if chunk is not None:
        monkeypatch.setattr(cache_chunks, "CPU_CHUNK_ELEMENTS", chunk)
    codec = get_codec(name, block)
    base, x = make("wide", (4097,), seed=1), make("wide", (4097,), seed=2)
    encoded = codec.encode_difference(x, base)
    assert encoded == codec.encode(x - base)
    fused = codec.decode_onto(encoded, base)
    assert torch.equal(fused.view(torch.int32), (codec.decode(encoded) + base).view(torch.int32))


@pytest.mark.parametrize("name", BLOCK_CODECS)
def test_all_zero_block_decodes_to_zeros(name):
    x = torch.randn(200)
    x[64:128] = 0.0
    x[190:] = 0.0  # the last, partial block
    _, decoded = roundtrip(name, x)
    assert (decoded[64:128] == 0).all() and (decoded[190:] == 0).all()


@pytest.mark.parametrize("name", BLOCK_CODECS)
def test_block_absmax_is_exact(name):
    x = make("wide", (1000,))
    _, decoded = roundtrip(name, x)
    largest = x.abs().reshape(-1)[:960].view(-1, 64).argmax(1) + torch.arange(0, 960, 64)
    assert torch.equal(decoded[largest], x[largest])


def test_fp4_grid_and_log_rounding():
    s = 1.0
    values = [s, 0.70, 0.71, -0.3, 0.011, 0.0111, 2**-6, -2**-6.5 * 0.999, 0.0, -0.0]
    expected = [1.0, 0.5, 1.0, -0.25, 0.0, 2**-6, 2**-6, 0.0, 0.0, 0.0]
    _, decoded = roundtrip("fp4", torch.tensor(values))
    assert decoded.tolist() == expected
    grid = {0.0} | {sign * 2.0**k for k in range(-6, 1) for sign in (1, -1)}
    _, decoded = roundtrip("fp4", torch.rand(64) * 2 - 1)
    scale = decoded.abs().max().item()
    assert {v / scale for v in decoded.tolist()} <= grid


@pytest.mark.parametrize("name, numel, block, payload, scales", [
    ("fp32", 1000, 64, 4000, 0),
    ("bf16", 1000, 64, 2000, 0),
    ("int8", 1000, 64, 1000, 16),
    ("int4", 1000, 64, 500, 16),
    ("fp4", 1000, 64, 500, 16),
    ("int4", 1001, 64, 501, 16),
    ("fp4", 4097, 64, 2049, 65),
    ("int8", 64, 64, 64, 1),
    ("int4", 1, 64, 1, 1),
    ("int8", 0, 64, 0, 0),
    ("int4", 1000, 128, 500, 8),
])
def test_wire_bytes(name, numel, block, payload, scales):
    encoded, _ = roundtrip(name, torch.randn(numel), block)
    assert len(encoded.payload) == payload
    assert len(encoded.scales) == scales * SCALE_BYTES
    assert encoded.wire_bytes() == TENSOR_HEADER_BYTES + payload + scales * SCALE_BYTES
    assert get_codec(name, block).wire_bytes(numel) == encoded.wire_bytes()


def test_int4_of_1000_elements_is_580_bytes():
    encoded, _ = roundtrip("int4", torch.randn(1000))
    assert encoded.wire_bytes() == 500 + 16 * 4 + TENSOR_HEADER_BYTES == 580


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("position", [0, 999])
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_non_finite_input_is_rejected(name, position, bad):
    x = torch.randn(1000)
    x[position] = bad
    with pytest.raises(DilocoError, match="NaN or Inf"):
        get_codec(name).encode(x)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_only_fp32_tensors_are_encoded(name):
    for x in (torch.randn(10, dtype=torch.float64), torch.arange(10), [1.0, 2.0]):
        with pytest.raises(DilocoError, match="fp32"):
            get_codec(name).encode(x)


def test_encoding_copies_the_input():
    x = torch.randn(100)
    codec = get_codec("fp32")
    encoded = codec.encode(x)
    original = x.clone()
    x.add_(1.0)
    assert torch.equal(codec.decode(encoded), original)


def test_unknown_codec_lists_the_known_ones():
    with pytest.raises(DilocoError, match="fp32, bf16, int8, int4, fp4"):
        get_codec("int2")
    with pytest.raises(DilocoError, match="block size"):
        get_codec("int4", block=0)


def _corruptions(name: str, encoded: Encoded) -> dict[str, Encoded]:
    replace = functools.partial(dataclasses.replace, encoded)
    cases = {
        "truncated payload": replace(payload=encoded.payload[:-1]),
        "extra payload byte": replace(payload=bytes(encoded.payload) + b"\0"),
        "empty payload": replace(payload=b""),
        "payload not bytes": replace(payload=bytearray(encoded.payload)),
        "other codec": replace(codec="int8" if name != "int8" else "int4"),
        "bigger shape": replace(shape=(1001,)),
        "negative dim": replace(shape=(-1000,)),
        "dim not an int": replace(shape=(1000.0,)),
        "shape a list": replace(shape=[1000]),
        "enormous shape": replace(shape=(2**40, 2**40)),
    }
    if name in BLOCK_CODECS:
        nan_scale = bytearray(encoded.scales)
        nan_scale[4:8] = torch.tensor([float("nan")]).numpy().tobytes()
        negative_scale = bytearray(encoded.scales)
        negative_scale[-4:] = torch.tensor([-1.0]).numpy().tobytes()
        cases |= {
            "truncated scales": replace(scales=encoded.scales[:-4]),
            "no scales": replace(scales=b""),
            "block 0": replace(block=0),
            "other block": replace(block=32),
            "block a bool": replace(block=True),
            "NaN scale": replace(scales=bytes(nan_scale)),
            "negative scale": replace(scales=bytes(negative_scale)),
        }
    else:
        nan_value = bytearray(encoded.payload)
        nan_value[-4:] = b"\xff\xff\xff\xff"
        cases |= {"scales added": replace(scales=b"\0\0\0\0"), "block 64": replace(block=64),
                  "NaN value": replace(payload=bytes(nan_value))}
    if name in LEVELS:
        unwritten = bytearray(encoded.payload)
        unwritten[10] = 0x80 if name == "int8" else 0x08  # -128, or -8 in the low nibble
        cases["unwritten code"] = replace(payload=bytes(unwritten))
    return cases


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_malformed_encoded_is_rejected(name):
    codec = get_codec(name)
    encoded = codec.encode(torch.randn(1000))
    for case, bad in _corruptions(name, encoded).items():
        with pytest.raises(DilocoError):
            codec.decode(bad)
            pytest.fail(f"{name}: {case} was accepted")


def _running_error(name: str, feedback: bool, steps: int = 300) -> tuple[float, float]:
    """(largest |Σ inputs − Σ decoded| over the steps, |mean decoded − true value| at the end) for a
    constant 0.3 that sits between grid points, next to a 1.0 that sets the block's scale."""
    codec = get_codec(name)
    ef = ErrorFeedback(codec)
    x = torch.full((64,), 0.3)
    x[0] = 1.0
    total = torch.zeros(64, dtype=torch.float64)
    worst = 0.0
    for step in range(1, steps + 1):
        encoded = ef.encode("w", x) if feedback else codec.encode(x)
        total += codec.decode(encoded).double()
        worst = max(worst, (step * x.double() - total).abs().max().item())
    return worst, (total[1:] / steps - 0.3).abs().max().item()


@pytest.mark.parametrize("name", ["int4", "fp4"])
def test_error_feedback_converges_where_plain_coding_stays_biased(name):
    worst, bias = _running_error(name, feedback=True)
    assert worst < 0.5
    assert bias < 0.5 / 300
    _, plain_bias = _running_error(name, feedback=False)
    assert plain_bias > 0.01  # 2/7 for int4, 1/4 for fp4


def test_error_feedback_keeps_the_residual_per_name():
    ef = ErrorFeedback(get_codec("int4"))
    a, b = torch.randn(100), torch.randn(3, 7)
    for _ in range(2):
        residual_a = ef.residuals.get("a", torch.zeros(100))
        encoded = ef.encode("a", a)
        ef.encode("b", b)
        assert torch.allclose(ef.residuals["a"], a + residual_a - ef.codec.decode(encoded))
    assert ef.residuals["b"].shape == b.shape
    encoded, decoded = ef.roundtrip("b", b)
    assert torch.equal(decoded, ef.codec.decode(encoded))
    with pytest.raises(DilocoError, match="shape"):
        ef.encode("a", torch.randn(101))
    ef.reset()
    assert not ef.residuals


def test_a_codec_is_made_once_per_name_and_block_and_a_peers_blocks_cannot_grow_the_cache():
    """A shard looks a push's codec up for every tensor: the instance, and the tables it made, are shared."""
    from diloco.codecs.registry import _shared

    assert get_codec("int4") is get_codec("int4", DEFAULT_BLOCK)
    assert get_codec("int4", 32) is not get_codec("int4") and get_codec("int4", 32).block == 32
    tables = get_codec("int8").loop_tables() if compiled.is_enabled() else None
    assert tables is None or get_codec("int8").loop_tables() is tables
    for bad in (True, 0, 2**32, 1.0, "64"):
        with pytest.raises(DilocoError, match="block size must be an integer"):
            get_codec("int4", bad)
    with pytest.raises(DilocoError, match="unknown codec"):
        get_codec(["int4"])  # type: ignore[arg-type]
    for block in range(1, 300):  # block sizes as a peer's headers may claim them
        get_codec("int8", block)
    assert _shared.cache_info().currsize <= 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_all_finite_finds_nan_and_either_infinity_anywhere(dtype):
    from diloco.codecs.base import all_finite, require_finite

    values = torch.linspace(-3, 3, 1001, dtype=dtype)
    assert all_finite(values) and all_finite(values[:0]) and all_finite(values.reshape(7, 11, 13)[:, ::2])
    for bad in (math.nan, math.inf, -math.inf):
        for at in (0, 500, 1000):
            damaged = values.clone()
            damaged[at] = bad
            assert not all_finite(damaged)
            with pytest.raises(DilocoError, match="^pushed Δ holds NaN or Inf"):
                require_finite(damaged, "pushed Δ")
    assert all_finite(torch.arange(5)) and all_finite(torch.tensor([True, False]))
    assert not all_finite(torch.tensor([1 + 1j, complex(math.nan, 0)]))

"""The codecs' compiled loops (numba) give the bytes and values of their torch ops, bit for bit, and refuse
what they refuse with the same message: a shard with numba and a learner without must agree exactly."""

from __future__ import annotations

import pytest
import torch

from diloco.codecs import compiled, get_codec
from diloco.errors import DilocoError

pytest.importorskip("numba")

BLOCK_CODECS = ("int8", "int4", "fp4")
LEVELS = {"int8": 127, "int4": 7}
LARGE = compiled.MIN_ELEMENTS + 13
"""Above the size the compiled loops take, and odd: the last int4 byte holds one code."""


def _values(kind: str, numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(numel, generator=gen) * 1e-3
    if kind == "wide":  # magnitudes from 1e-38 to 1e38 side by side in a block
        exponents = torch.rand(numel, generator=gen) * 76 - 38
        return torch.randn(numel, generator=gen).sign() * torch.pow(10.0, exponents)
    if kind == "subnormal":
        return torch.randn(numel, generator=gen) * 1e-40
    x = torch.randn(numel, generator=gen)
    x[::7] = 0.0
    x[1::11] = -0.0
    x[:4096] = 0.0  # whole blocks of zeros
    return x


def _both(run, monkeypatch: pytest.MonkeyPatch):
    """run() with the torch ops, then with the compiled loops (which must be the ones taken)."""
    monkeypatch.setattr(compiled, "_enabled", False)
    eager = run()
    monkeypatch.setattr(compiled, "_enabled", True)
    taken = []
    for name in ("decode", "encode_linear"):
        real = getattr(compiled, name)
        monkeypatch.setattr(compiled, name,
                            lambda *a, _real=real, _name=name, **k: taken.append(_name) or _real(*a, **k))
    loops = run()
    assert taken, "the compiled loops were not taken"
    return eager, loops


@pytest.mark.parametrize("kind", ["normal", "wide", "subnormal", "zeros"])
@pytest.mark.parametrize("name,block", [(name, block) for name in BLOCK_CODECS for block in (64, 2, 3, 1, 1 << 20)
                                        if name != "fp4" or block % 2 == 0])  # fp4, odd: torch both ways
def test_compiled_loops_give_the_torch_bytes_and_values(name, block, kind, monkeypatch):
    codec = get_codec(name, block)
    x, base = _values(kind, LARGE, 1), _values(kind, LARGE, 2)
    encoded = codec.encode(x)  # decoded by both from the same bytes

    def run():
        return (codec.encode(x), codec.encode_difference(x, base), *codec.encode_difference_onto(x, base),
                codec.decode(encoded), codec.decode_onto(encoded, base))

    eager, loops = _both(run, monkeypatch)
    assert loops[0] == eager[0] and loops[1] == eager[1] and loops[2] == eager[2] == eager[1]  # byte for byte
    moved = codec.decode_onto(eager[1], base)  # a syncer's published copy moved towards x, in two passes
    for got, want in zip(loops[3:], (moved, *eager[4:])):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(eager[3].view(torch.int32), moved.view(torch.int32))


@pytest.mark.parametrize("name", sorted(LEVELS))
def test_halves_round_to_even_as_torch_does(name, monkeypatch):
    """Elements exactly halfway between two codes (a block of absmax 1 holding (k + ½)/L): rounded to the
    even code, as torch's round does."""
    levels = LEVELS[name]
    halves = (torch.arange(-levels, levels).float() + 0.5) / levels
    assert torch.equal(halves * levels, torch.arange(-levels, levels).float() + 0.5)  # exact halves
    block = torch.ones(64)
    block[1:1 + halves.numel()] = halves[:63]
    x = block.repeat(LARGE // 64 + 1)[:LARGE]
    codec = get_codec(name)
    eager, loops = _both(lambda: codec.encode(x), monkeypatch)
    assert loops == eager
    decoded = codec.decode(loops)[1:1 + min(63, halves.numel())] * levels
    assert torch.equal(decoded, torch.round(halves[:63] * levels))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("name", sorted(LEVELS))
def test_non_finite_input_is_refused_in_the_same_words(name, bad, monkeypatch):
    x = torch.randn(LARGE)
    x[LARGE // 2] = bad
    messages = []
    base = torch.zeros(LARGE)
    for enabled in (False, True):
        monkeypatch.setattr(compiled, "_enabled", enabled)
        for encode in (get_codec(name).encode_difference, get_codec(name).encode_difference_onto):
            with pytest.raises(DilocoError, match="NaN or Inf") as refused:
                encode(x, base)
            messages.append(str(refused.value))
    assert len(set(messages)) == 1
    assert torch.equal(base, torch.zeros(LARGE))  # moving a copy onto it wrote a new tensor, never base


@pytest.mark.parametrize("position", [0, 1, LARGE // 2 - 1])
@pytest.mark.parametrize("name", sorted(LEVELS))
def test_a_code_no_encoder_writes_is_refused_in_the_same_words(name, position, monkeypatch):
    codec = get_codec(name)
    encoded = codec.encode(torch.randn(LARGE))
    payload = bytearray(encoded.payload)
    payload[position] = 0x80 if name == "int8" else 0x80 | (payload[position] & 0x0F)  # -128, or -8 high
    corrupt = type(encoded)(encoded.codec, encoded.shape, encoded.block, bytes(payload), encoded.scales)
    base = torch.zeros(LARGE)
    messages = []
    for enabled in (False, True):
        monkeypatch.setattr(compiled, "_enabled", enabled)
        for decode in (lambda: codec.decode(corrupt), lambda: codec.decode_onto(corrupt, base)):
            with pytest.raises(DilocoError, match="a code no encoder writes") as refused:
                decode()
            messages.append(str(refused.value))
    assert len(set(messages)) == 1
    assert torch.equal(base, torch.zeros(LARGE))  # decode_onto wrote a new tensor, never its base


def test_small_tensors_subclasses_and_accelerators_take_the_torch_ops():
    plain = torch.zeros(4)
    assert compiled.usable(compiled.MIN_ELEMENTS, plain)
    assert not compiled.usable(compiled.MIN_ELEMENTS - 1, plain)
    assert not compiled.usable(compiled.MIN_ELEMENTS, plain, torch.zeros(4, device="meta"))
    assert not compiled.usable(compiled.MIN_ELEMENTS, torch.nn.Parameter(plain))  # a subclass


def test_a_numba_that_will_not_import_leaves_the_torch_ops(monkeypatch, caplog):
    def broken():
        raise ImportError("numpy 9 is not supported")

    monkeypatch.setattr(compiled, "_kernels", broken)
    monkeypatch.setattr(compiled, "_enabled", True)
    x = torch.randn(LARGE)
    encoded = get_codec("int4").encode(x)
    assert not compiled._enabled and "numba did not load (ImportError: numpy 9" in caplog.text
    monkeypatch.setattr(compiled, "_enabled", False)
    assert get_codec("int4").encode(x) == encoded

"""Compiled CPU loops for the block codecs, where numba is installed (`pip install "diloco[fast]"`).

Why: in eager torch every op is a pass over memory, and a block codec's decode is several (a lookup,
an index conversion, a scale, a check) and its encode more (a difference, an abs, a max, a divide, a
round, a pack). A shard decodes every push and encodes and decodes every answer, so these passes were
half of its merge's CPU. One compiled loop does a block's work while the block is in registers.

Each loop does the fp32 arithmetic of the torch ops it replaces, element by element in the same order
(no fast-math), so its values are the same bit for bit (`tests/test_compiled_codecs.py` compares
both). Without numba, on an accelerator, or for small tensors (whose work is Python's, not memory's)
the torch ops run. Numba is imported on the first large tensor, not at import: a learner that never
codes one never pays for it, and compiled loops are cached on disk after the first process.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch

import diloco.chunk_threads as chunk_threads

MIN_ELEMENTS = 1 << 16
"""Below this a tensor takes the torch path: a call's fixed cost is then most of the work."""

_enabled = importlib.util.find_spec("numba") is not None


def set_enabled(flag: bool) -> None:
    """Turn the compiled loops off (or on again, where numba is installed): benchmarks compare both."""
    global _enabled
    _enabled = flag and importlib.util.find_spec("numba") is not None


def is_enabled() -> bool:
    return _enabled


def describe() -> str:
    """Which loops large tensors take, for a shard's log."""
    if _enabled:
        return f"compiled loops (numba) for tensors of {MIN_ELEMENTS} elements or more"
    return "torch ops (numba is not installed: `pip install \"diloco[fast]\"` codes 2-4x faster)"


def usable(numel: int, *tensors: torch.Tensor) -> bool:
    """Whether coding `numel` elements held in `tensors` takes the compiled loops: plain CPU tensors (not
    a subclass such as a DTensor, whose local data numpy cannot see), numba importable."""
    return (_enabled and numel >= MIN_ELEMENTS
            and all(type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided
                    and not t.is_neg() for t in tensors)
            and loaded())


def loaded() -> bool:
    """numba imported and the loops defined; where numba is installed but will not import (a numpy it
    does not support), the torch ops from now on, said once."""
    global _enabled
    try:
        _kernels()
    except Exception as exc:  # noqa: BLE001 — any failure to import leaves the torch ops, which always work
        _enabled = False
        logging.getLogger(__name__).warning("codecs: numba did not load (%s: %s); using torch ops",
                                            type(exc).__name__, exc)
        return False
    return True


@dataclass(frozen=True)
class DecodeTables:
    """A codec's byte table as the loops read it, made once per codec: each byte's first and (two codes
    per byte) second value, and whether the byte holds a code no encoder writes."""

    first: np.ndarray
    second: np.ndarray | None
    corrupt: np.ndarray
    squares: np.ndarray
    """Σ value² of each byte's codes, in float64: a block's Σ value² is its scale² times the sum of these."""

    @classmethod
    def of(cls, values: np.ndarray) -> DecodeTables:
        """From (256, codes per byte) fp32 values, the earlier element's first."""
        second = np.ascontiguousarray(values[:, 1]) if values.shape[1] == 2 else None
        return cls(np.ascontiguousarray(values[:, 0]), second,
                   np.isnan(values).any(axis=1).astype(np.uint8),  # a value is NaN exactly where its code's is
                   np.nan_to_num((values.astype(np.float64) ** 2).sum(axis=1)))


def decode(payload: np.ndarray, tables: DecodeTables, scales: np.ndarray, block: int, out: torch.Tensor,
           plus: torch.Tensor | None) -> bool:
    """out[i] = the value of element i's code · its block's scale (+ plus[i]); True where any value before
    `plus` is NaN (a code no encoder writes). Two codes per byte need an even `block` (`decodes`)."""
    target = out.numpy()
    added = target if plus is None else plus.reshape(-1).numpy()
    if tables.second is None:
        return bool(_kernels()["singles"](payload, tables.first, tables.corrupt, scales, block, target, added,
                                          plus is not None))
    return bool(_kernels()["pairs"](payload, tables.first, tables.second, tables.corrupt, scales, block, target,
                                    added, plus is not None))



def decodes(codes_per_byte: int, block: int) -> bool:
    """Whether `decode` takes this layout: a byte's two codes in one block."""
    return codes_per_byte == 1 or block % 2 == 0


def encode_linear(x: torch.Tensor, minus: torch.Tensor | None, block: int, levels: int, codes: np.ndarray | None,
                  scales: np.ndarray, onto: tuple[torch.Tensor, DecodeTables, int] | None = None,
                  packed: np.ndarray | None = None) -> None:
    """The linear codes of x − minus (x where None): per block its absmax s into `scales` (NaN or Inf if
    the block holds one, for the caller's finite check) and round_half_even((x − minus)/s · levels) into
    `codes` (int8), with s = 1 for an all-zero block. With `packed` (uint8, one byte per two codes, an even
    block) instead of `codes`, each block goes into `packed` as `pack_nibbles` packs it, while in cache: no
    codes of the whole tensor are written and read again. With `onto` (out, the codec's tables,
    the mask of a code's bits), also out = minus + each code's value · s, as `decode` onto minus computes it,
    while the block is in cache; a block that is not finite is left unwritten there (the caller refuses it)."""
    if onto is not None and minus is None:
        raise ValueError("decoding onto needs the tensor the difference was taken from")
    if (packed is None) == (codes is None):
        raise ValueError("codes go into `codes` or, packed, into `packed`: one of them")
    if packed is not None and (block % 2 or packed.shape[0] != (x.numel() + 1) // 2):
        raise ValueError("packing as it encodes needs an even block and a byte per two codes")
    source = x.numpy()
    subtracted = source if minus is None else minus.numpy()
    if onto is not None and not _linear(onto[1], levels, onto[2]):
        raise ValueError(f"a table whose codes are not q / {levels} cannot be decoded onto as a linear code")
    out = np.empty(0, np.float32) if onto is None else onto[0].numpy()
    kernel, spans = _kernels()["encode_linear"], chunk_threads.pieces(source.shape[0], block)

    def piece(start: int, stop: int) -> None:
        """Whole blocks from `start` (even where packed): their scales, codes, bytes and values, as the one
        loop over the tensor makes them."""
        kernel(source[start:stop], subtracted[start:stop], minus is not None, block, levels,
               codes[start:stop] if codes is not None else np.empty(0, np.int8),
               scales[start // block:-(-stop // block)],
               out[start:stop] if onto is not None else out, onto is not None,
               np.empty(0, np.uint8) if packed is None else packed[start // 2:(stop + 1) // 2], packed is not None)

    chunk_threads.run(spans, piece)


def _linear(tables: DecodeTables, levels: int, mask: int) -> bool:
    """Whether each code q (its `mask` bits, two's complement) decodes to fp32(q) / levels, as the encode's
    decode onto computes it in place of a table lookup (the linear codecs' tables are made so)."""
    key = (tables.first.tobytes(), levels, mask)
    if key not in _LINEAR:
        q = np.arange(256) & mask
        q = np.where(q > mask // 2, q - (mask + 1), q).astype(np.float32)
        valid = tables.corrupt == 0
        _LINEAR[key] = bool(np.array_equal(tables.first[valid], (q / np.float32(levels))[valid]))
    return _LINEAR[key]


_LINEAR: dict[tuple[bytes, int, int], bool] = {}


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Even-length int8 codes → bytes of two 4-bit codes each, the earlier in the low nibble."""
    packed = np.empty(codes.size // 2, dtype=np.uint8)
    _kernels()["pack"](codes, packed)
    return packed


@cache
def _kernels() -> dict[str, Callable[..., Any]]:
    """The loops, compiled on first use. Each loop indexes slices from 0, so that the compiler sees
    contiguous accesses and vectorizes them; `error_model="numpy"` keeps division free of Python's
    zero check, which stops vectorization (no divisor is ever zero here)."""
    import numba

    jit = numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
    round_shift = np.float32(1.5 * 2**23)
    """y + 1.5·2^23 − 1.5·2^23 rounds |y| < 2^22 to an integer, half to even, as torch's `round` does."""

    @jit
    def pairs(payload, first, second, corrupt, scales, block, out, plus, add):  # type: ignore[no-untyped-def]
        half = block // 2
        numel = out.shape[0]
        whole_bytes = numel // 2
        flag = np.uint8(0)
        for b in range(scales.shape[0]):
            scale = scales[b]
            start = b * half
            stop = min(start + half, whole_bytes)
            if stop <= start:
                break
            source = payload[start:stop]
            target = out[2 * start:2 * stop]
            if add:
                extra = plus[2 * start:2 * stop]
                for j in range(source.shape[0]):
                    byte = source[j]
                    flag |= corrupt[byte]
                    target[2 * j] = first[byte] * scale + extra[2 * j]
                    target[2 * j + 1] = second[byte] * scale + extra[2 * j + 1]
            else:
                for j in range(source.shape[0]):
                    byte = source[j]
                    flag |= corrupt[byte]
                    target[2 * j] = first[byte] * scale
                    target[2 * j + 1] = second[byte] * scale
        if numel % 2:  # an odd count's last byte holds one code
            byte = payload[whole_bytes]
            flag |= corrupt[byte]
            value = first[byte] * scales[scales.shape[0] - 1]
            out[numel - 1] = value + plus[numel - 1] if add else value
        return flag != 0

    @jit
    def singles(payload, first, corrupt, scales, block, out, plus, add):  # type: ignore[no-untyped-def]
        numel = out.shape[0]
        flag = np.uint8(0)
        for b in range(scales.shape[0]):
            scale = scales[b]
            start = b * block
            stop = min(start + block, numel)
            source = payload[start:stop]
            target = out[start:stop]
            if add:
                extra = plus[start:stop]
                for i in range(source.shape[0]):
                    byte = source[i]
                    flag |= corrupt[byte]
                    target[i] = first[byte] * scale + extra[i]
            else:
                for i in range(source.shape[0]):
                    byte = source[i]
                    flag |= corrupt[byte]
                    target[i] = first[byte] * scale
        return flag != 0

    @jit
    def encode_linear_kernel(x, minus, subtract, block, levels, codes, scales, onto, apply, packed,
                             pack):  # type: ignore[no-untyped-def]
        top = np.float32(levels)
        numel = x.shape[0]
        # a block's difference and (packed) codes in arrays of the loop's own: arrays passed in might overlap
        # the outputs for all the compiler knows, and its overlap checks before each block's loops cost a
        # quarter of an int4 encode
        scratch, room = np.empty(block, np.float32), np.empty(block, np.int8)
        word = np.zeros(1, np.uint32)
        word_value = word.view(np.float32)
        magnitude = np.uint32(0x7FFFFFFF)
        infinity = np.uint32(0x7F800000)
        for b in range(scales.shape[0]):
            start = b * block
            stop = min(start + block, numel)
            part = scratch[:stop - start]
            source = x[start:stop]
            if subtract:
                other = minus[start:stop]
                for i in range(part.shape[0]):
                    part[i] = source[i] - other[i]
            else:
                for i in range(part.shape[0]):
                    part[i] = source[i]
            # the absmax as the largest |x|'s bits: exact, and NaN's bits exceed every number's
            bits = part.view(np.uint32)
            top_bits = np.uint32(0)
            for i in range(bits.shape[0]):
                top_bits = max(top_bits, np.uint32(bits[i] & magnitude))
            word[0] = top_bits
            absmax = word_value[0]
            scales[b] = absmax
            if top_bits >= infinity:
                continue  # NaN or Inf: the caller's finite check refuses it
            divisor = absmax if top_bits > 0 else np.float32(1)
            target = room[:stop - start] if pack else codes[start:stop]
            if apply:  # and onto minus as `pairs`/`singles` decode: a code's value (q / levels) · the scale + minus
                out, base = onto[start:stop], minus[start:stop]
                for i in range(part.shape[0]):
                    q = (part[i] / divisor * top + round_shift) - round_shift
                    target[i] = np.int8(q)
                    out[i] = (q / top) * absmax + base[i]
            else:
                for i in range(part.shape[0]):
                    target[i] = np.int8((part[i] / divisor * top + round_shift) - round_shift)
            if pack:  # blocks start at even elements: this block's bytes, an odd last code alone in its byte
                half = part.shape[0] // 2
                into = packed[start // 2:start // 2 + half]
                for j in range(half):
                    into[j] = np.uint8(target[2 * j] & 15) | np.uint8((target[2 * j + 1] & 15) << 4)
                if part.shape[0] % 2:
                    packed[start // 2 + half] = np.uint8(target[part.shape[0] - 1] & 15)

    @jit
    def pack(codes, packed):  # type: ignore[no-untyped-def]
        for j in range(packed.shape[0]):
            packed[j] = np.uint8(codes[2 * j] & 15) | np.uint8((codes[2 * j + 1] & 15) << 4)

    return {"pairs": pairs, "singles": singles, "encode_linear": encode_linear_kernel, "pack": pack}

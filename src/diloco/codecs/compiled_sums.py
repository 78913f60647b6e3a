"""Compiled loops that fold a block-coded push into a round's sums, and measure it, from its codes (the
`fast` extra, as `compiled.py`; used by `coded_blocks.py`).

A group of int4 pushes (group commit: `core/merging.py`) is folded together, a cache-sized piece of the
sums at a time (`fold_group`): the sums are read and written once per group, not once per push.

The fold is one fused multiply-add per element, which is what torch's `add(total, values, alpha=alpha)`
computes wherever its CPU kernels are vectorized; `folds_like_torch` checks that against the torch in this
process once, and without it nothing here is used. The sum of squares is float64 and is not bit for bit
any torch op's (see `square_sum`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
import torch

import diloco.chunk_threads as chunk_threads
import diloco.codecs.compiled as compiled
from diloco.codecs.compiled import DecodeTables


def square_sum(payload: np.ndarray, tables: DecodeTables, scales: np.ndarray, block: int, numel: int,
               levels: float | None = None) -> tuple[float, bool]:
    """Σ value² in float64, each block's as its scale² times its codes' Σ (code value)², and whether any code
    is one no encoder writes. It differs from the decoded values' own Σ value² by their fp32 rounding
    (about 1e-7 relative); no sum of fp32 squares overflows it. Nothing is written. With `levels` (a linear
    code's, `arithmetic_levels`), each block's Σ q² is summed exactly in integers and scaled by (scale /
    levels)², without a table: the same sum but for the fp32 rounding of each q / levels."""
    per_byte = 1 if tables.second is None else 2
    if levels is not None:
        total, corrupt = _kernels()["square_sum_linear"](payload, scales, block // per_byte, numel // per_byte,
                                                         numel % per_byte, per_byte == 2)
        return float(total) / (levels * levels), bool(corrupt)
    total, corrupt = _kernels()["square_sum"](payload, tables.squares, tables.first, tables.corrupt, scales,
                                              block // per_byte, numel // per_byte, numel % per_byte)
    return float(total), bool(corrupt)


def fold(payload: np.ndarray, tables: DecodeTables, scales: np.ndarray, block: int, outs: list[torch.Tensor],
         totals: list[torch.Tensor | None], alphas: list[float]) -> None:
    """outs[i] = totals[i] + alphas[i]·value for each decoded value (alphas[i]·value where totals[i] is None;
    outs[i] may be totals[i]), as one fused multiply-add per element: what torch's `add(total, values,
    alpha=alpha)` computes on this CPU, which `folds_like_torch` checks before anyone relies on it. The values
    are never written; two sums are folded in one pass, each value decoded once for both."""
    kernels = _kernels()
    kind = "singles" if tables.second is None else "pairs"
    codes = (payload, tables.first) if tables.second is None else (payload, tables.first, tables.second)
    pending = list(zip(outs, totals, alphas))
    while pending:
        if len(pending) >= 2 and pending[0][1] is not None and pending[1][1] is not None:
            (out0, total0, alpha0), (out1, total1, alpha1) = pending[:2]
            kernels[f"fold_{kind}_two"](*codes, scales, block, _flat(out0), _flat(total0), np.float32(alpha0),
                                        _flat(out1), _flat(total1), np.float32(alpha1))
            pending = pending[2:]
            continue
        out, total, alpha = pending.pop(0)
        target = _flat(out)
        base = target if total is None else _flat(total)
        kernels[f"fold_{kind}"](*codes, scales, block, target, base, np.float32(alpha), total is not None)


GROUP_BLOCKS = 256
"""Blocks of every push of a group folded into a piece of both sums while that piece is in cache (64 KiB of
each sum at int4's 64-element blocks)."""


def fold_group(payloads: list[np.ndarray], scales: list[np.ndarray], block: int, levels: float,
               outs: tuple[torch.Tensor, torch.Tensor], totals: tuple[torch.Tensor | None, torch.Tensor | None],
               alphas: np.ndarray) -> None:
    """`fold` of a group of int4 pushes into two sums, push after push as `fold` would (the same fused
    multiply-adds in the same order), but a piece of the sums at a time: each piece is read and written once
    for the whole group, not once per push, and each value is decoded by arithmetic (code / `levels`, which
    `arithmetic_levels` checks against the table) rather than a table lookup, so the loop vectorizes.
    `alphas[k]`: push k's alpha for each sum; `totals` both None (the first push makes the sums) or both
    given (`outs` may be them)."""
    (out0, out1), (total0, total1) = outs, totals
    has_base = total0 is not None
    copy_base = has_base and not (out0.data_ptr() == total0.data_ptr() and out1.data_ptr() == total1.data_ptr())
    target0, target1 = _flat(out0), _flat(out1)
    base0, base1 = (_flat(total0), _flat(total1)) if has_base else (target0, target1)
    from numba.typed import List  # one compiled loop for any number of pushes (a tuple's length is its type)

    kernel, weights = _kernels()["fold_group_pairs"], alphas.astype(np.float32)

    def piece(start: int, stop: int) -> None:
        """Whole blocks from `start` (even: a byte's two codes in one piece), folded as the whole loop folds them."""
        bytes_, blocks = slice(start // 2, (stop + 1) // 2), slice(start // block, -(-stop // block))
        kernel(List([p[bytes_] for p in payloads]), List([s[blocks] for s in scales]), block, np.float32(levels),
               target0[start:stop], base0[start:stop], target1[start:stop], base1[start:stop], weights, has_base,
               copy_base, GROUP_BLOCKS)

    chunk_threads.run(chunk_threads.pieces(target0.shape[0], block * GROUP_BLOCKS), piece)


def arithmetic_levels(tables: DecodeTables) -> float | None:
    """L where every byte of a table decodes as a linear code's: each code q (two's complement, 4 bits for two
    codes a byte, else 8) to fp32(q) / fp32(L), and exactly those with q = −(L + 1) written by no encoder (the
    integer codecs: `fold_group` and `square_sum` then decode by arithmetic); None for any other table."""
    pairs = tables.second is not None
    bits = 4 if pairs else 8
    byte = np.arange(256)
    codes = [byte & 15, byte >> 4] if pairs else [byte]
    quanta = [((c ^ (1 << (bits - 1))) - (1 << (bits - 1))) for c in codes]
    if not tables.first[1] > 0:
        return None
    levels = np.float32(round(1 / float(tables.first[1])))
    if levels != (1 << (bits - 1)) - 1:
        return None
    corrupt = np.zeros(256, dtype=bool)
    for q in quanta:
        corrupt |= q == -(int(levels) + 1)
    if not np.array_equal(tables.corrupt != 0, corrupt):
        return None
    for values, q in zip((tables.first, tables.second) if pairs else (tables.first,), quanta):
        if not np.array_equal(values[~corrupt], (q.astype(np.float32) / levels)[~corrupt]):
            return None
    return float(levels)


def _flat(tensor: torch.Tensor) -> np.ndarray:
    return tensor.reshape(-1).numpy()


def folds() -> bool:
    """Whether pushes are folded into sums from their codes (`coded_blocks.py`): the loops on, and checked."""
    return compiled.is_enabled() and folds_like_torch()


@cache
def folds_like_torch() -> bool:
    """Whether `fold` gives torch's values bit for bit here: torch's `add` with an alpha is a fused
    multiply-add wherever its CPU kernels are vectorized (every x86-64 and arm64 build), but not on every
    build, so it is checked once on this process's torch before decoding into sums replaces decoding."""
    if not (compiled.is_enabled() and compiled.loaded()):
        return False
    generator = torch.Generator().manual_seed(0)
    numel, block = compiled.MIN_ELEMENTS + 37, 64
    values = torch.randn(numel, generator=generator)
    scales = torch.rand(-(-numel // block), generator=generator).numpy() + np.float32(0.5)
    codes = torch.randint(-7, 8, (numel + 1,), generator=generator, dtype=torch.int8).numpy()
    table = np.arange(256, dtype=np.int64)
    pair = np.stack([((table & 15) ^ 8) - 8, ((table >> 4) ^ 8) - 8], axis=1).astype(np.float32) / np.float32(7)
    tables = DecodeTables.of(pair)
    payload = compiled.pack_nibbles(codes)
    decoded = torch.empty(numel)
    compiled.decode(payload, tables, scales, block, decoded, None)
    total, other, alpha = values.clone(), values.flip(0), 0.3712345
    fold(payload, tables, scales, block, [total, other], [total, other], [alpha, 1.0])
    scaled = torch.empty(numel)
    fold(payload, tables, scales, block, [scaled], [None], [alpha])
    return bool(torch.equal(total, torch.add(values, decoded, alpha=alpha))
                and torch.equal(other, torch.add(values.flip(0), decoded))
                and torch.equal(scaled, torch.mul(decoded, alpha)))


@cache
def groups_like_torch() -> bool:
    """Whether `fold_group` gives what `fold`, push after push, gives here (and so torch's values): checked
    once, on an int4 table, odd and even counts, the sums made, given and folded in place."""
    if not folds_like_torch():
        return False
    generator = torch.Generator().manual_seed(1)
    table = np.arange(256, dtype=np.int64)
    tables = DecodeTables.of(np.stack([((table & 15) ^ 8) - 8, ((table >> 4) ^ 8) - 8], axis=1).astype(np.float32)
                             / np.float32(7))
    block, alphas = 64, np.array([[0.37, 1.9], [1.3, 0.011], [2.5, 0.73]], dtype=np.float32)
    for numel in (compiled.MIN_ELEMENTS + 37, compiled.MIN_ELEMENTS + 64):
        payloads = [compiled.pack_nibbles(torch.randint(-7, 8, (numel + 1,), generator=generator,
                                                        dtype=torch.int8).numpy()) for _ in alphas]
        scales = [torch.rand(-(-numel // block), generator=generator).numpy() + np.float32(0.5) for _ in alphas]
        base = (torch.randn(numel, generator=generator), torch.randn(numel, generator=generator))
        for totals in ((None, None), base, "in place"):
            expected = [t.clone() for t in base] if totals != (None, None) else [torch.empty(numel) for _ in base]
            for k, alpha in enumerate(alphas):
                made = k == 0 and totals == (None, None)
                fold(payloads[k], tables, scales[k], block, expected, [None, None] if made else expected, list(alpha))
            outs = tuple(t.clone() for t in base) if totals == "in place" else (torch.empty(numel), torch.empty(numel))
            fold_group(payloads, scales, block, 7.0, outs, outs if totals == "in place" else totals, alphas)
            if not all(torch.equal(a, b) for a, b in zip(outs, expected)):
                return False
    return True


@cache
def _kernels() -> dict[str, Callable[..., Any]]:
    """The loops, compiled on first use (see `compiled._kernels` for how they are written to vectorize)."""
    import numba

    fusing = numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy", fastmath={"contract"})
    """For the folds alone: value·alpha + sum contracted into one fused multiply-add, as torch's `add(alpha=)`
    is (a·b + c is the only product-and-sum in them that the compiler may fuse; `folds_like_torch` checks)."""
    summing = numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy", fastmath={"reassoc"})
    """For the float64 sums of squares alone: reordering their adds lets the compiler vectorize them, and
    the sums are rounded to fp32 afterwards, which float64's reordered adds do not reach."""

    @summing
    def square_sum(payload, squares, first, corrupt, scales, bytes_per_block, whole_bytes, odd):  # type: ignore[no-untyped-def]
        flag = np.uint8(0)
        total = 0.0
        for b in range(scales.shape[0]):
            source = payload[b * bytes_per_block:min((b + 1) * bytes_per_block, whole_bytes)]
            part = 0.0
            for j in range(source.shape[0]):
                byte = source[j]
                flag |= corrupt[byte]
                part += squares[byte]
            scale = np.float64(scales[b])
            total += part * scale * scale
        if odd:  # an odd int4 count's last byte holds one code (its byte checked whole, as `pairs` does)
            byte = payload[whole_bytes]
            flag |= corrupt[byte]
            value = np.float64(first[byte]) * np.float64(scales[scales.shape[0] - 1])
            total += value * value
        return total, flag != 0

    @summing
    def square_sum_linear(payload, scales, bytes_per_block, whole_bytes, odd, pairs):  # type: ignore[no-untyped-def]
        bad = np.int32(0)
        total = 0.0
        for b in range(scales.shape[0]):
            source = payload[b * bytes_per_block:min((b + 1) * bytes_per_block, whole_bytes)]
            part = np.int64(0)  # Σ q² of a block, exact
            if pairs:
                for j in range(source.shape[0]):
                    byte = np.int32(source[j])
                    low, high = ((byte & 15) ^ 8) - 8, ((byte >> 4) ^ 8) - 8
                    part += low * low + high * high
                    bad |= np.int32(low == -8) | np.int32(high == -8)
            else:
                for j in range(source.shape[0]):
                    q = (np.int32(source[j]) ^ 128) - 128
                    part += q * q
                    bad |= np.int32(q == -128)
            scale = np.float64(scales[b])
            total += np.float64(part) * scale * scale
        if odd:  # an odd int4 count's last byte holds one code (its byte checked whole, as `pairs` does)
            byte = np.int32(payload[whole_bytes])
            low, high = ((byte & 15) ^ 8) - 8, ((byte >> 4) ^ 8) - 8
            bad |= np.int32(low == -8) | np.int32(high == -8)
            scale = np.float64(scales[scales.shape[0] - 1])
            total += np.float64(low * low) * scale * scale
        return total, bad != 0

    @fusing
    def fold_pairs(payload, first, second, scales, block, out, total, alpha, add):  # type: ignore[no-untyped-def]
        half = block // 2
        numel = out.shape[0]
        whole_bytes = numel // 2
        for b in range(scales.shape[0]):
            scale = scales[b]
            start = b * half
            stop = min(start + half, whole_bytes)
            if stop <= start:
                break
            source = payload[start:stop]
            target = out[2 * start:2 * stop]
            if add:
                base = total[2 * start:2 * stop]
                for j in range(source.shape[0]):
                    byte = source[j]
                    target[2 * j] = first[byte] * scale * alpha + base[2 * j]
                    target[2 * j + 1] = second[byte] * scale * alpha + base[2 * j + 1]
            else:
                for j in range(source.shape[0]):
                    byte = source[j]
                    target[2 * j] = first[byte] * scale * alpha
                    target[2 * j + 1] = second[byte] * scale * alpha
        if numel % 2:
            value = first[payload[whole_bytes]] * scales[scales.shape[0] - 1]
            out[numel - 1] = value * alpha + total[numel - 1] if add else value * alpha

    @fusing
    def fold_singles(payload, first, scales, block, out, total, alpha, add):  # type: ignore[no-untyped-def]
        numel = out.shape[0]
        for b in range(scales.shape[0]):
            scale = scales[b]
            start = b * block
            stop = min(start + block, numel)
            source = payload[start:stop]
            target = out[start:stop]
            if add:
                base = total[start:stop]
                for i in range(source.shape[0]):
                    target[i] = first[source[i]] * scale * alpha + base[i]
            else:
                for i in range(source.shape[0]):
                    target[i] = first[source[i]] * scale * alpha

    @fusing
    def fold_pairs_two(payload, first, second, scales, block, out0, base0, alpha0, out1, base1, alpha1):  # type: ignore[no-untyped-def]
        half = block // 2
        numel = out0.shape[0]
        whole_bytes = numel // 2
        for b in range(scales.shape[0]):
            scale = scales[b]
            start = b * half
            stop = min(start + half, whole_bytes)
            if stop <= start:
                break
            source = payload[start:stop]
            target0, target1 = out0[2 * start:2 * stop], out1[2 * start:2 * stop]
            sum0, sum1 = base0[2 * start:2 * stop], base1[2 * start:2 * stop]
            for j in range(source.shape[0]):
                byte = source[j]
                low = first[byte] * scale
                high = second[byte] * scale
                target0[2 * j] = low * alpha0 + sum0[2 * j]
                target0[2 * j + 1] = high * alpha0 + sum0[2 * j + 1]
                target1[2 * j] = low * alpha1 + sum1[2 * j]
                target1[2 * j + 1] = high * alpha1 + sum1[2 * j + 1]
        if numel % 2:
            value = first[payload[whole_bytes]] * scales[scales.shape[0] - 1]
            out0[numel - 1] = value * alpha0 + base0[numel - 1]
            out1[numel - 1] = value * alpha1 + base1[numel - 1]

    @fusing
    def fold_singles_two(payload, first, scales, block, out0, base0, alpha0, out1, base1, alpha1):  # type: ignore[no-untyped-def]
        numel = out0.shape[0]
        for b in range(scales.shape[0]):
            scale = scales[b]
            start = b * block
            stop = min(start + block, numel)
            source = payload[start:stop]
            target0, target1, sum0, sum1 = out0[start:stop], out1[start:stop], base0[start:stop], base1[start:stop]
            for i in range(source.shape[0]):
                value = first[source[i]] * scale
                target0[i] = value * alpha0 + sum0[i]
                target1[i] = value * alpha1 + sum1[i]

    @fusing
    def fold_group_pairs(payloads, scales, block, levels, out0, base0, out1, base1, alphas, has_base, copy_base,
                         group_blocks):  # type: ignore[no-untyped-def]
        half = block // 2
        numel = out0.shape[0]
        whole_bytes = numel // 2
        blocks = scales[0].shape[0]
        for first_block in range(0, blocks, group_blocks):
            last_block = min(first_block + group_blocks, blocks)
            if copy_base:
                low, high = first_block * block, min(last_block * block, numel)
                out0[low:high] = base0[low:high]
                out1[low:high] = base1[low:high]
            for k in range(len(payloads)):
                payload, scale_of = payloads[k], scales[k]
                alpha0, alpha1 = alphas[k, 0], alphas[k, 1]
                adds = has_base or k > 0
                for b in range(first_block, last_block):
                    scale = scale_of[b]
                    start = b * half
                    stop = min(start + half, whole_bytes)
                    if stop <= start:
                        break
                    source = payload[start:stop]
                    target0, target1 = out0[2 * start:2 * stop], out1[2 * start:2 * stop]
                    if adds:
                        for j in range(source.shape[0]):
                            byte = np.int32(source[j])
                            low = (np.float32(((byte & 15) ^ 8) - 8) / levels) * scale
                            high = (np.float32(((byte >> 4) ^ 8) - 8) / levels) * scale
                            target0[2 * j] = low * alpha0 + target0[2 * j]
                            target0[2 * j + 1] = high * alpha0 + target0[2 * j + 1]
                            target1[2 * j] = low * alpha1 + target1[2 * j]
                            target1[2 * j + 1] = high * alpha1 + target1[2 * j + 1]
                    else:
                        for j in range(source.shape[0]):
                            byte = np.int32(source[j])
                            low = (np.float32(((byte & 15) ^ 8) - 8) / levels) * scale
                            high = (np.float32(((byte >> 4) ^ 8) - 8) / levels) * scale
                            target0[2 * j] = low * alpha0
                            target0[2 * j + 1] = high * alpha0
                            target1[2 * j] = low * alpha1
                            target1[2 * j + 1] = high * alpha1
        if numel % 2:  # an odd count's last byte holds one code (its base copied with the last piece)
            last, made = numel - 1, 0
            if not has_base:  # apart from the adds below, so that no product is shared with theirs, unfused
                value = (np.float32(((np.int32(payloads[0][whole_bytes]) & 15) ^ 8) - 8) / levels) * scales[0][blocks - 1]
                out0[last] = value * alphas[0, 0]
                out1[last] = value * alphas[0, 1]
                made = 1
            for k in range(made, len(payloads)):
                value = (np.float32(((np.int32(payloads[k][whole_bytes]) & 15) ^ 8) - 8) / levels) * scales[k][blocks - 1]
                out0[last] = value * alphas[k, 0] + out0[last]
                out1[last] = value * alphas[k, 1] + out1[last]

    return {"fold_group_pairs": fold_group_pairs, "square_sum": square_sum, "square_sum_linear": square_sum_linear, "fold_pairs": fold_pairs, "fold_singles": fold_singles,
            "fold_pairs_two": fold_pairs_two, "fold_singles_two": fold_singles_two}

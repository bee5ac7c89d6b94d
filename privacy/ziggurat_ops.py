"""The ziggurat of :mod:`privacy.ziggurat` in torch tensor ops: the same normals, drawn on the
device where the tensor they go to lives.

Every element's draw is a pure function of its block's seed and its offset
(:mod:`privacy.ziggurat`), so all elements are drawn at once: the pair calls of every element
are one batch of Philox rounds over a ``(blocks, BLOCK / 2)`` grid (the seeds broadcast along
rows), and only the elements they do not settle (about 1.5%: wedges and the tail) are gathered
and finished with their next calls, round after round, until none remain. The float work is the
host's operations in the host's order (``privacy.exact_math``'s ``exp`` and ``log``), so the
bits are the host sampler's: ``tests/test_ziggurat.py::test_torch_ops_equal_the_host_sampler_bit_for_bit``.

Host traffic: the seeds (20 bytes per block of ``BLOCK`` elements) go to the device; nothing
comes back but the sizes of the re-draw batches (boolean indexing reads a count: one small
synchronisation per re-draw round, a handful per call), never a value.
"""

from __future__ import annotations

import torch
from torch import Tensor

from privacy.exact_math import exp_torch, log_torch
from privacy.philox import philox_torch
from privacy.ziggurat import ACCEPT, COUNTER_SHIFT, HEIGHT, SCALE, TAIL_START

_U53 = 2.0**-53
_CHUNK_ELEMENTS = {"cpu": 1 << 16, "cuda": 1 << 24}  # grid size per batch: bounds the temporaries
_TABLES: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}


def _tables(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    if device not in _TABLES:
        _TABLES[device] = (torch.from_numpy(ACCEPT.view("int64")).to(device), torch.from_numpy(SCALE).to(device),
                           torch.from_numpy(HEIGHT).to(device))
    return _TABLES[device]


def block_normals(seeds: Tensor, first_block: int, start: int, stop: int, block: int) -> Tensor:
    """The float64 standard normals of flat elements ``[start, stop)``, element ``e`` being the
    normal at offset ``e - b * block`` of block ``b = e // block``, whose seed is row ``b -
    first_block`` of ``seeds`` (an int64 tensor of five 32-bit words per row, on the device the
    result is made on).

    Guarantee: equal to :func:`privacy.ziggurat.fill_normals` of each block, bit for bit
    (``tests/test_ziggurat.py::test_torch_ops_equal_the_host_sampler_bit_for_bit``).
    Edge cases: ``start == stop`` gives an empty tensor."""
    device = seeds.device
    out = torch.empty(stop - start, dtype=torch.float64, device=device)
    rows = max(1, _CHUNK_ELEMENTS.get(device.type, 1 << 24) // block)
    lo_block, hi_block = start // block, (stop - 1) // block + 1 if stop > start else start // block
    for b0 in range(lo_block, hi_block, rows):
        b1 = min(hi_block, b0 + rows)
        lo, hi = max(start, b0 * block), min(stop, b1 * block)
        grid = _grid_normals(seeds[b0 - first_block:b1 - first_block], block)
        out[lo - start:hi - start] = grid[lo - b0 * block:hi - b0 * block]
    return out


def _grid_normals(seeds: Tensor, block: int) -> Tensor:
    """The normals of every offset of every block in ``seeds``, flattened row by row."""
    c1, c2, c3, k0, k1 = (seeds[:, j:j + 1] for j in range(5))  # (g, 1): broadcast along the row
    pairs = torch.arange(block // 2, dtype=torch.int64, device=seeds.device).unsqueeze(0)  # (1, block / 2)
    y0, y1, y2, y3 = philox_torch(pairs, c1, c2, c3, k0, k1)
    # offset 2q takes W0 of pair call q, offset 2q + 1 its W1
    words = torch.stack([y0 | (y1 << 32), y2 | (y3 << 32)], -1).reshape(-1)
    x, negative, settled = _position(words)
    pending = torch.nonzero(~settled).squeeze(1)
    if pending.numel():
        x[pending], negative[pending] = _settle(pending % block, seeds[pending // block], words[pending])
    return torch.where(negative, -x, x)


def _lsr(word: Tensor, bits: int) -> Tensor:
    """``word >> bits`` as uint64 would shift it (int64 shifts copy the sign bit)."""
    return (word >> bits) & ((1 << (64 - bits)) - 1)


def _position(words: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For 64-bit position words: the candidate ``x`` (unsigned), the sign, and whether it lies
    inside its strip's inner rectangle (settled at once)."""
    accept, scale, _ = _tables(words.device)
    strip = words & 0xFF
    u = _lsr(words, 12)
    return u.to(torch.float64) * scale[strip], ((words >> 8) & 1).bool(), u < accept[strip]


def _word(offsets: Tensor, calls: Tensor, seeds: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Call ``calls`` (``>= 1``) of each offset: the four 32-bit words."""
    c1, c2, c3, k0, k1 = seeds.unbind(1)
    return philox_torch(offsets + (calls << COUNTER_SHIFT), c1, c2, c3, k0, k1)


def _settle(offsets: Tensor, seeds: Tensor, words: Tensor) -> tuple[Tensor, Tensor]:
    """The draws (unsigned ``x``, sign) of the offsets whose first position word ``words`` did
    not settle: wedge tests and fresh position words, tail trials, in the host's order of
    calls, round after round on the elements still open."""
    _, _, height = _tables(words.device)
    x, negative, _ = _position(words)
    calls = torch.ones_like(offsets)
    tail = (words & 0xFF) == 0  # unsettled in strip 0: the tail; else the wedge
    todo = torch.arange(offsets.numel(), device=offsets.device)
    while todo.numel():
        done = torch.zeros(todo.numel(), dtype=torch.bool, device=todo.device)
        t_idx, w_idx = torch.nonzero(tail[todo]).squeeze(1), torch.nonzero(~tail[todo]).squeeze(1)
        if t_idx.numel():  # one tail trial each: t from W0, e from W1
            el = todo[t_idx]
            y0, y1, y2, y3 = _word(offsets[el], calls[el], seeds[el])
            calls[el] += 1
            t = -log_torch((((y1 << 21) | (y0 >> 11)).to(torch.float64) + 1.0) * _U53) / TAIL_START
            e = -log_torch((((y3 << 21) | (y2 >> 11)).to(torch.float64) + 1.0) * _U53)
            ends = e + e > t * t
            x[el[ends]] = TAIL_START + t[ends]
            done[t_idx[ends]] = True
        if w_idx.numel():  # the wedge: the next call's W0 is the height uniform
            el = todo[w_idx]
            y0, y1, _, _ = _word(offsets[el], calls[el], seeds[el])
            calls[el] += 1
            strip = words[el] & 0xFF
            v = ((y1 << 21) | (y0 >> 11)).to(torch.float64) * _U53
            y = height[strip] + (height[strip + 1] - height[strip]) * v
            under = y < exp_torch(-0.5 * x[el] * x[el])
            done[w_idx[under]] = True
            # rejected: the next call's W0 is a fresh position word
            rej = el[~under]
            if rej.numel():
                y0, y1, _, _ = _word(offsets[rej], calls[rej], seeds[rej])
                calls[rej] += 1
                fresh = y0 | (y1 << 32)
                words[rej] = fresh
                x[rej], negative[rej], settled = _position(fresh)
                tail[rej] = ~settled & ((fresh & 0xFF) == 0)
                done[w_idx[~under][settled]] = True
        todo = todo[~done]
    return x, negative

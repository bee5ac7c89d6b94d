"""The ziggurat of :mod:`privacy.ziggurat` in torch tensor ops: the same normals, drawn on the
device where the tensor they go to lives.

Every element's draw is a pure function of its block's seed and its offset
(:mod:`privacy.ziggurat`), so all elements are drawn at once: call 0 of every element is one
batch of Philox rounds over a ``(blocks, BLOCK)`` grid (the seeds broadcast along rows), and only
the elements it does not settle (about 1.5%: wedge rejections and the tail) are gathered and
re-drawn with their next calls, batch after batch, until none remain. The float work is the
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
    offsets = torch.arange(block, dtype=torch.int64, device=seeds.device).unsqueeze(0)  # (1, block)
    words = [w.expand(seeds.shape[0], block).reshape(-1) for w in philox_torch(offsets, c1, c2, c3, k0, k1)]
    x, negative, settled = _call(words)
    pending = torch.nonzero(~settled).squeeze(1)
    if pending.numel():
        row = pending // block
        x[pending], negative[pending] = _redraw(pending % block, seeds[row], x[pending], negative[pending],
                                                [w[pending] for w in words])
    return torch.where(negative, -x, x)


def _call(words: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """One call's candidate ``x`` (unsigned), its sign, and whether it settles the element:
    inside the inner rectangle, or in a wedge and under the curve. Tail candidates (strip 0,
    outside) are not settled."""
    y0, y1, y2, y3 = words
    accept, scale, height = _tables(y0.device)
    strip = y0 & 0xFF
    negative = ((y0 >> 8) & 1).bool()
    u = (y1 << 20) | (y0 >> 12)
    x = u.to(torch.float64) * scale[strip]
    settled = u < accept[strip]
    wedge = torch.nonzero(~settled & (strip != 0)).squeeze(1)
    if wedge.numel():
        s, xw = strip[wedge], x[wedge]
        v = ((y3[wedge] << 21) | (y2[wedge] >> 11)).to(torch.float64) * _U53
        y = height[s] + (height[s + 1] - height[s]) * v
        settled[wedge] = y < exp_torch(-0.5 * xw * xw)
    return x, negative, settled


def _redraw(offsets: Tensor, seeds: Tensor, x: Tensor, negative: Tensor,
            words: list[Tensor]) -> tuple[Tensor, Tensor]:
    """The draws of the elements call 0 left unsettled (``x``, ``negative`` and ``words`` are
    their call 0's): tail trials for those in strip 0, fresh calls for wedge rejections, call
    ``n`` for every element in the batch that has made ``n`` calls, as the host loop does."""
    c1, c2, c3, k0, k1 = seeds.unbind(1)
    calls = torch.ones_like(offsets)
    tail = (words[0] & 0xFF) == 0  # strip 0 and unsettled: the tail
    todo = torch.ones_like(tail)  # still to draw
    while True:
        idx = torch.nonzero(todo).squeeze(1)
        if not idx.numel():
            return x, negative
        w = philox_torch(offsets[idx] + (calls[idx] << COUNTER_SHIFT), c1[idx], c2[idx], c3[idx], k0[idx], k1[idx])
        calls[idx] += 1
        in_tail = tail[idx]
        # tail trials: t from W0, e from W1
        t = -log_torch((((w[1] << 21) | (w[0] >> 11)).to(torch.float64) + 1.0) * _U53) / TAIL_START
        e = -log_torch((((w[3] << 21) | (w[2] >> 11)).to(torch.float64) + 1.0) * _U53)
        ends = in_tail & (e + e > t * t)
        x[idx[ends]] = TAIL_START + t[ends]
        # fresh calls for the wedge rejections
        fresh = ~in_tail
        cx, cneg, csettled = _call([v[fresh] for v in w])
        f = idx[fresh]
        x[f], negative[f] = cx, cneg
        cstrip0 = (w[0][fresh] & 0xFF) == 0
        tail[f] = ~csettled & cstrip0
        done = torch.zeros_like(todo)
        done[idx[ends]] = True
        done[f] = csettled
        todo = todo & ~done

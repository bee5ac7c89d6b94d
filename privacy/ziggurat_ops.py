"""The ziggurat of :mod:`privacy.ziggurat` in torch tensor ops: the same normals, drawn on the
device where the tensor they go to lives, without the host ever reading a device value.

Every element's draw is a pure function of its block's seed and its offset
(:mod:`privacy.ziggurat`), so all elements are drawn at once: the pair calls of every element
are one batch of Philox rounds over a ``(blocks, BLOCK / 2)`` grid (the seeds broadcast along
rows). Every later step of an element's rejection loop (a tail trial, a wedge test, a fresh
position word) consumes exactly one call, so an element still open at round ``k`` reads call
``k``, whatever path it took: the loop is a fixed number of rounds of one state machine
(:func:`_advance`) over fixed-size batches. The elements call 0 leaves open (about 1.5%) are
gathered into a batch of fixed capacity by a prefix sum and a scatter (:func:`_compact`; no
``nonzero``, whose output size the host would have to read), advanced ``ROUNDS_A`` rounds, and the
few still open gathered again and advanced ``ROUNDS_B`` rounds. Every shape depends on the
number of elements alone. The float work is the host's operations in the host's order
(``privacy.exact_math``'s ``exp`` and ``log``), so the bits are the host sampler's:
``tests/test_ziggurat.py::test_torch_ops_equal_the_host_sampler_bit_for_bit``.

Unsettled elements: an element still open after ``ROUNDS_A + ROUNDS_B`` calls, or one that did not
fit a batch's capacity, comes out of :func:`draw_normals` as NaN (a draw is never NaN). Both are
rare. Per element, the probability of being open after call ``k`` follows from the tables (the
loop is a Markov chain: a tail trial ends with probability 0.938, a wedge test with 0.44-0.50 by
strip, a fresh word settles with 0.985): ``OPEN_AFTER_CALL_0``, ``OPEN_AFTER_ROUNDS_A`` after
call 2 and ``OPEN_AFTER_ALL_ROUNDS`` (6e-20) after call 16. The capacities sit far enough above
the expected counts that a batch overflows with probability below ``2e-22`` (:func:`_capacity`).
So a draw of ``n`` elements has an element left open with probability below ``n * 6.1e-20 +
4e-22`` per batch of up to ``2^24``: about ``1e-11`` for GPT-2 small's 163M normals, i.e. once
in a hundred billion steps (the measured rates: ``tests/test_ziggurat.py::
test_the_stated_open_probabilities_bound_the_measured_ones``).

:func:`block_normals` makes that a guarantee, not a probability: it reads one boolean (is any
element NaN?) and, only when one is, draws those blocks on the host (:mod:`privacy.ziggurat`, the
reference itself) and takes the open elements from there. So:

* :func:`draw_normals`: no host read at all (``tests/test_step_syncs.py::
  test_the_device_sampler_reads_nothing_from_the_device``); exact wherever not NaN;
* :func:`block_normals`: exact everywhere, one read per call (the check)
  (``tests/test_ziggurat.py::test_the_host_fallback_fills_exactly_the_unsettled_elements``).

Host traffic otherwise: the seeds (20 bytes per block of ``BLOCK`` elements) go to the device.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from privacy.exact_math import exp_torch, log_torch
from privacy.philox import philox_torch
from privacy.ziggurat import ACCEPT, COUNTER_SHIFT, HEIGHT, SCALE, TAIL_START, fill_normals

_U53 = 2.0**-53
_CHUNK_ELEMENTS = {"cpu": 1 << 18, "cuda": 1 << 24}  # grid size per batch: bounds the temporaries
_TABLES: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}

ROUNDS_A = 2  # calls 1-2 on the elements call 0 leaves open: all but 0.7% of them settle
ROUNDS_B = 14  # calls 3-16 on those still open
# Per element, P(still open after call k), from the ziggurat's tables as a Markov chain (module doc):
OPEN_AFTER_CALL_0 = 0.0150  # 0.01492
OPEN_AFTER_ROUNDS_A = 1.01e-4  # 1.006e-4
OPEN_AFTER_ALL_ROUNDS = 6.1e-20  # 6.04e-20 after call 16
CAPACITY_SIGMAS = 10.0
_DONE, _TAIL, _WEDGE, _FRESH = 0, 1, 2, 3  # what an open element's next call is for


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

    Guarantee: equal to :func:`privacy.ziggurat.fill_normals` of each block, bit for bit, for
    every element (``tests/test_ziggurat.py::test_torch_ops_equal_the_host_sampler_bit_for_bit``;
    the host fallback: ``test_the_host_fallback_fills_exactly_the_unsettled_elements``).
    Host reads: one boolean per call (module doc). Edge cases: ``start == stop`` gives an empty
    tensor and reads nothing."""
    out = draw_normals(seeds, first_block, start, stop, block)
    if out.numel() and bool(out.isnan().any()):
        settle_on_host(out, seeds, first_block, start, block)
    return out


def batch_elements(device: torch.device) -> int:
    """How many elements :func:`draw_normals` draws in one batch on ``device`` (a bound on its
    temporaries): a caller drawing many small tensors groups them up to this many per call."""
    return _CHUNK_ELEMENTS.get(device.type, 1 << 24)


def draw_normals(seeds: Tensor, first_block: int, start: int, stop: int, block: int) -> Tensor:
    """:func:`block_normals` without its check: NaN at the elements the fixed rounds left open
    (probabilities in the module doc), the host sampler's bits everywhere else. Reads nothing
    from the device, and every shape it makes depends on ``start``, ``stop`` and ``block`` alone."""
    device = seeds.device
    out = torch.empty(stop - start, dtype=torch.float64, device=device)
    rows = max(1, batch_elements(device) // block)
    lo_block, hi_block = start // block, (stop - 1) // block + 1 if stop > start else start // block
    for b0 in range(lo_block, hi_block, rows):
        b1 = min(hi_block, b0 + rows)
        lo, hi = max(start, b0 * block), min(stop, b1 * block)
        grid = _grid_normals(seeds[b0 - first_block:b1 - first_block], block)
        out[lo - start:hi - start] = grid[lo - b0 * block:hi - b0 * block]
    return out


def settle_on_host(out: Tensor, seeds: Tensor, first_block: int, start: int, block: int) -> None:
    """Replace the NaNs of a :func:`draw_normals` result ``out`` (elements ``start ..``) by the
    host sampler's draws of their blocks, in place: the rare fallback, reading the NaN mask and
    the affected blocks' seeds from the device."""
    mask = out.isnan().cpu().numpy()
    host_seeds = seeds.cpu().tolist()
    for b in sorted({(start + int(i)) // block for i in np.flatnonzero(mask)}):
        lo, hi = max(start, b * block), min(start + out.numel(), (b + 1) * block)
        normals = np.empty(hi - lo)
        fill_normals(tuple(host_seeds[b - first_block]), lo - b * block, normals)
        part = torch.from_numpy(normals).to(out.device)
        view = out[lo - start:hi - start]
        view.copy_(torch.where(view.isnan(), part, view))


class _Open(NamedTuple):
    """A batch of open elements: their offsets in the block, seed rows, current candidate
    (unsigned ``x``, sign, strip) and what their next call is for (``_DONE`` for padding)."""

    offsets: Tensor
    seeds: Tensor
    x: Tensor
    negative: Tensor
    strip: Tensor
    mode: Tensor


def _grid_normals(seeds: Tensor, block: int) -> Tensor:
    """The normals of every offset of every block in ``seeds``, flattened row by row; NaN where
    open after the fixed rounds (module doc)."""
    c1, c2, c3, k0, k1 = (seeds[:, j:j + 1] for j in range(5))  # (g, 1): broadcast along the row
    pairs = torch.arange(block // 2, dtype=torch.int64, device=seeds.device).unsqueeze(0)  # (1, block / 2)
    y0, y1, y2, y3 = philox_torch(pairs, c1, c2, c3, k0, k1)
    # offset 2q takes W0 of pair call q, offset 2q + 1 its W1
    words = torch.stack([y0 | (y1 << 32), y2 | (y3 << 32)], -1).reshape(-1)
    x, negative, settled = _position(words)
    n = words.numel()
    out = torch.where(settled, torch.where(negative, -x, x), torch.nan)
    idx = _compact(~settled, _capacity(n, OPEN_AFTER_CALL_0), n)
    at = idx.clamp(max=n - 1)
    strip = words[at] & 0xFF
    first = _Open(at % block, seeds[at // block], x[at], negative[at], strip,
                  torch.where(idx < n, torch.where(strip == 0, _TAIL, _WEDGE), _DONE))
    first = _settle(first, n)
    values = torch.where(first.mode == _DONE, torch.where(first.negative, -first.x, first.x), torch.nan)
    padded = torch.cat([out, out.new_zeros(1)])  # slot n takes the padding's writes
    padded[idx] = torch.where(idx < n, values, 0.0)
    return padded[:n]


def _settle(batch: _Open, n: int) -> _Open:
    """``batch`` after calls ``1 .. ROUNDS_A``, then its still-open elements gathered into a
    smaller batch and advanced through calls ``ROUNDS_A + 1 .. ROUNDS_A + ROUNDS_B``."""
    batch = _advance(batch, 1, ROUNDS_A)
    size = batch.mode.numel()
    idx = _compact(batch.mode != _DONE, _capacity(n, OPEN_AFTER_ROUNDS_A), size)
    at = idx.clamp(max=size - 1)
    inner = _Open(*(t[at] for t in batch[:5]), torch.where(idx < size, batch.mode[at], _DONE))
    inner = _advance(inner, ROUNDS_A + 1, ROUNDS_B)
    merged = []
    for outer, new in zip(batch, inner):
        padded = torch.cat([outer, outer[:1]])  # slot ``size`` takes the padding's writes
        padded[idx] = new
        merged.append(padded[:size])
    # an element open after round A but past the inner capacity stays open: it comes out NaN
    return _Open(*merged)


def _capacity(n: int, p: float) -> int:
    """A batch size that the number of ``n`` elements open with probability ``p`` each exceeds
    with probability below ``2e-22``: ``d = CAPACITY_SIGMAS sqrt(m) + 32`` above the mean ``m``,
    and Chernoff's ``P(X >= m + d) <= exp(-d^2 / (2 (m + d / 3)))`` is below ``exp(-50)`` for any ``m``."""
    mean = n * p
    return min(n, math.ceil(mean + CAPACITY_SIGMAS * math.sqrt(mean) + 32))


def _compact(mask: Tensor, capacity: int, n: int) -> Tensor:
    """The indices of the first ``capacity`` true entries of ``mask`` (``n`` entries), in order,
    padded with ``n``: a prefix sum gives each true entry its slot, a scatter puts it there
    (every other entry lands in a spare slot that is cut off). No output size depends on the data."""
    slot = torch.cumsum(mask, 0) - 1
    slot = torch.where(mask & (slot < capacity), slot, capacity)
    idx = torch.full((capacity + 1,), n, dtype=torch.int64, device=mask.device)
    idx.index_put_((slot,), torch.arange(n, dtype=torch.int64, device=mask.device))
    return idx[:capacity]


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


def _advance(b: _Open, first_call: int, rounds: int) -> _Open:
    """``b`` after calls ``first_call .. first_call + rounds - 1``: each call does, for each
    element, what its mode says (the host's loop in :func:`privacy.ziggurat._normal`): a tail
    trial (``t`` from ``W0``, ``e`` from ``W1``); the wedge's height test (``W0``), a rejection
    making the next call a fresh position word; or that fresh word, settled at once, or the
    tail's or a wedge's next. Every call's words and float work (``log``, ``exp`` of the fresh
    candidate) are computed for every element at once, as a ``(batch, rounds)`` grid; the walk
    through the calls then only selects, so the op count hardly grows with ``rounds``."""
    _, _, height = _tables(b.x.device)
    calls = torch.arange(first_call, first_call + rounds, dtype=torch.int64, device=b.x.device) << COUNTER_SHIFT
    c1, c2, c3, k0, k1 = (w.unsqueeze(1) for w in b.seeds.unbind(1))
    y0, y1, y2, y3 = philox_torch(b.offsets.unsqueeze(1) + calls, c1, c2, c3, k0, k1)  # (batch, rounds)
    w0 = ((y1 << 21) | (y0 >> 11)).to(torch.float64)  # W0's top 53 bits
    t = -log_torch((w0 + 1.0) * _U53) / TAIL_START
    e = -log_torch((((y3 << 21) | (y2 >> 11)).to(torch.float64) + 1.0) * _U53)
    tail_ends, v = e + e > t * t, w0 * _U53
    fresh = y0 | (y1 << 32)
    fx, fneg, fsettled = _position(fresh)
    fstrip = fresh & 0xFF
    fexp = exp_torch(-0.5 * fx * fx)  # the wedge test's bound if the fresh candidate needs one
    fresh_mode = torch.where(fsettled, _DONE, torch.where(fstrip == 0, _TAIL, _WEDGE))
    x, negative, strip, mode = b.x, b.negative, b.strip, b.mode
    bound = exp_torch(-0.5 * x * x)
    for j in range(rounds):
        is_tail, is_wedge, is_fresh = mode == _TAIL, mode == _WEDGE, mode == _FRESH
        ends = is_tail & tail_ends[:, j]
        y = height[strip] + (height[strip + 1] - height[strip]) * v[:, j]
        under = y < bound
        x = torch.where(ends, TAIL_START + t[:, j], torch.where(is_fresh, fx[:, j], x))
        negative = torch.where(is_fresh, fneg[:, j], negative)
        strip = torch.where(is_fresh, fstrip[:, j], strip)
        bound = torch.where(is_fresh, fexp[:, j], bound)
        mode = torch.where(ends, _DONE, torch.where(is_wedge, torch.where(under, _DONE, _FRESH),
                                                     torch.where(is_fresh, fresh_mode[:, j], mode)))
    return _Open(b.offsets, b.seeds, x, negative, strip, mode)

"""Gaussian noise for DP-SGD, addressable by flat element index.

The noise added to element ``i`` of parameter ``name`` at ``step`` is a pure function of
``(key, step, name, i, dtype)``. It does not depend on the parameter's size, on how the
flat index space is cut into shards, or on which process draws it. A sharded run in which
each rank calls ``noise_slice`` on its own range therefore adds exactly the noise an
unsharded run adds, bit for bit (``test_noise_slices_concatenate_to_the_full_draw``).

Layout: the flat index space of a parameter is cut into blocks of ``BLOCK`` elements. Block
``b`` is the standard normal stream of :mod:`privacy.ziggurat` (an SFC64 generator, a 256-strip
ziggurat) started from a 192-bit BLAKE2b hash of ``(key, step, b, name)``; element ``i`` is
draw number ``i - b * BLOCK`` of that stream. A slice draws only the blocks it overlaps, and
only up to its own end, because a stream's first ``k`` draws do not depend on how many more are
drawn afterwards.

Why not ``torch.Generator``: torch's CPU generator keeps only the low 32 bits of its seed
(``manual_seed(s)`` and ``manual_seed(s + 2**32)`` give the same stream). A run draws one
seed per block per step, so 32-bit seeds collide within a run by the birthday bound, and a
collision means two blocks of noise are identical rather than independent. Seeding with
192 bits makes collisions negligible (about ``n**2 / 2**193`` for ``n`` seeds). Its
``normal_`` also cuts the float32 tail at about ``5.8 sigma`` (Box-Muller on 24-bit uniforms);
the ziggurat's tail reaches past ``13 sigma``.

Why not numpy's ``Generator.standard_normal`` (the sampler until this file's ``v2`` scheme): it
calls its bit generator through a function pointer per draw; on the benchmark GPTs its noise
cost 0.11x of a whole non-private step, the compiled loop's 0.06-0.07x
(``benchmarks/privacy_step.py --phases``).
"""

from __future__ import annotations

import hashlib
import math
import numbers
import operator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from privacy.ziggurat import add_scaled_normals, fill_normals

BLOCK = 2**16
"""Elements per independently seeded block. A slice draws at most ``BLOCK - 1`` elements
it does not return (the part of its first block before ``start``)."""

_HASH_PERSON = b"fsdpx.noise.v2"
_BLOCKS_PER_WORKER = 8  # below this a thread pool costs more than it saves

# Half types are drawn in float32 and rounded; float32 is the float64 draw rounded.
_DRAW_DTYPE = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.float32: torch.float32,
    torch.float64: torch.float64,
}


def _block_state(key: int, step: int, name: str, block: int) -> tuple[int, int, int]:
    """The 192-bit SFC64 starting state ``(a, b, c)`` of one block's stream."""
    # Decimal integers joined by ':' with the name last: distinct tuples give distinct messages.
    message = f"{key}:{step}:{block}:".encode() + name.encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(message, digest_size=24, person=_HASH_PERSON).digest()
    a, b, c = (int.from_bytes(digest[i:i + 8], "little") for i in (0, 8, 16))
    return a, b, c


def _check_std(std: float) -> float:
    if isinstance(std, bool) or not isinstance(std, numbers.Real):
        raise TypeError(f"std must be a real number, got {std!r}")
    std = float(std)
    if not (math.isfinite(std) and std >= 0.0):
        raise ValueError(f"std must be finite and >= 0, got std={std}")
    return std


def noise_slice(
    name: str,
    numel: int,
    start: int,
    stop: int,
    *,
    key: int,
    step: int,
    std: float,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Gaussian noise ``N(0, std**2)`` for flat elements ``[start, stop)`` of parameter ``name``.

    Args:
      name: the parameter's name; part of the noise's identity.
      numel: the parameter's number of elements; only bounds ``start`` and ``stop``.
      start, stop: the flat element range, ``0 <= start <= stop <= numel``.
      key: the run's secret noise key. step: the training step.
      std: the standard deviation (noise multiplier times clip norm).
      dtype: float16, bfloat16, float32 or float64.

    Returns:
      A 1-D CPU tensor of ``stop - start`` elements of ``dtype``.

    Formal Guarantees:
      * Pure: equal arguments give equal bits (``test_noise_is_a_pure_function_of_its_arguments``).
      * Partition invariance: for any ``0 = c_0 <= c_1 <= ... <= c_k = numel``, concatenating
        ``noise_slice(name, numel, c_j, c_{j+1}, ...)`` gives ``noise_slice(name, numel, 0,
        numel, ...)`` bit for bit (``test_noise_slices_concatenate_to_the_full_draw``).
      * Element ``i`` does not depend on ``numel``, ``start`` or ``stop``
        (``test_element_noise_does_not_depend_on_numel``).
      * Exact scaling: the result is ``noise_slice(..., std=1.0, dtype=float32 or float64) * std``
        computed in that draw dtype and then rounded to ``dtype``; so half types are the rounding
        of the float32 draw (``test_std_scales_the_unit_draw_exactly``,
        ``test_half_precision_noise_is_the_rounded_float32_noise``).
      * Distinct ``(key, step, name)`` and distinct blocks use distinct 192-bit seeds
        (``test_distinct_key_step_or_name_give_distinct_noise``).
      * Cost: draws ``stop - BLOCK * (start // BLOCK)`` normals, i.e. O(stop - start + BLOCK),
        never O(numel) (``test_slice_draws_only_the_blocks_it_overlaps_however_large_the_parameter``).
        Draws of at least ``2 * _BLOCKS_PER_WORKER`` blocks are spread over up to
        ``torch.get_num_threads()`` threads (the sampler releases the GIL); the bits do
        not depend on the thread count (``test_threaded_and_serial_draws_give_the_same_bits``).
        :func:`gaussian_noise` runs the blocks of all its parameters in one pool.
      * Bits depend only on this file, :mod:`privacy.ziggurat` and the platform's ``exp``/``log``
        (1.5% of draws use them): ranks of one run on one platform agree
        (``test_noise_bits_match_the_recorded_reference``). Moments:
        ``test_noise_moments_match_the_requested_gaussian``; distribution:
        ``tests/test_ziggurat.py::test_draws_pass_a_kolmogorov_smirnov_test_and_reach_the_tail``.

    Edge cases:
      ==============================  ==========================================
      ``start == stop``               empty tensor, nothing drawn
      ``std == 0``                    exact zeros (``+0.0``), nothing drawn
      ``std`` < 0, NaN or inf         ``ValueError`` naming ``std``
      ``start``/``stop`` out of range ``ValueError`` naming them
      ``numel`` < 0                   ``ValueError`` naming ``numel``
      non-float ``dtype``             ``ValueError`` naming ``dtype``
      non-integer key/step/bounds     ``TypeError``
      ==============================  ==========================================
    """
    out, tasks, std = _prepare(name, numel, start, stop, key=key, step=step, std=std, dtype=dtype)
    _run(tasks)
    return _finish(out, std, dtype, stop - start)


def _prepare(name: str, numel: int, start: int, stop: int, *, key: int, step: int, std: float,
             dtype: torch.dtype, pin: bool = False) -> tuple[Tensor | None, list[Callable[[], None]], float]:
    """Validate one slice's arguments; returns its output buffer (``None`` when nothing is
    drawn; page-locked when ``pin``, so a copy to an accelerator can be asynchronous), one task
    per block that fills its part of the buffer, and the checked ``std``."""
    numel, start, stop, key, step, std = _validate(name, numel, start, stop, key=key, step=step, std=std, dtype=dtype)
    if start == stop or std == 0.0:
        return None, [], std
    # the tensor itself is returned, not a view of it: the allocator of pinned memory keeps a
    # block from reuse until an asynchronous copy out of it ends only when it sees the tensor
    out = torch.empty(stop - start, dtype=_DRAW_DTYPE[dtype], pin_memory=pin)
    array = out.numpy()

    def draw(block: int) -> None:
        block_start = block * BLOCK
        lo, hi = max(start, block_start), min(stop, block_start + BLOCK)
        # a slice that begins inside this block skips the block's first draws
        fill_normals(_block_state(key, step, name, block), lo - block_start, array[lo - start : hi - start])

    return out, [partial(draw, b) for b in range(start // BLOCK, (stop - 1) // BLOCK + 1)], std


def _validate(name: str, numel: int, start: int, stop: int, *, key: int, step: int, std: float,
              dtype: torch.dtype) -> tuple[int, int, int, int, int, float]:
    """The arguments as plain ints and a checked float ``std``; raises as ``noise_slice`` documents."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    numel, start, stop = operator.index(numel), operator.index(start), operator.index(stop)
    key, step = operator.index(key), operator.index(step)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got numel={numel}")
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"need 0 <= start <= stop <= numel, got start={start}, stop={stop}, numel={numel}")
    std = _check_std(std)
    if dtype not in _DRAW_DTYPE:
        raise ValueError(f"dtype must be one of {sorted(map(str, _DRAW_DTYPE))}, got dtype={dtype}")
    return numel, start, stop, key, step, std


def _run(tasks: list[Callable[[], None]]) -> None:
    """Run block tasks, spread over up to ``torch.get_num_threads()`` threads when there are
    enough of them: each thread runs one contiguous share of the list (one hand-off per thread,
    not per block). Blocks write disjoint parts of their buffers and the sampler drops the GIL
    while drawing, so the bits are those of the serial loop; only the wall time changes."""
    workers = min(torch.get_num_threads(), len(tasks) // _BLOCKS_PER_WORKER)
    if workers > 1:
        shares = [tasks[i * len(tasks) // workers:(i + 1) * len(tasks) // workers] for i in range(workers)]
        with ThreadPoolExecutor(workers) as pool:
            for _ in pool.map(_run_serially, shares):
                pass
    else:
        _run_serially(tasks)


def _run_serially(tasks: list[Callable[[], None]]) -> None:
    for task in tasks:
        task()


def _finish(out: Tensor | None, std: float, dtype: torch.dtype, n: int, device: torch.device | None = None) -> Tensor:
    """The drawn buffer scaled by ``std`` in the draw dtype, rounded to ``dtype``, on ``device``
    (default CPU). Off the CPU the unit draw is copied first (asynchronously from a pinned
    buffer) and scaled there: IEEE multiplication and rounding give the CPU's bits."""
    if out is None:
        return torch.zeros(n, dtype=dtype, device=device)
    noise = out
    if device is not None and torch.device(device).type != "cpu":
        noise = noise.to(device, non_blocking=noise.is_pinned())
    if std != 1.0:
        noise.mul_(std)
    return noise.to(dtype)


def _pin(device: torch.device) -> bool:
    """Draw into page-locked memory when the noise goes to a CUDA device."""
    return device.type == "cuda" and torch.cuda.is_available()


def gaussian_noise(params_like: dict[str, Tensor], *, key: int, step: int, std: float) -> dict[str, Tensor]:
    """Noise shaped like ``params_like``: for each ``name``, the full draw of ``noise_slice``
    reshaped to the tensor's shape, with its dtype and on its device.

    Formal Guarantees:
      * ``gaussian_noise(p, ...)[name].flatten()[a:b]`` equals ``noise_slice(name, numel, a, b,
        ...)``: an unsharded run and a sharded one add the same noise
        (``test_gaussian_noise_is_the_full_slice_of_each_parameter``).
      * Only names, shapes, dtypes and devices of ``params_like`` are read, never values.

    Edge cases: an empty dict gives an empty dict; a zero-element tensor gives an empty tensor of
    its shape; a non-float tensor raises ``ValueError`` naming ``dtype``.
    """
    prepared = {name: _prepare(name, t.numel(), 0, t.numel(), key=key, step=step, std=std, dtype=t.dtype,
                               pin=_pin(t.device))
                for name, t in params_like.items()}
    _run([task for _, tasks, _ in prepared.values() for task in tasks])  # one pool for every block
    return {name: _finish(out, s, t.dtype, t.numel(), t.device).reshape(t.shape)
            for (name, t), (out, _, s) in zip(params_like.items(), prepared.values())}


class DrawnNoise(NamedTuple):
    """Unit draws made ahead of the tensors they go to (:func:`draw_ahead`): per name, the
    buffer (``None`` when nothing is drawn), the checked ``std``, and the numel and dtype it
    was drawn for."""

    key: int
    step: int
    std: float
    buffers: dict[str, tuple[Tensor | None, float, int, torch.dtype]]


def _in_place(t: Tensor) -> bool:
    """Whether :func:`add_gaussian_noise_` draws into ``t`` directly (no noise tensor)."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) and t.is_contiguous()


def draw_ahead(params_like: dict[str, Tensor], *, key: int, step: int, std: float) -> DrawnNoise:
    """The draws :func:`add_gaussian_noise_` would make for those of ``params_like`` it cannot
    draw into in place (off the CPU, half precision, not contiguous), made now: the noise does
    not depend on the gradient, so a step can draw it on the host while an accelerator runs the
    forward and backward (``privacy.step``). Reads names, shapes, dtypes and devices only;
    buffers bound for a CUDA device are pinned."""
    buffers = {}
    tasks: list[Callable[[], None]] = []
    for name, t in params_like.items():
        if _in_place(t):
            continue
        out, block_tasks, checked = _prepare(name, t.numel(), 0, t.numel(), key=key, step=step, std=std,
                                             dtype=t.dtype, pin=_pin(t.device))
        buffers[name] = (out, checked, t.numel(), t.dtype)
        tasks.extend(block_tasks)
    _run(tasks)
    return DrawnNoise(operator.index(key), operator.index(step), _check_std(std), buffers)


_AHEAD: list[ThreadPoolExecutor] = []  # one background thread, started on first use


def draw_ahead_async(params_like: dict[str, Tensor], *, key: int, step: int, std: float) -> Future[DrawnNoise]:
    """:func:`draw_ahead` on a background thread (the sampler releases the GIL)."""
    if not _AHEAD:
        _AHEAD.append(ThreadPoolExecutor(1, thread_name_prefix="fsdpx-noise"))
    return _AHEAD[0].submit(draw_ahead, params_like, key=key, step=step, std=std)


def add_gaussian_noise_(tensors: dict[str, Tensor], *, key: int, step: int, std: float,
                        drawn: DrawnNoise | None = None) -> dict[str, Tensor]:
    """Adds the noise of :func:`gaussian_noise` to each tensor IN PLACE; returns ``tensors``.

    Formal Guarantees:
      * Afterwards ``tensors[name]`` holds exactly the bits of ``t.add_(gaussian_noise(tensors,
        ...)[name])`` (``tests/test_noise.py::test_adding_noise_in_place_gives_the_bits_of_adding_the_draw``),
        with or without ``drawn`` (``test_noise_drawn_ahead_gives_the_same_bits``).
      * No noise tensor is formed for a contiguous float32/float64 CPU tensor: each block is
        drawn and added to its slice in one compiled pass
        (:func:`privacy.ziggurat.add_scaled_normals`), so a step allocates (and the kernel faults
        in) nothing for its noise and reads each gradient once.
      * Other tensors (on an accelerator, half precision, not contiguous) get the unit draw in a
        host buffer (pinned for CUDA, copied asynchronously), scaled, rounded and added on their
        device; every block of every tensor is drawn in one pool.
    ``drawn``: the result of :func:`draw_ahead` for the same ``key``, ``step`` and ``std``; the
    tensors it holds a buffer for are not drawn again.

    Edge cases: ``std == 0`` adds ``+0.0`` (so ``-0.0`` becomes ``+0.0``, as adding zeros
    does); an empty dict is returned unchanged; ``drawn`` for another key, step, std, numel or
    dtype raises ``ValueError``."""
    tasks: list[Callable[[], None]] = []
    allocated: dict[str, tuple[Tensor | None, float]] = {}
    for name, t in tensors.items():
        if not _in_place(t):
            if drawn is not None and name in drawn.buffers:
                out, checked, numel, dtype = drawn.buffers[name]
                if (drawn.key, drawn.step, drawn.std, numel, dtype) != (key, step, _check_std(std), t.numel(), t.dtype):
                    raise ValueError(f"noise drawn ahead for {name!r} was drawn for other arguments")
                allocated[name] = (out, checked)
                continue
            out, block_tasks, checked = _prepare(name, t.numel(), 0, t.numel(), key=key, step=step, std=std,
                                                 dtype=t.dtype, pin=_pin(t.device))
            allocated[name] = (out, checked)
            tasks.extend(block_tasks)
            continue
        numel, _, _, key, step, checked = _validate(name, t.numel(), 0, t.numel(), key=key, step=step, std=std,
                                                    dtype=t.dtype)
        if checked == 0.0:
            t.add_(0.0)
            continue
        tasks.extend(partial(_add_block, t.view(-1), name, b, key, step, checked) for b in range(-(-numel // BLOCK)))
    _run(tasks)  # one pool for every block, in place or not
    for name, (out, checked) in allocated.items():
        t = tensors[name]
        t.add_(_finish(out, checked, t.dtype, t.numel(), t.device).view(t.shape))
    return tensors


def _add_block(flat: Tensor, name: str, block: int, key: int, step: int, std: float) -> None:
    """``flat[block] += draw * std`` in ``flat``'s precision, drawn and added in one compiled
    pass: the operations (and so the bits) of ``_finish`` followed by ``add_``."""
    lo, hi = block * BLOCK, min(flat.numel(), (block + 1) * BLOCK)
    add_scaled_normals(_block_state(key, step, name, block), flat[lo:hi].detach().numpy(), std)

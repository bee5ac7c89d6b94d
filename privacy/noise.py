"""Gaussian noise for DP-SGD, addressable by flat element index.

The noise added to element ``i`` of parameter ``name`` at ``step`` is a pure function of
``(key, step, name, i, dtype)``. It does not depend on the parameter's size, on how the
flat index space is cut into shards, or on which process draws it. A sharded run in which
each rank calls ``noise_slice`` on its own range therefore adds exactly the noise an
unsharded run adds, bit for bit (``test_noise_slices_concatenate_to_the_full_draw``).

Layout: the flat index space of a parameter is cut into blocks of ``BLOCK`` elements. Block
``b`` has a 160-bit seed, a BLAKE2b hash of ``(key, step, b, name)``; element ``i`` is the
standard normal at offset ``i - b * BLOCK`` of that block (:mod:`privacy.ziggurat`): a 256-strip
ziggurat over Philox4x32-10 words whose counters hold the offset and seed words 0-2, and whose
key is seed words 3-4 (the exact layout is in :mod:`privacy.ziggurat`). Every element is a pure
function of its seed and its offset: a slice draws exactly its own elements, on the host (a numba loop,
:mod:`privacy.ziggurat`) for a CPU tensor, or in torch ops on the device for a tensor that lives
on one (:mod:`privacy.ziggurat_ops`; nothing but the seeds is copied from the host). The two
compute the same bits (``tests/test_ziggurat.py::test_torch_ops_equal_the_host_sampler_bit_for_bit``,
``tests/test_noise.py::test_device_formulation_equals_the_host_slices``).

Scheme ``v3`` (``_HASH_PERSON``; the bits changed, the guarantees did not). ``v2`` drew element
``i`` as draw number ``i - b * BLOCK`` of a sequential SFC64 stream: draw ``k`` needed every
draw before it, and the ziggurat's rejections consume a variable number of words, so no device
could draw elements in parallel and a GPU run drew on the host and copied the noise (652 MB a
step for GPT-2 small). ``v3`` replaces the stream by a counter-based generator, so any element
is computable alone, and the ziggurat's ``exp``/``log`` by :mod:`privacy.exact_math` (only
``+ - * /``), so the host's libm and a device's math library cannot disagree in the last ulp.
Noise is drawn afresh every step from ``(key, step)``, and no checkpoint records the scheme: a
run resumed across the change draws ``v3`` noise from then on, an equally valid Gaussian draw
(the privacy guarantee needs independence and the right std, not particular bits), but not the
bits an uninterrupted ``v2`` run would have drawn.

Why not ``torch.Generator``: torch's CPU generator keeps only the low 32 bits of its seed
(``manual_seed(s)`` and ``manual_seed(s + 2**32)`` give the same stream). A run draws one
seed per block per step, so 32-bit seeds collide within a run by the birthday bound, and a
collision means two blocks of noise are identical rather than independent. Seeding with
160 bits makes collisions negligible (about ``n**2 / 2**161`` for ``n`` seeds). torch's
``normal_`` also cuts the float32 tail at about ``5.8 sigma`` (Box-Muller on 24-bit uniforms); the
ziggurat's tail reaches past ``13 sigma``. (For one key, Philox maps distinct counters to distinct
outputs: blocks whose seeds share their key words still never repeat a word.)
"""

from __future__ import annotations

import hashlib
import math
import numbers
import operator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from privacy.ziggurat import add_scaled_normals, fill_normals
from privacy.ziggurat_ops import batch_elements, block_normals, draw_normals

BLOCK = 2**16
"""Elements per independently seeded block. A slice draws at most ``BLOCK - 1`` elements
it does not return (the part of its first block before ``start``)."""

_HASH_PERSON = b"fsdpx.noise.v3"  # see the module docstring: v3 is counter-based
_BLOCKS_PER_WORKER = 8  # below this a thread pool costs more than it saves

# Half types are drawn in float32 and rounded; float32 is the float64 draw rounded.
_DRAW_DTYPE = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.float32: torch.float32,
    torch.float64: torch.float64,
}


def _block_seed(key: int, step: int, name: str, block: int) -> tuple[int, int, int, int, int]:
    """The 160-bit seed of one block, five 32-bit words (:mod:`privacy.ziggurat`)."""
    # Decimal integers joined by ':' with the name last: distinct tuples give distinct messages.
    message = f"{key}:{step}:{block}:".encode() + name.encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(message, digest_size=20, person=_HASH_PERSON).digest()
    return tuple(int.from_bytes(digest[i:i + 4], "little") for i in range(0, 20, 4))


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
    device: torch.device | str | None = None,
    checked: bool = True,
) -> Tensor:
    """Gaussian noise ``N(0, std**2)`` for flat elements ``[start, stop)`` of parameter ``name``.

    Args:
      name: the parameter's name; part of the noise's identity.
      numel: the parameter's number of elements; only bounds ``start`` and ``stop``.
      start, stop: the flat element range, ``0 <= start <= stop <= numel``.
      key: the run's secret noise key. step: the training step.
      std: the standard deviation (noise multiplier times clip norm).
      dtype: float16, bfloat16, float32 or float64.
      device: where to draw and return it (default CPU). Off the CPU the draw is made there in
        torch ops (:mod:`privacy.ziggurat_ops`): only the block seeds travel from the host.
      checked: off the CPU, ``False`` skips the draw's one read from the device: an element
        the sampler's fixed rounds left open (about one in ``1.7e19``) is NaN, and the caller
        finds it with :func:`open_names` over many draws (one read) and draws that slice again
        checked (``fsdpx.runtime.owned_noise.OwnedNoise.settle``). On the CPU the draw is
        always exact.

    Returns:
      A 1-D tensor of ``stop - start`` elements of ``dtype`` on ``device``, the same bits on
      every device (``test_device_formulation_equals_the_host_slices``).

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
      * Distinct ``(key, step, name)`` and distinct blocks use distinct 160-bit seeds
        (``test_distinct_key_step_or_name_give_distinct_noise``).
      * Cost: on the host, draws exactly ``stop - start`` normals, hashing one seed per block
        overlapped, never O(numel)
        (``test_slice_draws_only_the_blocks_it_overlaps_however_large_the_parameter``); on a
        device, whole blocks (at most ``2 * BLOCK`` more).
        Draws of at least ``2 * _BLOCKS_PER_WORKER`` blocks are spread over up to
        ``torch.get_num_threads()`` threads (the sampler releases the GIL); the bits do
        not depend on the thread count (``test_threaded_and_serial_draws_give_the_same_bits``).
        :func:`gaussian_noise` runs the blocks of all its parameters in one pool.
      * Bits depend only on this file, :mod:`privacy.ziggurat`, :mod:`privacy.philox` and
        :mod:`privacy.exact_math` (IEEE ``+ - * /`` only, no platform ``exp``/``log``): ranks of
        one run agree whatever device they draw on (``test_noise_bits_match_the_recorded_reference``). Moments:
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
    if _on_device(device):
        numel, start, stop, key, step, std = _validate(name, numel, start, stop, key=key, step=step, std=std,
                                                       dtype=dtype)
        return _device_noise(name, start, stop, key=key, step=step, std=std, dtype=dtype, device=torch.device(device),
                             checked=checked)
    out, tasks, std = _prepare(name, numel, start, stop, key=key, step=step, std=std, dtype=dtype)
    _run(tasks)
    return _finish(out, std, dtype, stop - start)


def _on_device(device: torch.device | str | None) -> bool:
    """Whether noise for ``device`` is drawn there in torch ops (anything but the CPU)."""
    return device is not None and torch.device(device).type != "cpu"


def draws_on_device(device: torch.device | str | None) -> bool:
    """Whether :func:`noise_slice` draws for ``device`` there, in torch ops (any device but the
    CPU), so that ``checked=False`` may leave NaN for the caller to check."""
    return _on_device(device)


def _device_noise(name: str, start: int, stop: int, *, key: int, step: int, std: float, dtype: torch.dtype,
                  device: torch.device, checked: bool = True) -> Tensor:
    """``noise_slice`` of validated arguments, drawn on ``device`` in torch ops: the unit draw
    in float64, rounded to the draw dtype, scaled there and rounded to ``dtype`` (the host's
    operations, so the host's bits). ``checked=False``: the draw of
    :func:`privacy.ziggurat_ops.draw_normals`, which reads nothing from the device and leaves
    NaN where its fixed rounds did not settle an element (rare: the caller checks, once for
    many tensors); otherwise exact everywhere at the cost of one read."""
    if start == stop or std == 0.0:
        return torch.zeros(stop - start, dtype=dtype, device=device)
    if device.type == "meta":  # shapes only (a step traced for its memory): no values to draw
        return torch.empty(stop - start, dtype=dtype, device=device)
    first, last = start // BLOCK, (stop - 1) // BLOCK
    seeds = torch.tensor([_block_seed(key, step, name, b) for b in range(first, last + 1)], dtype=torch.int64)
    if device.type == "cuda":  # a pageable copy would make the host wait for the device's queue
        seeds = seeds.pin_memory().to(device, non_blocking=True)
    draw = block_normals if checked else draw_normals
    noise = draw(seeds.to(device), first, start, stop, BLOCK).to(_DRAW_DTYPE[dtype])
    if std != 1.0:
        noise.mul_(std)
    return noise.to(dtype)


def _prepare(name: str, numel: int, start: int, stop: int, *, key: int, step: int, std: float,
             dtype: torch.dtype) -> tuple[Tensor | None, list[Callable[[], None]], float]:
    """Validate one slice's arguments; returns its host output buffer (``None`` when nothing is
    drawn), one task per block that fills its part of the buffer, and the checked ``std``."""
    numel, start, stop, key, step, std = _validate(name, numel, start, stop, key=key, step=step, std=std, dtype=dtype)
    if start == stop or std == 0.0:
        return None, [], std
    out = torch.empty(stop - start, dtype=_DRAW_DTYPE[dtype])
    array = out.numpy()

    def draw(block: int) -> None:
        block_start = block * BLOCK
        lo, hi = max(start, block_start), min(stop, block_start + BLOCK)
        # every offset is drawn on its own: a slice beginning inside the block draws nothing before it
        fill_normals(_block_seed(key, step, name, block), lo - block_start, array[lo - start : hi - start])

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


def _finish(out: Tensor | None, std: float, dtype: torch.dtype, n: int) -> Tensor:
    """The drawn host buffer scaled by ``std`` in the draw dtype and rounded to ``dtype``."""
    if out is None:
        return torch.zeros(n, dtype=dtype)
    if std != 1.0:
        out.mul_(std)
    return out.to(dtype)


def _full_draw(name: str, t: Tensor, *, key: int, step: int, std: float, checked: bool = True) -> Tensor:
    """The whole of ``t``'s noise, drawn on ``t``'s device (in torch ops) and shaped like it
    (``checked``: as :func:`_device_noise`)."""
    numel, _, _, key, step, std = _validate(name, t.numel(), 0, t.numel(), key=key, step=step, std=std, dtype=t.dtype)
    return _device_noise(name, 0, numel, key=key, step=step, std=std, dtype=t.dtype, device=t.device,
                         checked=checked).view(t.shape)


def open_names(flags: dict[Any, Tensor]) -> list[Any]:
    """The keys whose flag (a 0-d boolean tensor: "this unchecked draw holds a NaN") is set:
    one boolean read from the device for all of them (nothing read when there are no flags),
    the keys read one by one only when it is set (rare).
    (``tests/test_step_syncs.py::test_device_noise_for_many_tensors_is_checked_with_one_read``)"""
    if not flags or not bool(torch.stack(list(flags.values())).any()):
        return []
    return [name for name, flag in flags.items() if bool(flag)]


def _grouped_unit_draws(params_like: dict[str, Tensor], *, key: int, step: int) -> list[tuple[Tensor, list[str]]]:
    """Unit draws (float64, unchecked: NaN where open) of every tensor of ``params_like`` (all on
    one device, not meta), several tensors to a call of :func:`draw_normals`: the seed tables of
    consecutive tensors are stacked until a group holds ``batch_elements`` elements, so a model's
    many small tensors (biases, norms: one block each) share one call's ops and one seed copy.
    Returns per group its draw and names; tensor ``k`` of a group is ``draw[at:at + numel]``,
    ``at`` the number of blocks before it times ``BLOCK`` (:func:`_group_slices`)."""
    groups: list[list[str]] = [[]]
    size = 0
    limit = batch_elements(next(iter(params_like.values())).device) if params_like else 0
    for name, t in params_like.items():
        blocks = -(-t.numel() // BLOCK)
        if groups[-1] and size + blocks * BLOCK > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += blocks * BLOCK
    out = []
    for names in groups:
        if not names:
            continue
        seeds = torch.tensor([_block_seed(key, step, n, b) for n in names
                              for b in range(-(-params_like[n].numel() // BLOCK))], dtype=torch.int64)
        device = params_like[names[0]].device
        if device.type == "cuda":  # a pageable copy would make the host wait for the device's queue
            seeds = seeds.pin_memory()
        draw = draw_normals(seeds.to(device, non_blocking=True), 0, 0, seeds.shape[0] * BLOCK, BLOCK)
        out.append((draw, names))
    return out


def _group_slices(draw: Tensor, names: list[str], params_like: dict[str, Tensor], std: float) -> dict[str, Tensor]:
    """Each tensor's noise from its group's unit draw: its slice, rounded to the draw dtype,
    scaled and rounded to its dtype (``_device_noise``'s operations), shaped like it."""
    out, at = {}, 0
    for name in names:
        t = params_like[name]
        noise = draw[at:at + t.numel()].to(_DRAW_DTYPE[t.dtype])
        if std != 1.0:
            noise.mul_(std)
        out[name] = noise.to(t.dtype).view(t.shape)
        at += -(-t.numel() // BLOCK) * BLOCK
    return out


def _drawable(params_like: dict[str, Tensor], key: int, step: int, std: float) -> tuple[dict[str, Tensor], float]:
    """The tensors that need a draw (not empty, not meta, ``std > 0``), grouped by device, after
    validating every one as ``noise_slice`` does; and the checked ``std``."""
    checked = std
    for name, t in params_like.items():
        *_, checked = _validate(name, t.numel(), 0, t.numel(), key=key, step=step, std=std, dtype=t.dtype)
    return {n: t for n, t in params_like.items() if t.numel() and t.device.type != "meta" and checked != 0.0}, checked


def _device_draws(params_like: dict[str, Tensor], *, key: int, step: int, std: float) -> dict[str, Tensor]:
    """:func:`_full_draw` of every tensor in ``params_like`` (all on devices), drawn in groups
    (:func:`_grouped_unit_draws`) and checked together: one read for all of them; a group with
    an element the fixed rounds left open (about once in ``1e11`` steps of GPT-2 small:
    :mod:`privacy.ziggurat_ops`) has its tensors drawn again, checked."""
    drawable, checked = _drawable(params_like, key, step, std)
    draws = {n: _full_draw(n, t, key=key, step=step, std=std) for n, t in params_like.items() if n not in drawable}
    flags = {}
    for device in {t.device for t in drawable.values()}:
        on = {n: t for n, t in drawable.items() if t.device == device}
        for i, (draw, names) in enumerate(_grouped_unit_draws(on, key=key, step=step)):
            draws.update(_group_slices(draw, names, on, checked))
            flags[(device, i)] = (draw.isnan().any(), names)
    for group in open_names({k: f for k, (f, _) in flags.items()}):
        for name in flags[group][1]:
            draws[name] = _full_draw(name, params_like[name], key=key, step=step, std=std)
    return {n: draws[n] for n in params_like}


def _add_device_noise_(tensors: dict[str, Tensor], *, key: int, step: int, std: float) -> None:
    """``t.add_(draw)`` for tensors on devices, with one host read for all of them: each group's
    draw (:func:`_grouped_unit_draws`) is made unchecked and added only where it is not NaN
    (``where``: an element left open keeps its value, its sign of zero included); after one read
    of all the groups' flags, the open elements of a flagged group's tensors (rare:
    :func:`_device_draws`) get the exact draw added. Every element ends as ``t + draw``, the
    bits of ``t.add_(draw)``."""
    drawable, checked = _drawable(tensors, key, step, std)
    for name, t in tensors.items():
        if name not in drawable:
            t.add_(_full_draw(name, t, key=key, step=step, std=std))  # shapes only, or exact zeros
    flags = {}
    for device in {t.device for t in drawable.values()}:
        on = {n: t for n, t in drawable.items() if t.device == device}
        for i, (draw, names) in enumerate(_grouped_unit_draws(on, key=key, step=step)):
            for name, noise in _group_slices(draw, names, on, checked).items():
                t = tensors[name]
                torch.where(noise.isnan(), t, t + noise, out=t)
            flags[(device, i)] = (draw.isnan().any(), names)
    for group in open_names({k: f for k, (f, _) in flags.items()}):
        for name in flags[group][1]:
            t = tensors[name]
            open_ = _full_draw(name, t, key=key, step=step, std=std, checked=False).isnan()
            exact = _full_draw(name, t, key=key, step=step, std=std)
            torch.where(open_, t + exact, t, out=t)


def gaussian_noise(params_like: dict[str, Tensor], *, key: int, step: int, std: float) -> dict[str, Tensor]:
    """Noise shaped like ``params_like``: for each ``name``, the full draw of ``noise_slice``
    reshaped to the tensor's shape, with its dtype and on its device (drawn there: a tensor
    off the CPU gets its noise from torch ops on its own device, nothing copied from the host
    but the block seeds).

    Formal Guarantees:
      * ``gaussian_noise(p, ...)[name].flatten()[a:b]`` equals ``noise_slice(name, numel, a, b,
        ...)``: an unsharded run and a sharded one add the same noise
        (``test_gaussian_noise_is_the_full_slice_of_each_parameter``).
      * Only names, shapes, dtypes and devices of ``params_like`` are read, never values.

    Edge cases: an empty dict gives an empty dict; a zero-element tensor gives an empty tensor of
    its shape; a non-float tensor raises ``ValueError`` naming ``dtype``.
    """
    on_host = {name: t for name, t in params_like.items() if not _on_device(t.device)}
    prepared = {name: _prepare(name, t.numel(), 0, t.numel(), key=key, step=step, std=std, dtype=t.dtype)
                for name, t in on_host.items()}
    _run([task for _, tasks, _ in prepared.values() for task in tasks])  # one pool for every block
    on_device = _device_draws({n: t for n, t in params_like.items() if n not in on_host}, key=key, step=step, std=std)
    return {name: _finish(prepared[name][0], prepared[name][2], t.dtype, t.numel()).reshape(t.shape) if name in prepared
            else on_device[name] for name, t in params_like.items()}


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
    """The host draws :func:`add_gaussian_noise_` would make for those CPU tensors of
    ``params_like`` it cannot draw into in place (half precision, not contiguous), made now: the
    noise does not depend on the gradient, so a step can draw it while the forward and backward
    run (``privacy.step``). Tensors on a device get no buffer: their noise is drawn on the device
    when it is added. Reads names, shapes, dtypes and devices only."""
    buffers = {}
    tasks: list[Callable[[], None]] = []
    for name, t in params_like.items():
        if _in_place(t) or _on_device(t.device):
            continue
        out, block_tasks, checked = _prepare(name, t.numel(), 0, t.numel(), key=key, step=step, std=std,
                                             dtype=t.dtype)
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
      * A tensor on a device (CUDA) gets its noise drawn on that device in torch ops
        (:mod:`privacy.ziggurat_ops`), scaled, rounded and added there: no noise crosses from
        the host (``test_noise_on_cuda_has_the_cpu_bits``), and the host reads one boolean for
        all such tensors together, after all their noise is queued (:func:`_add_device_noise_`;
        ``tests/test_step_syncs.py::test_device_noise_for_many_tensors_is_checked_with_one_read``).
      * Other CPU tensors (half precision, not contiguous) get the unit draw in a host buffer,
        scaled, rounded and added; every block of every host tensor is drawn in one pool.
    ``drawn``: the result of :func:`draw_ahead` for the same ``key``, ``step`` and ``std``; the
    tensors it holds a buffer for are not drawn again.

    Edge cases: ``std == 0`` adds ``+0.0`` (so ``-0.0`` becomes ``+0.0``, as adding zeros
    does); an empty dict is returned unchanged; ``drawn`` for another key, step, std, numel or
    dtype raises ``ValueError``."""
    tasks: list[Callable[[], None]] = []
    allocated: dict[str, tuple[Tensor | None, float]] = {}
    _add_device_noise_({n: t for n, t in tensors.items() if _on_device(t.device)}, key=key, step=step, std=std)
    for name, t in tensors.items():
        if _on_device(t.device):
            continue
        if not _in_place(t):
            if drawn is not None and name in drawn.buffers:
                out, checked, numel, dtype = drawn.buffers[name]
                if (drawn.key, drawn.step, drawn.std, numel, dtype) != (key, step, _check_std(std), t.numel(), t.dtype):
                    raise ValueError(f"noise drawn ahead for {name!r} was drawn for other arguments")
                allocated[name] = (out, checked)
                continue
            out, block_tasks, checked = _prepare(name, t.numel(), 0, t.numel(), key=key, step=step, std=std,
                                                 dtype=t.dtype)
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
        t.add_(_finish(out, checked, t.dtype, t.numel()).view(t.shape))
    return tensors


def _add_block(flat: Tensor, name: str, block: int, key: int, step: int, std: float) -> None:
    """``flat[block] += draw * std`` in ``flat``'s precision, drawn and added in one compiled
    pass: the operations (and so the bits) of ``_finish`` followed by ``add_``."""
    lo, hi = block * BLOCK, min(flat.numel(), (block + 1) * BLOCK)
    add_scaled_normals(_block_seed(key, step, name, block), flat[lo:hi].detach().numpy(), std)

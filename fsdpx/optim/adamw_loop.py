"""AdamW's elementwise arithmetic as ONE compiled pass over the memory, for CPU tensors.

``fsdpx.optim.adamw_kernel`` is a sequence of twelve plain operations (no fused ``lerp`` or
``addcmul``, whose SIMD lanes may use FMA where the scalar tail does not). Written as tensor
operations, each is a pass over the parameter, so on a CPU the update is bound by memory
traffic: about twelve reads and writes per element where one read of ``p, g, m, v`` and one
write of ``p, m, v`` suffice.

:func:`adamw_` runs the same operations in the same order inside one loop compiled by numba (no
fast-math, so nothing is contracted into an FMA). Every intermediate is rounded to the tensor's
dtype where the tensor version rounds it, and the scalars are rounded to that dtype first, as
torch does with a Python scalar. One difference is deliberate: the square root is the IEEE,
correctly rounded one. torch's CPU ``sqrt`` for float32 is within about half an ULP but not
always correctly rounded (on these machines about one element in 10^5 differs in the last
bit), so results agree with the tensor operations to one rounding of ``sqrt`` and are
otherwise exact (``tests/test_optim_loop.py``). Each element's bits depend only on that
element, whatever slice, layout or thread split it comes in: the elementwise guarantee that
sharding and ZenFlow rely on.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import torch
from torch import Tensor

CHUNK = 2**18
"""Elements per task when a parameter is spread over threads."""


@numba.njit(inline="always", error_model="numpy")
def _element(p, g, m, v, keep, b1, omb1, b2, omb2, bc2_sqrt, eps, step_size):  # noqa: ANN001, ANN202
    """AdamW on one element: ``(new_p, new_m, new_v)``, each operation rounded to the dtype."""
    new_p = p * keep
    new_m = m * b1
    new_m = new_m + g * omb1
    new_v = g * g
    new_v = new_v * omb2
    new_v = new_v + v * b2
    d = np.sqrt(new_v)
    d = d / bc2_sqrt
    d = d + eps
    d = new_m / d
    d = d * step_size
    return new_p - d, new_m, new_v


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _adamw(p, g, m, v, p_out, m_out, v_out, keep, b1, omb1, b2, omb2, bc2_sqrt, eps, step_size):  # noqa: ANN001, ANN202
    for i in range(p.shape[0]):
        p_out[i], m_out[i], v_out[i] = _element(p[i], g[i], m[i], v[i], keep, b1, omb1, b2, omb2, bc2_sqrt, eps,
                                                step_size)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _adamw_inplace(p, g, m, v, keep, b1, omb1, b2, omb2, bc2_sqrt, eps, step_size):  # noqa: ANN001, ANN202
    """:func:`_adamw` with the outputs written over ``p``, ``m``, ``v``. A kernel of its own
    because LLVM vectorises a loop only after checking at run time that its arrays do not
    overlap, and ``p_out is p`` fails that check (it then runs the scalar loop)."""
    for i in range(p.shape[0]):
        p[i], m[i], v[i] = _element(p[i], g[i], m[i], v[i], keep, b1, omb1, b2, omb2, bc2_sqrt, eps, step_size)


def applies(*tensors: Tensor) -> bool:
    """True when every tensor is a CPU tensor and all are float32, or all float64."""
    dtype = tensors[0].dtype
    return dtype in (torch.float32, torch.float64) and all(t.device.type == "cpu" and t.dtype == dtype
                                                           for t in tensors)


def adamw_(p: Tensor, g: Tensor, m: Tensor, v: Tensor, outs: tuple[Tensor, Tensor, Tensor], *, keep: float,
           b1: float, b2: float, bc2_sqrt: float, eps: float, step_size: float) -> None:
    """Writes AdamW's new ``(p, m, v)`` into ``outs`` (which may be ``(p, m, v)`` themselves):
    ``p * keep - (m' / (sqrt(v') / bc2_sqrt + eps)) * step_size`` with ``m' = m b1 + g (1 - b1)``
    and ``v' = g g (1 - b2) + v b2``, each operation rounded to the dtype. Tensors of any layout
    (non-contiguous ones go through contiguous copies); large ones are split over
    ``torch.get_num_threads()`` threads (the loop releases the GIL). Neither changes a bit."""
    inputs = [t.detach().contiguous().view(-1).numpy() for t in (p, g, m, v)]
    direct = [t.is_contiguous() for t in outs]
    targets = [t.detach() if ok else torch.empty(t.shape, dtype=t.dtype) for t, ok in zip(outs, direct)]
    arrays = inputs + [t.view(-1).numpy() for t in targets]
    scalar = np.float32 if p.dtype == torch.float32 else np.float64
    consts = [scalar(c) for c in (keep, b1, 1 - b1, b2, 1 - b2, bc2_sqrt, eps, step_size)]
    n = p.numel()
    chunks = [(lo, min(n, lo + CHUNK)) for lo in range(0, n, CHUNK)]
    workers = min(torch.get_num_threads(), len(chunks))

    inplace = all(ok and o is i for o, i, ok in zip(outs, (p, m, v), direct))

    def run(span: tuple[int, int]) -> None:
        lo, hi = span
        if inplace:
            _adamw_inplace(*(a[lo:hi] for a in arrays[:4]), *consts)
        else:
            _adamw(*(a[lo:hi] for a in arrays), *consts)

    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            shares = [chunks[i * len(chunks) // workers:(i + 1) * len(chunks) // workers] for i in range(workers)]
            list(pool.map(lambda share: [run(c) for c in share], shares))
    elif n:
        run((0, n))
    for out, target, ok in zip(outs, targets, direct):
        if not ok:
            out.detach().copy_(target)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _adamw_columns(p, g, m, v, p_out, m_out, v_out, keep, b1, omb1, b2, omb2, bc2_sqrt, eps, step_size):  # noqa: ANN001, ANN202
    """:func:`_adamw` on 2-D ``[rows, n]`` arrays, with column ``j``'s own ``bc2_sqrt[j]`` and
    ``step_size[j]`` (its own step count)."""
    for r in range(p.shape[0]):
        for j in range(p.shape[1]):
            p_out[r, j], m_out[r, j], v_out[r, j] = _element(p[r, j], g[r, j], m[r, j], v[r, j], keep, b1, omb1, b2,
                                                             omb2, bc2_sqrt[j], eps, step_size[j])


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _adamw_columns_inplace(p, g, m, v, keep, b1, omb1, b2, omb2, bc2_sqrt, eps, step_size):  # noqa: ANN001, ANN202
    """:func:`_adamw_columns` written over ``p``, ``m``, ``v`` (a kernel of its own for the
    reason :func:`_adamw_inplace` is one)."""
    for r in range(p.shape[0]):
        for j in range(p.shape[1]):
            p[r, j], m[r, j], v[r, j] = _element(p[r, j], g[r, j], m[r, j], v[r, j], keep, b1, omb1, b2, omb2,
                                                 bc2_sqrt[j], eps, step_size[j])


def adamw_columns(p: Tensor, g: Tensor, m: Tensor, v: Tensor, *, keep: float, b1: float, b2: float,
                  bc2_sqrt: list[float], eps: float, step_size: list[float],
                  inplace: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """New ``(p, m, v)`` for 2-D CPU tensors (``applies`` holds) whose column ``j`` takes its own
    ``bc2_sqrt[j]`` and ``step_size[j]``: each column's bits are those :func:`adamw_` gives that
    column alone with those scalars (the scalars are rounded to the dtype the same way). Rows are
    split over ``torch.get_num_threads()`` threads; that changes no bit. ``inplace`` (``p``,
    ``m``, ``v`` contiguous and the caller's to overwrite): the results are written into them
    and they are returned, the same bits (``tests/test_optim_loop.py``)."""
    if inplace and not all(t.is_contiguous() for t in (p, m, v)):
        raise ValueError("adamw_columns(inplace=True) needs contiguous p, m and v")
    arrays = [t.detach().contiguous().numpy() for t in (p, g, m, v)]
    outs = (p, m, v) if inplace else tuple(torch.empty(p.shape, dtype=p.dtype) for _ in range(3))
    scalar = np.float32 if p.dtype == torch.float32 else np.float64
    per_col = [np.asarray(x, dtype=np.float64).astype(scalar) for x in (bc2_sqrt, step_size)]
    consts = [scalar(c) for c in (keep, b1, 1 - b1, b2, 1 - b2)]
    rows = p.shape[0]
    workers = max(1, min(torch.get_num_threads(), rows * p.shape[1] // CHUNK))
    bounds = [rows * i // workers for i in range(workers + 1)]

    def run(i: int) -> None:
        lo, hi = bounds[i], bounds[i + 1]
        if inplace:
            _adamw_columns_inplace(*(a[lo:hi] for a in arrays), *consts, per_col[0], scalar(eps), per_col[1])
        else:
            _adamw_columns(*(a[lo:hi] for a in arrays), *(o.numpy()[lo:hi] for o in outs), *consts, per_col[0],
                           scalar(eps), per_col[1])

    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(run, range(workers)))
    elif p.numel():
        run(0)
    return outs

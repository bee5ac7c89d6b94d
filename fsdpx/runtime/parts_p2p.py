"""Per-example gradient contributions sent point to point, self-described.

A private pipeline completes the norm of a parameter two stages share (a tied embedding and LM
head) on one of them: the other sends its contributions (``privacy.contributions.Factored`` /
``Dense``), whose number and shapes the receiver cannot know in advance. A message is three
exchanges: the header's length, the header (per part its kind, factor size, row block, and
each tensor's dtype and shape), then the tensors. Both ends run the same sequence, so nothing
else is needed to match them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fsdpx.sharding.comm import Comm
from privacy.contributions import Contribution, Dense, Factored

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)
_DENSE, _FACTORED = 0, 1


def _describe(t: Tensor) -> list[int]:
    return [_DTYPES.index(t.dtype), t.dim(), *t.shape]


def send_parts(comm: Comm, peer: int, parts: list[Contribution]) -> None:
    """Send ``parts`` to ``peer`` (which calls ``recv_parts``); completes at ``comm.flush_p2p``."""
    header: list[int] = [len(parts)]
    tensors: list[Tensor] = []
    for part in parts:
        if isinstance(part, Dense):
            header += [_DENSE, 0, 0, 0, *_describe(part.grads)]
            tensors.append(part.grads)
        else:
            header += [_FACTORED, part.m, *part.rows, *_describe(part.left), *_describe(part.right)]
            tensors += [part.left, part.right]
    head = torch.tensor(header, dtype=torch.int64)
    comm.exchange_p2p([(peer, torch.tensor([head.numel()], dtype=torch.int64))], [])
    comm.exchange_p2p([(peer, head)], [])
    if tensors:
        comm.exchange_p2p([(peer, t.contiguous()) for t in tensors], [])


def recv_parts(comm: Comm, peer: int) -> list[Contribution]:
    """The contributions ``peer`` sent with ``send_parts``, in order."""
    (length,) = comm.exchange_p2p([], [(peer, (1,), torch.int64)])
    (head,) = comm.exchange_p2p([], [(peer, (int(length.item()),), torch.int64)])
    h = head.tolist()
    pos = 1
    layout: list[tuple[int, int, tuple[int, int], list[tuple[torch.dtype, tuple[int, ...]]]]] = []
    for _ in range(h[0]):
        kind, m, r0, r1 = h[pos:pos + 4]
        pos += 4
        specs = []
        for _ in range(1 if kind == _DENSE else 2):
            dtype, ndim = _DTYPES[h[pos]], h[pos + 1]
            specs.append((dtype, tuple(h[pos + 2:pos + 2 + ndim])))
            pos += 2 + ndim
        layout.append((kind, m, (r0, r1), specs))
    wanted = [(peer, shape, dtype) for *_, specs in layout for dtype, shape in specs]
    got = iter(comm.exchange_p2p([], wanted) if wanted else [])
    out: list[Contribution] = []
    for kind, m, rows, _ in layout:
        if kind == _DENSE:
            out.append(Dense(next(got)))
        else:
            left, right = next(got), next(got)
            out.append(Factored(left, right, m, rows))
    return out

"""Pipeline schedules as data: for every rank, the ordered list of actions it runs in one step.

A model cut into ``S`` stages runs on ``p`` ranks; every microbatch ``mb`` passes forward
through stages ``0 .. S-1`` and backward through ``S-1 .. 0``. An action names what one rank
does next:

=============================  ==============================================================
action                         meaning
=============================  ==============================================================
``F(mb, stage)``               forward of ``mb`` through ``stage``
``B(mb, stage)``               backward to the stage's INPUT gradient (what the previous
                               stage needs)
``W(mb, stage)``               backward to the stage's WEIGHT gradients (needed by nobody
                               downstream; frees the activations kept for it)
``SEND_F(mb, stage, peer)``    ``stage``'s output activations go to ``stage + 1`` on ``peer``
``RECV_F(mb, stage, peer)``    ``stage``'s input activations arrive from ``stage - 1`` on ``peer``
``SEND_B(mb, stage, peer)``    ``stage``'s input gradient goes to ``stage - 1`` on ``peer``
``RECV_B(mb, stage, peer)``    ``stage``'s output gradient arrives from ``stage + 1`` on ``peer``
=============================  ==============================================================

``stage`` is always the stage the acting rank runs, so ``SEND_F(mb, s, q)`` on rank ``r``
matches ``RECV_F(mb, s + 1, r)`` on rank ``q`` (and ``SEND_B(mb, s, q)`` matches
``RECV_B(mb, s - 1, r)``). Neighbouring stages on the same rank exchange nothing.

Placement is looped (Megatron, ``torch.distributed.pipelining``): with ``v`` virtual stages per
rank, ``S = p * v`` and stage ``s`` lives on rank ``s % p``, so rank ``r`` holds stages
``r, r + p, r + 2p, ...``.

Kinds (``KINDS``); every kind emits one ``F``, one ``B`` and one ``W`` per ``(mb, stage)``:

=====================  ====================================================================
kind                   order on rank ``r`` (``v = 1`` unless interleaved)
=====================  ====================================================================
``gpipe``              every forward (microbatch order), then every backward (microbatch
                       order)
``1f1b``               PipeDream-Flush: ``min(p - 1 - r, m)`` warm-up forwards, then one
                       forward and one backward alternately, then the remaining backwards
``interleaved_1f1b``   Narayanan et al. 2021: forwards in rounds of ``p`` microbatches
                       through chunk 0, 1, ..., ``v - 1`` (backwards through the chunks in
                       reverse); ``min((v - 1) p + 2 (p - 1 - r), m v)`` warm-up forwards
                       (Megatron's count; with ``v = 1`` it is exactly 1f1b), then
                       alternate, then the remaining backwards. Needs ``m`` a multiple of
                       ``p`` (so ``m >= p``).
``zero_bubble``        ZB-H1 (Qi et al. 2024): 1F1B's order of F and B, with ``W`` split off
                       and each rank's W running ``r`` backwards late (the last W's go at
                       the end), so every rank peaks at ``p`` microbatches in flight, the
                       same as 1F1B's first rank, and the deferred W's fill the cool-down
=====================  ====================================================================

What ``fsdpx.sharding.schedule_sim.simulate`` measures with unit costs (``F = B = W = 1``,
transfers free), proved in ``property_tests/test_schedule_properties.py``:

=====================  ==============================  ========================================
kind                   bubble                          peak microbatches in flight
=====================  ==============================  ========================================
``gpipe``              ``(p - 1) / (m + p - 1)``       ``m`` at every stage
``1f1b``               ``(p - 1) / (m + p - 1)``       ``min(p - s, m)`` at stage ``s``
``interleaved_1f1b``   ``(p - 1) / (v m + p - 1)``     ``min(warm-up + 1, v m)`` chunks on rank
                                                       ``r``, each ``1 / v`` of a stage
``zero_bubble``        ``(p - 1) / (3 m + p - 1)``     ``min(p, m)`` at every stage (1F1B's
                       when ``m >= p``                 peak, ``min(p, m)``, is never exceeded)
=====================  ==============================  ========================================

(``test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1``,
``test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1``,
``test_zero_bubble_idles_p_minus_1_units_per_rank_when_m_at_least_p``,
``test_in_flight_microbatches``, ``test_interleaved_in_flight_chunks_per_rank``; both
interleaved with ``v >= 2`` and zero_bubble are strictly below 1F1B for ``p > 1``, ``m >= p``:
``test_interleaved_and_zero_bubble_bubbles_are_strictly_smaller_than_1f1b``.)

Fused and split backward. gpipe, 1f1b and interleaved_1f1b run a FUSED backward: ``W`` comes
right after its ``B`` and the gradient is sent after the ``W`` (``B, W, SEND_B``), because a
fused backward hands out the input gradient only when it has finished. zero_bubble SPLITS it:
the gradient goes right after ``B`` (``B, SEND_B``) and ``W`` runs later. This is what makes
the simulator (``fsdpx.sharding.schedule_sim``) reproduce the classic bubbles with unit costs
``F = B = W = 1``: a fused backward costs ``B + W = 2``, twice the forward.

Receives come right before the action that needs them, sends right after the action that
produced their data (after the ``W`` for a fused backward); sends are buffered (a send never
waits for its receive), which the simulator assumes too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Iterable, Sequence

KINDS = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
INTERLEAVED = ("interleaved_1f1b",)
SPLIT_BACKWARD = ("zero_bubble",)  # the kinds that send the gradient before their W


# ---- actions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """One thing one rank does: ``kind`` (a class constant) on microbatch ``mb`` at ``stage``."""

    mb: int
    stage: int
    kind: ClassVar[str] = ""


@dataclass(frozen=True)
class F(Action):
    """Forward of ``mb`` through ``stage``."""

    kind: ClassVar[str] = "F"


@dataclass(frozen=True)
class B(Action):
    """Backward of ``mb`` through ``stage`` to its input gradient."""

    kind: ClassVar[str] = "B"


@dataclass(frozen=True)
class W(Action):
    """Backward of ``mb`` through ``stage`` to its weight gradients."""

    kind: ClassVar[str] = "W"


@dataclass(frozen=True)
class P2P(Action):
    """A point-to-point transfer of ``stage``'s data for ``mb`` with rank ``peer``."""

    peer: int


@dataclass(frozen=True)
class SEND_F(P2P):  # noqa: N801 - the action's name, as in the literature and torch
    """``stage``'s output activations of ``mb`` to stage ``stage + 1`` on ``peer``."""

    kind: ClassVar[str] = "SEND_F"


@dataclass(frozen=True)
class RECV_F(P2P):  # noqa: N801
    """``stage``'s input activations of ``mb`` from stage ``stage - 1`` on ``peer``."""

    kind: ClassVar[str] = "RECV_F"


@dataclass(frozen=True)
class SEND_B(P2P):  # noqa: N801
    """``stage``'s input gradient of ``mb`` to stage ``stage - 1`` on ``peer``."""

    kind: ClassVar[str] = "SEND_B"


@dataclass(frozen=True)
class RECV_B(P2P):  # noqa: N801
    """``stage``'s output gradient of ``mb`` from stage ``stage + 1`` on ``peer``."""

    kind: ClassVar[str] = "RECV_B"


COMPUTE = (F, B, W)
ACTION_KINDS = ("F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")


# ---- the schedule value ----------------------------------------------------------------------


def stage_rank(stage: int, num_ranks: int) -> int:
    """The rank that runs ``stage`` under looped placement: ``stage % num_ranks``."""
    return stage % num_ranks


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists for one step (see the module docstring).

    * ``kind``: one of ``KINDS``.
    * ``num_stages``: model stages ``S = len(ranks) * virtual_stages``.
    * ``num_microbatches``: ``m``.
    * ``ranks``: ``ranks[r]`` is what rank ``r`` runs, in order.

    Guarantee: ``num_stages`` is a positive multiple of ``len(ranks)`` (``ValueError``
    otherwise). Whether the actions form a complete, matched step is ``check``'s job."""

    kind: str
    num_stages: int
    num_microbatches: int
    ranks: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(tuple(actions) for actions in self.ranks))
        if not self.ranks or self.num_stages < 1 or self.num_stages % len(self.ranks):
            raise ValueError(f"{self.num_stages} stages do not spread evenly over {len(self.ranks)} ranks")

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.num_ranks

    def rank_of(self, stage: int) -> int:
        return stage_rank(stage, self.num_ranks)

    def compute(self, rank: int) -> tuple[Action, ...]:
        """Rank ``rank``'s ``F``/``B``/``W`` actions in order (transfers left out)."""
        return tuple(a for a in self.ranks[rank] if isinstance(a, COMPUTE))

    def describe(self) -> str:
        """One line per rank of its compute order, e.g. ``F0 F1 B0 W0``; ``F3.1`` is
        microbatch 3 at stage 1 when a rank holds several stages."""
        tag = (lambda a: f"{a.kind}{a.mb}.{a.stage}") if self.virtual_stages > 1 else (lambda a: f"{a.kind}{a.mb}")
        lines = [f"{self.kind}: {self.num_ranks} ranks, {self.num_stages} stages, {self.num_microbatches} microbatches"]
        lines += [f"  rank {r}: " + " ".join(tag(a) for a in self.compute(r)) for r in range(self.num_ranks)]
        return "\n".join(lines)


# ---- building one ----------------------------------------------------------------------------


def schedule(kind: str, num_stages: int, num_microbatches: int, *, virtual_stages: int = 1) -> Schedule:
    """The ``kind`` schedule of ``num_microbatches`` microbatches on ``num_stages`` RANKS.

    ``num_stages`` is the pipeline degree ``p`` (one rank per stage of a round); with
    ``virtual_stages = v`` each rank holds ``v`` model chunks and the model has ``p * v``
    stages (``Schedule.num_stages``), stage ``s`` on rank ``s % p``.

    Guarantees (``property_tests/test_schedule_properties.py``):
      * every ``(mb, stage)`` has exactly one ``F``, ``B`` and ``W``, on the stage's rank
        (``test_every_microbatch_and_stage_has_exactly_one_forward_backward_and_weight_pass``);
      * every send has exactly one matching receive, and neighbouring stages on different
        ranks exchange exactly one activation and one gradient per microbatch
        (``test_every_send_has_exactly_one_matching_receive``);
      * the simulator runs it to the end, each ``F`` before its ``B`` before its ``W``
        (``test_simulation_never_deadlocks_and_orders_forward_backward_weight``);
      * bubbles and memory as in the module docstring (the bubble and in-flight tests there).

    Edge cases: ``m < p`` is fine except for interleaved (warm-ups are capped at ``m``);
    ``p = 1`` gives one rank and no transfers; interleaved with ``v = 1`` is exactly 1f1b.

    Raises ``ValueError`` naming the problem for: an unknown ``kind`` (the message lists
    ``KINDS``), ``num_stages < 1``, ``num_microbatches < 1``, ``virtual_stages < 1``,
    ``virtual_stages > 1`` with a kind that is not interleaved, and interleaved with
    ``num_microbatches`` not a positive multiple of ``num_stages``. ``TypeError`` for a
    count that is not an ``int``."""
    _check_arguments(kind, num_stages, num_microbatches, virtual_stages)
    p, m, v = num_stages, num_microbatches, virtual_stages
    split = kind in SPLIT_BACKWARD
    ranks = tuple(_with_transfers(_compute_order(kind, p, m, v, r), p, p * v, split) for r in range(p))
    return Schedule(kind=kind, num_stages=p * v, num_microbatches=m, ranks=ranks)


def _check_arguments(kind: str, p: int, m: int, v: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown schedule kind {kind!r}; kinds are {KINDS}")
    for name, value in (("num_stages", p), ("num_microbatches", m), ("virtual_stages", v)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if v > 1 and kind not in INTERLEAVED:
        raise ValueError(
            f"virtual_stages={v} needs an interleaved kind {INTERLEAVED}; {kind!r} runs one stage per rank"
        )
    if kind in INTERLEAVED and m % p:
        raise ValueError(
            f"{kind} needs num_microbatches to be a multiple of num_stages (the {p} ranks), so at least {p};"
            f" got {m} microbatches"
        )


def _compute_order(kind: str, p: int, m: int, v: int, r: int) -> list[Action]:
    """Rank ``r``'s ``F``/``B``/``W`` actions in order, for the kinds of the module table."""
    if kind in INTERLEAVED:
        forwards = [F(mb, c * p + r) for mb, c in _interleaved_slots(p, m, v, reverse=False)]
        backwards = [B(mb, c * p + r) for mb, c in _interleaved_slots(p, m, v, reverse=True)]
        warmup = (v - 1) * p + 2 * (p - 1 - r) if v > 1 else p - 1 - r
        return _one_forward_one_backward(forwards, backwards, warmup, w_delay=0)
    forwards = [F(mb, r) for mb in range(m)]
    backwards = [B(mb, r) for mb in range(m)]
    if kind == "gpipe":
        return _one_forward_one_backward(forwards, backwards, warmup=m, w_delay=0)
    if kind == "1f1b":
        return _one_forward_one_backward(forwards, backwards, warmup=p - 1 - r, w_delay=0)
    return _one_forward_one_backward(forwards, backwards, warmup=p - 1 - r, w_delay=r)  # zero_bubble


def _interleaved_slots(p: int, m: int, v: int, *, reverse: bool) -> list[tuple[int, int]]:
    """``(mb, chunk)`` in the order one rank runs them: rounds of ``p`` microbatches, each
    round through chunks ``0 .. v-1`` (``v-1 .. 0`` with ``reverse``, for backwards). The
    order is the same on every rank, which is what keeps neighbours in step."""
    chunks = range(v - 1, -1, -1) if reverse else range(v)
    return [(start + i, c) for start in range(0, m, p) for c in chunks for i in range(p)]


def _one_forward_one_backward(forwards: Sequence[Action], backwards: Sequence[Action], warmup: int,
                              w_delay: int) -> list[Action]:
    """``warmup`` forwards, then forward/backward pairs, then the remaining backwards; each
    ``B`` is followed by the ``W`` of the backward ``w_delay`` places earlier (the last
    ``w_delay`` W's go at the end). ``warmup >= len(forwards)`` gives every forward first."""
    n = len(forwards)
    warmup = min(warmup, n)
    order: list[Action] = list(forwards[:warmup])
    for i, back in enumerate(backwards):
        if warmup + i < n:
            order.append(forwards[warmup + i])
        order.append(back)
        if i >= w_delay:
            order.append(_weight_pass(backwards[i - w_delay]))
    order += [_weight_pass(back) for back in backwards[max(0, n - w_delay):]]
    return order


def _weight_pass(back: Action) -> W:
    return W(back.mb, back.stage)


def _with_transfers(compute: Iterable[Action], p: int, num_stages: int, split_backward: bool) -> tuple[Action, ...]:
    """``compute`` with each receive right before the action needing it and each send right
    after the action producing its data: after ``B`` for a split backward, after the ``W``
    for a fused one (whose ``W`` always directly follows its ``B``). Only stages on
    different ranks exchange."""
    out: list[Action] = []
    for a in compute:
        s, mb = a.stage, a.mb
        prev_peer = stage_rank(s - 1, p) if s > 0 else None
        next_peer = stage_rank(s + 1, p) if s + 1 < num_stages else None
        here = stage_rank(s, p)
        prev_remote = prev_peer is not None and prev_peer != here
        next_remote = next_peer is not None and next_peer != here
        if isinstance(a, F):
            if prev_remote:
                out.append(RECV_F(mb, s, prev_peer))
            out.append(a)
            if next_remote:
                out.append(SEND_F(mb, s, next_peer))
        elif isinstance(a, B):
            if next_remote:
                out.append(RECV_B(mb, s, next_peer))
            out.append(a)
            if split_backward and prev_remote:
                out.append(SEND_B(mb, s, prev_peer))
        else:
            out.append(a)
            if not split_backward and prev_remote:
                out.append(SEND_B(mb, s, prev_peer))
    return tuple(out)


# ---- checking one ----------------------------------------------------------------------------


def check(sched: Schedule) -> None:
    """Raise ``ValueError`` unless ``sched`` is one complete, matched step:

    * every action's ``mb`` is in ``range(m)``, its ``stage`` in ``range(S)``, and it sits on
      ``stage % p``; every ``(mb, stage)`` has exactly one ``F``, ``B`` and ``W``;
    * transfers go only between neighbouring stages on different ranks, to the rank holding
      the neighbour; each cross-rank activation and gradient is sent exactly once and received
      exactly once.

    It does not check order (that needs timing): ``simulate`` finds deadlocks."""
    p, S, m = sched.num_ranks, sched.num_stages, sched.num_microbatches
    seen: dict[Action, int] = {}
    for r, actions in enumerate(sched.ranks):
        for a in actions:
            if not (0 <= a.mb < m and 0 <= a.stage < S):
                raise ValueError(f"{a!r} on rank {r}: microbatch or stage out of range ({m} microbatches, {S} stages)")
            if stage_rank(a.stage, p) != r:
                raise ValueError(f"{a!r} is on rank {r}, but stage {a.stage} lives on rank {stage_rank(a.stage, p)}")
            if isinstance(a, P2P):
                _check_transfer(a, p, S)
            if a in seen:
                raise ValueError(f"{a!r} appears twice on rank {r}")
            seen[a] = r
    for mb in range(m):
        for s in range(S):
            for cls in COMPUTE:
                if cls(mb, s) not in seen:
                    raise ValueError(f"{cls(mb, s)!r} is missing")
    for a in seen:
        if isinstance(a, P2P) and matching(a, p) not in seen:
            raise ValueError(f"{a!r} on rank {seen[a]} has no matching {matching(a, p)!r} on rank {a.peer}")
    for mb in range(m):
        for s in range(S - 1):
            here, there = stage_rank(s, p), stage_rank(s + 1, p)
            if here != there:
                for needed in (SEND_F(mb, s, there), SEND_B(mb, s + 1, here)):
                    if needed not in seen:
                        raise ValueError(f"{needed!r} is missing: stages {s} and {s + 1} are on different ranks")


def _check_transfer(a: P2P, p: int, S: int) -> None:
    neighbour = a.stage + 1 if isinstance(a, (SEND_F, RECV_B)) else a.stage - 1
    if not 0 <= neighbour < S:
        raise ValueError(f"{a!r}: stage {a.stage} has no stage {neighbour} to exchange with")
    if stage_rank(neighbour, p) != a.peer:
        raise ValueError(f"{a!r}: stage {neighbour} lives on rank {stage_rank(neighbour, p)}, not {a.peer}")
    if a.peer == stage_rank(a.stage, p):
        raise ValueError(f"{a!r}: stages {a.stage} and {neighbour} share a rank and exchange nothing")


def matching(a: P2P, num_ranks: int) -> P2P:
    """The transfer at the other end of ``a``: ``SEND_F(mb, s, q)`` <-> ``RECV_F(mb, s + 1, r)``
    and ``SEND_B(mb, s, q)`` <-> ``RECV_B(mb, s - 1, r)``, where ``r`` runs ``a``."""
    me = stage_rank(a.stage, num_ranks)
    if isinstance(a, SEND_F):
        return RECV_F(a.mb, a.stage + 1, me)
    if isinstance(a, RECV_F):
        return SEND_F(a.mb, a.stage - 1, me)
    if isinstance(a, SEND_B):
        return RECV_B(a.mb, a.stage - 1, me)
    return SEND_B(a.mb, a.stage + 1, me)


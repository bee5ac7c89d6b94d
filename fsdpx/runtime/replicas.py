"""The first step's check that a tensor-parallel plan fits the model: every parameter the plan
keeps whole on the ``tp`` ranks gets the same reduced gradient on each of them.

A replicated parameter is right when its module sees the same input on every ``tp`` rank (a norm
between regions, a row-parallel bias added after the sum). A module the plan leaves unstyled
inside a region sees the rank's split features instead (Qwen3's per-head query norm under
Llama's plan; a layer fed by a column-parallel output): each rank's gradient is then its own
share, the copies drift apart from the first update, and nothing else would say so. The check
compares, once, three sums of each such gradient (its sum, absolute sum and squared sum, in
float64) across the ``tp`` ranks that share everything else, after the gradient's reduction
and before any update, and raises ``TensorParallelPlanError`` naming the parameters. Replicas
computed from the same input agree to the bit on the CPU; the bound (``RTOL``) leaves room for
GPU kernels that accumulate with atomics, far below the gap of a share (a fraction of the whole).
Dropout gives the same symptom: each rank draws its own masks, so the activations the plan keeps
whole differ between ranks; when the model has dropout active the error says so and how to turn
it off (fsdpx does not yet give tensor-parallel ranks common masks;
``tests/test_tensor_parallel_hf.py::test_dropout_under_tensor_parallelism_is_refused_by_name``).

Proven by ``tests/test_tensor_parallel_hf.py::test_qwen3_per_head_norms_without_their_style_are_refused``
(simulated mesh) and ``tests/multiprocess/test_gloo.py::test_a_tp_plan_missing_a_style_is_refused_on_gloo``.
"""

from __future__ import annotations

from torch import Tensor, nn

from fsdpx.sharding.comm import Comm
from fsdpx.sharding.plan import ShardingPlan
from fsdpx.sharding.tensor_parallel import TensorParallelPlanError

RTOL = 1e-4


class ReplicaCheck:
    """Collects the fingerprints of this rank's tp-replicated gradients during the first step's
    reduction (``add``), then compares them across the ``tp`` group (``finish``, one object
    all-gather over ``comm``, uncounted); every later call does nothing."""

    def __init__(self, plan: ShardingPlan, comm: Comm, model: nn.Module | None = None):
        self.axis = plan.tp_axis
        self.comm, self.model = comm, model
        self.active = self.axis is not None and comm.mesh.axis_size(self.axis) > 1
        self.stats: dict[str, tuple[float, float, float]] = {}

    def add(self, plan: ShardingPlan, name: str, grad: Tensor) -> None:
        """Record ``grad`` (in the layout ``plan.params[name].grad``) if the plan keeps it whole
        over ``tp``."""
        if self.active and self.axis not in plan.params[name].grad.sharding_axes:
            g = grad.detach().double()
            self.stats[name] = (float(g.sum()), float(g.abs().sum()), float(g.square().sum()))

    def finish(self) -> None:
        """Raise ``TensorParallelPlanError`` naming every parameter whose fingerprint differs
        between two ranks of this rank's ``tp`` group; then stop checking."""
        if not self.active:
            return
        self.active = False
        mesh, axis = self.comm.mesh, self.axis
        others = tuple(a for a in mesh.axis_names if a != axis)
        mine = _group(mesh, self.comm.rank, others)
        everyone = self.comm.all_gather_object((mine, self.stats))
        peers = [(r, stats) for r, (group, stats) in enumerate(everyone) if group == mine]
        bad = sorted(n for n in self.stats if not all(_close(self.stats[n], stats.get(n)) for _, stats in peers))
        self.stats = {}
        if bad:
            dropout = active_dropout(self.model) if self.model is not None else []
            raise TensorParallelPlanError(_dropout_message(bad, dropout, axis) if dropout else _share_message(bad, axis))


def _share_message(bad: list[str], axis: str) -> str:
    return (f"parameters the tensor-parallel plan keeps whole on every {axis!r} rank got different gradients on "
            f"them: {bad}. Their modules compute on the rank's split features (a norm applied to each head "
            f"inside the attention, a layer fed by a column-parallel output), so each rank's gradient is only "
            f"its own share. Style those modules ReplicatedOnSplit (summed over {axis!r}) or split them "
            f"(fsdpx.sharding.tensor_parallel). Or the ranks drew different random numbers where the plan keeps "
            f"activations whole (dropout: every rank must seed its generator alike); nothing was updated")


def _dropout_message(bad: list[str], dropout: list[str], axis: str) -> str:
    more = lambda names, k: f"{names[:k]}{' and more' if len(names) > k else ''}"
    return (f"parameters the tensor-parallel plan keeps whole on every {axis!r} rank got different gradients on "
            f"them: {more(bad, 6)}. The model has dropout active ({more(dropout, 3)}), and each rank draws its own "
            f"masks, so activations the plan keeps whole differ between the ranks; fsdpx does not yet give "
            f"tensor-parallel ranks common masks. Set the dropout probabilities to 0 (e.g. --model-fields "
            f"'resid_pdrop = 0.0, embd_pdrop = 0.0, attn_pdrop = 0.0' for GPT-2), call model.eval() for your own "
            f"loop, or train without tensor parallelism; nothing was updated")


def active_dropout(model: nn.Module) -> list[str]:
    """Names of the modules that would drop activations in this forward: ``nn.Dropout``-like
    modules with ``p > 0`` and modules with a positive ``attention_dropout`` / ``attn_dropout``
    / ``dropout`` float (transformers' attention calls ``F.dropout`` with it), in training mode."""
    found = []
    for name, module in model.named_modules():
        if not module.training:
            continue
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            found.append(name)
        elif any(isinstance(getattr(module, a, None), float) and getattr(module, a) > 0
                 for a in ("attention_dropout", "attn_dropout", "dropout")):
            found.append(name)
    return found


def _group(mesh, rank: int, others: tuple[str, ...]) -> tuple[int, ...]:
    coords = mesh.coords(rank)
    return tuple(coords[a] for a in others)


def _close(a: tuple[float, float, float], b: tuple[float, float, float] | None) -> bool:
    """The two fingerprints agree: each sum within ``RTOL`` of the larger absolute sum (a sum
    near zero is judged on the scale of its terms), the squared sums within ``RTOL`` of each other."""
    if b is None:
        return False
    scale = max(a[1], b[1])
    return (abs(a[0] - b[0]) <= RTOL * scale and abs(a[1] - b[1]) <= RTOL * scale
            and abs(a[2] - b[2]) <= RTOL * max(a[2], b[2]))

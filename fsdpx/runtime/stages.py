"""One pipeline stage's forward, run through the user's unmodified model.

The model's own ``forward`` runs, so everything it computes besides the hidden state (position
ids, attention masks, rotary tables) is computed exactly as it would be. Three temporary changes
make it one stage's forward:

* the block list holds only the stage's blocks (its ``_modules`` swapped, keys kept, so
  iteration and slicing, the ways models walk their layers, see only them);
* a stage after the first has its input injected: a forward pre-hook on its first block replaces
  the hidden state (the first positional argument, or ``hidden_states``) with the received
  activation;
* a stage before the last stops after its last block: a forward hook raises ``StageExit``
  carrying the block's output, which ends the model's forward (the epilogue never runs).

Parameters this rank does not hold (another stage's prologue, e.g. the position embedding on a
later stage, whose output is replaced anyway) are swapped for stand-ins of their shape that own
one element of memory (``expand`` of a scalar): NaN for floating point. A stand-in must never
count, and two checks make sure it does not:

* a module using one before the blocks of stage 0, or after the blocks of the last stage, means
  the plan put a parameter on the wrong side of the block list (a model registered in another
  order than its forward runs): ``PipelinePlanError`` naming the module, as it runs;
  :func:`traced_prologue` finds the right side by running the forward once;
* anything else that carries a stand-in into what a stage sends or its losses (a parameter read
  directly rather than through its module, a prologue whose output feeds the blocks besides the
  hidden state, such as DeBERTa's relative position embeddings or an encoder under a
  decoder's blocks) turns them NaN: :meth:`StageForward.check_output` raises
  ``PipelinePlanError`` at a stage's first forward, naming the parameters it lacks.

Side effects live only inside :meth:`StageForward.running` and :func:`traced_prologue`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Collection, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from fsdpx.sharding.pipeline import PipelineLayout, PipelinePlanError
from . import global_rng
from .slots import Slots


class StageExit(Exception):
    """Raised by the last block of a stage that is not the model's last: carries its output."""

    def __init__(self, output: Tensor):
        super().__init__("pipeline stage finished")
        self.output = output


def hidden_of(output: Any) -> Tensor:
    """A block's hidden-state output: the tensor itself, or the first element of a tuple (as
    transformers' blocks return ``(hidden_states, ...)``)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    raise TypeError(f"a pipeline block must return a tensor or a tuple starting with one, got {type(output)}")


def absent_uses(model: nn.Module, planned: Collection[str], layout: PipelineLayout,
                stage: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Alias -> (shape, dtype) of every use of a ``planned`` parameter that ``stage`` does not
    hold, outside the blocks of other stages (the block list holds only the stage's blocks while
    it runs, so those are never called): the prologue and epilogue parameters the stage lacks."""
    held = set(layout.params_of([stage]))
    canonical = {id(p): n for n, p in model.named_parameters()}
    keys = list(dict(model.named_modules())[layout.blocks]._modules)
    prefix = f"{layout.blocks}." if layout.blocks else ""
    others = {f"{prefix}{k}." for i, k in enumerate(keys) if i not in layout.stages[stage]}
    return {alias: (tuple(p.shape), p.dtype) for alias, p in model.named_parameters(remove_duplicate=False)
            if canonical[id(p)] in planned and canonical[id(p)] not in held
            and not any(alias.startswith(o) for o in others)}


class StageForward:
    """Runs ``model``'s forward as one stage of ``layout`` (see the module docstring)."""

    def __init__(self, model: nn.Module, layout: PipelineLayout, absent: dict[str, tuple[Sequence[int], torch.dtype]],
                 *, device: torch.device | str | None = None):
        """``absent``: alias name -> (shape, dtype) of every parameter use this rank does not hold
        outside the blocks of other stages (``absent_uses``); ``device``: of their stand-ins
        (``"meta"`` to trace a stage on meta tensors)."""
        self.model, self.layout = model, layout
        self.block_list: nn.ModuleList = dict(model.named_modules())[layout.blocks]
        self.keys = list(self.block_list._modules)
        # stand-ins built once: NaN (zero for integers) owning one element, never written, never a leaf
        self.stand_ins = {alias: torch.full((), math.nan if dtype.is_floating_point or dtype.is_complex else 0,
                                        dtype=dtype, device=device).expand(tuple(shape))
                      for alias, (shape, dtype) in absent.items()}
        self.checked: set[int] = set()  # stages whose first output check_output has seen
        self.slots = Slots(model, self.stand_ins)
        modules = dict(model.named_modules())
        self.stand_in_users = {name: modules[name] for name in sorted({a.rpartition(".")[0] for a in absent})}

    @contextlib.contextmanager
    def running(self, stage: int, inject: Tensor | None) -> Iterator[None]:
        """Inside, ``model(...)`` is stage ``stage``'s forward: it starts from ``inject`` (stage
        > 0) and raises ``StageExit`` after the stage's last block (stage < S - 1)."""
        blocks = [self.block_list._modules[self.keys[i]] for i in self.layout.stages[stage]]
        saved = self.block_list._modules
        handles = []
        swapped = self.slots.swap(self.stand_ins) if self.stand_ins else {}
        try:
            self.block_list._modules = {self.keys[i]: b for i, b in zip(self.layout.stages[stage], blocks)}
            if inject is not None:
                handles.append(blocks[0].register_forward_pre_hook(_injector(inject), with_kwargs=True))
            if stage < self.layout.num_stages - 1:
                handles.append(blocks[-1].register_forward_hook(_exit))
            handles += self._guard(stage, blocks)
            yield
        finally:
            for h in handles:
                h.remove()
            self.block_list._modules = saved
            if swapped:
                self.slots.swap(swapped)

    def check_output(self, stage: int, output: Tensor) -> None:
        """At stage ``stage``'s first forward (each later one returns at once): raise
        ``PipelinePlanError`` when ``output`` (what the stage sends, or its per-example losses) is
        not finite while the stage computes with stand-ins, naming the parameters it lacks.
        Proven by ``tests/test_pipeline_prologue.py::test_a_stand_in_feeding_the_blocks_is_refused``."""
        if stage in self.checked:
            return
        self.checked.add(stage)
        if not self.stand_ins or output.device.type == "meta" or bool(torch.isfinite(output).all()):
            return
        raise PipelinePlanError(
            f"stage {stage} of the pipeline over {self.layout.blocks!r} computes with parameters it does not hold "
            f"(their stand-ins are NaN, and its output is not finite): {sorted(self.stand_ins)}. Something outside "
            f"the blocks feeds them besides the hidden state the stage receives (a parameter read directly, "
            f"relative position embeddings, an encoder), which a pipeline does not support; or, if it uses none "
            f"of these, the model itself gives non-finite values")

    def _guard(self, stage: int, blocks: list[nn.Module]) -> list:
        """Hooks that raise ``PipelinePlanError`` when a module using a stand-in runs where its
        output counts: before the blocks of stage 0, after the blocks of the last stage; none
        once the stage's first output was checked (:meth:`check_output`)."""
        last = self.layout.num_stages - 1
        if not self.stand_in_users or 0 < stage < last or stage in self.checked:
            return []  # the plan does not change: a stage whose first forward passed needs no guard
        phase = ["before"]
        handles = _phase_hooks(blocks[0], blocks[-1], phase)
        counts = ("before", 0) if stage == 0 else ("after", last)

        def check(name: str):
            def hook(module: nn.Module, args: tuple, output: Any) -> None:
                if phase[0] == counts[0]:
                    side, other = ("before", last) if stage == 0 else ("after", 0)
                    raise PipelinePlanError(
                        f"module {name!r} runs {side} the block list {self.layout.blocks!r}, on stage {stage}, but "
                        f"its parameters were placed on stage {other}: the model registers it on the other side "
                        f"of the block list, and without PipelineParallel(prologue=...) registration order is "
                        f"taken for the forward's. Pass prologue= naming the parameters the forward uses before "
                        f"the blocks (fsdpx.runtime.stages.traced_prologue(model, blocks, example) finds them)")
            return hook

        return handles + [m.register_forward_hook(check(n)) for n, m in self.stand_in_users.items()]


def traced_prologue(model: nn.Module, blocks: str, *args: Any, **kwargs: Any) -> tuple[str, ...]:
    """The parameters (``named_parameters(remove_duplicate=False)`` names) of the modules outside
    the block list ``blocks`` that ``model``'s forward, called on ``args`` / ``kwargs`` (one small
    example is enough), runs before its first block: ``PipelineParallel.prologue``.

    One forward under ``torch.no_grad`` in eval mode, the random number generators restored
    afterwards: the model, its mode and the run's random streams are left as they were.

    Guarantee: with it, a model registered in another order than its forward runs (transformers'
    OPT) trains under a pipeline exactly as unsharded (``tests/test_pipeline_prologue.py``).

    Raises ``PipelinePlanError`` for a module outside the blocks that runs both before and after
    them (one stage would need its parameters on both sides), and when no block runs."""
    modules = dict(model.named_modules())
    block_list = modules[blocks]
    prefix = f"{blocks}."
    phase = ["before"]
    seen: dict[str, set[str]] = {}
    outside = {n: m for n, m in modules.items()
               if n != blocks and not n.startswith(prefix) and any(True for _ in m.parameters(recurse=False))}
    handles = _phase_hooks(block_list[0], block_list[len(block_list) - 1], phase)
    handles += [m.register_forward_hook(lambda _m, _a, _o, n=n: seen.setdefault(n, set()).add(phase[0]))
                for n, m in outside.items()]
    args, kwargs = _on_model_device(model, args, kwargs)
    run_hooked(model, handles, args, kwargs)
    if phase[0] == "before":
        raise PipelinePlanError(f"the forward ran none of the blocks of {blocks!r}")
    both = sorted(n for n, sides in seen.items() if "before" in sides and "after" in sides)
    if both:
        raise PipelinePlanError(f"modules {both} run both before and after the block list: a pipeline stage would"
                                " need their parameters on both sides")
    return tuple(f"{n}.{k}" if n else k for n, m in outside.items() if "before" in seen.get(n, ())
                 for k, _ in m.named_parameters(recurse=False))


def check_stages(model: nn.Module, layout: PipelineLayout, *args: Any, rtol: float = 1e-5, atol: float = 1e-6,
                 **kwargs: Any) -> None:
    """Raise ``PipelinePlanError`` unless every stage of ``layout``, run the way the pipeline
    runs it (the block list holding only its blocks, its first block's hidden state injected),
    gives what the whole model's forward gives at that point, on ``args`` / ``kwargs`` (one small
    example), every parameter real. What it catches: blocks that take something from earlier
    blocks besides the hidden state (T5 passes its position bias from block to block), which no
    stage boundary carries, so a later stage would compute without it.

    One forward of the whole model and one of each stage, under ``torch.no_grad`` in eval mode,
    the random number generators and each module's mode restored. Proven by
    ``tests/test_pipeline_prologue.py::test_blocks_that_pass_state_besides_the_hidden_state_are_refused``."""
    block_list = dict(model.named_modules())[layout.blocks]
    keys = list(block_list._modules)
    entered: dict[int, Tensor] = {}
    left: dict[int, Tensor] = {}

    def capture(i: int):
        def pre(module: nn.Module, a: tuple, kw: dict) -> None:
            entered.setdefault(i, a[0] if a else kw["hidden_states"])

        def post(module: nn.Module, a: tuple, output: Any) -> None:
            left.setdefault(i, hidden_of(output))
        return pre, post

    args, kwargs = _on_model_device(model, args, kwargs)
    forward = StageForward(model, layout, {})
    handles = []
    try:
        with quietly(model):
            for i, k in enumerate(keys):
                pre, post = capture(i)
                handles += [block_list._modules[k].register_forward_pre_hook(pre, with_kwargs=True),
                            block_list._modules[k].register_forward_hook(post)]
            whole = _first_tensor(model(*args, **kwargs))
            for h in handles:
                h.remove()
            handles = []
            for s, blocks in enumerate(layout.stages):
                with forward.running(s, entered[blocks[0]] if s > 0 else None):
                    try:
                        got = _first_tensor(model(*args, **kwargs))
                    except StageExit as e:
                        got = e.output
                want = left[blocks[-1]] if s < layout.num_stages - 1 else whole
                if got.shape != want.shape or not torch.allclose(got, want, rtol=rtol, atol=atol):
                    gap = float((got - want).abs().max()) if got.shape == want.shape else math.inf
                    raise PipelinePlanError(
                        f"stage {s} (blocks {blocks[0]}-{blocks[-1]} of {layout.blocks!r}), run alone from the hidden "
                        f"state it receives, does not give what the whole model gives there (largest difference "
                        f"{gap:.3g}): its blocks take something from earlier blocks besides the hidden state (a "
                        f"position bias passed from block to block, a residual carried apart), which no stage "
                        f"boundary carries; such a model cannot be pipelined")
    finally:
        for h in handles:
            h.remove()


def run_hooked(model: nn.Module, handles: list, args: tuple, kwargs: dict) -> None:
    """One :func:`quietly` forward of ``model`` with the hooks whose ``handles`` are given, every
    one of them removed afterwards, also when the forward raises."""
    try:
        with quietly(model):
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def quietly(model: nn.Module) -> Iterator[None]:
    """Inside: eval mode, no gradients, the random number generators forked; on exit every
    module's own mode is back (a part the user keeps in eval stays in eval) and the run's random
    streams are as they were. The global generator is held (:mod:`fsdpx.runtime.global_rng`):
    forking it around this forward while another rank's thread built its model rewound that
    build's stream."""
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with global_rng.exclusive(), torch.no_grad():
            yield
    finally:
        for m, training in modes.items():
            m.training = training


def _phase_hooks(first: nn.Module, last: nn.Module, phase: list[str]) -> list:
    """Hooks that set ``phase[0]`` to ``"blocks"`` as ``first`` starts and to ``"after"`` as
    ``last`` ends (``phase[0]`` starts as ``"before"``)."""
    return [first.register_forward_pre_hook(lambda *_: phase.__setitem__(0, "blocks")),
            last.register_forward_hook(lambda *_: phase.__setitem__(0, "after"))]


def _on_model_device(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with their tensors on the device of ``model``'s parameters."""
    device = next((p.device for p in model.parameters()), None)
    move = (lambda t: t.to(device) if isinstance(t, Tensor) else t) if device is not None else (lambda t: t)
    return tree_map(move, args), tree_map(move, kwargs)


def _first_tensor(output: Any) -> Tensor:
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor)]
    if not tensors:
        raise TypeError(f"the model returned no tensor ({type(output).__name__})")
    return tensors[0]


def _injector(x: Tensor):
    def pre(module: nn.Module, args: tuple, kwargs: dict):
        if args:
            return (x, *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": x}
        raise TypeError(f"cannot find the hidden state among the first block's arguments (kwargs {sorted(kwargs)})")
    return pre


def _exit(module: nn.Module, args: tuple, output: Any) -> None:
    raise StageExit(hidden_of(output))

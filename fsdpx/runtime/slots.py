"""Where a model's named tensors live, found once, so swapping them in and out is a dict write.

A pipeline rank swaps its stage's parameters into the user's model for every microbatch's forward
(``Gatherer.installed``, ``StageForward.running``). ``NamedMemberAccessor.swap_tensors_dict``
walks the module path of every name on every call (a few microseconds a tensor, a few hundred
tensors per microbatch and stage); ``Slots`` resolves each name to its module's ``_parameters`` or
``_buffers`` dict once and then swaps by key.
"""

from __future__ import annotations

from typing import Iterable

from torch import Tensor, nn
from torch.nn.utils._named_member_accessor import NamedMemberAccessor


class Slots:
    """The storage places of ``names`` in ``model``, resolved when built.

    Resolving at construction also makes swapping independent of later changes to the module
    tree (a pipeline stage temporarily holds only its own blocks in the block list). A name that
    is neither a parameter nor a buffer of its module (a plain tensor attribute) is swapped
    through ``NamedMemberAccessor`` on every call, as before.
    """

    def __init__(self, model: nn.Module, names: Iterable[str]):
        self.accessor = NamedMemberAccessor(model)
        self.places: dict[str, tuple[dict, str] | None] = {}
        for name in names:
            prefix, _, attr = name.rpartition(".")
            module = model.get_submodule(prefix)
            if attr in module._parameters:
                self.places[name] = (module._parameters, attr)
            elif attr in module._buffers:
                self.places[name] = (module._buffers, attr)
            else:
                self.places[name] = None

    def swap(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Put ``tensors`` in their places; returns what was there, by name (pass it to ``swap``
        again to undo). Every name must have been given when the ``Slots`` was built (a
        ``KeyError`` otherwise); nothing is swapped when one is unknown. Equal in effect to
        ``NamedMemberAccessor(model).swap_tensors_dict(tensors, allow_missing=True)[0]`` for
        names that exist (``tests/test_slots.py::test_slots_swap_like_accessor``)."""
        places = [self.places[n] for n in tensors]  # KeyError before any write
        old = {}
        for (name, tensor), place in zip(tensors.items(), places):
            if place is None:
                old[name] = self.accessor.swap_tensor(name, tensor, allow_missing=True)
            else:
                store, key = place
                old[name] = store[key]
                store[key] = tensor
        return old

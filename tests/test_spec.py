"""Spec: canonical, printable, parseable, hashable; validation names what is wrong."""

import pytest

from fsdpx import Mesh, Spec


@pytest.mark.parametrize(
    "spec, text",
    [
        (Spec("dp", None), "Spec('dp', None)"),
        (Spec(("replica", "shard"), None, partial=("dp",)), "Spec(('replica', 'shard'), None, partial=('dp',))"),
        (Spec(), "Spec()"),
        (Spec(None, partial=("b", "a")), "Spec(None, partial=('a', 'b'))"),
    ],
)
def test_parse_inverts_repr(spec, text):
    assert repr(spec) == text
    assert Spec.parse(repr(spec)) == spec
    assert Spec.parse(text) == spec


def test_specs_are_canonical_so_equal_layouts_are_equal_values():
    assert Spec(("dp",), None) == Spec("dp", None)
    assert Spec((), "dp") == Spec(None, "dp")
    assert Spec(["a", "b"]) == Spec(("a", "b"))
    assert Spec(None, partial=["b", "a"]) == Spec(None, partial=("a", "b"))
    assert Spec(None, partial="dp") == Spec(None, partial=("dp",))
    assert hash(Spec(("dp",), None)) == hash(Spec("dp", None))
    assert Spec("a", "b") != Spec("b", "a") and Spec(("a", "b")) != Spec(("b", "a"))
    assert Spec.replicated(3) == Spec(None, None, None) and Spec.replicated(0) == Spec()
    assert Spec(("a", "b"), None).axes(0) == ("a", "b") and Spec("a").axes(0) == ("a",)
    with pytest.raises(AttributeError):
        Spec("dp").x = 1


def test_dual_swaps_replicated_and_partial_axes():
    m = Mesh(a=2, b=2, c=2)
    s = Spec("a", None, partial=("b",))
    assert s.dual(m) == Spec("a", None, partial=("c",))
    assert s.dual(m).dual(m) == s


@pytest.mark.parametrize(
    "make, axis",
    [
        (lambda: Spec("dp", "dp"), "dp"),
        (lambda: Spec(("a", "dp"), "dp"), "dp"),
        (lambda: Spec("dp", partial=("dp",)), "dp"),
        (lambda: Spec(None, partial=("x", "x")), "x"),
    ],
)
def test_an_axis_used_twice_is_rejected_by_name(make, axis):
    with pytest.raises(ValueError, match=f"axis '{axis}' used twice"):
        make()


def test_validate_names_unknown_axes_and_both_ranks():
    m = Mesh(dp=2)
    assert Spec("dp", None).validate(m, (4, 3)) == Spec("dp", None)
    with pytest.raises(ValueError, match="unknown mesh axis 'tp'"):
        Spec("tp", None).validate(m, (4, 3))
    with pytest.raises(ValueError, match="unknown mesh axis 'tp'"):
        Spec(None, partial=("tp",)).validate(m, (4,))
    with pytest.raises(ValueError, match=r"has 2 dims but shape \(4,\) has 1"):
        Spec("dp", None).validate(m, (4,))
    with pytest.raises(ValueError, match="non-negative"):
        Spec("dp").validate(m, (-1,))


@pytest.mark.parametrize("entry", [3, ("a", 3), "", ("a", "")])
def test_bad_entries_are_rejected(entry):
    with pytest.raises(ValueError):
        Spec(entry)


@pytest.mark.parametrize("text", ["Spec('a', foo)", "PartitionSpec('a')", "Spec('a', bogus=1)", "Spec(", "__import__('os')"])
def test_parse_rejects_anything_but_a_literal_spec(text):
    with pytest.raises(ValueError, match="cannot parse spec"):
        Spec.parse(text)

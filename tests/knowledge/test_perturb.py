"""The perturbations of `metainfer gate --perturb` (metainfer/knowledge/perturb*.py): each kind of output is
changed as documented, a method is replaced in its class only, and the modes stay within the quick
selections."""

from __future__ import annotations

import pytest
import torch

from metainfer.knowledge.blueprint import load_blueprint
from metainfer.knowledge.perturb import in_selection, perturbation_modes, quick_tests
from metainfer.knowledge.perturb_runtime import perturb_attribute, perturb_value, perturbed


def test_each_kind_of_output_is_perturbed():
    assert torch.equal(perturb_value(torch.tensor([1.0, -2.0])), torch.tensor([1.01, -2.02]))
    assert torch.equal(perturb_value(torch.tensor([3, 4], dtype=torch.int32)), torch.tensor([4, 5], dtype=torch.int32))
    assert torch.equal(perturb_value(torch.tensor([True, False])), torch.tensor([False, True]))
    assert perturb_value(7) == 8 and perturb_value(True) is False and perturb_value(2.0) == 2.02
    assert perturb_value([5, 6, 7]) == [5, 6] and perturb_value("stop") == "sto"
    name, tensor = perturb_value(("w", torch.ones(2)))
    assert name == "w" and torch.equal(tensor, torch.full((2,), 1.01))  # a record: its tensors only
    assert perturb_value({"a": 1, "b": (2, 3)}) == {"a": 2, "b": (3, 4)}
    pairs = list(perturb_value(pair for pair in [("x", 1), ("y", torch.ones(1))]))  # a generator: every item
    assert pairs[0] == ("", 2) and torch.equal(pairs[1][1], torch.full((1,), 1.01))


def test_an_engine_object_returned_has_its_attributes_perturbed_one_level():
    """A built runner or a started heartbeat (an object of the engine's own classes, returned itself): its
    attributes; an object inside it, and an object of another package, are left as they are."""
    class Built:
        def __init__(self, inner=None):
            self.rank, self.prefix, self.weights, self.inner = 1, "beat", torch.ones(2), inner

    Built.__module__ = "metainfer.fake"
    inner = Built()
    out = perturb_value(Built(inner))
    assert (out.rank, out.prefix, out.inner) == (2, "bea", inner) and torch.equal(out.weights, torch.full((2,), 1.01))
    assert inner.rank == 1  # one level only
    Built.__module__ = "elsewhere"
    assert perturb_value(Built()).rank == 1


def test_a_function_returning_nothing_has_its_arguments_perturbed():
    def store(dst: torch.Tensor, slots: list) -> None:
        dst.fill_(2.0)

    dst, slots = torch.zeros(2), [1, 2]
    perturbed(store)(dst, slots)
    assert torch.equal(dst, torch.full((2,), 2.02)) and slots == [1]


def test_a_method_is_replaced_in_its_class_only():
    class Base:
        def value(self):
            return 10

        @property
        def size(self):
            return 3

    class Child(Base):
        pass

    perturb_attribute(Child, "value")
    perturb_attribute(Child, "size")
    assert (Child().value(), Child().size, Base().value(), Base().size) == (11, 4, 10, 3)


def test_every_mode_runs_only_quick_tests_and_all_of_them():
    blueprint = load_blueprint()
    quick = quick_tests(blueprint)
    modes = perturbation_modes(blueprint, hints={"perturb.rms_norm_ref": ["tests/engine/test_llm_api.py::x"]})
    assert len(modes) >= 100
    for mode in modes:
        ran = [t for stage in mode["stages"] for t in stage]
        assert all(in_selection(t, quick) for t in ran), mode["id"]
        assert set(quick) <= set(ran) and len(ran) == len(set(ran)), mode["id"]  # every quick test, once
    rms = next(m for m in modes if m["id"] == "perturb.rms_norm_ref")
    assert "tests/engine/test_llm_api.py::x" not in rms["stages"][0]  # a hint outside the quick tests is dropped
    assert rms["stages"][0][0] == "tests/kernels/test_elementwise.py"  # its own quick tests first


def test_a_decorated_function_is_perturbed_in_its_own_module():
    """fill_dummy_weights is wrapped by @torch.no_grad(), whose source file is torch's: the mutation must still
    go into metainfer/loader/dummy.py, above its `def` (a wrong file was a harness error, not a result)."""
    import os

    from metainfer.knowledge.blueprint import locate_target

    path, owner, name = locate_target("metainfer.loader.dummy:fill_dummy_weights")
    assert path.endswith(os.path.join("metainfer", "loader", "dummy.py"))
    assert (owner, name) == ("", "fill_dummy_weights")
    mode = next(m for m in perturbation_modes(only=["perturb.fill_dummy_weights"]))
    assert mode["mutation"]["file"].endswith("metainfer/loader/dummy.py")


def test_a_check_that_raises_has_its_decision_flipped():
    """A check's output is its decision: perturbed, what it rejects goes through (annotated -> None only: a
    function that returns a value keeps its error)."""

    def check(x: int) -> None:
        if x < 0:
            raise ValueError("x must be >= 0")

    def parse(x: int) -> int:
        if x < 0:
            raise ValueError("x must be >= 0")
        return x

    assert perturbed(check)(-1) is None and perturbed(check)(1) is None
    with pytest.raises(ValueError):
        perturbed(parse)(-1)


def test_every_perturbation_has_its_own_id():
    """Two modules' `identity` once shared the id perturb.identity: the evidence held one result twice and
    --perturb-only could not name either alone."""
    ids = [m["id"] for m in perturbation_modes(load_blueprint())]
    assert len(ids) == len(set(ids))
    blueprint = load_blueprint()
    twins = [{"id": f"n{i}", "tests": [], "perturb": {"targets": [f"metainfer.distributed.{m}:identity"]}}
             for i, m in enumerate(("communication", "custom_all_reduce"))]
    modes = perturbation_modes({**blueprint, "nodes": twins})
    assert [m["id"] for m in modes] == ["perturb.communication.identity", "perturb.custom_all_reduce.identity"]
    assert modes[0]["mutation"]["file"] != modes[1]["mutation"]["file"]


def test_a_coroutine_and_an_async_generator_are_perturbed():
    """The server's endpoint steps are coroutines and its streams async generators: the awaited result, and every
    item yielded, are perturbed (a coroutine object itself has no value to change)."""
    import asyncio

    async def ids():
        return [1, 2, 3]

    async def stream():
        yield "abc"
        yield 5

    async def collect():
        return [item async for item in perturbed(stream)()]

    assert asyncio.run(perturbed(ids)()) == [1, 2]
    assert asyncio.run(collect()) == ["ab", 6]

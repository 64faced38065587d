"""The GPU suite's in-engine A/B offers another GPU's tuned tables on this one (an H200's on an A100, which ships
none): the variant's GEMM is the one select_ops builds for that GPU (its GEMV table; its skinny table for the
rows), and no such variant is offered on that GPU itself. The H100 ships the H200's GEMV and skinny tables (run
111's A/B of that variant there). Selection makes no CUDA call, so this runs on the CPU."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from metainfer.kernels import select_ops  # noqa: E402
from metainfer.kernels.tuned_configs import load_tuned_configs  # noqa: E402
from tools.gpu_suite import ab  # noqa: E402

A100, H100, H200 = "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def _gemv_table(ops):
    """The parsed GEMV table bound into ops' linear ({} for cuBLAS everywhere)."""
    base = ops.linear.keywords.get("base", ops.linear) if hasattr(ops.linear, "keywords") else ops.linear
    return dict(base.keywords["table"]) if hasattr(base, "keywords") and "table" in base.keywords else {}


def _variants(monkeypatch, gpu):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu)
    runner = SimpleNamespace(device=torch.device("cuda"), ops=select_ops("cuda", gpu_name=gpu, pdl=True))
    return ab._kernel_variants(SimpleNamespace(ab_tables_of=H200), runner, {})


def test_an_h200s_tables_are_a_variant_on_a_gpu_without_tables(monkeypatch):
    assert load_tuned_configs(H200)["gemv"] and not load_tuned_configs(A100)["gemv"]
    bs1, rows = _variants(monkeypatch, A100)
    names = [name for name, _ in bs1]
    assert names[0] == "default" and names[-1] == "default_again" and f"tables_of {H200}" in names
    other = dict(bs1)[f"tables_of {H200}"]
    assert _gemv_table(other) == _gemv_table(select_ops("cuda", gpu_name=H200, pdl=True)) != {}
    assert _gemv_table(dict(bs1)["default"]) == {}  # no GEMV table here: cuBLAS
    assert [name for name, _ in rows] == ["default", f"tables_of {H200}"]
    assert other.linear.func.__name__ == "linear_with_skinny"  # the H200's skinny table drives 3-64 rows


@pytest.mark.parametrize("gpu", [H200, H100])  # the H100 ships the H200's tables: nothing to compare
def test_no_variant_of_a_gpus_own_tables(monkeypatch, gpu):
    bs1, rows = _variants(monkeypatch, gpu)
    assert not any(name.startswith("tables_of") for name, _ in bs1) and rows == []


def test_the_h100_ships_the_h200s_gemv_and_skinny_tables_and_its_own_moe_table():
    h100, h200 = load_tuned_configs(H100), load_tuned_configs(H200)
    assert h100["gemv"] == h200["gemv"] != {} and h100["skinny"] == h200["skinny"] != {}
    assert h100["gemv_no_pdl"] == {}  # without PDL select_ops takes the gemv table (not measured on an H100)
    assert h100["moe"] and h100["moe"] != h200["moe"]
    assert _gemv_table(select_ops("cuda", gpu_name=H100, pdl=True)) == _gemv_table(select_ops("cuda", gpu_name=H200,
                                                                                           pdl=True))

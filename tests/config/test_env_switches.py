"""The engine's A/B environment switches reach the build-time kernel selection (read once, at build).

On the CPU the selected op set is the torch reference whatever the switches say, so the test records
what ModelRunner passes to select_ops; the GPU suite measures what each switch does on the H200."""

from __future__ import annotations

import pytest

import metainfer.engine.model_runner as model_runner
from metainfer import LLM
from metainfer.config import ConfigError
from tests.helpers.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ab_switches"))
    build_tiny_model(path, "qwen3")
    return path


@pytest.mark.parametrize("env, expected", [
    ({}, {"skinny_gemm": True, "fuse_decode_prep": False}),
    ({"METAINFER_SKINNY_GEMM": "0"}, {"skinny_gemm": False, "fuse_decode_prep": False}),
    ({"METAINFER_FUSED_DECODE_PREP": "1"}, {"skinny_gemm": True, "fuse_decode_prep": True}),
])
def test_switches_reach_select_ops(folder, monkeypatch, env, expected):
    seen = []
    real = model_runner.select_ops

    def recording_select_ops(device, **kwargs):
        seen.append(kwargs)
        return real(device, **kwargs)

    monkeypatch.setattr(model_runner, "select_ops", recording_select_ops)
    for name in ("METAINFER_SKINNY_GEMM", "METAINFER_FUSED_DECODE_PREP", "METAINFER_DISABLE_PDL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=8)
    assert len(seen) == 1 and {k: seen[0][k] for k in expected} == expected
    assert seen[0]["pdl"] is False  # the CPU has no programmatic dependent launch
    assert llm.llm_engine.runner.ops is not None


@pytest.mark.parametrize("env, pdl", [({}, True), ({"METAINFER_DISABLE_PDL": "1"}, False),
                                      ({"METAINFER_DISABLE_PDL": "0"}, True)])
def test_disable_pdl_switch_on_a_device_with_pdl(folder, monkeypatch, env, pdl):
    """As on an sm_90 GPU (pdl_supported faked True): PDL is on unless METAINFER_DISABLE_PDL=1. The
    recorded pdl is checked; the CPU build then proceeds with the reference ops (pdl needs CUDA)."""
    seen = []
    real = model_runner.select_ops

    def recording_select_ops(device, **kwargs):
        seen.append(kwargs)
        return real(device, **{**kwargs, "pdl": False})

    monkeypatch.setattr(model_runner, "select_ops", recording_select_ops)
    monkeypatch.setattr(model_runner, "pdl_supported", lambda device: True)
    monkeypatch.delenv("METAINFER_DISABLE_PDL", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    LLM(folder, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=8)
    assert len(seen) == 1 and seen[0]["pdl"] is pdl


@pytest.mark.parametrize("name, value", [("METAINFER_SKINNY_GEMM", "2"), ("METAINFER_DISABLE_PDL", "true"),
                                         ("METAINFER_FUSED_DECODE_PREP", "off"), ("METAINFER_FP8_V_TOKEN_MAJOR", ""),
                                         ("METAINFER_DECODE_ORDER", "shortest"), ("METAINFER_FUSED_SAMPLER", "no")])
@pytest.mark.parametrize("engine", [{}, {"tensor_parallel_size": 2}], ids=["tp1", "tp2"])
def test_unknown_switch_values_are_rejected(folder, monkeypatch, name, value, engine):
    """A switch set to a value it does not know is a ConfigError naming the variable, before anything is
    built or a TP worker is spawned, whatever the KV cache (METAINFER_FP8_V_TOKEN_MAJOR with a model-dtype
    one too): an A/B run with a typo would otherwise measure the default twice."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        LLM(folder, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=8, **engine)


def test_every_switch_is_documented_and_read():
    """Each switch of the table is named in the README and read somewhere in the engine (a table entry
    nobody reads, or one the README leaves out, fails here)."""
    import pathlib

    from metainfer.config import ENV_SWITCHES

    root = pathlib.Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    engine_src = "".join(p.read_text() for p in (root / "metainfer").rglob("*.py") if p.name != "config.py")
    for name, (default, choices) in ENV_SWITCHES.items():
        assert default in choices, name
        assert name in readme, f"{name} is not in the README"
        assert f'env_switch("{name}")' in engine_src or f'env_choice("{name}")' in engine_src, name

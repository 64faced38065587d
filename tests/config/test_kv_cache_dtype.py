"""The kv_cache_dtype option: the names and torch dtypes it accepts, the GPU it needs for fp8, a bad value
named in the error, and the CLI flag. (The fp8 cache's parity with HF: tests/models/test_fp8_kv_parity.py.)"""

from __future__ import annotations

import argparse

import pytest
import torch

from metainfer import LLM
from metainfer.entrypoints.cli import add_engine_args, engine_kwargs
from tests.helpers.tiny_models import build_tiny_model

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kv-dtype"))
    build_tiny_model(path, "qwen3")
    return path


@pytest.mark.parametrize("bad", ["int4", "FP8", ["fp8"], None, torch.float16])
def test_bad_kv_cache_dtype_names_the_field(folder, bad):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(folder, device="cpu", dtype="float32", kv_cache_dtype=bad)


def test_kv_cache_dtype_accepts_torch_dtypes_and_checks_the_gpu(monkeypatch):
    from metainfer.config import resolve_kv_cache_dtype

    bf16 = torch.bfloat16
    assert resolve_kv_cache_dtype(FP8, bf16) is FP8 and resolve_kv_cache_dtype(bf16, bf16) is bf16
    assert resolve_kv_cache_dtype("fp8_e4m3", bf16) is FP8 and resolve_kv_cache_dtype("auto", bf16) is bf16
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    with pytest.raises(ValueError, match="kv_cache_dtype.*8.9"):
        resolve_kv_cache_dtype("fp8", bf16, cuda)
    assert resolve_kv_cache_dtype("auto", bf16, cuda) is bf16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100 / H200
    assert resolve_kv_cache_dtype("fp8", bf16, cuda) is FP8


def test_cli_flag_reaches_the_engine_kwargs():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--model", "m", "--kv-cache-dtype", "fp8"]))["kv_cache_dtype"] == "fp8"
    assert engine_kwargs(p.parse_args(["--model", "m"]))["kv_cache_dtype"] == "auto"


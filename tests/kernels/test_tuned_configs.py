"""The per-device tuned tables (metainfer/kernels/configs/*.json): every shipped file parses into the
configs its kernels take and the loader finds it by its device name; the tuning tools' writer round-trips."""

from __future__ import annotations

import glob
import json
import os

import pytest

from metainfer.kernels.gemv import parse_gemv_table
from metainfer.kernels.skinny_gemm import parse_skinny_table
from metainfer.kernels.tuned_configs import CONFIG_DIR, SECTIONS, config_path, load_tuned_configs
from tools.gpu_suite.families import MOE_FAMILY_GEMV_SHAPES
from tools.tune_gemv import QWEN3_8B_DECODE_SHAPES, write_tuned_section

SHIPPED = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.json")))


def test_some_device_ships_a_table():
    assert SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_shipped_file_parses_and_loads_by_its_device_name(path):
    with open(path) as f:
        doc = json.load(f)
    assert config_path(doc["device"]) == path  # the file name the loader derives from torch's GPU name
    assert set(doc) <= {"device", "about", *SECTIONS}
    tuned = load_tuned_configs(doc["device"])
    for section in SECTIONS:
        assert tuned[section] == (doc.get(section) or {})
    shapes = set(QWEN3_8B_DECODE_SHAPES.values()) | set(MOE_FAMILY_GEMV_SHAPES.values())
    for section in ("gemv", "gemv_no_pdl"):
        assert set(parse_gemv_table(tuned[section])) <= shapes, section
    skinny = parse_skinny_table(tuned["skinny"])
    assert {(n, k) for n, k, _ in skinny} <= shapes


def test_unknown_device_gets_empty_tables():
    assert load_tuned_configs("A GPU without a file") == {name: {} for name in SECTIONS}
    assert load_tuned_configs(None) == {name: {} for name in SECTIONS}


def test_writer_merges_a_section_the_loader_reads(tmp_path, monkeypatch):
    import metainfer.kernels.tuned_configs as tc

    monkeypatch.setattr(tc, "CONFIG_DIR", str(tmp_path))
    path = write_tuned_section("Some GPU 9", "gemv", {"64x32": {"block_n": 4, "block_k": 32, "num_warps": 2}},
                               path=tc.config_path("Some GPU 9"))
    assert os.path.basename(path) == "Some_GPU_9.json"
    write_tuned_section("Some GPU 9", "skinny", {"64x32/m16": {"block_n": 32, "block_k": 32}}, path=path)
    write_tuned_section("Some GPU 9", "gemv", {"32x32": {"block_n": 2, "block_k": 32, "num_warps": 1}}, path=path)
    tuned = tc.load_tuned_configs("Some GPU 9")
    assert set(parse_gemv_table(tuned["gemv"])) == {(64, 32), (32, 32)}
    assert set(parse_skinny_table(tuned["skinny"])) == {(64, 32, 16)}
    assert tuned["gemv_no_pdl"] == {}
    with pytest.raises(ValueError, match="section"):
        write_tuned_section("Some GPU 9", "gemm", {}, path=path)

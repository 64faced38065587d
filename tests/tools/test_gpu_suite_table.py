"""The device script's pure-Python parts run on the CPU, so a typo there cannot cost a GPU run:
the summary table renders from every committed run's JSON (runs 20-28), and the sections the docs
run exist."""

from __future__ import annotations

import glob
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every suite result from run 20 on (the earlier ones predate some of the table's keys), not the pytest logs
RUNS = sorted(p for p in glob.glob(os.path.join(ROOT, "docs", "results", "gpu_run*.json"))
              if os.path.basename(p)[len("gpu_run"):-len(".json")].isdigit()
              and int(os.path.basename(p)[len("gpu_run"):-len(".json")]) >= 20)


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", os.path.join(ROOT, "scripts", "gpu_suite.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", RUNS, ids=[os.path.basename(p) for p in RUNS])
def test_table_renders_from_a_committed_run(suite, path):
    suite.RESULTS.clear()
    with open(path) as f:
        suite.RESULTS.update(json.load(f))
    table = suite.table()
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) >= 2, table  # the header and at least one figure (run 37 has only the GPU tests' row)


def test_the_sections_the_docs_run_are_defined(suite):
    sections = {name for name in dir(suite) if getattr(getattr(suite, name), "__name__", "") == "run"}  # @section
    assert {"latency", "throughput", "ab", "kv_fp8", "attn_kv_dtype", "graphs", "agreement", "gpu_tests",
            "profile", "profile_batch", "kernels", "baseline"} <= sections

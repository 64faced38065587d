"""Compile kernels for sm_90 ahead of time (tools/aot_check.py) in a fresh process: the CPU's check that a
kernel edit still compiles for the H200, without one."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest


def run_aot_check(ops: list[str]) -> str:
    """Compile the given ops for sm_90 in a fresh process without TRITON_INTERPRET; returns its output."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory() as cache_dir:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(TRITON_CACHE_DIR=cache_dir, TRITON_DEFAULT_FP_FUSION="1")
        proc = subprocess.run([sys.executable, "-m", "tools.aot_check", *ops], cwd=root, env=env,
                              capture_output=True, text=True, timeout=300)
    if proc.returncode == 2:
        pytest.skip(f"triton cannot compile for sm_90 here: {proc.stderr.strip()[-500:]}")
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    return proc.stdout

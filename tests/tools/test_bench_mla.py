"""tools/bench_mla.py on the CPU: importable with no CUDA call, its pure helpers, and a clean refusal without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_import_makes_no_cuda_call():
    code = (
        "import torch\n"
        "def boom(*a, **k):\n"
        "    raise AssertionError('CUDA touched at import')\n"
        "for name in ('is_available', 'init', 'device_count', 'get_device_name', 'synchronize', 'current_device'):\n"
        "    setattr(torch.cuda, name, boom)\n"
        "import tools.bench_mla\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_floor_and_flop_counts():
    from tools import bench_mla

    # one sequence of 512 tokens: 512 * 576 bf16 values = 589,824 bytes at 4.8 TB/s
    assert bench_mla.decode_floor_us(1, 512) == pytest.approx(589824 / 4.8e12 * 1e6)
    assert bench_mla.decode_floor_us(256, 8192) == pytest.approx(256 * 8192 * bench_mla.decode_floor_us(1, 1))
    # causal: T (T + 1) / 2 visible pairs; absorbed 512 + 64 + 512 per pair and head, expanded 192 + 128
    assert bench_mla.absorbed_prefill_flops(2) == 2.0 * 16 * 3 * 1088
    assert bench_mla.expanded_prefill_flops(2) == 2.0 * 16 * 3 * 320
    assert bench_mla.faster_form(1.0, 2.0) == "absorbed"
    assert bench_mla.faster_form(3.0, 2.0) == "expanded"
    assert bench_mla.faster_form(None, 2.0) is None


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal without a GPU")
def test_main_refuses_without_gpu(capsys):
    from tools import bench_mla

    assert bench_mla.main(["--budget-s", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_live_splits_follow_the_kernel_rule():
    """The sweep's live-split count is _split_range's: chunks of a block_n multiple of at least the minimum."""
    from tools import bench_mla

    # the engine at batch 1 over a 4,096-token table: 64 splits of >= 64 tokens
    assert [bench_mla.live_splits(c, 64, 64, 32) for c in (40, 64, 65, 100, 160, 512)] == [1, 1, 2, 2, 3, 8]
    assert bench_mla.live_splits(160, 64, 256, 32) == 1
    assert bench_mla.live_splits(512, 64, 128, 64) == 4
    assert bench_mla.live_splits(8192, 8, 64, 32) == 8  # long contexts: the split count bounds it

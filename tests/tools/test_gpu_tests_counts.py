"""The GPU suite's test runner counts what ran even when its timeout cuts pytest off (no JUnit XML), and a
timeout ends pytest-xdist's workers too. The reference is a generated test file whose outcomes are known by
construction, run by real pytest."""

import os
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

from tests.helpers.processes import wait_gone
from tools.gpu_suite import checks

OUTCOMES = textwrap.dedent("""
    import pytest

    @pytest.fixture
    def broken():
        raise RuntimeError("setup fails")

    @pytest.mark.parametrize("i", range(7))
    def test_pass(i):
        pass

    @pytest.mark.parametrize("i", range(3))
    def test_skip(i):
        pytest.skip("by construction")

    @pytest.mark.parametrize("i", range(2))
    def test_fail(i):
        assert i < 0

    def test_error(broken):
        pass
""")
EXPECTED = {"passed": 7, "skipped": 3, "failed": 2, "errors": 1}


def _pytest_output(path, *extra) -> str:
    proc = subprocess.run([sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider", *extra],
                          capture_output=True, text=True, timeout=120)
    return proc.stdout + proc.stderr


def test_progress_counts_match_pytests_outcomes(tmp_path):
    path = tmp_path / "test_outcomes.py"
    path.write_text(OUTCOMES)
    assert checks.progress_counts(_pytest_output(path)) == EXPECTED


def test_progress_counts_read_xdist_progress(tmp_path):
    pytest.importorskip("xdist")
    path = tmp_path / "test_outcomes.py"
    path.write_text(OUTCOMES)
    assert checks.progress_counts(_pytest_output(path, "-n", "2")) == EXPECTED


@pytest.mark.slow
def test_cut_off_run_counts_what_ran_and_ends_its_workers(tmp_path, monkeypatch):
    pytest.importorskip("xdist")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    fast = tmp_path / "test_a_fast.py"
    fast.write_text("import pytest\n\n@pytest.mark.parametrize('i', range(5))\ndef test_fast(i):\n    pass\n")
    slow = tmp_path / "test_b_slow.py"
    slow.write_text(textwrap.dedent(f"""
        import os
        import time

        def test_hangs():
            open(os.path.join({str(pid_dir)!r}, str(os.getpid())), "w").close()
            time.sleep(600)
    """))
    started = time.perf_counter()
    res = checks.pytest_on_gpu([str(fast), str(slow)], timeout=25, workers=2)
    assert time.perf_counter() - started < 60
    assert res["returncode"] == "timeout"
    assert res["counts"]["from_progress_lines"] and res["counts"]["tests"] == 5
    assert res["counts"]["failures"] == 0
    worker_pids = [int(name) for name in os.listdir(pid_dir)]
    assert worker_pids, "the hanging test never started"
    assert wait_gone(worker_pids, timeout=10) == [], "the xdist worker outlived pytest"


def test_engine_tests_run_alone_and_kernel_tests_share_the_gpu(monkeypatch):
    calls = []

    def fake_run(files, timeout, marker="", test_filter="", workers=1, output_name=""):
        calls.append((files, workers))
        bad = workers == 1
        return {"files": files, "counts": {"tests": 3, "failures": int(bad), "errors": 0, "skipped": 1},
                "failed": ["t::x"] if bad else [], "returncode": 1 if bad else 0}

    monkeypatch.setattr(checks, "pytest_on_gpu", fake_run)
    args = SimpleNamespace(gpu_test_files="tests/kernels,tests/worker,tests/kernels/test_gemv.py",
                           gpu_test_workers=4, budget_s=500.0, started=time.perf_counter(), quick_below_s=0.0,
                           gpu_test_marker="", gpu_test_filter="")
    res = checks.gpu_tests(args, {})
    assert calls == [(["tests/worker"], 1), (["tests/kernels", "tests/kernels/test_gemv.py"], 4)]
    assert res["counts"] == {"tests": 6, "failures": 1, "errors": 0, "skipped": 2}
    assert res["returncode"] == 1 and res["failed"] == ["t::x"]
    calls.clear()
    checks.gpu_tests(SimpleNamespace(**{**vars(args), "gpu_test_workers": 1}), {})
    assert calls == [(["tests/kernels", "tests/worker", "tests/kernels/test_gemv.py"], 1)]

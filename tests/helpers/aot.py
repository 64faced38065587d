"""Compile kernels for sm_90 ahead of time (tools/aot_check.py) in a fresh process: the CPU's check that a
kernel edit still compiles for the H200, without one."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest


def run_without_interpreter(argv: list[str], timeout: float = 300) -> str:
    """Run `python *argv` in a fresh process without TRITON_INTERPRET (the interpreter cannot compile) and a
    fresh Triton cache; skips the test on exit status 2 (Triton cannot compile for sm_90 here), fails it on any
    other non-zero status; returns its stdout."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory() as cache_dir:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(TRITON_CACHE_DIR=cache_dir, TRITON_DEFAULT_FP_FUSION="1")
        proc = subprocess.run([sys.executable, *argv], cwd=root, env=env, capture_output=True, text=True,
                              timeout=timeout)
    if proc.returncode == 2:
        pytest.skip(f"triton cannot compile for sm_90 here: {(proc.stdout + proc.stderr).strip()[-500:]}")
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    return proc.stdout


def run_aot_check(ops: list[str]) -> str:
    """Compile the given ops for sm_90 with tools/aot_check in a fresh process; returns its output."""
    return run_without_interpreter(["-m", "tools.aot_check", *ops])


def run_aot_main(module: str, function: str, timeout: float = 300) -> str:
    """Call `module.function()` (an `aot_main` caller) in a fresh process, its return value the exit status;
    returns its output."""
    return run_without_interpreter(["-c", f"import sys; from {module} import {function}; sys.exit({function}())"],
                                   timeout)


def aot_main(kernels: list, launch, *, fail_on_spills: bool = False) -> int:
    """Compile for sm_90 every distinct launch of `kernels` that `launch()` makes (the launchers run on CPU
    tensors with each kernel's `run` intercepted) and print a line each. Shared memory over the H200's fails,
    register spills too where asked. Returns the exit status: 0 all compiled, 1 a failure, 2 cannot compile here.
    Run it in a process without TRITON_INTERPRET (`run_aot_main`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    from tools.aot_check import _MAX_SHARED_BYTES, _compile_launch, _probe_compile, _resource_usage, capture_launches

    target = GPUTarget("cuda", 90, 32)
    reason = _probe_compile(target)
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    backend = make_backend(target)
    with capture_launches(kernels) as captured:
        launch()
    failures, seen = 0, set()
    for kernel, args, kwargs, grid in captured:
        name = kernel.fn.__name__
        try:
            compiled = _compile_launch(kernel, args, kwargs, target, backend)
        except Exception as exc:  # noqa: BLE001 - report every kernel, then fail
            failures += 1
            print(f"FAIL {name}: {type(exc).__name__}: {exc}")
            continue
        if compiled.hash in seen:
            continue
        seen.add(compiled.hash)
        shared, usage = compiled.metadata.shared, _resource_usage(compiled)
        status = ("FAIL shared memory" if shared > _MAX_SHARED_BYTES
                  else "FAIL register spills" if fail_on_spills and "SPILL" in usage else "ok")
        failures += status != "ok"
        print(f"{status} {name} grid={grid} smem={shared} {usage}")
    print(f"{len(seen)} distinct kernels compiled for sm_90, {failures} failures")
    return 1 if failures else 0

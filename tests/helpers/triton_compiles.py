"""Counting Triton kernel variants a run needs (the warm-up tests: serving must not JIT-compile).

GPU: `CompileCounter` installs `triton.knobs.runtime.jit_cache_hook`, which Triton calls on every miss of a
kernel's in-memory variant cache, i.e. before each compile or load from the on-disk cache.
CPU: the interpreter (TRITON_INTERPRET=1) compiles nothing, so `LaunchKeys` computes, for every launch, the key
the launch would look up in JITFunction's variant cache (the same binder Triton builds: each argument's
specialisation by `native_specialize_impl`, constexpr values, launch options) and records the set. A key first
seen after the warm-up is a variant the GPU would compile mid-serving.
"""

from __future__ import annotations

import inspect


class CompileCounter:
    """`with CompileCounter() as c: ...`; `c.kernels` lists the kernels Triton compiled (or loaded) meanwhile."""

    def __enter__(self):
        from triton import knobs

        self.kernels: list[str] = []
        self._knobs, self._previous = knobs.runtime, knobs.runtime.jit_cache_hook

        def hook(*args, **kwargs):
            fn = kwargs.get("fn")
            self.kernels.append(getattr(fn, "name", repr(fn)))
            return False  # go on compiling: we only count

        knobs.runtime.jit_cache_hook = hook
        return self

    def __exit__(self, *exc):
        self._knobs.jit_cache_hook = self._previous


class LaunchKeys:
    """`with LaunchKeys() as k: ...`: `k.seen` collects (kernel, variant key) of every interpreted launch.
    `run_kernels=False` records without running them (their outputs stay as allocated) but for `always_run`
    (the step's input ids: embedding indices): for a run whose launch shapes do not depend on the values computed
    (greedy, ignore_eos, fixed max_tokens), the interpreter's cost without its work."""

    def __init__(self, run_kernels: bool = True, always_run: tuple[str, ...] = ("_step_inputs_kernel",)):
        self.run_kernels, self.always_run = run_kernels, always_run

    def __enter__(self):
        from triton.backends.compiler import BaseBackend
        from triton.runtime import interpreter
        from triton.runtime.jit import KernelParam, create_function_from_signature

        self.seen: set[tuple[str, str]] = set()
        self._cls, self._run = interpreter.InterpretedFunction, interpreter.InterpretedFunction.run
        binders: dict[int, object] = {}
        keys = self

        def binder_of(fn):
            binder = binders.get(id(fn))
            if binder is None:
                sig = inspect.signature(fn.fn)
                dns = fn.kwargs.get("do_not_specialize") or []
                dnsa = fn.kwargs.get("do_not_specialize_on_alignment") or []
                params = [KernelParam(i, p, i in dns or p.name in dns, i in dnsa or p.name in dnsa)
                          for i, p in enumerate(sig.parameters.values())]
                binder = binders[id(fn)] = create_function_from_signature(sig, params, BaseBackend)
            return binder

        def run(fn, *args, grid, warmup, **kwargs):
            _, specialization, options = binder_of(fn)(*args, **kwargs)
            keys.seen.add((fn.fn.__qualname__, repr((specialization, sorted(options.items())))))
            if keys.run_kernels or fn.fn.__name__ in keys.always_run:
                return keys._run(fn, *args, grid=grid, warmup=warmup, **kwargs)
            return None

        interpreter.InterpretedFunction.run = run
        return self

    def __exit__(self, *exc):
        self._cls.run = self._run

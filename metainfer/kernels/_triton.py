"""Guarded Triton import shared by the kernel modules.

`import metainfer.kernels` must work on machines without Triton (the CPU path only needs the
torch references) and must never touch CUDA. Importing triton does neither, but it may be absent:
then `triton.jit` becomes a stub that keeps the kernel definitions importable and raises when a
Triton launcher is actually used.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Mapping
from dataclasses import asdict, fields
from typing import ClassVar, TypeVar

try:
    import triton
    import triton.language as tl
    from triton.compiler import CompiledKernel

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is missing
    HAS_TRITON = False
    CompiledKernel = type("CompiledKernel", (), {})  # nothing is one: PlannedLaunch never launches directly

    class _MissingKernel:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            raise RuntimeError("triton is not installed: use the *_ref kernels (select_ops('cpu'))")

    def _missing_jit(fn=None, **_kwargs):
        return _MissingKernel(fn) if fn is not None else _MissingKernel

    triton = types.SimpleNamespace(jit=_missing_jit, cdiv=lambda a, b: -(-a // b))
    # Only what kernel *signatures* evaluate at definition time is needed here.
    tl = types.SimpleNamespace(constexpr=object)


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Programmatic dependent launch (sm_90+): a kernel launched with `launch_pdl=True` may start
    while the previous kernel in the stream is finishing. It must pass this point before it loads
    anything an earlier kernel writes and before its first store (the caching allocator may hand it
    memory an earlier kernel still reads); weights may be read before it. gdc_wait returns once
    every earlier kernel has completed and its writes are visible; launch_dependents then lets the
    next kernel's programs be scheduled as this one's leave the SMs. Every program calls it, so a
    kernel's completion implies its predecessors' (the chain stays ordered)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def check_launch_fields(config, bounds: dict) -> None:
    """ValueError naming the field of a launch config (a dataclass) whose value is not an int in
    [lo, hi] (a power of two where asked): bounds = {field: (lo, hi, power_of_two)}."""
    for name, (lo, hi, pow2) in bounds.items():
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi \
                or (pow2 and value & (value - 1)):
            kind = "a power of two" if pow2 else "an integer"
            raise ValueError(f"{type(config).__name__}.{name} must be {kind} in [{lo}, {hi}], got {value!r}")


def launch_config_from_any(cls, value):
    """A launch config dataclass `cls` from an instance or a dict of its field names (as `asdict` / the
    sweeps' JSON give it); ValueError naming the unknown fields or the wrong type."""
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        known = [f.name for f in fields(cls)]
        unknown = set(value) - set(known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)} (known: {known})")
        return cls(**value)
    raise ValueError(f"a {cls.__name__} must be a {cls.__name__} or a dict, got {type(value).__name__}")


_Config = TypeVar("_Config", bound="LaunchConfig")


class LaunchConfig:
    """Base of the tuned tables' launch configs (frozen dataclasses): every table checks its fields on
    construction and round-trips through JSON the same way, so that is written once here."""

    BOUNDS: ClassVar[dict] = {}  # field -> (lo, hi, power_of_two), see check_launch_fields

    def __post_init__(self):
        check_launch_fields(self, self.BOUNDS)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_any(cls: type[_Config], value) -> _Config:
        """An instance, or a dict with its field names (as `to_dict` / the tuners' JSON give it)."""
        return launch_config_from_any(cls, value)


def pdl_args(pdl: bool) -> dict:
    """Launch keywords of a kernel with a `USE_PDL` constexpr (see pdl_enter)."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl else {"USE_PDL": False}


def pdl_supported(device) -> bool:
    """PDL needs a CUDA device of compute capability 9.0 or later (Hopper); a CUDA call."""
    import torch

    device = torch.device(device)
    return HAS_TRITON and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton tile sizes must be powers of two)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: use the *_ref kernels (select_ops('cpu'))")


class PlannedLaunch:
    """An attention launch with everything but q, the layer's K/V cache views and out worked out once (checks,
    split rule, tiles, strides, constexprs): the layers of one step repeat the same launch over their own caches,
    so the step's first layer plans it (`plans`, the step's AttentionMetadata.launch_plans) and the others replay
    it: ~3 us of Python a call instead of ~8-10 (docs/results/launcher_overhead_cpu.json). The kernel's
    arguments are (q, k_cache, v_cache, *before_out, out, *after_out); every call must pass tensors of the
    planned shapes, strides and dtypes (one step's layers do: views of one pool, one static or fresh output).
    kernel None: an empty launch (the output alone, allocated when not given).

    The first call launches through Triton's JITFunction (binding, specialization, the compiled-kernel lookup);
    the calls after it launch the compiled kernel it returned directly (`CompiledKernel[grid]`), the arguments
    already in signature order. That is valid while the four varying tensors keep the specialization the first
    call saw: Triton specializes a pointer on 16-byte alignment, so all four must be 16-byte aligned then and at
    every direct call (a call that is not goes through JITFunction; the plan's other arguments never change)."""

    __slots__ = ("kernel", "grid", "before_out", "after_out", "kwargs", "out_shape", "out_dtype", "_direct",
                 "_constexprs")

    def __init__(self, kernel, grid, before_out: tuple, after_out: tuple, kwargs: dict, out_shape, out_dtype):
        self.kernel, self.grid, self.kwargs = kernel, grid, kwargs
        self.before_out, self.after_out = before_out, after_out
        self.out_shape, self.out_dtype = tuple(out_shape), out_dtype
        self._direct = None  # the compiled kernel's launcher once known; False: this plan never launches directly
        self._constexprs = ()

    def __call__(self, q, k_cache, v_cache, out=None):
        if out is None:
            out = q.new_empty(self.out_shape, dtype=self.out_dtype)
        if self.kernel is None:
            return out
        direct = self._direct
        if direct and not (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr() | out.data_ptr()) & 15:
            direct(q, k_cache, v_cache, *self.before_out, out, *self.after_out, *self._constexprs)
            return out
        compiled = self.kernel[self.grid](q, k_cache, v_cache, *self.before_out, out, *self.after_out, **self.kwargs)
        if direct is None:
            self._direct = self._direct_launcher(compiled, (q, k_cache, v_cache, out))
        return out

    def _direct_launcher(self, compiled, tensors):
        """compiled[grid] when the first call's kernel can be relaunched directly, else False (the interpreter, a
        wrapper without a plain signature, a constexpr with neither a value nor a default, an unaligned tensor)."""
        params = getattr(self.kernel, "params", None)
        if not isinstance(compiled, CompiledKernel) or params is None or any(t.data_ptr() & 15 for t in tensors):
            return False
        num_given = 4 + len(self.before_out) + len(self.after_out)
        constexprs = []
        for param in params[num_given:]:
            if param.name in self.kwargs:
                constexprs.append(self.kwargs[param.name])
            elif param.default is not inspect.Parameter.empty:
                constexprs.append(param.default)
            else:
                return False
        self._constexprs = tuple(constexprs)
        grid = tuple(self.grid) + (1,) * (3 - len(self.grid))
        return compiled[grid]


__all__ = ["HAS_TRITON", "PlannedLaunch", "cdiv", "next_pow2", "pdl_args", "pdl_enter", "pdl_supported",
           "require_triton", "tl", "triton"]

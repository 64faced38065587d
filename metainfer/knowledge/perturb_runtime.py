"""What "perturb a function's output" means, by the kind of value it returns (metainfer/knowledge/perturb.py
wraps a blueprint function with `perturbed` inside a throw-away copy of the tree; nothing here runs in the
engine).

  floating tensor           scaled by 1.01 (a 1% relative change), in place where it can be (fp8: x 1.13,
                            the smallest change its 3-bit mantissa shows); an MLX array likewise, out of place
  integer tensor (ids, slots, positions)   + 1;  bool tensor: negated
  int (counts, sizes, hashes)  + 1;  bool (decisions): flipped;  float: x 1.01;  str: its last character dropped
  list of tensors or of lists   each element perturbed; any other non-empty list (a decision, a
                            selection, an order): its last element dropped
  tuple (a record)          its tensors perturbed; a tuple without tensors: every element
  generator                 every item it yields perturbed (a checkpoint's (name, tensor) pairs); an async
                            generator's items likewise, and a coroutine's result once awaited (the server's)
  nn.Module                 every parameter perturbed in place
  dict                      every value perturbed
  dataclass                 every field perturbed (a batch, a step layout, a sampler output)
  an object of the engine's own classes, returned itself (a built runner, a started heartbeat): every
                            attribute perturbed by these rules, one level (objects inside it are left as they are)
  None                      the function's tensor, module and list arguments perturbed in place (what it
                            wrote into them)
  a check (annotated `-> None`) that raises: its decision flipped, the error swallowed (a rejection let
                            through; the bad-input tests that expect it must fail)
This module imports nothing of the engine, so a mutated engine module can import it while it loads.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types

import torch

_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def perturb_value(x, depth: int = 0):
    """`x` perturbed as the module docstring says (in place for tensors where it can; the result returned)."""
    if depth > 3:
        return x
    if isinstance(x, torch.Tensor):
        return _perturb_tensor(x)
    if type(x).__module__.startswith("mlx") and type(x).__name__ == "array":
        return _perturb_mlx(x)
    if isinstance(x, torch.nn.Module):
        for param in x.parameters():
            _perturb_tensor(param)
        return x
    if isinstance(x, bool):
        return not x
    if isinstance(x, int):
        return x + 1
    if isinstance(x, float):
        return x * 1.01
    if isinstance(x, str):
        return x[:-1]
    if isinstance(x, tuple):  # a record: its tensors perturbed (or, with none, every field)
        has_tensor = any(isinstance(i, torch.Tensor) for i in x)
        items = [perturb_value(i, depth + 1) if isinstance(i, torch.Tensor) or not has_tensor else i for i in x]
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
    if isinstance(x, list):
        if x and all(isinstance(i, torch.Tensor | list | tuple | dict) for i in x):
            return [perturb_value(i, depth + 1) for i in x]
        return x[:-1]
    if isinstance(x, types.GeneratorType):
        return (perturb_value(item, depth + 1) for item in x)
    if isinstance(x, dict):
        return {k: perturb_value(v, depth + 1) for k, v in x.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        for field in dataclasses.fields(x):
            object.__setattr__(x, field.name, perturb_value(getattr(x, field.name), depth + 1))
        return x
    if depth == 0 and type(x).__module__.startswith("metainfer.") and hasattr(x, "__dict__"):
        for name, value in list(vars(x).items()):
            object.__setattr__(x, name, perturb_value(value, depth + 1))
        return x
    return x


def _perturb_tensor(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if x.dtype == torch.bool:
            return x.logical_not_()
        if x.dtype in _INTS:
            return x.add_(1)
        if x.is_floating_point():
            try:
                return x.mul_(1.01)
            except RuntimeError:  # fp8: no in-place arithmetic, and 1% is below its 3-bit mantissa's step
                return x.copy_((x.float() * 1.13).to(x.dtype))
    return x


def _perturb_mlx(x):
    """An MLX array (the MLX backend's values), out of place: floating x 1.01, integer + 1, bool negated."""
    import mlx.core as mx

    if x.dtype == mx.bool_:
        return mx.logical_not(x)
    if mx.issubdtype(x.dtype, mx.floating):
        return (x * 1.01).astype(x.dtype)
    if mx.issubdtype(x.dtype, mx.integer):
        return x + 1
    return x


def _perturb_arguments(args, kwargs) -> None:
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, torch.Tensor | torch.nn.Module):
            perturb_value(arg)
        elif isinstance(arg, list) and arg and not all(isinstance(i, torch.Tensor) for i in arg):
            del arg[-1]


def _returns_none(fn) -> bool:
    """Annotated `-> None` (a check that raises or returns nothing, or a store): its raise is its output."""
    return getattr(fn, "__annotations__", {}).get("return", "") in (None, "None")


def perturbed(fn):
    """`fn` with its output perturbed (a function that returns None: its arguments, what it wrote into)."""

    check = _returns_none(fn)

    def result(out, args, kwargs):
        if out is None:
            _perturb_arguments(args, kwargs)
            return out
        return perturb_value(out)

    if inspect.isasyncgenfunction(fn):  # an async generator (a stream): every item it yields perturbed
        @functools.wraps(fn)
        async def items(*args, **kwargs):
            async for item in fn(*args, **kwargs):
                yield perturb_value(item)

        return items

    if inspect.iscoroutinefunction(fn):  # a coroutine (an endpoint's step): what it returns once awaited
        @functools.wraps(fn)
        async def awaited(*args, **kwargs):
            try:
                out = await fn(*args, **kwargs)
            except Exception:
                if not check:
                    raise
                return None
            return result(out, args, kwargs)

        return awaited

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            out = fn(*args, **kwargs)
        except Exception:
            if not check:
                raise
            return None  # the check's decision flipped: what it rejects goes through
        return result(out, args, kwargs)

    return wrapped


def perturb_attribute(owner, name: str) -> None:
    """Replace owner.name (a method, staticmethod, classmethod or property of a class) by its perturbed form."""
    import inspect

    raw = inspect.getattr_static(owner, name)
    if isinstance(raw, staticmethod):
        setattr(owner, name, staticmethod(perturbed(raw.__func__)))
    elif isinstance(raw, classmethod):
        setattr(owner, name, classmethod(perturbed(raw.__func__)))
    elif isinstance(raw, property):
        setattr(owner, name, property(perturbed(raw.fget), raw.fset, raw.fdel))
    elif isinstance(raw, functools.cached_property):
        setattr(owner, name, functools.cached_property(perturbed(raw.func)))
    else:
        setattr(owner, name, perturbed(raw))

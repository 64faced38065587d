"""The quick gates' sensitivity: perturbing the output of any blueprint function on the CPU path (the kernel
references, the torch path of every op) must make `metainfer gate --quick`'s tests fail.

Each perturbation is a mutation for the failure-mode harness (metainfer/knowledge/mutants.py): the
function's `def` gets a decorator that scales its floating-point outputs by 1.01 and adds 1 to its integer
outputs (ids, positions), in place (a function that returns nothing has its tensor arguments changed
instead: its output is what it wrote into them). The tests are the union of every phase's quick selection;
`-x` stops at the first failure, so a caught perturbation costs seconds.
"""

from __future__ import annotations

import importlib
import inspect
import os

from metainfer.knowledge.blueprint import load_blueprint

DECORATOR = '''def _perturbed_output(fn):
    import functools

    import torch as _torch

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        items = out if isinstance(out, tuple) else (out,) if out is not None else args
        for item in items:
            if isinstance(item, _torch.Tensor) and item.is_floating_point():
                item.mul_(1.01)
            elif isinstance(item, _torch.Tensor) and item.dtype in (_torch.int32, _torch.int64):
                item.add_(1)
        return out
    return wrapped


@_perturbed_output
'''


def cpu_path_functions(blueprint: dict | None = None) -> list[str]:
    """The kernel_contracts nodes' references that run on the CPU: module-level functions of
    metainfer.kernels whose name ends in _ref, plus the CPU GEMM and the cos/sin table."""
    blueprint = blueprint or load_blueprint()
    refs = []
    for node in blueprint["nodes"]:
        if node["category"] != "kernel_contracts":
            continue
        for ref in node["ref_code"]:
            module, _, name = ref.partition(":")
            if module.startswith("metainfer.kernels.") and "." not in name and (
                    name.endswith("_ref") or name in ("linear_ref", "build_cos_sin_cache")):
                refs.append(ref)
    return list(dict.fromkeys(refs))


def quick_tests(blueprint: dict | None = None) -> list[str]:
    blueprint = blueprint or load_blueprint()
    return list(dict.fromkeys(t for phase in blueprint["phases"] for t in phase["quick"]))


def perturbation_modes(blueprint: dict | None = None, root: str | None = None) -> list[dict]:
    """One harness mode per CPU-path function: its `def` line decorated with _perturbed_output."""
    blueprint = blueprint or load_blueprint()
    tests = quick_tests(blueprint)
    modes = []
    for ref in cpu_path_functions(blueprint):
        module, _, name = ref.partition(":")
        path = inspect.getsourcefile(importlib.import_module(module))
        rel = os.path.relpath(path, root) if root else path
        modes.append({"id": f"perturb.{name}", "title": f"{ref} output x 1.01", "tests": tests,
                      "symptom": "the quick gates must fail", "cause": f"{ref}'s output scaled by 1.01",
                      "mutation": {"file": rel, "find": f"\ndef {name}(", "replace": f"\n{DECORATOR}def {name}("}})
    return modes

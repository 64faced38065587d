"""Top-level pytest setup.

TRITON_INTERPRET must be set before anything imports triton (kernels are decorated as
interpreted or compiled at import time), so this runs first. Set METAINFER_TEST_GPU=1 to run the
Triton kernel tests compiled on a CUDA device instead of in the CPU interpreter.
"""

import os

if os.environ.get("METAINFER_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one torch thread per xdist worker: the workers already use every core, and two OpenMP pools per
    # core slowed the fast tier (3m51 wall for 4m24 of CPU on 2 cores, against 2m55 with this)
    import torch

    torch.set_num_threads(1)


def _fix_triton_interpreter_scalar_index() -> None:
    """Interpreter scalars are 1-element numpy arrays; triton 3.6 turns them into Python ints with
    int(array), which numpy >= 2.3 rejects, so `for i in range(start, end)` with runtime bounds
    fails. Re-install __index__ via .item() (test-only; the GPU compiler is unaffected)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_metainfer_fixed", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._metainfer_fixed = True
    interpreter._patch_lang_tensor = patch_lang_tensor


_fix_triton_interpreter_scalar_index()

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


def _fix_triton_interpreter_fp8_casts() -> None:
    """The interpreter's float <-> float8e4nv conversions are not the GPU's: fp32 -> e4m3 drops the carry at a
    binade edge (31.5 -> 16), rounds ties away from even and truncates subnormals, and 0x7f (e4m3fn NaN) widens to
    480. sm_90 converts with round-to-nearest-even, saturating to +-448 (`cvt.rn.satfinite`), and widens NaN to NaN.
    Route every conversion to or from e4m3 through torch's (test-only), so CPU runs of the fp8 kernels see the
    GPU's values: the fp8 tensor-core decode's two-term splits and the stale-NaN tests depend on them."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import numpy as np
        import torch
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._convert_float
    if getattr(original, "_metainfer_fixed", False):
        return
    floats = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}
    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}

    def convert_float(data, input_dtype, output_dtype, rounding_mode):
        e4m3 = tl.float8e4nv
        if input_dtype in floats and output_dtype == e4m3:
            x = torch.from_numpy(np.ascontiguousarray(data)).view(floats[input_dtype]).float()
            return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        if input_dtype == e4m3 and output_dtype in floats:
            wide = floats[output_dtype]
            x = torch.from_numpy(np.ascontiguousarray(data)).view(torch.uint8).view(torch.float8_e4m3fn)
            return x.to(wide).view(ints[wide]).numpy()
        return original(data, input_dtype, output_dtype, rounding_mode)

    convert_float._metainfer_fixed = True
    interpreter._convert_float = convert_float


_fix_triton_interpreter_fp8_casts()

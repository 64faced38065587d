"""Where and in which dtypes the Triton kernel tests run (shared by the kernel test files).

CPU (default): the Triton interpreter, fp32 and fp16 (it mishandles bf16). METAINFER_TEST_GPU=1:
compiled on CUDA, bf16 too. References are checked in every dtype on the CPU.
"""

import os

import torch

ON_GPU = os.environ.get("METAINFER_TEST_GPU") == "1"
DEVICE = "cuda" if ON_GPU else "cpu"
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
REF_DTYPES = [torch.float32, torch.float16, torch.bfloat16]

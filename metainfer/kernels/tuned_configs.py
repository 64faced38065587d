"""Per-device tuned launch tables, shipped as JSON under kernels/configs/ and read once at engine build.

One file per GPU, named after `torch.cuda.get_device_name()` with every run of non-alphanumerics
replaced by "_" ("NVIDIA H200" -> NVIDIA_H200.json). Sections (each optional, a mapping of shape key ->
launch config): `gemv` (the Triton GEMV under PDL, keys "NxK"), `gemv_no_pdl` (without PDL), `skinny`
(the tensor-core skinny GEMM, keys "NxK/mB"), `moe` (the fused MoE's grouped GEMMs, keys "E{E}_N{N}_H{H}" ->
{"<max tokens bucket>": config}, kernels/fused_moe.py). The tuning tools (tools/tune_gemv.py, tools/tune_skinny.py,
tools/tune_moe.py) write their winners in this format. A GPU without a file gets cuBLAS everywhere.
"""

from __future__ import annotations

import json
import os
import re

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
SECTIONS = ("gemv", "gemv_no_pdl", "skinny", "moe")


def config_path(device_name: str) -> str:
    return os.path.join(CONFIG_DIR, re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


def load_tuned_configs(device_name: str | None) -> dict[str, dict]:
    """{section: table} for this GPU (empty tables where it has no file or no section)."""
    path = config_path(device_name) if device_name else None
    if path is None or not os.path.exists(path):
        return {name: {} for name in SECTIONS}
    with open(path) as f:
        doc = json.load(f)
    return {name: dict(doc.get(name) or {}) for name in SECTIONS}

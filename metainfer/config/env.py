"""The one registry of environment overrides, read once when an engine is configured.

Each override maps onto an `EngineConfig` field (the kill switches that protect users: PDL off, the
skinny GEMM off, the torch sampler, cuBLAS instead of cuBLASLt, the custom all-reduce off; and the opt-in to a
max_model_len past the model's positions). The field is the interface; the variable
only lets a benchmark script or a user flip it without code. A value outside the accepted ones is a
ConfigError naming the variable, so a typo cannot silently measure the default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from metainfer.config.errors import ConfigError

# variable -> (EngineConfig field, {accepted value: field value})
ENV_OVERRIDES: dict[str, tuple[str, dict[str, bool]]] = {
    "METAINFER_DISABLE_PDL": ("enable_pdl", {"0": True, "1": False}),
    "METAINFER_SKINNY_GEMM": ("enable_skinny_gemm", {"0": False, "1": True}),
    "METAINFER_FUSED_SAMPLER": ("enable_fused_sampler", {"0": False, "1": True}),
    "METAINFER_CUBLASLT": ("enable_cublaslt", {"0": False, "1": True}),
    "METAINFER_ALLOW_LONG_MAX_MODEL_LEN": ("allow_long_max_model_len", {"0": False, "1": True}),
    # this one kept its older, lenient spelling (it predates the registry)
    "METAINFER_DISABLE_CUSTOM_ALL_REDUCE": ("enable_custom_all_reduce", {
        **dict.fromkeys(("0", "false", "no", "off"), True), **dict.fromkeys(("1", "true", "yes", "on"), False)}),
}


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, bool]:
    """{EngineConfig field: value} for every override variable that is set (and non-empty). A set variable
    wins over the field's keyword (it is how a benchmark flips a switch without code)."""
    environ = os.environ if environ is None else environ
    out = {}
    for name, (field_name, values) in ENV_OVERRIDES.items():
        raw = environ.get(name, "").strip().lower()
        if raw == "":
            continue
        if raw not in values:
            raise ConfigError(f"{name}={raw!r}: expected one of {', '.join(values)}")
        out[field_name] = values[raw]
    return out


# What torchrun (or srun / mpirun wrappers that mimic it) sets for each process it starts; read for
# distributed_executor_backend="external_launcher" (distributed/external_launcher.py), never an engine switch.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RESTART_COUNT")


def launcher_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """{variable: value} for each of LAUNCHER_VARIABLES that is set and non-empty."""
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in LAUNCHER_VARIABLES if environ.get(name, "").strip()}

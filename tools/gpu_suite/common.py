"""What every section shares: the repository root, the model folder, engine construction and release.

A section is `fn(args, results) -> dict`: `args` the CLI namespace, `results` what the sections run
before it returned (a tuning sweep's winners feed the A/B that follows it).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def out_dir() -> str:
    """$OUT on the device machine (what comes back), else ./gpu_out; created here, so a section may write its
    files before the results are saved."""
    folder = os.environ.get("OUT", "gpu_out")
    os.makedirs(folder, exist_ok=True)
    return folder


def save(results: dict) -> None:
    """$OUT/gpu_results.json: after every section, and within a long section after each of its parts (a call cut
    off at its limit keeps what it measured)."""
    path = os.path.join(out_dir(), "gpu_results.json")
    with open(path + ".tmp", "w") as f:  # replaced whole: a call killed mid-write keeps the last complete file
        json.dump(results, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def ensure_packages(packages: dict[str, str]) -> list[str]:
    """Install from `.gpu_assets/wheels` (built by scripts/gpu_assets.sh; the device has no network) the
    {module: pip name} the machine lacks; returns the pip names installed."""
    missing = [name for module, name in packages.items() if importlib.util.find_spec(module) is None]
    if missing:
        wheels = os.path.join(ROOT, ".gpu_assets", "wheels")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheels,
                        *missing], check=True)
    return missing


def model_dir(args) -> str:
    """A folder with the real config.json and the Qwen3 tokenizer files (the engines load dummy weights)."""
    folder = os.path.join(tempfile.gettempdir(), "metainfer-model")
    os.makedirs(folder, exist_ok=True)
    shutil.copy(args.config, os.path.join(folder, "config.json"))
    copy_tokenizer(args.tokenizer_dir, folder)
    return folder


def copy_tokenizer(source: str | None, folder: str) -> None:
    for name in TOKENIZER_FILES:
        if source and os.path.exists(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), os.path.join(folder, name))


def bench_llm(args, **kwargs):
    """The suite's bf16 dummy-weight engine at the real config (max_model_len 4,096); `kwargs` are LLM
    keywords (kill switches included: enable_pdl, enable_skinny_gemm, enable_fused_sampler)."""
    from metainfer import LLM

    return LLM(model_dir(args), **{"load_format": "dummy", "dtype": "bfloat16", "max_model_len": 4096, **kwargs})


def on_engine(args, measure, **kwargs):
    """measure(llm) on a fresh suite engine (`bench_llm` keywords), released afterwards."""
    llm = bench_llm(args, **kwargs)
    try:
        return measure(llm)
    finally:
        del llm
        release()


def variant(args, measure, **kwargs) -> dict:
    """`on_engine` for an A/B variant: its exception becomes an error entry, so the figures measured
    before it are kept."""
    try:
        return on_engine(args, measure, **kwargs)
    except Exception as exc:
        traceback.print_exc()
        return error_of(exc)


def release() -> None:
    """Free what a dropped engine held: the next engine's memory profile must not count it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def error_of(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def show(name: str, value) -> None:
    print(name, json.dumps(value, indent=1, default=str), flush=True)

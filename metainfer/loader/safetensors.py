"""Safetensors source: one file or an index of shards, memory-mapped, one tensor at a time."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from metainfer.config import ConfigError


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, name) for name in files]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ConfigError(f"model folder {folder!r} has no *.safetensors files")
    return files


def iterate_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

"""Joining a tensor-parallel group whose processes an external launcher started (torchrun: one process a rank).

torchrun gives every process RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and
its agent on node 0 hosts a TCPStore at MASTER_ADDR:MASTER_PORT (without an agent, rank 0 hosts it). Joining
(`join_launched_group`) takes five steps, each bounded by `EngineConfig.distributed_timeout_s`:

1. read the variables (config/env.py: launcher_env) and check them: WORLD_SIZE must equal tensor_parallel_size;
   on CUDA this rank's device is cuda:LOCAL_RANK, which must exist (cuda:0 where the process sees one GPU);
2. rendezvous through torch.distributed's env:// handler (the agent's store, or rank 0's);
3. a join barrier: each rank announces itself in the store; a rank still missing at the deadline makes every
   rank that came fail with an error naming the missing ones;
4. the configuration agreement: each rank publishes its fingerprint (the engine options after `finalize`, the
   model spec, each weight file's name, size and `weights_digest`; not paths, which may differ between nodes) and
   every rank compares each one with rank 0's, so all of them refuse a mismatch with the same message naming the
   field;
5. the process group (parallel_state.init_tp_group): gloo on the CPU, NCCL on this rank's GPU; the custom
   all-reduce only when every rank is on this node and sees every GPU (it maps its peers' GPU memory).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from metainfer.config import ConfigError, EngineConfig
from metainfer.config.env import launcher_env
from metainfer.distributed.parallel_state import init_tp_group

log = logging.getLogger("metainfer")

REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# engine options that name local things (paths, the device index): compared through what they point at instead
LOCAL_FIELDS = ("model", "device", "tokenizer", "spec", "model_dir", "gguf_file", "torch_device")


@dataclass(frozen=True)
class LauncherEnv:
    """This process's place in the launched group, as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    restart: int = 0  # torchrun's restart count: keys of an earlier attempt are not this one's

    @property
    def single_node(self) -> bool:
        """Every rank runs on this host (the custom all-reduce's peer-to-peer memory needs that)."""
        return self.local_world_size == self.world_size

    @property
    def key_prefix(self) -> str:
        return f"metainfer/{self.restart}"


def read_launcher_env(environ: Mapping[str, str] | None = None) -> LauncherEnv:
    """The launcher's variables, or a ConfigError naming what is missing or malformed."""
    values = launcher_env(environ)
    missing = [name for name in REQUIRED if name not in values]
    if missing:
        raise ConfigError("distributed_executor_backend='external_launcher' needs the variables torchrun sets for "
                          f"each process; missing: {', '.join(missing)} (start the script with `torchrun "
                          "--nproc-per-node N script.py`)")

    def integer(name: str, default: int) -> int:
        raw = values.get(name)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not an integer") from None

    rank, world = integer("RANK", 0), integer("WORLD_SIZE", 1)
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world}")
    port = integer("MASTER_PORT", 0)
    if not 0 < port < 65536:
        raise ConfigError(f"MASTER_PORT={port} is not a TCP port")
    return LauncherEnv(rank, world, integer("LOCAL_RANK", rank), integer("LOCAL_WORLD_SIZE", 0),
                       values["MASTER_ADDR"], port, integer("TORCHELASTIC_RESTART_COUNT", 0))


def launched_device(config: EngineConfig, env: LauncherEnv) -> torch.device:
    """cuda:LOCAL_RANK (made the current device) on CUDA, or cuda:0 where the launcher shows each process one GPU
    (CUDA_VISIBLE_DEVICES per task, as Slurm's --gpus-per-task=1 does); else the configured device."""
    device = config.torch_device
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    if count == 1:
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    if env.local_rank >= count:
        raise ConfigError(f"LOCAL_RANK={env.local_rank} needs GPU {env.local_rank}, but this node shows {count}; "
                          "start at most one process per GPU (torchrun --nproc-per-node <= GPUs)")
    torch.cuda.set_device(env.local_rank)
    return torch.device("cuda", env.local_rank)


def check_launch(config: EngineConfig, env: LauncherEnv) -> None:
    if env.world_size != config.tensor_parallel_size:
        raise ConfigError(f"tensor_parallel_size ({config.tensor_parallel_size}) must equal the launcher's "
                          f"WORLD_SIZE ({env.world_size}): every launched process is one tensor-parallel rank")
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process; the external "
                           "launcher backend creates its own (one engine per process)")


# -- the configuration fingerprint -------------------------------------------------------------------
DIGEST_SAMPLES = 64  # evenly spaced 4 KiB reads per weight file (a few ms; a full hash would read every byte)
SAMPLE_BYTES = 4096
HEADER_LIMIT = 1 << 20  # GGUF (or a malformed file): this many leading bytes stand for the header


def weights_digest(path: str) -> str:
    """sha256 (16 hex digits) of a weight file's header (safetensors: its whole JSON header: names, dtypes,
    shapes, offsets; GGUF: the first MiB) and DIGEST_SAMPLES reads of SAMPLE_BYTES spread over the file.

    Cheap on purpose (a rank reads ~256 KiB a file, not the checkpoint): another architecture or shape, another
    layout, or another checkpoint whose bytes differ at the sampled places is caught; two checkpoints that differ
    only between the samples (a few changed values) are not."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        head = f.read(8)
        header_len = HEADER_LIMIT
        if path.endswith(".safetensors") and len(head) == 8:
            header_len = min(int.from_bytes(head, "little"), size)
        h.update(head + f.read(header_len))
        for i in range(DIGEST_SAMPLES):
            f.seek(max(0, (size - SAMPLE_BYTES) * i // max(1, DIGEST_SAMPLES - 1)))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def weight_files(config: EngineConfig) -> list[tuple[str, int, str]]:
    """(file name, bytes, weights_digest) of the weights this rank would read: a mismatched checkpoint shows
    here."""
    if config.gguf_file is not None:
        path = config.gguf_file
        return [(os.path.basename(path), os.path.getsize(path), weights_digest(path))]
    folder = config.model_dir
    return sorted((name, os.path.getsize(os.path.join(folder, name)), weights_digest(os.path.join(folder, name)))
                  for name in os.listdir(folder) if name.endswith(".safetensors"))


def config_fingerprint(config: EngineConfig) -> dict[str, str]:
    """{field: repr(value)} of what must be equal on every rank (finalized options, model spec, weights)."""
    out = {f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config) if f.name not in LOCAL_FIELDS}
    out["device"] = config.torch_device.type
    spec = config.spec
    for f in dataclasses.fields(spec):
        if f.compare:
            out[f"model.{f.name}"] = repr(getattr(spec, f.name))
    out["model weights"] = repr(weight_files(config) if config.load_format != "dummy" else [])
    return out


def first_mismatch(fingerprints: list[dict[str, str]]) -> str | None:
    """The first field on which a rank differs from rank 0, as a message every rank words the same."""
    reference = fingerprints[0]
    for rank, other in enumerate(fingerprints[1:], start=1):
        for name in sorted(set(reference) | set(other)):
            mine, theirs = reference.get(name, "<unset>"), other.get(name, "<unset>")
            if mine != theirs:
                return (f"ranks disagree on {name}: {theirs} on rank {rank}, {mine} on rank 0; every rank must be "
                        "started with the same model and engine options")
    return None


# -- joining ------------------------------------------------------------------------------------------
def _join_barrier(store: dist.Store, env: LauncherEnv, timeout: float) -> None:
    prefix = f"{env.key_prefix}/joined"
    store.set(f"{prefix}/{env.rank}", "1")
    deadline = time.monotonic() + timeout
    while True:
        missing = [r for r in range(env.world_size) if not store.check([f"{prefix}/{r}"])]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"tensor-parallel rank(s) {missing} of {env.world_size} did not join within "
                               f"{timeout:.0f} s (rendezvous at {env.master_addr}:{env.master_port}); was every "
                               "node started, with the same --nnodes / --master-addr / --master-port?")
        time.sleep(0.1)


def _agree_on_config(store: dist.Store, env: LauncherEnv, config: EngineConfig) -> None:
    prefix = f"{env.key_prefix}/config"
    store.set(f"{prefix}/{env.rank}", json.dumps(config_fingerprint(config)))
    prints = [json.loads(store.get(f"{prefix}/{r}")) for r in range(env.world_size)]
    message = first_mismatch(prints)
    if message is not None:
        raise ConfigError(message)


def join_launched_group(config: EngineConfig, env: LauncherEnv) -> tuple[torch.device, dist.Store]:
    """Steps 2-5 of the module docstring for this process (step 1, `read_launcher_env` / `check_launch`, is the
    caller's). Returns this rank's device and the rendezvous store."""
    check_launch(config, env)
    device = launched_device(config, env)
    timeout = datetime.timedelta(seconds=config.distributed_timeout_s)
    store, _, _ = next(dist.rendezvous("env://", rank=env.rank, world_size=env.world_size, timeout=timeout))
    _join_barrier(store, env, config.distributed_timeout_s)
    _agree_on_config(store, env, config)
    group_store = dist.PrefixStore(f"{env.key_prefix}/pg", store)
    # the custom all-reduce maps its peers' GPU memory: only with every rank on this node, each GPU in sight
    peers_visible = device.type != "cuda" or torch.cuda.device_count() >= env.world_size
    init_tp_group(env.rank, env.world_size, group_store, device, timeout=timeout,
                  custom_all_reduce=config.enable_custom_all_reduce and env.single_node and peers_visible)
    log.info("external launcher: rank %d of %d joined (%s, %s)", env.rank, env.world_size, device,
             "one node" if env.single_node else f"{env.local_world_size or '?'} rank(s) on this node")
    return device, store

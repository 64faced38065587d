"""Custom all-reduce for small TP messages over peer-to-peer GPU memory (PyTorch symmetric memory).

Row-parallel layers all-reduce one activation per layer; at decode these are small
(hidden_size x batch x 2 bytes: 8 KiB for one Qwen3-8B token), so NCCL's fixed cost (ring
set-up, proxy, a few microseconds a call) dominates. Here every rank owns one symmetric
buffer that every peer has mapped (`torch.distributed._symmetric_memory`, CUDA backend: IPC
handles exchanged once through the group's store), and PyTorch's own kernels reduce straight
out of the peers' buffers:

  bytes <= one_shot_max_bytes   one-shot: copy the input into my buffer, barrier, every rank
                                reads all peers' buffers and sums (`one_shot_all_reduce_copy_out`,
                                one kernel). Latency-optimal: one barrier round, but each rank
                                reads (world - 1) x bytes over NVLink.
  bytes <= buffer_bytes         two-shot: each rank reduces 1/world of the message from all
                                peers (reduce-scatter), then gathers the reduced chunks
                                (`two_shot_all_reduce_out`). Bandwidth-optimal: 2 (world-1)/world
                                x bytes read a rank, one more barrier.
  larger / anything unsupported NCCL (`dist.all_reduce`): prefill-size messages, fp16, odd sizes,
                                non-contiguous or misaligned views.

Both kernels add the ranks' values in rank order (0, 1, ..., N-1), so every rank gets
bit-identical sums, which TP needs (ranks must not drift apart).

One-shot threshold (bytes, chosen per world size; a first guess from the reads each shape
costs, to be replaced by the numbers of `tools/bench_all_reduce.py` on the multi-GPU machine):
world 2: 1 MiB (one-shot reads what two-shot reads, with one barrier fewer), world 4: 512
KiB, world >= 8: 256 KiB (one-shot reads 7 x bytes: two-shot wins past a few hundred KiB).
The buffer is 8 MiB: a Qwen3-8B decode batch of 1,024 tokens in bf16; prefill goes to NCCL.

CUDA graphs: the buffer is allocated and exchanged once, before any capture; a call issues
device work only (a copy and one PyTorch kernel, or one fused kernel), no host sync, and
the choice between paths depends only on shape/dtype, so it is made at capture time.
The kernels' barriers are signal pads in the same symmetric allocation; they hold no state
between calls, so replays are safe. A call writes its result into `x` (in place, like
`dist.all_reduce`).

NVLink multicast (NVLS) stays off: TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NCCL_NVLS_ENABLE=0
are set (if unset) when this module is imported, i.e. before any process group or symmetric
allocation exists, and no multimem op is ever called.

Selection happens once, in `make_all_reduce` (called by `init_tp_group`): the custom path is
used when the device is CUDA, tp_size > 1, it is not disabled (METAINFER_DISABLE_CUSTOM_ALL_REDUCE=1
or `enabled=False`), symmetric memory and its ops exist in this torch, and every pair of the
ranks' GPUs has peer access. Every rank must choose the same path (a rank on NCCL and one on
the custom kernel would wait for each other forever), so the ranks agree (all-reduce MIN)
after the local checks, after allocating and after the exchange; any failure anywhere puts
every rank on NCCL. Known limit: the kernels' barriers have no timeout, so a peer that dies
mid-step leaves the others spinning on the GPU (NCCL's watchdog would abort after its
timeout); the flag turns the custom path off where that matters.
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

log = logging.getLogger("metainfer")

DEFAULT_BUFFER_BYTES = 8 << 20
# dtypes PyTorch's symmetric-memory all-reduce kernels are built for (fp16 is not).
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)
# two_shot_all_reduce_out is compiled for these world sizes only; others use the in-place op.
TWO_SHOT_OUT_WORLD_SIZES = (2, 4, 8)
_ONE_SHOT_OPS = ("one_shot_all_reduce_copy_out", "one_shot_all_reduce_out")
_TWO_SHOT_OPS = ("two_shot_all_reduce_out", "two_shot_all_reduce_")


def default_one_shot_max_bytes(world_size: int) -> int:
    if world_size <= 2:
        return 1 << 20
    if world_size <= 4:
        return 512 << 10
    return 256 << 10


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def nccl_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """torch.distributed's all-reduce over the TP group (NCCL on CUDA), in place."""
    dist.all_reduce(x)
    return x


def gloo_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """torch.distributed's all-reduce over the TP group (gloo on the CPU), in place."""
    dist.all_reduce(x)
    return x


def _symm_mem_op(name: str):
    """torch.ops.symm_mem.<name>.default, or None where this torch lacks it."""
    try:
        return getattr(torch.ops.symm_mem, name).default
    except (AttributeError, RuntimeError):
        return None


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


# -- the checks behind the choice (each returns None when fine, else why not) -----------------
def disable_nvlink_multicast() -> None:
    """NVLink multicast (NVLS) stays off for NCCL and symmetric memory: the machines here hang with it.
    Set (as defaults a user's environment overrides) when a CUDA TP group is created, not at import."""
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def symm_mem_unavailable_reason() -> str | None:
    if not dist.is_available():
        return "torch.distributed is not available"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError as exc:
        return f"torch.distributed._symmetric_memory cannot be imported ({exc})"
    if not any(_symm_mem_op(n) for n in _ONE_SHOT_OPS + _TWO_SHOT_OPS):
        return "this torch has no symmetric-memory all-reduce op"
    return None


def p2p_unavailable_reason(device_index: int, peer_indices: list[int]) -> str | None:
    """Peer access from this rank's GPU to every other rank's GPU. A peer on the same GPU (two
    ranks sharing one device, as in tests) needs no peer access."""
    for peer in peer_indices:
        if peer != device_index and not torch.cuda.can_device_access_peer(device_index, peer):
            return f"GPU {device_index} cannot access GPU {peer} peer-to-peer"
    return None


# -- the custom all-reduce ---------------------------------------------------------------------
class CustomAllReduce:
    """All-reduce (sum) over a symmetric buffer: one-shot, two-shot or NCCL by message size.

    Collective to build: every rank of `group` constructs it at the same point. With
    `connect=False` the buffer is allocated but not exchanged; call `connect()` (collective).
    Call it (or `all_reduce`) with the same shapes and dtypes on every rank, as TP does."""

    kind = "custom"

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES, one_shot_max_bytes: int | None = None,
                 connect: bool = True):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if buffer_bytes < 16 or buffer_bytes % 16:
            raise ValueError(f"buffer_bytes must be a positive multiple of 16, got {buffer_bytes}")
        self.device, self.group = device, group or dist.group.WORLD
        self.group_name = self.group.group_name
        self.world_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.buffer_bytes = buffer_bytes
        if one_shot_max_bytes is None:
            one_shot_max_bytes = default_one_shot_max_bytes(self.world_size)
        self.one_shot_max_bytes = min(one_shot_max_bytes, buffer_bytes)

        # The ops this torch has, chosen once; a missing one falls back to the next.
        self._one_shot_copy_out = _symm_mem_op("one_shot_all_reduce_copy_out")
        self._one_shot_out = _symm_mem_op("one_shot_all_reduce_out")
        self._two_shot_out = _symm_mem_op("two_shot_all_reduce_out")
        self._two_shot_inplace = _symm_mem_op("two_shot_all_reduce_")
        if self.world_size not in TWO_SHOT_OUT_WORLD_SIZES:
            self._two_shot_out = None
        has_one_shot = self._one_shot_copy_out is not None or self._one_shot_out is not None
        has_two_shot = self._two_shot_out is not None or self._two_shot_inplace is not None
        if not (has_one_shot or has_two_shot):
            raise RuntimeError("this torch has no symmetric-memory all-reduce op")
        if not has_one_shot:
            self.one_shot_max_bytes = 0
        elif not has_two_shot:
            self.one_shot_max_bytes = buffer_bytes

        self.handle = None
        self.buffer = self._allocate()
        if connect:
            self.connect()

    def _allocate(self) -> torch.Tensor:
        """This rank's symmetric buffer (not collective; `connect` exchanges it)."""
        import torch.distributed._symmetric_memory as symm_mem

        if self.device.type != "cuda":
            raise ValueError(f"the custom all-reduce needs a CUDA device, got {self.device}")
        return symm_mem.empty(self.buffer_bytes, dtype=torch.uint8, device=self.device)

    def connect(self) -> None:
        """Exchange the buffer with the peers (collective; once, before any CUDA graph capture)."""
        import torch.distributed._symmetric_memory as symm_mem

        if _torch_release() < (2, 11):
            # Before 2.11 a group had to be registered for symmetric memory (deprecated since).
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(self.group_name)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)

    def close(self) -> None:
        """Release the buffer (PyTorch waits for the device before unmapping it)."""
        self.handle = self.buffer = None

    # -- per call ----------------------------------------------------------------------------
    def should_use(self, x: torch.Tensor) -> bool:
        """Whether `x` goes through the symmetric buffer (else NCCL). Depends only on what is
        the same on every rank (dtype, shape, strides, view offset), never on addresses."""
        nbytes = x.numel() * x.element_size()
        return (self.buffer is not None and self.handle is not None
                and x.dtype in SUPPORTED_DTYPES and x.device == self.device and x.is_contiguous()
                and 0 < nbytes <= self.buffer_bytes and nbytes % 4 == 0
                and (x.storage_offset() * x.element_size()) % 16 == 0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks into `x` (in place); returns `x`."""
        if not self.should_use(x):
            dist.all_reduce(x, group=self.group)
            return x
        if x.numel() * x.element_size() <= self.one_shot_max_bytes:
            return self.one_shot(x)
        return self.two_shot(x)

    __call__ = all_reduce

    def _staging(self, x: torch.Tensor) -> torch.Tensor:
        """The first bytes of my symmetric buffer, viewed as `x` (offset 0: aligned for the ops)."""
        return self.buffer[:x.numel() * x.element_size()].view(x.dtype).view(x.shape)

    def one_shot(self, x: torch.Tensor) -> torch.Tensor:
        staging = self._staging(x)
        if self._one_shot_copy_out is not None:  # the kernel itself copies x into the buffer
            self._one_shot_copy_out(staging, x, "sum", self.group_name, x)
        else:
            staging.copy_(x)
            self._one_shot_out(staging, "sum", self.group_name, x)
        return x

    def two_shot(self, x: torch.Tensor) -> torch.Tensor:
        staging = self._staging(x)
        staging.copy_(x)
        if self._two_shot_out is not None:
            self._two_shot_out(staging, "sum", self.group_name, x)
        else:
            self._two_shot_inplace(staging, "sum", self.group_name)
            x.copy_(staging)
        return x

    def path_for(self, x: torch.Tensor) -> str:
        """Which path `all_reduce(x)` takes: "one-shot", "two-shot" or "nccl"."""
        if not self.should_use(x):
            return "nccl"
        return "one-shot" if x.numel() * x.element_size() <= self.one_shot_max_bytes else "two-shot"


# -- the choice, made once ---------------------------------------------------------------------
def _agree(ok: bool, device: torch.device) -> bool:
    """True only if every rank says ok (all-reduce MIN; CPU tensors on a gloo group)."""
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=on)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _rank_device_indices(device: torch.device) -> list[int]:
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor([device.index], dtype=torch.int64, device=on)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [int(t.item()) for t in everyone]


def all_reduce_kind(fn: Callable) -> str:
    """"custom", "nccl", "gloo" or "none" for a callable from `make_all_reduce`."""
    if isinstance(fn, CustomAllReduce):
        return "custom"
    return {nccl_all_reduce: "nccl", gloo_all_reduce: "gloo", identity: "none"}.get(fn, "other")


def make_all_reduce(device: torch.device, tp_size: int, enabled: bool = True,
                    buffer_bytes: int = DEFAULT_BUFFER_BYTES, one_shot_max_bytes: int | None = None,
                    custom_cls: type = CustomAllReduce) -> Callable[[torch.Tensor], torch.Tensor]:
    """The TP all-reduce for this process, chosen once (see the module docstring).

    Called by every rank right after it joins the TP group (torch.distributed's default
    group). `enabled` is EngineConfig.enable_custom_all_reduce (env override in config/env.py). The flag and
    the device type are the same on every rank, so the early returns need no agreement; past
    them, every rank takes part in the same collectives. `custom_cls` is a test seam."""
    device = torch.device(device)
    if tp_size == 1:
        return identity
    if device.type != "cuda":
        return gloo_all_reduce
    if not enabled:
        log.info("all-reduce: NCCL (custom all-reduce disabled)")
        return nccl_all_reduce
    if not dist.is_initialized():
        raise RuntimeError("make_all_reduce needs the TP process group (call init_tp_group first)")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    reason = symm_mem_unavailable_reason()
    peers = _rank_device_indices(device)
    reason = reason or p2p_unavailable_reason(device.index, peers)
    if not _agree(reason is None, device):
        log.info("all-reduce: NCCL (%s)", reason or "another rank cannot use the custom all-reduce")
        return nccl_all_reduce

    custom, error = None, None
    try:
        custom = custom_cls(device, buffer_bytes=buffer_bytes, one_shot_max_bytes=one_shot_max_bytes,
                            connect=False)
    except Exception as exc:  # e.g. no driver API / IPC handles in this container
        error = exc
    if _agree(custom is not None, device):
        try:
            custom.connect()
        except Exception as exc:
            error = exc
        if _agree(error is None, device):
            log.info("all-reduce: custom (symmetric memory, %d MiB buffer, one-shot up to %d KiB, "
                     "two-shot up to the buffer, NCCL beyond)", custom.buffer_bytes >> 20,
                     custom.one_shot_max_bytes >> 10)
            return custom
    if custom is not None:
        custom.close()
    log.warning("all-reduce: NCCL (custom all-reduce set-up failed: %s)",
                f"{type(error).__name__}: {error}" if error else "on another rank")
    return nccl_all_reduce

"""The custom all-reduce (symmetric memory) and the one-time choice between it, NCCL and gloo.

On the CPU: the selection and fallback logic (flag, device, P2P, symmetric memory missing,
set-up failing on one rank, message size, dtype, layout), and the custom class's data path in
two gloo processes with the symmetric-memory ops emulated by gloo collectives. On a GPU: the
real kernels with two processes sharing GPU 0 (if the driver lets them map each other's
memory), and with two GPUs the factory's choice through init_tp_group, eager and in a CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import metainfer.distributed.custom_all_reduce as car
import metainfer.distributed.parallel_state as ps
from metainfer.distributed.communication import reducer
from metainfer.distributed.custom_all_reduce import (
    CustomAllReduce,
    all_reduce_kind,
    gloo_all_reduce,
    identity,
    make_all_reduce,
    nccl_all_reduce,
)
from metainfer.distributed.launch import run_on_ranks
from metainfer.distributed.parallel_state import create_store, get_group_all_reduce, init_tp_group

no_gpu = not torch.cuda.is_available() or torch.cuda.device_count() < 1
needs_gpu = pytest.mark.skipif(no_gpu, reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(no_gpu or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def _pattern(n: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Small integers, so bf16 and fp32 sums of a few ranks are exact."""
    return (torch.arange(n, device=device) % 7 - 3).to(dtype)


# -- emulation of the symmetric-memory ops on the CPU (for the data-path tests) -----------------
def _summed(staging: torch.Tensor) -> torch.Tensor:
    total = staging.clone()
    dist.all_reduce(total)
    return total


def _fake_one_shot_copy_out(buf, local, op, group_name, out):
    assert op == "sum" and group_name == dist.group.WORLD.group_name
    buf.copy_(local)
    out.copy_(_summed(buf))
    return out


def _fake_one_shot_out(buf, op, group_name, out):
    out.copy_(_summed(buf))
    return out


def _fake_two_shot_out(buf, op, group_name, out):
    out.copy_(_summed(buf))
    return out


def _fake_two_shot_inplace(buf, op, group_name):
    buf.copy_(_summed(buf))
    return buf


FAKE_OPS = {"one_shot_all_reduce_copy_out": _fake_one_shot_copy_out, "one_shot_all_reduce_out": _fake_one_shot_out,
            "two_shot_all_reduce_out": _fake_two_shot_out, "two_shot_all_reduce_": _fake_two_shot_inplace}
CALLS: list[str] = []


def _fake_op_lookup(available):
    """A stand-in for car._symm_mem_op that finds only the `available` ops (emulated)."""
    def op(name):
        if name not in available:
            return None

        def call(*args):
            CALLS.append(name)
            return FAKE_OPS[name](*args)
        return call
    return op


def _install_fake_ops(available) -> None:  # in a rank process (it exits afterwards)
    car._symm_mem_op = _fake_op_lookup(available)


class CpuCustomAllReduce(CustomAllReduce):
    """The custom all-reduce over a plain CPU buffer (the ops are emulated; see above).
    `fail` = (rank, stage): raise on that rank in "allocate" or "connect"."""

    fail: tuple[int, str] | None = None
    closed = 0

    def __init__(self, device, **kwargs):
        super().__init__(torch.device("cpu"), **kwargs)

    def _allocate(self):
        if self.fail == (self.rank, "allocate"):
            raise RuntimeError("no IPC handles here")
        return torch.zeros(self.buffer_bytes, dtype=torch.uint8)

    def connect(self):
        if self.fail == (self.rank, "connect"):
            raise RuntimeError("rendezvous failed")
        self.handle = "connected"

    def close(self):
        type(self).closed += 1
        super().close()


# -- one process: the choice ------------------------------------------------------------------
def test_cpu_gives_gloo_and_one_rank_gives_identity():
    assert make_all_reduce(torch.device("cpu"), 2) is gloo_all_reduce
    assert make_all_reduce(torch.device("cpu"), 4, enabled=True) is gloo_all_reduce
    assert make_all_reduce(torch.device("cpu"), 1) is identity
    assert make_all_reduce(torch.device("cuda"), 1) is identity
    assert all_reduce_kind(gloo_all_reduce) == "gloo" and all_reduce_kind(identity) == "none"


def test_flag_off_gives_nccl():
    # No process group exists here: a disabled custom all-reduce must not touch torch.distributed.
    assert make_all_reduce(torch.device("cuda", 0), 2, enabled=False) is nccl_all_reduce
    assert all_reduce_kind(nccl_all_reduce) == "nccl"


def test_multicast_is_off_when_a_cuda_group_is_made(monkeypatch):
    """Set as defaults by init_tp_group on CUDA (not at import); a user's own value wins."""
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    car.disable_nvlink_multicast()
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert os.environ["NCCL_NVLS_ENABLE"] == "1"


def test_p2p_check(monkeypatch):
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    assert "cannot access GPU 1" in car.p2p_unavailable_reason(0, [0, 1])
    assert car.p2p_unavailable_reason(0, [0, 0]) is None  # two ranks sharing GPU 0
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (a, b) != (1, 3))
    assert car.p2p_unavailable_reason(0, [0, 1, 2, 3]) is None
    assert "GPU 1 cannot access GPU 3" in car.p2p_unavailable_reason(1, [0, 1, 2, 3])


def test_symm_mem_check(monkeypatch):
    if not torch.cuda.is_available():
        assert car.symm_mem_unavailable_reason() == "CUDA is not available"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(car, "_symm_mem_op", lambda name: None)
    assert "no symmetric-memory all-reduce op" in car.symm_mem_unavailable_reason()


def test_this_torch_has_the_ops():
    for name in car._ONE_SHOT_OPS + car._TWO_SHOT_OPS:
        assert car._symm_mem_op(name) is not None, name
    assert car._symm_mem_op("no_such_op") is None


def test_should_use_by_size_dtype_and_layout(monkeypatch):
    """The path for each tensor, decided from dtype/shape/layout only (the same on every rank)."""
    monkeypatch.setattr(car, "_symm_mem_op", _fake_op_lookup(FAKE_OPS))
    store = create_store(1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ar = CpuCustomAllReduce(None, buffer_bytes=4096, one_shot_max_bytes=1024)
        f32 = torch.zeros(1024)  # 4 KiB
        assert ar.path_for(f32[:256]) == "one-shot"       # 1 KiB: at the threshold
        assert ar.path_for(f32[:260]) == "two-shot"
        assert ar.path_for(f32) == "two-shot"             # exactly the buffer
        assert ar.path_for(torch.zeros(1025)) == "nccl"   # larger than the buffer
        assert ar.path_for(torch.zeros(64, dtype=torch.bfloat16)) == "one-shot"
        assert ar.path_for(torch.zeros(63, dtype=torch.bfloat16)) == "nccl"  # 126 bytes: not 4-aligned
        assert ar.path_for(torch.zeros(64, dtype=torch.float16)) == "nccl"   # no fp16 kernel
        assert ar.path_for(torch.zeros(64, dtype=torch.int32)) == "nccl"
        assert ar.path_for(torch.zeros(8, 8).t()) == "nccl"                   # not contiguous
        assert ar.path_for(f32[1:65]) == "nccl"                               # view 4 bytes in
        assert ar.path_for(f32[4:68]) == "one-shot"                           # view 16 bytes in
        assert ar.path_for(torch.zeros(0)) == "nccl"
        ar.close()
        assert ar.path_for(f32[:16]) == "nccl"                                # released
    finally:
        dist.destroy_process_group()


def test_join_failure_leaves_no_group(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("choice failed")
    monkeypatch.setattr(ps, "make_all_reduce", broken)
    with pytest.raises(RuntimeError, match="choice failed"):
        init_tp_group(0, 1, create_store(1), torch.device("cpu"))
    assert not dist.is_initialized() and get_group_all_reduce() is None


# -- two gloo processes -----------------------------------------------------------------------
SIZES = [1, 7, 256, 4096, 300_000]


def _group_sums(rank: int, world: int) -> dict:
    chosen = get_group_all_reduce()
    sums = {}
    for n in SIZES:
        for dtype in (torch.float32, torch.bfloat16):
            x = _pattern(n, dtype) * (rank + 1)
            out = reducer()(x)
            sums[(n, str(dtype))] = bool(torch.equal(out, _pattern(n, dtype) * sum(range(1, world + 1))))
    return {"kind": all_reduce_kind(chosen), "reducer_is_chosen": reducer() is chosen, "sums": sums}


@pytest.mark.tp
def test_factory_all_reduce_sums_on_gloo():
    for out in run_on_ranks(_group_sums, 2):
        assert out["kind"] == "gloo" and out["reducer_is_chosen"]
        assert all(out["sums"].values()), out["sums"]


def _custom_data_path(rank: int, world: int, variants: list) -> list:
    """For each set of available ops: path, ops called, result and in-place-ness per size."""
    outs = []
    for available in variants:
        _install_fake_ops(available)
        ar = CpuCustomAllReduce(None, buffer_bytes=8192, one_shot_max_bytes=1024)
        results = {}
        for n in DATA_SIZES:
            x = (_pattern(n) * (rank + 1)).view(8, 8) if n == 64 else _pattern(n) * (rank + 1)
            CALLS.clear()
            path = ar.path_for(x)
            out = ar(x)
            results[n] = {"path": path, "ops": list(CALLS), "in_place": out is x,
                          "ok": bool(torch.equal(out.flatten(), _pattern(n) * sum(range(1, world + 1))))}
        bf = _pattern(512, torch.bfloat16) * (rank + 1)
        bf16_ok = bool(torch.equal(ar(bf), _pattern(512, torch.bfloat16) * 3))
        outs.append({"results": results, "bf16": bf16_ok, "one_shot_max": ar.one_shot_max_bytes})
        ar.close()
    return outs


# fp32 elements: 16 B, 1 KiB (= the one-shot limit), 1,028 B, 8 KiB (= the buffer), past the buffer, 8x8
DATA_SIZES = (4, 256, 257, 2048, 2049, 64)
DATA_VARIANTS = [  # (ops this torch has, op expected for one-shot, for two-shot, path per size)
    (tuple(FAKE_OPS), "one_shot_all_reduce_copy_out", "two_shot_all_reduce_out",
     ["one-shot", "one-shot", "two-shot", "two-shot", "nccl", "one-shot"]),
    (("one_shot_all_reduce_out", "two_shot_all_reduce_"), "one_shot_all_reduce_out", "two_shot_all_reduce_",
     ["one-shot", "one-shot", "two-shot", "two-shot", "nccl", "one-shot"]),
    (("two_shot_all_reduce_out",), None, "two_shot_all_reduce_out",  # no one-shot op: all two-shot
     ["two-shot", "two-shot", "two-shot", "two-shot", "nccl", "two-shot"]),
    (("one_shot_all_reduce_out",), "one_shot_all_reduce_out", None,  # no two-shot op: all one-shot
     ["one-shot", "one-shot", "one-shot", "one-shot", "nccl", "one-shot"]),
]


@pytest.mark.tp
def test_custom_data_path_with_emulated_ops():
    """Staging views, in-place results, the path each size takes and the op each path calls
    (falling back when an op is missing from this torch), over two gloo ranks, ops emulated."""
    outs = run_on_ranks(_custom_data_path, 2, [v[0] for v in DATA_VARIANTS])
    for per_rank in outs:
        for (available, one_op, two_op, paths), out in zip(DATA_VARIANTS, per_rank):
            r = out["results"]
            assert all(r[n]["ok"] and r[n]["in_place"] for n in DATA_SIZES), (available, r)
            assert out["bf16"]
            assert [r[n]["path"] for n in DATA_SIZES] == paths, available
            for n, path in zip(DATA_SIZES, paths):
                assert r[n]["ops"] == {"one-shot": [one_op], "two-shot": [two_op], "nccl": []}[path]
        assert [o["one_shot_max"] for o in per_rank] == [1024, 1024, 0, 8192]


def _factory_choice(rank: int, world: int, scenarios: list) -> list:
    """make_all_reduce on a fake CUDA device (gloo underneath), with P2P and set-up patched."""
    _install_fake_ops(FAKE_OPS)
    car.symm_mem_unavailable_reason = lambda: None
    outs = []
    for p2p, fail in scenarios:
        torch.cuda.can_device_access_peer = lambda a, b, p2p=p2p: p2p[a]
        CpuCustomAllReduce.fail, CpuCustomAllReduce.closed = fail, 0
        chosen = make_all_reduce(torch.device("cuda", rank), world, enabled=True, custom_cls=CpuCustomAllReduce)
        x = _pattern(1000) * (rank + 1)
        ok = bool(torch.equal(chosen(x), _pattern(1000) * sum(range(1, world + 1))))
        outs.append({"kind": all_reduce_kind(chosen), "ok": ok, "closed": CpuCustomAllReduce.closed})
    return outs


FACTORY_SCENARIOS = [  # (P2P per rank, set-up failure (rank, stage)), kind chosen, buffers released per rank
    (((True, True), None), "custom", (0, 0)),              # every check passes
    (((False, False), None), "nccl", (0, 0)),              # no P2P anywhere
    (((True, False), None), "nccl", (0, 0)),               # only rank 1 lacks P2P: both fall back
    (((True, True), (1, "allocate")), "nccl", (1, 0)),     # rank 1 cannot allocate: rank 0 releases its buffer
    (((True, True), (0, "connect")), "nccl", (1, 1)),      # the exchange fails on rank 0 only
]


@pytest.mark.tp
def test_factory_ranks_agree():
    outs = run_on_ranks(_factory_choice, 2, [s[0] for s in FACTORY_SCENARIOS])
    for i, (scenario, kind, closed) in enumerate(FACTORY_SCENARIOS):
        assert [o[i]["kind"] for o in outs] == [kind, kind], scenario
        assert all(o[i]["ok"] for o in outs), scenario
        assert tuple(o[i]["closed"] for o in outs) == closed, scenario


# -- GPU ----------------------------------------------------------------------------------------
def _check_sizes(ar: CustomAllReduce, rank: int, world: int, device) -> dict:
    total = sum(range(1, world + 1))
    report = {}
    big = ar.buffer_bytes // 2 + 1024  # bf16 elements: past the buffer -> NCCL (or gloo)
    for n in (4, 1024, 4096 * 8, ar.one_shot_max_bytes // 2 + 64, 1 << 20, big):
        for dtype in (torch.bfloat16, torch.float32):
            x = _pattern(n, dtype, device) * (rank + 1)
            path = ar.path_for(x)
            out = ar(x)
            expected = _pattern(n, dtype, device) * total
            report[f"{n}/{dtype}/{path}"] = bool(torch.equal(out, expected))
    # In a CUDA graph: capture once, replay with new inputs.
    static = {p: torch.zeros(n, dtype=torch.bfloat16, device=device) for p, n in (("one", 2048), ("two", 1_000_000))}
    for s in static.values():
        ar(s)  # eager once before capture (NCCL/gloo need it; the custom path does not)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in static.values():
            ar(s)
    for step in (1, 2):
        for s in static.values():
            s.copy_(_pattern(s.numel(), torch.bfloat16, device) * (rank + step))
        graph.replay()
        torch.cuda.synchronize()
        for name, s in static.items():
            expected = _pattern(s.numel(), torch.bfloat16, device) * sum(r + step for r in range(world))
            report[f"graph/{name}/{step}"] = bool(torch.equal(s, expected))
    return report


def _shared_gpu(rank: int, world: int) -> dict:
    """Two processes on GPU 0, over a gloo group (NCCL refuses two ranks on one GPU)."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    try:
        ar = CustomAllReduce(device)
    except Exception as exc:
        return {"skip": f"{type(exc).__name__}: {exc}"}
    try:
        return {"report": _check_sizes(ar, rank, world, device)}
    finally:
        ar.close()


@pytest.mark.gpu
@pytest.mark.tp
@needs_gpu
def test_custom_all_reduce_two_processes_one_gpu():
    try:
        outs = run_on_ranks(_shared_gpu, 2, timeout=float(os.environ.get("METAINFER_SHARED_GPU_TIMEOUT", 180)))
    except TimeoutError as exc:
        pytest.skip(f"two processes on one GPU made no progress (time-sliced spin barriers?): {exc}")
    skips = [o["skip"] for o in outs if "skip" in o]
    if skips:
        pytest.skip(f"symmetric memory cannot be shared by two processes on one GPU here: {skips[0]}")
    for out in outs:
        assert all(out["report"].values()), out["report"]


def _two_gpus(rank: int, world: int) -> dict:
    device = torch.device("cuda", rank)
    chosen = get_group_all_reduce()
    kind = all_reduce_kind(chosen)
    if kind != "custom":
        return {"kind": kind, "p2p": torch.cuda.can_device_access_peer(rank, 1 - rank)}
    return {"kind": kind, "report": _check_sizes(chosen, rank, world, device)}


@pytest.mark.gpu
@pytest.mark.tp
@needs_two_gpus
def test_factory_on_two_gpus():
    outs = run_on_ranks(_two_gpus, 2, device="cuda", timeout=300)
    assert outs[0]["kind"] == outs[1]["kind"]
    if outs[0]["kind"] != "custom":
        assert outs[0]["kind"] == "nccl"
        assert not (outs[0]["p2p"] and outs[1]["p2p"]), "P2P works, yet the custom all-reduce was not chosen"
        pytest.skip("no P2P between GPU 0 and 1: NCCL chosen (correctly)")
    for out in outs:
        assert all(out["report"].values()), out["report"]

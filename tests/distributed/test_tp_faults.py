"""The checks catch the classic tensor-parallel bugs: each test injects one fault and asserts it
IS detected, by the per-rank shape contract or by TP output differing from TP=1.

A fault in a TP run must be present on every rank: rank 0 (this process) gets it through
pytest's monkeypatch, the worker processes through `TPDriver.worker_hooks` (importable
functions below that apply the same patch in each worker before its model is built).
"""

from __future__ import annotations

import pytest
import torch

from metainfer import LLM, SamplingParams
from metainfer.config import ModelSpec
from metainfer.distributed.communication import identity
from metainfer.distributed.parallel_state import tp_state
from metainfer.kernels import REF_OPS, qkv_prep
from metainfer.layers import linear
from metainfer.loader import load_weights
from metainfer.loader.safetensors import iterate_safetensors
from metainfer.models.dense import DenseForCausalLM
from metainfer.models.shape_contract import ShapeContractError, check_param_shapes, shape_mismatches
from metainfer.worker.tp import driver as tp_driver
from tests.helpers.engine_checks import generate_ids
from tests.helpers.tiny_models import build_tiny_model, make_prompts

VOCAB = 509
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


# -- the faults (each applied in rank 0 by monkeypatch and in workers by a hook) ------------------
def _no_all_reduce_reducer():
    return identity


def _rotary_interleaved(positions, q, k, cos_sin, head_dim):
    """GPT-J style rotary (rotate adjacent pairs) where the checkpoints want neox (halves); in
    place, like the reference it replaces inside the fused q/k-norm + rotary + KV-store op."""
    cs = cos_sin[positions.long()]
    half = cs.shape[-1] // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for x in (q, k):
        heads = x.view(x.shape[0], -1, head_dim)
        pairs = heads[..., :2 * half]
        even, odd = pairs[..., 0::2].clone(), pairs[..., 1::2].clone()
        pairs.copy_(torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2))
    return q, k


def _kv_head_zero(self):
    return 0


def hook_drop_all_reduce():
    linear.reducer = _no_all_reduce_reducer


def hook_interleaved_rotary():
    qkv_prep.rotary_neox_ref = _rotary_interleaved


def hook_kv_head_zero():
    linear.QKVParallelLinear.kv_head_for_rank = _kv_head_zero


FAULTS = {
    "missing all-reduce": (hook_drop_all_reduce, linear, "reducer", _no_all_reduce_reducer, 2),
    "interleaved rotary": (hook_interleaved_rotary, qkv_prep, "rotary_neox_ref", _rotary_interleaved, 2),
    # heads 4, KV heads 2, tp 4: ranks 2 and 3 must hold KV head 1, not head 0
    "KV head replication": (hook_kv_head_zero, linear.QKVParallelLinear, "kv_head_for_rank", _kv_head_zero, 4),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tp-faults"))
    build_tiny_model(folder, "qwen2", vocab_size=VOCAB)  # heads 4, KV heads 2, qkv bias
    prompts = make_prompts([5, 12, 30], vocab=VOCAB, seed=3)
    expected = generate_ids(LLM(folder, device="cpu", dtype="float32"), prompts, GREEDY)
    return folder, prompts, expected


def _tp_outputs(folder, prompts, tp):
    with LLM(folder, device="cpu", dtype="float32", tensor_parallel_size=tp) as llm:
        return generate_ids(llm, prompts, GREEDY)


@pytest.mark.tp
@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_changes_tp_output(model_dir, monkeypatch, fault):
    folder, prompts, expected = model_dir
    hook, owner, attr, patched, tp = FAULTS[fault]
    monkeypatch.setattr(owner, attr, patched)
    monkeypatch.setattr(tp_driver.TPDriver, "worker_hooks", (hook,))
    got = _tp_outputs(folder, prompts, tp)
    assert got != expected, f"{fault} went unnoticed: TP={tp} still equals TP=1"


# -- faults the shape contract catches without running anything ----------------------------------
def _build_rank(folder, rank, tp) -> tuple[DenseForCausalLM, ModelSpec]:
    spec = ModelSpec.from_file(f"{folder}/config.json")
    with tp_state(rank, tp):
        model = DenseForCausalLM(spec, REF_OPS)
    load_weights(model, iterate_safetensors(folder))
    return model, spec


def test_contract_holds_on_every_rank(model_dir):
    folder = model_dir[0]
    for tp in (1, 2, 4):
        for rank in range(tp):
            model, spec = _build_rank(folder, rank, tp)
            assert shape_mismatches(model, spec, tp) == []


def test_double_slicing_caught_by_contract(model_dir, monkeypatch):
    """A row-parallel loader that slices the checkpoint tensor and then slices its shard again."""

    def slice_twice(self, param, loaded, shard_id=None, name=""):
        if param.dim() == 1:
            param.data = loaded.clone()
            return
        cols = loaded.shape[1] // self.tp_size
        shard = loaded.narrow(1, self.tp_rank * cols, cols)
        part = cols // self.tp_size
        param.data = shard.narrow(1, self.tp_rank * part, part).clone()

    monkeypatch.setattr(linear.RowParallelLinear, "weight_loader", slice_twice)
    model, spec = _build_rank(model_dir[0], 1, 2)
    with pytest.raises(ShapeContractError, match=r"o_proj.weight: shape \(64, 16\), contract \(64, 32\)"):
        check_param_shapes(model, spec, 2, rank=1)


def _slice_twice(self, param, loaded, shard_id=None, name=""):
    """A row-parallel loader that slices the checkpoint tensor and then slices its shard again."""
    if param.dim() == 1:
        param.data = loaded.clone()
        return
    cols = loaded.shape[1] // self.tp_size
    part = cols // self.tp_size
    param.data = loaded.narrow(1, self.tp_rank * cols, cols).narrow(1, self.tp_rank * part, part).clone()


def hook_slice_twice():
    linear.RowParallelLinear.weight_loader = _slice_twice


@pytest.mark.tp
def test_double_slicing_stops_a_real_tp_engine(model_dir, monkeypatch):
    """Through LLM(tensor_parallel_size=2): every rank's runner checks the contract after loading."""
    monkeypatch.setattr(linear.RowParallelLinear, "weight_loader", _slice_twice)
    monkeypatch.setattr(tp_driver.TPDriver, "worker_hooks", (hook_slice_twice,))
    with pytest.raises(Exception, match=r"o_proj.weight: shape \(64, 16\), contract \(64, 32\)"):
        LLM(model_dir[0], device="cpu", dtype="float32", tensor_parallel_size=2)


def test_kv_heads_not_replicated_caught_by_contract(model_dir, monkeypatch):
    """KV heads split as kv_heads // tp (0 when kv_heads < tp) instead of replicated."""
    original = linear.QKVParallelLinear.__init__

    def floor_split(self, hidden_size, head_dim, num_heads, num_kv_heads, bias=False, dtype=torch.float32, **kw):
        original(self, hidden_size, head_dim, num_heads, num_kv_heads, bias, dtype, **kw)
        self.num_kv_heads = num_kv_heads // self.tp_size
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.weight = torch.nn.Parameter(torch.empty(out, hidden_size), requires_grad=False)

    monkeypatch.setattr(linear.QKVParallelLinear, "__init__", floor_split)
    spec = ModelSpec.from_file(f"{model_dir[0]}/config.json")
    with tp_state(3, 4):
        model = DenseForCausalLM(spec, REF_OPS)
    with pytest.raises(ShapeContractError, match=r"qkv_proj.weight: shape \(16, 64\), contract \(48, 64\)"):
        check_param_shapes(model, spec, 4)

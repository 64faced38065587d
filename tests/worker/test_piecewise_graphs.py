"""Piecewise graphs for prefill and mixed steps (worker/piecewise_graphs.py).

CPU: a stand-in replays each bucket's pieces eagerly through the same static buffers a captured bucket uses
(the attention inputs copied into the shared statics, the backend run on their first T rows, its output
copied into the shared output the next piece reads, padded rows beside the real ones); greedy output must
still equal HF for the dense, MLA and MoE families, with mixed steps, chunked prompts and preemption.
GPU (marked gpu): the real captured pieces against the eager prefill (`max_piecewise_graph_tokens=0`), fp32.
"""

from __future__ import annotations

import pytest
import torch

from metainfer import LLM, SamplingParams
from metainfer.worker.piecewise_graphs import PiecewiseGraphs, piecewise_buckets
from tests.helpers.engine_checks import assert_drained, generate_ids
from tests.helpers.tiny_models import assert_matches_hf, hf_reference

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
LENGTHS = [1, 5, 16, 17, 40, 70, 9, 23]


def test_buckets_cover_every_token_count_up_to_the_cap_with_bounded_padding():
    for cap in (1, 16, 100, 2048, 8192):
        buckets = piecewise_buckets(cap)
        assert buckets == sorted(set(buckets)) and buckets[-1] == cap
        for n in range(129, cap + 1, 7):
            bucket = next(b for b in buckets if b >= n)
            assert bucket - n <= (n // 4 if n <= 512 else n // 8) + 1, (n, bucket)
    assert piecewise_buckets(0) == []


def test_a_bucket_is_captured_over_prompts_no_longer_than_max_model_len():
    from metainfer.worker.piecewise_graphs import _capture_batch
    from metainfer.worker.warmup import BlockCycle

    for tokens, max_len in ((2048, 512), (96, 4096), (100, 33)):
        batch = _capture_batch(tokens, max_len, BlockCycle(64), 16)
        lens = [s.num_scheduled_tokens for s in batch.seqs]
        assert sum(lens) == tokens and max(lens) <= max_len and batch.is_prefill
        assert all(s.num_computed_tokens == 0 and len(s.block_table) * 16 >= n for s, n in zip(batch.seqs, lens))


class _EagerPieces(PiecewiseGraphs):
    """PiecewiseGraphs whose buckets replay the model eagerly with each attention call routed through the
    static buffers (as between captured pieces); buckets 16, 32, 64."""

    def _capture(self, runner, max_tokens, pool) -> None:
        self.buckets, self.replays = [16, 32, 64], []
        self._ids = torch.zeros(64, dtype=torch.long)
        for bucket in self.buckets:
            self.hidden[bucket] = torch.zeros(bucket, runner.spec.hidden_size, dtype=runner.dtype)
            self.pieces[bucket] = [lambda bucket=bucket: self._replay_eagerly(bucket)]
        self.max_tokens = 64
        self._bucket_of = [next(b for b in self.buckets if b >= n) for n in range(65)]

    def _replay_eagerly(self, bucket: int) -> None:
        self.replays.append((bucket, self.num_tokens))
        with self._split_attention(_ThroughStatics(self)):
            self.hidden[bucket].copy_(self.model(self._ids[:bucket]))


class _ThroughStatics:
    def __init__(self, owner):
        self.owner = owner

    def forward(self, layer, *args):
        owner, n = self.owner, self.owner.num_tokens
        statics, copies = owner.static_inputs(args)
        for static, source in copies:
            static.copy_(source)
            static[n:] = float("nan")  # padded rows: their values must not reach the real rows
        out = owner.real_backend.forward(layer, *[None if s is None else s[:n] for s in statics])
        static_out = owner.static_output(torch.Size((args[0].shape[0], *out.shape[1:])), out.dtype)
        static_out[:n].copy_(out)
        static_out[n:] = float("nan")
        return static_out


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v2", "qwen3_moe"])
def test_steps_through_the_static_buffers_give_hf_greedy(tmp_path, arch):
    model, prompts, expected = hf_reference(str(tmp_path), arch, LENGTHS, NEW_TOKENS)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=48,
              num_kv_blocks=12)  # chunked prompts, mixed steps and preemption
    runner = llm.llm_engine.runner
    runner.piecewise = pieces = _EagerPieces(runner, 64, capture=True)
    got = generate_ids(llm, prompts, GREEDY)
    assert_matches_hf(model, prompts, got, expected)
    real = [n for _, n in pieces.replays]
    assert any(bucket > n for bucket, n in pieces.replays), "no step ran with padded rows"
    assert max(real) <= 48 and len(real) >= len(LENGTHS), "prefill steps must take the piecewise path"
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_drained(llm)


def test_zero_turns_piecewise_graphs_off_and_a_negative_cap_is_refused(tmp_path):
    hf_reference(str(tmp_path), "qwen3", [4], 1)
    assert LLM(str(tmp_path), device="cpu", max_piecewise_graph_tokens=0).llm_engine.runner.piecewise.max_tokens == 0
    with pytest.raises(ValueError, match="max_piecewise_graph_tokens"):
        LLM(str(tmp_path), device="cpu", max_piecewise_graph_tokens=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v2", "qwen3_moe"])
def test_captured_pieces_equal_the_eager_prefill_on_cuda(tmp_path, arch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _, prompts, _ = hf_reference(str(tmp_path), arch, LENGTHS * 3, NEW_TOKENS)
    outs = {}
    for cap in (0, 2048):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=96,
                  max_piecewise_graph_tokens=cap)
        pieces = llm.llm_engine.runner.piecewise
        assert pieces.max_tokens == (96 if cap else 0)
        if cap:
            layers = len(llm.llm_engine.runner.attention_layers)
            assert all(len(p) == 2 * layers + 1 for p in pieces.pieces.values())
        outs[cap] = generate_ids(llm, prompts, GREEDY)
        assert_drained(llm)
        del llm
        torch.cuda.empty_cache()
    assert outs[2048] == outs[0]

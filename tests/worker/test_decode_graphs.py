"""The CUDA-graph decode path's input handling, run eagerly on the CPU (a stand-in replays the graph body
on the bucket's fixed views), under async scheduling and preemption: greedy output still equals HF, for a
dense model (Qwen3) and both MoE families (DeepSeek-V2: MLA's latent cache and the fused MoE with a shared
expert; Qwen3-MoE: the fused MoE beside a dense layer), the tiny checkpoints of tests/helpers/tiny_models."""

from __future__ import annotations

import pytest

from metainfer import LLM, SamplingParams
from metainfer.worker.cuda_graphs import DecodeGraphs
from tests.helpers.engine_checks import assert_drained, token_ids
from tests.helpers.tiny_models import assert_matches_hf, hf_reference

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3", "deepseek_v2", "qwen3_moe"])  # ~1 s a family past the first
def reference(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(f"{request.param}-graphs"))
    model, prompts, expected = hf_reference(folder, request.param, [1, 7, 16, 33, 64], NEW_TOKENS)
    return folder, prompts, expected, model


class _EagerGraphs(DecodeGraphs):
    """DecodeGraphs whose "captured graphs" run the graph body eagerly on the bucket's fixed views of the
    staging buffer at each replay, as a captured CUDA graph would (buckets 1, 2, 4, 8)."""

    def _capture(self) -> None:
        self.batch_sizes, self.replays = [1, 2, 4, 8], []
        for bs in self.batch_sizes:
            self.graphs[bs] = _Replay(self, bs, self._idle_views(bs))
        self.max_batch = 8
        self._bucket_of = [next(b for b in self.batch_sizes if b >= n) for n in range(9)]


class _Replay:
    def __init__(self, graphs, bs, views):
        self.graphs, self.bs, self.views = graphs, bs, views

    def replay(self):
        self.graphs.replays.append(self.bs)
        self.graphs._forward(self.bs, self.views)


def test_graph_inputs_read_in_place_give_hf_greedy(reference):
    """The CUDA-graph decode path's input handling, run eagerly on the CPU: the step packed at the
    bucket's fixed offsets (tables at full width), PENDING ids gathered by the graph body, hidden
    states read back from the output the graph body left. Greedy output must still equal HF."""
    folder, prompts, expected, model = reference
    llm = LLM(folder, device="cpu", dtype="float32", async_scheduling=True,
              num_kv_blocks=14, kv_reserve_ratio=0.0)  # preemption too: rows change buckets and tables
    assert llm.llm_engine.lookahead == 1
    runner = llm.llm_engine.runner
    runner.graphs = graphs = _EagerGraphs(runner, capture=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_matches_hf(model, prompts, token_ids(outs), expected)
    assert len(graphs.replays) >= NEW_TOKENS - 1, "every decode step must take the graph path"
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_drained(llm)


def test_decode_halves_give_hf_greedy(reference, monkeypatch):
    """Buckets of 4 and 8 rows run as two row groups (DecoderModel.forward_row_groups: each half's layers under its
    own metadata, issued alternately), eagerly on the CPU: greedy output still equals HF, the halves' rows land in
    their places of the output, under async scheduling and preemption. The dense family only: the others never
    split (halves_min_batch), and their forward_row_groups is refused here by that rule."""
    folder, prompts, expected, model = reference
    llm = LLM(folder, device="cpu", dtype="float32", async_scheduling=True, num_kv_blocks=14, kv_reserve_ratio=0.0,
              decode_halves_min_batch=4)
    runner = llm.llm_engine.runner
    calls = []
    forward_row_groups = runner.model.forward_row_groups
    monkeypatch.setattr(runner.model, "forward_row_groups",
                        lambda ids, groups: calls.append([g.rows for g in groups]) or forward_row_groups(ids, groups))
    runner.graphs = graphs = _EagerGraphs(runner, capture=True)
    if runner.spec.moe_layers or runner.spec.kv_lora_rank:
        assert graphs.halves_min_batch == 0
        return
    graphs.halves_min_batch = 4  # the CPU's one stream: the split rule's workspace concern does not arise
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_matches_hf(model, prompts, token_ids(outs), expected)
    assert [slice(0, 4), slice(4, 8)] in calls and [slice(0, 2), slice(2, 4)] in calls
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_drained(llm)


def test_halves_only_where_they_can_run_side_by_side():
    """halves_min_batch: the configured batch for one dense GPU rank whose halves attend in one pass; 0 under TP,
    with MoE layers, with MLA, or where a half's decode attention would split (one workspace for both streams)."""
    from types import SimpleNamespace

    from metainfer.attention import MLABackend, PagedAttentionBackend
    from metainfer.worker.cuda_graphs import halves_min_batch

    paged = PagedAttentionBackend.__new__(PagedAttentionBackend)
    paged.num_kv_heads = 8

    def runner(want=128, world_size=1, moe_layers=(), backend=paged):
        return SimpleNamespace(config=SimpleNamespace(decode_halves_min_batch=want), world_size=world_size,
                               spec=SimpleNamespace(moe_layers=moe_layers), attn_backend=backend,
                               max_blocks_per_seq=256, block_size=16)

    assert halves_min_batch(runner()) == 128  # 64 rows x 8 kv heads fill the GPU: one pass
    assert halves_min_batch(runner(want=0)) == 0
    assert halves_min_batch(runner(world_size=2)) == 0
    assert halves_min_batch(runner(moe_layers=(1,))) == 0
    assert halves_min_batch(runner(backend=MLABackend.__new__(MLABackend))) == 0
    assert halves_min_batch(runner(want=32)) == 0  # 16-row halves would split their attention

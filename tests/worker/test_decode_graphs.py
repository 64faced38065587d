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

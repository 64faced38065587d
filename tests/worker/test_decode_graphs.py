"""The CUDA-graph decode path's input handling, run eagerly on the CPU (a stand-in replays the graph body
on the bucket's fixed views), under async scheduling and preemption: greedy output still equals HF, for a
dense model (Qwen3) and both MoE families (DeepSeek-V2: MLA's latent cache and the fused MoE with a shared
expert; Qwen3-MoE: the fused MoE beside a dense layer), the tiny checkpoints of tests/helpers/tiny_models."""

from __future__ import annotations

import pytest
import torch

from metainfer import LLM, SamplingParams
from metainfer.config import ConfigError
from metainfer.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes
from tests.helpers.engine_checks import assert_drained, token_ids
from tests.helpers.kernel_devices import ON_GPU
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


def test_the_buckets_by_default_and_as_configured():
    """Written out by hand: 1, 2, 4, 8 and the multiples of 16 below max_num_seqs (at most 512), then that count;
    a configured list keeps its sizes below that count and adds it (every row count has a graph)."""
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(3) == [1, 2, 3] and graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(512) == [1, 2, 4, 8] + [16 * i for i in range(1, 33)]
    assert graph_batch_sizes(600) == graph_batch_sizes(512)
    assert graph_batch_sizes(256, (300, 1, 8, 100)) == [1, 8, 100, 256]
    assert graph_batch_sizes(64, (64, 32)) == [32, 64]


@pytest.mark.parametrize("sizes, message", [
    ([], "two or more"), ([8], "two or more"), ([8, 8], "two or more"), (8, "a list of batch sizes"),
    ([0, 8], "integers >= 1"), ([8, -1], "integers >= 1"), (["8", "16"], "integers >= 1"), ([True, 4], "integers >= 1"),
    ([8.0, 16], "integers >= 1")])
def test_cuda_graph_sizes_other_than_two_or_more_positive_integers_are_refused(tmp_path, sizes, message):
    """One value is refused too: vLLM reads it as a pattern up to N, this engine would capture it as given."""
    from tests.helpers.tiny_models import build_tiny_model

    build_tiny_model(str(tmp_path), "qwen3")
    with pytest.raises(ConfigError, match=f"cuda_graph_sizes must .*{message}"):
        LLM(str(tmp_path), device="cpu", dtype="float32", cuda_graph_sizes=sizes)


def test_cuda_graph_sizes_are_taken_from_any_iterable_of_integers():
    import numpy as np

    from metainfer.config.engine_config import _graph_sizes

    assert _graph_sizes(iter([16, 4, 16])) == (4, 16) and _graph_sizes(range(1, 4)) == (1, 2, 3)
    assert _graph_sizes(np.array([8, 2])) == (2, 8) and all(type(b) is int for b in _graph_sizes([np.int64(3), 1]))


@pytest.mark.gpu
@pytest.mark.skipif(not (ON_GPU and torch.cuda.is_available()), reason="needs METAINFER_TEST_GPU=1 and CUDA")
def test_configured_buckets_are_the_ones_captured_and_replayed_on_cuda(reference):
    """cuda_graph_sizes (1, 4) with 8 sequences: graphs at 1, 4 and 8 rows. Outputs of 5 lengths make the decode
    rows go 5 -> 4 -> 3 -> 2 -> 1, so the 8-, 4- and 1-row graphs all replay; greedy output equals HF's."""
    folder, prompts, expected, model = reference
    lengths = [4, 8, 12, 16, NEW_TOKENS]
    llm = LLM(folder, device="cuda", dtype="float32", max_num_seqs=8, cuda_graph_sizes=(4, 1))
    try:
        graphs = llm.llm_engine.runner.graphs
        assert graphs.batch_sizes == [1, 4, 8]
        replayed, replay = [], graphs.replay
        graphs.replay = lambda batch: replayed.append(graphs._bucket_of[len(batch.seqs)]) or replay(batch)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.close()
    assert {1, 4, 8} <= set(replayed)
    assert_matches_hf(model, prompts, token_ids(outs), [e[:n] for e, n in zip(expected, lengths)])

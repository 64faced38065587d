"""The CUDA-graph decode path's input handling, run eagerly on the CPU (a stand-in replays the graph body
on the bucket's fixed views), under async scheduling and preemption: greedy output still equals HF."""

from __future__ import annotations

import pytest

from metainfer import LLM, SamplingParams
from tests.helpers.engine_checks import assert_drained, token_ids
from tests.helpers.tiny_models import assert_matches_hf, hf_reference

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3-graphs"))
    model, prompts, expected = hf_reference(folder, "qwen3", [1, 7, 16, 33, 64], NEW_TOKENS)
    return folder, prompts, expected, model


class _ForwardAsReplay:
    """Stands in for a captured CUDA graph on the CPU: a replay runs the graph's body eagerly on the
    bucket's fixed views of the staging buffer, as the captured graph would."""

    def __init__(self, runner, bs):
        from metainfer.layers.attention import AttentionMetadata

        self.runner, self.bs = runner, bs
        self.views = runner._idle_step_inputs(bs)
        self.meta = AttentionMetadata(False, self.views["slots"], self.views["context_lens"], self.views["tables"])

    def replay(self):
        from metainfer.layers.attention import forward_context

        with forward_context(self.meta):
            self.runner._graph_forward(self.bs, self.views)


def test_graph_inputs_read_in_place_give_hf_greedy(reference):
    """The CUDA-graph decode path's input handling, run eagerly on the CPU: the step packed at the
    bucket's fixed offsets (tables at full width), PENDING ids gathered by the graph body, hidden
    states read back from the output the graph body left. Greedy output must still equal HF."""
    folder, prompts, expected, model = reference
    llm = LLM(folder, device="cpu", dtype="float32", async_scheduling=True,
              num_kv_blocks=14)  # preemption too: rows change buckets and tables
    assert llm.llm_engine.lookahead == 1
    runner = llm.llm_engine.runner
    runner.graph_batch_sizes = [1, 2, 4, 8]
    runner.graph_hidden = {}
    runner.graphs = {bs: _ForwardAsReplay(runner, bs) for bs in runner.graph_batch_sizes}
    runner.max_graph_batch = 8
    runner._bucket_of = [next(b for b in runner.graph_batch_sizes if b >= n) for n in range(9)]
    replays = []
    for graph in runner.graphs.values():
        graph.replay = (lambda g=graph: (replays.append(g.bs), _ForwardAsReplay.replay(g)))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_matches_hf(model, prompts, token_ids(outs), expected)
    assert len(replays) >= NEW_TOKENS - 1, "every decode step must take the graph path"
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_drained(llm)

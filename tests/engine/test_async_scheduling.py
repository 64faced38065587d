"""Async scheduling (step n+1 launched before step n is read back) on the CPU.

Greedy output must equal HF transformers under every scheduling regime, and every sampling
feature must give what the synchronous engine gives for the same requests (seeded sampling,
stops one step late, penalties, logprobs, aborts). Nothing PENDING may leak into outputs or
prefix-cache hashes, and every block comes back.
"""

from __future__ import annotations

import pytest
import torch

from metainfer import LLM, SamplingParams
from metainfer.engine.sequence import PENDING
from tests.helpers.tiny_models import assert_matches_hf, build_tiny_model, hf_greedy, make_prompts

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
LENGTHS = [1, 7, 16, 33, 64]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3-async"))
    model = build_tiny_model(folder, "qwen3")
    prompts = make_prompts(LENGTHS)
    return folder, prompts, hf_greedy(model, prompts, NEW_TOKENS), model


def _engine(folder, async_scheduling=True, **kw):
    llm = LLM(folder, device="cpu", dtype="float32", async_scheduling=async_scheduling, **kw)
    assert llm.llm_engine.lookahead == (1 if async_scheduling else 0)
    return llm


def _check_clean(llm):
    engine = llm.llm_engine
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    assert not engine.has_unfinished_requests()
    assert all(PENDING not in b.token_ids for b in bm.blocks), "a PENDING token was hashed"


@pytest.mark.parametrize("engine_kw", [{}, {"num_kv_blocks": 16}, {"max_num_batched_tokens": 24},
                                       {"block_size": 1}], ids=["plain", "preempt", "chunked", "block1"])
def test_greedy_matches_hf(reference, engine_kw):
    folder, prompts, expected, model = reference
    llm = _engine(folder, **engine_kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert_matches_hf(model, prompts, got, expected)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    if "num_kv_blocks" in engine_kw:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    _check_clean(llm)


def test_prefix_hits_and_arrivals_during_decode(reference):
    folder, prompts, expected, model = reference
    shared = make_prompts([48], seed=7)[0]
    cached = [shared + t for t in make_prompts([3, 9], seed=8)]
    cached_expected = hf_greedy(model, cached, NEW_TOKENS)
    llm = _engine(folder)
    engine, done, steps = llm.llm_engine, {}, 0
    queue = [(f"c{i}", p) for i, p in enumerate(cached)] + [(f"r{i}", p) for i, p in enumerate(prompts)]
    engine.add_request(*queue.pop(0), GREEDY)
    while engine.has_unfinished_requests() or queue:
        if queue and steps % 3 == 2:
            engine.add_request(*queue.pop(0), GREEDY)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
    assert engine.block_manager.prefix_hit_tokens >= 48
    assert_matches_hf(model, cached + prompts, [done[f"c{i}"] for i in range(2)] +
                      [done[f"r{i}"] for i in range(len(prompts))], cached_expected + expected)
    _check_clean(llm)


def _mixed_params(prompts_text_stop: str, stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=1.0, seed=11, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[prompts_text_stop]),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, min_tokens=12, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.7, seed=5, n=2, max_tokens=10, ignore_eos=True),
    ]


def _summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs]


def test_sampling_features_equal_sync(reference):
    folder, prompts, expected, _ = reference
    sync = _engine(folder, async_scheduling=False)
    stop_token = expected[2][5]  # greedy reaches it at the 6th token: a stop in mid-decode
    text = sync.get_tokenizer().decode(expected[3][:8])
    stop_string = text[len(text) // 2:][:2] or text[-1:]
    params = _mixed_params(stop_string, stop_token)
    reqs = [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(len(params))]
    want = sync.generate(reqs, params, use_tqdm=False)
    got = _engine(folder).generate(reqs, params, use_tqdm=False)
    assert _summary(got) == _summary(want)
    assert want[2].outputs[0].finish_reason == "stop" and len(want[2].outputs[0].token_ids) < 20
    assert want[3].outputs[0].finish_reason == "stop"


def test_penalties_read_back_before_scheduling(reference):
    folder, prompts, _, _ = reference
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5,
                             presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)]
    reqs = [{"prompt_token_ids": p} for p in prompts[:2]]
    want = _engine(folder, async_scheduling=False).generate(reqs, params, use_tqdm=False)
    llm = _engine(folder)
    got = llm.generate(reqs, params, use_tqdm=False)
    assert _summary(got) == _summary(want)
    _check_clean(llm)


def test_abort_and_stream_while_in_flight(reference):
    folder, prompts, expected, model = reference
    llm = _engine(folder)
    engine = llm.llm_engine
    engine.add_request("keep", {"prompt_token_ids": prompts[1]}, GREEDY, stream=True)
    engine.add_request("drop", {"prompt_token_ids": prompts[2]}, GREEDY, stream=True)
    seen, steps, final = [], 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert PENDING not in out.outputs[0].token_ids
            if out.request_id == "keep":
                seen.append(list(out.outputs[0].token_ids))
                final = out
        steps += 1
        if steps == 4:
            engine.abort_request("drop")
    assert all(a == b[:len(a)] for a, b in zip(seen, seen[1:])), "streamed token lists must only grow"
    assert final.finished
    assert_matches_hf(model, [prompts[1]], [final.outputs[0].token_ids], [expected[1]])
    _check_clean(llm)


def test_async_with_tensor_parallel_is_rejected(reference):
    folder = reference[0]
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(folder, device="cpu", dtype="float32", tensor_parallel_size=2, async_scheduling=True)


@pytest.mark.parametrize("tokens, seqs, width, sampling", [(8192, 13, 37, 13), (7, 3, 1, 2), (1, 1, 5, 1)])
def test_step_layout_fields_are_16_byte_aligned_and_disjoint(tokens, seqs, width, sampling):
    """Every field view starts on a 16-byte boundary (Triton specialises on pointer alignment, so
    varying alignment would recompile the prefill kernels mid-run) and the fields never overlap."""
    from metainfer.engine.model_runner import StepLayout

    layout = StepLayout(tokens, seqs, width, sampling)
    buf = torch.zeros(layout.size, dtype=torch.int32)
    views = layout.views(buf)
    assert set(views) == set(layout.sizes)
    for name, view in views.items():
        assert (view.data_ptr() - buf.data_ptr()) % 16 == 0, name
        assert view.numel() == layout.sizes[name], name
        view.fill_(1)
    assert int(buf.sum()) == sum(layout.sizes.values())  # disjoint: each element written once
    assert views["tables"].shape == (seqs, width)


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
    llm = _engine(folder, num_kv_blocks=14)  # preemption too: rows change buckets and tables
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
    assert_matches_hf(model, prompts, [o.outputs[0].token_ids for o in outs], expected)
    assert len(replays) >= NEW_TOKENS - 1, "every decode step must take the graph path"
    assert llm.llm_engine.scheduler.num_preemptions > 0
    _check_clean(llm)

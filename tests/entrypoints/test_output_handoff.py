"""The engine -> HTTP process hand-off (issue 23, item 4): every message waiting on the engine's output pipe is
applied in one reader callback (several steps cost the event loop one wake-up), and a consumer that fell behind
gets each request's latest cumulative output once, decoded once, not every intermediate one."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest

from metainfer.entrypoints.openai.engine_core import STATS_FIELDS
from metainfer.entrypoints.openai.engine_loop import EngineLoop, RequestGroup, RequestState
from metainfer.entrypoints.openai.metrics import ServerMetrics
from metainfer.sampling_params import SamplingParams

STATS = (0,) * len(STATS_FIELDS)


class _Tokenizer:
    """Token i decodes to the letter chr(97 + i): a reference anyone can check by hand."""

    def __init__(self):
        self.calls = 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        return "".join(chr(97 + i) for i in ids)


def _loop(tokenizer=None, handle=None) -> EngineLoop:
    return EngineLoop(handle, tokenizer or _Tokenizer(), ServerMetrics())


def _state(loop: EngineLoop, group: RequestGroup, rid: str) -> RequestState:
    state = RequestState(rid, None, [1, 2], SamplingParams(max_tokens=8), group.queue, 0.0)
    loop._requests[rid] = state
    return state


def _delta(ids, finished=False):
    return [(list(ids), None, None, "length" if finished else None, None, None)]


class _AliveHandle:
    """An engine process that is alive and never answers (nothing is started)."""

    alive = True


class _SlowTokenizer(_Tokenizer):
    """Every encode takes `delay` seconds and gives [1, 2, 3]."""

    def __init__(self, delay: float):
        super().__init__()
        self.delay = delay

    def encode(self, text, add_special_tokens=True):
        import time

        time.sleep(self.delay)
        return [1, 2, 3]


def _live_loop(tokenizer, **kw) -> EngineLoop:
    """An EngineLoop bound to the running event loop, its engine alive."""
    loop = EngineLoop(_AliveHandle(), tokenizer, ServerMetrics(), **kw)
    loop._loop = asyncio.get_running_loop()
    return loop


def test_a_consumer_behind_gets_each_requests_latest_output_once():
    async def run():
        loop = _loop()
        group = RequestGroup(loop, ["a", "b"])
        a, b = _state(loop, group, "a"), _state(loop, group, "b")
        for state, ids, finished in ((a, [0], False), (b, [0], False), (a, [1], False), (a, [2], False),
                                     (b, [1], True)):
            state.apply(finished, 0, _delta(ids, finished))
            group.queue.put_nowait(state)
        gen = group.outputs()
        first = [await gen.__anext__(), await gen.__anext__()]
        assert [(o.request_id, o.outputs[0].token_ids, o.outputs[0].text) for o in first] == [
            ("a", [0, 1, 2], "abc"), ("b", [0, 1], "ab")]
        assert group.unfinished == {"a"} and loop.num_queued == 0
        for ids, finished in (([3], False), ([4], True)):
            a.apply(finished, 0, _delta(ids, finished))
            group.queue.put_nowait(a)
        last = [o async for o in gen]
        assert [(o.request_id, o.outputs[0].text, o.finished) for o in last] == [("a", "abcde", True)]

    asyncio.run(run())


def test_an_error_after_outputs_is_raised_once_they_are_yielded():
    async def run():
        loop = _loop()
        group = RequestGroup(loop, ["a"])
        a = _state(loop, group, "a")
        a.apply(False, 0, _delta([0]))
        group.queue.put_nowait(a)
        group.queue.put_nowait(RuntimeError("step failed"))
        seen = []
        with pytest.raises(RuntimeError, match="step failed"):
            async for o in group.outputs():
                seen.append(len(o.outputs[0].token_ids))
        # the group still knows what may be running: close() aborts it (a failed request's siblings)
        assert seen == [1] and group.unfinished == {"a"}
        group.close()
        assert not loop._requests and loop._outbox.get_nowait() == ("abort", ["a"])

    asyncio.run(run())


def test_sends_while_a_flush_is_pending_schedule_no_second_wake_up():
    """Three steps' messages wait on the pipe: one reader callback applies them all, the request is queued three
    times but decoded once when the consumer reads it, and the metrics see every token."""
    class Handle:
        outputs, sender = mp.Pipe(duplex=False)

    async def run():
        tokenizer = _Tokenizer()
        loop = _loop(tokenizer, Handle)
        loop._loop = asyncio.get_running_loop()
        group = RequestGroup(loop, ["a"])
        _state(loop, group, "a")
        for ids, finished in (([0], False), ([1], False), ([2], True)):
            Handle.sender.send(("step", [("a", finished, 0, None, _delta(ids, finished), None)], STATS))
        loop._on_readable()
        assert group.queue.qsize() == 3 and not Handle.outputs.poll() and not loop._requests
        outs = [o async for o in group.outputs()]
        assert [(o.outputs[0].text, o.finished) for o in outs] == [("abc", True)]
        # the finished choice: its one full decode (after the prompt's last ids) and that context's own, no
        # per-token decodes
        assert tokenizer.calls == 2
        assert loop.metrics.itl.count == 2 and loop.metrics.ttft.count == 1

    asyncio.run(run())


class _RecordingTokenizer(_Tokenizer):
    """_Tokenizer that remembers what it decoded."""

    def __init__(self):
        super().__init__()
        self.decoded: list[list[int]] = []

    def decode(self, ids, skip_special_tokens=True):
        self.decoded.append(list(ids))
        return super().decode(ids, skip_special_tokens)


def _seqs(*per_choice):
    """One SeqDelta per choice: (new ids, finished)."""
    return [(list(ids), None, None, "length" if done else None, None, None) for ids, done in per_choice]


def test_a_finished_choice_of_a_running_request_is_decoded_once():
    """n=2: choice 0 finishes first; the consumer's later wake-ups (choice 1 still running) do not decode choice 0
    again (its tokens are 0-2, choice 1's are 10 and up)."""
    async def run():
        tokenizer = _RecordingTokenizer()
        loop = _loop(tokenizer)
        group = RequestGroup(loop, ["a"])
        a = RequestState("a", None, [1, 2], SamplingParams(max_tokens=8, n=2), group.queue, 0.0)
        loop._requests["a"] = a
        gen = group.outputs()
        a.apply(False, 0, _seqs(([0, 1, 2], True), ([10], False)))
        group.queue.put_nowait(a)
        assert [c.text for c in (await gen.__anext__()).outputs] == ["abc", "k"]
        for step in range(3):
            a.apply(step == 2, 0, _seqs(([], True), ([11 + step], step == 2)))
            group.queue.put_nowait(a)
            out = await gen.__anext__()
            assert out.outputs[0].text == "abc"
        assert out.outputs[1].text == "klmn" and out.finished
        assert sum(0 in ids for ids in tokenizer.decoded) == 1, tokenizer.decoded

    asyncio.run(run())


def test_a_non_streamed_request_is_decoded_once_at_the_end():
    async def run():
        tokenizer = _Tokenizer()
        loop = _loop(tokenizer)
        group = RequestGroup(loop, ["a"])
        a = _state(loop, group, "a")
        outs = []

        async def consume():
            async for out in group.outputs(partial=False):
                outs.append(out)

        consumer = asyncio.ensure_future(consume())
        for ids, finished in (([0], False), ([1], False), ([2], False), ([3], True)):
            a.apply(finished, 0, _delta(ids, finished))
            group.queue.put_nowait(a)
            for _ in range(3):
                await asyncio.sleep(0)  # the consumer wakes for every step
        await asyncio.wait_for(consumer, 5)
        assert [(o.outputs[0].text, o.finished) for o in outs] == [("abcd", True)]
        assert tokenizer.calls == 2 and loop.num_queued == 0  # the full decode after the context, the context's

    asyncio.run(run())


def test_streamed_chunks_carry_the_tokens_of_their_own_text():
    """n=2 with logprobs, streamed: after a chunk is yielded the consumer waits (the SSE send), and the next
    step's tokens arrive meanwhile. Every chunk's logprob tokens must be those of its text (one letter a token),
    not the choice's live list one step ahead."""
    from metainfer.entrypoints.openai.protocol import CompletionRequest, parse_request
    from metainfer.entrypoints.openai.serving_completion import OpenAIServingCompletion

    async def run():
        loop = _loop()
        serving = OpenAIServingCompletion(loop, ["m"], 5)
        req = parse_request(b'{"prompt": [1, 2], "n": 2, "logprobs": 1, "max_tokens": 3, "stream": true}',
                            CompletionRequest)
        params = SamplingParams(max_tokens=3, n=2, logprobs=1)
        group = RequestGroup(loop, ["a"])
        a = RequestState("a", None, [1, 2], params, group.queue, 0.0)
        loop._requests["a"] = a

        def step(token, finished):
            lp = [{token: -1.0}]
            seqs = [([token], lp, -1.0, "length" if finished else None, None, None)] * 2
            a.apply(finished, 0, seqs)
            group.queue.put_nowait(a)

        step(0, False)
        chunks = []
        tokens = iter([(1, False), (2, True)])
        async for chunk in serving._chunks(group, req, params, {}, {}):
            chunks.append(chunk["choices"][0])
            if len(chunks) % 2 == 1 and (nxt := next(tokens, None)) is not None:  # after choice 0's chunk
                step(*nxt)  # the next step arrives before choice 1's chunk is made
        for choice in chunks:
            assert "".join(choice["logprobs"]["tokens"]) == choice["text"], chunks
        assert "".join(c["text"] for c in chunks if c["index"] == 1) == "abc"

    asyncio.run(run())


def test_engine_process_stop_reads_the_output_an_engine_is_blocked_writing():
    """An engine blocked writing more output than the pipe holds never reads "stop" unless the server keeps
    reading: stop() drops that output until the engine ends, well within its timeout."""
    import threading
    import time

    from metainfer.entrypoints.openai.engine_core import EngineProcess

    req_r, req_w = mp.Pipe(duplex=False)
    out_r, out_w = mp.Pipe(duplex=False)
    got = []

    def engine():
        for _ in range(64):
            out_w.send(("step", [("x" * 4096,)], STATS))  # 256 KiB: blocks until read
        got.append(req_r.recv())
        out_w.close()

    thread = threading.Thread(target=engine, daemon=True)
    handle = EngineProcess(req_w, out_r, thread=thread)
    handle.start()
    time.sleep(0.2)
    start = time.monotonic()
    handle.stop(timeout=5)
    assert not thread.is_alive() and got == [("stop",)]
    assert time.monotonic() - start < 2
    handle.stop(timeout=5)  # idempotent


def test_a_sender_that_fails_marks_the_engine_gone_instead_of_hanging():
    """Anything the input pipe's send raises (here a TypeError) ends the sender thread: the engine is marked gone
    (/health 503) and the waiting submit answers 503, instead of hanging with /health 200."""
    from metainfer.entrypoints.openai.errors import OpenAIError

    class Requests:
        def send(self, msg):
            raise TypeError("cannot pickle this")

    class Handle:
        outputs, sender = mp.Pipe(duplex=False)
        requests = Requests()
        alive = True

        def start(self):
            pass

    async def run():
        loop = EngineLoop(Handle(), _Tokenizer(), ServerMetrics())
        loop.start(asyncio.get_running_loop())
        with pytest.raises(OpenAIError) as info:
            await asyncio.wait_for(loop.submit([("r", [1, 2], SamplingParams(max_tokens=2))]), 5)
        assert info.value.status == 503 and not loop.alive

    asyncio.run(run())


def test_a_prompt_longer_than_the_context_is_refused_before_it_is_sent():
    """A token-id prompt over max_model_len is a 400 naming `prompt` (the engine's own check and message),
    answered here: nothing is pickled and shipped to the engine."""
    from metainfer.entrypoints.openai.errors import OpenAIError

    async def run():
        loop = _live_loop(_Tokenizer(), max_model_len=100)
        with pytest.raises(OpenAIError) as info:
            await loop.submit([("r", [1] * 5000, SamplingParams(max_tokens=2))])
        assert info.value.status == 400 and info.value.param == "prompt"
        assert "longer than max_model_len (100)" in str(info.value.message)
        assert loop._outbox.empty() and not loop._requests and loop.num_queued == 0

    asyncio.run(run())


def test_a_slow_prompt_is_tokenized_off_the_event_loop():
    """Tokenizing a request (here an encode that takes 0.5 s, as a very long prompt or a slow chat template may)
    runs on EngineLoop's tokenizing thread with a copy of the tokenizer of its own (a Rust tokenizer is not safe to
    share across threads): meanwhile the event loop keeps running (every other stream's SSE events)."""
    import threading
    import time

    from metainfer.entrypoints.openai.errors import OpenAIError

    class SlowTokenizer(_Tokenizer):
        def encode(self, text, add_special_tokens=True):
            self.thread = threading.current_thread().name
            time.sleep(0.5)
            return [1] * 5000

    async def run():
        tokenizer = SlowTokenizer()
        loop = _live_loop(tokenizer, max_model_len=100)
        gaps, done = [], asyncio.Event()

        async def ticker():
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        with pytest.raises(OpenAIError) as info:  # 5,000 ids over max_model_len: refused after the slow encode
            await loop.submit([("r", "a long text", SamplingParams(max_tokens=2))])
        done.set()
        await task
        assert info.value.status == 400 and info.value.param == "prompt"
        assert len(gaps) >= 20 and max(gaps) < 0.25, f"the event loop stalled {max(gaps):.2f} s"
        lane = loop.lanes[0]
        assert lane.tokenizer is not tokenizer and not hasattr(tokenizer, "thread")
        assert lane.tokenizer.thread.startswith("metainfer-tokenize")

    asyncio.run(run())


def test_a_long_request_does_not_hold_up_short_ones():
    """A request body over LONG_REQUEST_BYTES tokenizes on the long lane, with a tokenizer of its own: a short
    request sent while it encodes (here 1 s) is added first; requests on one lane keep their arrival order."""
    from metainfer.entrypoints.openai.engine_loop import LONG_REQUEST_BYTES

    async def run():
        loop = _live_loop(_SlowTokenizer(0.0))
        loop.lanes[1].tokenizer.delay = 1.0
        sent = []
        loop._send = lambda msg: (sent.append(msg[2][0][0]), loop._adds.pop(msg[1]).set_result(None))
        long = asyncio.create_task(loop.submit([("long", "text", SamplingParams(max_tokens=2))],
                                               LONG_REQUEST_BYTES + 1))
        await asyncio.sleep(0.05)
        for rid in ("a", "b"):
            await asyncio.wait_for(loop.submit([(rid, "text", SamplingParams(max_tokens=2))], 100), 0.5)
        assert sent == ["a", "b"] and not long.done()
        await long
        assert sent == ["a", "b", "long"]
        assert len({id(lane.tokenizer) for lane in loop.lanes}) == 2

    asyncio.run(run())


def test_stop_shuts_both_tokenizing_lanes_down():
    """Nothing queued on either lane runs after stop(), and neither lane takes new work."""
    class Handle:
        alive = True

        def stop(self, timeout, send_stop=True):
            self.stopped = True

    loop = EngineLoop(Handle(), _Tokenizer(), ServerMetrics())
    loop.stop()
    assert loop.handle.stopped
    for lane in loop.lanes:
        with pytest.raises(RuntimeError, match="shutdown"):
            lane.executor.submit(print)


def test_the_queue_cap_holds_for_requests_that_were_tokenizing_together():
    """Two requests arrive together while tokenizing is slow (off the loop): the first one's slot is held while it
    tokenizes, so with a cap of 1 the second is refused (503 queue_full) instead of overfilling the queue."""
    from metainfer.entrypoints.openai.errors import OpenAIError

    async def run():
        loop = _live_loop(_SlowTokenizer(0.2), max_queued_requests=1)
        loop._send = lambda msg: None  # the engine never answers the add: the first request stays queued
        first = asyncio.create_task(loop.submit([("a", "text a", SamplingParams(max_tokens=2))]))
        second = asyncio.create_task(loop.submit([("b", "text b", SamplingParams(max_tokens=2))]))
        with pytest.raises(OpenAIError) as info:
            await second
        assert info.value.status == 503 and info.value.code == "queue_full"
        await asyncio.sleep(0.4)  # the first finished tokenizing and was added
        assert loop.num_queued == 1 and loop.num_admitting == 0 and list(loop._requests) == ["a"]
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first

    asyncio.run(run())


def test_drain_waits_for_a_request_still_tokenizing_and_takes_it():
    """A request accepted before the drain began and still tokenizing is waited for and taken (not refused with
    a 503 after the fact); one arriving after the drain began is refused."""
    from metainfer.entrypoints.openai.errors import OpenAIError

    async def run():
        loop = _live_loop(_SlowTokenizer(0.3))
        sent = []
        loop._send = sent.append  # the engine never answers: the taken request stays in flight
        accepted = asyncio.create_task(loop.submit([("a", "text", SamplingParams(max_tokens=2))]))
        await asyncio.sleep(0.05)  # it is tokenizing now
        assert loop.num_admitting == 1
        drain = asyncio.create_task(loop.drain(timeout=1.0))
        await asyncio.sleep(0)  # the drain has begun
        with pytest.raises(OpenAIError) as info:
            await loop.submit([("b", "text", SamplingParams(max_tokens=2))])
        assert info.value.status == 503 and info.value.code == "server_shutdown"
        await asyncio.sleep(0.4)  # the accepted one finished tokenizing while the drain waited
        assert not drain.done() and [m[0] for m in sent] == ["add"] and "a" in loop._requests
        accepted.cancel()
        await drain

    asyncio.run(run())


def test_a_submit_queued_behind_tokenizing_gets_a_503_when_the_engine_stops():
    """stop() cancels the tokenizing thread's queued work: a submit waiting there answers 503 (engine gone), not a
    bare CancelledError without a response body."""
    from metainfer.entrypoints.openai.errors import OpenAIError

    async def run():
        loop = _live_loop(_SlowTokenizer(0.3))
        first = asyncio.create_task(loop.submit([("a", "text", SamplingParams(max_tokens=2))]))
        queued = asyncio.create_task(loop.submit([("b", "text", SamplingParams(max_tokens=2))]))
        await asyncio.sleep(0.05)
        loop._dead = "the server stopped"  # what stop() records, then it shuts the tokenizing thread down
        loop.lanes[0].executor.shutdown(wait=False, cancel_futures=True)
        for task in (first, queued):
            with pytest.raises(OpenAIError) as info:
                await task
            assert info.value.status == 503

    asyncio.run(run())


def test_pieces_yield_every_output_with_new_tokens_even_without_new_text():
    """A step whose token ends inside a character adds no text: its piece still goes out (empty text, its token
    id), so a client sees every step (vLLM's rule); an output with no new token (nothing to say) is skipped."""
    from metainfer.engine.token_texts import TokenTexts
    from metainfer.entrypoints.openai.serving_base import OpenAIServing
    from metainfer.outputs import CompletionOutput, RequestOutput

    # cumulative outputs as the engine loop hands them over: texts "a", "a" (token 2 ends mid-character),
    # "a\u00e9" (token 3 completes it), the same again (no new token), then finished
    steps = [([1], "a", None), ([1, 2], "a", None), ([1, 2, 3], "a\u00e9", None), ([1, 2, 3], "a\u00e9", None),
             ([1, 2, 3, 4], "a\u00e9b", "length")]

    class Group:
        position = {"r": 0}

        async def outputs(self):
            for ids, text, finish in steps:
                out = CompletionOutput(0, text, list(ids), finish_reason=finish, logprobs=[{t: -1.0} for t in ids])
                yield RequestOutput("r", None, [9], [out], finish is not None)

    class Tokenizer:  # 9, 1, 4 decode whole; 2 (a lead byte) and 3 (a trailing byte) alone to U+FFFD
        def decode(self, ids):
            return "".join({9: "x", 1: "a", 2: "\ufffd", 3: "\ufffd", 4: "b"}[t] for t in ids)

    serving = OpenAIServing.__new__(OpenAIServing)
    serving.token_texts = TokenTexts(Tokenizer())

    async def collect():
        return [(text, ids, ctx, own) async for _, _, text, ids, _, ctx, own
                in serving.pieces(Group(), 1, SamplingParams(), False, {})]

    # each piece also names the ids before its new ones that their token texts read (back to the last one whose
    # decode alone is whole: the prompt's, then earlier outputs'), and how many of them are outputs
    assert asyncio.run(collect()) == [("a", [1], [9], 0), ("", [2], [1], 1), ("\u00e9", [3], [1, 2], 2),
                                      ("b", [4], [1, 2, 3], 3)]


def test_pieces_read_the_prompts_tail_only():
    """The context of a choice's token texts is read from the prompt's end, however long it is: no copy of the whole
    prompt per streamed chunk (a prompt that cannot be iterated whole still streams), into the prompt as far as the
    outputs before the new ones hold partial ids only (a prompt that ends with a lead byte: back to its last whole
    id)."""
    from metainfer.engine.token_texts import TokenTexts
    from metainfer.entrypoints.openai.serving_base import OpenAIServing
    from metainfer.outputs import CompletionOutput, RequestOutput

    class Prompt(list):
        def __iter__(self):
            raise AssertionError("the whole prompt was copied")

    prompt = Prompt([1] * 100_000 + [5, 2])
    steps = [([3], "\u00e9", None), ([3, 4], "\u00e9b", "length")]

    class Group:
        position = {"r": 0}

        async def outputs(self):
            for ids, text, finish in steps:
                out = CompletionOutput(0, text, list(ids), finish_reason=finish, logprobs=[{t: -1.0} for t in ids])
                yield RequestOutput("r", None, prompt, [out], finish is not None)

    class Tokenizer:
        def decode(self, ids):
            return "".join({1: "a", 5: "x", 2: "\ufffd", 3: "\ufffd", 4: "b"}[t] for t in ids)

    serving = OpenAIServing.__new__(OpenAIServing)
    serving.token_texts = TokenTexts(Tokenizer())

    async def collect():
        return [(ids, ctx, own) async for _, _, _, ids, _, ctx, own
                in serving.pieces(Group(), 1, SamplingParams(), False, {})]

    assert asyncio.run(collect()) == [([3], [5, 2], 0), ([4], [5, 2, 3], 1)]

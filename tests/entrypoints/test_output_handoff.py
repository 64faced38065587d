"""The engine thread -> event loop hand-off (issue 23, item 4): outputs queue in an outbox that one scheduled
callback drains (a step whose predecessor's outputs are undelivered adds no wake-up), and a consumer that fell
behind gets each request's latest cumulative output once, not every intermediate one."""

from __future__ import annotations

import asyncio
import threading

import pytest

from metainfer.entrypoints.openai.engine_loop import EngineLoop, RequestGroup
from metainfer.entrypoints.openai.metrics import ServerMetrics
from metainfer.outputs import CompletionOutput, RequestOutput


def _out(rid: str, n: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, None, [1, 2], [CompletionOutput(0, "x" * n, list(range(n)),
                                                               finish_reason="length" if finished else None)],
                         finished)


def test_a_consumer_behind_gets_each_requests_latest_output_once():
    async def run():
        loop = EngineLoop(engine=None, metrics=ServerMetrics())
        group = RequestGroup(loop, ["a", "b"])
        for item in (_out("a", 1), _out("b", 1), _out("a", 2), _out("a", 3), _out("b", 2, True)):
            group.queue.put_nowait(item)
        gen = group.outputs()
        first = [await gen.__anext__(), await gen.__anext__()]
        assert [(o.request_id, len(o.outputs[0].token_ids)) for o in first] == [("a", 3), ("b", 2)]
        assert group.unfinished == {"a"} and loop.num_queued == 0
        group.queue.put_nowait(_out("a", 4))
        group.queue.put_nowait(_out("a", 5, True))
        last = [o async for o in gen]
        assert [(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in last] == [("a", 5, True)]

    asyncio.run(run())


def test_an_error_after_outputs_is_raised_once_they_are_yielded():
    async def run():
        group = RequestGroup(EngineLoop(engine=None, metrics=ServerMetrics()), ["a"])
        group.queue.put_nowait(_out("a", 1))
        group.queue.put_nowait(RuntimeError("step failed"))
        group.queue.put_nowait(_out("a", 2))
        seen = []
        with pytest.raises(RuntimeError, match="step failed"):
            async for o in group.outputs():
                seen.append(len(o.outputs[0].token_ids))
        assert seen == [1] and not group.unfinished

    asyncio.run(run())


def test_sends_while_a_flush_is_pending_schedule_no_second_wake_up():
    async def run():
        engine_loop = EngineLoop(engine=None, metrics=ServerMetrics())
        engine_loop._loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        scheduled = []
        real = engine_loop._loop.call_soon_threadsafe

        def counting(callback, *args):
            scheduled.append(callback)
            return real(callback, *args)

        engine_loop._loop.call_soon_threadsafe = counting

        def engine_thread():  # three steps' outputs before the loop gets to run
            for n in (1, 2, 3):
                engine_loop._send([(sink, _out("a", n))])

        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join()
        assert len(scheduled) == 1
        await asyncio.sleep(0)
        assert [len(sink.get_nowait().outputs[0].token_ids) for _ in range(3)] == [1, 2, 3]
        engine_loop._send([(sink, _out("a", 4))])  # delivered: the next send wakes the loop again
        assert len(scheduled) == 2
        await asyncio.sleep(0)
        assert sink.get_nowait().outputs[0].token_ids == [0, 1, 2, 3]

    asyncio.run(run())

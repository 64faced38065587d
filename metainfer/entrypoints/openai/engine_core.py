"""The engine side of the server: `EngineCore` owns the LLMEngine and runs its step loop, normally in a process
of its own (`start_engine_process`), so that nothing of the HTTP process (JSON, SSE framing, detokenizing, the
event loop) holds the GIL the step loop needs (vLLM V1's EngineCore, SGLang's scheduler process).

The core talks to the server over two one-way `multiprocessing` pipes (pickled tuples; the only text that crosses
them is the final text of each choice of a request with stop strings, which the engine cuts):

  in  ("add", group_id, [(request_id, {"prompt_token_ids": ids}, SamplingParams), ...])
      ("abort", [request_id, ...])        ("stop",)
  out ("ready", info) | ("build_error", "Type: message")        once, first
      ("added", [(group_id, None | (kind, message, param)), ...])  kind "invalid" (a 400) or "internal" (a 500)
      ("step", [Delta, ...], Stats)       one message per step, every request the step changed
      ("step_failed", message, [request_id, ...], Stats)  the step raised: these (every request the engine had)
                                          were aborted; a request whose "add" is still in the pipe is not one
      ("stats", Stats)                    when the engine goes idle or after aborts

Delta = (request_id, finished, num_cached_tokens, error | None, [SeqDelta per choice], prompt logprobs | None),
the prompt logprobs (SamplingParams.prompt_logprobs) in the request's first Delta;
SeqDelta = (new token ids, their logprob dicts | None, cumulative logprob | None, finish_reason, stop_reason,
text | None); the text is the engine's final text of a choice of a request with stop strings, sent once, in the
delta where the choice finishes (its siblings may still run); the server detokenizes everything else itself, with
the same incremental detokenizer, so its text equals the engine's.
Stats = `STATS_FIELDS` in that order.

While requests are in flight the loop takes new input without blocking (`poll(0)`) before each step; idle, it
blocks on the input pipe. A closed input pipe (the server died) ends the core like "stop". While the engine builds
nothing reads the pipes: the engine process then watches its parent instead and exits when it is gone.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from multiprocessing import util as mp_util

from metainfer.sampling_params import SamplingParams

log = logging.getLogger("metainfer.server")

STATS_FIELDS = ("running", "waiting", "kv_usage", "prompt_tokens", "generation_tokens", "preemptions",
                "failed_requests", "failed_steps", "prefix_cache_queries", "prefix_cache_hits",
                "prefix_cache_preempted_queries", "prefix_cache_preempted_hits", "engine_errors",
                "batch_size", "step_interval", "kv_reserve_ratio_bounded", "kv_reserve_ratio_open")


class EngineCore:
    """The step loop over one LLMEngine; `run` serves the pipes until "stop" or the input pipe closes."""

    def __init__(self, engine, requests, outputs):
        self.engine = engine
        self.requests, self.outputs = requests, outputs
        self._sent: dict[str, list[int]] = {}  # request id -> tokens sent so far, per choice
        self._stop_strings: set[str] = set()  # requests whose text the engine cuts (it detokenizes those)
        self.engine_errors = 0
        self._last_step_sent: float | None = None  # monotonic time of the last "step" message; None when idle

    def info(self) -> dict:
        """What the server needs to know about the engine: its tokenizer's place and the request limits."""
        c = self.engine.config
        return {"model": c.model, "model_dir": c.model_dir, "gguf_file": c.gguf_file, "tokenizer": c.tokenizer,
                "max_model_len": c.max_model_len, "max_logprobs": c.max_logprobs, "pid": os.getpid(),
                "vocab_size": self.engine.spec.vocab_size}

    def run(self) -> None:
        engine, requests = self.engine, self.requests
        try:
            while True:
                if not engine.has_unfinished_requests():
                    self._last_step_sent = None  # the next step's interval would count the idle time
                    self.outputs.send(("stats", self.stats(0)))
                    if not self._handle(requests.recv()):
                        return
                while requests.poll(0):  # everything queued, without blocking
                    if not self._handle(requests.recv()):
                        return
                if engine.has_unfinished_requests():
                    self._step()
        except (EOFError, BrokenPipeError, ConnectionResetError):  # the server is gone
            return
        finally:
            for request_id in list(self._sent):
                engine.abort_request(request_id)
            self._sent.clear()

    def _handle(self, msg) -> bool:
        kind = msg[0]
        if kind == "add":
            self.outputs.send(("added", [(msg[1], self._add(msg[2]))]))
        elif kind == "abort":
            for request_id in msg[1]:
                if self._sent.pop(request_id, None) is not None:
                    self.engine.abort_request(request_id)
                    self._stop_strings.discard(request_id)
            if not self.engine.has_unfinished_requests():
                return True  # the idle branch reports the stats
            self.outputs.send(("stats", self.stats(0)))
        elif kind == "stop":
            return False
        return True

    def _add(self, items: list[tuple[str, dict, SamplingParams]]):
        """Add one client request's engine requests, all or none; None, or why not (kind, message, param)."""
        try:
            # stream=False: step() builds no cumulative RequestOutput per token (the core reads the new tokens
            # itself, `_progress`) and decodes only what stop strings need; decode_logprobs=False: the HTTP
            # process decodes the logprob tokens it answers with (OpenAIServing.token_texts_at), not this one
            self.engine.add_request_group(items, stream=False, decode_logprobs=False)
        except Exception as exc:
            if isinstance(exc, (ValueError, TypeError, KeyError, IndexError)):
                return ("invalid", str(exc) or type(exc).__name__, getattr(exc, "param", None))
            log.exception("adding a request failed")
            return ("internal", f"{type(exc).__name__}: {exc}", None)
        for request_id, _, params in items:
            self._sent[request_id] = [0] * params.n
            if params.stop_strings:
                self._stop_strings.add(request_id)
        return None

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed; aborting the requests in flight")
            self.engine_errors += 1
            aborted = list(self._sent)
            for request_id in aborted:
                self.engine.abort_request(request_id)
            self._sent.clear()
            self._stop_strings.clear()
            self.outputs.send(("step_failed", f"engine step failed: {type(exc).__name__}: {exc}", aborted,
                               self.stats(0)))
            return
        finished = {out.request_id: out for out in outputs}
        deltas = []
        requests, cut = self.engine.requests, self._stop_strings
        for request_id, counts in self._sent.items():
            out = finished.get(request_id)
            if out is not None:
                deltas.append(self._final(out, counts, request_id in cut))
            else:
                request = requests.get(request_id)
                delta = self._progress(request, counts, request_id in cut) if request is not None else None
                if delta is not None:
                    deltas.append(delta)
        for request_id in finished:
            self._sent.pop(request_id, None)
            cut.discard(request_id)
        if deltas:  # a step that read nothing back (the first of a burst, under async scheduling) says nothing
            now, last = time.monotonic(), self._last_step_sent
            self._last_step_sent = now
            self.outputs.send(("step", deltas, self.stats(len(deltas), 0.0 if last is None else now - last)))

    @staticmethod
    def _progress(request, counts: list[int], cut_at_stop_strings: bool):
        """The Delta of an unfinished request: the tokens its choices' sequences read back since the last one,
        None when there are none (the engine's own fields, not a RequestOutput built for every token). A choice
        of a request with stop strings that finished in this step (its last tokens are the new ones: the engine
        sets finish_reason as it reads them back) carries the engine's text, cut at the stop string, once."""
        seqs, new = [], False
        first = not any(counts)
        want_logprobs = request.params.logprobs is not None
        for seq in request.seqs:
            start, known, base = counts[seq.index], seq.num_known_output_tokens, seq.num_prompt_tokens
            text = None
            if known > start:
                new = True
                counts[seq.index] = known
                if cut_at_stop_strings and seq.finish_reason is not None:
                    text = seq.output_text
            seqs.append((seq.token_ids[base + start:base + known],
                         seq.output_logprobs[start:known] if want_logprobs else None,
                         seq.cumulative_logprob if want_logprobs else None, seq.finish_reason, seq.stop_reason, text))
        if not new:
            return None
        scored = request.seqs[0].prompt_logprobs if first else None  # complete once a token is sampled
        return (request.request_id, False, request.seqs[0].num_cached_prompt_tokens, None, seqs,
                list(scored) if scored is not None else None)

    @staticmethod
    def _final(out, counts: list[int], cut_at_stop_strings: bool):
        """The Delta of a finished request (its RequestOutput): what is left, and the engine's text of a choice
        cut at a stop string."""
        seqs, first = [], not any(counts)
        for c in out.outputs:
            start = counts[c.index]
            seqs.append((c.token_ids[start:], c.logprobs[start:] if c.logprobs is not None else None,
                         c.cumulative_logprob, c.finish_reason, c.stop_reason,
                         c.text if cut_at_stop_strings else None))
        return (out.request_id, True, out.num_cached_tokens, out.error, seqs, out.prompt_logprobs if first else None)

    def stats(self, batch_size: int, step_interval: float = 0.0) -> tuple:
        """STATS_FIELDS; `step_interval`: seconds since the step message before this one while requests ran (0:
        none to compare, or not a step message), the engine's own side of the inter-token latency."""
        e = self.engine
        return (e.num_running(), e.num_waiting(), e.kv_cache_usage(), e.stats.get("prompt_tokens", 0),
                e.stats.get("generation_tokens", 0), getattr(e.scheduler, "num_preemptions", 0),
                e.stats.get("failed_requests", 0), e.stats.get("failed_steps", 0),
                e.block_manager.prefix_query_tokens, e.block_manager.prefix_hit_tokens,
                e.block_manager.preempted_query_tokens, e.block_manager.preempted_hit_tokens, self.engine_errors,
                batch_size, step_interval, *e.scheduler.kv_reserve.reported_ratios())


def freeze_startup_heap() -> int:
    """Collect, then move every object alive now (torch, the model's modules, the tokenizer, the web framework)
    into the collector's permanent generation, so its full passes while serving scan only what serving
    allocated. Why: a full pass over a built server's ~267k startup objects took 91-113 ms on this CPU (session
    16), a stall of every stream at once; after the freeze ~0. Process-wide and for good (a frozen object in a
    cycle is never collected), so only a process that is a server calls it, once it is built: the engine
    process and `serve`'s HTTP process, never an `LLM` in a user's program. Returns the frozen object count."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


PARENT_POLL_S = 0.5


def _exit_if_orphaned_while(parent_pid: int, building: threading.Event) -> None:
    """While the engine builds it reads no pipe, so a server that dies then (SIGTERM or SIGKILL while the model
    loads) would leave it building for minutes on its own: poll the parent and exit when it is gone."""
    while building.is_set():
        if os.getppid() != parent_pid:
            os._exit(1)  # the TP ranks it spawned see their parent go (worker/tp/rank.py) and exit too
        time.sleep(PARENT_POLL_S)


def engine_process_main(engine_kwargs: dict, requests, outputs, log_level: int = logging.INFO,
                        parent_pid: int | None = None) -> None:
    """The engine process: build the engine (CUDA graphs and warm-up included), say "ready" (or send the
    build's error as one line), then serve the pipes; close the engine (and its TP ranks) at the end. During the
    build it exits if `parent_pid` (the server) is gone; once serving, an EOF on the input pipe ends it."""
    # Ctrl-C (and a SIGTERM to the process group) reach this process too: the server decides when the engine stops
    # ("stop" after its drain), and a server that dies closes the input pipe, which ends this process as well
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    building = threading.Event()
    if parent_pid is not None:
        building.set()
        threading.Thread(target=_exit_if_orphaned_while, args=(parent_pid, building), daemon=True,
                         name="metainfer-engine-parent-watchdog").start()
    from metainfer.llm import LLM

    try:
        llm = LLM(**engine_kwargs)
    except BaseException as exc:
        from metainfer.config import ConfigError

        if not isinstance(exc, ConfigError):  # a bad option is the user's one line; anything else may be a bug
            log.exception("the engine failed to build")
        try:
            outputs.send(("build_error", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else ""))
        except OSError:  # the server is gone
            pass
        return
    try:
        core = EngineCore(llm.llm_engine, requests, outputs)
        info = core.info()
        info["gc_frozen"] = freeze_startup_heap()
        building.clear()  # from here the pipes tell: a server that dies closes them
        try:
            outputs.send(("ready", info))
        except OSError:  # the server died as the build ended
            return
        core.run()
    finally:
        llm.close()
        log.info("engine process closed its engine")


class EngineProcess:
    """The server's handle on the engine: its pipes, and the process (or, for an `LLM` the caller built, the
    thread) that runs the core. `ready_info` holds the core's `info()` once started."""

    def __init__(self, requests, outputs, process=None, thread=None, engine=None):
        self.requests, self.outputs = requests, outputs  # our ends: we send requests, receive outputs
        self.process, self.thread, self.engine = process, thread, engine
        self.ready_info: dict = {}

    def start(self) -> None:
        """Start the core's thread (a process is running since `start_engine_process`)."""
        if self.thread is not None and self.thread.ident is None:
            self.thread.start()

    @property
    def alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        return self.thread is not None and self.thread.is_alive()

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else os.getpid()

    def stop(self, timeout: float = 30.0, send_stop: bool = True) -> None:
        """Ask the core to stop (it aborts what is left and closes its engine; `send_stop=False`: the caller's
        sender thread sends "stop"), read and drop its output until it ends (an engine blocked writing output
        would never read "stop"), wait, then close the pipes. Kills a process that does not stop within
        `timeout`. Idempotent."""
        if self.requests.closed:
            return
        if send_stop:
            try:
                self.requests.send(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        self._discard_output_until_eof(deadline)
        if self.process is not None:
            self.process.join(max(0.0, deadline - time.monotonic()))
            if self.process.is_alive():
                log.warning("the engine process did not stop in %g s; killing it", timeout)
                self.kill()
        elif self.thread is not None and self.thread.ident is not None:
            self.thread.join(max(0.0, deadline - time.monotonic()))
        for conn in (self.requests, self.outputs):
            conn.close()

    def kill(self) -> None:
        """End the engine process now (it ignores SIGTERM); its TP ranks follow (they watch their parent)."""
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def _discard_output_until_eof(self, deadline: float) -> None:
        outputs = self.outputs
        try:
            while time.monotonic() < deadline:
                if outputs.poll(min(0.1, max(0.0, deadline - time.monotonic()))):
                    outputs.recv_bytes()
                elif not self.alive:
                    return
        except (EOFError, OSError):  # the engine closed its end: it is done
            return


class EngineStartError(RuntimeError):
    """The engine process failed to build (the message is its error's one line) or died before it was ready."""


def start_engine_process(engine_kwargs: dict) -> EngineProcess:
    """Spawn the engine process and wait for its "ready"; raise its build error (a ConfigError stays one)."""
    ctx = mp.get_context("spawn")  # CUDA cannot be forked; the process spawns TP ranks itself, so not a daemon
    req_r, req_w = ctx.Pipe(duplex=False)
    out_r, out_w = ctx.Pipe(duplex=False)
    log_level = logging.getLogger("metainfer").getEffectiveLevel()  # the server's --log-level
    process = ctx.Process(target=engine_process_main, args=(engine_kwargs, req_r, out_w, log_level, os.getpid()),
                          name="metainfer-engine", daemon=False)
    process.start()
    req_r.close()  # the child holds these ends: closing ours lets each side see EOF when the other dies
    out_w.close()
    handle = EngineProcess(req_w, out_r, process=process)
    # An app that is never run (or a program that exits without stopping it) stops the engine at exit, before
    # multiprocessing joins its children (a non-daemon child blocked reading our pipe would hang the exit)
    mp_util.Finalize(handle, handle.stop, kwargs={"timeout": 10}, exitpriority=10)
    try:
        with _signals_raise(signal.SIGTERM):  # a supervisor's SIGTERM during the build ends the wait, not us alone
            handle.ready_info = _wait_ready(out_r, process)
    except BaseException as exc:
        from metainfer.config import ConfigError

        if not isinstance(exc, (EngineStartError, ConfigError)):  # interrupted (Ctrl-C, SIGTERM): it is building
            handle.kill()
        handle.stop(timeout=10)  # else it reported its error and ends by itself
        raise
    return handle


class _signals_raise:
    """While inside: the given signals raise SystemExit(128 + signal) in the main thread, where their handler is
    the default (which would end this process at once and leave the engine process building); else a no-op."""

    def __init__(self, *signums):
        self.signums, self.saved = signums, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.signums:
                if signal.getsignal(signum) == signal.SIG_DFL:
                    self.saved[signum] = signal.signal(signum, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    def __exit__(self, *exc):
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)


def start_engine_thread(llm) -> EngineProcess:
    """The core over an `LLM` the caller built (and keeps), in a thread of this process (started by `start()`):
    the same pipes and messages; for an embedded server and for torchrun's rank 0, whose engine cannot move to
    another process. The GIL is shared here, so this host keeps the old per-token cost."""
    req_r, req_w = mp.Pipe(duplex=False)
    out_r, out_w = mp.Pipe(duplex=False)
    core = EngineCore(llm.llm_engine, req_r, out_w)

    def run():
        try:
            core.run()
        finally:
            out_w.close()  # the server's reader sees EOF: the engine is gone
            req_r.close()

    out_w.send(("ready", core.info()))
    thread = threading.Thread(target=run, name="metainfer-engine", daemon=True)
    handle = EngineProcess(req_w, out_r, thread=thread, engine=llm.llm_engine)
    handle.ready_info = _wait_ready(out_r, None)
    return handle


def _wait_ready(outputs, process) -> dict:
    """The engine's "ready" info; no time limit (a cold GPU build compiles for minutes), only its death ends it."""
    while not outputs.poll(0.2):
        if process is not None and not process.is_alive():
            raise EngineStartError(f"the engine process exited with code {process.exitcode} before it was ready")
    try:
        msg = outputs.recv()
    except EOFError:
        raise EngineStartError("the engine process exited before it was ready") from None
    if msg[0] == "build_error":
        from metainfer.config import ConfigError

        kind, message = msg[1], msg[2]
        if kind == "ConfigError":
            raise ConfigError(message)
        raise EngineStartError(f"the engine failed to start: {kind}: {message}")
    return msg[1]

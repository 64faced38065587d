"""The SPMD script the external-launcher tests start under torchrun (one process a rank).

Every rank builds `LLM(..., distributed_executor_backend="external_launcher")`, generates the prompts of
`--prompts` (a JSON list of token-id lists) greedily, then makes four more calls (an out-of-vocabulary prompt,
which rank 0 refuses; prompts that differ on the last rank; a sampling_params list that does not match the prompts
on the last rank only; the first prompt again) and writes what its calls returned or raised to OUT/rank{RANK}.json.
Fault options: `--max-model-len-on RANK:N` gives one rank another max_model_len; `--model-on RANK:PATH` another
model; `--die-rank R --die-at-step K` SIGKILLs rank R in its K-th model step; `--stall-rank R` never builds an
engine; `--vanish-rank R --idle-s S` ends rank R after the first generate while the others idle;
`--freeze-rank R` stops rank R (SIGSTOP: a hung host, no connection closes) after the first generate.
Each rank writes OUT/pid{RANK} first, so a test can check that no process outlives the run, and OUT/start{RANK}
(time.time() before the engine is built) and OUT/fault{RANK} (time.time() as it dies or vanishes), so a test can
bound how long the others take to end.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-model-len-on", default=None, help="RANK:N")
    p.add_argument("--model-on", default=None, help="RANK:PATH (another model on that rank)")
    p.add_argument("--timeout", type=float, default=60.0, help="distributed_timeout_s")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--die-rank", type=int, default=None)
    p.add_argument("--die-at-step", type=int, default=3)
    p.add_argument("--stall-rank", type=int, default=None)
    p.add_argument("--vanish-rank", type=int, default=None, help="exits (os._exit) after the first generate, "
                   "while the other ranks stay idle for --idle-s")
    p.add_argument("--idle-s", type=float, default=0.0)
    p.add_argument("--freeze-rank", type=int, default=None)
    p.add_argument("--warmup-steps", type=int, default=0, help="rank 0 runs this many steps of the warm-up plan "
                   "(the torch references plan none on the CPU: nothing compiles there)")
    return p.parse_args(argv)


def stamp(out: str, name: str) -> None:
    with open(os.path.join(out, name), "w") as f:
        f.write(repr(time.time()))


def die_in_step(step: int, out: str, rank: int) -> None:
    """SIGKILL this process in its `step`-th model step (no cleanup, like a crashed node)."""
    from metainfer.worker.model_runner import ModelRunner

    original, calls = ModelRunner.execute, [0]

    def execute(self, batch):
        calls[0] += 1
        if calls[0] == step:
            stamp(out, f"fault{rank}")
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, batch)

    ModelRunner.execute = execute


def force_warmup(num_steps: int) -> None:
    """Give rank 0's runner the first `num_steps` steps of its warm-up plan (on the CPU it plans none)."""
    from metainfer.worker.model_runner import ModelRunner
    from metainfer.worker.warmup import warmup_plan

    original = ModelRunner.warm_up

    def warm_up(self):
        if self.rank == 0:
            c = self.config
            self.warmup_steps = warmup_plan(c.max_num_batched_tokens, c.max_model_len, c.max_num_seqs,
                                            self.block_size, [], 0)[:num_steps]
        return original(self)

    ModelRunner.warm_up = warm_up


def count_steps() -> list[int]:
    """A counter of this rank's model steps (ModelRunner.execute calls)."""
    from metainfer.worker.model_runner import ModelRunner

    original, calls = ModelRunner.execute, [0]

    def execute(self, batch):
        calls[0] += 1
        return original(self, batch)

    ModelRunner.execute = execute
    return calls


def main(argv=None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    rank = int(os.environ["RANK"])
    with open(os.path.join(args.out, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == args.stall_rank:
        time.sleep(3600)
        return 0
    from metainfer import LLM, SamplingParams

    max_model_len = args.max_model_len
    if args.max_model_len_on:
        on, value = (int(x) for x in args.max_model_len_on.split(":"))
        max_model_len = value if rank == on else max_model_len
    if rank == args.die_rank:
        die_in_step(args.die_at_step, args.out, rank)
    model = args.model
    if args.model_on:
        on, path = args.model_on.split(":", 1)
        model = path if rank == int(on) else model
    with open(args.prompts) as f:
        prompts = json.load(f)
    if args.warmup_steps:
        force_warmup(args.warmup_steps)
    steps = count_steps()
    stamp(args.out, f"start{rank}")
    llm = LLM(model, device=args.device, dtype=args.dtype, tensor_parallel_size=args.tp,
              max_model_len=max_model_len, distributed_executor_backend="external_launcher",
              distributed_timeout_s=args.timeout)
    steps_at_build = steps[0]  # the warm-up's, replayed by every rank
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
        if args.vanish_rank is not None:
            if rank == args.vanish_rank:
                stamp(args.out, f"fault{rank}")
                os._exit(3)  # gone without closing, and no collective is running to notice
            time.sleep(args.idle_s)
        if rank == args.freeze_rank:
            stamp(args.out, f"fault{rank}")
            os.kill(os.getpid(), signal.SIGSTOP)
        refused = {}
        try:  # rank 0 refuses the prompt; every rank raises the same ValueError
            llm.generate([{"prompt_token_ids": [10**6]}], params, use_tqdm=False)
        except ValueError as err:
            refused["bad_prompt"] = str(err)
        mine = prompts[:-1] if rank == args.tp - 1 else prompts  # the last rank passes one prompt fewer
        try:
            llm.generate([{"prompt_token_ids": p} for p in mine], params, use_tqdm=False)
        except ValueError as err:
            refused["different_args"] = str(err)
        try:  # the last rank's call is invalid on its own (two params for one prompt): every rank raises
            llm.generate([{"prompt_token_ids": prompts[0]}], [params, params] if rank == args.tp - 1 else params,
                         use_tqdm=False)
        except ValueError as err:
            refused["bad_params"] = str(err)
        again = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # still usable
    finally:
        llm.close()
    record = {"rank": rank, "token_ids": [o.outputs[0].token_ids for o in outs],
              "finish_reasons": [o.outputs[0].finish_reason for o in outs],
              "refused": refused, "second_call": again[0].outputs[0].token_ids, "steps_at_build": steps_at_build}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

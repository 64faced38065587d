"""The `metainfer` CLI (issue 23, item 6): every bad value is one line naming the option, before the model
loads where it can; a folder without tokenizer files names itself and --tokenizer; `serve` without the
server packages names the extra; every option has help text."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import pytest

from metainfer.entrypoints import cli, serve_cli
from tests.helpers.tiny_models import copy_model_files

MISSING = "/nonexistent/model-folder"  # were the model loaded first, the error would name this path


def _one_line_error(capsys, argv, status: int = 2) -> str:
    """Run the CLI; it must stop with exit `status` (2, argparse's for a bad invocation, unless said) and an
    error whose whole output is one line; return that line."""
    try:
        rc = cli.main(argv)
        message = ""
    except SystemExit as exit_:
        rc, message = exit_.code, exit_.code if isinstance(exit_.code, str) else ""
        rc = 1 if isinstance(rc, str) else rc
    captured = capsys.readouterr()
    lines = [line for line in (captured.err + captured.out + message).splitlines() if line.strip()]
    assert rc == status and len(lines) == 1, (rc, lines)
    assert lines[0].startswith("metainfer: error: "), lines
    return lines[0]


@pytest.mark.parametrize("argv, option", [
    (["--max-tokens", "-1"], "--max-tokens"), (["--temperature", "-2"], "--temperature"),
    (["--top-p", "0"], "--top-p"), (["--top-p", "nan"], "--top-p"), (["--temperature", "inf"], "--temperature"),
    (["--top-k", str(2**63)], "--top-k"), (["--min-p", "1.5"], "--min-p"),
    (["--sample-seed", str(2**64)], "--sample-seed"), (["--seed", str(2**64)], "--seed"),
    (["--top-p", "1e-300"], "--top-p"), (["--temperature", "1e39"], "--temperature"),
])
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_bad_sampling_values_are_one_line_before_the_model_loads(capsys, command, argv, option):
    line = _one_line_error(capsys, [command, "--model", MISSING, *argv])
    assert option in line and MISSING not in line, line


def test_bad_engine_option_is_one_line(capsys, model_dir):
    line = _one_line_error(capsys, ["generate", "x", "--model", model_dir, "--device", "cpu", "--block-size", "0"])
    assert "block_size" in line
    line = _one_line_error(capsys, ["generate", "x", "--model", MISSING])
    assert MISSING in line


@pytest.mark.parametrize("argv, option", [
    (["--max-num-seqs", "0"], "--max-num-seqs: max_num_seqs"), (["--tp", "0"], "--tp: tensor_parallel_size"),
    (["--kv-cache-dtype", "int4"], "--kv-cache-dtype: kv_cache_dtype"),
    (["--gpu-memory-utilization", "2"], "--gpu-memory-utilization: gpu_memory_utilization"),
    (["--max-piecewise-graph-tokens", "-1"], "--max-piecewise-graph-tokens: max_piecewise_graph_tokens"),
    (["--kv-reserve-ratio", "1.5"], "--kv-reserve-ratio: kv_reserve_ratio"),
    (["--cuda-graph-sizes", "8", "0"], "--cuda-graph-sizes: cuda_graph_sizes"),
])
def test_engine_option_errors_name_the_cli_option(capsys, model_dir, argv, option):
    line = _one_line_error(capsys, ["generate", "x", "--model", model_dir, "--device", "cpu", *argv])
    assert line.startswith(f"metainfer: error: {option}"), line


@pytest.mark.parametrize("argv, expected", [
    (["--num-kv-blocks", str(10**12)],
     r"--num-kv-blocks: num_kv_blocks \(1000000000000\) needs .* GiB for the KV cache; the cpu has .* GiB in all"),
    (["--max-num-seqs", str(10**12)],
     r"the cpu cannot hold the buffers these sizes ask for \(max_num_seqs=1000000000000"),
    (["--max-num-batched-tokens", str(10**12)], r"cannot hold the buffers .*max_num_batched_tokens=1000000000000"),
    (["--block-size", str(10**7)], r"no memory left for the KV cache \(a block of block_size=10000000 tokens .*\); "
                                   r"raise cpu_kv_cache_gib \(.*\) or lower block_size"),
])
def test_sizes_the_device_cannot_hold_are_one_line_naming_them(capsys, model_dir, argv, expected):
    """Sizes past the device's memory (spec review of issue 23): a one-line error naming the options (they ended in
    an allocator's traceback), and a block size that leaves no KV block names block_size and the CPU's budget
    (it named the GPU's options)."""
    line = _one_line_error(capsys, ["generate", "x", "--model", model_dir, "--device", "cpu", *argv])
    assert re.search(expected, line), line


def test_only_a_message_that_starts_with_a_field_gets_its_option():
    parser = cli.build_parser()
    assert cli.with_option_name("block_size must be >= 1, got 0", parser).startswith("--block-size: block_size")
    for message in ("--distributed-executor-backend: the HF baseline runs in one process on one device",
                    "the HF baseline runs on one device", "no memory left for the KV cache; lower max_num_seqs"):
        assert cli.with_option_name(message, parser) == message


@pytest.mark.parametrize("argv, option", [
    (["generate", "--max-tokens", "abc"], "--max-tokens"), (["chat", "--top-p", "x"], "--top-p"),
    (["generate", "--no-such-option"], "--no-such-option"), (["generate", "--dtype"], "--dtype"),
])
def test_argparse_errors_are_one_line_without_the_usage_block(capsys, argv, option):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    captured = capsys.readouterr()
    lines = [line for line in (captured.err + captured.out).splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1, lines
    assert option in lines[0] and "--help" in lines[0] and "usage:" not in lines[0], lines


def test_empty_prompt_is_one_line(capsys):
    assert "prompt" in _one_line_error(capsys, ["generate", "", "--model", MISSING])


def test_prompt_over_the_context_is_one_line(capsys, model_dir):
    line = _one_line_error(capsys, ["generate", "hello " * 40, "--model", model_dir, "--device", "cpu",
                                    "--dtype", "float32", "--max-model-len", "16"])
    assert "max_model_len (16)" in line


def test_missing_tokenizer_names_the_folder_and_the_option(capsys, model_dir, tmp_path):
    copy_model_files(model_dir, str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        (tmp_path / name).unlink(missing_ok=True)
    line = _one_line_error(capsys, ["generate", "x", "--model", str(tmp_path), "--device", "cpu"])
    assert str(tmp_path) in line and "--tokenizer" in line
    assert cli.main(["generate", "x", "--model", str(tmp_path), "--device", "cpu", "--dtype", "float32",
                     "--tokenizer", model_dir, "--max-tokens", "2", "--json"]) == 0


@pytest.mark.parametrize("kept", [("tokenizer_config.json",), ("tokenizer_config.json", "vocab.json"),
                                  ("tokenizer_config.json", "merges.txt")])
def test_tokenizer_files_without_a_vocabulary_are_no_tokenizer(capsys, model_dir, tmp_path, kept):
    """tokenizer_config.json names a class, no vocabulary (transformers built a tokenizer that encoded every prompt
    to zero tokens, found only after the weights loaded); vocab.json needs merges.txt. The folder has no weights:
    the refusal comes before any weight is read."""
    copy_model_files(model_dir, str(tmp_path), weights=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        if name not in kept:
            (tmp_path / name).unlink()
    line = _one_line_error(capsys, ["generate", "x", "--model", str(tmp_path), "--device", "cpu"])
    assert line.startswith(f"metainfer: error: --model: model folder '{tmp_path}' has no tokenizer files that "
                           "define a vocabulary (tokenizer.json, tokenizer.model, or vocab.json with merges.txt); "
                           "pass a folder that has them with --tokenizer PATH"), line
    line = _one_line_error(capsys, ["generate", "x", "--model", model_dir, "--device", "cpu",
                                    "--tokenizer", str(tmp_path)])
    assert line.startswith(f"metainfer: error: --tokenizer: tokenizer folder '{tmp_path}' has no tokenizer files "
                           "that define a vocabulary"), line


def test_each_vocabulary_file_set_counts(tmp_path):
    from metainfer.engine.tokenizer import has_vocabulary

    for names, expected in [((), False), (("tokenizer_config.json",), False), (("vocab.json",), False),
                            (("tokenizer_config.json", "merges.txt"), False), (("tokenizer.json",), True),
                            (("tokenizer.model",), True), (("vocab.json", "merges.txt"), True)]:
        folder = tmp_path / ("-".join(names) or "empty")
        folder.mkdir()
        for name in names:
            (folder / name).write_text("{}")
        assert has_vocabulary(str(folder)) is expected, names
    (tmp_path / "dir" / "tokenizer.json").mkdir(parents=True)  # a folder of that name is no file
    assert not has_vocabulary(str(tmp_path / "dir"))


def test_min_p_error_states_the_accepted_range(capsys):
    """0 (off) is accepted beside [1e-06, 1]: the message says both (it said "in [1e-06, 1]" alone)."""
    from metainfer import SamplingParams

    expected = "min_p must be 0 (off) or a finite number in [1e-06, 1], got 2.0"
    line = _one_line_error(capsys, ["generate", "x", "--model", MISSING, "--min-p", "2"])
    assert line == f"metainfer: error: --min-p: {expected}", line
    with pytest.raises(ValueError, match=re.escape(expected)):
        SamplingParams(min_p=2.0)
    with pytest.raises(ValueError, match=re.escape(expected.replace("2.0", "1e-07"))):
        SamplingParams(min_p=1e-7)
    for ok in (0, 0.0, 1e-6, 0.5, 1.0):
        assert SamplingParams(min_p=ok).min_p == ok
    help_text = next(a.help for a in cli.build_parser()._subparsers._group_actions[0].choices["generate"]._actions
                     if "--min-p" in a.option_strings)
    assert "0 (off) or in [1e-06, 1]" in help_text


def test_bench_serve_without_its_client_names_the_extra(capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "aiohttp", None)  # an import of it now raises ImportError
    line = _one_line_error(capsys, ["bench", "serve", "--base-url", "http://127.0.0.1:9"], status=1)
    assert "pip install 'metainfer[serve]'" in line and "aiohttp" in line


def test_serve_without_the_server_packages_names_the_extra(capsys, monkeypatch):
    monkeypatch.setattr(serve_cli, "missing_server_packages", lambda: ["fastapi", "uvicorn"])
    line = _one_line_error(capsys, ["serve", "--model", MISSING], status=1)  # the install, not the invocation
    assert "pip install 'metainfer[serve]'" in line and "uvicorn" in line and MISSING not in line



@pytest.mark.parametrize("argv, option", [
    (["--port", "70000"], "--port"), (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["--max-queued-requests", "-1"], "--max-queued-requests"),
    (["--max-queued-requests", "0"], "--max-queued-requests: must be >= 1"),
    (["--shutdown-timeout", "inf"], "--shutdown-timeout"), (["other-model"], "MODEL or as --model"),
    (["--max-mixed-prefill-tokens", "-1"], "--max-mixed-prefill-tokens: must be >= 0 (0: no cap)"),
])
def test_bad_serve_values_exit_2_naming_the_option(capsys, monkeypatch, argv, option):
    monkeypatch.setattr(serve_cli, "missing_server_packages", lambda: [])
    line = _one_line_error(capsys, ["serve", "--model", MISSING, *argv])
    assert option in line and MISSING not in line, line


def _options(parser: argparse.ArgumentParser, path: str = "metainfer"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_option_has_help():
    missing = [f"{path} {'/'.join(a.option_strings) or a.dest}" for path, a in _options(cli.build_parser())
               if not a.help or a.help == argparse.SUPPRESS]
    assert missing == []


def test_seed_errors_name_the_option_given(capsys):
    """--seed feeds the request's seed when --sample-seed is absent: the error names --seed, not --sample-seed."""
    for bad in (2**64, -1):
        line = _one_line_error(capsys, ["generate", "x", "--model", MISSING, "--seed", str(bad)])
        assert line.startswith("metainfer: error: --seed: ") and "--sample-seed" not in line, line
        assert "[0, 2**64)" in line, line  # the engine's range, not the request's int64
    line = _one_line_error(capsys, ["generate", "x", "--model", MISSING, "--seed", "1", "--sample-seed", str(2**64)])
    assert line.startswith("metainfer: error: --sample-seed: "), line


def test_every_engine_seed_is_a_request_seed():
    """--seed takes [0, 2**64) (the engine's range); as the request's int64 seed its upper half keeps its 64 bits,
    so every valid --seed runs, and two of them never share a request seed."""
    parse = cli.build_parser().parse_args
    for seed, want in ((0, 0), (2**63 - 1, 2**63 - 1), (2**63, -(2**63)), (2**64 - 1, -1)):
        assert cli.sampling_params(parse(["generate", "x", "--seed", str(seed)])).seed == want
    assert cli.sampling_params(parse(["generate", "x", "--seed", str(2**63), "--sample-seed", "7"])).seed == 7


def test_max_n_and_max_logprobs_options(capsys, model_dir):
    """--max-n and --max-logprobs reach the engine (serve takes the engine options too); a bad one is one line."""
    args = cli.build_parser().parse_args(["serve", "--model", model_dir, "--max-n", "3", "--max-logprobs", "5"])
    kwargs = cli.engine_kwargs(args)
    assert kwargs["max_n"] == 3 and kwargs["max_logprobs"] == 5
    defaults = cli.engine_kwargs(cli.build_parser().parse_args(["generate", "--model", model_dir]))
    assert defaults["max_n"] == 128 and defaults["max_logprobs"] == 20
    line = _one_line_error(capsys, ["generate", "x", "--model", model_dir, "--device", "cpu", "--max-n", "0"])
    assert "max_n" in line, line
    from metainfer import LLM

    llm = LLM(**cli.engine_kwargs(cli.build_parser().parse_args(
        ["generate", "--model", model_dir, "--device", "cpu", "--dtype", "float32", "--max-model-len", "32",
         "--max-n", "2", "--max-logprobs", "1"])))
    try:
        limits = llm.llm_engine.request_limits()
        assert limits.max_n == 2 and limits.max_logprobs == 1
    finally:
        llm.close()


# -- the bench commands' sizes and the context, refused before any model loads (issue 23, item 6) ---------------

def _refuse_loading(*args, **kwargs):
    raise AssertionError("a model was loaded (or a server loaded) before the bad value was refused")


@pytest.fixture()
def no_loading(monkeypatch):
    """Any model load (the engine; the HF baseline's) or server run fails the test: a refusal must come first."""
    import metainfer
    from metainfer.bench import baselines
    from metainfer.bench import serve as bench_serve

    monkeypatch.setattr(metainfer, "LLM", _refuse_loading)
    monkeypatch.setattr(baselines, "load_hf_model", _refuse_loading)
    monkeypatch.setattr(bench_serve, "run_benchmark", _refuse_loading)


@pytest.fixture(scope="module")
def weightless_dir(model_dir, tmp_path_factory):
    """The tiny model's config and tokenizer without its weights: loading it would fail, differently."""
    folder = tmp_path_factory.mktemp("weightless")
    copy_model_files(model_dir, str(folder), weights=False)
    return str(folder)


def _usage_line(capsys, argv, status: int = 2) -> str:
    """The CLI stops with exit `status` and one line on stderr (argparse's own, "metainfer bench latency: error:
    argument --x: ...", or the commands' "metainfer: error: ..."), nothing on stdout; return the line."""
    with pytest.raises(SystemExit) as exit_:
        rc = cli.main(argv)
        raise SystemExit(rc)
    captured = capsys.readouterr()
    code = exit_.value.code
    message = code if isinstance(code, str) else ""
    lines = [line for line in (captured.err + message).splitlines() if line.strip()]
    assert (1 if message else code) == status and len(lines) == 1 and not captured.out.strip(), (code, lines)
    assert lines[0].startswith("metainfer") and ": error: " in lines[0] and "Traceback" not in lines[0], lines
    return lines[0]


@pytest.mark.parametrize("bench, argv, option", [
    ("latency", ["--input-len", "-1"], "--input-len"), ("latency", ["--input-len", "0"], "--input-len"),
    ("latency", ["--batch-size", "0"], "--batch-size"), ("latency", ["--batch-size", "-2"], "--batch-size"),
    ("latency", ["--iters", "0"], "--iters"), ("latency", ["--warmup", "-1"], "--warmup"),
    ("latency", ["--input-len", "1.5"], "--input-len"),
    ("baseline", ["--batch-size", "0"], "--batch-size"), ("baseline", ["--input-len", "-1"], "--input-len"),
    ("baseline", ["--iters", "0"], "--iters"), ("baseline", ["--modes", "eager,fast"], "--modes"),
    ("throughput", ["--num-seqs", "-1"], "--num-seqs"),
    ("serve", ["--num-prompts", "0"], "--num-prompts"), ("serve", ["--input-len", "0"], "--input-len"),
    ("serve", ["--output-len", "-1"], "--output-len"), ("serve", ["--max-concurrency", "0"], "--max-concurrency"),
    ("serve", ["--random-range-ratio", "1.5"], "--random-range-ratio"),
    ("serve", ["--random-range-ratio", "-0.1"], "--random-range-ratio"),
    ("serve", ["--request-rate", "0"], "--request-rate"), ("serve", ["--request-rate", "nan"], "--request-rate"),
    ("serve", ["--temperature", "-1"], "--temperature"), ("serve", ["--temperature", "inf"], "--temperature"),
    ("serve", ["--timeout", "0"], "--timeout"), ("serve", ["--metric-percentiles", "50,abc"], "--metric-percentiles"),
    ("serve", ["--metric-percentiles", "101"], "--metric-percentiles"),
    ("serve", ["--token-id-range", "5", "2"], "--token-id-range"),
    ("serve", ["--token-id-range", "-1", "5"], "--token-id-range"),
])
def test_bad_bench_values_are_one_line_before_the_model_loads(capsys, no_loading, bench, argv, option):
    line = _usage_line(capsys, ["bench", bench, "--model", MISSING, *argv])
    assert option in line and MISSING not in line, line


@pytest.mark.parametrize("bench, argv, message", [
    ("latency", ["--input-len", "500", "--output-len", "13"], "--input-len + --output-len is 513 tokens, more than "
                                                            "max_model_len (512, the model's max_position_embeddings"),
    ("latency", ["--max-model-len", "64", "--input-len", "60", "--output-len", "8"],
     "--input-len + --output-len is 68 tokens, more than max_model_len (64, --max-model-len)"),
    ("throughput", ["--max-input-len", "300", "--max-output-len", "300"],
     "--max-input-len + --max-output-len is 600 tokens, more than max_model_len (512,"),
])
def test_bench_shape_over_the_context_is_one_line_before_the_model_loads(capsys, no_loading, weightless_dir, bench,
                                                                        argv, message):
    """The tiny model's config says max_position_embeddings 512: a shape whose outputs the engine would cut short
    is refused from the config alone (the weights are not there to load)."""
    line = _usage_line(capsys, ["bench", bench, "--model", weightless_dir, "--device", "cpu", *argv])
    assert line.startswith(f"metainfer: error: {message}"), line


def test_bench_shape_that_fits_the_context_reaches_the_engine(capsys, no_loading, weightless_dir):
    """512 tokens in all is the context exactly: not refused early (the patched loader is what stops it)."""
    with pytest.raises(AssertionError, match="a model was loaded"):
        cli.main(["bench", "latency", "--model", weightless_dir, "--input-len", "500", "--output-len", "12"])


def test_prompt_over_the_context_is_refused_before_the_model_loads(capsys, no_loading, weightless_dir):
    """The prompt's length comes from the tokenizer, the context from --max-model-len or the model's config; the
    message names the option that sets it."""
    line = _usage_line(capsys, ["generate", "hello " * 40, "--model", weightless_dir, "--max-model-len", "16"])
    assert line.startswith("metainfer: error: --max-model-len: prompt is ") and "max_model_len (16)" in line, line
    line = _usage_line(capsys, ["generate", "short", "hello " * 600, "--model", weightless_dir])
    assert "--max-model-len: " in line and "max_model_len (512)" in line and "(prompt 2 of 2)" in line, line


def test_the_early_prompt_check_refuses_only_what_the_engine_would(weightless_dir):
    """The rule is the engine's (check_prompt_length: a prompt of max_model_len tokens still gets its one token):
    the count comes from the HF tokenizer itself, not from the code under test."""
    from transformers import AutoTokenizer

    prompt = "The capital of France is " * 30
    tokens = len(AutoTokenizer.from_pretrained(weightless_dir).encode(prompt))
    args = cli.build_parser().parse_args(["generate", "--model", weightless_dir, "--max-model-len", str(tokens)])
    cli.check_prompts_fit(args, [prompt])  # fits exactly: left to the engine
    args.max_model_len = tokens - 1
    with pytest.raises(SystemExit) as exit_:
        cli.check_prompts_fit(args, [prompt])
    assert exit_.value.code == 2


@pytest.mark.parametrize("seed", [2**64, -1])
def test_engine_seed_out_of_range_names_the_option(capsys, weightless_dir, seed):
    """torch.manual_seed's overflow (and MLX's refusal of a negative seed) named no option; EngineConfig refuses
    the seed before any weight is read."""
    line = _usage_line(capsys, ["bench", "latency", "--model", weightless_dir, "--device", "cpu",
                                "--seed", str(seed)])
    assert line.startswith("metainfer: error: --seed: seed must be in [0, 2**64)"), line


def test_bench_serve_without_a_server_is_one_line(capsys):
    from tests.helpers.server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    line = _usage_line(capsys, ["bench", "serve", "--base-url", url, "--timeout", "5"], status=1)
    assert line.startswith(f"metainfer: error: --base-url {url}: ClientConnectorError"), line


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bad_values_fail_fast_in_the_console_command(weightless_dir):
    """Two of the review's cases as real `metainfer` processes (side by side; the rest run in-process above): exit 2,
    one stderr line naming the option, no traceback, quickly; the folder has no weights, so a load would have
    failed otherwise."""
    cases = [(["bench", "latency", "--input-len", "-1"], "argument --input-len"),
             (["generate", "hello " * 40, "--max-model-len", "16"], "--max-model-len: prompt is 41 tokens long")]
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "metainfer.entrypoints.cli", *argv, "--model", weightless_dir,
                               "--device", "cpu"], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for argv, _ in cases]
    for proc, (argv, expected) in zip(procs, cases):
        out, err = proc.communicate(timeout=120)
        lines = err.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], (argv[:3], proc.returncode, err)
        assert "Traceback" not in err and not out.strip()
    assert time.perf_counter() - start < 30  # ~4 s on 2 idle cores; a model load would fail, not just be slow


@pytest.mark.parametrize("argv, prog, unknown", [(["serve", "--max-tokens", "3"], "metainfer serve", "--max-tokens"),
                                                (["bench", "latency", "--num-iters", "3"], "metainfer bench latency",
                                                 "--num-iters 3"),
                                                (["generate", "--bogus"], "metainfer generate", "--bogus")])
def test_an_unknown_option_points_to_its_subcommands_help(capsys, argv, prog, unknown):
    line = _usage_line(capsys, argv)
    assert line == f"{prog}: error: unrecognized arguments: {unknown} (see {prog} --help)", line


def test_a_constraint_error_names_the_option(capsys, weightless_dir):
    """The spec's constraint (its heads not divisible by --tp) names --tp, as the other engine errors their option;
    refused before any weight is read (a weightless folder)."""
    line = _usage_line(capsys, ["generate", "--model", weightless_dir, "--device", "cpu", "--tp", "3", "x"])
    assert line.startswith("metainfer: error: --tp: constraint."), line


def test_build_app_refuses_a_queue_cap_that_would_refuse_every_request():
    from metainfer.entrypoints.openai.api_server import build_app

    with pytest.raises(ValueError, match="max_queued_requests"):  # before any engine starts
        build_app({"model": MISSING}, max_queued_requests=0)


@pytest.mark.parametrize("command", [["generate", "Hi"], ["spec"], ["serve", "--port", "8049"]])
def test_a_broken_model_config_is_one_line(capsys, command, tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64}')
    argv = [*command, "--model", str(tmp_path)] if command[0] != "spec" else ["spec", str(tmp_path)]
    try:
        rc = cli.main(argv)
    except SystemExit as exit_:
        rc = exit_.code
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc not in (0, None) and len(lines) == 1 and "lacks 'num_attention_heads'" in lines[0], (rc, lines)

"""The `metainfer` CLI (issue 23, item 6): every bad value is one line naming the option, before the model
loads where it can; a folder without tokenizer files names itself and --tokenizer; `serve` without the
server packages names the extra; every option has help text."""

from __future__ import annotations

import argparse

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
])
def test_engine_option_errors_name_the_cli_option(capsys, model_dir, argv, option):
    line = _one_line_error(capsys, ["generate", "x", "--model", model_dir, "--device", "cpu", *argv])
    assert line.startswith(f"metainfer: error: {option}"), line


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


def test_serve_without_the_server_packages_names_the_extra(capsys, monkeypatch):
    monkeypatch.setattr(serve_cli, "missing_server_packages", lambda: ["fastapi", "uvicorn"])
    line = _one_line_error(capsys, ["serve", "--model", MISSING], status=1)  # the install, not the invocation
    assert "pip install 'metainfer[serve]'" in line and "uvicorn" in line and MISSING not in line



@pytest.mark.parametrize("argv, option", [
    (["--port", "70000"], "--port"), (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["--max-queued-requests", "-1"], "--max-queued-requests"), (["other-model"], "MODEL or as --model"),
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
    line = _one_line_error(capsys, ["generate", "x", "--model", MISSING, "--seed", str(2**64)])
    assert line.startswith("metainfer: error: --seed: ") and "--sample-seed" not in line, line
    line = _one_line_error(capsys, ["generate", "x", "--model", MISSING, "--seed", "1", "--sample-seed", str(2**64)])
    assert line.startswith("metainfer: error: --sample-seed: "), line


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

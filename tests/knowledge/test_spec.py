"""`metainfer spec` (knowledge/spec_report.py) against transformers' own models and the engine's: parameter
counts and names from HF models built on the meta device, per-rank shapes from the engine's model built on
the meta device as one rank of a faked TP group, and the constraints the engine refuses at build."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from metainfer.config import ConfigError, ModelSpec
from metainfer.distributed.parallel_state import tp_state
from metainfer.kernels import REF_OPS
from metainfer.knowledge.spec_report import (
    build_report,
    compress_shapes,
    expand_shapes,
    fold_experts,
    load_config,
    param_shapes,
    spec_violations,
    to_yaml,
)
from metainfer.models.registry import model_class
from tests.helpers.tiny_models import smollm2_gguf, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = ("qwen3-8b", "qwen3-30b-a3b", "deepseek-v2-lite")
TPS = (1, 2, 4, 8)  # all valid for the three configs


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    out = {}
    for name in CONFIGS:
        folder = tmp_path_factory.mktemp(name)
        shutil.copy(os.path.join(ROOT, "benchmarks", "configs", f"{name}.json"), folder / "config.json")
        out[name] = str(folder)
    return out


def hf_shapes(folder: str) -> tuple[int, dict[str, tuple[int, ...]]]:
    """(parameter count, {name: shape}) of transformers' model built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return sum(p.numel() for p in model.parameters()), {n: tuple(p.shape) for n, p in model.named_parameters()}


def engine_model(spec: ModelSpec, tp: int):
    with tp_state(0, tp), torch.device("meta"):
        return model_class(spec)(spec, REF_OPS, dtype=torch.bfloat16)


def assert_agrees_with_engine(model, shapes: dict[str, tuple[int, ...]], num_experts: int) -> None:
    """Every checkpoint name maps (through the engine's own loader mapping) onto an engine parameter whose
    per-rank shape is the report's shards stacked: fused q/k/v and gate/up rows, experts along dim 0."""
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    parts: dict[str, list] = {}
    for name, shape in shapes.items():
        target, sid = model.map_checkpoint_name(name) or (name, None)
        if target == name:
            for fragment, (fused, s) in model.packed_modules_mapping.items():
                if f".{fragment}." in name:
                    target, sid = name.replace(f".{fragment}.", f".{fused}."), s
                    break
        assert target in params, f"{name} -> {target}: no such engine parameter"
        parts.setdefault(target, []).append((sid, shape))
    assert set(parts) == set(params)
    for target, shards in parts.items():
        want = params[target]
        if len(want) == 3:  # stacked experts [E + S, rows, cols]: E routed then S shared
            shared = want[0] - num_experts
            routed: dict[int, list] = {}
            for (expert, _), shape in shards:
                if expert == "shared":
                    rows, cols = (shape[0] // shared, shape[1]) if target.endswith("gate_up_proj") else \
                        (shape[0], shape[1] // shared)
                    routed.setdefault("shared", []).append((rows, cols))
                else:
                    routed.setdefault(expert, []).append(shape)
            assert len([e for e in routed if e != "shared"]) == num_experts
            for expert, got in routed.items():
                assert (sum(s[0] for s in got), got[0][1]) == want[1:], (target, expert, got, want)
        else:
            assert (sum(s[0] for _, s in shards), *shards[0][1][1:]) == want, (target, shards, want)
            if len(shards) > 1:
                assert len({s[1:] for _, s in shards}) == 1


@pytest.mark.parametrize("name", CONFIGS)
def test_params_and_names_equal_transformers(folders, name):
    count, shapes = hf_shapes(folders[name])
    report = build_report(load_config(folders[name]), tp=1)
    assert report["violations"] == []
    assert report["params_total"] == count
    assert fold_experts(expand_shapes(report["per_rank_shapes"])) == shapes  # every name, exact shapes


@pytest.mark.parametrize("name", CONFIGS)
def test_per_rank_shapes_agree_with_the_engine(folders, name):
    spec = ModelSpec.from_dict(load_config(folders[name]))
    names = set(param_shapes(spec, 1))
    for tp in TPS:
        report = build_report(load_config(folders[name]), tp=tp)
        assert report["violations"] == []
        shapes = expand_shapes(report["per_rank_shapes"])
        assert set(shapes) == names  # the same names at every tp
        assert_agrees_with_engine(engine_model(spec, tp), shapes, spec.num_experts)
        weights = sum(torch.Size(s).numel() * (4 if ".mlp.gate." in n and spec.router_fp32 else 2)
                      for n, s in shapes.items())
        assert report["weight_bytes_per_rank"] == weights


# -- tp > 1 against transformers' own tensor-parallel plan --------------------------------------------------
# transformers' config classes carry a TP plan (`base_model_tp_plan`: "layers.*.self_attn.q_proj": "colwise", ...);
# the model resolves it per parameter (`_expand_parallel_plan`) and `apply_tensor_parallelism` wraps each planned
# parameter as a DTensor of the style's placement (transformers/distributed/tensor_parallel.py): colwise and
# colwise_gather_output Shard(ndim - 2) (a Linear's out rows, its bias too), rowwise Shard(-1) (in columns; its
# bias Replicate), embedding_rowwise Shard(0) (the vocabulary; uneven: rank 0 holds ceil(V / tp) rows, as
# torch.chunk does), and replicated_with_grad_allreduce / mla_kv_a_proj shard nothing (they only hook the forward /
# backward); a parameter without an entry stays whole. The script below runs that code itself on the meta device in
# a fake process group of `tp` ranks (torch's test backend "fake": no communication), as rank 0, in a subprocess
# (the process group is process-wide), and prints every parameter's plan style, full and local shape.
_HF_TP_SCRIPT = r"""
import json, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, apply_tensor_parallelism

folder, out = sys.argv[1], {}
for tp in map(int, sys.argv[2:]):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    mesh = init_device_mesh("cpu", (tp,))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    plan = model._expand_parallel_plan(model.tp_plan)
    apply_tensor_parallelism(model, mesh, plan)
    full = {n: list(p.shape) for n, p in model.named_parameters()}
    local = lambda p: list(p.to_local().shape if isinstance(p, DTensor) else p.shape)
    hf = {n: {"style": plan.get(n), "full": full[n], "local": local(p)} for n, p in model.named_parameters()}
    for name, module in model.named_modules():  # the fused experts under transformers' own packed TP styles
        if name.endswith(".mlp.experts"):
            ALL_PARALLEL_STYLES["packed_colwise"].shard_param(module, "gate_up_proj", mesh)
            ALL_PARALLEL_STYLES["rowwise"].shard_param(module, "down_proj", mesh)
            for param in ("gate_up_proj", "down_proj"):
                hf[name + "." + param]["tp_styles"] = local(getattr(module, param))
    out[tp] = hf
    dist.destroy_process_group()
print(json.dumps(out))
"""


def hf_tp_plan_shapes(folder: str, tps: tuple[int, ...]) -> dict[int, dict[str, dict]]:
    """{tp: {HF parameter name: {"style", "full", "local"[, "tp_styles"]}}} from transformers' TP code (above)."""
    run = subprocess.run([sys.executable, "-c", _HF_TP_SCRIPT, folder, *map(str, tps)], capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return {int(tp): shapes for tp, shapes in json.loads(run.stdout.strip().splitlines()[-1]).items()}


def expected_from_hf_plan(name: str, hf: dict, spec: ModelSpec, tp: int) -> tuple[int, ...]:
    """rank 0's shape of `name` under transformers' plan, with the engine's deliberate differences as rules."""
    if ".mlp.experts." in name:
        # Rule 1, routed experts. transformers has no TP-plan entry for them (asserted here): Qwen3-MoE's and
        # DeepSeek-V2's configs put `mlp.experts` in `base_model_ep_plan` (grouped_gemm: whole experts per rank,
        # expert parallelism). The engine shards every expert's intermediate dimension instead (tensor-parallel
        # experts, as vLLM does without expert parallelism). The reference for that is transformers' own TP styles
        # for a fused [E, out, in] layout: packed_colwise on gate_up_proj [E, 2N, H] (gate and up halves split
        # alike, dim 1) and rowwise on down_proj [E, H, N] (dim -1), computed by the script.
        assert hf["style"] is None, f"{name}: transformers now plans the experts as {hf['style']!r}: compare with it"
        return tuple(hf["tp_styles"])
    if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")) \
            and spec.num_kv_heads < tp:
        # Rule 2, fewer KV heads than ranks (Qwen3-30B-A3B's 4 at tp 8). transformers' colwise would give each rank
        # part of a head (512 rows / 8 = 64 < head_dim 128); the engine replicates whole heads, one per rank
        # (constraint.tp_kv_heads: tp a multiple of the KV heads).
        assert hf["style"] == "colwise" and hf["local"][0] < spec.head_dim
        return (spec.head_dim, *hf["local"][1:])
    # Everything else is transformers' plan as it stands: q / o / MLP / shared experts / embedding / lm_head split,
    # MLA's kv_a_proj_with_mqa replicated (mla_kv_a_proj shards nothing) and its norms, q_norm / k_norm, the
    # router (`mlp.gate`: no entry; `layers.*.mlp.gate_proj` does not match it) and every layer norm whole.
    return tuple(hf["local"])


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_per_rank_shapes_follow_transformers_tp_plan(folders, name, capsys):
    """`metainfer spec --json --tp N` (N = 2, 4, 8) against the per-rank shapes transformers' own tensor-parallel
    code gives its model's parameters (rank 0 of a fake process group, meta device), under the plan in its config
    class, with the engine's two deliberate differences as explicit rules (expected_from_hf_plan)."""
    from metainfer.entrypoints.cli import main

    spec = ModelSpec.from_dict(load_config(folders[name]))
    tps = (2, 4, 8)
    hf_by_tp = hf_tp_plan_shapes(folders[name], tps)
    styles = {hf["style"] for hf in hf_by_tp[8].values()}
    assert {"colwise", "rowwise", "embedding_rowwise", "colwise_gather_output"} <= styles  # the plan applied
    rules = {"experts": 0, "kv": 0}
    for tp in tps:
        assert main(["spec", folders[name], "--tp", str(tp), "--json"]) == 0
        ours = fold_experts(expand_shapes(json.loads(capsys.readouterr().out)["per_rank_shapes"]))
        hf = hf_by_tp[tp]
        assert set(ours) == set(hf)
        wrong = {}
        for param, entry in hf.items():
            want = expected_from_hf_plan(param, entry, spec, tp)
            rules["experts"] += ".mlp.experts." in param
            rules["kv"] += tuple(entry["local"]) != want and ".mlp.experts." not in param
            if ours[param] != want:
                wrong[param] = (ours[param], want, entry["style"])
        assert wrong == {}, f"tp={tp}: (ours, transformers' plan, style): {dict(list(wrong.items())[:8])}"
    assert bool(rules["experts"]) == bool(spec.moe_layers)
    assert bool(rules["kv"]) == (name == "qwen3-30b-a3b")  # the only one with fewer KV heads (4) than a tp (8)


def test_known_per_rank_shapes(folders):
    """A few by hand: KV heads replicated (4 KV heads at tp=8), vocabulary padded, MLA split by heads."""
    moe = expand_shapes(build_report(load_config(folders["qwen3-30b-a3b"]), tp=8)["per_rank_shapes"])
    assert moe["model.layers.0.self_attn.k_proj.weight"] == (128, 2048)
    assert moe["model.layers.0.self_attn.q_proj.weight"] == (512, 2048)
    assert moe["model.layers.5.mlp.experts.127.down_proj.weight"] == (2048, 96)
    assert moe["model.layers.5.mlp.gate.weight"] == (128, 2048)
    assert moe["model.embed_tokens.weight"] == (151936 // 8, 2048)
    ds = expand_shapes(build_report(load_config(folders["deepseek-v2-lite"]), tp=4)["per_rank_shapes"])
    assert ds["model.layers.0.self_attn.q_proj.weight"] == (4 * 192, 2048)
    assert ds["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (576, 2048)
    assert ds["model.layers.0.self_attn.kv_b_proj.weight"] == (4 * 256, 512)
    assert ds["model.layers.0.mlp.gate_proj.weight"] == (10944 // 4, 2048)
    assert ds["model.layers.3.mlp.shared_experts.gate_proj.weight"] == (2 * 1408 // 4, 2048)
    assert ds["model.layers.3.mlp.experts.63.up_proj.weight"] == (1408 // 4, 2048)
    odd = ModelSpec.from_dict({**load_config(folders["qwen3-8b"]), "vocab_size": 151_937})
    assert param_shapes(odd, 4)["lm_head.weight"] == (37_985, 4096)  # ceil(V / tp) rows


def test_kv_bytes_and_memory(folders):
    ds = build_report(load_config(folders["deepseek-v2-lite"]), tp=1)
    assert ds["kv_bytes_per_token"] == 31_104 and ds["memory"] is None
    assert build_report(load_config(folders["deepseek-v2-lite"]), tp=8)["kv_bytes_per_token"] == 31_104  # replicated
    q8 = build_report(load_config(folders["qwen3-8b"]), tp=1, gpu_memory_gib=80)
    assert q8["kv_bytes_per_token"] == 147_456
    assert build_report(load_config(folders["qwen3-8b"]), kv_cache_dtype="fp8")["kv_bytes_per_token"] == 73_728
    assert build_report(load_config(folders["qwen3-30b-a3b"]), tp=8)["kv_bytes_per_token"] == 2 * 48 * 128 * 2
    mem = q8["memory"]
    assert mem["budget_bytes"] == int(80 * 2**30 * 0.9)
    assert mem["kv_bytes_available"] == mem["budget_bytes"] - q8["weight_bytes_per_rank"]
    assert mem["kv_tokens"] == mem["kv_bytes_available"] // 147_456
    assert mem["max_sequences_at_max_model_len"] == mem["kv_tokens"] // 40_960
    assert build_report(load_config(folders["qwen3-8b"]), gpu_memory_gib=8)["memory"]["kv_tokens"] == 0


@pytest.mark.parametrize("name,tp,overrides,node", [
    ("qwen3-8b", 3, {}, "constraint.tp_divides_heads"),
    ("deepseek-v2-lite", 64, {}, "constraint.tp_divides_heads"),
    ("qwen3-8b", 16, {"num_key_value_heads": 6, "num_attention_heads": 48}, "constraint.tp_kv_heads"),
    ("qwen3-8b", 4, {"intermediate_size": 12290}, "constraint.tp_divides_intermediate"),
    ("qwen3-30b-a3b", 4, {"intermediate_size": 12290}, None),  # every layer MoE: the dense size is unused
    ("qwen3-30b-a3b", 4, {"moe_intermediate_size": 770}, "constraint.tp_divides_moe_intermediate"),
    ("qwen3-8b", 1, {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "constraint.rope_scaling_supported"),
    ("qwen3-8b", 1, {"architectures": ["MistralForCausalLM"]}, "constraint.supported_architecture"),
])
def test_violations_name_the_node(folders, name, tp, overrides, node):
    report = build_report({**load_config(folders[name]), **overrides}, tp=tp)
    assert [v["node"] for v in report["violations"]][:1] == ([node] if node else [])
    assert report["architecture"] == (overrides.get("architectures") or [report["architecture"]])[0]
    if node and node != "constraint.rope_scaling_supported":
        assert report["per_rank_shapes"] is None


def test_memory_plan_says_which_sequence_length_it_assumes(folders, capsys):
    from metainfer.entrypoints.cli import main

    config = load_config(folders["qwen3-8b"])
    default = build_report(config, gpu_memory_gib=80)["memory"]
    assert (default["max_model_len"], default["max_model_len_from"]) == (40_960, "max_position_embeddings")
    short = build_report(config, gpu_memory_gib=80, max_model_len=4096)["memory"]
    assert (short["max_model_len"], short["max_model_len_from"]) == (4096, "--max-model-len")
    assert short["kv_tokens"] == default["kv_tokens"] and short["max_sequences_at_max_model_len"] == \
        short["kv_tokens"] // 4096 > default["max_sequences_at_max_model_len"]
    assert main(["spec", folders["qwen3-8b"], "--gpu-memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "max_model_len 40,960 tokens (the config's max_position_embeddings)" in out
    assert "model.layers.{i}.self_attn.q_proj.weight [4096, 4096] i=0-35" in out  # the text view is compressed
    assert main(["spec", folders["qwen3-8b"], "--gpu-memory-gib", "80", "--max-model-len", "0"]) == 2
    assert "--max-model-len must be >= 1" in capsys.readouterr().err


def test_kv_cache_dtype_violation(folders):
    spec = ModelSpec.from_dict(load_config(folders["qwen3-8b"]))
    assert spec_violations(spec, 1, "int4") == [{"node": "constraint.kv_cache_dtype", "message":
                                                 "kv_cache_dtype must be one of auto, fp8, fp8_e4m3; got 'int4'"}]
    assert spec_violations(spec, 8, "fp8") == []


@pytest.mark.parametrize("argv, expected", [
    (["--gpu-memory-gib", "-1"], "argument --gpu-memory-gib: must be > 0 and finite, got -1"),
    (["--gpu-memory-gib", "0"], "argument --gpu-memory-gib: must be > 0 and finite, got 0"),
    (["--gpu-memory-gib", "nan"], "argument --gpu-memory-gib: must be > 0 and finite, got nan"),
    (["--gpu-memory-gib", "inf"], "argument --gpu-memory-gib: must be > 0 and finite, got inf"),
    (["--gpu-memory-gib", "80GB"], "argument --gpu-memory-gib: expected float > 0 and finite, got '80GB'"),
    (["--kv-cache-dtype", "int4"],
     "argument --kv-cache-dtype: invalid choice: 'int4' (choose from 'auto', 'fp8', 'fp8_e4m3')"),
])
def test_bad_spec_option_values_are_usage_errors(folders, capsys, argv, expected):
    """A negative GPU memory printed negative bytes; --kv-cache-dtype int4 exited 1 naming the report's node
    (constraint.kv_cache_dtype): both are bad option values, exit 2 and one line naming the option."""
    from metainfer.entrypoints.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["spec", folders["qwen3-8b"], *argv])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and not out and err.count("\n") == 1, (exit_.value.code, out, err)
    assert err.startswith(f"metainfer spec: error: {expected}"), err
    for good in (["--gpu-memory-gib", "0.5"], ["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "fp8_e4m3"]):
        assert main(["spec", folders["qwen3-8b"], *good]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("gib", [-1, 0, float("nan"), float("inf")])
def test_build_report_refuses_a_memory_that_is_not_positive(folders, gib):
    with pytest.raises(ConfigError, match="gpu_memory_gib must be a finite number > 0"):
        build_report(load_config(folders["qwen3-8b"]), gpu_memory_gib=gib)


def test_cli_exit_status_and_one_line(folders, capsys, tmp_path):
    from metainfer.entrypoints.cli import main

    assert main(["spec", folders["qwen3-8b"], "--tp", "3", "--json"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["violations"][0]["node"] == "constraint.tp_divides_heads"
    assert err.count("\n") == 1 and "constraint.tp_divides_heads" in err and "num_attention_heads (32)" in err
    assert main(["spec", folders["qwen3-8b"], "--tp", "3"]) == 1  # the summary says why it stops short
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == ("per-rank facts: none at tp=3 (violated: constraint.tp_divides_heads, "
                                    "constraint.tp_kv_heads; the error below)")
    assert err.count("\n") == 1 and "constraint.tp_divides_heads" in err
    target = tmp_path / "model_spec.yaml"
    assert main(["spec", folders["deepseek-v2-lite"], "--tp", "2", "-o", str(target)]) == 0
    yaml = pytest.importorskip("yaml")
    assert yaml.safe_load(target.read_text()) == build_report(load_config(folders["deepseek-v2-lite"]), tp=2)
    assert main(["spec", folders["qwen3-8b"], "-o", str(tmp_path / "s.json"), "--gpu-memory-gib", "80"]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["memory"]["kv_tokens"] > 0


def test_cli_module_prints_json(folders):
    run = subprocess.run([sys.executable, "-m", "metainfer.entrypoints.cli", "spec", folders["qwen3-30b-a3b"],
                          "--json", "--tp", "4"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert list(report) == ["architecture", "family", "features", "params_total", "per_rank_shapes",
                            "weight_bytes_per_rank", "kv_bytes_per_token", "memory", "violations"]
    assert report["family"] == "qwen3_moe" and report["features"]["moe"]["num_moe_layers"] == 48
    shapes = report["per_rank_shapes"]  # every HF parameter name, not the compressed templates
    assert len(shapes) == 3 + 48 * (9 + 3 * 128) and not any("{" in name for name in shapes)
    assert shapes["model.layers.47.mlp.experts.127.gate_proj.weight"] == [192, 2048]
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == [128, 2048]  # 4 KV heads over tp 4: one each


def test_gguf_header_report():
    """The embedded SmolLM2 GGUF: shapes from the header's tensor list, count from transformers' Llama."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    from metainfer.loader.gguf import _hf_name

    path = smollm2_gguf()
    config = load_config(path)  # the header is parsed in ~3 s: once
    report = build_report(config, tp=1)
    assert report["architecture"] == "LlamaForCausalLM" and report["violations"] == []
    header = {_hf_name(t.name): tuple(int(d) for d in reversed(t.shape)) for t in gguf.GGUFReader(path).tensors}
    assert expand_shapes(report["per_rank_shapes"]) == header
    with torch.device("meta"):
        hf = LlamaForCausalLM(LlamaConfig(**config))
    assert report["params_total"] == sum(p.numel() for p in hf.parameters())
    assert report["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert build_report(config, tp=2)["violations"][0]["node"] == "constraint.tp_divides_heads"  # 9 heads


def test_compressed_form_round_trips_and_is_small():
    shapes = {"model.layers.0.a.weight": (2,), "model.layers.2.a.weight": (2,), "model.layers.1.a.weight": (3,),
              "model.layers.0.mlp.experts.0.w": (1, 2), "model.layers.0.mlp.experts.1.w": (1, 2), "x": (5,)}
    compressed = compress_shapes(shapes)
    assert compressed["model.layers.0.a.weight"] == [2]  # shapes differ by layer: left expanded
    assert compressed["model.layers.{i}.mlp.experts.{e}.w"] == {"shape": [1, 2], "i": [[0, 0]], "e": [[0, 1]]}
    assert expand_shapes(compressed) == shapes
    assert "model.layers.{i}" in to_yaml(compressed)


# -- the engine refuses what the report flags, before any weight is read ------------------------------------
@pytest.fixture
def no_weights(monkeypatch):
    import torch.multiprocessing as mp

    from metainfer.worker import model_runner

    def refuse(*a, **k):
        raise AssertionError("weights were read or a worker was started")
    monkeypatch.setattr(model_runner, "load_model_weights", refuse)
    monkeypatch.setattr(mp, "get_context", refuse)


def _saved_tiny(folder, **overrides) -> str:
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(tiny_config("qwen3", **overrides).to_dict(), f)
    return str(folder)


def test_engine_refuses_tp3_naming_the_node(tmp_path, no_weights):
    from metainfer import LLM

    folder = _saved_tiny(tmp_path)
    spec = ModelSpec.from_file(os.path.join(folder, "config.json"))
    assert spec_violations(spec, 3)[0]["node"] == "constraint.tp_divides_heads"
    with pytest.raises(ConfigError, match=r"constraint\.tp_divides_heads: num_attention_heads \(4\)"):
        LLM(folder, device="cpu", tensor_parallel_size=3)


def test_engine_refuses_at_tp1_too(tmp_path, no_weights):
    from metainfer import LLM

    folder = _saved_tiny(tmp_path, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ConfigError, match=r"constraint\.rope_scaling_supported: rope_scaling type 'dynamic'"):
        LLM(folder, device="cpu", tensor_parallel_size=1)


def test_unsupported_features_are_refused_by_node(tmp_path):
    """MLP biases and sliding-window attention: the spec report names constraint.supported_features, and the
    engine refuses the same config through the one shared check (validate_tp_config) before any weight."""
    import json as _json

    from metainfer.config import ConfigError, ModelSpec
    from metainfer.knowledge.spec_report import spec_violations
    from metainfer.models.shape_contract import validate_tp_config

    with open(os.path.join(ROOT, "benchmarks", "configs", "qwen3-8b.json")) as f:
        cfg = _json.load(f)
    for extra in ({"mlp_bias": True}, {"use_sliding_window": True, "sliding_window": 4096}):
        spec = ModelSpec.from_dict({**cfg, **extra})
        assert [v["node"] for v in spec_violations(spec, 1)] == ["constraint.supported_features"]
        with pytest.raises(ConfigError, match="constraint.supported_features"):
            validate_tp_config(spec, 1)
    assert spec_violations(ModelSpec.from_dict(cfg), 1) == []


def test_every_violation_node_is_listed_and_in_the_blueprint():
    """NODES names every constraint node spec_violations can report (each bad("node", ...) call in the
    module), and each is a blueprint node."""
    import ast

    from metainfer.knowledge import spec_report
    from metainfer.knowledge.blueprint import load_blueprint

    with open(spec_report.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    emitted = {node.args[0].value for node in ast.walk(tree)
               if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "bad"
               and node.args and isinstance(node.args[0], ast.Constant)}
    assert "constraint.supported_features" in emitted
    assert emitted <= set(spec_report.NODES), emitted - set(spec_report.NODES)
    assert set(spec_report.NODES) <= {n["id"] for n in load_blueprint()["nodes"]}


def test_spec_takes_a_config_json_path_and_refuses_a_bad_tp_as_usage(folders, capsys, tmp_path):
    """`metainfer spec path/to/config.json` is the folder's report; --tp 0 is a bad option value (exit 2, one line
    naming --tp), a tp the model cannot be split by a violation (exit 1)."""
    import os

    from metainfer.entrypoints.cli import main

    config_path = os.path.join(folders["qwen3-8b"], "config.json")
    assert load_config(config_path) == load_config(folders["qwen3-8b"])
    assert main(["spec", config_path, "--tp", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == build_report(load_config(folders["qwen3-8b"]), tp=2)
    assert main(["spec", config_path, "--tp", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tp must be >= 1" in err
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    assert main(["spec", str(broken)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_spec_output_file_problems_are_one_line(folders, capsys, tmp_path):
    """-o into a missing folder, onto a folder, or with a name that says no format: exit 2, one line naming -o."""
    from metainfer.entrypoints.cli import main

    (tmp_path / "a.yaml").mkdir()
    for target in (tmp_path / "missing" / "x.yaml", tmp_path / "a.yaml", tmp_path / "x.txt"):
        assert main(["spec", folders["qwen3-8b"], "-o", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"metainfer spec: error: -o {target}: "), err
    assert not (tmp_path / "x.txt").exists()
    assert main(["spec", folders["qwen3-8b"], "-o", str(tmp_path / "x.yml")]) == 0


@pytest.mark.parametrize("argv", [["spec", "deepseek-v2-lite", "--json"], ["blueprint", "--json"]])
def test_a_reader_that_closes_early_ends_the_output_quietly(folders, argv):
    """`metainfer spec ... | head -1`: the reader closes after one line while the command still writes (the JSON
    is far larger than a pipe's buffer, so the write meets the closed pipe); no BrokenPipeError traceback, and
    the command's own exit status."""
    argv = [folders[a] if a in folders else a for a in argv]
    proc = subprocess.Popen([sys.executable, "-m", "metainfer.entrypoints.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT)
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert first.strip() == b"{"
    assert "BrokenPipeError" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("overrides,node,message", [
    ({"architectures": ["MixtralForCausalLM"]}, "constraint.supported_architecture",
     "unsupported architecture ['MixtralForCausalLM']"),
    ({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "kv_lora_rank": 512,
      "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 8,
      "scoring_func": "sigmoid"}, "constraint.supported_features", "scoring_func 'sigmoid' is not supported"),
])
def test_an_unsupported_model_is_refused_by_node_in_spec_and_engine(folders, tmp_path, no_weights, capsys,
                                                                     overrides, node, message):
    """An architecture the engine does not route (Mixtral) or a routing it does not implement: `metainfer spec`
    reports the node (exit 1) and the engine refuses the same config with the same node and message (the one
    path, spec_report.model_spec), before the tokenizer or any weight."""
    from metainfer import LLM
    from metainfer.entrypoints.cli import main

    config = {**load_config(folders["qwen3-8b"]), **overrides}
    (tmp_path / "config.json").write_text(json.dumps(config))
    report = build_report(config, tp=2)
    assert [v["node"] for v in report["violations"]] == [node] and message in report["violations"][0]["message"]
    assert report["per_rank_shapes"] is None
    assert main(["spec", str(tmp_path), "--tp", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{node}: {message}" in err
    with pytest.raises(ConfigError) as caught:
        LLM(str(tmp_path), device="cpu")
    assert str(caught.value) == f"{node}: {report['violations'][0]['message']}"

"""The blueprint against the code (metainfer/knowledge/blueprint.py): in step as shipped, and every kind of
drift caught: a wrong formula, a parameter without a node, a reference or a test that does not exist, a
document the schema refuses. Formulas are evaluated without eval()."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from metainfer.knowledge.blueprint import check_blueprint, evaluate, load_blueprint


@pytest.fixture(scope="module")
def blueprint():
    return load_blueprint()


def _node(doc, node_id):
    return next(n for n in doc["nodes"] if n["id"] == node_id)


def test_blueprint_is_in_step_with_the_code(blueprint):
    result = check_blueprint(blueprint)
    assert result["errors"] == []
    assert result["nodes"] >= 80 and result["shapes_compared"] > 1000
    assert len(blueprint["categories"]) == 11
    assert {n["category"] for n in blueprint["nodes"]} == set(blueprint["categories"])


def test_a_broken_formula_is_drift(blueprint):
    doc = copy.deepcopy(blueprint)
    params = _node(doc, "dims.gqa_attention")["formula"]["params"]
    params["model.layers.{i}.self_attn.qkv_proj.weight"][0] = "(heads_per_rank + kv_heads_per_rank) * head_dim"
    errors = check_blueprint(doc)["errors"]
    assert errors and all(e.startswith("dims.gqa_attention: ") for e in errors)
    assert any("qwen3-8b tp=2" in e and "qkv_proj" in e for e in errors)


def test_a_parameter_without_a_formula_is_drift(blueprint):
    doc = copy.deepcopy(blueprint)
    doc["nodes"] = [n for n in doc["nodes"] if n["id"] != "dims.mla"]
    errors = check_blueprint(doc)["errors"]
    assert any("deepseek-v2-lite tp=1: parameter 'model.layers.0.self_attn.kv_b_proj.weight' has no blueprint"
               in e for e in errors)


def test_missing_code_tests_and_links_are_drift(blueprint):
    doc = copy.deepcopy(blueprint)
    node = _node(doc, "kernel.rms_norm")
    node["ref_code"].append("metainfer.kernels.rms_norm:no_such_kernel")
    node["tests"].append("tests/kernels/test_elementwise.py::test_no_such_test")
    node["phase"] = "P99"
    node["failure_modes"] = ["fm.not_in_the_library"]
    errors = check_blueprint(doc)["errors"]
    assert any("no_such_kernel" in e for e in errors) and any("test_no_such_test" in e for e in errors)
    assert any("unknown phase 'P99'" in e for e in errors) and any("fm.not_in_the_library" in e for e in errors)


def test_the_schema_refuses_a_malformed_node(blueprint):
    doc = copy.deepcopy(blueprint)
    del _node(doc, "kernel.rms_norm")["contract"]
    _node(doc, "kernel.silu_and_mul")["category"] = "kernels"
    errors = check_blueprint(doc)["errors"]
    assert any("'contract' is a required property" in e for e in errors)


def test_formulas_are_arithmetic_only():
    symbols = {"num_heads": 32, "tp": 4, "num_kv_heads": 8}
    assert evaluate("max(1, num_kv_heads // tp) * 2 + cdiv(num_heads, 3)", symbols) == 15
    assert evaluate("7 if tp > 2 and num_heads == 32 else 0", symbols) == 7
    for bad in ("__import__('os')", "num_heads.bit_length()", "num_heads / tp", "[1, 2]", "unknown + 1"):
        with pytest.raises(ValueError):
            evaluate(bad, symbols)


def test_cli_prints_and_checks(tmp_path, blueprint):
    run = [sys.executable, "-m", "metainfer.entrypoints.cli", "blueprint"]
    printed = subprocess.run([*run, "--json"], capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0 and json.loads(printed.stdout)["nodes"]
    ok = subprocess.run([*run, "check"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "blueprint check: ok" in ok.stdout, ok.stderr[-2000:]
    doc = copy.deepcopy(blueprint)
    _node(doc, "dims.moe")["formula"]["params"]["model.layers.{i}.mlp.gate.weight"] = ["num_experts + 1", "hidden_size"]
    broken = tmp_path / "blueprint.json"
    broken.write_text(json.dumps(doc))
    bad = subprocess.run([*run, "check", "--file", str(broken)], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "drift: dims.moe:" in bad.stderr


def test_a_kernel_without_a_node_is_drift(blueprint):
    doc = copy.deepcopy(blueprint)
    doc["nodes"] = [n for n in doc["nodes"] if n["id"] != "kernel.fused_moe"]
    errors = check_blueprint(doc)["errors"]
    assert any(e.startswith("kernel op fused_moe (metainfer.kernels.fused_moe:fused_moe_triton)") for e in errors)
    assert any(e.startswith("kernel op fused_moe (metainfer.kernels.moe_ref:fused_moe_ref)") for e in errors)


# sha256 of the real models' config.json as published (Qwen/Qwen3-8B, Qwen/Qwen3-30B-A3B,
# deepseek-ai/DeepSeek-V2-Lite), taken from the team's shared copies, byte-identical to benchmarks/configs/.
REAL_CONFIG_SHA256 = {
    "qwen3-8b": "c059cd48dad3b980bab8a5cee3ace5f1844a526eb49f97ac46472fcbc508549e",
    "qwen3-30b-a3b": "23a397de797661c3b489afd826b2328069624e161cec437296ee5a322304bc9e",
    "deepseek-v2-lite": "b6f78caa25a18d9d83de564e8f164b2518bbe169e152cb3888dbcadf8ec903f6",
}


def test_the_checked_configs_are_the_shared_real_ones():
    """The check reads benchmarks/configs (a clean clone has them): each file must be the real config.json,
    byte for byte (its pinned sha256, on every checkout); where the team's shared configs are present beside the
    checkout they must be the same documents too."""
    import hashlib
    import os

    from metainfer.knowledge.blueprint import FAMILY_CONFIGS, REPO_ROOT

    names = [name for names in FAMILY_CONFIGS.values() for name in names]
    assert sorted(names) == sorted(REAL_CONFIG_SHA256)  # a family config without a pin is a gap
    for name in names:
        with open(os.path.join(REPO_ROOT, "benchmarks", "configs", f"{name}.json"), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == REAL_CONFIG_SHA256[name], name
    shared = os.path.join(os.path.dirname(REPO_ROOT), "shared", "configs")
    if not os.path.isdir(shared):
        return  # the pins above are the check; the shared copies are an extra one where they exist
    for name in names:
        with open(os.path.join(REPO_ROOT, "benchmarks", "configs", f"{name}.json")) as ours, \
                open(os.path.join(shared, name, "config.json")) as theirs:
            assert json.load(ours) == json.load(theirs), name


def test_code_without_a_node_is_drift(blueprint):
    """Node completeness: drop the node of the row-parallel layer and the class is reported; an exemption for
    code that is gone is drift too; public_refs must be stated."""
    from metainfer.knowledge.blueprint import check_node_coverage, check_schema

    doc = copy.deepcopy(blueprint)
    doc["nodes"] = [n for n in doc["nodes"] if n["id"] != "layer.row_parallel"]
    assert "coverage: metainfer.layers.linear:RowParallelLinear has no blueprint node (add one, or list it in " \
        "coverage.exempt with why)" in check_node_coverage(doc)
    doc = copy.deepcopy(blueprint)
    doc["coverage"]["exempt"]["metainfer.layers.linear:GoneLinear"] = "was here once, long ago"
    assert "coverage: exempt metainfer.layers.linear:GoneLinear does not exist (any more)" in check_node_coverage(doc)
    doc = copy.deepcopy(blueprint)
    _node(doc, "layer.row_parallel")["public_refs"] = []
    assert any("nodes/" in e and "public_refs" in e for e in check_schema(doc))


def test_a_ref_neither_perturbed_nor_exempt_is_drift(blueprint):
    from metainfer.knowledge.blueprint import check_perturb_fields

    doc = copy.deepcopy(blueprint)
    node = _node(doc, "kernel.rms_norm")
    del node["perturb"]["exempt"]["metainfer.kernels.rms_norm:rms_norm_triton"]
    node["perturb"]["targets"].append("metainfer.kernels.rms_norm:no_such_function")
    errors = check_perturb_fields(doc)
    assert any("'metainfer.kernels.rms_norm:rms_norm_triton' is neither a perturbation target nor exempt" in e
               for e in errors)
    assert any("no_such_function" in e for e in errors)


def test_a_renamed_parameter_id_is_drift(tmp_path):
    """A test id's "[param]" must be one pytest collects: renaming a parametrize id leaves the blueprint's
    reference dangling, which the check names (and so does the failure-mode library's check)."""
    from metainfer.knowledge.blueprint import check_tests, missing_parametrized_ids
    from metainfer.knowledge.mutants import _test_exists, check_library, load_failure_modes

    test_file = tmp_path / "tests" / "test_p.py"
    test_file.parent.mkdir()
    test_file.write_text("import pytest\n\n\n@pytest.mark.parametrize('x', [1, 2], ids=['one', 'two'])\n"
                         "def test_x(x):\n    pass\n")
    doc = {"nodes": [{"id": "n", "tests": ["tests/test_p.py::test_x[one]", "tests/test_p.py::test_x[two]"]}],
           "phases": []}
    assert check_tests(doc, str(tmp_path)) == []
    test_file.write_text(test_file.read_text().replace("'two'", "'deux'"))
    assert check_tests(doc, str(tmp_path)) == [
        "n: test 'tests/test_p.py::test_x[two]': pytest collects no parameter id 'test_x[two]' in tests/test_p.py"]
    assert _test_exists("tests/test_p.py::test_x[two]", tmp_path) is None  # the name alone still resolves
    assert list(missing_parametrized_ids(["tests/test_p.py::test_x[two]"], str(tmp_path))) == [
        "tests/test_p.py::test_x[two]"]
    mode = {**load_failure_modes()[0], "tests": ["tests/test_p.py::test_x[two]"]}
    assert any("pytest collects no parameter id 'test_x[two]'" in p for p in check_library([mode], tmp_path))


def test_the_schema_requires_30_failure_modes(blueprint):
    from metainfer.knowledge.blueprint import check_schema

    assert check_schema(blueprint) == []
    short = copy.deepcopy(blueprint)
    short["failure_modes"] = short["failure_modes"][:29]
    assert [e for e in check_schema(short) if e.startswith("schema: failure_modes: ")]  # "... is too short"
    missing = copy.deepcopy(blueprint)
    del missing["failure_modes"]
    assert any("'failure_modes' is a required property" in e for e in check_schema(missing))


def test_docs_links_must_land_on_a_heading(blueprint, tmp_path):
    """A ref_docs entry without an anchor, with one that is not a heading, or with one that only a `#` comment
    inside a fenced code block spells, is drift; every shipped node's anchors resolve."""
    from metainfer.knowledge.blueprint import check_docs

    assert check_docs(blueprint) == []
    doc = copy.deepcopy(blueprint)
    _node(doc, "sampler.top_p")["ref_docs"] = ["docs/CONTRACTS.md#no-such-section"]
    assert "sampler.top_p: ref_docs 'docs/CONTRACTS.md#no-such-section': no such heading" in \
        check_blueprint(doc)["errors"]
    doc = copy.deepcopy(blueprint)
    _node(doc, "kernel.rms_norm")["ref_docs"] = ["docs/CONTRACTS.md"]
    assert any(e.startswith("schema: ") and "'docs/CONTRACTS.md' does not match" in e
               for e in check_blueprint(doc)["errors"])
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "X.md").write_text("# Title\n```bash\n# a comment\n```\n## Real heading\n")
    probe = {"nodes": [{"id": "x.y", "ref_docs": ["docs/X.md#a-comment", "docs/X.md#real-heading", "docs/X.md"]}]}
    assert check_docs(probe, str(tmp_path)) == [
        "x.y: ref_docs 'docs/X.md#a-comment': no such heading",
        "x.y: ref_docs 'docs/X.md': names no heading (file.md#anchor)"]


def test_every_sampler_feature_has_its_node(blueprint):
    """One node per SamplingParams feature the sampler or the stop logic implements, each with a test."""
    ids = {n["id"] for n in blueprint["nodes"]}
    features = {"greedy", "temperature", "top_k", "top_p", "min_p", "penalties", "min_tokens", "seed", "logprobs",
                "stop_strings", "stop_ids_and_length", "n"}
    assert {f"sampler.{f}" for f in features} <= ids


def test_a_quick_test_outside_its_full_selection_is_drift(blueprint):
    doc = copy.deepcopy(blueprint)
    phase = next(p for p in doc["phases"] if p["id"] == "P7")
    phase["full"] = [t for t in phase["full"] if t != "tests/engine/test_request_budget.py"]
    assert "P7: quick test 'tests/engine/test_request_budget.py' is not in the phase's full selection" in \
        check_blueprint(doc)["errors"]


def test_a_refused_split_is_reported_and_explained(blueprint):
    """A (config, tp) the engine refuses is skipped by the formula check, visibly: named with the node that
    refuses it (Qwen2.5-7B's 28 heads at tp 8), in the check's result and the CLI's summary."""
    from metainfer.knowledge.blueprint import check_formulas

    errors, compared, skipped = check_formulas(blueprint)
    assert errors == [] and compared > 1000
    assert skipped == ["qwen2.5-7b-dims tp=8: constraint.tp_divides_heads"]
    run = subprocess.run([sys.executable, "-m", "metainfer.entrypoints.cli", "blueprint", "check"],
                         capture_output=True, text=True, timeout=300)
    assert "1 split(s) skipped" in run.stdout and "skipped: qwen2.5-7b-dims tp=8: constraint.tp_divides_heads" \
        in run.stdout, run.stdout + run.stderr[-2000:]


def test_a_wrong_refusal_cannot_hide_drift(blueprint, monkeypatch):
    """A refusal the constraint nodes' `requires` do not explain is drift, not a silent skip: a spec_violations
    bug that checks the KV heads against tp * tp (refusing qwen3-8b's 8 KV heads at tp 4 and 8) would otherwise
    leave every formula unchecked at those splits. The converse too: a split the engine builds although a
    condition says it cannot."""
    from metainfer.knowledge import spec_report
    from metainfer.knowledge.blueprint import check_formulas
    from metainfer.models import shape_contract

    real = spec_report.spec_violations

    def buggy(spec, tp, kv_cache_dtype="auto"):
        found = real(spec, tp, kv_cache_dtype)
        if spec.num_kv_heads % (tp * tp) and not found:
            found = [{"node": "constraint.tp_kv_heads", "message": "num_key_value_heads is not divisible"}]
        return found

    monkeypatch.setattr(shape_contract, "spec_violations", buggy)
    errors, _, skipped = check_formulas(blueprint)
    assert "qwen3-8b tp=4: constraint.tp_kv_heads" in skipped
    assert any(e.startswith("qwen3-8b tp=4: the engine refuses it") and "every constraint's requires holds" in e
               for e in errors), errors
    monkeypatch.setattr(shape_contract, "spec_violations", real)
    doc = copy.deepcopy(blueprint)
    del _node(doc, "constraint.tp_divides_heads")["requires"]  # the real refusal is unexplained now
    assert any(e.startswith("qwen2.5-7b-dims tp=8: the engine refuses it") for e in check_formulas(doc)[0])
    _node(doc, "constraint.tp_divides_heads")["requires"] = "num_heads % (2 * tp) == 0"  # too strict
    errors = check_formulas(doc)[0]
    assert any(e.startswith("constraint.tp_divides_heads: qwen2.5-7b-dims tp=4: the engine builds this split")
               for e in errors), errors


def test_a_node_test_no_gate_runs_is_drift(blueprint):
    """Every test a node names is in some phase's full selection: the warm-up's tests (P7) taken out of P7's full
    selection are reported; the custom all-reduce tests run in their nodes' phase (P2)."""
    from metainfer.knowledge.blueprint import check_phase_selections, in_selection

    assert check_phase_selections(blueprint) == []
    phases = {p["id"]: p for p in blueprint["phases"]}
    for node_id in ("comm.custom_all_reduce", "comm.all_reduce_selection"):
        node = _node(blueprint, node_id)
        assert all(in_selection(t, phases[node["phase"]]["full"]) for t in node["tests"]), node_id
    doc = copy.deepcopy(blueprint)
    p7 = next(p for p in doc["phases"] if p["id"] == "P7")
    p7["full"].remove("tests/worker/test_warmup.py")
    errors = check_phase_selections(doc)
    assert errors and all(e.startswith("assembly.warmup: test 'tests/worker/test_warmup.py::") for e in errors)
    assert all(e.endswith("is in no phase's full selection (no gate runs it)") for e in errors)


def test_coverage_reaches_the_engine_entry_points(blueprint):
    """Node completeness covers the engine loop, sequences, tokenizer, sampling params, config, the LLM entry,
    outputs, the CLI and the server (issue 22: every assembly step and sampler feature): their modules are in
    coverage.scope, and a feature whose node is dropped (the server's request validation, SamplingParams) is
    reported."""
    from metainfer.knowledge.blueprint import check_node_coverage

    scope = set(blueprint["coverage"]["scope"])
    assert {"metainfer.engine.llm_engine", "metainfer.engine.sequence", "metainfer.engine.tokenizer",
            "metainfer.sampling_params", "metainfer.config", "metainfer.llm", "metainfer.outputs",
            "metainfer.entrypoints"} <= scope
    assert check_node_coverage(blueprint) == []
    doc = copy.deepcopy(blueprint)
    doc["nodes"] = [n for n in doc["nodes"] if n["id"] not in ("serve.request_validation", "sampler.sampling_params")]
    errors = check_node_coverage(doc)
    for ref in ("metainfer.entrypoints.openai.protocol:parse_request", "metainfer.entrypoints.openai.protocol:usage",
                "metainfer.sampling_params:SamplingParams"):
        assert f"coverage: {ref} has no blueprint node (add one, or list it in coverage.exempt with why)" in errors

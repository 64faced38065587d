"""The failure-mode library (the blueprint's `failure_modes`) and its mutation harness: the library is
well formed against the real tree and names the classic bugs of an inference engine; the harness catches a
real mutation in a sandbox copy, reports a harmless one as survived and a non-compiling one as broken."""

from __future__ import annotations

import json
from pathlib import Path

from metainfer.knowledge.mutants import check_library, classify, load_failure_modes, run_mutants

ROOT = Path(__file__).resolve().parents[2]

# the classic failure modes the library must cover, by the id chosen for each
CLASSICS = {
    "TP double slicing": "fm.tp_row_shard_sliced_twice",
    "TP wrong rank offset": "fm.tp_column_wrong_rank_offset",
    "missing all-reduce": "fm.tp_row_parallel_all_reduce_missing",
    "wrong GQA head mapping": "fm.gqa_head_mapping_interleaved",
    "neox vs interleaved rope (MLA)": "fm.mla_rope_neox_instead_of_interleaved",
    "neox vs interleaved rope (dense)": "fm.dense_rope_interleaved_instead_of_neox",
    "wrong rope theta": "fm.rope_theta_v5_key_ignored",
    "rope scaling ignored": "fm.llama3_rope_scaling_ignored",
    "KV slot off by one": "fm.kv_slot_off_by_one",
    "block table stale after preemption": "fm.block_table_stale_after_preemption",
    "prefix hash over a token not yet sampled": "fm.prefix_hash_over_pending_token",
    "wrong softmax scale": "fm.mla_softmax_scale_v_head_dim",
    "MLA YaRN mscale": "fm.mla_yarn_mscale_not_squared",
    "RMSNorm eps": "fm.rms_norm_eps_outside_rsqrt",
    "RMSNorm rounding point": "fm.rms_norm_rounding_point",
    "untied tied embeddings": "fm.tied_embeddings_copied_not_tied",
    "dropped qkv bias": "fm.qwen2_qkv_bias_dropped",
    "router top-k not renormalised": "fm.router_topk_not_renormalised",
    "shared experts skipped": "fm.shared_experts_skipped",
    "seed ignored": "fm.seed_ignored",
    "stop string split across tokens": "fm.stop_string_split_across_tokens",
}

CHEAP = "fm.prefix_hash_not_chained"  # one block-manager test: a couple of seconds in a fresh interpreter


def test_library_has_32_modes_and_the_classics():
    modes = load_failure_modes()
    ids = {m["id"] for m in modes}
    assert len(modes) >= 32 and len(ids) == len(modes)
    missing = {what: i for what, i in CLASSICS.items() if i not in ids}
    assert not missing, f"classic failure modes missing: {missing}"


def test_library_checks_clean_on_the_real_tree():
    assert check_library(load_failure_modes(), ROOT) == []


def test_every_find_occurs_exactly_once():
    for mode in load_failure_modes():
        m = mode["mutation"]
        text = (ROOT / m["file"]).read_text(encoding="utf-8")
        assert text.count(m["find"]) == 1, mode["id"]
        assert m["find"] != m["replace"], mode["id"]


def test_check_library_names_each_problem():
    good = next(m for m in load_failure_modes() if m["id"] == CHEAP)
    bad_find = {**good, "id": "fm.bad_find", "mutation": {**good["mutation"], "find": "no such text"}}
    no_file = {**good, "id": "fm.no_file", "mutation": {**good["mutation"], "file": "metainfer/nope.py"}}
    no_test = {**good, "id": "fm.no_test", "tests": ["tests/engine/test_block_manager.py::test_nope"]}
    extra_key = {**good, "id": "fm.extra", "note": "x"}
    problems = check_library([good, good, bad_find, no_file, no_test, extra_key], ROOT)
    text = "\n".join(problems)
    assert "duplicate id" in text and "occurs 0 times" in text and "does not exist" in text
    assert "no function test_nope" in text and "fm.extra: keys" in text
    assert len(problems) == 5


def test_classify():
    assert classify(1, "1 failed") == "caught"
    assert classify(0, "1 passed") == "survived"
    assert classify(2, "Interrupted: 1 error during collection") == "broken"
    assert classify(5, "no tests ran") == "broken"
    assert classify(None, "") == "timeout"


def test_run_mutants_catches_a_real_bug_and_lets_a_harmless_edit_survive():
    cheap = next(m for m in load_failure_modes() if m["id"] == CHEAP)
    first_line = (ROOT / "metainfer/engine/block_manager.py").read_text(encoding="utf-8").splitlines()[0]
    assert first_line.startswith('"""'), "the harmless edit rewords the module docstring's first line"
    harmless = {**cheap, "id": "fm.harmless_docstring_edit", "mutation": {
        "file": "metainfer/engine/block_manager.py", "find": first_line,
        "replace": first_line.replace('"""', '"""In short: ', 1)}}
    syntax = {**cheap, "id": "fm.does_not_compile", "mutation": {
        "file": "metainfer/engine/block_manager.py", "find": "def chain_hash(", "replace": "def chain_hash(("}}
    result = run_mutants([cheap, harmless, syntax], ROOT, timeout_s=120)
    assert result["baseline"]["status"] == "passed", result["baseline"]
    status = {m["id"]: m["status"] for m in result["modes"]}
    assert status == {CHEAP: "caught", "fm.harmless_docstring_edit": "survived", "fm.does_not_compile": "broken"}
    assert (result["caught"], result["total"]) == (1, 3) and result["score"] == 1 / 3
    assert result["survivors"] == ["fm.harmless_docstring_edit", "fm.does_not_compile"]
    # the checkout itself is never modified
    assert cheap["mutation"]["find"] in (ROOT / cheap["mutation"]["file"]).read_text(encoding="utf-8")


def test_exemptions_citing_mutations_name_a_mode_that_mutates_that_module():
    """A perturbation exemption that says its rule is covered by the failure-mode mutations must name such a
    mode, and that mode's mutation must edit the exempt function's own module."""
    import json
    import re

    blueprint = json.loads((ROOT / "metainfer" / "knowledge" / "blueprint.json").read_text(encoding="utf-8"))
    modes = {m["id"]: m for m in blueprint["failure_modes"]}
    bad = []
    for node in blueprint["nodes"]:
        for ref, why in (node.get("perturb") or {}).get("exempt", {}).items():
            if "mutat" not in why:
                continue
            module_file = ref.split(":")[0].replace(".", "/") + ".py"
            named = re.findall(r"fm\.[a-z0-9_]+[a-z0-9]", why)
            if not any(modes.get(i, {}).get("mutation", {}).get("file") == module_file for i in named):
                bad.append(f"{node['id']}: {ref}: {why}")
    assert bad == []


def test_the_sop_calls_the_quick_gate_time_a_target():
    """The 3-minute quick-gate time is a target; the SOP says so, pins no figure of its own (one that goes stale)
    and points at where the measurements are: README's knowledge section, whose current figure must be the
    newest `gate all --quick` evidence run (its commit's run.json: wall seconds, load at start and end, no
    failure)."""
    import re

    sop = " ".join((ROOT / "docs" / "SOP.md").read_text(encoding="utf-8").split())
    assert "stays within 3 minutes" not in sop
    paragraph = sop[sop.index("The target for the whole `gate all --quick` is 3 minutes on 2 cores"):]
    paragraph = paragraph[:paragraph.index("What the first complete perturbation run taught")]
    assert "a target, not a promise" in paragraph and "README.md's knowledge-package section" in paragraph
    assert "docs/results/gates_quick_tp/" in paragraph and "timing lock" in paragraph
    assert re.findall(r"\d+(?:\.\d+)? s\b", paragraph) == []  # no figure here: README carries the current one
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    quoted = re.search(r"`metainfer gate all --quick --evidence DIR`: \*\*([\d.]+) s wall\*\* at ([0-9a-f]{7,40})\b"
                       r"[^;]*?load ([\d.]+) at the start, ([\d.]+) at the end", readme)
    assert quoted, "README's knowledge section quotes no current quick-gate figure"
    wall, commit, load_start, load_end = quoted.groups()
    runs = {path: json.loads(path.read_text(encoding="utf-8")) for path in
            [*(ROOT / "docs" / "results" / "gates_quick_tp").glob("*/run.json"),
             ROOT / "docs" / "results" / "gates" / "run.json"]}
    newest = max(runs, key=lambda path: runs[path]["run_started_utc"])
    assert newest == ROOT / "docs" / "results" / "gates_quick_tp" / commit / "run.json", newest
    run = runs[newest]
    assert (run["run_wall_s"], run["load_1min_start"], run["load_1min_end"], run["failed"]) == \
        (float(wall), float(load_start), float(load_end), 0)


def test_a_captured_error_log_line_is_not_a_failed_test():
    """caught_by names pytest's FAILED / ERROR summary entries only: an engine log line captured in the output
    ("ERROR    metainfer:llm_engine.py:285 ...") once became a 'test id' and broke the catchers' baseline."""
    from metainfer.knowledge.mutants import _failed_tests

    output = ("ERROR    metainfer:llm_engine.py:285 request offline-0 failed a step\n"
              "FAILED tests/engine/test_x.py::test_a[1] - AssertionError: no\n"
              "ERROR tests/engine/test_y.py - ImportError\n")
    assert _failed_tests(output) == ["tests/engine/test_x.py::test_a[1]", "tests/engine/test_y.py"]

"""The quick gates' sensitivity: perturbing the output of any blueprint function that runs on the CPU path
must make `metainfer gate --quick`'s tests fail.

Every node says which of its `ref_code` run on the CPU path and how they are perturbed, in its `perturb`
field: `targets` (functions, methods or properties: each one a perturbation) and `exempt` ({ref: why it is
not perturbed}: GPU-only Triton kernels, CUDA graphs, declarations with no output). `blueprint check`
requires every ref_code of every node to be one of the two (blueprint.check_perturb_fields), so nothing is skipped
silently. What a perturbation does to a value depends on its kind (perturb_runtime.py: tensors x 1.01, ids
and counts + 1, decisions flipped, lists one element short, ...).

Each perturbation is a mutation for the failure-mode harness (metainfer/knowledge/mutants.py), applied to
a throw-away copy of the tree: a module-level function's `def` gets the perturbing decorator; a method or
property is replaced at the end of its class's module. The tests are the union of every phase's quick
selection, in stages that stop at the first failing one: the test that caught it in the last run (a hint),
the quick tests in the node's own test files (whole-engine ones included: a node whose contract only a
whole-model test checks is decided there without the rest first), the other unit-level quick tests, then the
ones that build whole engines against transformers (HEAVY: minutes on a busy machine); `-x` stops at the
first failure.
Every test run is one of the quick selections', so a failure is the quick gates' failure, and a perturbation
that survives every stage survived them all. There is no upfront baseline (the quick tests take minutes on a
busy machine): each test that caught a perturbation runs once unmutated at the end, and a perturbation whose
catcher fails there too counts as not caught.
"""

from __future__ import annotations

import os

from metainfer.knowledge.blueprint import in_selection, load_blueprint, locate_target

RUNTIME = "__import__('metainfer.knowledge.perturb_runtime', fromlist=['perturbed'])"
# left out of every perturbation run: the mutation itself adds a line or two to a module, and the module-size
# rule is a layout rule, not a contract a perturbed output could break
NOT_CONTRACTS = ("tests/structure/test_layout.py::test_module_size",)


def _mutation(target: str, root: str | None) -> dict:
    path, owner, name = locate_target(target)
    rel = os.path.relpath(path, root) if root else path
    if not owner:
        return {"file": rel, "find": f"\ndef {name}(", "replace": f"\n@{RUNTIME}.perturbed\ndef {name}("}
    return {"file": rel, "append": f"\n{RUNTIME}.perturb_attribute({owner}, {name!r})\n"}


def quick_tests(blueprint: dict | None = None) -> list[str]:
    blueprint = blueprint or load_blueprint()
    return list(dict.fromkeys(t for phase in blueprint["phases"] for t in phase["quick"]))


def _ordered(tests: list[str], first_files: set[str]) -> list[str]:
    """The same selection, the entries in the node's own test files first (a caught perturbation fails early)."""
    return sorted(tests, key=lambda t: t.split("::", 1)[0] not in first_files)


# quick tests that build whole engines and transformers references (seconds each, minutes on a busy machine):
# the last stage, for what the unit-level quick tests let through
HEAVY = ("tests/models/test_hf_parity.py", "tests/models/test_moe_families.py", "tests/mlx/",
         "tests/distributed/", "tests/entrypoints/", "tests/engine/test_sampling.py")


def previous_catchers(*paths: str | None) -> dict[str, list[str]]:
    """{perturbation id: the test that caught it} from earlier evidence (a report's JSON or a run's
    perturb_progress.jsonl): hints for the run order, never results."""
    import json

    hints: dict[str, list[str]] = {}
    for path in paths:
        if not path or not os.path.exists(path):
            continue
        with open(path) as f:
            text = f.read()
        modes = json.loads(text).get("modes", []) if path.endswith(".json") else \
            [json.loads(line) for line in text.splitlines() if line.strip()]
        hints.update({m["id"]: m["caught_by"] for m in modes if m.get("caught_by")})
    return hints


def cpu_path_targets(blueprint: dict | None = None) -> list[tuple[dict, str]]:
    blueprint = blueprint or load_blueprint()
    return [(n, t) for n in blueprint["nodes"] for t in (n.get("perturb") or {}).get("targets", [])]


def not_cpu_path(blueprint: dict | None = None) -> list[dict]:
    """The refs no perturbation covers, with the node's reason (the evidence lists them)."""
    blueprint = blueprint or load_blueprint()
    return [{"node": n["id"], "ref": ref, "reason": why}
            for n in blueprint["nodes"] for ref, why in (n.get("perturb") or {}).get("exempt", {}).items()]


def perturbation_modes(blueprint: dict | None = None, root: str | None = None,
                       only: list[str] | None = None, hints: dict[str, list[str]] | None = None) -> list[dict]:
    """One harness mode per CPU-path target (`only`: ids or node ids to keep). Its stages together are the quick
    selections, each without what an earlier one ran: the test that caught it before (`hints`), the quick tests
    of the node's own test files, the other unit-level quick tests, then the HEAVY ones."""
    blueprint = blueprint or load_blueprint()
    tests = quick_tests(blueprint)
    nodes: dict[str, list[dict]] = {}  # a target named by several nodes is perturbed once
    for node, target in cpu_path_targets(blueprint):
        nodes.setdefault(target, []).append(node)
    names = [t.partition(":")[2] for t in nodes]
    modes = []
    for target, owners in nodes.items():
        module, _, name = target.partition(":")
        # a qualname two modules share (communication.identity, custom_all_reduce.identity) is named by its module
        mode_id = f"perturb.{name}" if names.count(name) == 1 else f"perturb.{module.rpartition('.')[2]}.{name}"
        if only and mode_id not in only and not {n["id"] for n in owners} & set(only):
            continue
        own = {t.split("::", 1)[0] for n in owners for t in n["tests"]}
        ordered = _ordered(tests, own)
        hinted = [t for t in (hints or {}).get(mode_id, []) if in_selection(t, tests)]
        mine = [t for t in ordered if t.split("::", 1)[0] in own]  # the node's own files, heavy ones included
        cheap = [t for t in ordered if not t.startswith(HEAVY)]
        stages, seen = [], set()
        for stage in (hinted, mine, cheap, ordered):  # each: what the earlier ones left
            stage = [t for t in dict.fromkeys(stage) if t not in seen]
            seen.update(stage)
            if stage:
                stages.append(stage)
        modes.append({"id": mode_id, "title": f"{target}'s output perturbed", "tests": ordered, "stages": stages,
                      "symptom": "the quick gates must fail", "cause": f"{target}'s output perturbed",
                      "nodes": [n["id"] for n in owners], "mutation": _mutation(target, root)})
    return modes

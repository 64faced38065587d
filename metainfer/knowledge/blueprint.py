"""The blueprint: every contract of the engine as a node (metainfer/knowledge/blueprint.json, its JSON Schema
beside it), and the check that keeps it from drifting from the code.

`check_blueprint()` returns the list of drift errors (empty = in step):
  schema    the document against blueprint_schema.json (jsonschema);
  links     unique node ids, known categories and phases, failure-mode ids that exist, docs and their
            headings that exist;
  ref_code  every "module:qualname" imports, and every op of the kernel sets is named by a node;
  coverage  every public class / function of the engine's kernel, layer, attention, model, loader,
            scheduler, sampler, communication and assembly modules is named by a node or exempt with a
            reason (coverage.scope / coverage.exempt);
  perturb   every ref_code is a perturbation target on the CPU path or exempt with a reason (gate --perturb);
  tests     every pytest node id names an existing file and test function;
  formulas  every per-rank shape formula, evaluated from each supported family's real config
            (benchmarks/configs/) and variants of them (Qwen2-style qkv bias, tied Llama, q-LoRA MLA,
            Qwen2.5-7B's dimensions) at tp 1, 2, 4 and 8, equals the shape of the parameter in the model the
            engine builds on the meta device under that tp; and every parameter of those models is covered
            by some formula (a layer added without its node is drift too). A split the engine refuses is
            skipped and reported (`splits_skipped`), and the refusal must be the one the constraint nodes'
            `requires` conditions give, evaluated here: a wrong refusal cannot hide drift.
Formulas are expressions over the ModelSpec fields, `tp` and the blueprint's `definitions`, evaluated by a
small arithmetic evaluator (+ - * // %, comparisons, and/or, `x if c else y`, max, min, cdiv): no eval().
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import operator
import os
import re
from collections.abc import Iterable

KNOWLEDGE_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(KNOWLEDGE_DIR))
BLUEPRINT_PATH = os.path.join(KNOWLEDGE_DIR, "blueprint.json")
SCHEMA_PATH = os.path.join(KNOWLEDGE_DIR, "blueprint_schema.json")
TP_SIZES = (1, 2, 4, 8)
# each supported family's real config (copies of the shared configs, so a clean clone can check them)
FAMILY_CONFIGS = {"dense": ("qwen3-8b",), "qwen3_moe": ("qwen3-30b-a3b",), "deepseek_v2": ("deepseek-v2-lite",)}
# variants of those configs, so that every formula's `when` is true somewhere: (name, base, overrides)
CONFIG_VARIANTS = (
    ("qwen2-style", "qwen3-8b", {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}),
    ("llama-tied", "qwen3-8b", {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                "tie_word_embeddings": True}),
    ("deepseek-v2-qlora", "deepseek-v2-lite", {"q_lora_rank": 1536}),
    # Qwen2.5-7B's attention and MLP dimensions (28 heads, 4 KV heads): tp 8 is refused (28 % 8), a skip
    # the check reports and explains (constraint.tp_divides_heads' requires)
    ("qwen2.5-7b-dims", "qwen3-8b", {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                                     "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
                                     "intermediate_size": 18944, "num_hidden_layers": 28, "vocab_size": 152064}),
)


def load_blueprint(path: str = BLUEPRINT_PATH) -> dict:
    with open(path) as f:
        return json.load(f)


def load_schema() -> dict:
    with open(SCHEMA_PATH) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------------ formulas

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge}
_FUNCTIONS = {"max": max, "min": min, "cdiv": lambda a, b: -(-a // b)}


def evaluate(expr: str, symbols: dict[str, int]) -> int | bool:
    """Value of an arithmetic formula over `symbols` (ValueError naming what it does not allow)."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in symbols:
                raise ValueError(f"unknown symbol {node.id!r} in {expr!r}")
            return symbols[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
            return _COMPARE[type(node.ops[0])](ev(node.left), ev(node.comparators[0]))
        if isinstance(node, ast.BoolOp):
            values = [ev(v) for v in node.values]
            return all(values) if isinstance(node.op, ast.And) else any(values)
        if isinstance(node, ast.IfExp):
            return ev(node.body) if ev(node.test) else ev(node.orelse)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS \
                and not node.keywords:
            return _FUNCTIONS[node.func.id](*(ev(a) for a in node.args))
        raise ValueError(f"{ast.dump(node)[:60]} is not allowed in a formula ({expr!r})")

    return ev(ast.parse(expr, mode="eval"))


def spec_symbols(spec, tp: int, definitions: dict[str, str]) -> dict[str, int]:
    """The formula symbols of one (spec, tp): every int/bool field of the ModelSpec (None as 0), `tp`,
    `num_moe_layers`, then the blueprint's definitions in order."""
    symbols: dict[str, int] = {"tp": tp, "num_moe_layers": len(spec.moe_layers)}
    for field in dataclasses.fields(spec):
        value = getattr(spec, field.name)
        if value is None:
            symbols[field.name] = 0
        elif isinstance(value, bool | int) and not isinstance(value, float):
            symbols[field.name] = int(value)
    for name, expr in definitions.items():
        symbols[name] = evaluate(expr, symbols)
    return symbols


def _family_grid(root: str) -> Iterable[tuple[str, int, object, str | None]]:
    """(config name, tp, spec, refusal) for every family config and variant at every tp of TP_SIZES; refusal
    is the engine's own build-time error (validate_tp_config, the check LLMEngine runs) or None."""
    from metainfer.config import ConfigError, ModelSpec
    from metainfer.models.shape_contract import validate_tp_config

    def load(name: str) -> dict:
        with open(os.path.join(root, "benchmarks", "configs", f"{name}.json")) as f:
            return json.load(f)

    configs = [(name, load(name)) for names in FAMILY_CONFIGS.values() for name in names]
    configs += [(name, {**load(base), **overrides}) for name, base, overrides in CONFIG_VARIANTS]
    for name, cfg in configs:
        spec = ModelSpec.from_dict(cfg)
        for tp in TP_SIZES:
            try:
                validate_tp_config(spec, tp)
            except ConfigError as err:
                yield name, tp, spec, str(err)
                continue
            yield name, tp, spec, None


def built_shapes(spec, tp: int) -> dict[str, tuple[int, ...]]:
    """{parameter name: per-rank shape} of the engine's model for `spec`, built on the meta device as one rank of
    a tp-way group."""
    import torch

    from metainfer.distributed.parallel_state import tp_state
    from metainfer.kernels import REF_OPS
    from metainfer.models.registry import model_class

    with tp_state(0, tp), torch.device("meta"):
        model = model_class(spec)(spec, REF_OPS, dtype=torch.bfloat16)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def check_refusal(blueprint: dict, name: str, tp: int, symbols: dict[str, int], refusal: str | None) -> list[str]:
    """The engine's refusal of (config, tp) against the constraint nodes' `requires` conditions, evaluated here
    independently: a split is refused exactly when some condition is false, by that node. A refusal no
    condition explains would hide the drift of every formula at that split (check_formulas skips it), so it
    is an error, and so is a split the engine builds though a condition says it cannot."""
    failing = []
    for node in blueprint["nodes"]:
        if node.get("requires"):
            try:
                if not evaluate(node["requires"], symbols):
                    failing.append(node["id"])
            except (ValueError, ZeroDivisionError) as exc:
                return [f"{node['id']}: {name} tp={tp}: requires error: {exc}"]
    if refusal is None:
        return [f"{n}: {name} tp={tp}: the engine builds this split though the node's requires is false"
                for n in failing]
    refused_by = refusal.partition(":")[0]
    if refused_by not in failing:
        because = f"the false conditions are {', '.join(failing)}" if failing else "every constraint's requires holds"
        return [f"{name} tp={tp}: the engine refuses it ({refusal}) but {because}: a wrong refusal would hide "
                "formula drift at this split"]
    return []


def _layer_indices(selection: str, spec) -> Iterable[int]:
    if selection == "all":
        return range(spec.num_layers)
    if selection == "moe":
        return spec.moe_layers
    if selection == "dense_mlp":
        return [i for i in range(spec.num_layers) if i not in spec.moe_layers]
    return [None]


def check_formulas(blueprint: dict, root: str = REPO_ROOT) -> tuple[list[str], int, list[str]]:
    """Drift errors between the formulas and the built models, how many shapes were compared, and the
    (config, tp) splits skipped because the engine refuses them ("name tp=N: node"), each refusal checked
    against the constraint nodes' `requires` (check_refusal) so that a wrong one cannot hide drift."""
    errors, compared, skipped = [], 0, []
    definitions = blueprint.get("definitions", {})
    formula_nodes = [n for n in blueprint["nodes"] if n.get("formula")]
    for name, tp, spec, refusal in _family_grid(root):
        try:
            symbols = spec_symbols(spec, tp, definitions)
        except (ValueError, ZeroDivisionError) as exc:
            errors.append(f"definitions: {name} tp={tp}: {exc}")
            continue
        errors += check_refusal(blueprint, name, tp, symbols, refusal)
        if refusal is not None:
            skipped.append(f"{name} tp={tp}: {refusal.partition(':')[0]}")
            continue
        family, shapes = spec.family, built_shapes(spec, tp)
        covered: set[str] = set()
        for node in formula_nodes:
            formula = node["formula"]
            if family not in formula["families"]:
                continue
            try:
                if "when" in formula and not evaluate(formula["when"], symbols):
                    continue
                for i in _layer_indices(formula["layers"], spec):
                    for template, dims in formula["params"].items():
                        param = template.format(i=i) if i is not None else template
                        expected = tuple(int(evaluate(d, symbols)) for d in dims)
                        covered.add(param)
                        compared += 1
                        if param not in shapes:
                            errors.append(f"{node['id']}: {name} tp={tp}: no parameter {param!r} in the built model")
                        elif shapes[param] != expected:
                            errors.append(f"{node['id']}: {name} tp={tp}: {param} is {shapes[param]}, "
                                          f"the formula gives {expected}")
            except (ValueError, KeyError, ZeroDivisionError) as exc:
                errors.append(f"{node['id']}: {name} tp={tp}: formula error: {exc}")
        for param in sorted(set(shapes) - covered):
            errors.append(f"{name} tp={tp}: parameter {param!r} has no blueprint formula")
    return errors, compared, skipped


# ------------------------------------------------------------------------------------------------ links


def check_schema(blueprint: dict) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft202012Validator(load_schema())
    return [f"schema: {'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message[:200]}"
            for e in sorted(validator.iter_errors(blueprint), key=lambda e: list(map(str, e.absolute_path)))]


def check_links(blueprint: dict) -> list[str]:
    errors = []
    ids = [n["id"] for n in blueprint["nodes"]]
    errors += [f"node id {i!r} is used twice" for i in sorted({i for i in ids if ids.count(i) > 1})]
    phases = {p["id"] for p in blueprint["phases"]}
    modes = {m["id"] for m in blueprint.get("failure_modes", [])}
    for node in blueprint["nodes"]:
        if node["category"] not in blueprint["categories"]:
            errors.append(f"{node['id']}: unknown category {node['category']!r}")
        if node["phase"] not in phases:
            errors.append(f"{node['id']}: unknown phase {node['phase']!r}")
        errors += [f"{node['id']}: unknown failure mode {m!r}" for m in node["failure_modes"] if m not in modes]
    return errors


def in_selection(test_id: str, selection: list[str]) -> bool:
    """Whether a pytest node id is one of the tests a selection runs (an entry, a test of a file or folder
    entry, a parametrization of a function entry)."""
    file = test_id.split("::", 1)[0]
    for entry in selection:
        if test_id == entry or test_id.startswith(entry + "[") or test_id.startswith(entry + "::"):
            return True
        if "::" not in entry and (file == entry or file.startswith(entry.rstrip("/") + "/")):
            return True
    return False


def check_phase_selections(blueprint: dict) -> list[str]:
    """A phase's full selection runs everything its quick one does (the quick tier is a subset, never extra), and
    every test a node or failure mode names is in some phase's full selection (a contract test no gate runs
    cannot hold the contract)."""
    errors = [f"{p['id']}: quick test {t!r} is not in the phase's full selection"
              for p in blueprint["phases"] for t in p["quick"] if not in_selection(t, p["full"])]
    fulls = [p["full"] for p in blueprint["phases"]]
    pairs = [(n["id"], t) for n in blueprint["nodes"] for t in n["tests"]]
    pairs += [(m["id"], t) for m in blueprint.get("failure_modes", []) for t in m["tests"]]
    return errors + [f"{owner}: test {t!r} is in no phase's full selection (no gate runs it)"
                     for owner, t in pairs if not any(in_selection(t, full) for full in fulls)]


def _anchors(path: str) -> set[str]:
    """GitHub-style anchors of a markdown file's headings (lowercase, punctuation dropped, spaces -> -); a
    `#` line inside a fenced code block is a comment, not a heading."""
    headings, fenced = [], False
    with open(path) as f:
        for line in f:
            if line.startswith("```"):
                fenced = not fenced
            elif line.startswith("#") and not fenced:
                headings.append(line.lstrip("#").strip())
    return {re.sub(r"[^a-z0-9 _-]", "", h.lower()).replace(" ", "-") for h in headings}


def check_docs(blueprint: dict, root: str = REPO_ROOT) -> list[str]:
    """Every ref_docs entry names an existing file and, after `#`, one of its headings (a bare file is drift:
    the reader must land on the section that states the contract)."""
    errors = []
    for node in blueprint["nodes"]:
        for doc in node["ref_docs"]:
            path, _, anchor = doc.partition("#")
            full = os.path.join(root, path)
            if not os.path.isfile(full):
                errors.append(f"{node['id']}: ref_docs {doc!r}: no such file")
            elif not anchor:
                errors.append(f"{node['id']}: ref_docs {doc!r}: names no heading (file.md#anchor)")
            elif anchor not in _anchors(full):
                errors.append(f"{node['id']}: ref_docs {doc!r}: no such heading")
    return errors


def resolve_ref(ref: str):
    """The object a "module:qualname" reference names (ImportError / AttributeError where it does not)."""
    module, _, qualname = ref.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def check_refs(blueprint: dict) -> list[str]:
    errors = []
    for node in blueprint["nodes"]:
        for ref in node["ref_code"]:
            try:
                resolve_ref(ref)
            except (ImportError, AttributeError) as exc:
                errors.append(f"{node['id']}: ref_code {ref!r} does not resolve: {type(exc).__name__}: {exc}")
    return errors


def test_exists(test_id: str, root: str = REPO_ROOT) -> bool:
    """A pytest node id "path.py[::name[param]]" names an existing file and a top-level test function
    (a phase may also name a test folder)."""
    path, _, rest = test_id.partition("::")
    full = os.path.join(root, path)
    if not path.endswith(".py"):
        return os.path.isdir(full)
    if not os.path.isfile(full):
        return False
    if not rest:
        return True
    name = rest.split("[", 1)[0]
    with open(full) as f:
        return re.search(rf"^def {re.escape(name)}\(", f.read(), re.MULTILINE) is not None


def all_test_ids(blueprint: dict) -> list[tuple[str, str]]:
    pairs = [(n["id"], t) for n in blueprint["nodes"] for t in n["tests"]]
    pairs += [(m["id"], t) for m in blueprint.get("failure_modes", []) for t in m["tests"]]
    pairs += [(p["id"], t) for p in blueprint["phases"] for t in p["quick"] + p["full"]]
    return pairs


def missing_parametrized_ids(test_ids: Iterable[str], root: str = REPO_ROOT) -> dict[str, str]:
    """{id: problem} for the ids with a parameter ("path.py::name[param]") that pytest does not collect:
    one `pytest --collect-only` over just the files that carry such ids (a few seconds). A file that
    collects nothing (a module skipped for a missing optional package) cannot say: its ids are left to
    the static check."""
    import subprocess
    import sys

    wanted = sorted({t for t in test_ids if "[" in t.partition("::")[2]})
    files = sorted({t.partition("::")[0] for t in wanted if os.path.isfile(os.path.join(root, t.partition("::")[0]))})
    if not files:
        return {}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=",
                           "-p", "no:cacheprovider", *files], capture_output=True, text=True, cwd=root, timeout=600)
    collected = {line.strip() for line in proc.stdout.splitlines() if "::" in line and not line.startswith(" ")}
    seen_files = {c.partition("::")[0] for c in collected}
    problems = {}
    for test_id in wanted:
        path = test_id.partition("::")[0]
        if path not in files:
            continue  # no such file: the static check names it
        if path not in seen_files:
            if proc.returncode not in (0, 5):
                problems[test_id] = f"{path} does not collect: {proc.stdout.strip()[-200:]}"
            continue
        if test_id not in collected:
            problems[test_id] = f"pytest collects no parameter id {test_id.partition('::')[2]!r} in {path}"
    return problems


def check_tests(blueprint: dict, root: str = REPO_ROOT) -> list[str]:
    pairs = all_test_ids(blueprint)
    errors = [f"{owner}: test {t!r} does not exist" for owner, t in pairs if not test_exists(t, root)]
    params = missing_parametrized_ids([t for _, t in pairs if test_exists(t, root)], root)
    return errors + [f"{owner}: test {t!r}: {params[t]}" for owner, t in pairs if t in params]


def check_kernel_coverage(blueprint: dict) -> list[str]:
    """Every op of the kernel set (KernelOps' callable fields, the CPU references and the GPU launchers) is
    named by some node's ref_code: a kernel added without its node is drift."""
    import dataclasses as dc
    import functools

    from metainfer.kernels import REF_OPS, TRITON_OPS

    named = {ref for node in blueprint["nodes"] for ref in node["ref_code"]}
    errors = []
    for ops in (REF_OPS, TRITON_OPS):
        for field in dc.fields(ops):
            fn = getattr(ops, field.name)
            while isinstance(fn, functools.partial):
                fn = fn.func
            if not callable(fn) or not hasattr(fn, "__qualname__"):
                continue
            ref = f"{fn.__module__}:{fn.__qualname__}"
            if ref not in named:
                errors.append(f"kernel op {field.name} ({ref}) has no blueprint node")
    return errors


# ------------------------------------------------------------------------------------------------ coverage


def public_definitions(root: str, scope: list[str]) -> list[str]:
    """"module:name" of every public top-level class and function of the modules under `scope` (packages or
    modules), read from the source (a module whose optional dependency is missing here is still listed)."""
    refs = []
    for entry in scope:
        base = os.path.join(root, *entry.split("."))
        files = [base + ".py"] if os.path.isfile(base + ".py") else sorted(
            os.path.join(folder, name) for folder, _, names in os.walk(base) for name in names if name.endswith(".py"))
        for path in files:
            module = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            with open(path) as f:
                tree = ast.parse(f.read())
            refs += [f"{module}:{node.name}" for node in tree.body
                     if isinstance(node, ast.ClassDef | ast.FunctionDef) and not node.name.startswith("_")]
    return refs


def check_node_coverage(blueprint: dict, root: str = REPO_ROOT) -> list[str]:
    """Every public class and function of the engine's kernels, layers, attention backends, models (MoE parts
    included), loaders, scheduler and block manager, sampler, communication and assembly modules
    (`coverage.scope`) is named by some node's ref_code (itself or a member) or listed in `coverage.exempt`
    with the reason: code added without its node is drift. An exemption for code that is gone is drift too."""
    coverage = blueprint.get("coverage")
    if not coverage:
        return ["coverage: the blueprint names no scope (coverage.scope) to check node completeness over"]
    named = {ref for node in blueprint["nodes"] for ref in node["ref_code"]}
    exempt = coverage.get("exempt", {})
    errors, found = [], public_definitions(root, coverage["scope"])
    for ref in found:
        if ref in named or any(r.startswith(ref + ".") for r in named):
            continue
        if not exempt.get(ref, "").strip():
            errors.append(f"coverage: {ref} has no blueprint node (add one, or list it in coverage.exempt with why)")
    errors += [f"coverage: exempt {ref} does not exist (any more)" for ref in exempt if ref not in set(found)]
    return errors


# ------------------------------------------------------------------------------------------------ perturb


def _covers(ref: str, target: str) -> bool:
    return target == ref or target.startswith(ref + ".")


def check_perturb_fields(blueprint: dict) -> list[str]:
    """Every ref_code of every node is a perturbation target (or contains one) or is exempt with a reason;
    every target resolves to a function, method or property and belongs to one of the node's refs."""
    errors = []
    for node in blueprint["nodes"]:
        field = node.get("perturb") or {}
        targets, exempt = field.get("targets", []), field.get("exempt", {})
        for ref in node["ref_code"]:
            if not any(_covers(ref, t) for t in targets) and not exempt.get(ref, "").strip():
                errors.append(f"{node['id']}: ref_code {ref!r} is neither a perturbation target nor exempt "
                              "with a reason (perturb.targets / perturb.exempt)")
        for ref in exempt:
            if ref not in node["ref_code"]:
                errors.append(f"{node['id']}: perturb.exempt names {ref!r}, not one of its ref_code")
        for target in targets:
            if not any(_covers(ref, target) for ref in node["ref_code"]):
                errors.append(f"{node['id']}: perturbation target {target!r} is not under its ref_code")
                continue
            try:
                locate_target(target)
            except (ImportError, AttributeError, ValueError) as exc:
                errors.append(f"{node['id']}: perturbation target {target!r}: {exc}")
    return errors


def locate_target(target: str) -> tuple[str, str, str]:
    """(source file, owner qualname or "", attribute name) of a target; ValueError if it is not a function,
    method or property."""
    module, _, qualname = target.partition(":")
    owner_name, _, name = qualname.rpartition(".")
    if not owner_name:
        fn = resolve_ref(target)
        if not inspect.isfunction(fn):
            raise ValueError("a module-level target must be a function")
        # the module's own file, not the function's: a decorated function (@torch.no_grad()) reports the
        # decorator's source file, and the mutation writes `@perturbed` above the `def` in this module
        path = inspect.getsourcefile(importlib.import_module(module))
        with open(path, encoding="utf-8") as f:
            if f.read().count(f"\ndef {name}(") != 1:
                raise ValueError(f"`def {name}(` does not occur once at the top level of {module}")
        return path, "", name
    owner = resolve_ref(f"{module}:{owner_name}")
    if not inspect.isclass(owner):
        raise ValueError(f"{owner_name} is not a class")
    raw = inspect.getattr_static(owner, name)
    if not (inspect.isfunction(raw) or isinstance(raw, staticmethod | classmethod | property)):
        raise ValueError(f"{name} is not a method or property of {owner_name}")
    return inspect.getsourcefile(owner), owner_name, name


def check_blueprint(blueprint: dict | None = None, root: str = REPO_ROOT) -> dict:
    """Every check; {"errors": [...], "nodes": n, "shapes_compared": m, "splits_skipped": ["name tp=N: node"]}."""
    blueprint = load_blueprint() if blueprint is None else blueprint
    errors = check_schema(blueprint)
    if errors:  # the other checks read the structure the schema guarantees
        return {"errors": errors, "nodes": len(blueprint.get("nodes", [])), "shapes_compared": 0,
                "splits_skipped": []}
    errors += check_links(blueprint) + check_refs(blueprint) + check_tests(blueprint, root)
    errors += check_kernel_coverage(blueprint) + check_docs(blueprint, root) + check_perturb_fields(blueprint)
    errors += check_phase_selections(blueprint)
    errors += check_node_coverage(blueprint, root)
    formula_errors, compared, skipped = check_formulas(blueprint, root)
    return {"errors": errors + formula_errors, "nodes": len(blueprint["nodes"]), "shapes_compared": compared,
            "splits_skipped": skipped}

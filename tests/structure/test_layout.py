"""The package's structural rules (the redesign issue's acceptance), checked from the source:
no import cycle among metainfer's modules (function-level imports included), no module over 600
lines, no tool under metainfer/kernels, nothing imported from tools/ or tests/, env vars read only
by the registry (config/env.py) and the documented non-switch readers."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "metainfer")
MAX_LINES = 600
# modules allowed to touch os.environ besides the registry, none of them an engine switch: the tokenizer's
# cache folder and offline flag, the API-key defaults of `serve` / `bench serve`, and the NCCL multicast
# defaults a CUDA TP group sets when it is created
ENV_READERS = {"metainfer.config.env", "metainfer.engine.tokenizer", "metainfer.entrypoints.serve_cli",
               "metainfer.entrypoints.cli", "metainfer.bench.serve", "metainfer.distributed.custom_all_reduce",
               # not an engine option: a gate's pytest gets this environment minus PYTEST_ADDOPTS / PYTEST_PLUGINS
               "metainfer.knowledge.gates"}


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(module: str, path: str) -> set[str]:
    """Every metainfer module `module` imports, at any depth of its code (resolved to existing modules)."""
    tree = ast.parse(open(path).read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _package_parents(module: str) -> set[str]:
    """A module's import also runs its packages' __init__: those edges are implied, not cycles of ours."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_no_import_cycle():
    graph = {m: _imports(m, p) - _package_parents(m) for m, p in MODULES.items()}
    # a package's __init__ importing its own submodules is the usual re-export, not a cycle
    for m in graph:
        if MODULES[m].endswith("__init__.py"):
            graph[m] = {n for n in graph[m] if not n.startswith(m + ".")}
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph))


def test_cycle_finder_finds_a_planted_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module):
    with open(MODULES[module]) as f:
        assert sum(1 for _ in f) <= MAX_LINES


def test_package_imports_no_tools_or_tests():
    for module, path in MODULES.items():
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.split(".")[0] in ("tools", "tests", "scripts") for n in names), module


def test_no_tools_under_kernels():
    """A kernel module is a kernel and its reference: no command line, no sweeps, no timing."""
    for module, path in MODULES.items():
        if module.startswith("metainfer.kernels"):
            source = open(path).read()
            assert "argparse" not in source and '__name__ == "__main__"' not in source, module
            assert "perf_counter" not in source and "Event(enable_timing" not in source, module


def test_environment_read_only_by_the_registry():
    for module, path in MODULES.items():
        if module in ENV_READERS:
            continue
        source = open(path).read()
        assert "os.environ" not in source and "getenv(" not in source, module


def test_lost_experiments_are_gone():
    everything = "".join(open(p).read() for p in MODULES.values())
    for name in ("METAINFER_FUSED_DECODE_PREP", "METAINFER_FP8_V_TOKEN_MAJOR", "METAINFER_DECODE_ORDER",
                 "paged_decode_attention_qkv", "norm_linear_engine", "has_unfinished("):
        assert name not in everything, name

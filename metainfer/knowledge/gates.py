"""The phase gates: each phase of the blueprint names a quick and a full test selection; a gate runs its
phase's selection after the earlier phases' quick selections (regression), behind three guards:

  immutability  gate_manifest.json holds the sha256 of every test file a gate selects, of the shared test
                files and of the pytest configuration (addopts, markers); a gate whose files changed without
                their manifest entry fails (`metainfer gate --update-manifest` writes it, a
                deliberate, reviewed commit);
  L0            the engine's import closure (metainfer, its models, kernels, server) holds none of vllm,
                sglang, flash_attn, flashinfer, xformers, and no module under metainfer/ writes such an
                import anywhere (an ast scan: function-level imports and modules outside the closure);
  evidence      one JSON per gate under --evidence DIR: the top-level command, the pytest command, result,
                duration, commit, a dirty-tree flag, environment, test counts.
`--mutants` runs the failure-mode library's mutations (metainfer/knowledge/mutants.py) and reports
caught / total.
"""

from __future__ import annotations

import ast
import glob
import hashlib
import json
import os
import platform
import subprocess
import sys
import time

from metainfer.knowledge.blueprint import KNOWLEDGE_DIR, REPO_ROOT, load_blueprint

MANIFEST_PATH = os.path.join(KNOWLEDGE_DIR, "gate_manifest.json")
FORBIDDEN_IMPORTS = ("vllm", "sglang", "flash_attn", "flashinfer", "xformers")
ENGINE_MODULES = ("metainfer", "metainfer.llm", "metainfer.models.registry", "metainfer.worker.model_runner",
                  "metainfer.kernels", "metainfer.entrypoints.cli", "metainfer.entrypoints.openai.api_server")


def selection(phase: dict, quick: bool) -> list[str]:
    return list(phase["quick"] if quick else phase["full"])


def selected_files(test_ids: list[str], root: str = REPO_ROOT) -> list[str]:
    """The test files a selection runs (a folder: every test_*.py below it), repo-relative, sorted."""
    files = set()
    for test_id in test_ids:
        path = test_id.split("::", 1)[0]
        if path.endswith(".py"):
            files.add(path)
        else:
            files.update(os.path.relpath(f, root) for f in glob.glob(os.path.join(root, path, "**", "test_*.py"),
                                                                       recursive=True))
    return sorted(files)


def file_hashes(files: list[str], root: str = REPO_ROOT) -> dict[str, str]:
    out = {}
    for path in files:
        with open(os.path.join(root, path), "rb") as f:
            out[path] = hashlib.sha256(f.read()).hexdigest()
    return out


SELECTION_KEY = "selection"


def shared_test_files(root: str = REPO_ROOT) -> list[str]:
    """What every gate also depends on: every conftest.py under tests/ (nested ones included: a folder
    selection runs its folder's conftest) and the shared builders of the references in tests/helpers/."""
    found = glob.glob(os.path.join(root, "tests", "**", "conftest.py"), recursive=True)
    found += glob.glob(os.path.join(root, "tests", "helpers", "*.py"))
    return sorted({os.path.relpath(f, root) for f in found})


PYTEST_CONFIG_KEY = "pytest configuration"
ROOT_PYTEST_FILES = ("pytest.ini", "setup.cfg", "tox.ini", "conftest.py")  # what pytest also reads at the root


def pytest_config_digest(root: str = REPO_ROOT) -> str:
    """sha256 of what configures every gate's pytest run: pyproject.toml's [tool.pytest.ini_options] table
    (parsed, canonical JSON: addopts with `-m "not slow"` or a `--deselect` would narrow every gate) and every
    pytest.ini / setup.cfg / tox.ini / conftest.py at the repository root that exists (whole files)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
        import tomli as tomllib

    table = None
    pyproject = os.path.join(root, "pyproject.toml")
    if os.path.exists(pyproject):
        with open(pyproject, "rb") as f:
            table = tomllib.load(f).get("tool", {}).get("pytest", {}).get("ini_options")
    parts = {"pyproject.toml [tool.pytest.ini_options]": table}
    for name in ROOT_PYTEST_FILES:
        path = os.path.join(root, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                parts[name] = hashlib.sha256(f.read()).hexdigest()
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def build_manifest(blueprint: dict, root: str = REPO_ROOT) -> dict:
    """{phase id: {file: sha256, "selection": sha256 of its quick and full lists, "pytest configuration":
    pytest_config_digest}} over both selections of every phase and the shared test files: narrowing a gate
    (its selection or pytest's addopts / markers), or changing a fixture, is a manifest change."""
    shared = shared_test_files(root)
    config = pytest_config_digest(root)
    out = {}
    for p in blueprint["phases"]:
        entry = file_hashes(sorted(set(selected_files(p["quick"] + p["full"], root)) | set(shared)), root)
        entry[SELECTION_KEY] = hashlib.sha256(json.dumps([p["quick"], p["full"]]).encode()).hexdigest()
        entry[PYTEST_CONFIG_KEY] = config
        out[p["id"]] = entry
    return out


def manifest_drift(phase_id: str, blueprint: dict, manifest: dict, root: str = REPO_ROOT) -> list[str]:
    """Files of a gate whose content (or presence) differs from the committed manifest."""
    current = build_manifest({"phases": [p for p in blueprint["phases"] if p["id"] == phase_id]}, root)[phase_id]
    recorded = manifest.get(phase_id, {})
    names = {SELECTION_KEY: "its test selection", PYTEST_CONFIG_KEY: "its pytest configuration"}
    changed = [names.get(f, f) for f in current if recorded.get(f) != current[f]]
    gone = [f for f in recorded if f not in current]
    return [f"{phase_id}: {f} changed without its manifest entry" for f in changed] + \
        [f"{phase_id}: {f} left the gate without its manifest entry" for f in gone]


def l0_violations(modules: tuple[str, ...] = ENGINE_MODULES,
                  forbidden: tuple[str, ...] = FORBIDDEN_IMPORTS) -> list[str]:
    """Forbidden packages in the engine's import closure (a fresh interpreter imports the engine modules)."""
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    if proc.returncode:
        return [f"L0: importing the engine failed: {proc.stderr.strip()[-300:]}"]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    return [f"L0: the engine imports {m}" for m in loaded if m.split(".")[0] in forbidden]


def _imported_names(tree: ast.AST):
    """(line, module) for every import statement anywhere in a module (function bodies included) and every
    importlib.import_module / __import__ call with a literal name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.lineno, node.module
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__"):
                yield node.lineno, node.args[0].value


def static_import_violations(package_dir: str = os.path.join(REPO_ROOT, "metainfer"),
                             forbidden: tuple[str, ...] = FORBIDDEN_IMPORTS) -> list[str]:
    """Forbidden imports written anywhere in the package's source (ast, no import): the modules the runtime
    closure does not reach (launchers, the MLX backend, function-level imports) are checked too."""
    out = []
    for path in sorted(glob.glob(os.path.join(package_dir, "**", "*.py"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        rel = os.path.relpath(path, os.path.dirname(package_dir))
        out += [f"L0: {rel}:{line} imports {name}" for line, name in _imported_names(tree)
                if name.split(".")[0] in forbidden]
    return out


def _environment() -> dict:
    """The versions and machine a gate ran on (evidence)."""
    from importlib.metadata import PackageNotFoundError, version

    env = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    for package in ("torch", "transformers", "triton"):
        try:
            env[package] = version(package)
        except PackageNotFoundError:
            env[package] = None
    return env


def _git_commit(root: str) -> str:
    proc = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=root)
    return proc.stdout.strip() or "unknown"


def _git_dirty(root: str) -> bool | None:
    """Whether the work tree differs from the commit (modified, staged or untracked files); None: no git."""
    proc = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=root)
    return bool(proc.stdout.strip()) if proc.returncode == 0 else None


def provenance(command: str | None, root: str = REPO_ROOT, committed: bool = False) -> dict:
    """What evidence says about where it came from: the top-level command, the commit, whether the tested
    tree was that commit (a --committed run tests the commit itself) or a work tree with changes, and the
    environment."""
    return {"command": command, "commit": _git_commit(root), "tree": "commit" if committed else "work tree",
            "dirty": False if committed else _git_dirty(root), "environment": _environment()}


def run_pytest(test_ids: list[str], root: str = REPO_ROOT, timeout_s: int = 3600) -> dict:
    """pytest over the selection (2 xdist workers); the counts come from its JUnit XML report."""
    import tempfile
    import xml.etree.ElementTree as ET

    with tempfile.TemporaryDirectory(prefix="metainfer-gate-") as tmp:
        report = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadscope",
               f"--junitxml={report}", *test_ids]
        start = time.perf_counter()
        # options from the environment would narrow the gate past its manifest (the pytest configuration is hashed)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=timeout_s, env=env)
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if os.path.exists(report):
            for suite in ET.parse(report).getroot().iter("testsuite"):
                for key in counts:
                    counts[key] += int(suite.get(key, 0))
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    summary = f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped"
    failing = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))][:5]
    return {"command": " ".join(["pytest", *cmd[3:-len(test_ids)], *test_ids]).replace(f"--junitxml={report} ", ""),
            "returncode": proc.returncode, "summary": summary, "counts": {"passed": passed, **counts},
            "failing": failing, "seconds": round(time.perf_counter() - start, 1)}


def run_gate(phase_id: str, quick: bool, blueprint: dict | None = None, manifest: dict | None = None,
             root: str = REPO_ROOT, regression: bool = True, l0: bool = True, command: str | None = None) -> dict:
    """One gate: manifest check, L0, then the earlier phases' quick selections (regression) and this phase's
    selection. A run of every phase in order passes regression=False (the earlier phases just ran) and checks
    L0 once. `command` is the top-level command line that ran the gate (its evidence records it)."""
    blueprint = blueprint or load_blueprint()
    if manifest is None:
        with open(MANIFEST_PATH) as f:
            manifest = json.load(f)
    order = [p["id"] for p in blueprint["phases"]]
    if phase_id not in order:
        raise ValueError(f"unknown phase {phase_id!r}; phases: {', '.join(order)}")
    phases = {p["id"]: p for p in blueprint["phases"]}
    earlier = order[: order.index(phase_id)] if regression else []
    start = time.perf_counter()
    errors = [e for pid in [*earlier, phase_id] for e in manifest_drift(pid, blueprint, manifest, root)]
    errors += l0_violations() + static_import_violations() if l0 else []
    tests = [t for pid in earlier for t in phases[pid]["quick"]] + selection(phases[phase_id], quick)
    result = {"gate": phase_id, "title": phases[phase_id]["title"], "quick": quick, "regression_phases": earlier,
              **provenance(command, root)}
    if not errors:
        run = run_pytest(list(dict.fromkeys(tests)), root)
        result["pytest"] = run
        if run["returncode"]:
            errors.append(f"{phase_id}: pytest failed: {run['summary']}: {'; '.join(run['failing'])}")
    result.update(errors=errors, passed=not errors, seconds=round(time.perf_counter() - start, 1))
    return result

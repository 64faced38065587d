"""The phase gates (metainfer/knowledge/gates.py): the committed manifest matches the tree; a changed test
file, a narrowed selection or a changed fixture is drift; L0 finds a planted import; a gate writes its
evidence."""

from __future__ import annotations

import copy
import json

from metainfer.knowledge.blueprint import load_blueprint
from metainfer.knowledge.gates import (
    MANIFEST_PATH,
    build_manifest,
    l0_violations,
    manifest_drift,
    run_gate,
    static_import_violations,
)


def _manifest():
    with open(MANIFEST_PATH) as f:
        return json.load(f)


def test_the_committed_manifest_matches_the_tree():
    blueprint, manifest = load_blueprint(), _manifest()
    assert {p["id"] for p in blueprint["phases"]} == set(manifest)
    assert [e for p in blueprint["phases"] for e in manifest_drift(p["id"], blueprint, manifest)] == []


def test_changed_files_and_selections_are_drift():
    blueprint, manifest = load_blueprint(), _manifest()
    changed = copy.deepcopy(manifest)
    changed["P1"]["tests/kernels/test_elementwise.py"] = "0" * 64  # as if the file had been edited
    assert manifest_drift("P1", blueprint, changed) == [
        "P1: tests/kernels/test_elementwise.py changed without its manifest entry"]
    fixture = copy.deepcopy(manifest)
    fixture["P3"]["tests/helpers/tiny_models.py"] = "0" * 64
    assert any("tiny_models.py" in e for e in manifest_drift("P3", blueprint, fixture))
    narrowed = copy.deepcopy(blueprint)
    narrowed["phases"][7]["quick"] = []
    assert manifest_drift(narrowed["phases"][7]["id"], narrowed, manifest) == [
        f"{narrowed['phases'][7]['id']}: its test selection changed without its manifest entry"]
    assert build_manifest(blueprint) == manifest


def test_l0_finds_a_planted_import():
    assert l0_violations() == []
    planted = l0_violations(modules=("json",), forbidden=("json",))
    assert planted and all(v.startswith("L0: the engine imports json") for v in planted)


def test_a_gate_runs_its_selection_and_records_evidence():
    result = run_gate("P0", quick=True, regression=False, l0=False)
    assert result["passed"], result["errors"]
    assert result["pytest"]["returncode"] == 0 and result["pytest"]["counts"]["passed"] >= 10
    assert result["pytest"]["counts"]["failures"] == 0 and result["environment"]["torch"]
    assert len(result["commit"]) == 40 and result["seconds"] > 0 and result["gate"] == "P0"


def test_a_changed_nested_conftest_is_drift(tmp_path):
    """A folder's own conftest.py (e.g. tests/entrypoints/conftest.py) is in every gate's manifest entry."""
    for path in ("tests/conftest.py", "tests/helpers/h.py", "tests/sub/conftest.py", "tests/sub/test_x.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("# v1\n")
    blueprint = {"phases": [{"id": "P0", "quick": ["tests/sub/test_x.py"], "full": ["tests/sub"]}]}
    manifest = build_manifest(blueprint, str(tmp_path))
    assert "tests/sub/conftest.py" in manifest["P0"]
    assert manifest_drift("P0", blueprint, manifest, str(tmp_path)) == []
    (tmp_path / "tests/sub/conftest.py").write_text("# v2\n")
    assert manifest_drift("P0", blueprint, manifest, str(tmp_path)) == [
        "P0: tests/sub/conftest.py changed without its manifest entry"]
    assert "tests/entrypoints/conftest.py" in build_manifest(load_blueprint())["P10"]


def test_l0_static_scan_finds_a_function_level_import(tmp_path):
    """Imports the runtime closure never executes (inside a function, a module outside the closure, a
    literal importlib call) are found by the ast scan of every module under the package."""
    pkg = tmp_path / "metainfer"
    (pkg / "distributed").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import json\n")
    (pkg / "distributed" / "launch.py").write_text(
        "def launch():\n    from flash_attn.ops import x  # noqa\n    import xformers.ops\n")
    (pkg / "mlx_backend.py").write_text("import importlib\nm = importlib.import_module('flashinfer')\n")
    assert static_import_violations(str(pkg)) == [
        "L0: metainfer/distributed/launch.py:2 imports flash_attn.ops",
        "L0: metainfer/distributed/launch.py:3 imports xformers.ops",
        "L0: metainfer/mlx_backend.py:2 imports flashinfer"]
    assert static_import_violations() == []


def test_a_gate_runs_the_static_l0_scan(monkeypatch):
    from metainfer.knowledge import gates

    monkeypatch.setattr(gates, "l0_violations", lambda: [])
    monkeypatch.setattr(gates, "static_import_violations", lambda: ["L0: planted"])
    blueprint = load_blueprint()
    result = run_gate("P0", quick=True, blueprint=blueprint, manifest=build_manifest(blueprint), regression=False)
    assert result["errors"] == ["L0: planted"] and not result["passed"] and "pytest" not in result


def test_provenance_flags_a_dirty_tree(tmp_path):
    import subprocess

    from metainfer.knowledge.gates import provenance

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("1\n")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    clean = provenance("metainfer gate P0", str(tmp_path))
    assert clean["dirty"] is False and len(clean["commit"]) == 40 and clean["command"] == "metainfer gate P0"
    assert clean["environment"]["python"] and clean["tree"] == "work tree"
    (tmp_path / "a.txt").write_text("2\n")
    assert provenance(None, str(tmp_path))["dirty"] is True
    assert provenance(None, str(tmp_path), committed=True)["dirty"] is False  # a --committed run tests HEAD


def test_gate_and_mutants_evidence_name_the_command(tmp_path, monkeypatch):
    """Each gate's JSON and the --mutants JSON carry the top-level command, the commit, the dirty flag and
    the environment (run_gate and the harness are stubbed: this is about the records)."""
    from metainfer.entrypoints.cli import main
    from metainfer.knowledge import gates, mutants

    seen = {}

    def fake_gate(phase_id, quick, blueprint, regression, l0, command):
        seen[phase_id] = command
        return {"gate": phase_id, "passed": True, "seconds": 0.0, "errors": [], **gates.provenance(command)}

    monkeypatch.setattr(gates, "run_gate", fake_gate)
    monkeypatch.setattr(mutants, "run_mutants", lambda *a, **k: {"caught": 1, "total": 1, "modes": []})
    evidence = tmp_path / "ev"
    assert main(["gate", "P0", "--quick", "--mutants", "--evidence", str(evidence)]) == 0
    command = f"metainfer gate P0 --quick --mutants --evidence {evidence}"
    assert seen == {"P0": command}
    for name in ("gate_P0.json", "mutants.json"):
        record = json.loads((evidence / name).read_text())
        assert record["command"] == command, name
        assert len(record["commit"]) == 40 and isinstance(record["dirty"], bool) and record["environment"]["torch"]
    for name in ("gate_P0.json", "mutants.json", "run.json"):  # the run's clock and load, beside any figure
        record = json.loads((evidence / name).read_text())
        assert record["run_started_utc"].endswith("Z") and record["run_wall_s"] >= 0, name
        assert isinstance(record["load_1min_start"], float) and isinstance(record["load_1min_end"], float), name
    assert json.loads((evidence / "run.json").read_text())["command"] == command


def test_the_mutants_cli_json_names_the_command(tmp_path, monkeypatch):
    from metainfer.knowledge import mutants

    stub = {"caught": 1, "total": 1, "score": 1.0, "modes": [], "baseline": {"status": "passed"}, "wall_s": 0.0}
    monkeypatch.setattr(mutants, "run_mutants", lambda *a, **k: dict(stub))
    mode = mutants.load_failure_modes()[0]["id"]
    out = tmp_path / "m.json"
    assert mutants.main(["--only", mode, "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["command"] == f"python -m metainfer.knowledge.mutants --only {mode} --json {out}"
    assert len(record["commit"]) == 40 and isinstance(record["dirty"], bool) and record["environment"]["python"]


def _recording_gates(monkeypatch, tmp_path) -> list[list[str]]:
    """Stub pytest, L0 and the committed manifest (one built from the tree): what each gate would run."""
    from metainfer.knowledge import gates

    runs: list[list[str]] = []

    def fake_pytest(test_ids, root=None, timeout_s=None):
        runs.append(list(test_ids))
        return {"command": "pytest", "returncode": 0, "summary": "stub", "counts": {}, "failing": [], "seconds": 0}

    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(build_manifest(load_blueprint())))
    monkeypatch.setattr(gates, "run_pytest", fake_pytest)
    monkeypatch.setattr(gates, "MANIFEST_PATH", str(manifest))
    monkeypatch.setattr(gates, "l0_violations", lambda: [])
    monkeypatch.setattr(gates, "static_import_violations", lambda: [])
    return runs


def test_a_phase_gate_runs_every_earlier_phase_quick_selection(monkeypatch, tmp_path):
    """Regression (issue 22 item 5): a phase's gate runs the earlier phases' quick selections, then its own
    selection, for every phase, through run_gate and through `metainfer gate PHASE`."""
    from metainfer.entrypoints.cli import main

    runs = _recording_gates(monkeypatch, tmp_path)
    phases = load_blueprint()["phases"]
    for i, phase in enumerate(phases):
        for quick in (True, False):
            runs.clear()
            result = run_gate(phase["id"], quick=quick, l0=False)
            assert result["passed"], result["errors"]
            assert result["regression_phases"] == [p["id"] for p in phases[:i]]
            (ran,) = runs
            missing = [t for p in phases[:i] for t in p["quick"] if t not in ran]
            assert missing == [], f"{phase['id']} leaves out earlier quick tests: {missing}"
            assert [t for t in phase["quick" if quick else "full"] if t not in ran] == []
    runs.clear()
    assert main(["gate", "P8"]) == 0
    assert len(runs) == 1 and all(t in runs[0] for p in phases[:8] for t in p["quick"])
    assert all(t in runs[0] for t in phases[8]["full"])


def _tree_with_pytest_config(root, addopts: str) -> dict:
    """A minimal tree: one test file, a root pyproject.toml with a pytest table; its one-phase blueprint."""
    (root / "tests").mkdir(parents=True, exist_ok=True)
    (root / "tests" / "test_x.py").write_text("def test_x():\n    pass\n")
    (root / "pyproject.toml").write_text(
        '[project]\nname = "x"\n\n[tool.pytest.ini_options]\ntestpaths = ["tests"]\n'
        f'addopts = "{addopts}"\nmarkers = ["slow: long"]\n\n[tool.ruff]\nline-length = 120\n')
    return {"phases": [{"id": "P0", "quick": ["tests/test_x.py"], "full": ["tests"]}]}


def test_a_changed_pytest_configuration_is_drift(tmp_path):
    """pytest's addopts / markers configure every gate's run: `-m "not slow"` or a `--deselect` added to
    pyproject.toml's [tool.pytest.ini_options] narrows every gate, so it is drift for every phase; so is a
    pytest.ini / setup.cfg / tox.ini / conftest.py appearing at the root. Other pyproject tables, and the table's
    formatting, are not."""
    import shutil

    from metainfer.knowledge.gates import PYTEST_CONFIG_KEY, REPO_ROOT, pytest_config_digest

    blueprint = _tree_with_pytest_config(tmp_path, "-q --strict-markers")
    manifest = build_manifest(blueprint, str(tmp_path))
    assert manifest["P0"][PYTEST_CONFIG_KEY] == pytest_config_digest(str(tmp_path))
    assert manifest_drift("P0", blueprint, manifest, str(tmp_path)) == []
    for narrowed in ('-q --strict-markers -m \\"not slow\\"', "-q --strict-markers --deselect tests/test_x.py::test_x"):
        _tree_with_pytest_config(tmp_path, narrowed)
        assert manifest_drift("P0", blueprint, manifest, str(tmp_path)) == [
            "P0: its pytest configuration changed without its manifest entry"], narrowed
    _tree_with_pytest_config(tmp_path, "-q --strict-markers")
    text = (tmp_path / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(text.replace("line-length = 120", "line-length = 100")
                                             .replace('addopts = "', 'addopts   =   "'))
    assert manifest_drift("P0", blueprint, manifest, str(tmp_path)) == []  # parsed: not the table's layout
    for name, body in (("pytest.ini", "[pytest]\naddopts = -m 'not slow'\n"), ("conftest.py", "collect_ignore = []\n")):
        (tmp_path / name).write_text(body)
        assert manifest_drift("P0", blueprint, manifest, str(tmp_path)) == [
            "P0: its pytest configuration changed without its manifest entry"], name
        (tmp_path / name).unlink()
    # the repository's own pyproject.toml, copied and narrowed, changes the digest every phase records
    copy_root = tmp_path / "repo"
    copy_root.mkdir()
    shutil.copy(f"{REPO_ROOT}/pyproject.toml", copy_root / "pyproject.toml")
    before = pytest_config_digest(str(copy_root))
    assert before == pytest_config_digest(REPO_ROOT)
    text = (copy_root / "pyproject.toml").read_text()
    assert 'addopts = "-q --strict-markers"' in text
    (copy_root / "pyproject.toml").write_text(text.replace('addopts = "-q --strict-markers"',
                                                           'addopts = "-q --strict-markers -m \'not slow\'"'))
    assert pytest_config_digest(str(copy_root)) != before
    assert {e[PYTEST_CONFIG_KEY] for e in build_manifest(load_blueprint()).values()} == {before}


def test_pytest_options_from_the_environment_cannot_narrow_a_gate(monkeypatch):
    """PYTEST_ADDOPTS is not in the manifest: a gate's pytest runs without it (here it would deselect everything)."""
    from metainfer.knowledge.gates import run_pytest

    monkeypatch.setenv("PYTEST_ADDOPTS", "-k no_test_has_this_name")
    res = run_pytest(["tests/knowledge/test_gates.py::test_l0_finds_a_planted_import"])
    assert res["counts"]["passed"] == 1 and res["returncode"] == 0, res


def test_bad_phases_and_an_unwritable_evidence_folder_are_refused_before_any_gate_runs(monkeypatch, capsys, tmp_path):
    """A phase id in any case is accepted; an unknown one names the known ones; an --evidence path that cannot be a
    folder is one line, before any gate runs (a gate's results would be lost after its tests)."""
    from metainfer.entrypoints.cli import main
    from metainfer.knowledge import gates

    ran = []
    monkeypatch.setattr(gates, "run_gate", lambda phase, *a, **k: ran.append(phase) or {
        "passed": True, "seconds": 0.0, "errors": []})
    assert main(["gate", "P77"]) == 2
    assert "unknown phase(s) P77 (phases: P0, P1" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["gate", "p0", "--quick", "--evidence", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--evidence {blocker / 'sub'}:" in err and ran == []
    assert main(["gate", "p0", "--quick"]) == 0 and ran == ["P0"]

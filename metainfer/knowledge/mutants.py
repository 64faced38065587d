"""The failure-mode library (the blueprint's `failure_modes`, metainfer/knowledge/blueprint.json) and its
mutation harness.

Why: a failure mode is only known if a test fails when the bug is put back. Each mode carries a minimal
mutation of our code and the fastest tests that must catch it; `run_mutants` applies each mutation to a
throw-away copy of the repository and runs those tests, so the score says how much of the library the
suite really guards. The checkout itself is never modified.

CLI: `python -m metainfer.knowledge.mutants [--only ID ...] [--json PATH] [--jobs N]`.
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path

KEYS = {"id", "title", "symptom", "cause", "tests", "mutation"}
MUTATION_KEYS = {"file", "find", "replace"}
ID_PATTERN = re.compile(r"^fm\.[a-z0-9]+(?:_[a-z0-9]+)*$")
PYTEST_ARGS = ("-m", "pytest", "-x", "-q", "-p", "no:cacheprovider")
TAIL_CHARS = 3000


def load_failure_modes() -> list[dict]:
    """The library as packaged in the blueprint (package data, so an installed wheel has it too)."""
    text = resources.files("metainfer.knowledge").joinpath("blueprint.json").read_text(encoding="utf-8")
    return json.loads(text)["failure_modes"]


# -- static checks ---------------------------------------------------------------------------------------


def _test_exists(node_id: str, root: Path) -> str | None:
    """None when the node id's file exists and defines its function (and class); else the problem."""
    path, _, rest = node_id.partition("::")
    file = root / path
    if not rest:
        return f"test id {node_id!r} names no function"
    if not file.is_file():
        return f"test id {node_id!r}: no file {path}"
    text = file.read_text(encoding="utf-8")
    *classes, func = rest.split("::")
    func = func.split("[", 1)[0]
    for cls in classes:
        if not re.search(rf"^\s*class {re.escape(cls)}\b", text, re.M):
            return f"test id {node_id!r}: no class {cls} in {path}"
    if not re.search(rf"^\s*(?:async\s+)?def {re.escape(func)}\(", text, re.M):
        return f"test id {node_id!r}: no function {func} in {path}"
    return None


def check_library(modes: list[dict], repo_root) -> list[str]:
    """Every problem of the library against the tree at `repo_root` (empty: it is usable)."""
    root, problems, seen = Path(repo_root), [], set()
    for i, mode in enumerate(modes):
        name = mode.get("id", f"#{i}") if isinstance(mode, dict) else f"#{i}"
        if not isinstance(mode, dict) or set(mode) != KEYS:
            keys = sorted(mode) if isinstance(mode, dict) else type(mode).__name__
            problems.append(f"{name}: keys {keys}, expected {sorted(KEYS)}")
            continue
        if not isinstance(name, str) or not ID_PATTERN.match(name):
            problems.append(f"{name!r}: id is not fm.<snake_case>")
        if name in seen:
            problems.append(f"{name}: duplicate id")
        seen.add(name)
        for key in ("title", "symptom", "cause"):
            if not isinstance(mode[key], str) or not mode[key].strip():
                problems.append(f"{name}: empty {key}")
        tests = mode["tests"]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            problems.append(f"{name}: tests must be a non-empty list of pytest node ids")
            tests = []
        for node_id in tests:
            problem = _test_exists(node_id, root)
            if problem:
                problems.append(f"{name}: {problem}")
        mutation = mode["mutation"]
        if not isinstance(mutation, dict) or set(mutation) != MUTATION_KEYS:
            problems.append(f"{name}: mutation needs exactly {sorted(MUTATION_KEYS)}")
            continue
        file = root / mutation["file"]
        if not file.is_file():
            problems.append(f"{name}: mutation file {mutation['file']} does not exist")
            continue
        if mutation["find"] == mutation["replace"]:
            problems.append(f"{name}: the mutation changes nothing")
        count = file.read_text(encoding="utf-8").count(mutation["find"]) if mutation["find"] else 0
        if count != 1:
            problems.append(f"{name}: find occurs {count} times in {mutation['file']}, expected exactly once")
    from metainfer.knowledge.blueprint import missing_parametrized_ids

    test_ids = [(m["id"], t) for m in modes if isinstance(m, dict) and isinstance(m.get("tests"), list)
                for t in m["tests"] if isinstance(t, str) and _test_exists(t, root) is None]
    params = missing_parametrized_ids([t for _, t in test_ids], str(root))
    problems += [f"{name}: test id {t!r}: {params[t]}" for name, t in test_ids if t in params]
    return problems


# -- the sandbox -----------------------------------------------------------------------------------------


def _repo_files(root: Path) -> list[str]:
    """Tracked files and untracked ones git does not ignore (what the suite sees of the checkout)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True).stdout
    return sorted({f for f in out.decode().split("\0") if f})


def make_copy(repo_root, dest, commit: str | None = None) -> Path:
    """Copy the repository's files into `dest` (the mutants' sandbox); returns dest. With `commit`, the files
    of that commit instead of the work tree (a shared tree's uncommitted edits of others left out)."""
    root, dest = Path(repo_root), Path(dest)
    if commit:
        import io
        import tarfile

        archive = subprocess.run(["git", "archive", commit], cwd=root, check=True, capture_output=True).stdout
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(dest, filter="data")
        return dest
    for rel in _repo_files(root):
        src = root / rel
        if src.is_file() and not src.is_symlink():  # a tracked file deleted in the work tree is skipped
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    return dest


def sandbox_command(copy: Path, *args: str) -> list[str]:
    """`python args` with the copy's metainfer first on the path (not the editable install's) and the Triton
    interpreter on. Set through env(1): the child inherits this process's environment plus these, so the
    harness reads no environment variable itself (config/env.py is the one reader)."""
    return ["env", "-u", "PYTEST_ADDOPTS", f"PYTHONPATH={copy}", "TRITON_INTERPRET=1",
            "PYTHONDONTWRITEBYTECODE=1",  # a mutated module must never be read back from a stale .pyc
            sys.executable, *args]


def check_imports_copy(copy: Path) -> str:
    """Where `metainfer` resolves from inside the sandbox; raises unless it is the copy's."""
    out = subprocess.run(sandbox_command(copy, "-c", "import metainfer; print(metainfer.__file__)"), cwd=copy,
                         capture_output=True, text=True, timeout=120)
    where = out.stdout.strip()
    if out.returncode or not Path(where).resolve().is_relative_to(copy.resolve()):
        raise RuntimeError(f"the sandbox imports metainfer from {where or out.stderr[-500:]!r}, not {copy}")
    return where


def _pytest(copy: Path, tests: list[str], timeout_s: float,
            deselect: tuple[str, ...] = ()) -> tuple[int | None, str, float]:
    """(return code or None on timeout, output tail, seconds)."""
    start = time.monotonic()
    extra = [arg for test in deselect for arg in ("--deselect", test)]
    try:
        out = subprocess.run(sandbox_command(copy, *PYTEST_ARGS, *extra, *tests), cwd=copy, capture_output=True,
                             text=True, timeout=timeout_s)
        return out.returncode, (out.stdout + out.stderr)[-TAIL_CHARS:], time.monotonic() - start
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"") + (exc.stderr or b"")
        text = text.decode(errors="replace") if isinstance(text, bytes) else text
        return None, text[-TAIL_CHARS:], time.monotonic() - start


def classify(returncode: int | None, output: str) -> str:
    """pytest's exit code -> caught (tests failed), survived (passed), broken (collection or usage error,
    no tests run), timeout."""
    if returncode is None:
        return "timeout"
    if returncode == 0:
        return "survived"
    if returncode == 1 and "error during collection" not in output and "errors during collection" not in output:
        return "caught"
    return "broken"


def _apply(copy: Path, mutation: dict) -> tuple[Path, str, str | None]:
    """Write the mutated file into the copy; returns (path, original text, problem or None)."""
    path = copy / mutation["file"]
    original = path.read_text(encoding="utf-8")
    if "append" in mutation:  # the perturbations replace a method at the end of its module
        mutated = original + mutation["append"]
    elif original.count(mutation["find"]) != 1:
        return path, original, f"find occurs {original.count(mutation['find'])} times"
    else:
        mutated = original.replace(mutation["find"], mutation["replace"])
    path.write_text(mutated, encoding="utf-8")
    if path.suffix == ".py":
        try:
            compile(mutated, str(path), "exec")
        except SyntaxError as exc:
            return path, original, f"the mutated file does not compile: {exc}"
    return path, original, None


def run_mode(copy: Path, mode: dict, timeout_s: float, deselect: tuple[str, ...] = ()) -> dict:
    """Apply one mode's mutation to the copy, run its tests, restore the file. A mode with `stages` (lists of
    tests, each a subset of `tests`, the last usually all of them) runs them in order and stops at the first
    that fails: a test of the selection that fails on its own is a failure of the selection, found sooner."""
    path, original, problem = _apply(copy, mode["mutation"])
    stages, seconds, stage = mode.get("stages") or [mode["tests"]], 0.0, 0
    try:
        if problem:
            return {"id": mode["id"], "status": "broken", "seconds": 0.0, "detail": problem}
        for index, tests in enumerate(stages):
            stage = index
            code, output, took = _pytest(copy, tests, timeout_s, deselect)
            seconds += took
            if code != 0:
                break
    finally:
        path.write_text(original, encoding="utf-8")
    status = classify(code, output)
    result = {"id": mode["id"], "status": status, "seconds": round(seconds, 2)}
    if len(stages) > 1:
        result["stage"] = stage
    if status == "caught":  # which test caught it (the evidence names it)
        result["caught_by"] = _failed_tests(output)[:1]
    else:
        result["detail"] = output
    return result


def _failed_tests(output: str) -> list[str]:
    """The test ids of pytest's short summary ("FAILED tests/x.py::test - why", "ERROR tests/x.py"); a captured
    log line that starts with ERROR ("ERROR    metainfer:llm_engine.py:285 ...") is not one."""
    ids = [line.split(" ", 1)[1].split(" - ", 1)[0].strip() for line in output.splitlines()
           if line.startswith(("FAILED ", "ERROR "))]
    return [i for i in ids if i.split("::", 1)[0].endswith(".py")]


def _verify_catchers(copy: Path, results: dict[str, dict], timeout_s: float, deselect: tuple[str, ...]) -> dict:
    """The catchers' baseline: every test that caught a mode, run once on the unmutated copy; a mode caught by a
    test that also fails unmutated is 'unverified', not caught."""
    catchers = sorted({t for r in results.values() for t in r.get("caught_by", [])})
    if not catchers:
        return {"status": "passed", "tests": 0, "seconds": 0.0, "deselected": list(deselect), "kind": "catchers"}
    start = time.monotonic()
    extra = [arg for test in deselect for arg in ("--deselect", test)]
    try:
        out = subprocess.run(sandbox_command(copy, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, *catchers),
                             cwd=copy, capture_output=True, text=True, timeout=timeout_s)
        code, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired:
        code, text = None, ""
    failing = set(_failed_tests(text))
    for result in results.values():
        if result["status"] == "caught" and (code is None or set(result.get("caught_by", [])) & failing):
            result["status"] = "unverified"
    return {"status": "passed" if code == 0 else "failed", "returncode": code, "tests": len(catchers),
            "failing": sorted(failing), "seconds": round(time.monotonic() - start, 2), "deselected": list(deselect),
            "kind": "catchers"}


def run_mutants(modes: list[dict], repo_root, jobs: int = 1, timeout_s: float = 300,
                log=None, commit: str | None = None, deselect: tuple[str, ...] = (), on_result=None,
                baseline_first: bool = True) -> dict:
    """Baseline (every mode's tests on the unmutated copy) then each mode on its own mutated file, `jobs`
    copies in parallel. A failing baseline stops the run: no mode's result would mean anything. `deselect`:
    tests left out of every run (one already failing on a shared tree for an unrelated reason; recorded).
    `baseline_first=False` (a large selection on a busy machine): no upfront baseline; instead every test that
    caught a mode runs once unmutated at the end, and a mode whose catcher fails there too is not caught."""
    log = log or (lambda msg: None)
    start, jobs = time.monotonic(), max(1, min(jobs, len(modes) or 1))
    with tempfile.TemporaryDirectory(prefix="metainfer-mutants-") as tmp:
        copies = [make_copy(repo_root, Path(tmp) / f"copy{i}", commit) for i in range(jobs)]
        for copy in copies:
            check_imports_copy(copy)
        tests = list(dict.fromkeys(t for mode in modes for t in mode["tests"]))
        baseline = {}
        if baseline_first:
            code, output, seconds = _pytest(copies[0], tests, timeout_s * 2, deselect) if tests else (0, "", 0.0)
            baseline = {"status": "passed" if code == 0 else "failed", "returncode": code,
                        "seconds": round(seconds, 2), "tests": len(tests), "deselected": list(deselect)}
            log(f"baseline: {baseline['status']} ({len(tests)} tests, {seconds:.1f} s)")
            if code != 0:
                baseline["detail"] = output
                return {"caught": 0, "total": len(modes), "score": 0.0, "modes": [], "baseline": baseline,
                        "survivors": [m["id"] for m in modes], "wall_s": round(time.monotonic() - start, 1)}
        results: dict[str, dict] = {}
        todo: queue.Queue = queue.Queue()
        for mode in modes:
            todo.put(mode)

        def worker(copy: Path) -> None:
            while True:
                try:
                    mode = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    result = run_mode(copy, mode, timeout_s, deselect)
                except Exception as exc:  # a harness failure is reported, never a silent gap in the results
                    result = {"id": mode["id"], "status": "broken", "seconds": 0.0, "detail": repr(exc)}
                results[mode["id"]] = result
                log(f"{result['status']:>8} {result['seconds']:6.1f} s  {mode['id']}")
                if on_result is not None:  # e.g. a progress file, so a long run stopped midway keeps its results
                    on_result(result)

        threads = [threading.Thread(target=worker, args=(copy,)) for copy in copies]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if not baseline_first:
            baseline = _verify_catchers(copies[0], results, timeout_s * 4, deselect)
            log(f"catchers' baseline: {baseline['status']} ({baseline['tests']} tests, {baseline['seconds']} s)")
    ordered = [results[m["id"]] for m in modes]
    caught = sum(r["status"] == "caught" for r in ordered)
    return {"caught": caught, "total": len(modes), "score": caught / len(modes) if modes else 1.0,
            "modes": ordered, "baseline": baseline,
            "survivors": [r["id"] for r in ordered if r["status"] != "caught"],
            "wall_s": round(time.monotonic() - start, 1)}


# -- CLI -------------------------------------------------------------------------------------------------


def _default_root() -> Path:
    here = Path(__file__).resolve().parents[2]
    return here if (here / ".git").exists() else Path.cwd()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metainfer.knowledge.mutants",
                                     description="Run the failure-mode library's mutations against the tests.")
    parser.add_argument("--only", nargs="+", metavar="ID", help="run only these mode ids")
    parser.add_argument("--json", metavar="PATH", help="write the full result here")
    parser.add_argument("--jobs", type=int, default=1, help="parallel sandbox copies (default 1)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per mode's pytest run")
    parser.add_argument("--repo", default=None, help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    root = Path(args.repo) if args.repo else _default_root()
    modes = load_failure_modes()
    if args.only:
        unknown = set(args.only) - {m["id"] for m in modes}
        if unknown:
            parser.error(f"unknown mode id(s): {', '.join(sorted(unknown))}")
        modes = [m for m in modes if m["id"] in args.only]
    problems = check_library(modes, root)
    if problems:
        print("library problems:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    result = run_mutants(modes, root, jobs=args.jobs, timeout_s=args.timeout,
                         log=lambda msg: print(msg, file=sys.stderr, flush=True))
    from metainfer.knowledge.gates import provenance

    argv = sys.argv[1:] if argv is None else argv
    result.update(provenance(shlex.join(["python", "-m", "metainfer.knowledge.mutants", *argv]), str(root)))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"caught {result['caught']}/{result['total']} (score {result['score']:.3f}), "
          f"baseline {result['baseline']['status']}, wall {result['wall_s']} s")
    for mode in result["modes"]:
        if mode["status"] != "caught":
            print(f"  {mode['status']}: {mode['id']}")
    return 0 if result["baseline"]["status"] == "passed" and result["caught"] == result["total"] else 1


if __name__ == "__main__":
    sys.exit(main())

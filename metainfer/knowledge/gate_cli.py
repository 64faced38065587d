"""`metainfer gate [PHASE ...|all] [--quick] [--evidence DIR] [--mutants] [--perturb] [--update-manifest]`:
run the blueprint's phase gates (metainfer/knowledge/gates.py); --mutants the failure-mode library,
--perturb the quick gates' sensitivity (metainfer/knowledge/perturb.py)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time


def add_parser(sub) -> None:
    p = sub.add_parser("gate", help="run the blueprint's phase gates", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phases", nargs="*", default=["all"], help="phase ids (P0..P10) or all (default)")
    p.add_argument("--quick", action="store_true", help="each phase's quick selection (the fast tier)")
    p.add_argument("--evidence", default=None, help="write one JSON per gate into this folder")
    p.add_argument("--mutants", action="store_true", help="also run the failure-mode library's mutations")
    p.add_argument("--perturb", action="store_true",
                   help="also check the quick gates catch a perturbed output of every CPU-path blueprint function")
    p.add_argument("--perturb-only", nargs="+", metavar="ID", default=None,
                   help="with --perturb: only these perturbation ids (perturb.<qualname>) or node ids")
    p.add_argument("--committed", action="store_true",
                   help="--mutants / --perturb on a copy of the last commit, not the work tree (a shared tree)")
    p.add_argument("--perturb-hints", nargs="*", default=[], metavar="PATH",
                   help="--perturb: earlier results (JSON or perturb_progress.jsonl) whose catching tests run first")
    p.add_argument("--jobs", type=int, default=1, help="--perturb: sandbox copies run in parallel (default 1)")
    p.add_argument("--deselect", action="append", default=[], metavar="TEST",
                   help="--mutants / --perturb: leave this test out (one failing on the tree for another reason; "
                        "the evidence records it)")
    p.add_argument("--update-manifest", action="store_true",
                   help="rewrite gate_manifest.json from the current test files (a deliberate, reviewed change)")
    p.set_defaults(func=run)


def command_line(args) -> str:
    """The top-level command, rebuilt from the parsed options (evidence names what produced it)."""
    parts = ["metainfer", "gate", *args.phases]
    for flag in ("quick", "mutants", "perturb", "committed", "update_manifest"):
        parts += [f"--{flag.replace('_', '-')}"] if getattr(args, flag) else []
    parts += ["--evidence", args.evidence] if args.evidence else []
    parts += ["--perturb-only", *args.perturb_only] if args.perturb_only else []
    parts += ["--perturb-hints", *args.perturb_hints] if args.perturb_hints else []
    parts += ["--jobs", str(args.jobs)] if args.jobs != 1 else []
    parts += [arg for test in args.deselect for arg in ("--deselect", test)]
    return shlex.join(parts)


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _load_1min() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # no load average on this platform
        return None


def _clock(start: float, load_start: float | None) -> dict:
    """The run's wall time so far, its start (UTC) and the 1-minute load average at its start and now: on shared
    cores a duration means nothing without the load it ran under."""
    now = time.time()
    return {"run_started_utc": _utc(start), "run_wall_s": round(now - start, 1), "run_ended_utc": _utc(now),
            "load_1min_start": load_start, "load_1min_end": _load_1min()}


def _write(evidence: str, name: str, record: dict, start: float, load_start: float | None) -> None:
    os.makedirs(evidence, exist_ok=True)
    with open(os.path.join(evidence, name), "w") as f:
        json.dump({**record, **_clock(start, load_start)}, f, indent=1)


def _unwritable(folder: str) -> str | None:
    """Why evidence cannot be written into `folder` (created if missing), or None."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        return err.strerror or str(err)
    return None if os.access(folder, os.W_OK) else "not writable"


def run(args) -> int:
    start, load_start = time.time(), _load_1min()
    from metainfer.knowledge.blueprint import REPO_ROOT, load_blueprint
    from metainfer.knowledge.cli import emit
    from metainfer.knowledge.gates import MANIFEST_PATH, build_manifest, provenance, run_gate

    blueprint = load_blueprint()
    if args.update_manifest:
        with open(MANIFEST_PATH, "w") as f:
            json.dump(build_manifest(blueprint), f, indent=1, sort_keys=True)
            f.write("\n")
        emit(f"wrote {os.path.relpath(MANIFEST_PATH)}")
        return 0
    known = [p["id"] for p in blueprint["phases"]]
    ids = known if args.phases == ["all"] else [i.upper() for i in args.phases]
    unknown = [i for i in ids if i not in known]
    if unknown:
        print(f"metainfer: error: unknown phase(s) {', '.join(unknown)} (phases: {', '.join(known)}, or all)",
              file=sys.stderr)
        return 2
    if args.evidence:  # before any gate runs: a folder that cannot be written would lose their results
        problem = _unwritable(args.evidence)
        if problem:
            print(f"metainfer: error: --evidence {args.evidence}: {problem}", file=sys.stderr)
            return 2
    failed = 0
    every = args.phases == ["all"]  # in order, each phase's own selection: the earlier ones just ran
    for i, phase_id in enumerate(ids):
        result = run_gate(phase_id, args.quick, blueprint, regression=not every, l0=i == 0,
                          command=command_line(args))
        failed += not result["passed"]
        emit(f"{phase_id} {'PASS' if result['passed'] else 'FAIL'} {result['seconds']:.1f}s "
              f"{result.get('pytest', {}).get('summary', '')} " + "; ".join(result["errors"]))
        if args.evidence:  # run_*: the whole command so far (this gate's own time is "seconds")
            _write(args.evidence, f"gate_{phase_id}.json", result, start, load_start)
    if args.mutants:
        from metainfer.knowledge import mutants

        origin = provenance(command_line(args), REPO_ROOT, committed=args.committed)  # HEAD as the copy is made
        report = mutants.run_mutants(mutants.load_failure_modes(), REPO_ROOT, commit="HEAD" if args.committed else None,
                                     deselect=tuple(args.deselect))
        report.update(origin)
        emit(f"mutants: {report['caught']}/{report['total']} caught")
        failed += report["caught"] != report["total"]
        if args.evidence:
            _write(args.evidence, "mutants.json", report, start, load_start)
    if args.perturb:
        from metainfer.knowledge import mutants, perturb

        hints = perturb.previous_catchers(os.path.join(REPO_ROOT, "docs", "results", "knowledge_perturb.json"),
                                          *args.perturb_hints)
        modes = perturb.perturbation_modes(blueprint, REPO_ROOT, only=args.perturb_only, hints=hints)
        progress = open(os.path.join(args.evidence, "perturb_progress.jsonl"), "a") if args.evidence else None

        def record(result: dict) -> None:
            if progress is not None:
                progress.write(json.dumps(result) + "\n")
                progress.flush()

        origin = provenance(command_line(args), REPO_ROOT, committed=args.committed)  # HEAD as the copies are made
        report = mutants.run_mutants(modes, REPO_ROOT, log=lambda msg: print(msg, file=sys.stderr, flush=True),
                                     commit="HEAD" if args.committed else None,
                                     deselect=tuple(args.deselect) + perturb.NOT_CONTRACTS,
                                     on_result=record, jobs=args.jobs, timeout_s=900, baseline_first=False)
        for mode, result in zip(modes, report["modes"]):
            result["nodes"] = mode["nodes"]
        report["not_cpu_path"] = perturb.not_cpu_path(blueprint)
        report.update(origin)
        emit(f"perturbations: {report['caught']}/{report['total']} caught by the quick gates "
              f"({len(report['not_cpu_path'])} refs exempt as not on the CPU path, with reasons)"
              + (f"; survived: {', '.join(report['survivors'])}" if report.get("survivors") else ""))
        failed += report["caught"] != report["total"]
        if args.evidence:
            _write(args.evidence, "perturb.json", report, start, load_start)
    if args.evidence:
        _write(args.evidence, "run.json", {"command": command_line(args), "phases": ids, "failed": failed},
               start, load_start)
    return 1 if failed else 0


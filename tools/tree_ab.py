"""One engine protocol run by another tree's `metainfer`, for A/B across commits on one machine.

A change without a switch (a scheduling rule, a kernel rewrite) is measured against the commit before it on the
same machine, in one call: two device machines differ by 1-3% (docs/PERFORMANCE.md, "Noise").

    python -m tools.tree_ab prepare COMMIT      # here: .tree_ab/<commit>/metainfer (git-ignored; carry .tree_ab)
    python -m tools.gpu_suite --sections tree_ab --tree-ab-dir .tree_ab/<commit> [--tree-ab-protocol nano_vllm]
        [--tree-ab-engine-kw '{"num_kv_blocks": 6192}'] [--tree-ab-order ABBA]

The suite section runs `python -m tools.tree_ab run ...` once per letter of the order, in a fresh process whose
working directory is the tree (A: this checkout as it is, uncommitted changes included), so `import metainfer` takes
that tree's package; the run refuses any `metainfer` module from elsewhere, before its engine builds and after its
protocol. Both sides run the protocol through their own `metainfer.bench.throughput.run_throughput` (present since
the nano-vllm figures began); the comparison is refused where the runs' token totals or request hashes differ. Each
finished run is written to the record file at once, so a call cut short keeps the runs it made.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_PREFIX = "TREE_AB_RESULT "
COMMIT_FILE = "TREE_AB_COMMIT"
# run_throughput's arguments per protocol (the suite's: figures.throughput, serving.throughput_1k)
PROTOCOLS = {
    "nano_vllm": ({}, {}),
    "throughput_1k": (dict(num_seqs=1000, min_in=1000, max_in=1000, min_out=1000, max_out=1000), {"max_num_seqs": 512}),
    "smoke": (dict(num_seqs=4, min_in=8, max_in=16, min_out=2, max_out=6), {}),  # the CPU test's
}


def prepare(commit: str, root: str = ROOT, dest: str | None = None) -> str:
    """COMMIT's `metainfer` package (its tuned tables included) extracted under dest (default root/.tree_ab) in a
    folder named by the commit id; returns that folder. The full id is written beside the package, for the results
    to name."""
    full = _git(root, "rev-parse", "--verify", f"{commit}^{{commit}}").decode().strip()
    archive = _git(root, "archive", full, "metainfer")  # before the folder: a commit without the package leaves none
    folder = os.path.join(dest or os.path.join(root, ".tree_ab"), full[:12])
    os.makedirs(folder, exist_ok=True)
    subprocess.run(["tar", "-x", "-f", "-", "-C", folder], input=archive, check=True)
    with open(os.path.join(folder, COMMIT_FILE), "w") as f:
        f.write(full + "\n")
    return folder


def _git(root: str, *args: str) -> bytes:
    proc = subprocess.run(["git", "-C", root, *args], capture_output=True)
    if proc.returncode:
        raise RuntimeError(f"git {' '.join(args)}: {proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout


def tree_commit(tree: str) -> str:
    """The commit a prepared tree holds ("checkout" for a folder `prepare` did not make, e.g. this working tree)."""
    path = os.path.join(tree, COMMIT_FILE)
    return open(path).read().strip() if os.path.exists(path) else "checkout"


def imported_tree() -> str:
    """The folder holding the `metainfer` this process imports."""
    import metainfer

    return os.path.dirname(os.path.dirname(os.path.abspath(metainfer.__file__)))


def _refuse_strays(tree: str) -> None:
    """A submodule the tree lacks may still import from elsewhere (an editable install's finder serves any
    `metainfer.X` from its own checkout): every loaded module of the package must be the tree's."""
    strays = sorted(name for name, mod in sys.modules.items() if name.split(".")[0] == "metainfer"
                    and getattr(mod, "__file__", None) and not os.path.realpath(mod.__file__).startswith(
                        os.path.join(os.path.realpath(tree), "metainfer", "")))
    if strays:
        raise RuntimeError(f"modules of metainfer imported from outside {tree}: {strays}")


def request_hash(llm, run_throughput, bench_kw: dict) -> str | None:
    """sha256 of the requests run_throughput makes (each prompt's ids and max_tokens), through the tree's own
    `make_requests` with run_throughput's arguments; None where the tree's bench differs in shape from this one's
    (then the token totals are the only check)."""
    try:
        from metainfer.bench.throughput import make_requests

        args = {name: p.default for name, p in inspect.signature(run_throughput).parameters.items()
                if p.default is not inspect.Parameter.empty}
        args.update(bench_kw)
        prompts, params = make_requests(args["num_seqs"], args["min_in"], args["max_in"], args["min_out"],
                                        args["max_out"], vocab=llm.llm_engine.spec.vocab_size)
        items = [[list(p["prompt_token_ids"]), sp.max_tokens] for p, sp in zip(prompts, params, strict=True)]
    except Exception:  # noqa: BLE001 - an older tree's bench: no hash, not a failed run
        return None
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


def run_protocol(model: str, protocol: str, engine_kw: dict, expect_tree: str | None = None) -> dict:
    """One protocol run in this process with whichever `metainfer` it imports (refused before the engine builds
    when that is not expect_tree's); the figures, the request hash and the tree."""
    tree = imported_tree()
    if expect_tree and os.path.realpath(tree) != os.path.realpath(expect_tree):
        raise RuntimeError(f"this process imports metainfer from {tree}, not from {expect_tree}")
    from metainfer import LLM
    from metainfer.bench.throughput import run_throughput

    _refuse_strays(tree)
    bench_kw, protocol_engine_kw = PROTOCOLS[protocol]
    llm = LLM(model, **{**protocol_engine_kw, **engine_kw})
    full = run_throughput(llm, progress=False, **bench_kw)
    _refuse_strays(tree)
    keys = ("output_tok_s", "elapsed_s", "input_tokens", "output_tokens", "preemptions")
    return {"tree": tree, **{k: full.get(k) for k in keys}, "num_kv_blocks": llm.llm_engine.block_manager.num_blocks,
            "request_hash": request_hash(llm, run_throughput, bench_kw)}


def run_in_tree(tree: str, model: str, protocol: str, engine_kw: dict, timeout_s: float | None = None) -> dict:
    """run_protocol in a fresh process whose `metainfer` is tree's; its result, checked to come from that tree."""
    tree = os.path.abspath(tree)  # the run's working directory is the tree: a relative --expect-tree would miss
    cmd = [sys.executable, "-m", "tools.tree_ab", "run", "--model", model, "--protocol", protocol,
           "--engine-kw", json.dumps(engine_kw), "--expect-tree", tree]
    # `tools` from this checkout; the working directory (the tree) comes first on sys.path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode or not lines:
        why = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        raise RuntimeError(f"tree {tree}: {why}: {(proc.stderr or proc.stdout)[-3000:]}")
    return {**json.loads(lines[-1][len(RESULT_PREFIX):]), "commit": tree_commit(tree),
            "stderr_tail": proc.stderr[-1500:]}


def compare(runs: list[dict]) -> dict:
    """A's and B's mean output tok/s and B / A, from runs labelled "A" / "B"; refused where the runs' token totals
    or (where both trees give one) request hashes differ: the two trees generated different request sets."""
    totals = {(r["input_tokens"], r["output_tokens"]) for r in runs}
    hashes = {r.get("request_hash") for r in runs} - {None}
    if len(totals) != 1 or len(hashes) > 1:
        each = [(r["label"], r.get("commit", "?")[:12], r["input_tokens"], r["output_tokens"],
                 (r.get("request_hash") or "-")[:12]) for r in runs]
        raise ValueError(f"the runs' requests differ (label, commit, input tokens, output tokens, hash): {each}")
    means = {}
    for label in ("A", "B"):
        figures = [r["output_tok_s"] for r in runs if r["label"] == label]
        if not figures:
            raise ValueError(f"no {label} run in the order")
        means[label] = sum(figures) / len(figures)
    pools = {r["label"]: r.get("num_kv_blocks") for r in runs}
    return {"a_mean": means["A"], "b_mean": means["B"], "b_over_a": means["B"] / means["A"],
            "pools_differ": len({r.get("num_kv_blocks") for r in runs}) > 1, "num_kv_blocks": pools}


def ab(tree_b: str, model: str, protocol: str, engine_kw: dict, order: str = "ABBA", tree_a: str = ROOT,
       timeout_s: float | None = None, record_path: str | None = None) -> dict:
    """Interleaved runs (order: a string of A and B) of the protocol with tree_a's and tree_b's `metainfer`; each
    finished run is written to record_path (JSON) before the next starts."""
    if set(order) != {"A", "B"}:  # checked before the runs: a side missing would only show after all of them
        raise ValueError(f"order must be a string of A and B, both, got {order!r}")
    runs = []
    for label in order:
        res = run_in_tree(tree_a if label == "A" else tree_b, model, protocol, engine_kw, timeout_s)
        runs.append({"label": label, **res})
        if record_path:
            with open(record_path, "w") as f:
                json.dump({"protocol": protocol, "engine_kw": engine_kw, "order": order, "runs": runs}, f, indent=1)
        print(f"tree_ab {label} {res['commit'][:12]}: {res['output_tok_s']:.1f} tok/s, {res['preemptions']} "
              "preemptions", flush=True)
    return {"protocol": protocol, "engine_kw": engine_kw, "order": order, "runs": runs, **compare(runs)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.tree_ab", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="extract COMMIT's metainfer under .tree_ab/")
    prep.add_argument("commit")
    run = sub.add_parser("run", help="one protocol run with the metainfer of the working directory")
    run.add_argument("--model", required=True)
    run.add_argument("--protocol", choices=sorted(PROTOCOLS), default="nano_vllm")
    run.add_argument("--engine-kw", default="{}", help="LLM keywords as a JSON object")
    run.add_argument("--expect-tree", default=None, help="refuse to run unless metainfer comes from this folder")
    args = p.parse_args(argv)
    if args.command == "prepare":
        folder = prepare(args.commit)
        print(f"{folder}\ncarry {os.path.relpath(os.path.dirname(folder), ROOT)} to the device machine; "
              f"--tree-ab-dir {os.path.relpath(folder, ROOT)}")
        return
    res = run_protocol(args.model, args.protocol, json.loads(args.engine_kw), args.expect_tree)
    print(RESULT_PREFIX + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()

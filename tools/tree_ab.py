"""One engine protocol run by another tree's `metainfer`, for A/B across commits on one machine.

A change without a switch (a scheduling rule, a kernel rewrite) is measured against the commit before it on the
same machine, in one call: two device machines differ by 1-3% (docs/PERFORMANCE.md, "Noise").

    python -m tools.tree_ab prepare COMMIT      # here: .tree_ab/<commit>/metainfer (git-ignored; carry .tree_ab)
    python -m tools.gpu_suite --sections tree_ab --tree-ab-dir .tree_ab/<commit> [--tree-ab-protocol nano_vllm]
        [--tree-ab-engine-kw '{"num_kv_blocks": 6192}'] [--tree-ab-order ABBA]

The suite section runs `python -m tools.tree_ab run ...` once per letter of the order, in a fresh process whose
working directory is the tree (A: this checkout), so `import metainfer` takes that tree's package; the run checks
that it did before its engine builds. Both sides run the protocol through their own
`metainfer.bench.throughput.run_throughput` (present since the nano-vllm figures began), and the section refuses a
comparison whose token totals differ.
"""

from __future__ import annotations

import argparse
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
    full = subprocess.run(["git", "-C", root, "rev-parse", "--verify", f"{commit}^{{commit}}"], check=True,
                          capture_output=True, text=True).stdout.strip()
    folder = os.path.join(dest or os.path.join(root, ".tree_ab"), full[:12])
    os.makedirs(folder, exist_ok=True)
    archive = subprocess.run(["git", "-C", root, "archive", full, "metainfer"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    with open(os.path.join(folder, COMMIT_FILE), "w") as f:
        f.write(full + "\n")
    return folder


def tree_commit(tree: str) -> str:
    """The commit a prepared tree holds ("checkout" for this working tree)."""
    path = os.path.join(tree, COMMIT_FILE)
    return open(path).read().strip() if os.path.exists(path) else "checkout"


def imported_tree() -> str:
    """The folder holding the `metainfer` this process imports."""
    import metainfer

    return os.path.dirname(os.path.dirname(os.path.abspath(metainfer.__file__)))


def run_protocol(model: str, protocol: str, engine_kw: dict, expect_tree: str | None = None) -> dict:
    """One protocol run in this process with whichever `metainfer` it imports (refused before the engine builds
    when that is not expect_tree's); the figures and the tree."""
    tree = imported_tree()
    if expect_tree and os.path.realpath(tree) != os.path.realpath(expect_tree):
        raise RuntimeError(f"this process imports metainfer from {tree}, not from {expect_tree}")
    from metainfer import LLM
    from metainfer.bench.throughput import run_throughput

    bench_kw, protocol_engine_kw = PROTOCOLS[protocol]
    llm = LLM(model, **{**protocol_engine_kw, **engine_kw})
    full = run_throughput(llm, progress=False, **bench_kw)
    # a submodule the tree lacks may still import from elsewhere (an editable install's finder serves any
    # `metainfer.X` from its own checkout): every module of the package must be the tree's
    strays = sorted(name for name, mod in sys.modules.items() if name.split(".")[0] == "metainfer"
                    and getattr(mod, "__file__", None) and not os.path.realpath(mod.__file__).startswith(
                        os.path.join(os.path.realpath(tree), "metainfer", "")))
    if strays:
        raise RuntimeError(f"modules of metainfer imported from outside {tree}: {strays}")
    keys = ("output_tok_s", "elapsed_s", "input_tokens", "output_tokens", "preemptions")
    return {"tree": tree, **{k: full.get(k) for k in keys}, "num_kv_blocks": llm.llm_engine.block_manager.num_blocks}


def run_in_tree(tree: str, model: str, protocol: str, engine_kw: dict, timeout_s: float | None = None) -> dict:
    """run_protocol in a fresh process whose `metainfer` is tree's; its result, checked to come from that tree."""
    tree = os.path.abspath(tree)  # the run's working directory is the tree: a relative --expect-tree would miss
    cmd = [sys.executable, "-m", "tools.tree_ab", "run", "--model", model, "--protocol", protocol,
           "--engine-kw", json.dumps(engine_kw), "--expect-tree", tree]
    env = {**os.environ, "PYTHONPATH": ROOT}  # `tools` from this checkout; the working directory comes first
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode or not lines:
        raise RuntimeError(f"tree {tree}: exit {proc.returncode}: {(proc.stderr or proc.stdout)[-2000:]}")
    return {**json.loads(lines[-1][len(RESULT_PREFIX):]), "commit": tree_commit(tree)}


def compare(runs: list[dict]) -> dict:
    """A's and B's mean output tok/s and B / A, from runs labelled "A" / "B"; refused where the runs' token totals
    differ (the two trees generated different request sets)."""
    totals = {(r["input_tokens"], r["output_tokens"]) for r in runs}
    if len(totals) != 1:
        raise ValueError(f"the runs' (input, output) token totals differ: {sorted(totals)}; the protocols differ")
    means = {}
    for label in ("A", "B"):
        figures = [r["output_tok_s"] for r in runs if r["label"] == label]
        if not figures:
            raise ValueError(f"no {label} run in the order")
        means[label] = sum(figures) / len(figures)
    return {"a_mean": means["A"], "b_mean": means["B"], "b_over_a": means["B"] / means["A"]}


def ab(tree_b: str, model: str, protocol: str, engine_kw: dict, order: str = "ABBA", tree_a: str = ROOT,
       timeout_s: float | None = None) -> dict:
    """Interleaved runs (order: a string of A and B) of the protocol with tree_a's and tree_b's `metainfer`."""
    if set(order) != {"A", "B"}:  # checked before the runs: a side missing would only show after all of them
        raise ValueError(f"order must be a string of A and B, both, got {order!r}")
    runs = []
    for label in order:
        res = run_in_tree(tree_a if label == "A" else tree_b, model, protocol, engine_kw, timeout_s)
        runs.append({"label": label, **res})
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

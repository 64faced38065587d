"""tools/tree_ab: a protocol run with another tree's `metainfer` in a fresh process. The checks: `prepare` extracts
the named commit's package (read back with git itself), each side's run imports its own tree's package (a tree
without one is refused, not silently run with this checkout's), the labels map to their trees, and runs whose
request sets differ are not compared."""

import json
import os
import subprocess

import pytest

from tests.helpers.tiny_models import build_tiny_model
from tools import tree_ab

pytestmark = pytest.mark.filterwarnings("ignore")


def _git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_prepare_extracts_the_commits_package_not_the_working_tree(tmp_path):
    repo = tmp_path / "repo"
    (repo / "metainfer").mkdir(parents=True)
    _git(tmp_path, "init", "-q", str(repo))
    (repo / "metainfer" / "__init__.py").write_text("MARK = 'first'\n")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "first")
    first = _git(repo, "rev-parse", "HEAD")
    (repo / "metainfer" / "__init__.py").write_text("MARK = 'second'\n")  # uncommitted: must not be taken
    folder = tree_ab.prepare("HEAD", root=str(repo), dest=str(tmp_path / "trees"))
    assert os.path.basename(folder) == first[:12]
    assert open(os.path.join(folder, "metainfer", "__init__.py")).read() == _git(repo, "show",
                                                                                 "HEAD:metainfer/__init__.py") + "\n"
    assert tree_ab.tree_commit(folder) == first
    assert tree_ab.tree_commit(str(repo)) == "checkout"


def _stub_tree(root, tok_s: float, output_tokens: int = 40, first_id: int | None = None):
    """A tree whose `metainfer` answers the protocol with fixed figures (the wiring test's trees); with first_id its
    bench also has make_requests (the request hash's source), its first prompt starting at that id."""
    pkg = root / "metainfer"
    (pkg / "bench").mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from types import SimpleNamespace\n"
        "class LLM:\n"
        "    def __init__(self, model, **kw):\n"
        "        self.kw = kw\n"
        "        blocks = SimpleNamespace(num_blocks=kw.get('num_kv_blocks', 7))\n"
        "        self.llm_engine = SimpleNamespace(block_manager=blocks, spec=SimpleNamespace(vocab_size=100))\n")
    (pkg / "bench" / "__init__.py").write_text("")
    (pkg / "bench" / "throughput.py").write_text(
        "def run_throughput(llm, progress=True, **kw):\n"
        f"    return dict(output_tok_s={tok_s}, elapsed_s=1.0, input_tokens=30, output_tokens={output_tokens},\n"
        "                preemptions=len(kw))\n")
    if first_id is not None:
        (pkg / "bench" / "throughput.py").write_text(
            (pkg / "bench" / "throughput.py").read_text()
            + "from types import SimpleNamespace\n"
            "def make_requests(num_seqs, min_in, max_in, min_out, max_out, seed=0, vocab=10001):\n"
            f"    return [{{'prompt_token_ids': [{first_id}, 2]}}], [SimpleNamespace(max_tokens=3)]\n")
        (pkg / "bench" / "throughput.py").write_text((pkg / "bench" / "throughput.py").read_text().replace(
            "def run_throughput(llm, progress=True, **kw):",
            "def run_throughput(llm, num_seqs=1, min_in=1, max_in=2, min_out=1, max_out=2, progress=True, **kw):"))
    return str(root)


def test_each_label_runs_its_own_trees_package(tmp_path):
    a, b = _stub_tree(tmp_path / "a", 100.0), _stub_tree(tmp_path / "b", 110.0)
    res = tree_ab.ab(b, "unused-model", "nano_vllm", {"num_kv_blocks": 6192}, order="ABBA", tree_a=a)
    assert [(r["label"], r["tree"], r["output_tok_s"]) for r in res["runs"]] == [
        ("A", a, 100.0), ("B", b, 110.0), ("B", b, 110.0), ("A", a, 100.0)]
    assert all(r["num_kv_blocks"] == 6192 for r in res["runs"])  # the engine keywords reach LLM
    assert res["b_over_a"] == pytest.approx(1.1)
    one_k = tree_ab.ab(b, "unused-model", "throughput_1k", {}, order="AB", tree_a=a)
    assert one_k["runs"][0]["preemptions"] == 5  # the 1,000 x 1,000 protocol's five bench arguments arrived


def test_a_tree_without_its_own_package_is_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RuntimeError, match="not from"):  # it would have imported this checkout's metainfer
        tree_ab.run_in_tree(str(empty), "unused-model", "smoke", {"device": "not-a-device"})


def test_runs_with_different_request_sets_are_not_compared(tmp_path):
    a, b = _stub_tree(tmp_path / "a", 100.0), _stub_tree(tmp_path / "b", 110.0, output_tokens=41)
    with pytest.raises(ValueError, match="requests differ"):  # the token totals
        tree_ab.ab(b, "unused-model", "nano_vllm", {}, order="AB", tree_a=a)
    # equal totals, different prompt ids: the request hashes differ
    a, b = _stub_tree(tmp_path / "a2", 100.0, first_id=1), _stub_tree(tmp_path / "b2", 110.0, first_id=2)
    with pytest.raises(ValueError, match="requests differ"):
        tree_ab.ab(b, "unused-model", "nano_vllm", {}, order="AB", tree_a=a)
    same = _stub_tree(tmp_path / "b3", 110.0, first_id=1)
    res = tree_ab.ab(same, "unused-model", "nano_vllm", {}, order="AB", tree_a=a)
    assert res["runs"][0]["request_hash"] == res["runs"][1]["request_hash"] is not None
    with pytest.raises(ValueError, match="string of A and B"):
        tree_ab.ab(b, "unused-model", "nano_vllm", {}, order="AC", tree_a=a)


@pytest.mark.slow
def test_this_commit_against_itself_on_a_tiny_model(tmp_path):
    """The real engine on both sides (HEAD extracted against this checkout): the same request set, both trees."""
    model = str(tmp_path / "model")
    build_tiny_model(model, "qwen3")
    tree = tree_ab.prepare("HEAD", dest=str(tmp_path / "trees"))
    res = tree_ab.ab(tree, model, "smoke", {"device": "cpu", "dtype": "float32", "enforce_eager": True}, order="AB")
    a, b = res["runs"]
    assert a["tree"] == tree_ab.ROOT and b["tree"] == tree and b["commit"] == _git(tree_ab.ROOT, "rev-parse", "HEAD")
    assert a["output_tokens"] == b["output_tokens"] > 0 and res["b_over_a"] > 0


def test_a_relative_tree_is_its_own_folder(tmp_path, monkeypatch):
    """As the README passes it (--tree-ab-dir .tree_ab/<id>): relative to the caller, not to the run's working
    directory, which is the tree itself."""
    _stub_tree(tmp_path / ".tree_ab" / "b", 110.0)
    _stub_tree(tmp_path / "a", 100.0)
    monkeypatch.chdir(tmp_path)
    res = tree_ab.ab(os.path.join(".tree_ab", "b"), "unused-model", "nano_vllm", {}, order="AB", tree_a="a")
    assert [(r["label"], r["output_tok_s"]) for r in res["runs"]] == [("A", 100.0), ("B", 110.0)]


def test_a_submodule_from_outside_the_tree_is_refused(tmp_path):
    """The tree's package found first, but a submodule it lacks served from another folder (as an editable
    install's finder serves `metainfer.X` from its checkout): refused, not a run with the other tree's code."""
    other = _stub_tree(tmp_path / "other", 120.0)
    tree = tmp_path / "tree"
    (tree / "metainfer").mkdir(parents=True)
    init = (tmp_path / "other" / "metainfer" / "__init__.py").read_text()
    (tree / "metainfer" / "__init__.py").write_text(init + f"__path__.append({os.path.join(other, 'metainfer')!r})\n")
    with pytest.raises(RuntimeError, match="imported from outside"):
        tree_ab.run_in_tree(str(tree), "unused-model", "smoke", {})


def test_an_order_without_both_sides_is_refused_before_any_run(tmp_path):
    with pytest.raises(ValueError, match="both"):  # a missing tree would raise RuntimeError if a run started
        tree_ab.ab(str(tmp_path / "missing"), "unused-model", "nano_vllm", {}, order="AA", tree_a=str(tmp_path))


def test_each_finished_run_is_recorded_before_the_next(tmp_path):
    """A call cut short keeps the runs it made: here B's tree has no package, so the comparison never comes, and
    A's run is in the record."""
    a = _stub_tree(tmp_path / "a", 100.0)
    (tmp_path / "b").mkdir()
    record = tmp_path / "runs.json"
    with pytest.raises(RuntimeError):
        tree_ab.ab(str(tmp_path / "b"), "unused-model", "nano_vllm", {}, order="AB", tree_a=a,
                   record_path=str(record))
    runs = json.loads(record.read_text())["runs"]
    assert [(r["label"], r["output_tok_s"]) for r in runs] == [("A", 100.0)]


def test_prepare_of_a_commit_without_the_package_fails_and_leaves_no_folder(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(tmp_path, "init", "-q", str(repo))
    (repo / "README").write_text("x\n")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "no package")
    with pytest.raises(RuntimeError, match="metainfer"):
        tree_ab.prepare("HEAD", root=str(repo), dest=str(tmp_path / "trees"))
    assert not (tmp_path / "trees").exists()

"""Every building block of the paper copies alone: its closure (the definitions it reaches, whole, plus their
imports) stays within a budget, never reaches the run machinery, and pasted into an empty folder, with this
project off sys.path, gives exactly what the import gives.

The closure and its size are tools/copy_size.py's (what docs/python.md quotes): every top-level function,
class or constant a definition names, bare or as `module.name` of a project module, and so on; lines are
counted as pasted (docstrings and comments included) plus the import lines the pasted code uses."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import copy_size  # noqa: E402

# lines a student pastes, at most (docs/python.md shows each block's size); compare_sides holds the claim family
# with Holm's step-down, the p-values its intervals give, the bounds of each row, best-over-sigma rows over
# each side's own sigmas and the seed design (paired or unpaired seeds) besides the intervals
BUDGETS = {"certify:certify": 205, "certify:predict": 175, "grid:grid_certify": 440, "train_ours:ours_loss": 190,
           "train_ours:discard_hard": 220, "train_ours:radius_weights": 95, "train_baselines:smoothadv_loss": 220,
           "train_baselines:macer_loss": 155, "train_baselines:consistency_loss": 145,
           "train_baselines:smoothmix_loss": 235, "train_baselines:catrs_loss": 240, "compare:compare_sides": 435,
           "ddrs:optimize_sigma": 210}
# the other blocks a student looks for: pure too, no budget
MORE_BLOCKS = ["common:sphere_pgd", "ddrs:semi_elastic_radius", "analyze:acr", "analyze:certified_accuracy",
               "analyze:ecdf", "grid:grid_plan", "readers:read_certification_log", "compare:test_set_votes"]


def pasted(roots):
    """(the pasted file's text, lines counted, definitions): tools/copy_size.py's, the project's own measure."""
    return copy_size.pasted(roots, CODE)


CODE = copy_size.project_modules(ROOT)


@pytest.mark.parametrize("block", sorted(BUDGETS))
def test_each_building_block_pastes_within_its_budget(block):
    _, count, keys = pasted([block])
    assert count <= BUDGETS[block], f"{block}: {count} lines pasted > {BUDGETS[block]} ({len(keys)} definitions)"


@pytest.mark.parametrize("block", sorted(BUDGETS) + MORE_BLOCKS)
def test_no_building_block_reaches_the_run_machinery(block):
    text, _, keys = pasted([block])
    assert not [k for k in keys if k[0] == "machinery"], keys
    # no files written, no printing, no process groups, no argparse, no exits in what a student pastes
    found = re.findall(r"\bprint\(|open\([^)]*['\"][wax]|os\.replace|os\.remove|torch\.distributed|argparse|"
                       r"sys\.exit|\bTSVLog\b", text)
    assert not found, (block, found)


def copy_size_lines(tool, blocks):
    out = subprocess.run([sys.executable, tool, *blocks], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return {line.split("\t")[0]: line.split("\t")[1:4] for line in out.stdout.splitlines() if "\t" in line}


def test_the_project_tool_counts_as_the_budgets_and_the_workspace_tool_do():
    """tools/copy_size.py from the command line: lines equal the budgets' count; where the workspace's own
    measure is at hand beside the checkout (../shared/tools/copy_size.py), every column equals it."""
    blocks = sorted(BUDGETS) + MORE_BLOCKS
    ours = copy_size_lines(os.path.join(ROOT, "tools", "copy_size.py"), blocks)
    assert {b: int(v[0].split()[1]) for b, v in ours.items()} == {b: pasted([b])[1] for b in blocks}
    workspace = os.path.join(ROOT, "..", "shared", "tools", "copy_size.py")
    if os.path.exists(workspace):
        assert copy_size_lines(workspace, blocks) == ours


def test_the_copy_size_tool_refuses_an_unknown_block_and_writes_the_pasted_file(tmp_path):
    tool = os.path.join(ROOT, "tools", "copy_size.py")
    bad = subprocess.run([sys.executable, tool, "certify:nothing"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "no top-level 'nothing' in certify.py" in bad.stderr
    out = tmp_path / "both.py"
    done = subprocess.run([sys.executable, tool, "grid:grid_certify", "grid:grid_plan", "--emit", str(out)],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and out.read_text() == pasted(["grid:grid_certify", "grid:grid_plan"])[0]


# ----------------------------------------------------------------------------------------------------------
# Pasted into an empty folder, each block gives what the import gives
# ----------------------------------------------------------------------------------------------------------
# Each case: the roots pasted into one file, then the same script run twice, once against the import and once
# in a fresh process from the case's folder (python -E -s: the project is not on sys.path); `result` is compared.

SETUP = """
import numpy as np
import torch
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                          torch.nn.Flatten(), torch.nn.Linear(256, 10))
net[1].running_mean.uniform_(-0.1, 0.1)
images = torch.rand(12, 1, 8, 8)
labels = torch.arange(12) % 10
"""
CASES = {
    "certify": (["certify:certify"], """
net.train()
result = [certify(net, images[i], 0.5, 50, 400, 0.001, 100, 10, torch.Generator().manual_seed(i)) for i in range(3)]
result.append(net.training)
"""),
    "predict": (["certify:predict"], """
result = [predict(net, images[i], 0.25, 300, 0.001, 100, 10, torch.Generator().manual_seed(i)) for i in range(3)]
"""),
    "grid_certify": (["grid:grid_certify", "grid:grid_plan"], """
plan = grid_plan([0.25, 0.5], 0.5, 2000, 0.001)
result = [grid_certify(net.eval(), images[i], 0.5, 50, 100, 10, torch.Generator().manual_seed(i), plan)
          for i in range(2)]
"""),
    "ours_loss": (["train_ours:ours_loss"], """
torch.manual_seed(3)
out = ours_loss(net.train(), images[:4], labels[:4], 0.5, 2, 2, 0.25, "l2")
out["loss"].backward()
result = [out["loss"].item(), int(out["correct"]), out["total"], net[0].weight.grad.clone()]
"""),
    "discard_hard": (["train_ours:discard_hard", "train_ours:radius_weights"], """
torch.manual_seed(4)
kept, counts, got = discard_hard(net, torch.utils.data.TensorDataset(images, labels), 0.25, 20, 0.1, batch=40)
result = [kept, counts, got, radius_weights(counts, 20, 0.1, 0.75, "paper")]
"""),
    "smoothadv_loss": (["train_baselines:smoothadv_loss", "train_baselines:macer_loss"], """
torch.manual_seed(5)
a = smoothadv_loss(net.train(), images[:4], labels[:4], None, sigma=0.5, m=2, T=2, eps=0.5, warm=0.5)["loss"].item()
b = macer_loss(net, images[:4], labels[:4], None, sigma=0.5, m=2, beta=16.0, gamma=8.0, lbd=12.0)["loss"].item()
result = [a, b]
"""),
    "compare_sides": (["compare:compare_sides", "readers:read_certification_log", "analyze:acr",
                       "analyze:certified_accuracy", "analyze:ecdf"], """
rng = np.random.default_rng(0)
logs = []
for name, shift in (("a.tsv", 0.0), ("b.tsv", 0.4)):
    nY = rng.binomial(1000, np.clip(rng.uniform(0.3, 1.0, 200) + shift, 0, 1))
    radius = np.where(nY > 600, 0.5 * (nY - 500) / 500, 0.0)
    with open(name, "w") as f:
        f.write("idx\\tlabel\\tpredict\\tradius\\tcorrect\\ttime\\tnA\\tN\\tnY\\n")
        for i, (r, y) in enumerate(zip(radius, nY)):
            f.write(f"{i}\\t{i % 10}\\t{i % 10 if r > 0 else -1}\\t{r:.6}\\t{int(r > 0)}\\t0:00:01\\t{y}\\t1000\\t{y}\\n")
    logs.append(read_certification_log(name))
rows, facts = compare_sides([logs[0]], [logs[1]], [0.25, 0.5])
result = [rows, facts["n"], acr(logs[1]["radius"], logs[1]["correct"]),
          certified_accuracy(logs[1]["radius"], logs[1]["correct"], [0.0, 0.25]),
          ecdf(logs[1]["nY"] / logs[1]["N"], [0.5, 0.9])]
"""),
    "optimize_sigma": (["ddrs:optimize_sigma", "common:sphere_pgd"], """
gens = [torch.Generator().manual_seed(10 + i) for i in range(3)]
sigmas = optimize_sigma(net.eval(), images[:3], 0.25, 3, 8, 1e-3, gens)
torch.manual_seed(6)
delta = 0.5 * torch.randn(2, 4, 1, 8, 8)
result = [sigmas, sphere_pgd(net, images[:4], labels[:4], delta, 2, 0.25)]
"""),
}


def same(a, b):
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b or (a != a and b != b)   # nan equals nan here


# One process runs every case, each from its own folder holding only its pasted.py (a fresh module per case):
# torch is imported once, not once a case.
RUNNER = """import os, runpy, sys
for folder in sys.argv[1:]:
    os.chdir(folder)
    sys.path[0] = folder
    sys.modules.pop("pasted", None)
    runpy.run_path("driver.py")
"""


@pytest.fixture(scope="module")
def pasted_results(tmp_path_factory):
    """{case: (its folder, the result the pasted code gave, or the error it raised)}."""
    folders = {}
    for case, (roots, script) in CASES.items():
        folder = tmp_path_factory.mktemp(case)
        (folder / "pasted.py").write_text(pasted(roots)[0])
        (folder / "driver.py").write_text("import torch\nfrom pasted import *\n" + SETUP + script +
                                          "torch.save(result, 'result.pt')\n")
        folders[case] = folder
    runner = tmp_path_factory.mktemp("runner") / "runner.py"
    runner.write_text(RUNNER)
    done = subprocess.run([sys.executable, "-E", "-s", str(runner), *map(str, folders.values())],
                          cwd=runner.parent, capture_output=True, text=True, timeout=600,
                          env={"PATH": os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"})
    return {case: (folder, done.stderr[-3000:]) for case, folder in folders.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_pasted_block_runs_alone_and_gives_what_the_import_gives(case, pasted_results, monkeypatch):
    roots, script = CASES[case]
    tmp_path, errors = pasted_results[case]
    assert (tmp_path / "result.pt").exists(), errors              # the runner stops at the first failing case
    theirs = torch.load(tmp_path / "result.pt", weights_only=False)   # our own file, just written
    monkeypatch.chdir(tmp_path)
    namespace = {}
    for root in roots:
        module, name = root.split(":")
        namespace[name] = getattr(__import__(module), name)
    torch.set_num_threads(1)
    exec(SETUP + script, namespace)
    assert same(namespace["result"], theirs), case

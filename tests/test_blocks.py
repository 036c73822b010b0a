"""The building blocks refuse what they cannot certify with, imported or pasted alone: a slip that the command
line refuses must not give a wrong certificate from Python. Each case runs twice, against the import and in a
fresh process on the pasted closure (test_paste.pasted, the project off sys.path), and must raise a ValueError
whose message names the argument; the positive cases (half-precision inputs, every module's mode kept) must
give the same answer both ways."""
import json
import os
import subprocess
import sys

import pytest
import torch

from test_paste import SETUP, pasted

ROOTS = ["certify:certify", "certify:predict", "grid:grid_certify", "grid:grid_plan",
         "grid:grid_certify_many", "train_ours:ours_loss", "train_ours:radius_weights", "common:sphere_pgd",
         "train_baselines:macer_loss", "train_baselines:consistency_loss"]
G = "torch.Generator().manual_seed(0)"
PLAN = "grid_plan([0.25, 0.5, 0.75, 1.0], sigma=0.5, N_max=500, alpha=0.001)"

# (case name, code that must raise, a word its message must hold)
REFUSED = [
    ("grid plan of another sigma", f"grid_certify(net.eval(), images[0], 0.5, 100, 100, 10, {G}, "
                                   "grid_plan([0.25, 0.5, 0.75, 1], sigma=1.0, N_max=500, alpha=0.001))", "plan"),
    ("grid_many plan of another sigma", f"grid_certify_many(net, [(images[0], {G}, None)], 0.25, 100, 100, 10, {PLAN})",
     "plan"),
    ("grid without a plan", f"grid_certify(net, images[0], 0.5, 100, 100, 10, {G})", "plan"),
    ("grid num_classes one short", f"grid_certify(net, images[0], 0.5, 100, 100, 9, {G}, {PLAN})", "num_classes"),
    ("grid batch 0", f"grid_certify(net, images[0], 0.5, 100, 0, 10, {G}, {PLAN})", "batch"),
    ("grid_plan alpha 1.5", "grid_plan([0.5], 0.5, 500, 1.5)", "alpha"),
    ("grid_plan sigma 0", "grid_plan([0.5], 0.0, 500, 0.001)", "sigma"),
    ("grid_plan negative radius", "grid_plan([-0.5], 0.5, 500, 0.001)", "radii"),
    ("grid_plan N_max 0", "grid_plan([0.5], 0.5, 0, 0.001)", "N_max"),
    *[(f"certify alpha {a}", f"certify(net, images[0], 0.5, 50, 200, {a}, 100, 10, {G})", "alpha")
      for a in ("1.5", "-0.1", "1", "0", "float('nan')")],
    *[(f"certify sigma {s}", f"certify(net, images[0], {s}, 50, 200, 0.001, 100, 10, {G})", "sigma")
      for s in ("-0.5", "0", "float('inf')", "float('nan')")],
    *[(f"certify num_classes {k}", f"certify(net, images[0], 0.5, 50, 200, 0.001, 100, {k}, {G})", "num_classes")
      for k in (9, 5, 11, 0)],
    ("certify N 0", f"certify(net, images[0], 0.5, 50, 0, 0.001, 100, 10, {G})", "N"),
    ("certify N0 0", f"certify(net, images[0], 0.5, 0, 200, 0.001, 100, 10, {G})", "N0"),
    ("certify N 2.5", f"certify(net, images[0], 0.5, 50, 2.5, 0.001, 100, 10, {G})", "N"),
    ("certify batch 0", f"certify(net, images[0], 0.5, 50, 200, 0.001, 0, 10, {G})", "batch"),
    ("predict alpha 1.5", f"predict(net, images[0], 0.5, 200, 1.5, 100, 10, {G})", "alpha"),
    ("predict num_classes 9", f"predict(net, images[0], 0.5, 200, 0.001, 100, 9, {G})", "num_classes"),
    ("predict sigma -1", f"predict(net, images[0], -1.0, 200, 0.001, 100, 10, {G})", "sigma"),
    *[(f"ours_loss attack {a}", f"ours_loss(net, images[:2], labels[:2], 0.5, 2, 1, 0.25, {a})", "attack")
      for a in ("'L2'", "'l_2'", "None", "'linf '")],
    ("ours_loss sigma -0.5", "ours_loss(net, images[:2], labels[:2], -0.5, 2, 1, 0.25, 'l2')", "sigma"),
    ("ours_loss m 0", "ours_loss(net, images[:2], labels[:2], 0.5, 0, 1, 0.25, 'l2')", "m >= 1"),
    *[(f"radius_weights formula {f}", f"radius_weights([3, 16], 16, 0.1, 0.75, {f})", "formula")
      for f in ("'Paper'", "'official'", "None")],
    ("macer_loss sigma -0.5", "macer_loss(net, images[:2], labels[:2], None, sigma=-0.5, m=2, beta=16.0, gamma=8.0, "
                              "lbd=12.0)", "sigma"),
    ("consistency_loss m 0", "consistency_loss(net, images[:2], labels[:2], None, sigma=0.5, m=0, lbd=10.0, eta=0.5)",
     "m >= 1"),
    ("sphere_pgd norm L2", "sphere_pgd(net, images[:2], labels[:2], torch.randn(2, 2, 1, 8, 8), 1, 0.25, 'L2')",
     "norm_type"),
]

# (case name, code that sets `result`): the same answer from the import and from the pasted closure
KEPT = [
    ("bf16 model and inputs", f"r = certify(net.to(torch.bfloat16), images[0].to(torch.bfloat16), 0.5, 50, 200, "
                              f"0.001, 100, 10, {G}); net.float(); result = [r['predict'], r['nA'], r['counts']]"),
    ("float64 model and inputs", f"r = certify(net.double(), images[0].double(), 0.5, 50, 200, 0.001, 100, 10, {G});"
                                 " net.float(); result = [r['predict'], r['nA']]"),
    ("grid on bf16", f"r = grid_certify(net.eval().to(torch.bfloat16), images[0].to(torch.bfloat16), 0.5, 50, 100, 10,"
                     f" {G}, {PLAN}); net.float(); result = [r['radius'], r['N']]"),
    ("frozen BatchNorm stays in eval", "net.train(); net[1].eval(); torch.manual_seed(0); "
                                       "out = ours_loss(net, images[:2], labels[:2], 0.5, 2, 2, 0.25, 'l2'); "
                                       "result = [net.training, net[1].training, net[0].training]"),
    ("certify keeps every module's mode", f"net.train(); net[1].eval(); certify(net, images[0], 0.5, 20, 50, 0.01, 50,"
                                          f" 10, {G}); result = [net.training, net[1].training]"),
    ("radius_weights paper formula", "result = radius_weights([12, 15, 16], 16, 0.1, 0.75, 'paper').tolist()"),
]

DRIVER = """
import json
outcomes = {}
for name, code in CASES:   # each case in its own copy of this namespace, as the import's side does
    ns = dict(globals())
    try:
        exec(code, ns)
        outcomes[name] = ["ok", repr(ns.get("result"))]
    except Exception as e:
        outcomes[name] = [type(e).__name__, str(e), isinstance(e, (ValueError, TypeError))]
json.dump(outcomes, open("out.json", "w"))
"""


def outcome(code, namespace):
    try:
        exec(code, namespace)
        return ["ok", repr(namespace.get("result"))]
    except Exception as e:
        return [type(e).__name__, str(e), isinstance(e, (ValueError, TypeError))]


@pytest.fixture(scope="module")
def from_paste(tmp_path_factory):
    folder = tmp_path_factory.mktemp("blocks")
    (folder / "pasted.py").write_text(pasted(ROOTS)[0])
    cases = [(n, c) for n, c, _ in REFUSED] + KEPT
    (folder / "driver.py").write_text("import torch\nfrom pasted import *\n" + SETUP + f"CASES = {cases!r}\n" + DRIVER)
    done = subprocess.run([sys.executable, "-E", "-s", "driver.py"], cwd=folder, capture_output=True, text=True,
                          timeout=600, env={"PATH": os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.load(open(folder / "out.json"))


def from_import():
    import certify
    import common
    import grid
    import train_baselines
    import train_ours
    namespace = {"torch": torch}
    for root in ROOTS:
        module, name = root.split(":")
        namespace[name] = getattr({"certify": certify, "common": common, "grid": grid, "train_ours": train_ours,
                                   "train_baselines": train_baselines}[module], name)
    exec(SETUP, namespace)   # a fresh model and data for each case, as in the pasted run's copy of its namespace
    return namespace


@pytest.mark.parametrize("name, code, word", REFUSED, ids=[c[0] for c in REFUSED])
def test_a_block_refuses_what_it_cannot_certify_with_imported_and_pasted(name, code, word, from_paste):
    torch.set_num_threads(1)
    mine = outcome(code, from_import())
    assert mine[0] != "ok" and mine[2] and word in mine[1], (name, mine)
    assert from_paste[name] == mine, (name, from_paste[name], mine)


@pytest.mark.parametrize("name, code", KEPT, ids=[c[0] for c in KEPT])
def test_what_a_block_must_keep_holds_imported_and_pasted(name, code, from_paste):
    torch.set_num_threads(1)
    mine = outcome(code, from_import())
    assert mine[0] == "ok", (name, mine)
    assert from_paste[name] == mine, (name, from_paste[name], mine)
    result = eval(mine[1])
    if name == "frozen BatchNorm stays in eval" or name == "certify keeps every module's mode":
        assert result[:2] == [True, False]
    if name == "radius_weights paper formula":
        assert result[0] == 1.0 and abs(result[1] - 1.134) < 1e-3 and abs(result[2] - 1.642) < 1e-3

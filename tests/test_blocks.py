"""The building blocks refuse what they cannot certify with, imported or pasted alone: a slip that the command
line refuses must not give a wrong certificate from Python. Each case runs twice, against the import and in a
fresh process on the pasted closure (test_paste.pasted, the project off sys.path), and must raise a ValueError
whose message names the argument; the positive cases (half-precision inputs, every module's mode kept) must
give the same answer both ways."""
import json
import math
import os
import subprocess
import sys

import numpy as np
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
    ("certify a NaN pixel", f"x = images[0].clone(); x[0, 0, 0] = float('nan'); "
                            f"certify(net, x, 0.5, 50, 200, 0.001, 100, 10, {G})", "x holds NaN"),
    ("certify float64 input, float32 model", f"certify(net, images[0].double(), 0.5, 50, 200, 0.001, 100, 10, {G})",
     "x is torch.float64"),
    ("certify N0 a string beside a candidate", f"certify(net, images[0], 0.5, 'abc', 200, 0.001, 100, 10, {G}, "
                                               f"candidate=1)", "N0"),
    ("grid N0 0 without a candidate", f"grid_certify(net, images[0], 0.5, 0, 20, 10, {G}, {PLAN})", "N0"),
    ("grid_many inputs of two shapes", f"grid_certify_many(net, [(images[0], {G}, None), (torch.rand(1, 9, 9), {G}, "
                                       f"None)], 0.5, 10, 100, 10, {PLAN})", "shape"),
    *[(f"ours_loss label {k}", f"ours_loss(net, images[:2], torch.tensor([{k}, 1]), 0.5, 2, 1, 0.25, 'l2')", "y holds")
      for k in (-100, -1, 10)],
    ("consistency_loss label 10", "consistency_loss(net, images[:2], torch.tensor([10, 1]), None, sigma=0.5, m=2, "
                                  "lbd=10.0, eta=0.5)", "y holds"),
    *[(f"macer_loss sigma tensor {s}", f"macer_loss(net, images[:4], labels[:4], None, sigma={s}, m=2, beta=16.0, "
                                       f"gamma=8.0, lbd=12.0)", "sigma")
      for s in ("torch.full((4, 1, 1, 1), -0.5)", "torch.full((4, 1, 1, 1), float('nan'))", "torch.full((4,), 0.5)")],
    ("sphere_pgd a NaN pixel", "x = images[:2].clone(); x[0, 0, 0, 0] = float('nan'); "
                               "sphere_pgd(net, x, labels[:2], torch.randn(2, 2, 1, 8, 8), 1, 0.25)", "x holds NaN"),
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
    # a model wrapped in a function is still that model: certified in eval mode, its BatchNorm statistics kept
    ("certify a lambda of a model in train mode", f"net.train(); kept = net[1].running_mean.clone(); "
                                                  f"a = certify(lambda z: net(z), images[0], 0.5, 20, 50, 0.01, 50, 10, {G});"
                                                  f" assert torch.equal(kept, net[1].running_mean) and net.training; "
                                                  f"b = certify(net.eval(), images[0], 0.5, 20, 50, 0.01, 50, 10, {G}); "
                                                  f"assert a['counts'] == b['counts']; result = a['counts']"),
]

DRIVER = """
import json
import math
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


# ----------------------------------------------------------------------------------------------------------
# The training loop's and the measurements' blocks: a model handed back as it came, arguments that would
# train or measure something else refused
# ----------------------------------------------------------------------------------------------------------

def small_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(256, 10))


def test_the_counter_samples_a_model_in_train_mode_in_eval_mode_and_keeps_its_statistics():
    import common
    net = small_net().train()
    net[1].running_mean.uniform_(-0.5, 0.5)
    kept = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.rand(2, 1, 8, 8)
    given = common.sample_counts(net, x, 0.5, 40, 40, 10, torch.Generator().manual_seed(0))
    assert net.training and all(torch.equal(kept[k], v) for k, v in net.state_dict().items())
    assert torch.equal(given, common.sample_counts(net.eval(), x, 0.5, 40, 40, 10, torch.Generator().manual_seed(0)))


def test_evaluate_noisy_hands_every_module_back_and_refuses_what_is_no_test_set():
    import common
    net = small_net().train()
    net[1].eval()
    x, y = torch.rand(4, 1, 8, 8), torch.arange(4)
    common.evaluate_noisy(net, [(x, y)], 0.5, torch.device("cpu"))
    assert net.training and not net[1].training
    for loader, word in [([((x * 255).byte(), y)], "uint8"), ([], "no examples"), ([(x, y - 5)], "y holds"),
                         ([(x, y + 7)], "classes 0 .. 9")]:
        with pytest.raises((TypeError, ValueError), match=word):
            common.evaluate_noisy(net, loader, 0.5, torch.device("cpu"))


def test_train_epoch_refuses_another_models_optimizer_and_an_empty_loader():
    import common
    net = small_net()
    step = lambda f, x, y, idx: common.gaussian_loss(f, x, y, 0.5, 1)   # noqa: E731
    batches = [(torch.rand(4, 1, 8, 8), torch.arange(4), torch.arange(4))]
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    with pytest.raises(ValueError, match="not the model's"):
        common.train_epoch(net, batches, other, step, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="no batches"):
        common.train_epoch(net, [], torch.optim.SGD(net.parameters(), lr=0.1), step, 1, torch.device("cpu"))


def test_gradient_norms_hand_every_module_back_in_its_own_mode():
    import common
    net = small_net().train()
    net[1].eval()
    common.per_example_grad_norms(net, lambda f, x, y, i: {"loss": f(x).sum()}, torch.rand(2, 1, 8, 8),
                                  torch.arange(2))
    assert net.training and not net[1].training


def test_a_scheduler_refuses_a_repeated_milestone_and_takes_an_array():
    import numpy as np
    import common
    optimizer = torch.optim.SGD(small_net().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="repeat"):
        common.make_scheduler(optimizer, 10, 0.1, [5, 5])
    assert sorted(common.make_scheduler(optimizer, 10, 0.1, np.array([10, 5])).milestones) == [5, 10]


def test_dominance_compares_lists_as_the_curves_they_are():
    import analyze
    assert analyze.dominance({"a": [0.3, 0.0], "b": [0.1, 0.5]}) == ([], [("a", "b")])
    assert analyze.dominance({"a": [0.3, 0.5], "b": [0.1, 0.5]}) == ([("a", "b")], [])


def test_optimize_sigma_refuses_per_input_sigmas_that_are_not_positive():
    import ddrs
    x = torch.rand(2, 1, 8, 8)
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    for bad in ([-1.0, 0.5], [float("nan"), 0.5], [0.0, 0.5]):
        with pytest.raises(ValueError, match="sigma0"):
            ddrs.optimize_sigma(small_net(), x, torch.tensor(bad), 2, 2, 1e-3, gens)


class Rows(torch.nn.Module):
    """A model giving `extra` rows more (or fewer) than its inputs: its votes would be another input's."""

    def __init__(self, extra):
        super().__init__()
        self.w, self.extra = torch.nn.Parameter(torch.zeros(())), extra

    def forward(self, z):
        return torch.nn.functional.one_hot(torch.zeros(len(z) + self.extra, dtype=torch.long), 10).float() + self.w


@pytest.mark.parametrize("extra", [-1, 1])
def test_a_model_giving_other_rows_than_its_inputs_is_refused_by_every_counter(extra):
    import common
    import grid
    x, g = torch.rand(1, 8, 8), torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="expected"):
        common.sample_counts(Rows(extra), x[None], 0.5, 20, 20, 10, g)
    with pytest.raises(ValueError, match="expected"):
        grid.grid_certify(Rows(extra), x, 0.5, 10, 20, 10, g, grid.grid_plan([0.25], 0.5, 200, 0.01))


def test_an_attack_takes_a_model_wrapped_in_a_function_and_keeps_its_statistics():
    import train_ours
    net = small_net().train()
    kept = net[1].running_mean.clone()
    out = train_ours.ours_loss(lambda z: net(z), torch.rand(4, 1, 8, 8), torch.arange(4), 0.5, 2, 1, 0.25, "l2")
    assert out["total"] == 8 and net.training and all(p.requires_grad for p in net.parameters())
    assert not torch.equal(kept, net[1].running_mean)   # the loss's own pass trains BatchNorm; the attack's does not


def test_a_baselines_given_noise_and_target_are_checked():
    import train_baselines as tb
    net, x, y = small_net(), torch.rand(4, 1, 8, 8), torch.arange(4)
    for noise, words in [(torch.full((2, 4, 1, 8, 8), float("nan")), "NaN"), (torch.zeros(2, 4, 1, 8, 8).double(),
                                                                                 "torch.float64")]:
        with pytest.raises(ValueError, match=words):
            tb.macer_loss(net, x, y, None, sigma=0.5, m=2, beta=16.0, gamma=8.0, lbd=12.0, noise=noise)
    for target in (torch.full((4, 10), 7.0), torch.full((4, 5), 0.2)):
        with pytest.raises(ValueError, match="target"):
            tb.catrs_loss(net, x, y, torch.arange(4), sigma=0.5, m=2, T=1, eps=0.25, lbd=0.5, target=target)


def test_train_time_pA_counts_refuse_labels_outside_the_classes_before_counting():
    import common
    data = torch.utils.data.TensorDataset(torch.rand(4, 1, 8, 8), torch.tensor([0, 1, 2, 10]))
    with pytest.raises(ValueError, match="y holds labels outside"):
        common.count_correct(small_net(), data, [0, 1, 2, 3], 0.5, 4, 8)


def test_compare_sides_refuses_a_hand_made_log_that_breaks_the_readers_contract():
    import numpy as np
    import compare
    good = {"path": "a", "radius": np.array([0.5, 0.0, 0.2]), "correct": np.array([True, False, True]),
            "idx": np.arange(3), "y": np.zeros(3, dtype=int)}
    for bad in ({"radius": np.array([np.nan, 0.0, 0.2])}, {"radius": np.array([-0.5, 0.0, 0.2])},
                {"nY": np.array([5, 0, 1]), "N": np.array([4, 4, 4])}):
        with pytest.raises(TypeError, match="logs as readers.read_certification_log"):
            compare.compare_sides([dict(good, **bad)], [good], [0.25], 0.95)


@pytest.mark.parametrize("row, words", [("0\t1\t1\t0.5\t1\t0\t0\t0", "N must be >= 1"),
                                        ("0\t1\t2\t0.5\t1\t0\t5\t5", "correct is 1 but predict is not the label"),
                                        ("0\t1\t-1\t0.5\t0\t0\t5\t5", "an abstention")])
def test_the_log_reader_refuses_rows_no_certifier_writes(tmp_path, row, words):
    import common
    import readers
    path = tmp_path / "log.tsv"
    path.write_text("idx\tlabel\tpredict\tradius\tcorrect\ttime\tN\tnY\n" + row + "\n")
    with pytest.raises(common.UserError, match=words):
        readers.read_certification_log(str(path))


def test_the_gradient_norm_reader_refuses_an_infinite_norm_and_a_probe_twice(tmp_path):
    import common
    import readers
    for rows in (["0\t1\t0.5\tinf"], ["0\t1\t0.5\t1.0", "0\t1\t0.7\t2.0"]):
        path = tmp_path / "g.tsv"
        path.write_text("idx\tlabel\tpA\tgrad_norm\n" + "\n".join(rows) + "\n")
        with pytest.raises(common.UserError):
            readers.read_gradient_norms(str(path))


def test_clopper_pearson_is_the_beta_quantile_also_for_a_count_below_one_and_takes_bf16():
    import common
    from scipy.stats import beta
    assert common.clopper_pearson_lower(0.5, 10, 0.01) == pytest.approx(beta.ppf(0.01, 0.5, 10.5), rel=1e-12)
    assert common.clopper_pearson_upper(9.5, 10, 0.01) == pytest.approx(beta.ppf(0.99, 10.5, 0.5), rel=1e-12)
    assert common.check_array("x", torch.tensor([0.5], dtype=torch.bfloat16)).tolist() == [0.5]
    with pytest.raises(ValueError, match="N"):
        common.clopper_pearson_lower(5, 1e300, 0.01)


def test_holm_refuses_a_p_value_that_is_no_probability():
    import compare
    with pytest.raises(ValueError, match="pvalues"):
        compare.holm([float("nan"), 0.9], 0.05)
    assert compare.holm([0.001, 0.9], 0.05) == {0}


def test_the_training_loader_refuses_draws_that_are_not_examples_of_its_dataset():
    import common
    data = torch.utils.data.TensorDataset(torch.rand(6, 1, 8, 8), torch.arange(6))
    for kwargs, error in [(dict(batch=0), ValueError), (dict(batch=True), TypeError), (dict(seed=1.5), TypeError)]:
        with pytest.raises(error):
            common.TrainLoader(data, **{**dict(batch=2, workers=0, seed=0), **kwargs})
    loaders = common.TrainLoader(data, 2, 0, 0)
    for kwargs in (dict(indices=[-1, 2]), dict(indices=[0, 6]), dict(indices=[0, 1], weights=[1.0]),
                   dict(indices=[0, 1], weights=[0.0, 0.0]), dict(weights=[1.0] * 6), dict(indices=[0], num_samples=0)):
        with pytest.raises(ValueError):
            loaders.epoch(0, **kwargs)
    assert len(loaders.epoch(0, indices=[0, 1], weights=[1.0, 0.0], num_samples=4)) == 2


def test_keep_easy_refuses_counts_outside_zero_to_N():
    import train_ours
    with pytest.raises(ValueError, match="0..N"):
        train_ours.keep_easy(torch.tensor([20, 3]), 10, 0.5)


def _careless_calls():
    """Calls a student could make by mistake, each of which computed something else than asked (a wrong
    certificate, interval or seed) or crashed deep inside torch: now a ValueError or TypeError naming the argument."""
    import analyze
    import certify
    import common
    import compare
    import ddrs
    import grid
    import train_baselines
    m = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    x, xb = torch.rand(1, 8, 8), torch.rand(4, 1, 8, 8)
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    checks = grid.look_schedule(1000)
    y4, n24 = torch.arange(4), 0.25 * torch.randn(2, 4, 1, 8, 8)
    return {
        "wilson z < 0": (lambda: common.wilson(0.3, 100, -1.96), "z"),
        "wilson count for a share": (lambda: common.wilson(30, 100, 1.96), "p"),
        "newcombe z < 0": (lambda: common.newcombe_interval(0.3, 100, 0.5, 100, -1.96), "z"),
        "tango more excess than pairs": (lambda: common.tango_interval(80, 40, 100, 1.96), "x12 + x21"),
        "radius_moments z of another N": (lambda: compare.radius_moments([0.9], 50, compare.z_table(100, 1e-3), 0.5),
                                          "z has"),
        "crossing lengths differ": (lambda: grid.crossing_probability(
            grid.threshold_row(0.6, checks, math.log(100), 1)[:5], checks, 0.6), "lower"),
        "threshold tau > 1": (lambda: grid.threshold_row(1.5, [10, 20], 4.6, 1), "tau"),
        "wealth side 0": (lambda: grid.one_sided_log_wealth(8, 10, 0.5, 0), "side"),
        "wealth A > t": (lambda: grid.kt_log_wealth(11, 10, 0.5), "A <= t"),
        "kt prior of three": (lambda: grid.kt_interval(5, 10, 0.01, 0.01, (0.5, 0.5, 0.5)), "prior"),
        "example_line predict 'no'": (lambda: certify.example_line(m, x, 3, 0, .5, 10, 100, .01, 100, 10, 0, "no"),
                                      "use_predict"),
        "example_line label -1": (lambda: certify.example_line(m, x, -1, 0, .5, 10, 100, .01, 100, 10, 0, False),
                                  "label"),
        "select max 0": (lambda: certify.select_examples(10, 1, 0, set()), "max_count"),
        "select skip 0": (lambda: certify.select_examples(10, 0, None, set()), "skip"),
        "votes of other classes": (lambda: certify.certify(m, x, .5, 10, 100, .01, 100, 10, torch.Generator(),
                                                           sample=lambda *a, **k: torch.ones(1, 3, dtype=torch.long)),
                                   "sample returned"),
        "early abstain alpha 1.5": (lambda: certify.sampler_of(early_abstain=1.5), "alpha"),
        "ds loss of no method": (lambda: ddrs.ds_loss_fn("smoothAdv", {}, torch.full((4,), .5), (1, 2, .01), 0, 0),
                                 "method"),
        "proxy negative sigma": (lambda: ddrs.radius_proxy(m, xb, -torch.ones(4), torch.randn(2, 4, 1, 8, 8)), "s must"),
        "proxy class beyond": (lambda: ddrs.optimize_sigma(m, xb, .5, 2, 2, .01, gens, cA=[10, 0, 1, 2]), "cA"),
        "one generator for all": (lambda: ddrs.optimize_sigma(m, xb, .5, 2, 2, .01, [gens[0]] * 4), "generators"),
        "semi-elastic pA 1": (lambda: ddrs.semi_elastic_radius(1.0, 0.5, 0.01, 64), "pA_lower"),
        "worst class equal sigmas": (lambda: ddrs.worst_class_b(0.5, 0.5, 0.5, 0.9, 64), "sigma1"),
        "memory NaN input": (lambda: ddrs.memory_step([], x * float("nan"), 1, 0.5), "x holds"),
        "catrs rows not distributions": (lambda: train_baselines.catrs_loss(
            m, xb, torch.arange(4), torch.arange(4), sigma=.25, m=2, T=1, eps=.5, lbd=1.,
            target=torch.full((10, 10), .9)), "probability vectors"),
        "seed 1.7": (lambda: common.epoch_seed(1.7, 0), "seed"),
        "images and labels": (lambda: common.TensorImages(xb, torch.arange(6)), "labels"),
        "std 0": (lambda: common.NormalizeLayer([.5], [0.]), "std"),
        "batch_cap floats": (lambda: common.batch_cap(100.5, 1000.5, (1, 8, 8), 10 ** 6), "N0"),
        "sound levels off the grid": (lambda: common.sound_noisy_inputs(torch.full((1, 1, 2, 2), 1000,
                                                                                   dtype=torch.int32), 2, .01), "a holds"),
        "defaults at sigma nan": (lambda: train_baselines.method_defaults("macer", "cifar10", math.nan), "sigma"),
        "job k0 above N0": (lambda: grid.job_tables(grid.grid_plan([.25], .5, 500, .01), 50, 10), "k0"),
        "easy/hard of counts": (lambda: analyze.easy_hard(np.array([30, 60, 80]), np.array([1., 2., 3.])), "pA"),
        "negative variance": (lambda: compare.satterthwaite([(-1.0, 3.0), (1.0, 4.0)]), "variances"),
        "pgd attack of 2.5 steps": (lambda: train_baselines.smoothadv_attack(m, xb, y4, n24, 2.5, .5), "T"),
        "pgd attack eps < 0": (lambda: train_baselines.smoothadv_attack(m, xb, y4, n24, 2, -.5), "eps"),
        "pgd noise of other images": (lambda: train_baselines.smoothadv_attack(m, xb, y4, n24[:, :3], 2, .5), "noise"),
        "ddn one grey level": (lambda: train_baselines.ddn_attack(m, xb, y4, n24, 2, .5, levels=1), "levels"),
        "ddn gamma 1.5": (lambda: train_baselines.ddn_attack(m, xb, y4, n24, 2, .5, gamma=1.5), "gamma"),
        "smoothmix warm 2": (lambda: train_baselines.smoothmix_attack(m, xb, y4, n24, 2, .5, 1, 2.0), "warm"),
        "smoothmix fp64 noise": (lambda: train_baselines.smoothmix_attack(m, xb, y4, n24.double(), 2, .5, 1, 1.), "noise"),
        "catrs attack pb of labels": (lambda: train_baselines.catrs_attack(m, xb, y4, n24, 2, .5), "pb"),
        "bottom K of 0": (lambda: train_baselines.bottom_k_sum(torch.rand(3, 2), torch.tensor([0, 1])), "K"),
        "moments of one tensor for two": (lambda: train_baselines.match_moments(torch.rand(2, 5), torch.zeros(1, 1),
                                                                                torch.ones(1, 1)), "mu0 and rms0"),
        "project radius < 0": (lambda: train_baselines.project_l2(xb, -1.0), "radius"),
        "certify at alpha 0.95": (lambda: certify.certify(m, x, .5, 10, 100, .95, 100, 10), "alpha"),
        "grid plan of another budget": (lambda: certify.example_line(m, x, 3, 0, .5, 10, 1000, .001, 100, 10, 0, False,
                                                                     plan=grid.grid_plan([.25], .5, 100, .1)), "plan"),
        "fold a string": (lambda: certify.fold_batchnorm("x"), "model"),
        "wealth of a string count": (lambda: grid.kt_log_wealth("5", 10, .5), "A"),
        "wealth side True": (lambda: grid.one_sided_log_wealth(8, 10, .5, True), "side"),
        "smoothadv attack DDN": (lambda: train_baselines.make_loss_fn("smoothadv", {"m": 2, "T": 1, "eps": .5,
                                                                                    "warmup": 1, "attack": "DDN"}, .5, 0),
                                 "attack"),
        "rank -1 takes the sampler's stream": (lambda: common.seed_epoch(0, 0, rank=-1), "rank"),
        "sphere noise of fp64": (lambda: common.sphere_pgd(m, xb, y4, n24.double(), 1, .25), "delta"),
        "generators seeded alike": (lambda: ddrs.optimize_sigma(m, xb, .5, 2, 2, .01, [torch.Generator().manual_seed(0)
                                                                                      for _ in range(4)]), "generators"),
        "grad norms of other indices": (lambda: common.per_example_grad_norms(
            m, lambda f, a, b, i: {"loss": f(a).sum()}, xb, torch.arange(4), torch.arange(1)), "idx"),
    }


@pytest.mark.parametrize("name", sorted(_careless_calls()))
def test_a_careless_argument_is_refused_by_name(name):
    call, words = _careless_calls()[name]
    with pytest.raises((ValueError, TypeError)) as caught:
        call()
    assert words in str(caught.value), (name, str(caught.value))


def test_a_model_held_by_an_object_or_a_dict_is_certified_in_eval_mode():
    import certify
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(256, 10))
    x = torch.rand(1, 8, 8)

    class Wrapper:   # a student's wrapper: not an nn.Module, the net an attribute
        def __init__(self, net):
            self.net = net

        def __call__(self, z):
            return self.net(z)
    run = lambda model: certify.certify(model, x, .25, 10, 500, .01, 100, 10, torch.Generator().manual_seed(0))
    plain = run(net.eval())["counts"]
    held = {"net": net}
    for model in (Wrapper(net.train()), lambda z: held["net"](z)):
        net.train()
        assert run(model)["counts"] == plain and net.training   # eval mode while certifying, then handed back


def test_an_early_abstention_sampler_serves_one_example_and_its_class():
    import certify
    import common
    m = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    x = torch.rand(1, 8, 8)
    sample = certify.sampler_of(early_abstain=1e-3)
    certify.certify(m, x, .25, 10, 1000, .01, 100, 10, torch.Generator(), sample=sample)
    with pytest.raises(ValueError, match="make a new one for each example"):
        certify.certify(m, x, .25, 10, 1000, .01, 100, 10, torch.Generator(), sample=sample)
    with pytest.raises(ValueError, match="not on the candidate 5"):
        certify.certify(m, x, .25, 0, 1000, .01, 100, 10, torch.Generator(),
                        sample=certify.EarlyAbstention(common.sample_counts, 1e-3, candidate=3), candidate=5)


def test_the_semi_elastic_radius_is_not_proved_where_its_sigma_band_leaves_float64():
    import ddrs
    assert ddrs.semi_elastic_radius(0.9, 0.5, 1e6, 64) < 1e-3 * 0.5 * 1.2816   # far below Cohen's, never a crash
    assert ddrs.semi_elastic_radius(0.9, 1e-300, 0.01, 64) >= 0


def test_ranks_put_a_missing_value_last():
    import analyze
    assert analyze.ranks([0.5, float("nan"), 0.7]).tolist() == [2, 3, 1]

"""The fast paths give the plain paths' answers: counter, channels-last, precision, compile, early abstention, --amp.

Correctness only: speed is measured by tools/bench.py, never here.
"""
import copy
import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy.stats import beta, norm

import bench
import certify
import common
import machinery
import readers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Channels-last and compiled models sum in another order, so a vote can flip where two logits tie to within
# float rounding: the documented tolerance (docs/speed.md) is 0.1 % of the draws.
TOLERANCE = 1e-3


class Linear1D(nn.Module):
    """Class 1 iff the first coordinate of x exceeds t: under N(0, sigma^2) noise at x = 0, pA(1) = Phi(-t / sigma)."""

    def __init__(self, t):
        super().__init__()
        self.t = t

    def forward(self, x):
        s = x.flatten(1)[:, 0] - self.t
        return torch.stack([torch.zeros_like(s), s], 1)


def digits_model(seed=0):
    """digits_cnn (convolutions and BatchNorm) with random weights: its votes under noise spread over classes."""
    torch.manual_seed(seed)
    return common.get_architecture("digits_cnn", "digits").eval()


@pytest.fixture(scope="module")
def trained_ckpt(tmp_path_factory):
    """digits_cnn briefly trained with noise sigma = 1: many test examples have a clearly low pA."""
    torch.manual_seed(0)
    model = common.get_architecture("digits_cnn", "digits")
    train = common.get_dataset("digits", "train")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(60):
        i = torch.randint(0, len(train), (64,))
        x, y = train.images[i], train.labels[i]
        loss = F.cross_entropy(model(x + torch.randn_like(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = str(tmp_path_factory.mktemp("ckpt") / "checkpoint.pth.tar")
    machinery.save_checkpoint({"arch": "digits_cnn", "dataset": "digits", "sigma": 1.0,
                               "state_dict": model.state_dict()}, path)
    return path


def run_cli(argv):
    try:
        machinery.run(lambda: certify.main([str(a) for a in argv]))
    except SystemExit as e:
        return e.code
    return 0


def tsv_rows(path):
    """Data lines as dicts, without the time column."""
    with open(path) as f:
        lines = f.read().splitlines()
    header = lines[0].split("\t")
    return [{k: v for k, v in zip(header, line.split("\t")) if k != "time"} for line in lines[1:]]


# ----------------------------------------------------------------------------------------------------------
# The counter: device counting, channels-last, precision, staged counting
# ----------------------------------------------------------------------------------------------------------

def test_device_counter_equals_the_textbook_loop_for_the_same_seed():
    model, x = digits_model(), common.get_dataset("digits", "test").images[0]
    for n, batch in ((3000, 500), (700, 700)):  # several passes; one pass
        fast = common.sample_counts(model, x.unsqueeze(0), 0.5, n, batch, 10, torch.Generator().manual_seed(4))
        slow = bench.textbook_counts(model, x, 0.5, n, batch, 10, torch.Generator().manual_seed(4))
        assert fast[0].tolist() == slow.tolist()
    assert (fast[0] > 0).sum() >= 2  # the votes really spread over classes: the comparison is not trivial


def test_channels_last_counts_match_the_plain_layout_within_the_tolerance():
    model, images = digits_model(), common.get_dataset("digits", "test").images[:3]
    fast_model = copy.deepcopy(model).to(memory_format=torch.channels_last)
    assert fast_model[1].conv1.weight.is_contiguous(memory_format=torch.channels_last)
    n = 4000
    plain = common.sample_counts(model, images, 0.5, n, 1000, 10, torch.Generator().manual_seed(5))
    fast = common.sample_counts(fast_model, images, 0.5, n, 1000, 10, torch.Generator().manual_seed(5))
    assert (fast.sum(1) == n).all()
    assert ((fast - plain).abs().sum(1) <= TOLERANCE * n).all()


def test_certify_fast_path_gives_the_plain_lines(trained_ckpt, tmp_path):
    base = ["--checkpoint", trained_ckpt, "--max", 6, "--N0", 50, "--N", 1000, "--batch", 500]
    assert run_cli([*base, "--no-channels-last", "--no-fold-bn", "--outfile", tmp_path / "plain.tsv"]) == 0
    assert run_cli([*base, "--outfile", tmp_path / "fast.tsv"]) == 0  # channels-last, BatchNorm folded: defaults
    settings = json.load(open(tmp_path / "fast.tsv.json"))
    assert settings["channels_last"] is True and settings["fold_bn"] is True
    for a, b in zip(tsv_rows(tmp_path / "plain.tsv"), tsv_rows(tmp_path / "fast.tsv")):
        assert a["predict"] == b["predict"] and abs(int(a["nA"]) - int(b["nA"])) <= TOLERANCE * 1000
        assert float(a["radius"]) == pytest.approx(float(b["radius"]), abs=0.01)


def test_folded_batchnorm_is_the_same_classifier_up_to_rounding():
    model = digits_model()
    g = torch.Generator().manual_seed(1)
    for bn in (model[1].bn1, model[1].bn2):  # statistics far from the identity, so that folding matters
        bn.running_mean.uniform_(-0.5, 0.5, generator=g)
        bn.running_var.uniform_(0.2, 3.0, generator=g)
        bn.weight.data.uniform_(0.5, 2.0, generator=g)
        bn.bias.data.uniform_(-0.5, 0.5, generator=g)
    folded = certify.fold_batchnorm(model)
    assert not any(isinstance(mod, nn.BatchNorm2d) for mod in folded.modules())
    assert any(isinstance(mod, nn.BatchNorm2d) for mod in model.modules())  # the original is left alone
    x = torch.rand(500, 1, 8, 8)
    with torch.no_grad():
        assert torch.allclose(folded(x), model(x), rtol=1e-4, atol=1e-5)
    n, images = 4000, common.get_dataset("digits", "test").images[:2]
    plain = common.sample_counts(model, images, 0.5, n, 1000, 10, torch.Generator().manual_seed(2))
    fast = common.sample_counts(certify.fast_model(model, True, False, [], "fp32", fold_bn=True), images, 0.5, n,
                                1000, 10, torch.Generator().manual_seed(2))
    assert ((fast - plain).abs().sum(1) <= TOLERANCE * n).all()


class DataDependent(nn.Module):
    """forward() branches on a tensor value: torch.fx cannot trace it."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)

    def forward(self, x):
        out = self.bn(self.conv(x))
        return out.flatten(1) if out.sum() > 0 else -out.flatten(1)


def test_an_untraceable_model_is_certified_unfolded_with_a_note(capsys):
    model = DataDependent().eval()
    assert certify.fold_batchnorm(model) is model
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "BatchNorm" in err


def test_bf16_counts_sum_to_n_and_agree_with_fp32_on_the_top_class():
    model, x = digits_model(), common.get_dataset("digits", "test").images[:2]
    fp32 = common.sample_counts(model, x, 0.5, 2000, 1000, 10, torch.Generator().manual_seed(6))
    bf16 = common.sample_counts(common.in_precision(model, "bf16"), x, 0.5, 2000, 1000, 10,
                                torch.Generator().manual_seed(6))
    assert bf16.dtype == torch.long and (bf16.sum(1) == 2000).all()
    assert torch.equal(fp32.argmax(1), bf16.argmax(1))
    assert ((fp32 - bf16).abs().sum(1) <= 0.1 * 2000).all()  # rounding moves some votes, not the picture


def test_passes_have_equal_sizes_and_cover_n():
    assert common.pass_sizes(100_000, 1000) == [1000] * 100
    assert common.pass_sizes(1001, 300) == [251, 250, 250, 250]
    assert common.pass_sizes(30, 500) == [30] and common.pass_sizes(0, 10) == []
    for n in range(1, 60):
        for per_pass in (1, 7, 60):
            sizes = common.pass_sizes(n, per_pass)
            assert sum(sizes) == n and max(sizes) <= per_pass and max(sizes) - min(sizes) <= 1


def test_a_stopped_count_is_the_prefix_of_the_full_count():
    model, x = digits_model(), common.get_dataset("digits", "test").images[:1]
    full = common.sample_counts(model, x, 0.5, 3000, 500, 10, torch.Generator().manual_seed(7))
    seen = []

    def stop(counts, drawn):
        seen.append(drawn)
        return drawn == 1500
    stopped = common.sample_counts(model, x, 0.5, 3000, 500, 10, torch.Generator().manual_seed(7), stop=stop)
    prefix = common.sample_counts(model, x, 0.5, 1500, 500, 10, torch.Generator().manual_seed(7))
    assert seen == [500, 1000, 1500] and torch.equal(stopped, prefix) and stopped.sum() == 1500
    never = common.sample_counts(model, x, 0.5, 3000, 500, 10, torch.Generator().manual_seed(7),
                                 stop=lambda counts, drawn: False)
    assert torch.equal(never, full)


# ----------------------------------------------------------------------------------------------------------
# Early abstention: its own alpha, and the full run's lines wherever it does not stop
# ----------------------------------------------------------------------------------------------------------

def test_abstain_checks_double_and_never_include_the_last_pass():
    assert certify.abstain_checks(100_000, 1000) == [1000, 2000, 4000, 8000, 16000, 32000, 64000]
    assert certify.abstain_checks(1000, 1000) == [] and certify.abstain_checks(2000, 1000) == [1000]


def stop_rate(pA, alpha, runs, N=1600, batch=100):
    """Fraction of runs that early abstention stops, for a classifier whose pA(class 1) is known."""
    sigma = 1.0
    model, x = Linear1D(-sigma * norm.ppf(pA)), torch.zeros(1, 1, 1)
    stops = 0
    for i in range(runs):
        rule = certify.abstain_rule(1, N, batch, alpha)
        counts = common.sample_counts(model, x.unsqueeze(0), sigma, N, batch, 2, common.example_generator(9, i),
                                      stop=rule)
        stops += int(counts.sum()) < N
    return stops / runs


def test_early_abstention_stops_an_example_with_pA_one_half_at_most_alpha_of_the_time():
    # 4 checks at level alpha / 4 each: the stop rate at pA = 1/2 is at most alpha (Bonferroni). alpha = 0.3 is
    # large so that a rule spending alpha at every check (rate ~0.6) or testing the lower bound (rate ~1) fails;
    # the margin is 3 binomial standard deviations (false failure below 0.2 %).
    alpha, runs = 0.3, 300
    assert stop_rate(0.5, alpha, runs) <= alpha + 3 * (alpha * (1 - alpha) / runs) ** 0.5


def test_early_abstention_stops_a_clearly_bad_example_at_the_first_check():
    # pA = 0.3 with 100 draws: the 0.999-upper bound is about 0.45 < 1/2 for all but a few draws
    assert stop_rate(0.3, 0.001, 40) >= 0.9


def test_early_abstention_writes_the_full_lines_or_abstains_after_a_check(trained_ckpt, tmp_path):
    base = ["--checkpoint", trained_ckpt, "--max", 16, "--N0", 50, "--N", 2000, "--batch", 250]
    assert run_cli([*base, "--outfile", tmp_path / "full.tsv"]) == 0
    assert run_cli([*base, "--early-abstain", "--outfile", tmp_path / "early.tsv"]) == 0
    checks = certify.abstain_checks(2000, 250)
    assert checks == [250, 500, 1000]
    level = certify.EARLY_ABSTAIN_ALPHA / len(checks)
    stopped = 0
    for full, early in zip(tsv_rows(tmp_path / "full.tsv"), tsv_rows(tmp_path / "early.tsv")):
        if early["N"] == "2000":
            assert early == full  # same noise stream, same line
            continue
        stopped += 1
        nA, n = int(early["nA"]), int(early["N"])
        assert n in checks and early["predict"] == "-1" and early["radius"] == "0.0" and early["correct"] == "0"
        assert beta.ppf(1 - level, nA + 1, n - nA) < 0.5  # the one-sided upper bound, from scipy directly
        assert full["predict"] == "-1"  # here the full run abstains too
    assert stopped >= 3  # the trained sigma = 1 model has clearly hard examples
    assert json.load(open(tmp_path / "early.tsv.json"))["early_abstain"] == certify.EARLY_ABSTAIN_ALPHA
    # resuming the early-abstaining file without the flag would mix two rules: refused, file untouched
    before = (tmp_path / "early.tsv").read_bytes()
    assert run_cli([*base, "--max", 20, "--outfile", tmp_path / "early.tsv"]) == 2
    assert (tmp_path / "early.tsv").read_bytes() == before


def test_early_abstain_with_predict_is_refused(trained_ckpt, tmp_path):
    assert run_cli(["--checkpoint", trained_ckpt, "--predict", "--early-abstain", "--outfile", tmp_path / "p.tsv"]) == 2


# ----------------------------------------------------------------------------------------------------------
# --precision and --compile on the command line; sidecars written before these settings existed
# ----------------------------------------------------------------------------------------------------------

def test_precision_bf16_runs_and_a_resume_in_fp32_is_refused(trained_ckpt, tmp_path, capsys):
    base = ["--checkpoint", trained_ckpt, "--max", 3, "--N0", 20, "--N", 200, "--batch", 200,
            "--outfile", tmp_path / "bf16.tsv"]
    assert run_cli([*base, "--precision", "bf16"]) == 0
    assert json.load(open(tmp_path / "bf16.tsv.json"))["precision"] == "bf16"
    assert len(tsv_rows(tmp_path / "bf16.tsv")) == 3
    capsys.readouterr()
    assert run_cli([*base, "--max", 5]) == 2  # fp32 lines would certify another base classifier
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "precision" in err


def test_fp16_on_the_cpu_is_one_line_and_exit_2(trained_ckpt, tmp_path, capsys):
    assert run_cli(["--checkpoint", trained_ckpt, "--precision", "fp16", "--device", "cpu",
                    "--outfile", tmp_path / "x.tsv"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "fp16" in err and not (tmp_path / "x.tsv").exists()


def test_a_sidecar_that_lacks_a_setting_that_changes_the_lines_is_not_resumed(trained_ckpt, tmp_path, capsys):
    """What the log was made with cannot be checked: refused in one line naming the settings, the log kept."""
    base = ["--checkpoint", trained_ckpt, "--N0", 20, "--N", 200, "--batch", 200, "--outfile", tmp_path / "o.tsv"]
    assert run_cli([*base, "--max", 2, "--no-channels-last"]) == 0
    sidecar = tmp_path / "o.tsv.json"
    settings = json.load(open(sidecar))
    for key in ("precision", "early_abstain"):
        del settings[key]
    sidecar.write_text(json.dumps(settings))
    before = (tmp_path / "o.tsv").read_bytes()
    capsys.readouterr()
    assert run_cli([*base, "--max", 4, "--no-channels-last"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "precision None -> " in err[0] and "early_abstain None -> " in err[0], err
    assert (tmp_path / "o.tsv").read_bytes() == before


def test_compile_falls_back_to_eager_with_a_note(monkeypatch, capsys):
    def broken(model, **kwargs):
        return lambda x: (_ for _ in ()).throw(RuntimeError("no compiler here\nmore"))
    monkeypatch.setattr(torch, "compile", broken)
    model = digits_model()
    out = certify.fast_model(model, False, True, [(5, 1, 8, 8)], "fp32")
    assert out is model
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--compile" in err and "no compiler here" in err


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="torch.compile's CPU backend needs a C++ compiler")
def test_compile_runs_from_the_command_line_and_gives_the_eager_lines(trained_ckpt, tmp_path, capsys):
    # One batch shape (N0 = N = batch) keeps it to a single compilation: 10-40 s on a CPU.
    base = ["--checkpoint", trained_ckpt, "--max", 3, "--N0", 100, "--N", 100, "--batch", 100]
    assert run_cli([*base, "--outfile", tmp_path / "eager.tsv"]) == 0
    capsys.readouterr()
    from torch._dynamo.utils import counters
    graphs = counters["stats"]["unique_graphs"]
    assert run_cli([*base, "--compile", "--outfile", tmp_path / "compiled.tsv"]) == 0
    if "running eager" in capsys.readouterr().err:
        pytest.skip("torch.compile is not usable on this machine (certify.py fell back to eager, as it should)")
    assert counters["stats"]["unique_graphs"] - graphs == 1   # one pass shape, compiled once: no example recompiles
    assert json.load(open(tmp_path / "compiled.tsv.json"))["compile"] is True
    for a, b in zip(tsv_rows(tmp_path / "eager.tsv"), tsv_rows(tmp_path / "compiled.tsv")):
        assert a["predict"] == b["predict"] and abs(int(a["nA"]) - int(b["nA"])) <= max(1, TOLERANCE * 100)


# ----------------------------------------------------------------------------------------------------------
# Training: --channels-last is the same training up to rounding, --amp trains, the flags parse
# ----------------------------------------------------------------------------------------------------------

def train_two_steps(channels_last, precision):
    model = digits_model().train()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = common.make_optimizer(model, lr=0.05)
    train = common.get_dataset("digits", "train")
    batches = [(train.images[i:i + 32], train.labels[i:i + 32], torch.arange(i, i + 32)) for i in (0, 32)]
    torch.manual_seed(3)
    row = common.train_epoch(model, batches, optimizer, lambda f, x, y, idx: common.gaussian_loss(f, x, y, 0.5, 2),
                             2, torch.device("cpu"), precision=precision)
    return model, row


def test_channels_last_training_gives_the_plain_weights_up_to_rounding():
    plain, row_plain = train_two_steps(False, "fp32")
    fast, row_fast = train_two_steps(True, "fp32")
    for (name, a), b in zip(plain.state_dict().items(), fast.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5), name
    assert row_fast["train_loss"] == pytest.approx(row_plain["train_loss"], rel=1e-5)


def test_bf16_amp_trains_close_to_fp32():
    plain, row_plain = train_two_steps(False, "fp32")
    amp, row_amp = train_two_steps(True, "bf16")
    assert np.isfinite(row_amp["train_loss"])
    assert row_amp["train_loss"] == pytest.approx(row_plain["train_loss"], rel=0.05)  # bf16: ~3 decimal digits
    moved = [not torch.equal(a, b) for a, b in zip(digits_model().state_dict().values(), amp.state_dict().values())]
    assert any(moved)


@pytest.mark.parametrize("script", ["train_gaussian.py", "train_ours.py"])
def test_training_scripts_accept_amp_and_channels_last(script, tmp_path, monkeypatch, capsys):
    cmd = [sys.executable, os.path.join(ROOT, script), "--dataset", "digits", "--sigma", "0.5", "--epochs", "1",
           "--max-batches", "2", "--workers", "0", "--channels-last"]
    if script == "train_ours.py":
        cmd += ["--no-discard", "--T", "1"]
    import importlib
    from helpers import run_main
    module = importlib.import_module(script[:-3])   # its main reads sys.argv: the command line, in this process
    monkeypatch.setattr(sys, "argv", [script, *cmd[2:], "--amp", "--outdir", str(tmp_path / "run")])
    assert run_main(lambda a: module.main(), []) == 0, capsys.readouterr().err[-2000:]
    model, _ = readers.load_model(str(tmp_path / "run" / machinery.CHECKPOINT))  # certify.py reads it as usual
    assert json.load(open(tmp_path / "run" / "args.json"))["amp"] == "bf16"
    if script == "train_gaussian.py":  # the check is shared (machinery.check_precision): one script is enough
        import train_gaussian
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", [script, *cmd[2:], "--amp", "fp16", "--outdir", str(tmp_path / "run16")])
        assert run_main(lambda a: train_gaussian.main(), []) == 2   # in this process: the same command line
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "fp16" in err and not (tmp_path / "run16").exists()


class Counted(nn.Module):
    """Stands in for torch.compile's module (which holds the model as its child _orig_mod): counts the calls."""

    def __init__(self, model):
        super().__init__()
        self._orig_mod, self.calls = model, 0

    def forward(self, x):
        self.calls += 1
        return self._orig_mod(x)


@pytest.mark.parametrize("script", ["train_gaussian.py", "train_ours.py"])
def test_compile_trains_through_the_compiled_module_and_saves_the_plain_models_weights(script, tmp_path,
                                                                                       monkeypatch):
    import importlib
    from helpers import run_main
    module = importlib.import_module(script[:-3])
    made = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: made.append(Counted(model)) or made[-1])
    argv = [script, "--dataset", "digits", "--sigma", "0.5", "--epochs", "1", "--max-batches", "2", "--workers", "0"]
    if script == "train_ours.py":
        argv += ["--no-discard", "--T", "1"]
    weights = {}
    for flags in ([], ["--compile"]):
        monkeypatch.setattr(sys, "argv", [*argv, *flags, "--outdir", str(tmp_path / f"run{len(flags)}")])
        assert run_main(lambda a: module.main(), []) == 0
        weights[len(flags)] = readers.load_checkpoint(str(tmp_path / f"run{len(flags)}" / machinery.CHECKPOINT))
    assert len(made) == 1 and made[0].calls >= 2 * 4                # every step's passes went through it
    plain, compiled = weights[0]["state_dict"], weights[1]["state_dict"]
    assert list(plain) == list(compiled)                              # no wrapper's prefix in the checkpoint
    assert all(torch.equal(plain[k], compiled[k]) for k in plain)    # the same steps: the same weights


def test_bench_reports_the_largest_certified_accuracy_change_over_all_radii():
    full = [{"radius": 0.8, "correct": 1}, {"radius": 0.3, "correct": 1}, {"radius": 0.5, "correct": 0}]
    early = [{"radius": 0.8, "correct": 1}, {"radius": 0.0, "correct": 0}, {"radius": 0.5, "correct": 0}]
    # the second example lost its radius 0.3: one of three examples, at every radius up to 0.3
    assert bench.certified_accuracy_change(full, early) == pytest.approx(100 / 3)
    assert bench.certified_accuracy_change(full, full) == 0.0


def test_bench_baselines_times_every_method_against_gaussian_with_its_m(monkeypatch, capsys):
    """Section (e) runs each method's real loss once (a tiny model stands in for cifar_resnet20; no timing asserted)."""
    def tiny(device, channels_last=False, seed=0):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Conv2d(3, 4, 3, stride=4), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                             nn.Linear(4 * 8 * 8, 10)).to(device)
    monkeypatch.setattr(bench, "make_model", tiny)
    bench.bench_baselines(torch.device("cpu"), 1, "bf16", True)
    lines = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [line[0] for line in lines] == list(bench.train_baselines.METHODS)
    m = {line[0]: int(line[3].rstrip(",")) for line in lines}
    assert m == {"smoothadv": 8, "macer": 16, "consistency": 2, "smoothmix": 2, "catrs": 4, "stability": 1}
    assert all(float(line[-1].rstrip("x")) > 0 for line in lines)


# ----------------------------------------------------------------------------------------------------------
# --cuda-graph: refused off CUDA, under fp16 and torchrun; the dispatch (tests/test_cuda.py checks the replays)
# ----------------------------------------------------------------------------------------------------------

def test_a_graphed_epoch_is_refused_off_cuda_under_fp16_and_for_a_non_bool():
    model = digits_model()
    optimizer = common.make_optimizer(model)
    batches = [(torch.rand(4, 1, 8, 8), torch.zeros(4, dtype=torch.long), torch.arange(4))]
    loss_fn = lambda f, x, y, idx: common.gaussian_loss(f, x, y, 0.5, 2)   # noqa: E731
    before = copy.deepcopy(model.state_dict())
    for device, precision, graph, error, words in [("cpu", "fp32", True, ValueError, "CUDA device"),
                                                   ("cpu", "fp32", 1, TypeError, "graph")]:
        with pytest.raises(error, match=words):
            common.train_epoch(model, batches, optimizer, loss_fn, 2, torch.device(device), precision=precision,
                               graph=graph)
    with pytest.raises(ValueError, match="bf16"):
        common.check_graph(torch.device("cuda"), "fp16")
    with pytest.raises(ValueError, match="torchrun"):
        common.check_graph(torch.device("cuda"), "bf16", world=2)
    common.check_graph(torch.device("cuda"), "bf16")     # allowed: CUDA, bf16, one process
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())   # refused before any step


def test_a_graphed_epoch_warms_each_shape_up_then_replays_it_and_trains_the_eager_weights(monkeypatch):
    """With CUDA's graph and streams replaced by eager stand-ins: each chunk shape gets GRAPH_WARMUP eager
    steps, then one capture and replays for the rest; a shape seen once (the last batch) stays eager; the
    weights are the eager epoch's."""
    made = []

    class Replayed:   # runs the step eagerly where a replay would run the captured kernels
        def __init__(self, model, optimizer, loss_fn, precision, chunk):
            self.step, self.shape, self.calls = (model, optimizer, loss_fn), tuple(chunk[0].shape), 0
            made.append(self)

        def __call__(self, chunk):
            model, optimizer, loss_fn = self.step
            self.calls += 1
            out = loss_fn(model, *chunk)
            optimizer.zero_grad(set_to_none=True)
            out["loss"].backward()
            optimizer.step()
            return out
    monkeypatch.setattr(common, "GraphedStep", Replayed)
    monkeypatch.setattr(common, "check_graph", lambda *a, **k: None)
    stream = type("Stream", (), {"wait_stream": lambda self, other: None})
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: __import__("contextlib").nullcontext())
    train = common.get_dataset("digits", "train")
    batches = [(train.images[i:i + 32], train.labels[i:i + 32], torch.arange(i, i + 32)) for i in range(0, 160, 32)]
    batches.append((train.images[160:166], train.labels[160:166], torch.arange(160, 166)))   # a smaller last batch
    loss_fn = lambda f, x, y, idx: common.gaussian_loss(f, x, y, 0.5, 2)   # noqa: E731
    weights, rows = [], []
    for graph in (False, True):
        model = digits_model().train()
        optimizer = common.make_optimizer(model, lr=0.05)
        torch.manual_seed(3)
        rows.append(common.train_epoch(model, batches, optimizer, loss_fn, 2, torch.device("cpu"), graph=graph))
        weights.append(model.state_dict())
    assert [(r.shape, r.calls) for r in made] == [((16, 1, 8, 8), 10 - common.GRAPH_WARMUP)]   # 5 batches x 2 chunks
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert rows[0] == rows[1]


def test_cuda_graph_on_the_command_line_is_one_line_off_cuda_and_may_change_on_resume(tmp_path, monkeypatch,
                                                                                     capsys):
    from helpers import run_main
    import train_gaussian
    argv = ["train_gaussian.py", "--dataset", "digits", "--sigma", "0.5", "--epochs", "1", "--max-batches", "2",
            "--workers", "0", "--device", "cpu"]
    monkeypatch.setattr(sys, "argv", [*argv, "--cuda-graph", "--outdir", str(tmp_path / "graph")])
    assert run_main(lambda a: train_gaussian.main(), []) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--cuda-graph needs a CUDA device" in err
    assert not (tmp_path / "graph").exists() or not any((tmp_path / "graph").iterdir())
    assert "cuda_graph" in machinery.RESUME_MAY_CHANGE   # how fast, not what: a resume may add or drop it

"""certify.py: CERTIFY and PREDICT (Cohen et al. 2019, App. C.2), the Monte Carlo counter, resume and torchrun."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy.stats import beta, norm

import certify
import common
import grid
import machinery
import readers
from helpers import as_recorded, digits_checkpoint, run_main
from torchrun_util import failure_report, run_torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIGMA = 0.25


# ----------------------------------------------------------------------------------------------------------
# Classifiers whose smoothed behaviour is known in closed form
# ----------------------------------------------------------------------------------------------------------

class LinearClassifier(nn.Module):
    """Base classifier sign(w.x + b) with 2 logits: the smoothed classifier has pA = Phi(d / sigma), where
    d = |w.x + b| / ||w|| is also its exact l2 robust radius (the smoothed classifier is the same half-space)."""

    def __init__(self, w, b):
        super().__init__()
        self.w, self.b = w, b

    def forward(self, x):
        s = x.flatten(1) @ self.w + self.b
        return torch.stack([torch.zeros_like(s), s], 1)  # class 1 iff w.x + b > 0


class ConstantClassifier(nn.Module):
    def __init__(self, label, num_classes=10):
        super().__init__()
        self.label, self.num_classes = label, num_classes

    def forward(self, x):
        return F.one_hot(torch.full((x.shape[0],), self.label), self.num_classes).float()


def point_at_distance(w, b, d):
    """An input x (1, 1, D) on the positive side of w.x + b = 0 at l2 distance d from it."""
    return ((d * w.norm() - b) * w / w.norm() ** 2).view(1, 1, -1)


def linear_model(D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return LinearClassifier(torch.randn(D, generator=g), torch.tensor(0.3))


# ----------------------------------------------------------------------------------------------------------
# The Monte Carlo counter and the per-example generators (common.py)
# ----------------------------------------------------------------------------------------------------------

def test_sample_counts_give_n_votes_per_input_for_any_batch():
    model = linear_model()
    x = torch.randn(3, 1, 1, 4)
    for batch in (1, 2, 100, 10_000):  # batch < B, odd chunking, one pass
        counts = common.sample_counts(model, x, 0.5, 1001, batch, 2, torch.Generator().manual_seed(1))
        assert counts.shape == (3, 2) and counts.dtype == torch.long
        assert counts.sum(1).tolist() == [1001, 1001, 1001]


def test_sample_counts_follow_the_binomial_law_of_a_linear_classifier():
    model = linear_model()
    sigma, n = 0.5, 20_000
    x = torch.cat([point_at_distance(model.w, model.b, d) for d in (0.0, 0.25, 0.5)]).unsqueeze(1)  # (3, 1, 1, 4)
    counts = common.sample_counts(model, x, sigma, n, 4096, 2, torch.Generator().manual_seed(2))
    for row, d in zip(counts, (0.0, 0.25, 0.5)):
        pA = norm.cdf(d / sigma)
        # 5 binomial standard deviations: a false failure has probability below 1e-6
        assert abs(int(row[1]) - n * pA) < 5 * (n * pA * (1 - pA)) ** 0.5


def test_example_generator_depends_on_seed_and_idx_only():
    draw = lambda seed, idx: torch.randn(5, generator=common.example_generator(seed, idx))
    assert torch.equal(draw(0, 7), draw(0, 7))
    assert not torch.equal(draw(0, 7), draw(0, 8))
    assert not torch.equal(draw(0, 7), draw(1, 7))
    assert not torch.equal(draw(1, 0), draw(0, 1))


# ----------------------------------------------------------------------------------------------------------
# CERTIFY and PREDICT on one input
# ----------------------------------------------------------------------------------------------------------

def test_certify_radius_of_constant_classifier_is_sigma_times_inverse_normal():
    out = certify.certify(ConstantClassifier(3), torch.rand(1, 8, 8), SIGMA, N0=10, N=1000, alpha=0.001,
                          batch=300, num_classes=10, generator=torch.Generator().manual_seed(0))
    assert out["predict"] == 3 and out["nA"] == 1000 and out["N"] == 1000
    assert out["radius"] == pytest.approx(SIGMA * norm.ppf(0.001 ** (1 / 1000)), rel=1e-12)


def test_certify_and_predict_abstain_on_a_coin_flip_classifier():
    model = LinearClassifier(torch.tensor([1.0, 0.0]), torch.tensor(0.0))  # at x = 0: pA = 1/2 exactly
    x = torch.zeros(1, 1, 2)
    for seed in range(20):  # each abstains with probability >= 1 - alpha = 0.999
        out = certify.certify(model, x, SIGMA, 100, 2000, 0.001, 10_000, 2, common.example_generator(seed, 0))
        assert out["predict"] == -1 and out["radius"] == 0.0
        assert 800 < out["nA"] < 1200
        out = certify.predict(model, x, SIGMA, 2000, 0.001, 10_000, 2, common.example_generator(seed, 1))
        assert out["predict"] == -1


def test_certify_is_sound_on_a_linear_classifier():
    # A certificate fails when it names the wrong class or a radius beyond the true one, d.
    # CERTIFY promises failure probability <= alpha; allow alpha plus 3 binomial standard deviations.
    model = linear_model()
    sigma, d, alpha, runs = 0.5, 0.5, 0.01, 600  # pA = Phi(1) = 0.84
    x = point_at_distance(model.w, model.b, d)
    failures = 0
    for i in range(runs):
        out = certify.certify(model, x, sigma, 100, 1000, alpha, 100_000, 2, common.example_generator(1, i))
        failures += out["predict"] == 0 or (out["predict"] == 1 and out["radius"] > d)
    assert failures <= runs * alpha + 3 * (runs * alpha * (1 - alpha)) ** 0.5


def test_certify_radius_approaches_the_true_radius_with_N_10000():
    model = linear_model()
    sigma, d, alpha, N = 0.5, 0.5, 0.01, 10_000
    x = point_at_distance(model.w, model.b, d)
    radii = [certify.certify(model, x, sigma, 100, N, alpha, 100_000, 2, common.example_generator(2, i))["radius"]
             for i in range(200)]
    assert 0.94 * d < np.mean(radii) < 0.99 * d  # the lower bound costs about 3.5% of the radius here
    # the radius at the expected count, from scipy directly; the mean of 200 radii has a standard error of 0.1%
    nA = round(N * norm.cdf(d / sigma))
    typical = sigma * norm.ppf(beta.ppf(alpha, nA, N - nA + 1))
    assert np.mean(radii) == pytest.approx(typical, rel=0.005)


def test_predict_returns_the_side_of_a_linear_classifier():
    model = linear_model()
    x = point_at_distance(model.w, model.b, 0.5)
    out = certify.predict(model, x, 0.5, 1000, 0.001, 10_000, 2, common.example_generator(0, 0))
    assert out["predict"] == 1 and 750 < out["nA"] < 930 and out["pvalue"] < 1e-6


# ----------------------------------------------------------------------------------------------------------
# Checkpoints in the released format of Cohen et al. (no normalisation tensors, `module.` prefixes)
# ----------------------------------------------------------------------------------------------------------

def save_foreign(model, arch, path, wrap=""):
    """Save model's state_dict as {'arch', 'state_dict'} with keys rewritten by `wrap` ('', 'outer', 'inner')."""
    sd = model.state_dict()
    if wrap == "outer":    # DataParallel around the whole Sequential
        sd = {f"module.{k}": v for k, v in sd.items()}
    elif wrap == "inner":  # DataParallel inside the Sequential, as Cohen's ImageNet ResNet-50
        sd = {f"1.module.{k[2:]}": v for k, v in sd.items()}
    torch.save({"arch": arch, "state_dict": sd}, path)
    return sd


@pytest.mark.parametrize("arch,wrap", [("cifar_resnet20", ""), ("cifar_resnet20", "outer"),
                                       ("cifar_resnet110", ""), ("cifar_resnet110", "inner")])
def test_cohen_cifar_checkpoints_load_strictly_and_certify_like_the_original(tmp_path, arch, wrap):
    torch.manual_seed(0)
    original = common.get_architecture(arch, "cifar10").eval()
    sd = save_foreign(original, arch, tmp_path / "ck.pth.tar", wrap)
    assert "1.conv1.weight" in sd or "module.1.conv1.weight" in sd or "1.module.conv1.weight" in sd
    assert not any(k.startswith(("0.", "module.0.")) for k in sd)  # no saved normalisation tensors
    model, ckpt = readers.load_model(str(tmp_path / "ck.pth.tar"))
    assert ckpt["arch"] == arch and not model.training
    for (name, p), q in zip(original.state_dict().items(), model.state_dict().values()):
        assert torch.equal(p, q), name
    if arch == "cifar_resnet20":  # certify on a random CIFAR-shaped input: same answer as the original model
        x = torch.rand(3, 32, 32)
        runs = [certify.certify(m, x, SIGMA, 10, 40, 0.001, 64, 10, common.example_generator(0, 5))
                for m in (original, model)]
        assert runs[0] == runs[1] and runs[0]["N"] == 40 and 0 <= runs[0]["nA"] <= 40


def test_cohen_imagenet_resnet50_checkpoint_loads_strictly(tmp_path):
    original = common.get_architecture("resnet50", "imagenet")
    sd = save_foreign(original, "resnet50", tmp_path / "ck.pth.tar", wrap="inner")
    assert "1.module.conv1.weight" in sd
    model, _ = readers.load_model(str(tmp_path / "ck.pth.tar"))
    assert torch.equal(model.state_dict()["1.fc.weight"], original.state_dict()["1.fc.weight"])


# ----------------------------------------------------------------------------------------------------------
# The command line: TSV, reproducibility, subsets, resume, torchrun, bad input
# ----------------------------------------------------------------------------------------------------------

CLI = ["--N0", "30", "--N", "300", "--batch", "500"]


@pytest.fixture(scope="module")
def digits_ckpt(tmp_path_factory):
    """A LeNet briefly trained with Gaussian noise on digits, so that certificates differ between examples."""
    return digits_checkpoint(tmp_path_factory.mktemp("ckpt") / "checkpoint.pth.tar", sigma=SIGMA)


def run_cli(argv):
    """certify.py's main in this process, as the command line runs it; returns the exit code."""
    try:
        machinery.run(lambda: certify.main([str(a) for a in argv]))
    except SystemExit as e:
        return e.code
    return 0


def rows(path, drop_time=True):
    """Data lines of a TSV as lists of cells, the time column (index 5) left out."""
    with open(path) as f:
        lines = f.read().splitlines()[1:]
    return [[c for j, c in enumerate(line.split("\t")) if not (drop_time and j == 5)] for line in lines]


@pytest.fixture(scope="module")
def reference(digits_ckpt, tmp_path_factory):
    """An uninterrupted run over every 3rd test example, first 24 of them."""
    out = str(tmp_path_factory.mktemp("ref") / "ref.tsv")
    assert run_cli(["--checkpoint", digits_ckpt, "--outfile", out, "--skip", 3, "--max", 24, *CLI]) == 0
    return out


def test_tsv_has_cohens_columns_and_reads_in_pandas(reference):
    import pandas as pd
    df = pd.read_csv(reference, sep="\t")
    assert list(df.columns) == ["idx", "label", "predict", "radius", "correct", "time", "nA", "N", "nY"]
    assert (df["N"] == 300).all() and ((df["predict"] == -1) == (df["radius"] == 0)).all()
    # the true label's votes: nA on correct rows; on the others a count of its own (0 <= nY <= N - nA)
    assert (df["nY"][df["correct"] == 1] == df["nA"][df["correct"] == 1]).all()
    wrong = df[(df["correct"] == 0) & (df["predict"] >= 0)]
    assert (wrong["nY"] <= wrong["N"] - wrong["nA"]).all()
    assert (df["correct"] == (df["predict"] == df["label"]).astype(int)).all()
    assert pd.to_timedelta(df["time"]).notna().all()
    assert df["nA"].nunique() > 3  # the model is trained: certificates differ between examples
    with open(reference + ".json") as f:
        settings = json.load(f)
    assert settings["sigma"] == SIGMA and settings["N"] == 300 and settings["N0"] == 30 and settings["seed"] == 0
    # the checkpoint is named relative to the working directory (no machine's path in a published log) and
    # identified by its hash
    assert not os.path.isabs(settings["checkpoint"]) and os.path.isfile(settings["checkpoint"])
    assert settings["checkpoint_sha256"] == machinery.file_sha256(settings["checkpoint"])


def test_skip_and_max_pick_every_kth_example_with_its_label(reference):
    test = common.get_dataset("digits", "test")
    got = rows(reference)
    assert [int(r[0]) for r in got] == list(range(0, 72, 3))
    assert [int(r[1]) for r in got] == [int(test[i][1]) for i in range(0, 72, 3)]


def test_same_seed_same_tsv_and_a_subset_gives_the_same_lines(reference, digits_ckpt, tmp_path):
    again, subset, other = tmp_path / "again.tsv", tmp_path / "subset.tsv", tmp_path / "other.tsv"
    assert run_cli(["--checkpoint", digits_ckpt, "--outfile", again, "--skip", 3, "--max", 24, *CLI]) == 0
    assert rows(again) == rows(reference)
    assert run_cli(["--checkpoint", digits_ckpt, "--outfile", subset, "--skip", 6, "--max", 5, *CLI]) == 0
    assert rows(subset) == rows(reference)[0:10:2]
    assert run_cli(["--checkpoint", digits_ckpt, "--outfile", other, "--skip", 3, "--max", 24, *CLI,
                    "--seed", 1]) == 0
    assert [r[5] for r in rows(other)] != [r[5] for r in rows(reference)]  # nA: the seed drives the noise


def test_torn_last_line_is_dropped_and_redone(reference, digits_ckpt, tmp_path):
    out = tmp_path / "torn.tsv"
    with open(reference) as f:
        lines = f.read().splitlines(keepends=True)
    shutil.copy(reference + ".json", str(out) + ".json")
    for torn in (lines[6][:7], lines[6][:-1], lines[6].rsplit("\t", 1)[0] + "\n"):  # no newline / too few fields
        out.write_text("".join(lines[:6]) + torn)
        as_recorded(out, str(out) + ".json")   # a run stopped with a torn last line
        assert run_cli(["--checkpoint", digits_ckpt, "--outfile", out, "--skip", 3, "--max", 24, *CLI]) == 0
        assert rows(out) == rows(reference)
    # a finished file is left as it is
    before = out.read_bytes()
    assert run_cli(["--checkpoint", digits_ckpt, "--outfile", out, "--skip", 3, "--max", 24, *CLI]) == 0
    assert out.read_bytes() == before


def test_max_extends_a_finished_run_and_overwrite_restarts(reference, digits_ckpt, tmp_path):
    out = tmp_path / "grow.tsv"
    assert run_cli(["--checkpoint", digits_ckpt, "--outfile", out, "--skip", 3, "--max", 10, *CLI]) == 0
    assert run_cli(["--checkpoint", digits_ckpt, "--outfile", out, "--skip", 3, "--max", 24, *CLI]) == 0
    assert rows(out) == rows(reference)
    assert run_cli(["--checkpoint", digits_ckpt, "--outfile", out, "--skip", 3, "--max", 2, *CLI,
                    "--overwrite"]) == 0
    assert rows(out) == rows(reference)[:2]


def subprocess_env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def test_sigkill_then_rerun_equals_an_uninterrupted_run(digits_ckpt, tmp_path):
    args = ["--checkpoint", digits_ckpt, "--max", 40, "--N0", 30, "--N", 2000, "--batch", 1000]
    full, killed = tmp_path / "full.tsv", tmp_path / "killed.tsv"
    cmd = [sys.executable, os.path.join(ROOT, "certify.py"), *map(str, args), "--outfile", str(killed)]
    proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while proc.poll() is None and time.time() < deadline:
        if killed.exists() and killed.read_text().count("\n") >= 6:  # header + at least 5 lines
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert 5 <= len(rows(killed)) < 40
    assert run_cli([*args, "--outfile", killed]) == 0
    assert run_cli([*args, "--outfile", full]) == 0
    assert rows(killed) == rows(full) and len(rows(full)) == 40


def test_merge_of_rank_parts_gives_one_line_per_idx_in_order(tmp_path):
    cols = certify.PREDICT_COLUMNS
    out = str(tmp_path / "m.tsv")
    line = lambda i: f"{i}\t1\t1\t1\t0:00:01\t9\t10\t9\n"
    header = "\t".join(cols) + "\n"
    with open(out, "w") as f:
        f.write(header + line(0) + line(6))
    with open(out + ".rank0", "w") as f:
        f.write(header + line(2) + line(8) + line(6))   # 6 again: a crash after a merge, before the parts went
    with open(out + ".rank1", "w") as f:
        f.write(header + line(4) + line(10) + "12\t1\t")  # a torn last line
    assert machinery.merge_parts(out, cols) == 6
    assert open(out).read() == header + "".join(line(i) for i in (0, 2, 4, 6, 8, 10))
    assert machinery.part_files(out) == []
    assert machinery.merge_parts(out, cols) is None  # nothing to merge: the file is left alone


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not installed")
def test_torchrun_with_two_ranks_resumes_splits_and_merges_like_one_process(reference, digits_ckpt, tmp_path):
    out = tmp_path / "dist.tsv"
    with open(reference) as f:
        out.write_text("".join(f.read().splitlines(keepends=True)[:4]))  # a killed run: 3 lines done
    shutil.copy(reference + ".json", str(out) + ".json")
    as_recorded(str(out) + ".json")
    # `--` keeps torchrun from reading --max as an abbreviation of its own --max-restarts
    args = [os.path.join(ROOT, "certify.py"), "--", "--checkpoint", digits_ckpt, "--outfile", str(out),
            "--skip", "3", "--max", "24", *CLI, "--device", "cpu"]
    res = run_torchrun(args, tmp_path / "logs", env=subprocess_env(), timeout=120)
    assert res.returncode == 0, failure_report(res, tmp_path / "logs")
    assert rows(out) == rows(reference)
    assert machinery.part_files(str(out)) == []


def test_true_label_votes_and_saved_counts_agree_across_resume_and_torchrun(digits_ckpt, tmp_path):
    base = ["--checkpoint", digits_ckpt, "--skip", 3, "--max", 24, *CLI, "--save-counts", "--device", "cpu"]
    whole = tmp_path / "whole.tsv"
    assert run_cli([*base, "--outfile", whole]) == 0
    counts = read_counts(str(whole) + ".counts")
    assert sorted(counts) == [int(r[0]) for r in rows(whole)]
    for r in rows(whole):   # (idx, label, predict, radius, correct, nA, N, nY) without time
        votes = counts[int(r[0])]
        assert sum(votes) == int(r[6]) and votes[int(r[1])] == int(r[7])          # nY = the label's votes
        if int(r[2]) >= 0:
            assert votes[int(r[2])] == int(r[5])                                  # nA = cA's votes
    # a killed run (3 lines, counts of 4: the kill came between the two writes) resumes to the same files
    part = tmp_path / "part.tsv"
    part.write_text("".join(open(whole).read().splitlines(keepends=True)[:4]))
    (tmp_path / "part.tsv.counts").write_text("".join(open(str(whole) + ".counts").read()
                                                      .splitlines(keepends=True)[:5]))
    shutil.copy(str(whole) + ".json", str(part) + ".json")
    as_recorded(str(part) + ".json")
    assert run_cli([*base, "--outfile", part]) == 0
    assert rows(part) == rows(whole) and read_counts(str(part) + ".counts") == counts
    # two ranks under torchrun: the same lines and counts, merged
    dist = tmp_path / "dist.tsv"
    args = [os.path.join(ROOT, "certify.py"), "--", *map(str, base), "--outfile", str(dist)]
    res = run_torchrun(args, tmp_path / "logs", env=subprocess_env(), timeout=120)
    assert res.returncode == 0, failure_report(res, tmp_path / "logs")
    assert rows(dist) == rows(whole) and read_counts(str(dist) + ".counts") == counts
    assert machinery.part_files(str(dist) + ".counts") == []


def read_counts(path):
    """{idx: votes per class} of a --save-counts file; a repeated idx keeps its first row."""
    out = {}
    for line in open(path).read().splitlines()[1:]:
        cells = [int(c) for c in line.split("\t")]
        out.setdefault(cells[0], cells[1:])
    return out


def test_a_log_in_other_columns_is_not_resumed(reference, digits_ckpt, tmp_path, capsys):
    """A log without nY (its sidecar naming those columns) is not one certify.py resumes: one line, the log kept."""
    old = tmp_path / "old.tsv"
    lines = open(reference).read().splitlines()
    old.write_text("".join("\t".join(ln.split("\t")[:-1]) + "\n" for ln in lines[:6]))  # header + 5, no nY
    settings = json.load(open(reference + ".json"))
    settings["columns"] = settings["columns"][:-1]
    json.dump(settings, open(str(old) + ".json", "w"))
    as_recorded(str(old) + ".json")
    before = old.read_bytes()
    capsys.readouterr()
    assert run_cli(["--checkpoint", digits_ckpt, "--outfile", old, "--skip", 3, "--max", 24, *CLI]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nY" in err[0], err
    assert old.read_bytes() == before


def test_early_abstention_keeps_the_true_label_votes_of_the_draws_made(tmp_path):
    class NoisePixels(nn.Module):   # the class is the largest of the first 10 noisy pixels: pA about 0.1
        def forward(self, x):
            return x.flatten(1)[:, :10]
    x, votes = torch.full((1, 8, 8), 0.5), []
    line = certify.example_line(NoisePixels(), x, 3, 0, SIGMA, 10, 4000, 0.001, 100, 10, 0, False, "fp32",
                                certify.EARLY_ABSTAIN_ALPHA, counts_out=votes)
    cells = dict(zip(certify.CERTIFY_COLUMNS, line.split("\t")))
    assert cells["predict"] == "-1" and int(cells["N"]) < 4000     # stopped early
    assert sum(votes[0]) == int(cells["N"]) and votes[0][3] == int(cells["nY"]) > 0
    line = certify.example_line(ConstantClassifier(0), x, 0, 0, SIGMA, 10, 400, 0.001, 100, 10, 0, False, "fp32")
    cells = dict(zip(certify.CERTIFY_COLUMNS, line.split("\t")))
    assert cells["nY"] == cells["nA"] == "400" and cells["correct"] == "1"


def test_settings_mismatch_is_refused_and_the_outfile_untouched(reference, digits_ckpt, tmp_path):
    out = tmp_path / "keep.tsv"
    shutil.copy(reference, out)
    shutil.copy(reference + ".json", str(out) + ".json")
    other_ckpt = tmp_path / "other.pth.tar"
    ckpt = torch.load(digits_ckpt, weights_only=False)
    ckpt["state_dict"]["1.fc3.bias"] += 1.0
    torch.save(ckpt, other_ckpt)
    base = ["--checkpoint", digits_ckpt, "--outfile", out, "--skip", 3, "--max", 24]
    changes = [["--sigma", 0.5, *CLI], ["--N0", 30, "--N", 400, "--batch", 500], ["--N0", 20, "--N", 300],
               [*CLI, "--alpha", 0.01], [*CLI, "--seed", 1], [*CLI, "--predict"], [*CLI, "--split", "train"]]
    before = out.read_bytes(), (tmp_path / "keep.tsv.json").read_bytes()
    for change in changes + [["--checkpoint", other_ckpt, *CLI]]:
        assert run_cli([*base, *change]) == 2, change
        assert (out.read_bytes(), (tmp_path / "keep.tsv.json").read_bytes()) == before
    # a TSV we did not write (no settings file) is refused as well
    os.remove(str(out) + ".json")
    assert run_cli([*base, *CLI]) == 2 and out.read_bytes() == before[0]


def test_predict_mode_writes_the_predict_columns(digits_ckpt, tmp_path, reference):
    import pandas as pd
    out = tmp_path / "pred.tsv"
    argv = ["--checkpoint", digits_ckpt, "--outfile", out, "--skip", 3, "--max", 6, "--predict", *CLI]
    assert run_cli(argv) == 0
    df = pd.read_csv(out, sep="\t")
    assert list(df.columns) == ["idx", "label", "predict", "correct", "time", "nA", "N", "nY"]
    assert df["idx"].tolist() == list(range(0, 18, 3))
    assert (df["predict"] >= 0).sum() >= 3


def make_fake_cifar(folder, per_class=1):
    """A tiny CIFAR-10 look-alike in the image-folder layout (test/<class>/*.png)."""
    from PIL import Image
    rng = np.random.default_rng(0)
    for c in range(10):
        os.makedirs(folder / "test" / f"class{c}")
        for k in range(per_class):
            pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / "test" / f"class{c}" / f"{k}.png")
    return folder


def test_cohen_checkpoint_certifies_from_the_command_line(tmp_path):
    ck = tmp_path / "cohen.pth.tar"
    save_foreign(common.get_architecture("cifar_resnet20", "cifar10"), "cifar_resnet20", ck, wrap="outer")
    data = make_fake_cifar(tmp_path / "cifar")
    out = tmp_path / "c.tsv"
    argv = ["--checkpoint", ck, "--dataset", "cifar10", "--data-dir", data, "--outfile", out,
            "--N0", 10, "--N", 20, "--batch", 40, "--skip", 4]
    assert run_cli(argv) == 2  # Cohen's checkpoints store no sigma: it must be given
    assert run_cli([*argv, "--sigma", 0.5]) == 0
    assert [int(r[0]) for r in rows(out)] == [0, 4, 8] and [int(r[1]) for r in rows(out)] == [0, 4, 8]


@pytest.fixture()
def bad_input_setup(reference, digits_ckpt, tmp_path):
    """An existing outfile that every bad command must leave byte-identical."""
    out = tmp_path / "keep.tsv"
    shutil.copy(reference, out)
    shutil.copy(reference + ".json", str(out) + ".json")
    (tmp_path / "junk.pth.tar").write_text("not a checkpoint")
    ck = tmp_path / "cifar.pth.tar"
    net = common.get_architecture("cifar_resnet20", "cifar10")
    machinery.save_checkpoint({"arch": "cifar_resnet20", "dataset": "cifar10", "sigma": SIGMA,
                               "state_dict": net.state_dict()}, str(ck))
    return out


BAD_INPUTS = {
    "missing checkpoint": ["--checkpoint", "{tmp}/nothing.pth.tar"],
    "unreadable checkpoint": ["--checkpoint", "{tmp}/junk.pth.tar"],
    "state_dict of another architecture": ["--checkpoint", "{ckpt}", "--arch", "digits_cnn"],
    "sigma zero": ["--checkpoint", "{ckpt}", "--sigma", "0"],
    "sigma negative": ["--checkpoint", "{ckpt}", "--sigma", "-0.25"],
    "N0 zero": ["--checkpoint", "{ckpt}", "--N0", "0"],
    "N zero": ["--checkpoint", "{ckpt}", "--N", "0"],
    "N0 above N": ["--checkpoint", "{ckpt}", "--N0", "500", "--N", "300"],
    "alpha zero": ["--checkpoint", "{ckpt}", "--alpha", "0"],
    "alpha one": ["--checkpoint", "{ckpt}", "--alpha", "1"],
    "skip zero": ["--checkpoint", "{ckpt}", "--skip", "0"],
    "unknown split": ["--checkpoint", "{ckpt}", "--split", "val"],
    "dataset missing offline": ["--checkpoint", "{tmp}/cifar.pth.tar", "--data-dir", "{tmp}/no_cifar"],
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_the_outfile_intact(name, bad_input_setup, digits_ckpt, capsys):
    out = bad_input_setup
    before = out.read_bytes(), open(str(out) + ".json", "rb").read()
    argv = [a.format(tmp=out.parent, ckpt=digits_ckpt) for a in BAD_INPUTS[name]]
    capsys.readouterr()
    assert run_cli([*argv, "--outfile", out]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "error" in err, err
    assert (out.read_bytes(), open(str(out) + ".json", "rb").read()) == before


def test_bad_input_in_a_real_process_has_no_traceback(digits_ckpt, tmp_path):
    res = subprocess.run([sys.executable, os.path.join(ROOT, "certify.py"), "--checkpoint", digits_ckpt,
                          "--alpha", "1.5", "--outfile", str(tmp_path / "x.tsv")],
                         env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1 and "--alpha" in res.stderr
    assert not (tmp_path / "x.tsv").exists()


def test_logs_and_runs_record_the_environment_they_were_made_with(tmp_path, monkeypatch):
    """The versions and the CPU (its vector extensions decide floating point and bf16 speed) in the sidecar of a
    log and in a run's args.json, and in one line for report headers (a sidecar's broken record shows as ?)."""
    env = machinery.environment()
    assert env["torch"] == torch.__version__ and env["numpy"] == np.__version__ and env["python"].startswith("3.")
    assert isinstance(env["cpu"]["extensions"], list) and env["cpu"]["logical_cpus"] >= 1
    ckpt = digits_checkpoint(tmp_path / "m.pth.tar", steps=5)
    out = tmp_path / "log.tsv"
    assert run_main(certify.main, ["--checkpoint", ckpt, "--N0", 10, "--N", 100, "--max", 2, "--device", "cpu",
                                   "--outfile", out]) == 0
    assert json.loads((tmp_path / "log.tsv.json").read_text())["environment"] == json.loads(json.dumps(env))
    run = tmp_path / "run"
    import train_gaussian   # its main reads sys.argv: the command line, in this process
    monkeypatch.setattr(sys, "argv", ["train_gaussian.py", "--dataset", "digits", "--sigma", "0.25", "--epochs", "1",
                                      "--max-batches", "1", "--workers", "0", "--outdir", str(run)])
    assert run_main(lambda a: train_gaussian.main(), []) == 0
    assert json.loads((run / "args.json").read_text())["environment"]["torch"] == torch.__version__
    line = machinery.environment_line()
    assert f"torch {torch.__version__}" in line and env["cpu"]["model"] in line
    assert machinery.environment_line({"cpu": "broken"}).startswith("python ?")


@pytest.mark.parametrize("flags, warned", [("fpu sse4_2 avx avx2 fma", True), ("avx2 avx512f avx512_bf16", False),
                                           ("avx2 amx_bf16", False), (None, False)])
def test_bf16_on_a_cpu_without_native_bf16_warns_with_the_measured_cost(tmp_path, capsys, monkeypatch, flags, warned):
    info = tmp_path / "cpuinfo"
    if flags is not None:   # else no /proc/cpuinfo (not Linux): nothing known, nothing said
        info.write_text(f"model name\t: Some CPU\nflags\t\t: {flags}\n")
    assert machinery.cpu_info(str(info)) == ((("Some CPU", flags.split()) if flags else (None, None)))
    real = machinery.cpu_info
    monkeypatch.setattr(machinery, "cpu_info", lambda: real(str(info)))
    machinery.check_precision("bf16", "cpu")
    assert ("warning: bf16 on a CPU without native bf16" in capsys.readouterr().err) == warned
    machinery.check_precision("fp32", "cpu")
    assert capsys.readouterr().err == ""


def test_certify_predict_and_grid_evaluate_in_eval_mode_and_hand_the_model_back_as_it_came():
    """A BatchNorm model handed in train mode: the certificate is the eval-mode one (same counts as a model put
    in eval mode first), its running statistics are untouched, and it comes back in train mode; the generator
    has a default."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 3))
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
    x = torch.rand(1, 8, 8)
    reference = certify.certify(model.eval(), x, 0.5, 20, 500, 0.001, 100, 3, common.example_generator(0, 0))
    model.train()
    stats = model[1].running_mean.clone()
    out = certify.certify(model, x, 0.5, 20, 500, 0.001, 100, 3, common.example_generator(0, 0))
    assert out["counts"] == reference["counts"] and out["nA"] == reference["nA"]
    assert model.training and model[1].training and torch.equal(model[1].running_mean, stats)
    assert certify.predict(model, x, 0.5, 200, 0.001, 100, 3)["N"] == 200       # default generator
    plan = grid.grid_plan([0.25], 0.5, 2000, 0.001)
    grid.grid_certify(model, x, 0.5, 20, 100, 3, plan=plan)
    assert model.training and torch.equal(model[1].running_mean, stats)
    model[1].eval()                                  # a mixed model comes back mixed
    certify.certify(model, x, 0.5, 20, 200, 0.001, 100, 3)
    assert model.training and not model[1].training


# ----------------------------------------------------------------------------------------------------------
# --batch auto: the largest pass that fits on a GPU, the passes of Cohen et al.'s code elsewhere
# ----------------------------------------------------------------------------------------------------------

def test_fitting_batch_is_the_largest_pass_within_the_memory_share_and_the_cap():
    # a model whose pass takes 3 MB fixed plus 10 kB an input: with 100 MB free and half of it usable,
    # (50 MB - 3 MB) / 10 kB = 4,700 inputs
    def pass_bytes(k):
        return 3_000_000 + 10_000 * k
    assert common.fitting_batch(pass_bytes, 100_000_000, 10 ** 6) == 4_700
    assert common.fitting_batch(pass_bytes, 100_000_000, 1_000) == 1_000          # at most the cap (N)
    assert common.fitting_batch(pass_bytes, 1_000_000, 10 ** 6) == 1              # nothing fits: one input
    assert common.fitting_batch(pass_bytes, 100_000_000, 10 ** 6, share=1.0) == 9_700
    with pytest.raises(ValueError, match="free_bytes"):
        common.fitting_batch(pass_bytes, -1, 10)


def test_batch_cap_is_the_largest_count_or_a_hundredth_of_N_with_early_abstention():
    limit = machinery.MAX_BATCH_BYTES
    assert common.batch_cap(100, 100_000, (3, 32, 32), limit) == 100_000
    assert common.batch_cap(100, 100_000, (3, 32, 32), limit, early_abstain=True) == 1_000
    assert common.batch_cap(100, 50, (3, 32, 32), limit, early_abstain=True) == 1
    big = common.batch_cap(100, 10 ** 9, (3, 224, 224), limit)          # the byte limit of one pass
    assert big * 4 * 3 * 224 * 224 <= limit < (big + 1) * 4 * 3 * 224 * 224


def test_auto_batch_keeps_the_resumed_logs_batch_and_probes_only_on_cuda(monkeypatch):
    import types
    probed = []
    monkeypatch.setattr(common, "cuda_batch", lambda model, shape, device, precision, cap: probed.append(cap) or 4_700)
    cuda, cpu = types.SimpleNamespace(type="cuda"), torch.device("cpu")
    assert common.auto_batch(None, (1, 8, 8), cuda, "fp32", 10 ** 5, 300) == 300       # resumed: the log's own
    assert common.auto_batch(None, (1, 8, 8), cuda, "fp32", 10 ** 5) == 4_700          # fresh, on a GPU: the probe's
    assert common.auto_batch(None, (1, 8, 8), cuda, "fp32", 10 ** 5, True) == 4_700    # not a batch a log records
    assert common.auto_batch(None, (1, 8, 8), cpu, "fp32", 10 ** 5) == common.CPU_BATCH == 1000
    assert probed == [10 ** 5] * 2                                                       # at most the cap, on CUDA only


def test_batch_auto_is_the_default_records_its_number_and_a_resume_keeps_the_logs(digits_ckpt, tmp_path, capsys):
    base = ["--checkpoint", digits_ckpt, "--N0", 30, "--N", 300, "--skip", 3]
    out = tmp_path / "auto.tsv"
    assert run_cli([*base, "--max", 4, "--outfile", out]) == 0
    assert json.load(open(str(out) + ".json"))["batch"] == common.CPU_BATCH    # on the CPU: as before
    explicit = tmp_path / "b7.tsv"
    assert run_cli([*base, "--max", 8, "--batch", 7, "--outfile", explicit]) == 0
    part = tmp_path / "part.tsv"
    assert run_cli([*base, "--max", 4, "--batch", 7, "--outfile", part]) == 0
    capsys.readouterr()
    assert run_cli([*base, "--max", 8, "--batch", "auto", "--outfile", part]) == 0   # resumed with auto
    assert "note" not in capsys.readouterr().err                                      # the same batch: no note
    assert json.load(open(str(part) + ".json"))["batch"] == 7
    assert rows(part) == rows(explicit)          # the log's chunking kept: the lines of an uninterrupted run
    assert run_cli([*base, "--batch", "many", "--outfile", tmp_path / "x.tsv"]) == 2
    assert "'auto'" in capsys.readouterr().err


def test_batch_auto_on_a_gpu_records_the_probes_batch_capped_at_N(digits_ckpt, tmp_path, monkeypatch):
    """load_run's GPU branch on the CPU: the device seen as cuda, cuda_batch a fake that fits 640 inputs."""
    import types
    auto, caps = common.auto_batch, []
    monkeypatch.setattr(common, "auto_batch", lambda model, shape, device, precision, cap, previous=None:
                        auto(model, shape, types.SimpleNamespace(type="cuda"), precision, cap, previous))
    monkeypatch.setattr(common, "cuda_batch", lambda model, shape, device, precision, cap:
                        caps.append(cap) or min(640, cap))
    for extra, cap, batch in (([], 3000, 640), (["--N", 300], 300, 300), (["--early-abstain"], 30, 30)):
        out = tmp_path / f"gpu{len(caps)}.tsv"
        assert run_cli(["--checkpoint", digits_ckpt, "--N0", 30, "--N", 3000, "--max", 2, *extra,
                        "--outfile", out]) == 0
        assert caps[-1] == cap and json.load(open(str(out) + ".json"))["batch"] == batch


def test_a_stopped_torchrun_run_lists_its_parts_and_resumes_them(tmp_path):
    """Every rank's part is made (header only) and listed in the sidecar before any rank writes, so a run stopped
    while the parts hold lines resumes them instead of refusing them as a user's files."""
    with open(os.path.join(ROOT, "results", "cifar10_cpu", "certify", "gaussian_noise_0.5.tsv.json")) as f:
        settings = {k: v for k, v in json.load(f).items() if k != "written"}
    out, cols = str(tmp_path / "dist.tsv"), certify.CERTIFY_COLUMNS
    assert machinery.prepare_outputs(out, settings, cols, False, world=2) == set()
    assert {"dist.tsv.rank0", "dist.tsv.rank1"} <= set(json.load(open(out + ".json"))["written"])
    with open(out + ".rank1", "a") as f:   # rank 1 certified example 3, then the run was stopped
        f.write("3\t1\t1\t0.5\t1\t0:00:01\t90\t100\t90\n")
    assert machinery.prepare_outputs(out, settings, cols, False, world=2) == {3}
    assert machinery.prepare_outputs(out, settings, cols, False, world=1) == {3}   # resumed by one process too

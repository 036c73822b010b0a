"""ddrs.py (DDRS, Alfarra et al. 2022; DDRS.md §7): OptimizeSigma's gradient, clamp and toys, certification at
sigma_x equal to certify.py when K = 0, and the memory's invariant, cases and order dependence."""
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from scipy.stats import norm

import certify
import common
import machinery
import readers
import ddrs
from helpers import digits_checkpoint, run_main


class SoftLinear(nn.Module):
    """Two classes with f^1(z) = Phi((w.z + b) / tau) as logits log f (softmax gives f back)."""

    def __init__(self, w, b, tau):
        super().__init__()
        self.w, self.b, self.tau = w, b, tau

    def forward(self, z):
        u = (z.flatten(1) @ self.w + self.b) / self.tau
        p1 = torch.special.ndtr(u).clamp(1e-12, 1 - 1e-12)
        return torch.stack([torch.log1p(-p1), torch.log(p1)], 1)


def toy(d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return SoftLinear(torch.randn(d, generator=g, dtype=torch.float64).float(), 0.2, 0.3)


# ----------------------------------------------------------------------------------------------------------
# Algorithm 1
# ----------------------------------------------------------------------------------------------------------

def test_autograd_gradient_matches_finite_differences_and_the_closed_form():
    model, x = toy(), torch.full((1, 1, 2, 2), 0.3)
    e = torch.randn(64, 1, 1, 2, 2, generator=torch.Generator().manual_seed(1))     # common random numbers
    s = torch.tensor([0.4], requires_grad=True)
    radius, E = ddrs.radius_proxy(model, x, s, e, torch.tensor([1]), clamp=(1e-6, 1 - 1e-6))
    grad, = torch.autograd.grad(radius.sum(), s)
    h = 1e-3
    up = ddrs.radius_proxy(model, x, torch.tensor([0.4 + h]), e, torch.tensor([1]), (1e-6, 1 - 1e-6))[0]
    down = ddrs.radius_proxy(model, x, torch.tensor([0.4 - h]), e, torch.tensor([1]), (1e-6, 1 - 1e-6))[0]
    assert float(grad) == pytest.approx(float((up - down) / (2 * h)), rel=1e-2)
    # closed form: dR/ds = R/s + s/2 [E_A' / phi(Phi^-1(E_A)) - E_B' / phi(Phi^-1(E_B))], E_c' = mean <grad f^c, e>
    z = (x.unsqueeze(0) + 0.4 * e).flatten(0, 1).requires_grad_(True)
    p = torch.softmax(model(z), 1)
    dA, = torch.autograd.grad(p[:, 1].sum(), z)
    dA = (dA * e.flatten(0, 1)).flatten(1).sum(1).mean()
    EA, EB = float(E[0, 1].detach()), float(E[0, 0].detach())
    closed = float(radius.detach()) / 0.4 + 0.2 * (float(dA) / norm.pdf(norm.ppf(EA)) + float(dA) / norm.pdf(norm.ppf(EB)))
    assert float(grad) == pytest.approx(closed, rel=1e-3)                         # E_B' = -E_A' (two classes)


def test_a_clamped_proxy_has_the_exact_gradient_of_its_constant_gap():
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    with torch.no_grad():
        model[1].weight.zero_()
        model[1].bias.copy_(torch.tensor([30.0, 0.0, -30.0]))                     # E_A ~ 1, E_B ~ 0: both clamped
    s = torch.tensor([0.5], requires_grad=True)
    radius, _ = ddrs.radius_proxy(model, torch.zeros(1, 1, 2, 2), s, torch.randn(3, 1, 1, 2, 2))
    grad, = torch.autograd.grad(radius.sum(), s)
    assert float(grad) == pytest.approx((norm.ppf(0.98) - norm.ppf(0.02)) / 2, abs=1e-6)   # 2.054
    assert float(grad) == pytest.approx(2.0537, abs=1e-4)


def test_linear_toy_sigma_grows_and_the_proxy_stays_below_the_distance():
    model = toy()
    x = torch.full((1, 1, 2, 2), 0.3)
    w, b, tau = model.w.double(), model.b, model.tau
    dist = abs(float(x.flatten().double() @ w) + b) / float(w.norm())
    exact = lambda s: norm.cdf((float(x.flatten().double() @ w) + b) / math.sqrt(tau ** 2 + s ** 2 * float(w @ w)))  # noqa
    proxy = lambda s: s / 2 * (norm.ppf(exact(s)) - norm.ppf(1 - exact(s)))                                            # noqa
    assert all(proxy(a) < proxy(b_) <= dist for a, b_ in [(0.1, 0.2), (0.2, 0.5), (0.5, 2.0)])
    gens = [ddrs.sigma_generator(0, 0, "cpu")]
    s = ddrs.optimize_sigma(model, x, 0.1, 50, 16, 0.05, gens, clamp=(1e-6, 1 - 1e-6))
    assert float(s) > 0.1                                                       # ascent moves sigma up


class SoftBall(nn.Module):
    """Class 0 inside the ball ||z|| < rho (soft edge tau), class 1 outside: an optimum sigma exists."""

    def __init__(self, rho=1.0, tau=0.05):
        super().__init__()
        self.rho, self.tau = rho, tau

    def forward(self, z):
        inside = torch.special.ndtr((self.rho - z.flatten(1).norm(dim=1)) / self.tau).clamp(1e-12, 1 - 1e-12)
        return torch.stack([torch.log(inside), torch.log1p(-inside)], 1)


def test_ball_toy_sigma_ascends_to_near_the_best_sigma_of_the_exact_objective():
    model, x = SoftBall(), torch.zeros(1, 1, 1, 2)                  # the centre of the class-0 ball, in 2-D
    e = torch.randn(40_000, 1, 1, 1, 2, generator=torch.Generator().manual_seed(0))

    def objective(s):   # the proxy with 40,000 common draws: close to the exact expectation
        return float(ddrs.radius_proxy(model, x, torch.tensor([s]), e, torch.tensor([0]))[0])
    grid = np.linspace(0.05, 1.5, 59)
    values = [objective(s) for s in grid]
    best = grid[int(np.argmax(values))]
    s = float(ddrs.optimize_sigma(model, x, 0.1, 300, 256, 0.01, [ddrs.sigma_generator(0, 0, "cpu")])[0])
    assert objective(s) >= objective(0.1)                           # never worse than sigma_0
    assert abs(s - best) < 0.1 and objective(s) > max(values) - 0.02   # near the grid argmax


def test_k_zero_is_sigma0_bounds_hold_and_the_result_is_reproducible():
    model, x = toy(), torch.rand(3, 1, 2, 2)
    gens = lambda: [ddrs.sigma_generator(0, i, "cpu") for i in range(3)]         # noqa: E731
    assert torch.equal(ddrs.optimize_sigma(model, x, 0.25, 0, 1, 0.1, gens()), torch.full((3,), 0.25))
    a = ddrs.optimize_sigma(model, x, 0.25, 20, 2, 5.0, gens(), bounds=(0.2, 0.3))
    b = ddrs.optimize_sigma(model, x, 0.25, 20, 2, 5.0, gens(), bounds=(0.2, 0.3))
    assert torch.equal(a, b) and bool(((a >= 0.2) & (a <= 0.3)).all())
    one = ddrs.optimize_sigma(model, x[1:2], 0.25, 20, 2, 5.0, gens()[1:2], bounds=(0.2, 0.3))
    assert float(one[0]) == pytest.approx(float(a[1]), abs=1e-6)                  # independent of the batch


# ----------------------------------------------------------------------------------------------------------
# Algorithm 3
# ----------------------------------------------------------------------------------------------------------

def test_memory_fuzz_keeps_balls_of_different_classes_disjoint():
    rng = np.random.default_rng(0)
    for _ in range(20):
        memory = []
        for _ in range(40):
            x = torch.tensor(rng.random(2))
            c, r = int(rng.integers(-1, 3)), float(rng.random() * 0.3)
            r = 0.0 if c == ddrs.ABSTAIN else r
            before = list(memory)
            c_out, r_out, case = ddrs.memory_step(memory, x, c, r, "paper")
            assert len(memory) == len(before) + 1 and memory[:-1] == before     # stored entries never change
            assert 0 <= r_out <= r or case == "inside"
            assert ddrs.check_memory_invariant(memory)


def test_memory_is_transparent_without_foreign_overlap_and_case_i_switches_class():
    memory = []
    assert ddrs.memory_step(memory, torch.tensor([0.0]), 0, 1.0) == (0, 1.0, "none")
    assert ddrs.memory_step(memory, torch.tensor([3.0]), 1, 1.0) == (1, 1.0, "none")   # far away: unchanged
    c, r, case = ddrs.memory_step(memory, torch.tensor([0.5]), 2, 0.4)                # inside class 0's ball
    assert (c, case) == (0, "inside") and r <= 1.0 - 0.5


def test_order_dependence_of_the_1d_example():
    # DDRS.md §7.6: stored (0, class 0, 1), query (1.5, class 1, 1) -> r = 0.5; reversed: the 0 query gets 0.5
    first = []
    ddrs.memory_step(first, torch.tensor([0.0]), 0, 1.0)
    assert ddrs.memory_step(first, torch.tensor([1.5]), 1, 1.0) == (1, 0.5, "touching")
    assert ddrs.memory_step(first, torch.tensor([0.8]), 1, 0.3)[:2] == (0, pytest.approx(0.2))
    second = []
    ddrs.memory_step(second, torch.tensor([1.5]), 1, 1.0)
    assert ddrs.memory_step(second, torch.tensor([0.0]), 0, 1.0) == (0, 0.5, "touching")
    assert ddrs.memory_step(second, torch.tensor([0.8]), 1, 0.3)[:2] == (1, pytest.approx(0.3))


def test_an_abstained_point_is_never_covered_by_a_later_ball():
    memory = []
    ddrs.memory_step(memory, torch.tensor([0.0, 0.0]), ddrs.ABSTAIN, 0.0)
    c, r, case = ddrs.memory_step(memory, torch.tensor([0.3, 0.4]), 1, 2.0)
    assert case == "touching" and r == pytest.approx(0.5)                         # stops at the abstained point


# ----------------------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return digits_checkpoint(tmp_path_factory.mktemp("ddrs") / "checkpoint.pth.tar")


run = run_main


def rows(path):
    return [ln.split("\t") for ln in open(path).read().splitlines()[1:]]


def test_k_zero_lines_equal_certify_py_and_memory_replays_the_log(ckpt, tmp_path, capsys):
    common_flags = ["--checkpoint", ckpt, "--N0", 20, "--N", 300, "--batch", 300, "--skip", 9, "--max", 8]
    assert run(ddrs.main, ["certify", *common_flags, "--K", 0, "--outfile", tmp_path / "d.tsv"]) == 0
    assert run(certify.main, [*common_flags, "--outfile", tmp_path / "c.tsv"]) == 0
    d, c = rows(tmp_path / "d.tsv"), rows(tmp_path / "c.tsv")
    assert [r[:5] + r[6:-1] for r in d] == [r[:5] + r[6:] for r in c]               # time column aside
    assert all(float(r[-1]) == 0.25 for r in d)
    assert run(ddrs.main, ["certify", *common_flags, "--K", 5, "--lr", 0.05, "--outfile", tmp_path / "k.tsv"]) == 0
    assert any(float(r[-1]) != 0.25 for r in rows(tmp_path / "k.tsv"))
    assert run(ddrs.main, ["certify", *common_flags, "--K", 6, "--lr", 0.05, "--outfile", tmp_path / "k.tsv"]) == 2
    capsys.readouterr()
    import analyze
    assert run(analyze.main, ["table", tmp_path / "k.tsv", "--radii", 0]) == 0
    assert "(DDRS)" in capsys.readouterr().out                                   # the table says what it is
    assert run(ddrs.main, ["memory", tmp_path / "k.tsv"]) == 0
    out = capsys.readouterr().out
    assert "case (i)" in out and len(rows(tmp_path / "k_memory.tsv")) == 8


@pytest.mark.parametrize("argv", [["certify", "--K", -1], ["certify", "--M", 0], ["certify", "--clamp", 0.9, 0.1],
                                  ["memory", "missing.tsv"], ["train"]])
def test_bad_input_is_one_line_and_exit_code_2(argv, ckpt, tmp_path, capsys):
    if argv[0] == "certify":
        argv = [*argv, "--checkpoint", ckpt, "--outfile", tmp_path / "x.tsv"]
    assert run(ddrs.main, argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "x.tsv").exists()


@pytest.mark.parametrize("method, extra", [("gaussian", []), ("smoothadv", []), ("macer", ["--m", 4])])
def test_ds_training_learns_stores_sigmas_resumes_exactly_and_certifies(method, extra, tmp_path, capsys):
    argv = ["train", "--method", method, "--dataset", "digits", "--sigma", 0.25, "--workers", 0, "--warmup", 1,
            "--lr_sigma", 0.01, "--max-batches", 3, *extra]
    assert run(ddrs.main, [*argv, "--epochs", 4, "--outdir", tmp_path / "whole"]) == 0
    assert run(ddrs.main, [*argv, "--epochs", 2, "--outdir", tmp_path / "parts"]) == 0
    assert run(ddrs.main, [*argv, "--epochs", 4, "--outdir", tmp_path / "parts", "--resume"]) == 0
    a = readers.load_checkpoint(str(tmp_path / "whole" / "checkpoint.pth.tar"))
    b = readers.load_checkpoint(str(tmp_path / "parts" / "checkpoint.pth.tar"))
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    assert torch.equal(a["extra"]["sigmas"], b["extra"]["sigmas"])               # the sigmas resume too
    sigmas = a["extra"]["sigmas"]
    assert len(sigmas) == 1437 and (sigmas != 0.25).any()                          # optimised after the warm-up
    log = [ln.split("\t") for ln in open(tmp_path / "whole" / "log.tsv").read().splitlines()[1:]]
    if method != "macer":   # it learns (MACER at lambda 12 needs far more than these 12 steps: docs/training.md)
        assert float(log[-1][3]) < float(log[0][3]) and float(log[-1][6]) > 0.3
    ckpt = tmp_path / "whole" / "checkpoint.pth.tar"
    for main, flags in ((ddrs.main, ["certify", "--K", 2]), (certify.main, [])):
        assert run(main, [*flags, "--checkpoint", ckpt, "--N0", 10, "--N", 100, "--max", 3,
                          "--outfile", tmp_path / f"{len(flags)}.tsv"]) == 0


# ----------------------------------------------------------------------------------------------------------
# The class sigma_x is optimised for (DDRS as published)
# ----------------------------------------------------------------------------------------------------------

def test_smoothed_class_is_the_prediction_of_the_model_smoothed_at_sigma0(ckpt):
    model, _ = readers.load_model(ckpt)
    test = common.get_dataset("digits", "test", None, train_transform=False)
    checked = 0
    for idx in range(0, 360, 9):
        x = test[idx][0]
        big = common.sample_counts(model, x.unsqueeze(0), 0.25, 12_000, 4000, 10,
                                   torch.Generator().manual_seed(10_000 + idx))[0]
        top2 = torch.topk(big, 2).values.tolist()
        from scipy.stats import binomtest
        if binomtest(top2[0], sum(top2), 0.5).pvalue > 1e-6:
            continue   # too close to a tie to know the smoothed prediction
        c, drawn = ddrs.smoothed_class(model, x, 0.25, 10, ddrs.sigma_generator(0, idx, "cpu", ddrs.CLASS_STREAM))
        assert c == int(big.argmax()) and 100 <= drawn <= ddrs.CLASS_MAX_DRAWS
        checked += 1
    assert checked >= 30


def test_fixed_cA_keeps_the_class_it_is_given_at_every_step(monkeypatch):
    seen = []
    proxy = ddrs.radius_proxy

    def spy(model, x, s, e, cA=None, clamp=(0.02, 0.98)):
        seen.append(None if cA is None else cA.tolist())
        return proxy(model, x, s, e, cA, clamp)
    monkeypatch.setattr(ddrs, "radius_proxy", spy)
    model, x = toy(), torch.full((2, 1, 2, 2), 0.3)
    gens = [ddrs.sigma_generator(0, i, "cpu") for i in range(2)]
    ddrs.optimize_sigma(model, x, 0.25, 5, 1, 0.01, gens, cA=[0, 1])
    assert seen == [[0, 1]] * 5
    seen.clear()
    ddrs.optimize_sigma(model, x, 0.25, 5, 1, 0.01, gens, fixed_cA=False, cA=[0, 1])   # the official code's
    assert seen == [None] * 5


# ----------------------------------------------------------------------------------------------------------
# DS training as published (part 3)
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", sorted(ddrs.DS_METHODS))
def test_every_method_trains_on_a_batch_of_one_and_a_partial_batch(method):
    model = common.get_architecture("lenet", "digits")
    train = common.get_dataset("digits", "train", None, train_transform=False)
    hp = dict(ddrs.DS_METHODS[method], m=min(4, ddrs.DS_METHODS[method]["m"]))
    for b in (1, 3):
        x = torch.stack([train[i][0] for i in range(b)])
        y, idx = torch.tensor([int(train[i][1]) for i in range(b)]), torch.arange(b)
        sigmas = torch.full((len(train),), 0.25)
        out = ddrs.ds_loss_fn(method, hp, sigmas, (1, 1, 0.01), 0, 0)(model, x, y, idx)
        assert out["loss"].dim() == 0 and torch.isfinite(out["loss"])
        out["loss"].backward()


def test_init_checkpoint_starts_from_its_weights_and_is_recorded(ckpt, tmp_path, capsys):
    import json
    argv = ["train", "--method", "gaussian", "--dataset", "digits", "--arch", "lenet", "--sigma", 0.25,
            "--workers", 0, "--epochs", 1, "--max-batches", 1, "--lr", 1e-12, "--momentum", 0, "--weight_decay", 0]
    assert run(ddrs.main, [*argv, "--init-checkpoint", ckpt, "--outdir", tmp_path / "a"]) == 0
    start, end = readers.load_checkpoint(ckpt), readers.load_checkpoint(str(tmp_path / "a" / "checkpoint.pth.tar"))
    assert all(torch.allclose(start["state_dict"][k], end["state_dict"][k], atol=1e-8) for k in start["state_dict"])
    recorded = json.load(open(tmp_path / "a" / "args.json"))
    assert recorded["init_checkpoint"]["sha256"] == machinery.file_sha256(ckpt) and recorded["K_train"] == 1
    assert run(ddrs.main, [*argv, "--outdir", tmp_path / "b"]) == 0                 # without: fresh weights
    fresh = readers.load_checkpoint(str(tmp_path / "b" / "checkpoint.pth.tar"))
    assert not all(torch.allclose(start["state_dict"][k], fresh["state_dict"][k], atol=1e-3)
                   for k in start["state_dict"])
    capsys.readouterr()
    bad = [a if a != "lenet" else "digits_cnn" for a in argv]                          # another architecture
    assert run(ddrs.main, [*bad, "--init-checkpoint", ckpt, "--outdir", tmp_path / "c"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--init-checkpoint" in err
    assert run(ddrs.main, [*argv, "--init-checkpoint", tmp_path / "none", "--outdir", tmp_path / "d"]) == 2


def test_k_train_defaults_to_the_official_code_per_method():
    assert ddrs.DS_K_TRAIN.get(("cifar10", "macer"), 1) == 10
    assert all(ddrs.DS_K_TRAIN.get((d, m), 1) == 1 for d in ("cifar10", "digits") for m in ("gaussian", "smoothadv"))


# ----------------------------------------------------------------------------------------------------------
# A sound radius for input-dependent sigma (part 4; DDRS.md §4, §7.13)
# ----------------------------------------------------------------------------------------------------------

def test_semi_elastic_radius_matches_ddrs_md_and_tends_to_cohen():
    cohen = 0.25 * norm.ppf(0.999)
    assert cohen == pytest.approx(0.773, abs=1e-3)
    assert ddrs.semi_elastic_radius(0.999, 0.25, 0.0, 3072) == cohen
    for r, expected in ((0.01, 0.758), (0.05, 0.549), (0.1, 0.346)):
        assert ddrs.semi_elastic_radius(0.999, 0.25, r, 3072) == pytest.approx(expected, abs=1e-2)
    assert ddrs.semi_elastic_radius(0.999, 0.25, 0.001, 3072) == pytest.approx(cohen, abs=2e-3)
    for pA in (0.55, 0.9, 0.99999):
        radii = [ddrs.semi_elastic_radius(pA, 0.5, r, 3072) for r in (0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3)]
        assert all(a >= b for a, b in zip(radii, radii[1:]))                       # non-increasing in r
        assert radii[0] == pytest.approx(0.5 * norm.ppf(pA))
    assert ddrs.semi_elastic_radius(0.5, 0.25, 0.01, 3072) == 0.0


def test_semi_elastic_radius_holds_for_every_sigma_and_distance_up_to_it_and_is_tight():
    sigma, r, dim, pA = 0.25, 0.05, 3072, 0.999
    R = ddrs.semi_elastic_radius(pA, sigma, r, dim)
    d = R * np.linspace(0.05, 1, 20)[:, None]
    f = np.linspace(0.1, 1, 10)                  # interior sigmas (very near sigma_0, scipy's series is slow)
    s1 = sigma * np.exp(np.concatenate([-f, f])[None, :] * r * d)
    assert np.all(ddrs.worst_class_b(d, sigma, s1, pA, dim) < 0.5)
    d = 1.01 * R
    assert max(ddrs.worst_class_b(d, sigma, sigma * np.exp(k * r * d), pA, dim) for k in (-1, 1)) >= 0.5


def test_worst_class_b_is_the_probability_of_the_neyman_pearson_ball_by_simulation():
    # dim 3, sigma 1 -> 0.8 at distance 0.5: the ball B with P_x0(B) = 1 - pA has P_x1(B) = worst_class_b
    from scipy.stats import ncx2
    dim, s0, s1, d, pA = 3, 1.0, 0.8, 0.5, 0.9
    x0, x1 = np.zeros(dim), np.r_[d, np.zeros(dim - 1)]
    c = (s0 ** 2 * x1 - s1 ** 2 * x0) / (s0 ** 2 - s1 ** 2)
    L0 = s0 ** 2 * d ** 2 / (s0 ** 2 - s1 ** 2) ** 2
    t = s0 ** 2 * ncx2.ppf(1 - pA, dim, L0)
    rng = np.random.default_rng(0)
    z0 = x0 + s0 * rng.standard_normal((400_000, dim))
    z1 = x1 + s1 * rng.standard_normal((400_000, dim))
    assert np.mean(((z0 - c) ** 2).sum(1) <= t) == pytest.approx(1 - pA, abs=3e-3)
    assert np.mean(((z1 - c) ** 2).sum(1) <= t) == pytest.approx(float(ddrs.worst_class_b(d, s0, s1, pA, dim)),
                                                                 abs=3e-3)
    # near sigma1 = sigma0 it is Cohen's: DDRS.md's check, sigma 0.5, pA 0.9, dim 2 crosses 1/2 at 0.641
    cross = 0.5 * norm.ppf(0.9)
    assert float(ddrs.worst_class_b(0.99 * cross, 0.5, 0.5 * (1 + 1e-4), 0.9, 2)) < 0.5
    assert float(ddrs.worst_class_b(1.01 * cross, 0.5, 0.5 * (1 + 1e-4), 0.9, 2)) > 0.5


def test_knn_distance_is_the_mean_of_the_k_nearest_and_1_lipschitz():
    g = torch.Generator().manual_seed(0)
    train = torch.rand(300, 12, generator=g)
    for _ in range(20):
        a, b = torch.rand(12, generator=g), torch.rand(12, generator=g)
        brute = torch.sort((train.double() - a.double()).norm(dim=1)).values[:5].mean()
        assert ddrs.knn_distance(train, a, 5, chunk=64) == pytest.approx(float(brute), rel=1e-12)
        assert abs(ddrs.knn_distance(train, a, 5) - ddrs.knn_distance(train, b, 5)) <= float((a - b).norm()) + 1e-9


def test_semi_elastic_certify_at_r_zero_is_certify_py_and_is_sound_below_cohen(ckpt, tmp_path, capsys):
    import json
    flags = ["--checkpoint", ckpt, "--N0", 20, "--N", 300, "--batch", 300, "--skip", 9, "--max", 8]
    assert run(ddrs.main, ["certify", *flags, "--semi-elastic", "--elastic-r", 0, "--outfile", tmp_path / "0.tsv"]) == 0
    assert run(certify.main, [*flags, "--outfile", tmp_path / "c.tsv"]) == 0
    zero, c = rows(tmp_path / "0.tsv"), rows(tmp_path / "c.tsv")
    assert [r[:5] + r[6:-1] for r in zero] == [r[:5] + r[6:] for r in c]            # sigma(x) = sigma_0 exactly
    assert run(ddrs.main, ["certify", *flags, "--semi-elastic", "--elastic-r", 0.05, "--outfile",
                           tmp_path / "e.tsv"]) == 0
    side = json.load(open(tmp_path / "e.tsv.json"))["ddrs"]["semi_elastic"]
    assert side["r"] == 0.05 and side["k"] == 20 and side["m"] > 0 and side["train_data"]
    for row in rows(tmp_path / "e.tsv"):
        nA, N, s = int(row[6]), int(row[7]), float(row[-1])
        pA = common.clopper_pearson_lower(nA, N, 0.001)
        if int(row[2]) >= 0:
            assert float(row[3]) == pytest.approx(ddrs.semi_elastic_radius(pA, s, 0.05, 64), rel=1e-5)
            assert float(row[3]) <= s * norm.ppf(pA) + 1e-9
    capsys.readouterr()
    import analyze
    assert run(analyze.main, ["table", tmp_path / "e.tsv", "--radii", 0]) == 0
    assert "semi-elastic" in capsys.readouterr().out
    assert run(ddrs.main, ["certify", *flags, "--semi-elastic", "--elastic-r", 1e-5, "--outfile",
                           tmp_path / "x.tsv"]) == 2
    assert not (tmp_path / "x.tsv").exists()


def test_the_committed_ddrs_report_is_the_output_of_ddrs_py_report(tmp_path):
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = os.path.join(root, "results", "ddrs_cpu")
    logs = [os.path.join(results, f"{n}_noise_0.25.tsv") for n in
            ("ds_lr0.0001", "ds_lr0.001", "ds_lr0.003", "ds_lr0.01", "ds_lr0.03", "semi_elastic")]
    assert run(ddrs.main, ["report", *logs, "--fixed", os.path.join(results, "fixed_noise_0.25.tsv"),
                           "--out", tmp_path]) == 0
    for name in ("report.md", "report.tsv"):
        assert (tmp_path / name).read_text() == open(os.path.join(results, name)).read(), name


def test_the_report_refuses_a_ddrs_log_of_another_budget_than_the_fixed_one(tmp_path, capsys):
    """DDRS against the fixed sigma_0 differs in mode by design; a budget that differs too is refused in one line."""
    import json
    import os
    import shutil
    results = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "ddrs_cpu")
    for name in ("fixed_noise_0.25.tsv", "ds_lr0.01_noise_0.25.tsv"):
        shutil.copy(os.path.join(results, name), tmp_path / name)
        shutil.copy(os.path.join(results, name + ".json"), tmp_path / (name + ".json"))
    argv = ["report", tmp_path / "ds_lr0.01_noise_0.25.tsv", "--fixed", tmp_path / "fixed_noise_0.25.tsv", "--out",
            tmp_path / "out"]
    assert run_main(ddrs.main, argv) == 0
    side = json.loads((tmp_path / "ds_lr0.01_noise_0.25.tsv.json").read_text())
    (tmp_path / "ds_lr0.01_noise_0.25.tsv.json").write_text(json.dumps(dict(side, alpha=0.01)))
    capsys.readouterr()
    shutil.rmtree(tmp_path / "out")
    assert run_main(ddrs.main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "alpha 0.01, but" in err[0] and "ddrs.py report" in err[0]
    assert not (tmp_path / "out").exists()

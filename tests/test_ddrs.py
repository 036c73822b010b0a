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
    a = common.load_checkpoint(str(tmp_path / "whole" / "checkpoint.pth.tar"))
    b = common.load_checkpoint(str(tmp_path / "parts" / "checkpoint.pth.tar"))
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    assert torch.equal(a["extra"]["sigmas"], b["extra"]["sigmas"])               # the sigmas resume too
    sigmas = a["extra"]["sigmas"]
    assert len(sigmas) == 1437 and (sigmas != 0.25).any()                          # optimised after the warm-up
    log = [ln.split("\t") for ln in open(tmp_path / "whole" / "log.tsv").read().splitlines()[1:]]
    if method != "macer":   # it learns (MACER at lambda 12 needs far more than these 12 steps: README, Baselines)
        assert float(log[-1][3]) < float(log[0][3]) and float(log[-1][6]) > 0.3
    ckpt = tmp_path / "whole" / "checkpoint.pth.tar"
    for main, flags in ((ddrs.main, ["certify", "--K", 2]), (certify.main, [])):
        assert run(main, [*flags, "--checkpoint", ckpt, "--N0", 10, "--N", 100, "--max", 3,
                          "--outfile", tmp_path / f"{len(flags)}.tsv"]) == 0

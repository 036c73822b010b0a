"""Anytime-valid certification at a grid of radii (certify.py --radii; ADAPTIVE.md §4): the betting sequence's
coverage against an invalid repeated test, the false-certificate rate on a classifier with known pA, the
integer tables against brute force, threshold logic, the limiting case equal to CERTIFY, monotonicity,
curtailment, accounting and resume. Seeded; rates are checked against alpha + 3 standard errors."""
import json
import importlib.util
import math
import os
import re
import shutil
import sys
import types
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st
from scipy.stats import beta as beta_dist
from scipy.stats import norm

import certify
import common
import readers
import grid
import machinery
from helpers import digits_checkpoint, run_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------------------
# The statistics
# ----------------------------------------------------------------------------------------------------------

def test_kt_closed_form_equals_the_step_by_step_product():
    rng = np.random.default_rng(0)
    draws = rng.random(500) < 0.8
    log_q, A = 0.0, 0
    for t, hit in enumerate(draws):
        q = (A + 0.5) / (t + 1)                     # the KT estimate before draw t + 1
        log_q += math.log(q if hit else 1 - q)
        A += int(hit)
    for p in (0.3, 0.8, 0.95):
        by_steps = log_q - A * math.log(p) - (500 - A) * math.log(1 - p)
        assert grid.kt_log_wealth(A, 500, p) == pytest.approx(by_steps, abs=1e-9)


def test_tables_match_brute_force_for_small_t():
    taus, checks = [0.5, 0.7, 0.9], list(range(10, 501, 49))
    tables = grid.grid_tables(taus, checks, 0.01, 0.02, 0.05, 500)
    for j, tau in enumerate(taus):
        for i, t in enumerate(checks):
            A = np.arange(t + 1)
            up, down = grid.one_sided_log_wealth(A, t, tau, +1), grid.one_sided_log_wealth(A, t, tau, -1)
            lower = A[(A / t > tau) & (up >= math.log(100))]
            upper = A[(A / t < tau) & (down >= math.log(50))]
            assert tables["lower"][j, i] == (lower.min() if len(lower) else t + 1)
            assert tables["upper"][j, i] == (upper.max() if len(upper) else -1)
        A = np.arange(501)
        cp = beta_dist.ppf(0.05, np.maximum(A, 1), 500 - A + 1) * (A > 0)
        ok = A[(cp > tau) if j == 0 else (cp >= tau)]
        assert tables["final"][j] == (ok.min() if len(ok) else 501)
    assert np.all(np.diff(tables["lower"], axis=0) >= 0)              # higher radius, more votes needed


@pytest.mark.parametrize("prior", [grid.KT_PRIOR, (80.5, 20.5), (3.5, 97.5)])
def test_one_sided_wealth_is_the_restricted_mixture_and_never_below_the_two_sided(prior):
    """grid.one_sided_log_wealth against numerical integration of the prior (KT, and selection posteriors
    Beta(k0 + 1/2, N0 - k0 + 1/2) as certify.py uses them) restricted to one side of tau, and the reason for
    it: where A / t lies beyond tau it exceeds the two-sided wealth by at most log(1 / prior mass of that side),
    which it approaches as the posterior leaves tau behind."""
    from scipy.special import betainc, betaincc
    mpmath = pytest.importorskip("mpmath")   # scipy's quad loses 1e-7 on these peaked integrands; 40 digits
    mpmath.mp.dps = 40
    for A, t, tau, side in [(90, 100, 0.8, 1), (60, 100, 0.8, -1), (995, 1000, 0.977, 1), (3, 10, 0.5, -1),
                            (30, 100, 0.2, 1)]:
        a0, b0 = map(mpmath.mpf, prior)
        density = lambda q: (q ** (a0 - 1) * (1 - q) ** (b0 - 1) / mpmath.beta(a0, b0)           # noqa: E731
                             if 0 < q < 1 else 0)   # tanh-sinh nodes can round onto the ends, where KT's is infinite
        lr = lambda q: (q / tau) ** A * ((1 - q) / (1 - tau)) ** (t - A)                          # noqa: E731
        lo, hi = (tau, 1) if side > 0 else (0, tau)
        cuts = sorted({*mpmath.linspace(lo, hi, 41), *(q for q in (A / t, prior[0] / sum(prior)) if lo < q < hi)})
        num, mass = mpmath.quad(lambda q: lr(q) * density(q), cuts), mpmath.quad(density, cuts)
        assert grid.one_sided_log_wealth(A, t, tau, side, prior) == pytest.approx(
            float(mpmath.log(num / mass)), abs=1e-9), (A, t, tau, side)
    tau = norm.cdf(2.0)
    gain = grid.one_sided_log_wealth(1000, 1000, tau, +1, prior) - grid.kt_log_wealth(1000, 1000, tau, prior)
    assert 0 < gain <= -math.log(max(betaincc(*prior, tau), 1e-300)) + 1e-12
    if prior == grid.KT_PRIOR:
        assert gain == pytest.approx(-math.log(1 - betainc(0.5, 0.5, tau)), abs=1e-3)   # 2.3 nats


def test_one_sided_wealth_never_overstates_when_the_prior_mass_underflows():
    """A selection posterior far from tau (k0 = 1 of 300 against tau = 0.99) has a prior mass above tau of
    about 1e-600, which underflows: the wealth must never exceed the true value (mpmath, 60 digits), so that
    underflow can only withhold a certificate; where the posterior's own mass above tau is representable
    (50,000 votes of 50,000) it stays finite."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 60
    prior, tau = (1.5, 299.5), 0.99
    for A, t in [(10, 10), (990, 1000), (50_000, 50_000)]:
        got = grid.one_sided_log_wealth(A, t, tau, +1, prior)
        f = lambda q: q ** (prior[0] - 1) * (1 - q) ** (prior[1] - 1) / mpmath.beta(*prior)         # noqa: E731
        cuts = mpmath.linspace(tau, 1, 41)
        num = mpmath.quad(lambda q: (q / tau) ** A * ((1 - q) / (1 - tau)) ** (t - A) * f(q), cuts)
        true = float(mpmath.log(num) - mpmath.log(mpmath.quad(f, cuts)))
        assert got <= true + 1e-9, (A, t, got, true)
    assert np.isfinite(got)


def test_the_selection_votes_set_the_prior_and_label_mode_keeps_kt():
    """grid_certify_many tests each example with the posterior of its candidate's selection votes: a model that
    always says class 1 gives k0 = N0, so the tables of Beta(N0 + 1/2, 1/2) decide and report; with the label
    as candidate (no selection draws) the KT prior does."""
    class One(nn.Module):
        def forward(self, x):
            return torch.stack([torch.zeros(len(x)), torch.ones(len(x))], dim=1)
    x = torch.zeros(1, 1, 4)
    plan = grid.grid_plan([0.5, 1.0], 0.5, 5000, 0.001, 0.2, True)
    out = grid.grid_certify(One(), x, 0.5, 60, 500, 2, common.example_generator(0, 0), plan)
    assert set(plan["cache"]) == {grid.KT_PRIOR, (60.5, 0.5)}
    informed = grid.prior_tables(plan, (60.5, 0.5))
    assert out["prior"] == (60.5, 0.5) and grid.grid_interval(out, plan)[0] == pytest.approx(
        grid.kt_interval(out["nA"], out["N"], 0.001, 0.2, (60.5, 0.5))[0])
    first = lambda tables: (tables["lower"] <= np.array(plan["checks"])).argmax(axis=1)   # noqa: E731
    assert np.all(first(informed) <= first(plan))      # with every vote for cA, no level comes later than KT's
    label = grid.grid_certify(One(), x, 0.5, 60, 500, 2, common.example_generator(0, 0), plan, candidate=1)
    assert label["prior"] == grid.KT_PRIOR                                  # label mode: KT's prior
    assert out["radius"] == label["radius"] == 1.0 and out["N"] <= label["N"]    # the same answer, no later
    for k0 in (0, 37, 60):   # curtailing's final thresholds never exceed the exact accounting's
        tables = grid.final_look_tables(plan, grid.prior_tables(plan, (k0 + 0.5, 60 - k0 + 0.5)))
        assert np.all(tables["final_bound"] <= tables["final"]) and tables["spent"] + tables["alpha_fin"] <= 0.001
    label = grid.grid_plan([0.5, 1.0], 0.5, 5000, 0.001, 0.2, True)
    grid.grid_certify(One(), x, 0.5, 60, 500, 2, common.example_generator(0, 0), label, candidate=1)
    assert set(label["cache"]) == {grid.KT_PRIOR}


def cs_violations(p, n, alpha, beta, rng, checks):
    """Share of seeded Bernoulli(p) streams where the KT interval excluded p at some check: p lies outside
    kt_interval(A, t) exactly where the wealth at p reaches the level of its side (checked against the
    interval itself on the first streams), so all streams and checks are decided at once."""
    t = np.array(checks)
    A = np.cumsum(rng.random((n, checks[-1])) < p, axis=1)[:, t - 1]
    wealth = grid.kt_log_wealth(A, t, p)
    out = np.where(p < A / t, wealth >= math.log(1 / alpha), wealth >= math.log(1 / beta))
    for k in range(5):   # the same verdict as the interval's ends
        for i in range(0, len(checks), 7):
            L, U = grid.kt_interval(int(A[k, i]), int(t[i]), alpha, beta)
            assert (not L <= p <= U) == bool(out[k, i]), (p, A[k, i], t[i], L, U)
    return float(np.mean(out.any(axis=1)))


def test_confidence_sequence_covers_at_every_look_and_a_repeated_cp_test_does_not():
    rng = np.random.default_rng(1)
    alpha, n = 0.05, 2000
    checks = [int(c) for c in np.unique(np.geomspace(10, 4000, 40).astype(int))]
    se = math.sqrt(2 * alpha * (1 - 2 * alpha) / n)
    for p in (0.05, 0.5, 0.9, 0.99):
        assert cs_violations(p, n, alpha, alpha, rng, checks) <= 2 * alpha + 3 * se, p
    # negative control: a fixed-n Clopper-Pearson bound recomputed at every look is not anytime-valid
    t = np.array(checks)
    A = np.cumsum(rng.random((n, checks[-1])) < 0.5, axis=1)[:, t - 1]
    fails = np.mean((common.clopper_pearson_lower(A, t, alpha) > 0.5).any(axis=1))
    assert fails > alpha + 3 * math.sqrt(alpha * (1 - alpha) / n)          # clearly invalid: about 0.2


def test_table_boundaries_agree_with_the_radius_formula():
    # at the threshold count the bound certifies r (sigma Phi^-1(L) >= r), one vote fewer it does not
    sigma, N = 0.5, 5000
    plan = grid.grid_plan([0.25, 0.5, 1.0], sigma, N, 0.001, 0.001, True)
    for j, r in enumerate(plan["radii"]):   # the final look: each level at its own alpha_fin_j, monotone in j
        A, level = int(plan["final"][j]), plan["alpha_fin_levels"][j]
        assert level == pytest.approx(0.001 - plan["spent_levels"][j]) and plan["alpha_fin"] <= level
        L = common.clopper_pearson_lower(A, N, level)
        assert sigma * norm.ppf(L) >= r - 1e-9 and (L > 0.5 if r == 0 else True)
        below = [common.clopper_pearson_lower(A - 1, N, plan["alpha_fin_levels"][k]) for k in range(j + 1)]
        assert any(sigma * norm.ppf(b) < rk + 1e-9 or (rk == 0 and b <= 0.5)   # one vote fewer: some level <= j fails
                   for b, rk in zip(below, plan["radii"]))
        tau, level = norm.cdf(r / sigma), math.log(1 / plan["alpha_seq"])
        for i, t in enumerate(plan["checks"]):
            A = int(plan["lower"][j, i])
            if A <= t:   # reachable: the one-sided wealth at tau_j crosses 1 / alpha exactly there
                assert grid.one_sided_log_wealth(A, t, tau, +1) >= level
                assert (grid.one_sided_log_wealth(A - 1, t, tau, +1) < level or A - 1 <= t * tau or
                        (j > 0 and plan["lower"][j - 1, i] == A))     # or raised to the level below's
    assert plan["radii"] == [0.0, 0.25, 0.5, 1.0]                         # 0 is always a level


# ----------------------------------------------------------------------------------------------------------
# The pipeline, N0 included, on classifiers whose pA is known
# ----------------------------------------------------------------------------------------------------------

class Halfspace(nn.Module):
    """Class 1 iff w.x + b > 0: at signed distance d, pA = Phi(d / sigma) and the exact radius is d."""

    def __init__(self, w, b):
        super().__init__()
        self.w, self.b = w, b

    def forward(self, x):
        s = x.flatten(1) @ self.w + self.b
        return torch.stack([torch.zeros_like(s), s], 1)


def point_at(w, b, d):
    return ((d * w.norm() - b) * w / w.norm() ** 2).view(1, 1, -1)


def test_false_certificate_rate_at_the_worst_case_stays_within_alpha():
    torch.manual_seed(0)
    w, b, sigma, alpha = torch.randn(4), torch.tensor(0.3), 0.5, 0.05
    model = Halfspace(w, b)
    plan = grid.grid_plan([0.25, 0.5], sigma, 20_000, alpha, alpha, True)   # no rule-out errs
    for r in (0.25, 0.5):
        for d, runs in ((r, 300), (r - 0.02 * sigma, 128)):               # exactly at, and just below, r
            x = point_at(w, b, d)   # packed 64 a group: each run gets the result it gets alone (the packing test)
            outs = [o for g in range(0, runs, 64) for o in grid.grid_certify_many(
                model, [(x, common.example_generator(7, k), None) for k in range(g, min(g + 64, runs))], sigma,
                100, 1000, 2, plan)]
            wrong = sum(o["radius"] >= r for o in outs)
            assert wrong / runs <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs), (r, d)
    x = point_at(w, b, 0.5 + 0.4 * sigma)                                 # comfortably beyond 0.5: certified
    got = [grid.grid_certify(model, x, sigma, 100, 1000, 2, common.example_generator(8, k), plan)
           for k in range(20)]
    assert all(o["radius"] == 0.5 and o["N"] < 20_000 for o in got)      # and early


def test_limiting_configuration_equals_fixed_n_certify(monkeypatch):
    # no sequential looks (alpha_seq = 0, beta = 0) and the whole alpha on the final look: CERTIFY at N
    torch.manual_seed(1)
    w, b, sigma, N = torch.randn(4), torch.tensor(0.1), 0.5, 5000
    model = Halfspace(w, b)
    radii = [0.1 * k for k in range(1, 12)]
    plan = grid.grid_plan(radii, sigma, N, 0.001, 0.0, True)
    monkeypatch.setattr(grid, "job_tables", lambda plan, k0, N0: plan)   # every example: the tables below
    checks = [int(t) for t in np.cumsum(common.pass_sizes(N, 500))]   # CERTIFY's passes: the same noise chunks
    plan = dict(plan, checks=checks, **grid.grid_tables(norm.cdf(np.array(plan["radii"]) / sigma), checks, 0.0,
                                                          0.0, 0.001, N))
    plan["reach"] = np.full_like(plan["lower"], 10 ** 9)                  # no sequential certificate reachable
    plan["final_bound"] = plan["final"]
    plan["alpha_seq"], plan["alpha_fin"] = 0.0, 0.001
    for d in (-0.2, 0.05, 0.2, 0.5, 0.9, 1.5):
        x = point_at(w, b, d)
        full = certify.certify(model, x, sigma, 100, N, 0.001, 500, 2, common.example_generator(3, 0))
        out = grid.grid_certify(model, x, sigma, 100, 500, 2, common.example_generator(3, 0), plan)
        expected = max([r for r in plan["radii"] if r <= full["radius"]], default=0.0)
        assert out["predict"] == full["predict"], d
        if full["predict"] >= 0:
            assert out["radius"] == pytest.approx(expected) and out["nA"] <= full["nA"]


def test_curtailment_never_changes_the_answer_and_draws_never_exceed_the_budget(monkeypatch):
    torch.manual_seed(2)
    w, b, sigma = torch.randn(4), torch.tensor(0.0), 0.5
    model = Halfspace(w, b)
    plan = grid.grid_plan([0.25, 0.5, 1.0, 2.5], sigma, 20_000, 0.001, 0.001, True)
    monkeypatch.setattr(grid, "job_tables", lambda plan, k0, N0: plan)   # KT's tables, curtailed or not
    full = dict(plan, reach=np.full_like(plan["reach"], -10 ** 9))       # never curtailed
    for d in (0.3, 0.6, 1.2, 3.0):                                        # 3.0: the top level is out of reach
        x = point_at(w, b, d)
        a = grid.grid_certify(model, x, sigma, 100, 1000, 2, common.example_generator(5, 0), plan)
        c = grid.grid_certify(model, x, sigma, 100, 1000, 2, common.example_generator(5, 0), full)
        assert a["radius"] == c["radius"] and a["N"] <= c["N"] <= 20_000
        low, high = grid.grid_interval(a, plan)
        assert a["N"] in plan["checks"] and low <= high


def test_levels_never_fall_and_more_votes_never_certify_less():
    plan = grid.grid_plan([0.25, 0.5, 1.0], 0.5, 10_000, 0.001, 0.001, True)
    for i in range(len(plan["checks"])):
        levels = [grid.decided_levels(plan, A, i)[0] for A in range(0, plan["checks"][i] + 1, 7)]
        assert levels == sorted(levels)


def test_draw_accounting_counts_every_forward_call():
    calls = []

    class Counting(Halfspace):
        def forward(self, x):
            calls.append(x.shape[0])
            return super().forward(x)
    torch.manual_seed(3)
    w = torch.randn(4)
    model = Counting(w, torch.tensor(0.0))
    plan = grid.grid_plan([0.25, 0.5], 0.5, 20_000, 0.001, 0.001, True)
    out = grid.grid_certify(model, point_at(w, torch.tensor(0.0), 0.4), 0.5, 100, 1000, 2,
                               common.example_generator(0, 0), plan)
    assert sum(calls) == 100 + out["N"] and out["N"] in plan["checks"]


# ----------------------------------------------------------------------------------------------------------
# The command line: columns, resume, analysis
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def digits_model(tmp_path_factory):
    return digits_checkpoint(tmp_path_factory.mktemp("grid") / "checkpoint.pth.tar", steps=150)


def run_cli(argv):
    return run_main(certify.main, argv)


def test_grid_log_resumes_to_the_same_lines_and_analyze_reads_it(digits_model, tmp_path, capsys):
    import analyze
    base = ["--checkpoint", digits_model, "--N", 20_000, "--batch", 1000, "--radii", 0.25, 0.5, "--skip", 5]
    whole, part = tmp_path / "whole.tsv", tmp_path / "part.tsv"
    assert run_cli([*base, "--max", 12, "--outfile", whole]) == 0
    assert run_cli([*base, "--max", 5, "--outfile", part]) == 0            # a run stopped after 5 examples
    assert run_cli([*base, "--max", 12, "--outfile", part]) == 0
    strip = lambda path: [ln.split("\t")[:5] + ln.split("\t")[6:] for ln in open(path).read().splitlines()]  # noqa
    assert strip(part) == strip(whole)
    header = open(whole).readline().rstrip("\n").split("\t")
    assert header == list(certify.GRID_COLUMNS)
    rows = [dict(zip(header, ln.split("\t"))) for ln in open(whole).read().splitlines()[1:]]
    assert all(r["stop"] in ("decided", "curtailed", "budget") and float(r["radius"]) in (0.0, 0.25, 0.5)
               for r in rows)
    # pA_certified is the bound the written radius rests on: radius = sigma Phi^-1(pA_certified), 0 without one;
    # pA_lower (the betting interval, an estimate) need not support it
    sigma = json.load(open(str(whole) + ".json"))["sigma"]
    for r in rows:
        p = float(r["pA_certified"])
        assert (p == 0) if r["predict"] == "-1" else abs(sigma * norm.ppf(p) - float(r["radius"])) < 1e-6, r
    # a log in other columns (no pA_certified) is not resumed: one line, the log kept
    old = tmp_path / "old.tsv"
    lines = open(part).read().splitlines()[:6]
    old.write_text("".join(ln.rsplit("\t", 1)[0] + "\n" for ln in lines))
    side = json.load(open(str(part) + ".json"))
    side["columns"] = side["columns"][:-1]
    open(str(old) + ".json", "w").write(json.dumps(side))
    from helpers import as_recorded
    as_recorded(str(old) + ".json")
    before = old.read_bytes()
    assert run_cli([*base, "--max", 12, "--outfile", old]) == 2 and old.read_bytes() == before
    assert run_cli([*base[:-2], "--skip", 5, "--max", 12, "--outfile", whole, "--radii", 0.25]) == 2   # other radii
    capsys.readouterr()
    code = 0
    try:
        machinery.run(lambda: analyze.main(["table", str(whole), "--radii", "0", "0.25", "0.5"]))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr().out
    assert code == 0 and "grid" in out and "model evaluations" in out
    try:
        machinery.run(lambda: analyze.main(["ecdf", str(whole)]))
        code = 0
    except SystemExit as e:
        code = e.code
    assert code == 2 and "--radii" in capsys.readouterr().err


def test_budget_bound_line_counts_the_examples_run_to_the_budget_and_their_distance_to_a_threshold(capsys):
    """By hand: sigma 0.25 and the radii 0, 0.5 have the thresholds 0.5 and Phi(2) = 0.97725; two of four
    examples ran to the budget (N0 + N = 20,100) with pA 0.00025 and 0.01275 from Phi(2)."""
    import bench
    row = {"evals": [20_100, 1_100, 20_100, 100], "radii": [0.0, 0.5]}
    bench.print_budget_bound("grid", row, [0.977, 0.6, 0.99, 0.3], 0.25, 20_000, 100)
    assert capsys.readouterr().out.strip() == (
        "bound of grid: 2 examples (50.0 %) ran to the budget and took 97 % of its evaluations; the reference's pA "
        "estimate lies a median 0.0065 from a threshold Phi(r/sigma) for them, 0.1500 for the others; without "
        "them the mean would be 600 (33.5x)")


def test_bench_table_from_logs_counts_evaluations_and_disagreements(digits_model, tmp_path, capsys, monkeypatch):
    """tools/bench.py --sections g --grid-logs: the benchmark rebuilt from resumable certify.py logs."""
    import bench
    base = ["--checkpoint", digits_model, "--batch", 1000, "--skip", 5, "--max", 8]
    full, small, grid = tmp_path / "certify_N20000.tsv", tmp_path / "certify_N2000.tsv", tmp_path / "grid.tsv"
    assert run_cli([*base, "--N", 20_000, "--outfile", full]) == 0
    assert run_cli([*base, "--N", 2_000, "--outfile", small]) == 0
    assert run_cli([*base, "--N", 20_000, "--radii", 0.25, 0.5, "--outfile", grid]) == 0
    capsys.readouterr()
    bench.grid_from_logs([str(full), str(small), str(grid)])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("    certify_", "    grid"))
            and "points [" not in line}
    assert set(rows) == {"certify_N20000", "certify_N2000", "grid"}
    cells = lambda name: rows[name].split(";")[0].split()   # noqa: E731
    assert cells("certify_N20000")[1:4] == ["20,100"] * 3 and cells("certify_N2000")[1] == "2,100"
    assert rows["certify_N20000"].split(";")[1].split() == ["0", "0", "0"]   # no disagreement with itself
    draws = [int(n) for n in readers.read_table(str(grid), ("N",), ())["N"]]
    evals = [100 + n for n in draws]   # N0 + draws
    assert cells("grid")[1] == f"{np.mean(evals):,.0f}"
    assert cells("grid")[7].endswith("x") and cells("certify_N20000")[7] == "1.0x"   # wall time saved
    ran = sum(n == 20_000 for n in draws)
    assert f"    bound of grid: {ran} examples ({100 * ran / 8:.1f} %) ran to the budget" in out
    # the oracle's own saving: the reference's N0 + N over N0 + the oracle's draws
    needs, saves = re.search(r"oracle of grid: .* needs ([\d,]+) estimation draws per example \(it saves ([\d.]+)x",
                             out).groups()
    assert float(saves) == pytest.approx(20_100 / (100 + int(needs.replace(",", ""))), abs=0.051 + 0.01 * float(saves))
    # one seed for every log: said as the paired design, and each arm's difference from the reference with its
    # interval (compare.compare_sides), over the grid's radii for the grid
    assert "noise paired: every arm seed 0:" in out
    lines = [line.split() for line in out.splitlines() if line.startswith(("    certify_N2000 ", "    grid "))
             and "points [" in line]
    assert [line[0] for line in lines] == ["certify_N2000", "grid"]
    assert lines[1][3].rstrip(":") in ("r=0.25", "r=0.5")
    # an arm with its own seed: the design is mixed, and says which arm still shares the reference's noise
    again = tmp_path / "grid_seed1.tsv"
    assert run_cli([*base, "--N", 20_000, "--radii", 0.25, 0.5, "--seed", 1, "--outfile", again]) == 0
    capsys.readouterr()
    bench.grid_from_logs([str(full), str(small), str(again)])
    assert "noise mixed: certify_N2000 shares the reference's seed 0" in capsys.readouterr().out
    bench.grid_from_logs([str(full), str(again)])
    assert "noise independent: each arm its own seed:" in capsys.readouterr().out
    # a grid arm on a smaller budget than the reference's N: run to *its* budget, and its oracle cut there
    small_budget = tmp_path / "grid_N1000.tsv"
    assert run_cli([*base, "--N", 1_000, "--radii", 0.25, "--seed", 2, "--outfile", small_budget]) == 0
    capsys.readouterr()
    bench.grid_from_logs([str(full), str(small_budget)])
    out = capsys.readouterr().out
    draws = [int(n) for n in readers.read_table(str(small_budget), ("N",), ())["N"]]
    ran = sum(n == 1_000 for n in draws)
    assert f"    bound of grid_N1000: {ran} examples ({100 * ran / 8:.1f} %) ran to the budget" in out
    share = [line for line in out.splitlines() if line.startswith("    grid_N1000 ") and "points [" not in line]
    assert share[0].split()[4] == f"{100 * ran / 8:.0f}%"
    budgets, oracle = [], bench.oracle_draws
    monkeypatch.setattr(bench, "oracle_draws", lambda *a, **k: budgets.append(a[4]) or oracle(*a, **k))
    bench.grid_from_logs([str(full), str(small_budget)])
    assert budgets == [1_000] and "oracle of grid_N1000" in capsys.readouterr().out
    # the wall time saved is the reference's seconds over the arm's
    one = {"radius": [0.3], "correct": [True], "evals": [1000]}
    bench.print_grid_table({"ref": dict(one, time=10.0), "arm": dict(one, time=4.0)}, "ref", {"arm"}, 20_000, 100,
                           [0.0])
    assert capsys.readouterr().out.splitlines()[2].split()[7] == "2.5x"
    # no NaN in the table or the oracle line on degenerate inputs: CERTIFY rows have no budget share, a log
    # whose times read 0 no wall ratio, and where every example's oracle passes N_max nothing is left to compare
    bench.print_grid_table({"ref": dict(one, time=10.0), "arm": dict(one, time=0.0)}, "ref", {"arm"}, 20_000, 100,
                           [0.0])
    ref_line, arm_line = capsys.readouterr().out.splitlines()[1:3]
    assert ref_line.split()[4] == "-" and arm_line.split()[4] == "0%" and arm_line.split()[7] == "-"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        at_threshold = [float(norm.cdf(1.0))] * 2   # pA on the threshold of r = 0.5 at sigma 0.5
        bench.print_oracle("grid", {"radii": [0.5], "evals": [600, 700]}, at_threshold, 0.5, 500, 100, 0.001, 0.2)
    out = capsys.readouterr().out
    assert "every example's oracle passes N_max" in out and "nan" not in out.lower()
    # a verdict beyond noise names its radii, so that "lower" and "within noise" never read as one verdict
    rows = [("certified accuracy r=0.5", 0.3, 0.29, -0.01, -0.02, 0.01, "within noise"),
            ("certified accuracy r=1.5", 0.06, 0.03, -0.03, -0.05, -0.01, "lower"),
            ("certified accuracy r=1.75", 0.04, 0.0, -0.04, -0.07, -0.02, "lower")]
    assert bench.verdict_by_radius(rows) == "lower at r=1.5, r=1.75; within noise at the other 1"
    assert bench.verdict_by_radius(rows[:1]) == "every radius within noise"
    assert bench.verdict_by_radius(rows[1:]) == "lower at r=1.5, r=1.75"
    # examples must match: a log of other examples is one clear error
    other = tmp_path / "other.tsv"
    assert run_cli([*base[:-4], "--skip", 3, "--max", 8, "--N", 2_000, "--outfile", other]) == 0
    with pytest.raises(common.UserError, match="not the examples"):
        bench.grid_from_logs([str(full), str(other)])


def test_crossing_probability_matches_closed_forms_and_a_simulation():
    from scipy.stats import binom
    # one check: the binomial tail
    assert abs(grid.crossing_probability([7], [10], 0.4) - binom.sf(6, 10, 0.4)) < 1e-11
    # two checks by enumeration: cross at 10 (A_10 >= 7), or not and then A_30 >= 15
    exact = binom.sf(6, 10, 0.4) + sum(binom.pmf(a, 10, 0.4) * binom.sf(15 - a - 1, 20, 0.4) for a in range(7))
    assert abs(grid.crossing_probability([7, 15], [10, 30], 0.4) - exact) < 1e-11
    # a long schedule (FFT path) against 200,000 simulated paths with known p
    checks, p = list(range(100, 3001, 100)), 0.6
    lower = [int(t * p + 2.5 * (t * p * (1 - p)) ** 0.5) + 1 for t in checks]
    rng = np.random.default_rng(0)
    paths = np.cumsum(rng.binomial(100, p, size=(200_000, len(checks))), axis=1)
    rate = np.mean((paths >= np.array(lower)).any(axis=1))
    dp = grid.crossing_probability(lower, checks, p)
    assert abs(rate - dp) < 4 * (dp * (1 - dp) / 200_000) ** 0.5 + 1e-9


def test_exact_accounting_gives_the_final_look_the_rest_and_spends_at_most_alpha():
    """At the paper's setting (N = 100,000, alpha = 0.001) the one-sided tests, set at Ville's level alpha and
    looking after 16 draws and then every 2 % more (at most 200 apart), spend 0.7-0.85 of it per level (the
    two-sided KT sequence less: its boundary is wider); the final look gets the rest of each level's, and no
    level's total exceeds alpha."""
    plan = grid.grid_plan([0.25, 0.5, 0.75, 1.0], 0.5, 100_000, 0.001, 0.2, True)
    assert plan["alpha_seq"] == 0.001 and 0.6 * 0.001 < plan["spent"] < 0.9 * 0.001
    assert plan["spent"] + plan["alpha_fin"] <= 0.001 + 1e-15 and plan["alpha_fin"] > 0.1 * 0.001
    assert np.allclose(plan["spent_levels"] + plan["alpha_fin_levels"], 0.001, rtol=0, atol=1e-15)
    assert np.all(np.diff(plan["final"]) >= 0) and plan["alpha_fin"] == plan["alpha_fin_levels"].min()
    for j, tau in enumerate(norm.cdf(np.array(plan["radii"]) / 0.5)):   # every level within its share
        assert grid.crossing_probability(plan["lower"][j], plan["checks"], tau) == plan["spent_levels"][j]


def ville_rows(plan, prior):
    """The rule-out rows at Ville's 1 / beta (ruled_out_rows before its exact steps), for the comparisons below."""
    rows = [grid.threshold_row(tau, plan["checks"], math.log(1 / plan["beta"]), -1, prior) for tau in plan["taus"]]
    return np.maximum.accumulate(rows, axis=0)


def test_each_rule_out_errs_at_most_beta_exactly_and_close_to_it():
    """Ruling level j out while pA >= tau_j (a certificate lost, never a wrong one) happens with probability at
    most beta, computed exactly at the worst case pA = tau_j; the rows are set close to beta, where Ville's
    1 / beta leaves their error at a fraction of it; a simulation of the votes agrees with the computation."""
    plan = grid.grid_plan([0.25, 0.5, 1.0], 0.5, 5000, 0.001, 0.2, True)
    checks, rng = np.array(plan["checks"]), np.random.default_rng(0)
    steps = np.diff(np.concatenate([[0], checks]))
    for k0 in (55, 80, 100):
        exact, loose = grid.job_tables(plan, k0, 100), ville_rows(plan, (k0 + 0.5, 100 - k0 + 0.5))
        errors = []
        for j, tau in enumerate(plan["taus"]):
            error = grid.crossing_probability(checks - exact["upper"][j], checks, 1 - tau)
            assert error <= 0.2 and np.all(exact["upper"][j] >= loose[j])
            assert error >= grid.crossing_probability(checks - loose[j], checks, 1 - tau)
            errors.append(error)
        assert max(errors) > 0.9 * 0.2, (k0, errors)
        j = int(np.argmax(errors))
        paths = np.cumsum(rng.binomial(steps, plan["taus"][j], size=(20_000, len(checks))), axis=1)
        rate = np.mean((paths <= exact["upper"][j]).any(axis=1))
        assert abs(rate - errors[j]) < 4 * math.sqrt(errors[j] * (1 - errors[j]) / 20_000), (k0, rate, errors[j])


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(-50, 50), st.integers(0, 60), st.integers(-80, 80), st.integers(-90, 90)),
                min_size=1, max_size=30))
def test_first_true_finds_the_same_answer_from_any_guess(entries):
    """grid.first_true: per entry the smallest x in [lo, hi] with x >= target (hi + 1 if none), whether it
    bisects alone or starts from a guess, close or far; asked only about entries still open."""
    lo = np.array([e[0] for e in entries])
    hi, target, guess = lo + [e[1] for e in entries], np.array([e[2] for e in entries]), [e[3] for e in entries]
    expected = np.clip(target, lo, hi + 1)
    asked = []

    def ok(x, at):
        asked.append(len(at))
        assert len(np.unique(at)) == len(at) and np.all((lo[at] <= x) & (x <= hi[at]))
        return x >= target[at]
    assert np.array_equal(grid.first_true(lo, hi, ok), expected)
    assert np.array_equal(grid.first_true(lo, hi, ok, guess), expected)
    assert np.array_equal(grid.first_true(lo, hi, ok, np.clip(target, lo, hi)), expected)


def test_rule_outs_far_from_the_prior_sit_at_villes_level_and_near_ones_at_beta():
    """ruled_out_rows computes the exact error only where the prior (the selection votes' posterior) puts its
    mass near tau_j: a level the prior rules out by far keeps Ville's row (its error <= beta by Ville), a
    plausible one gets the row of error near beta; the certify rows do not depend on it."""
    from scipy.special import betainc
    plan = grid.grid_plan([0.25, 0.5, 1.0, 1.5], 0.5, 5000, 0.001, 0.2, True)
    checks = np.array(plan["checks"])
    for k0 in (60, 100):
        prior = (k0 + 0.5, 100 - k0 + 0.5)
        exact, loose = grid.job_tables(plan, k0, 100), ville_rows(plan, (k0 + 0.5, 100 - k0 + 0.5))
        near = [grid.NEAR_PRIOR <= betainc(*prior, tau) <= 1 - grid.NEAR_PRIOR for tau in plan["taus"]]
        assert any(near) and not all(near), (k0, near)
        for j, tau in enumerate(plan["taus"]):
            error = grid.crossing_probability(checks - exact["upper"][j], checks, 1 - tau)
            assert error <= 0.2
            if not near[j] and (j == 0 or not near[j - 1]):   # (a plausible level below lifts this row)
                assert np.array_equal(exact["upper"][j], loose[j]), (k0, j)


def test_label_mode_false_certificate_rate_stays_within_alpha_and_spends_no_selection_draws():
    """--label-mode (candidate = the true label, class 1 here): at the worst case (the point exactly at r, and
    just inside it) a radius >= r is certified at most alpha of the time, for CERTIFY and for the grid."""
    torch.manual_seed(0)
    w, b, sigma, alpha = torch.randn(4), torch.tensor(0.3), 0.5, 0.05
    calls = []

    class Counting(Halfspace):
        def forward(self, x):
            calls.append(len(x))
            return super().forward(x)
    model = Counting(w, b)
    # rule-outs never make a certificate wrong, and the same argument holds on any schedule: coarser looks, quicker
    plan = grid.grid_plan([0.25, 0.5], sigma, 20_000, alpha, alpha, True,
                          looks=grid.look_schedule(20_000, 32, 1.25, 500))
    runs = 300
    for r in (0.25, 0.5):
        for d in (r, r - 0.02 * sigma):
            x = point_at(w, b, d)
            packed = [o for g in range(0, runs, 64) for o in grid.grid_certify_many(   # packed, as above
                model, [(x, common.example_generator(9, k), 1) for k in range(g, min(g + 64, runs))], sigma, 100,
                1000, 2, plan)]
            cert = [certify.certify(model, x, sigma, 100, 2000, alpha, 1000, 2, common.example_generator(9, k),
                                    candidate=1) for k in range(runs)]
            for outs in (packed, cert):
                wrong = sum(o["radius"] >= r and o["predict"] == 1 for o in outs)
                assert wrong / runs <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs), (r, d)
    calls.clear()
    out = certify.certify(model, point_at(w, b, 0.3), sigma, 100, 2000, alpha, 1000, 2,
                          common.example_generator(1, 1), candidate=1)
    assert sum(calls) == 2000 == out["N"]       # no N0 selection draws


def test_label_mode_and_random_seed_on_the_command_line(digits_model, tmp_path, capsys):
    import json
    import analyze
    base = ["--checkpoint", digits_model, "--max", "6", "--N0", "50", "--N", "400", "--batch", "200",
            "--device", "cpu"]
    label = tmp_path / "label.tsv"
    assert run_cli(base + ["--outfile", label, "--label-mode"]) == 0
    lines = label.read_text().splitlines()
    assert lines[0].endswith("\tcandidate") and all(ln.endswith("\tlabel") for ln in lines[1:])
    side = json.loads((tmp_path / "label.tsv.json").read_text())
    assert side["candidate"] == "label"
    assert run_cli(base + ["--outfile", label]) == 2          # resuming it as a CERTIFY log is refused
    capsys.readouterr()
    assert run_main(analyze.main, ["table", str(label)]) == 0 and "label mode" in capsys.readouterr().out
    # --seed random: a seed drawn at the start and recorded; the same lines as that seed given by hand
    first, second = tmp_path / "r1.tsv", tmp_path / "r2.tsv"
    for path in (first, second):
        assert run_cli(base + ["--outfile", path, "--seed", "random"]) == 0
    seeds = [json.loads((tmp_path / f"{p.name}.json").read_text())["seed_value"] for p in (first, second)]
    assert all(isinstance(s, int) for s in seeds) and seeds[0] != seeds[1]
    fixed = tmp_path / "fixed.tsv"
    assert run_cli(base + ["--outfile", fixed, "--seed", seeds[0]]) == 0
    cells = lambda p: [ln.split("\t")[:5] + ln.split("\t")[6:] for ln in p.read_text().splitlines()]
    assert cells(fixed) == cells(first)
    # a resume of a random-seed log continues with its recorded seed
    grown = tmp_path / "grown.tsv"
    assert run_cli(base[:2] + ["--max", "3"] + base[4:] + ["--outfile", grown, "--seed", "random"]) == 0
    assert run_cli(base + ["--outfile", grown, "--seed", "random"]) == 0
    value = json.loads((tmp_path / "grown.tsv.json").read_text())["seed_value"]
    again = tmp_path / "again.tsv"
    assert run_cli(base + ["--outfile", again, "--seed", value]) == 0
    assert cells(grown) == cells(again)


def test_beta_curve_simulation_follows_the_real_rule_and_beta_only_saves_draws(monkeypatch):
    """tools/beta_curve.py's simulation against grid.grid_certify on a halfspace with known pA: the mean
    draws and the certified level agree within noise; with common paths, a larger beta never draws more."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("beta_curve", os.path.join(ROOT, "tools", "beta_curve.py"))
    beta_curve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(beta_curve)
    torch.manual_seed(0)
    w, b, sigma = torch.randn(4), torch.tensor(0.3), 0.5
    model = Halfspace(w, b)
    d = 0.5 + 0.2 * sigma
    plan = grid.grid_plan([0.25, 0.5, 0.75], sigma, 20_000, 0.01, 0.2, True)
    real = [grid.grid_certify(model, point_at(w, b, d), sigma, 100, 1000, 2, common.example_generator(3, k),
                                 plan, candidate=1) for k in range(200)]
    draws, acc = beta_curve.simulate(plan, np.array([norm.cdf(d / sigma)]), np.array([True]), 4000, 0)
    real_draws = np.array([o["N"] for o in real], dtype=float)
    assert abs(real_draws.mean() - draws) < 4 * real_draws.std() / math.sqrt(200) + 1
    real_at_05 = np.mean([o["radius"] >= 0.5 for o in real])
    assert abs(real_at_05 - acc[2]) < 4 * math.sqrt(acc[2] * (1 - acc[2]) / 200) + 0.01
    p = np.array([0.3, 0.55, 0.7, 0.85, 0.95, 0.99])
    ok = np.ones(len(p), bool)
    costs = [beta_curve.simulate(grid.grid_plan([0.25, 0.5], sigma, 20_000, 0.01, beta, True), p, ok,
                                 50, 1) for beta in (0.0, 0.01, 0.2, 0.5)]
    assert all(a[0] >= b_[0] for a, b_ in zip(costs, costs[1:]))          # draws never rise with beta
    assert all(a <= b_ + 1e-12 for c in costs[1:] for a, b_ in zip(c[1], costs[0][1]))   # nor certificates
    # predict mode: the selection votes (N0 = 100) set each run's prior, in the simulation as in certify.py
    real = [grid.grid_certify(model, point_at(w, b, d), sigma, 100, 1000, 2, common.example_generator(4, k),
                                 plan) for k in range(200)]
    draws, acc = beta_curve.simulate(plan, np.array([norm.cdf(d / sigma)]), np.array([True]), 4000, 0, N0=100)
    real_draws = np.array([o["N"] for o in real], dtype=float)
    assert abs(real_draws.mean() - draws) < 4 * real_draws.std() / math.sqrt(200) + 1
    # and the point of that prior: fewer draws than KT's at every pA where there is something to decide
    plan = grid.grid_plan([0.25, 0.5, 0.75], sigma, 20_000, 0.01, 0.2, True)
    for pA in (0.6, 0.8, 0.99):
        informed = beta_curve.simulate(plan, np.array([pA]), np.array([True]), 1000, 2, N0=100)[0]
        with monkeypatch.context() as m:   # KT's prior for every example, whatever its selection votes
            m.setattr(grid, "job_tables", lambda plan, k0, N0: plan)
            kt_draws = beta_curve.simulate(plan, np.array([pA]), np.array([True]), 1000, 2, N0=100)[0]
        assert informed < (0.95 if pA < 0.99 else 1.0) * kt_draws, pA   # 0.99: only r = 0.75 (0.93), quick


def test_packing_gives_each_example_the_result_it_gets_alone_and_draws_ahead_where_no_look_can_end_it(digits_model):
    """grid_certify_many: an example's noise comes from its own chunks, each drawn on its own, so packed with
    others (group of 12) it gets the result it gets alone; a pass takes several chunks of an example where no
    look between them could end it (fewer passes than chunks, alone), and packing needs fewer passes still."""
    model, _ = readers.load_model(digits_model)
    data = common.get_dataset("digits", "test")
    plan = grid.grid_plan([0.25, 0.5], 0.25, 5000, 0.001, 0.2, True)
    sizes, chunks = [], []

    def copies(x, k, sigma, generator):
        chunks.append(k)
        return common.gaussian_copies(x, k, sigma, generator)
    hook = model.register_forward_pre_hook(lambda m, inp: sizes.append(len(inp[0])))
    items = lambda: [(data[i][0], common.example_generator(0, i), None) for i in range(12)]   # noqa: E731
    packed = grid.grid_certify_many(model, items(), 0.25, 100, 200, 10, plan, copies)
    packed_sizes = list(sizes)
    sizes.clear(), chunks.clear()
    alone = [grid.grid_certify_many(model, [item], 0.25, 100, 200, 10, plan, copies)[0] for item in items()]
    hook.remove()
    assert packed == alone
    assert sum(packed_sizes) == sum(100 + o["N"] for o in packed) == sum(sizes)   # every draw evaluated once
    assert len(sizes) < 0.8 * len(chunks)                                            # chunks drawn ahead
    assert len(packed_sizes) < 0.6 * len(sizes)                                      # packing: fewer passes


def test_false_certificate_rate_with_packing_stays_within_alpha():
    """The worst case of the validity test, 40 examples packed per group (one halfspace point each)."""
    torch.manual_seed(0)
    w, b, sigma, alpha = torch.randn(4), torch.tensor(0.3), 0.5, 0.05
    model = Halfspace(w, b)
    plan = grid.grid_plan([0.25, 0.5], sigma, 20_000, alpha, alpha, True)   # no rule-out errs
    runs = 240
    for r in (0.25, 0.5):
        x = point_at(w, b, r)   # one input (C, H, W) = (1, 1, 4)
        outs = []
        for g in range(0, runs, 40):
            outs += grid.grid_certify_many(model, [(x, common.example_generator(11, k), None)
                                                      for k in range(g, g + 40)], sigma, 100, 1000, 2, plan)
        wrong = sum(o["radius"] >= r for o in outs)
        assert wrong / runs <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs), r


def test_a_resumed_grid_run_redoes_its_unfinished_group_and_writes_the_same_log(digits_model, tmp_path):
    base = ["--checkpoint", digits_model, "--N", 4000, "--batch", 200, "--radii", 0.25, 0.5, "--group", 5,
            "--device", "cpu"]
    whole, part = tmp_path / "whole.tsv", tmp_path / "part.tsv"
    assert run_cli([*base, "--max", 12, "--outfile", whole]) == 0
    assert run_cli([*base, "--max", 7, "--outfile", part]) == 0          # the second group half written
    assert run_cli([*base, "--max", 12, "--outfile", part]) == 0
    cells = lambda p: [ln.split("\t")[:5] + ln.split("\t")[6:] for ln in p.read_text().splitlines()]
    assert cells(part) == cells(whole) and len(cells(whole)) == 13


@pytest.mark.skipif(__import__("shutil").which("torchrun") is None, reason="torchrun not installed")
def test_torchrun_grid_run_splits_groups_and_merges_like_one_process(digits_model, tmp_path):
    from torchrun_util import failure_report, run_torchrun
    base = ["--checkpoint", digits_model, "--N", 4000, "--batch", 200, "--radii", 0.25, 0.5, "--group", 3,
            "--max", 11, "--device", "cpu"]
    whole, dist = tmp_path / "whole.tsv", tmp_path / "dist.tsv"
    assert run_cli([*base, "--outfile", whole]) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    res = run_torchrun([os.path.join(ROOT, "certify.py"), "--", *base, "--outfile", dist], tmp_path / "logs",
                       env=env, timeout=180)
    assert res.returncode == 0, failure_report(res, tmp_path / "logs")
    cells = lambda p: [ln.split("\t")[:5] + ln.split("\t")[6:] for ln in p.read_text().splitlines()]
    assert cells(dist) == cells(whole) and machinery.part_files(str(dist)) == []


def test_the_oracle_sprt_matches_walds_identity_and_the_rule_never_beats_it():
    """bench.oracle_draws: with every draw voting cA the certify SPRT stops at the fixed-n count
    ceil(ln(1/alpha) / ln(1/tau)); one SPRT's mean lies between Wald's identity's bound / KL(p || tau) and that
    plus one step (the overshoot); at a threshold it never decides (cut at N_max every run); and the real
    grid rule (tools/beta_curve.py's simulation of it) spends at least the oracle's draws on average, and
    with the prior of its selection votes at most 1.25 times them (1.05-1.20 here)."""
    import bench
    import importlib.util
    from scipy.special import rel_entr
    tau = norm.cdf(2.0)
    mean, cut = bench.oracle_draws([1.0], [0.5, tau], 0.001, 0.2, 10**6, runs=50)
    assert mean[0] == math.ceil(math.log(1000) / math.log(1 / tau)) and cut[0] == 0
    kl = lambda p, q: rel_entr(p, q) + rel_entr(1 - p, 1 - q)   # noqa: E731
    p, runs = 0.8, 4000                                          # certify 1/2, rule out tau: the certify test is the later
    mean, _ = bench.oracle_draws([p], [0.5, 0.999], 0.001, 0.5, 10**6, runs=runs)
    low = math.log(1000) / kl(p, 0.5)
    high = (math.log(1000) + math.log(p / 0.5)) / kl(p, 0.5)
    assert low * 0.97 <= mean[0] <= high * 1.03 + 4 * math.sqrt(low) / runs ** 0.5, (low, mean, high)
    mean, cut = bench.oracle_draws([tau], [0.5, tau], 0.001, 0.2, 5000, runs=20)
    assert mean[0] == 5000 and cut[0] == 1.0                     # at a threshold: never decided
    spec = importlib.util.spec_from_file_location("beta_curve", os.path.join(ROOT, "tools", "beta_curve.py"))
    beta_curve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(beta_curve)
    sigma, radii = 0.5, [0.25, 0.5, 0.75]
    plan = grid.grid_plan(radii, sigma, 20_000, 0.001, 0.2, True)
    thresholds = norm.cdf(np.array(plan["radii"]) / sigma)
    for pA in (0.3, 0.6, 0.8, 0.99, 1.0):
        oracle = bench.oracle_draws([pA], thresholds, 0.001, 0.2, 20_000, runs=400)[0][0]
        for N0 in (0, 100) if pA in (0.6, 0.8, 0.99) else (0,):   # KT's prior (label mode); the selection votes'
            draws, _ = beta_curve.simulate(plan, np.array([pA]), np.array([True]), 400, 0, N0)
            assert draws >= oracle * 0.97, (pA, N0, draws, oracle)
            assert N0 == 0 or draws <= 1.25 * oracle, (pA, draws, oracle)   # and, with the selection votes, close


def test_bench_from_logs_reads_time_cells_of_both_formats_and_rejects_others(tmp_path):
    """tools/bench.py --grid-logs reads untrusted logs: a time cell is H:MM:SS(.f), 'D day(s), H:MM:SS' or seconds;
    anything else is one UserError naming the file and line (was a ValueError traceback)."""
    import bench
    assert readers.log_seconds("0:00:03.617651") == pytest.approx(3.617651)
    assert readers.log_seconds("2 days, 1:00:00") == 2 * 86400 + 3600
    assert readers.log_seconds("3.5") == 3.5
    source = os.path.join(ROOT, "results", "grid_cpu", "independent", "sigma0.25")
    for name in ("certify_N100000.tsv", "grid.tsv"):
        for suffix in ("", ".json"):
            shutil.copy(os.path.join(source, name + suffix), tmp_path / (name + suffix))
    lines = (tmp_path / "grid.tsv").read_text().splitlines()
    for bad in ("bogus", "1:99:00", "-1", "nan", ""):
        cells = lines[4].split("\t")
        cells[5] = bad
        (tmp_path / "grid.tsv").write_text("\n".join(lines[:4] + ["\t".join(cells)] + lines[5:]) + "\n")
        with pytest.raises(common.UserError, match=r"grid.tsv line 5: time"):
            bench.grid_from_logs([str(tmp_path / "certify_N100000.tsv"), str(tmp_path / "grid.tsv")])


def test_validity_harness_accepts_the_rule_and_catches_repeated_fixed_n_tests(tmp_path, monkeypatch):
    """tools/grid_validity.py (the long benchmark, here with 3,000 runs a level and no pipeline part): the
    exact error of every level is within alpha and the simulated rates agree with it, at alpha = 0.001 the
    exact spend is alpha and no more, and the negative control, a Clopper-Pearson test repeated at every look,
    is caught."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("grid_validity", os.path.join(ROOT, "tools", "grid_validity.py"))
    grid_validity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grid_validity)
    out = tmp_path / "report.md"
    real = grid.grid_plan
    assert grid_validity.main(["--out", str(out), "--trials", "3000", "--pipeline-trials", "0",
                               "--alphas", "0.05", "--priors", "0", "57", "100"]) == 0
    text = out.read_text()
    assert "**All checks hold**" in text and "The harness can fail" in text
    assert all(f"## 1. Vote process, {mode} mode, α = 0.05" in text for mode in ("predict", "label"))
    rows, plan = grid_validity.vote_process([0.25, 0.5], 0.5, 5000, 0.05, 0.2, 2000, 3, negative=True)
    assert all(lo > 0.05 for *_, (lo, _) in rows)                      # repeated fixed-n tests: far above alpha
    # the pipeline part (--workers) counts the same in worker processes as in this one
    import multiprocessing
    monkeypatch.setattr(grid, "grid_plan", real)   # the workers' grid is the real one
    monkeypatch.syspath_prepend(os.path.join(ROOT, "tools"))   # workers import it by name, as the script's do
    monkeypatch.setitem(sys.modules, "grid_validity", grid_validity)
    setting = ([0.25], 0.5, 2000, 0.3, 0.2, 24, 5)
    with multiprocessing.get_context("spawn").Pool(2) as pool:   # not fork: torch's threads in this process
        pooled = grid_validity.pipeline(*setting, pool)
    alone = grid_validity.pipeline(*setting)
    assert pooled == alone and set(alone) == {False, True} and [len(rows) for rows in alone.values()] == [2, 2]
    assert all([row[0] for row in rows] == [0.0, 0.25] for rows in alone.values())   # r = 0 included
    assert sum(row[3] for rows in alone.values() for row in rows) > 0   # at alpha 0.3 some false certificates


def test_validity_counts_a_certificate_of_the_other_class_as_false_at_r0():
    """Predict mode with two classes at 1/2 (pA = tau_0): a certificate of either class at r = 0 is false. The
    vote process counts the other class's too, and the exact column bounds the rate with them."""
    load = lambda name: importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))  # noqa: E731
    spec = load("grid_validity")
    grid_validity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grid_validity)
    plan = grid.grid_plan([0.25], 0.5, 2000, 0.3, 0.2, True)
    at_half = (plan, np.array([0.5]), np.array([True]), 4000, 1, 100)
    _, accuracy = grid_validity.beta_curve.simulate(*at_half)
    _, false = grid_validity.beta_curve.simulate(*at_half, false_certificates=True)
    assert false[0] > 1.5 * accuracy[0]   # the other class wins about half the selections; its certificates count
    exact = grid_validity.exact_totals(plan, 100)[0]
    assert exact <= 0.3 and false[0] <= exact + 3 * math.sqrt(exact * (1 - exact) / 4000)


def test_no_zero_level_decides_only_the_listed_radii_and_stays_valid(digits_model, tmp_path, capsys):
    """--no-zero-level: r = 0 (does the smoothed classifier predict at all) is not a level, so an example far
    below the one threshold stops at once instead of settling pA against 1/2; a certificate at the worst case
    (pA = tau exactly) is still wrong at most alpha of the time; the log records the radii it decided."""
    import json
    torch.manual_seed(0)
    w, b, sigma, alpha = torch.randn(4), torch.tensor(0.3), 0.5, 0.05
    model = Halfspace(w, b)
    alone = grid.grid_plan([0.5], sigma, 20_000, alpha, 0.2, True, zero_level=False)
    both = grid.grid_plan([0.5], sigma, 20_000, alpha, 0.2, True)
    assert alone["radii"] == [0.5] and both["radii"] == [0.0, 0.5]
    runs = 300
    x = point_at(w, b, 0.5)   # packed 64 a group: each run gets the result it gets alone (the packing test)
    outs = [o for g in range(0, runs, 64) for o in grid.grid_certify_many(
        model, [(x, common.example_generator(12, k), None) for k in range(g, min(g + 64, runs))], sigma, 100, 1000,
        2, alone)]
    assert sum(o["predict"] >= 0 for o in outs) / runs <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs)
    near_half = point_at(w, b, 0.03)                                     # pA = Phi(0.06) = 0.52
    n_alone = [grid.grid_certify(model, near_half, sigma, 100, 1000, 2, common.example_generator(13, k), alone)
               for k in range(20)]
    n_both = [grid.grid_certify(model, near_half, sigma, 100, 1000, 2, common.example_generator(13, k), both)
              for k in range(20)]
    assert all(o["predict"] == -1 and o["radius"] == 0.0 for o in n_alone)
    assert 10 * np.mean([o["N"] for o in n_alone]) < np.mean([o["N"] for o in n_both])
    base = ["--checkpoint", digits_model, "--N", 4000, "--batch", 500, "--max", 4, "--device", "cpu"]
    out = tmp_path / "alone.tsv"
    assert run_cli([*base, "--radii", 0.5, "--no-zero-level", "--outfile", out]) == 0
    assert json.loads((tmp_path / "alone.tsv.json").read_text())["radii"] == [0.5]
    assert run_cli([*base, "--radii", 0.5, "--outfile", out]) == 2        # not resumed as a run with r = 0
    assert run_cli([*base, "--no-zero-level", "--outfile", tmp_path / "x.tsv"]) == 2
    # every option of --radii alone is refused without it, not silently ignored (CERTIFY would run instead)
    for only_grid in (["--no-final-look"], ["--group", 8], ["--beta", 0.1]):
        capsys.readouterr()
        assert run_cli([*base, *only_grid, "--outfile", tmp_path / "x.tsv"]) == 2
        assert f"{only_grid[0]} goes with --radii" in capsys.readouterr().err
        assert not (tmp_path / "x.tsv").exists()
    capsys.readouterr()
    import analyze
    assert run_main(analyze.main, ["table", str(out)]) == 0
    assert "r = 0 was not a level" in capsys.readouterr().out


def load_script(name):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_like_for_like_rules_match_brute_force_and_simulation():
    """tools/like_for_like.py: the betting sequence's integer thresholds are those of a search over every
    vote count, and the staged Clopper-Pearson rule's exact mean draws are what its simulation spends."""
    lfl = load_script("like_for_like")
    tau, alpha = 0.8, 0.01
    lo, hi = lfl.betting_thresholds(tau, alpha, 300)
    for t in (1, 7, 40, 123, 300):
        a = np.arange(t + 1)
        ok = grid.kt_log_wealth(a, t, tau) >= math.log(2 / alpha)
        want_lo = a[ok & (a > tau * t)].min(initial=t + 1)
        want_hi = a[ok & (a < tau * t)].max(initial=-1)
        assert (lo[t - 1], hi[t - 1]) == (want_lo, want_hi), t
    stages, rng = (50, 200, 1000), np.random.default_rng(0)
    for p in (0.75, 0.85, 0.95):
        exact = lfl.staged_draws(np.array([p]), tau, alpha, alpha / 2, stages)[0]
        runs, total = 20_000, 0
        live = np.ones(runs, bool)
        for i, n in enumerate(stages):
            total += n * live.sum()
            k = rng.binomial(n, p, runs)
            done = common.clopper_pearson_lower(k, n, alpha / 3) >= tau
            if i < 2:
                done |= beta_dist.ppf(1 - alpha / 4, k + 1, n - k) < tau
            live &= ~done
        assert abs(total / runs - exact) < 0.03 * exact, (p, total / runs, exact)


def test_bench_gives_each_arm_its_difference_with_an_interval_at_the_radii_it_decides(capsys):
    """tools/bench.py (g): an arm that certifies as the reference is within noise; one that loses 30 of 100
    certificates at r = 0.5 is lower there, and an arm is judged only at its own radii."""
    import bench
    n = 100
    ref = {"radius": [0.5] * 60 + [0.25] * 20 + [-1.0] * 20, "correct": [True] * 90 + [False] * 10,
           "idx": list(range(n)), "y": [0] * n}
    worse = dict(ref, radius=[0.5] * 30 + [0.25] * 50 + [-1.0] * 20)
    results = {"reference": ref, "same": dict(ref), "worse": worse, "r = 0.5 alone": dict(worse)}
    bench.arm_intervals(results, "reference", {"same": [0.25, 0.5], "r = 0.5 alone": [0.25]}, [0.25, 0.5],
                        "independent")
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "every radius within noise" in lines["same"] and "+0.0 points" in lines["same"]
    assert "r=0.5: -30.0 points" in lines["worse"] and "lower" in lines["worse"]
    assert "r=0.25" in lines["r"] and "within noise" in lines["r"]   # its own radius only


def test_savings_table_reports_each_arm_against_certify_and_the_oracle_consistently(tmp_path):
    """tools/beta_curve.py --savings on a small log: each saving is CERTIFY's N0 + N over the evaluations, the
    oracle's too, and "x the oracle" is the rule's estimation draws over the oracle's."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("beta_curve", os.path.join(ROOT, "tools", "beta_curve.py"))
    beta_curve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(beta_curve)
    N = 2000
    nA = [1990, 1900, 1700, 1400, 1100, 600]
    rows = ["idx\tlabel\tpredict\tradius\tcorrect\ttime\tnA\tN"] + \
        [f"{i}\t0\t0\t0.1\t1\t0:00:01\t{k}\t{N}" for i, k in enumerate(nA)]
    log = tmp_path / "log.tsv"
    log.write_text("\n".join(rows) + "\n")
    (tmp_path / "log.tsv.json").write_text(json.dumps({"sigma": 0.5}))
    md = beta_curve.savings(types.SimpleNamespace(log=str(log), radii=[0.25, 0.5], N=N, N0=100, alpha=0.01, reps=3,
                                                  seed=0, estimates=0))
    arms = [line.split("|")[1:-1] for line in md.splitlines() if line.startswith("| ") and "x |" in line]
    assert [a[0].strip() for a in arms] == ["grid", "single radius 0.5", "r = 0.5 alone"]
    number = lambda cell: float(cell.split("±")[0].strip(" *x").replace(",", ""))   # noqa: E731
    for arm in arms:
        assert len(arm) == 7
        for cell in (arm[1], arm[3], arm[5]):   # the rule's, the ratio's and the oracle's standard errors
            assert 0 < float(cell.split("±")[1].replace(",", "")) < 0.5 * number(cell), cell
        new, new_saving, new_x = map(number, arm[1:4])
        uncut, cut = arm[4].split("(")
        oracle, oracle_saving = number(arm[5]), number(arm[6])
        assert 0 < float(uncut) and 0 <= int(cut.strip(") ")) <= len(nA)
        for evaluations, saving in ((new, new_saving), (oracle, oracle_saving)):
            assert 100 <= evaluations <= 100 + N
            assert saving == pytest.approx((100 + N) / evaluations, abs=0.051)
        assert new_x == pytest.approx((new - 100) / (oracle - 100), abs=0.006 + 1 / (oracle - 100))


def test_savings_measures_the_oracle_ratio_as_the_benchmark_does_from_estimates_of_pA(tmp_path):
    """--estimates K: the oracle ratio without the cut examples with the oracle at K estimates of pA (as tools/bench.py
    measures it from a reference log), mean [smallest, largest]; from a reference so long that its estimates
    are the truth, it is the known-truth ratio of the column before; from a short one it moves."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("beta_curve", os.path.join(ROOT, "tools", "beta_curve.py"))
    beta_curve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(beta_curve)
    truth = [0.999, 0.95, 0.87, 0.7, 0.6, 0.3]
    for n, close in ((10 ** 9, True), (300, False)):
        rows = ["idx\tlabel\tpredict\tradius\tcorrect\ttime\tnA\tN"] + \
            [f"{i}\t0\t0\t0.1\t1\t0:00:01\t{round(q * n)}\t{n}" for i, q in enumerate(truth)]
        log = tmp_path / f"log{n}.tsv"
        log.write_text("\n".join(rows) + "\n")
        (tmp_path / f"log{n}.tsv.json").write_text(json.dumps({"sigma": 0.5}))
        md = beta_curve.savings(types.SimpleNamespace(log=str(log), radii=[0.25, 0.5], N=2000, N0=100, alpha=0.01,
                                                      reps=40, seed=0, estimates=3))
        arms = [line.split("|")[1:-1] for line in md.splitlines() if line.startswith("| ") and "x |" in line]
        assert len(arms) == 3 and all(len(arm) == 8 for arm in arms)
        for arm in arms:
            known = float(arm[4].split("(")[0])
            mean, low, high = map(float, arm[7].replace("[", " ").replace("]", " ").replace(",", " ").split())
            assert low <= mean <= high
            if close:
                assert mean == pytest.approx(known, abs=0.02) and high - low <= 0.02
        if not close:
            assert any(float(arm[7].split("[")[1].split(",")[0]) < float(arm[7].split(", ")[1].rstrip("] "))
                       for arm in arms)


def test_budgets_table_runs_the_grid_on_each_budget_against_certify_and_the_run_on_N(tmp_path, capsys):
    """tools/beta_curve.py --budgets: one row per budget (--N first), evaluations within N0 + N_max, the saving
    against CERTIFY at --N, certified accuracy against the run on --N (its own row: no change), r = 0 left out
    with --no-zero-level; its options refused outside their mode."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("beta_curve", os.path.join(ROOT, "tools", "beta_curve.py"))
    beta_curve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(beta_curve)
    N, nA = 4000, [3990, 3800, 3400, 3370, 2800, 1200]
    rows = ["idx\tlabel\tpredict\tradius\tcorrect\ttime\tnA\tN"] + \
        [f"{i}\t0\t0\t0.1\t1\t0:00:01\t{k}\t{N}" for i, k in enumerate(nA)]
    log = tmp_path / "log.tsv"
    log.write_text("\n".join(rows) + "\n")
    (tmp_path / "log.tsv.json").write_text(json.dumps({"sigma": 0.5}))
    md = beta_curve.budgets(types.SimpleNamespace(log=str(log), radii=[0.5], N=N, N0=100, alpha=0.01, reps=20,
                                                  seed=0, budgets=[500, 2000, 8000], no_zero_level=True))
    header = next(line for line in md.splitlines() if line.startswith("| N_max"))
    assert "r = 0 " not in header and "r = 0.5" in header
    table = [line.split("|")[1:-1] for line in md.splitlines() if re.match(r"\| \d", line)]
    number = lambda cell: float(cell.split("±")[0].strip(" *x+").replace(",", ""))   # noqa: E731
    assert [int(number(r[0])) for r in table] == [8000, 4000, 2000, 500]   # a budget above --N too
    for r in table:   # evaluations and x the oracle carry their Monte Carlo standard error
        for cell in (r[1], r[3]):
            assert 0 < float(cell.split("±")[1].replace(",", "")) < 0.5 * number(cell), cell
    for n_max, evaluations, saving, _, _, _, change in (list(map(number, r)) for r in table):
        assert 100 <= evaluations <= 100 + n_max
        assert saving == pytest.approx((100 + N) / evaluations, abs=0.051 + 0.5 * saving / evaluations)   # rounding
    assert number(table[1][6]) == 0   # the run on N against itself
    assert number(table[3][1]) < number(table[1][1])   # a budget of 500 stops the examples next to Phi(1)
    for bad in (["--no-zero-level"], ["--budgets", "500", "--savings"], ["--estimates", "2"],
                ["--budgets", "0"]):
        assert run_main(beta_curve.main, [str(log), "--radii", "0.5", *bad]) == 2
        assert "error:" in capsys.readouterr().err


def test_the_exact_beta_oracle_rules_out_at_an_error_of_beta_and_the_ville_one_below():
    """bench.exact_ruleout_bound: the SPRT of p = 0.7 against tau = 0.8 ruling tau out, simulated at tau: its error
    is beta within Monte Carlo noise (never above), Ville's bound 1 / beta errs less and waits longer."""
    import bench
    p, tau, beta, n_max, runs = 0.7, 0.8, 0.2, 400, 20_000
    tuned = bench.exact_ruleout_bound(p, tau, beta, n_max)
    assert tuned < math.log(1 / beta)
    votes = np.random.default_rng(0).random((runs, n_max)) < tau
    path = np.cumsum(np.where(votes, math.log(p / tau), math.log((1 - p) / (1 - tau))), axis=1)
    se = math.sqrt(beta * (1 - beta) / runs)
    rate = lambda b: float(np.mean((path >= b).any(1)))   # noqa: E731
    assert abs(rate(tuned) - beta) <= 3 * se and rate(math.log(1 / beta)) < beta - 3 * se


def test_the_simulations_standard_error_is_the_spread_of_their_means_over_seeds():
    """beta_curve.mean_se from one run's per-run draws agrees with the standard deviation of the mean draws
    over independent seeds (the examples' pA fixed), within the noise of 30 seeds."""
    spec = importlib.util.spec_from_file_location("beta_curve", os.path.join(ROOT, "tools", "beta_curve.py"))
    beta_curve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(beta_curve)
    plan = grid.grid_plan([0.25, 0.5], 0.5, 4000, 0.01, 0.2, True)
    pA, ok = np.array([0.62, 0.75, 0.9, 0.97]), np.ones(4, bool)
    means, ses = [], []
    for seed in range(30):
        mean, se = beta_curve.mean_se(beta_curve.simulate(plan, pA, ok, 40, seed, per_run=True)[0])
        means.append(mean)
        ses.append(se)
    spread = np.std(means, ddof=1)
    assert 0.7 * spread < np.mean(ses) < 1.4 * spread, (spread, np.mean(ses))
    assert np.isnan(beta_curve.mean_se(np.ones((3, 1)))[1])   # one run an example: no error to give

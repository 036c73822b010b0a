"""Validity of certify.py --radii with known truth (the long version of tests/test_grid.py's validity tests).

At level j's worst case, pA = tau_j = Phi(r_j / sigma) exactly, any certificate of r_j or more is false; the
rule promises that this happens with probability at most alpha. Four checks, written to one Markdown report:

1. The vote process: TRIALS runs per level of Bernoulli(tau_j) votes through the plan's integer tables and
   stopping rule (tools/beta_curve.simulate, which tests/test_grid.py checks against certify.py), for every
   level of the grid, in both modes: predict mode, each run after its N0 = 100 selection votes
   k0 ~ Binomial(N0, tau_j), which choose its prior; label mode (the true label the candidate), KT's prior.
   Beside each rate: the exact probability that the path crosses level j's thresholds, final look included,
   averaged over k0 (exact_totals: an upper bound of the rate, since stopping only removes crossings), which
   must be <= alpha, and the rate's 95 % Clopper-Pearson interval, whose lower end must not exceed the
   exact value (the simulation agrees with the computation). The upper end is shown too: where the exact
   value is within about 1.6 standard errors of alpha it exceeds alpha by chance, since the rule spends all of
   alpha there by design.
2. The pipeline: grid.grid_certify_many itself, examples packed 64 to a group, on a halfspace classifier
   whose point lies at distance r_j from its boundary (so pA = tau_j), with N0 selection draws (predict mode)
   and with the true label as candidate (label mode); the same checks.
3. The exact computation at the paper's setting (alpha = 0.001, N_max = 100,000), for every prior the rule
   can use (KT, and each selection count k0 of N0 = 100): the error the sequence spends, the final look's
   share and, per level, the exact total (sequence and final look on one path, grid.crossing_probability),
   all <= alpha.
4. A negative control: a Clopper-Pearson bound at alpha recomputed at every look (a fixed-n test used
   sequentially, not anytime-valid) through the same harness; its rate exceeds alpha, so the harness can fail.

  python tools/grid_validity.py --out results/grid_validity/report.md [--trials 40000] [--pipeline-trials 40000]
"""
import contextlib
import importlib.util
import multiprocessing
import os
import sys
import time

import numpy as np
import torch
from scipy.stats import beta as beta_dist
from scipy.stats import norm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402
import grid  # noqa: E402
import machinery  # noqa: E402

SPEC = importlib.util.spec_from_file_location("beta_curve", os.path.join(ROOT, "tools", "beta_curve.py"))
beta_curve = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(beta_curve)


def interval95(k, n):
    """Two-sided 95 % Clopper-Pearson interval of a rate k / n."""
    return (0.0 if k == 0 else float(beta_dist.ppf(0.025, k, n - k + 1)),
            1.0 if k == n else float(beta_dist.ppf(0.975, k + 1, n - k)))


def path_crossing(tables, checks, j, tau):
    """The exact probability at pA = tau that the votes ever reach level j's certification threshold with these
    tables, the final look's included (grid.crossing_probability on one path)."""
    merged = [int(a) for a in tables["lower"][j]]
    merged[-1] = min(merged[-1], int(tables["final"][j]))   # tables completed by grid.final_look_tables
    return grid.crossing_probability(merged, checks, float(tau))


def exact_totals(plan, N0=0):
    """Per level j, the exact probability of a false certificate of r_j or more at pA = tau_j (an upper bound:
    stopping only removes crossings). Label mode (N0 = 0): path_crossing with the KT tables. Predict mode (N0
    selection draws, two classes: the other has 1 - tau_j, as in beta_curve.simulate and the halfspace of
    `pipeline`): the average over the candidate's selection votes k0 ~ Binomial(N0, tau_j) of path_crossing
    with k0's tables where it wins (k0 > N0 / 2), and where the other class wins (k0 < N0 / 2) the chance that
    it is certified at all, at r = 0 or more (its own crossing of level 0 at 1 - tau_j with the tables of its
    N0 - k0 votes); a tie counts as the larger of the two. Values of k0 with probability below 1e-15 count as
    certain errors."""
    from scipy.stats import binom
    totals = []
    tables_of = lambda k: grid.final_look_tables(plan, grid.job_tables(plan, k, N0))   # noqa: E731
    for j, tau in enumerate(plan["taus"]):
        if not N0:
            totals.append(path_crossing(plan, plan["checks"], j, tau))
            continue
        pmf, total = binom.pmf(np.arange(N0 + 1), N0, tau), 0.0
        for k in range(N0 + 1):
            if pmf[k] < 1e-15:
                total += pmf[k]
                continue
            wins = path_crossing(tables_of(k), plan["checks"], j, tau) if 2 * k >= N0 else 0.0
            other = tables_of(N0 - k)
            # reaching any level's threshold reaches level 0's: the rows grow with the level at every look
            assert np.all(np.diff(np.asarray(other["lower"], float), axis=0) >= 0)
            loses = path_crossing(other, plan["checks"], 0, 1 - tau) if 2 * k <= N0 else 0.0
            total += pmf[k] * max(wins, loses)
        totals.append(min(total, 1.0))
    return totals


class Halfspace(torch.nn.Module):
    """Class 1 where w.x + b > 0: a point at distance d from the boundary has pA = Phi(d / sigma) exactly."""

    def __init__(self, w, b):
        super().__init__()
        self.w, self.b = w, b

    def forward(self, x):
        s = x.flatten(1) @ self.w + self.b
        return torch.stack([-s, s], dim=1)


def vote_process(radii, sigma, N, alpha, beta, trials, seed, negative=False, N0=100):
    """Rows (r_j, tau_j, exact, false certificates, trials, rate, 95 % interval) at pA = tau_j, every level;
    each run first draws its selection votes k0 ~ Binomial(N0, tau_j), which set its prior (grid.grid_plan);
    N0 = 0 is label mode, KT's prior for every run."""
    plan = grid.grid_plan(radii, sigma, N, alpha, beta, True)
    if negative:   # a fixed-n Clopper-Pearson test at alpha at every look: thresholds without any correction
        taus = norm.cdf(np.array(plan["radii"]) / sigma)
        plan = dict(plan, **grid.grid_tables(taus, plan["checks"], alpha, beta, alpha, N))
        plan["lower"] = np.stack([grid.final_thresholds(taus, t, alpha) for t in plan["checks"]], axis=1)
        slack = plan["lower"] - np.array(plan["checks"])
        plan["reach"] = np.minimum.accumulate(slack[:, ::-1], axis=1)[:, ::-1]
        plan["final_bound"] = plan["final"]
        N0 = 0   # these thresholds take no prior
    rows, exact = [], exact_totals(plan, N0)
    for j, r in enumerate(plan["radii"]):
        tau = float(norm.cdf(r / sigma))
        false = 0
        for start in range(0, trials, 10_000):   # memory: trials x looks
            n = min(10_000, trials - start)
            _, wrong = beta_curve.simulate(plan, np.array([tau]), np.array([True]), n, seed + 1000 * j + start,
                                           N0, false_certificates=True)
            false += round(wrong[j] * n)
        rows.append((r, tau, exact[j], false, trials, false / trials, interval95(false, trials)))
    return rows, plan


def pipeline_cell(radii, sigma, N, alpha, beta, trials, seed, label_mode, j):
    """False certificates of level j in `trials` runs of grid.grid_certify_many on a halfspace whose point
    lies at distance r_j from its boundary, packed 64 examples a group; run k draws example_generator(seed, k)."""
    torch.set_num_threads(1)
    plan = grid.grid_plan(radii, sigma, N, alpha, beta, True)
    torch.manual_seed(seed)
    w, b = torch.randn(4, dtype=torch.float64).float(), torch.tensor(0.3)
    model, r = Halfspace(w, b), plan["radii"][j]
    x = ((r * float(w.norm()) - float(b)) * w / float(w.norm()) ** 2).view(4, 1, 1)   # w.x + b = r |w|
    false = 0
    for g in range(0, trials, 64):
        items = [(x, common.example_generator(seed, k), 1 if label_mode else None)
                 for k in range(g, min(g + 64, trials))]
        outs = grid.grid_certify_many(model, items, sigma, 100, 10_000, 2, plan)
        false += sum(o["predict"] >= 0 and (o["predict"] != 1 or o["radius"] >= r) for o in outs)
    return false


def pipeline(radii, sigma, N, alpha, beta, trials, seed, pool=None):
    """Part 2's rows, {label_mode: rows} for predict mode (False) and label mode (True): every level, r = 0
    included, through pipeline_cell (in `pool`'s processes if given: the same counts, the cells being independent and
    seeded alike), with the exact totals beside them."""
    plan = grid.grid_plan(radii, sigma, N, alpha, beta, True)
    cells = [(radii, sigma, N, alpha, beta, trials, seed, label_mode, j)
             for label_mode in (False, True) for j in range(len(plan["radii"]))]
    counts = pool.starmap(pipeline_cell, cells) if pool else [pipeline_cell(*cell) for cell in cells]
    exact = {mode: exact_totals(plan, 0 if mode else 100) for mode in (False, True)}
    rows = {False: [], True: []}
    for (*_, label_mode, j), false in zip(cells, counts):
        r = plan["radii"][j]
        rows[label_mode].append((r, float(norm.cdf(r / sigma)), exact[label_mode][j], false, trials,
                                 false / trials, interval95(false, trials)))
    return rows


def table(rows):
    lines = ["| r | pA = τ | exact (DP) | false certificates | trials | rate | 95 % interval |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r:g} | {tau:.4f} | {e:.5f} | {k} | {n:,} | {rate:.5f} | [{lo:.5f}, {hi:.5f}] |"
              for r, tau, e, k, n, rate, (lo, hi) in rows]
    return "\n".join(lines)


def holds(rows, alpha):
    """The exact error is within alpha and the simulated rate is not above it (its lower limit)."""
    return all(e <= alpha and lo <= e for _, _, e, _, _, _, (lo, _) in rows)


def main(argv=None):
    p = machinery.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="a Markdown file")
    p.add_argument("--trials", type=int, default=40_000, help="vote-process runs per level and alpha")
    p.add_argument("--pipeline-trials", type=int, default=40_000, help="grid_certify_many runs per level and mode")
    p.add_argument("--alphas", type=float, nargs="+", default=[0.05, 0.01])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="processes for part 2's cells (a mode and a level each; "
                   "the same counts as one process)")
    p.add_argument("--priors", type=int, nargs="+", default=list(range(101)), metavar="K0",
                   help="part 3: the selection counts k0 (of N0 = 100) whose priors are checked (default all, 0 ... 100)")
    args = p.parse_args(argv)
    common.check(args.trials >= 1 and args.pipeline_trials >= 0, "--trials must be >= 1, --pipeline-trials >= 0")
    common.check(all(0 < a < 1 for a in args.alphas), "--alphas must lie in (0, 1)")
    common.check(1 <= args.workers <= 64, f"--workers must lie in [1, 64] (got {args.workers})")
    common.check(args.workers == 1 or args.pipeline_trials > 0, "--workers runs part 2's cells; with "
                                                                "--pipeline-trials 0 there are none")
    common.check(all(0 <= k <= 100 for k in args.priors), f"--priors must lie in [0, 100], the selection counts of "
                                                          f"N0 = 100 (got {args.priors})")
    sigma, radii, N, beta = 0.5, [0.25, 0.5, 0.75, 1.0], 20_000, grid.DEFAULT_BETA
    start, parts, ok = time.time(), [], True
    parts.append(f"# certify.py --radii: validity with known truth\n\nMade by `python tools/grid_validity.py "
                 f"--out {args.out} --trials {args.trials} --pipeline-trials {args.pipeline_trials}`. σ = {sigma}, "
                 f"grid {', '.join(map(str, radii))} (and 0), N_max = {N:,}, β = {beta}, the rule of certify.py --radii "
                 f"({grid.GRID_TEST} tests, exact accounting). At pA = τ_j every certificate of r_j or more is "
                 f"false; the rule promises a rate of at most α.\n")
    for label_mode in (False, True):   # predict mode: N0 = 100 selection votes set the prior; label mode: KT's
        for alpha in args.alphas:
            rows, _ = vote_process(radii, sigma, N, alpha, beta, args.trials, args.seed, N0=0 if label_mode else 100)
            ok &= holds(rows, alpha)
            parts.append(f"## 1. Vote process, {'label' if label_mode else 'predict'} mode, α = {alpha:g}\n\n"
                         f"{table(rows)}\n")
    if args.pipeline_trials:
        alpha = max(args.alphas)
        with multiprocessing.get_context("spawn").Pool(args.workers) if args.workers > 1 else \
                contextlib.nullcontext() as pool:
            modes = pipeline(radii, sigma, N // 2, alpha, beta, args.pipeline_trials, args.seed + 1, pool)
        for label_mode, rows in modes.items():
            ok &= holds(rows, alpha)
            parts.append(f"## 2. Pipeline (grid_certify_many, 64 examples a group, N_max = {N // 2:,}), "
                         f"{'label' if label_mode else 'predict'} mode, α = {alpha:g}\n\n{table(rows)}\n")
    plan = grid.grid_plan([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75], 0.5, 100_000, 0.001, beta, True)
    worst = []   # per prior: (k0, spent, alpha_fin, the largest exact total over the levels)
    for k0 in [None, *args.priors]:
        tables = plan if k0 is None else grid.final_look_tables(plan, grid.job_tables(plan, k0, 100))
        totals = [path_crossing(tables, plan["checks"], j, tau) for j, tau in enumerate(plan["taus"])]
        worst.append((k0, tables["spent"], tables["alpha_fin"], max(totals)))
        ok &= bool(np.all(tables["spent_levels"] + tables["alpha_fin_levels"] <= 0.001 + 1e-15)) and max(totals) <= 0.001
    kt, informed = worst[0], worst[1:]
    parts.append("## 3. Exact, α = 0.001, N_max = 100,000, σ = 0.5, grid 0.25 ... 1.75\n\n"
                 f"For each prior the rule can use, the KT prior (label mode) and the posterior of each selection "
                 f"count k0 = {'0 ... 100' if args.priors == list(range(101)) else ', '.join(map(str, args.priors))} "
                 f"of N0 = 100: the error the sequence spends (its worst level), the final "
                 f"look's smallest level (each level j gets α minus its own spend) and the largest exact total over the levels (the sequence and the final look on one "
                 f"path, at pA = τ_j), each of which must be ≤ α, since the guarantee holds given the selection.\n\n"
                 f"- KT prior: spends {kt[1]:.3e}, the final look gets {kt[2]:.3e} ({kt[2] / 0.001:.3f} α), "
                 f"largest total {kt[3]:.3e}.\n"
                 f"- selection priors: spent {min(w[1] for w in informed):.3e} to {max(w[1] for w in informed):.3e}, "
                 f"the final look {min(w[2] for w in informed) / 0.001:.3f} α to {max(w[2] for w in informed) / 0.001:.3f} α, "
                 f"spent + final at most {max(w[1] + w[2] for w in informed):.3e}, largest total "
                 f"{max(w[3] for w in informed):.3e} (k0 = {max(informed, key=lambda w: w[3])[0]}).\n")
    alpha = max(args.alphas)
    rows, _ = vote_process(radii, sigma, N, alpha, beta, args.trials, args.seed + 7, negative=True)
    fails = any(lo > alpha for *_, (lo, _) in rows)
    ok &= fails
    parts.append(f"## 4. Negative control: Clopper-Pearson at α = {alpha:g} at every look\n\n{table(rows)}\n\n"
                 f"The harness {'can' if fails else 'did NOT'} fail: this rule's rate exceeds α beyond its interval "
                 f"(its exact column: the same computation for this rule's own thresholds, which the simulation matches).\n")
    parts.append(f"**{'All checks hold' if ok else 'A CHECK FAILED'}** ({time.time() - start:.0f} s).\n")
    text = "\n".join(parts)
    machinery.write_text_output(args.out, "grid validity report", text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(machinery.run(main))

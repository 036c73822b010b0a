"""Grid certification against the published adaptive rules, on their terms (Voráček 2024; Horváth et al. 2022).

The setting of Voráček's and Horváth et al.'s comparisons: one radius r fixed in advance (0.5), the true
label as the candidate (label mode: no selection draws), alpha = 0.001 and beta = alpha / 2 (the error of
ruling r out). Every rule meets the per-example guarantee P(certify r while pA < Phi(r / sigma)) <= alpha.
The examples: the pA of the true label of each image of a CERTIFY log at N = 100,000 (nY / N), taken as the
truth; each rule's mean draws per image (exact, or simulated with `--reps` runs an image), and how many
times fewer than CERTIFY's 100,000:
- this rule: grid.grid_plan([r], --no-zero-level, label mode's KT prior, N_max 100,000), simulated with
  tools/beta_curve.simulate (the integer tables of the real rule);
- Voráček's betting confidence sequence (his Alg. 2): the KT mixture's wealth against Phi(r / sigma),
  alpha / 2 on each side, a look after every draw, undecided after 131,100 draws; simulated;
- Horváth et al.'s staged Clopper-Pearson: fresh stages of 1,000 / 10,000 / 125,000 draws, certified when
  the stage's CP lower bound at alpha / 3 reaches Phi(r / sigma), given up at the first two stages when the
  CP upper bound at beta / 2 stays below it; exact (binomial sums).

  python tools/like_for_like.py results/grid_cpu/independent/sigma0.25/certify_N100000.tsv \\
      results/grid_cpu/independent/sigma0.5/certify_N100000.tsv --out results/grid_cpu/like_for_like.md
"""
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))                   # beta_curve
import beta_curve  # noqa: E402
import common  # noqa: E402
import readers  # noqa: E402
import grid  # noqa: E402
import machinery  # noqa: E402

CERTIFY_N = 100_000
BETTING_MAX = 131_100                 # Voráček's code: undecided after this many draws
STAGES = (1_000, 10_000, 125_000)     # Horváth et al.'s README


def betting_thresholds(tau, alpha, n_max):
    """(lo, hi): at draw t (index t - 1), the betting sequence certifies with at least lo[t - 1] votes for the
    label and rules out with at most hi[t - 1] (-1: never): the KT mixture's log wealth against tau reaches
    log(2 / alpha) with the votes on that side of tau (grid.kt_log_wealth; monotone in the votes there)."""
    t = np.arange(1, n_max + 1, dtype=float)
    bound = math.log(2 / alpha)

    def search(lo, hi, ok):   # the smallest integer in [lo, hi] where ok holds (ok monotone); hi + 1 if none
        while np.any(lo < hi):
            active, mid = lo < hi, (lo + hi) // 2
            good = ok(mid)
            hi, lo = np.where(active & good, mid, hi), np.where(active & ~good, mid + 1, lo)
        return np.where(ok(lo), lo, lo + 1)
    above = np.floor(tau * t) + 1                                          # votes strictly above tau * t
    lo = search(above, t, lambda a: grid.kt_log_wealth(a, t, tau) >= bound)
    below = np.ceil(tau * t) - 1                                           # votes strictly below tau * t
    # the largest a in [0, below] with enough wealth: search on b = below - a
    b = search(np.zeros_like(t), np.maximum(below, 0),
               lambda d: grid.kt_log_wealth(below - d, t, tau) >= bound)
    hi = np.where((below >= 0) & (b <= np.maximum(below, 0)), below - b, -1)
    return lo, hi


def betting_draws(pA, tau, alpha, reps, seed, n_max=BETTING_MAX, chunk=4096, per_run=False):
    """Mean draws per image of the betting sequence (a look after every draw), reps runs an image (per_run:
    every run's draws, an array (images, reps))."""
    lo, hi = betting_thresholds(tau, alpha, n_max)
    rng = np.random.default_rng(seed)
    means = []
    for p in pA:
        votes, stop, live, drawn = np.zeros(reps), np.full(reps, float(n_max)), np.ones(reps, bool), 0
        while drawn < n_max and live.any():
            k = min(chunk, n_max - drawn)
            path = votes[live, None] + np.cumsum(rng.random((int(live.sum()), k)) < p, axis=1)
            hit = (path >= lo[drawn:drawn + k]) | (path <= hi[drawn:drawn + k])
            first = np.where(hit.any(1), hit.argmax(1) + 1, 0)
            idx = np.flatnonzero(live)
            stop[idx[first > 0]] = drawn + first[first > 0]
            votes[idx] = path[:, -1]
            live[idx[first > 0]] = False
            drawn += k
        means.append(stop if per_run else stop.mean())
    return np.array(means)


def staged_draws(pA, tau, alpha, beta, stages=STAGES):
    """Exact mean draws per image of the staged Clopper-Pearson rule (fresh draws each stage)."""
    from scipy.stats import binom
    s = len(stages)
    cost, go_on = np.zeros(len(pA)), np.ones(len(pA))
    for i, n in enumerate(stages):
        k = np.arange(n + 1)
        certify_k = common.clopper_pearson_lower(k, n, alpha / s) >= tau
        give_up = common.clopper_pearson_upper(k, n, beta / (s - 1)) < tau if i < s - 1 else np.zeros(n + 1, bool)
        c = int(np.argmax(certify_k)) if certify_k.any() else n + 1          # certify from c votes on
        g = int(np.flatnonzero(give_up).max()) if give_up.any() else -1      # give up at g votes or fewer
        stop = binom.sf(c - 1, n, pA) + (binom.cdf(g, n, pA) if g >= 0 else 0.0)
        cost += go_on * n
        go_on = go_on * (1 - stop)
    return cost


# The kinds of log (readers.LOG_KINDS) refused as the truth, and why (a label-mode log's nY is the label's votes).
TRUTH_REFUSED = {kind: why for kind, why in beta_curve.TRUTH_REFUSED.items() if kind != "label mode"}


def rule_draws(log, radius, alpha, reps, seed):
    """One table row per rule for the images of `log`."""
    from scipy.stats import norm
    data, sidecar = readers.read_certification_log(log), readers.read_sidecar(log, required=("sigma",))
    readers.check_log_kinds(data, sidecar, TRUTH_REFUSED, "like_for_like.py")
    common.check("nY" in data, f"{log}: needs a CERTIFY log with the true label's votes (nY)")
    sigma = sidecar["sigma"]
    pA, tau, beta = data["nY"] / data["N"], float(norm.cdf(radius / sigma)), alpha / 2
    plan = grid.grid_plan([radius], sigma, CERTIFY_N, alpha, beta, True, zero_level=False)   # label mode: KT
    runs, _ = beta_curve.simulate(plan, pA, np.ones(len(pA), bool), reps, seed, per_run=True)
    return sigma, len(pA), sorted({int(n) for n in data["N"]}), {   # (mean, its Monte Carlo standard error)
        "grid (this rule, r alone, label mode)": beta_curve.mean_se(runs),
        "Voráček: betting confidence sequence": beta_curve.mean_se(betting_draws(pA, tau, alpha, reps, seed,
                                                                                 per_run=True)),
        "Horváth et al.: staged Clopper-Pearson": (float(staged_draws(pA, tau, alpha, beta).mean()), 0.0)}   # exact


def main(argv=None):
    p = machinery.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("logs", nargs="+", help="CERTIFY logs at N = 100,000 with nY (their pA is the truth)")
    p.add_argument("--radius", type=float, default=0.5)
    p.add_argument("--alpha", type=float, default=0.001)
    p.add_argument("--reps", type=int, default=20, help="simulated runs per image (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="the Markdown file to write")
    args = p.parse_args(argv)
    common.check(args.radius > 0 and 0 < args.alpha < 1 and args.reps >= 1,
                 "--radius > 0, --alpha in (0, 1) and --reps >= 1")
    machinery.set_inputs([q for log in args.logs for q in (log, log + ".json")])
    # the columns sit side by side: one dataset and split (the truth's mode and budget may differ: nY / N is pA)
    readers.check_comparable([dict(readers.read_certification_log(log), sidecar=readers.read_sidecar(log))
                              for log in args.logs], ("mode", "budget"), "like_for_like.py")
    rows = [rule_draws(log, args.radius, args.alpha, args.reps, args.seed) for log in args.logs]
    names = list(rows[0][3])
    budgets = sorted({n for row in rows for n in row[2]})
    md = (f"Mean draws per image to decide r = {args.radius:g}, label mode, alpha = {args.alpha:g}, beta = alpha / 2, "
          f"on the true pA (nY / N at N = {' or '.join(f'{n:,}' for n in budgets)}) of each image of {', '.join(args.logs)}; simulated rules with "
          f"{args.reps} runs an image (seed {args.seed}; ± their Monte Carlo standard error, the images' pA "
          f"fixed; the staged rule's draws are computed exactly); in brackets, how many times fewer than CERTIFY's "
          f"{CERTIFY_N:,} (`python tools/like_for_like.py {' '.join(args.logs)}`; tools/like_for_like.py "
          f"says how each rule is run).\n\n| rule | " +
          " | ".join(f"σ = {s:g} ({n} images)" for s, n, _, _ in rows) + " |\n|---|" + "---|" * len(rows) + "\n" +
          "".join(f"| {name} | " + " | ".join(f"{r[name][0]:,.0f}{f' ± {r[name][1]:,.0f}' if r[name][1] else ''} "
                                              f"({CERTIFY_N / r[name][0]:.1f}x)" for _, _, _, r in rows)
                  + " |\n" for name in names))
    print(md)
    if args.out:
        machinery.write_text_output(args.out, "like-for-like table", md)


if __name__ == "__main__":
    machinery.run(main, exit_process=True)

"""The level beta of certify.py --radii, chosen by measurement (docs/certification.md).

beta sets the upper confidence bound that rules radii out and stops sampling early. It never enters the
guarantee (ruling out only removes certificates), so it is a pure cost trade-off: a larger beta stops
earlier (fewer model evaluations) but now and then rules out a radius the example would have certified.
This script measures that trade-off by simulation with known truth: the true pA of each example is taken
from a CERTIFY log at N = 100,000 (nA / N for its class cA), the votes of the grid run are drawn as
Binomial increments between the plan's checks, and grid.grid_plan's integer tables decide every look
exactly as grid.grid_certify does (certified level, ruled out, curtailed, budget with the final look).
For each beta: mean model evaluations per example (N0 + draws) and certified accuracy at each grid radius,
against beta = 0 (never rule out: every certificate the budget allows).

  python tools/beta_curve.py results/grid_cpu/sigma0.25/certify_N100000.tsv --radii 0.25 0.5 0.75 \
      --out results/grid_cpu/sigma0.25
Writes beta_curve.tsv, beta_curve.md and beta_curve.png in --out (when given) and prints the table.
"""
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import common  # noqa: E402
import readers  # noqa: E402
import grid  # noqa: E402
import machinery  # noqa: E402

BETAS = (0.0, 0.0001, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


# The kinds of log (readers.LOG_KINDS) this script refuses as the truth, and why.
STOPPED_EARLY = "its nA / N comes from a run that stopped early, not an estimate of pA to take as the truth"
PER_INPUT_SIGMA = "its sigma differs per input; the simulation runs at one sigma"
TRUTH_REFUSED = {"PREDICT": "it has no votes to take as pA", "grid": STOPPED_EARLY,
                 "grid without r = 0": STOPPED_EARLY,
                 "label mode": "its nA counts the label's votes, not those of the class the model selects",
                 "DDRS": PER_INPUT_SIGMA, "semi-elastic": PER_INPUT_SIGMA}


def read_truth(path):
    """sigma, and per example the true pA (nA / N), whether its class is the label and the log's N, from a
    CERTIFY log."""
    log = readers.read_certification_log(path)
    sidecar = readers.read_sidecar(path, required=("sigma",))
    readers.check_log_kinds(log, sidecar, TRUTH_REFUSED, "beta_curve.py")
    common.check("nA" in log, f"{path}: needs a CERTIFY log with nA and N columns")
    return sidecar["sigma"], log["nA"] / log["N"], log["y"] == log["predict"], log["N"]


def simulate(plan, p, correct, reps, seed, N0=0, per_example=False, false_certificates=False, per_run=False):
    """Mean draws and certified accuracy per grid radius of the grid rule on examples with true pA = p
    (per_example: the mean draws of each example's runs, an array, instead of the overall mean; per_run: every
    run's draws, an array (examples, reps), for the Monte Carlo error: mean_se).

    false_certificates: instead of the accuracy, per level j the share of runs that certify a wrong radius
    when every pA = p is a level's worst case: the candidate certified at r_j or more, or any other class
    certified at all (its probability is at most 1/2, so even r = 0 is false for it).

    With N0 selection draws each run first selects its candidate as certify.py does, the argmax of the N0
    votes. The logs record only the votes of their class cA, so a second class gets q = min(pA, 1 - pA) of
    the rest (all of it where pA >= 1/2: the split where the argmax errs most; at most pA below, as cA was
    the log's argmax) and the others never win; ties go to the second class. When it wins, the run
    certifies it (true probability q), not the label. The candidate's count k0 chooses the prior of its tests
    (grid.job_tables); runs are grouped by k0."""
    rng = np.random.default_rng(seed)
    pp, ok = np.repeat(p, reps), np.repeat(correct, reps)
    informed = bool(N0)
    if N0:
        k0 = rng.binomial(N0, pp)                                          # cA's selection votes
        q = np.minimum(pp, 1 - pp)
        kB = rng.binomial(N0 - k0, np.divide(q, 1 - pp, out=np.zeros_like(pp), where=pp < 1))
        other = kB >= k0                                                   # the second class is the argmax
        k0, pp, ok = np.where(other, kB, k0), np.where(other, q, pp), ok & ~other
    else:
        other = np.zeros(len(pp), bool)
    k0 = k0 if informed else np.zeros(len(pp), np.int64)
    T, jL = np.zeros(len(pp)), np.zeros(len(pp), np.int64)
    for k in np.unique(k0):
        group = k0 == k
        tables = grid.job_tables(plan, int(k), N0) if informed else plan
        T[group], jL[group] = decide(plan, tables, pp[group], rng)
    if false_certificates:
        accuracy = [float(np.mean((~other & (jL >= j)) | (other & (jL >= 0)))) for j in range(len(plan["radii"]))]
    else:
        accuracy = [float(np.mean(ok & (jL >= j))) for j in range(len(plan["radii"]))]
    draws = T.reshape(-1, reps)
    return (draws if per_run else draws.mean(1) if per_example else float(np.mean(T))), accuracy


def mean_se(runs):
    """The mean of per-run draws (examples, reps) over everything and its Monte Carlo standard error: the
    examples are fixed (their pA the truth), so the error is the runs' own, sqrt(sum_i var_i / reps) / n from
    each example's variance over its runs (nan with one run an example)."""
    runs = np.asarray(runs, float)
    n, reps = runs.shape
    se = math.sqrt(runs.var(axis=1, ddof=1).sum() / reps) / n if reps > 1 else math.nan
    return float(runs.mean()), se


def ratio_se(a, se_a, b, se_b):
    """a / b and its standard error (delta method; a and b from independent runs)."""
    return a / b, a / b * math.sqrt((se_a / a) ** 2 + (se_b / b) ** 2)


def decide(plan, tables, pp, rng):
    """Estimation draws and certified level of one simulated run per true pA in pp, with the given tables."""
    checks = np.array(plan["checks"])
    steps = np.diff(np.concatenate([[0], checks]))
    K, n = len(plan["radii"]), len(pp)
    A = np.cumsum(rng.binomial(steps[None, :], pp[:, None]), axis=1)          # votes for cA at every check
    jL, jU = np.full(n, -1), np.full(n, K - 1)
    T, live = np.full(n, checks[-1]), np.ones(n, bool)
    for i, t in enumerate(checks):
        a = A[:, i]
        cert = (a[:, None] >= tables["lower"][:, i][None, :])
        if i == len(checks) - 1 and live.any():   # the exact accounting only where a run reached the budget
            cert |= a[:, None] >= grid.final_look_tables(plan, tables)["final"][None, :]
        level = np.where(cert.any(1), K - 1 - np.argmax(cert[:, ::-1], axis=1), -1)
        jL = np.where(live, np.maximum(jL, level), jL)
        jU = np.where(live, np.minimum(jU, (a[:, None] > tables["upper"][:, i][None, :]).sum(1) - 1), jU)
        if i == len(checks) - 1:
            break
        nxt = np.minimum(jL + 1, K - 1)
        decided = (jL >= jU) | (jL + 1 == K)
        curtailed = (a - t < tables["reach"][nxt, i]) & (a + checks[-1] - t < tables["final_bound"][nxt])
        stop = live & (decided | curtailed)
        T = np.where(stop, t, T)
        live &= ~stop
    return T, jL


def draws_at(pAs, radii, sigma, N, N0, alpha, reps, seeds):
    """Mean estimation draws per example at each true pA: the rule against the oracle, Ville's (rule-out at
    1 / beta) and the one whose rule-out spends beta exactly (as the rule's do); each a mean over the seeds
    (`reps` runs each) with its standard error over them."""
    import bench
    from scipy.stats import norm
    beta = grid.DEFAULT_BETA
    plan = grid.grid_plan(radii, sigma, N, alpha, beta, True)
    thresholds = norm.cdf(np.array(plan["radii"]) / sigma)
    lines = []
    for p in pAs:
        runs = np.array([(simulate(plan, np.array([p]), np.array([True]), reps, seed, N0)[0],
                          bench.oracle_draws([p], thresholds, alpha, beta, N, runs=reps, seed=seed)[0][0],
                          bench.oracle_draws([p], thresholds, alpha, beta, N, runs=reps, seed=seed,
                                             exact_beta=True)[0][0]) for seed in seeds])
        columns = [runs[:, 0], runs[:, 1], runs[:, 2], runs[:, 0] / runs[:, 1], runs[:, 0] / runs[:, 2]]
        se = [c.std(ddof=1) / np.sqrt(len(seeds)) if len(seeds) > 1 else np.nan for c in columns]
        lines.append(f"| {p:g} | " + " | ".join(f"{c.mean():,.0f} ± {e:,.0f}" for c, e in zip(columns[:3], se[:3]))
                     + " | " + " | ".join(f"{c.mean():.3f} ± {e:.3f}" for c, e in zip(columns[3:], se[3:])) + " |\n")
    return (f"Estimation draws per example (the N0 = {N0} selection draws not included) of --radii "
            f"{' '.join(f'{r:g}' for r in radii)} at sigma {sigma:g}, N_max {N:,}, alpha {alpha:g}, beta {beta:g}: "
            f"mean ± standard error over {len(seeds)} seeds ({', '.join(map(str, seeds))}) of {reps:,} simulated "
            f"runs each; each run selects its candidate as the argmax of N0 votes (pA against a second class of "
            f"1 - pA). The rule: {grid.GRID_TEST} (tests on looks from {grid.LOOK_FIRST} draws growing by "
            f"{100 * (grid.LOOK_GROWTH - 1):g} %, at most {grid.LOOK_MAX_GAP} apart; each rule-out at the "
            f"level whose exact error is beta). The oracles: Wald's SPRTs at the known pA, a look after every draw "
            f"(bench.oracle_draws), certifying at Ville's 1 / alpha; the Ville oracle rules out at 1 / beta, the "
            f"exact-beta oracle at the bound whose exact error is beta (bench.exact_ruleout_bound), as the rule's "
            f"rule-outs. The ratios are taken seed by seed.\n\n"
            "| pA | rule | oracle, Ville | oracle, exact beta | rule / Ville oracle | rule / exact-beta oracle |\n"
            "|---|---|---|---|---|---|\n" + "".join(lines))


def savings(args):
    """Mean model evaluations per example of the grid, one radius and r = 0.5 alone (the arms of tools/bench.py g),
    simulated on the log's pA, with the saving against CERTIFY and the ratio to the oracle's draws."""
    import bench
    sigma, pA, correct, n_log = read_truth(args.log)
    arms = {"grid": dict(radii=args.radii), "single radius 0.5": dict(radii=[0.5]),
            "r = 0.5 alone": dict(radii=[0.5], zero_level=False)}
    lines = []
    for name, arm in arms.items():
        plan = grid.grid_plan(arm["radii"], sigma, args.N, args.alpha, grid.DEFAULT_BETA, True,
                              zero_level=arm.get("zero_level", True))
        runs, _ = simulate(plan, pA, correct, args.reps, args.seed, args.N0, per_run=True)
        each, (draws, draws_se) = runs.mean(1), mean_se(runs)
        oracle_runs, capped = bench.oracle_draws(pA, plan["taus"], args.alpha, grid.DEFAULT_BETA, args.N,
                                                 runs=args.reps, seed=args.seed, per_run=True)
        oracle_each, (oracle, oracle_se) = oracle_runs.mean(1), mean_se(oracle_runs)
        kept = capped == 0   # kept: no oracle run of the example reached N_max
        x_oracle, x_se = ratio_se(draws, draws_se, oracle, oracle_se)
        measured = ""
        if args.estimates:   # tools/bench.py's way: the oracle, and which examples it cuts, at an estimate of pA
            rng, ratios = np.random.default_rng(args.seed + 1), []
            for k in range(args.estimates):
                estimate = rng.binomial(n_log.astype(np.int64), pA) / n_log   # another CERTIFY run's nA / N
                at, cut = bench.oracle_draws(estimate, plan["taus"], args.alpha, grid.DEFAULT_BETA, args.N,
                                             runs=args.reps, seed=args.seed)   # the oracle's noise as above
                ratios.append(each[cut == 0].mean() / at[cut == 0].mean() if (cut == 0).any() else np.nan)
            measured = f" {np.mean(ratios):.2f} [{np.min(ratios):.2f}, {np.max(ratios):.2f}] |"
        evaluations = args.N0 + draws
        lines.append(f"| {name} | {evaluations:,.0f} ± {draws_se:,.0f} | **{(args.N0 + args.N) / evaluations:.1f}x** | "
                     f"{x_oracle:.2f} ± {x_se:.2f} | "
                     f"{each[kept].mean() / oracle_each[kept].mean() if kept.any() else np.nan:.2f} "
                     f"({int((~kept).sum())}) | "
                     f"{args.N0 + oracle:,.0f} ± {oracle_se:,.0f} | {(args.N0 + args.N) / (args.N0 + oracle):.1f}x |"
                     f"{measured}\n")
    return (f"Simulated on the {len(pA)} examples of {args.log} (each example's pA: the log's nA / N, taken as the "
            f"truth; {args.reps} runs an example, each selecting its candidate from N0 = {args.N0} votes): mean model "
            f"evaluations per example (N0 included), how many times fewer than CERTIFY at N = {args.N:,} "
            f"(N0 + N = {args.N0 + args.N:,}), and the estimation draws over the oracle's (bench.oracle_draws, Wald's "
            f"SPRTs at each pA, a look after every draw; {args.reps} runs an example). sigma {sigma:g}, N_max "
            f"{args.N:,}, alpha {args.alpha:g}, beta {grid.DEFAULT_BETA:g}; the grid: --radii "
            f"{' '.join(f'{r:g}' for r in args.radii)}; the rule: {grid.GRID_TEST}. ± gives the Monte Carlo "
            f"standard error of the simulation (the examples' pA fixed: from each example's variance over its "
            f"runs; the ratio's by the delta method).\n\n"
            f"The oracle's own evaluations (N0 + its draws) and saving: the reference (per level, no test with the "
            f"same error and power at that pA needs fewer draws on average: Wald and Wolfowitz); its runs undecided at "
            f"N_max are counted as N_max, which only raises its saving; the ratio without the examples of which some oracle "
            f"run reached N_max (those next to a threshold) is given beside."
            + (f" The last column is that ratio as tools/bench.py measures it, the oracle and its cut taken at an estimate "
               f"of pA (nA / N of an independent CERTIFY run with the log's N, drawn {args.estimates} times: mean "
               f"[smallest, largest]) while the rule runs at the true pA: it differs from the known-truth ratio "
               f"by the estimate's error alone." if args.estimates else "") + "\n\n"
            "| arm | evaluations | saving | x the oracle | x the oracle without the examples it cuts (how many) | "
            "oracle: evaluations | oracle: saving |"
            + (" the same ratio, the oracle at an estimate of pA |\n|---" if args.estimates else "\n")
            + "|---|---|---|---|---|---|---|\n" + "".join(lines))


def budgets(args):
    """The grid of --radii (with --no-zero-level: those radii alone) on each budget N_max of --budgets and on --N,
    simulated on the log's pA: mean model evaluations, the saving against CERTIFY at --N, certified accuracy at
    each radius against the run on --N, and the oracle cut at the same budget. The guarantee holds on any
    budget; a smaller one gives up the certificates of examples whose pA lies next to a threshold."""
    import bench
    sigma, pA, correct, _ = read_truth(args.log)
    rows = []
    for n_max in sorted({args.N, *args.budgets}, reverse=True):
        plan = grid.grid_plan(args.radii, sigma, n_max, args.alpha, grid.DEFAULT_BETA, True,
                                 zero_level=not args.no_zero_level)
        runs, acc = simulate(plan, pA, correct, args.reps, args.seed, args.N0, per_run=True)
        oracle_runs = bench.oracle_draws(pA, plan["taus"], args.alpha, grid.DEFAULT_BETA, n_max, runs=args.reps,
                                         seed=args.seed, per_run=True)[0]
        (draws, se), (oracle, oracle_se) = mean_se(runs), mean_se(oracle_runs)
        rows.append((n_max, args.N0 + draws, se, acc, args.N0 + oracle, ratio_se(draws, se, oracle, oracle_se)))
    base = next(acc for n_max, _, _, acc, _, _ in rows if n_max == args.N)   # the changes: against the run on --N
    radii = plan["radii"]
    return (f"certify.py --radii {' '.join(f'{r:g}' for r in args.radii)}"
            f"{' --no-zero-level' if args.no_zero_level else ''} on each budget N_max (sigma {sigma:g}, alpha "
            f"{args.alpha:g}, beta {grid.DEFAULT_BETA:g}, {grid.GRID_TEST}), simulated on the {len(pA)} "
            f"examples of {args.log} (each example's pA: the log's nA / N, taken as the truth; {args.reps} runs an "
            f"example, each selecting its candidate from N0 = {args.N0} votes): mean model evaluations per example "
            f"(N0 included), how many times fewer than CERTIFY at N = {args.N:,} (N0 + N = {args.N0 + args.N:,}), "
            f"certified accuracy (%) at each radius and its change (points) against N_max = {args.N:,}, and the "
            f"oracle (bench.oracle_draws: Wald's SPRTs at each pA, a look after every draw, a run undecided at the "
            f"budget counted there) on the same budget; ± the simulation's Monte Carlo standard error (the "
            f"examples' pA fixed; the ratio's by the delta method).\n\n"
            "| N_max | evaluations | saving | x the oracle | oracle: saving | "
            + " | ".join(f"r = {r:g}" for r in radii) + " | " + " | ".join(f"change at r = {r:g}" for r in radii)
            + " |\n|" + "---|" * (5 + 2 * len(radii)) + "\n"
            + "".join(f"| {n:,} | {e:,.0f} ± {se:,.0f} | {(args.N0 + args.N) / e:.1f}x | {x:.2f} ± {x_se:.2f} | "
                      f"{(args.N0 + args.N) / o:.1f}x | " + " | ".join(f"{100 * a:.2f}" for a in acc) + " | "
                      + " | ".join(f"{100 * (a - b):+.2f}" for a, b in zip(acc, base)) + " |\n"
                      for n, e, se, acc, o, (x, x_se) in rows))


def emit(args, name, md):
    """Print a mode's Markdown and, with --out, write it there as `name`."""
    print(md)
    if args.out:
        machinery.write_text_output(os.path.join(args.out, name), "beta curve", md)


def main(argv=None):
    p = machinery.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log", help="a CERTIFY log at a large N (its nA / N is taken as the true pA of cA)")
    p.add_argument("--radii", type=float, nargs="+", required=True, help="the grid, as certify.py --radii")
    p.add_argument("--N", type=int, default=100_000, help="the grid's budget N_max (default 100,000)")
    p.add_argument("--N0", type=int, default=100, help="selection draws counted per example (default 100)")
    p.add_argument("--alpha", type=float, default=0.001)
    p.add_argument("--reps", type=int, default=20, help="simulated runs per example (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="+", help="with --at-pA: the seeds, each a run of --reps per pA "
                   "(default 0 1 2 3 4: the tables give the mean and its standard error over them)")
    p.add_argument("--out", help="folder for beta_curve.tsv, .md and .png")
    p.add_argument("--at-pA", type=float, nargs="+", metavar="P", help="instead: mean draws at these true pA, the "
                   "rule against the oracles (the log is then "
                   "unused but for its sigma; --out: draws_at_pA.md)")
    p.add_argument("--savings", action="store_true", help="instead: the arms of tools/bench.py g (the grid, one radius "
                   "0.5, r = 0.5 alone), simulated on the log's pA (--out: savings.md)")
    p.add_argument("--estimates", type=int, metavar="K", help="with --savings: also the oracle ratio "
                   "without the cut examples as tools/bench.py measures it, the oracle at K independent estimates of pA")
    p.add_argument("--budgets", type=int, nargs="+", metavar="N_MAX", help="instead: the grid on each of these "
                   "budgets N_max and on --N, its saving against CERTIFY at --N and its certified accuracy against "
                   "the run on --N, simulated on the log's pA (--out: budgets.md)")
    p.add_argument("--no-zero-level", action="store_true", help="with --budgets: decide the radii alone, not r = 0 "
                   "(as certify.py --no-zero-level)")
    args = p.parse_args(argv)
    modes = [f"--{m.replace('_', '-')}" for m in ("savings", "at_pA", "budgets") if getattr(args, m)]
    common.check(len(modes) <= 1, f"{' and '.join(modes)} are {len(modes)} modes; give one")
    machinery.check_mode_options(args, {"estimates": ["savings"], "seeds": ["at_pA"]})
    common.check(not args.no_zero_level or args.budgets, "--no-zero-level goes with --budgets")
    args.seeds = [0, 1, 2, 3, 4] if args.seeds is None else args.seeds
    args.estimates = 0 if args.estimates is None else args.estimates
    common.check(args.estimates >= 0 and args.N0 >= 0, "--estimates and --N0 must be >= 0")
    common.check(args.N >= 1 and args.reps >= 1 and 0 < args.alpha < 1,
                 "--N and --reps must be >= 1 and --alpha in (0, 1)")
    common.check(len(set(args.seeds)) == len(args.seeds), f"--seeds repeats a seed ({args.seeds})")
    machinery.set_inputs([args.log, args.log + ".json"])
    if args.budgets:
        common.check(all(n >= 1 for n in args.budgets), "--budgets values must be >= 1")
        return emit(args, "budgets.md", budgets(args))
    if args.savings:
        return emit(args, "savings.md", savings(args))
    if args.at_pA:
        common.check(all(0 <= q <= 1 for q in args.at_pA), "--at-pA values must lie in [0, 1]")
        sigma = readers.read_sidecar(args.log, required=("sigma",))["sigma"]
        return emit(args, "draws_at_pA.md", draws_at(args.at_pA, args.radii, sigma, args.N, args.N0, args.alpha,
                                                      args.reps, args.seeds))
    sigma, pA, correct, _ = read_truth(args.log)
    rows, base = [], None
    for beta in BETAS:
        plan = grid.grid_plan(args.radii, sigma, args.N, args.alpha, beta, True)
        runs, acc = simulate(plan, pA, correct, args.reps, args.seed, args.N0, per_run=True)
        draws, se = mean_se(runs)
        base = base or (draws, acc)
        lost = max(100 * (b - a) for a, b in zip(acc, base[1]))
        rows.append([beta, args.N0 + draws, se, (args.N0 + args.N) / (args.N0 + draws), lost] + [100 * a for a in acc])
    radii = plan["radii"]
    header = ["beta", "evaluations", "evaluations_se", "x_fewer_than_certify", "max_points_lost"] + \
        [f"acc_r{r:g}" for r in radii]
    tsv = "\n".join(["\t".join(header)] + ["\t".join(f"{v:.6g}" for v in row) for row in rows]) + "\n"
    md = (f"beta of certify.py --radii {' '.join(f'{r:g}' for r in args.radii)} (sigma {sigma:g}, N_max {args.N:,}, "
          f"alpha {args.alpha:g}), simulated on the true pA of the {len(pA)} examples of {args.log} "
          f"({args.reps} runs each): mean model evaluations per example (N0 = {args.N0} included), how many "
          f"times fewer than CERTIFY at N = {args.N:,}, and the largest loss of certified accuracy (points, at "
          f"any grid radius) against beta = 0; ± the simulation's Monte Carlo standard error (the examples' pA "
          f"fixed).\n\n| beta | evaluations | x fewer | max points lost | " +
          " | ".join(f"r = {r:g}" for r in radii) + " |\n|" + "---|" * (4 + len(radii)) + "\n" +
          "".join(f"| {r[0]:g} | {r[1]:,.0f} ± {r[2]:,.0f} | {r[3]:.2f} | {r[4]:.3f} | " +
                  " | ".join(f"{a:.1f}" for a in r[5:]) + " |\n" for r in rows))
    print(md)
    if args.out:
        machinery.write_text_output(os.path.join(args.out, "beta_curve.tsv"), "beta curve", tsv)
        machinery.write_text_output(os.path.join(args.out, "beta_curve.md"), "beta curve", md)
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5, 3.4), layout="constrained")
        ax.plot([r[4] for r in rows], [r[3] for r in rows], marker="o")
        for r in rows:
            ax.annotate(f"{r[0]:g}", (r[4], r[3]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set(xlabel="certified accuracy lost (points, worst radius)", ylabel="x fewer evaluations than CERTIFY",
               title=f"beta of --radii (sigma {sigma:g})")
        ax.grid(alpha=0.3)
        machinery.write_output(os.path.join(args.out, "beta_curve.png"), "beta curve",
                               lambda f: fig.savefig(f, format="png", dpi=150))
        print(f"wrote {args.out}/beta_curve.tsv, .md, .png")


if __name__ == "__main__":
    machinery.run(main, exit_process=True)

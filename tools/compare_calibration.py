"""Calibration of `analyze.py compare` against known truths: false alarms under the null, simultaneous and per-row
coverage of the true difference, and power, in scenarios that vary what the intervals must handle.

Each scenario simulates certification logs as CERTIFY writes them: an image's probability pA of its true class
under noise is sigmoid(logit(p0) + shift + seed + interaction), p0 from a scenario's distribution, shift 0 for A
and for B under the null, `shift` for B under the alternative; a training seed adds a shift ~ N(0, tau^2) to all
images and an interaction ~ N(0, omega^2) to each; the votes are nY ~ Binomial(N, pA); the class is the true
one when pA > 1/2 (else a wrong one, certified from its own votes), and the radius is Cohen's. The truth of a
row is its expectation over images, seeds and votes (--over images: 2,000,000 simulated images with the exact
vote probabilities), or over the votes on the fixed images of the scenario (--over test-set: exact).

Matched seeds (the seed study): seed j of both sides is training seed j, recorded in the logs' settings so that
compare pairs the seeds; its shift and interaction are correlated rho across the sides. --rich-seeds and
--ignore-train-seeds calibrate compare under another seed rule on the same simulated logs.

    python tools/compare_calibration.py --out results/compare_calibration
"""
import argparse
import multiprocessing
import os
import shlex
import signal
import sys
import time

import numpy as np
from scipy.special import expit, logit
from scipy.stats import binom

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import analyze  # noqa: E402
import compare  # noqa: E402
import common  # noqa: E402
import machinery  # noqa: E402

ALPHA, SIGMA, RADII, LEVEL = 0.001, 0.5, [0.25, 0.5, 0.75, 1.0, 1.5], 0.95
PAIR_SEEDS = True   # False (--ignore-train-seeds): the logs record no training seed, so matched seeds go unpaired
P0 = {   # the distribution of p0 (pA before the shifts)
    "u-shaped": lambda rng, n: rng.beta(0.2, 0.2, n),
    "near-half": lambda rng, n: rng.beta(30, 30, n),
    "mostly-one": lambda rng, n: rng.beta(8, 0.3, n),
}

# name: (p0, paired, counts, N, seeds, images, over, tau, omega, shift under the alternative, rho: None where
# the sides' seeds are unrelated (no training seed recorded), else seed j of both sides is training seed j,
# its shift and interaction correlated rho across the sides)
SCENARIOS = {
    "cifar paired": ("cifar", True, True, 10 ** 5, 1, 500, "images", 0, 0.5, 0.5, None),
    "u-shaped paired": ("u-shaped", True, True, 10 ** 5, 1, 500, "images", 0, 0.5, 0.5, None),
    "near-half paired N=1e4": ("near-half", True, True, 10 ** 4, 1, 500, "images", 0, 0.5, 0.3, None),
    "mostly-one paired (rare rows)": ("mostly-one", True, True, 10 ** 5, 1, 500, "images", 0, 0.5, 0.5, None),
    "cifar unpaired": ("cifar", False, True, 10 ** 5, 1, 500, "images", 0, 0.5, 0.5, None),
    "cifar paired, Cohen columns only": ("cifar", True, False, 10 ** 5, 1, 500, "images", 0, 0.5, 0.5, None),
    "cifar paired, 2 seeds": ("cifar", True, True, 10 ** 5, 2, 500, "images", 0.15, 0.5, 0.5, None),
    "cifar paired, 3 seeds": ("cifar", True, True, 10 ** 5, 3, 500, "images", 0.15, 0.5, 0.5, None),
    "cifar paired, 5 seeds": ("cifar", True, True, 10 ** 5, 5, 500, "images", 0.15, 0.5, 0.5, None),
    "cifar paired, 10,000 images": ("cifar", True, True, 10 ** 5, 1, 10_000, "images", 0, 0.5, 0.15, None),
    "cifar paired, 2 seeds, 10,000 images": ("cifar", True, True, 10 ** 5, 2, 10_000, "images", 0.05, 0.5, 0.3, None),
    "test-set: cifar, one model twice": ("cifar", True, True, 10 ** 5, 1, 500, "test-set", 0, 0, 0.1, None),
    "test-set: near-half N=1e4, Cohen columns": ("near-half", True, False, 10 ** 4, 1, 500, "test-set", 0, 0,
                                                 0.05, None),
    # the seed study (results/compare_calibration/seeds): named with --scenarios, not run by default
    "cifar paired, 5 seeds, shift 0.25": ("cifar", True, True, 10 ** 5, 5, 500, "images", 0.15, 0.5, 0.25, None),
    "mostly-one paired, 5 seeds (rare rows)": ("mostly-one", True, True, 10 ** 5, 5, 500, "images", 0.15, 0.5, 0.5,
                                               None),
    "cifar paired, 2 matched seeds": ("cifar", True, True, 10 ** 5, 2, 500, "images", 0.15, 0.5, 0.5, 0.85),
    "cifar paired, 3 matched seeds": ("cifar", True, True, 10 ** 5, 3, 500, "images", 0.15, 0.5, 0.5, 0.85),
    "cifar paired, 5 matched seeds": ("cifar", True, True, 10 ** 5, 5, 500, "images", 0.15, 0.5, 0.5, 0.85),
    "cifar paired, 5 matched seeds, shift 0.25": ("cifar", True, True, 10 ** 5, 5, 500, "images", 0.15, 0.5, 0.25,
                                                 0.85),
    "cifar paired, 5 matched seeds, uncorrelated": ("cifar", True, True, 10 ** 5, 5, 500, "images", 0.15, 0.5, 0.5,
                                                    0.0),
}


DEFAULT = list(SCENARIOS)[:13]   # the general scenarios: images, counts, budgets, modes, a few seeds


def scenario_p0(name, rng, n):
    """p0 of n images from the scenario's distribution, kept away from 0 and 1 for the logit."""
    if name == "cifar":
        kind = rng.choice(3, size=n, p=[0.3, 0.4, 0.3])
        p = np.select([kind == 0, kind == 1], [rng.beta(0.3, 5, n), rng.beta(5, 0.3, n)], rng.uniform(size=n))
    else:
        p = P0[name](rng, n)
    return np.clip(p, 1e-9, 1 - 1e-9)


def pA_of(p0, shift, tau, omega, rng, per_image_seed=False):
    """pA of each image for one training seed (per_image_seed: a new seed per image, for the truth)."""
    n = len(p0)
    seed = rng.normal(0, tau, n if per_image_seed else 1) if tau else 0.0
    inter = rng.normal(0, omega, n) if omega else 0.0
    return expit(logit(p0) + shift + seed + inter)


def certify_log(pA, N, counts, rng, z, idx, path):
    """The log CERTIFY writes for images with these pA (see the module's docstring)."""
    n = len(pA)
    nY = rng.binomial(N, pA)
    right = pA > 0.5
    nA = np.where(right, nY, rng.binomial(N, np.minimum(0.8 * (1 - pA), 0.5)))
    zz = z[nA]
    predict = np.where(np.isfinite(zz), np.where(right, 0, 1), -1)
    log = {"path": path, "idx": idx, "y": np.zeros(n, dtype=np.int64), "predict": predict,
           "radius": np.round(np.where(np.isfinite(zz), SIGMA * zz, 0.0), 3 if not counts else 12),
           "correct": predict == 0, "sigma": SIGMA, "sidecar": {"alpha": ALPHA, "N": N}, "grid": False,
           "label_mode": False}
    if counts:
        log.update(nA=nA, N=np.full(n, N), nY=nY)
    return log


def expected_rows(pA, N, counts, z, rng=None):
    """{row: mean over these images of the row's expectation over the votes}: exact vote probabilities for the
    0/1 rows; ACR exact per image, or from one draw of votes per image with `rng` (a large population)."""
    right = pA > 0.5
    out = {}
    thresholds = {"clean accuracy": analyze.min_count(0.0, N, ALPHA, SIGMA)}
    thresholds.update({f"certified accuracy r={r:g}": analyze.min_count(r, N, ALPHA, SIGMA) for r in RADII})
    for name, t in thresholds.items():
        out[name] = float(np.mean(np.where(right, binom.sf(t - 1, N, pA), 0.0)))
    if rng is None:
        out["ACR"] = float(np.sum(compare.radius_moments(pA[right], N, z, SIGMA)[0])) / len(pA)
    else:
        out["ACR"] = float(np.mean(np.where(right, SIGMA * np.maximum(z[rng.binomial(N, pA)], 0.0), 0.0)))
    if counts:
        for name, test in analyze.SHARES:
            t = compare.count_threshold(test, N) if not name.startswith("P(pA<") else \
                compare.count_threshold(lambda p: ~test(p), N)
            above = binom.sf(t - 1, N, pA)
            out[name] = float(np.mean(1 - above if name.startswith("P(pA<") else above))
    return out


def truth(spec, z, rng, images=None):
    """{row: B - A}: over images (a large population, a new seed per image) or on the fixed `images` (p0)."""
    p0_name, paired, counts, N, k, n, over, tau, omega, shift, rho = spec
    out = {}
    for which, s in (("null", 0.0), ("alternative", shift)):
        if over == "images":
            rows = {}
            for _ in range(4):   # 4 x 100,000 images with exact vote probabilities; ACR by votes drawn
                p0 = scenario_p0(p0_name, rng, 100_000)
                ra = expected_rows(pA_of(p0, 0.0, tau, omega, rng, True), N, counts, z, rng)
                rb = expected_rows(pA_of(p0, s, tau, omega, rng, True), N, counts, z, rng)
                for key in ra:
                    rows[key] = rows.get(key, 0.0) + (rb[key] - ra[key]) / 4
        else:
            ea, eb = expected_rows(images, N, counts, z), expected_rows(expit(logit(images) + s), N, counts, z)
            rows = {key: eb[key] - ea[key] for key in ea}
        out[which] = rows
    out["null"] = {key: 0.0 for key in out["null"]} if over == "images" else out["null"]
    return out


def matched_sides(p0a, p0b, s, tau, omega, rho, k, rng):
    """pA of the k seeds of each side when seed j of both is training seed j: its shift and its interaction
    correlated rho across the sides (one draw each, B's the same mixed with a fresh one)."""
    out_a, out_b = [], []
    for _ in range(k):
        seed_a, inter_a = rng.normal(0, tau), rng.normal(0, omega, len(p0a))
        seed_b = rho * seed_a + np.sqrt(1 - rho ** 2) * rng.normal(0, tau)
        inter_b = rho * inter_a + np.sqrt(1 - rho ** 2) * rng.normal(0, omega, len(p0b))
        out_a.append(expit(logit(p0a) + seed_a + inter_a))
        out_b.append(expit(logit(p0b) + s + seed_b + inter_b))
    return out_a, out_b


def one_run(spec, z, rng, s, images, family=None):
    """compare.compare_sides on one simulated pair of sides: ({row: (low, high, verdict)} of the family's rows
    (all rows without one: the rows outside a family are exploratory, not part of what is calibrated), each
    side's per-seed ACR)."""
    p0_name, paired, counts, N, k, n, over, tau, omega, shift, rho = spec
    p0a = images if images is not None else scenario_p0(p0_name, rng, n)
    p0b = p0a if paired else scenario_p0(p0_name, rng, n)
    idx_a = np.arange(n)
    idx_b = idx_a if paired else idx_a + n
    if rho is None:
        pa = [pA_of(p0a, 0.0, tau, omega, rng) for j in range(k)]
        pb = [pA_of(p0b, s, tau, omega, rng) for j in range(k)]
    else:
        pa, pb = matched_sides(p0a, p0b, s, tau, omega, rho, k, rng)
    side_a = [certify_log(p, N, counts, rng, z, idx_a, f"a{j}") for j, p in enumerate(pa)]
    side_b = [certify_log(p, N, counts, rng, z, idx_b, f"b{j}") for j, p in enumerate(pb)]
    if rho is not None and PAIR_SEEDS:   # the settings files record the training seeds: compare pairs the seeds
        for j in range(k):
            side_a[j]["sidecar"]["train_seed"] = side_b[j]["sidecar"]["train_seed"] = j
    names = [m for m, *_ in compare.compare_sides(side_a[:1], side_a[:1], RADII, LEVEL)[0]] if family else None
    claim = None if family is None else [m for m in family if m in names or m == "ACR"]   # rows these logs have
    rows, facts = compare.compare_sides(side_a, side_b, RADII, LEVEL,
                                        None if over == "images" else compare.test_set_votes(), claim)
    acr = [np.array([np.where(log["correct"], log["radius"], 0.0).mean() for log in side]) for side in (side_a, side_b)]
    return {m: (lo, hi, v) for m, _, _, _, lo, hi, v in rows
            if facts["roles"].get(m) != "exploratory" or not family}, acr


def run_scenario(name, spec, runs, seed, family=None):
    """Counts of false alarms, misses of the truth (any row and per row), rejections and true effects found
    (a verdict of the true sign on a row whose true difference is not 0), under both hypotheses."""
    rng = np.random.default_rng(seed)
    N, over = spec[3], spec[6]
    z = compare.z_table(N, ALPHA)
    images = scenario_p0(spec[0], rng, spec[5]) if over == "test-set" else None
    true = truth(spec, z, rng, images)
    result = {}
    for which, s in (("null", 0.0), ("alternative", spec[9])):
        tally = {"runs": 0, "any_miss": 0, "any_flag": 0, "miss": {}, "flag": {}, "seen": {}, "effects": 0,
                 "found": 0}
        for _ in range(runs):
            found, acr = one_run(spec, z, rng, s, images, family)
            if spec[4] > 1:    # the seed spread of ACR: each side's SD over its seeds, and that of B - A
                tally["seed_sd"] = tally.get("seed_sd", 0.0) + float(acr[0].std(ddof=1))
                tally["diff_sd"] = tally.get("diff_sd", 0.0) + float((acr[1] - acr[0]).std(ddof=1))
            misses = [m for m, (lo, hi, v) in found.items() if m in true[which] and not lo <= true[which][m] <= hi]
            tally["runs"] += 1
            tally["any_miss"] += bool(misses)
            tally["any_flag"] += any(v != "within noise" for _, _, v in found.values())
            for m, (lo, hi, v) in found.items():
                effect = true[which].get(m, 0.0)
                if abs(effect) > 1e-12:
                    tally["effects"] += 1
                    tally["found"] += v == ("higher" if effect > 0 else "lower")
                tally["seen"][m] = tally["seen"].get(m, 0) + 1
                tally["miss"][m] = tally["miss"].get(m, 0) + (m in misses)
                tally["flag"][m] = tally["flag"].get(m, 0) + (v != "within noise")
        result[which] = tally
    result["truth"] = true["alternative"]
    print(f"{name}: done", file=sys.stderr, flush=True)
    return result


def wilson95(k, n):
    """A 95 % Wilson interval for a rate k / n, in the report's format."""
    lo, hi = common.wilson(k / n, n, 1.959964)
    return f"{k / n:.3f} [{lo:.3f}, {hi:.3f}]"


def calibration_report(results, command, seconds, jobs, family=None):
    """report.md: the targets with the power beside them, then per-row coverage and power."""
    lines = ["# Calibration of `analyze.py compare`", "",
             f"Command: `{command}` ({seconds / 60:.1f} min with {jobs} process{'es' if jobs > 1 else ''} on "
             f"{os.cpu_count()} CPU cores). Level 0.95; radii {', '.join(map(str, RADII))}; α = {ALPHA}; "
             "σ = 0.5. Rates with their 95 % Wilson interval (Monte Carlo error). Targets: family-wise error under "
             "the null ≤ 0.05, simultaneous coverage of the true difference under the alternative ≥ 0.94: `hold` "
             "where both estimates meet them, `hold within Monte Carlo error` where an estimate misses but its 95 % "
             "interval contains the target, `MISSED` where the interval excludes it. The Bonferroni construction "
             "promises at least 0.95 coverage, so estimates scatter around 0.95-0.99 by design. " +
             (f"The family: {', '.join(family)} (the rows a scenario's logs have), declared as `compare --family` "
              "does: Bonferroni intervals, Holm's step-down verdicts; the other rows are exploratory and not counted "
              "here. " if family else "The family: every row (Bonferroni intervals and verdicts). ") +
             f"compare's seed rule: one t critical value and no floor on 0/1 rows from {compare.RICH_SEEDS} seeds a "
             "side on; matched seeds " + ("paired (their training seeds recorded). " if PAIR_SEEDS else
                                          "compared unpaired (no training seed recorded). ") +
             "Power: the share of the family's rows with a true difference (under the alternative) that get the "
             "verdict of its sign; beside it the effect it holds for (the true ΔACR of the alternative; every "
             "row's in the power table below) and the seed spread (the SD of a side's per-seed ACR over its seeds, "
             "and of the per-seed differences B − A, each the mean over the alternative's runs). Seeds `matched`: "
             "seed j of both sides is training seed j (recorded in the logs' settings, so compare pairs the "
             "seeds), its logit shift and interaction correlated ρ across the sides.", "",
             "| scenario | p0 | paired | nA N nY | N | seeds | images | over | runs | family-wise error (null) | "
             "simultaneous coverage (alternative) | power | ΔACR | seed SD of ACR: a side / B − A | targets |",
             "|---" * 15 + "|"]
    holds_all = True
    for name, r in results.items():
        p0_name, paired, counts, N, k, n, over, tau, omega, shift, rho = SCENARIOS[name]
        null, alt = r["null"], r["alternative"]
        fwer, cover = null["any_flag"] / null["runs"], 1 - alt["any_miss"] / alt["runs"]
        fwer_low = common.wilson(fwer, null["runs"], 1.959964)[0]
        cover_high = common.wilson(cover, alt["runs"], 1.959964)[1]
        word = ("hold" if fwer <= 0.05 and cover >= 0.94 else "hold within Monte Carlo error"
                if fwer_low <= 0.05 and cover_high >= 0.94 else "MISSED")
        holds_all &= word != "MISSED"
        lines.append(f"| {name} | {p0_name} | {'yes' if paired else 'no'} | {'yes' if counts else 'no'} | {N:,} | "
                     f"{k}{'' if rho is None else f' matched (ρ {rho:g})'} | {n:,} | {over} | {null['runs']} | "
                     f"{wilson95(null['any_flag'], null['runs'])} | "
                     f"{wilson95(alt['runs'] - alt['any_miss'], alt['runs'])} | "
                     f"{wilson95(alt['found'], alt['effects']) if alt['effects'] else 'n/a'} | "
                     f"{r['truth']['ACR']:+.3f} | " +
                     (f"{alt['seed_sd'] / alt['runs']:.3f} / {alt['diff_sd'] / alt['runs']:.3f}" if k > 1 else "") +
                     f" | {word} |")
    lines += ["", f"No target missed beyond Monte Carlo error: {'yes' if holds_all else 'no'}.", "",
              "## Per-row coverage of the true difference under the alternative (each row alone; the family's "
              "Bonferroni share is 0.95 / rows, so each should be near 1)", ""]
    rows = list(dict.fromkeys(m for r in results.values() for m in r["alternative"]["seen"]))
    lines += ["| scenario | " + " | ".join(rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for name, r in results.items():
        alt = r["alternative"]
        cell = lambda m: f"{1 - alt['miss'][m] / alt['seen'][m]:.3f}" if m in alt["seen"] else ""
        lines.append(f"| {name} | " + " | ".join(cell(m) for m in rows) + " |")
    lines += ["", "## Power: the share of runs whose row is beyond noise under the alternative (true difference "
              "in brackets, points; ACR in radius units)", "",
              "| scenario | " + " | ".join(rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for name, r in results.items():
        alt, t = r["alternative"], r["truth"]
        fmt = lambda m: (f"{t[m]:+.3f}" if m == "ACR" else f"{100 * t[m]:+.1f}") if m in t else "?"
        cell = lambda m: f"{alt['flag'][m] / alt['seen'][m]:.2f} ({fmt(m)})" if m in alt["seen"] else ""
        lines.append(f"| {name} | " + " | ".join(cell(m) for m in rows) + " |")
    lines += ["", "## The null: per-row false-alarm rate", "", "| scenario | " + " | ".join(rows) + " |",
              "|---" * (len(rows) + 1) + "|"]
    for name, r in results.items():
        null = r["null"]
        cell = lambda m: f"{null['flag'][m] / null['seen'][m]:.3f}" if m in null["seen"] else ""
        lines.append(f"| {name} | " + " | ".join(cell(m) for m in rows) + " |")
    return "\n".join(lines) + "\n", holds_all


def quiet_worker():
    """A forked worker ends at its pool's SIGTERM without machinery.run's handler (no traceback); Ctrl-C is the
    parent's."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def main(argv=None):
    p = machinery.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=1000, help="runs per scenario and hypothesis (default 1000)")
    p.add_argument("--heavy-runs", type=int, default=300, help="the same for the slow scenarios, 10,000 images "
                                                                 "or --over test-set (default 300)")
    p.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), help="default: the first 13 (the seed "
                   "study's scenarios are named here)")
    p.add_argument("--seed", type=int, default=0, help="base seed (scenario i uses seed + i)")
    p.add_argument("--jobs", type=int, default=2, help="processes (default 2)")
    p.add_argument("--out", help="folder for report.md")
    p.add_argument("--family", nargs="+", metavar="ROW", help="calibrate compare --family with these rows (e.g. ACR "
                   "'P(pA>=0.99)' 'P(pA<0.5)' 'clean accuracy'): Holm's verdicts, the other rows exploratory")
    p.add_argument("--rich-seeds", type=int, default=compare.RICH_SEEDS, help="calibrate compare with this many "
                   f"seeds a side as the point from which one t and no floor apply (default compare's, "
                   f"{compare.RICH_SEEDS})")
    p.add_argument("--ignore-train-seeds", action="store_true", help="record no training seed in the simulated "
                   "logs: matched seeds are compared unpaired")
    args = p.parse_args(argv)
    common.check(args.rich_seeds >= 2, f"--rich-seeds must be >= 2 (got {args.rich_seeds})")
    global PAIR_SEEDS
    compare.RICH_SEEDS, PAIR_SEEDS = args.rich_seeds, not args.ignore_train_seeds   # the workers fork after this
    family = compare.family_names(args.family)
    common.check(args.runs >= 1 and args.heavy_runs >= 1, f"--runs and --heavy-runs must be >= 1 (got {args.runs}, "
                                                          f"{args.heavy_runs})")
    common.check(1 <= args.jobs <= 64, f"--jobs must lie in [1, 64] (got {args.jobs})")
    start = time.time()
    names = args.scenarios or DEFAULT
    heavy = lambda spec: spec[5] > 1000 or spec[6] == "test-set"      # 10,000 images or votes bounded per image
    jobs = [(name, SCENARIOS[name], args.heavy_runs if heavy(SCENARIOS[name]) else args.runs,
             args.seed + list(SCENARIOS).index(name), family) for name in names]
    order = sorted(range(len(jobs)), key=lambda i: jobs[i][2] * jobs[i][1][5], reverse=True)   # longest first
    with multiprocessing.Pool(args.jobs, quiet_worker) as pool:   # scenarios are independent: one process each
        done = pool.starmap(run_scenario, [jobs[i] for i in order], chunksize=1)
    results = {names[i]: r for i, r in sorted(zip(order, done))}
    command = "python tools/compare_calibration.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    text, holds = calibration_report(results, command, time.time() - start, args.jobs, family)
    if args.out:
        machinery.write_text_output(os.path.join(args.out, "report.md"), "compare calibration", text)
    print(text)
    return 0 if holds else 1


if __name__ == "__main__":
    machinery.run(lambda: sys.exit(main()), exit_process=True)   # exit 1 where a scenario fails its check

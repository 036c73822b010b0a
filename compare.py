"""Compare two configurations of randomized smoothing: B - A for every metric of the paper's evaluation, each with
an interval that accounts for the test sample, the certification's Monte Carlo noise and the training seeds, and
a verdict (higher, lower, within noise) whose error is controlled over all rows together.

This extends the paper's evaluation (analyze.py) from point estimates to verdicts with their uncertainty. Its
command is `analyze.py compare`; `compare_sides` is the building block.

Usage: python analyze.py compare runs/certify/gaussian.tsv runs/certify/ours.tsv --out runs/compare
       python analyze.py compare A_seed0.tsv A_seed1.tsv A_seed2.tsv --vs B_seed0.tsv B_seed1.tsv B_seed2.tsv
"""
import functools
import math
import os
import sys

import numpy as np
from scipy.special import ndtri

import analyze
import common
import readers


# ----------------------------------------------------------------------------------------------------------
# compare: the difference between two configurations, with simultaneous intervals of measured coverage
# ----------------------------------------------------------------------------------------------------------
# A side is one log or several (training seeds of one configuration; several sigmas give per-sigma rows and
# the best-over-sigma rows). Every row is a mean over images of a per-image value: 0/1 for accuracies and
# shares of pA, the radius (0 where wrong) for ACR. The difference d = B - A estimates one of two truths:
#   images    (default) the expectation over the distribution the test images come from (and over training
#             seeds where a side has several). Images that every log certified (the same idx and label) are
#             paired; rows that not all logs have are left out and counted (compare.md and one warning line);
#             logs with no image in common are compared unpaired, and compare.md says so. The Monte Carlo noise
#             of certification is inside each image's value, so the spread over images carries it.
#   test-set  the expectation on these very images over the certification's votes (a paper's fixed test set).
#             Each image's value is a function of its count; its variance is bounded by the largest it takes
#             over a 99.9 % Clopper-Pearson interval of the image's probability (1/4 for a 0/1 value whose
#             count is unknown: an abstention in a log without nA). N from the log or its sidecar, alpha from
#             the sidecar, else --N / --alpha; unknown means refused. The logged class cA stays (the N0
#             selection draws are not redrawn); grid logs and per-row sigma logs have no count model: refused.
# One model a side: a 0/1 row gets a score interval, Tango's (1998) for paired images, Newcombe's (1998)
# hybrid Wilson score for unpaired ones; ACR a t interval. None has zero width.
# Training seeds: the k seed means of a side vary by sigma_seed^2 + sigma_c^2 / n (sigma_c^2: the seed-by-
# image interaction, read off the two-way layout's residual mean square), so s^2 / k with k - 1 degrees of
# freedom estimates the seed part of the variance of d exactly, and the spread over images, less the
# interaction it also holds, gives the image part (n - 1 degrees of freedom). Paired seeds (seed_design: both
# sides' logs record the same training seeds, each once): seed j of B minus seed j of A is one two-way layout
# of differences, whose k per-seed means give the seed part (k - 1 degrees of freedom); what a seed decides on
# both sides (initialisation, data order) then cancels. Unpaired seeds: each side's s^2 / k. With RICH_SEEDS
# or more a side, one t at the Welch-Satterthwaite degrees of freedom of all parts; with fewer, each part
# keeps its own critical value (the seeds' t, the images' t or z) and the half-width is sqrt(sum of critical^2
# x variance) (MOVER), and 0/1 rows are widened to at least the one-model score interval on the seed means.
# A side with one log has no seed term: its verdict is about that model, not its training method.
# Multiplicity: Bonferroni over every row tested (rows where both sides certify nothing are tested but not
# shown), each at level 1 - (1 - level) / m, so all intervals hold together with probability >= level under
# any dependence between rows. A best-over-sigma row takes the hull of its per-sigma intervals: max_s b_s -
# max_s a_s lies between min_s (b_s - a_s) and max_s (b_s - a_s), so it needs no share of the error.
# A row is `higher` or `lower` when its interval excludes 0, else `within noise`. Coverage, false alarms and
# power against known truths: tools/compare_calibration.py (results/compare_calibration/).

COMPARE_OVER = ("images", "test-set")
VOTE_LEVEL = 0.999   # the Clopper-Pearson interval of an image's probability over which test-set bounds its variance




def z_table(N, alpha):
    """Phi^-1 of the Clopper-Pearson lower bound for every count 0..N (-inf where it would abstain, < 1/2)."""
    z = ndtri(common.clopper_pearson_lower(np.arange(N + 1), N, alpha))
    return np.where(z >= 0, z, -np.inf)


def image_values(log, radii, with_acr, with_pA):
    """{row: per-image values} of one log: 0/1 for accuracies and shares of pA, the radius for ACR."""
    radius, correct = log["radius"], log["correct"]
    out = {"clean accuracy": correct.astype(float)}
    for r in radii:
        out[f"certified accuracy r={r:g}"] = (correct & (radius >= r)).astype(float)
    if with_acr:
        out["ACR"] = np.where(correct, radius, 0.0)
    if with_pA:
        for name, test in analyze.SHARES:
            out[name] = test(log["nY"] / log["N"]).astype(float)
    return out








def seed_layout(f):
    """A side's (k seeds, n images) values: (s^2 / k of the seed means, its degrees of freedom, and the
    interaction's share sigma_c^2 / (n k) of it, from the two-way residual mean square); zeros for k = 1."""
    k, n = f.shape
    if k == 1:
        return 0.0, 0, 0.0
    means = f.mean(1)
    resid = f - f.mean(0) - means[:, None] + f.mean()
    return float(means.var(ddof=1)) / k, k - 1, float((resid ** 2).sum()) / ((n - 1) * (k - 1)) / (n * k)


def satterthwaite(terms):
    """Welch-Satterthwaite degrees of freedom of a sum of variance estimates [(v, df)] (df inf: known)."""
    common.check(all(v >= 0 and df > 0 for v, df in terms), f"satterthwaite needs variances >= 0 and df > 0: {terms}")
    total = sum(v for v, _ in terms)
    denom = sum(v * v / df for v, df in terms if v > 0 and math.isfinite(df))
    return math.inf if denom == 0 else total * total / denom


RICH_SEEDS = 5   # seeds a side from which the seed part is known well enough for one critical value and no floor


def row_interval(fa, fb, binary, paired, a, vote_a=None, vote_b=None, matched=False):
    """(d, low, high, critical value) of one row: fa, fb each side's (seeds, images) values (paired: one image
    order), binary for 0/1 values, a its two-sided error; vote_a, vote_b: votes' variance bounds (or None);
    matched: row j of fa and of fb come from the same training seed (paired seeds: the seed term is the spread
    of the k per-seed differences)."""
    from scipy.stats import t as student_t   # here: scipy.stats takes seconds to import
    if matched and not fa.shape[0] == fb.shape[0] >= 2:
        raise ValueError(f"matched: both sides need the same number of seeds, at least 2 (got {fa.shape[0]} and "
                         f"{fb.shape[0]})")
    d = float(fb.mean() - fa.mean())
    (ea, dfa, ca), (eb, dfb, cb) = seed_layout(fa), seed_layout(fb)
    one_model = fa.shape[0] == fb.shape[0] == 1
    if matched and paired:                 # one two-way layout of the per-image, per-seed differences
        e, df, c = seed_layout(fb - fa)
        seeds, inter = [(e, df)], c
    elif matched:                          # other images a side: the k differences of the seed means
        k = fa.shape[0]
        seeds, inter = [(float(np.var(fb.mean(1) - fa.mean(1), ddof=1)) / k, k - 1)], ca + cb
    else:
        seeds, inter = [(e, df) for e, df in ((ea, dfa), (eb, dfb)) if df > 0], ca + cb
    if vote_a is not None:                 # test-set: the votes' variance (k = 1) or the seeds' spread (k > 1)
        known = [float(v.sum()) / v.size ** 2 for f, v in ((fa, vote_a), (fb, vote_b)) if f.shape[0] == 1]
        images = [(sum(known), math.inf)]
    else:
        ma, mb = fa.mean(0), fb.mean(0)    # per-image means over seeds
        if paired and one_model and binary:
            x12, x21 = int(np.sum((mb > ma))), int(np.sum((ma > mb)))
            return (d, *common.tango_interval(x12, x21, len(ma), -ndtri(a / 2)), -ndtri(a / 2))
        if not paired and one_model and binary:
            return (d, *common.newcombe_interval(float(ma.mean()), len(ma), float(mb.mean()), len(mb), -ndtri(a / 2)),
                    -ndtri(a / 2))
        if paired:
            images = [(max(float(np.var(mb - ma, ddof=1)) / len(ma) - inter, 0.0), len(ma) - 1)]
        else:
            images = [(max(float(np.var(m, ddof=1)) / len(m) - c, 0.0), len(m) - 1) for m, c in ((ma, ca), (mb, cb))]
    crit = lambda terms: (-ndtri(a / 2) if math.isinf(df := satterthwaite(terms)) else student_t.isf(a / 2, df))
    v_img, v_seed = sum(v for v, _ in images), sum(v for v, _ in seeds)
    # with RICH_SEEDS or more a side (4+ degrees of freedom in every seed part) one Welch-Satterthwaite t over all
    # parts holds the error and 0/1 rows need no floor (results/compare_calibration/seeds); with fewer, each
    # independent part keeps its own critical value (Zou and Donner's MOVER): a pooled t is liberal when a 1-2
    # df seed part meets a well-known image part (3.7x the error at k = 2, test_compare.py)
    rich = bool(seeds) and all(df >= RICH_SEEDS - 1 for _, df in seeds)
    if rich:
        half = crit(images + seeds) * math.sqrt(v_img + v_seed)
    else:
        half = math.sqrt((crit(images) ** 2 * v_img if v_img > 0 else 0.0) +
                         (crit(seeds) ** 2 * v_seed if v_seed > 0 else 0.0))
    if (rich or not binary) and v_img + v_seed == 0:   # no spread at all (a log against itself): never zero
        reach = 1.0 if binary else float(max(np.abs(fa).max(), np.abs(fb).max()))   # width. |differences| <= R,
        half = max(half, reach * (1 - (a / 2) ** (1 / fa.shape[1])))   # n all 0 has probability <= (1 - |delta| / R)^n
    t = half / math.sqrt(v_img + v_seed) if v_img + v_seed > 0 else -ndtri(a / 2)
    low, high = d - half, d + half
    if binary and vote_a is None and not rich:   # few seeds: never narrower than the one-model score interval
        z = -ndtri(a / 2)                        # on the seed means
        ma, mb = fa.mean(0), fb.mean(0)
        floor = (common.tango_interval(float(np.maximum(mb - ma, 0).sum()), float(np.maximum(ma - mb, 0).sum()), len(ma), z)
                 if paired else common.newcombe_interval(float(ma.mean()), len(ma), float(mb.mean()), len(mb), z))
        low, high = min(low, floor[0]), max(high, floor[1])
    return d, low, high, t


def count_threshold(test, N):
    """The smallest count c of N with test(c / N) true (test false below it, true from it on); N + 1: never."""
    hits = np.flatnonzero(test(np.arange(N + 1) / N))
    return int(hits[0]) if len(hits) else N + 1


def budget_for_votes(log, N_flag, alpha_flag):
    """(N, alpha) for --over test-set: N from the log's N column (its largest: rows below it stopped early) or
    sidecar, alpha from the sidecar, else the flags; a UserError where either stays unknown or they disagree."""
    path, side = log["path"], log.get("sidecar") or {}
    own_N = int(log["N"].max()) if "N" in log else side.get("N")
    own_alpha = side.get("alpha")
    for name, own, flag in (("N", own_N, N_flag), ("alpha", own_alpha, alpha_flag)):
        common.check(own is None or flag is None or float(own) == float(flag),
                     f"{path}: the log was certified with {name} = {own}, but --{name} {flag} was given")
        common.check(own is not None or flag is not None,
                     f"{path}: {name} unknown (no column, no sidecar {path}.json): --over test-set redraws the "
                     f"votes, so it needs the budget; pass --{name}")
    N = int(own_N if own_N is not None else N_flag)
    alpha = float(own_alpha if own_alpha is not None else alpha_flag)
    common.check(N >= 1 and 0 < alpha < 1, f"{path}: need N >= 1 and 0 < alpha < 1 (got N = {N}, alpha = {alpha})")
    return N, alpha


def radius_moments(p, N, z, sigma, chunk=256):
    """(mean, variance) of sigma * max(z[count], 0) over count ~ Binomial(N, p), for each p of an array; z is
    z_table(N, alpha). Summed over the counts within 7 standard deviations (the rest weighs < 3e-12)."""
    from scipy.stats import binom   # here: scipy.stats takes seconds to import
    p = common.check_array("p", p, ndim=1, ge=0, le=1)
    common.check_float("sigma", sigma, gt=0)
    common.check(len(z) == common.check_int("N", N) + 1, f"z has {len(z)} entries: z_table(N, alpha) of N = {N} has N + 1")
    mean, var = np.zeros(len(p)), np.zeros(len(p))
    for start in range(0, len(p), chunk):
        q = p[start:start + chunk]
        half = int(np.ceil(7 * np.sqrt(N * q * (1 - q)).max())) + 2
        counts = np.round(N * q).astype(np.int64)[:, None] + np.arange(-half, half + 1)[None]
        inside = (counts >= 0) & (counts <= N)
        counts = np.clip(counts, 0, N)
        w = np.where(inside, binom.pmf(counts, N, q[:, None]), 0.0)
        w /= w.sum(1, keepdims=True)
        r = sigma * np.maximum(z[counts], 0.0)
        m = (w * r).sum(1)
        mean[start:start + chunk], var[start:start + chunk] = m, np.maximum((w * (r - m[:, None]) ** 2).sum(1), 0)
    return mean, var


def test_set_votes(N=None, alpha=None, sigma=None):
    """compare_sides's `votes` for intervals over the fixed test set (--over test-set): vote_variances with the
    budget N, alpha and the sigma of logs that record none (None: each from the log)."""
    N = None if N is None else common.check_int("N", N)
    alpha = None if alpha is None else common.check_float("alpha", alpha, gt=0, lt=1)
    sigma = None if sigma is None else common.check_float("sigma", sigma, gt=0)
    return functools.partial(vote_variances, N_flag=N, alpha_flag=alpha, sigma=sigma)


def vote_variances(log, radii, with_acr, with_pA, N_flag=None, alpha_flag=None, sigma=None):
    """{row: per-image bound on the variance of the row's value when the image's votes are drawn again}
    (--over test-set; see the comment above compare's functions). N_flag, alpha_flag, sigma: for a log that
    does not record them (its N column or sidecar, analyze.load_logs's sigma)."""
    path = log["path"]
    common.check(not log.get("grid"), f"{path}: a grid log (certify.py --radii) records no vote counts to redraw; "
                                      f"compare it with --over images")
    common.check("sigma_x" not in log and not analyze.semi_elastic(log),
                 f"{path}: a ddrs.py log (per-row sigma or semi-elastic radius); --over test-set models CERTIFY's "
                 f"radius only: compare it with --over images")
    N, alpha = budget_for_votes(log, N_flag, alpha_flag)
    own = log.get("sigma")
    common.check(own is None or sigma is None or float(own) == float(sigma),
                 f"{path}: the log was certified at sigma {own}, but sigma {sigma} was given")
    sigma = analyze.need_sigma(log) if sigma is None else float(sigma)
    n = len(log["radius"])
    if "nA" in log:
        count, known = log["nA"], log["N"] == N                # rows stopped early (--early-abstain): unknown
    else:                                                      # Cohen's columns: the count behind each radius
        count = np.minimum(analyze.min_count(log["radius"], N, alpha, sigma), N)
        known = log["predict"] >= 0                            # an abstention's count is unknown
    right = log["correct"] | bool(log.get("label_mode")) | (
        (log["predict"] < 0) & (log["nY"] == log["nA"]) if "nY" in log and "nA" in log else False)
    count = np.where(known, count, 0)
    tail = (1 - VOTE_LEVEL) / 2
    from scipy.stats import binom   # here: scipy.stats takes seconds to import
    p_low = np.atleast_1d(common.clopper_pearson_lower(count, N, tail))
    p_high = np.atleast_1d(common.clopper_pearson_upper(count, N, tail))

    def bernoulli(t, c_low, c_high):           # the largest q (1 - q) of q = P(count >= t) over [c_low, c_high]
        q_low, q_high = binom.sf(t - 1, N, c_low), binom.sf(t - 1, N, c_high)
        inside = (q_low <= 0.5) & (q_high >= 0.5)
        return np.where(inside, 0.25, np.maximum(q_low * (1 - q_low), q_high * (1 - q_high)))

    ones = lambda t: np.where(known, np.where(right, bernoulli(t, p_low, p_high), 0.0), 0.25)
    out = {"clean accuracy": ones(analyze.min_count(0.0, N, alpha, sigma))}
    for r in radii:
        out[f"certified accuracy r={r:g}"] = ones(analyze.min_count(r, N, alpha, sigma))
    if with_acr:
        z = z_table(N, alpha)
        edge = np.full(n, min(analyze.min_count(0.0, N, alpha, sigma), N) / N)   # unknown rows: the worst below abstaining
        need = ~known | right                                  # a known wrong row's radius stays 0
        worst = np.zeros(n)
        worst[need] = np.max([radius_moments(np.where(known, p, edge)[need], N, z, sigma)[1]
                              for p in (p_low, count / N, p_high)], axis=0)
        out["ACR"] = worst
    if with_pA:
        n_row = log["N"]
        y_low = np.atleast_1d(common.clopper_pearson_lower(log["nY"], n_row, tail))
        y_high = np.atleast_1d(common.clopper_pearson_upper(log["nY"], n_row, tail))
        for name, test in analyze.SHARES:
            out[name] = np.where(n_row == N, bernoulli(count_threshold(test, N) if not name.startswith("P(pA<") else
                                                       count_threshold(lambda p: ~test(p), N), y_low, y_high), 0.25)
    return out




def side_groups(logs):
    """{sigma: [logs]} of one side (sigma None for logs of unknown sigma)."""
    groups = {}
    for log in logs:
        groups.setdefault(log.get("sigma"), []).append(log)
    return groups


def hull_best_rows(ga, gb, sigmas, radii, values, per_sigma):
    """Best-over-sigma rows when both sides have the same sigmas: max_s b_s - max_s a_s lies between the smallest
    and the largest b_s - a_s, so the hull of the per-sigma intervals holds with them (no share of the error)."""
    out = []
    for r in radii:
        name = f"certified accuracy r={r:g}"
        best = lambda g: max(float(np.stack([values[id(log)][name] for log in g[s]]).mean()) for s in sigmas)  # noqa: E731
        ba, bb = best(ga), best(gb)
        if ba or bb:   # left out where neither side certifies anything
            out.append((f"best over σ r={r:g}", ba, bb, bb - ba, min(per_sigma[(s, name)][1] for s in sigmas),
                        max(per_sigma[(s, name)][2] for s in sigmas)))
    return out


def own_best_rows(ga, gb, own_a, own_b, radii, values, variances, a):
    """Best-over-sigma rows when the sides' sigmas differ: at each radius, max over B's own sigmas of its
    certified accuracy minus max over A's own. Each sigma's level gets an interval (row_interval against a
    side of zeros, Bonferroni: a split over the sides' sigmas), and max_s b_s - max_t a_t lies between
    max_s low(b_s) - max_t high(a_t) and max_s high(b_s) - max_t low(a_t) when every level interval holds.
    Radii where neither side certifies anything are left out. Rows (name, a, b, d, low, high)."""
    out, k = [], len(own_a) + len(own_b)
    for r in radii:
        name = f"certified accuracy r={r:g}"
        levels = {}
        for side, groups, sigmas in (("A", ga, own_a), ("B", gb, own_b)):
            for s in sigmas:
                f = np.stack([values[id(log)][name] for log in groups[s]])
                zero = np.zeros((1, f.shape[1]))
                v = (np.zeros_like(zero), np.stack([variances[id(log)][name] for log in groups[s]])) \
                    if variances is not None else (None, None)
                _, low, high, _ = row_interval(zero, f, True, True, a / k, *v)
                levels.setdefault(side, []).append((float(f.mean()), max(low, 0.0), min(high, 1.0)))
        ba, bb = max(x[0] for x in levels["A"]), max(x[0] for x in levels["B"])
        if ba == 0 and bb == 0:
            continue
        low = max(x[1] for x in levels["B"]) - max(x[2] for x in levels["A"])
        high = max(x[2] for x in levels["B"]) - max(x[1] for x in levels["A"])
        out.append((f"best over σ r={r:g}", ba, bb, bb - ba, max(low, -1.0), min(high, 1.0)))
    return out


def training_seed(log):
    """The training seed of a log's model: log["train_seed"] (compare --train-seeds), else the one its settings
    file records (certify.py reads it from the checkpoint), else None."""
    seed = log.get("train_seed")
    return seed if seed is not None else (log.get("sidecar") or {}).get("train_seed")


def seed_design(logs_a, logs_b):
    """How the two sides' logs at one sigma relate over training seeds: "paired" when both have at least 2 logs
    whose recorded training seeds are the same set, each once a side (seed j of both sides shares what a seed
    decides: initialisation, data order); "unpaired" for several seeds otherwise; None with one log a side."""
    if len(logs_a) == len(logs_b) == 1:
        return None
    seeds_a, seeds_b = [training_seed(log) for log in logs_a], [training_seed(log) for log in logs_b]
    known = None not in seeds_a + seeds_b and len(set(seeds_a)) == len(seeds_a) and len(set(seeds_b)) == len(seeds_b)
    return "paired" if known and len(seeds_a) >= 2 and sorted(seeds_a) == sorted(seeds_b) else "unpaired"


def seed_designs(ga, gb, sigmas):
    """{sigma: seed_design} of the sides' logs by sigma ({sigma: [logs]}); where "paired", both sides' logs are
    put in the order of their training seeds, so that row j of each side is the same seed."""
    design = {s: seed_design(ga[s], gb[s]) for s in sigmas}
    for s in sigmas:
        if design[s] == "paired":
            ga[s], gb[s] = sorted(ga[s], key=training_seed), sorted(gb[s], key=training_seed)
    return design


def compare_scope(side_a, side_b):
    """What two sides can be compared on: each side's logs by sigma, the sigmas both have, and whether there
    are ACR rows (no grid log) and pA rows (every log has nY)."""
    ga, gb = side_groups(side_a), side_groups(side_b)
    sigmas = [s for s in ga if s in gb]
    common.check(sigmas, f"the two sides share no sigma (A: {sorted(map(str, ga))}, B: {sorted(map(str, gb))}); "
                         f"compare logs certified at the same sigma")
    for side, name in ((side_a, "A"), (side_b, "B")):   # a log given twice would fake a seed spread of zero
        seen = {}
        for log in side:
            key = (log["idx"].tobytes(), log["radius"].tobytes(), log["correct"].tobytes(), log.get("sigma"))
            common.check(key not in seen, f"side {name} holds the same log twice ({seen.get(key)}, {log['path']})")
            seen[key] = log["path"]
        for sigma, logs in side_groups(side).items():
            readers.check_distinct_models(logs, f"side {name} at sigma {sigma}")
    logs = side_a + side_b
    with_acr = not any(log.get("grid") for log in logs)
    with_pA = all("nY" in log for log in logs) and with_acr
    return ga, gb, sigmas, with_acr, with_pA


def row_pvalue(interval):
    """The smallest two-sided error a at which interval(a) -> (low, high) excludes 0 (1 if none): the p-value
    that the interval's own construction gives, by bisection on log a (intervals narrow as a grows); below
    e^-40 it says e^-40, an upper bound that orders and tests the same at any family size in use."""
    excludes = lambda a: (lambda lo, hi: lo > 0 or hi < 0)(*interval(a))
    if not excludes(1 - 1e-9):
        return 1.0
    lo, hi = -40.0, math.log(1 - 1e-9)   # log a
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if excludes(math.exp(mid)) else (mid, hi)
    return math.exp(hi)


def holm(pvalues, error):
    """Holm's step-down: the indices of pvalues rejected at family-wise error `error`."""
    if len(pvalues):
        common.check_array("pvalues", pvalues, ndim=1, ge=0, le=1)
    common.check_float("error", error, gt=0, lt=1)
    order, rejected = sorted(range(len(pvalues)), key=lambda i: pvalues[i]), set()
    for k, i in enumerate(order):
        if pvalues[i] > error / (len(order) - k):
            break
        rejected.add(i)
    return rejected


def decided_rows(logs, radii):
    """(the radii every log decides, those some grid log did not, the grid logs without r = 0 as a level, whose
    clean accuracy counts only inputs certified at their smallest level: a lower bound). A grid log decides its
    own levels (its settings file's radii; without one, every radius, as analyze.decided takes it)."""
    levels = [(log["path"], (log.get("sidecar") or {}).get("radii")) for log in logs if log.get("grid")]
    undecided = [r for r in radii if any(g and r not in g for _, g in levels)]
    no_zero = [path for path, g in levels if g and 0 not in g]
    return [r for r in radii if r not in undecided], undecided, no_zero


def check_sides(side_a, side_b, radii, level, votes, family):
    """compare_sides' arguments, each checked (a TypeError or ValueError naming it); the radii as floats."""
    is_log = lambda log: isinstance(log, dict) and all(isinstance(log.get(k), np.ndarray) and len(log[k]) ==   # noqa: E731
                                                       len(log["radius"]) for k in ("radius", "correct", "idx", "y")) \
        and log["correct"].dtype == bool and bool(np.all(np.isfinite(log["radius"]) & (log["radius"] >= 0))) \
        and all(bool(np.all(log[k] <= log["N"])) for k in ("nA", "nY") if k in log and "N" in log) \
        and "path" in log   # read_certification_log's, with its contract
    lists = {"side_a": (side_a, list, is_log, "logs"), "side_b": (side_b, list, is_log, "logs"),
             "radii": (radii, (list, tuple, np.ndarray), lambda r: True, "radii"),
             "family": (family or ["?"], (list, tuple), lambda n: isinstance(n, str), "row names")}
    for name, (value, kind, ok, what) in lists.items():
        if not isinstance(value, kind) or not all(map(ok, value)):
            raise TypeError(f"{name} must be a list of {what} (got {value!r:.80}; logs as "
                            f"readers.read_certification_log returns them)")
        common.check(len(value) > 0, f"{name} is empty: give at least one")
    common.check(family is None or len(family) > 0, "family is empty: give the claim's rows, or None for all rows")
    common.check_float("level", level, gt=0, lt=1)
    if votes is not None and not callable(votes):
        raise TypeError(f"votes must be None or test_set_votes(N, alpha, sigma) (got {votes!r:.60})")
    return [common.check_float(f"radii[{i}]", r, ge=0) for i, r in enumerate(radii)]


def image_rows(side_a, side_b):
    """Rows of each log on the images every log certified (paired images), else, where the sides share none, on
    each side's own shared images: ({log id: rows}, the number of shared images (0: unpaired), {path: rows left
    out})."""
    rows_of, n_shared, left = analyze.shared_images(side_a + side_b)
    common.check(n_shared != 1, "the logs share one image: an interval needs at least 2 (the spread over images)")
    if n_shared == 0:
        left = {}
        for side, name in ((side_a, "A"), (side_b, "B")):
            own, n_own, own_left = analyze.shared_images(side)
            common.check(n_own > 1, f"the logs of side {name} share {'no image' if n_own == 0 else 'one image'} (idx, "
                                    f"label): one test set a side, and an interval needs at least 2 images")
            rows_of.update(own)
            left.update(own_left)
    return rows_of, n_shared, left


def compare_sides(side_a, side_b, radii, level=0.95, votes=None, family=None):
    """Rows (metric, a, b, diff, low, high, verdict) comparing side B with side A (diff = b - a), and facts. Each
    side: logs (a model, or a training seed, each) as read_certification_log gives them, compared per 'sigma'.
    votes: None (over images) or test_set_votes(N, alpha, sigma) (over the fixed test set). family: None, every
    row tested, Bonferroni intervals holding together with probability >= level and verdicts from them; else the
    claim's row names, the error spent on them alone (Bonferroni intervals, Holm's step-down verdicts), the other
    rows exploratory at level alone (facts["roles"]). A row that cannot change (test-set) is "fixed"."""
    radii = check_sides(side_a, side_b, radii, level, votes, family)
    ga, gb, sigmas, with_acr, with_pA = compare_scope(side_a, side_b)
    logs = side_a + side_b
    radii, undecided, no_clean = decided_rows(logs, radii)
    rows_of, n_shared, left = image_rows(side_a, side_b)
    paired = n_shared > 0
    values, variances = {}, {}
    for log in logs:
        rows = rows_of[id(log)]
        values[id(log)] = {k: v[rows] for k, v in image_values(log, radii, with_acr, with_pA).items()}
        if votes is not None:
            variances[id(log)] = {k: v[rows] for k, v in votes(log, radii, with_acr, with_pA).items()}
    names = [n for n in values[id(logs[0])] if n != "clean accuracy" or not no_clean]
    common.check(names, "no row to compare: every row was left out (radii no grid log decided, no r = 0 level)")
    claims = names if family is None else [n for n in names if n in family]
    common.check(family is None or set(family) <= set(names), f"--family names rows these logs do not have: "
                 f"{sorted(set(family or ()) - set(names))}; the rows are {', '.join(names)}")
    own_a, own_b = [s for s in ga if s is not None], [s for s in gb if s is not None]   # own_best_rows: a share each
    own = set(own_a) != set(own_b) and own_a and own_b and max(len(own_a), len(own_b)) > 1
    m = len(claims) * len(sigmas) + (len(radii) if own and family is None else 0)
    stack = lambda group, store, name: np.stack([store[id(log)][name] for log in group])
    ceiling = max(common.radius_ceiling(log) for log in logs)   # no ACR difference beyond +-ceiling
    out, per_sigma, crits, roles, pvalues, clamped = [], {}, [], {}, {}, []
    design = seed_designs(ga, gb, sigmas)   # paired seeds put in training-seed order
    for s in sigmas:
        prefix = f"σ={'?' if s is None else float(s)} " if len(sigmas) > 1 else ""   # as analyze.fmt_sigma
        for name in names:
            fa, fb = stack(ga[s], values, name), stack(gb[s], values, name)
            va, vb = (stack(ga[s], variances, name), stack(gb[s], variances, name)) if votes else (None, None)
            bound = ceiling if name == "ACR" else 1.0
            interval = lambda a: (lambda r: (max(r[1], -bound), min(r[2], bound), r[3], r[1] < -bound or r[2] > bound))(
                row_interval(fa, fb, name != "ACR", paired, a, va, vb, design[s] == "paired"))
            low, high, crit, cut = interval((1 - level) / (m if name in claims else 1))
            clamped += [prefix + name] if cut else []
            d = float(fb.mean() - fa.mean())
            per_sigma[(s, name)] = (d, low, high)
            crits.append(crit)
            roles[prefix + name] = "claim" if name in claims else "exploratory"
            if family is not None and name in claims:
                pvalues[prefix + name] = row_pvalue(lambda a: interval(a)[:2])
            if (" r=" in name or name == "ACR") and fa.mean() == 0 and fb.mean() == 0:
                continue                 # tested (counted in m), not shown: both sides certify nothing there
            out.append((prefix + name, float(fa.mean()), float(fb.mean()), d, low, high))
    if own:
        best = own_best_rows(ga, gb, own_a, own_b, radii, values, variances if votes else None,
                             (1 - level) / (m if family is None else 1))
        roles.update({row[0]: "claim" if family is None else "exploratory" for row in best})
    else:
        best = hull_best_rows(ga, gb, sigmas, radii, values, per_sigma) if len(sigmas) > 1 else []
    out += best
    rejected = {list(pvalues)[i] for i in holm(list(pvalues.values()), 1 - level)}
    verdict = lambda name, d, lo, hi: "fixed" if lo == hi == d else \
        ("higher" if d > 0 else "lower") if (name in rejected if name in pvalues else lo > 0 or hi < 0) else \
        "within noise"
    rows = [(name, va, vb, d, lo, hi, verdict(name, d, lo, hi)) for name, va, vb, d, lo, hi in out]
    seeds = ({s: len(g) for s, g in ga.items()}, {s: len(g) for s, g in gb.items()})
    facts = {"paired": paired, "n": n_shared if paired else {k: len(rows_of[id(g[0])]) for k, g in
                                                           (("A", side_a), ("B", side_b))},
             "left": left, "m": m, "z": float(-ndtri((1 - level) / m / 2)), "with_acr": with_acr, "with_pA": with_pA,
             "sigmas": sigmas, "seeds": seeds, "seed_design": design, "over": "test-set" if votes else "images",
             "critical": max(crits), "roles": roles, "pvalues": pvalues, "family": family is not None, "clamped": clamped,
             "undecided": undecided, "one_side": sorted(str(s) for s in {**ga, **gb} if s not in sigmas),
             "no_clean": no_clean}
    return rows, facts


def family_names(family):
    """--family's row names as compare_sides names them (>= accepted for ≥)."""
    return None if family is None else [name.replace(">=", "≥") for name in family]


def compare_report(side_a, side_b, labels, radii, level, over, out, N=None, alpha=None, family=None, allow=()):
    """compare.tsv (metric a b diff low high verdict, shares as fractions; with a family, a column role) and
    compare.md (the same in %). Logs whose settings differ (readers.check_comparable) are refused, but for the
    settings in `allow` (--allow-different), which compare.md names above its table."""
    common.check(over in COMPARE_OVER, f"--over must be one of {', '.join(COMPARE_OVER)} (got {over!r})")
    differs = [(s, line) for s, line in readers.check_comparable(side_a + side_b, (*allow, readers.IMAGES),
                                                                  "analyze.py compare") if s != readers.IMAGES]
    rows, facts = compare_sides(side_a, side_b, radii, level, None if over == "images" else test_set_votes(N, alpha),
                                family_names(family))
    facts.update(differs=[line for s, line in differs if s not in (*readers.NOTED, *readers.NOTES)],
                 noted=[line for s, line in differs if s in readers.NOTED],
                 notes=[line for s, line in differs if s in readers.NOTES],
                 no_nY=[log["path"] for log in side_a + side_b if "nY" not in log] if facts["with_acr"] else [])
    role = (lambda m: [facts["roles"].get(m, "exploratory")]) if facts["family"] else (lambda m: [])
    if facts["left"]:
        print(f"warning: {sum(facts['left'].values())} rows of {len(facts['left'])} logs are not on images every "
              f"log certified and are left out (" + ", ".join(f"{p}: {k}" for p, k in facts["left"].items()) + ")",
              file=sys.stderr)
    number = lambda v: f"{v:.6g}"
    analyze.write_text(out, "compare.tsv", analyze.tsv(["metric", "a", "b", "diff", "low", "high", "verdict"] +
                                       ["role"] * facts["family"], [[m, number(a), number(b), number(d), number(lo),
                                                                     number(hi), v] + role(m)
                                                                    for m, a, b, d, lo, hi, v in rows]))
    show = lambda name, v: f"{v:.3f}" if name.endswith("ACR") else f"{100 * v:.1f}"
    shown_interval = lambda m, lo, hi, v: "fixed" if v == "fixed" else f"[{show(m, lo)}, {show(m, hi)}]"
    table = analyze.markdown(["metric", labels[0], labels[1], "diff", f"{100 * level:g} % interval", "verdict"] +
                     ["role"] * facts["family"],
                     [[m, show(m, a), show(m, b), show(m, d), shown_interval(m, lo, hi, v), v] + role(m)
                      for m, a, b, d, lo, hi, v in rows])
    md = f"# {labels[1]} against {labels[0]}\n\n" + compare_words(rows, facts, labels, level) + \
         "\n\nShares and their differences in points (%), ACR in radius units; diff = " + \
         f"{labels[1]} − {labels[0]}.\n\n" + table
    analyze.write_text(out, "compare.md", md)
    return md


def seed_words(facts):
    """compare.md's sentence on the seed design (paired or unpaired seeds) and how the seed term enters."""
    design = set(facts["seed_design"].values()) - {None}
    rich = all(n[s] == 1 or n[s] >= RICH_SEEDS for n in facts["seeds"] for s in facts["sigmas"])   # as row_interval
    paired = ("Paired seeds: both sides' logs record the same training seeds (settings file or --train-seeds), "
              "so seed j of one side is compared with seed j of the other, and the seed term is the spread of "
              "the k per-seed differences (s² / k, k − 1 degrees of freedom).")
    unpaired = ("Unpaired seeds: the logs do not record the same training seeds on both sides, so the seed term is "
                "each side's spread between its seeds (s² / k a side).")
    text = paired if design == {"paired"} else unpaired if design == {"unpaired"} else \
        f"{paired} {unpaired[:-1]} at the other sigmas."
    return text + (" The seed and image parts share one t critical value at their Welch-Satterthwaite degrees of "
                   f"freedom ({RICH_SEEDS} seeds or more a side)." if rich else
                   " Each part keeps its own critical value (the seeds' t at their Welch-Satterthwaite degrees of "
                   f"freedom), and with fewer than {RICH_SEEDS} seeds a side no 0/1 row is narrower than the "
                   "one-model score interval on the per-seed means.")


def setting_words(facts):
    """compare.md's first sentences: settings that differ (--allow-different), samplers and precisions, and the
    notes (readers.NOTES: one model on both sides, settings a log does not record)."""
    differs, noted, notes = (facts.get(key) or [] for key in ("differs", "noted", "notes"))
    one_model = any("one model" in n for n in notes)
    return [f"- Not the same setting (--allow-different): {'; '.join(differs)}. A difference here is one of the "
            f"model and its setting together: each verdict is about both, not about the model alone."] * bool(differs) + \
        [f"- Certified otherwise (each model as certified): {'; '.join(noted)}."] * bool(noted) + \
        [f"- Note: {'; '.join(notes)}" + (": a difference between its sides is one of how it was certified (and of "
                                           "Monte Carlo noise), not of the model." if one_model else ".")] * bool(notes)


def compare_words(rows, facts, labels, level):
    """compare.md's sentences: what differs beyond noise, the design, and what the interval accounts for."""
    roles = facts["roles"] if facts["family"] else {}
    found = [f"{m} ({v})" for m, a, b, d, lo, hi, v in rows if v not in ("within noise", "fixed")
             and roles.get(m) != "exploratory"]
    lines = setting_words(facts)
    lines += [f"- Beyond noise{' (the claim)' if roles else ''}: {'; '.join(found)}." if found else
             f"- Every {'row of the claim' if roles else 'row'} is within noise."]
    hints = [f"{m} ({v})" for m, a, b, d, lo, hi, v in rows if v in ("higher", "lower") and roles.get(m) == "exploratory"]
    if hints:
        lines.append(f"- Exploratory rows beyond noise at their own level (not part of the claim): {'; '.join(hints)}.")
    fixed = [m for m, a, b, d, lo, hi, v in rows if v == "fixed"]
    if fixed:
        lines.append(f"- Fixed: {', '.join(fixed)}: no vote of these images can change them (--over test-set), so "
                     f"their difference is exact, not an estimate.")
    if facts["undecided"]:
        lines.append(f"- Left out: certified accuracy at r = {', '.join(f'{r:g}' for r in facts['undecided'])}, "
                     f"which a grid log (--radii) did not decide.")
    if facts.get("no_clean"):
        lines.append(f"- Left out: clean accuracy, which {', '.join(map(os.path.basename, facts['no_clean']))} (a grid "
                     f"log without r = 0: --no-zero-level) bounds from below only.")
    if facts.get("no_nY"):
        without = ", ".join(map(os.path.basename, facts["no_nY"]))
        lines.append(f"- Left out: the shares of pA (P(pA<0.5), ...), which {without} "
                     f"{'does' if len(facts['no_nY']) == 1 else 'do'} not record (no nY column: the true label's votes).")
    if facts["one_side"]:
        lines.append(f"- σ on one side only, not compared σ by σ: {', '.join(facts['one_side'])}; best-over-σ rows "
                     f"are over each side's own σ (each σ's certified accuracy bounded on its own, Bonferroni).")
    seeds = facts["seeds"]
    one = [labels[i] for i in (0, 1) if max(seeds[i].values()) == 1]
    k = "; ".join(f"{labels[i]}: {', '.join(f'{n} at σ={analyze.fmt_sigma(s)}' for s, n in seeds[i].items())}"
                  for i in (0, 1))
    lines.append(f"- Training seeds per sigma ({k})." + (
        f" With one seed ({', '.join(one)}), the verdict is about these models, not their training methods."
        if one else " " + seed_words(facts)))
    if facts["critical"] > 2 * facts["z"]:
        lines.append(f"- Few seeds: the seed term has few degrees of freedom, so the widest interval reaches "
                     f"{facts['critical']:.1f} standard errors (against {facts['z']:.2f} with many seeds); with "
                     f"this many seeds only a difference many times the seed spread can show, and a verdict "
                     f"within noise says little.")
    left = facts["left"]
    shared = ("" if not left else f" {sum(left.values())} rows of {len(left)} logs are on images not every log "
              f"certified and are left out (" + ", ".join(f"{os.path.basename(p)}: {k}" for p, k in left.items())
              + ").")
    if facts["over"] == "images":
        lines.append("- The truth estimated: the expectation over test images (--over images). " + (
            f"Paired over the {facts['n']} images every log certified." if facts["paired"] else
            f"Unpaired: the sides share no image (A {facts['n']['A']}, B {facts['n']['B']} images).") + shared +
            " Each image's Monte Carlo noise of certification is part of the spread over images.")
    else:
        lines.append("- The truth estimated: the expectation on these very images over the certification's votes "
                     "(--over test-set): each image's variance is bounded over a 99.9 % Clopper-Pearson interval of "
                     "its probability (1/4 where its count is unknown); the class cA and the images stay fixed." +
                     shared)
    one_model = set(facts["seed_design"].values()) == {None}   # with seeds, the seed sentence says how
    score = "0/1 rows by score intervals (Tango's paired, Newcombe's unpaired), ACR by t." if one_model else ""
    if facts["family"]:
        claim = [m for m, role in facts["roles"].items() if role == "claim"]
        lines.append(f"- The claim (--family): {', '.join(claim)} ({facts['m']} rows). Its intervals "
                     f"hold together with probability at least {100 * level:g} % (Bonferroni, each at "
                     f"{100 * (1 - (1 - level) / facts['m']):.2f} %); its verdicts come from Holm's step-down at "
                     f"family-wise error {1 - level:g} on each row's own p-value (the interval's), so a verdict may "
                     f"clear the noise where the simultaneous interval still touches 0. Every other row is "
                     f"exploratory: its interval is at {100 * level:g} % alone, and its verdict says only where to "
                     f"look next.")
    else:
        lines.append(f"- Multiplicity: Bonferroni over the {facts['m']} rows tested (rows where both sides certify "
                     f"nothing are not shown), each at {100 * (1 - (1 - level) / facts['m']):.2f} % "
                     f"(z = {facts['z']:.2f}), so all hold together with probability at least {100 * level:g} %" +
                     (f"; {score}" if score else ".") +
                     ("" if facts["with_acr"] else " No ACR row: grid logs certify grid radii only."))
    if facts["family"] or facts["clamped"]:
        lines.append("- " + (f"{score} " if facts["family"] and score else "") + "No interval reaches past what "
                     "its row can take (a share difference within [-1, 1], an ACR difference within the largest "
                     "radius the logs allow)" +
                     (f"; cut there: {', '.join(facts['clamped'])}." if facts["clamped"] else "."))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------

def check_same_images(logs):
    """compare pairs examples by idx: every log whose settings file names its data (fingerprint and split)
    must name the same, or its idx would be other images (a log without a settings file, such as the
    published ones, is taken as it comes)."""
    named = [(log["path"], (log["sidecar"].get("data"), log["sidecar"].get("split"))) for log in logs
             if log["sidecar"].get("data") is not None]
    for path, data in named[1:]:
        common.check(data == named[0][1], f"{path}: certified on other images than {named[0][0]} (data "
                                          f"{data[0]} {data[1]} vs {named[0][1][0]} {named[0][1][1]}): its idx "
                                          f"are not the same examples")


def set_train_seeds(logs, seeds):
    """Give each log its training seed (--train-seeds, one per log); refused where the count differs or a log's
    settings file records another."""
    common.check(len(seeds) == len(logs), f"--train-seeds takes one seed per log ({len(logs)}), got {len(seeds)}")
    for log, seed in zip(logs, seeds):
        common.check(seed >= 0, f"--train-seeds: a seed is >= 0 (got {seed})")
        own = (log.get("sidecar") or {}).get("train_seed")
        common.check(own is None or own == seed, f"{log['path']}: its settings file records training seed {own}, "
                                                 f"but --train-seeds gives {seed}")
        log["train_seed"] = seed


def add_command(sub):
    """`analyze.py compare`: its options, and compare_command as its handler."""
    help_text = ("the difference B - A of every metric with a simultaneous interval that includes the test "
                 "sample, the certification's Monte Carlo noise and training seeds; verdict higher, lower or "
                 "within noise")
    s = sub.add_parser("compare", help=help_text, description=help_text + ". Usage: compare A.tsv B.tsv, or "
                       "compare A_seed0.tsv A_seed1.tsv ... --vs B_seed0.tsv B_seed1.tsv ... (several logs of a "
                       "side: its training seeds, or its sigmas for the best-over-sigma rows)")
    s.add_argument("logs", nargs="+", help="side A's logs; without --vs exactly two logs, A then B")
    s.add_argument("--vs", nargs="+", metavar="LOG", help="side B's logs")
    s.add_argument("--labels", nargs=2, metavar=("A", "B"), help="names of the sides (default: from the paths)")
    s.add_argument("--radii", nargs="+", type=float, default=analyze.DEFAULT_RADII[1:],
                   help="radii of the certified-accuracy rows (default 0.25 to 2.5; rows where both are 0 drop)")
    s.add_argument("--level", type=float, default=0.95, help="simultaneous coverage of the intervals")
    s.add_argument("--family", nargs="+", metavar="ROW", help="the rows that make up the claim, declared before "
                   "the run (e.g. ACR 'P(pA>=0.99)' 'P(pA<0.5)' 'clean accuracy' 'certified accuracy r=1'): the "
                   "error is spent on them alone, verdicts by Holm's step-down; the other rows are exploratory, "
                   "each at --level alone (default: every row is the family, Bonferroni)")
    s.add_argument("--over", choices=COMPARE_OVER, default="images", help="the truth the interval is about: "
                   "the expectation over test images (default; paired over the images the logs share, which "
                   "carries the certification's Monte Carlo noise), or on these very images over the votes")
    s.add_argument("--sigmas", nargs="+", type=float, help="one sigma per log, A's then B's (default: from the "
                                                            "sidecar or the path)")
    s.add_argument("--train-seeds", nargs="+", type=int, metavar="SEED", help="one training seed (the training "
                   "script's --seed) per log, A's then B's, for logs whose settings file records none: sides "
                   "with the same seeds are paired over seeds (default: from the settings files)")
    s.add_argument("--N", type=int, help="--over test-set: N of logs that record none (no N column, no sidecar)")
    s.add_argument("--alpha", type=float, help="--over test-set: alpha of logs whose sidecar records none")
    s.add_argument("--out", help="folder for compare.tsv and compare.md")
    analyze.add_allow_different(s)
    s.set_defaults(handler=compare_command)


def compare_command(args):
    """The compare command of the parsed arguments: compare.md's text (files under --out)."""
    side_a, side_b = (args.logs, args.vs) if args.vs else (args.logs[:1], args.logs[1:])
    common.check(args.vs or len(args.logs) == 2, f"compare takes two logs (A B), or A's logs then --vs and "
                                                  f"B's logs; got {len(args.logs)} logs and no --vs")
    common.check(args.over == "test-set" or (args.N is None and args.alpha is None),
                 "--N and --alpha go with --over test-set (the images' comparison reads no budget)")
    common.check(len(set(args.labels or "ab")) == 2, f"--labels names both sides {(args.labels or [''])[0]!r}: give "
                                                      f"each its own name")
    labels = [analyze.shown(x) for x in args.labels or [analyze.label_from_path(p) for p in (side_a[0], side_b[0])]]
    if labels[0] == labels[1]:
        labels = [f"A ({labels[0]})", f"B ({labels[1]})"]
    logs = analyze.load_logs(side_a + side_b, sigmas=args.sigmas,
                             command="compare --over test-set" if args.over == "test-set" else "compare",
                             allow=args.allow_different, assumed={"N": args.N, "alpha": args.alpha})
    check_same_images(logs)
    if args.train_seeds is not None:
        set_train_seeds(logs, args.train_seeds)
    return compare_report(logs[:len(side_a)], logs[len(side_a):], labels, args.radii, args.level, args.over,
                          args.out, args.N, args.alpha, args.family, args.allow_different)


if __name__ == "__main__":   # the same command as `python analyze.py compare ...`
    import machinery
    machinery.run(lambda: analyze.main(["compare", *sys.argv[1:]]), exit_process=True)

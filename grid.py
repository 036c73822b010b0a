"""Certification at a grid of radii, anytime-valid (certify.py --radii): the radius an example certifies is the
largest grid radius r_j whose threshold tau_j = Phi(r_j / sigma) a one-sided betting test proves pA to exceed,
and sampling stops as soon as the example's level is decided. docs/certification.md states the guarantee and
the sources (Voráček 2024; Horváth et al. 2022; Wald 1945 for the tests' optimality).

Copy what you need: the statistics (the betting wealth, its integer thresholds on a schedule of looks, the exact
error a sequence spends) come first, then the plan of one (sigma, radii, budget), then the runner that packs
the draws of many examples into full forward passes.
"""
import math

import numpy as np
import torch
from scipy.special import ndtr

import common


# --radii: the level of the upper bound that rules radii out. It never enters the guarantee (ruling out only
# removes certificates); chosen by measurement (tools/beta_curve.py on results/grid_cpu, docs/certification.md):
# at 0.2, 27-29 % fewer evaluations than at beta = alpha for 0.18-0.20 points of certified accuracy (18-20 of
# 10,000 simulated runs, results/grid_cpu/sigma*/beta_curve.md).
DEFAULT_BETA = 0.2
# --radii: the largest budget N_max (5,232 looks; a prior's tables, with their exact rule-out levels, then take
# 10-30 s on a CPU core, about 1 s at the paper's 100,000)
MAX_GRID_DRAWS = 10 ** 6
# --radii: examples whose draws share forward passes (--group's default): enough to keep a batch of 1,000 full
# once most of them have stopped, few enough that a group's tables and looks stay cheap
GROUP = 64

# ----------------------------------------------------------------------------------------------------------
# Anytime-valid bounds for certification at a grid of radii (Voráček 2024, Alg. 2; Horváth et al. 2022)
# ----------------------------------------------------------------------------------------------------------
# The betting confidence sequence of Voráček (2024, Alg. 2) with the Krichevsky-Trofimov mixture: after t
# draws with A votes for cA, the wealth of betting against pA = p is the mixture likelihood ratio
#   W_t(p) = B(A + 1/2, t - A + 1/2) / (pi p^A (1 - p)^(t - A)),
# a nonnegative martingale with mean 1 under the true p, so by Ville's inequality P(exists t: W_t(p) >=
# 1/alpha) <= alpha: rejecting every p with log W_t(p) >= log(1/alpha) is wrong with probability at most alpha,
# at all times at once, whatever the stopping rule. Any mixing prior fixed before the draws keeps this; the
# closer it sits to pA, the sooner the wealth grows (certify.py --radii takes the posterior of its selection
# draws, which are independent of the estimation draws).

KT_PRIOR = (0.5, 0.5)   # Krichevsky-Trofimov: Beta(1/2, 1/2)


def check_prior(prior):
    """The mixing prior Beta(a0, b0): two numbers > 0, else a TypeError or ValueError naming it."""
    a = common.check_array("prior", prior, ndim=1, gt=0)
    common.check(len(a) == 2, f"prior must be (a0, b0), the parameters of a Beta distribution, not {prior!r:.40}")
    return float(a[0]), float(a[1])


def kt_log_wealth(A, t, p, prior=KT_PRIOR):
    """log W_t(p) = log B(A + a0, t - A + b0) / (B(a0, b0) p^A (1 - p)^(t - A)), mixture prior Beta(a0, b0);
    0 <= A <= t votes, p in [0, 1] (arrays broadcast)."""
    return _kt_log_wealth(*check_draws(A, t), common.check_array("p", p, ge=0, le=1), *check_prior(prior))


def check_draws(A, t):
    """A votes among t draws (numbers or arrays, broadcast): whole, 0 <= A <= t; as float64 arrays."""
    A, t = common.check_array("A", A, integral=True, ge=0), common.check_array("t", t, integral=True, ge=0)
    common.check(bool(np.all(A <= t)), "A <= t: the votes are among the t draws")
    return A, t


def _kt_log_wealth(A, t, p, a0, b0):
    """kt_log_wealth of arguments already checked: the searches call it many times."""
    from scipy.special import betaln, xlog1py, xlogy
    return betaln(A + a0, t - A + b0) - betaln(a0, b0) - xlogy(A, p) - xlog1py(t - A, -p)


def one_sided_log_wealth(A, t, tau, side, prior=KT_PRIOR):
    """log wealth after t draws with A votes of the mixture Beta(a0, b0) restricted to q > tau (side +1) or q < tau
    (side -1): kt_log_wealth times the posterior mass beyond tau over the prior's. A supermartingale when p <= tau
    (side +1), so by Ville P(ever >= 1 / alpha) <= alpha; underflow only lowers it (prior mass floored)."""
    common.check(side in (-1, 1) and not isinstance(side, bool), f"side must be +1 (against pA <= tau) or -1 "
                                                                  f"(against pA >= tau), not {side!r:.20}")
    common.check_float("tau", tau, gt=0, lt=1)
    return _one_sided_log_wealth(*check_draws(A, t), tau, side, *check_prior(prior))


def _one_sided_log_wealth(A, t, tau, side, a0, b0):
    """one_sided_log_wealth of arguments already checked (threshold_row's search)."""
    from scipy.special import betainc, betaincc
    a, b = A + a0, t - A + b0
    tail, mass = (betaincc(a, b, tau), betaincc(a0, b0, tau)) if side > 0 else \
        (betainc(a, b, tau), betainc(a0, b0, tau))
    with np.errstate(divide="ignore"):
        return _kt_log_wealth(A, t, tau, a0, b0) + np.log(tail) - math.log(max(float(mass), 1e-300))


def first_true(lo, hi, ok, guess=None):
    """Per entry, the smallest integer x in [lo, hi] with ok(x, at) (rising in x; `at`: the open entries), hi + 1 if
    none, by binary search on whole arrays; guess: near each answer (guess -/+ 4 are probed first)."""
    lo, hi = np.array(lo, dtype=np.int64), np.array(hi, dtype=np.int64)   # below lo: not ok; above hi: ok
    for edge in () if guess is None else (np.asarray(guess, dtype=np.int64) + d for d in (-4, 4)):
        at = np.flatnonzero((lo <= edge) & (edge <= hi))
        good = ok(edge[at], at)
        hi[at[good]], lo[at[~good]] = edge[at][good] - 1, edge[at][~good] + 1
    at = np.flatnonzero(lo <= hi)
    while len(at):
        mid = (lo[at] + hi[at]) // 2
        good = ok(mid, at)
        hi[at[good]], lo[at[~good]] = mid[good] - 1, mid[~good] + 1
        at = at[lo[at] <= hi[at]]
    return lo


def threshold_row(tau, checks, level, side, prior=KT_PRIOR):
    """Per check t: side +1, the smallest A > t tau whose log wealth against pA <= tau reaches `level` (t + 1: none);
    side -1, the largest A < t tau whose wealth against pA >= tau reaches it (-1: none); one_sided_log_wealth.
    Every 8th check first: their answers, interpolated, guide the others."""
    common.check_float("tau", tau, gt=0, lt=1)
    common.check(side in (-1, 1), f"side must be +1 or -1, not {side!r:.20}")
    common.check(not math.isnan(level), "level is NaN; a log wealth (math.inf: never)")
    t = np.asarray(common.check_array("checks", checks, ndim=1, integral=True, ge=1), dtype=np.int64)
    a0, b0 = check_prior(prior)
    lo, hi = (np.floor(t * tau).astype(np.int64) + 1, t) if side > 0 else (0 * t, np.ceil(t * tau).astype(np.int64) - 1)

    def search(idx, guess=None):   # side -1: the first A whose wealth falls short of the level, minus 1
        def ok(A, at):
            w = _one_sided_log_wealth(np.asarray(A, dtype=float), t[idx[at]].astype(float), tau, side, a0, b0)
            return w >= level if side > 0 else w < level
        return first_true(lo[idx], hi[idx], ok, guess) - (side < 0)
    coarse = np.r_[np.arange(0, len(t) - 1, 8), len(t) - 1]
    return search(np.arange(len(t)), np.interp(t, t[coarse], search(coarse)).round())


def grid_tables(taus, checks, alpha_seq, beta, alpha_fin, N_max, prior=KT_PRIOR):
    """Integer thresholds of the grid's tests per tau_j = Phi(r_j / sigma) and check t = checks[i]:
    level j is certified once A >= lower[j, i] (A / t > tau_j and log W+_t(tau_j) >= log(1 / alpha_seq)) and
    ruled out once A <= upper[j, i] (A / t < tau_j and log W-_t(tau_j) >= log(1 / beta)); unreachable: t + 1,
    -1 (threshold_row). Both made non-decreasing over j (only removes certificates). Returns int64 lower, upper
    (k, len(checks)) and final (final_thresholds at alpha_fin)."""
    level_seq = math.log(1 / alpha_seq) if alpha_seq > 0 else math.inf
    level_beta = math.log(1 / beta) if beta > 0 else math.inf
    lower = [threshold_row(tau, checks, level_seq, +1, prior) for tau in taus]
    upper = [threshold_row(tau, checks, level_beta, -1, prior) for tau in taus]
    lower, upper = np.maximum.accumulate(lower, axis=0), np.maximum.accumulate(upper, axis=0)
    return {"lower": lower, "upper": upper, "final": final_thresholds(taus, N_max, alpha_fin)}


def final_thresholds(taus, N_max, alpha_fin):
    """The smallest A whose Clopper-Pearson bound at alpha_fin (per tau, or one) over N_max draws reaches tau_j (> 1/2
    for tau_0 = 1/2, as CERTIFY), N_max + 1 if none or at alpha_fin = 0 (no final look)."""
    taus = np.asarray(taus, dtype=float)
    alphas, strict = np.broadcast_to(alpha_fin, taus.shape), np.arange(len(taus)) == 0

    def certifies(A, at):
        bound = common.clopper_pearson_lower(A, N_max, alphas[at])
        return (bound > taus[at]) | (~strict[at] & (bound >= taus[at]))
    return first_true(np.zeros(len(taus)), np.full(len(taus), N_max), certifies)


def crossing_probability(lower, checks, p, drop=1e-15):
    """P(A_t >= lower[i] at some check t = checks[i]) when each draw votes cA with probability p, by dynamic
    programming over the paths not yet crossed: the error a sequential test spends. An upper bound: every rounding
    counts as crossing (1e-12 per cutting check, `drop` of lower tail per check, binomial tails under 1e-20)."""
    from scipy.signal import fftconvolve
    from scipy.stats import binom
    checks = common.check_array("checks", checks, ndim=1, integral=True, ge=1)
    common.check(len(np.asarray(lower)) == len(checks) and bool(np.all(np.diff(checks) > 0)),
                 f"lower ({len(np.asarray(lower))}) must have one threshold per check ({len(checks)}), checks rising")
    common.check_float("p", p, ge=0, le=1)
    dist, offset, previous, crossed = np.ones(1), 0, 0, 0.0   # dist[k]: P(A = offset + k, not crossed)
    sizes = np.unique(np.diff(checks, prepend=0)).astype(np.int64)
    steps = {}                                                 # n -> (first count kept, its pmf, mass cut off)
    for n, pmf in zip(sizes, binom.pmf(np.arange(sizes.max() + 1), sizes[:, None], p)):   # one call for all
        keep = np.flatnonzero(pmf > 1e-20)
        lo, hi = (int(keep[0]), int(keep[-1])) if len(keep) else (0, 0)
        steps[int(n)] = (lo, pmf[lo:hi + 1], float(pmf[:lo].sum() + pmf[hi + 1:].sum()))
    for t, threshold in zip(np.asarray(checks).tolist(), np.asarray(lower).tolist()):
        lo, step, cut_off = steps[t - previous]
        dist = np.clip(fftconvolve(dist, step), 0.0, None) if len(dist) * len(step) > 200_000 else \
            np.convolve(dist, step)
        offset, crossed = offset + lo, crossed + cut_off
        cut = int(np.searchsorted(np.cumsum(dist), drop, side="right")) if dist[0] <= drop else 0   # mass <= drop
        if cut:
            crossed += float(dist[:cut].sum())
            dist, offset = dist[cut:], offset + cut
        if threshold - offset < len(dist):
            crossed += float(dist[max(threshold - offset, 0):].sum()) + 1e-12
            dist = dist[:max(threshold - offset, 0)]
        previous = t
    return min(crossed, 1.0)


def kt_interval(A, t, alpha_low, beta_up, prior=KT_PRIOR):
    """[L, U]: the p the betting sequence with mixture `prior` has not rejected after t draws with A votes, at
    level alpha_low below A / t and beta_up above (log W_t(p) <= 0 at A / t, rising away: one root per end)."""
    common.check_int("t", t, 0)
    common.check_int("A", A, 0, t)
    common.check_float("alpha_low", alpha_low, ge=0, lt=1)
    common.check_float("beta_up", beta_up, ge=0, lt=1)
    a0, b0 = check_prior(prior)
    from scipy.optimize import brentq
    if t == 0:
        return 0.0, 1.0
    center, tiny = A / t, 1e-300

    def end(level, outside):   # the root of log W_t(p) = level between the center and `outside`
        if level == math.inf or _kt_log_wealth(A, t, outside, a0, b0) < level:
            return outside
        return brentq(lambda p: _kt_log_wealth(A, t, p, a0, b0) - level, min(center, outside), max(center, outside),
                      xtol=1e-15)
    L = 0.0 if A == 0 else end(math.log(1 / alpha_low) if alpha_low > 0 else math.inf, tiny)
    U = 1.0 if A == t else end(math.log(1 / beta_up) if beta_up > 0 else math.inf, 1 - 1e-16)
    return float(L), float(U)


# ----------------------------------------------------------------------------------------------------------
# Anytime-valid certification at a grid of radii (Voráček 2024; Horváth et al. 2022)
# ----------------------------------------------------------------------------------------------------------

# --radii looks at 16 draws, then every 2 % more, at most 200 draws apart (732 looks up to 10^5): finer
# looks stop closer to where the evidence suffices and cost no evaluations, since an example's chunks are packed
# with other examples' into full passes (--group); the looks cost nothing in alpha beyond what grid_plan accounts.
LOOK_FIRST, LOOK_GROWTH, LOOK_MAX_GAP = 16, 1.02, 200
NEAR_PRIOR = 1e-3   # ruled_out_rows: exact beta where the prior's mass below tau_j is in [1e-3, 1 - 1e-3]
# The tests behind --radii's decisions, recorded in the sidecar: a log is only resumed under the same ones.
GRID_TEST = ("one-sided, prior from the selection votes, looks every 2 %, exact beta near the prior and per-level "
             "final look")


def look_schedule(N_max, first=LOOK_FIRST, growth=LOOK_GROWTH, max_gap=LOOK_MAX_GAP):
    """The draw counts at which --radii looks at an example: `first`, then growing geometrically (at most
    `max_gap` apart), and N_max.

    Counted in draws, not in passes: an easy example stops after tens of draws whatever --batch is, since
    the model still evaluates full batches of draws packed from several examples (grid_certify_many)."""
    for name, n in (("N_max", N_max), ("first", first), ("max_gap", max_gap)):
        common.check_int(name, n)
    common.check_float("growth", growth, gt=1)
    looks, t = [], first
    while t < N_max:
        looks.append(int(t))
        t = min(max(t + 1, math.ceil(t * growth)), t + max_gap)
    return looks + [int(N_max)]


def grid_plan(radii, sigma, N_max, alpha, beta=None, final_look=True, zero_level=True, looks=None):
    """The precomputed part of GRID-CS for one (sigma, radii, budget): levels r_0 = 0 < r_1 < ... (no r_0 = 0
    with zero_level False: --no-zero-level), their thresholds tau_j = Phi(r_j / sigma), the check times
    (look_schedule) and, through prior_tables, the integer tables of the tests (threshold_row) with
    their exact alpha accounting.

    The tests. Level j is certified when the one-sided mixture against pA <= tau_j reaches 1 / alpha and
    ruled out when the one against pA >= tau_j reaches a level set for beta (one_sided_log_wealth). Ruling out
    never makes a certificate wrong, it only loses one; each level's rule-out is set at a wealth level whose
    exact error is at most beta and near it (ruled_out_rows: P(level j ever ruled out | pA = tau_j) <= beta,
    exact), not at Ville's 1 / beta, whose error the looks leave at 0.5-0.8 beta. looks: the check times
    (default look_schedule(N_max)).

    The mixture's prior. An example whose candidate cA got k0 of the N0
    selection votes is tested with the prior Beta(k0 + 1/2, N0 - k0 + 1/2) (job_tables), the KT
    posterior of those votes: it centres the mixture near pA, so the wealth grows about as fast as if pA were
    known to within sqrt(pA (1 - pA) / N0). Valid because the estimation draws are independent of the
    selection draws: given the selection (cA and k0), the prior is fixed before the test's first draw, and
    every statement below holds conditionally on it, hence also on average. Without selection draws (label
    mode): the KT prior Beta(1/2, 1/2). The plan's own lower, upper, final, reach,
    alpha_fin and spent are the KT prior's; prior_tables gives any other's (computed once, then cached).

    Exact alpha accounting. The thresholds are set at alpha (Ville's bound makes the sequence valid alone), but on this schedule of checks it spends less: crossing_probability gives
    the exact probability that it ever certifies level j when pA = tau_j (the worst case of a wrong certificate
    at r_j: crossing rises with pA, and a higher level is only crossed after this one, the tables being
    monotone in j). The final Clopper-Pearson look at N_max gets the rest, level by level: alpha_fin_j =
    alpha - spent_j, separately for each prior (its thresholds made monotone in j, so that a final certificate
    of r_j or more needs the bound at alpha_fin_j to reach tau_j). Guarantee, per example and whatever the
    stopping (early stops only end sampling): when pA <= tau_j, P(certified radius >= r_j | selection) <=
    spent_j + alpha_fin_j = alpha. Without final_look there is no final look (the sequence's Ville bound
    alone).
    beta defaults to DEFAULT_BETA, final_look to True (certify.py's defaults).
    """
    beta = DEFAULT_BETA if beta is None else common.check_float("beta", beta, ge=0, lt=1)
    radii = common.check_array("radii", radii, ndim=1, ge=0).tolist()
    common.check_smoothing(sigma, alpha, N_max=N_max)
    sigma, alpha = float(sigma), float(alpha)   # a tensor or numpy number: a plain float in the plan
    common.check_type("final_look", final_look, bool)
    common.check_type("zero_level", zero_level, bool)
    radii = sorted({0.0, *radii} if zero_level else set(radii))
    checks = look_schedule(N_max) if looks is None else \
        common.check_array("looks", looks, ndim=1, integral=True, ge=1, le=N_max).astype(int).tolist()
    common.check(checks[-1] == N_max and all(np.diff(checks) > 0), "looks must rise and end at N_max")
    plan = dict(radii=radii, sigma=float(sigma), taus=ndtr(np.array(radii) / sigma), checks=checks,
                position={t: i for i, t in enumerate(checks)}, alpha=alpha, alpha_seq=alpha, beta=beta,
                N_max=N_max, final_look=final_look, cache={})
    # the final look's thresholds at the whole alpha, the same for every prior (prior_tables' final_bound)
    plan["final_bound"] = final_thresholds(plan["taus"], N_max, alpha if final_look else 0.0)
    return dict(plan, **final_look_tables(plan, prior_tables(plan, KT_PRIOR)))


def prior_tables(plan, prior):
    """grid_plan's tables for the mixture Beta(prior), cached: lower (threshold_row), upper (ruled_out_rows),
    reach (votes beyond all-cA draws still needed: curtailing) and final_bound (the final look's at the whole alpha)."""
    key = check_prior(prior)
    if key not in plan["cache"]:
        checks, level = plan["checks"], math.log(1 / plan["alpha_seq"])
        lower = np.maximum.accumulate([threshold_row(tau, checks, level, +1, key)
                                       for tau in plan["taus"]], axis=0)
        slack = lower - np.array(checks)
        reach = np.minimum.accumulate(slack[:, ::-1], axis=1)[:, ::-1]   # suffix minima: can level j still come?
        plan["cache"][key] = dict(lower=lower, upper=ruled_out_rows(plan, key), reach=reach,
                                  final_bound=plan["final_bound"], prior=key)
    return plan["cache"][key]


def ruled_out_rows(plan, prior):
    """prior_tables' upper: level j is ruled out once A <= upper[j, i]; row by row (each >= the one below) at a log
    wealth whose exact error P(ever ruled out | pA = tau_j) is <= beta and near it (up to three secant steps from
    Ville's log(1 / beta)) where the prior's mass below tau_j is in [NEAR_PRIOR, 1 - NEAR_PRIOR]; else Ville's."""
    from scipy.special import betainc
    checks, beta, floor, rows = np.array(plan["checks"]), plan["beta"], -1, []
    for tau in plan["taus"]:
        exact = NEAR_PRIOR <= betainc(*prior, tau) <= 1 - NEAR_PRIOR

        def tried(level):
            row = np.maximum(floor, threshold_row(tau, checks, level, -1, prior))
            error = crossing_probability(checks - row, checks, 1 - tau, 1e-12) if exact else 0.0
            return level, row, error   # A <= row: t - A >= t - row
        good, bad, slope = tried(math.log(1 / beta) if beta > 0 else math.inf), None, -1.0
        for _ in range(3 if 0 < good[2] < beta else 0):
            if good[2] > 0.9 * beta:
                break
            level = good[0] + math.log(0.98 * beta / good[2]) / slope
            new = tried(level if bad is None or bad[0] < level else (bad[0] + good[0]) / 2)
            slope = min(math.log(max(new[2], 1e-300) / good[2]) / (new[0] - good[0]), -0.05)
            good, bad = (new, bad) if new[2] <= beta else (good, new)
        floor = good[1]
        rows.append(floor)
    return np.array(rows)


def final_look_tables(plan, tables):
    """Adds grid_plan's exact alpha accounting to prior_tables' tables, once: spent_levels (the sequence's error at
    pA = tau_j), alpha_fin_levels = alpha - spent_j (0 without final_look), final (monotone), spent, alpha_fin."""
    if "final" not in tables:
        alpha, checks = plan["alpha"], plan["checks"]
        spent = np.array([crossing_probability(tables["lower"][j], checks, tau)
                          for j, tau in enumerate(plan["taus"])])
        common.check(spent.max() <= alpha, f"the sequence spends {spent.max():.3g} > alpha")
        alpha_fin = np.maximum(alpha - spent, 0.0) if plan["final_look"] else np.zeros(len(spent))
        final = np.maximum.accumulate(final_thresholds(plan["taus"], plan["N_max"], alpha_fin))
        tables.update(spent_levels=spent, alpha_fin_levels=alpha_fin, final=final, spent=float(spent.max()),
                      alpha_fin=float(alpha_fin.min()))
    return tables


def job_tables(plan, k0, N0):
    """The tables for a candidate with k0 of N0 selection votes: the posterior Beta(k0 + 1/2, N0 - k0 + 1/2)'s
    (prior_tables), or the plan's own (KT's prior) without selection draws (grid_plan)."""
    if not N0:
        return plan
    common.check_int("k0", k0, 0, common.check_int("N0", N0, 0))
    return prior_tables(plan, (k0 + 0.5, N0 - k0 + 0.5))


def decided_levels(tables, A, i, final=False):
    """(highest certified level, highest not ruled out) after check i with A votes (-1: none); columns rise in j."""
    common.check_int("i", i, 0, tables["lower"].shape[1] - 1)
    common.check_int("A", A, 0)
    certified = int(np.searchsorted(tables["lower"][:, i], A, side="right"))
    if final:
        certified = max(certified, int(np.searchsorted(tables["final"], A, side="right")))
    return certified - 1, int(np.searchsorted(tables["upper"][:, i], A, side="left")) - 1


def grid_certify(model, x, sigma, N0, batch, num_classes, generator=None, plan=None, copies=common.gaussian_copies,
                 candidate=None):
    """GRID-CS on one input (grid_certify_many, see there). plan: grid_plan(...), required."""
    common.check(plan is not None, "grid_certify needs plan= (a grid_plan(radii, sigma, N_max, alpha))")
    return grid_certify_many(model, [(x, generator, candidate)], sigma, N0, batch, num_classes, plan, copies)[0]


class GridJob:
    """One example of grid_certify_many, its draws cut into chunks (selection, each gap between looks) of <= batch."""

    def __init__(self, x, generator, candidate, N0, batch, num_classes, plan):
        self.x, self.generator, self.cA, self.plan = x, generator, candidate, plan
        select = [] if candidate is not None else [("select", k) for k in common.pass_sizes(N0, batch)]
        ends = np.diff(np.concatenate([[0], plan["checks"]])).astype(int)
        self.chunks = select + [(i, k) for i, gap in enumerate(ends) for k in common.pass_sizes(int(gap), batch)]
        self.next, self.drawn = 0, 0
        self.tables = plan                                   # replaced after selection (job_tables)
        self.counts = np.zeros(num_classes + 1, np.int64)    # + a column of failed sound draws
        self.jL, self.jU, self.stop, self.done = -1, len(plan["radii"]) - 1, "budget", False

    def ahead(self, room):
        """The chunks to draw in this pass, within room: the next, then more while none could end it at a look."""
        plan, tables, nxt, A = self.plan, self.tables, self.jL + 1, int(self.counts[self.cA or 0])
        sizes, end = [], self.next
        while end < len(self.chunks) and sum(sizes) + self.chunks[end][1] <= room:
            (i, k), end = self.chunks[end], end + 1
            sizes.append(k)
            if end == len(self.chunks) or self.chunks[end][0] == i:   # no look after this chunk
                continue
            t = plan["checks"][i] if i != "select" else 0
            if i == "select" or i == len(plan["checks"]) - 1 or A + t - self.drawn >= tables["lower"][nxt, i] or \
                    A <= tables["upper"][nxt, i] or (A - t < tables["reach"][nxt, i] and
                                                     A + plan["N_max"] - t < tables["final_bound"][nxt]):
                break
        return sizes

    def add(self, votes):
        """Count one chunk's votes (class indices; num_classes for a failed draw), then look if it ends a gap."""
        phase, k = self.chunks[self.next]
        self.counts += np.bincount(votes, minlength=len(self.counts))
        self.next += 1
        if phase == "select":
            if self.next == len(self.chunks) or self.chunks[self.next][0] != "select":
                self.cA = int(self.counts[:-1].argmax())          # first class on ties, as CERTIFY
                k0, N0 = int(self.counts[self.cA]), int(self.counts.sum())
                self.tables = job_tables(self.plan, k0, N0)
                self.counts[:] = 0
            return
        self.drawn += k
        if self.drawn == self.plan["checks"][phase]:
            self.look(phase)

    def look(self, i):
        """The rule of GRID-CS after look i with A votes for cA (grid_certify_many)."""
        plan, tables, A, t = self.plan, self.tables, int(self.counts[self.cA]), self.drawn
        last = i == len(plan["checks"]) - 1
        if last:
            final_look_tables(plan, tables)
        jL, jU = decided_levels(tables, A, i, final=last)
        self.jL, self.jU = max(self.jL, jL), min(self.jU, jU)
        nxt = self.jL + 1
        if last:
            self.done = True
        elif self.jL >= self.jU or nxt == len(plan["radii"]):
            self.stop, self.done = "decided", True
        elif A - t < tables["reach"][nxt, i] and A + plan["N_max"] - t < tables["final_bound"][nxt]:
            self.stop, self.done = "curtailed", True

    def result(self):
        jL, plan = self.jL, self.plan
        return {"predict": self.cA if jL >= 0 else -1, "radius": plan["radii"][jL] if jL >= 0 else 0.0,
                "nA": int(self.counts[self.cA]), "N": self.drawn, "stop": self.stop, "prior": self.tables["prior"],
                "counts": self.counts[:-1].tolist(), "pA_certified": float(plan["taus"][jL]) if jL >= 0 else 0.0}


def grid_interval(out, plan):
    """(pA_lower, pA_upper) of a grid_certify_many result, the log's estimate of pA: the betting interval of its
    count with its test's prior (alpha_seq below, beta above), the lower end raised to the final look's
    Clopper-Pearson bound where it ran to N_max. Its pA_certified, not this, is what the radius rests on."""
    common.check(out["N"] <= plan["N_max"], f"out has N = {out['N']} draws, beyond the plan's N_max = {plan['N_max']}")
    L, U = kt_interval(out["nA"], out["N"], plan["alpha_seq"], plan["beta"], out["prior"])
    tables = final_look_tables(plan, prior_tables(plan, out["prior"])) if out["N"] == plan["N_max"] else {}
    if tables.get("alpha_fin", 0) > 0:
        L = max(L, float(common.clopper_pearson_lower(out["nA"], out["N"], tables["alpha_fin"])))
    return L, U


def grid_certify_many(model, items, sigma, N0, batch, num_classes, plan, copies=common.gaussian_copies):
    """GRID-CS: cA from N0 draws (or the candidate), then draws until each example's level is decided, all packed into
    passes of `batch`. items: (x (C, H, W), generator, candidate or None). An example stops when decided, when the
    next level is out of reach (curtailed) or at N_max (budget, with the final look); whatever the stopping, its
    radius is wrong with probability <= alpha (grid_plan). Returns per item predict (-1: none), radius, nA, N, stop,
    prior, counts, pA_certified. sigma must be the plan's own; copies: gaussian_copies or sound_copies."""
    common.check_type("plan", plan, dict)
    common.check_smoothing(sigma, batch=batch, num_classes=num_classes)
    common.check_int("N0", N0, 0)   # 0: no selection draws (the candidates given)
    common.check(plan.get("sigma") == float(sigma), f"sigma {sigma} is not its plan's {plan.get('sigma')} (grid_plan)")
    common.check_type("copies", copies, callable)
    common.check(isinstance(items, (list, tuple)) and len(items) > 0 and
                 all(isinstance(item, (list, tuple)) and len(item) == 3 for item in items),
                 "items must be a non-empty list of (x, generator, candidate) triples")
    for item in items:
        common.check_smoothed(model, item[0], item[1])
        if item[2] is not None:   # a class of the model's: -1 would index the last one
            common.check_int("candidate", item[2], 0, num_classes - 1)
    common.check(N0 >= 1 or all(item[2] is not None for item in items), "N0 must be >= 1 where an item has no "
                                                                        "candidate (its class is selected from N0 draws)")
    common.check(len({(tuple(item[0].shape), item[0].dtype) for item in items}) == 1,
                 "items: every x must have one shape and dtype (their draws share forward passes)")
    jobs = [GridJob(x, g, c, N0, batch, num_classes, plan) for x, g, c in items]
    active = list(jobs)
    with torch.inference_mode(), common.eval_mode(model):
        while active:
            room, taken, inputs, failures = batch, [], [], []
            for job in active:   # each chunk drawn on its own: an example's noise does not depend on the packing
                for k in job.ahead(room):
                    noisy, failed = copies(job.x.unsqueeze(0), k, sigma, job.generator)
                    taken.append((job, k))
                    inputs.append(noisy)
                    failures.append(failed)
                    room -= k
                if room == 0:
                    break
            inputs = torch.cat(inputs)
            logits = model(inputs)
            common.check(isinstance(logits, torch.Tensor) and logits.shape == (len(inputs), num_classes),
                         f"the model gave {getattr(logits, 'shape', type(logits).__name__)} for {len(inputs)} inputs; "
                         f"expected ({len(inputs)}, num_classes = {num_classes})")
            pred = torch.where(torch.isfinite(logits).all(1), logits.argmax(1), -1)
            if failures[0] is not None:   # the sound sampler's failed draws vote for no class
                pred = torch.where(torch.cat(failures), num_classes, pred)
            pred = pred.cpu().numpy()   # one transfer per pass
            common.check(bool((pred >= 0).all()), f"the model gave non-finite outputs on noisy inputs (sigma {sigma}); "
                                                   f"no certificate from them: lower --sigma, or use fp32 (--precision)")
            start = 0
            for job, k in taken:   # chunk by chunk, in order: every look as if each chunk had its own pass
                job.add(pred[start:start + k])
                start += k
            active = [job for job in active if not job.done]
    return [job.result() for job in jobs]

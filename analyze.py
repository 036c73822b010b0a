"""Evaluate certification logs: ACR, certified accuracy, best over sigma, ECDF of pA, budgets (§4, §7, App. B).

Reads Cohen-format TSVs only (`idx label predict radius correct time`, ours add `nA N`), never checkpoints:
the logs this repository's certify.py writes and those other projects publish. Subcommands:

  table     ACR and certified accuracy at radii, one row per log, grouped by sigma (Tables 3, 4; Fig. 6)
  envelope  best certified accuracy across sigma at each radius, per method, and which log gives it (§7)
  ecdf      P(pA >= p) for p in [0.5, 1] and which model dominates which (Figs. 3, 7, 9, 11; App. B.2, B.3)
  budget    expected certified accuracy under another budget --N --alpha, from the ECDF (Fig. 8; App. B.1)
  theory    the trivial classifier of Theorem 1 against a pA = 0.9 classifier, and Figure 2 (§4.1, §4.2)
  trainpa   pA of the training set from train_ours.py's estimates or train-split logs (§5.1)
  gradnorm  gradient norm of easy (pA > 0.5) and hard (pA < 0.5) examples (Table 2, Fig. 5)
  ablation  Table 5 from logs labelled by the parts of our method that were on
  compare   B - A for every metric, with an interval for the test sample, Monte Carlo and seed noise
  paper     all of the above that the paper's published logs allow (the list sits at the bottom of this file)

Markdown goes to stdout; --out DIR also writes .md/.tex/.tsv files and figures (PNG + PDF).

Usage: python analyze.py theory --out figures
       python analyze.py table runs/certify/*.tsv --radii 0 0.25 0.5 0.75 1
       python analyze.py paper --root acr-weakness --out figures
"""
import argparse
import contextlib
import functools
import glob
import math
import json
import os
import re
import sys

import numpy as np
from scipy.special import ndtri   # scipy.stats' norm.ppf (and -ndtri its isf), bit for bit, without its import time

import common
import readers
import machinery

PAPER_N, PAPER_ALPHA = 100_000, 0.001               # the certification budget of every table in the paper
COHEN_COLUMNS, GRADNORM_COLUMNS = readers.COHEN_COLUMNS, readers.GRADNORM_COLUMNS
DEFAULT_RADII = [0.25 * i for i in range(11)]       # Table 3: 0.00, 0.25, ..., 2.50
# The p grid of the published ECDF files, float noise included: a few points lie one ulp above p = k / 1000
# (0.5640000000000001, ...), where P(pA >= p) leaves out the examples with pA exactly k / 1000.
ECDF_GRID = np.linspace(0.5, 1.0, 501)
FULL_GRID = np.linspace(0.0, 1.0, 1001)             # the whole range of pA (Fig. 3), where nY is recorded
# §4.3 in numbers: mass near 0 (hard inputs given up) and near 1 (easy inputs), and §5.1's pA < 0.5.
SHARES = (("P(pA<0.1)", lambda p: p < 0.1), ("P(pA<0.5)", lambda p: p < 0.5), ("P(pA≥0.9)", lambda p: p >= 0.9),
          ("P(pA≥0.99)", lambda p: p >= 0.99))
SUMMARY_P = [0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0]
# A model whose clean accuracy is below twice chance (2 / classes) has collapsed: its training failed, so its
# pA describes that failure, not its method. §4.3's sentence flags it and gives no verdict for it.
COLLAPSE_FLOOR = 2.0
PARTS = ("discard", "weight", "attack")             # Table 5: §5.1, §5.2, §5.3


def parse_args(argv=None):
    p = machinery.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, parser_class=machinery.ArgumentParser)
    add_metric_commands(sub)
    add_training_commands(sub)
    import compare   # compare.py builds on this module, so it is imported here, where it adds its command
    compare.add_command(sub)
    add_paper_command(sub)
    return p.parse_args(argv)


def logs_command(sub, name, help_text, logs_help="certification TSVs (Cohen's columns, optionally nA N)"):
    """A subcommand that reads certification logs, with the options every such command takes."""
    s = sub.add_parser(name, help=help_text, description=help_text)
    s.add_argument("logs", nargs="+", help=logs_help)
    s.add_argument("--labels", nargs="+", help="one label per log (default: from the path, e.g. "
                                               "certify/cifar10/ours/noise_0.5.tsv -> ours)")
    s.add_argument("--sigmas", nargs="+", type=float, help="one sigma per log (default: from the path, "
                                                            "e.g. noise_0.25 or sigma0.5, else <log>.json)")
    s.add_argument("--out", help="folder for .md/.tex/.tsv files and PNG + PDF figures")
    add_allow_different(s)
    return s


def add_allow_different(s):
    """The one flag that sets logs of different settings (readers.SETTINGS) side by side."""
    s.add_argument("--allow-different", nargs="+", choices=readers.COMPARED, default=[], metavar="SETTING",
                   help="set side by side logs that differ in these settings (dataset, split, budget: N and alpha, "
                        "mode: label mode, DDRS ...), which is otherwise refused: a row of one would not mean what "
                        "it means in the other. Reports then name what differs (docs/analysis.md)")


def add_metric_commands(sub):
    """table, envelope, ecdf, budget and theory: the metrics of §4 and §7."""
    s = logs_command(sub, "table", "ACR and certified accuracy at radii, grouped by sigma (Tables 3, 4)")
    s.add_argument("--radii", nargs="+", type=float, default=DEFAULT_RADII, help="default 0 to 2.5 step 0.25")
    s.add_argument("--format", choices=("markdown", "latex", "tsv"), default="markdown", help="what stdout gets")
    s.add_argument("--baseline", help="label of the row that LaTeX greys against (default: gaussian, if a log "
                   "has that label)")
    s.add_argument("--group-by-seed", action="store_true", help="Table 8: logs of one method and sigma from "
                   "several seeds (paths that differ only in a seed part, e.g. seed1/ or _seed2, or equal "
                   "--labels) become one row, mean ± sample standard deviation over the seeds")

    s = logs_command(sub, "envelope", "best certified accuracy across sigma at each radius, per label (§7)")
    s.add_argument("--radii", nargs="+", type=float, default=DEFAULT_RADII, help="default 0 to 2.5 step 0.25")

    s = logs_command(sub, "ecdf", "empirical distribution P(pA >= p), p in [0.5, 1], and dominance (App. B.2, B.3)")
    s.add_argument("--N", type=int, help=f"certification N of logs without nA/N columns or sidecar "
                                         f"(default {PAPER_N})")
    s.add_argument("--alpha", type=float, help=f"certification alpha of logs without sidecar "
                                               f"(default {PAPER_ALPHA})")
    s.add_argument("--pmax", type=float, default=0.99, help="compare models on p in [0.5, pmax] (default 0.99: "
                                                            "where the paper's App. B.3 statements hold) and on "
                                                            "[0.5, 1]")
    s.add_argument("--baseline", help="label that §4.3's statement compares each method with (default: gaussian, "
                   "if a log has that label)")

    s = logs_command(sub, "budget", "expected certified accuracy under another budget --N --alpha (App. B.1)",
                     logs_help="certification TSVs, or ECDF files with columns `x y` (as published)")
    s.add_argument("--N", type=int, required=True, help="the new certification budget N")
    s.add_argument("--alpha", type=float, required=True, help="the new failure probability alpha")
    s.add_argument("--radii", nargs="+", type=float, default=DEFAULT_RADII, help="radii of the Markdown table")
    s.add_argument("--log-N", type=int, help=f"N the logs were certified with, if they do not say "
                                             f"(default {PAPER_N})")
    s.add_argument("--log-alpha", type=float, help=f"alpha the logs were certified with, if they do not say "
                                                   f"(default {PAPER_ALPHA})")

    s = sub.add_parser("theory", help="Theorem 1's toy example and Figure 2 in numbers (§4.1, §4.2)")
    s.add_argument("--N", type=int, default=PAPER_N, help="budget of Figure 2 (the toy example scans N)")
    s.add_argument("--alpha", type=float, default=PAPER_ALPHA, help="alpha of both")
    s.add_argument("--sigma", type=float, default=1.0, help="sigma of both")
    s.add_argument("--pA", type=float, default=0.9, help="pA of the non-trivial classifier on every input")
    s.add_argument("--Nmax", type=int, default=1000, help="the toy example scans N = 1 .. Nmax for order flips")
    s.add_argument("--out", help="folder for theory.md/.tsv and the figures")


def add_training_commands(sub):
    """trainpa, gradnorm and ablation: what §5 measures of training."""
    s = logs_command(sub, "trainpa", "pA of the training set (§5.1): histogram, shares below 0.5 and below pt",
                     logs_help="train_ours.py's estimates (pA_epoch*_discard.tsv, pA_epoch*_weights.tsv: idx "
                               "label count n) or certify.py --split train logs (with nY)")
    s.add_argument("--pt", type=float, default=0.4, help="the discard threshold to report (default 0.4, "
                                                         "Table 6 at sigma 0.5)")

    s = logs_command(sub, "gradnorm", "mean gradient norm of easy and hard examples (Table 2) and histograms (Fig. 5)",
                     logs_help="gradient-norm TSVs (columns idx label pA grad_norm) of the training scripts")
    s.add_argument("--acr", nargs="+", metavar="LOG", help="certification logs of the probed models, one per "
                   "gradient-norm file in order ('-' for none): Table 2's ACR column")
    s.add_argument("--level", type=float, default=0.95, help="coverage of the intervals (simultaneous for the "
                   "comparisons with the first file)")
    s.add_argument("--replicates", type=int, default=2000, help="bootstrap replicates (default 2000)")
    s.add_argument("--seed", type=int, default=0, help="seed of the bootstrap")

    s = logs_command(sub, "ablation", "Table 5: ACR and certified accuracy of logs labelled by the parts that were on")
    s.add_argument("--parts", nargs="+", required=True,
                   help="one per log: 'none' (Gaussian) or parts joined by '+', e.g. discard+weight+attack")
    s.add_argument("--radii", nargs="+", type=float, default=DEFAULT_RADII, help="default 0 to 2.5 step 0.25")
    s.add_argument("--format", choices=("markdown", "latex", "tsv"), default="markdown", help="what stdout gets")


def add_paper_command(sub):
    """paper: every table and figure of the published logs."""
    s = sub.add_parser("paper", help="every table and figure the paper's published logs allow")
    s.add_argument("--root", required=True, help="folder with certify/<dataset>/<method>/noise_<sigma>.tsv "
                                                 "(the paper repository's data folder)")
    s.add_argument("--out", help="folder for the tables and figures")


# ----------------------------------------------------------------------------------------------------------
# Reading TSVs: one clear line for a missing file, a foreign header or a malformed line
# ----------------------------------------------------------------------------------------------------------

# The readers of every format live in readers.py (one reader per format); the names analyze.py uses:
read_columns, read_lines, check_rows = readers.read_table, readers.read_lines, readers.check_rows
read_log, read_sidecar = readers.read_certification_log, readers.read_sidecar
read_train_pA, read_gradnorm = readers.read_train_pA, readers.read_gradient_norms
read_ecdf_or_log = readers.read_ecdf_or_log
# which log is which, and what each analysis refuses (readers.load_logs)
load_logs, label_from_path, sigma_from_path, strip_sigma = (readers.load_logs, readers.label_from_path,
                                                            readers.sigma_from_path, readers.strip_sigma)
shown, REFUSED = readers.shown, readers.REFUSED


# ----------------------------------------------------------------------------------------------------------
# N and alpha of a log
# ----------------------------------------------------------------------------------------------------------

def need_sigma(log):
    """sigma of a log where a conversion needs it; a UserError saying how to give it otherwise."""
    common.check(log.get("sigma") is not None, f"{log['path']}: sigma unknown (not in the path nor in a <log>.json); "
                                               f"pass --sigmas")
    return log["sigma"]


def log_budget(log, N_flag, alpha_flag):
    """(N, alpha) a log was certified with: its N column / sidecar, else the flags, else the paper's.

    A flag that contradicts the log, or an N column with several values, is a UserError: converting radii
    needs the one budget the log was certified with.
    """
    path, side = log["path"], log["sidecar"]
    N = side.get("N")
    if "N" in log:
        values = np.unique(log["N"])
        common.check(len(values) == 1, f"{path}: N varies between lines ({values[0]} .. {values[-1]}); "
                                       f"converting radii needs one N")
        common.check(N is None or int(N) == values[0], f"{path}: N column says {values[0]}, sidecar says {N}")
        N = int(values[0])
    alpha = side.get("alpha")
    for name, own, flag in (("N", N, N_flag), ("alpha", alpha, alpha_flag)):
        common.check(own is None or flag is None or float(own) == float(flag),
                     f"{path}: the log was certified with {name} = {own}, but --{name} {flag} was given")
    N = int(N if N is not None else N_flag if N_flag is not None else PAPER_N)
    alpha = float(alpha if alpha is not None else alpha_flag if alpha_flag is not None else PAPER_ALPHA)
    common.check(N >= 1 and 0 < alpha < 1, f"{path}: need N >= 1 and 0 < alpha < 1 (got N = {N}, alpha = {alpha})")
    return N, alpha


# ----------------------------------------------------------------------------------------------------------
# ACR and certified accuracy (§3, Tables 3-5)
# ----------------------------------------------------------------------------------------------------------

def check_radius_correct(radius, correct):
    """One radius (>= 0) and one correct (0/1 or bool) per example: two float64 arrays of one length."""
    radius = common.check_array("radius", radius, ndim=1, ge=0)
    correct = common.check_array("correct", correct, ndim=1, integral=True, bools=True, ge=0, le=1)
    common.check(len(radius) == len(correct), f"radius has {len(radius)} rows, correct {len(correct)}")
    return radius, correct


def acr(radius, correct):
    """Average certified radius: the mean over all examples of radius * 1[correct] (abstentions count 0)."""
    radius, correct = check_radius_correct(radius, correct)
    return float(np.mean(np.where(correct, radius, 0.0)))


def certified_accuracy(radius, correct, radii):
    """Share of examples with correct = 1 and radius >= r, for each r in radii (an array like radii)."""
    radius, correct = check_radius_correct(radius, correct)
    radii = common.check_array("radii", radii, ndim=1)
    radius = np.where(correct, radius, -np.inf)
    return np.array([np.mean(radius >= r) for r in radii])


def decided(log, radii):
    """Where a log decides certified accuracy (a boolean array like radii): at every radius for CERTIFY; for a grid
    log (certify.py --radii) at its levels only (r = 0 among them unless --no-zero-level), its count elsewhere
    being a lower bound. A grid log without its settings file (levels unknown) is taken to decide every radius."""
    levels = (log.get("sidecar") or {}).get("radii")
    if not log.get("grid") or not isinstance(levels, list):
        return np.ones(len(radii), dtype=bool)
    return np.isin(np.asarray(radii, dtype=float), np.asarray(levels, dtype=float))


def fine_radii(logs):
    """A radius grid up to the largest radius of the logs, for curves."""
    top = max(float(np.max(np.where(log["correct"], log["radius"], 0.0))) for log in logs)
    return np.linspace(0.0, max(top, 1e-3) * 1.02, 400)


# ----------------------------------------------------------------------------------------------------------
# The ECDF of pA and budgets (App. B): pA is the empirical share nA / N, not its lower bound
# ----------------------------------------------------------------------------------------------------------

def radius_of_count(nA, N, alpha, sigma):
    """The radius CERTIFY gives when the top class gets nA of N votes: sigma * Phi^-1(CP_lower(nA, N, alpha))."""
    common.check_float("sigma", sigma, gt=0)
    return common.certified_radius(common.clopper_pearson_lower(nA, N, alpha), sigma)


def min_count(radius, N, alpha, sigma):
    """App. B.1: the smallest count nA (of N) whose certified radius is >= radius; N + 1 where none is.

    Bisection on nA: the radius grows with nA. Elementwise on arrays (evaluated once per distinct radius).
    """
    common.check_array("radius", radius, finite=False)   # inf: never certified; below 0: any count
    common.check_smoothing(sigma, alpha, N=N)
    values, inverse = np.unique(np.asarray(radius, dtype=float), return_inverse=True)
    lo = np.zeros(len(values), dtype=np.int64)
    hi = np.full(len(values), N + 1, dtype=np.int64)        # the answer lies in [lo, hi]; N + 1: never
    while np.any(lo < hi):
        active = lo < hi
        mid = (lo + hi) // 2                                 # <= N where active
        ok = radius_of_count(np.minimum(mid, N), N, alpha, sigma) >= values
        hi = np.where(active & ok, mid, hi)
        lo = np.where(active & ~ok, mid + 1, lo)
    return lo[inverse].reshape(np.shape(radius))


def min_pA(radius, N, alpha, sigma):
    """App. B.1: the smallest pA = nA / N that certifies `radius` under (N, alpha); inf if none does."""
    k = min_count(radius, N, alpha, sigma)
    return np.where(k <= N, k / N, np.inf)


def pA_from_radius(radius, N, alpha, sigma):
    """App. B.2 for logs without counts: the smallest pA = nA / N whose radius reaches the row's radius, the
    rule the published ECDF files follow. Exact when radius is exact; a printed radius (Cohen: 3 significant
    digits) can shift nA by a count or more. A radius rounded above the largest one counts as pA = 1."""
    return np.minimum(min_count(radius, N, alpha, sigma), N) / N


def ecdf(pA, ps):
    """P(pA >= p) for each p: the share of all rows whose pA is at least p (rows with -inf never count)."""
    pA = common.check_array("pA", pA, ndim=1, finite=False, le=1)
    common.check(np.all((pA >= 0) | (pA == -np.inf)), "pA must lie in [0, 1] (or be -inf: a row that never counts)")
    common.check_array("ps", ps, ge=0, le=1)
    ordered = np.sort(pA)
    return (len(ordered) - np.searchsorted(ordered, ps, side="left")) / len(ordered)


ECDF_LEVEL = 0.95   # the simultaneous band drawn around every ECDF


def dkw_halfwidth(n, level=ECDF_LEVEL):
    """Dvoretzky-Kiefer-Wolfowitz (Massart's constant): with probability >= level the ECDF of n independent
    draws lies within this distance of the true distribution at every p at once. Here the draws are the
    images' estimates (nA / N or nY / N, not pA itself); the test sample's noise, not the Monte Carlo noise."""
    common.check_int("n", n)
    common.check_float("level", level, gt=0, lt=1)
    return math.sqrt(math.log(2 / (1 - level)) / (2 * n))


def ecdf_band_rows(ps, values, n):
    """ECDF file rows `x y low high`: the curve and its DKW band, clipped to [0, 1]."""
    eps = dkw_halfwidth(n)
    return [[repr(float(p)), repr(float(y)), repr(max(0.0, float(y) - eps)), repr(min(1.0, float(y) + eps))]
            for p, y in zip(ps, values)]


def ecdf_lookup(grid_p, grid_y, ps):
    """P(pA >= p) from a tabulated ECDF: the value at the smallest grid point >= p (exact on the grid, a lower
    bound between grid points); 0 beyond the grid."""
    grid_p, grid_y = common.check_array("grid_p", grid_p, ndim=1), common.check_array("grid_y", grid_y, ndim=1)
    common.check(len(grid_p) == len(grid_y) and np.all(np.diff(grid_p) > 0), "grid_p must rise, one grid_y each")
    common.check_array("ps", ps)
    i = np.searchsorted(grid_p, ps, side="left")
    return np.where(i < len(grid_p), np.asarray(grid_y)[np.minimum(i, len(grid_p) - 1)], 0.0)


def budget_accuracy(ecdf_at, radii, N, alpha, sigma):
    """App. B.1: expected certified accuracy at each radius under (N, alpha) = P(pA >= smallest certifying pA)."""
    common.check_type("ecdf_at", ecdf_at, callable)
    p_needed = min_pA(radii, N, alpha, sigma)
    return np.where(np.isfinite(p_needed), ecdf_at(np.minimum(p_needed, 1.0)), 0.0)


def dominance(curves):
    """App. B.3: pairs (a, b) where a's ECDF is >= b's at every p and higher at some p, and the pairs where
    neither holds (incomparable). curves: {label: ECDF values on one p grid}."""
    common.check_type("curves", curves, dict)
    values = [common.check_array(f"curves[{k!r}]", v, ndim=1, ge=0, le=1) for k, v in curves.items()]
    common.check(len({len(v) for v in values}) <= 1, "curves must hold values on one p grid (one length)")
    better, incomparable = [], []
    names = list(curves)
    arrays = dict(zip(names, values))   # the checked arrays: lists would compare lexicographically
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ya, yb = arrays[a], arrays[b]
            if np.all(ya >= yb) and np.any(ya > yb):
                better.append((a, b))
            elif np.all(yb >= ya) and np.any(yb > ya):
                better.append((b, a))
            elif not np.array_equal(ya, yb):
                incomparable.append((a, b))
    return better, incomparable


# ----------------------------------------------------------------------------------------------------------
# §4: Theorem 1's toy example and Figure 2
# ----------------------------------------------------------------------------------------------------------

def max_radius(N, alpha, sigma):
    """§4.2: the largest radius CERTIFY can give with N samples, sigma * Phi^-1(alpha ** (1 / N)) (pA = 1)."""
    common.check_smoothing(sigma, alpha, N=N)
    return float(radius_of_count(N, N, alpha, sigma))


def trivial_acr(N, alpha, sigma):
    """§4.1: ACR of a constant classifier on balanced binary data: half the inputs get nA = N, half are wrong."""
    return 0.5 * max(0.0, max_radius(N, alpha, sigma))


def constant_pA_acr(pA, N, alpha, sigma):
    """§4.1, the paper's numbers: ACR when every input has pA and CERTIFY sees nA = pA N (as in App. B)."""
    common.check_float("pA", pA, ge=0, le=1)
    common.check_smoothing(sigma, alpha, N=N)
    return max(0.0, float(radius_of_count(pA * N, N, alpha, sigma)))


def expected_constant_pA_acr(pA, N, alpha, sigma):
    """The same classifier with Monte Carlo counts: E[radius] over nA ~ Binomial(N, pA) (abstaining gives 0)."""
    common.check_float("pA", pA, ge=0, le=1)
    common.check_smoothing(sigma, alpha, N=N)
    from scipy.stats import binom   # here: scipy.stats takes seconds to import
    lo, hi = binom.ppf(1e-15, N, pA), binom.isf(1e-15, N, pA)     # the counts that carry any weight
    nA = np.arange(int(lo), int(hi) + 1)
    return float(np.sum(binom.pmf(nA, N, pA) * np.maximum(radius_of_count(nA, N, alpha, sigma), 0.0)))


def order_flips(Ns, a, b):
    """The N at which the sign of a - b changes from the previous N (ties never flip)."""
    Ns, a, b = (common.check_array(name, v, ndim=1) for name, v in (("Ns", Ns), ("a", a), ("b", b)))
    common.check(len(Ns) == len(a) == len(b), f"Ns, a and b must be of one length (got {len(Ns)}, {len(a)}, {len(b)})")
    sign = np.sign(np.asarray(a) - np.asarray(b))
    flips, last = [], 0
    for N, s in zip(Ns, sign):
        if s != 0 and last != 0 and s != last:
            flips.append(int(N))
        last = s if s != 0 else last
    return flips


def radius_curve(ps, N, alpha, sigma):
    """Figure 2: r(pA) = sigma Phi^-1(CP_lower(pA N, N, alpha)) (0 when it would abstain) and dr/dpA (central
    differences of one count, 1 / N)."""
    ps = common.check_array("ps", ps, ge=0, le=1)
    common.check_smoothing(sigma, alpha, N=N)
    r = lambda p: np.maximum(radius_of_count(np.clip(p, 0, 1) * N, N, alpha, sigma), 0.0)
    h = 1.0 / N
    lo, hi = np.clip(ps - h, 0, 1), np.clip(ps + h, 0, 1)
    return r(ps), (r(hi) - r(lo)) / (hi - lo)


# ----------------------------------------------------------------------------------------------------------
# Output: Markdown, LaTeX (bold best, underline second, grey below the baseline), TSV; figures
# ----------------------------------------------------------------------------------------------------------

def markdown(header, rows):
    """A Markdown table (header: list of str; rows: lists of str)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def tsv(header, rows):
    """Tab-separated text with a header line."""
    return "\n".join("\t".join(map(str, r)) for r in [header] + rows)


def ranks(values):
    """Competition ranks, largest first (1, 1, 3, ...): the paper bolds rank 1 and underlines rank 2. A value that
    is not a number (none to show) ranks last, never first."""
    values = np.asarray(values, dtype=float)
    return np.array([len(values) if np.isnan(v) else 1 + np.sum(values > v) for v in values])


def latex_cell(text, rank, grey, distinct):
    """Bold rank 1, underline rank 2 (only when the column is not constant), grey when below the baseline."""
    if distinct and rank == 1:
        text = rf"\textbf{{{text}}}"
    elif distinct and rank == 2:
        text = rf"\underline{{{text}}}"
    return rf"\textcolor{{gray}}{{{text}}}" if grey else text


def latex_group(rows, values, baseline):
    """LaTeX cells of one sigma group. values: (rows, columns) numbers, column 0 = ACR (never greyed)."""
    values = np.asarray(values)
    cells = [list(r) for r in rows]
    for j in range(values.shape[1]):
        col = values[:, j]
        rk, distinct = ranks(col), len(np.unique(col)) > 1
        for i in range(len(rows)):
            grey = j > 0 and baseline is not None and col[i] < values[baseline, j]
            k = j - values.shape[1]                             # numbers are the last cells of a row
            cells[i][k] = latex_cell(cells[i][k], rk[i], grey, distinct)
    return cells


TEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
               "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def tex_text(text):
    """A label as LaTeX text: its special characters escaped, so `ours_v2 & b` stays one cell."""
    return "".join(TEX_SPECIAL.get(c, c) for c in str(text))


def latex(header, groups, lead):
    """A booktabs table: groups = [(rows, values, baseline_index)], `lead` leading text columns per row (escaped:
    tex_text)."""
    lines = [r"% needs \usepackage{booktabs,xcolor}",
             r"\begin{tabular}{" + "l" * lead + "r" * (len(header) - lead) + "}", r"\toprule",
             " & ".join(header) + r" \\", r"\midrule"]
    for g, (rows, values, baseline) in enumerate(groups):
        for row in latex_group(rows, values, baseline):
            lines.append(" & ".join([tex_text(c) for c in row[:lead]] + row[lead:]) + r" \\")
        lines.append(r"\midrule" if g < len(groups) - 1 else r"\bottomrule")
    return "\n".join(lines + [r"\end{tabular}"])


def write_text(out, name, text):
    """<out>/<name> (when --out was given) through the output guard, announced on stderr once in place (stdout
    stays Markdown). name may hold a label from a file: it is made safe for a file name first (safe_name)."""
    if out:
        path = os.path.join(machinery.make_outdir(out), safe_name(name))
        machinery.write_text_output(path, "analyze.py output", text + "\n", announce=True)


def safe_name(name):
    """A file name from labels of logs: path separators, spaces and other odd characters become '_'."""
    cleaned = re.sub(r"_+", "_", re.sub(r"[^A-Za-z0-9._+=-]+|\.{2,}", "_", name)).strip("._") or "unnamed"
    return cleaned[:200]


def pyplot():
    """matplotlib with the Agg backend (files only), imported when a figure is drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, out, name):
    """figures as <out>/<name>.png and .pdf, the same bytes for the same figure (no date in the PDF), so that
    a rerun on the same logs changes no committed file."""
    try:
        machinery.make_outdir(out)
        for ext in ("png", "pdf"):
            path = os.path.join(out, f"{safe_name(name)}.{ext}")
            metadata = {"CreationDate": None} if ext == "pdf" else None
            machinery.write_output(path, "analyze.py figure", lambda f: fig.savefig(
                f, format=ext, dpi=150, bbox_inches="tight", metadata=metadata), announce=True)
    finally:   # also when an output is refused: no figure left open in a notebook's session
        pyplot().close(fig)


def fmt_acr(value, digits):
    """An ACR with `digits` decimals; 'n/a' where there is none (a grid log: certify.py --radii)."""
    return "n/a" if np.isnan(value) else f"{value:.{digits}f}"


def fmt_percent(share):
    """A share as a percentage with one decimal, halves rounded up as in the paper's tables (0.6905 -> 69.1)."""
    return f"{math.floor(round(1000 * share, 6) + 0.5) / 10:.1f}"


def fmt_sigma(sigma):
    """sigma as the paper writes it."""
    return "?" if sigma is None else str(float(sigma))             # 0.25, 0.5, 1.0 as in the paper


def by_sigma(logs):
    """Logs grouped by sigma (ascending, unknown last), input order kept inside a group."""
    keys = sorted({log["sigma"] for log in logs}, key=lambda s: (s is None, s or 0))
    return [(s, [log for log in logs if log["sigma"] == s]) for s in keys]


def sigma_panels(plt, groups):
    """One panel per sigma group."""
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.4), squeeze=False,
                             layout="constrained")
    return fig, axes[0]


# ----------------------------------------------------------------------------------------------------------
# table and ablation (Tables 3, 4, 5; Fig. 6)
# ----------------------------------------------------------------------------------------------------------

def table_rows(logs, radii):
    """Every log gets its ACR ('acr') and certified accuracy at the radii ('acc', shares)."""
    for log in logs:
        # a grid log's radius is a certified grid level, not a radius: it has no ACR in any output (nan -> n/a)
        log["acr"] = float("nan") if log.get("grid") else acr(log["radius"], log["correct"])
        # a radius a grid log did not decide has no value (n/a in every output, never ranked), not its lower bound
        log["acc"] = np.where(decided(log, radii), certified_accuracy(log["radius"], log["correct"], radii), np.nan)
    return logs


def table_report(logs, radii, fmt, out, name="table", baseline="gaussian", extra=None):
    """Tables 3/4/5: Markdown / LaTeX / TSV, grouped by sigma. extra: (header, cells per log) after the label."""
    extra_header, extra_cells = extra or ([], {})
    table_rows(logs, radii)
    radius_header = [f"{r:.2f}" for r in radii]
    md_rows, tsv_rows, groups = [], [], []
    for sigma, group in by_sigma(logs):
        rows, values, base = [], [], None
        for i, log in enumerate(group):
            shown = log["label"] + (" (sound)" if log["sidecar"].get("sound") else "") + \
                (" (grid)" if log.get("grid") else "") + (" (DDRS)" if "sigma_x" in log else "")
            lead = [fmt_sigma(sigma) if i == 0 else "", shown] + extra_cells.get(id(log), [])
            numbers = ["n/a" if log.get("grid") else f"{log['acr']:.3f}"] + \
                ["n/a" if np.isnan(a) else fmt_percent(a) for a in log["acc"]]
            md_rows.append(lead[:2] + [str(len(log["radius"]))] + lead[2:] + numbers)
            tsv_rows.append([fmt_sigma(sigma), log["label"], len(log["radius"])] + lead[2:] + [fmt_acr(log["acr"], 6)]
                            + ["n/a" if np.isnan(a) else f"{100 * a:.2f}" for a in log["acc"]])
            rows.append(lead + numbers)
            values.append([float("nan") if x == "n/a" else float(x) for x in numbers])   # rank what is printed
            if log["label"].lower() == baseline.lower():
                base = i
        groups.append((rows, values, base))
    md = readers.differs_line(logs) + markdown(["σ", "method", "n"] + extra_header + ["ACR"] + radius_header, md_rows)
    for log in logs:
        elastic = semi_elastic(log)
        if "sigma_x" in log:
            sx = log["sigma_x"]
            md += (f"\n\n(DDRS): the radii of {log['label']} come from a data-dependent sigma (ddrs.py, grouped "
                   f"here under its sigma_0): sigma_x median {np.median(sx):.3f}, 5-95 % {np.percentile(sx, 5):.3f}-"
                   f"{np.percentile(sx, 95):.3f}. " + (
                       f"Its sigma is semi-elastic (ddrs.py certify --semi-elastic, r {elastic['r']:g}) and its "
                       f"radii hold for the data-dependent classifier z -> g_sigma(z)(z) itself (Súkeník et al. "
                       f"2022; docs/ddrs.md)." if elastic else
                       "Each is a certificate of the classifier smoothed at that input's sigma_x only, not of the "
                       "data-dependent classifier (ddrs.py's docstring; docs/ddrs.md)."))
        if log.get("label_mode"):
            md += (f"\n\n(label mode): {log['label']} was certified with certify.py --label-mode: the candidate "
                   f"class was the true label (no selection draws), so its rows give certified accuracy, not the "
                   f"smoothed classifier's predictions (its `predict` column is the label where certified).")
        if log.get("grid"):
            N0 = 0 if log.get("label_mode") else log["sidecar"].get("N0") or 100
            levels = log["sidecar"].get("radii") or []
            zero_note = "" if not levels or 0.0 in levels else \
                " and below the smallest (r = 0 was not a level: --no-zero-level)"
            md += (f"\n\n(grid): {log['label']} was certified at a grid of radii (certify.py --radii "
                   f"{' '.join(f'{r:g}' for r in log['sidecar'].get('radii') or [])}): its radius is the largest "
                   f"grid radius certified, so certified accuracy is exact at the grid radii and only a lower bound "
                   f"between them{zero_note}" + (", where the table says n/a" if levels else " (its levels are "
                   "unknown without its settings file: the table shows those lower bounds)") +
                   f", and there is no ACR (certify without --radii). Mean model evaluations per "
                   f"example: {N0 + np.mean(log['N']):,.0f} (median {N0 + np.median(log['N']):,.0f}; CERTIFY "
                   f"with N = 100,000: 100,100).")
    if any(log["sidecar"].get("sound") for log in logs):
        md += ("\n\n(sound): certified with `certify.py --sound` (exact integer noise on the input grid: a "
               "certificate floating point cannot fake); the other rows used the float sampler of Cohen et al.")
    tex = latex([r"$\sigma$", "Method"] + extra_header + ["ACR"] + radius_header, groups, 2 + len(extra_header))
    tab = tsv(["sigma", "label", "n"] + extra_header + ["ACR"] + radius_header, tsv_rows)
    write_text(out, f"{name}.md", md)
    write_text(out, f"{name}.tex", tex)
    write_text(out, f"{name}.tsv", tab)
    return {"markdown": md, "latex": tex, "tsv": tab}[fmt]


SEED_PATTERN = r"[_-]?seed[_=-]?\d+"                   # seed1, seed_2, _seed3, -seed=4


def strip_seed(path):
    """The path without its seed parts: runs/seed1/ours/noise_0.5.tsv -> runs/ours/noise_0.5.tsv,
    ours_seed2_sigma0.5.tsv -> ours_sigma0.5.tsv. Logs of several seeds of one run then share one label."""
    return os.path.normpath(re.sub(SEED_PATTERN, "", path))


def mean_std(values):
    """Mean and sample standard deviation (ddof = 1; nan for one value) along axis 0.

    The paper's Table 8 (three seeds) does not say which deviation it reports; the sample one is the usual
    estimate and is sqrt(3/2) = 1.22x the population one for three seeds."""
    values = np.asarray(values, dtype=float)
    std = values.std(axis=0, ddof=1) if len(values) > 1 else np.full(values.shape[1:], np.nan)
    return values.mean(axis=0), std


def plus_minus(mean, std, digits):
    """'0.5613 ± 0.0022' as Table 8 prints it; the mean alone where there is no deviation (one seed)."""
    if np.isnan(mean):   # a radius a grid log did not decide
        return "n/a"
    return f"{mean:.{digits}f}" if np.isnan(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def seed_table_report(logs, radii, fmt, out, name="table_seeds"):
    """Table 8: per (sigma, label), mean ± standard deviation over seeds of ACR and certified accuracy."""
    table_rows(logs, radii)
    md_rows, tsv_rows, tex_rows = [], [], []
    for sigma, group in by_sigma(logs):
        labels = list(dict.fromkeys(log["label"] for log in group))   # first appearance order
        for i, label in enumerate(labels):
            runs = [log for log in group if log["label"] == label]
            readers.check_distinct_models(runs, f"{label} at sigma {fmt_sigma(sigma)}")
            acr_m, acr_s = mean_std([[log["acr"]] for log in runs])
            acc_m, acc_s = mean_std([100 * log["acc"] for log in runs])
            sizes = sorted({len(log["radius"]) for log in runs})
            pm = [fmt_acr(acr_m[0], 4) if np.isnan(acr_m[0]) else plus_minus(acr_m[0], acr_s[0], 4)] + \
                [plus_minus(m, d, 2) for m, d in zip(acc_m, acc_s)]
            lead = [fmt_sigma(sigma) if i == 0 else "", label, str(len(runs)), "/".join(map(str, sizes))]
            md_rows.append(lead + pm)
            tex_rows.append([tex_text(c) for c in lead[:2]] + [c.replace("±", r"$\pm$") for c in pm])
            tsv_rows.append([fmt_sigma(sigma), label, len(runs), "/".join(map(str, sizes)), fmt_acr(acr_m[0], 6),
                             f"{acr_s[0]:.6f}" if not np.isnan(acr_m[0]) else "n/a"] +
                            ["n/a" if np.isnan(v) else f"{v:.4f}" for pair in zip(acc_m, acc_s) for v in pair])
    radius_header = [f"{r:.2f}" for r in radii]
    md = readers.differs_line(logs) + markdown(["σ", "method", "seeds", "n", "ACR"] + radius_header, md_rows)
    tex = "\n".join([r"\begin{tabular}{ll" + "r" * (1 + len(radii)) + "}", r"\toprule",
                     " & ".join([r"$\sigma$", "Method", "ACR"] + radius_header) + r" \\", r"\midrule"]
                    + [" & ".join(row) + r" \\" for row in tex_rows] + [r"\bottomrule", r"\end{tabular}"])
    tab = tsv(["sigma", "label", "seeds", "n", "ACR_mean", "ACR_std"]
              + [f"{r:.2f}_{k}" for r in radii for k in ("mean", "std")], tsv_rows)
    write_text(out, f"{name}.md", md)
    write_text(out, f"{name}.tex", tex)
    write_text(out, f"{name}.tsv", tab)
    return {"markdown": md, "latex": tex, "tsv": tab}[fmt]


def plot_certified_accuracy(logs, out, name):
    """Fig. 6: certified accuracy against radius, one panel per sigma."""
    plt = pyplot()
    groups = by_sigma(logs)
    fig, axes = sigma_panels(plt, groups)
    for ax, (sigma, group) in zip(axes, groups):
        radii = fine_radii(group)
        for log in group:
            ax.plot(radii, 100 * certified_accuracy(log["radius"], log["correct"], radii), label=log["label"])
        ax.set(title=f"σ = {fmt_sigma(sigma)}", xlabel="radius r", ylabel="certified accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, out, name)


def parse_parts(text):
    """'none' or 'discard+weight+attack' -> the set of parts that were on (Table 5)."""
    parts = set() if text.lower() in ("none", "gaussian", "-") else set(text.lower().split("+"))
    common.check(parts <= set(PARTS), f"--parts {text!r}: use 'none' or parts of {'+'.join(PARTS)} joined by '+'")
    return parts


def ablation_report(logs, parts, radii, fmt, out):
    """Table 5: one row per log with a check mark for each part that was on; 'none' is the Gaussian row."""
    cells, order = {}, {}
    for log, text in zip(logs, parts):
        on = parse_parts(text)
        cells[id(log)] = ["✓" if p in on else "" for p in PARTS]
        order[id(log)] = (len(on), [p not in on for p in PARTS])   # Gaussian, one part, two parts, all three
        if not on:
            log["label"] = "Gaussian"                               # the row LaTeX greys against
    logs = sorted(logs, key=lambda log: order[id(log)])
    return table_report(logs, radii, fmt, out, "ablation", "gaussian", (list(PARTS), cells))


# ----------------------------------------------------------------------------------------------------------
# envelope (§7)
# ----------------------------------------------------------------------------------------------------------

def envelope(logs, radii, bounds=False):
    """Per label: the best certified accuracy over its logs (sigmas) at each radius, and the sigma giving it
    (nan and None where no log of the label decides the radius: a grid log's lower bounds count only with bounds)."""
    result = {}
    for log in logs:
        acc = certified_accuracy(log["radius"], log["correct"], radii)
        acc = acc if bounds else np.where(decided(log, radii), acc, -1.0)
        best = result.setdefault(log["label"], {"acc": np.full(len(radii), -1.0), "sigma": [None] * len(radii)})
        for j in np.flatnonzero(acc > best["acc"]):          # ties keep the first log given
            best["acc"][j], best["sigma"][j] = acc[j], log["sigma"]
    for best in result.values():
        best["acc"][best["acc"] < 0] = np.nan
    return result


def envelope_report(logs, radii, out, name="envelope"):
    """§7: table of the best certified accuracy over sigma per label, the sigma giving it, the best label."""
    env = envelope(logs, radii)
    header = ["method"] + [f"{r:.2f}" for r in radii]
    cell = lambda a, s: "n/a" if np.isnan(a) else f"{fmt_percent(a)} ({fmt_sigma(s)})"   # noqa: E731
    rows = [[label] + [cell(a, s) for a, s in zip(e["acc"], e["sigma"])] for label, e in env.items()]
    best = []
    for j in range(len(radii)):   # every label that reaches the best value: a tie is not a win
        top = max((env[label]["acc"][j] for label in env if not np.isnan(env[label]["acc"][j])), default=np.nan)
        best.append(" = ".join(label for label in env if env[label]["acc"][j] == top) or "n/a")
    rows.append(["best"] + best)
    tsv_rows = [[label, "accuracy"] + ["n/a" if np.isnan(a) else f"{100 * a:.2f}" for a in e["acc"]]
                for label, e in env.items()]
    tsv_rows += [[label, "sigma"] + [fmt_sigma(s) for s in e["sigma"]] for label, e in env.items()]
    md = (readers.differs_line(logs) + "Best certified accuracy (%) across σ at each radius (the σ giving it in "
          "brackets):\n\n" + markdown(header, rows))
    if any(not decided(log, radii).all() for log in logs):
        md += ("\n\nn/a, and no σ: no log of the label decides that radius; a grid log (certify.py --radii) "
               "counts only at its levels, where its certified accuracy is exact, not with its lower bounds between.")
    write_text(out, f"{name}.md", md)
    write_text(out, f"{name}.tsv", tsv(["method", "what"] + header[1:], tsv_rows))
    if out:
        plot_envelope(logs, out, name)
    return md


def plot_envelope(logs, out, name):
    """§7: the best-over-sigma certified accuracy curve of each method."""
    plt = pyplot()
    fine = fine_radii(logs)
    fig, ax = plt.subplots(figsize=(5.5, 3.8), layout="constrained")
    for label, e in envelope(logs, fine, bounds=True).items():
        ax.plot(fine, 100 * e["acc"], label=label)
    ax.set(xlabel="radius r", ylabel="best certified accuracy over σ (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, out, name)


# ----------------------------------------------------------------------------------------------------------
# ecdf and budget (App. B)
# ----------------------------------------------------------------------------------------------------------

def warn_if_beyond_budget(log, N, alpha):
    """A radius above the largest (N, alpha) can certify, even rounded as Cohen prints it, means another budget."""
    top, limit = float(np.max(log["radius"])), max_radius(N, alpha, need_sigma(log))
    if top > limit * 1.006:                                   # 3 significant digits round up by <= 0.5 %
        print(f"warning: {log['path']}: radius {top:g} exceeds the largest certifiable at N = {N}, "
              f"alpha = {alpha:g} ({limit:.4g}); certified with another budget? (pass --N --alpha)", file=sys.stderr)


def attach_pA(logs, N_flag, alpha_flag):
    """Every log gets the pA of its rows ('pA': nA / N of the true class, -inf where not certified correct,
    so never counted) and where it came from ('source'). Logs with the true label's votes also get
    'pA_all': nY / N for every row, wrong and abstained ones included (the whole range [0, 1])."""
    for log in logs:
        common.check(not log.get("grid"), f"{log['path']}: a grid log (certify.py --radii) has no pA estimate "
                                          f"(nA / N is biased by its adaptive stopping) and no full radius; "
                                          f"certify without --radii for the ECDF of pA or a budget conversion")
        if "nY" in log:
            log["pA_all"] = log["nY"] / log["N"]
        if "nA" in log:
            pA, log["source"] = log["nA"] / log["N"], "nA/N"
        else:
            N, alpha = log_budget(log, N_flag, alpha_flag)
            log["budget"] = N, alpha
            warn_if_beyond_budget(log, N, alpha)
            pA = pA_from_radius(log["radius"], N, alpha, need_sigma(log))
            log["source"] = f"radius (N={N}, α={alpha:g})"
        log["pA"] = np.where(log["correct"], pA, -np.inf)
    return logs


CURVE_SETTINGS = ("script", "mode", "dataset", "split", "data", "N", "alpha", "N0", "sound", "precision", "sigma",
                  "candidate", "ddrs", "checkpoint_sha256", "train_seed")   # what a curve keeps of its log's settings


def write_curve(out, name, points, log):
    """An ECDF curve file (x y low high) and its settings file (<name>.json): its log's settings (with the budget
    its radii were converted at) and the log's name, so that budget, reading the curve, checks what the log was."""
    write_text(out, name, tsv(["x", "y", "low", "high"], points))
    settings = {k: log["sidecar"][k] for k in CURVE_SETTINGS if k in log["sidecar"]}
    if "N" in log and len(np.unique(log["N"])) == 1:
        settings.setdefault("N", int(log["N"][0]))
    settings.update(kind="ecdf", source=os.path.basename(log["path"]), sigma=log["sigma"],
                    **dict(zip(("N", "alpha"), log.get("budget", (settings.get("N"), settings.get("alpha"))))))
    settings = {k: v for k, v in settings.items() if v is not None}
    write_text(out, name + ".json", json.dumps(settings, indent=1, sort_keys=True))


def ecdf_report(logs, pmax, out, name="ecdf", baseline="gaussian"):
    """App. B.2, B.3: summary table of P(pA >= p), dominance per sigma on [0.5, pmax] and on [0.5, 1]; for logs
    with the true label's votes, §4.3 over the whole range [0, 1]; curve files and the plots."""
    common.check(0.5 <= pmax <= 1, f"--pmax must lie in [0.5, 1] (got {pmax})")
    curves = [safe_name(f"{name}_{log['label']}_{fmt_sigma(s)}.tsv") for s, group in by_sigma(logs) for log in group]
    twice = sorted({c for c in curves if curves.count(c) > 1})
    common.check(not twice, f"two logs would write one curve file ({', '.join(twice)}): their labels and sigma "
                            f"give one file name; give them distinct --labels")   # before anything is written
    rows, lines = [], []
    for sigma, group in by_sigma(logs):
        for log in group:
            rows.append([fmt_sigma(sigma), log["label"], log["source"]] +
                        [fmt_percent(y) for y in ecdf(log["pA"], SUMMARY_P)])
            log["ecdf"] = ecdf(log["pA"], ECDF_GRID)
            points = ecdf_band_rows(ECDF_GRID, log["ecdf"], len(log["pA"]))   # x y as published, then the band
            write_curve(out, f"{name}_{log['label']}_{fmt_sigma(sigma)}.tsv", points, log)
        lines += dominance_lines(sigma, group, pmax)
    md = (readers.differs_line(logs) + "P(pA >= p) in %, pA = nA/N of the true class on correct rows (App. B):\n\n" +
          markdown(["σ", "method", "from"] + [f"{p:g}" for p in SUMMARY_P], rows) +
          f"\n\nEvery curve in the ECDF files (columns low high) and plots carries a simultaneous "
          f"{100 * ECDF_LEVEL:g} % DKW band over the images (±{dkw_halfwidth(len(logs[0]['pA'])):.3f} at "
          f"{len(logs[0]['pA'])} images), a statement about that curve alone. Two curves are told apart by the "
          f"two-sample band under each pair below: the sum of their DKW half-widths, each at 1 − 5 % / (curves "
          f"of the σ), so every pair's statement holds at once with probability ≥ 95 %." +
          f"\n\nDominance (App. B.3: A > B if A's ECDF is >= B's at every p of the range and higher "
          f"somewhere; ~: neither), on [0.5, {pmax:g}] and on the paper's literal [0.5, 1]:\n\n" +
          "\n".join(lines))
    md += "\n\n" + full_range_report(logs, baseline, out, name)
    write_text(out, f"{name}.md", md)
    if out:
        plot_ecdf(logs, out, name)
    return md


def dominance_lines(sigma, group, pmax):
    """App. B.3 for one sigma on both ranges, each ordered or incomparable pair judged by the two-sample band
    (two_sample_words), and for each pair ordered differently, the p that decides it."""
    ranges = {"pmax": ECDF_GRID <= pmax + 1e-12, "all": np.ones(len(ECDF_GRID), dtype=bool)}
    orders = {k: dominance({log["label"]: log["ecdf"][mask] for log in group}) for k, mask in ranges.items()}
    text = lambda order: ("; ".join(f"{a} > {b}" for a, b in order[0]) or "no order") + (
        "" if not order[1] else "; incomparable: " + "; ".join(f"{a} ~ {b}" for a, b in order[1]))
    lines = [f"- σ = {fmt_sigma(sigma)}: [0.5, {pmax:g}]: {text(orders['pmax'])}"]
    lines += two_sample_words(group, orders["pmax"][0] + orders["pmax"][1], ranges["pmax"])
    if orders["pmax"] == orders["all"]:
        return lines + ["  - [0.5, 1]: the same order"]
    lines.append(f"  - [0.5, 1]: {text(orders['all'])}")
    curves = {log["label"]: log["ecdf"] for log in group}
    for a, b in [pair for pair in orders["pmax"][0] if pair not in orders["all"][0]]:   # in the listed order
        j = int(np.argmax(np.where(ECDF_GRID > pmax + 1e-12, curves[b] - curves[a], -np.inf)))
        lines.append(f"  - why: {a} > {b} only up to p = {pmax:g}: at p = {ECDF_GRID[j]:g}, P(pA ≥ p) is "
                     f"{fmt_percent(curves[b][j])} % for {b} against {fmt_percent(curves[a][j])} % for {a}")
    return lines


def two_sample_halfwidth(n_a, n_b, curves, level=ECDF_LEVEL):
    """A band for the difference of two ECDFs: each of the `curves` ECDFs of its sigma gets a DKW band at level
    1 - (1 - level) / curves, so with probability >= level every curve lies in its band at once, and then every
    difference of two curves lies within the sum of their half-widths at every p (whatever the dependence
    between curves, e.g. two models on the same images)."""
    inner = 1 - (1 - level) / curves
    return dkw_halfwidth(n_a, inner) + dkw_halfwidth(n_b, inner)


def two_sample_words(group, pairs, mask, level=ECDF_LEVEL):
    """One line per pair (a, b): where a's ECDF lies above or below b's by more than the two-sample band."""
    by_label = {log["label"]: log for log in group}
    lines = []
    for a, b in pairs:
        la, lb = by_label[a], by_label[b]
        eps = two_sample_halfwidth(len(la["pA"]), len(lb["pA"]), len(group), level)
        gap = la["ecdf"][mask] - lb["ecdf"][mask]
        above, below = gap > eps, gap < -eps
        found = [f"{a} {word} {b} beyond noise at p = {ECDF_GRID[mask][hits][0]:g} ... "
                 f"{ECDF_GRID[mask][hits][-1]:g} (largest gap {100 * gap[hits][np.argmax(np.abs(gap[hits]))]:+.1f} "
                 f"points)" for hits, word in ((above, "above"), (below, "below")) if hits.any()]
        lines.append(f"  - {a} vs {b}, two-sample band ±{eps:.3f} ({100 * level:g} % for all curves of this σ at "
                     f"once): " + ("; ".join(found) if found else "within noise at every p (not told apart)"))
    return lines


def full_range_report(logs, baseline, out, name):
    """§4.3 over [0, 1] from nY / N of every row: shares near 0 and 1 per log, one sentence per method
    against the baseline of its sigma, and ECDF files on the whole range. Logs without nY get a note."""
    without = list(dict.fromkeys(log["label"] for log in logs if "pA_all" not in log))
    note = "" if not without else (
        f"Note: no true-label votes (nY) in {', '.join(without)}: the ECDF above covers [0.5, 1] from correct "
        f"rows only; certify.py records nY, so recertify to see the whole range.")
    full = [log for log in logs if "pA_all" in log]
    if not full:
        return note
    rows, sentences = [], []
    for sigma, group in by_sigma(full):
        base = next((log for log in group if log["label"].lower() == baseline.lower()), None)
        for log in group:
            log["shares"] = [float(np.mean(test(log["pA_all"]))) for _, test in SHARES]
            rows.append([fmt_sigma(sigma), log["label"] + (" (collapsed)" if collapsed(log) else ""),
                         str(len(log["pA_all"]))] + [fmt_percent(v) for v in log["shares"]])
            points = ecdf_band_rows(FULL_GRID, ecdf(log["pA_all"], FULL_GRID), len(log["pA_all"]))
            write_curve(out, f"{name}_full_{log['label']}_{fmt_sigma(sigma)}.tsv", points, log)
        for log in group:
            if base is not None and log is not base:
                sentences.append(f"- σ = {fmt_sigma(sigma)}: " + mass_sentence(log, base))
    md = ("The whole range (§4.3, Fig. 3): pA = nY/N of the true label on every row, wrong and abstained "
          "ones too; shares in %:\n\n" + markdown(["σ", "method", "n"] + [h for h, _ in SHARES], rows))
    if sentences:
        md += (f"\n\n§4.3 (more mass than {baseline} near pA = 0 and near pA = 1, beyond noise? Intervals "
               f"simultaneous over the two shares at 95 %; `analyze.py compare` gives every metric):\n\n" +
               "\n".join(sentences))
    if any(collapsed(log) for log in full):
        md += (f"\n\nCollapsed: clean accuracy below {COLLAPSE_FLOOR:g} times chance (1 / the classes of the "
               f"dataset its settings file names), a training that failed; its shares are shown, not judged.")
    return md + ("\n\n" + note if note else "")


def collapse_floor(log):
    """The clean accuracy below which the log's model has collapsed: COLLAPSE_FLOOR / classes, the classes of
    the dataset its sidecar names; None where it names none we know (then no model is called collapsed)."""
    dataset = log.get("sidecar", {}).get("dataset")
    classes = common.NUM_CLASSES.get(dataset) if isinstance(dataset, str) else None
    return None if classes is None else COLLAPSE_FLOOR / classes


def collapsed(log):
    """True when the log's clean accuracy (its share of correct rows) is below collapse_floor(log)."""
    floor = collapse_floor(log)
    return floor is not None and float(np.mean(log["correct"])) < floor


def mass_sentence(log, base):
    """One sentence: does `log` have more mass than `base` near 0 (pA < 0.1) and near 1 (pA >= 0.99), beyond
    noise? Each difference gets an interval, simultaneous over the two at 95 % (Bonferroni, normal
    approximation): paired over images when both logs certified the same ones, else unpaired. No verdict where
    either model collapsed (collapsed)."""
    gone = [g for g in (log, base) if collapsed(g)]
    if gone:
        return f"{log['label']} vs {base['label']}: no verdict: " + "; ".join(
            f"{g['label']} collapsed (clean accuracy {fmt_percent(np.mean(g['correct']))} %, below "
            f"{fmt_percent(collapse_floor(g))} %)" for g in gone)
    parts, more = [], []
    for k, where in ((0, "near 0"), (3, "near 1")):
        d, lo, hi = share_difference(log, base, SHARES[k][1])
        word = "higher" if lo > 0 else "lower" if hi < 0 else "within noise"
        if word == "higher":
            more.append(where)
        parts.append(f"{SHARES[k][0]} {fmt_percent(log['shares'][k])} vs {fmt_percent(base['shares'][k])} %, "
                     f"{100 * d:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] points, {word}")
    verdict = ("more mass near 0 and near 1: §4.3's pattern" if len(more) == 2 else
               f"more mass {more[0]} only" if more else "no more mass near 0 or near 1 beyond noise")
    return f"{log['label']} vs {base['label']}: {verdict} ({'; '.join(parts)})"


def share_difference(log, base, test, a=0.05 / 2):
    """The difference of the shares of rows where test(pA_all) holds, log minus base, and its interval at
    two-sided error a (the default makes two such intervals hold together at 95 %): Tango's score interval
    over the images both certified, Newcombe's where they share none."""
    rows, n, _ = shared_images([log, base])
    z = -ndtri(a / 2)
    if n:
        b, o = test(base["pA_all"][rows[id(base)]]), test(log["pA_all"][rows[id(log)]])
        return float(o.mean() - b.mean()), *common.tango_interval(int(np.sum(o & ~b)), int(np.sum(b & ~o)), n, z)
    b, o = test(base["pA_all"]).astype(float), test(log["pA_all"]).astype(float)
    return float(o.mean() - b.mean()), *common.newcombe_interval(float(b.mean()), len(b), float(o.mean()), len(o), z)


def plot_ecdf(logs, out, name):
    """Figs. 3, 7, 9, 11: P(pA >= p) against p, one panel per sigma; with nY also <name>_full: the ECDF on
    [0, 1] (Fig. 3's layout) above a histogram of pA, one column per sigma."""
    plt = pyplot()
    groups = by_sigma(logs)
    fig, axes = sigma_panels(plt, groups)
    for ax, (sigma, group) in zip(axes, groups):
        for log in group:
            band(ax, ECDF_GRID, log["ecdf"], len(log["pA"]), log["label"])
        ax.set(title=f"σ = {fmt_sigma(sigma)}", xlabel="p", ylabel="P(pA ≥ p)", xlim=(0.5, 1.0))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, out, name)
    groups = by_sigma([log for log in logs if "pA_all" in log])
    if not groups:
        return
    fig, axes = plt.subplots(2, len(groups), figsize=(4.2 * len(groups), 6.4), squeeze=False, layout="constrained")
    for j, (sigma, group) in enumerate(groups):
        for log in group:
            band(axes[0, j], FULL_GRID, ecdf(log["pA_all"], FULL_GRID), len(log["pA_all"]), log["label"])
            axes[1, j].hist(log["pA_all"], bins=np.linspace(0, 1, 21), density=True, histtype="step",
                            label=log["label"])
        axes[0, j].set(title=f"σ = {fmt_sigma(sigma)}", xlabel="p", ylabel="P(pA ≥ p)", xlim=(0, 1))
        # a log axis: one bin near pA = 1 often holds most inputs and would flatten the mass at low pA (§4.3)
        axes[1, j].set(xlabel="pA", ylabel="density (log scale)", xlim=(0, 1), yscale="log")
        for ax in axes[:, j]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    save_figure(fig, out, f"{name}_full")


def band(ax, ps, values, n, label):
    """An ECDF curve with its shaded DKW band (dkw_halfwidth)."""
    eps = dkw_halfwidth(n)
    line, = ax.plot(ps, values, label=label)
    ax.fill_between(ps, np.clip(values - eps, 0, 1), np.clip(values + eps, 0, 1), color=line.get_color(),
                    alpha=0.15, linewidth=0)


def budget_report(logs, N, alpha, radii, log_N, log_alpha, out, name="budget"):
    """App. B.1: certified accuracy each model is expected to reach when certified with (N, alpha), from its log
    (the logs' own budget: log_N, log_alpha where they do not say) or from a tabulated ECDF."""
    common.check(N >= 1 and 0 < alpha < 1, f"need --N >= 1 and 0 < --alpha < 1 (got {N}, {alpha})")
    curves = {}
    for log in logs:
        sigma = need_sigma(log)
        if "grid_p" in log:
            at = lambda ps, log=log: ecdf_lookup(log["grid_p"], log["grid_y"], ps)
        else:
            attach_pA([log], log_N, log_alpha)
            at = lambda ps, log=log: ecdf(log["pA"], ps)
        top = max_radius(N, alpha, sigma)
        fine = np.linspace(0, max(top, 0) * 1.05 + 1e-3, 300)
        curves[id(log)] = (budget_accuracy(at, radii, N, alpha, sigma), fine,
                           budget_accuracy(at, fine, N, alpha, sigma))
    rows, tsv_rows = [], []
    for sigma, group in by_sigma(logs):
        for log in group:
            acc = curves[id(log)][0]
            rows.append([fmt_sigma(sigma), log["label"]] + [fmt_percent(a) for a in acc])
            tsv_rows.append([fmt_sigma(sigma), log["label"]] + [f"{100 * a:.2f}" for a in acc])
    need = [[fmt_sigma(sigma), "smallest pA"] + [f"{p:.4g}" if p <= 1 else "none"
                                                 for p in min_pA(radii, N, alpha, sigma)]
            for sigma, _ in by_sigma(logs)]
    md = (f"Expected certified accuracy (%) when certified with N = {N}, α = {alpha:g} (App. B.1; the last rows: "
          f"the smallest pA = nA / N certifying each radius):\n\n" +
          markdown(["σ", "method"] + [f"{r:.2f}" for r in radii], rows + need))
    write_text(out, f"{name}.md", md)
    write_text(out, f"{name}.tsv", tsv(["sigma", "label"] + [f"{r:.2f}" for r in radii], tsv_rows))
    if out:
        plot_budget(logs, curves, N, alpha, out, name)
    return md


def plot_budget(logs, curves, N, alpha, out, name):
    """Fig. 8: the converted certified accuracy-radius curves."""
    plt = pyplot()
    groups = by_sigma(logs)
    fig, axes = sigma_panels(plt, groups)
    for ax, (sigma, group) in zip(axes, groups):
        for log in group:
            _, fine, acc = curves[id(log)]
            ax.plot(fine, 100 * acc, label=log["label"])
        ax.set(title=f"σ = {fmt_sigma(sigma)}, N = {N}, α = {alpha:g}", xlabel="radius r",
               ylabel="expected certified accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, out, name)


# ----------------------------------------------------------------------------------------------------------
# theory (§4.1, §4.2)
# ----------------------------------------------------------------------------------------------------------

TOY_N = (10, 20, 50, 100, 200, 500, 1000, 10_000, 100_000)
FIGURE2_P = (0.5, 0.6, 0.76, 0.9, 0.99, 0.999, 0.9999, 1.0)


def theory_report(N, alpha, sigma, pA, Nmax, out):
    """§4.1's toy example over the budget N (table, flips, plot) and §4.2's Figure 2 at (N, alpha, sigma)."""
    common.check(N >= 1 and Nmax >= 1 and 0 < alpha < 1 and sigma > 0 and 0 <= pA <= 1,
                 "need --N, --Nmax >= 1, 0 < --alpha < 1, --sigma > 0 and 0 <= --pA <= 1")
    scan = np.arange(1, Nmax + 1)
    toy = {"trivial": [trivial_acr(n, alpha, sigma) for n in scan],
           "paper": [constant_pA_acr(pA, n, alpha, sigma) for n in scan],
           "binomial": [expected_constant_pA_acr(pA, n, alpha, sigma) for n in scan]}
    rows = []
    for n in TOY_N:
        t, o, e = trivial_acr(n, alpha, sigma), constant_pA_acr(pA, n, alpha, sigma), \
            expected_constant_pA_acr(pA, n, alpha, sigma)
        higher = "trivial" if t > o else f"pA = {pA:g}" if o > t else "tie"
        rows.append([str(n), f"{t:.4f}", f"{o:.4f}", f"{e:.4f}", higher])
    ps = np.array(FIGURE2_P)
    r, dr = radius_curve(ps, N, alpha, sigma)
    flips = lambda other: ", ".join(map(str, order_flips(scan, toy["trivial"], toy[other]))) or "never"
    md = (f"§4.1: balanced binary data, α = {alpha:g}, σ = {sigma:g}. ACR of the trivial classifier (one class "
          f"always: pA = 1 on half the data) and of a classifier with pA = {pA:g} on every input, CERTIFY seeing "
          f"nA = pA N (the paper's numbers) or nA ~ Binomial(N, pA) (expectation)\n\n" +
          markdown(["N", "trivial", f"pA = {pA:g}, nA = pA N", f"pA = {pA:g}, E over nA", "higher (nA = pA N)"],
                   rows) +
          f"\n\nThe order flips at N = {flips('paper')} with nA = pA N, at N = {flips('binomial')} in expectation "
          f"(N = 1 .. {Nmax}).\n\n"
          f"§4.2 / Figure 2: N = {N}, α = {alpha:g}, σ = {sigma:g}: largest certifiable radius "
          f"σ Φ⁻¹(α^(1/N)) = {max_radius(N, alpha, sigma):.3f}; r(pA) = σ Φ⁻¹(CP_lower(pA N, N, α))\n\n" +
          markdown(["pA", "radius r", "dr/dpA"],
                   [[f"{p:g}", f"{ri:.3f}", f"{di:.4g}"] for p, ri, di in zip(ps, r, dr)]))
    write_text(out, "theory.md", md)
    write_text(out, "theory.tsv", tsv(["N", "trivial", "constant_pA", "constant_pA_expected"],
                                      [[n] + [f"{toy[k][i]:.6f}" for k in toy] for i, n in enumerate(scan)]))
    if out:
        plot_theory(scan, toy, pA, N, alpha, sigma, out)
    return md


def plot_theory(scan, toy, pA, N, alpha, sigma, out):
    """§4.1 (ACR against the budget N) and Figure 2 (r and dr/dpA against pA)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.plot(scan, toy["trivial"], label="trivial classifier")
    ax.plot(scan, toy["paper"], label=f"pA = {pA:g} everywhere, nA = pA N")
    ax.plot(scan, toy["binomial"], ":", label=f"pA = {pA:g} everywhere, E over nA")
    ax.set(xscale="log", xlabel="certification budget N", ylabel="ACR",
           title=f"§4.1 (α = {alpha:g}, σ = {sigma:g})")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, out, "theorem1")
    ps = np.linspace(0.5, 1.0, 20001)
    r, dr = radius_curve(ps, N, alpha, sigma)
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
    a.plot(ps, r)
    a.set(xlabel="pA", ylabel="certified radius r", title=f"(a) r, N = {N}, α = {alpha:g}")
    b.plot(ps, dr)
    b.set(xlabel="pA", ylabel="∂r / ∂pA", yscale="log", title="(b) sensitivity")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    save_figure(fig, out, "figure2")


# ----------------------------------------------------------------------------------------------------------
# gradnorm (Table 2, Fig. 5)
# ----------------------------------------------------------------------------------------------------------

def trainpa_report(logs, pt, out, name="trainpa"):
    """§5.1: how much of the training set is hard: shares with pA < 0.5 and pA < pt, and a histogram."""
    common.check(0 <= pt <= 1, f"--pt must lie in [0, 1] (got {pt})")
    rows = [[log["label"], log["source"], str(len(log["pA_all"])), fmt_percent(np.mean(log["pA_all"] < 0.5)),
             fmt_percent(np.mean(log["pA_all"] < pt)), f"{np.mean(log['pA_all']):.3f}"] for log in logs]
    md = ("Training-set pA (§5.1: 20%-50% of the data has pA < 0.5 on CIFAR-10), shares in %:\n\n" +
          markdown(["file", "from", "n", "P(pA<0.5)", f"P(pA<{pt:g})", "mean pA"], rows))
    write_text(out, f"{name}.md", md)
    if out:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(5, 3.4), layout="constrained")
        for log in logs:
            ax.hist(log["pA_all"], bins=np.linspace(0, 1, 21), histtype="step", label=log["label"])
        ax.axvline(pt, color="grey", linestyle="--", label=f"pt = {pt:g}")
        ax.set(xlabel="pA (training example)", ylabel="examples")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        save_figure(fig, out, name)
    return md


def easy_hard(pA, grad_norm):
    """Table 2: mean gradient norm of easy (pA > 0.5) and hard (pA < 0.5) examples and easy / hard (arrays of one
    length: pA in [0, 1], a share of votes, never a count)."""
    pA, grad_norm = common.check_array("pA", pA, ndim=1, ge=0, le=1), common.check_array("grad_norm", grad_norm, ndim=1)
    common.check(len(pA) == len(grad_norm), f"pA ({len(pA)}) and grad_norm ({len(grad_norm)}): one each per example")
    easy, hard = grad_norm[pA > 0.5], grad_norm[pA < 0.5]
    e = float(np.mean(easy)) if len(easy) else math.nan
    h = float(np.mean(hard)) if len(hard) else math.nan
    return {"easy": e, "hard": h, "ratio": e / h if h > 0 else math.nan, "n_easy": len(easy), "n_hard": len(hard)}


def gradnorm_intervals(logs, level, replicates, seed):
    """Bootstrap intervals of Table 2's easy / hard ratio: per file a percentile interval of its ratio, and
    for every file after the first the factor ratio / ratio of the first with a simultaneous band (max-|t|
    over the files on the log scale, as compare's) and a verdict.

    The probes are resampled with replacement, jointly over the files when they probed the same examples (the
    same idx in the same order: a paired bootstrap) and separately otherwise; each replicate reclassifies its
    probes as easy or hard by their own pA. The noise this covers is the choice of probes; the pA estimates
    (100 noisy copies) and the training seed are held fixed, so a verdict is about these models. A replicate
    without an easy or a hard probe makes the interval undefined ('n/a')."""
    common.check(0 < level < 1, f"--level must lie in (0, 1) (got {level})")
    common.check(replicates >= 100, f"--replicates must be >= 100 (got {replicates})")
    rng = np.random.default_rng(seed)
    paired = all(np.array_equal(log["idx"], logs[0]["idx"]) for log in logs)
    shared = rng.integers(0, len(logs[0]["idx"]), size=(replicates, len(logs[0]["idx"]))) if paired else None
    boot = np.empty((replicates, len(logs)))
    for m, log in enumerate(logs):
        rows = shared if paired else rng.integers(0, len(log["pA"]), size=(replicates, len(log["pA"])))
        pA, g = log["pA"][rows], log["grad_norm"][rows]
        with np.errstate(divide="ignore", invalid="ignore"):
            boot[:, m] = np.log(((g * (pA > 0.5)).sum(1) / (pA > 0.5).sum(1)) /
                                ((g * (pA < 0.5)).sum(1) / (pA < 0.5).sum(1)))
    point = np.log([easy_hard(log["pA"], log["grad_norm"])["ratio"] for log in logs])
    ok = np.isfinite(boot).all(axis=0) & np.isfinite(point)
    tails = ((1 - level) / 2, (1 + level) / 2)
    own = [tuple(np.exp(np.quantile(boot[:, m], tails))) if ok[m] else None for m in range(len(logs))]
    vs = [None] * len(logs)
    live = [m for m in range(1, len(logs)) if ok[m] and ok[0]]
    if live:
        diffs = boot[:, live] - boot[:, [0]]
        d = point[live] - point[0]
        se = diffs.std(axis=0, ddof=1)
        varies = se > 0
        c = float(np.quantile((np.abs(diffs[:, varies] - d[varies]) / se[varies]).max(axis=1), level)) \
            if varies.any() else 0.0
        for k, m in enumerate(live):
            low, high = d[k] - c * se[k], d[k] + c * se[k]
            vs[m] = (math.exp(d[k]), math.exp(low), math.exp(high),
                     "higher" if low > 0 else "lower" if high < 0 else "within noise")
    return own, vs, paired


GRADNORM_SETTINGS = {"sigma": None, "N": "budget", "dataset": "dataset", "data": "data"}   # field -> --allow-different


def check_gradnorm_comparable(logs, allow=()):
    """Gradient-norm files set side by side (Table 2) were measured alike: one sigma (the noise of the loss), one
    N (the draws of each probe's pA, which split easy from hard) and the same training images, where their
    records say so; a difference is refused in one line (but N, dataset and data under --allow-different)."""
    records = [(log["path"], readers.read_sidecar(log["path"])) for log in logs]
    for field, group in GRADNORM_SETTINGS.items():
        seen = {}
        for path, record in records:
            if record.get(field) is not None:
                seen.setdefault(record[field], path)
        if len(seen) > 1 and group not in allow:
            (first, where), (other, path) = list(seen.items())[:2]
            raise common.UserError(f"{path}: {field} {other}, but {where} has {field} {first}: gradient norms "
                                   f"measured otherwise are not set side by side" +
                                   (f" (--allow-different {group} does)" if group else ""))


def gradnorm_report(logs, out, name="gradnorm", acr_paths=None, level=0.95, replicates=2000, seed=0, allow=()):
    """Table 2 and the Fig. 5 histograms, with gradnorm_intervals' intervals. acr_paths: one certification
    log per gradient-norm log ('-' for none), whose ACR goes beside it as in Table 2 (logs of one setting, as
    load_logs checks, but for the settings in `allow`); None: no ACR column."""
    if acr_paths is not None:
        common.check(len(acr_paths) == len(logs), f"--acr needs one certification log per gradient-norm file "
                                                  f"('-' for none): got {len(acr_paths)} for {len(logs)}")
        loaded = iter(load_logs([p for p in acr_paths if p != "-"], command="gradnorm --acr", allow=allow))
        certified = [None if p == "-" else next(loaded) for p in acr_paths]
        for log, cert in zip(logs, certified):   # the same model, where the records say which it was
            measured = readers.read_sidecar(log["path"]).get("checkpoint_sha256")
            sha = cert and cert["sidecar"].get("checkpoint_sha256")
            common.check(not (measured and sha) or measured == sha,
                         f"{cert and cert['path']}: certifies another checkpoint than {log['path']} was measured on; "
                         f"--acr takes the log of each gradient-norm file's model")
    check_gradnorm_comparable(logs, allow)
    bare = [os.path.basename(log["path"]) for log in logs if not readers.read_sidecar(log["path"])]
    note = bare and (f"{', '.join(bare)} {'has' if len(bare) == 1 else 'have'} no record beside them (<file>.json), so neither the checkpoint each "
                     f"probed nor its sigma, N and probed images is checked against the other files"
                     f"{' or the --acr logs' * bool(acr_paths)}")
    if note:
        print(f"note: {note}", file=sys.stderr)
    own, vs, paired = gradnorm_intervals(logs, level, replicates, seed)
    rows = []
    for i, log in enumerate(logs):
        s = easy_hard(log["pA"], log["grad_norm"])
        row = [log["label"], f"{s['easy']:.2f}", f"{s['hard']:.2f}", f"{s['ratio']:.2f}", str(s["n_easy"]),
               str(s["n_hard"]), "n/a" if own[i] is None else f"[{own[i][0]:.2f}, {own[i][1]:.2f}]",
               "" if i == 0 else "n/a" if vs[i] is None else f"{vs[i][0]:.2f} [{vs[i][1]:.2f}, {vs[i][2]:.2f}]",
               "" if i == 0 else "n/a" if vs[i] is None else vs[i][3]]
        if acr_paths is not None:
            row.insert(1, "" if certified[i] is None else "n/a" if certified[i]["grid"] else
                       f"{acr(certified[i]['radius'], certified[i]['correct']):.3f}")
        rows.append(row)
    pct = f"{100 * level:g} %"
    header = ["method", "easy", "hard", "easy / hard", "n easy", "n hard", f"easy / hard [{pct}]",
              f"x {logs[0]['label']} [{pct}]", "verdict"]
    if acr_paths is not None:
        header.insert(1, "ACR")
    md = ("Mean per-example gradient l2 norm, easy: pA > 0.5, hard: pA < 0.5 (Table 2):\n\n" +
          (f"Note: {note}.\n\n" if note else "") +
          markdown(header, rows) +
          f"\n\nIntervals: a bootstrap over the probes ({replicates} replicates, seed {seed}; "
          f"{'paired: every file probed the same examples' if paired else 'unpaired: the files probed different examples'}"
          f"); 'x {logs[0]['label']}' is the file's easy / hard over {logs[0]['label']}'s, with a band "
          f"simultaneous over the files. They cover the choice of probes, not the training seed nor the pA "
          f"estimates: a verdict is about these models (analyze.gradnorm_intervals).\n")
    write_text(out, f"{name}.md", md)
    write_text(out, f"{name}.tsv", tsv(header, rows))
    if out:
        plot_gradnorm(logs, out, name)
    return md


def plot_gradnorm(logs, out, name):
    """Fig. 5: histograms of the gradient norm of easy and hard examples, log-scale counts."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(logs), figsize=(4.2 * len(logs), 3.2), squeeze=False,
                             layout="constrained")
    for ax, log in zip(axes[0], logs):
        bins = np.linspace(0, max(float(np.max(log["grad_norm"])), 1e-9), 40)
        ax.hist(log["grad_norm"][log["pA"] > 0.5], bins=bins, alpha=0.6, label="easy (pA > 0.5)")
        ax.hist(log["grad_norm"][log["pA"] < 0.5], bins=bins, alpha=0.6, label="hard (pA < 0.5)")
        ax.set(yscale="log", title=log["label"], xlabel="gradient l2 norm", ylabel="examples")
        ax.legend(fontsize=7)
    save_figure(fig, out, f"{name}_hist")


# ----------------------------------------------------------------------------------------------------------
# paper: the published logs -> Tables 3, 4, Figs. 2, 3, 6-9, 11 and the §7 envelope
# ----------------------------------------------------------------------------------------------------------

def paper_logs(root, figure, read=read_log):
    """The logs of one PAPER_FIGURES entry that exist under root (maybe none), with the paper's method names."""
    paths, labels = [], []
    for sigma in figure["sigmas"]:
        for method in figure["methods"]:
            found = sorted(glob.glob(os.path.join(root, figure["logs"].format(method=method, sigma=sigma))))
            if found:
                paths.append(found[0])
                labels.append(PAPER_NAMES.get(method, method))
    return load_logs(paths, labels, reader=read, command="paper") if paths else []


def paper_report(root, out):
    """Every entry of PAPER_FIGURES whose logs exist under root, then the §4 numbers."""
    common.check(os.path.isdir(root), f"--root {root!r} is not a folder")
    parts, read = [], functools.lru_cache(maxsize=None)(read_log)   # a log serves several figures: read once
    for figure in PAPER_FIGURES:
        logs = paper_logs(root, figure, lambda path: dict(read(path)))   # a copy: the reports add their keys
        kind, name = figure["kind"], figure["name"]
        parts.append(f"## {figure['title']}")
        if not logs:
            parts.append(f"(no logs {os.path.join(root, figure['logs'])})")
        elif kind == "table":
            parts.append(table_report(logs, figure["radii"], "markdown", out, name))
            if out:
                plot_certified_accuracy(logs, out, name + "_curves")
        elif kind == "envelope":
            parts.append(envelope_report(logs, figure["radii"], out, name))
        elif kind == "ecdf":
            parts.append(ecdf_report(attach_pA(logs, None, None), 0.99, out, name))
        elif kind == "budget":
            parts.append(budget_report(logs, figure["N"], figure["alpha"], figure["radii"], None, None, out, name))
    parts.append("## §4 in numbers")
    parts.append(theory_report(PAPER_N, PAPER_ALPHA, 1.0, 0.9, 1000, out))
    return "\n\n".join(parts)


# ----------------------------------------------------------------------------------------------------------
# Shared images of logs, the semi-elastic settings of a DDRS log (compare.py builds on them)
# ----------------------------------------------------------------------------------------------------------

def semi_elastic(log):
    """The semi-elastic settings of a ddrs.py certify --semi-elastic log (r, k, m, sigma_b), else None."""
    ddrs_settings = (log.get("sidecar") or {}).get("ddrs") or {}
    return ddrs_settings.get("semi_elastic") if isinstance(ddrs_settings, dict) else None


def shared_images(logs):
    """Rows of each log on the images all logs certified (the same idx and label), in one order: {log id: rows},
    the number of shared images, and {path: rows left out} for logs with more."""
    keys = [list(zip(log["idx"].tolist(), log["y"].tolist())) for log in logs]
    shared = sorted(set.intersection(*map(set, keys)))
    rows = {}
    for log, own in zip(logs, keys):
        where = {key: i for i, key in enumerate(own)}
        rows[id(log)] = np.array([where[key] for key in shared], dtype=np.int64)
    left = {log["path"]: len(own) - len(shared) for log, own in zip(logs, keys) if len(own) > len(shared)}
    return rows, len(shared), left


def main(argv=None):
    args = parse_args(argv)
    out = getattr(args, "out", None)
    with machinery.folder_lock(out, f"--out {out!r}") if out else contextlib.nullcontext():
        analyze(args)


def analyze(args):
    """The command of the parsed arguments, run: its report printed, its files written under --out."""
    c = args.command
    common.check(all(0 <= r < math.inf for r in getattr(args, "radii", None) or []),
                 f"--radii must be finite numbers >= 0 (got {getattr(args, 'radii', None)})")
    machinery.set_inputs([p for p in (getattr(args, "logs", None) or []) + (getattr(args, "vs", None) or []) +
                          (getattr(args, "acr", None) or []) + [getattr(args, "root", None)] if p not in (None, "-")])
    if c == "compare":   # the extension's own runner (compare.add_command)
        text = args.handler(args)
    elif c == "theory":
        text = theory_report(args.N, args.alpha, args.sigma, args.pA, args.Nmax, args.out)
    elif c == "paper":
        text = paper_report(args.root, args.out)
    elif c == "gradnorm":
        text = gradnorm_report(load_logs(args.logs, args.labels, args.sigmas, read_gradnorm), args.out,
                               acr_paths=args.acr, level=args.level, replicates=args.replicates, seed=args.seed,
                               allow=args.allow_different)
    elif c == "trainpa":
        text = trainpa_report(load_logs(args.logs, args.labels, args.sigmas, read_train_pA, command="trainpa",
                                        allow=args.allow_different), args.pt, args.out)
    elif c == "budget":
        logs = load_logs(args.logs, args.labels, args.sigmas, read_ecdf_or_log, command="budget",
                         allow=args.allow_different)
        text = budget_report(logs, args.N, args.alpha, args.radii, args.log_N, args.log_alpha, args.out)
    else:
        by_seed = c == "table" and args.group_by_seed
        labels = args.labels
        if by_seed and not labels:   # labels from the paths without their seed parts
            labels = [label_from_path(strip_seed(path)) for path in args.logs]
        flags = {"N": getattr(args, "N", None), "alpha": getattr(args, "alpha", None)}   # ecdf's, for logs without
        logs = load_logs(args.logs, labels, args.sigmas, command=c, allow=args.allow_different, assumed=flags)
        check_baseline(args, logs)
        if c in ("table", "envelope") and not by_seed:
            check_one_log_a_row(logs, c)
        if by_seed:
            text = seed_table_report(logs, args.radii, args.format, args.out)
        elif c == "table":
            text = table_report(logs, args.radii, args.format, args.out, baseline=args.baseline or "gaussian")
            if args.out:
                plot_certified_accuracy(logs, args.out, "certified_accuracy")
        elif c == "ablation":
            common.check(len(args.parts) == len(logs), f"--parts got {len(args.parts)} values for {len(logs)} logs")
            text = ablation_report(logs, args.parts, args.radii, args.format, args.out)
        elif c == "envelope":
            text = envelope_report(logs, args.radii, args.out)
        else:
            text = ecdf_report(attach_pA(logs, args.N, args.alpha), args.pmax, args.out,
                               baseline=args.baseline or "gaussian")
    print(text)


def check_one_log_a_row(logs, command):
    """table and envelope show one log per (label, sigma): two would be rows no reader can tell apart, and the
    envelope's best over sigma would be a best over them too (seeds: table --group-by-seed; else --labels)."""
    seen = {}
    for log in logs:
        key = (log["label"], log["sigma"])
        common.check(key not in seen, f"{log['path']}: the same label {log['label']!r} at sigma {log['sigma']} as "
                                      f"{seen.get(key)}; {command} shows one log a label and sigma: name them with "
                                      f"--labels (seeds of one method: table --group-by-seed)")
        seen[key] = log["path"]


def check_baseline(args, logs):
    """A --baseline given is one of the logs' labels, and acts: table greys against it in LaTeX only (--format
    latex, or the .tex file of --out), ecdf compares with it. Otherwise one clear error, not a quiet no-op."""
    if getattr(args, "baseline", None) is None:
        return
    labels = sorted({log["label"] for log in logs})
    common.check(args.baseline.lower() in {label.lower() for label in labels},
                 f"--baseline {args.baseline!r} is none of the logs' labels ({', '.join(labels)}); --labels names them")
    common.check(args.command != "table" or args.group_by_seed is False and (args.format == "latex" or args.out),
                 "--baseline greys LaTeX rows: it goes with --format latex or --out (and not --group-by-seed)")


# ----------------------------------------------------------------------------------------------------------
# The paper's tables and figures from its published logs (`paper --root`): inputs and legends, as data
# ----------------------------------------------------------------------------------------------------------

PAPER_NAMES = {"gaussian": "Gaussian", "macer": "MACER", "smoothadv": "SmoothAdv", "consistency": "Consistency",
               "smoothmix": "SmoothMix", "catrs": "CAT-RS", "ours": "Ours"}
CIFAR = dict(logs="certify/cifar10/{method}/noise_{sigma}.tsv", sigmas=("0.25", "0.5", "1.0"),
             methods=("gaussian", "macer", "smoothadv", "consistency", "smoothmix", "catrs", "ours"))
IMAGENET = dict(logs="certify/imagenet/{method}/noise_{sigma}*", sigmas=("0.25", "0.5", "1.0"),
                methods=("gaussian", "smoothadv", "consistency", "smoothmix", "catrs", "ours"))
IMAGENET_RADII = [0.5 * i for i in range(8)]
PAPER_FIGURES = [
    dict(name="table3_cifar10", kind="table", title="Table 3 and Figure 6: CIFAR-10", radii=DEFAULT_RADII, **CIFAR),
    dict(name="table4_imagenet", kind="table", title="Table 4: ImageNet", radii=IMAGENET_RADII, **IMAGENET),
    dict(name="envelope_cifar10", kind="envelope", title="§7: best over σ, CIFAR-10", radii=DEFAULT_RADII,
         **CIFAR),
    dict(name="envelope_imagenet", kind="envelope", title="§7: best over σ, ImageNet", radii=IMAGENET_RADII,
         **IMAGENET),
    dict(name="figure9_ecdf_cifar10", kind="ecdf", title="Figures 3, 9 and App. B.3: ECDF of pA, CIFAR-10",
         **CIFAR),
    dict(name="figure11_ecdf_imagenet", kind="ecdf", title="Figure 11: ECDF of pA, ImageNet", **IMAGENET),
    dict(name="figure8_budget", kind="budget", title="Figure 8: the models of Figure 7 (CIFAR-10, σ = 1.0) "
         "certified with N = 100, α = 0.01", N=100, alpha=0.01, radii=[0.25 * i for i in range(8)],
         logs=CIFAR["logs"], sigmas=("1.0",), methods=("gaussian", "consistency", "catrs", "ours")),
]

if __name__ == "__main__":
    machinery.run(main, exit_process=True)

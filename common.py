"""Shared building blocks of randomized smoothing (RS): models, data, noise, statistics, the training loop.

Everything the paper's numbers rest on lives here exactly once: the architectures of Cohen et al. (2019),
the datasets and the readers of the project's file formats, the Gaussian noise and the Monte Carlo class
counter that CERTIFY and the training-time pA estimates share, the one-sided Clopper-Pearson bound and the
certified radius (Thm. of Cohen et al.), the adaptive attack on the noise sphere (Alg. 1) and the shared
training loop. Every function takes arguments and returns values: no argparse, no output files, no process
groups, nothing runs on import; copy any function into a notebook. What the commands do around these
(the output guard, checkpoints, resume, torchrun) is machinery.py's.
"""
import contextlib
import functools
import json
import math
import os
import re

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy.special import betaincinv, ndtri   # scipy.stats' beta.ppf and norm.ppf, bit for bit, without its import time

PROJECT = "acr-weakness"   # the scripts check it: a student's own common.py earlier on sys.path is not this one

DATASETS = ("cifar10", "imagenet", "digits")
ARCHS = ("cifar_resnet20", "cifar_resnet110", "resnet50", "lenet", "digits_cnn")
DEFAULT_ARCH = {"cifar10": "cifar_resnet110", "imagenet": "resnet50", "digits": "digits_cnn"}
NUM_CLASSES = {"cifar10": 10, "imagenet": 1000, "digits": 10}
INPUT_SHAPE = {"cifar10": (3, 32, 32), "imagenet": (3, 224, 224), "digits": (1, 8, 8)}
# Normalisation constants of the released checkpoints' code (Cohen et al. and successors).
MEAN = {"cifar10": (0.4914, 0.4822, 0.4465), "imagenet": (0.485, 0.456, 0.406), "digits": (0.3,)}
STD = {"cifar10": (0.2023, 0.1994, 0.2010), "imagenet": (0.229, 0.224, 0.225), "digits": (0.38,)}


# ----------------------------------------------------------------------------------------------------------
# Errors: bad input is a UserError (a ValueError); the commands turn it into one line and exit code 2
# ----------------------------------------------------------------------------------------------------------

class UserError(ValueError):
    """A problem with the user's input; the message names the problem and the fix."""


def check(condition, message):
    """Raise UserError(message) unless condition holds."""
    if not condition:
        raise UserError(message)


SEPARATORS = {"\t": "a tab", "\n": "a line break", "\r": "a carriage return", "|": "'|'"}


def check_cell(text, what):
    """Refuse (UserError) a label or file name that would break the tables it names: a tab or a line break ends a
    TSV field or row, '|' a Markdown cell."""
    found = [name for sep, name in SEPARATORS.items() if sep in text]
    check(not found, f"{what} {text!r} holds {' and '.join(found)}, which would break the tables it is written into; "
                     f"rename it (or give --labels)")
    return text


def radius_ceiling(log):
    """The largest radius a CERTIFY log's rows can hold, sigma Phi^-1(alpha^(1 / N)) at its largest N, from its
    settings file (log["sidecar"]: sigma, alpha) and N column; infinity where either is unknown, and for a log
    with a sigma per input (DDRS, semi-elastic), whose radii another bound governs."""
    side = log.get("sidecar") or {}
    sigma, alpha, N = side.get("sigma", log.get("sigma")), side.get("alpha"), log.get("N")
    if "sigma_x" in log or not (_is_number(sigma) and _is_number(alpha) and 0 < alpha < 1 and N is not None
                                and len(N)):
        return math.inf
    return float(sigma * ndtri(alpha ** (1 / float(np.max(N)))))


def check_smoothing(sigma, alpha=0.5, **counts):
    """UserError (a ValueError) naming the argument unless 0 < sigma < inf, 0 < alpha < 1, each count an int >= 1."""
    for name, value, ok in [("sigma", sigma, 0 < sigma < math.inf), ("alpha", alpha, 0 < alpha < 1)] + \
            [(name, n, int(n) == n >= 1) for name, n in counts.items()]:
        check(ok, f"{name} = {value!r} is out of range (sigma > 0 and finite, 0 < alpha < 1, counts integers >= 1)")


# ----------------------------------------------------------------------------------------------------------
# Readers: one per format, each checking its whole contract (a UserError names the file, the line, the field)
# ----------------------------------------------------------------------------------------------------------

COHEN_COLUMNS = ("idx", "label", "predict", "radius", "correct", "time")   # certification log (Cohen et al.)
GRADNORM_COLUMNS = ("idx", "label", "pA", "grad_norm")                      # --gradnorm measurements
PA_COLUMNS = ("idx", "label", "count", "n")                                 # train_ours.py's pA estimates
TRAIN_LOG_COLUMNS = ("epoch", "time", "lr", "train_loss", "train_acc", "test_loss", "test_acc_noisy", "kept")


def read_table(path, required, numeric):
    """Read a tab-separated file with a header into {column: list of str, or np.array for `numeric` ones}.

    `required` columns must be in the header. A line with the wrong number of fields or a non-numeric value
    in a numeric column is a UserError naming the file and line. Blank lines are skipped; '_line' holds the
    line number of every row (the header is line 1).
    """
    lines = read_lines(path)
    check(lines and lines[0].strip(), f"{path}: empty file (expected a header {' '.join(required)})")
    sep = "\t" if "\t" in lines[0] else None                  # Cohen's logs are tab-separated
    header = [h.strip() for h in lines[0].split(sep)]
    twice = sorted({h for h in header if header.count(h) > 1})
    check(not twice, f"{path}: column {' '.join(twice)} appears more than once in the header; keep one")
    missing = [c for c in required if c not in header]
    check(not missing, f"{path}: not the expected format: header lacks {' '.join(missing)} "
                              f"(expected columns {' '.join(required)})")
    cols, numbers = {h: [] for h in header}, []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        cells = line.split(sep)
        check(len(cells) == len(header), f"{path} line {number}: {len(cells)} fields, the header has "
                                                 f"{len(header)}")
        for h, cell in zip(header, cells):
            cols[h].append(cell.strip())
        numbers.append(number)
    for h in numeric:
        if h in cols:
            cols[h] = to_numbers(path, h, cols[h], numbers)
    cols["_line"] = np.array(numbers, dtype=np.int64)
    return cols


def check_regular(path):
    """A file that can be read without waiting: a missing one, a folder or a FIFO, device or socket (whose
    reading could block for ever) is a UserError."""
    check(not os.path.isdir(path), f"{path}: is a folder; name a file")
    check(os.path.exists(path), f"{path}: file not found")
    check(os.path.isfile(path), f"{path}: not a regular file (a FIFO, device or socket)")


def read_lines(path):
    """The lines of a text file; a missing, special or unreadable one is a UserError."""
    check_regular(path)
    try:
        with open(path, encoding="utf-8-sig", errors="replace") as f:   # a byte-order mark is not a column
            return f.read().splitlines()
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None


# A number as the project writes them: ASCII digits, optional sign, point and exponent, or inf / nan. Python's
# float() also takes underscores ("0_5" is 5.0) and other scripts' digits; a reader must not.
NUMBER = re.compile(r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|(?i:inf|infinity|nan))")


def to_numbers(path, column, cells, line_numbers):
    """Column cells as a float array; the first cell that is not a number (NUMBER) is a UserError with its line."""
    for number, cell in zip(line_numbers, cells):
        if not NUMBER.fullmatch(cell):
            raise UserError(f"{path} line {number}: {column} {cell!r} is not a number")
    return np.array(cells, dtype=float)


def read_certification_log(path):
    """A Cohen-format certification log: {'radius', 'correct'} arrays, plus 'nA', 'N' and 'nY' (the true
    label's votes, certify.py since it records them) when present.

    Contract: a header with Cohen's columns idx label predict radius correct time (tab- or space-separated),
    one line per example, idx unique; idx, label integers >= 0; predict an integer (-1: abstain); radius a
    finite number; correct 0 or 1; optional nA, N, nY counts with 0 <= nA, nY <= N, N >= 1; optional sigma > 0
    (ddrs.py); a `stop` column marks a grid log (certify.py --radii), whose radius is a grid level, not a
    radius to average (it has no ACR)."""
    header = (read_lines(path) or [""])[0].split()
    check(not ("radius" not in header and {"idx", "predict", "correct"} <= set(header)),
          f"{path}: a PREDICT log (no radius column); this needs a CERTIFY log (certify.py without --predict)")
    cols = read_table(path, COHEN_COLUMNS, ("idx", "label", "predict", "radius", "correct", "nA", "N", "nY",
                                              "sigma"))
    check(len(cols["radius"]) > 0, f"{path}: no examples (only a header)")
    for name in ("idx", "label"):
        check_rows(cols, path, (cols[name] >= 0) & (cols[name] == np.round(cols[name])) & (cols[name] < 2 ** 53),
                   f"{name} must be an integer >= 0")
    seen = {}
    for idx, line in zip(cols["idx"].astype(np.int64).tolist(), cols["_line"]):   # two writers, or logs pasted
        check(idx not in seen, f"{path} line {line}: idx {idx} again (first on line {seen.get(idx)}); "
                                      f"each example must appear once: remove the duplicate rows")
        seen[idx] = line
    check_rows(cols, path, (cols["predict"] == np.round(cols["predict"])) & (cols["predict"] >= -1) &
               (cols["predict"] < 2 ** 53), "predict must be a class (an integer >= 0) or -1 (abstain)")
    check_rows(cols, path, np.isin(cols["correct"], (0, 1)), "correct must be 0 or 1")
    check_rows(cols, path, np.isfinite(cols["radius"]), "radius must be a finite number")
    log = {"path": path, "radius": cols["radius"], "correct": cols["correct"].astype(bool),
           "idx": cols["idx"].astype(np.int64), "y": cols["label"].astype(np.int64),
           "predict": cols["predict"].astype(np.int64),
           "grid": "stop" in cols,   # certify.py --radii: the radius is a certified grid level
           "label_mode": "candidate" in cols}   # certify.py --label-mode: cA was the true label, not a prediction
    if "sigma" in cols:                  # ddrs.py certify: each row's own sigma_x
        check_rows(cols, path, np.isfinite(cols["sigma"]) & (cols["sigma"] > 0), "sigma must be a number > 0")
        log["sigma_x"] = cols["sigma"]
    for name in ("nA", "N", "nY"):
        if name in cols:
            check_rows(cols, path, (cols[name] >= 0) & (cols[name] == np.round(cols[name])) & (cols[name] < 2 ** 53),
                       f"{name} must be a count (an integer >= 0)")
            log[name] = cols[name].astype(np.int64)
    if "nA" in log:
        check("N" in log, f"{path}: has an nA column but no N column")
        check_rows(cols, path, (log["nA"] <= log["N"]) & (log["N"] >= 1), "need 0 <= nA <= N and N >= 1")
    if "nY" in log:
        check("N" in log, f"{path}: has an nY column but no N column")
        check_rows(cols, path, log["nY"] <= log["N"], "need 0 <= nY <= N")
    return log


def check_rows(cols, path, ok, what):
    """UserError naming the line of the first row where `ok` (a boolean array over rows) is False."""
    bad = np.flatnonzero(~ok)
    check(len(bad) == 0, f"{path} line {cols['_line'][bad[0]] if len(bad) else 0}: {what}")


# The kinds of certification log the scripts write; each analysis says which it handles (analyze.REFUSED,
# bench.check_bench_log, ddrs.py's report and memory) and refuses the others in one line.
LOG_KINDS = ("CERTIFY", "PREDICT", "grid", "grid without r = 0", "label mode", "DDRS", "semi-elastic")


def log_kinds(log, sidecar):
    """The kinds (LOG_KINDS) of a log as read_certification_log returns it, with its settings file
    (read_sidecar: {} for a log from elsewhere, read as CERTIFY). One of CERTIFY, PREDICT, grid and grid
    without r = 0 (certify.py --radii without the level 0), then label mode, DDRS or semi-elastic (ddrs.py
    certify) where they apply."""
    radii = sidecar.get("radii")
    kinds = [("grid without r = 0" if isinstance(radii, list) and 0 not in radii else "grid") if log.get("grid")
             else "PREDICT" if sidecar.get("mode") == "predict" else "CERTIFY"]
    if log.get("label_mode") or sidecar.get("candidate") == "label":
        kinds.append("label mode")
    ddrs = sidecar.get("ddrs")
    if isinstance(ddrs, dict) and ddrs.get("semi_elastic"):
        kinds.append("semi-elastic")
    elif "sigma_x" in log or sidecar.get("script") == "ddrs.py certify":
        kinds.append("DDRS")
    return kinds


def check_log_kinds(log, sidecar, refused, command):
    """A UserError in one line if the log is of a kind that `command` refuses (refused: {kind: why}), or if a
    row claims more than its own counts allow (check_radii)."""
    for kind in log_kinds(log, sidecar):
        check(kind not in refused, f"{log['path']}: a {kind} log, which {command} does not take: {refused.get(kind)}")
    check_radii(log, sidecar)


def check_radii(log, sidecar):
    """Refuse (UserError, one line) a CERTIFY log row whose radius exceeds sigma Phi^-1(CP_lower(nA, N, alpha)),
    the most its own counts allow, where the log carries nA and N and its settings file sigma and alpha (a
    radius edited by hand, or a log paired with another run's settings). The TSV's 6 significant digits are
    allowed for; grid, DDRS and semi-elastic logs bound their radii otherwise and are not checked here."""
    sigma, alpha = sidecar.get("sigma"), sidecar.get("alpha")
    if "nA" not in log or "N" not in log or not (_is_number(sigma) and _is_number(alpha)) or \
            set(log_kinds(log, sidecar)) & {"grid", "grid without r = 0", "PREDICT", "DDRS", "semi-elastic"}:
        return
    with np.errstate(invalid="ignore", divide="ignore"):
        bound = np.maximum(sigma * ndtri(clopper_pearson_lower(log["nA"], log["N"], alpha)), 0.0)
    bad = np.flatnonzero(log["radius"] > bound * (1 + 1e-5) + 1e-6)
    if len(bad):
        i = bad[0]
        raise UserError(f"{log['path']}: the row of idx {int(log['idx'][i])} has radius {log['radius'][i]:g}, more "
                        f"than its nA {int(log['nA'][i])} of N {int(log['N'][i])} allow at sigma {sigma:g}, alpha "
                        f"{alpha:g} ({bound[i]:.6g}); {len(bad)} such row(s): edited by hand, or another run's log")


# The sidecar's fields that readers use, with their contract (a field may be missing: older logs lack some).
SIDECAR_FIELDS = {
    "script": lambda v: isinstance(v, str),
    "mode": lambda v: v in ("certify", "predict", "grid", "label"),
    "dataset": lambda v: v in DATASETS, "split": lambda v: v in ("train", "test"),
    "sigma": lambda v: _is_number(v) and 0 < v < math.inf,
    "N": lambda v: _is_int(v) and v >= 1, "N0": lambda v: v is None or (_is_int(v) and v >= 1),
    "alpha": lambda v: _is_number(v) and 0 < v < 1, "seed": lambda v: _is_int(v) or v == "random",
    "sound": lambda v: isinstance(v, bool), "save_counts": lambda v: isinstance(v, bool),
    "checkpoint": lambda v: isinstance(v, str), "checkpoint_sha256": lambda v: isinstance(v, str),
    "radii": lambda v: v is None or (isinstance(v, list) and all(_is_number(r) and r >= 0 for r in v)),
    "beta": lambda v: v is None or (_is_number(v) and 0 <= v < 1),
    "columns": lambda v: isinstance(v, list) and all(isinstance(c, str) for c in v),
    "data": lambda v: v is None or isinstance(v, str),
    "candidate": lambda v: v in ("label", "selected"), "seed_value": lambda v: v is None or _is_int(v),
}


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def read_json_object(path, what):
    """A JSON file holding an object (dict); anything else is a UserError naming the file and `what` it is."""
    check(not os.path.isdir(path), f"{path}: is a folder, not the {what}")
    check_regular(path)
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:   # RecursionError: nested too deep
        raise UserError(f"{path}: cannot read the {what} ({type(e).__name__}); it must be JSON") from None
    check(isinstance(obj, dict), f"{path}: the {what} must be a JSON object, not {type(obj).__name__}")
    return obj


def read_sidecar(path, required=()):
    """The settings certify.py writes beside a log (`<log>.json`, or `<stem>.json`); {} when there is none.

    Contract: a JSON object; each field of SIDECAR_FIELDS that is present has its type and range; the fields
    in `required` are present. A violation is a UserError naming the file and the field."""
    for candidate in (path + ".json", os.path.splitext(path)[0] + ".json"):
        if os.path.isfile(candidate):
            settings = read_json_object(candidate, "settings file of a log")
            for key, ok in SIDECAR_FIELDS.items():
                if key in settings and not ok(settings[key]):
                    raise UserError(f"{candidate}: field {key!r} has an invalid value {settings[key]!r}")
            missing = [k for k in required if k not in settings]
            check(not missing, f"{candidate}: lacks the field(s) {', '.join(missing)}")
            return settings
    check(not required, f"{path}: its settings file {path}.json is missing (it names {', '.join(required)})")
    return {}


def read_log_prefix(path, columns, restart="pass --overwrite to start again, or choose another output"):
    """Our own log being resumed (certify.py): its complete data lines and the byte length of that valid prefix.

    A last line without its newline or with the wrong field count is torn (cut off by a kill): it is left out.
    A file without any complete line counts as empty. A wrong header or a malformed earlier line is a UserError
    that ends with `restart`, the way out with the reading command's own flags.
    """
    check_regular(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path!r} ({type(e).__name__}); {restart}") from None
    # byte offsets below are those of the text: a file with CR LF line ends (edited on Windows) is refused
    check(b"\r" not in data, f"{path!r} has Windows line endings (CR LF); convert it back (dos2unix) to "
                             f"resume, or {restart}")
    lines = text.split("\n")[:-1]  # the piece after the last newline is torn (or empty)
    if not lines:
        return [], 0
    check(lines[0] == "\t".join(columns),
          f"{path!r} has header {lines[0][:60]!r}, not {' '.join(columns)!r} (another format or setting); "
          f"{restart}")
    rows = lines[1:]
    if rows and len(rows[-1].split("\t")) != len(columns):
        rows = rows[:-1]
    for k, row in enumerate(rows):
        cells = row.split("\t")
        check(len(cells) == len(columns) and cells[0].isascii() and cells[0].isdigit(),
              f"{path!r} line {k + 2} is malformed; repair it, or {restart}")
    return rows, len("".join(line + "\n" for line in [lines[0]] + rows).encode("utf-8"))


def read_header(path):
    """The first line of a text file without its newline ('' for an empty file)."""
    check_regular(path)
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.readline().rstrip("\n")


def read_train_log(path):
    """A training run's log.tsv (TRAIN_LOG_COLUMNS): its complete rows as dicts of strings, epochs in order.

    A torn last line (a killed run) is dropped; any other malformed line is a UserError."""
    rows, _ = read_log_prefix(path, TRAIN_LOG_COLUMNS, "start a new run in another --outdir")
    return [dict(zip(TRAIN_LOG_COLUMNS, row.split("\t"))) for row in rows]


def read_args_json(path):
    """A run's args.json: a JSON object of its settings, with 'run' (run_identity) in runs since it exists."""
    args = read_json_object(path, "settings of a run (args.json)")
    check("run" not in args or isinstance(args["run"], dict), f"{path}: field 'run' must be an object")
    return args


NO_NY = "it records no nY (the true label's votes); certify.py --split train without --radii writes it"


def read_train_pA(path):
    """Training-set pA: train_ours.py's estimates (`idx label count n`: count / n) or a certification log of
    the train split with the true label's votes (nY / N)."""
    lines = read_lines(path)
    if lines and lines[0].split("\t")[:4] == ["idx", "label", "count", "n"]:
        cols = read_table(path, ("idx", "label", "count", "n"), ("count", "n"))
        check(len(cols["n"]) > 0, f"{path}: no examples (only a header)")
        check_rows(cols, path, (cols["n"] >= 1) & (cols["count"] >= 0) & (cols["count"] <= cols["n"]),
                   "need 0 <= count <= n and n >= 1")
        return {"path": path, "pA_all": cols["count"] / cols["n"], "source": "count/n"}
    log = read_certification_log(path)
    check("nY" in log, f"{path}: neither train_ours.py's pA estimates (idx label count n) nor a "
                       f"certification log with an nY column: {NO_NY}")
    return dict(log, pA_all=log["nY"] / log["N"], source="nY/N")


def read_gradient_norms(path):
    """A gradient-norm TSV of the training scripts' --gradnorm mode: {'pA', 'grad_norm'} arrays."""
    cols = read_table(path, GRADNORM_COLUMNS, ("pA", "grad_norm"))
    check(len(cols["pA"]) > 0, f"{path}: no examples (only a header)")
    check_rows(cols, path, (cols["pA"] >= 0) & (cols["pA"] <= 1) & (cols["grad_norm"] >= 0),
               "need 0 <= pA <= 1 and grad_norm >= 0 (finite)")
    return {"path": path, "idx": cols["idx"], "pA": cols["pA"], "grad_norm": cols["grad_norm"]}


LOG_TIME_CELL = re.compile(r"(?:(\d+) days?, )?(\d+):([0-5]\d):([0-5]\d(?:\.\d+)?)")


def log_seconds(cell, where="time"):
    """Seconds of a certification log's time cell: str of a datetime.timedelta ('H:MM:SS.ffffff' or
    'D day(s), H:MM:SS.ffffff', as certify.py and Cohen et al.'s code write it) or plain seconds; anything
    else is a UserError naming `where`."""
    match = LOG_TIME_CELL.fullmatch(cell.strip())
    if match:
        days, hours, minutes, secs = match.groups()
        return int(days or 0) * 86400 + int(hours) * 3600 + int(minutes) * 60 + float(secs)
    try:
        seconds = float(cell)
    except ValueError:
        seconds = float("nan")
    check(math.isfinite(seconds) and seconds >= 0, f"{where}: time {cell!r} is neither H:MM:SS nor seconds")
    return seconds


def read_ecdf_or_log(path):
    """budget accepts certification logs and tabulated ECDFs (`x y`, p increasing in [0, 1])."""
    lines = read_lines(path)
    if not lines or lines[0].split()[:2] != ["x", "y"]:
        return read_certification_log(path)
    cols = read_table(path, ("x", "y"), ("x", "y"))
    x, y = cols["x"], cols["y"]
    check(len(x) > 0, f"{path}: no points (only a header)")
    check(np.all(np.diff(x) > 0) and x[0] >= 0 and x[-1] <= 1 and np.all((y >= 0) & (y <= 1)),
                 f"{path}: an ECDF needs x increasing in [0, 1] and y in [0, 1]")
    return {"path": path, "grid_p": x, "grid_y": y}


# ----------------------------------------------------------------------------------------------------------
# Models: Sequential(NormalizeLayer, net), with the parameter names of Cohen et al.'s released checkpoints
# ----------------------------------------------------------------------------------------------------------

class NormalizeLayer(nn.Module):
    """(x - mean) / std per channel. Non-persistent buffers: state_dicts keep Cohen's keys (`1.conv1.weight`)."""

    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)

    def forward(self, x):
        return (x - self.mean) / self.std


class BasicBlock(nn.Module):
    """Post-activation residual block of the CIFAR ResNets (He et al. 2016) as in Cohen et al.'s code."""

    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        residual = x if self.downsample is None else self.downsample(x)
        return self.relu(out + residual)


class CifarResNet(nn.Module):
    """CIFAR ResNet of depth 6n+2 (20, 110): widths 16/32/64, 8x8 average pool, one linear layer."""

    def __init__(self, depth, num_classes=10):
        super().__init__()
        assert (depth - 2) % 6 == 0, "depth must be 6n+2"
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(*[BasicBlock(16, 16) for _ in range(n)])
        self.layer2 = nn.Sequential(BasicBlock(16, 32, 2), *[BasicBlock(32, 32) for _ in range(n - 1)])
        self.layer3 = nn.Sequential(BasicBlock(32, 64, 2), *[BasicBlock(64, 64) for _ in range(n - 1)])
        self.avgpool = nn.AvgPool2d(8)
        self.fc = nn.Linear(64, num_classes)
        for mod in self.modules():  # He initialisation, as in the original code
            if isinstance(mod, nn.Conv2d):
                fan_out = mod.kernel_size[0] * mod.kernel_size[1] * mod.out_channels
                mod.weight.data.normal_(0, (2.0 / fan_out) ** 0.5)
            elif isinstance(mod, nn.BatchNorm2d):
                mod.weight.data.fill_(1)
                mod.bias.data.zero_()

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class LeNet(nn.Module):
    """LeNet-5 style CNN for small grey-scale images (padding keeps it valid down to 8x8 inputs)."""

    def __init__(self, in_channels=1, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5, padding=2)
        self.pool = nn.AdaptiveAvgPool2d(5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = self.pool(F.relu(self.conv2(x)))
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc3(F.relu(self.fc2(x)))


class DigitsCNN(nn.Module):
    """Small CNN for scikit-learn's 8x8 digits: fast enough for the CPU demo and the tests (has BatchNorm)."""

    def __init__(self, in_channels=1, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)  # (B, 32, 4, 4)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def get_architecture(arch, dataset):
    """The base classifier f: Sequential(NormalizeLayer(mean, std), net); inputs live in [0, 1] pixel space."""
    check(arch in ARCHS, f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    check(dataset in DATASETS, f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    channels, k = INPUT_SHAPE[dataset][0], NUM_CLASSES[dataset]
    if arch == "cifar_resnet20":
        net = CifarResNet(20, k)
    elif arch == "cifar_resnet110":
        net = CifarResNet(110, k)
    elif arch == "resnet50":
        import torchvision  # imported here: only ImageNet needs it for models
        net = torchvision.models.resnet50(num_classes=k)
    elif arch == "lenet":
        net = LeNet(channels, k)
    else:
        net = DigitsCNN(channels, k)
    return nn.Sequential(NormalizeLayer(MEAN[dataset], STD[dataset]), net)


# ----------------------------------------------------------------------------------------------------------
# Data: inputs in [0, 1]; normalisation is the model's first layer
# ----------------------------------------------------------------------------------------------------------

class TensorImages(torch.utils.data.Dataset):
    """Images held in memory as a float tensor (N, C, H, W) in [0, 1], an optional tensor transform."""

    def __init__(self, images, labels, transform=None):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = self.images[i]
        if self.transform is not None:
            x = self.transform(x)
        return x, int(self.labels[i])


def random_crop_flip(x, padding=4):
    """CIFAR training augmentation on one (C, H, W) tensor: random crop with zero padding, random h-flip."""
    _, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    i, j = torch.randint(0, 2 * padding + 1, (2,)).tolist()
    x = padded[:, i:i + h, j:j + w]
    return x.flip(2) if torch.rand(()) < 0.5 else x


@functools.lru_cache(maxsize=1)
def _digits_arrays():
    """(images (1797, 8, 8) in 0..16, labels) of scikit-learn's bundled digits: its digits.csv.gz, read as
    load_digits reads it (the same arrays) without importing scikit-learn (a second of start-up)."""
    import importlib.util
    spec = importlib.util.find_spec("sklearn")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz") if spec else ""
    if not os.path.isfile(path):   # another layout of scikit-learn: its loader
        from sklearn.datasets import load_digits
        data = load_digits()
        return data.images, data.target
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)


def _digits(split):
    """scikit-learn's bundled 8x8 digits in [0, 1], a fixed seeded 80/20 train/test split (no network)."""
    images, labels = _digits_arrays()
    images = torch.tensor(images / 16.0, dtype=torch.float32).unsqueeze(1)  # (1797, 1, 8, 8)
    labels = torch.tensor(labels, dtype=torch.long)
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(labels))
    part = perm[:cut] if split == "train" else perm[cut:]
    return TensorImages(images[part], labels[part])


MAX_PIXELS = 2 ** 26   # an image folder's images are small (CIFAR-10: 32x32); a bigger one is not a dataset image


def _image_folder_in_memory(folder, num_classes=None, shape=None):
    """Decode a small-image folder tree (`<class>/<image>`, classes sorted by name) into memory once.

    Contract: at least one class folder, each holding at least one image; num_classes (when given) class
    folders exactly; every image readable and of the same size (shape (3, H, W) when given). Hidden files are
    skipped. A violation is a UserError naming the folder or the image."""
    from PIL import Image, UnidentifiedImageError
    try:
        classes = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d))
                         and not d.startswith("."))
    except OSError as e:
        raise UserError(f"image folder {folder!r}: cannot list it ({e.strerror})") from None
    check(classes, f"image folder {folder!r} has no class folders (expected <class>/<image> inside)")
    check(num_classes is None or len(classes) == num_classes,
          f"image folder {folder!r} has {len(classes)} class folders, the dataset has {num_classes}")
    images, labels = [], []
    for label, name in enumerate(classes):
        files = sorted(f for f in os.listdir(os.path.join(folder, name)) if not f.startswith("."))
        check(files, f"image folder {folder!r}: class folder {name!r} holds no images")
        for fname in files:
            path = os.path.join(folder, name, fname)
            check(os.path.isfile(path), f"{path}: not a regular file (a FIFO, socket or folder); remove it")
            try:
                with Image.open(path) as img:
                    check(img.width * img.height <= MAX_PIXELS, f"{path}: {img.width}x{img.height} pixels, more "
                                                                f"than any dataset here; remove it")
                    images.append(np.asarray(img.convert("RGB"), dtype=np.uint8))
            except UserError:
                raise
            except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as e:
                raise UserError(f"{path}: not a readable image ({type(e).__name__}); remove it") from None
            want = images[0].shape if shape is None else (shape[1], shape[2], shape[0])
            check(images[-1].shape == want, f"{path}: image of size {images[-1].shape[1]}x{images[-1].shape[0]}, "
                                            f"expected {want[1]}x{want[0]}")
            labels.append(label)
    images = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float().div_(255)  # (N, 3, H, W)
    return images, torch.tensor(labels, dtype=torch.long)


def _cifar10(split, data_dir, train_transform):
    folder = os.path.join(data_dir, "train" if split == "train" else "test")
    transform = random_crop_flip if train_transform and split == "train" else None
    check(not os.path.exists(folder) or os.path.isdir(folder), f"{folder!r} is not a folder; --data-dir must hold "
                                                                 f"train/ and test/ image folders, or torchvision's files")
    if os.path.isdir(folder):  # image-folder layout, e.g. the JPEG copy on offline machines
        images, labels = _image_folder_in_memory(folder, NUM_CLASSES["cifar10"], INPUT_SHAPE["cifar10"])
        return TensorImages(images, labels, transform)
    import torchvision
    made = not os.path.lexists(data_dir)
    try:
        ds = torchvision.datasets.CIFAR10(data_dir, train=(split == "train"), download=True)
    except Exception as e:  # offline, unwritable, corrupt: one line saying where we looked
        if made:   # the folder the failed download created, with its partial archive: nothing is left behind
            import shutil
            shutil.rmtree(data_dir, ignore_errors=True)
        raise UserError(f"CIFAR-10 not found in {data_dir!r} and could not be downloaded ({type(e).__name__}); "
                        f"put torchvision's cifar-10-batches-py or train/ and test/ image folders there "
                        f"and pass --data-dir") from None
    images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).float().div_(255)
    return TensorImages(images, torch.tensor(ds.targets, dtype=torch.long), transform)


def _imagenet(split, data_dir, train_transform):
    import torchvision
    from torchvision import transforms
    folder = os.path.join(data_dir, "train" if split == "train" else "val")
    check(os.path.isdir(folder), f"ImageNet folder {folder!r} not found; pass --data-dir with train/ and val/ "
                                 f"image folders (ImageNet cannot be downloaded automatically)")
    if split == "train" and train_transform:
        tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                 transforms.ToTensor()])
    else:
        tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor()])
    return torchvision.datasets.ImageFolder(folder, tf)


def default_data_dir():
    """--data-dir default: $RS_DATA_DIR, else ./data."""
    return os.environ.get("RS_DATA_DIR", "./data")


def get_dataset(name, split, data_dir=None, train_transform=True):
    """Dataset of (x, y) with x a float tensor in [0, 1]. split: 'train' or 'test'.

    train_transform=False gives the training images without augmentation (e.g. for a fixed probe set).
    """
    check(name in DATASETS, f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    check(split in ("train", "test"), f"unknown split {split!r}; use train or test")
    data_dir = data_dir or default_data_dir()
    if name == "digits":
        return _digits(split)
    if name == "cifar10":
        return _cifar10(split, data_dir, train_transform)
    return _imagenet(split, data_dir, train_transform)


class WithIndex(torch.utils.data.Dataset):
    """Wrap a dataset so that it yields (x, y, idx): training needs idx for weights and per-example targets."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        """key: an index, or (index, seed) from TrainLoader, whose random augmentation then draws from seed."""
        if not isinstance(key, tuple):
            return (*self.dataset[key], key)
        i, seed = key
        saved = torch.get_rng_state()             # the caller's global generator (the noise) stays untouched
        torch.default_generator.manual_seed(seed)  # the CPU generator only (torch.manual_seed costs 40x more)
        try:
            x, y = self.dataset[i]
        finally:
            torch.set_rng_state(saved)
        return x, y, i


# ----------------------------------------------------------------------------------------------------------
# Statistics of CERTIFY (Cohen et al. 2019)
# ----------------------------------------------------------------------------------------------------------

def clopper_pearson_lower(nA, N, alpha):
    """One-sided (1 - alpha) Clopper-Pearson lower bound, elementwise: Beta(nA, N - nA + 1)'s alpha-quantile, 0 at 0."""
    nA, N = np.asarray(nA, dtype=float), np.asarray(N, dtype=float)
    with np.errstate(invalid="ignore"):
        bound = betaincinv(np.maximum(nA, 1), N - nA + 1, alpha)
    bound = np.where(nA > 0, bound, 0.0)
    return float(bound) if bound.ndim == 0 else bound


def clopper_pearson_upper(nA, N, alpha):
    """One-sided (1 - alpha) Clopper-Pearson upper bound: the (1 - alpha)-quantile of Beta(nA + 1, N - nA); 1 at nA == N."""
    nA, N = np.asarray(nA, dtype=float), np.asarray(N, dtype=float)
    with np.errstate(invalid="ignore"):
        bound = betaincinv(nA + 1, np.maximum(N - nA, 1), 1 - alpha)
    bound = np.where(nA < N, bound, 1.0)
    return float(bound) if bound.ndim == 0 else bound


def certified_radius(pA_lower, sigma):
    """Certified l2 radius sigma * Phi^-1(pA_lower) of Cohen et al.'s Theorem 1 (negative below 1/2)."""
    return sigma * ndtri(pA_lower)


# ----------------------------------------------------------------------------------------------------------
# Noise and the Monte Carlo class counter (CERTIFY, PREDICT and training's pA estimates)
# ----------------------------------------------------------------------------------------------------------

def example_generator(seed, idx, device="cpu"):
    """A torch.Generator seeded by (seed, idx): example idx gets the same noise in any run, subset or shard."""
    state = np.random.SeedSequence([int(seed), int(idx)]).generate_state(2, dtype=np.uint32)
    g = torch.Generator(device=device)
    g.manual_seed(int(state[0]) << 32 | int(state[1]))
    return g


def gaussian_copies(x, k, sigma, generator=None):
    """k copies x + sigma N(0, I) of each x (B, C, H, W) in x's dtype, (k * B, C, H, W), copy j of b at j * B + b;
    and which draws failed: None, a Gaussian draw never fails (sound_copies' can)."""
    noise = sigma * torch.randn((k, *x.shape), device=x.device, generator=generator,   # half types: drawn in fp32
                                dtype=x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32)
    return (x.unsqueeze(0) + noise).to(x.dtype).flatten(0, 1), None


def pass_sizes(n, per_pass):
    """Split n draws into ceil(n / per_pass) passes of (nearly) equal size: no nearly empty last pass."""
    passes = -(-n // per_pass)
    q, r = divmod(n, max(passes, 1))
    return [q + 1] * r + [q] * (passes - r) if passes > 0 else []


@contextlib.contextmanager
def eval_mode(model):
    """The model in eval mode for a block (one fixed classifier), then every module back in the mode it came in."""
    modes = [(m, m.training) for m in model.modules()] if isinstance(model, torch.nn.Module) else []
    try:
        yield model.eval() if modes else model
    finally:
        for module, training in modes:
            module.train(training)


def sample_counts(model, x, sigma, n, batch, num_classes, generator=None, copies=gaussian_copies, stop=None):
    """Votes (int64 (B, num_classes), x's device) on n noisy copies of each x (B, C, H, W), about `batch` inputs a pass,
    noise by copies (sound_copies' failed draws vote for none) from generator; stop(counts, drawn) -> True ends."""
    B = x.shape[0]
    with torch.inference_mode():
        counts = torch.zeros(B, num_classes + 1, dtype=torch.long, device=x.device)   # + failed draws
        finite, drawn = torch.ones((), dtype=torch.bool, device=x.device), 0
        for k in pass_sizes(n, max(1, batch // B)):
            noisy, failed = copies(x, k, sigma, generator)
            logits = model(noisy)
            check(logits.shape[-1] == num_classes, f"num_classes {num_classes} != {logits.shape[-1]} model outputs")
            finite = finite & torch.isfinite(logits).all()   # on the device: one sync at the end, not per pass
            pred = logits.argmax(1) if failed is None else torch.where(failed, num_classes, logits.argmax(1))
            counts.view(-1).index_add_(0, torch.arange(B, device=x.device).repeat(k) * (num_classes + 1) + pred,
                                       torch.ones_like(pred))
            drawn += k
            if stop is not None and drawn < n and stop(counts[:, :num_classes], drawn):
                break
    check(bool(finite), f"the model gave non-finite outputs on noisy inputs (sigma {sigma}): no certificate")
    return counts[:, :num_classes].clone()   # a normal tensor: callers may update it outside inference mode




# ----------------------------------------------------------------------------------------------------------
# Sound sampling (Voráček & Hein 2023): integer noise on the 8-bit grid, one conversion to float
# ----------------------------------------------------------------------------------------------------------
# The float path feeds f with fl(x + fl(sigma * randn)), which keeps low-order bits of x: a base classifier
# can read them and get certificates that are false (Voráček & Hein 2023, §3). The sound path draws the Gaussian rounded
# to the grid h = 1/255 (J = round(G / h)) by comparing fair 62-bit integers with integer thresholds, adds
# it to the input's integer levels (a + J) and converts once, z = fp32(a + J) / 255. Since x + q_h(G) =
# q_h(x + G) for x on the grid, the votes are those of the Gaussian smoothing of f o phi o q_h, so Cohen's
# radius holds unchanged for that classifier. A draw whose integer falls past the last threshold (about
# 1e-16 to 5e-16 per coordinate for sigma 0.25 to 1) is a failure and votes for no class: never A, and counted
# in the full N.

SOUND_Q = 2 ** 62       # the uniform integers compared with the thresholds: 62 fair coin flips per coordinate
GRID_LEVELS = 255       # 8-bit inputs x = a / 255
# The grid each dataset's inputs lie on: 8-bit images, and scikit-learn's digits with their 17 levels k / 16.
DATASET_LEVELS = {"cifar10": 255, "imagenet": 255, "digits": 16}


@functools.lru_cache(maxsize=16)
def rounded_gaussian_table(sigma, Q=SOUND_Q, levels=GRID_LEVELS):
    """Cumulative integer thresholds S of the Gaussian N(0, sigma^2) rounded to the grid h = 1 / levels.

    Bin j (|j| <= L = ceil(10 sigma / h)) has exact mass p_j = Phi((j + 1/2) h / sigma) - Phi((j - 1/2) h /
    sigma) and gets W_j = floor(Q p_j) of the Q integers, so no bin is sampled more often than its exact mass.
    Precision: the floors are computed with mpmath at 50 and at 80 significant digits and must agree; Q p_j
    is at most 2^62 < 10^19, so 50 digits leave 30 after the point, and a floor can only differ between the
    two precisions if Q p_j lies within about 1e-30 of an integer, which the check would catch. sigma is taken
    at its exact binary value. Returns (S, L): S an int64 tensor (2L + 1,) of cumulative sums of W on CPU.
    """
    import mpmath
    L = math.ceil(10 * sigma * levels)

    def floors(digits):
        with mpmath.workdps(digits):
            scale = mpmath.mpf(1) / (levels * mpmath.mpf(sigma))      # h / sigma
            cdf = [mpmath.ncdf((j + mpmath.mpf(1) / 2) * scale) for j in range(-L - 1, L + 1)]
            return [int(mpmath.floor(Q * (b - a))) for a, b in zip(cdf, cdf[1:])]

    W = floors(50)
    if W != floors(80):
        raise ArithmeticError(f"rounded Gaussian table for sigma {sigma}: floors differ between precisions")
    return torch.tensor(np.cumsum(np.array(W, dtype=object)).astype(np.int64)), L


@functools.lru_cache(maxsize=16)
def _table_on(sigma, device, Q=SOUND_Q, levels=GRID_LEVELS):
    S, L = rounded_gaussian_table(sigma, Q, levels)
    return S.to(device), L


def grid_levels(x, levels=GRID_LEVELS):
    """The integer levels a = round(levels * x) of an input on the grid x = a / levels (int32, x's shape and
    device; levels = 255 for 8-bit images, DATASET_LEVELS per dataset).

    An input off the grid (|levels x - a| >= 1e-3 anywhere) is a UserError: the sound sampler certifies only
    inputs on the grid (ToTensor of 8-bit images; our datasets)."""
    scaled = x.double() * levels
    a = scaled.round()
    on_grid = ((scaled - a).abs().max() < 1e-3) & (a.min() >= 0) & (a.max() <= levels)   # one host sync, not three
    check(bool(on_grid), f"--sound needs inputs on the grid x = a / {levels}, a in 0..{levels} (this input is not)")
    return a.to(torch.int32)


def sound_noisy_inputs(a, k, sigma, generator=None, Q=SOUND_Q, levels=GRID_LEVELS):
    """k noisy copies of each input on the grid, formed exactly: z = fp32(a + J) / levels (docs/certification.md, --sound).

    a: int32 levels (B, C, H, W) (grid_levels). J: the rounded Gaussian drawn with integer thresholds on a's
    device. Returns (z (k, B, C, H, W) float32, failed (k, B) bool: a draw with any failed coordinate).
    """
    S, L = _table_on(sigma, a.device, Q, levels)
    U = torch.randint(0, Q, (k, *a.shape), dtype=torch.int64, device=a.device, generator=generator)
    index = torch.searchsorted(S, U, right=True, out_int32=True)  # bin of U; len(S) means past the last one
    failed = (index == len(S)).reshape(k, a.shape[0], -1).any(2)
    z = (a.unsqueeze(0) + (index - L)).float() / levels           # integer sum (int32), one conversion
    return z, failed


def sound_copies(levels=GRID_LEVELS):
    """The `copies` of sample_counts for inputs on the grid x = a / levels: sound_noisy_inputs' exact
    integer noise (certify.py --sound). Its failed draws vote for no class."""
    def copies(x, k, sigma, generator=None):
        z, failed = sound_noisy_inputs(grid_levels(x, levels), k, sigma, generator, levels=levels)
        return z.flatten(0, 1).to(x.dtype), failed.flatten()   # a cast of the grid point: part of the classifier
    return copies


# ----------------------------------------------------------------------------------------------------------
# Reduced precision: the base classifier under bf16 / fp16 autocast (certify.py --precision)
# ----------------------------------------------------------------------------------------------------------

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device_type, precision="fp32"):
    """The autocast context of a precision: fp32 is a no-op, bf16/fp16 run matmuls and convolutions in it."""
    dtype = PRECISIONS[precision]
    return torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


class InPrecision(nn.Module):
    """model evaluated under autocast(precision): the reduced-precision classifier that a certificate computed
    with it is about (the model itself unchanged; pass the result to certify, predict or grid_certify)."""

    def __init__(self, model, precision):
        super().__init__()
        self.model, self.precision = model, precision

    def forward(self, x):
        with autocast(x.device.type, self.precision):
            return self.model(x)


def in_precision(model, precision):
    """model as it is for fp32, else InPrecision(model, precision)."""
    return model if precision == "fp32" else InPrecision(model, precision)


# ----------------------------------------------------------------------------------------------------------
# The adaptive attack on the noise sphere (Alg. 1, App. C.3; as the paper's released code runs it, docs/training.md)
# ----------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def frozen_eval(model):
    """Run attacks in eval mode (BatchNorm statistics untouched) with frozen parameters (no weight gradients); then
    every module gets back its own mode (not only the top one's) and every parameter its requires_grad."""
    modes = [(m, m.training) for m in model.modules()]   # each module's own: a frozen BatchNorm stays in eval
    flags = [p.requires_grad for p in model.parameters()]
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        yield model
    finally:
        for p, flag in zip(model.parameters(), flags):
            p.requires_grad_(flag)
        for module, training in modes:
            module.train(training)


def sphere_pgd(model, x, y, delta, T, eps, norm_type="l2"):
    """Move each Gaussian noise along its sphere ||delta|| = const to make the base model err (Alg. 1).

    x: (B, C, H, W); y: (B,); delta: (m, B, C, H, W), the m noise draws. T PGD steps on the cross-entropy with
    step eps, l2 the normalised gradient, linf its sign over sqrt(d) (the official code's), each draw rescaled to
    its norm after each step. A draw keeps its first misclassified iterate, else the last (T = 0: delta). The model
    runs under frozen_eval (weights and BatchNorm statistics kept). Returns a new detached tensor like delta.
    """
    check(norm_type in ("l2", "linf"), f"norm_type must be 'l2' or 'linf' (got {norm_type!r})")
    if T == 0:
        return delta.detach().clone()
    model = unwrap(model)  # under DDP: attack the plain module, no gradient synchronisation
    m, B = delta.shape[:2]
    d = x[0].numel()
    with frozen_eval(model):
        xs, ys = x.unsqueeze(0).expand_as(delta).flatten(0, 1), y.repeat(m)    # block order (m*B, ...)
        r0 = delta.flatten(2).norm(dim=2).view(m * B, *[1] * (x.dim() - 1))    # (m*B, 1, 1, 1)
        cur = delta.detach().flatten(0, 1).clone()
        best = cur.clone()
        found = torch.zeros(m * B, dtype=torch.bool, device=x.device)
        for _ in range(T):
            cur.requires_grad_(True)
            logits = model(xs + cur)
            wrong = (logits.argmax(1) != ys) & ~found                          # first misclassification
            best = torch.where(wrong.view_as(r0), cur.detach(), best)          # no host sync (vs. masking)
            found |= wrong
            loss = F.cross_entropy(logits, ys, reduction="sum") / m
            grad, = torch.autograd.grad(loss, cur)
            with torch.no_grad():
                if norm_type == "l2":
                    step = grad / (grad.flatten(1).norm(dim=1).view_as(r0) + 1e-8)
                else:
                    step = grad.sign() / d ** 0.5
                cur = cur.detach() + eps * step
                cur = cur * r0 / (cur.flatten(1).norm(dim=1).view_as(r0) + 1e-8)  # back onto the sphere
        best = torch.where(found.view_as(r0), best, cur.detach())
        return best.view_as(delta)


# ----------------------------------------------------------------------------------------------------------
# The shared training loop (App. C.1): SGD, step schedule, m-chunk convention, noisy evaluation, logs
# ----------------------------------------------------------------------------------------------------------


def make_optimizer(model, lr=0.1, momentum=0.9, weight_decay=1e-4):
    """Plain SGD with momentum, as in every official RS training script."""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)


def make_scheduler(optimizer, lr_step, gamma=0.1, milestones=None):
    """lr x gamma every lr_step epochs, or at each of the epochs in `milestones` when given; stepped once at
    the end of each epoch (so the first decay applies from epoch lr_step, or milestones[0], on)."""
    if milestones:
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=sorted(milestones), gamma=gamma)
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=lr_step, gamma=gamma)


def split_chunks(batch, m):
    """Cut a loader batch into m consecutive chunks of floor(B/m) examples (Salman et al. 2019's convention, docs/training.md).

    Each chunk is replicated with m noise draws and gets its own optimizer step, so every step sees about
    B noisy inputs. Leftover examples of a batch not divisible by m are dropped, as in the official code.
    """
    b = batch[0].shape[0] // m
    if b == 0:
        return [batch]  # a batch smaller than m (tiny last batch): train on it whole
    return [tuple(t[i * b:(i + 1) * b] for t in batch) for i in range(m)]


def train_epoch(model, loader, optimizer, loss_fn, chunks, device, progress=None, max_batches=None, *,
                precision="fp32"):
    """One training epoch: every loader batch is split into `chunks` chunks, one optimizer step each.

    loss_fn(model, x, y, idx) -> dict with 'loss' (scalar tensor to minimise), 'correct' (tensor: correct
    predictions among its noisy inputs) and 'total' (int: number of noisy inputs). Loss and accuracy are
    accumulated on the device (no per-step host synchronisation). Returns {'train_loss', 'train_acc'}.
    progress: optional callable(batches_done, batches_total) for a progress line. max_batches: stop after
    that many loader batches (smoke tests and timing; None = the whole epoch). precision: 'fp32', or
    'bf16'/'fp16' autocast of loss_fn (mixed precision, --amp); fp16 scales the loss (a GradScaler per
    epoch, so a run resumed at an epoch boundary repeats the uninterrupted one).
    """
    model.train()
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None  # bf16 has fp32's range
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device)
    total, steps = 0, 0
    n_batches = len(loader) if max_batches is None else min(max_batches, len(loader))
    for i, batch in enumerate(loader):
        if i >= n_batches:
            break
        batch = tuple(t.to(device, non_blocking=True) for t in batch)
        for x, y, idx in split_chunks(batch, chunks):
            with autocast(device.type, precision):
                out = loss_fn(model, x, y, idx)
            optimizer.zero_grad(set_to_none=True)
            if scaler is None:
                out["loss"].backward()
                optimizer.step()
            else:  # skips the step when the scaled gradients overflowed
                scaler.scale(out["loss"]).backward()
                scaler.step(optimizer)
                scaler.update()
            loss_sum += out["loss"].detach()
            correct += out["correct"]
            total += out["total"]
            steps += 1
        if progress is not None:
            progress(i + 1, n_batches)
    train_loss = (loss_sum / max(steps, 1)).item()
    lr = optimizer.param_groups[0]["lr"]
    check(math.isfinite(train_loss), f"the training loss became {train_loss} at learning rate {lr:g} (this "
                                     f"epoch's, from --lr and the schedule): the run diverged; stopped before "
                                     f"saving, so the checkpoint of the last good epoch is kept")
    return {"train_loss": train_loss, "train_acc": (correct / max(total, 1)).item()}


def gaussian_loss(model, x, y, sigma, m):
    """Gaussian data augmentation (Cohen et al.): mean cross-entropy over m noisy copies, block order.

    x: (b, C, H, W), y: (b,). Returns the loss_fn dict of train_epoch.
    """
    noisy = (x.unsqueeze(0) + sigma * torch.randn(m, *x.shape, device=x.device, dtype=x.dtype)).flatten(0, 1)
    logits = model(noisy)
    targets = y.repeat(m)
    loss = F.cross_entropy(logits, targets)
    return {"loss": loss, "correct": (logits.argmax(1) == targets).sum(), "total": len(targets)}


@torch.no_grad()
def evaluate_noisy(model, loader, sigma, device, generator=None):
    """Loss and accuracy of the base classifier on one Gaussian-noised copy of each test input.

    generator: the noise's own torch.Generator on `device` (seed it from (seed, epoch)): then the noise
    depends neither on the loader's workers nor on what ran before, and a resumed run logs what an
    uninterrupted one logs."""
    model.eval()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device)
    total = 0
    for batch in loader:
        x, y = batch[0].to(device), batch[1].to(device)
        logits = model(x + sigma * torch.randn(x.shape, device=device, generator=generator))
        loss_sum += F.cross_entropy(logits, y, reduction="sum")
        correct += (logits.argmax(1) == y).sum()
        total += len(y)
    return {"test_loss": (loss_sum / total).item(), "test_acc_noisy": (correct / total).item()}


# ----------------------------------------------------------------------------------------------------------
# Per-example measurements of the training scripts: pA estimates (Alg. 2) and gradient norms (Table 2)
# ----------------------------------------------------------------------------------------------------------


def unwrap(model):
    """The plain model inside a DistributedDataParallel/DataParallel wrapper (attacks, evaluation, saving)."""
    return model.module if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) else model


@torch.no_grad()
def count_correct(model, dataset, indices, sigma, n, batch, workers=0):
    """For each example dataset[i], i in indices: how many of n noisy copies the model labels correctly.

    The training-time pA estimate of Alg. 2 (an empirical frequency of the TRUE label, not a bound): the
    model in eval mode (handed back as it came), the examples as `dataset` yields them (with its augmentation,
    as the official code), noise from the global generator. Returns int64 counts (len(indices),) and the
    labels, both on the CPU."""
    net = unwrap(model)
    device = next(net.parameters()).device
    subset = torch.utils.data.Subset(dataset, [int(i) for i in indices])
    per_batch = max(1, batch // n)  # examples per forward pass, each with (up to) batch noisy copies
    loader = torch.utils.data.DataLoader(subset, batch_size=per_batch, shuffle=False, num_workers=workers)
    counts, labels, num_classes = [], [], None
    with eval_mode(net):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            num_classes = num_classes or net(x[:1]).shape[1]
            votes = sample_counts(net, x, sigma, n, batch, num_classes)  # (B, K)
            counts.append(votes.gather(1, y.view(-1, 1)).squeeze(1).cpu())
            labels.append(y.cpu())
    return torch.cat(counts), torch.cat(labels)


def per_example_grad_norms(model, loss_fn, x, y, idx=None):
    """l2 norm of the gradient of each example's own training loss w.r.t. the model parameters (Table 2).

    loss_fn(model, x, y, idx) -> {'loss', ...}: any train_epoch loss, called on one example at a time (its
    noise copies and attacks happen inside). The model is in eval mode, so BatchNorm uses its running
    statistics and an example's gradient does not depend on the rest of its batch. x: (B, C, H, W);
    y, idx: (B,). Returns a float64 tensor (B,) on CPU; the parameters' .grad fields are not touched.
    """
    net = unwrap(model)
    was_training = net.training
    net.eval()
    params = [p for p in net.parameters() if p.requires_grad]
    norms = []
    try:
        for i in range(len(x)):
            out = loss_fn(net, x[i:i + 1], y[i:i + 1], None if idx is None else idx[i:i + 1])
            grads = torch.autograd.grad(out["loss"], params, allow_unused=True)
            norms.append(torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)).item())
    finally:
        net.train(was_training)
    return torch.tensor(norms, dtype=torch.float64)



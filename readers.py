"""The readers: one per file format the project reads (certification logs, their sidecars, training logs, pA
estimates, gradient norms, ECDFs, checkpoints), each checking its whole contract: a bad file is one UserError
that names the file, the line and the field, never a traceback; a checkpoint never runs code. Every script reads
through these."""
import hashlib
import io
import json
import math
import os
import re
import sys

import numpy as np
import torch
from scipy.special import ndtri

import common


COHEN_COLUMNS = ("idx", "label", "predict", "radius", "correct", "time")   # certification log (Cohen et al.)
GRADNORM_COLUMNS = ("idx", "label", "pA", "grad_norm")                      # --gradnorm measurements
PA_COLUMNS = ("idx", "label", "count", "n")                                 # train_ours.py's pA estimates
TRAIN_LOG_COLUMNS = ("epoch", "time", "lr", "train_loss", "train_acc", "test_loss", "test_acc_noisy", "kept")


def read_table(path, required, numeric):
    """Read a tab-separated file with a header into {column: list of str, or np.array for `numeric` ones}.

    `required` columns must be in the header. A line with the wrong number of fields or a non-numeric value
    in a numeric column is a common.UserError naming the file and line. Blank lines are skipped; '_line' holds the
    line number of every row (the header is line 1).
    """
    lines = read_lines(path)
    common.check(lines and lines[0].strip(), f"{path}: empty file (expected a header {' '.join(required)})")
    sep = "\t" if "\t" in lines[0] else None                  # Cohen's logs are tab-separated
    header = [h.strip() for h in lines[0].split(sep)]
    twice = sorted({h for h in header if header.count(h) > 1})
    common.check(not twice, f"{path}: column {' '.join(twice)} appears more than once in the header; keep one")
    missing = [c for c in required if c not in header]
    common.check(not missing, f"{path}: not the expected format: header lacks {' '.join(missing)} "
                              f"(expected columns {' '.join(required)})")
    cols, numbers = {h: [] for h in header}, []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        cells = line.split(sep)
        common.check(len(cells) == len(header), f"{path} line {number}: {len(cells)} fields, the header has "
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
    common.check(not os.path.isdir(path), f"{path}: is a folder; name a file")
    common.check(os.path.exists(path), f"{path}: file not found")
    common.check(os.path.isfile(path), f"{path}: not a regular file (a FIFO, device or socket)")


def read_lines(path):
    """The lines of a text file; a missing, special or unreadable one is a UserError."""
    check_regular(path)
    try:
        with open(path, encoding="utf-8-sig", errors="replace") as f:   # a byte-order mark is not a column
            return f.read().splitlines()
    except OSError as e:
        raise common.UserError(f"{path}: cannot read ({e.strerror})") from None


def read_bytes(path):
    """The bytes of a file (a dataset's image, copied as it is); a missing, special or unreadable one is a UserError."""
    check_regular(path)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise common.UserError(f"{path}: cannot read ({e.strerror})") from None


# A number as the project writes them: ASCII digits, optional sign, point and exponent, or inf / nan. Python's
# float() also takes underscores ("0_5" is 5.0) and other scripts' digits; a reader must not.
NUMBER = re.compile(r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|(?i:inf|infinity|nan))")


def to_numbers(path, column, cells, line_numbers):
    """Column cells as a float array; the first cell that is not a number (NUMBER) is a common.UserError with its line."""
    for number, cell in zip(line_numbers, cells):
        if not NUMBER.fullmatch(cell):
            raise common.UserError(f"{path} line {number}: {column} {cell!r} is not a number")
    return np.array(cells, dtype=float)


def read_certification_log(path):
    """A Cohen-format certification log: {'radius', 'correct'} arrays, plus 'nA', 'N' and 'nY' (the true
    label's votes, certify.py since it records them) when present.

    Contract: a header with Cohen's columns idx label predict radius correct time (tab- or space-separated),
    one line per example, idx unique; idx, label integers >= 0; predict an integer (-1: abstain, with correct 0
    and radius 0); radius a finite number >= 0; correct 1 only where predict is the label; correct 0 or 1; optional nA, N, nY counts with 0 <= nA, nY <= N, N >= 1; optional sigma > 0
    (ddrs.py); a `stop` column marks a grid log (certify.py --radii), whose radius is a grid level, not a
    radius to average (it has no ACR)."""
    header = (read_lines(path) or [""])[0].split()
    common.check(not ("radius" not in header and {"idx", "predict", "correct"} <= set(header)),
          f"{path}: a PREDICT log (no radius column); this needs a CERTIFY log (certify.py without --predict)")
    cols = read_table(path, COHEN_COLUMNS, ("idx", "label", "predict", "radius", "correct", "nA", "N", "nY",
                                              "sigma"))
    common.check(len(cols["radius"]) > 0, f"{path}: no examples (only a header)")
    for name in ("idx", "label"):
        check_rows(cols, path, (cols[name] >= 0) & (cols[name] == np.round(cols[name])) & (cols[name] < 2 ** 53),
                   f"{name} must be an integer >= 0")
    seen = {}
    for idx, line in zip(cols["idx"].astype(np.int64).tolist(), cols["_line"]):   # two writers, or logs pasted
        common.check(idx not in seen, f"{path} line {line}: idx {idx} again (first on line {seen.get(idx)}); "
                                      f"each example must appear once: remove the duplicate rows")
        seen[idx] = line
    check_rows(cols, path, (cols["predict"] == np.round(cols["predict"])) & (cols["predict"] >= -1) &
               (cols["predict"] < 2 ** 53), "predict must be a class (an integer >= 0) or -1 (abstain)")
    check_rows(cols, path, np.isin(cols["correct"], (0, 1)), "correct must be 0 or 1")
    check_rows(cols, path, np.isfinite(cols["radius"]) & (cols["radius"] >= 0), "radius must be a finite number >= 0")
    check_rows(cols, path, (cols["correct"] == 0) | (cols["predict"] == cols["label"]),
               "correct is 1 but predict is not the label")
    check_rows(cols, path, (cols["predict"] != -1) | ((cols["correct"] == 0) & (cols["radius"] == 0)),
               "an abstention (predict -1) has correct 0 and radius 0")
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
        common.check("N" in log, f"{path}: has an nA column but no N column")
        check_rows(cols, path, (log["nA"] <= log["N"]) & (log["N"] >= 1), "need 0 <= nA <= N and N >= 1")
    if "N" in log:
        check_rows(cols, path, log["N"] >= 1, "N must be >= 1 (the draws a row made)")
    if "nY" in log:
        common.check("N" in log, f"{path}: has an nY column but no N column")
        check_rows(cols, path, log["nY"] <= log["N"], "need 0 <= nY <= N")
    return log


def check_rows(cols, path, ok, what):
    """UserError naming the line of the first row where `ok` (a boolean array over rows) is False."""
    bad = np.flatnonzero(~ok)
    common.check(len(bad) == 0, f"{path} line {cols['_line'][bad[0]] if len(bad) else 0}: {what}")


# The kinds of certification log the scripts write; each analysis says which it handles (REFUSED below,
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


SPLIT_KINDS = ("test split", "train split")   # the split its settings file records, where it records one


def check_log_kinds(log, sidecar, refused, command):
    """A common.UserError in one line if the log is of a kind (LOG_KINDS, or SPLIT_KINDS) that `command` refuses
    (refused: {kind: why}), or if a row claims more than its own counts allow (check_radii)."""
    split = [f"{sidecar['split']} split"] if sidecar.get("split") in ("test", "train") else []
    for kind in log_kinds(log, sidecar) + split:
        common.check(kind not in refused, f"{log['path']}: a {kind} log, which {command} does not take: {refused.get(kind)}")
    check_radii(log, sidecar)


def check_radii(log, sidecar):
    """Refuse (common.UserError, one line) a CERTIFY log row whose radius exceeds sigma Phi^-1(CP_lower(nA, N, alpha)),
    the most its own counts allow, where the log carries nA and N and its settings file sigma and alpha (a
    radius edited by hand, or a log paired with another run's settings). The TSV's 6 significant digits are
    allowed for; grid, DDRS and semi-elastic logs bound their radii otherwise and are not checked here."""
    sigma, alpha = sidecar.get("sigma"), sidecar.get("alpha")
    if "nA" not in log or "N" not in log or not (common._is_number(sigma) and common._is_number(alpha)) or \
            set(log_kinds(log, sidecar)) & {"grid", "grid without r = 0", "PREDICT", "DDRS", "semi-elastic"}:
        return
    with np.errstate(invalid="ignore", divide="ignore"):
        bound = np.maximum(sigma * ndtri(common.clopper_pearson_lower(log["nA"], log["N"], alpha)), 0.0)
    bad = np.flatnonzero(log["radius"] > bound * (1 + 1e-5) + 1e-6)
    if len(bad):
        i = bad[0]
        raise common.UserError(f"{log['path']}: the row of idx {int(log['idx'][i])} has radius {log['radius'][i]:g}, more "
                        f"than its nA {int(log['nA'][i])} of N {int(log['N'][i])} allow at sigma {sigma:g}, alpha "
                        f"{alpha:g} ({bound[i]:.6g}); {len(bad)} such row(s): edited by hand, or another run's log")


# What a row of a certification log means besides its model: logs whose rows are set side by side (a comparison,
# a table, a ranking) must agree on these, or a difference between two rows may be one of setting, not of model.
# A setting a log does not record (a log without settings file: its dataset, split and alpha, and its N unless
# it has an N column) is taken to be the others'. sigma is not here: every analysis groups its logs by sigma.
# data: the fingerprint of the images certified; budget: N, alpha and N0 (whose selection draws decide abstentions).
SETTINGS = {"dataset": ("dataset",), "split": ("split",), "data": ("data",), "budget": ("N", "alpha", "N0"),
            "mode": ("mode",)}
# Compared and named in the reports, never refused: --sound certifies the same smoothed classifier with a sampler
# floating point cannot fool, and --precision is part of the model compared (a bf16 certificate is the bf16
# classifier's).
NOTED = {"sampler": ("sound", "precision")}
IMAGES = "images"   # check_comparable's check of the idx sets (--allow-different images)
# Never refused, always said (check_comparable): one model under two names (its checkpoint's hash), and the
# settings a log does not record (no settings file: taken as the others').
ONE_MODEL, UNRECORDED = "one model", "unrecorded"
NOTES = (ONE_MODEL, UNRECORDED)
COMPARED = (*SETTINGS, IMAGES)   # what --allow-different names


def check_sidecar_fits(log, sidecar):
    """Refuse (common.UserError) a settings file that does not describe the log beside it: other columns than the
    log's header, or an N that its rows contradict (a CERTIFY row draws N; one stopped early, or a grid row, at
    most N): a settings file copied from another log."""
    columns = sidecar.get("columns")
    if columns is not None:
        header = read_header(log["path"]).split("\t")
        common.check(header == columns, f"{log['path']}: its settings file lists the columns {' '.join(columns)}, "
                                        f"the log has {' '.join(header)}: the settings file of another log")
    N = sidecar.get("N")
    if N is None or "N" not in log:
        return
    exact = sidecar.get("mode") == "certify" and not sidecar.get("early_abstain") and not log.get("grid")
    bad = np.flatnonzero(log["N"] != N if exact else log["N"] > N)
    common.check(len(bad) == 0, f"{log['path']}: the row of idx {int(log['idx'][bad[0]]) if len(bad) else 0} has N "
                                f"{int(log['N'][bad[0]]) if len(bad) else 0}, its settings file N {N}: the settings "
                                f"file of another log")


def log_setting(log, sidecar):
    """{field: value, None where unknown} of SETTINGS' fields for a log (read_certification_log) and its settings
    file (read_sidecar: {} for a log from elsewhere; check_sidecar_fits first). N: the settings file's (a grid
    log's N_max), else the largest of an N column (rows stopped early have less) of a log that is not a grid log
    (whose N column holds the draws each row made). mode: what a row certifies: CERTIFY (a grid log's levels
    are certificates of the same prediction), PREDICT, label mode (the true label, no selection), DDRS or
    semi-elastic (a sigma per input)."""
    check_sidecar_fits(log, sidecar)
    N = sidecar.get("N")
    if N is None and "N" in log and not log.get("grid"):
        N = int(log["N"].max())
    mode = [kind for kind in log_kinds(log, sidecar) if kind not in ("CERTIFY", "grid", "grid without r = 0")]
    return {"dataset": sidecar.get("dataset"), "split": sidecar.get("split"), "data": sidecar.get("data"), "N": N,
            "alpha": sidecar.get("alpha"), "N0": sidecar.get("N0"), "mode": " + ".join(mode) or "CERTIFY",
            "sound": sidecar.get("sound"), "precision": sidecar.get("precision")}


def short_names(paths):
    """{path: its file name, or folder/name where two share a name (the published logs do)}, for a report's line."""
    names = [os.path.basename(p) for p in paths]
    return {p: os.path.join(*os.path.normpath(p).split(os.sep)[-2:]) if names.count(n) > 1 else n
            for p, n in zip(paths, names)}


def judged(log):
    """Whether check_comparable and the kinds' check judge a file: a certification log, or an ECDF curve whose
    settings file (analyze.py ecdf's) names the log it came from; a published curve or a pA estimate file has none."""
    return "radius" in log or (log.get("sidecar") or {}).get("kind") == "ecdf"


def check_comparable(logs, allow=(), command="this analysis", assumed=None):
    """Refuse (common.UserError, one line naming the setting and two logs) logs to be set side by side whose
    SETTINGS differ, or that certify other images (idx sets: IMAGES), except those in `allow` (names of COMPARED,
    the flag --allow-different's, or of SETTINGS' fields where a command compares across one by design, e.g. N).
    Logs are read_certification_log's, each with its settings file as 'sidecar' where it has one; other files
    (ECDFs, pA estimates) are passed over. assumed: {field: value} a log that does not record the field is read
    with (a command's --N, --alpha for such logs). Returns (setting, what differs) for each allowed difference
    and each NOTED one, e.g. ('budget', 'N: 500 (a.tsv), 1000 (b.tsv)'), and the NOTES, for the report to say
    above its table."""
    if isinstance(allow, str) or not all(isinstance(a, str) for a in allow):
        raise TypeError(f"allow must be a list of names of SETTINGS (got {allow!r})")
    wrong = sorted(set(allow) - set(COMPARED) - {field for fields in SETTINGS.values() for field in fields})
    common.check(not wrong, f"allow: {', '.join(wrong)} is not a setting; the settings are {', '.join(COMPARED)}")
    known = lambda log: {field: value if value is not None else (assumed or {}).get(field)   # noqa: E731
                         for field, value in log_setting(log, log.get("sidecar") or {}).items()}
    settings = [(log["path"], known(log)) for log in logs if judged(log)]
    short = short_names([path for path, _ in settings])
    differs = []
    for group, fields in {**SETTINGS, **NOTED}.items():
        for field in fields:
            seen = {}   # value -> the first log that records it
            for path, setting in settings:
                if setting[field] is not None:
                    seen.setdefault(setting[field], path)
            if len(seen) < 2:
                continue
            (first, where), (other, path) = list(seen.items())[:2]
            common.check(group in allow or field in allow or group in NOTED,
                         f"{path}: {field} {other}, but {where} has {field} {first}"
                         f"{' (certified on other images)' if field == 'data' else ''}: a row does not mean the same in "
                         f"both, so {command} does not set them side by side (analyze.py's --allow-different {group} "
                         f"does, docs/analysis.md)")
            values = ", ".join(f"{value} ({short[p]})" for value, p in seen.items())
            differs.append((group, f"{field}: {values}"))
    images = {}   # idx set -> the first log that certifies it
    for log in logs:
        if "radius" in log:
            images.setdefault(frozenset(log["idx"].tolist()), log["path"])
    if len(images) > 1:
        (first, where), (other, path) = list(images.items())[:2]
        common.check(IMAGES in allow, f"{path}: certifies {len(other)} images, {len(other & first)} of them among the "
                                      f"{len(first)} of {where}: its rows are about other inputs, so {command} does "
                                      f"not set them side by side (analyze.py's --allow-different images does)")
        differs.append((IMAGES, "idx sets: " + ", ".join(f"{len(s)} images ({short[p]})"
                                                         for s, p in images.items())))
    models = {}   # checkpoint hash -> the logs of that model
    for log in logs:
        sha = (log.get("sidecar") or {}).get("checkpoint_sha256")
        if judged(log) and isinstance(sha, str):
            models.setdefault(sha, []).append(short[log["path"]])
    differs += [(ONE_MODEL, f"{', '.join(names)} are one model (checkpoint {sha[:12]})")
                for sha, names in models.items() if len(names) > 1]
    for path, setting in settings:
        unknown = [f for fields in SETTINGS.values() for f in fields
                   if setting[f] is None and any(other[f] is not None for _, other in settings)]
        differs += [(UNRECORDED, f"{short[path]} records no {', '.join(unknown)} (taken as the other logs')")] * \
            bool(unknown)
    return differs


def check_same_run(paths, keys=("checkpoint_sha256", "data", "split")):
    """The logs at `paths` come from one model on one set of images: their sidecars name the same checkpoint
    hash, data fingerprint and split (ddrs.py report pairs a DDRS log with its fixed-sigma log this way). A log
    whose sidecar does not record them is refused: what it was made from cannot be checked."""
    sides = [read_sidecar(p) for p in paths]
    for path, side in zip(paths, sides):
        missing = [k for k in keys if side.get(k) is None]
        common.check(not missing, f"{path}: its settings file does not record {', '.join(missing)} (the run's "
                                  f"identity), so it cannot be paired with {paths[0]}; certify it with certify.py")
        for k in keys:
            common.check(side[k] == sides[0][k], f"{path}: another {k.replace('_sha256', '')} than {paths[0]} "
                                                 f"({str(side[k])[:16]} vs {str(sides[0][k])[:16]}): not the same "
                                                 f"model on the same images")


def check_distinct_models(logs, what):
    """Logs taken as the training seeds of one method at one sigma (what: where, for the message) are of distinct
    models: no two name the same checkpoint hash or the same training seed (log["train_seed"], else their
    settings files'). One model certified twice, with other noise or on other images, is not two seeds: its
    spread would be Monte Carlo noise passed off as the seeds'."""
    for key, name in (("checkpoint_sha256", "checkpoint"), ("train_seed", "training seed")):
        seen = {}
        for log in logs:
            value = log.get(key) if log.get(key) is not None else (log.get("sidecar") or {}).get(key)
            if value is None:
                continue
            common.check(value not in seen, f"{log['path']}: the same {name} as {seen.get(value)} "
                                            f"({str(value)[:16]}), both as seeds of {what}: one model certified twice "
                                            f"is not two training seeds; give each seed's own log once")
            seen[value] = log["path"]


# The sidecar's fields that readers use, with their contract (a field may be missing: a log from elsewhere).
SIDECAR_FIELDS = {
    "script": lambda v: isinstance(v, str),
    "mode": lambda v: v in ("certify", "predict", "grid", "label"),
    "dataset": lambda v: v in common.DATASETS, "split": lambda v: v in ("train", "test"),
    "sigma": lambda v: common._is_number(v) and 0 < v < math.inf,
    "N": lambda v: _is_int(v) and v >= 1, "N0": lambda v: v is None or (_is_int(v) and v >= 1),
    "alpha": lambda v: common._is_number(v) and 0 < v < 1, "seed": lambda v: _is_int(v) or v == "random",
    "sound": lambda v: isinstance(v, bool), "save_counts": lambda v: isinstance(v, bool),
    "checkpoint": lambda v: isinstance(v, str), "checkpoint_sha256": lambda v: isinstance(v, str),
    "radii": lambda v: v is None or (isinstance(v, list) and all(common._is_number(r) and r >= 0 for r in v)),
    "beta": lambda v: v is None or (common._is_number(v) and 0 <= v < 1),
    "columns": lambda v: isinstance(v, list) and all(isinstance(c, str) for c in v),
    "data": lambda v: v is None or isinstance(v, str),
    "candidate": lambda v: v in ("label", "selected"), "seed_value": lambda v: v is None or _is_int(v),
    "train_seed": lambda v: v is None or (_is_int(v) and v >= 0),
}


def settings_sha256(sidecar):
    """The sha256 of a sidecar's settings (all but "written", which records it), in a canonical JSON form."""
    settings = {k: v for k, v in sidecar.items() if k != "written"}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def read_json_object(path, what):
    """A JSON file holding an object (dict); anything else is a common.UserError naming the file and `what` it is."""
    common.check(not os.path.isdir(path), f"{path}: is a folder, not the {what}")
    check_regular(path)
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:   # RecursionError: nested too deep
        raise common.UserError(f"{path}: cannot read the {what} ({type(e).__name__}); it must be JSON") from None
    common.check(isinstance(obj, dict), f"{path}: the {what} must be a JSON object, not {type(obj).__name__}")
    return obj


def read_sidecar(path, required=()):
    """The settings certify.py writes beside a log (`<log>.json`, or `<stem>.json`); {} when there is none.

    Contract: a JSON object; each field of SIDECAR_FIELDS that is present has its type and range; the fields
    in `required` are present. A violation is a common.UserError naming the file and the field."""
    for candidate in (path + ".json", os.path.splitext(path)[0] + ".json"):
        if os.path.isfile(candidate):
            settings = read_json_object(candidate, "settings file of a log")
            for key, ok in SIDECAR_FIELDS.items():
                if key in settings and not ok(settings[key]):
                    raise common.UserError(f"{candidate}: field {key!r} has an invalid value {settings[key]!r}")
            missing = [k for k in required if k not in settings]
            common.check(not missing, f"{candidate}: lacks the field(s) {', '.join(missing)}")
            written = settings.get("written") if isinstance(settings.get("written"), dict) else {}
            own = next((v for k, v in written.items() if isinstance(v, str) and k.endswith(".json")), None)
            common.check(own in (None, settings_sha256(settings)), f"{candidate}: changed since the run wrote it (its "
                                                                   f"record of its own settings differs): restore it, "
                                                                   f"or certify again")
            name = next((k[:-len(".json")] for k, v in written.items() if isinstance(v, str)), os.path.basename(path))
            common.check(begins_as_recorded(path, written.get(name)),   # the log under the name it was written
                         f"{path}: changed since {settings.get('script', 'the run')} wrote it, or not the log "
                         f"{candidate} describes (it does not begin with the bytes the run recorded); certify again, "
                         f"or move {candidate} away")
            return settings
    common.check(not required, f"{path}: its settings file {path}.json is missing (it names {', '.join(required)})")
    return {}


def begins_as_recorded(path, entry):
    """A file begins with what its run recorded of it ({size, sha256}: the run's lines up to then, which it only
    appends to); True without a record or a file to check."""
    if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and os.path.isfile(path)):
        return True
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(entry["size"])).hexdigest() == entry.get("sha256")


def read_log_prefix(path, columns, restart="pass --overwrite to start again, or choose another output"):
    """Our own log being resumed (certify.py): its complete data lines and the byte length of that valid prefix.

    A last line without its newline or with the wrong field count is torn (cut off by a kill): it is left out.
    A file without any complete line counts as empty. A wrong header or a malformed earlier line is a common.UserError
    that ends with `restart`, the way out with the reading command's own flags.
    """
    check_regular(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise common.UserError(f"cannot read {path!r} ({type(e).__name__}); {restart}") from None
    # byte offsets below are those of the text: a file with CR LF line ends (edited on Windows) is refused
    common.check(b"\r" not in data, f"{path!r} has Windows line endings (CR LF); convert it back (dos2unix) to "
                             f"resume, or {restart}")
    lines = text.split("\n")[:-1]  # the piece after the last newline is torn (or empty)
    if not lines:
        return [], 0
    common.check(lines[0] == "\t".join(columns),
          f"{path!r} has header {lines[0][:60]!r}, not {' '.join(columns)!r} (another format or setting); "
          f"{restart}")
    rows = lines[1:]
    if rows and len(rows[-1].split("\t")) != len(columns):
        rows = rows[:-1]
    seen = set()
    for k, row in enumerate(rows):
        cells = row.split("\t")
        common.check(len(cells) == len(columns) and cells[0].isascii() and cells[0].isdigit(),
              f"{path!r} line {k + 2} is malformed; repair it, or {restart}")
        common.check(cells[0] not in seen, f"{path!r} line {k + 2}: idx {cells[0]} again (each example once); remove "
                                           f"the duplicate, or {restart}")
        seen.add(cells[0])
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
    common.check("run" not in args or isinstance(args["run"], dict), f"{path}: field 'run' must be an object")
    return args


NO_NY = "it records no nY (the true label's votes); certify.py --split train without --radii writes it"


def read_train_pA(path):
    """Training-set pA: train_ours.py's estimates (`idx label count n`: count / n) or a certification log of
    the train split with the true label's votes (nY / N)."""
    lines = read_lines(path)
    if lines and lines[0].split("\t")[:4] == ["idx", "label", "count", "n"]:
        cols = read_table(path, ("idx", "label", "count", "n"), ("count", "n"))
        common.check(len(cols["n"]) > 0, f"{path}: no examples (only a header)")
        check_rows(cols, path, (cols["n"] >= 1) & (cols["count"] >= 0) & (cols["count"] <= cols["n"]),
                   "need 0 <= count <= n and n >= 1")
        return {"path": path, "pA_all": cols["count"] / cols["n"], "source": "count/n"}
    log = read_certification_log(path)
    common.check("nY" in log, f"{path}: neither train_ours.py's pA estimates (idx label count n) nor a "
                       f"certification log with an nY column: {NO_NY}")
    return dict(log, pA_all=log["nY"] / log["N"], source="nY/N")


def read_gradient_norms(path):
    """A gradient-norm TSV of the training scripts' --gradnorm mode: {'pA', 'grad_norm'} arrays."""
    cols = read_table(path, GRADNORM_COLUMNS, ("idx", "pA", "grad_norm"))
    common.check(len(cols["pA"]) > 0, f"{path}: no examples (only a header)")
    check_rows(cols, path, (cols["pA"] >= 0) & (cols["pA"] <= 1) & (cols["grad_norm"] >= 0) &
               np.isfinite(cols["grad_norm"]) & (cols["idx"] >= 0) & (cols["idx"] == np.round(cols["idx"])),
               "need 0 <= pA <= 1, grad_norm >= 0 finite and idx an integer >= 0")
    common.check(len(np.unique(cols["idx"])) == len(cols["idx"]), f"{path}: an idx appears twice (one row a probe)")
    return {"path": path, "idx": cols["idx"].astype(np.int64), "pA": cols["pA"], "grad_norm": cols["grad_norm"]}


LOG_TIME_CELL = re.compile(r"(?:(\d+) days?, )?(\d+):([0-5]\d):([0-5]\d(?:\.\d+)?)")


def log_seconds(cell, where="time"):
    """Seconds of a certification log's time cell: str of a datetime.timedelta ('H:MM:SS.ffffff' or
    'D day(s), H:MM:SS.ffffff', as certify.py and Cohen et al.'s code write it) or plain seconds; anything
    else is a common.UserError naming `where`."""
    match = LOG_TIME_CELL.fullmatch(cell.strip())
    if match:
        days, hours, minutes, secs = match.groups()
        return int(days or 0) * 86400 + int(hours) * 3600 + int(minutes) * 60 + float(secs)
    try:
        seconds = float(cell)
    except ValueError:
        seconds = float("nan")
    common.check(math.isfinite(seconds) and seconds >= 0, f"{where}: time {cell!r} is neither H:MM:SS nor seconds")
    return seconds


def read_ecdf_or_log(path):
    """budget accepts certification logs and tabulated ECDFs (`x y`, p increasing in [0, 1])."""
    lines = read_lines(path)
    if not lines or lines[0].split()[:2] != ["x", "y"]:
        return read_certification_log(path)
    cols = read_table(path, ("x", "y"), ("x", "y"))
    x, y = cols["x"], cols["y"]
    common.check(len(x) > 0, f"{path}: no points (only a header)")
    common.check(np.all(np.diff(x) > 0) and x[0] >= 0 and x[-1] <= 1 and np.all((y >= 0) & (y <= 1)),
                 f"{path}: an ECDF needs x increasing in [0, 1] and y in [0, 1]")
    return {"path": path, "grid_p": x, "grid_y": y}


# ----------------------------------------------------------------------------------------------------------
# Logs for an analysis: label and sigma from the path, each log checked against what the analysis refuses
# ----------------------------------------------------------------------------------------------------------

SIGMA_PATTERNS = (r"(?:noise|sigma)[_=-]?(\d+(?:\.\d+)?)",    # noise_0.25, sigma0.5, sigma=1.0
                  r"_(\d+\.\d+)(?=\.(?:csv|tsv)$)")          # catrs_0.25.csv (the published ECDF files)
GENERIC_STEMS = ("", "noise", "sigma", "certify", "log", "results")
SPLITS = ("test", "train", "val", "valid", "validation")   # Cohen's layout: <model>/noise_<s>/<split>/sigma_<s>


def sigma_from_path(path):
    """sigma written in the file name, else in its folders (innermost first); None if nowhere."""
    parts = os.path.normpath(path).split(os.sep)[::-1]
    for part in parts:
        for pattern in SIGMA_PATTERNS:
            m = re.search(pattern, part)
            if m:
                return float(m.group(1))
    return None


def strip_sigma(name):
    """A file or folder name without its sigma part and extension: noise_0.25.tsv -> '', ours_sigma0.5 -> ours."""
    for pattern in SIGMA_PATTERNS:
        name = re.sub(pattern, "", name)
    return re.sub(r"\.(tsv|csv|txt)$", "", name).strip("_-. ")


def label_from_path(path):
    """The file name without sigma, else the first telling folder above it.

    The recognised layouts: the paper's certify/cifar10/ours/noise_0.5.tsv -> ours; the CAT-RS repository's
    cifar10/noise_0.5/catrs/noise_0.5.tsv -> catrs; ours runs/certify/train_ours_cifar10_sigma0.5.tsv ->
    train_ours_cifar10 (our own output files lose their prefix: ecdf_ours_0.5.tsv -> ours); Cohen et al.'s
    <model>/noise_<training sigma>/<split>/sigma_<certification sigma> -> <model>/noise_<training sigma>
    (split folders are skipped, and a training-noise folder keeps its model folder in the label)."""
    stem = re.sub(r"\.(tsv|csv|txt)$", "", os.path.basename(path))
    label = re.sub(r"^(ecdf|gradnorm)_", "", strip_sigma(os.path.basename(path)))
    if label.lower() not in GENERIC_STEMS:
        return label
    folders = os.path.dirname(os.path.abspath(path)).split(os.sep)[::-1]   # innermost first
    for i, folder in enumerate(folders):
        if folder.lower() in SPLITS:
            continue
        if sigma_from_path(folder) is not None and strip_sigma(folder).lower() in GENERIC_STEMS:
            above = next((f for f in folders[i + 1:] if strip_sigma(f).lower() not in GENERIC_STEMS), "")
            return f"{above}/{folder}" if above else folder      # the training noise, with its model
        return strip_sigma(folder) or folder
    return stem


def shown(text):
    """A label as tables and figures can show it: bytes of a file name that are not UTF-8 as \\xff; a tab, line
    break or '|', which would break a table, refused (common.check_cell)."""
    return common.check_cell(os.fsencode(text).decode("utf-8", "backslashreplace"), "the label")


def per_log(values, logs, flag):
    """A --labels/--sigmas list must give one value per log."""
    common.check(values is None or len(values) == len(logs),
                 f"{flag} got {len(values or [])} values for {len(logs)} logs; give one per log")
    return values or [None] * len(logs)


# What each analysis does with each kind of certification log (LOG_KINDS): the kinds listed here are
# refused, in one line, before anything is written; every other kind is handled, and the reports say how
# (a grid log has no ACR and its accuracy is exact at its levels; label mode, DDRS and semi-elastic logs are
# named with what their radii certify). A PREDICT log has no radius: the reader refuses it for every analysis.
NO_PA = "its nA / N is biased by the adaptive stopping, so it estimates no pA; certify without --radii"
PER_INPUT_SIGMA = "each input was certified at its own sigma, and the conversion assumes one sigma per log"
NO_VOTES = "its radii do not follow from the votes of one sigma; compare it with --over images"
PREDICT_REFUSED = {"PREDICT": "it has no radius; certify without --predict"}
REFUSED = {
    "table": PREDICT_REFUSED, "envelope": PREDICT_REFUSED, "ablation": PREDICT_REFUSED, "paper": PREDICT_REFUSED,
    "compare": PREDICT_REFUSED,
    "compare --over test-set": {**PREDICT_REFUSED, "grid": "it records no vote counts to redraw; compare it with "
                                                          "--over images",
                                "grid without r = 0": "it records no vote counts to redraw; compare it with "
                                                      "--over images",
                                "DDRS": NO_VOTES, "semi-elastic": NO_VOTES},
    "ecdf": {**PREDICT_REFUSED, "grid": NO_PA, "grid without r = 0": NO_PA},
    "budget": {**PREDICT_REFUSED, "grid": NO_PA, "grid without r = 0": NO_PA, "DDRS": PER_INPUT_SIGMA,
               "semi-elastic": PER_INPUT_SIGMA},
    "trainpa": {**PREDICT_REFUSED, "grid": NO_NY, "grid without r = 0": NO_NY,   # its reader says so
                "test split": "trainpa measures the training set; certify with certify.py --split train"},
    "gradnorm --acr": {**PREDICT_REFUSED,   # a grid log's ACR shows as n/a
                       "train split": "Table 2's ACR is the test set's; certify with certify.py --split test"},
}


# Settings an analysis sets side by side by design (check_comparable): budget converts each log from its
# own budget to the one asked for; compare pairs the images the logs share; paper takes the published logs as
# they are (one of them covers 427 of the 500 ImageNet images), and says so.
BY_DESIGN = {"budget": ("budget",), "compare": (IMAGES,), "compare --over test-set": (IMAGES,), "paper": (IMAGES,)}


def load_logs(paths, labels=None, sigmas=None, reader=read_certification_log, command=None, allow=(), assumed=None):
    """Read every log first (bad input fails before anything is written); attach label, sigma and sidecar.
    command: the analysis (a key of REFUSED), whose refused kinds of certification log stop it here, and which
    sets these logs side by side: settings that differ between them (check_comparable) stop it too,
    except those in `allow` (--allow-different) and BY_DESIGN's, which a note on stderr names. assumed: the
    budget the command gives logs that record none ({"N": --N, "alpha": --alpha}), checked as theirs."""
    common.check_type("paths", paths, list, tuple)   # a bare string would be read as one log per character
    labels, sigmas = per_log(labels, paths, "--labels"), per_log(sigmas, paths, "--sigmas")
    logs = []
    for path, label, sigma in zip(paths, labels, sigmas):
        log = reader(path)
        log["sidecar"] = read_sidecar(path)
        if command is not None and judged(log):   # a certification log, or a curve analyze.py ecdf made from one
            check_log_kinds(log, log["sidecar"], REFUSED[command], f"analyze.py {command}")
        log["label"] = shown(label or label_from_path(path))
        own, guessed = log["sidecar"].get("sigma"), sigma_from_path(path)
        if sigma is None and isinstance(own, (int, float)) and guessed is not None and float(own) != guessed:
            print(f"note: {path}: sigma {own} from its settings file {path}.json, not {guessed} as its path "
                  f"suggests (certified at another sigma than the model was trained with?)", file=sys.stderr)
        common.check(sigma is None or own is None or float(sigma) == float(own),
                     f"{path}: --sigmas gives {sigma}, but its settings file records sigma {own} (the sigma it was "
                     f"certified at, which its radii are in units of); drop --sigmas or give {own}")
        if sigma is None:   # what certify.py recorded wins over a guess from the path
            sigma = own if own is not None else guessed
        common.check(sigma is None or (common._is_number(sigma) and sigma > 0),
                     f"{path}: sigma must be a finite number > 0 (got {sigma!r})")
        log["sigma"] = None if sigma is None else float(sigma)
        logs.append(log)
    if command is not None:
        differs = [(setting, line) for setting, line in check_comparable(
            logs, set(allow) | set(BY_DESIGN.get(command, ())), f"analyze.py {command}", assumed)
                   if setting in allow or setting in (IMAGES, *NOTED, *NOTES)]
        for setting, line in differs:
            print("note: " + (line if setting in NOTES else f"the logs differ in {line}" + (
                f" (--allow-different {setting}): each row is about its model and that setting together" if setting in
                allow else ": each row is about its own images" if setting == IMAGES else ": each row is about its "
                "model certified so")), file=sys.stderr)
        for log in logs:   # the reports say it above their tables (differs_line)
            log["differs"] = differs
    return logs


def differs_line(logs):
    """The line a report puts above its table when its logs differ in a setting load_logs let through, else ''."""
    differs = next((log["differs"] for log in logs if log.get("differs")), [])
    other, notes = [line for s, line in differs if s not in NOTES], [line for s, line in differs if s in NOTES]
    return ("Not the same setting: " + "; ".join(other) + ". Each row is about its model and its own setting.\n\n") * \
        bool(other) + ("Note: " + "; ".join(notes) + ".\n\n") * bool(notes)


# ====== Checkpoints: torch files read without running code, checked against their contract

_LOADED_SHA256 = {}   # path as given -> sha256 of the bytes safe_load last read through it in this process


def loaded_sha256(path):
    """The sha256 of the bytes safe_load last read from `path` in this process (None if none): the identity a
    record gives the model it used, from those very bytes, never from reading the path again (a training run
    may replace the file in between)."""
    return _LOADED_SHA256.get(path)


def safe_load(path, device="cpu", trust=False, what="checkpoint"):
    """torch.load that cannot run code from the file: its pickle is read with weights_only=True, which allows
    tensors and plain Python values (every checkpoint released with Cohen et al., SmoothAdv, Consistency,
    SmoothMix, CAT-RS and the paper, and ours). A file that names a class or a function is a UserError naming
    what it asks for and --trust-checkpoint; trust=True loads anything (weights_only=False): only for files from
    a trusted source. The file is read once; its bytes are loaded and hashed (loaded_sha256)."""
    common.check(not os.path.isdir(path), f"{what} {path!r} is a folder, not a file")
    common.check(os.path.isfile(path), f"{what} {path!r} not found")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise common.UserError(f"cannot read {what} {path!r} ({e.strerror or type(e).__name__})") from None
    _LOADED_SHA256[path] = hashlib.sha256(data).hexdigest()
    try:
        return torch.load(io.BytesIO(data), map_location=device, weights_only=not trust)
    except Exception as e:
        # torch.save writes a zip archive, older torch a pickle (protocol 2 and up): other bytes are no torch file
        if trust or "Weights only load failed" not in str(e) or not data.startswith((b"PK\x03\x04", b"\x80")):
            raise common.UserError(f"cannot read {what} {path!r} ({type(e).__name__}): not a torch file") from None
    try:
        names = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))) or "objects"
    except Exception:
        names = "objects"
    raise common.UserError(f"{what} {path!r} needs arbitrary unpickling ({names}), which can run any code it holds; "
                           f"pass --trust-checkpoint only if you trust where the file came from")


def read_torch_dict(path, what, fields, trust=False, required=True):
    """A torch file holding a dict (safe_load) whose `fields` ({name: check(value) -> bool}) pass their checks:
    all present (required) or those present; anything else is a UserError naming the file and the first bad
    field."""
    saved = safe_load(path, trust=trust, what=what)
    common.check(isinstance(saved, dict), f"{what} {path!r} must hold a dict, not {type(saved).__name__}")
    for name, ok in fields.items():
        common.check(name in saved or not required, f"{what} {path!r} lacks the field {name!r}")
        common.check(name not in saved or ok(saved[name]), f"{what} {path!r}: field {name!r} has an invalid value "
                                                           f"({type(saved.get(name)).__name__})")
    return saved


def is_tensor_dict(value):
    return isinstance(value, dict) and all(torch.is_tensor(v) for v in value.values())


# The fields of a checkpoint: Cohen's {'arch', 'state_dict'}, and those ours add, each checked when present.
CHECKPOINT_FIELDS = {"state_dict": is_tensor_dict, "arch": lambda v: isinstance(v, str),
                     "dataset": lambda v: v is None or v in common.DATASETS,
                     "sigma": lambda v: v is None or (common._is_number(v) and 0 < v < math.inf),
                     "epoch": lambda v: _is_int(v) and v >= 0,
                     **{k: lambda v: v is None or isinstance(v, dict) for k in ("args", "extra", "optimizer",
                                                                                 "scheduler", "rng")}}


def load_checkpoint(path, device="cpu", trust=False):
    """A checkpoint dict ({'arch', 'state_dict', ...}, or a bare state_dict) read with safe_load and checked
    against CHECKPOINT_FIELDS; a missing or unreadable file, or one that would run code (unless trust), is a
    UserError."""
    common.check(os.path.isfile(path), f"checkpoint {path!r} " + ("is a folder, not a file" if os.path.isdir(path) else
                                                                  "not found (no such file)"))   # whichever flag
    if is_tensor_dict(ckpt := safe_load(path, device, trust)) and "state_dict" not in ckpt:
        ckpt = {"state_dict": ckpt}
    common.check(isinstance(ckpt, dict) and "state_dict" in ckpt,
                 f"checkpoint {path!r} holds no 'state_dict'; expected {{'arch': ..., 'state_dict': ...}}")
    common.check(is_tensor_dict(ckpt["state_dict"]), f"checkpoint {path!r}: its 'state_dict' is not a dict of tensors")
    for name, ok in CHECKPOINT_FIELDS.items():
        common.check(name not in ckpt or ok(ckpt[name]), f"checkpoint {path!r}: field {name!r} has an invalid value "
                                                         f"({type(ckpt.get(name)).__name__})")
    return ckpt


def state_dict_of(path, ckpt, model):
    """The checkpoint's state_dict without the `module.` segments of DataParallel and DDP, checked:
    what the model holds in floating point is real floating point and finite (load_state_dict would cast silently)."""
    common.check(all(isinstance(k, str) for k in ckpt["state_dict"]), "the checkpoint's state_dict has keys that "
                 "are not parameter names (strings); not a model's weights")
    state = {".".join(p for p in k.split(".") if p != "module"): v for k, v in ckpt["state_dict"].items()}
    own = common.unwrap(model).state_dict()
    for name, value in state.items():
        common.check(not value.is_complex() and not (name in own and own[name].is_floating_point() and
                                                     not value.is_floating_point()),
                     f"checkpoint {path!r}: tensor {name!r} is {value.dtype}, not real floating point")
        common.check(not value.is_floating_point() or bool(torch.isfinite(value).all()),
                     f"checkpoint {path!r}: tensor {name!r} has non-finite values (a diverged run?)")
    return state


def load_model(path, dataset=None, arch=None, device="cpu", trust=False, precision="fp32"):
    """Build the architecture the checkpoint (or `arch`) names and load its weights with strict key
    matching; returns (model in eval mode on device, checkpoint). dataset: default the checkpoint's, else guessed
    from the architecture. precision: the weights must stay finite cast to it (fp16 overflows above 65504)."""
    ckpt = load_checkpoint(path, device, trust)
    arch = arch or ckpt.get("arch")
    common.check(arch is not None, f"checkpoint {path!r} names no architecture; pass --arch")
    dataset = dataset or ckpt.get("dataset") or {"resnet50": "imagenet", "digits_cnn": "digits",
                                                 "lenet": "digits"}.get(arch, "cifar10")
    common.check(arch in common.ARCHS, f"checkpoint {path!r} names an unknown architecture {arch!r}; pass --arch")
    model = common.get_architecture(arch, dataset)
    try:
        model.load_state_dict(state_dict_of(path, ckpt, model), strict=True)
    except RuntimeError as e:
        first = str(e).split("\n\t")[1][:200] if "\n\t" in str(e) else str(e)[:200]
        raise common.UserError(f"checkpoint {path!r} does not fit architecture {arch!r} on {dataset}: {first}") from None
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    bad = [k for k, v in ckpt["state_dict"].items() if dtype is not None and v.is_floating_point() and
           not torch.isfinite(v.to(dtype)).all()]
    common.check(not bad, f"checkpoint {path!r} has weights too large for --precision {precision} "
                          f"({', '.join(bad[:2])} overflow when cast); certify in fp32")
    model = model.to(device).eval()
    try:   # one forward pass on a dummy input: a model that cannot take this dataset's inputs fails here
        with torch.no_grad():
            model(torch.zeros(1, *common.INPUT_SHAPE[dataset], device=device))
    except RuntimeError as e:
        raise common.UserError(f"checkpoint {path!r} ({arch}) cannot take {dataset} inputs of shape "
                               f"{common.INPUT_SHAPE[dataset]} ({str(e).splitlines()[0][:120]}); pass the right "
                               f"--dataset") from None
    return model, ckpt

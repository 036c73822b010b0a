"""Shared building blocks of randomized smoothing (RS): models, data, noise, statistics, checkpoints, training.

Everything the paper's numbers rest on lives here exactly once: the architectures of Cohen et al. (2019),
the datasets, the Gaussian noise, the adaptive attack on the noise sphere (Alg. 1), the one-sided
Clopper-Pearson bound and the certified radius (Thm. of Cohen et al.), the Monte Carlo class counter that
CERTIFY and the training-time pA estimates share, atomic checkpoints and the shared training loop.
No argparse here and nothing runs on import: copy any function into a notebook.
"""
import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import re
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy.stats import beta as beta_dist
from scipy.stats import norm

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
# Errors: bad input is one line on stderr and exit code 2, never a traceback
# ----------------------------------------------------------------------------------------------------------

class UserError(Exception):
    """A problem with the user's input; the message names the problem and the fix."""


FLAG_NAMES = {}   # dest -> the flag as typed (--elastic-m for elastic_m), for messages about a parsed value


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is a single line on stderr (exit code 2)."""

    def parse_args(self, args=None, namespace=None):
        FLAG_NAMES.update({a.dest: max(a.option_strings, key=len) for a in self._actions if a.option_strings})
        return super().parse_args(args, namespace)

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


class Interrupted(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C (SIGINT) so that every `finally` and every temporary-file cleanup runs."""


def _raise_interrupted(signum, frame):
    raise Interrupted()


def run(main):
    """Call main(); a UserError becomes one line on stderr and exit code 2.

    SIGINT (Ctrl-C) and SIGTERM stop the command with one line and exit code 130 or 143: files are written
    through write_output (a temporary file, then os.replace) or appended a line at a time (a torn last line
    is dropped on resume), so an interrupted command leaves every file valid and resumable.
    Under torchrun the process group is always torn down before the process exits (end_distributed): a
    gloo group left alive at exit aborts the process ("terminate called without an active exception").
    """
    import signal
    try:
        signal.signal(signal.SIGTERM, _raise_interrupted)
    except ValueError:   # not the main thread (a test runner's worker): keep the default
        pass
    try:
        main()
    except UserError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
    except OSError as e:   # disk full, a read-only folder, ...: what the system said, on one line
        where = f" ({e.filename})" if e.filename else ""
        sys.stderr.write(f"error: {e.strerror or e}{where}; {written_so_far()}\n")
        sys.exit(2)
    except KeyboardInterrupt as e:
        term = isinstance(e, Interrupted)
        sys.stderr.write(f"interrupted ({'SIGTERM' if term else 'SIGINT'}): every file is complete or resumable; "
                         f"rerun the same command to continue\n")
        sys.exit(143 if term else 130)
    except MemoryError:
        sys.stderr.write(f"error: out of memory; lower --batch (or --N, --m); {written_so_far()}\n")
        sys.exit(2)
    finally:
        end_distributed(wait=False)


def check(condition, message):
    """Raise UserError(message) unless condition holds."""
    if not condition:
        raise UserError(message)


FLOAT32_MAX = 3.4028234663852886e38   # numbers reach the models, optimisers and noise in float32
MAX_DRAWS = 10 ** 9                    # --N, --N0: beyond, one example takes hours on any machine
MAX_BATCH_BYTES = 2 ** 33              # one pass of noisy inputs (float32) above 8 GiB is a typo, not a setting
SIGMA_RANGE = (1e-4, 1e4)              # inputs lie in [0, 1]: below, float32 loses the noise; above, the input
SIGMA_MAX_FP16 = 1e3                   # fp16 overflows at 65504: x + 7 sigma must stay below it


def check_finite(settings):
    """Every number among the settings (a dict of flag -> value) is usable where it is used: a float is finite in
    float32 (--lr 1e300 is inf there), an integer fits in 64 bits. A violation is a UserError naming the flag."""
    for key, value in settings.items():
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, float):
                check(math.isfinite(v) and abs(v) <= FLOAT32_MAX,
                      f"{FLAG_NAMES.get(key, '--' + key)} must be a finite number in float32 (|x| < 3.4e38), got "
                      f"{value}")
            elif isinstance(v, int) and not isinstance(v, bool):
                check(abs(v) < 2 ** 63, f"{FLAG_NAMES.get(key, '--' + key)} must fit in 64 bits, got {value}")


def check_sigma(sigma, flag="--sigma", precision="fp32"):
    """sigma is a noise level the float32 (or fp16) arithmetic of sampling and the model can carry: in
    SIGMA_RANGE, and at most SIGMA_MAX_FP16 under fp16. A certificate at a sigma the arithmetic cannot carry
    (the noise rounded away, or overflowing to inf) would be wrong, so it is refused before anything runs."""
    low, high = SIGMA_RANGE[0], SIGMA_MAX_FP16 if precision == "fp16" else SIGMA_RANGE[1]
    check(isinstance(sigma, (int, float)) and not isinstance(sigma, bool) and low <= sigma <= high,
          f"{flag} must lie in [{low:g}, {high:g}]{' under fp16' if precision == 'fp16' else ''} (inputs are in "
          f"[0, 1]), got {sigma}")


def check_batch_bytes(inputs, shape, what="--batch"):
    """`inputs` noisy inputs of `shape` in float32 fit in MAX_BATCH_BYTES: checked before anything is allocated."""
    size = inputs * 4 * math.prod(shape)
    check(size <= MAX_BATCH_BYTES, f"{what} asks for {inputs} noisy inputs of shape {tuple(shape)} at once "
                                   f"({size / 2 ** 30:.3g} GiB); lower it")


@contextlib.contextmanager
def exclusive_lock(path, what):
    """Hold an exclusive lock on the file `path` (created if missing) for the block: one run per output.

    A second run asking for the same lock gets a UserError at once (no waiting). The lock is the kernel's
    (flock): it is released when the block ends or the process dies, however it dies, so a killed run never
    leaves a stale lock. Where fcntl does not exist (Windows) there is no lock.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    f = open(path, "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise UserError(f"{what} is in use by another run (it holds {path}); wait for that run to end, or "
                        f"choose another output") from None
    _HELD_LOCKS.add(os.path.realpath(path))
    try:
        yield
    finally:
        _HELD_LOCKS.discard(os.path.realpath(path))
        f.close()


def is_locked(path):
    """True when another process holds exclusive_lock(path) now."""
    try:
        import fcntl
    except ImportError:
        return False
    if not os.path.exists(path):
        return False
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def fsync_dir(path):
    """fsync the folder holding path, so that a rename into it survives a power cut (POSIX; a no-op elsewhere)."""
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------------------
# Outputs: one guard for every file any script writes
# ----------------------------------------------------------------------------------------------------------
# Every file a script writes goes through write_output (whole files) or open_append (logs that grow a line at a
# time). The guard refuses to write over an input of the same command, a link, a folder or a special file,
# a file another run holds, and any existing file that this project did not write for the same purpose.
# What was written, and for what, is kept in one record per output folder (RECORD): {file name: {"kind",
# "by", "sha256"}} (no sha256 for appended logs). A whole file is written to a temporary file, fsynced and
# renamed over the old one, so a failed or interrupted write leaves the previous file as it was.

RECORD = ".rs-outputs.json"
RECORD_LOCK = ".rs-outputs.lock"
_WRITTEN = []        # the files this process has completed, for the message of a failed write
_HELD_LOCKS = set()  # realpaths of the exclusive_locks this process holds (not "another run")


_INPUTS = []         # the files the running command reads (set_inputs): never written over


def set_inputs(paths):
    """Declare the files the command now starting reads; the guard refuses to write over any of them.
    A folder stands for every file under it."""
    _INPUTS.clear()
    _WRITTEN.clear()
    for path in paths:
        if path and os.path.isdir(path):
            _INPUTS.extend(os.path.join(root, f) for root, _, files in os.walk(path) for f in files)
        elif path:
            _INPUTS.append(path)


def written_so_far():
    """For an error message: which files this command completed before it stopped."""
    rest = "logs it was appending keep every complete line (rerun to resume)"
    if not _WRITTEN:
        return f"this command completed no file; every file written before is unchanged, and {rest}"
    names = ", ".join(_WRITTEN[-4:]) + (f" and {len(_WRITTEN) - 4} more" if len(_WRITTEN) > 4 else "")
    return f"completed before it: {names}; every other file is as it was, and {rest}"


def _read_record(folder):
    path = os.path.join(folder, RECORD)
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read this folder's record of outputs ({type(e).__name__}); remove it "
                        f"(the files it listed then count as not written by this project)") from None
    check(isinstance(record, dict) and all(isinstance(v, dict) for v in record.values()),
          f"{path}: not a record of outputs (expected {{file name: {{kind, by, sha256}}}}); remove it")
    return record


@contextlib.contextmanager
def _folder_record(folder):
    """The output record of `folder`, read and (when the block ends without error) written back under a lock."""
    make_outdir(folder)
    with open(os.path.join(folder, RECORD_LOCK), "a") as lock:
        try:
            import fcntl
            fcntl.flock(lock, fcntl.LOCK_EX)   # held for one file write at most
        except ImportError:
            pass
        record = _read_record(folder)
        yield record
        path = os.path.join(folder, RECORD)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def output_problem(path, kind, inputs=(), record=None, append=False, claimed=False):
    """Why `path` may not be written as `kind` by this command (a message), or None when it may.

    inputs: the files this command reads (an output may not be one of them, links and hard links included).
    record: the folder's record (read when None). append: the file grows (no checksum is kept for it).
    claimed: the caller has read the file's own record (a certification log's sidecar naming certify.py),
    so a file missing from the folder's record (copied from elsewhere) may still be resumed or replaced.
    """
    name = os.path.basename(path)
    if name in ("", ".", "..", RECORD, RECORD_LOCK):
        return f"{path!r} is not a file name this command may write"
    if os.path.islink(path):
        return f"{path!r} is a symbolic link (to {os.path.realpath(path)!r}); name a plain file"
    for source in list(inputs) + _INPUTS:
        if source and os.path.exists(source) and os.path.exists(path) and os.path.samefile(source, path):
            return f"{path!r} is an input of this command ({source!r}); choose another output"
    if os.path.exists(path):
        import stat
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            return f"{path!r} is a folder; name a file inside it"
        if not stat.S_ISREG(mode):
            return f"{path!r} is not a regular file (a FIFO, device or socket); choose another output"
    lock = path + ".lock"
    if os.path.realpath(lock) not in _HELD_LOCKS and is_locked(lock):
        return f"{path!r} is being written by another run (it holds {lock!r}); wait for it or choose another output"
    if not os.path.exists(path):
        return None
    record = _read_record(os.path.dirname(os.path.abspath(path))) if record is None else record
    entry = record.get(name)
    if entry is None and claimed:
        return None
    if entry is None:
        return (f"{path!r} exists and was not written by this project (no entry in "
                f"{os.path.join(os.path.dirname(path), RECORD)!r}); move it away or choose another output")
    if entry.get("kind") != kind:
        return f"{path!r} was written as {entry.get('kind')!r}, not as {kind!r}; choose another output"
    if not (append or claimed or entry.get("append")) and entry.get("sha256") != file_sha256(path):
        return (f"{path!r} changed since {entry.get('by', 'this project')} wrote it; move it away or choose "
                f"another output")
    return None


def _entry(kind, sha256=None):
    entry = {"kind": kind, "by": os.path.basename(sys.argv[0] or "python")}
    if sha256 is None:
        entry["append"] = True
    else:
        entry["sha256"] = sha256
    return entry


def write_output(path, kind, write, inputs=(), append=False, claimed=False):
    """Write the file `path` as `kind` ('table', 'checkpoint', ...) through the guard; returns path.

    write(f): puts the whole content into the binary file object f. The content goes to a temporary file,
    is fsynced and replaces `path` in one rename; a failed write (disk full, `ulimit -f`, Ctrl-C) removes the
    temporary file, leaves `path` as it was and says so. append=True: a log that open_append extends later.
    """
    folder = os.path.dirname(os.path.abspath(path))
    with _folder_record(folder) as record:
        problem = output_problem(path, kind, inputs, record, append, claimed)
        check(problem is None, problem)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            digest = None if append else file_sha256(tmp)
            os.replace(tmp, path)
        except BaseException as e:
            if os.path.exists(tmp):
                os.remove(tmp)
            if isinstance(e, OSError):
                raise UserError(f"{path!r} not written ({e.strerror or type(e).__name__}), its previous content "
                                f"is intact; {written_so_far()}") from None
            raise
        record[os.path.basename(path)] = _entry(kind, digest)
    fsync_dir(path)
    _WRITTEN.append(path)
    return path


def write_text_output(path, kind, text, inputs=()):
    """write_output of a text (UTF-8)."""
    return write_output(path, kind, lambda f: f.write(text.encode("utf-8")), inputs)


def write_json(obj, path, kind="settings", inputs=(), claimed=False):
    """obj as pretty JSON (args.json, sidecars, summaries), through the guard."""
    text = json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"
    return write_output(path, kind, lambda f: f.write(text.encode("utf-8")), inputs, claimed=claimed)


def open_append(path, kind, header, inputs=(), claimed=False):
    """Open the log `path` (kind `kind`) to append rows, through the guard; a new or empty file gets `header`
    (a line) first. The caller flushes each row: a kill leaves at most a torn last line, which the readers
    drop (read_log_prefix)."""
    folder = os.path.dirname(os.path.abspath(path))
    with _folder_record(folder) as record:
        problem = output_problem(path, kind, inputs, record, append=True, claimed=claimed)
        check(problem is None, problem)
        record[os.path.basename(path)] = _entry(kind)
    f = open(path, "a", encoding="utf-8")
    if f.tell() == 0:
        f.write(header + "\n")
        f.flush()
    return f


def copy_training_log(source, path):
    """Copy a run's log.tsv (read_train_log checks it) to `path` through the guard (scripts/lib.sh keep_log)."""
    rows = read_train_log(source)
    text = "".join("\t".join(str(r[c]) for c in TRAIN_LOG_COLUMNS) + "\n" for r in rows)
    return write_text_output(path, "training log copy", "\t".join(TRAIN_LOG_COLUMNS) + "\n" + text, [source])


def remove_output(path, kind, claimed=False):
    """Remove a file this project wrote as `kind` (certify.py --overwrite); anything else is refused."""
    if not os.path.lexists(path):
        return
    folder = os.path.dirname(os.path.abspath(path))
    with _folder_record(folder) as record:
        problem = output_problem(path, kind, (), record, append=True, claimed=claimed)
        if problem is not None:
            raise UserError(problem.replace("choose another output", "refusing to remove it"))
        os.remove(path)
        record.pop(os.path.basename(path), None)


def adopt_outputs(paths, kind):
    """Enter existing files in their folders' records as written by this project as `kind` (for files made
    before the record existed: results/ of earlier versions). Only for files you know this project wrote."""
    for path in paths:
        with _folder_record(os.path.dirname(os.path.abspath(path))) as record:
            record[os.path.basename(path)] = _entry(kind, file_sha256(path))


def file_sha256(path):
    """The sha256 of a file's bytes (hex), read in 1 MiB blocks."""
    import hashlib
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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


def read_lines(path):
    """The lines of a text file; a missing, special or unreadable one is a UserError."""
    check(not os.path.isdir(path), f"{path}: is a folder; name a file")
    check(os.path.exists(path), f"{path}: file not found")
    check(os.path.isfile(path), f"{path}: not a regular file (a FIFO, device or socket)")
    try:
        with open(path, errors="replace") as f:
            return f.read().splitlines()
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None


def to_numbers(path, column, cells, line_numbers):
    """Column cells as a float array; the first non-number is a UserError with its line number."""
    try:
        return np.array(cells, dtype=float)
    except ValueError:
        for number, cell in zip(line_numbers, cells):
            try:
                float(cell)
            except ValueError:
                raise UserError(f"{path} line {number}: {column} {cell!r} is not a number") from None
        raise


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
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError) as e:
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


def read_log_prefix(path, columns):
    """Our own log being resumed (certify.py): its complete data lines and the byte length of that valid prefix.

    A last line without its newline or with the wrong field count is torn (cut off by a kill): it is left out.
    A file without any complete line counts as empty. A wrong header or a malformed earlier line is a UserError.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path!r} ({type(e).__name__}); pass --overwrite to replace it") from None
    # byte offsets below are those of the text: a file with CR LF line ends (edited on Windows) is refused
    check(b"\r" not in data, f"{path!r} has Windows line endings (CR LF); convert it back (dos2unix) to "
                             f"resume, or pass --overwrite to start again")
    lines = text.split("\n")[:-1]  # the piece after the last newline is torn (or empty)
    if not lines:
        return [], 0
    check(lines[0] == "\t".join(columns),
          f"{path!r} has header {lines[0][:60]!r}, not {' '.join(columns)!r} (another format or setting); pass "
          f"--overwrite to replace it or choose another output")
    rows = lines[1:]
    if rows and len(rows[-1].split("\t")) != len(columns):
        rows = rows[:-1]
    for k, row in enumerate(rows):
        cells = row.split("\t")
        check(len(cells) == len(columns) and cells[0].isdigit(),
              f"{path!r} line {k + 2} is malformed; repair it, pass --overwrite, or choose another output")
    return rows, len("".join(line + "\n" for line in [lines[0]] + rows).encode("utf-8"))


def read_header(path):
    """The first line of a text file without its newline ('' for an empty file)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.readline().rstrip("\n")


def read_train_log(path):
    """A training run's log.tsv (TRAIN_LOG_COLUMNS): its complete rows as dicts of strings, epochs in order.

    A torn last line (a killed run) is dropped; any other malformed line is a UserError."""
    rows, _ = read_log_prefix(path, TRAIN_LOG_COLUMNS)
    return [dict(zip(TRAIN_LOG_COLUMNS, row.split("\t"))) for row in rows]


def read_args_json(path):
    """A run's args.json: a JSON object of its settings, with 'run' (run_identity) in runs since it exists."""
    args = read_json_object(path, "settings of a run (args.json)")
    check("run" not in args or isinstance(args["run"], dict), f"{path}: field 'run' must be an object")
    return args


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
                              f"certification log with an nY column (certify.py --split train writes one)")
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


def _digits(split):
    """scikit-learn's bundled 8x8 digits in [0, 1], a fixed seeded 80/20 train/test split (no network)."""
    from sklearn.datasets import load_digits
    data = load_digits()
    images = torch.tensor(data.images / 16.0, dtype=torch.float32).unsqueeze(1)  # (1797, 1, 8, 8)
    labels = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(labels))
    part = perm[:cut] if split == "train" else perm[cut:]
    return TensorImages(images[part], labels[part])


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
            try:
                with Image.open(path) as img:
                    images.append(np.asarray(img.convert("RGB"), dtype=np.uint8))
            except (OSError, UnidentifiedImageError, ValueError) as e:
                raise UserError(f"{path}: not a readable image ({type(e).__name__}); remove it") from None
            want = images[0].shape if shape is None else (shape[1], shape[2], shape[0])
            check(images[-1].shape == want, f"{path}: image of size {images[-1].shape[1]}x{images[-1].shape[0]}, "
                                            f"expected {want[1]}x{want[0]}")
            labels.append(label)
    images = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float().div_(255)  # (N, 3, H, W)
    return images, torch.tensor(labels, dtype=torch.long)


def data_fingerprint(name, split, data_dir=None):
    """A short hash naming the data a run reads (its identity; a resume on other data is refused).

    digits: the bundled arrays of the split. An image folder or torchvision's files: the sorted list of file
    paths (relative to the split's folder) and sizes, without reading the images."""
    import hashlib
    digest = hashlib.sha256(f"{name}/{split}".encode())
    if name == "digits":
        ds = _digits(split)
        digest.update(ds.images.numpy().tobytes())
        digest.update(ds.labels.numpy().tobytes())
        return digest.hexdigest()[:16]
    data_dir = data_dir or default_data_dir()
    sub = {"cifar10": "train" if split == "train" else "test", "imagenet": "train" if split == "train" else "val"}
    folder = os.path.join(data_dir, sub[name])
    if not os.path.isdir(folder):
        folder = os.path.join(data_dir, "cifar-10-batches-py")   # torchvision's CIFAR-10 files
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for f in sorted(files):
            path = os.path.join(root, f)
            digest.update(f"{os.path.relpath(path, folder)}\t{os.path.getsize(path)}\n".encode())
    return digest.hexdigest()[:16]


def environment():
    """The software and the machine a result is made with, recorded in every sidecar, args.json and report
    header: floating point differs between CPUs (vector extensions, native bf16) and library versions, so a
    retrained model or a rerun can differ in its last digits, and this says with what each file was made."""
    import importlib.metadata
    import platform
    versions = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__}
    for name in ("torchvision", "scipy"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        versions["numpy_blas"] = f"{blas.get('name')} {blas.get('version', '')}".strip()
    except Exception:       # older numpy: no dict form; the record is informative only
        versions["numpy_blas"] = None
    cpu, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), cpu)
        flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    except OSError:
        pass
    wanted = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")
    versions["cpu"] = {"model": cpu, "logical_cpus": os.cpu_count(), "extensions": [f for f in wanted if f in flags],
                       "torch_capability": torch.backends.cpu.get_cpu_capability()}
    if torch.cuda.is_available():
        versions["gpu"] = torch.cuda.get_device_name(0)
    return versions


def environment_line(env=None):
    """environment() (or one read from a sidecar: any missing part shows as ?) in one line, for report headers."""
    env = env if isinstance(env, dict) else environment()
    cpu = env.get("cpu") if isinstance(env.get("cpu"), dict) else {}
    get = lambda d, key: str(d.get(key)) if d.get(key) is not None else "?"
    ext = " ".join(map(str, cpu["extensions"])) if isinstance(cpu.get("extensions"), list) else "?"
    return (f"python {get(env, 'python')}, torch {get(env, 'torch')}, torchvision {get(env, 'torchvision')}, "
            f"numpy {get(env, 'numpy')} ({get(env, 'numpy_blas')}), scipy {get(env, 'scipy')}; {get(cpu, 'model')}, "
            f"{get(cpu, 'logical_cpus')} logical CPUs, {ext or 'no listed extensions'} (torch: "
            f"{get(cpu, 'torch_capability')})" + (f"; {env['gpu']}" if env.get("gpu") else ""))


def run_identity(script, dataset, data_dir=None):
    """What a run is, beyond its settings: the script that runs it and the data it trains and tests on."""
    return {"script": script, "data": {split: data_fingerprint(dataset, split, data_dir)
                                       for split in ("train", "test")}}


def _cifar10(split, data_dir, train_transform):
    folder = os.path.join(data_dir, "train" if split == "train" else "test")
    transform = random_crop_flip if train_transform and split == "train" else None
    if os.path.isdir(folder):  # image-folder layout, e.g. the JPEG copy on offline machines
        images, labels = _image_folder_in_memory(folder, NUM_CLASSES["cifar10"], INPUT_SHAPE["cifar10"])
        return TensorImages(images, labels, transform)
    import torchvision
    try:
        ds = torchvision.datasets.CIFAR10(data_dir, train=(split == "train"), download=True)
    except Exception as e:  # offline, unwritable, corrupt: one line saying where we looked
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
    """One-sided (1 - alpha) Clopper-Pearson lower confidence bound on a binomial proportion.

    The alpha-quantile of Beta(nA, N - nA + 1); 0 when nA == 0 (the beta quantile is undefined there).
    Closed form at nA == N: alpha ** (1 / N). Works elementwise on numpy arrays.
    """
    nA, N = np.asarray(nA, dtype=float), np.asarray(N, dtype=float)
    with np.errstate(invalid="ignore"):
        bound = beta_dist.ppf(alpha, np.maximum(nA, 1), N - nA + 1)
    bound = np.where(nA > 0, bound, 0.0)
    return float(bound) if bound.ndim == 0 else bound


def clopper_pearson_upper(nA, N, alpha):
    """One-sided (1 - alpha) Clopper-Pearson upper bound: the (1 - alpha)-quantile of Beta(nA + 1, N - nA); 1 at nA == N."""
    nA, N = np.asarray(nA, dtype=float), np.asarray(N, dtype=float)
    with np.errstate(invalid="ignore"):
        bound = beta_dist.ppf(1 - alpha, nA + 1, np.maximum(N - nA, 1))
    bound = np.where(nA < N, bound, 1.0)
    return float(bound) if bound.ndim == 0 else bound


def certified_radius(pA_lower, sigma):
    """Certified l2 radius sigma * Phi^-1(pA_lower) of Cohen et al.'s Theorem 1 (negative below 1/2)."""
    return sigma * norm.ppf(pA_lower)


# ----------------------------------------------------------------------------------------------------------
# Anytime-valid bounds for certification at a grid of radii (ADAPTIVE.md §1b, §2: GRID-CS)
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


def kt_log_wealth(A, t, p, prior=KT_PRIOR):
    """log W_t(p) of the betting confidence sequence whose mixture is Beta(a0, b0) = prior (KT by default):
    B(A + a0, t - A + b0) / (B(a0, b0) p^A (1 - p)^(t - A)), in closed form with scipy's betaln; for the KT
    prior B(1/2, 1/2) = pi, the formula above. numpy-vectorised."""
    from scipy.special import betaln, xlog1py, xlogy
    A, t, p = np.asarray(A, dtype=float), np.asarray(t, dtype=float), np.asarray(p, dtype=float)
    a0, b0 = prior
    return betaln(A + a0, t - A + b0) - betaln(a0, b0) - xlogy(A, p) - xlog1py(t - A, -p)


def one_sided_log_wealth(A, t, tau, side, prior=KT_PRIOR):
    """log wealth of the one-sided mixture against p = tau after t draws with A votes: the prior Beta(a0, b0)
    (KT's Beta(1/2, 1/2) by default) restricted to q > tau (side +1, evidence that p > tau) or to q < tau
    (side -1) and renormalised,

      W+_t(tau) = integral over q > tau of (q / tau)^A ((1 - q) / (1 - tau))^(t - A) pi(q) dq / pi(q > tau),

    that is the mixture's wealth (kt_log_wealth) times the posterior mass of Beta(A + a0, t - A + b0) above
    tau over the prior's mass above tau (scipy's betaincc; betainc for side -1). Each likelihood ratio with
    q > tau has mean 1 at p = tau and less below, so W+ is a nonnegative supermartingale whenever p <= tau
    (Ville: P(ever >= 1/alpha) <= alpha), for any prior fixed before the draws. It spends nothing on
    alternatives on the wrong side of tau, which the two-sided mixture does: with the KT prior its threshold
    is lower by log(1 / pi(q > tau)), 2.3 nats at tau = Phi(2). Underflow only lowers the wealth: a
    posterior mass that underflows counts as 0 and a prior mass below 1e-300 as 1e-300 (dividing by more
    than the true mass is a sub-probability mixture, still a supermartingale). numpy-vectorised."""
    from scipy.special import betainc, betaincc
    A, t = np.asarray(A, dtype=float), np.asarray(t, dtype=float)
    a0, b0 = prior
    a, b = A + a0, t - A + b0
    tail, mass = (betaincc(a, b, tau), betaincc(a0, b0, tau)) if side > 0 else \
        (betainc(a, b, tau), betainc(a0, b0, tau))
    with np.errstate(divide="ignore"):
        return kt_log_wealth(A, t, tau, prior) + np.log(tail) - math.log(max(float(mass), 1e-300))


def first_true(lo, hi, ok):
    """Per entry, the smallest integer x in [lo, hi] with ok(x) (ok rises with x), hi + 1 if none: a binary
    search run on whole arrays at once."""
    lo, hi = np.array(lo, dtype=np.int64), np.array(hi, dtype=np.int64)
    while (lo <= hi).any():
        open_ = lo <= hi
        mid = (lo + hi) // 2
        good = ok(mid) & open_
        hi = np.where(good, mid - 1, hi)
        lo = np.where(open_ & ~good, mid + 1, lo)
    return lo


def grid_tables(taus, checks, alpha_seq, beta, alpha_fin, N_max, one_sided=True, prior=KT_PRIOR):
    """Integer thresholds of GRID-CS (ADAPTIVE.md §2), one row per threshold tau_j = Phi(r_j / sigma).

    At check time checks[i] with A votes: level j is certified once A >= lower[j, i] (the smallest A with
    A / t > tau_j and log W+_t(tau_j) >= log(1 / alpha_seq)), and ruled out once A <= upper[j, i] (the largest
    A with A / t < tau_j and log W-_t(tau_j) >= log(1 / beta)); unreachable entries are t + 1 and -1. W+ and W-
    are one_sided_log_wealth's one-sided mixtures of `prior` (one_sided=False: the two-sided wealth for both,
    the earlier two-sided rule). Both tables are then made non-decreasing over j (a level is certified only with every
    level below it, ruled out with every level above it), which only removes certificates. final[j]: the
    smallest A whose Clopper-Pearson bound at alpha_fin over N_max draws exceeds tau_j (>= for j > 0; > 1/2 for
    tau_0 = 1/2), N_max + 1 if none. The wealths grow with A above t tau and fall below it, so each threshold
    is a binary search (first_true). Returns a dict of int64 arrays: lower, upper (k, len(checks)), final (k,).
    """
    t = np.asarray(checks, dtype=np.int64)
    level_seq = math.log(1 / alpha_seq) if alpha_seq > 0 else math.inf
    level_beta = math.log(1 / beta) if beta > 0 else math.inf

    def wealth(A, tau, side):
        return one_sided_log_wealth(A, t, tau, side, prior) if one_sided else kt_log_wealth(A, t, tau, prior)
    lower, upper = np.zeros((len(taus), len(t)), np.int64), np.zeros((len(taus), len(t)), np.int64)
    for j, tau in enumerate(taus):
        above = np.floor(t * tau).astype(np.int64) + 1                 # the smallest A with A / t > tau
        lower[j] = first_true(above, t, lambda A: wealth(A, tau, +1) >= level_seq)
        below = np.ceil(t * tau).astype(np.int64) - 1                  # the largest A with A / t < tau
        upper[j] = first_true(np.zeros_like(t), below, lambda A: ~(wealth(A, tau, -1) >= level_beta)) - 1
    lower, upper = np.maximum.accumulate(lower, axis=0), np.maximum.accumulate(upper, axis=0)
    return {"lower": lower, "upper": upper, "final": final_thresholds(taus, N_max, alpha_fin)}


def final_thresholds(taus, N_max, alpha_fin):
    """final[j] of grid_tables: the smallest A whose Clopper-Pearson bound at alpha_fin over N_max draws exceeds
    tau_j (>= for j > 0; > 1/2 for tau_0 = 1/2), N_max + 1 if none or if alpha_fin = 0 (no final look)."""
    final = np.full(len(taus), N_max + 1, np.int64)
    if alpha_fin <= 0:
        return final
    for j, tau in enumerate(taus):
        lo, hi = 0, N_max
        while lo <= hi:   # binary search: the bound rises with A
            mid = (lo + hi) // 2
            bound = clopper_pearson_lower(mid, N_max, alpha_fin)
            if bound > tau or (j > 0 and bound >= tau):   # r = 0: > 1/2, as CERTIFY's prediction
                hi = mid - 1
            else:
                lo = mid + 1
        final[j] = lo
    return final


def crossing_probability(lower, checks, p, drop=1e-15):
    """P(A_t >= lower[i] at some check t = checks[i]) when every draw votes cA with probability p: the exact error
    a sequential test with these integer thresholds spends (ADAPTIVE.md §2, validity), by dynamic programming.

    The distribution of A over the paths that have not crossed yet is carried from check to check: convolved
    with Binomial(t_i - t_(i-1), p), the mass at or above the threshold is added to the crossing probability
    and removed. Three roundings, each counted as crossing so that the result is an upper bound of the exact
    value (to far below any alpha in use): the arithmetic's (1e-12 is added per check that cuts), the lower
    tail of the carried distribution, at most `drop` of mass per check, and the binomial's own tails beyond
    entries of 1e-20, which are cut off so that only a window of a few standard deviations is carried and
    convolved (about 10 ms a level at N = 10^5)."""
    from scipy.signal import fftconvolve
    from scipy.stats import binom
    dist, offset, previous, crossed = np.ones(1), 0, 0, 0.0   # dist[k]: P(A = offset + k, not crossed)
    steps = {}                                                 # n -> (first count kept, its pmf, mass cut off)
    for t, threshold in zip(checks, lower):
        n = int(t - previous)
        if n not in steps:
            pmf = binom.pmf(np.arange(n + 1), n, p)
            keep = np.flatnonzero(pmf > 1e-20)
            lo, hi = (int(keep[0]), int(keep[-1])) if len(keep) else (0, 0)
            steps[n] = (lo, pmf[lo:hi + 1], float(pmf[:lo].sum() + pmf[hi + 1:].sum()))
        lo, step, cut_off = steps[n]
        dist = np.clip(fftconvolve(dist, step), 0.0, None) if len(dist) * len(step) > 200_000 else \
            np.convolve(dist, step)
        offset, crossed = offset + lo, crossed + cut_off
        cut = int(np.searchsorted(np.cumsum(dist), drop, side="right"))   # leading entries of mass <= drop
        if cut:
            crossed += float(dist[:cut].sum())
            dist, offset = dist[cut:], offset + cut
        if threshold - offset < len(dist):
            crossed += float(dist[max(threshold - offset, 0):].sum()) + 1e-12
            dist = dist[:max(threshold - offset, 0)]
        previous = t
    return min(crossed, 1.0)


def kt_interval(A, t, alpha_low, beta_up, prior=KT_PRIOR):
    """[L, U]: the values of p the betting sequence with mixture `prior` (KT by default) has not rejected after
    t draws with A votes, at level alpha_low below A / t and beta_up above it. log W_t(p) is at most 0 at
    p = A / t (a mixture of likelihoods is at most their maximum) and grows monotonically away from it, so
    each end is one root (scipy's brentq)."""
    from scipy.optimize import brentq
    if t == 0:
        return 0.0, 1.0
    center, tiny = A / t, 1e-300

    def end(level, outside):   # the root of log W_t(p) = level between the center and `outside`
        if level == math.inf or kt_log_wealth(A, t, outside, prior) < level:
            return outside
        return brentq(lambda p: kt_log_wealth(A, t, p, prior) - level, min(center, outside), max(center, outside),
                      xtol=1e-15)
    L = 0.0 if A == 0 else end(math.log(1 / alpha_low) if alpha_low > 0 else math.inf, tiny)
    U = 1.0 if A == t else end(math.log(1 / beta_up) if beta_up > 0 else math.inf, 1 - 1e-16)
    return float(L), float(U)


# ----------------------------------------------------------------------------------------------------------
# Noise and the Monte Carlo class counter (CERTIFY, PREDICT and training's pA estimates)
# ----------------------------------------------------------------------------------------------------------

def example_generator(seed, idx, device="cpu"):
    """A torch.Generator seeded by (seed, idx): example idx gets the same noise in any run, subset or shard."""
    state = np.random.SeedSequence([int(seed), int(idx)]).generate_state(2, dtype=np.uint32)
    g = torch.Generator(device=device)
    g.manual_seed(int(state[0]) << 32 | int(state[1]))
    return g


def gaussian_noise(shape, sigma, device, generator=None):
    """sigma * N(0, I) of the given shape, drawn on `device` (from `generator` if given)."""
    return sigma * torch.randn(shape, device=device, generator=generator)


# ----------------------------------------------------------------------------------------------------------
# Sound sampling (Voráček & Hein 2023; SOUND.md): integer noise on the 8-bit grid, one conversion to float
# ----------------------------------------------------------------------------------------------------------
# The float path feeds f with fl(x + fl(sigma * randn)), which keeps low-order bits of x: a base classifier
# can read them and get certificates that are false (SOUND.md §1). The sound path draws the Gaussian rounded
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
    check(bool((scaled - a).abs().max() < 1e-3) and bool(a.min() >= 0) and bool(a.max() <= levels),
          f"--sound needs inputs on the grid x = a / {levels}, a in 0..{levels} (this input is not)")
    return a.to(torch.int32)


def sound_noisy_inputs(a, k, sigma, generator=None, Q=SOUND_Q, levels=GRID_LEVELS):
    """k noisy copies of each input on the grid, formed exactly: z = fp32(a + J) / levels (SOUND.md §2-§3).

    a: int32 levels (B, C, H, W) (grid_levels). J: the rounded Gaussian drawn with integer thresholds on a's
    device. Returns (z (k, B, C, H, W) float32, failed (k, B) bool: a draw with any failed coordinate).
    """
    S, L = _table_on(sigma, a.device, Q, levels)
    U = torch.randint(0, Q, (k, *a.shape), dtype=torch.int64, device=a.device, generator=generator)
    index = torch.searchsorted(S, U, right=True, out_int32=True)  # bin of U; len(S) means past the last one
    failed = (index == len(S)).reshape(k, a.shape[0], -1).any(2)
    z = (a.unsqueeze(0) + (index - L)).float() / levels           # integer sum (int32), one conversion
    return z, failed


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision, device):
    """Raise a UserError unless `precision` (fp32, bf16, fp16) can run on `device` (fp16: CUDA only)."""
    device = torch.device(device)
    check(precision in PRECISIONS, f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    check(precision != "fp16" or device.type == "cuda", "fp16 needs a CUDA device; use bf16 on the CPU")
    check(precision != "bf16" or device.type != "cuda" or torch.cuda.is_bf16_supported(),
          "this GPU does not support bf16; use fp16")
    if precision == "bf16" and device.type == "cpu" and cpu_has_native_bf16() is False:
        print("warning: bf16 on a CPU without native bf16 (no avx512_bf16 or amx_bf16 in /proc/cpuinfo): it is "
              "emulated and slower than fp32 here (8x in certification on an AVX2-only AMD EPYC, "
              "results/speed/bf16_cpu.txt); fp32 is faster on this machine", file=sys.stderr)


def cpu_has_native_bf16(cpuinfo="/proc/cpuinfo"):
    """True if the CPU has bf16 instructions (AVX512-BF16 or AMX-BF16), False if it has not, None where unknown
    (no /proc/cpuinfo: not Linux). Without them torch emulates bf16 with fp32 conversions, which costs more
    than fp32 itself."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else bool({"avx512_bf16", "amx_bf16"} & set(flags))


def autocast(device_type, precision="fp32"):
    """The autocast context of a precision: fp32 is a no-op, bf16/fp16 run matmuls and convolutions in it."""
    dtype = PRECISIONS[precision]
    return torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def pass_sizes(n, per_pass):
    """Split n draws into ceil(n / per_pass) passes of (nearly) equal size: no nearly empty last pass."""
    passes = -(-n // per_pass)
    if passes <= 0:
        return []
    q, r = divmod(n, passes)
    return [q + 1] * r + [q] * (passes - r)


@contextlib.contextmanager
def eval_mode(model):
    """The model in eval mode for a block (BatchNorm's running statistics, no dropout), then every module back in
    the mode it came in: certification evaluates one fixed classifier and leaves the caller's model as it was."""
    modes = [(m, m.training) for m in model.modules()] if isinstance(model, torch.nn.Module) else []
    if modes:
        model.eval()
    try:
        yield model
    finally:
        for module, training in modes:   # parents before children (modules() is pre-order)
            module.train(training)


def in_eval_mode(fn):
    """Decorator: fn(model, ...) runs with eval_mode(model)."""
    @functools.wraps(fn)
    def wrapper(model, *args, **kwargs):
        with eval_mode(model):
            return fn(model, *args, **kwargs)
    return wrapper


def sample_counts(model, x, sigma, n, batch, num_classes, generator=None, *, precision="fp32", stop=None,
                  sound=None):
    """Count the base classifier's votes on n Gaussian-noised copies of each input.

    model: in eval mode, on x's device (any memory format: a channels-last model reorders its input).
    x: (B, C, H, W) in [0, 1]. The n copies go through the model in pass_sizes(n, batch // B) passes of
    about `batch` noisy inputs (at least one copy of every input per pass). Noise is drawn on the device in
    fp32 and votes are counted there, in inference mode; nothing goes to the host. precision: 'fp32', or
    'bf16'/'fp16' autocast of the forward passes (the certificate is then one of that reduced-precision
    classifier). stop: optional callable(counts, drawn) -> bool, called after each pass but the last;
    True ends counting early. The passes before a stop are exactly those of the full count, so the noise
    stream does not depend on `stop`. Returns an int64 tensor (B, num_classes) on x's device; each row
    sums to the number of draws made (n unless stopped).
    sound: None (the float sampler), or the number of levels of x's grid (255 for 8-bit images): draw the
    noise with the exact integer sampler (sound_noisy_inputs); a failed draw votes for no class, so a row
    may then sum to less than the draws made.
    """
    B = x.shape[0]
    a = grid_levels(x, sound) if sound else None
    with torch.inference_mode():
        counts = torch.zeros(B, num_classes + 1, dtype=torch.long, device=x.device)   # + a column of failures
        finite, drawn = torch.ones((), dtype=torch.bool, device=x.device), 0
        for k in pass_sizes(n, max(1, batch // B)):
            if sound:
                noisy, failed = sound_noisy_inputs(a, k, sigma, generator, levels=sound)  # (k, B, C, H, W)
            else:
                noisy = x.unsqueeze(0) + gaussian_noise((k, *x.shape), sigma, x.device, generator)
            with autocast(x.device.type, precision):
                logits = model(noisy.flatten(0, 1))
            finite = finite & torch.isfinite(logits).all()   # on the device: one sync at the end, not per pass
            pred = logits.argmax(1)                                                    # (k*B,)
            if sound:
                pred = torch.where(failed.flatten(), num_classes, pred)                # never a class
            slots = torch.arange(B, device=x.device).repeat(k) * (num_classes + 1) + pred  # copy j of input b -> b
            counts.view(-1).index_add_(0, slots, torch.ones_like(pred))
            drawn += k
            if stop is not None and drawn < n and stop(counts[:, :num_classes], drawn):
                break
    # votes of a model that overflowed (inf or nan outputs) are not votes of the smoothed classifier
    check(bool(finite), f"the model gave non-finite outputs on noisy inputs (sigma {sigma}, precision "
                        f"{precision}); no certificate is written from them: lower --sigma or use fp32")
    return counts[:, :num_classes].clone()  # a normal tensor: callers may update it in place outside inference mode


# ----------------------------------------------------------------------------------------------------------
# The adaptive attack on the noise sphere (Alg. 1, App. C.3; official behaviour in BASELINES.md 7.2)
# ----------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def frozen_eval(model):
    """Run attacks with model.eval() and frozen parameters (BASELINES.md 0.2); both are restored afterwards.

    Eval mode keeps BatchNorm statistics untouched; frozen parameters keep the attack's backward pass from
    computing (or accumulating) weight gradients.
    """
    was_training = model.training
    flags = [p.requires_grad for p in model.parameters()]
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        yield model
    finally:
        for p, flag in zip(model.parameters(), flags):
            p.requires_grad_(flag)
        model.train(was_training)


def sphere_pgd(model, x, y, delta, T, eps, norm_type="l2"):
    """Move each Gaussian noise along its sphere ||delta|| = const to make the base model err (Alg. 1).

    x: (B, C, H, W); y: (B,); delta: (m, B, C, H, W), the m noise draws. T PGD steps on the cross-entropy
    with step eps: l2 uses the normalised gradient, linf the sign scaled by 1/sqrt(d) (as the official code,
    so eps is comparable across norms). After each step every draw is rescaled to its original norm.
    Each draw keeps the first iterate the model misclassifies (a draw misclassified from the start comes back
    unchanged); draws never misclassified take the final iterate. T = 0 returns delta. Runs the model in eval
    mode with gradients off for the parameters and restores both, so weights and BatchNorm statistics stay.
    Returns a new tensor shaped like delta, detached.
    """
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
# Checkpoints: atomic save, tolerant load of ours and of the released ones (Cohen, SmoothAdv, ...)
# ----------------------------------------------------------------------------------------------------------


def save_checkpoint(state, path, kind="checkpoint", inputs=()):
    """torch.save through the guard (write_output): a temporary file, fsync, then os.replace, so a crash or
    power cut never leaves a torn checkpoint and a failed write (disk full) leaves the old one in place.
    inputs: files the command reads, never written over (hard links included)."""
    write_output(path, kind, lambda f: torch.save(state, f), inputs)


def numpy_array_globals():
    """What unpickling a plain numpy array needs (the RNG state in checkpoints of ours from before they stored
    it as tensors), under numpy 2's and numpy 1's module names. Object arrays stay refused: their items
    would still have to pass the weights-only unpickler."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    numeric_dtypes = [type(np.dtype(code)) for code in "?bBhHiIlLqQefdFD"]   # not object ('O') arrays
    return [np.ndarray, np.dtype, *numeric_dtypes, (_reconstruct, "numpy._core.multiarray._reconstruct"),
            (_reconstruct, "numpy.core.multiarray._reconstruct")]


def safe_load(path, device="cpu", trust=False, what="checkpoint"):
    """torch.load that cannot run code from the file (its pickle is read with weights_only=True).

    Allowed: tensors, plain Python values (dicts, lists, numbers, strings) and plain numpy arrays: every
    checkpoint released with Cohen et al., SmoothAdv, Consistency, SmoothMix, CAT-RS and the paper, and ours.
    A file whose pickle names anything else (a class, a function) could run code while loading: it is a
    UserError naming the file, what it asks for and the flag --trust-checkpoint. trust=True (that flag)
    loads with weights_only=False, which runs whatever the file holds: only for files from a trusted source.
    """
    check(os.path.isfile(path), f"{what} {path!r} not found")
    if trust:
        try:
            return torch.load(path, map_location=device, weights_only=False)
        except Exception as e:
            raise UserError(f"cannot read {what} {path!r} ({type(e).__name__}): not a torch file?") from None
    try:
        with torch.serialization.safe_globals(numpy_array_globals()):
            return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        if "Weights only load failed" not in str(e):
            raise UserError(f"cannot read {what} {path!r} ({type(e).__name__}): not a torch file?") from None
        try:
            names = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(path)) or "objects"
        except Exception:
            names = "objects"
        raise UserError(f"{what} {path!r} needs arbitrary unpickling ({names}), which can run any code it holds; "
                        f"pass --trust-checkpoint only if you trust where the file came from") from None


def load_checkpoint(path, device="cpu", trust=False):
    """Read a checkpoint dict ({'arch', 'state_dict', ...}) with safe_load; a missing or unreadable file, or one
    that would need arbitrary unpickling (unless trust), is a UserError."""
    check(os.path.isfile(path), f"checkpoint {path!r} not found; pass --checkpoint with a trained model file")
    ckpt = safe_load(path, device, trust)
    if isinstance(ckpt, dict) and "state_dict" not in ckpt and all(torch.is_tensor(v) for v in ckpt.values()):
        ckpt = {"state_dict": ckpt}  # a bare state_dict
    check(isinstance(ckpt, dict) and "state_dict" in ckpt,
          f"checkpoint {path!r} holds no 'state_dict'; expected {{'arch': ..., 'state_dict': ...}}")
    check(isinstance(ckpt["state_dict"], dict) and all(torch.is_tensor(v) for v in ckpt["state_dict"].values()),
          f"checkpoint {path!r}: its 'state_dict' is not a dict of tensors")
    for name, ok in CHECKPOINT_FIELDS.items():
        if name in ckpt and not ok(ckpt[name]):
            raise UserError(f"checkpoint {path!r}: field {name!r} has an invalid value ({type(ckpt[name]).__name__})")
    return ckpt


def read_torch_dict(path, what, fields, trust=False):
    """A torch file holding a dict (safe_load), whose `fields` ({name: check(value) -> bool}) are present and
    pass their checks; anything else is a UserError naming the file and the first bad field."""
    saved = safe_load(path, trust=trust, what=what)
    check(isinstance(saved, dict), f"{what} {path!r} must hold a dict, not {type(saved).__name__}")
    for name, ok in fields.items():
        check(name in saved, f"{what} {path!r} lacks the field {name!r}")
        if not ok(saved[name]):
            raise UserError(f"{what} {path!r}: field {name!r} has an invalid value ({type(saved[name]).__name__})")
    return saved


# The fields of our checkpoints beyond Cohen's {'arch', 'state_dict'}: present in ours, checked when present.
CHECKPOINT_FIELDS = {"arch": lambda v: isinstance(v, str), "dataset": lambda v: v is None or v in DATASETS,
                     "sigma": lambda v: v is None or (_is_number(v) and 0 < v < math.inf),
                     "epoch": lambda v: _is_int(v) and v >= 0, "args": lambda v: v is None or isinstance(v, dict),
                     "extra": lambda v: v is None or isinstance(v, dict),
                     "optimizer": lambda v: v is None or isinstance(v, dict),
                     "scheduler": lambda v: v is None or isinstance(v, dict),
                     "rng": lambda v: v is None or isinstance(v, dict)}


def strip_module_prefix(state_dict):
    """Drop every `module.` segment that DataParallel/DDP put into the keys (`1.module.conv1.weight`)."""
    return {".".join(p for p in k.split(".") if p != "module"): v for k, v in state_dict.items()}


def load_model(path, dataset=None, arch=None, device="cpu", trust=False):
    """Build the architecture named by the checkpoint (or `arch`) and load its weights with strict key matching.

    Returns (model in eval mode on device, checkpoint dict). Dataset defaults to the checkpoint's, else
    guessed from the architecture. A state_dict that does not fit is a UserError naming the first bad keys.
    trust: see safe_load (--trust-checkpoint).
    """
    ckpt = load_checkpoint(path, device, trust)
    arch = arch or ckpt.get("arch")
    check(arch is not None, f"checkpoint {path!r} names no architecture; pass --arch")
    dataset = dataset or ckpt.get("dataset") or {"resnet50": "imagenet", "digits_cnn": "digits",
                                                 "lenet": "digits"}.get(arch, "cifar10")
    check(arch in ARCHS, f"checkpoint {path!r} names an unknown architecture {arch!r}; pass --arch")
    model = get_architecture(arch, dataset)
    try:
        model.load_state_dict(strip_module_prefix(ckpt["state_dict"]), strict=True)
    except RuntimeError as e:
        first = str(e).split("\n\t")[1][:200] if "\n\t" in str(e) else str(e)[:200]
        raise UserError(f"checkpoint {path!r} does not fit architecture {arch!r} on {dataset}: {first}") from None
    bad = [k for k, v in ckpt["state_dict"].items() if v.is_floating_point() and not torch.isfinite(v).all()]
    check(not bad, f"checkpoint {path!r} has non-finite weights ({', '.join(bad[:2])}): a diverged run?")
    model = model.to(device).eval()
    try:   # one forward pass on a dummy input: a model that cannot take this dataset's inputs fails here
        with torch.no_grad():
            model(torch.zeros(1, *INPUT_SHAPE[dataset], device=device))
    except RuntimeError as e:
        raise UserError(f"checkpoint {path!r} ({arch}) cannot take {dataset} inputs of shape "
                        f"{INPUT_SHAPE[dataset]} ({str(e).splitlines()[0][:120]}); pass the right --dataset") from None
    return model, ckpt


# ----------------------------------------------------------------------------------------------------------
# Small utilities shared by the scripts
# ----------------------------------------------------------------------------------------------------------

def get_device(name=None):
    """torch.device from --device, default cuda when available."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    check(device.type != "cuda" or torch.cuda.is_available(), f"device {name!r} requested but CUDA is not available")
    return device


def seed_everything(seed):
    """Seed Python's, numpy's and torch's global generators."""
    import random
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def format_eta(done, total, start):
    """'12.3/s, ETA 0:04:10' for `done` of `total` items since time.time() == start."""
    elapsed = time.time() - start
    rate = done / elapsed if elapsed > 0 else 0.0
    eta = datetime.timedelta(seconds=int((total - done) / rate)) if rate > 0 else "?"
    return f"{rate:.2f}/s, ETA {eta}"


# ----------------------------------------------------------------------------------------------------------
# The shared training loop (App. C.1): SGD, step schedule, m-chunk convention, noisy evaluation, logs
# ----------------------------------------------------------------------------------------------------------

def check_training_settings(settings):
    """What every training script refuses, before anything is written: non-finite numbers, lr <= 0, negative
    momentum, weight decay or seed. settings: the run's flags as a dict."""
    check_finite(settings)
    if settings.get("sigma") is not None:
        check_sigma(settings["sigma"], precision=settings.get("amp") or "fp32")
    if settings.get("dataset") in INPUT_SHAPE and isinstance(settings.get("batch"), int):
        m = settings.get("m") if isinstance(settings.get("m"), int) else 1
        check_batch_bytes(settings["batch"] * max(m, 1), INPUT_SHAPE[settings["dataset"]], "--batch x --m")
    check(settings["lr"] > 0, f"--lr must be > 0, got {settings['lr']}")
    check(settings["momentum"] >= 0 and settings["weight_decay"] >= 0,
          f"--momentum and --weight_decay must be >= 0, got {settings['momentum']} and {settings['weight_decay']}")
    check(settings["seed"] >= 0, f"--seed must be >= 0, got {settings['seed']}")


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
    """Cut a loader batch into m consecutive chunks of floor(B/m) examples (BASELINES.md 0.1).

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
    noisy = (x.unsqueeze(0) + sigma * torch.randn(m, *x.shape, device=x.device)).flatten(0, 1)  # (m*b, ...)
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
        logits = model(x + gaussian_noise(x.shape, sigma, device, generator))
        loss_sum += F.cross_entropy(logits, y, reduction="sum")
        correct += (logits.argmax(1) == y).sum()
        total += len(y)
    return {"test_loss": (loss_sum / total).item(), "test_acc_noisy": (correct / total).item()}


class TSVLog:
    """Append rows to a TSV file with a fixed header, each row flushed at once (a killed run keeps its rows).

    A new log (append=False) replaces an earlier log of the same kind; every write goes through the guard."""

    def __init__(self, path, columns, kind, append=False, sync=False, inputs=()):
        self.columns, self.sync = list(columns), sync   # sync: fsync every row (the epoch log)
        header = "\t".join(self.columns)
        if not append:
            write_output(path, kind, lambda f: f.write((header + "\n").encode()), inputs, append=True)
        self.file = open_append(path, kind, header, inputs)

    def row(self, **values):
        cells = [values.get(c, "") for c in self.columns]
        print("\t".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in cells), file=self.file, flush=True)
        if self.sync:
            os.fsync(self.file.fileno())

    def close(self):
        self.file.close()


def make_outdir(outdir):
    """Create the run folder (or raise a UserError saying it is not writable); returns it."""
    try:
        os.makedirs(outdir, exist_ok=True)
        probe = os.path.join(outdir, f".write_test{os.getpid()}")  # per process: torchrun ranks probe at once
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise UserError(f"cannot write to output folder {outdir!r} ({e.strerror}); pass a writable --outdir") from None
    return outdir


# ----------------------------------------------------------------------------------------------------------
# Run plumbing of the training scripts: per-epoch seeds, loaders, resumable checkpoints, the epoch log,
# per-example gradient norms (Table 2, Fig. 5) and DistributedDataParallel under torchrun
# ----------------------------------------------------------------------------------------------------------

CHECKPOINT = "checkpoint.pth.tar"
# Default schedule per dataset (App. C.1: CIFAR-10 150 epochs, lr x0.1 every 50; ImageNet 90, every 30).
# digits is our CPU demo, not in the paper: a short schedule that trains the small CNN in seconds.
SCHEDULE = {"cifar10": {"epochs": 150, "lr_step": 50}, "imagenet": {"epochs": 90, "lr_step": 30},
            "digits": {"epochs": 20, "lr_step": 10}}


def get_rank():
    """This process's rank under torchrun (0 without a process group)."""
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size():
    """Number of training processes under torchrun (1 without a process group)."""
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process():
    """True on rank 0: the one process that evaluates, logs and writes checkpoints."""
    return get_rank() == 0


def setup_distributed(device_name=None):
    """The training device; under torchrun (even with one process) also join the process group.

    Backend nccl on GPUs (one GPU per LOCAL_RANK), gloo on CPU (so it can be tried on a laptop).
    Without torchrun this is get_device(device_name).
    """
    device = get_device(device_name)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:   # not started by torchrun
        return device
    import torch.distributed as dist
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def end_distributed(wait=True):
    """Leave the process group (under torchrun; a no-op otherwise). Call it once every rank is done.

    wait=True first meets the other ranks at a barrier, so no rank tears its connections down while another
    still uses them. Without destroy_process_group, gloo's communication threads are still running when the
    interpreter exits, and C++ aborts the process (SIGABRT, "terminate called without an active exception"):
    the rank that finishes first (any rank but 0, which still saves the checkpoint) died that way.
    """
    import gc
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()   # a DDP model caught in a reference cycle still holds the group: free it, so that destroying
    if wait:       # the group really joins gloo's threads (once, under load, a resume still aborted that way)
        dist.barrier()
    dist.destroy_process_group()


class AllReduceSum(torch.autograd.Function):
    """Sum of a tensor over all ranks, differentiable: the gradient of a sum over ranks is again that sum."""

    @staticmethod
    def forward(ctx, tensor):
        import torch.distributed as dist
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class GlooSyncBatchNorm(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics are those of the whole batch across ranks, for CPU (gloo) ranks.

    torch.nn.SyncBatchNorm does this on GPUs only; this is the same computation with one all_reduce of
    (sum, sum of squares, count) per layer, differentiated through AllReduceSum. Eval mode, and a
    run without a process group, behave as BatchNorm2d. State-dict keys are BatchNorm2d's.
    """

    def forward(self, x):
        import torch.distributed as dist
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return super().forward(x)
        c = x.shape[1]
        xf = x.transpose(0, 1).reshape(c, -1).float()                            # (C, local B*H*W)
        count = torch.full((1,), float(xf.shape[1]), device=x.device)
        stats = AllReduceSum.apply(torch.cat([xf.sum(1), (xf * xf).sum(1), count]))  # sums over every rank
        n = stats[-1]
        mean = stats[:c] / n
        var = (stats[c:2 * c] / n - mean * mean).clamp(min=0)                   # biased, as BatchNorm
        with torch.no_grad():
            self.num_batches_tracked += 1
            factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
            self.running_mean.lerp_(mean.detach(), factor)
            self.running_var.lerp_(var.detach() * n / (n - 1).clamp(min=1), factor)  # unbiased, as BatchNorm
        shape = (1, c, 1, 1)
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        return (out * self.weight.view(shape) + self.bias.view(shape)).to(x.dtype)


def sync_batchnorm(model, device):
    """Every BatchNorm of the model synchronised across ranks (--sync-bn): torch.nn.SyncBatchNorm on GPUs,
    GlooSyncBatchNorm on CPU ranks. Parameters and buffers are kept (moved, not copied)."""
    if device.type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for name, child in model.named_children():
        if type(child) is nn.BatchNorm2d and child.affine and child.track_running_stats:
            sync = GlooSyncBatchNorm(child.num_features, child.eps, child.momentum, child.affine,
                                     child.track_running_stats)
            # the same tensors, not copies: the optimizer already holds these parameters
            sync.weight, sync.bias = child.weight, child.bias
            sync.running_mean, sync.running_var = child.running_mean, child.running_var
            sync.num_batches_tracked = child.num_batches_tracked
            setattr(model, name, sync)
        else:
            sync_batchnorm(child, device)
    return model


def run_folder_lock(outdir):
    """The run folder, created, and locked for this run on rank 0 (a context manager): two training runs on one
    --outdir would overwrite each other's checkpoints and log; the second one gets a UserError instead."""
    make_outdir(outdir)
    if not is_main_process():
        return contextlib.nullcontext()
    return exclusive_lock(os.path.join(outdir, "run.lock"), f"run folder {outdir!r}")


def wrap_model(model, device, sync_bn=False):
    """DistributedDataParallel around the model under torchrun (gradients averaged across ranks), else the model.

    sync_bn: BatchNorm statistics over the whole batch of all ranks (--sync-bn) instead of each rank's
    batch // world_size inputs; without torchrun it changes nothing.
    """
    if get_world_size() == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel
    if sync_bn:
        model = sync_batchnorm(model, device)
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)


def unwrap(model):
    """The plain model inside a DistributedDataParallel/DataParallel wrapper (attacks, evaluation, saving)."""
    return model.module if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) else model


def broadcast(tensor):
    """Rank 0's tensor on every rank (in place); a no-op without a process group. Keeps kept sets identical."""
    if get_world_size() > 1:
        import torch.distributed as dist
        dist.broadcast(tensor, src=0)
    return tensor


def epoch_seed(seed, epoch, stream=0):
    """An integer seed derived from (seed, epoch, stream); streams separate the sampler from each rank's noise."""
    state = np.random.SeedSequence([int(seed), int(epoch), int(stream)]).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 32 | int(state[1])


EVAL_STREAM = 2 ** 21   # epoch_seed stream of the noisy test evaluation


def eval_generator(seed, epoch, device):
    """The generator of epoch `epoch`'s noisy test evaluation: seeded by (seed, epoch) alone."""
    g = torch.Generator(device=device)
    g.manual_seed(epoch_seed(seed, epoch, EVAL_STREAM))
    return g


def seed_epoch(seed, epoch):
    """Reseed all global generators at the start of an epoch (noise, attacks).

    Each epoch's randomness then depends only on (seed, epoch, rank), so a run resumed at an epoch
    boundary draws exactly what the uninterrupted run drew.
    """
    seed_everything(epoch_seed(seed, epoch, 1 + get_rank()))


AUGMENT_STREAM = 2 ** 20   # epoch_seed stream of the augmentation seeds (0: the sampler, 1 + rank: the noise)


class EpochSampler(torch.utils.data.Sampler):
    """The current epoch's draws as (index, augmentation seed) pairs; TrainLoader.epoch sets them."""

    def __init__(self):
        self.items = []

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        return iter(self.items)


class TrainLoader:
    """The training loader of a whole run: one DataLoader whose sampler is set anew each epoch.

    Reusing one loader lets its worker processes live across epochs (persistent_workers: no restart and
    dataset re-read at every epoch, which keeps a GPU fed). Exact resume does not depend on the workers'
    state: each draw's augmentation is seeded from (seed, epoch, its position in the epoch) wherever it is
    loaded, so an epoch's batches depend only on (seed, epoch), not on --workers or on earlier epochs.
    Use: loaders = TrainLoader(train_set, batch, workers, seed); each epoch: loader = loaders.epoch(epoch).
    """

    def __init__(self, dataset, batch, workers, seed):
        self.dataset, self.seed, self.sampler = dataset, seed, EpochSampler()
        world = get_world_size()
        # Under torchrun every rank gets batch // world_size examples per batch. The loader's own generator
        # keeps its per-epoch seed draw out of the global stream (the training noise).
        self.loader = torch.utils.data.DataLoader(
            WithIndex(dataset), batch_size=max(1, batch // world), sampler=self.sampler, num_workers=workers,
            persistent_workers=workers > 0, pin_memory=torch.cuda.is_available(),
            generator=torch.Generator().manual_seed(epoch_seed(seed, 0, AUGMENT_STREAM + 1)))

    def epoch(self, epoch, indices=None, weights=None, num_samples=None):
        """The loader of one training epoch; it yields (x, y, idx) with idx the example's index in the dataset.

        indices=None gives one shuffled pass. Otherwise the epoch draws num_samples examples (default
        len(dataset): Alg. 2 keeps |D| draws per epoch after discarding) with replacement from `indices`
        (e.g. the kept examples), uniformly, or proportionally to `weights` (one non-negative weight per entry
        of indices). The draws, their order and their augmentation depend only on (seed, epoch), so a resumed
        run sees the same batches. Under torchrun every rank gets an equal share of the draws.
        """
        g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch, 0))  # stream 0: the same on every rank
        if indices is None:
            order = torch.randperm(len(self.dataset), generator=g)
        else:
            indices = torch.as_tensor(indices, dtype=torch.long)
            check(len(indices) > 0, "no training examples left to sample from (every example was discarded)")
            num_samples = len(self.dataset) if num_samples is None else num_samples
            if weights is None:
                pick = torch.randint(len(indices), (num_samples,), generator=g)
            else:
                pick = torch.multinomial(torch.as_tensor(weights, dtype=torch.double), num_samples, True, generator=g)
            order = indices[pick]
        base = epoch_seed(self.seed, epoch, AUGMENT_STREAM) % 2 ** 62
        items = [(i, base + k) for k, i in enumerate(order.tolist())]   # by position: a repeated draw differs
        world = get_world_size()
        if world > 1:
            items = items[get_rank()::world][:len(items) // world]
        self.sampler.items = items
        return self.loader


def make_test_loader(dataset, batch, workers):
    """Plain in-order loader of (x, y) for evaluation."""
    # its own generator: starting the workers then draws nothing from the global one (the training noise)
    return torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=False, num_workers=workers,
                                       persistent_workers=workers > 0, pin_memory=torch.cuda.is_available(),
                                       generator=torch.Generator().manual_seed(0))


def _rng_state():
    """Every global generator's state as tensors and plain values (so checkpoints load with weights_only)."""
    import random
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
    state = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state):
    import random
    if not state:
        return
    torch.set_rng_state(state["torch"].cpu())
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):   # ours since checkpoints hold tensors only; before: numpy's legacy tuple
        numpy_state = dict(numpy_state, state=dict(numpy_state["state"],
                                                   key=numpy_state["state"]["key"].numpy().astype(np.uint32)))
    np.random.set_state(numpy_state)
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save_training_checkpoint(outdir, model, optimizer, scheduler, epoch, args, extra=None, save_every=0):
    """Write outdir/checkpoint.pth.tar after `epoch` completed epochs (atomically), and keep a copy
    checkpoint_epoch{epoch}.pth.tar every `save_every` epochs (0: never). Only rank 0 writes.

    args: the run's arguments (Namespace or dict) with at least arch, dataset, sigma. extra: a dict of
    the method's state needed to resume (kept indices, sampling weights, ...). The file is a Cohen-style
    checkpoint ({'arch', 'state_dict', ...}) that certify.py reads unchanged.
    """
    if not is_main_process():
        return
    args = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
    state = {"arch": args["arch"], "dataset": args["dataset"], "sigma": args["sigma"], "epoch": epoch,
             "state_dict": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "args": args, "rng": _rng_state(), "extra": extra or {}}
    save_checkpoint(state, os.path.join(outdir, CHECKPOINT))
    if save_every and epoch % save_every == 0:
        save_checkpoint(state, os.path.join(outdir, f"checkpoint_epoch{epoch}.pth.tar"))


# Settings a resumed run may change: where and how fast it runs, how long; never what it computes.
RESUME_MAY_CHANGE = {"epochs", "resume", "workers", "device", "outdir", "data_dir", "max_batches", "save_every",
                     "trust_checkpoint", "gradnorm", "probe", "note", "channels_last"}


def resume_mismatches(saved_args, args):
    """'key old -> new' for every setting of args that differs from the checkpoint's saved arguments
    (only keys both know, and not RESUME_MAY_CHANGE). The run identity ('run': script and data) is compared
    part by part, so the message names what differs."""
    diff = []
    for k in sorted(set(saved_args) & set(args) - RESUME_MAY_CHANGE):
        old, new = saved_args[k], args[k]
        if k == "run" and isinstance(old, dict) and isinstance(new, dict):
            if old.get("script") != new.get("script"):
                diff.append(f"script {old.get('script')!r} -> {new.get('script')!r}")
            if old.get("data") != new.get("data"):
                diff.append("data: other images than the run was trained on (--data-dir?)")
        elif old != new and not (isinstance(new, (list, tuple)) and list(new) == list(old or [])):
            diff.append(f"{k} {old!r} -> {new!r}")
    return diff


def remove_stale_temporaries(outdir):
    """Remove the *.tmp<pid> files a killed or failed writer left in outdir (we hold the run's lock)."""
    import glob
    import re
    for path in glob.glob(os.path.join(glob.escape(outdir), "*.tmp*")):
        if re.search(r"\.tmp\d+$", path):
            os.remove(path)


def start_or_resume(model, optimizer, scheduler, outdir, resume, expect=None, trust=False, args=None):
    """Start a new run in outdir, or (resume=True) restore it from outdir/checkpoint.pth.tar.

    Returns (start_epoch, extra): the number of epochs already done (0 for a new run) and the `extra`
    dict saved with the checkpoint ({} for a new run). A new run refuses a folder that already holds a
    checkpoint (nothing is overwritten silently); resume without one is a UserError. expect: optional
    dict such as {'arch': ..., 'dataset': ..., 'sigma': ...} that the checkpoint must match. args: the run's
    settings (a dict); on resume every one that is not RESUME_MAY_CHANGE must equal the checkpoint's (lr, m,
    seed, batch, ...: the restored optimizer and schedule would otherwise contradict args.json).
    """
    remove_stale_temporaries(outdir)
    path = os.path.join(outdir, CHECKPOINT)
    if not resume:
        check(not os.path.isfile(path), f"{outdir!r} already holds a run ({CHECKPOINT}); pass --resume to "
                                        f"continue it, or choose another --outdir")
        return 0, {}
    check(os.path.isfile(path), f"--resume: no {CHECKPOINT} in {outdir!r}; start the run without --resume")
    ckpt = load_checkpoint(path, next(model.parameters()).device, trust)
    missing = [k for k in ("epoch", "optimizer", "scheduler") if k not in ckpt]
    check(not missing, f"--resume: {path!r} lacks {', '.join(missing)} (not a checkpoint of a training run "
                       f"of ours); start a new run in another --outdir")
    for key, value in (expect or {}).items():
        check(ckpt.get(key) == value, f"--resume: the checkpoint in {outdir!r} has {key}={ckpt.get(key)!r}, "
                                      f"this run has {key}={value!r}; use the same settings or another --outdir")
    diff = resume_mismatches(ckpt.get("args") or {}, args or {})
    check(not diff, f"--resume: {outdir!r} was trained with other settings ({'; '.join(diff)}); resume with "
                    f"the same ones, or start a new run in another --outdir")
    try:
        unwrap(model).load_state_dict(strip_module_prefix(ckpt["state_dict"]))
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise UserError(f"--resume: {path!r} does not fit this model/optimizer ({type(e).__name__}); "
                        f"use the same settings or another --outdir") from None
    _set_rng_state(ckpt.get("rng"))
    return int(ckpt["epoch"]), ckpt.get("extra") or {}


def open_train_log(outdir, start_epoch):
    """outdir/log.tsv with TRAIN_LOG_COLUMNS (None on ranks other than 0).

    On resume the rows of epochs >= start_epoch are dropped first (they are about to be redone), so the
    log never holds an epoch twice.
    """
    if not is_main_process():
        return None
    path = os.path.join(outdir, "log.tsv")
    if start_epoch > 0 and os.path.isfile(path):
        rows = [r for r in read_train_log(path) if int(r["epoch"]) < start_epoch]
        text = "".join("\t".join(str(r[c]) for c in TRAIN_LOG_COLUMNS) + "\n" for r in rows)
        header = "\t".join(TRAIN_LOG_COLUMNS) + "\n"
        write_output(path, "training log", lambda f: f.write((header + text).encode()), append=True)
    return TSVLog(path, TRAIN_LOG_COLUMNS, "training log", append=start_epoch > 0, sync=True)


def log_epoch(log, epoch, epochs, run_start, first_epoch, row):
    """One TSV row (0-based epoch) and one readable stdout line with the run's ETA; rank 0 only.

    row: dict with the other TRAIN_LOG_COLUMNS (time, lr, train_loss, ...). run_start: time.time() when
    this process started training at epoch first_epoch (the ETA uses only epochs run in this process).
    """
    if log is None:
        return
    log.row(epoch=epoch, **row)
    done = epoch + 1 - first_epoch
    per_epoch = (time.time() - run_start) / max(done, 1)
    eta = datetime.timedelta(seconds=int(per_epoch * (epochs - epoch - 1)))
    print(f"epoch {epoch + 1}/{epochs}  {row['time']:.1f}s  lr {row['lr']:.4g}  "
          f"train loss {row['train_loss']:.4f} acc {row['train_acc']:.4f}  "
          f"noisy test loss {row['test_loss']:.4f} acc {row['test_acc_noisy']:.4f}  "
          f"kept {row['kept']}  ETA {eta}", flush=True)


def progress_line(prefix, every=60.0):
    """A progress callable(done, total) for train_epoch: one '<prefix> batch 12/196, 3.1/s, ETA ...' line.

    On a terminal the line is rewritten in place on stderr; otherwise (a log file) a line is printed at
    most every `every` seconds, so batch jobs show progress without flooding their logs.
    """
    start, last = time.time(), [time.time()]

    def show(done, total):
        if not is_main_process():
            return
        text = f"{prefix} batch {done}/{total}, {format_eta(done, total, start)}"
        if sys.stderr.isatty():
            sys.stderr.write("\r" + text + ("\033[K\n" if done == total else "\033[K"))
        elif time.time() - last[0] >= every and done < total:
            last[0] = time.time()
            sys.stderr.write(text + "\n")
        sys.stderr.flush()
    return show


@torch.no_grad()
def count_correct(model, dataset, indices, sigma, n, batch, workers=0):
    """For each example dataset[i], i in indices: how many of n noisy copies the model labels correctly.

    The training-time pA estimate of Alg. 2 (an empirical frequency of the TRUE label, not a bound): the
    model in eval mode, the examples as `dataset` yields them (with its augmentation, as the official code),
    noise from the global generator. Returns int64 (len(indices),) counts and the labels, both on CPU.
    """
    net = unwrap(model)
    was_training = net.training
    net.eval()
    device = next(net.parameters()).device
    subset = torch.utils.data.Subset(dataset, [int(i) for i in indices])
    per_batch = max(1, batch // n)  # examples per forward pass, each with (up to) batch noisy copies
    loader = torch.utils.data.DataLoader(subset, batch_size=per_batch, shuffle=False, num_workers=workers)
    counts, labels, num_classes = [], [], None
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        num_classes = num_classes or net(x[:1]).shape[1]
        votes = sample_counts(net, x, sigma, n, batch, num_classes)  # (B, K)
        counts.append(votes.gather(1, y.view(-1, 1)).squeeze(1).cpu())
        labels.append(y.cpu())
    net.train(was_training)
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


def measure_grad_norms(model, dataset, loss_fn, sigma, probe, n, seed, batch, path, inputs=()):
    """The gradient-norm mode of the training scripts (Table 2, Fig. 5): TSV `idx label pA grad_norm`.

    Probe set: the first `probe` examples of a permutation of `dataset` seeded by `seed` (pass the
    training set without augmentation). pA: fraction of n noisy copies labelled correctly (count_correct).
    grad_norm: per_example_grad_norms of loss_fn. Returns the rows as a dict of lists.
    """
    seed_everything(seed)
    probe_idx = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:probe]
    counts, labels = count_correct(model, dataset, probe_idx, sigma, n, batch)
    device = next(unwrap(model).parameters()).device
    xs = torch.stack([dataset[int(i)][0] for i in probe_idx]).to(device)
    norms = per_example_grad_norms(model, loss_fn, xs, labels.to(device), probe_idx.to(device))
    rows = {"idx": probe_idx.tolist(), "label": labels.tolist(), "pA": (counts.double() / n).tolist(),
            "grad_norm": norms.tolist()}
    log = TSVLog(path, GRADNORM_COLUMNS, "gradient norms", inputs=inputs)
    for i in range(len(probe_idx)):
        log.row(**{k: v[i] for k, v in rows.items()})
    log.close()
    return rows

"""The run machinery of the scripts: what a command does around the paper's building blocks.

Flags checked before any work, one-line errors, signals; the output guard (one way to write any file: a
temporary file renamed into place as the command ends; one lock per run); run identity and each run's record
(a log's sidecar, a training run's checkpoint); checkpoints loaded without running code; resumable training
runs and their logs; torchrun plumbing. The building blocks (common.py, and
the paper's functions in each script: certify, ours_loss, the baselines' losses, acr, compare_sides, ...)
never call into this module: they take arguments and return values, so each can be pasted alone
(tools/copy_size.py measures it; tests/test_paste.py keeps it so). The scripts' main paths call them
and do the writing, broadcasting and printing here.
"""
import argparse
import contextlib
import datetime
import errno
import functools
import glob
import json
import math
import os
import re
import sys
import time

import numpy as np
import torch
import torch.nn as nn

import common
import readers


# ----------------------------------------------------------------------------------------------------------
# Commands: one-line errors (common.UserError -> exit code 2), signals, checks of flags before any work
# ----------------------------------------------------------------------------------------------------------

FLAG_NAMES = {}   # dest -> the flag as typed (--elastic-m for elastic_m), for messages about a parsed value
FLAG_DEFAULTS = {}   # dest -> its default, of the last command line parsed (check_mode_options)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is a single line on stderr (exit code 2)."""

    def parse_args(self, args=None, namespace=None):
        FLAG_NAMES.update({a.dest: max(a.option_strings, key=len) for a in self._actions if a.option_strings})
        FLAG_DEFAULTS.clear()
        FLAG_DEFAULTS.update({a.dest: a.default for a in self._actions if a.option_strings})
        return super().parse_args(args, namespace)

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


class Interrupted(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C (SIGINT) so that every `finally` and every temporary-file cleanup runs."""


def _raise_interrupted(signum, frame):
    """The handler of SIGTERM and SIGINT: raise Interrupted or KeyboardInterrupt where the command is."""
    import signal
    raise Interrupted() if signum == signal.SIGTERM else KeyboardInterrupt()


def run(main, exit_process=False):
    """Call main(); a UserError becomes one line on stderr and exit code 2.

    SIGINT (Ctrl-C) and SIGTERM stop the command with one line and exit code 130 or 143, every file valid and
    resumable (write_output, open_append).
    Under torchrun the process group is always torn down before the process exits (end_distributed): a
    gloo group left alive at exit aborts the process ("terminate called without an active exception").
    exit_process (a script's `if __name__ == "__main__"`): where this process runs only this command (its
    command line is the script's), it ends here without tearing the interpreter down, after the atexit
    handlers and a flush of stdout and stderr: every file is closed by then, and torch's module teardown
    would cost 0.6 s of CPU per command. Otherwise (from Python, or a runner of several) it raises SystemExit.
    """
    orig = list(getattr(sys, "orig_argv", []))   # `python [options] script.py args`, not -m (a profiler) or -c
    own = sys.argv[:1] != [""] and orig[-len(sys.argv):] == sys.argv and \
        not any(a.startswith(("-m", "-c")) for a in orig[1:-len(sys.argv)])
    if not (exit_process and own):
        return _run(main)
    try:
        _run(main)
        code = 0
    except SystemExit as e:
        code = e.code
    if not isinstance(code, int):   # sys.exit("text") or sys.exit(None), as the interpreter handles them
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    import atexit
    atexit._run_exitfuncs()   # what the interpreter runs at exit (worker processes, logging), then no teardown
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):   # a broken pipe (`| head`), a closed stream (None)
            pass
    os._exit(code)


class GuardedStream:
    """sys.stdout or sys.stderr while a command runs: a write or flush to a stream that is closed (`>&-`: Python
    then has None) or broken (`| head` that has exited) is dropped from then on instead of raising, so what
    the terminal no longer shows never stops or fails the work, nor turns into a traceback."""

    def __init__(self, stream):
        self.stream, self.broken = stream, stream is None

    def write(self, text):
        if not self.broken:
            try:
                return self.stream.write(text)
            except (OSError, ValueError):   # EPIPE, EBADF, a closed file object
                self.broken = True
        return len(text)

    def flush(self):
        if not self.broken:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self.broken = True

    def isatty(self):
        return not self.broken and self.stream.isatty()

    def __getattr__(self, name):   # encoding, fileno, ...: the stream's own (None's: an AttributeError)
        return getattr(self.stream, name)


def is_out_of_memory(e):
    """True for any out-of-memory error: Python's MemoryError, or torch's allocator failing on a GPU
    (torch.OutOfMemoryError) or on the CPU (a RuntimeError "can't allocate memory")."""
    text = str(e)
    return isinstance(e, MemoryError) or isinstance(e, getattr(torch, "OutOfMemoryError", MemoryError)) or (
        isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower()))


def _run(main):
    """run's body: streams guarded, signals raised as exceptions, outputs renamed into place once main() ends
    well, and every failure turned into one line on stderr and an exit code."""
    import signal
    global _STAGED
    saved, outer, _STAGED = (sys.stdout, sys.stderr), _STAGED, {}   # a command run inside another keeps its own
    for stream in saved:   # a file name that is not UTF-8 (in a label, a message) as \xff
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    sys.stdout, sys.stderr = GuardedStream(saved[0]), GuardedStream(saved[1])
    try:
        signal.signal(signal.SIGTERM, _raise_interrupted)
        signal.signal(signal.SIGINT, _raise_interrupted)   # the scripts stop quietly while importing
    except ValueError:   # not the main thread (a test runner's worker): keep the default
        pass
    try:
        try:
            main()
        finally:   # a normal end or sys.exit: every output was checked and written, now they replace their files
            while _STAGED and sys.exc_info()[0] in (None, SystemExit):
                path = next(iter(_STAGED))   # in the order they were written
                _install(path, *_STAGED.pop(path))
    except common.UserError as e:
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
    except (MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        sizes = [FLAG_NAMES.get(d, "--" + d) for d in ("batch", "N", "m") if d in FLAG_DEFAULTS]   # this command's
        sys.stderr.write(f"error: out of memory{'; lower ' + ' or '.join(sizes) if sizes else ''}; "
                         f"{written_so_far()}\n")
        sys.exit(2)
    finally:
        for tmp, _ in (_STAGED or {}).values():
            _discard(tmp)
        _STAGED = outer
        end_distributed(wait=False)
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved


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
                common.check(math.isfinite(v) and abs(v) <= FLOAT32_MAX,
                             f"{FLAG_NAMES.get(key, '--' + key)} must be a finite number in float32 (|x| < 3.4e38), got "
                             f"{value}")
            elif isinstance(v, int) and not isinstance(v, bool):
                common.check(abs(v) < 2 ** 63, f"{FLAG_NAMES.get(key, '--' + key)} must fit in 64 bits, got {value}")


def check_mode_options(args, modes, alone=None):
    """modes: {option: the modes it takes effect in} (argparse dests; an option not given is None, a mode off is
    falsy). An option given while none of its modes is on is a UserError naming both: silently ignoring it would
    run something other than what was asked. alone: {mode: the options it uses}; with that mode on, any other
    option set away from its default (ArgumentParser records them) is refused the same way."""
    def flag(dest):
        return FLAG_NAMES.get(dest, "--" + dest.replace("_", "-"))
    for option, needs in modes.items():
        if getattr(args, option) is not None and not any(getattr(args, m) for m in needs):
            common.check(False, f"{flag(option)} goes with {' or '.join(flag(m) for m in needs)}")
    for mode, used in (alone or {}).items():
        if getattr(args, mode):
            unused = [d for d, v in vars(args).items()
                      if d != mode and d not in used and d in FLAG_DEFAULTS and v != FLAG_DEFAULTS[d]]
            common.check(not unused, f"{', '.join(map(flag, unused))} {'does' if len(unused) == 1 else 'do'} not "
                                     f"apply to {flag(mode)}")


def check_sigma(sigma, flag="--sigma", precision="fp32"):
    """sigma is a noise level the float32 (or fp16) arithmetic of sampling and the model can carry: in
    SIGMA_RANGE, and at most SIGMA_MAX_FP16 under fp16. A certificate at a sigma the arithmetic cannot carry
    (the noise rounded away, or overflowing to inf) would be wrong, so it is refused before anything runs."""
    low, high = SIGMA_RANGE[0], SIGMA_MAX_FP16 if precision == "fp16" else SIGMA_RANGE[1]
    common.check(isinstance(sigma, (int, float)) and not isinstance(sigma, bool) and low <= sigma <= high,
                 f"{flag} must lie in [{low:g}, {high:g}]{' under fp16' if precision == 'fp16' else ''} (inputs are in "
                 f"[0, 1]), got {sigma}")


def check_batch_bytes(inputs, shape, what="--batch"):
    """`inputs` noisy inputs of `shape` in float32 fit in MAX_BATCH_BYTES: checked before anything is allocated."""
    size = inputs * 4 * math.prod(shape)
    common.check(size <= MAX_BATCH_BYTES, f"{what} asks for {inputs} noisy inputs of shape {tuple(shape)} at once "
                                   f"({size / 2 ** 30:.3g} GiB); lower it")


# ----------------------------------------------------------------------------------------------------------
# Outputs: one way to write any file, one lock per run
# ----------------------------------------------------------------------------------------------------------

# Every file a script writes goes through write_output (whole files, renamed into place) or open_append (logs
# that grow a line at a time). What a run is and what it wrote is its own record, the file a resume reads: a
# certification log's sidecar (<log>.json), a training run's checkpoint. Tables, figures and reports have their
# folder's record (outputs.json).

def open_file(path, mode, new=False, encoding=None):
    """Open a file this project writes (an appended log, a temporary, a lock): never through a symbolic link,
    never waiting on a FIFO, never a device. mode: "r", "a" or "w" (plus "b" for bytes); new=True creates the
    file or refuses (O_EXCL); "w" does not truncate. A refusal is a UserError naming the path.

    O_NOFOLLOW refuses a link as the last part of the path; O_NONBLOCK makes the open of a FIFO return at once,
    and the type is read from the open descriptor, so nothing can swap the file in between.
    """
    import stat
    flags = {"r": os.O_RDONLY, "a": os.O_WRONLY | os.O_APPEND | os.O_CREAT, "w": os.O_WRONLY | os.O_CREAT}[mode[0]]
    flags |= getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    flags |= (os.O_EXCL if new else 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if os.path.islink(path):
            raise common.UserError(f"{path!r} is a symbolic link (to {os.readlink(path)!r}); this project writes "
                                   f"only plain files: move the link away") from None
        if new and e.errno == errno.EEXIST:
            raise common.UserError(f"{path!r} exists (a file left by another program?); move it away") from None
        if not os.path.exists(path) or stat.S_ISREG(os.stat(path).st_mode):
            raise common.UserError(f"cannot open {path!r} ({e.strerror or type(e).__name__})") from None
        raise common.UserError(f"{path!r} is not a regular file (a FIFO, device or socket); move it away") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise common.UserError(f"{path!r} is not a regular file (a FIFO, device or socket); move it away")
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode, encoding=encoding)
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def exclusive_lock(path, what, wait=False):
    """Hold the kernel's exclusive lock (flock) on the lock file `path` for the block: one run per output
    (certify.py's <outfile>.lock). A second run asking for it gets a UserError at once (wait: it blocks until
    the lock is free). The kernel drops the lock however the process ends, so a killed run leaves no stale
    lock. The file is removed when the block ends (an error or a signal too); after SIGKILL an empty file
    stays and holds nothing. Removing it races with a process that opened it just before, which may then lock
    the removed file: so after locking, the path must still name the file locked, else the new one is taken.
    Where fcntl does not exist (Windows) there is no lock.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    while True:
        f = open_file(path, "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
                    break
        except BlockingIOError:
            f.close()
            raise common.UserError(f"{what} is in use by another run (it holds {path}); wait for that run to end, "
                                   f"or choose another output") from None
        except BaseException:
            f.close()
            raise
        f.close()   # the holder removed it after this process opened it: take the file now under that name
    _HELD_LOCKS.add(os.path.realpath(path))
    try:
        yield
    finally:
        _HELD_LOCKS.discard(os.path.realpath(path))
        with contextlib.suppress(OSError):
            os.remove(path)   # still holding the lock: whoever opens the name next makes a new file
        f.close()


@contextlib.contextmanager
def folder_lock(folder, what):
    """Hold an exclusive lock on the folder itself (created if missing) for the block: one command writing into
    it at a time (a training run's --outdir, analyze.py --out), so that two never mix their outputs. A second
    one gets a UserError at once. The kernel's lock on the folder's own descriptor: no file is added to the
    folder, and nothing outlives the process."""
    made = not os.path.lexists(folder)
    make_outdir(folder)
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise common.UserError(f"{what} is in use by another run writing into it; wait for it to end, "
                                   f"or choose another folder") from None
        yield
    finally:
        os.close(fd)
        if made:   # a command that wrote nothing (refused, failed) leaves no folder: rmdir takes only an empty one
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def is_locked(path):
    """True when another process holds exclusive_lock(path) now."""
    try:
        import fcntl
    except ImportError:
        return False
    if not os.path.exists(path):
        return False
    with open_file(path, "r") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


_WRITTEN = []        # the files this process has completed, for the message of a failed write
_HELD_LOCKS = set()  # realpaths of the exclusive_locks this process holds (not "another run")
_INPUTS = []         # the files the running command reads (set_inputs): never written over
_STAGED = None       # inside run: {path: (its temporary file, kind)} of tables and reports, renamed at the end


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


def output_problem(path, inputs=()):
    """Why this command may not write `path` (a message), or None: not a file name, a folder, an input of the
    command (through a link or a hard link too), or an output another run holds (its <path>.lock)."""
    if os.path.basename(path) in ("", ".", "..", OUTPUTS):
        return f"{path!r} is not a file name this command may write"
    if os.path.isdir(path) and not os.path.islink(path):
        return f"{path!r} is a folder; name a file inside it"
    for given in list(inputs) + _INPUTS:
        if given and os.path.exists(given) and os.path.exists(path) and os.path.samefile(given, path):
            return f"{path!r} is an input of this command ({given!r}); choose another output"
    lock = path + ".lock"
    if os.path.realpath(lock) not in _HELD_LOCKS and is_locked(lock):
        return f"{path!r} is being written by another run (it holds {lock!r}); wait for it or choose another output"
    return None


def check_output(path, inputs=()):
    """output_problem as a UserError."""
    problem = output_problem(path, inputs)
    common.check(problem is None, problem)


def write_output(path, kind, write, inputs=(), now=False):
    """Write the file `path` (a `kind`: 'table', 'checkpoint', ..., for messages) through the guard; returns path.

    write(f): puts the whole content into the binary file object f. The content goes to a new temporary file,
    is fsynced and replaces `path` in one rename; a failed write (disk full, `ulimit -f`, Ctrl-C) removes the
    temporary file, leaves `path` as it was and says so. A temporary file a killed writer left (its process
    gone) is removed first.

    now=True: a file of a run's own state (a checkpoint, a sidecar, a log), which its run's record covers,
    renamed at once. Otherwise a table, figure or report: it replaces only a file its folder's record
    (outputs.json) lists as this kind with the content recorded (owned_problem), and, inside a command (run),
    only as the command ends, so that a command refused at its last output has changed no file.
    """
    check_output(path, inputs)
    problem = None if now else owned_problem(path, kind)
    common.check(problem is None, problem)
    make_outdir(os.path.dirname(os.path.abspath(path)))
    for left in glob.glob(glob.escape(path) + ".tmp*"):
        pid = left[len(path) + 4:]
        if pid.isdigit() and not alive(int(pid)) and os.path.isfile(left) and not os.path.islink(left):
            os.remove(left)
    if _STAGED and path in _STAGED:   # written twice in one command: the last content counts
        _discard(_STAGED.pop(path)[0])
    try:
        tmp = _write_temp(path, write)
    except OSError as e:
        raise common.UserError(f"{path!r} not written ({e.strerror or type(e).__name__}), its previous content "
                               f"is intact; {written_so_far()}") from None
    if _STAGED is not None and not now:
        _STAGED[path] = tmp, kind
    else:
        _install(path, tmp, None if now else kind)
    return path


OUTPUTS = "outputs.json"   # a folder's record of the tables, figures and reports written into it


def read_outputs(folder):
    """The record of the tables, figures and reports in `folder`: {file name: {"kind", "by", "sha256"}}."""
    path = os.path.join(folder, OUTPUTS)
    if not os.path.lexists(path):
        return {}
    record = readers.read_json_object(path, "record of outputs")
    common.check(all(isinstance(v, dict) for v in record.values()),
                 f"{path}: not a record of outputs (expected {{file name: {{kind, by, sha256}}}}); remove it")
    return record


def _save_outputs(folder, record):
    path = os.path.join(folder, OUTPUTS)
    tmp = _write_temp(path, lambda f: f.write((json.dumps(record, indent=1, sort_keys=True) + "\n").encode()))
    try:
        os.replace(tmp, path)
    except BaseException:
        _discard(tmp)
        raise


def owned_problem(path, kind):
    """Why a table, figure or report may not replace the existing `path` (a message), or None: only a file its
    folder's record lists, as this kind, with the content recorded (or the one before a rename a stop cut
    short), is replaced; anything else there is a user's."""
    if not os.path.lexists(path):
        return None
    folder, name = os.path.split(os.path.abspath(path))
    entry = read_outputs(folder).get(name)
    if entry is None or os.path.islink(path) or not os.path.isfile(path):
        return (f"{path!r} exists and was not written by this project (not in {os.path.join(folder, OUTPUTS)!r}); "
                f"move it away or choose another output")
    if entry.get("kind") != kind:
        return f"{path!r} was written as {entry.get('kind')!r}, not as {kind!r}; choose another output"
    if file_sha256(path) not in (entry.get("sha256"), entry.get("was")):
        return f"{path!r} changed since {entry.get('by')} wrote it; move it away or choose another output"
    return None


def _write_temp(path, write):
    """A new temporary file beside `path` (<name>.tmp<pid>) holding what write(f) puts in it, fsynced; its path.
    A failure removes it."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open_file(tmp, "wb", new=True) as f:
        try:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            _discard(tmp)
            raise
    return tmp


def _discard(tmp):
    with contextlib.suppress(OSError):
        os.remove(tmp)


def _install(path, tmp, kind=None):
    """Rename the temporary file `tmp` over `path`; kind: a table, figure or report, whose new hash goes into its
    folder's record first, beside the old one ("was") until the rename is done, so that a stop anywhere leaves
    a record that accepts the file."""
    folder, name = os.path.split(os.path.abspath(path))
    try:
        if kind is not None:
            record = read_outputs(folder)
            record[name] = {"kind": kind, "by": os.path.basename(sys.argv[0] or "python"), "sha256": file_sha256(tmp)}
            if os.path.isfile(path):
                record[name]["was"] = file_sha256(path)
            _save_outputs(folder, record)
        os.replace(tmp, path)   # atomic: a stop leaves the old file or the new one
        if kind is not None:
            record[name].pop("was", None)
            _save_outputs(folder, record)
    except OSError as e:
        _discard(tmp)
        raise common.UserError(f"{path!r} not written ({e.strerror or type(e).__name__}), its previous content "
                               f"is intact; {written_so_far()}") from None
    fsync_dir(path)
    _WRITTEN.append(path)


def alive(pid):
    """True when the process `pid` runs now (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:   # another user's process
        pass
    return True


def fsync_dir(path):
    """fsync the folder holding path, so that a rename into it survives a power cut (POSIX; a no-op elsewhere)."""
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    with contextlib.suppress(OSError):
        os.fsync(fd)
    os.close(fd)


def write_text_output(path, kind, text, inputs=()):
    """write_output of a text (UTF-8; a file name that is not UTF-8, in a label, shows its bytes as \\xff)."""
    return write_output(path, kind, lambda f: f.write(text.encode("utf-8", "backslashreplace")), inputs)


def write_json(obj, path, kind="settings", inputs=()):
    """obj as pretty JSON (args.json, sidecars, summaries), through the guard, at once (a run's record)."""
    text = json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"
    return write_output(path, kind, lambda f: f.write(text.encode("utf-8")), inputs, now=True)


def open_append(path, header, inputs=()):
    """Open the log `path` to append rows, through the guard; a new or empty file gets `header` (a line) first.
    The caller flushes each row: a kill leaves at most a torn last line, which the readers drop."""
    check_output(path, inputs)
    f = open_file(path, "a", encoding="utf-8")
    if f.tell() == 0:
        f.write(header + "\n")
        f.flush()
    return f


def copy_training_log(source, path):
    """Copy a run's log.tsv (read_train_log checks it) to `path` through the guard (scripts/lib.sh keep_log)."""
    rows = readers.read_train_log(source)
    text = "".join("\t".join(str(r[c]) for c in readers.TRAIN_LOG_COLUMNS) + "\n" for r in rows)
    return write_text_output(path, "training log copy", "\t".join(readers.TRAIN_LOG_COLUMNS) + "\n" + text, [source])


def remove_output(path):
    """Remove an output of this command's run (certify.py --overwrite, merged parts) through the guard."""
    check_output(path)
    if os.path.lexists(path):
        os.remove(path)


DEMO_RECORD = ".demo"   # scripts/demo.sh's record of its folder: {path: sha256} of every file it wrote


def record_tree(folder):
    """Write the record of the folder tree `folder` (scripts/demo.sh, once its run is done): every file in it
    with its sha256, so that remove_tree can tell the demo's files from a user's."""
    files = {os.path.relpath(os.path.join(root, name), folder): file_sha256(os.path.join(root, name))
             for root, _, names in os.walk(folder) for name in sorted(names) if name != DEMO_RECORD}
    write_json(files, os.path.join(folder, DEMO_RECORD), "record of a folder")


def remove_tree(folder):
    """Remove the folder tree `folder` if it holds only the files its record (record_tree) lists, each with its
    content: scripts/demo.sh starts afresh this way, not with rm -rf. Anything else (a user's file, a link, a
    FIFO, a changed file, or no record: an interrupted demo) stops it before anything is removed."""
    record = readers.read_json_object(os.path.join(folder, DEMO_RECORD), "record of a folder")
    files, folders, foreign = [], [], []
    for root, dirs, names in os.walk(folder):   # os.walk does not enter links to folders
        folders.append(root)
        for name in names + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            path = os.path.join(root, name)
            key = os.path.relpath(path, folder)
            ours = key == DEMO_RECORD or (os.path.isfile(path) and not os.path.islink(path)
                                          and record.get(key) == file_sha256(path))
            (files if ours else foreign).append(path)
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise common.UserError(f"{folder!r} holds files this project did not write, or that changed since: "
                               f"{', '.join(foreign[:3])}{more}; move them away, or choose another folder")
    for path in files:
        os.remove(path)
    for root in sorted(folders, key=len, reverse=True):
        os.rmdir(root)


def file_sha256(path, size=None):
    """The sha256 of a file's bytes (hex), or of its first `size` bytes, read in 1 MiB blocks."""
    import hashlib
    digest = hashlib.sha256()
    left = math.inf if size is None else size
    with open_file(path, "rb") as f:
        while left > 0:
            block = f.read(int(min(1 << 20, left)))
            if not block:
                break
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------------------
# Run identity: what a sidecar records so that a resume or a pairing of logs can be checked
# ----------------------------------------------------------------------------------------------------------

def check_same_run(paths, keys=("checkpoint_sha256", "data", "split")):
    """The logs at `paths` come from one model on one set of images: their settings files (certify.py's
    sidecars) name the same checkpoint hash, data fingerprint and split. A log without them is refused: what
    it was made from cannot be checked (ddrs.py report pairs a DDRS log with the fixed-sigma log this way)."""
    sides = [readers.read_sidecar(p) for p in paths]
    for path, side in zip(paths, sides):
        missing = [k for k in keys if side.get(k) is None]
        common.check(not missing, f"{path}: its settings file does not record {', '.join(missing)} (the run's "
                                  f"identity), so it cannot be paired with {paths[0]}; certify it with certify.py")
    for path, side in zip(paths[1:], sides[1:]):
        for k in keys:
            common.check(side[k] == sides[0][k], f"{path}: another {k.replace('_sha256', '')} than {paths[0]} "
                                                 f"({str(side[k])[:16]} vs {str(sides[0][k])[:16]}): not the same "
                                                 f"model on the same images")


def data_fingerprint(name, split, data_dir=None):
    """A short hash naming the data a run reads (its identity; a resume on other data is refused).

    digits: the bundled arrays of the split. An image folder or torchvision's files: every file's path
    (relative to the split's folder), size and the sha256 of its bytes, so other images under the same names
    count as other data. Hidden files and anything that is not a regular file are left out (the loader skips
    or refuses them). It reads every file once: about 5 s for CIFAR-10's train split on one core, a pass over
    the data for ImageNet (read in parallel threads)."""
    import concurrent.futures
    import hashlib
    digest = hashlib.sha256(f"{name}/{split}".encode())
    if name == "digits":
        ds = common._digits(split)
        digest.update(ds.images.numpy().tobytes())
        digest.update(ds.labels.numpy().tobytes())
        return digest.hexdigest()[:16]
    data_dir = data_dir or common.default_data_dir()
    sub = {"cifar10": "train" if split == "train" else "test", "imagenet": "train" if split == "train" else "val"}
    folder = os.path.join(data_dir, sub[name])
    if not os.path.isdir(folder):
        folder = os.path.join(data_dir, "cifar-10-batches-py")   # torchvision's CIFAR-10 files
    paths = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))   # hidden files: the loader skips them too
        paths += [os.path.join(root, f) for f in sorted(files) if not f.startswith(".")
                  and os.path.isfile(os.path.join(root, f))]

    def file_digest(path):
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:   # sha256 frees the GIL
        for path, content in zip(paths, pool.map(file_digest, paths)):
            digest.update(f"{os.path.relpath(path, folder)}\t{os.path.getsize(path)}\t{content}\n".encode())
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
    cpu, flags = cpu_info()
    cpu, flags = cpu or platform.processor() or platform.machine(), flags or []
    wanted = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")
    versions["cpu"] = {"model": cpu, "logical_cpus": os.cpu_count(), "extensions": [f for f in wanted if f in flags],
                       "torch_capability": torch.backends.cpu.get_cpu_capability(), **math_kernels()}
    if torch.cuda.is_available():
        versions["gpu"] = torch.cuda.get_device_name(0)
    return versions


# The variables that cap the math libraries' instruction sets (scripts/demo.sh pins them for a report that is the
# same file on every x86-64 CPU with AVX2); recorded as set.
ISA_PINS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
            "MKL_CBWR", "OPENBLAS_CORETYPE")


@functools.lru_cache(maxsize=None)
def math_kernels():
    """What the CPU math libraries run in this process, read from the libraries themselves, not from the CPU's
    flags: {"onednn_isa": oneDNN's own line ("Intel AVX2", ...), "openblas_core": the core OpenBLAS chose for
    numpy ("Haswell", "SkylakeX", ...), "isa_pins": the ISA_PINS variables that are set}; None where unknown.
    oneDNN says its ISA once per process, in its verbose output (a C printf to descriptor 1): one small
    convolution is run with it on and that descriptor caught in a temporary file (about 20 ms)."""
    import tempfile
    onednn = None
    if torch.backends.mkldnn.is_available():
        try:
            sys.stdout.flush()
            saved = os.dup(1)
            with tempfile.TemporaryFile() as caught:
                os.dup2(caught.fileno(), 1)
                try:   # a batch of 2 of this size goes to oneDNN (a smaller one may not)
                    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                        torch.nn.functional.conv2d(torch.ones(2, 3, 32, 32), torch.ones(6, 3, 5, 5))
                finally:
                    os.dup2(saved, 1)
                    os.close(saved)
                caught.seek(0)
                text = caught.read().decode(errors="replace")
            onednn = next((line.split("isa:", 1)[1].strip() for line in text.splitlines() if ",isa:" in line), None)
        except (OSError, RuntimeError, ValueError):   # no descriptor 1 (a closed stdout), a build without verbose
            onednn = None
    openblas = None
    try:
        import threadpoolctl
        openblas = next((lib.get("architecture") for lib in threadpoolctl.threadpool_info()
                         if lib.get("internal_api") == "openblas"), None)
    except Exception:   # threadpoolctl missing or failing: the record is informative only
        pass
    return {"onednn_isa": onednn, "openblas_core": openblas,
            "isa_pins": {name: os.environ[name] for name in ISA_PINS if name in os.environ}}


def environment_line(env=None):
    """environment() (or one read from a sidecar: any missing part shows as ?) in one line, for report headers."""
    env = env if isinstance(env, dict) else environment()
    cpu = env.get("cpu") if isinstance(env.get("cpu"), dict) else {}
    get = lambda d, key: str(d.get(key)) if d.get(key) is not None else "?"
    ext = " ".join(map(str, cpu["extensions"])) if isinstance(cpu.get("extensions"), list) else "?"
    given = cpu.get("isa_pins") if isinstance(cpu.get("isa_pins"), dict) else {}
    pins = "; pinned " + " ".join(f"{k}={v}" for k, v in sorted(given.items())) if given else ""
    return (f"python {get(env, 'python')}, torch {get(env, 'torch')}, torchvision {get(env, 'torchvision')}, "
            f"numpy {get(env, 'numpy')} ({get(env, 'numpy_blas')}), scipy {get(env, 'scipy')}; {get(cpu, 'model')}, "
            f"{get(cpu, 'logical_cpus')} logical CPUs, {ext or 'no listed extensions'} (torch: "
            f"{get(cpu, 'torch_capability')}, oneDNN: {get(cpu, 'onednn_isa')}, OpenBLAS: {get(cpu, 'openblas_core')}"
            f"{pins})" + (f"; {env['gpu']}" if env.get("gpu") else ""))


def run_identity(script, dataset, data_dir=None):
    """What a run is, beyond its settings: the script that runs it and the data it trains and tests on."""
    return {"script": script, "data": {split: data_fingerprint(dataset, split, data_dir)
                                       for split in ("train", "test")}}


def check_precision(precision, device):
    """Raise a UserError unless `precision` (fp32, bf16, fp16) can run on `device` (fp16: CUDA only)."""
    device = torch.device(device)
    common.check(precision in common.PRECISIONS,
                 f"unknown precision {precision!r}; choose one of {', '.join(common.PRECISIONS)}")
    common.check(precision != "fp16" or device.type == "cuda", "fp16 needs a CUDA device; use bf16 on the CPU")
    common.check(precision != "bf16" or device.type != "cuda" or torch.cuda.is_bf16_supported(),
                 "this GPU does not support bf16; use fp16")
    if precision == "bf16" and device.type == "cpu" and cpu_has_native_bf16() is False:
        print("warning: bf16 on a CPU without native bf16 (no avx512_bf16 or amx_bf16 in /proc/cpuinfo): it is "
              "emulated and slower than fp32 here (8x in certification on an AVX2-only AMD EPYC, "
              "results/speed/bf16_cpu.txt); fp32 is faster on this machine", file=sys.stderr)


def cpu_info(cpuinfo="/proc/cpuinfo"):
    """(the CPU's model name, its list of flags) from /proc/cpuinfo; None for what it does not say (not Linux)."""
    try:
        with open(cpuinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    model, flags = ([line.split(":", 1)[1] for line in lines if line.startswith(key)]
                    for key in ("model name", "flags"))
    return model[0].strip() if model else None, flags[0].split() if flags else None


def cpu_has_native_bf16(cpuinfo="/proc/cpuinfo"):
    """True if the CPU has bf16 instructions (AVX512-BF16 or AMX-BF16), False if it has not, None where unknown.
    Without them torch emulates bf16 with fp32 conversions, which costs more than fp32 itself."""
    flags = cpu_info(cpuinfo)[1]
    return None if flags is None else bool({"avx512_bf16", "amx_bf16"} & set(flags))


# ----------------------------------------------------------------------------------------------------------
# Checkpoints: atomic save, loading of ours and of the released ones without running code
# ----------------------------------------------------------------------------------------------------------

def save_checkpoint(state, path, kind="checkpoint", inputs=()):
    """torch.save through the guard (write_output, at once: a run's own state). torch.save fills a buffer in
    memory first: a write that fails inside torch's zip writer would surface as a RuntimeError, not an OSError."""
    import io

    def write(f):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        f.write(buffer.getbuffer())
    write_output(path, kind, write, inputs, now=True)


_LOADED_SHA256 = {}   # path as given -> sha256 of the bytes safe_load last read through it in this process


def loaded_sha256(path):
    """The sha256 of the bytes that safe_load read from `path` (the last time, in this process): the identity a
    record gives the model it used, taken from those very bytes, never from reading the path again (a training
    run may replace the file in between). None if it was not loaded."""
    return _LOADED_SHA256.get(path)


def safe_load(path, device="cpu", trust=False, what="checkpoint"):
    """torch.load that cannot run code from the file (its pickle is read with weights_only=True).

    Allowed: tensors and plain Python values (dicts, lists, numbers, strings): every checkpoint released with
    Cohen et al., SmoothAdv, Consistency, SmoothMix, CAT-RS and the paper, and ours.
    A file whose pickle names anything else (a class, a function) could run code while loading: it is a
    UserError naming the file, what it asks for and the flag --trust-checkpoint. trust=True (that flag)
    loads with weights_only=False, which runs whatever the file holds: only for files from a trusted source.
    The file is read once; its bytes are loaded and hashed (loaded_sha256).
    """
    import hashlib
    import io
    common.check(os.path.isfile(path), f"{what} {path!r} not found")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise common.UserError(f"cannot read {what} {path!r} ({e.strerror or type(e).__name__})") from None
    _LOADED_SHA256[path] = hashlib.sha256(data).hexdigest()
    if trust:
        try:
            return torch.load(io.BytesIO(data), map_location=device, weights_only=False)
        except Exception as e:
            raise common.UserError(f"cannot read {what} {path!r} ({type(e).__name__}): not a torch file?") from None
    try:
        return torch.load(io.BytesIO(data), map_location=device, weights_only=True)
    except Exception as e:
        if "Weights only load failed" not in str(e):
            raise common.UserError(f"cannot read {what} {path!r} ({type(e).__name__}): not a torch file?") from None
        try:
            names = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))) or "objects"
        except Exception:
            names = "objects"
        raise common.UserError(f"{what} {path!r} needs arbitrary unpickling ({names}), which can run any code it holds; "
                               f"pass --trust-checkpoint only if you trust where the file came from") from None


def load_checkpoint(path, device="cpu", trust=False):
    """Read a checkpoint dict ({'arch', 'state_dict', ...}) with safe_load; a missing or unreadable file, or one
    that would need arbitrary unpickling (unless trust), is a UserError."""
    common.check(os.path.isfile(path), f"checkpoint {path!r} not found (no such file)")   # whichever flag named it
    ckpt = safe_load(path, device, trust)
    if isinstance(ckpt, dict) and "state_dict" not in ckpt and all(torch.is_tensor(v) for v in ckpt.values()):
        ckpt = {"state_dict": ckpt}  # a bare state_dict
    common.check(isinstance(ckpt, dict) and "state_dict" in ckpt,
                 f"checkpoint {path!r} holds no 'state_dict'; expected {{'arch': ..., 'state_dict': ...}}")
    common.check(isinstance(ckpt["state_dict"], dict) and all(torch.is_tensor(v) for v in ckpt["state_dict"].values()),
                 f"checkpoint {path!r}: its 'state_dict' is not a dict of tensors")
    for name, ok in CHECKPOINT_FIELDS.items():
        if name in ckpt and not ok(ckpt[name]):
            raise common.UserError(f"checkpoint {path!r}: field {name!r} has an invalid value "
                                   f"({type(ckpt[name]).__name__})")
    return ckpt


def read_torch_dict(path, what, fields, trust=False):
    """A torch file holding a dict (safe_load), whose `fields` ({name: check(value) -> bool}) are present and
    pass their checks; anything else is a UserError naming the file and the first bad field."""
    saved = safe_load(path, trust=trust, what=what)
    common.check(isinstance(saved, dict), f"{what} {path!r} must hold a dict, not {type(saved).__name__}")
    for name, ok in fields.items():
        common.check(name in saved, f"{what} {path!r} lacks the field {name!r}")
        if not ok(saved[name]):
            raise common.UserError(f"{what} {path!r}: field {name!r} has an invalid value ({type(saved[name]).__name__})")
    return saved


# The fields of our checkpoints beyond Cohen's {'arch', 'state_dict'}: present in ours, checked when present.
CHECKPOINT_FIELDS = {"arch": lambda v: isinstance(v, str), "dataset": lambda v: v is None or v in common.DATASETS,
                     "sigma": lambda v: v is None or (common._is_number(v) and 0 < v < math.inf),
                     "epoch": lambda v: readers._is_int(v) and v >= 0, "args": lambda v: v is None or isinstance(v, dict),
                     "extra": lambda v: v is None or isinstance(v, dict),
                     "optimizer": lambda v: v is None or isinstance(v, dict),
                     "scheduler": lambda v: v is None or isinstance(v, dict),
                     "rng": lambda v: v is None or isinstance(v, dict)}


def strip_module_prefix(state_dict):
    """Drop every `module.` segment that DataParallel/DDP put into the keys (`1.module.conv1.weight`)."""
    common.check(all(isinstance(k, str) for k in state_dict), "the checkpoint's state_dict has keys that are not "
                                                               "parameter names (strings); not a model's weights")
    return {".".join(p for p in k.split(".") if p != "module"): v for k, v in state_dict.items()}


def check_weights(path, state_dict, model):
    """Every tensor the model holds in floating point (parameters, float buffers) is real floating point and
    finite in the checkpoint; integer buffers (num_batches_tracked) may stay integers. load_state_dict would
    cast an integer or complex tensor silently. A violation is a UserError naming the checkpoint and tensor."""
    own = common.unwrap(model).state_dict()
    for name, value in state_dict.items():
        if value.is_complex() or (name in own and own[name].is_floating_point() and not value.is_floating_point()):
            raise common.UserError(f"checkpoint {path!r}: tensor {name!r} is {value.dtype}, not real floating point")
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise common.UserError(f"checkpoint {path!r}: tensor {name!r} has non-finite values (a diverged run?)")


def load_model(path, dataset=None, arch=None, device="cpu", trust=False, precision="fp32"):
    """Build the architecture named by the checkpoint (or `arch`) and load its weights with strict key matching.

    Returns (model in eval mode on device, checkpoint dict). Dataset defaults to the checkpoint's, else
    guessed from the architecture. A state_dict that does not fit is a UserError naming the first bad keys.
    trust: see safe_load (--trust-checkpoint). precision: the weights must also be finite once cast to it
    (fp16 overflows above 65504, bf16 just below float32's largest number), as autocast will use them.
    """
    ckpt = load_checkpoint(path, device, trust)
    arch = arch or ckpt.get("arch")
    common.check(arch is not None, f"checkpoint {path!r} names no architecture; pass --arch")
    dataset = dataset or ckpt.get("dataset") or {"resnet50": "imagenet", "digits_cnn": "digits",
                                                 "lenet": "digits"}.get(arch, "cifar10")
    common.check(arch in common.ARCHS, f"checkpoint {path!r} names an unknown architecture {arch!r}; pass --arch")
    model = common.get_architecture(arch, dataset)
    check_weights(path, strip_module_prefix(ckpt["state_dict"]), model)
    try:
        model.load_state_dict(strip_module_prefix(ckpt["state_dict"]), strict=True)
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


# ----------------------------------------------------------------------------------------------------------
# Small utilities of the scripts' main paths
# ----------------------------------------------------------------------------------------------------------

def get_device(name=None):
    """torch.device from --device, default cuda when available."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise common.UserError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    common.check(device.type != "cuda" or torch.cuda.is_available(),
                 f"device {name!r} requested but CUDA is not available")
    return device


def format_eta(done, total, start):
    """'12.3/s, ETA 0:04:10' for `done` of `total` items since time.time() == start."""
    elapsed = time.time() - start
    rate = done / elapsed if elapsed > 0 else 0.0
    eta = datetime.timedelta(seconds=int((total - done) / rate)) if rate > 0 else "?"
    return f"{rate:.2f}/s, ETA {eta}"


def check_training_settings(settings):
    """What every training script refuses, before anything is written: non-finite numbers, lr <= 0, negative
    momentum, weight decay or seed, --sync-bn on the CPU. settings: the run's flags as a dict."""
    check_finite(settings)
    if settings.get("sigma") is not None:
        check_sigma(settings["sigma"], precision=settings.get("amp") or "fp32")
    if settings.get("dataset") in common.INPUT_SHAPE and isinstance(settings.get("batch"), int):
        m = settings.get("m") if isinstance(settings.get("m"), int) else 1
        check_batch_bytes(settings["batch"] * max(m, 1), common.INPUT_SHAPE[settings["dataset"]], "--batch x --m")
    common.check(settings["lr"] > 0, f"--lr must be > 0, got {settings['lr']}")
    common.check(settings["momentum"] >= 0 and settings["weight_decay"] >= 0,
                 f"--momentum and --weight_decay must be >= 0, got {settings['momentum']} and {settings['weight_decay']}")
    common.check(settings["seed"] >= 0, f"--seed must be >= 0, got {settings['seed']}")
    common.check(not settings.get("sync_bn") or get_device(settings.get("device")).type != "cpu",
                 "--sync-bn needs GPUs (torch's SyncBatchNorm does not run on the CPU); drop it")
    common.check(settings.get("max_batches") is None or settings["max_batches"] >= 1,
                 f"--max-batches must be >= 1 (omit it for whole epochs), got {settings.get('max_batches')}")


class TSVLog:
    """Append rows to a TSV file with a fixed header, each row flushed at once (a killed run keeps its rows).

    A new log (append=False) replaces an earlier one; every write goes through the guard."""

    def __init__(self, path, columns, append=False, sync=False, inputs=()):
        self.columns, self.sync = list(columns), sync   # sync: fsync every row (the epoch log)
        header = "\t".join(self.columns)
        if not append:
            write_output(path, "log", lambda f: f.write((header + "\n").encode()), inputs, now=True)
        self.file = open_append(path, header, inputs)

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
    except OSError as e:
        raise common.UserError(f"cannot write to output folder {outdir!r} ({e.strerror}); choose a folder that "
                               f"can be written") from None   # every command that writes files comes here
    # access() asks without writing anything (it knows read-only file systems too)
    common.check(os.access(outdir, os.W_OK | os.X_OK), f"cannot write to output folder {outdir!r} (permission "
                                                        f"denied or read-only); choose a folder that can be written")
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


def run_folder_lock(outdir, precision="fp32", device="cpu"):
    """The run folder, created, and locked for this run on rank 0 (folder_lock, a context manager): two training
    runs on one --outdir would overwrite each other's checkpoints and log; the second one gets a UserError. The
    run's precision is checked on its device first: a run that cannot start leaves no folder behind."""
    check_precision(precision, device)
    if not is_main_process():
        return contextlib.nullcontext(make_outdir(outdir))
    return folder_lock(outdir, f"run folder {outdir!r}")


def wrap_model(model, device, sync_bn=False):
    """DistributedDataParallel around the model under torchrun (gradients averaged across ranks), else the model.

    sync_bn (--sync-bn): every BatchNorm uses the statistics of the whole batch of all ranks
    (torch.nn.SyncBatchNorm), instead of each rank's batch // world_size inputs. torch runs it on GPUs only, so
    on the CPU (check_training_settings refuses it there); without torchrun it changes nothing.
    """
    if get_world_size() == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel
    if sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)


def broadcast(tensor):
    """Rank 0's tensor on every rank (in place); a no-op without a process group. Keeps kept sets identical."""
    if get_world_size() > 1:
        import torch.distributed as dist
        dist.broadcast(tensor, src=0)
    return tensor


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
    torch.set_rng_state(state["torch"].cpu())
    numpy_state = state["numpy"]   # its key saved as a tensor: checkpoints hold tensors only
    np.random.set_state(dict(numpy_state, state=dict(numpy_state["state"],
                                                     key=numpy_state["state"]["key"].cpu().numpy().astype(np.uint32))))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save_training_checkpoint(outdir, model, optimizer, scheduler, epoch, args, extra=None, save_every=0):
    """Write outdir/checkpoint.pth.tar after `epoch` completed epochs (atomically), and keep a copy
    checkpoint_epoch{epoch}.pth.tar every `save_every` epochs (0: never). Only rank 0 writes.

    args: the run's arguments (Namespace or dict) with at least arch, dataset, sigma. extra: a dict of
    the method's state needed to resume (kept indices, sampling weights, ...). The file is a Cohen-style
    checkpoint ({'arch', 'state_dict', ...}) that certify.py reads unchanged. It is the run's record: it also
    holds the size and sha256 of log.tsv as it is now, which a resume checks (start_or_resume).
    """
    if not is_main_process():
        return
    args = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
    log = os.path.join(outdir, "log.tsv")
    size = os.path.getsize(log) if os.path.isfile(log) else 0
    state = {"arch": args["arch"], "dataset": args["dataset"], "sigma": args["sigma"], "epoch": epoch,
             "state_dict": common.unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "args": args, "rng": _rng_state(), "extra": extra or {},
             "log": {"size": size, "sha256": file_sha256(log) if size else None}}
    save_checkpoint(state, os.path.join(outdir, CHECKPOINT))
    if save_every and epoch % save_every == 0:
        save_checkpoint(state, os.path.join(outdir, f"checkpoint_epoch{epoch}.pth.tar"))


# Settings a resumed run may change: where and how fast it runs, how long; never what it computes.
RESUME_MAY_CHANGE = {"epochs", "resume", "workers", "device", "outdir", "data_dir", "max_batches", "save_every",
                     "trust_checkpoint", "gradnorm", "probe", "note", "channels_last", "compile"}


def resume_mismatches(saved_args, args):
    """'key old -> new' for every setting of args that differs from the checkpoint's saved arguments
    (only keys both know, and not RESUME_MAY_CHANGE). The run identity ('run': script and data) is compared
    part by part, so the message names what differs."""
    diff = []
    if isinstance(args.get("run"), dict) and not isinstance(saved_args.get("run"), dict):
        diff.append("the checkpoint records no run identity (script and data), so what it was trained on cannot "
                    "be checked")
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


def check_own_settings(path):
    """A new run writes its settings to `path` (args.json): one already there must be a run's of ours (stopped before
    its first checkpoint: the settings and the environment every training script records), never a user's file."""
    own = None
    if os.path.isfile(path) and not os.path.islink(path):
        try:
            with open(path, encoding="utf-8") as f:
                own = json.load(f)
        except (OSError, ValueError):
            pass
    common.check(not os.path.lexists(path) or isinstance(own, dict) and {"outdir", "seed", "environment"} <= set(own),
                 f"{path!r} exists and is not the settings of a run of ours; move it away or choose another --outdir")


def start_or_resume(model, optimizer, scheduler, outdir, resume, expect=None, trust=False, args=None):
    """Start a new run in outdir, or (resume=True) restore it from outdir/checkpoint.pth.tar.

    Returns (start_epoch, extra): the number of epochs already done (0 for a new run) and the `extra`
    dict saved with the checkpoint ({} for a new run). A new run refuses a folder that already holds a
    checkpoint (nothing is overwritten silently); resume without one is a UserError. expect: optional
    dict such as {'arch': ..., 'dataset': ..., 'sigma': ...} that the checkpoint must match. args: the run's
    settings (a dict); on resume every one that is not RESUME_MAY_CHANGE must equal the checkpoint's (lr, m,
    seed, batch, ...: the restored optimizer and schedule would otherwise contradict args.json).
    """
    path = os.path.join(outdir, CHECKPOINT)
    if not resume:
        common.check(not os.path.lexists(path), f"{outdir!r} already holds a run ({CHECKPOINT}); pass --resume to "
                                                f"continue it, or choose another --outdir")
        check_own_settings(os.path.join(outdir, "args.json"))
        return 0, {}
    common.check(os.path.isfile(path), f"--resume: no {CHECKPOINT} in {outdir!r}; start the run without --resume")
    # On the CPU: load_state_dict copies weights and optimizer state to the model's device; the rest (generator
    # states, a method's kept indices) is host data, whatever device the run was saved from.
    ckpt = load_checkpoint(path, "cpu", trust)
    missing = [k for k in ("epoch", "optimizer", "scheduler", "rng", "log") if k not in ckpt]
    common.check(not missing, f"--resume: {path!r} lacks {', '.join(missing)} (not a checkpoint of a training run "
                       f"of ours); start a new run in another --outdir")
    for key, value in (expect or {}).items():
        common.check(ckpt.get(key) == value, f"--resume: the checkpoint in {outdir!r} has {key}={ckpt.get(key)!r}, "
                                      f"this run has {key}={value!r}; use the same settings or another --outdir")
    diff = resume_mismatches(ckpt.get("args") or {}, args or {})
    common.check(not diff, f"--resume: {outdir!r} was trained with other settings ({'; '.join(diff)}); resume with "
                    f"the same ones, or start a new run in another --outdir")
    log, kept = os.path.join(outdir, "log.tsv"), ckpt["log"]
    common.check(isinstance(kept, dict) and os.path.isfile(log) and os.path.getsize(log) >= kept.get("size", 0) and
                 (not kept.get("size") or file_sha256(log, kept["size"]) == kept.get("sha256")),
                 f"--resume: {log!r} is missing or changed since the run wrote it (its checkpoint records what it "
                 f"held); start a new run in another --outdir")
    check_weights(path, strip_module_prefix(ckpt["state_dict"]), model)
    try:
        common.unwrap(model).load_state_dict(strip_module_prefix(ckpt["state_dict"]))
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise common.UserError(f"--resume: {path!r} does not fit this model/optimizer ({type(e).__name__}); "
                               f"use the same settings or another --outdir") from None
    _set_rng_state(ckpt["rng"])
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
        rows = [r for r in readers.read_train_log(path) if int(r["epoch"]) < start_epoch]
        text = "".join("\t".join(str(r[c]) for c in readers.TRAIN_LOG_COLUMNS) + "\n" for r in rows)
        header = "\t".join(readers.TRAIN_LOG_COLUMNS) + "\n"
        write_output(path, "training log", lambda f: f.write((header + text).encode()), now=True)
    return TSVLog(path, readers.TRAIN_LOG_COLUMNS, append=start_epoch > 0, sync=True)


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


def check_gradnorm_output(path, inputs):
    """The guard's verdict on a gradient-norm file made from the checkpoint inputs[0] (measure_grad_norms): its
    record (<path>.json) names the checkpoint's sha256, so a file of another checkpoint is never replaced."""
    check_output(path, inputs)
    check_output(path + ".json", inputs)
    old = readers.read_json_object(path + ".json", "record of gradient norms") if os.path.isfile(path + ".json") \
        else {}
    sha = loaded_sha256(inputs[0]) if inputs else None
    common.check(old.get("checkpoint_sha256") in (None, sha), f"{path!r} was made from another checkpoint "
                 f"({old.get('checkpoint')!r}): two inputs would share one output; choose another output (--outdir)")


def measure_grad_norms(model, dataset, loss_fn, sigma, probe, n, seed, batch, path, inputs=()):
    """The gradient-norm mode of the training scripts (Table 2, Fig. 5): common.probe_grad_norms written as
    the TSV `idx label pA grad_norm` at `path`; returns its rows. inputs[0]: the checkpoint loaded
    (load_model), which the file's record <path>.json names with its sha256.
    """
    check_gradnorm_output(path, inputs)
    rows = common.probe_grad_norms(model, dataset, loss_fn, sigma, probe, n, seed, batch)
    lines = ["\t".join(readers.GRADNORM_COLUMNS)] + ["\t".join(f"{v[i]:.6g}" if isinstance(v[i], float) else
                                                            str(v[i]) for v in rows.values())
                                                  for i in range(len(rows["idx"]))]
    ckpt = inputs[0] if inputs else None
    record = {"script": os.path.basename(sys.argv[0] or "python"), "checkpoint": ckpt and os.path.relpath(ckpt),
              "checkpoint_sha256": ckpt and loaded_sha256(ckpt), "probe": probe, "N": n, "seed": seed, "sigma": sigma}
    record = {k: v for k, v in record.items() if v is not None}   # no checkpoint: a model given from Python
    write_json(record, path + ".json", "record of gradient norms", inputs)   # first: it names what replaces
    write_output(path, "gradient norms", lambda f: f.write(("\n".join(lines) + "\n").encode()), inputs, now=True)
    return rows


# ----------------------------------------------------------------------------------------------------------
# Certification logs (certify.py, ddrs.py): the run's record (its sidecar), resume, torchrun parts
# ----------------------------------------------------------------------------------------------------------

# Settings that change what a line means: a resumed file must have been written with the same ones.
CHECKED_SETTINGS = ("script", "data", "mode", "dataset", "split", "checkpoint_sha256", "arch", "sigma", "N0", "N",
                    "alpha", "seed", "skip", "precision", "early_abstain", "save_counts", "sound", "radii", "beta",
                    "final_look", "grid_test", "ddrs")
IDENTITY = ("script", "data", "checkpoint_sha256")   # never unknown in a log that is resumed
# Settings that change the random draws or the rounding but not their distribution: a change is only worth a note.
NOTED_SETTINGS = ("batch", "device_type", "channels_last", "fold_bn", "compile")


def part_files(outfile):
    """The per-rank files `<outfile>.rank<r>` that exist now (any world size), sorted by rank."""
    parts = [p for p in glob.glob(glob.escape(outfile) + ".rank*") if re.search(r"\.rank\d+$", p)]
    return sorted(parts, key=lambda p: int(p.rsplit(".rank", 1)[1]))


def run_files(outfile):
    """The files of the certification run writing `outfile` that exist now: the log, its vote counts
    (<outfile>.counts, where its sidecar says it keeps them) and their per-rank parts. No log: no run."""
    logs = [p for p in [outfile] + part_files(outfile) if os.path.lexists(p)]
    try:
        keeps = logs and readers.read_json_object(outfile + ".json", "settings file of a log").get("save_counts")
    except common.UserError:
        keeps = False
    counts = [p for p in [outfile + ".counts"] + part_files(outfile + ".counts") if os.path.lexists(p)]
    return logs + (counts if keeps is True else [])


def log_problem(outfile):
    """Why the existing files of the run at `outfile` are not the ones its sidecar records (a message), or None.

    The sidecar (<outfile>.json) is the run's record: it names certify.py (or ddrs.py), the checkpoint's hash,
    the log's columns, whether vote counts are kept, and the size and sha256 of what each file held when the
    run last stopped writing ("written"). A log only grows, so that prefix must still be there: an edit is
    refused, a log that a stopped run lengthened is resumed, and a log copied with its sidecar is recognised.
    """
    files = run_files(outfile)
    sidecar = outfile + ".json"
    if not files:
        return None
    try:
        old = readers.read_json_object(sidecar, "settings file of a log")
    except common.UserError:
        old = {}
    if old.get("script") not in ("certify.py", "ddrs.py certify") or not old.get("checkpoint_sha256"):
        return (f"{files[0]!r} exists and was not written by this project (no settings file {sidecar!r} of "
                f"certify.py claims it); move it away or choose another --outfile")
    written = old.get("written") if isinstance(old.get("written"), dict) else {}
    if os.path.basename(sidecar) in written and written[os.path.basename(sidecar)] != settings_sha256(old):
        return f"{sidecar!r} changed since {old['script']} wrote it; move it away or choose another --outfile"
    for path in files:
        if os.path.islink(path) or not os.path.isfile(path):
            return f"{path!r} is not a plain file (a link, FIFO or device); move it away"
        counts = path[len(outfile):].startswith(".counts")
        if not counts and os.path.getsize(path) > 0 and readers.read_header(path) != "\t".join(old.get("columns", [])):
            return (f"{path!r} exists and was not written by this project (not the columns {sidecar!r} names); "
                    f"move it away or choose another --outfile")
        kept = written.get(os.path.basename(path))
        if isinstance(kept, dict) and not (os.path.getsize(path) >= kept.get("size", 0) and
                                           file_sha256(path, kept.get("size", 0)) == kept.get("sha256")):
            return f"{path!r} changed since {old['script']} wrote it; move it away or choose another --outfile"
    return None


def check_resumable(outfile, settings, columns, counts=None):
    """Read-only: refuse an existing outfile (or part) written with other settings, or one we cannot parse."""
    existing = [p for p in [outfile] + part_files(outfile) if os.path.exists(p)]
    if not existing:
        return
    sidecar = outfile + ".json"
    common.check(os.path.isfile(sidecar), f"{outfile!r} exists but its settings file {sidecar!r} does not; "
                                          f"pass --overwrite to replace it or choose another --outfile")
    old = readers.read_json_object(sidecar, "settings file of a log")
    missing = [k for k in CHECKED_SETTINGS if k not in old or (k in IDENTITY and old[k] is None)]
    common.check(not missing, f"{sidecar!r} does not record {', '.join(missing)}, so what {outfile!r} was made with "
                              f"cannot be checked; pass --overwrite to start again or choose another --outfile")
    old = {k: old.get(k) for k in CHECKED_SETTINGS + NOTED_SETTINGS}
    diff = [f"{k} {old[k]!r} -> {settings[k]!r}" for k in CHECKED_SETTINGS if old[k] != settings[k]]
    common.check(not diff, f"{outfile!r} was written with other settings ({'; '.join(diff)}); rerun with the "
                           f"same ones to resume, pass --overwrite to start again, or choose another --outfile")
    for path in existing:
        readers.read_log_prefix(path, columns)
    if counts:
        for path in [counts[0]] + part_files(counts[0]):
            if os.path.exists(path):
                readers.read_log_prefix(path, counts[1])
    for k in NOTED_SETTINGS:
        if old[k] != settings[k]:
            sys.stderr.write(f"note: resuming with {k} {settings[k]!r} (was {old[k]!r}): new lines are valid "
                             f"but may differ from those an uninterrupted run would write (noise or rounding)\n")


def check_outputs(outfile, counts, inputs):
    """Before any work (rank 0): every file of the run may be written (the guard), and those that exist are
    the ones its sidecar records (log_problem)."""
    for path in [outfile, outfile + ".json", outfile + ".counts"] + part_files(outfile) + \
            part_files(outfile + ".counts"):
        check_output(path, inputs)
    problem = log_problem(outfile)
    common.check(problem is None, problem)
    common.check(not counts or not os.path.lexists(counts[0]) or counts[0] in run_files(outfile),
                 f"{counts and counts[0]!r} exists and was not written by this project (no log's sidecar keeps "
                 f"vote counts); move it away or choose another --outfile")


def prepare_outputs(outfile, settings, columns, overwrite, counts=None, inputs=()):
    """Single writer (rank 0): start or resume the outfile; returns the set of idx already done in any file.

    --overwrite removes every file of the run it replaces (run_files: its vote counts too, kept or not now).
    Otherwise torn last lines are cut off, and vote counts of examples the log lacks (a stop between the two
    writes) are dropped. The sidecar is written before the TSV, so a TSV without one was not written by us;
    it records what each file holds now ("written", log_problem). counts: optional (path, columns) of the
    --save-counts file, started or resumed alike (the TSV decides what is done).
    """
    check_outputs(outfile, counts, inputs)
    if overwrite:
        for path in run_files(outfile):
            remove_output(path)
    files = [(outfile, columns)] + ([counts] if counts else [])
    done = set()
    for main_path, cols in files:   # the log first: it decides what is done
        for path in [p for p in [main_path] + part_files(main_path) if os.path.exists(p)]:
            rows, keep = readers.read_log_prefix(path, cols)
            ids = [int(row.split("\t", 1)[0]) for row in rows]
            if main_path == outfile:
                done.update(ids)
            if main_path == outfile or (set(ids) <= done and len(set(ids)) == len(ids)):
                with open_file(path, "a") as f:   # cut a torn last line
                    f.truncate(keep)
            else:   # counts of examples the log lacks: the rerun redraws them
                seen, kept = set(), []
                for i, row in zip(ids, rows):
                    if i in done and i not in seen:
                        seen.add(i)
                        kept.append(row + "\n")
                text = "\t".join(cols) + "\n" + "".join(kept)
                write_output(path, "vote counts", lambda f: f.write(text.encode("utf-8")), inputs, now=True)
    settings = json.loads(json.dumps(settings, default=str))   # as the sidecar will hold them
    write_json(dict(settings, written=written_now(outfile, settings)), outfile + ".json", "settings of a log", inputs)
    for path, cols in files:
        for log in [path] + part_files(path):   # every rank appends to its own part later
            open_append(log, "\t".join(cols), inputs).close()
    return done


def settings_sha256(sidecar):
    """The sha256 of a sidecar's settings (all but "written"), in a canonical JSON form."""
    import hashlib
    text = json.dumps({k: v for k, v in sidecar.items() if k != "written"}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def written_now(outfile, settings):
    """The sidecar's "written": {file name: {size, sha256}} of the run's files as they are now, and the sha256
    of the sidecar's own settings under its name."""
    files = {os.path.basename(p): {"size": os.path.getsize(p), "sha256": file_sha256(p)} for p in run_files(outfile)}
    return dict(files, **{os.path.basename(outfile) + ".json": settings_sha256(settings)})


def record_written(outfile):
    """Record in the sidecar what the run's files hold now (rank 0, once its lines are complete and merged)."""
    sidecar = readers.read_json_object(outfile + ".json", "settings file of a log")
    write_json(dict(sidecar, written=written_now(outfile, sidecar)), outfile + ".json", "settings of a log")


def merge_parts(outfile, columns, kind="certification log"):
    """Merge `<outfile>.rank*` into the outfile, one line per idx in idx order, then remove the parts.

    The merged file replaces the outfile atomically, and parts are removed only afterwards: a crash at any
    point loses no line (a rerun sees duplicates, which are merged away). Returns the number of data lines.
    """
    parts = part_files(outfile)
    if not parts:
        return None
    rows = {}
    for path in [outfile] + parts:
        if os.path.exists(path):
            for row in readers.read_log_prefix(path, columns)[0]:
                rows.setdefault(int(row.split("\t", 1)[0]), row)
    text = "".join(line + "\n" for line in ["\t".join(columns)] + [rows[i] for i in sorted(rows)])
    write_output(outfile, kind, lambda f: f.write(text.encode("utf-8")), now=True)
    for path in parts:
        remove_output(path)
    return len(rows)


def lock_outputs(locks, outfile):
    """One run per outfile (rank 0): lock <outfile>.lock, and refuse rank files that a live worker of an
    earlier run still holds (under torchrun each rank locks its own <outfile>.rank<r>.lock while it writes)."""
    locks.enter_context(exclusive_lock(outfile + ".lock", f"--outfile {outfile!r}"))
    for part in part_files(outfile):
        common.check(not is_locked(part + ".lock"), f"{part!r} is still written by a worker of an "
                                                    f"earlier run; stop it first")

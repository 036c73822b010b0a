"""The run machinery of the scripts: what a command does around the paper's building blocks.

Flags checked before any work, one-line errors, signals; the output guard (one way to write any file, one lock per
run); each run's record (a log's sidecar, a training run's checkpoint); models loaded; resumable training runs;
torchrun. The building blocks (common.py, the paper's functions in each script) never call it: each can be pasted
alone (tools/copy_size.py measures it)."""
import argparse
import contextlib
import datetime
import errno
import functools
import glob
import hashlib
import json
import math
import os
import random
import re
import shlex
import signal
import stat
import sys
import time

import numpy as np
import torch

import common
import readers


# ====== Commands: one-line errors (common.UserError -> exit code 2), signals, checks of flags before any work

FLAG_NAMES = {}      # dest -> the flag as typed (--elastic-m for elastic_m), for messages about a parsed value
FLAG_DEFAULTS = {}   # dest -> its default, of the last command line parsed (check_mode_options)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is a single line on stderr (exit code 2)."""

    def parse_args(self, args=None, namespace=None):
        subs = [p for a in self._actions if isinstance(a, argparse._SubParsersAction) for p in a.choices.values()]
        actions = [a for parser in [self, *subs] for a in parser._actions if a.option_strings]
        FLAG_NAMES.update({a.dest: max(a.option_strings, key=len) for a in actions})
        FLAG_DEFAULTS.clear()
        FLAG_DEFAULTS.update({a.dest: a.default for a in actions})
        parsed = super().parse_args(args, namespace)
        for name, value in vars(parsed).items():   # an empty value (a path, a device) names nothing: not the default
            if value == "" or isinstance(value, list) and "" in value:
                self.error(f"{flag(name)} is empty; give a value or leave the flag out")
            values = value if isinstance(value, list) else [value]
            if name in ("seed", "seeds") and any(isinstance(s, int) and s < 0 for s in values):
                self.error(f"{flag(name)} must be >= 0 (got {value}): numpy's generators take no "
                           f"negative seed")
            if any(isinstance(v, float) and not (math.isfinite(v) and abs(v) <= FLOAT32_MAX) for v in values):
                self.error(f"{flag(name)} must be a finite number in float32 (|x| < 3.4e38), got "
                           f"{value}")   # --lr 1e300 is inf where models, optimisers and noise compute
            if any(isinstance(v, int) and abs(v) >= 2 ** 63 for v in values):
                self.error(f"{flag(name)} must fit in 64 bits, got {value}")
        return parsed

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


class Interrupted(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that every `finally` and every temporary-file cleanup runs."""


def run(main, exit_process=False):
    """Call main() as a command: a UserError, an OSError or running out of memory is one line on stderr and
    exit code 2, Ctrl-C or SIGTERM one line and 130 or 143 (every file valid and resumable); staged outputs replace
    their files once main() ends well; a torchrun process group is always torn down; a non-zero code is raised as
    SystemExit. exit_process (a script's `__main__`): where this process runs only this command, it ends with
    os._exit after the atexit handlers and a flush, skipping torch's teardown (0.6 s of CPU)."""
    global _STAGED
    saved, outer, _STAGED = (sys.stdout, sys.stderr), _STAGED, {}   # a command run inside another keeps its own
    for stream in saved:   # a file name that is not UTF-8 (in a label, a message) as \xff
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    sys.stdout, sys.stderr = GuardedStream(saved[0]), GuardedStream(saved[1])

    def interrupted(signum, frame):
        raise Interrupted() if signum == signal.SIGTERM else KeyboardInterrupt()
    with contextlib.suppress(ValueError):   # not the main thread (a test runner's worker): keep the default
        signal.signal(signal.SIGTERM, interrupted)
        signal.signal(signal.SIGINT, interrupted)
    code, error = 0, None
    try:
        try:
            main()
        finally:   # a normal end or sys.exit: every output was checked and written, now they replace their files
            while _STAGED and sys.exc_info()[0] in (None, SystemExit):
                path = next(iter(_STAGED))   # in the order they were written
                _install(path, *_STAGED.pop(path))
    except SystemExit as e:
        code = e.code
    except common.UserError as e:
        code, error = 2, f"error: {e}"
    except OSError as e:   # disk full, a read-only folder, ...: what the system said, on one line
        code, error = 2, f"error: {e.strerror or e}{f' ({e.filename})' if e.filename else ''}; {written_so_far()}"
    except KeyboardInterrupt as e:
        signame = "SIGTERM" if isinstance(e, Interrupted) else "SIGINT"
        code, error = 143 if isinstance(e, Interrupted) else 130, (f"interrupted ({signame}): every file is complete "
                                                                  f"or resumable; rerun the same command to continue")
    except (MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        sizes = [flag(d) for d in ("batch", "N", "m") if d in FLAG_DEFAULTS]   # this command's
        code, error = 2, f"error: out of memory{'; lower ' + ' or '.join(sizes) if sizes else ''}; {written_so_far()}"
    finally:
        for tmp, *_ in (_STAGED or {}).values():
            _discard(tmp)
        _STAGED = outer
        if error:
            sys.stderr.write(error + "\n")
        end_distributed(wait=False)
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved
    orig = list(getattr(sys, "orig_argv", []))   # `python [options] script.py args`, not -m (a profiler) or -c
    own = sys.argv[:1] != [""] and orig[-len(sys.argv):] == sys.argv and \
        not any(a.startswith(("-m", "-c")) for a in orig[1:-len(sys.argv)])
    if not (exit_process and own):
        if code != 0:
            sys.exit(code)
        return
    if not isinstance(code, int):   # sys.exit("text") or sys.exit(None), as the interpreter handles them
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    import atexit
    atexit._run_exitfuncs()   # what the interpreter runs at exit (worker processes, logging), then no teardown
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):   # a broken pipe, a closed stream (None)
            stream.flush()
    os._exit(code)


class GuardedStream:
    """sys.stdout or sys.stderr while a command runs: once the stream is closed (`>&-`: None) or broken (`| head`
    has exited), writes are dropped instead of raising, so what the terminal no longer shows never stops the work."""

    def __init__(self, stream):
        self.stream, self.broken = stream, stream is None

    def _do(self, op, *args):
        if not self.broken:
            try:
                return getattr(self.stream, op)(*args)
            except (OSError, ValueError):   # EPIPE, EBADF, a closed file object
                self.broken = True

    def write(self, text):
        self._do("write", text)
        return len(text)

    def flush(self):
        self._do("flush")

    def isatty(self):
        return not self.broken and self.stream.isatty()

    def __getattr__(self, name):   # encoding, fileno, ...: the stream's own
        return getattr(self.stream, name)


def is_out_of_memory(e):
    """True for Python's MemoryError and torch's allocator failing on a GPU or on the CPU."""
    return isinstance(e, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))) or isinstance(
        e, RuntimeError) and any(words in str(e).lower() for words in ("out of memory", "can't allocate memory"))


FLOAT32_MAX = 3.4028234663852886e38   # numbers reach the models, optimisers and noise in float32
MAX_DRAWS = common.MAX_DRAWS           # --N, --N0: beyond, one example takes hours on any machine
MAX_BATCH_BYTES = 2 ** 33              # one pass of noisy inputs (float32) above 8 GiB is a typo, not a setting
SIGMA_RANGE = (1e-4, 1e4)              # inputs lie in [0, 1]: below, float32 loses the noise; above, the input
SIGMA_MAX_FP16 = 1e3                   # fp16 overflows at 65504: x + 7 sigma must stay below it


def flag(dest):
    """The flag of an argparse dest as the user types it."""
    return FLAG_NAMES.get(dest, "--" + dest.replace("_", "-"))


def check_mode_options(args, modes, alone=None):
    """Refuse an option given while none of its modes is on (modes: {option: its modes}, argparse dests): ignoring
    it would run something else than asked. alone: {mode: the options it uses}; with the mode on, any other option
    set away from its default is refused too."""
    for option, needs in modes.items():
        common.check(getattr(args, option) is None or any(getattr(args, m) for m in needs),
                     f"{flag(option)} goes with {' or '.join(map(flag, needs))}")
    for mode, used in (alone or {}).items():
        unused = [d for d, v in vars(args).items() if getattr(args, mode) and d != mode and d not in used and
                  d in FLAG_DEFAULTS and v != FLAG_DEFAULTS[d]]
        common.check(not unused, f"{', '.join(map(flag, unused))} {'does' if len(unused) == 1 else 'do'} not "
                                 f"apply to {flag(mode)}")


def check_sigma(sigma, what="--sigma", precision="fp32"):
    """Refuse a sigma the arithmetic cannot carry (the noise rounded away, or overflowing to inf)."""
    low, high = SIGMA_RANGE[0], SIGMA_MAX_FP16 if precision == "fp16" else SIGMA_RANGE[1]
    common.check(isinstance(sigma, (int, float)) and not isinstance(sigma, bool) and low <= sigma <= high,
                 f"{what} must lie in [{low:g}, {high:g}]{' under fp16' if precision == 'fp16' else ''} (inputs are in "
                 f"[0, 1]), got {sigma}")


def check_batch_bytes(inputs, shape, what="--batch"):
    """`inputs` noisy inputs of `shape` in float32 fit in MAX_BATCH_BYTES: checked before anything is allocated."""
    size = inputs * 4 * math.prod(shape)
    common.check(size <= MAX_BATCH_BYTES, f"{what} asks for {inputs} noisy inputs of shape {tuple(shape)} at once "
                                          f"({size / 2 ** 30:.3g} GiB); lower it")


def check_training_settings(settings):
    """What every training script refuses before anything is written (settings: its
    flags): numbers out of range, a batch too large, --sync-bn on the CPU."""
    if settings.get("sigma") is not None:
        check_sigma(settings["sigma"], precision=settings.get("amp") or "fp32")
    if settings.get("dataset") in common.INPUT_SHAPE and isinstance(settings.get("batch"), int):
        m = settings.get("m") if isinstance(settings.get("m"), int) else 1
        check_batch_bytes(settings["batch"] * max(m, 1), common.INPUT_SHAPE[settings["dataset"]], "--batch x --m")
    common.check(settings["lr"] > 0, f"--lr must be > 0, got {settings['lr']}")
    common.check(settings.get("save_every") is None or settings["save_every"] >= 0, "--save_every must be >= 0")
    common.check(settings["momentum"] >= 0 and settings["weight_decay"] >= 0,
                 f"--momentum and --weight_decay must be >= 0, got {settings['momentum']} and {settings['weight_decay']}")
    arch, dataset = settings.get("arch"), settings.get("dataset")
    common.check(arch not in common.ARCH_DATASETS or dataset in common.ARCH_DATASETS[arch],
                 f"--arch {arch} does not take {dataset}'s inputs; it takes "
                 f"{' and '.join(common.ARCH_DATASETS.get(arch, ()))}")
    device = get_device(settings.get("device"))   # one this project runs on, before any file
    common.check(not settings.get("sync_bn") or device.type != "cpu",
                 "--sync-bn needs GPUs (torch's SyncBatchNorm does not run on the CPU); drop it")
    common.check(settings.get("max_batches") is None or settings["max_batches"] >= 1,
                 f"--max-batches must be >= 1 (omit it for whole epochs), got {settings.get('max_batches')}")


def get_device(name=None):
    """torch.device from --device, default cuda when available."""
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise common.UserError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    common.check(device.type == "cuda" or device == torch.device("cpu"), f"device {name!r} is not one this project "
                                                                         f"runs on; use cpu, cuda or cuda:N")
    common.check(device.type != "cuda" or torch.cuda.is_available(), f"device {name!r} requested but CUDA is not "
                                                                      f"available")
    return device


def torchrun_env():
    """(rank, world size) from torchrun's environment, (0, 1) without it; values torchrun would not set refused."""
    given = [k for k in ("RANK", "WORLD_SIZE") if k in os.environ]
    if not given:
        return 0, 1
    common.check(len(given) == 2 and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ,
                 f"{' and '.join(given)} set without torchrun's other variables (RANK, WORLD_SIZE, MASTER_ADDR, "
                 f"MASTER_PORT): unset them, or start the command with torchrun")
    rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
    common.check(rank.isdigit() and world.isdigit() and int(rank) < int(world),
                 f"RANK={rank!r} and WORLD_SIZE={world!r} are not torchrun's (a rank below the world size): unset "
                 f"them, or start the command with torchrun")
    return int(rank), int(world)


def check_precision(precision, device):
    """Refuse a precision `device` cannot run (fp16: CUDA only); warn of bf16 emulated on a CPU."""
    device = torch.device(device)
    common.check(precision in common.PRECISIONS,
                 f"unknown precision {precision!r}; choose one of {', '.join(common.PRECISIONS)}")
    common.check(precision != "fp16" or device.type == "cuda", "fp16 needs a CUDA device; use bf16 on the CPU")
    common.check(precision != "bf16" or device.type != "cuda" or torch.cuda.is_bf16_supported(),
                 "this GPU does not support bf16; use fp16")
    flags = cpu_info()[1] if precision == "bf16" and device.type == "cpu" else None   # None: unknown, or not asked
    if flags is not None and not {"avx512_bf16", "amx_bf16"} & set(flags):   # emulated: slower than fp32
        print("warning: bf16 on a CPU without native bf16 (no avx512_bf16 or amx_bf16 in /proc/cpuinfo): it is "
              "emulated and slower than fp32 here (8x in certification on an AVX2-only AMD EPYC, "
              "results/speed/bf16_cpu.txt); fp32 is faster on this machine", file=sys.stderr)


# ====== Outputs: one way to write any file, one lock per run

# Every file goes through write_output (whole, renamed into place) or open_append (logs growing a line at a time).
# A run's record is its log's sidecar (<log>.json) or its checkpoint; tables and figures have their outputs.json.

_WRITTEN = []        # the files this process has completed, for the message of a failed write
_HELD_LOCKS = set()  # realpaths of the exclusive_locks this process holds (not "another run")
_INPUTS = []         # the files the running command reads (set_inputs): never written over
_STAGED = None       # inside run: {path: (its temporary file, kind)} of tables and reports, renamed at the end
_PROVENANCE = {}     # provenance() of the command running: its inputs hashed once
OUTPUTS = "outputs.json"   # a folder's record of the tables, figures and reports written into it


def open_file(path, mode, new=False, encoding=None):
    """Open a file this project writes (an appended log, a temporary, a lock) or hashes: never through a symbolic
    link, never waiting on a FIFO, never a device (O_NOFOLLOW, O_NONBLOCK, the type read from the open
    descriptor). mode "r", "a" or "w" (+ "b"); new=True creates the file or refuses; "w" does not truncate."""
    flags = {"r": os.O_RDONLY, "a": os.O_WRONLY | os.O_APPEND | os.O_CREAT, "w": os.O_WRONLY | os.O_CREAT}[mode[0]]
    for name in ("O_NOFOLLOW", "O_NONBLOCK", "O_CLOEXEC", "O_BINARY") + (("O_EXCL",) if new else ()):
        flags |= getattr(os, name, 0)
    why = "is not a regular file (a FIFO, device or socket); move it away"
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if os.path.islink(path):
            why = f"is a symbolic link (to {os.readlink(path)!r}); this project writes only plain files: move it away"
        elif new and e.errno == errno.EEXIST:
            why = "exists (a file left by another program?); move it away"
        elif not os.path.exists(path) or stat.S_ISREG(os.stat(path).st_mode):
            why = f"cannot be opened ({e.strerror or type(e).__name__})"
        raise common.UserError(f"{path!r} {why}") from None
    try:
        common.check(stat.S_ISREG(os.fstat(fd).st_mode), f"{path!r} {why}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode, encoding=encoding)
    except BaseException:
        os.close(fd)
        raise


def _flock(f, wait=False):
    """The kernel's lock on an open file or folder (flock); False while another holds it. Windows: no lock."""
    try:
        import fcntl
    except ImportError:
        return True
    try:
        fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def exclusive_lock(path, what, wait=False):
    """Hold the lock file `path` for the block: one run per output (certify.py's <outfile>.lock); a second run
    gets a UserError at once (wait: it blocks). The file goes as the block ends; as a process that opened it just
    before may then lock the removed file, the path must still name the file locked, else it is taken anew."""
    while True:
        f = open_file(path, "a")
        try:
            common.check(_flock(f, wait), f"{what} is in use by another run (it holds {path}); wait for that run "
                                          f"to end, or choose another output")
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
                    common.check(os.fstat(f.fileno()).st_size == 0, f"{path!r} exists and is not a lock of this "
                                                                    f"project (it holds data); move it away")
                    break
        except BaseException:
            f.close()
            raise
        f.close()
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
    """Hold the lock of the folder itself (made if missing): one command writing into it at a time. A folder it
    made and left empty (a refused or failed command) is removed."""
    made = not os.path.lexists(folder)
    make_outdir(folder)
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)) \
        if os.name == "posix" else None
    try:
        common.check(fd is None or _flock(fd), f"{what} is in use by another run writing into it; wait for it to "
                                               f"end, or choose another folder")
        yield
    finally:
        if fd is not None:
            os.close(fd)
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def is_locked(path):
    """True when another process holds exclusive_lock(path) now."""
    if not os.path.exists(path):
        return False
    with open_file(path, "r") as f:
        return not _flock(f)   # a lock taken here is dropped as the file closes


def set_inputs(paths):
    """Declare the files the command now starting reads (a folder: every file under it): never written over."""
    _INPUTS.clear()
    _PROVENANCE.clear()
    _WRITTEN.clear()
    for path in filter(None, paths):
        _INPUTS.extend([os.path.join(r, f) for r, _, files in os.walk(path) for f in files] if os.path.isdir(path)
                       else [path])


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
    common.check((problem := output_problem(path, inputs)) is None, problem)


def _not_written(path, e):
    return common.UserError(f"{path!r} not written ({e.strerror or type(e).__name__}), its previous content is "
                            f"intact; {written_so_far()}")


def write_output(path, kind, write, inputs=(), now=False, announce=False):
    """Write the file `path` (of a `kind`: 'table', 'checkpoint', ...) through the guard; returns path.

    write(f) puts the content into the binary file f: a new temporary file <path>.tmp<pid>, fsynced, renamed over
    `path`; a failed write (disk full, Ctrl-C) leaves `path` as it was and removes the temporary. One a killed
    process left (SIGKILL, a power cut) stays: nothing tells it from a user's file of that name.
    now=True: a file of a run's own state (checkpoint, sidecar, log), which its record covers, renamed at once.
    Else a table, figure or report: it replaces only a file its folder's outputs.json lists as this kind with the
    content recorded, and inside run only as the command ends (a command refused at its last output changed none).
    announce: say "wrote <path>" on stderr once the file is in place. One path takes one kind of output a command."""
    check_output(path, inputs)
    common.check(not _STAGED or path not in _STAGED or _STAGED[path][1] == kind,
                 f"{path!r} is given for two outputs of this command ({_STAGED and path in _STAGED and _STAGED[path][1]}"
                 f", {kind}); give each its own path")
    problem = None if now else owned_problem(path, kind)
    common.check(problem is None, problem)
    make_outdir(os.path.dirname(os.path.abspath(path)))
    if _STAGED and path in _STAGED:   # written twice in one command: the last content counts
        _discard(_STAGED.pop(path)[0])
    try:
        tmp = _write_temp(path, write)
    except OSError as e:
        raise _not_written(path, e) from None
    if _STAGED is not None and not now:
        _STAGED[path] = tmp, kind, announce
    else:
        _install(path, tmp, None if now else kind, announce)
    return path


def read_outputs(folder):
    """The record of the tables, figures and reports in `folder`: {file name: {"kind", "by", "sha256", and what
    it was made from (provenance): "command", "inputs_sha256", "models"}}."""
    path = os.path.join(folder, OUTPUTS)
    record = readers.read_json_object(path, "record of outputs") if os.path.lexists(path) else {}
    common.check(all(isinstance(v, dict) and {"kind", "by", "sha256"} <= set(v) for v in record.values()),
                 f"{path}: not this project's record of outputs (expected {{file name: {{kind, by, sha256}}}}); move "
                 f"it away")
    return record


def owned_problem(path, kind):
    """Why a table, figure or report may not replace the existing `path`, or None: only a file its
    folder's record lists as this kind, with the content recorded (or the one before a cut-short rename), is ours."""
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
    """A new temporary file beside `path` (<name>.tmp<pid>) holding what write(f) put in it, fsynced."""
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


def _replace(tmp, path):
    try:
        os.replace(tmp, path)   # atomic: a stop leaves the old file or the new one
    except BaseException:
        _discard(tmp)
        raise


def _install(path, tmp, kind=None, announce=False):
    """Rename the temporary file `tmp` over `path`; a table, figure or report (kind) has its new hash put
    into its folder's record first, beside the old one ("was") until the rename is done: a stop anywhere leaves a
    record that accepts the file."""
    folder, name = os.path.split(os.path.abspath(path))
    record, record_path = read_outputs(folder) if kind is not None else None, os.path.join(folder, OUTPUTS)
    save_record = lambda: _replace(_write_temp(record_path, lambda f: f.write(  # noqa: E731
        (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())), record_path)
    try:
        if kind is not None:
            record[name] = {"kind": kind, "by": os.path.basename(sys.argv[0] or "python"), "sha256": file_sha256(tmp),
                            **provenance()}
            if os.path.isfile(path):
                record[name]["was"] = file_sha256(path)
            save_record()
        _replace(tmp, path)
        if kind is not None:
            record[name].pop("was", None)
            save_record()
    except OSError as e:
        _discard(tmp)
        raise _not_written(path, e) from None
    with contextlib.suppress(OSError):   # the rename survives a power cut (POSIX)
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _WRITTEN.append(path)
    if announce:
        print(f"wrote {path}", file=sys.stderr)


def provenance():
    """What a table, figure or report was made from, for its folder's record: the command line (shell-quoted,
    paths relative), the sha256 over the files it read (set_inputs) and their settings files (path, then hash, a
    line each), and {input: the checkpoint hash its settings file names}. Hashed once a command."""
    key = (tuple(sys.argv), tuple(sorted(set(_INPUTS))))
    if key not in _PROVENANCE:
        lines, models = [], {}
        for path in key[1]:
            for p in (path, path + ".json"):
                if os.path.isfile(p):
                    lines.append(f"{os.path.relpath(p)}\t{file_sha256(p)}\n")
            with contextlib.suppress(OSError, ValueError, common.UserError):   # <log>.json or <stem>.json
                if isinstance(sha := readers.read_sidecar(path).get("checkpoint_sha256"), str):
                    models[os.path.relpath(path)] = sha
        command = [os.path.basename(sys.argv[0] or "python")] + [os.path.relpath(a) if os.path.isabs(a) else a
                                                                 for a in sys.argv[1:]]
        _PROVENANCE.clear()
        _PROVENANCE[key] = {"command": shlex.join(command), "models": models, "inputs_sha256": hashlib.sha256(
            "".join(lines).encode("utf-8", "surrogateescape")).hexdigest()}
    return dict(_PROVENANCE[key])


def write_text_output(path, kind, text, inputs=(), announce=False):
    """write_output of a text (UTF-8; a file name that is not UTF-8, in a label, shows its bytes as \\xff)."""
    return write_output(path, kind, lambda f: f.write(text.encode("utf-8", "backslashreplace")), inputs,
                        announce=announce)


def write_json(obj, path, kind="settings", inputs=()):
    """obj as pretty JSON (args.json, sidecars, summaries), through the guard, at once (a run's record)."""
    text = json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"
    return write_output(path, kind, lambda f: f.write(text.encode("utf-8")), inputs, now=True)


def _cell(value):
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def write_tsv(path, columns, rows, kind, inputs=(), now=True):
    """A whole TSV file, the header `columns` then `rows` (floats as %.6g), through the guard (write_output)."""
    text = "".join("\t".join(map(_cell, row)) + "\n" for row in [columns, *rows])
    return write_output(path, kind, lambda f: f.write(text.encode("utf-8", "backslashreplace")), inputs, now)


def open_append(path, header, inputs=()):
    """Open the log `path` to append rows, through the guard; a new or empty file gets `header` (a line) first.
    The caller flushes each row: a kill leaves at most a torn last line, which the readers drop."""
    check_output(path, inputs)
    f = open_file(path, "a", encoding="utf-8")
    if f.tell() == 0:
        f.write(header + "\n")
        f.flush()
    return f


def remove_output(path):
    """Remove an output of this command's run through the guard (its folder's record of outputs too)."""
    if os.path.basename(path) != OUTPUTS:
        check_output(path)
    if os.path.lexists(path):
        os.remove(path)


def file_sha256(path, size=None):
    """The sha256 of a file's bytes (hex), or of its first `size` bytes, read in 1 MiB blocks."""
    digest, left = hashlib.sha256(), math.inf if size is None else size
    with open_file(path, "rb") as f:
        while left > 0 and (block := f.read(int(min(1 << 20, left)))):
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


# ====== Run identity and environment: what a record says a run was made from and with

def data_fingerprint(name, split, data_dir=None):
    """A short hash naming the data a run reads (a resume on other data is refused): digits'
    bundled arrays, or each file's relative path, size and sha256 (other images under the same names are other data;
    hidden and special files are left out, as the loader skips them). About 5 s for CIFAR-10's train split."""
    import concurrent.futures
    digest = hashlib.sha256(f"{name}/{split}".encode())
    if name == "digits":
        ds = common._digits(split)
        digest.update(ds.images.numpy().tobytes() + ds.labels.numpy().tobytes())
        return digest.hexdigest()[:16]
    data_dir = data_dir or common.default_data_dir()
    folder = os.path.join(data_dir, "train" if split == "train" else {"cifar10": "test", "imagenet": "val"}[name])
    if not os.path.isdir(folder):
        folder = os.path.join(data_dir, "cifar-10-batches-py")   # torchvision's CIFAR-10 files
    paths = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        paths += [p for p in (os.path.join(root, f) for f in sorted(files) if not f.startswith(".")) if os.path.isfile(p)]
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:   # sha256 frees the GIL
        for path, content in zip(paths, pool.map(lambda p: hashlib.sha256(readers.read_bytes(p)).hexdigest(), paths)):
            digest.update(f"{os.path.relpath(path, folder)}\t{os.path.getsize(path)}\t{content}\n".encode())
    return digest.hexdigest()[:16]


def run_identity(script, dataset, data_dir=None):
    """What a run is, beyond its settings: the script that runs it and the data it trains and tests on."""
    return {"script": script, "data": {split: data_fingerprint(dataset, split, data_dir) for split in ("train", "test")}}


def environment():
    """The software and the machine a result is made with (in every sidecar, args.json and report header)."""
    import importlib.metadata
    import platform
    versions = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
                "numpy_blas": None, **{name: importlib.metadata.version(name) for name in ("torchvision", "scipy")}}
    with contextlib.suppress(Exception):   # older numpy: no dict form; the record is informative only
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        versions["numpy_blas"] = f"{blas.get('name')} {blas.get('version', '')}".strip()
    cpu, flags = cpu_info()
    wanted = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")
    versions["cpu"] = {"model": cpu or platform.processor() or platform.machine(), "logical_cpus": os.cpu_count(),
                       "extensions": [f for f in wanted if f in (flags or [])],
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
    """What the CPU math libraries run in this process, from the libraries themselves: oneDNN's ISA
    ("Intel AVX2"), the core OpenBLAS chose ("Haswell"), the ISA_PINS set; None where unknown. oneDNN says its ISA
    in its verbose output (a C printf to descriptor 1): one small convolution runs with that descriptor caught."""
    import tempfile
    found = {"onednn_isa": None, "openblas_core": None,
             "isa_pins": {name: os.environ[name] for name in ISA_PINS if name in os.environ}}
    # no descriptor 1 (a closed stdout), a build without verbose, no threadpoolctl: the record is informative only
    with contextlib.suppress(Exception), tempfile.TemporaryFile() as caught:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(caught.fileno(), 1)
        try:   # a batch of 2 of this size goes to oneDNN (a smaller one may not)
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                torch.nn.functional.conv2d(torch.ones(2, 3, 32, 32), torch.ones(6, 3, 5, 5))
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        caught.seek(0)
        found["onednn_isa"] = next((line.split("isa:", 1)[1].strip() for line in
                                    caught.read().decode(errors="replace").splitlines() if ",isa:" in line), None)
    with contextlib.suppress(Exception):
        import threadpoolctl
        found["openblas_core"] = next((lib.get("architecture") for lib in threadpoolctl.threadpool_info()
                                       if lib.get("internal_api") == "openblas"), None)
    return found


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


def cpu_info(cpuinfo="/proc/cpuinfo"):
    """(the CPU's model name, its list of flags) from /proc/cpuinfo; None for what it does not say (not Linux)."""
    try:
        with open(cpuinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    model, flags = ([line.split(":", 1)[1] for line in lines if line.startswith(key)] for key in ("model name", "flags"))
    return model[0].strip() if model else None, flags[0].split() if flags else None


# ====== Checkpoints: atomic save (readers.load_model loads ours and the released ones without running code)

def save_checkpoint(state, path, kind="checkpoint", inputs=()):
    """torch.save through the guard, at once (a run's own state); into memory first, as torch's zip writer turns
    a Ctrl-C or an error of the file mid-write into another error."""
    import io

    def write(f):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        f.write(buffer.getbuffer())
    write_output(path, kind, write, inputs, now=True)


# ====== Training runs: the folder and its lock, resumable checkpoints, the epoch log, progress, torchrun

CHECKPOINT = "checkpoint.pth.tar"


def make_outdir(outdir):
    """Create the output folder (or raise a UserError saying it cannot be written); returns it."""
    try:
        os.makedirs(outdir, exist_ok=True)
    except OSError as e:
        raise common.UserError(f"cannot write to output folder {outdir!r} ({e.strerror}); choose a folder that "
                               f"can be written") from None
    common.check(os.access(outdir, os.W_OK | os.X_OK),   # asks without writing (read-only file systems too)
                 f"cannot write to output folder {outdir!r} (permission denied or read-only); choose a folder that "
                 f"can be written")
    return outdir


def _dist():
    """torch.distributed when this process is in a process group (under torchrun), else None."""
    import torch.distributed as dist
    return dist if dist.is_available() and dist.is_initialized() else None


def get_rank():
    """This process's rank under torchrun (0 without a process group)."""
    return _dist().get_rank() if _dist() else 0


def get_world_size():
    """Number of training processes under torchrun (1 without a process group)."""
    return _dist().get_world_size() if _dist() else 1


def is_main_process():
    """True on rank 0: the one process that evaluates, logs and writes checkpoints."""
    return get_rank() == 0


def setup_distributed(device_name=None):
    """The training device; under torchrun also the process group (nccl on GPUs, gloo on the CPU)."""
    device = get_device(device_name)
    if torchrun_env() == (0, 1) and "RANK" not in os.environ:   # not started by torchrun
        return device
    import torch.distributed as dist
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def end_distributed(wait=True):
    """Leave the process group (a no-op without one) once every rank is done; wait: first meet the
    other ranks at a barrier. A gloo group alive at exit aborts the process ("terminate called without an active
    exception")."""
    import gc
    if (dist := _dist()) is None:
        return
    gc.collect()   # a DDP model caught in a reference cycle still holds the group: free it, so that destroying
    if wait:       # the group really joins gloo's threads
        dist.barrier()
    dist.destroy_process_group()


def run_folder_lock(outdir, precision="fp32", device="cpu"):
    """The run folder, created and locked on rank 0 (folder_lock): two training runs on one --outdir
    would overwrite each other's files. The precision is checked first: a run that cannot start leaves no folder."""
    check_precision(precision, device)
    if not is_main_process():
        return contextlib.nullcontext(make_outdir(outdir))
    return folder_lock(outdir, f"run folder {outdir!r}")


def wrap_model(model, device, sync_bn=False):
    """DistributedDataParallel around the model under torchrun (--sync-bn: SyncBatchNorm, GPUs only)."""
    if get_world_size() == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) if sync_bn else model
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)


def broadcast(tensor):
    """Rank 0's tensor on every rank (in place); a no-op without a process group. Keeps kept sets identical."""
    if get_world_size() > 1:
        _dist().broadcast(tensor, src=0)
    return tensor


def _rng_state():
    """Every global generator's state as tensors and plain values (so checkpoints load with weights_only)."""
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
    cuda = {"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {}
    return {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate(), **cuda}


def _set_rng_state(state):
    torch.set_rng_state(state["torch"].cpu())
    numpy_state = state["numpy"]   # its key saved as a tensor: checkpoints hold tensors only
    np.random.set_state(dict(numpy_state, state=dict(numpy_state["state"],
                                                     key=numpy_state["state"]["key"].cpu().numpy().astype(np.uint32))))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save_training_checkpoint(outdir, model, optimizer, scheduler, epoch, args, extra=None, save_every=0):
    """Write outdir/checkpoint.pth.tar after `epoch` epochs (rank 0), and a copy
    checkpoint_epoch{epoch}.pth.tar every `save_every` epochs (0: never). args: the run's arguments; extra: the
    method's state a resume needs. certify.py reads it as it reads Cohen's; as the run's record it holds the size
    and sha256 of log.tsv now, which a resume checks."""
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
                     "trust_checkpoint", "gradnorm", "probe", "note", "channels_last", "compile", "cuda_graph"}


def resume_mismatches(saved_args, args):
    """'key old -> new' for every setting both know that differs and is not RESUME_MAY_CHANGE; the run identity
    ('run': script and data) part by part, so that the message names what differs."""
    diff = []
    for k in sorted(set(saved_args) & set(args) - RESUME_MAY_CHANGE):
        old, new = saved_args[k], args[k]
        if k == "run" and isinstance(old, dict) and isinstance(new, dict):
            diff += [f"script {old.get('script')!r} -> {new.get('script')!r}"] * (old.get("script") != new.get("script"))
            diff += ["data: other images than the run was trained on (--data-dir?)"] * (old.get("data") != new.get("data"))
        elif old != new and not (isinstance(new, (list, tuple)) and list(new) == list(old or [])):
            diff.append(f"{k} {old!r} -> {new!r}")
    return diff


RUN_FILES = ("log.tsv", "checkpoint*.pth.tar", "discard.json", "pA_epoch*.tsv")   # what a training run writes


def foreign_run_files(outdir, epoch):
    """The files named like a training run's in outdir (RUN_FILES) that its run, resumed after `epoch` epochs (0: a
    new run of our args.json), did not write and may replace: a checkpoint copy or pA estimates of a later epoch,
    or in another form than ours (a stop in the epoch it resumes at may have left its own)."""
    found = lambda pattern: sorted(glob.glob(os.path.join(glob.escape(outdir), pattern)))   # noqa: E731
    later = lambda p: int(re.search(r"epoch(\d+)", os.path.basename(p)).group(1)) > epoch   # noqa: E731
    header = lambda p, columns: os.path.isfile(p) and readers.read_header(p) == "\t".join(columns)   # noqa: E731
    theirs = [p for p in found("checkpoint_epoch*.pth.tar") if later(p)] + [
        p for p in found("pA_epoch*.tsv") if later(p) or not header(p, readers.PA_COLUMNS)]
    theirs += [p for p in found("log.tsv") if epoch == 0 and not header(p, readers.TRAIN_LOG_COLUMNS)]
    def keys(p):   # those of train_ours.discard_step's summary; None: no JSON object
        with contextlib.suppress(common.UserError):
            return set(readers.read_json_object(p, "discard summary"))
    return theirs + [p for p in found("discard.json") if keys(p) != {"epoch", "pt", "N", "kept", "total", "ratio"}]


def start_or_resume(model, optimizer, scheduler, outdir, resume, expect=None, trust=False, args=None):
    """Start a new run in outdir, or (resume) restore it from its checkpoint; returns (epochs done,
    the checkpoint's `extra`), (0, {}) for a new run. A new run refuses a folder holding a checkpoint or another's
    args.json. On resume the checkpoint must have `expect`'s values, every setting of args that is not
    RESUME_MAY_CHANGE must be the checkpoint's, and log.tsv must begin with what the checkpoint says it held."""
    path = os.path.join(outdir, CHECKPOINT)
    if not resume:
        common.check(not os.path.lexists(path), f"{outdir!r} already holds a run ({CHECKPOINT}); pass --resume to "
                                                f"continue it, or choose another --outdir")
        settings, own = os.path.join(outdir, "args.json"), None   # ours: a run that stopped before its checkpoint
        with contextlib.suppress(common.UserError):
            own = not os.path.islink(settings) and readers.read_json_object(settings, "settings of a run")
        ours = isinstance(own, dict) and {"outdir", "seed", "environment"} <= set(own)
        theirs = foreign_run_files(outdir, 0) if ours else [settings] * os.path.lexists(settings) + sorted(
            p for pattern in RUN_FILES for p in glob.glob(os.path.join(glob.escape(outdir), pattern)))
        common.check(not theirs, f"{theirs[0] if theirs else ''!r} exists and was not written by a run of ours: a "
                                 f"new run would replace it; move it away or choose another --outdir")
        return 0, {}
    common.check(os.path.isfile(path), f"--resume: no {CHECKPOINT} in {outdir!r}; start the run without --resume")
    ckpt = readers.load_checkpoint(path, "cpu", trust)   # load_state_dict moves it to the model's device
    missing = [k for k in ("epoch", "optimizer", "scheduler", "rng", "log") if k not in ckpt] + \
        ["args.run (its run identity: script and data)"] * (isinstance((args or {}).get("run"), dict) and
                                          not isinstance((ckpt.get("args") or {}).get("run"), dict))
    common.check(not missing, f"--resume: {path!r} lacks {', '.join(missing)} (not a checkpoint of a training run "
                              f"of ours); start a new run in another --outdir")
    for key, value in (expect or {}).items():
        common.check(ckpt.get(key) == value, f"--resume: the checkpoint in {outdir!r} has {key}={ckpt.get(key)!r}, "
                                             f"this run has {key}={value!r}; use the same settings or another --outdir")
    theirs = foreign_run_files(outdir, int(ckpt["epoch"]))
    common.check(not theirs, f"--resume: {theirs[0] if theirs else ''!r} exists and was not written by this run up to "
                             f"its checkpoint (epoch {ckpt['epoch']}): the run would replace it; move it away")
    diff = resume_mismatches(ckpt.get("args") or {}, args or {})
    common.check(not diff, f"--resume: {outdir!r} was trained with other settings ({'; '.join(diff)}); resume with "
                           f"the same ones, or start a new run in another --outdir")
    log, kept = os.path.join(outdir, "log.tsv"), ckpt["log"]
    common.check(isinstance(kept, dict) and os.path.isfile(log) and os.path.getsize(log) >= kept.get("size", 0) and
                 (not kept.get("size") or file_sha256(log, kept["size"]) == kept.get("sha256")),
                 f"--resume: {log!r} is missing or changed since the run wrote it (its checkpoint records what it "
                 f"held); start a new run in another --outdir")
    state = readers.state_dict_of(path, ckpt, model)
    try:
        common.unwrap(model).load_state_dict(state)
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise common.UserError(f"--resume: {path!r} does not fit this model/optimizer ({type(e).__name__}); "
                               f"use the same settings or another --outdir") from None
    _set_rng_state(ckpt["rng"])
    return int(ckpt["epoch"]), ckpt.get("extra") or {}


def open_train_log(outdir, start_epoch):
    """outdir/log.tsv open for log_epoch (rank 0; None elsewhere), without the rows of epochs >=
    start_epoch, which a resumed run is about to redo."""
    if not is_main_process():
        return None
    path, columns = os.path.join(outdir, "log.tsv"), readers.TRAIN_LOG_COLUMNS
    rows = [[r[c] for c in columns] for r in readers.read_train_log(path) if int(r["epoch"]) < start_epoch] \
        if start_epoch > 0 and os.path.isfile(path) else []
    write_tsv(path, columns, rows, "training log")
    return open_append(path, "\t".join(columns))


def format_eta(done, total, start):
    """'12.3/s, ETA 0:04:10' for `done` of `total` items since time.time() == start."""
    elapsed = time.time() - start
    rate = done / elapsed if elapsed > 0 else 0.0
    eta = datetime.timedelta(seconds=int((total - done) / rate)) if rate > 0 else "?"
    return f"{rate:.2f}/s, ETA {eta}"


def log_epoch(log, epoch, epochs, run_start, first_epoch, row):
    """One row of the log open_train_log opened (epoch 0-based; row: the other TRAIN_LOG_COLUMNS), and a
    stdout line with the ETA from the epochs this process ran since run_start (from first_epoch). Rank 0 only."""
    if log is None:
        return
    print("\t".join(_cell(dict(row, epoch=epoch).get(c, "")) for c in readers.TRAIN_LOG_COLUMNS), file=log, flush=True)
    os.fsync(log.fileno())   # the epoch's row survives a power cut, as its checkpoint does
    per_epoch = (time.time() - run_start) / max(epoch + 1 - first_epoch, 1)
    eta = datetime.timedelta(seconds=int(per_epoch * (epochs - epoch - 1)))
    print(f"epoch {epoch + 1}/{epochs}  {row['time']:.1f}s  lr {row['lr']:.4g}  "
          f"train loss {row['train_loss']:.4f} acc {row['train_acc']:.4f}  "
          f"noisy test loss {row['test_loss']:.4f} acc {row['test_acc_noisy']:.4f}  "
          f"kept {row['kept']}  ETA {eta}", flush=True)


def progress_line(prefix, every=60.0):
    """A progress callable(done, total) for train_epoch: '<prefix> batch 12/196, 3.1/s, ETA ...' on
    stderr, in place on a terminal, else every `every` seconds at most (rank 0)."""
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
    """The guard on a gradient-norm file of the checkpoint inputs[0]: never one its record names another for."""
    for p in (path, path + ".json"):
        check_output(p, inputs)
    old = readers.read_json_object(path + ".json", "record of gradient norms") if os.path.isfile(path + ".json") else {}
    ours = {"script", "probe", "N", "seed", "sigma"} <= set(old)   # measure_grad_norms' record
    common.check(not (os.path.lexists(path) or os.path.lexists(path + ".json")) or ours,
                 f"{path!r} or its record exists and was not written by this project's --gradnorm (no record of "
                 f"ours beside it); move it away or choose another --outdir")
    common.check(old.get("checkpoint_sha256") in (None, readers.loaded_sha256(inputs[0]) if inputs else None),
                 f"{path!r} was made from another checkpoint ({old.get('checkpoint')!r}): two inputs would share one "
                 f"output; choose another output (--outdir)")


def measure_grad_norms(model, dataset, loss_fn, sigma, probe, n, seed, batch, path, inputs=(), data=None):
    """The training scripts' gradient-norm mode (Table 2, Fig. 5): common.probe_grad_norms as the
    TSV `idx label pA grad_norm` at `path`, with its record <path>.json naming the checkpoint inputs[0] by hash
    and, given data = (dataset name, --data-dir), the training images probed (data_fingerprint)."""
    check_gradnorm_output(path, inputs)
    rows = common.probe_grad_norms(model, dataset, loss_fn, sigma, probe, n, seed, batch)
    ckpt = inputs[0] if inputs else None
    record = {"script": os.path.basename(sys.argv[0] or "python"), "checkpoint": ckpt and os.path.relpath(ckpt),
              "checkpoint_sha256": ckpt and readers.loaded_sha256(ckpt), "probe": probe, "N": n, "seed": seed,
              "sigma": sigma, "dataset": data and data[0], "split": data and "train",
              "data": data and data_fingerprint(data[0], "train", data[1])}
    record = {k: v for k, v in record.items() if v is not None}   # no checkpoint: a model given from Python
    write_json(record, path + ".json", "record of gradient norms", inputs)   # first: it names what replaces
    write_tsv(path, readers.GRADNORM_COLUMNS, zip(*rows.values()), "gradient norms", inputs)
    return rows


# ====== Certification logs (certify.py, ddrs.py): the run's record (its sidecar), resume, torchrun parts

# Settings that change what a line means: a resumed file must have been written with the same ones.
CHECKED_SETTINGS = ("script", "data", "mode", "dataset", "split", "checkpoint_sha256", "arch", "sigma", "N0", "N",
                    "alpha", "seed", "skip", "precision", "early_abstain", "save_counts", "sound", "radii", "beta",
                    "final_look", "grid_test", "ddrs")
# Settings that change the random draws or the rounding but not their distribution: a change is only worth a note.
NOTED_SETTINGS = ("batch", "device_type", "channels_last", "fold_bn", "compile")


def part_files(outfile):
    """The per-rank files `<outfile>.rank<r>` that exist now (any world size), sorted by rank."""
    parts = [p for p in glob.glob(glob.escape(outfile) + ".rank*") if re.search(r"\.rank\d+$", p)]
    return sorted(parts, key=lambda p: int(p.rsplit(".rank", 1)[1]))


def listed_files(outfile, sidecar):
    """{path: what the sidecar (a dict) records of it} for the files of the run at `outfile` that exist and are
    listed in its "written", under the log's name when it was written (a renamed copy keeps its record)."""
    written = sidecar.get("written") if isinstance(sidecar.get("written"), dict) else {}
    own = next((k for k, v in written.items() if isinstance(v, str) and k.endswith(".json")), None)
    base = own[:-len(".json")] if own else os.path.basename(outfile)
    candidates = [outfile, outfile + ".counts"] + part_files(outfile) + part_files(outfile + ".counts")
    return {p: written[base + p[len(outfile):]] for p in candidates if base + p[len(outfile):] in written and
            os.path.lexists(p)}


def run_files(outfile):
    """The files of the certification run at `outfile` that exist now: those its sidecar lists."""
    try:
        return list(listed_files(outfile, readers.read_json_object(outfile + ".json", "settings file of a log")))
    except common.UserError:
        return []


def check_log(outfile, settings, columns, counts=None, inputs=(), overwrite=False):
    """Read-only, before any work: may this run write the log `outfile`, its parts and its vote counts
    (counts: (path, columns) or None)? Every file passes the guard, and a file of the run's that exists is one the
    sidecar (the run's record: certify.py's or ddrs.py's, naming model and data) lists, still beginning with what
    it held when the run last stopped writing (an edit is refused, a copy with its sidecar recognised); any other
    is a user's, refused. Unless overwrite, the sidecar records every CHECKED_SETTINGS as this run has them and
    the lines parse. Returns notes on NOTED_SETTINGS that changed."""
    sidecar, logs = outfile + ".json", [outfile] + part_files(outfile)
    maybe = [outfile + ".counts"] + part_files(outfile + ".counts")
    for path in [sidecar] + logs + maybe:
        check_output(path, inputs)
    old = {}
    if os.path.isfile(sidecar) and not os.path.islink(sidecar):   # a user's file there would be replaced
        with contextlib.suppress(common.UserError):
            old = readers.read_json_object(sidecar, "settings file of a log")
        common.check(old.get("script") in ("certify.py", "ddrs.py certify"), f"{sidecar!r} exists and was not "
                     f"written by this project (the run's settings file would replace it); move it away or choose "
                     f"another --outfile")
    files = listed_files(outfile, old)
    theirs = [p for p in logs + (maybe if counts else []) if os.path.lexists(p) and p not in files]
    common.check(not theirs, f"{theirs and theirs[0]!r} exists and was not written by this project (no settings "
                             f"file {sidecar!r} of certify.py lists it); move it away or choose another --outfile")
    if not files:
        return []
    diff = [f"{k} {old.get(k)!r} -> {settings[k]!r}" for k in CHECKED_SETTINGS if not overwrite and
            old.get(k) != settings[k]]   # one it does not record (None) too: what the lines mean is unknown
    common.check(not diff, f"{outfile!r} was written with other settings ({'; '.join(diff)}); rerun with the "
                           f"same ones to resume, pass --overwrite to start again, or choose another --outfile")
    for path in [] if overwrite else files:
        readers.read_log_prefix(path, counts[1] if path[len(outfile):].startswith(".counts") else columns)
    readers.read_sidecar(outfile)   # refuses a sidecar edited by hand (its record of its own settings)
    for path, kept in files.items():   # its header, once made, is part of what the record covers
        common.check(os.path.isfile(path) and not os.path.islink(path),
                     f"{path!r} is not a plain file (a link, FIFO or device); move it away")
        common.check(not isinstance(kept, dict) or os.path.getsize(path) >= kept.get("size", 0) and
                     file_sha256(path, kept.get("size", 0)) == kept.get("sha256"), f"{path!r} changed since "
                     f"{old['script']} wrote it; move it away or choose another --outfile")
    return [] if overwrite else [f"note: resuming with {k} {settings[k]!r} (was {old.get(k)!r}): new lines are "
                                 f"valid but may differ from those an uninterrupted run would write (noise or "
                                 f"rounding)" for k in NOTED_SETTINGS if old.get(k) != settings[k]]


def lock_outputs(locks, outfile):
    """One run per outfile (<outfile>.lock, rank 0); refuse parts that a live worker still holds."""
    locks.enter_context(exclusive_lock(outfile + ".lock", f"--outfile {outfile!r}"))
    for part in part_files(outfile):
        common.check(not is_locked(part + ".lock"), f"{part!r} is still written by a worker of an earlier run; "
                                                    f"stop it first")


def prepare_outputs(outfile, settings, columns, overwrite, counts=None, inputs=(), world=1):
    """Rank 0, under lock_outputs: check_log, then start or resume the outfile; returns the idx done.
    --overwrite removes every file of the run it replaces (those its sidecar lists); else torn last lines are cut,
    and vote counts the log lacks are dropped (the log decides what is done). The sidecar goes first (a log
    without one is not ours) and lists what each file holds, the files the `world` ranks will write too."""
    for note in check_log(outfile, settings, columns, counts, inputs, overwrite):
        sys.stderr.write(note + "\n")
    for path in run_files(outfile) if overwrite else []:
        remove_output(path)
    files, done = [(outfile, columns)] + ([counts] if counts else []), set()
    for main_path, cols in files:   # the log first: it decides what is done
        for path in [p for p in [main_path] + part_files(main_path) if os.path.exists(p)]:
            rows, keep = readers.read_log_prefix(path, cols)
            ids = [int(row.split("\t", 1)[0]) for row in rows]
            done.update(ids if main_path == outfile else [])
            if main_path == outfile or (set(ids) <= done and len(set(ids)) == len(ids)):
                with open_file(path, "a") as f:   # cut a torn last line
                    f.truncate(keep)
            else:   # counts of examples the log lacks, or twice: the rerun redraws them
                first = {i: row for i, row in reversed(list(zip(ids, rows))) if i in done}   # each idx's first row
                write_tsv(path, cols, [[first[i]] for i in dict.fromkeys(ids) if i in first], "vote counts", inputs)
    planned = {p: cols for path, cols in files for p in [path] + part_files(path) +
               [f"{path}.rank{r}" for r in range(world) if world > 1]}   # every rank appends to its own part
    settings = json.loads(json.dumps(settings, default=str))   # as the sidecar will hold them
    write_json(dict(settings, written=written_now(outfile, settings, planned)), outfile + ".json", "settings of a log",
               inputs)
    for log, cols in planned.items():
        open_append(log, "\t".join(cols), inputs).close()
    record_written(outfile)   # now with the headers, each part's too
    return done


def written_now(outfile, settings, planned=()):
    """The sidecar's record "written": each file of the run (and each of `planned`) with its size and sha256 now
    (0 bytes for one not made yet), and the settings' own hash."""
    paths = dict.fromkeys(run_files(outfile) + list(planned))
    files = {os.path.basename(p): {"size": os.path.getsize(p), "sha256": file_sha256(p)} if os.path.lexists(p) else
             {"size": 0, "sha256": hashlib.sha256(b"").hexdigest()} for p in paths}
    return dict(files, **{os.path.basename(outfile) + ".json": readers.settings_sha256(settings)})


def record_written(outfile):
    """Record in the sidecar what the run's files hold now (rank 0, once its lines are complete and merged)."""
    sidecar = readers.read_json_object(outfile + ".json", "settings file of a log")
    write_json(dict(sidecar, written=written_now(outfile, sidecar)), outfile + ".json", "settings of a log")


def merge_parts(outfile, columns, kind="certification log"):
    """Merge `<outfile>.rank*` into the outfile (one line per idx, in idx order), then remove the parts;
    returns the number of lines (None without parts). A crash at any point loses no line."""
    parts = part_files(outfile)
    if not parts:
        return None
    rows = {}
    for path in [outfile] + parts:
        if os.path.exists(path):
            for row in readers.read_log_prefix(path, columns)[0]:
                rows.setdefault(int(row.split("\t", 1)[0]), row)
    write_tsv(outfile, columns, [[rows[i]] for i in sorted(rows)], kind)
    for path in parts:
        remove_output(path)
    return len(rows)

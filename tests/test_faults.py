"""Fault injection: a command stopped at any one of its file operations (an open, a write, an fsync, a rename,
a removal) leaves a folder that the next valid command accepts, and that rerun gives the files of an
uninterrupted run. Three kinds of stop at every operation k of a run: the operation fails (a full disk: the
command says so in one line, exit 2), the process dies there (os._exit in a forked copy: no cleanup runs,
as under SIGKILL or a power cut that keeps the written pages), and a real SIGTERM arrives there (in a forked
copy: the command must stop with exit 143 wherever it lands, never finish as if nothing came). A user's file in the folder stays as it was.

The runs: a small certification with --save-counts and a two-epoch training, which between them reach every
writer of machinery.py. `make fuzz` stops them at every k in both modes (FAULT_RUNS=all); the suite at 16
operations spread over each run, the three modes taking turns."""
import errno
import json
import os
import signal
import sys

import pytest

import certify
import machinery
import train_gaussian

KILLED = 137
TERMINATED = 143
DIGITS = ["--dataset", "digits", "--sigma", "0.25", "--workers", "0"]


class Faults:
    """Counts the file operations of a run; the k-th fails (mode 'error') or ends the process ('kill')."""

    def __init__(self, k=None, mode="error"):
        self.k, self.mode, self.n = k, mode, 0

    def tick(self, what):
        self.n += 1
        if self.n == self.k:
            if self.mode == "kill":
                os._exit(KILLED)
            if self.mode == "signal":   # delivered now; Python runs the handler at the next bytecode
                os.kill(os.getpid(), signal.SIGTERM)
                return
            raise OSError(errno.ENOSPC, f"No space left on device (injected at {what})")


class Writer:
    """A file of machinery.open_file whose every write is an operation."""

    def __init__(self, f, faults):
        self._f, self._faults = f, faults

    def write(self, data):
        self._faults.tick("write")
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


def patch(monkeypatch, faults):
    real = {name: getattr(os, name) for name in ("fsync", "replace", "remove")}
    for name, fn in real.items():
        monkeypatch.setattr(os, name, lambda *a, _fn=fn, _name=name, **k: (faults.tick(_name), _fn(*a, **k))[1])
    open_file = machinery.open_file

    def faulty_open(*a, **k):
        faults.tick("open")
        return Writer(open_file(*a, **k), faults)
    monkeypatch.setattr(machinery, "open_file", faulty_open)


def command(main, argv, monkeypatch, faults=None):
    """main(argv) as its script runs it (machinery.run), with faults; the exit code."""
    if faults is not None:
        patch(monkeypatch, faults)
    monkeypatch.setattr(sys, "argv", ["x.py", *argv])
    try:
        machinery.run(lambda: main(argv))
        return 0
    except SystemExit as e:
        return e.code
    finally:
        monkeypatch.undo()


def killed_at(main, argv, k, mode="kill"):
    """Run the command in a forked copy of this process that dies (or gets SIGTERM: mode "signal") at operation
    k; (its exit status, its pid)."""
    pid = os.fork()
    if pid == 0:   # the child: never returns into pytest
        code = 99
        try:
            mp = pytest.MonkeyPatch()
            code = command(main, argv, mp, Faults(k, mode))
        finally:
            os._exit(code if isinstance(code, int) else 98)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), pid


def snapshot(folder, ignore_columns=("time",)):
    """The folder's files, with the time columns of TSVs and the volatile keys of JSON files left out."""
    out = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".lock"):
            continue
        data = open(path, "rb").read()
        if name.endswith((".tsv", ".counts")) and data:
            lines = data.decode().splitlines()
            keep = [i for i, c in enumerate(lines[0].split("\t")) if c not in ignore_columns]
            out[name] = [[row.split("\t")[i] for i in keep] for row in lines]
        elif name.endswith(".json"):
            obj = json.loads(data)
            volatile = ("environment", "time", "started", "seconds", "outdir", "resume", "written")
            out[name] = {k: v for k, v in obj.items() if k not in volatile}
        elif name.endswith(".pth.tar"):
            import torch
            state = torch.load(path, weights_only=True)["state_dict"]
            out[name] = {k: v.tolist() for k, v in state.items()}
        else:
            out[name] = data
    return out


def stop_everywhere(tmp_path, monkeypatch, main, argv_of, rerun_of):
    """Every operation k of the run, in both modes: stop there, rerun, compare with the uninterrupted run."""
    ref = tmp_path / "ref"
    count = Faults()
    assert command(main, argv_of(ref), monkeypatch, count) == 0
    want = snapshot(ref)
    assert count.n >= 10
    if os.environ.get("FAULT_RUNS") == "all":
        stops = [(k, mode) for k in range(1, count.n + 1) for mode in ("error", "kill", "signal")]
    else:   # 16 operations spread over the run, the three modes taking turns
        ks = sorted({round(1 + j * (count.n - 1) / 15) for j in range(16)})
        stops = [(k, ("error", "kill", "signal")[j % 3]) for j, k in enumerate(ks)]
    for k, mode in stops:
        out = tmp_path / f"{mode}{k}"
        out.mkdir()
        (out / "notes.txt").write_bytes(b"a user's notes\n")
        killed = None
        if mode in ("kill", "signal"):
            code, killed = killed_at(main, argv_of(out), k, mode)
            assert code == (KILLED if mode == "kill" else TERMINATED), (mode, k, code)
        else:   # a best-effort step (a lock's release) may fail without harm
            code = command(main, argv_of(out), monkeypatch, Faults(k, "error"))
            assert code in (0, 2), (k, code)
        assert command(main, rerun_of(out), monkeypatch) == 0, (mode, k)
        got = snapshot(out)
        assert got.pop("notes.txt") == b"a user's notes\n"
        # a process killed mid-write (SIGKILL) leaves its temporary file, which no command can tell from a user's
        left = [f for f in got if ".tmp" in f]
        assert all(mode == "kill" and f.endswith(f".tmp{killed}") for f in left), (mode, k, left)
        assert {f: v for f, v in got.items() if f not in left} == want, (mode, k)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    mp = pytest.MonkeyPatch()
    argv = [*DIGITS, "--epochs", "1", "--max-batches", "2", "--outdir", str(out)]
    assert command(lambda a: train_gaussian.main(), argv, mp) == 0
    return str(out / "checkpoint.pth.tar")


def test_certify_stopped_at_any_file_operation_resumes_to_the_uninterrupted_files(ckpt, tmp_path, monkeypatch):
    argv = lambda out: ["--checkpoint", ckpt, "--outfile", str(out / "log.tsv"), "--max", "3",  # noqa: E731
                        "--N0", "10", "--N", "40", "--batch", "100", "--save-counts"]
    stop_everywhere(tmp_path, monkeypatch, certify.main, argv, argv)


def test_training_stopped_at_any_file_operation_resumes_to_the_uninterrupted_run(tmp_path, monkeypatch):
    argv = lambda out: [*DIGITS, "--epochs", "2", "--max-batches", "1", "--outdir", str(out)]  # noqa: E731
    rerun = lambda out: argv(out) + (["--resume"] if (out / "checkpoint.pth.tar").exists() else [])  # noqa: E731
    stop_everywhere(tmp_path, monkeypatch, lambda a: train_gaussian.main(), argv, rerun)

"""Property-based fuzzing of every script's entry point (nothing lost, no traceback, by construction).

Strategies build certification logs, sidecars, checkpoint dictionaries, args.json files, image folders and
command lines, valid and corrupted, and run the entry points in this process as their command lines do
(machinery.run). The promises checked for every example:
  - the exit code is 0 or 2, and nothing else escapes (an exception here is a traceback for the user);
  - on exit 2 the error is one line on stderr (`error: ...`), and no traceback is printed;
  - every file that existed before is byte-identical afterwards, unless it is a documented output of the
    command that the guard allows it to write (a file this project wrote for that purpose).
The regular suite runs a short derandomized profile; `make fuzz` runs the long campaign (tests/conftest.py).
"""
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import event, given, note, strategies as st  # noqa: E402

import analyze  # noqa: E402
import certify  # noqa: E402
import common  # noqa: E402
import machinery  # noqa: E402
import readers  # noqa: E402
import ddrs  # noqa: E402
import train_gaussian  # noqa: E402
from helpers import digits_checkpoint  # noqa: E402

COHEN = ["idx", "label", "predict", "radius", "correct", "time"]


# ----------------------------------------------------------------------------------------------------------
# The harness
# ----------------------------------------------------------------------------------------------------------

def run_entry(main, argv):
    """(exit code, stdout, stderr) of main(argv) run as its command line runs it, in this process."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            machinery.run(lambda: main([str(a) for a in argv]))
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def snapshot(folder):
    """{path: bytes} of every regular file under folder (the record of outputs left out)."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path) and name != machinery.OUTPUTS:
                with open(path, "rb") as f:
                    files[path] = f.read()
    return files


def check_promises(main, argv, folder, may_change=()):
    """Run main(argv) and assert the promises; returns the exit code. may_change: the command's own outputs."""
    before = snapshot(folder)
    code, out, err = run_entry(main, argv)
    with contextlib.suppress(hypothesis.errors.InvalidArgument):   # outside a property (the controls below)
        note(f"argv {argv}\nexit {code}\nstderr {err[-2000:]}")
        event(f"exit {code}")   # `make fuzz` prints how often each outcome was tried
    assert code in (0, 2), f"exit code {code}: {err[-500:]}"
    assert "Traceback" not in err
    if code == 2:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert lines and lines[-1].startswith(("error:", "analyze.py: error:", "certify.py: error:")) or \
            ": error: " in lines[-1], err[-500:]
        assert "\n" not in lines[-1]
    after = snapshot(folder)
    allowed = {os.path.abspath(p) for p in may_change}
    for path, data in before.items():
        if os.path.abspath(path) in allowed:
            continue
        assert after.get(path) == data, f"{path} changed or vanished (exit {code}: {err[-300:]})"
    return code


# ----------------------------------------------------------------------------------------------------------
# Strategies: cells, logs, sidecars, command lines
# ----------------------------------------------------------------------------------------------------------

weird_numbers = st.sampled_from(["nan", "inf", "-inf", "1e309", "-1", "1e300", "0x10", "", " ", "1,5", "२",
                                 "9" * 40, "-0", "1e-320", "True", "0_5", "1_000", "²", "٣", "½", "１"])
cell = st.one_of(st.integers(-3, 12).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr),
                 weird_numbers, st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=6))


@st.composite
def certification_log(draw):
    """A Cohen-format log (with nA N nY most of the time), valid or with corrupted cells, header or lines."""
    n = draw(st.integers(0, 8))
    extra = draw(st.sampled_from([[], ["nA", "N"], ["nA", "N", "nY"], ["nA", "N", "nY", "stop"], ["sigma"]]))
    header = COHEN + extra
    if draw(st.booleans()):
        header = draw(st.permutations(header))
    if draw(st.integers(0, 19)) == 0:
        header = header[:draw(st.integers(0, len(header)))]
    if header and draw(st.integers(0, 19)) == 0:   # a column twice
        header = header + [draw(st.sampled_from(header))]
    rows, corrupt = [], draw(st.integers(0, 3)) == 0   # one log in four has a bad cell
    for i in range(n):
        N = draw(st.integers(1, 1000))
        nA = draw(st.integers(0, N))
        row = {"idx": str(draw(st.integers(0, 20)) if draw(st.integers(0, 5)) == 0 else i),
               "label": str(draw(st.integers(0, 9))), "predict": str(draw(st.integers(-1, 9))),
               "radius": repr(draw(st.floats(0, 3))), "correct": str(draw(st.integers(0, 1))), "time": "0:00:01",
               "nA": str(nA), "N": str(N), "nY": str(draw(st.integers(0, nA))), "stop": "budget",
               "sigma": repr(draw(st.floats(0.01, 1)))}
        if corrupt and draw(st.integers(0, 2)) == 0:   # a corrupted cell
            row[draw(st.sampled_from(header or ["idx"]))] = draw(cell)
        rows.append("\t".join(row.get(h, "0") for h in header))
    text = "\n".join(["\t".join(header)] + rows) + "\n"
    ending = draw(st.sampled_from(["", "", "", "", "torn", "crlf", "blank", "binary"]))
    if ending == "torn" and rows:
        text = text[:-draw(st.integers(1, max(1, len(rows[-1]))))]
    elif ending == "crlf":
        text = text.replace("\n", "\r\n")
    elif ending == "blank":
        text += "\n\n"
    elif ending == "binary":
        return draw(st.binary(max_size=64))
    return text.encode("utf-8", "surrogatepass")


json_value = st.recursive(st.none() | st.booleans() | st.integers(-10, 10 ** 6) |
                          st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=5),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                       max_size=3), max_leaves=6)


@st.composite
def sidecar(draw):
    """A sidecar: certify.py's fields with values of the right or the wrong type, or other JSON, or not JSON."""
    kind = draw(st.integers(0, 10))
    if kind == 0:
        return draw(st.binary(max_size=30))
    if kind == 10:   # nested deeper than any parser's recursion
        depth = draw(st.sampled_from([1000, 100_000]))
        return ("[" * depth + "]" * depth).encode() if draw(st.booleans()) else ('{"a":' * depth + "1" + "}" * depth).encode()
    if kind == 1:
        return json.dumps(draw(json_value)).encode()
    fields = {"script": "certify.py", "mode": "certify", "dataset": "digits", "split": "test", "sigma": 0.25,
              "N": 1000, "N0": 100, "alpha": 0.001, "seed": 0, "sound": False, "radii": None}
    for key in draw(st.lists(st.sampled_from(sorted(fields)), max_size=2)) if kind < 5 else []:
        fields[key] = draw(json_value)
    return json.dumps(fields).encode()


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)


@pytest.fixture(scope="module")
def digits_ckpt(tmp_path_factory):
    return digits_checkpoint(tmp_path_factory.mktemp("fuzz_ckpt") / "checkpoint.pth.tar", steps=20)


# ----------------------------------------------------------------------------------------------------------
# analyze.py: every subcommand on generated logs and sidecars, outputs aimed at inputs and at user files
# ----------------------------------------------------------------------------------------------------------

@given(logs=st.lists(st.tuples(certification_log(), st.none() | sidecar()), min_size=1, max_size=2),
       command=st.sampled_from(["table", "ecdf", "envelope", "compare", "budget", "ablation", "trainpa",
                                "gradnorm"]),
       flags=st.lists(st.sampled_from([["--format", "latex"], ["--format", "tsv"], ["--radii", "0", "0.5"],
                                       ["--radii", "nan"], ["--radii", "-1"], ["--sigmas", "0.25"],
                                       ["--sigmas", "0"], ["--labels", "a/b", "c d"], ["--group-by-seed"],
                                       ["--replicates", "20"], ["--replicates", "0"], ["--level", "2"],
                                       ["--N", "1000"], ["--alpha", "0"], ["--pt", "0.5"], ["--over", "test-set"],
                                       ["--parts", "discard"]]), max_size=1),
       out=st.sampled_from(["outdir"] * 4 + ["none"] * 2 + ["input", "notes", "fifo", "link", "file-as-dir"]),
       name=st.sampled_from(["m", "m", "m", os.fsdecode(b"m\xff"), "mü"]),
       special=st.sampled_from([None] * 6 + ["fifo", "fifo-sidecar", "folder"]))
def test_analyze_keeps_its_promises_on_any_log(logs, command, flags, out, name, special):
    """Any logs (names that are not UTF-8 too), a FIFO or a folder in place of a log or its sidecar."""
    with tempfile.TemporaryDirectory() as d:
        paths = []
        for k, (log, side) in enumerate(logs):
            path = os.path.join(d, f"{name}{k}_noise_0.25.tsv")
            write(path, log)
            if side is not None:
                write(path + ".json", side)
            paths.append(path)
        if special == "fifo":   # a reader must not wait for a writer that never comes
            os.remove(paths[-1])
            os.mkfifo(paths[-1])
        elif special == "fifo-sidecar":
            if os.path.exists(paths[-1] + ".json"):
                os.remove(paths[-1] + ".json")
            os.mkfifo(paths[-1] + ".json")
        elif special == "folder":
            os.remove(paths[-1])
            os.mkdir(paths[-1])
        write(os.path.join(d, "notes.txt"), b"my notes\n")
        argv = [command] + paths[:1] + (["--vs"] + paths[1:] if command == "compare" and len(paths) > 1 else
                                        paths[1:])
        argv += [a for f in flags for a in f]
        target = {"outdir": os.path.join(d, "out"), "input": paths[0], "notes": os.path.join(d, "notes.txt"),
                  "file-as-dir": os.path.join(d, "notes.txt", "x")}.get(out)
        if out == "fifo":
            target = os.path.join(d, "fifo")
            os.mkfifo(target)
        if out == "link":
            target = os.path.join(d, "link")
            os.symlink(paths[0], target)
        if target:
            argv += ["--out", target]
        check_promises(analyze.main, argv, d)


@given(log=certification_log(), name=st.sampled_from(["table.md", "ecdf.md", "table.tsv", "certified_accuracy.png"]))
def test_analyze_never_replaces_a_file_it_did_not_write(log, name):
    """A user's file with the name of an output is never replaced; an output analyze wrote is rewritten."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ours_noise_0.25.tsv")
        write(path, log)
        out = os.path.join(d, "out")
        os.makedirs(out)
        write(os.path.join(out, name), b"a user's file\n")
        for command in ("table", "ecdf"):
            check_promises(analyze.main, [command, path, "--out", out], d)


# ----------------------------------------------------------------------------------------------------------
# certify.py and ddrs.py: command lines, outputs aimed anywhere, checkpoints edited by hand
# ----------------------------------------------------------------------------------------------------------

number_flags = st.sampled_from([
    ["--N0", "10"], ["--N", "50"], ["--N", "0"], ["--N", str(2 ** 40)], ["--N", str(2 ** 63)],
    ["--N0", str(10 ** 15)], ["--batch", "0"], ["--batch", str(10 ** 12)], ["--batch", "7"],
    ["--alpha", "1e-320"], ["--alpha", "0.5"], ["--alpha", "nan"], ["--sigma", "1e-50"], ["--sigma", "1e39"],
    ["--sigma", "inf"], ["--sigma", "0.25"], ["--sigma", "1e300"], ["--radii", "0", "0.25"],
    ["--radii", "1e300"], ["--radii", "nan"], ["--beta", "0.01"], ["--no-final-look"], ["--group", "3"], ["--no-zero-level"], ["--skip", "0"], ["--max", "0"],
    ["--seed", "-1"], ["--seed", str(2 ** 70)], ["--predict"], ["--sound"], ["--overwrite"], ["--save-counts"],
    ["--early-abstain"], ["--split", "train"], ["--precision", "bf16"]])


@given(flags=st.lists(number_flags, max_size=3),
       out=st.sampled_from(["new"] * 5 + ["checkpoint", "notes", "folder", "link", "fifo", "log", "sidecar-only"]),
       side=st.none() | sidecar(), log=certification_log())
def test_certify_keeps_its_promises_on_any_command_line(digits_ckpt, flags, out, side, log):
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "model.pth.tar")
        shutil.copy(digits_ckpt, ckpt)
        write(os.path.join(d, "notes.txt"), b"my notes\n")
        outfile = {"new": os.path.join(d, "o.tsv"), "checkpoint": ckpt, "notes": os.path.join(d, "notes.txt"),
                   "folder": d, "log": os.path.join(d, "log.tsv"), "sidecar-only": os.path.join(d, "s.tsv")}.get(out)
        if out == "link":
            outfile = os.path.join(d, "link.tsv")
            os.symlink(os.path.join(d, "notes.txt"), outfile)
        if out == "fifo":
            outfile = os.path.join(d, "fifo.tsv")
            os.mkfifo(outfile)
        if out == "log":
            write(outfile, log)
        if out in ("log", "sidecar-only") and side is not None:
            write(outfile + ".json", side)
        argv = ["--checkpoint", ckpt, "--outfile", outfile, "--max", "2", "--N0", "10", "--N", "40",
                "--batch", "40", "--device", "cpu"] + [a for f in flags for a in f]
        # the command's own outputs: the outfile and its sidecar, when certify.py wrote (or may resume) them
        mine = [os.path.join(d, "o.tsv"), os.path.join(d, "o.tsv.json"), os.path.join(d, "o.tsv.counts")]
        if out in ("log", "sidecar-only"):
            mine += [outfile, outfile + ".json", outfile + ".counts"]
        check_promises(certify.main, argv, d, mine)


checkpoint_field = st.sampled_from(["arch", "dataset", "sigma", "epoch", "args", "extra", "state_dict"])


@given(edits=st.lists(st.tuples(checkpoint_field, json_value), min_size=1, max_size=3))
def test_a_checkpoint_edited_by_hand_is_refused_in_one_line_or_used(digits_ckpt, edits):
    with tempfile.TemporaryDirectory() as d:
        ckpt = torch.load(digits_ckpt, weights_only=True)
        for key, value in edits:
            ckpt[key] = value
        path = os.path.join(d, "edited.pth.tar")
        torch.save(ckpt, path)
        argv = ["--checkpoint", path, "--outfile", os.path.join(d, "o.tsv"), "--max", "1", "--N0", "10", "--N",
                "20", "--batch", "20", "--device", "cpu"]
        check_promises(certify.main, argv, d, [os.path.join(d, "o.tsv"), os.path.join(d, "o.tsv.json")])


@given(log=certification_log(), side=st.none() | sidecar(), out=st.sampled_from(["default", "input", "notes", "new"]))
def test_ddrs_memory_keeps_its_promises_on_any_log(log, side, out):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ds.tsv")
        write(path, log)
        if side is not None:
            write(path + ".json", side)
        write(os.path.join(d, "notes.txt"), b"my notes\n")
        argv = ["memory", path]
        target = {"input": path, "notes": os.path.join(d, "notes.txt"), "new": os.path.join(d, "m.tsv")}.get(out)
        if target:
            argv += ["--outfile", target]
        check_promises(ddrs.main, argv, d, [os.path.join(d, "ds_memory.tsv"), os.path.join(d, "m.tsv")])


@given(fixed=certification_log(), ds=certification_log(), side=st.none() | sidecar(),
       out=st.sampled_from(["new", "input", "notes-folder"]))
def test_ddrs_report_keeps_its_promises_on_any_logs(fixed, ds, side, out):
    with tempfile.TemporaryDirectory() as d:
        paths = [os.path.join(d, "fixed.tsv"), os.path.join(d, "ds.tsv")]
        for path, log in zip(paths, (fixed, ds)):
            write(path, log)
            if side is not None:
                write(path + ".json", side)
        folder = {"new": os.path.join(d, "rep"), "input": d, "notes-folder": os.path.join(d, "notes")}[out]
        if out == "notes-folder":
            os.makedirs(folder)
            write(os.path.join(folder, "report.md"), b"my notes\n")
        mine = [os.path.join(d, "rep", "report.md"), os.path.join(d, "rep", "report.tsv"),
                os.path.join(d, "report.md"), os.path.join(d, "report.tsv")]
        check_promises(ddrs.main, ["report", paths[1], "--fixed", paths[0], "--out", folder], d, mine)


elastic_flags = st.sampled_from([["--elastic-r", "0"], ["--elastic-r", "0.05"], ["--elastic-r", "1e-9"],
    ["--elastic-r", "nan"], ["--elastic-r", "-0.01"], ["--elastic-r", "1e30"], ["--elastic-k", "0"],
    ["--elastic-k", "1"], ["--elastic-k", "5000"], ["--elastic-k", str(2 ** 70)], ["--elastic-m", "inf"],
    ["--elastic-m", "-1e30"], ["--elastic-m", "1e4"], ["--sigma", "1e-4"], ["--sigma", "9000"], ["--predict"]])


@given(flags=st.lists(elastic_flags, max_size=3))
def test_ddrs_semi_elastic_keeps_its_promises_on_any_command_line(digits_ckpt, flags):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "se.tsv")
        argv = ["certify", "--checkpoint", digits_ckpt, "--outfile", out, "--max", "2", "--N0", "10", "--N", "40",
                "--batch", "40", "--device", "cpu", "--semi-elastic"] + [a for f in flags for a in f]
        check_promises(ddrs.main, argv, d, [out, out + ".json"])


# ----------------------------------------------------------------------------------------------------------
# Training: command lines and run folders (args.json, checkpoints) edited by hand
# ----------------------------------------------------------------------------------------------------------

train_flags = st.sampled_from([["--m", "1"], ["--lr", "0.05"], ["--sigma", "0.5"],
    ["--sigma", "0"], ["--sigma", "1e-50"], ["--sigma", "1e39"], ["--m", "0"], ["--m", str(10 ** 9)],
    ["--batch", str(10 ** 10)], ["--lr", "nan"], ["--lr", "-1"], ["--epochs", "-1"], ["--seed", "-3"],
    ["--resume"], ["--weight_decay", "1e308"], ["--m", "2"], ["--batch", "16"]])


@given(flags=st.lists(train_flags, max_size=3),
       folder=st.sampled_from(["new", "args-only", "edited-checkpoint", "file"]), args_json=sidecar(),
       edits=st.lists(st.tuples(checkpoint_field, json_value), max_size=2))
def test_training_keeps_its_promises_on_any_command_line_and_run_folder(digits_ckpt, flags, folder, args_json,
                                                                        edits):
    with tempfile.TemporaryDirectory() as d:
        outdir = os.path.join(d, "run")
        if folder == "file":
            write(outdir, b"not a folder\n")
        elif folder != "new":
            os.makedirs(outdir)
            write(os.path.join(outdir, "args.json"), args_json)
            if folder == "edited-checkpoint":
                ckpt = torch.load(digits_ckpt, weights_only=True)
                for key, value in edits:
                    ckpt[key] = value
                torch.save(ckpt, os.path.join(outdir, machinery.CHECKPOINT))
        argv = ["--dataset", "digits", "--sigma", "0.25", "--epochs", "1", "--max-batches", "1", "--batch", "32",
                "--workers", "0", "--device", "cpu", "--outdir", outdir] + [a for f in flags for a in f]
        mine = [os.path.join(outdir, n) for n in ("args.json", "log.tsv", machinery.CHECKPOINT, "run.lock")]
        code = check_promises(lambda a: train_gaussian_main(a), argv, d, mine if folder == "new" else [])
        assert code == 2 or folder == "new" or "--resume" in argv


def train_gaussian_main(argv):
    import sys
    saved = sys.argv
    sys.argv = ["train_gaussian.py"] + argv
    try:
        train_gaussian.main()
    finally:
        sys.argv = saved


# ----------------------------------------------------------------------------------------------------------
# Image folders: the reader refuses what is not a dataset, in one line
# ----------------------------------------------------------------------------------------------------------

@given(classes=st.sampled_from([10, 10, 10, 0, 1, 9, 11]), per_class=st.integers(0, 2), broken=st.sampled_from(["none", "text", "size",
                                                                                          "empty-class", "hidden"]))
def test_an_image_folder_is_read_or_refused_in_one_line(classes, per_class, broken):
    from PIL import Image
    with tempfile.TemporaryDirectory() as d:
        folder = os.path.join(d, "test")
        os.makedirs(folder)
        for c in range(classes):
            os.makedirs(os.path.join(folder, f"class{c}"))
            for i in range(per_class):
                Image.new("RGB", (32, 32), (c * 20, i, 0)).save(os.path.join(folder, f"class{c}", f"{i}.png"))
        if classes and broken == "text":
            write(os.path.join(folder, "class0", "bad.png"), b"not an image")
        if classes and broken == "size":
            Image.new("RGB", (31, 32)).save(os.path.join(folder, "class0", "odd.png"))
        if broken == "hidden":
            write(os.path.join(folder, ".DS_Store"), b"\0")
        if classes and broken == "empty-class":
            shutil.rmtree(os.path.join(folder, "class0"))
            os.makedirs(os.path.join(folder, "class0"))

        def main(argv):
            ds = common.get_dataset("cifar10", "test", d)
            assert len(ds) == classes * per_class and ds[0][0].shape == (3, 32, 32)
        valid = classes == 10 and per_class > 0 and broken in ("none", "hidden")
        code = check_promises(main, [], d)
        assert code == (0 if valid else 2)


# ----------------------------------------------------------------------------------------------------------
# Negative controls: the harness fails on each broken promise
# ----------------------------------------------------------------------------------------------------------

def test_the_harness_fails_on_a_traceback_a_changed_file_and_a_two_line_error(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("before\n")

    def crashes(argv):
        raise ValueError("a bug")

    def clobbers(argv):
        victim.write_text("after\n")

    def two_lines(argv):
        raise common.UserError("first line\nsecond line")

    for main in (crashes, clobbers, two_lines):
        with pytest.raises((AssertionError, ValueError)):
            check_promises(main, [], str(tmp_path))
        victim.write_text("before\n")
    assert check_promises(lambda argv: None, [], str(tmp_path)) == 0


# ----------------------------------------------------------------------------------------------------------
# Sequences of commands in one folder (hypothesis's RuleBasedStateMachine)
# ----------------------------------------------------------------------------------------------------------

from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402

import errno  # noqa: E402


def sequence_checkpoint():
    """One digits checkpoint shared by every sequence (made once per process)."""
    if not hasattr(sequence_checkpoint, "path"):
        sequence_checkpoint.path = digits_checkpoint(tempfile.mkdtemp(prefix="seq") + "/c.pth.tar", steps=5)
    return sequence_checkpoint.path


REFERENCE = {}   # (N, seed) -> {idx: row without its time}: the uninterrupted run's lines
TRAINED = {}     # sigma -> {epoch: state_dict} of the uninterrupted 2-epoch training run
TRAIN = ["--dataset", "digits", "--epochs", 2, "--max-batches", 1, "--workers", 0]


def rows_of(path):
    """{idx: the row without its time column} of a certification log (its complete lines)."""
    if not os.path.isfile(path):
        return {}
    lines = open(path, encoding="utf-8").read().split("\n")[1:-1]
    out = {}
    for line in lines:
        cells = line.split("\t")
        out[int(cells[0])] = cells[:5] + cells[6:]
    return out


def train_main(argv):
    """train_gaussian.py's main (it reads sys.argv) on argv."""
    saved = sys.argv
    sys.argv = ["train_gaussian.py", *argv]
    try:
        train_gaussian.main()
    finally:
        sys.argv = saved


def model_weights(path):
    """(epoch, sigma, state_dict) of a training checkpoint."""
    ckpt = readers.load_checkpoint(path)
    return ckpt["epoch"], ckpt["sigma"], ckpt["state_dict"]


class CommandSequences(RuleBasedStateMachine):
    """A folder with a user's files planted (a plain file, a symlink and a hard link to the checkpoint, a
    FIFO), and random sequences of certify (resumed, with changed settings, --overwrite, a full disk at a
    random file operation), analyze table and compare, ddrs memory and report (on a log they do not take),
    and training into a run folder (new, --resume, another sigma, a full disk). After every step: user files
    byte-identical, exit 0 or 2 with one line and no traceback, every line of the log equal to the
    uninterrupted run's, the run's checkpoint equal to the uninterrupted run's at its epoch, every folder's
    record true of its files."""

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="seq")
        self.ckpt = sequence_checkpoint()
        self.log = os.path.join(self.dir, "cert.tsv")
        with open(os.path.join(self.dir, "notes.txt"), "w") as f:
            f.write("a user's notes\n")
        os.symlink(self.ckpt, os.path.join(self.dir, "link.pth.tar"))
        os.link(self.ckpt, os.path.join(self.dir, "hard.pth.tar"))
        os.mkfifo(os.path.join(self.dir, "pipe.tsv"))
        self.user = snapshot(self.dir)

    def teardown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def step(self, main, argv, faults_at=None):
        patches = contextlib.ExitStack()
        if faults_at is not None:   # a full disk at the k-th write through the guard
            seen = [0]
            real = machinery.open_file

            def full(*a, **k):
                seen[0] += 1
                if seen[0] == faults_at:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real(*a, **k)
            mp = pytest.MonkeyPatch()
            mp.setattr(machinery, "open_file", full)
            patches.callback(mp.undo)
        with patches:
            code, _, err = run_entry(main, argv)
        note(f"{argv} -> {code}: {err.strip()[-300:]}")
        assert code in (0, 2) and "Traceback" not in err, (argv, code, err)
        if code == 2:
            assert len([ln for ln in err.splitlines() if ln.startswith("error")]) == 1, err
        return code

    def certify_args(self, N, seed, counts, extra=()):
        return ["--checkpoint", self.ckpt, "--outfile", self.log, "--max", 4, "--N0", 10, "--N", N,
                "--seed", seed, *(["--save-counts"] if counts else []), *extra]

    @rule(N=st.sampled_from([30, 40]), seed=st.sampled_from([0, 1]), counts=st.booleans(),
          overwrite=st.booleans(), fault=st.one_of(st.none(), st.integers(1, 12)))
    def certify(self, N, seed, counts, overwrite, fault):
        side = self.log + ".json"
        same = os.path.isfile(side) and {k: json.load(open(side)).get(k) for k in ("N", "seed", "save_counts")} == \
            {"N": N, "seed": seed, "save_counts": counts}
        code = self.step(certify.main, self.certify_args(N, seed, counts, ["--overwrite"] if overwrite else []),
                         fault)
        event(f"certify {'overwrite ' if overwrite else ''}{'fault ' if fault else ''}-> {code}")
        if fault is None and (overwrite or same):   # a valid command: whatever came before, it is accepted
            assert code == 0, "a stop or a refusal before left a folder that a valid command is refused in"

    def reference(self, N, seed):
        """The uninterrupted run's lines at these settings, made once, in a folder of its own."""
        if (N, seed) not in REFERENCE:
            ref = tempfile.mkdtemp(prefix="ref")
            assert run_entry(certify.main, ["--checkpoint", self.ckpt, "--outfile", ref + "/cert.tsv", "--max", 4,
                                            "--N0", 10, "--N", N, "--seed", seed])[0] == 0
            REFERENCE[(N, seed)] = rows_of(ref + "/cert.tsv")
            shutil.rmtree(ref)
        return REFERENCE[(N, seed)]

    @rule()
    def analyze_table(self):
        if os.path.isfile(self.log):
            self.step(analyze.main, ["table", self.log, "--out", os.path.join(self.dir, "tables")])

    @rule(name=st.sampled_from(["notes.txt", "link.pth.tar", "hard.pth.tar", "pipe.tsv"]))
    def certify_into_a_users_file(self, name):
        code = self.step(certify.main, ["--checkpoint", self.ckpt, "--outfile", os.path.join(self.dir, name),
                                        "--max", 2, "--N0", 10, "--N", 30])
        assert code == 2

    @rule()
    def analyze_compare(self):
        if os.path.isfile(self.log):
            self.step(analyze.main, ["compare", self.log, self.log, "--out", os.path.join(self.dir, "compare")])

    @rule(report=st.booleans())
    def ddrs_on_a_certify_log(self, report):
        """ddrs.py memory and report take ddrs.py's logs only: a certify.py log is refused in one line."""
        argv = ["report", self.log, "--fixed", self.log, "--out", os.path.join(self.dir, "ddrs")] if report \
            else ["memory", self.log, "--outfile", os.path.join(self.dir, "memory.tsv")]
        assert self.step(ddrs.main, argv) == 2

    @rule(sigma=st.sampled_from([0.25, 0.5]), resume=st.booleans(), fault=st.one_of(st.none(), st.integers(1, 30)))
    def train(self, sigma, resume, fault):
        ckpt = os.path.join(self.dir, "run", machinery.CHECKPOINT)
        same = os.path.isfile(ckpt) and model_weights(ckpt)[1] == sigma
        code = self.step(train_main, [*TRAIN, "--sigma", sigma, "--outdir", os.path.join(self.dir, "run"),
                                      *(["--resume"] if resume else [])], fault)
        event(f"train {'resume ' if resume else ''}{'fault ' if fault else ''}-> {code}")
        if fault is None and resume and same:   # resuming the run there, with its settings: accepted
            assert code == 0, "a stop or a refusal before left a run folder that --resume is refused in"

    def trained(self, sigma):
        """The uninterrupted 2-epoch run's weights after each epoch, made once, in a folder of its own."""
        if sigma not in TRAINED:
            ref = tempfile.mkdtemp(prefix="ref")
            assert run_entry(train_main, [*TRAIN, "--sigma", sigma, "--outdir", ref, "--save_every", 1])[0] == 0
            TRAINED[sigma] = {e: model_weights(f"{ref}/checkpoint_epoch{e}.pth.tar")[2] for e in (1, 2)}
            shutil.rmtree(ref)
        return TRAINED[sigma]

    @invariant()
    def the_run_is_the_uninterrupted_runs(self):
        path = os.path.join(self.dir, "run", "checkpoint.pth.tar")
        if os.path.isfile(path):
            epoch, sigma, weights = model_weights(path)
            want = self.trained(sigma)[epoch]
            assert set(weights) == set(want) and all(torch.equal(weights[k], want[k]) for k in want), (sigma, epoch)

    @invariant()
    def users_files_are_untouched(self):
        now = snapshot(self.dir)
        assert {p: now.get(p) for p in self.user} == self.user

    @invariant()
    def every_line_is_the_uninterrupted_runs(self):
        """Each line of the log (at the settings its sidecar records) is the uninterrupted run's line."""
        if not os.path.isfile(self.log) or not os.path.isfile(self.log + ".json"):
            return
        side = json.load(open(self.log + ".json"))
        ref = self.reference(side["N"], side["seed"])
        got = rows_of(self.log)
        assert all(ref.get(i) == row for i, row in got.items()), (side["N"], side["seed"], got, ref)
        if side.get("save_counts") and os.path.isfile(self.log + ".counts"):   # one counts row per logged example
            ids = [int(line.split("\t")[0]) for line in open(self.log + ".counts").read().split("\n")[1:-1]]
            assert len(ids) == len(set(ids)) and set(ids) <= set(got) | {max(got, default=-1) + 1}


CommandSequences.TestCase.settings = hypothesis.settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", 4)) if os.environ.get("HYPOTHESIS_PROFILE") != "fuzz"
    else int(os.environ.get("FUZZ_EXAMPLES", 200)),
    stateful_step_count=6 if os.environ.get("HYPOTHESIS_PROFILE") != "fuzz" else 25,
    deadline=None, derandomize=os.environ.get("HYPOTHESIS_PROFILE") != "fuzz", database=None,
    suppress_health_check=list(hypothesis.HealthCheck))
test_sequences_of_commands_keep_every_promise = CommandSequences.TestCase

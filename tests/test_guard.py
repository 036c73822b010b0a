"""The output guard and the readers are the only ways the scripts touch files (one guard, one reader).

A grep over every script and module but the guard, the readers and the data loaders (common.py): no file is opened, saved, dumped, replaced or removed except
through machinery.write_output / open_append / remove_output, and no format is parsed outside readers.py's
readers. Then the guard's own promises, each a regression test of a case found while building it."""
import os
import re
import stat
import sys

import pytest
import torch

import common
import machinery

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = [f for f in sorted(os.listdir(ROOT)) if f.endswith(".py") and f not in ("common.py", "machinery.py", "readers.py")] + \
          [os.path.join("tools", f) for f in sorted(os.listdir(os.path.join(ROOT, "tools"))) if f.endswith(".py")]
# analyze.write_text is the analyses' own writer, through machinery's guard (compare.py calls it)
BYPASSES = [r"(?<![\w.])open\(", r"torch\.save\(", r"torch\.load\(", r"json\.dump\(", r"json\.load\(",
            r"np\.(save|load|savetxt|loadtxt)", r"os\.(replace|remove|unlink|rename)\(", r"shutil\.",
            r"(?<!analyze)\.write_text\(", r"\.write_bytes\(", r"read_csv\(", r"to_csv\(", r"ImageFolder\("]


# tools/copy_size.py reads the project's own source code (its input is code, not data or a log)
SOURCE_READS = {("tools/copy_size.py", 'with open(path, encoding="utf-8") as f:')}


def test_no_script_writes_or_parses_a_file_outside_common():
    found = []
    for name in SCRIPTS:
        with open(os.path.join(ROOT, name)) as f:
            lines = f.read().splitlines()
        for number, line in enumerate(lines, 1):
            code = line.split("#", 1)[0]
            found += [f"{name}:{number}: {line.strip()}" for pattern in BYPASSES if re.search(pattern, code)
                      and (name, line.strip()) not in SOURCE_READS]
            # a figure is saved only inside machinery.write_output (the statement that starts on this line or above)
            if "savefig(" in code and "write_output(" not in code + "".join(lines[max(0, number - 3):number - 1]):
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "files touched outside machinery.py's guard and readers.py:\n" + "\n".join(found)


def test_the_grep_finds_a_bypass(tmp_path):
    """Negative control: the patterns catch the ways a script could bypass the guard."""
    for snippet in ('with open(p, "w") as f:', "torch.save(state, p)", "json.dump(obj, f)", "os.remove(p)",
                    "np.save(p, a)", "Path(p).write_text(t)"):
        assert any(re.search(pattern, snippet) for pattern in BYPASSES), snippet


def test_guard_refuses_links_folders_fifos_inputs_and_foreign_files(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    link = tmp_path / "link.md"
    os.symlink(notes, link)
    fifo = tmp_path / "fifo.md"
    os.mkfifo(fifo)
    (tmp_path / "folder.md").mkdir()
    data = tmp_path / "log.tsv"
    data.write_text("idx\n")
    hard = tmp_path / "hard.md"
    os.link(data, hard)
    machinery.set_inputs([str(data)])
    try:
        for path, why in ((notes, "not written by this project"), (link, "not written by this project"),
                          (fifo, "not written by this project"), (tmp_path / "folder.md", "is a folder"),
                          (hard, "input of this command")):
            with pytest.raises(common.UserError, match=why):
                machinery.write_text_output(str(path), "analyze.py output", "x\n")
    finally:
        machinery.set_inputs([])
    assert notes.read_text() == "mine\n" and data.read_text() == "idx\n" and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert os.path.islink(link)


def test_guard_rewrites_its_own_output_but_not_one_changed_since_or_of_another_kind(tmp_path):
    path = str(tmp_path / "table.md")
    machinery.write_text_output(path, "analyze.py output", "one\n")
    machinery.write_text_output(path, "analyze.py output", "two\n")           # its own: rewritten
    assert open(path).read() == "two\n"
    with pytest.raises(common.UserError, match="written as 'analyze.py output', not as 'checkpoint'"):
        machinery.write_text_output(path, "checkpoint", "three\n")
    with open(path, "a") as f:
        f.write("edited by hand\n")
    with pytest.raises(common.UserError, match="changed since"):
        machinery.write_text_output(path, "analyze.py output", "four\n")
    assert open(path).read() == "two\nedited by hand\n"


def test_outputs_of_a_command_replace_theirs_only_as_it_ends(tmp_path):
    """Inside machinery.run, whole files wait for the command's end: an error after the first leaves it as it
    was; now=True (a run's record, a checkpoint) writes at once."""
    first, second = tmp_path / "a.md", tmp_path / "b.md"
    machinery.write_text_output(str(first), "analyze.py output", "before\n")   # outside a command: at once

    def main():
        machinery.write_text_output(str(first), "analyze.py output", "after\n")
        machinery.write_output(str(second), "settings", lambda f: f.write(b"now\n"), now=True)
        assert first.read_text() == "before\n" and second.read_text() == "now\n"
        raise common.UserError("refused at the last output")
    with pytest.raises(SystemExit):
        machinery.run(main)
    assert first.read_text() == "before\n" and not [p for p in os.listdir(tmp_path) if ".tmp" in p]
    machinery.run(lambda: machinery.write_text_output(str(first), "analyze.py output", "after\n"))
    assert first.read_text() == "after\n"


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = str(tmp_path / "out.md")
    machinery.write_text_output(path, "analyze.py output", "complete\n")

    def fails(f):
        f.write(b"half")
        raise OSError(27, "File too large")
    with pytest.raises(common.UserError, match="not written .File too large., its previous content is intact"):
        machinery.write_output(path, "analyze.py output", fails)
    assert open(path).read() == "complete\n"
    assert sorted(os.listdir(tmp_path)) == ["out.md", "outputs.json"]


def test_a_write_over_ulimit_f_fails_in_one_line_and_keeps_the_old_file(tmp_path):
    """`ulimit -f` (SIGXFSZ, ignored by Python): the write fails with EFBIG; the file before stays whole."""
    import subprocess
    import sys
    path = tmp_path / "big.md"
    code = ("import sys; sys.path.insert(0, %r); import machinery; "
            "machinery.run(lambda: machinery.write_text_output(%r, 'analyze.py output', sys.argv[1] * 4096))")
    first = subprocess.run([sys.executable, "-c", code % (ROOT, str(path)), "a"], capture_output=True, text=True)
    assert first.returncode == 0
    before = path.read_bytes()
    run = subprocess.run(["bash", "-c", f'ulimit -f 1; "{sys.executable}" -c "$0" b', code % (ROOT, str(path))],
                         capture_output=True, text=True)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "not written" in run.stderr and path.read_bytes() == before
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_sigterm_exits_143_in_one_line_and_leaves_the_files_valid(tmp_path):
    """SIGTERM during a long command: exit 143, one line, and every file written so far (now=True: at once, not
    at the command's end) complete."""
    import signal
    import subprocess
    import sys
    import time
    code = ("import sys, time; sys.path.insert(0, %r); import machinery\n"
            "def main():\n"
            "    machinery.write_output(%r, 'analyze.py output', lambda f: f.write(b'done\\n'), now=True)\n"
            "    print('ready', flush=True)\n"
            "    time.sleep(60)\n"
            "machinery.run(main)\n") % (ROOT, str(tmp_path / "a.md"))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and len(err.strip().splitlines()) == 1 and "SIGTERM" in err
    assert (tmp_path / "a.md").read_text() == "done\n"
    time.sleep(0)


# ----------------------------------------------------------------------------------------------------------
# Regression tests of cases found while building the readers (each a sibling of a reported example)
# ----------------------------------------------------------------------------------------------------------

def run_analyze(argv, capsys):
    import analyze
    try:
        machinery.run(lambda: analyze.main([str(a) for a in argv]))
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def grid_log(path):
    path.write_text("idx\tlabel\tpredict\tradius\tcorrect\ttime\tnA\tN\tpA_lower\tpA_upper\tstop\n"
                    "0\t1\t1\t0.5\t1\t0:00:01\t90\t100\t0.8\t0.95\tupper\n"
                    "1\t2\t1\t0.25\t0\t0:00:01\t60\t100\t0.5\t0.7\tbudget\n")
    return str(path)


@pytest.mark.parametrize("flags", [[], ["--format", "tsv"], ["--format", "latex"], ["--group-by-seed"],
                                   ["--group-by-seed", "--format", "tsv"], ["--group-by-seed", "--format", "latex"]])
def test_a_grid_log_has_no_acr_in_any_format_or_grouping(tmp_path, capsys, flags):
    path = grid_log(tmp_path / "grid_noise_0.5.tsv")
    code, out, _ = run_analyze(["table", path, *flags], capsys)
    assert code == 0
    row = next(line for line in out.splitlines() if "grid" in line and "0.5" in line and "certified at" not in line)
    assert "n/a" in row and "0.3750" not in row and "0.375" not in row   # the mean grid level is not an ACR


def test_labels_with_slashes_and_spaces_become_safe_file_names(tmp_path, capsys):
    path = tmp_path / "m_noise_0.25.tsv"
    path.write_text("idx\tlabel\tpredict\tradius\tcorrect\ttime\tnA\tN\tnY\n0\t1\t1\t0.5\t1\t0:00:01\t90\t100\t90\n")
    out = tmp_path / "out"
    code, _, err = run_analyze(["ecdf", path, "--labels", "../a/b c", "--out", out], capsys)
    assert code == 0, err
    names = os.listdir(out)
    assert any(n.startswith("ecdf_a_b_c_") for n in names) and not (tmp_path / "a").exists()


def test_a_folder_given_as_a_log_is_named_a_folder(tmp_path, capsys):
    code, _, err = run_analyze(["table", tmp_path], capsys)
    assert code == 2 and "is a folder" in err and "not found" not in err


def test_a_predict_log_where_a_certify_log_is_needed_says_so(tmp_path, capsys):
    path = tmp_path / "p.tsv"
    path.write_text("idx\tlabel\tpredict\tcorrect\ttime\tnA\tN\tnY\n0\t1\t1\t1\t0:00:01\t90\t100\t90\n")
    code, _, err = run_analyze(["table", path], capsys)
    assert code == 2 and "PREDICT log" in err and len(err.strip().splitlines()) == 1


def test_a_sidecar_of_the_wrong_shape_names_the_field(tmp_path, capsys):
    path = tmp_path / "m_noise_0.25.tsv"
    path.write_text("idx\tlabel\tpredict\tradius\tcorrect\ttime\n0\t1\t1\t0.5\t1\t0:00:01\n")
    (tmp_path / "m_noise_0.25.tsv.json").write_text('{"sigma": "0.25", "N": 1000}')
    code, _, err = run_analyze(["table", path], capsys)
    assert code == 2 and "field 'sigma'" in err


# ----------------------------------------------------------------------------------------------------------
# Run identity: a resume on other data, by another script or of another checkpoint is refused, naming it
# ----------------------------------------------------------------------------------------------------------

def cifar_folder(root, shade):
    """A CIFAR-10 image-folder copy in miniature: 10 classes, one 32x32 image each (train and test)."""
    from PIL import Image
    for split in ("train", "test"):
        for c in range(10):
            os.makedirs(root / split / f"c{c}")
            Image.new("RGB", (32, 32), (shade, c * 20, 0)).save(root / split / f"c{c}" / "0.png")
    return str(root)


def run_script(module, argv, capsys):
    import sys
    saved = sys.argv
    sys.argv = [module.__name__ + ".py"] + [str(a) for a in argv]
    try:
        machinery.run(module.main)
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = saved
    return code, capsys.readouterr().err


def test_a_training_resume_on_other_data_or_by_another_script_is_refused(tmp_path, capsys):
    import train_gaussian
    import train_ours
    a, b = cifar_folder(tmp_path / "a", 0), cifar_folder(tmp_path / "b", 9)
    (tmp_path / "b" / "test" / "c0" / "1.png").write_bytes((tmp_path / "b" / "test" / "c0" / "0.png").read_bytes())
    run = tmp_path / "run"
    base = ["--dataset", "cifar10", "--arch", "lenet", "--sigma", "0.25", "--batch", "4", "--workers", "0",
            "--device", "cpu", "--outdir", run]
    code, err = run_script(train_gaussian, base + ["--data-dir", a, "--epochs", "1"], capsys)
    assert code == 0, err
    before = {f: (run / f).read_bytes() for f in os.listdir(run) if not f.startswith(".")}
    code, err = run_script(train_gaussian, base + ["--data-dir", b, "--epochs", "2", "--resume"], capsys)
    assert code == 2 and "data: other images" in err and len(err.strip().splitlines()) == 1
    code, err = run_script(train_ours, base + ["--data-dir", a, "--epochs", "2", "--resume"], capsys)
    assert code == 2 and "train_gaussian.py" in err
    assert {f: (run / f).read_bytes() for f in os.listdir(run) if not f.startswith(".")} == before


def test_a_certification_resume_on_other_data_or_another_checkpoint_is_refused(tmp_path, capsys):
    import certify
    from helpers import digits_checkpoint
    a, b = cifar_folder(tmp_path / "a", 0), cifar_folder(tmp_path / "b", 9)
    (tmp_path / "b" / "test" / "c0" / "1.png").write_bytes((tmp_path / "b" / "test" / "c0" / "0.png").read_bytes())
    model = common.get_architecture("lenet", "cifar10")
    ckpt = str(tmp_path / "m.pth.tar")
    machinery.save_checkpoint({"arch": "lenet", "dataset": "cifar10", "sigma": 0.25, "state_dict": model.state_dict()},
                              ckpt)
    out = tmp_path / "log.tsv"
    base = ["--checkpoint", ckpt, "--outfile", out, "--N0", "10", "--N", "20", "--batch", "20", "--device", "cpu"]
    assert run_script(certify, base + ["--data-dir", a, "--max", "2"], capsys)[0] == 0
    before = out.read_bytes()
    code, err = run_script(certify, base + ["--data-dir", b, "--max", "4"], capsys)
    assert code == 2 and "data" in err and out.read_bytes() == before
    other = digits_checkpoint(tmp_path / "d.pth.tar", steps=1)
    code, err = run_script(certify, ["--checkpoint", other] + base[2:] + ["--data-dir", a, "--max", "4",
                                                                         "--dataset", "digits"], capsys)
    assert code == 2 and out.read_bytes() == before


def test_certify_stopped_by_sigterm_exits_143_and_resumes_to_the_uninterrupted_log(tmp_path):
    import signal
    import subprocess
    import sys
    import time
    from helpers import digits_checkpoint
    ckpt = digits_checkpoint(tmp_path / "c.pth.tar", steps=20)
    import certify
    from helpers import run_main
    flags = ["--checkpoint", ckpt, "--N0", "10", "--N", "2000", "--batch", "500", "--device", "cpu", "--max", "40"]
    argv = [sys.executable, os.path.join(ROOT, "certify.py"), *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    whole = tmp_path / "whole.tsv"   # the uninterrupted run and the resume in this process, the stopped one not
    assert run_main(certify.main, flags + ["--outfile", str(whole)]) == 0
    cut = tmp_path / "cut.tsv"
    proc = subprocess.Popen(argv + ["--outfile", str(cut)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and (not cut.exists() or cut.read_text().count("\n") < 4):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    lines = [ln for ln in err.splitlines() if not ln.startswith(("certify:", "note:")) and "examples," not in ln]
    assert proc.returncode == 143 and lines == [lines[-1]] and "SIGTERM" in lines[-1], err
    assert not list(tmp_path.glob("*.lock")), "a stopped run leaves no lock file"
    assert run_main(certify.main, flags + ["--outfile", str(cut)]) == 0
    assert not list(tmp_path.glob("*.lock")), "a finished run leaves no lock file"
    strip = lambda p: [ln.split("\t")[:5] + ln.split("\t")[6:] for ln in p.read_text().splitlines()]   # no time
    assert strip(cut) == strip(whole)


# ----------------------------------------------------------------------------------------------------------
# Numbers checked in the precision and range where they are used (found by the fuzzer and by hand)
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, why", [
    (["--sigma", "1e39"], "finite number in float32"),        # was a certificate of radius 3.8e39 (noise = inf)
    (["--sigma", "1e-50"], "--sigma must lie in"),            # was 0 in float32: no noise at all
    (["--sigma", "5000", "--precision", "fp16"], "under fp16"),
    (["--N", str(2 ** 40)], "at most 1e+09"),                 # was a loop of 10^9 passes
    (["--N", str(2 ** 63)], "fit in 64 bits"),                # was a MemoryError
    (["--alpha", "1e-320"], None),                            # tiny but valid: runs
])
def test_certify_numbers_are_checked_where_they_are_used(tmp_path, capsys, flags, why):
    import certify
    from helpers import digits_checkpoint
    ckpt = digits_checkpoint(tmp_path / "c.pth.tar", steps=5)
    out = tmp_path / "o.tsv"
    code, err = run_script(certify, ["--checkpoint", ckpt, "--outfile", out, "--max", "1", "--N0", "10", "--N", "50",
                                     "--batch", "50", "--device", "cpu", *flags], capsys)
    if why is None:
        assert code == 0, err
        radius = float(out.read_text().splitlines()[1].split("\t")[3])
        assert radius == radius and abs(radius) < 10
    else:
        assert code == 2 and why in err and len(err.strip().splitlines()) == 1 and not out.exists()


def test_a_model_with_non_finite_outputs_gives_no_votes():
    class Overflow(torch.nn.Module):
        def forward(self, x):
            return torch.full((x.shape[0], 10), float("nan"))
    with pytest.raises(common.UserError, match="non-finite outputs"):
        common.sample_counts(Overflow(), torch.zeros(1, 1, 8, 8), 0.25, 10, 10, 10)


def test_training_sizes_are_bounded_before_anything_is_allocated(tmp_path, capsys):
    import train_gaussian
    code, err = run_script(train_gaussian, ["--dataset", "digits", "--sigma", "0.25", "--m", str(10 ** 9),
                                            "--outdir", tmp_path / "run", "--device", "cpu"], capsys)
    assert code == 2 and "--batch x --m" in err and not (tmp_path / "run").exists()
    code, err = run_script(train_gaussian, ["--dataset", "digits", "--sigma", "0.25", "--weight_decay", "1e300",
                                            "--outdir", tmp_path / "run", "--device", "cpu"], capsys)
    assert code == 2 and "float32" in err


def test_no_shell_script_writes_a_file_itself():
    """scripts/*.sh leave every write to the Python commands (and so to the guard): no cp, mv, tee or `> file`."""
    found = []
    for name in sorted(os.listdir(os.path.join(ROOT, "scripts"))):
        if not name.endswith(".sh"):
            continue
        with open(os.path.join(ROOT, "scripts", name)) as f:
            for number, line in enumerate(f, 1):
                code = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
                code = re.sub(r'"[^"]*"|\'[^\']*\'', '""', code)              # text in quotes is not a redirection
                code = re.sub(r"\d*>\s*/dev/null|2>&1|>&2", "", code)
                if re.search(r"(^|[\s;|&])(cp|mv|tee)\s", code) or re.search(r"(?<![-=<>])>\s*[^\s&=]", code):
                    found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "shell-level writes:\n" + "\n".join(found)


def test_a_sidecar_copied_beside_a_user_file_does_not_let_overwrite_remove_it(tmp_path, capsys):
    """The log's own record (its sidecar) names its columns: a user's file beside a copied sidecar is not it."""
    import certify
    from helpers import digits_checkpoint
    ckpt = digits_checkpoint(tmp_path / "c.pth.tar", steps=5)
    log = tmp_path / "log.tsv"
    argv = ["--checkpoint", ckpt, "--max", "2", "--N0", "10", "--N", "50", "--batch", "50", "--device", "cpu"]
    assert run_script(certify, argv + ["--outfile", log], capsys)[0] == 0
    notes = tmp_path / "notes.tsv"
    notes.write_text("my\tnotes\n")
    (tmp_path / "notes.tsv.json").write_bytes((tmp_path / "log.tsv.json").read_bytes())
    code, err = run_script(certify, argv + ["--outfile", notes, "--overwrite"], capsys)
    assert code == 2 and "changed since certify.py wrote it" in err and notes.read_text() == "my\tnotes\n"


def test_a_command_ends_its_own_process_without_teardown_and_no_other(monkeypatch):
    """machinery.run(main, exit_process=True) ends with os._exit (after the atexit handlers) only in the
    process of the script itself: a profiler (-m), a runner of several commands or a test keep SystemExit."""
    import atexit
    exits, handlers = [], []
    monkeypatch.setattr(os, "_exit", exits.append)
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: handlers.append(1))
    for orig, fast in ((["python", "x.py", "a"], True), (["python", "-u", "-X", "importtime", "x.py", "a"], True),
                       (["python", "-m", "cProfile", "x.py", "a"], False), (["python", "-c", "x.py", "a"], False),
                       (["python", "runner.py", "commands.json"], False)):
        monkeypatch.setattr(sys, "orig_argv", orig, raising=False)
        monkeypatch.setattr(sys, "argv", ["x.py", "a"])
        exits.clear()
        handlers.clear()
        try:
            machinery.run(lambda: sys.exit(3), exit_process=True)
            code = None
        except SystemExit as e:
            code = e.code
        assert (exits, handlers, code) == (([3], [1], None) if fast else ([], [], 3)), orig


def test_a_lock_file_lives_only_while_held_and_its_removal_cannot_give_the_lock_twice(tmp_path):
    """machinery.exclusive_lock: the file is removed at the end of the block. A process that opened the old file
    just before its removal (a thread here: flock locks belong to an open file, so two opens in one process
    conflict like two processes) must not hold the removed file's lock while a third locks the new one."""
    import threading
    path = str(tmp_path / "o.tsv.lock")
    got, release = threading.Event(), threading.Event()

    def second():
        with machinery.exclusive_lock(path, "test", wait=True):   # opens the first's file, waits, then takes the new one
            got.set()
            release.wait(30)
    with machinery.exclusive_lock(path, "test"):
        assert os.path.exists(path)
        worker = threading.Thread(target=second)
        worker.start()
        assert not got.wait(0.3)                        # blocked while the first holds it
    assert got.wait(30)
    with pytest.raises(common.UserError):               # the second holds the file now under that name
        with machinery.exclusive_lock(path, "test"):
            pass
    assert machinery.is_locked(path)
    release.set()
    worker.join(30)
    assert not os.path.exists(path) and os.listdir(tmp_path) == []


def test_a_command_refused_at_its_last_output_has_replaced_none(tmp_path, capsys):
    """`analyze.py table DIR/table.tsv --out DIR --format tsv`: table.tsv is its input, so table.md and
    table.tex, written before it, must not replace anything either (the guard installs outputs at the end)."""
    folder = tmp_path / "d"
    folder.mkdir()
    log = grid_log(folder / "table.tsv")
    lines = open(log).read().splitlines()
    cols = lines[0].split("\t")[:6] + ["nA", "N"]
    open(log, "w").write("\t".join(cols) + "\n" + "0\t1\t1\t0.5\t1\t0:00:01\t90\t100\n")
    code, _, err = run_analyze(["table", log, "--out", folder, "--format", "tsv"], capsys)
    assert code == 2 and "is an input of this command" in err, err
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == ["table.tsv"]

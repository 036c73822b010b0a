"""The readers' whole contract, at the one reader of each format: numbers as the project writes them, no column
twice, a byte-order mark, JSON nested without end, checkpoints whose keys are not names, special files among
the images, hidden files in a data folder, a --data-dir whose split is a file; and Ctrl-C while a script is
still importing. Each case is one UserError line (or a quiet stop), never a traceback or a hang."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import common
import readers
import machinery
from helpers import as_written

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG = "idx\tlabel\tpredict\tradius\tcorrect\ttime\n0\t1\t1\t{}\t1\t0:00:01\n1\t2\t2\t0.25\t1\t0:00:01\n"


@pytest.mark.parametrize("cell", ["0_5", "٣", "0x1", "1e", "--1", "½"])
def test_a_number_is_ascii_digits_and_nothing_else(tmp_path, cell):
    path = tmp_path / "log.tsv"
    path.write_text(LOG.format(cell))
    with pytest.raises(common.UserError, match="line 2: radius .* is not a number"):
        readers.read_certification_log(str(path))


@pytest.mark.parametrize("cell", ["0.5", "0", "1e-05", "2.5E+3", ".5", "1."])
def test_numbers_as_the_project_writes_them_still_read(tmp_path, cell):
    path = tmp_path / "log.tsv"
    path.write_text(LOG.format(cell))
    assert readers.read_certification_log(str(path))["radius"][0] == float(cell)


def test_a_negative_radius_is_no_radius_but_predict_minus_one_is_an_abstention(tmp_path):
    path = tmp_path / "log.tsv"
    path.write_text(LOG.format("-1"))
    with pytest.raises(common.UserError, match="line 2: radius must be a finite number >= 0"):
        readers.read_certification_log(str(path))
    path.write_text(LOG.format("0").replace("0\t1\t1\t0\t1", "0\t1\t-1\t0\t0"))
    assert readers.read_certification_log(str(path))["predict"][0] == -1


def test_a_column_twice_is_named_as_such(tmp_path):
    path = tmp_path / "log.tsv"
    path.write_text("idx\tlabel\tpredict\tradius\tcorrect\ttime\tidx\n0\t1\t1\t0.5\t1\t0:00:01\t0\n")
    with pytest.raises(common.UserError, match="column idx appears more than once"):
        readers.read_certification_log(str(path))


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
    path = tmp_path / "log.tsv"
    path.write_bytes(b"\xef\xbb\xbf" + LOG.format("0.5").encode())
    assert readers.read_certification_log(str(path))["idx"].tolist() == [0, 1]


def test_a_resumed_log_with_a_non_ascii_idx_is_malformed_not_a_crash(tmp_path):
    path = tmp_path / "log.tsv"
    path.write_text("idx\tlabel\n0\t1\n²\t2\n")
    with pytest.raises(common.UserError, match="line 3 is malformed"):
        readers.read_log_prefix(str(path), ("idx", "label"))


def test_a_broken_training_log_names_the_training_scripts_way_out_not_certify_flags(tmp_path, monkeypatch, capsys):
    """read_log_prefix serves certify.py (which has --overwrite) and the training runs' log.tsv (which have not):
    each message ends with the reading command's own way out."""
    (tmp_path / "log.tsv").write_text("\t".join(readers.TRAIN_LOG_COLUMNS) + "\n" + "x\n" * 2)
    with pytest.raises(common.UserError, match="line 2 is malformed") as e:
        readers.read_train_log(str(tmp_path / "log.tsv"))
    assert "--overwrite" not in str(e.value) and "another --outdir" in str(e.value)
    (tmp_path / "log.tsv").write_bytes(b"epoch\r\n")
    for read in (readers.read_train_log, lambda p: readers.read_log_prefix(p, readers.TRAIN_LOG_COLUMNS)):
        with pytest.raises(common.UserError, match="CR LF") as e:
            read(str(tmp_path / "log.tsv"))
        assert ("--overwrite" in str(e.value)) == (read is not readers.read_train_log)


@pytest.mark.parametrize("flags, named", [(["--batch", "--N"], "lower --batch or --N"), ([], "error: out of memory; ")])
def test_out_of_memory_names_only_the_size_flags_the_command_has(flags, named, capsys):
    parser = machinery.ArgumentParser()
    for flag in flags:
        parser.add_argument(flag, type=int, default=1)
    parser.parse_args([])

    def main():
        raise MemoryError
    with pytest.raises(SystemExit) as e:
        machinery.run(main)
    err = capsys.readouterr().err
    assert e.value.code == 2 and named in err and err.count("\n") == 1
    assert "--m" not in err and ("--batch" in err) == bool(flags)   # no flag the command lacks


def test_json_nested_without_end_is_one_line(tmp_path):
    path = tmp_path / "log.tsv.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(common.UserError, match="must be JSON"):
        readers.read_json_object(str(path), "settings file")


def test_a_checkpoint_whose_keys_are_not_names_is_refused(tmp_path):
    path = tmp_path / "ckpt.pth.tar"
    torch.save({"arch": "digits_cnn", "dataset": "digits", "state_dict": {0: torch.zeros(1)}}, path)
    with pytest.raises(common.UserError, match="keys that are not parameter names"):
        readers.load_model(str(path))


def image_folder(root, fifo=False):
    from PIL import Image
    for split in ("train", "test"):
        for name in ("airplane", "bird"):
            folder = root / split / name
            folder.mkdir(parents=True)
            Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(folder / "a.png")
    if fifo:
        os.mkfifo(root / "test" / "bird" / "x.png")


def test_a_fifo_among_the_images_is_refused_without_waiting_for_it(tmp_path):
    image_folder(tmp_path, fifo=True)
    code = (f"import sys; sys.path.insert(0, {ROOT!r}); import common\n"
            f"common._image_folder_in_memory({str(tmp_path / 'test')!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "x.png: not a regular file" in done.stderr


def test_hidden_files_the_loader_skips_do_not_change_the_data_fingerprint(tmp_path):
    image_folder(tmp_path)
    before = machinery.data_fingerprint("cifar10", "test", str(tmp_path))
    (tmp_path / "test" / "bird" / ".DS_Store").write_bytes(b"finder")
    (tmp_path / "test" / ".hidden").mkdir()
    assert machinery.data_fingerprint("cifar10", "test", str(tmp_path)) == before
    (tmp_path / "test" / "bird" / "b.png").write_bytes((tmp_path / "test" / "bird" / "a.png").read_bytes())
    assert machinery.data_fingerprint("cifar10", "test", str(tmp_path)) != before   # a real image counts


def test_the_data_fingerprint_covers_the_images_contents_not_only_their_names_and_sizes(tmp_path):
    image_folder(tmp_path)
    before = machinery.data_fingerprint("cifar10", "test", str(tmp_path))
    image = tmp_path / "test" / "bird" / "a.png"
    data = bytearray(image.read_bytes())
    data[-13] ^= 1   # one bit of the same file: same name, same size, another image
    image.write_bytes(bytes(data))
    assert machinery.data_fingerprint("cifar10", "test", str(tmp_path)) != before
    os.mkfifo(tmp_path / "test" / "bird" / "y.png")   # not a regular file: left out, and not waited for
    machinery.data_fingerprint("cifar10", "test", str(tmp_path))


def test_a_data_dir_whose_split_is_a_file_says_so_and_downloads_nothing(tmp_path):
    (tmp_path / "test").write_text("not a folder")
    with pytest.raises(common.UserError, match="is not a folder"):
        common.get_dataset("cifar10", "test", str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["test"]


def test_a_failed_download_leaves_no_folder_behind(tmp_path, monkeypatch):
    """No data and no network: torchvision's CIFAR10 makes the folder and a partial archive, then fails; the
    folder it made goes (a folder that was there before stays, with what was in it)."""
    import urllib.error

    import torchvision

    def offline(root, train, download):
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, "cifar-10-python.tar.gz"), "wb") as f:
            f.write(b"partial")
        raise urllib.error.URLError("no network")
    monkeypatch.setattr(torchvision.datasets, "CIFAR10", offline)
    with pytest.raises(common.UserError, match="could not be downloaded"):
        common.get_dataset("cifar10", "test", str(tmp_path / "data"))
    assert os.listdir(tmp_path) == []
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    with pytest.raises(common.UserError, match="could not be downloaded"):
        common.get_dataset("cifar10", "test", str(tmp_path / "mine"))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "kept"


def test_ctrl_c_during_a_command_stops_it_quietly_with_exit_code_130(tmp_path):
    """SIGINT once the command runs (machinery.run handles it): one line naming it, no traceback, exit 130."""
    code = ("import sys, time; sys.path.insert(0, %r); import machinery\n"
            "def main():\n"
            "    print('ready', flush=True)\n"
            "    time.sleep(60)\n"
            "machinery.run(main, exit_process=True)\n") % ROOT
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err and err.strip().splitlines() == [err.strip()], err
    assert "SIGINT" in err


# ---- sizes: every size flag bounded before anything is allocated or planned ----------------------------------

def run_training(monkeypatch, argv):
    """train_gaussian.py's main on argv (it reads sys.argv), through machinery.run: the exit code."""
    import train_gaussian
    from helpers import run_main
    monkeypatch.setattr(sys, "argv", ["train_gaussian.py", *map(str, argv)])
    return run_main(lambda _: train_gaussian.main(), [])


@pytest.mark.parametrize("flags, message", [(["--m", "1000000000"], "--batch x --m"),
                                            (["--seed", "18446744073709551616"], "--seed must fit in 64 bits"),
                                            (["--sigma", "1e30"], "--sigma must lie in")])
def test_gradient_norm_mode_checks_its_sizes_before_it_allocates(tmp_path, monkeypatch, capsys, flags, message):
    ckpt = tmp_path / "c.pth.tar"
    machinery.save_checkpoint({"arch": "digits_cnn", "dataset": "digits", "sigma": 0.5,
                               "state_dict": common.get_architecture("digits_cnn", "digits").state_dict()}, str(ckpt))
    assert run_training(monkeypatch, ["--gradnorm", ckpt, "--outdir", tmp_path / "out", *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "gradnorm_gaussian.tsv").exists()


@pytest.mark.parametrize("script, argv, message", [
    ("certify", ["--no-final-look"], "--no-final-look goes with --radii"),
    ("certify", ["--group", "8"], "--group goes with --radii"),
    ("train_gaussian", ["--probe", "5"], "--probe goes with --gradnorm"),
    ("train_gaussian", ["--N", "5"], "--N goes with --gradnorm"),
    ("train_ours", ["--probe", "5"], "--probe goes with --gradnorm"),
    ("train_baselines", ["--method", "macer", "--N", "5"], "--N goes with --gradnorm or --make-catrs-target"),
    ("train_baselines", ["--method", "macer", "--checkpoint", "c", "--out", "o"],
     "--checkpoint goes with --make-catrs-target"),
    ("bench", ["--sections", "a", "--grid-radii", "0.5"], "--grid-radii goes with --sections g"),
    ("bench", ["--sections", "g", "--grid-logs", "x.tsv", "--grid-noise", "paired"], "not --grid-logs"),
    ("bench", ["--sections", "ab", "--checkpoint", "c"], "--checkpoint goes with --sections d or g or h"),
    ("bench", ["--sections", "d", "--grid-logs", "x.tsv"], "--grid-logs goes with --sections g"),
    # and in a mode, the options of the others: --gradnorm trains nothing, --make-catrs-target probes nothing
    ("train_gaussian", ["--gradnorm", "c", "--epochs", "3", "--lr", "0.2"], "--epochs, --lr do not apply to --gradnorm"),
    ("train_ours", ["--gradnorm", "c", "--Et", "5"], "--Et does not apply to --gradnorm"),
    ("train_baselines", ["--method", "macer", "--gradnorm", "c", "--amp"], "--amp does not apply to --gradnorm"),
    ("train_baselines", ["--make-catrs-target", "--checkpoint", "c", "--out", "o", "--method", "macer"],
     "--method, --outdir do not apply to --make-catrs-target")])
def test_an_option_of_another_mode_is_refused_not_ignored(script, argv, message, tmp_path, monkeypatch, capsys):
    """An option that only acts in a mode (--radii, --gradnorm, a bench section) given without it would run
    something other than what was asked: one line and exit 2, before anything is written."""
    import importlib
    from helpers import run_main
    module = importlib.import_module(script)
    out = ["--outdir", tmp_path / "run"] if script.startswith("train") else \
        ["--outfile", tmp_path / "run.tsv", "--checkpoint", tmp_path / "c.pth.tar"] if script == "certify" else []
    full = ["--dataset", "digits", "--sigma", "0.5", *out, *argv] if script != "bench" else argv
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *map(str, full)])
    assert run_main(lambda _: module.main(), []) == 2
    assert message in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("script, argv, message", [
    ("compare_calibration", ["--runs", "0"], "--runs and --heavy-runs must be >= 1"),
    ("compare_calibration", ["--heavy-runs", "-1"], "--runs and --heavy-runs must be >= 1"),
    ("compare_calibration", ["--jobs", "0"], "--jobs must lie in [1, 64]"),
    ("grid_validity", ["--out", "v.md", "--priors", "500"], "--priors must lie in [0, 100]"),
    ("grid_validity", ["--out", "v.md", "--workers", "2", "--pipeline-trials", "0"], "with --pipeline-trials 0"),
    ("demo_seeds", ["--epochs", "0"], "--epochs and --N must be >= 1"),
    ("demo_seeds", ["--seeds", "-1"], "--seeds must be >= 0"),
    ("macer_init", ["--data-dir", "d", "--batches", "0"], "--batches must be >= 1"),
    ("macer_init", ["--data-dir", "d", "--archs", "foo"], "unknown architecture 'foo'"),
    ("ddrs_class_check", ["--checkpoint", "c", "--out", "o.md", "--skip", "0"], "--skip must be >= 1"),
    ("gpu_check", ["--images", "0"], "--images must be >= 1"),
    ("gpu_check", ["--budget", "0"], "--budget must be > 0"),
    ("gpu_check", ["--batch", "0"], "--batch must be >= 1"),
    ("beta_curve", ["log.tsv", "--radii", "0.5", "--estimates", "2"], "--estimates goes with --savings"),
    ("beta_curve", ["log.tsv", "--radii", "0.5", "--seeds", "1", "2"], "--seeds goes with --at-pA"),
    ("beta_curve", ["log.tsv", "--radii", "0.5", "--savings", "--budgets", "5"], "are 2 modes; give one"),
    ("like_for_like", ["log.tsv", "--reps", "0"], "--reps >= 1")])
def test_the_helper_scripts_refuse_a_bad_number_in_one_line(script, argv, message, tmp_path, monkeypatch, capsys):
    """tools/*.py: a count below 1, a value out of range or an option of another mode is one line and exit 2
    before any work (not a traceback from a pool, a division or an empty list, nor a run that ignores it)."""
    import importlib.util
    from helpers import run_main
    spec = importlib.util.spec_from_file_location(script, os.path.join(ROOT, "tools", f"{script}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.chdir(tmp_path)
    assert run_main(module.main, argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert os.listdir(tmp_path) == []


def test_an_output_folder_in_the_way_is_named_without_a_flag_the_command_lacks(tmp_path, capsys):
    """The one guard of output folders (machinery.make_outdir) serves every command, whose flags differ (--out,
    --outfile, --report, --outdir): its message names the folder, not a flag."""
    import analyze
    from helpers import run_main
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    log = tmp_path / "noise_0.5.tsv"
    log.write_text(LOG.format("0.5"))
    assert run_main(analyze.main, ["table", log, "--out", blocker / "tables"]) == 2
    err = capsys.readouterr().err
    assert "cannot write to output folder" in err and "--outdir" not in err and err.count("\n") == 1
    assert blocker.read_text() == "not a folder"


@pytest.mark.parametrize("argv, message", [
    (["compare", "A", "--vs", "B", "--N", "100"], "--N and --alpha go with --over test-set"),
    (["table", "A", "B", "--baseline", "zzz"], "--baseline 'zzz' is none of the logs' labels (a, b)"),
    (["table", "A", "B", "--baseline", "a"], "--baseline greys LaTeX rows"),
    (["ecdf", "A", "B", "--baseline", "zzz"], "--baseline 'zzz' is none of the logs' labels")])
def test_an_analyze_option_that_would_do_nothing_is_refused(argv, message, tmp_path, capsys):
    """analyze.py: --N / --alpha of compare's test-set mode on the images' comparison, a --baseline no log is
    called, or one given where nothing is greyed: one line and exit 2, not a report that ignored them."""
    import analyze
    from helpers import run_main
    paths = {"A": tmp_path / "a" / "noise_0.5.tsv", "B": tmp_path / "b" / "noise_0.5.tsv"}
    for path in paths.values():
        path.parent.mkdir()
        path.write_text(LOG.format("0.5"))
    assert run_main(analyze.main, [str(paths.get(a, a)) for a in argv]) == 2
    assert message in capsys.readouterr().err
    latex = ["table", paths["A"], paths["B"], "--baseline", "a", "--format", "latex"]
    assert run_main(analyze.main, latex) == 0 and "\\bottomrule" in capsys.readouterr().out


def test_max_batches_below_one_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    assert run_training(monkeypatch, ["--dataset", "digits", "--sigma", "0.5", "--epochs", "1", "--workers", "0",
                                      "--max-batches", "-1", "--outdir", tmp_path / "run"]) == 2
    assert "--max-batches must be >= 1" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_a_grid_budget_that_would_take_minutes_to_plan_is_refused(tmp_path):
    import certify
    args = certify.parse_args(["--checkpoint", "c.pth.tar", "--radii", "0.5", "--N", "1000000000"])
    with pytest.raises(common.UserError, match="budget N_max"):
        certify.check_args(args)


def test_two_logs_that_would_write_one_curve_file_are_refused_before_anything_is_written(tmp_path):
    """Output names unique per input: labels 'a b' and 'a_b' both become ecdf_a_b_<sigma>.tsv."""
    import analyze
    from helpers import run_main
    logs = []
    for name in ("one", "two"):
        path = tmp_path / f"{name}.tsv"
        path.write_text("idx\tlabel\tpredict\tradius\tcorrect\ttime\tnA\tN\tnY\n"
                        "0\t1\t1\t0.5\t1\t0:00:01\t90\t100\t90\n1\t2\t2\t0.2\t1\t0:00:01\t70\t100\t70\n")
        logs.append(str(path))
    out = tmp_path / "out"
    code = run_main(analyze.main, ["ecdf", *logs, "--labels", "a b", "a_b", "--sigmas", "0.5", "0.5",
                                   "--out", out])
    assert code == 2 and not out.exists()


# Files the guard does not name: locks, sidecars, temporaries, records --------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from helpers import digits_checkpoint
    return digits_checkpoint(tmp_path_factory.mktemp("ckpt") / "c.pth.tar", steps=5)


def certify_into(ckpt, out, capsys):
    import certify
    from helpers import run_main
    code = run_main(certify.main, ["--checkpoint", ckpt, "--outfile", out, "--max", 2, "--N0", 10, "--N", 40])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("helper", ["o.tsv.lock", "o.tsv.json", "o.tsv.json.tmp<pid>", "o.tsv.counts"])
def test_a_link_in_place_of_a_helper_file_is_never_written_through(ckpt, tmp_path, capsys, helper):
    """A lock or a temporary file is opened without following a link (refused); a sidecar replaces a link by
    its rename (the link goes, its target is not made); a counts file this run does not write is left alone."""
    helper = helper.replace("<pid>", str(os.getpid()))   # the temporary file of this process's sidecar
    os.symlink(tmp_path / "target", tmp_path / helper)
    code, err = certify_into(ckpt, str(tmp_path / "o.tsv"), capsys)
    if helper in ("o.tsv.counts", "o.tsv.json"):
        assert code == 0, err
    else:
        assert code == 2 and len(err.strip().splitlines()) == 1 and "link" in err, err
    assert not (tmp_path / "target").exists()
    assert os.path.islink(tmp_path / helper) == (helper != "o.tsv.json")


@pytest.mark.parametrize("helper", ["o.tsv.lock", "o.tsv.json"])
def test_a_fifo_in_place_of_a_helper_file_is_never_waited_on(ckpt, tmp_path, capsys, helper):
    """A FIFO where the lock goes is refused at once; one where the sidecar goes is replaced by its rename."""
    os.mkfifo(tmp_path / helper)
    start = time.time()
    code, err = certify_into(ckpt, str(tmp_path / "o.tsv"), capsys)
    assert time.time() - start < 30
    if helper == "o.tsv.lock":
        assert code == 2 and len(err.strip().splitlines()) == 1, err
    else:
        assert code == 0 and os.path.isfile(tmp_path / helper), err


# "Ours" by content, one output per input, resume checks before work -------------------------------------

def train_into(out, capsys, *extra):
    import train_gaussian
    from helpers import run_main
    argv = ["--dataset", "digits", "--sigma", 0.25, "--max-batches", 1, "--workers", 0, "--outdir", out, *extra]
    old = sys.argv
    sys.argv = ["train_gaussian.py", *map(str, argv)]
    try:
        code = run_main(lambda a: train_gaussian.main(), argv)
    finally:
        sys.argv = old
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_checkpoint_copied_into_a_new_folder_is_refused_before_any_epoch(tmp_path, capsys):
    assert train_into(tmp_path / "a", capsys, "--epochs", 1)[0] == 0
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "checkpoint.pth.tar").write_bytes((tmp_path / "a" / "checkpoint.pth.tar").read_bytes())
    code, out, err = train_into(tmp_path / "b", capsys, "--epochs", 2, "--resume")
    assert code == 2 and "missing or changed since" in err and "epoch" not in out
    assert sorted(p.name for p in (tmp_path / "b").iterdir() if not p.name.startswith(".")) == ["checkpoint.pth.tar"]


def test_a_log_changed_since_it_was_written_is_not_resumed_but_one_cut_by_a_kill_is(tmp_path, capsys):
    assert train_into(tmp_path / "a", capsys, "--epochs", 1)[0] == 0
    log = tmp_path / "a" / "log.tsv"
    ours = log.read_bytes()
    log.write_bytes(ours.replace(b"\n0\t", b"\n7\t", 1))   # an edited row, same length
    code, _, err = train_into(tmp_path / "a", capsys, "--epochs", 2, "--resume")
    assert code == 2 and "changed since" in err and len(err.strip().splitlines()) == 1
    log.write_bytes(ours + b"2\t0.1")                       # what a kill mid-row leaves: a longer log
    assert train_into(tmp_path / "a", capsys, "--epochs", 2, "--resume")[0] == 0
    assert log.read_bytes().startswith(ours) and log.read_bytes().count(b"\n") == 3


def test_two_checkpoints_never_share_one_gradient_norm_file(tmp_path, capsys):
    import train_gaussian
    from helpers import digits_checkpoint, run_main
    a = digits_checkpoint(tmp_path / "a.pth.tar", arch="digits_cnn", steps=2)
    b = digits_checkpoint(tmp_path / "b.pth.tar", arch="digits_cnn", steps=2, seed=1)

    def gradnorm(ckpt):
        argv = ["--gradnorm", ckpt, "--outdir", tmp_path / "g", "--probe", 10, "--N", 5]
        old, sys.argv = sys.argv, ["train_gaussian.py", *map(str, argv)]
        try:
            return run_main(lambda a: train_gaussian.main(), argv), capsys.readouterr()
        finally:
            sys.argv = old
    assert gradnorm(a)[0] == 0
    first = (tmp_path / "g" / "gradnorm_gaussian.tsv").read_bytes()
    code, captured = gradnorm(b)
    assert code == 2 and "two inputs would share one output" in captured.err and "wrote" not in captured.out
    assert (tmp_path / "g" / "gradnorm_gaussian.tsv").read_bytes() == first
    assert gradnorm(a)[0] == 0   # the same checkpoint again: its own file is replaced


def test_a_random_seed_whose_value_is_lost_is_not_resumed_with_another(ckpt, tmp_path, capsys):
    import certify
    from helpers import run_main
    argv = ["--checkpoint", ckpt, "--outfile", tmp_path / "o.tsv", "--N0", 10, "--N", 40, "--seed", "random"]
    assert run_main(certify.main, argv + ["--max", 2]) == 0
    capsys.readouterr()
    sidecar = json.loads((tmp_path / "o.tsv.json").read_text())
    sidecar["seed_value"] = None
    (tmp_path / "o.tsv.json").write_text(json.dumps(sidecar))
    from helpers import as_recorded
    as_recorded(tmp_path / "o.tsv", tmp_path / "o.tsv.json")   # a log from elsewhere that lost its seed value
    before = (tmp_path / "o.tsv").read_bytes()
    assert run_main(certify.main, argv + ["--max", 3]) == 2
    err = capsys.readouterr().err
    assert "seed is not recorded" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "o.tsv").read_bytes() == before


def test_the_grid_benchmark_refuses_logs_it_cannot_count(ckpt, tmp_path, capsys):
    import bench
    import certify
    from helpers import run_main
    logs = {}
    for name, extra in (("a/cert", []), ("b/cert", []), ("grid", ["--radii", 0.25]),
                        ("label", ["--label-mode"]), ("predict", ["--predict"])):
        logs[name] = str(tmp_path / f"{name}.tsv")
        assert run_main(certify.main, ["--checkpoint", ckpt, "--outfile", logs[name], "--max", 2, "--N0", 10,
                                       "--N", 40, *extra]) == 0, name
    capsys.readouterr()
    with pytest.raises(common.UserError, match="two logs named 'cert'"):
        bench.grid_from_logs([logs["a/cert"], logs["b/cert"]])
    with pytest.raises(common.UserError, match="label-mode"):
        bench.grid_from_logs([logs["a/cert"], logs["label"]])
    with pytest.raises(common.UserError, match="PREDICT log"):
        bench.grid_from_logs([logs["a/cert"], logs["predict"]])
    sidecar = json.loads(open(logs["grid"] + ".json").read())
    sidecar["N0"] = None
    with open(logs["grid"] + ".json", "w") as f:
        json.dump(as_written(sidecar, logs["grid"] + ".json"), f)
    with pytest.raises(common.UserError, match="N0 None"):
        bench.grid_from_logs([logs["a/cert"], logs["grid"]])


def test_two_analyses_into_one_folder_do_not_mix_their_outputs(tmp_path, capsys):
    """A second analyze.py writing into an --out that a running one holds is refused at once, and leaves the
    folder as it was; without the other one it writes (the lock is the folder's own: no file is added)."""
    import analyze
    from helpers import run_main
    log = tmp_path / "a.tsv"
    log.write_text("idx\tlabel\tpredict\tradius\tcorrect\ttime\n0\t1\t1\t0.5\t1\t0:00:01\n")
    out = tmp_path / "out"
    argv = ["table", log, "--sigmas", 0.25, "--out", out]
    with machinery.folder_lock(str(out), "--out"):
        assert run_main(analyze.main, argv) == 2
        err = capsys.readouterr().err
        assert "in use by another run" in err and len(err.strip().splitlines()) == 1
        assert os.listdir(out) == []
    assert run_main(analyze.main, argv) == 0
    assert not [f for f in os.listdir(out) if f.endswith(".lock")]


# Run identity checked by every consumer ---------------------------------------------------------------------

def test_a_resume_from_a_checkpoint_without_its_run_identity_is_refused(tmp_path, capsys):
    assert train_into(tmp_path / "a", capsys, "--epochs", 1)[0] == 0
    path = tmp_path / "a" / "checkpoint.pth.tar"
    ckpt = torch.load(path, weights_only=False)
    del ckpt["args"]["run"]
    torch.save(ckpt, path)
    code, out, err = train_into(tmp_path / "a", capsys, "--epochs", 2, "--resume")
    assert code == 2 and "run identity" in err and "epoch 2" not in out


def test_ddrs_pairs_only_logs_of_one_model_on_the_images_it_reads(ckpt, tmp_path, capsys):
    import certify
    import ddrs
    from helpers import digits_checkpoint, run_main
    other = digits_checkpoint(tmp_path / "other.pth.tar", steps=3, seed=5)
    common_flags = ["--max", 2, "--N0", 10, "--N", 40]
    assert run_main(certify.main, ["--checkpoint", other, "--outfile", tmp_path / "fixed.tsv", *common_flags]) == 0
    assert run_main(ddrs.main, ["certify", "--checkpoint", ckpt, "--outfile", tmp_path / "ds.tsv", "--K", 2,
                                *common_flags]) == 0
    capsys.readouterr()
    assert run_main(ddrs.main, ["report", tmp_path / "ds.tsv", "--fixed", tmp_path / "fixed.tsv",
                                "--out", tmp_path / "report"]) == 2
    err = capsys.readouterr().err
    assert "another checkpoint" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "report").exists()
    side = json.loads((tmp_path / "ds.tsv.json").read_text())
    side["data"] = "0" * 16   # a log certified on other images
    (tmp_path / "ds.tsv.json").write_text(json.dumps(as_written(side, tmp_path / "ds.tsv.json")))
    assert run_main(ddrs.main, ["memory", tmp_path / "ds.tsv"]) == 2
    err = capsys.readouterr().err
    assert "other images" in err and not (tmp_path / "ds_memory.tsv").exists()


def test_weights_finite_in_float32_but_not_in_the_runs_precision_are_refused_before_any_output(tmp_path, capsys):
    import certify
    from helpers import run_main, train_digits_model
    model = train_digits_model(steps=2)
    state = model.state_dict()
    first = next(k for k, v in state.items() if v.is_floating_point())
    state[first].view(-1)[0] = 3.4e38   # finite in float32, inf once rounded to bfloat16
    path = str(tmp_path / "big.pth.tar")
    machinery.save_checkpoint({"arch": "lenet", "dataset": "digits", "sigma": 0.25, "state_dict": state}, path)
    out = tmp_path / "o.tsv"
    assert run_main(certify.main, ["--checkpoint", path, "--outfile", out, "--max", 1, "--N0", 10, "--N", 20,
                                   "--precision", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "too large for --precision bf16" in err and not out.exists() and not (tmp_path / "o.tsv.json").exists()


def test_compare_refuses_logs_of_other_images_under_the_same_idx(ckpt, tmp_path, capsys):
    import analyze
    import certify
    from helpers import run_main
    for name in ("a", "b"):
        assert run_main(certify.main, ["--checkpoint", ckpt, "--outfile", tmp_path / f"{name}.tsv", "--max", 3,
                                       "--N0", 10, "--N", 40, "--seed", 1 if name == "b" else 0]) == 0
    argv = ["compare", tmp_path / "a.tsv", tmp_path / "b.tsv", "--out", tmp_path / "cmp"]
    assert run_main(analyze.main, argv) == 0   # one model, one set of images, two seeds
    side = json.loads((tmp_path / "b.tsv.json").read_text())
    side["data"] = "0" * 16
    (tmp_path / "b.tsv.json").write_text(json.dumps(as_written(side, tmp_path / "b.tsv.json")))
    capsys.readouterr()
    assert run_main(analyze.main, argv[:-1] + [tmp_path / "cmp2"]) == 2
    err = capsys.readouterr().err
    assert "other images" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "cmp2").exists()


def test_a_log_whose_name_is_not_utf8_is_analysed_and_its_label_shows_the_byte(tmp_path):
    """A file name with a byte that is not UTF-8 becomes a label: tables, the terminal and figures show it
    as \\xff (it was a UnicodeEncodeError in the .md and a TypeError in matplotlib)."""
    log = tmp_path / os.fsdecode(b"m\xff_noise_0.25.tsv")
    log.write_text("idx\tlabel\tpredict\tradius\tcorrect\ttime\tnA\tN\n0\t0\t0\t0.5\t1\t0:00:01\t90\t100\n"
                   "1\t1\t1\t0.2\t1\t0:00:01\t70\t100\n")
    import analyze
    from helpers import run_main
    done = subprocess.run([sys.executable, os.path.join(ROOT, "analyze.py"), "table", str(log), "--out",
                           str(tmp_path / "table")], capture_output=True, timeout=300)   # the terminal too
    assert done.returncode == 0 and b"Traceback" not in done.stderr and b"m\\xff" in done.stdout, done.stderr
    assert run_main(analyze.main, ["ecdf", log, "--out", tmp_path / "ecdf"]) == 0
    for command, figure in (("table", "certified_accuracy.png"), ("ecdf", "ecdf.png")):
        assert b"m\\xff" in (tmp_path / command / f"{command}.md").read_bytes()
        assert (tmp_path / command / figure).exists()


# ---- what the math libraries ran: read from them, recorded in every sidecar -----------------------------------

@pytest.mark.parametrize("pin, expected", [("AVX2", "Intel AVX2"), (None, None)])
def test_the_record_says_which_instruction_set_onednn_ran(pin, expected):
    if not torch.backends.mkldnn.is_available() or "avx2" not in open("/proc/cpuinfo").read().split():
        pytest.skip("no oneDNN or no AVX2")
    env = {k: v for k, v in os.environ.items() if k not in machinery.ISA_PINS}
    if pin:
        env["ONEDNN_MAX_CPU_ISA"] = pin
    code = ("import json, machinery; e = machinery.environment()['cpu']; "
            "print(json.dumps([e['onednn_isa'], e['isa_pins']]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    isa, pins = json.loads(done.stdout.strip().splitlines()[-1])
    assert isa and isa.startswith("Intel ") and (expected is None or isa == expected)
    assert pins == ({"ONEDNN_MAX_CPU_ISA": pin} if pin else {})
    assert done.stdout.count("onednn_verbose") == 0          # the library's own lines are caught, not printed


def test_the_record_of_the_math_libraries_survives_a_closed_stdout_and_an_old_sidecar():
    code = "import os, machinery; os.close(1); import sys; machinery.environment(); sys.stderr.write('ok')"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr.endswith("ok"), done.stderr
    old = {"python": "3.11", "cpu": {"model": "x", "torch_capability": "AVX2"}}   # written before the fields existed
    assert "(torch: AVX2, oneDNN: ?, OpenBLAS: ?)" in machinery.environment_line(old)

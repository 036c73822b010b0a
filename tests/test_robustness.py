"""The README's promises under hostile use: nothing lost, nothing clobbered, one line and exit code 2.

Each test is one observed failure: Windows line endings, two writers, an output that is an input, a resume
with other settings, non-finite values, a kill between two writes, stale temporaries, disk full, a model
that does not fit the data, bad target files, live workers of an earlier run, and the noisy evaluation's
dependence on the loader's workers."""
import errno
import os
import shutil
import subprocess
import sys

import pytest
import torch

import analyze
import certify
import common
import machinery
import train_baselines
import train_gaussian

DIGITS = ["--dataset", "digits", "--sigma", 0.25, "--workers", 0]
CLI = ["--N0", 20, "--N", 100, "--batch", 500]


def run(module, argv, monkeypatch, capsys=None):
    """module's command line in this process: (exit code, stderr or None)."""
    monkeypatch.setattr(sys, "argv", [module.__name__ + ".py", *map(str, argv)])
    main = (lambda: certify.main([str(a) for a in argv])) if module is certify else \
        (lambda: analyze.main([str(a) for a in argv])) if module is analyze else module.main
    try:
        machinery.run(main)
        code = 0
    except SystemExit as e:
        code = e.code
    return code, (capsys.readouterr().err if capsys else None)


def one_line(err):
    return len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A digits checkpoint of ours (one short epoch)."""
    out = tmp_path_factory.mktemp("run")
    mp = pytest.MonkeyPatch()
    try:
        assert run(train_gaussian, [*DIGITS, "--epochs", 1, "--max-batches", 2, "--outdir", out], mp)[0] == 0
    finally:
        mp.undo()
    return str(out / "checkpoint.pth.tar")


def certified(ckpt, out, monkeypatch, capsys, *extra):
    return run(certify, ["--checkpoint", ckpt, "--outfile", out, "--max", 6, *CLI, *extra], monkeypatch, capsys)


# 1. CR LF ------------------------------------------------------------------------------------------------

def test_a_log_with_windows_line_endings_is_refused_and_left_untouched(ckpt, tmp_path, monkeypatch, capsys):
    out = tmp_path / "c.tsv"
    assert certified(ckpt, out, monkeypatch, capsys)[0] == 0
    crlf = out.read_bytes().replace(b"\n", b"\r\n")
    out.write_bytes(crlf)
    code, err = run(certify, ["--checkpoint", ckpt, "--outfile", out, "--max", 8, *CLI], monkeypatch, capsys)
    assert code == 2 and one_line(err) and "CR LF" in err
    assert out.read_bytes() == crlf                               # never truncated into data


# 2. two writers ------------------------------------------------------------------------------------------

def test_a_second_certify_on_the_same_outfile_is_refused(ckpt, tmp_path, monkeypatch, capsys):
    out = tmp_path / "c.tsv"
    assert certified(ckpt, out, monkeypatch, capsys)[0] == 0
    before = out.read_bytes()
    with machinery.exclusive_lock(str(out) + ".lock", "test"):      # another run holds it
        code, err = certified(ckpt, out, monkeypatch, capsys, "--max", 8)
    assert code == 2 and one_line(err) and "in use by another run" in err and out.read_bytes() == before
    assert certified(ckpt, out, monkeypatch, capsys, "--max", 8)[0] == 0   # free again once that run ends


def test_a_second_training_run_on_the_same_folder_is_refused(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    out.mkdir()
    with machinery.folder_lock(str(out), "test"):
        code, err = run(train_gaussian, [*DIGITS, "--epochs", 1, "--max-batches", 1, "--outdir", out],
                        monkeypatch, capsys)
    assert code == 2 and one_line(err) and "in use by another run" in err
    assert not (out / "checkpoint.pth.tar").exists() and not (out / "log.tsv").exists()


def test_analyze_refuses_a_log_with_an_example_twice(tmp_path, monkeypatch, capsys):
    log = tmp_path / "x_sigma0.5.tsv"
    log.write_text("idx\tlabel\tpredict\tradius\tcorrect\ttime\n0\t1\t1\t0.5\t1\t0:00:01\n"
                   "1\t2\t2\t0.4\t1\t0:00:01\n0\t1\t1\t0.5\t1\t0:00:01\n")
    code, err = run(analyze, ["table", log], monkeypatch, capsys)
    assert code == 2 and one_line(err) and "idx 0 again" in err


# 4. an output that is an input ---------------------------------------------------------------------------

def test_no_command_writes_over_its_own_input(ckpt, tmp_path, monkeypatch, capsys):
    victim = tmp_path / "v.pth.tar"
    shutil.copy(ckpt, victim)
    before = victim.read_bytes()
    for extra in ([], ["--overwrite"]):
        code, err = run(certify, ["--checkpoint", victim, "--outfile", victim, *CLI, *extra], monkeypatch, capsys)
        assert code == 2 and one_line(err) and victim.read_bytes() == before
    other = tmp_path / "notes.txt"                                # --overwrite replaces only our own logs
    other.write_text("my notes\n")
    code, err = run(certify, ["--checkpoint", ckpt, "--outfile", other, *CLI, "--overwrite"], monkeypatch, capsys)
    assert code == 2 and "not written by this project" in err and other.read_text() == "my notes\n"
    for out in (victim, victim.parent / "link.pth.tar"):   # the input, by its name or through a link
        if out != victim:
            os.symlink(victim, out)
        code, err = run(train_baselines, ["--make-catrs-target", "--checkpoint", victim, "--out", out, "--N", 2],
                        monkeypatch, capsys)
        assert code == 2 and one_line(err)
    assert victim.read_bytes() == before and other.read_text() == "my notes\n"


# 5. resume with other settings ---------------------------------------------------------------------------

@pytest.mark.parametrize("change", [["--lr", 0.05], ["--m", 2], ["--seed", 3], ["--batch", 128]])
def test_a_resume_with_other_settings_is_refused_naming_them(change, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    argv = [*DIGITS, "--max-batches", 1, "--outdir", out]
    assert run(train_gaussian, [*argv, "--epochs", 1], monkeypatch)[0] == 0
    before = (out / "checkpoint.pth.tar").read_bytes(), (out / "args.json").read_text()
    code, err = run(train_gaussian, [*argv, "--epochs", 2, "--resume", *change], monkeypatch, capsys)
    assert code == 2 and one_line(err) and change[0][2:] in err
    assert ((out / "checkpoint.pth.tar").read_bytes(), (out / "args.json").read_text()) == before
    assert run(train_gaussian, [*argv, "--epochs", 2, "--resume"], monkeypatch)[0] == 0   # more epochs: fine


# 6. non-finite values ------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["--lr", "nan"], ["--weight_decay", "nan"], ["--sigma", "inf"], ["--lr", -0.1],
                                  ["--momentum", -0.9], ["--seed", -1], ["--lr", 0]])
def test_non_finite_or_negative_training_settings_are_refused(argv, tmp_path, monkeypatch, capsys):
    code, err = run(train_gaussian, [*DIGITS, "--epochs", 1, *argv, "--outdir", tmp_path / "o"], monkeypatch, capsys)
    assert code == 2 and one_line(err) and argv[0] in err and not (tmp_path / "o").exists()


def test_certify_refuses_an_infinite_sigma_and_non_finite_weights(ckpt, tmp_path, monkeypatch, capsys):
    code, err = certified(ckpt, tmp_path / "a.tsv", monkeypatch, capsys, "--sigma", "inf")
    assert code == 2 and one_line(err) and "--sigma" in err
    bad = torch.load(ckpt, weights_only=True)
    bad["state_dict"]["1.fc2.bias"][0] = float("nan")
    torch.save(bad, tmp_path / "nan.pth.tar")
    code, err = certified(str(tmp_path / "nan.pth.tar"), tmp_path / "b.tsv", monkeypatch, capsys)
    assert code == 2 and one_line(err) and "non-finite" in err and not (tmp_path / "b.tsv").exists()


def test_a_diverging_run_stops_in_one_line_before_saving(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    code, err = run(train_gaussian, [*DIGITS, "--epochs", 2, "--lr", 1e30, "--max-batches", 3, "--outdir", out],
                    monkeypatch, capsys)
    assert code == 2 and one_line(err) and "diverged" in err
    assert not (out / "checkpoint.pth.tar").exists()              # no non-finite weights written


# 7. a kill between two writes, stale temporaries, disk full ----------------------------------------------

def test_a_kill_between_the_log_row_and_the_checkpoint_loses_no_row(tmp_path, monkeypatch):
    argv = [*DIGITS, "--epochs", 3, "--max-batches", 2]
    assert run(train_gaussian, [*argv, "--outdir", tmp_path / "whole"], monkeypatch)[0] == 0
    save = machinery.save_training_checkpoint
    calls = []

    def killed_at_epoch_2(outdir, model, optimizer, scheduler, epoch, *a, **k):
        calls.append(epoch)
        if epoch == 2:
            raise KeyboardInterrupt                                # a kill after the row, before the checkpoint
        return save(outdir, model, optimizer, scheduler, epoch, *a, **k)
    monkeypatch.setattr(machinery, "save_training_checkpoint", killed_at_epoch_2)
    assert run(train_gaussian, [*argv, "--outdir", tmp_path / "parts"], monkeypatch)[0] == 130
    monkeypatch.setattr(machinery, "save_training_checkpoint", save)
    assert run(train_gaussian, [*argv, "--outdir", tmp_path / "parts", "--resume"], monkeypatch)[0] == 0
    rows = {name: [ln.split("\t") for ln in open(tmp_path / name / "log.tsv").read().splitlines()[1:]]
            for name in ("whole", "parts")}
    without_time = lambda table: [r[:1] + r[2:] for r in table]   # noqa: E731
    assert without_time(rows["parts"]) == without_time(rows["whole"])   # each epoch once, the same numbers


def test_stale_temporaries_are_kept_and_a_full_disk_is_one_line(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    argv = [*DIGITS, "--max-batches", 1, "--outdir", out]
    assert run(train_gaussian, [*argv, "--epochs", 1], monkeypatch)[0] == 0
    # a file named like the temporary of a writer killed mid-save (<name>.tmp<pid>, that process gone) may be a
    # user's: no write removes it, and it blocks none
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / f"checkpoint.pth.tar.tmp{dead.pid}").write_bytes(b"x" * 1000)
    (out / f"notes.tmp{dead.pid}").write_bytes(b"a user's file")
    before = (out / "checkpoint.pth.tar").read_bytes()

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", no_space)
    code, err = run(train_gaussian, [*argv, "--epochs", 2, "--resume"], monkeypatch, capsys)
    assert code == 2 and one_line(err) and "No space left" in err
    assert (out / "checkpoint.pth.tar").read_bytes() == before    # the last good checkpoint stays
    assert sorted(p.name for p in out.iterdir() if ".tmp" in p.name) == sorted(
        [f"checkpoint.pth.tar.tmp{dead.pid}", f"notes.tmp{dead.pid}"])
    assert (out / f"checkpoint.pth.tar.tmp{dead.pid}").read_bytes() == b"x" * 1000
    monkeypatch.undo()
    assert run(train_gaussian, [*argv, "--epochs", 2, "--resume"], monkeypatch)[0] == 0   # it blocks no write
    assert (out / f"checkpoint.pth.tar.tmp{dead.pid}").read_bytes() == b"x" * 1000


# 8. checks before anything is written ---------------------------------------------------------------------

def test_a_model_that_cannot_take_the_data_is_refused_before_writing(tmp_path, monkeypatch, capsys):
    cifar = tmp_path / "cifar.pth.tar"
    torch.save({"arch": "cifar_resnet20", "sigma": 0.25,
                "state_dict": common.get_architecture("cifar_resnet20", "cifar10").state_dict()}, cifar)
    out = tmp_path / "c.tsv"
    code, err = run(certify, ["--checkpoint", cifar, "--dataset", "digits", "--outfile", out, *CLI],
                    monkeypatch, capsys)
    assert code == 2 and one_line(err) and "digits" in err and not out.exists()
    torch.save({"arch": "lenet", "state_dict": [1, 2]}, tmp_path / "list.pth.tar")
    code, err = run(certify, ["--checkpoint", tmp_path / "list.pth.tar", "--outfile", out, *CLI], monkeypatch, capsys)
    assert code == 2 and one_line(err) and "not a dict" in err and not out.exists()


@pytest.mark.parametrize("target", [{"counts": [[1, 2]], "N": 3, "dataset": "digits"},
                                    {"counts": torch.zeros(1437, 10, dtype=torch.long), "N": 0, "dataset": "digits"}])
def test_a_bad_catrs_target_is_one_line(target, tmp_path, monkeypatch, capsys):
    torch.save(target, tmp_path / "t.pt")
    code, err = run(train_baselines, ["--method", "catrs", *DIGITS, "--epochs", 1, "--catrs-target", tmp_path / "t.pt",
                                      "--outdir", tmp_path / "o"], monkeypatch, capsys)
    assert code == 2 and one_line(err) and "catrs-target" in err


# 9. live workers of an earlier run ------------------------------------------------------------------------

def test_a_rank_file_still_written_by_a_live_worker_is_refused(ckpt, tmp_path, monkeypatch, capsys):
    out = tmp_path / "c.tsv"
    assert certified(ckpt, out, monkeypatch, capsys, "--max", 2)[0] == 0    # an earlier run, with its sidecar
    part = tmp_path / "c.tsv.rank1"
    part.write_text("\t".join(certify.CERTIFY_COLUMNS) + "\n")
    from helpers import as_recorded
    as_recorded(str(out) + ".json")    # the part of an earlier torchrun, which its sidecar lists
    with machinery.exclusive_lock(str(part) + ".lock", "worker"):    # a worker of a killed torchrun, still alive
        code, err = certified(ckpt, out, monkeypatch, capsys)
    assert code == 2 and one_line(err) and "earlier run" in err


# 10. the noisy evaluation does not depend on the workers ---------------------------------------------------

def test_noisy_evaluation_of_a_resumed_run_with_workers_equals_the_uninterrupted_one(tmp_path, monkeypatch):
    argv = ["--dataset", "digits", "--sigma", 0.25, "--workers", 2, "--max-batches", 2]
    assert run(train_gaussian, [*argv, "--epochs", 2, "--outdir", tmp_path / "whole"], monkeypatch)[0] == 0
    assert run(train_gaussian, [*argv, "--epochs", 1, "--outdir", tmp_path / "parts"], monkeypatch)[0] == 0
    assert run(train_gaussian, [*argv, "--epochs", 2, "--outdir", tmp_path / "parts", "--resume"], monkeypatch)[0] == 0
    logs = [open(tmp_path / name / "log.tsv").read().splitlines() for name in ("whole", "parts")]
    cols = logs[0][0].split("\t")
    pick = [cols.index(c) for c in ("train_loss", "test_loss", "test_acc_noisy")]
    assert [[ln.split("\t")[i] for i in pick] for ln in logs[0][1:]] == \
           [[ln.split("\t")[i] for i in pick] for ln in logs[1][1:]]

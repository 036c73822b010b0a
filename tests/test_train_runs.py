"""End-to-end tests of train_gaussian.py and train_ours.py on the bundled digits: learning, records, resume,
gradient-norm mode, bad input. CPU, short runs in-process (one subprocess checks the real exit path)."""
import json
import shutil
import os
import subprocess
import sys

import pytest
import torch

import machinery
import readers
import train_gaussian
import train_ours
from helpers import as_written

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_main(module, monkeypatch, *argv):
    """Run module.main() as `python module.py argv` would (through machinery.run); returns the exit code."""
    monkeypatch.setattr(sys, "argv", [module.__name__ + ".py", *map(str, argv)])
    try:
        machinery.run(module.main)
    except SystemExit as e:
        return e.code
    return 0


def read_log(outdir):
    lines = open(os.path.join(outdir, "log.tsv")).read().splitlines()
    header = lines[0].split("\t")
    return [dict(zip(header, ln.split("\t"))) for ln in lines[1:]]


DIGITS = ("--dataset", "digits", "--sigma", 0.25, "--workers", 0)
OURS_ALL_ON = (*DIGITS, "--epochs", 5, "--Et", 2, "--reweight_every", 2, "--T", 2, "--N", 30)


def test_gaussian_training_lowers_the_loss_and_beats_chance_under_noise(monkeypatch, tmp_path, capsys):
    out = tmp_path / "gauss"
    assert run_main(train_gaussian, monkeypatch, *DIGITS, "--epochs", 3, "--outdir", out) == 0
    log = read_log(out)
    assert [int(r["epoch"]) for r in log] == [0, 1, 2]
    assert float(log[-1]["train_loss"]) < float(log[0]["train_loss"])
    assert float(log[-1]["test_acc_noisy"]) > 0.5                    # 10 classes: chance is 0.1
    assert json.load(open(out / "args.json"))["m"] == 4
    model, ckpt = readers.load_model(str(out / "checkpoint.pth.tar"))  # what certify.py loads
    assert ckpt["epoch"] == 3 and ckpt["sigma"] == 0.25 and ckpt["arch"] == "digits_cnn"
    assert "ETA" in capsys.readouterr().out


def test_ours_with_all_parts_on_learns_and_records_its_estimates(monkeypatch, tmp_path):
    out = tmp_path / "ours"
    assert run_main(train_ours, monkeypatch, *OURS_ALL_ON, "--outdir", out) == 0
    log = read_log(out)
    assert float(log[-1]["train_loss"]) < float(log[0]["train_loss"])
    assert float(log[-1]["test_acc_noisy"]) > 0.4
    discard = json.load(open(out / "discard.json"))
    assert discard["epoch"] == 2 and 0 < discard["kept"] < discard["total"] == int(log[0]["kept"])
    assert all(int(r["kept"]) == discard["kept"] for r in log[2:])
    for name in ("pA_epoch2_discard.tsv", "pA_epoch2_weights.tsv", "pA_epoch4_weights.tsv"):
        assert open(out / name).readline() == "idx\tlabel\tcount\tn\n"
    assert len(open(out / "pA_epoch4_weights.tsv").readlines()) == discard["kept"] + 1  # kept examples only
    ckpt = readers.load_checkpoint(str(out / "checkpoint.pth.tar"))
    assert len(ckpt["extra"]["kept"]) == discard["kept"] and len(ckpt["extra"]["weights"]) == discard["kept"]
    readers.load_model(str(out / "checkpoint.pth.tar"))


def test_the_paper_settings_follow_sigma_and_flags_override():
    s = train_ours.settings(parse(train_ours, "--sigma", 0.5, "--Et", 70, "--pt", 0.4), 0.5, "cifar10")
    assert (s.m, s.Et, s.pt, s.T, s.eps, s.reweight, s.N, s.epochs, s.lr_step) == (4, 70, 0.4, 6, 0.25, True, 100, 150, 50)
    s = train_ours.settings(parse(train_ours, "--sigma", 1.0, "--T", 0), 1.0, "cifar10")
    assert (s.T, s.eps, s.Et, s.pt, s.arch) == (0, 0.5, 60, 0.4, "cifar_resnet110")
    s = train_ours.settings(parse(train_ours, "--sigma", 1.0, "--dataset", "imagenet", "--pA-checkpoint", __file__),
                            1.0, "imagenet")
    assert (s.m, s.Et, s.pt, s.T, s.eps, s.reweight, s.N, s.epochs, s.lr_step) == (2, 0, 0.1, 1, 2.0, False, 50, 90, 30)


def parse(module, *argv):
    old = sys.argv
    sys.argv = ["x", *map(str, argv)]
    try:
        return module.parse_args()
    finally:
        sys.argv = old


@pytest.mark.parametrize("module, argv", [
    (train_gaussian, (*DIGITS, "--epochs", 3)),
    (train_ours, (*DIGITS, "--epochs", 3, "--Et", 1, "--reweight_every", 2, "--T", 2, "--N", 20,
                  "--max-batches", 2)),
    (train_gaussian, (*DIGITS, "--epochs", 3, "--lr_milestones", 1, 2, "--max-batches", 2)),
])
def test_a_resumed_run_ends_with_the_same_weights_as_an_uninterrupted_one(module, argv, monkeypatch, tmp_path):
    epochs = int(argv[argv.index("--epochs") + 1])
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert run_main(module, monkeypatch, *argv, "--outdir", whole) == 0
    # stop one epoch early (after the discard and the reweighting at epoch 1, which the resumed run must restore)
    stop_at = [a if a != epochs else epochs - 1 for a in argv]
    assert run_main(module, monkeypatch, *stop_at, "--outdir", parts) == 0
    assert run_main(module, monkeypatch, *argv, "--outdir", parts, "--resume") == 0
    a = readers.load_checkpoint(str(whole / "checkpoint.pth.tar"))
    b = readers.load_checkpoint(str(parts / "checkpoint.pth.tar"))
    assert a["epoch"] == b["epoch"] == epochs
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    assert [r["epoch"] for r in read_log(parts)] == [str(e) for e in range(epochs)]
    assert [r["train_loss"] for r in read_log(parts)] == [r["train_loss"] for r in read_log(whole)]


def test_a_new_run_refuses_a_folder_that_holds_a_run(monkeypatch, tmp_path, capsys):
    argv = (*DIGITS, "--epochs", 1, "--max-batches", 1, "--outdir", tmp_path)
    assert run_main(train_gaussian, monkeypatch, *argv) == 0
    before = open(tmp_path / "checkpoint.pth.tar", "rb").read()
    capsys.readouterr()
    assert run_main(train_gaussian, monkeypatch, *argv) == 2
    assert "--resume" in capsys.readouterr().err
    assert open(tmp_path / "checkpoint.pth.tar", "rb").read() == before


def test_gradnorm_mode_writes_norms_with_and_without_the_attack(monkeypatch, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_main(train_gaussian, monkeypatch, *DIGITS, "--epochs", 2, "--outdir", out) == 0
    ckpt = out / "checkpoint.pth.tar"
    assert run_main(train_gaussian, monkeypatch, "--gradnorm", ckpt, "--probe", 8, "--N", 20) == 0
    assert run_main(train_ours, monkeypatch, "--gradnorm", ckpt, "--probe", 8, "--N", 20, "--T", 3) == 0
    tables = {}
    for name in ("gradnorm_gaussian", "gradnorm_ours_attack", "gradnorm_ours_noattack"):
        lines = open(out / f"{name}.tsv").read().splitlines()
        assert lines[0] == "idx\tlabel\tpA\tgrad_norm" and len(lines) == 9
        tables[name] = [ln.split("\t") for ln in lines[1:]]
    attack, plain = tables["gradnorm_ours_attack"], tables["gradnorm_ours_noattack"]
    assert [r[:3] for r in attack] == [r[:3] for r in plain]   # same probes, same pA
    assert any(a[3] != p[3] for a, p in zip(attack, plain))    # the attack changes the loss
    # Table 2's ACR column pairs each file with the log of its model: the record names the checkpoint
    import analyze
    import certify
    from helpers import run_main as run_entry
    log = tmp_path / "cert.tsv"
    assert run_entry(certify.main, ["--checkpoint", ckpt, "--outfile", log, "--max", 3, "--N0", 10, "--N", 40]) == 0
    argv = ["gradnorm", out / "gradnorm_gaussian.tsv", "--acr", log, "--replicates", 100]
    assert run_entry(analyze.main, argv) == 0
    side = json.loads(open(f"{log}.json").read())
    side["checkpoint_sha256"] = "0" * 64   # a log of another model
    open(f"{log}.json", "w").write(json.dumps(as_written(side, f"{log}.json")))
    capsys.readouterr()
    assert run_entry(analyze.main, argv) == 2 and "another checkpoint" in capsys.readouterr().err


BAD_INPUTS = [
    (train_gaussian, ("--dataset", "mnist", "--sigma", 0.5)),
    (train_gaussian, ("--dataset", "digits", "--arch", "vgg", "--sigma", 0.5)),
    (train_gaussian, ("--dataset", "digits", "--sigma", 0)),
    (train_gaussian, ("--dataset", "digits", "--sigma", 0.5, "--m", 0)),
    (train_gaussian, ("--dataset", "digits")),
    (train_ours, ("--dataset", "imagenet2", "--sigma", 0.5)),
    (train_ours, ("--dataset", "digits", "--arch", "resnet18", "--sigma", 0.5)),
    (train_ours, ("--dataset", "digits", "--sigma", -1)),
    (train_ours, ("--dataset", "digits", "--sigma", 0.5, "--m", 0)),
    (train_ours, ("--dataset", "digits", "--sigma", 0.5, "--pt", 1.5)),
    (train_ours, ("--dataset", "digits", "--sigma", 0.5, "--pt", -0.1)),
    (train_ours, ("--dataset", "digits", "--sigma", 0.5, "--T", -1)),
    (train_ours, ("--dataset", "digits", "--sigma", 0.5, "--T", 2, "--eps", 0)),
    (train_ours, ("--dataset", "digits", "--sigma", 0.5, "--eps", -0.5)),
]


@pytest.mark.parametrize("module, argv", BAD_INPUTS, ids=lambda v: " ".join(map(str, v)) if isinstance(v, tuple) else "")
def test_bad_input_is_one_line_and_exit_code_2(module, argv, monkeypatch, tmp_path, capsys):
    assert run_main(module, monkeypatch, *argv, "--workers", 0, "--outdir", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()   # nothing written before the input was checked


@pytest.mark.parametrize("module", [train_gaussian, train_ours])
def test_resume_without_a_checkpoint_and_an_unwritable_outdir_are_one_line_exit_2(module, monkeypatch, tmp_path, capsys):
    assert run_main(module, monkeypatch, *DIGITS, "--outdir", tmp_path / "empty", "--resume") == 2
    assert "no checkpoint" in capsys.readouterr().err
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert run_main(module, monkeypatch, *DIGITS, "--outdir", blocker / "run") == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "cannot write" in err


@pytest.mark.parametrize("module", [train_gaussian, train_ours])
def test_a_new_run_never_replaces_a_users_args_json_but_restarts_its_own(module, monkeypatch, tmp_path, capsys):
    """A run folder without a checkpoint may hold args.json: the user's own file is refused in one line and kept;
    the settings of a run of ours that stopped before its first checkpoint are replaced by the new run's."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "args.json").write_text('{"mine": "my own notes"}\n')
    assert run_main(module, monkeypatch, *DIGITS, "--epochs", 1, "--max-batches", 1, "--outdir", out) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "args.json" in err and "Traceback" not in err
    assert (out / "args.json").read_text() == '{"mine": "my own notes"}\n' and not (out / "log.tsv").exists()
    (out / "args.json").write_text(json.dumps({"outdir": str(out), "seed": 0, "environment": {}}))
    assert run_main(module, monkeypatch, *DIGITS, "--epochs", 1, "--max-batches", 1, "--outdir", out) == 0
    assert json.loads((out / "args.json").read_text())["epochs"] == 1


def test_eps_zero_is_fine_with_the_attack_off(monkeypatch, tmp_path):
    argv = (*DIGITS, "--epochs", 1, "--max-batches", 1, "--T", 0, "--eps", 0, "--outdir", tmp_path)
    assert run_main(train_ours, monkeypatch, *argv) == 0


def test_bad_input_exits_2_with_one_line_from_the_command_line(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_ours.py"), "--dataset", "digits",
                           "--sigma", "0.5", "--pt", "2", "--outdir", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "--pt" in proc.stderr


def test_lr_milestones_decay_the_lr_at_those_epochs_in_every_training_script(monkeypatch, tmp_path):
    argv = (*DIGITS, "--epochs", 4, "--max-batches", 1, "--lr", 0.1, "--lr_milestones", 1, 3)
    assert run_main(train_gaussian, monkeypatch, *argv, "--outdir", tmp_path / "g") == 0
    assert run_main(train_ours, monkeypatch, *argv, "--T", 0, "--outdir", tmp_path / "o") == 0
    for run in ("g", "o"):
        lrs = [float(r["lr"]) for r in read_log(tmp_path / run)]
        assert lrs == pytest.approx([0.1, 0.01, 0.01, 0.001])
    assert run_main(train_gaussian, monkeypatch, *DIGITS, "--lr_milestones", 0, "--outdir", tmp_path / "x") == 2


def test_a_sigma_between_the_presets_says_which_row_it_borrows(capsys):
    s = train_ours.settings(parse(train_ours, "--sigma", 0.75, "--T", 2), 0.75, "cifar10")
    err = capsys.readouterr().err
    assert (s.Et, s.pt, s.T) == (70, 0.4, 2)          # 0.75 ties between rows 0.5 and 1.0: the first wins
    assert len(err.strip().splitlines()) == 1 and "sigma 0.5 row" in err and "Table 6" in err
    assert ": m, Et, pt, eps from" in err              # --T was given: not borrowed
    train_ours.settings(parse(train_ours, "--sigma", 0.5), 0.5, "cifar10")
    assert capsys.readouterr().err == ""              # a sigma of the table borrows nothing


def test_a_run_records_its_pA_checkpoint_and_refuses_another_on_resume(monkeypatch, tmp_path):
    from helpers import digits_checkpoint
    ck, other = str(tmp_path / "pa.pth.tar"), str(tmp_path / "other.pth.tar")
    digits_checkpoint(ck, steps=5)
    digits_checkpoint(other, steps=5, seed=1)
    argv = (*DIGITS, "--Et", 1, "--T", 0, "--no-reweight", "--max-batches", 1, "--N", 10, "--pA-checkpoint", ck,
            "--outdir", tmp_path / "run")
    assert run_main(train_ours, monkeypatch, *argv, "--epochs", 1) == 0
    assert json.load(open(tmp_path / "run" / "args.json"))["pA_checkpoint_sha256"] == machinery.file_sha256(ck)
    shutil.copy(other, ck)   # another model at the same path: its pA would discard other images
    assert run_main(train_ours, monkeypatch, *argv, "--epochs", 2, "--resume") == 2

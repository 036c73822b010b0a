"""Checkpoints cannot run code: every command that reads a checkpoint or a target file refuses a pickle that
would need arbitrary unpickling (exit code 2, one line naming --trust-checkpoint), and nothing it holds runs.
The released checkpoint formats (Cohen et al. and successors: tensors, plain values, optimizer state) and our
own load without the flag."""
import os
import pathlib
import sys

import pytest
import torch

import bench
import certify
import common
import machinery
import readers
import train_baselines
import train_gaussian
import train_ours

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import ddrs_class_check  # noqa: E402


class Payload:
    """Unpickling this creates a file: a harmless stand-in for the code a hostile checkpoint could run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def digits_state_dict(arch="digits_cnn"):
    torch.manual_seed(0)
    return common.get_architecture(arch, "digits").state_dict()


@pytest.fixture
def hostile(tmp_path):
    """(path of a checkpoint that would create `marker` when unpickled, marker)."""
    marker = tmp_path / "code_ran"
    path = tmp_path / "hostile.pth.tar"
    torch.save({"arch": "digits_cnn", "dataset": "digits", "sigma": 0.25, "state_dict": digits_state_dict(),
                "extra": Payload(str(marker))}, path)
    return str(path), marker


def run_main(module, argv, monkeypatch):
    """module.main as its command line runs it (through machinery.run); returns the exit code."""
    monkeypatch.setattr(sys, "argv", [module.__name__ + ".py", *map(str, argv)])
    try:
        machinery.run(module.main if module is not certify else lambda: certify.main([str(a) for a in argv]))
    except SystemExit as e:
        return e.code
    return 0


DIGITS = ["--dataset", "digits", "--sigma", 0.25, "--workers", 0, "--epochs", 1, "--max-batches", 1]


def commands(path, tmp_path):
    """Every way a command reads a checkpoint or a target file, given the hostile file `path`."""
    resume_dir = tmp_path / "resume"
    resume_dir.mkdir()
    os.link(path, resume_dir / "checkpoint.pth.tar")
    out = tmp_path / "out"
    return [
        (certify, ["--checkpoint", path, "--N0", 10, "--N", 20, "--max", 1, "--outfile", tmp_path / "c.tsv"]),
        (train_gaussian, [*DIGITS, "--outdir", resume_dir, "--resume"]),
        (train_gaussian, ["--gradnorm", path, "--probe", 2, "--N", 4, "--outdir", out]),
        (train_ours, ["--gradnorm", path, "--probe", 2, "--outdir", out]),
        (train_ours, [*DIGITS, "--Et", 0, "--pA-checkpoint", path, "--outdir", tmp_path / "ours"]),
        (train_ours, [*DIGITS, "--outdir", resume_dir, "--resume"]),
        (train_baselines, ["--method", "consistency", "--gradnorm", path, "--probe", 2, "--outdir", out]),
        (train_baselines, ["--method", "consistency", *DIGITS, "--outdir", resume_dir, "--resume"]),
        (train_baselines, ["--make-catrs-target", "--dataset", "digits", "--checkpoint", path, "--N", 2,
                           "--out", tmp_path / "target.pt"]),
        (train_baselines, ["--method", "catrs", *DIGITS, "--catrs-target", path, "--outdir", tmp_path / "catrs"]),
        (bench, ["--quick", "--sections", "d", "--checkpoint", path, "--device", "cpu"]),
        (ddrs_class_check, ["--checkpoint", path, "--out", tmp_path / "check.md"]),
    ]


def test_every_command_refuses_a_checkpoint_that_would_run_code(hostile, tmp_path, monkeypatch, capsys):
    path, marker = hostile
    for module, argv in commands(path, tmp_path):
        assert run_main(module, argv, monkeypatch) == 2, (module.__name__, argv)
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "--trust-checkpoint" in err, (module.__name__, err)
        assert not marker.exists(), module.__name__          # nothing the file holds ran


def test_trust_checkpoint_loads_it_and_so_runs_its_code(hostile, tmp_path, monkeypatch):
    path, marker = hostile   # the control: the payload is real, and the flag is what lets it run
    argv = ["--checkpoint", path, "--N0", 10, "--N", 20, "--max", 1, "--outfile", tmp_path / "c.tsv",
            "--trust-checkpoint"]
    assert run_main(certify, argv, monkeypatch) == 0 and marker.exists()


def test_released_formats_and_ours_load_without_the_flag(tmp_path, monkeypatch):
    # Cohen et al.'s layout: DataParallel prefixes, an optimizer state, an epoch and an arch string
    model = common.get_architecture("cifar_resnet20", "cifar10")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.rand(2, 3, 32, 32)).sum().backward()
    opt.step()
    state = {f"1.module.{k[2:]}" if k.startswith("1.") else k: v for k, v in model.state_dict().items()}
    path = tmp_path / "cohen.pth.tar"
    torch.save({"epoch": 90, "arch": "cifar_resnet20", "state_dict": state, "optimizer": opt.state_dict()}, path)
    loaded, ckpt = readers.load_model(str(path))
    assert ckpt["epoch"] == 90 and all(torch.equal(a, b) for a, b in
                                       zip(loaded.state_dict().values(), model.state_dict().values()))
    # our own training checkpoint, RNG states included, loads and resumes without the flag
    out = tmp_path / "ours"
    argv = [*DIGITS, "--outdir", out]
    assert run_main(train_gaussian, argv, monkeypatch) == 0
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(out / "checkpoint.pth.tar")) == []
    argv[argv.index("--epochs") + 1] = 2
    assert run_main(train_gaussian, [*argv, "--resume"], monkeypatch) == 0


def test_a_checkpoint_holding_numpy_arrays_needs_the_flag(tmp_path):
    """Ours and the released ones hold tensors and plain values only: a numpy array asks the unpickler for
    numpy's classes, and an object array would run its items' code."""
    import numpy as np
    path = tmp_path / "np.pth.tar"
    torch.save({"arch": "digits_cnn", "dataset": "digits", "sigma": 0.25, "state_dict": digits_state_dict(),
                "rng": {"numpy": np.random.get_state(), "torch": torch.get_rng_state()}}, path)
    with pytest.raises(common.UserError, match="--trust-checkpoint"):
        readers.load_checkpoint(str(path))
    # an object array is not a plain array: refused like any other object
    torch.save({"state_dict": {}, "x": np.array([Payload(str(tmp_path / "m"))], dtype=object)}, path)
    with pytest.raises(common.UserError, match="--trust-checkpoint"):
        readers.load_checkpoint(str(path))
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("bad", ["complex", "integer", "nan", "inf"])
def test_a_weight_that_is_not_real_finite_floating_point_is_refused_naming_the_tensor(tmp_path, bad):
    """load_state_dict would cast an integer or complex tensor into the model silently; NaN or inf weights
    certify nothing. Integer buffers (num_batches_tracked) stay integers and load."""
    state = digits_state_dict()
    name = next(k for k, v in state.items() if v.is_floating_point())
    value = state[name]
    state[name] = {"complex": value.to(torch.complex64), "integer": value.round().to(torch.int64),
                   "nan": value.clone().fill_(float("nan")), "inf": value.clone().fill_(float("inf"))}[bad]
    path = tmp_path / "bad.pth.tar"
    torch.save({"arch": "digits_cnn", "dataset": "digits", "sigma": 0.25, "state_dict": state}, path)
    with pytest.raises(common.UserError, match=f"checkpoint .*{path.name}.*tensor '{name}'"):
        readers.load_model(str(path))
    good = tmp_path / "good.pth.tar"
    torch.save({"arch": "digits_cnn", "dataset": "digits", "sigma": 0.25, "state_dict": digits_state_dict()}, good)
    assert readers.load_model(str(good))[0] is not None

"""DistributedDataParallel under torchrun on CPU (gloo): two ranks train train_ours.py with every part on."""
import os

import pytest
import torch

import machinery
import readers
from torchrun_util import failure_report, run_torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOO = torch.distributed.is_available() and torch.distributed.is_gloo_available()


@pytest.mark.skipif(not GLOO, reason="torch.distributed with gloo is not available")
def test_two_ranks_under_torchrun_train_discard_reweight_attack_and_resume(tmp_path):
    out = tmp_path / "ddp"
    args = [os.path.join(ROOT, "train_ours.py"), "--dataset", "digits", "--sigma", "0.5", "--epochs", "1",
            "--Et", "0", "--pt", "0.1", "--T", "1", "--N", "10", "--max-batches", "2", "--workers", "0",
            "--device", "cpu", "--lr_milestones", "1", "--outdir", out]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = run_torchrun(args, tmp_path / "logs1", env=env)
    assert proc.returncode == 0, failure_report(proc, tmp_path / "logs1")
    assert proc.stdout.count("epoch 1/1") == 1                  # only rank 0 logs
    lines = open(out / "log.tsv").read().splitlines()
    assert len(lines) == 2 and os.path.isfile(out / "pA_epoch0_weights.tsv")
    model, ckpt = readers.load_model(str(out / "checkpoint.pth.tar"))   # a plain state_dict, no `module.`
    assert ckpt["epoch"] == 1 and not any(k.startswith("module.") for k in ckpt["state_dict"])
    assert len(ckpt["extra"]["kept"]) == int(lines[-1].split("\t")[-1])
    assert ckpt["scheduler"]["milestones"] == {1: 1}             # --lr_milestones reached the scheduler
    # resume for a second epoch under torchrun: it starts, runs and tears down cleanly as well
    args[args.index("--epochs") + 1] = "2"
    proc = run_torchrun(args + ["--resume"], tmp_path / "logs2", env=env)
    assert proc.returncode == 0, failure_report(proc, tmp_path / "logs2")
    lines = open(out / "log.tsv").read().splitlines()
    assert [ln.split("\t")[0] for ln in lines[1:]] == ["0", "1"]
    assert float(lines[2].split("\t")[2]) == pytest.approx(0.01)   # lr x0.1 from epoch 1 on


def test_sync_bn_on_the_cpu_is_refused_before_anything_is_written(tmp_path):
    """torch's SyncBatchNorm runs on GPUs only: --sync-bn on the CPU is one line and exit code 2, no folder made."""
    import subprocess
    import sys
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_gaussian.py"), "--dataset", "digits", "--sigma",
                           "0.5", "--device", "cpu", "--sync-bn", "--outdir", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--sync-bn" in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert not out.exists()

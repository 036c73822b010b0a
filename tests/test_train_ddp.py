"""DistributedDataParallel under torchrun on CPU (gloo): two ranks train train_ours.py with every part on."""
import os
import subprocess
import sys

import pytest
import torch

import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_two_ranks_under_torchrun_train_discard_reweight_and_attack(tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "train_ours.py"), "--dataset", "digits", "--sigma", "0.5", "--epochs", "1",
           "--Et", "0", "--pt", "0.1", "--T", "1", "--N", "10", "--max-batches", "2", "--workers", "0",
           "--device", "cpu", "--outdir", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("epoch 1/1") == 1                  # only rank 0 logs
    lines = open(out / "log.tsv").read().splitlines()
    assert len(lines) == 2 and os.path.isfile(out / "pA_epoch0_weights.tsv")
    model, ckpt = common.load_model(str(out / "checkpoint.pth.tar"))   # a plain state_dict, no `module.`
    assert ckpt["epoch"] == 1 and not any(k.startswith("module.") for k in ckpt["state_dict"])
    assert len(ckpt["extra"]["kept"]) == int(lines[-1].split("\t")[-1])

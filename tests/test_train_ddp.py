"""DistributedDataParallel under torchrun on CPU (gloo): two ranks train train_ours.py with every part on."""
import os

import pytest
import torch

import machinery
from torchrun_util import failure_report, run_torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOO = torch.distributed.is_available() and torch.distributed.is_gloo_available()


@pytest.mark.skipif(not GLOO, reason="torch.distributed with gloo is not available")
def test_two_ranks_under_torchrun_train_discard_reweight_attack_with_sync_bn_and_resume(tmp_path):
    out = tmp_path / "ddp"
    args = [os.path.join(ROOT, "train_ours.py"), "--dataset", "digits", "--sigma", "0.5", "--epochs", "1",
            "--Et", "0", "--pt", "0.1", "--T", "1", "--N", "10", "--max-batches", "2", "--workers", "0",
            "--device", "cpu", "--sync-bn", "--lr_milestones", "1", "--outdir", out]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = run_torchrun(args, tmp_path / "logs1", env=env)
    assert proc.returncode == 0, failure_report(proc, tmp_path / "logs1")
    assert proc.stdout.count("epoch 1/1") == 1                  # only rank 0 logs
    lines = open(out / "log.tsv").read().splitlines()
    assert len(lines) == 2 and os.path.isfile(out / "pA_epoch0_weights.tsv")
    model, ckpt = machinery.load_model(str(out / "checkpoint.pth.tar"))   # a plain state_dict, no `module.`
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


def _sync_bn_rank(rank, world, store_path, x, w, out_path):
    """One rank of the SyncBatchNorm check: half of the batch through GlooSyncBatchNorm, forward and backward."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        bn = machinery.GlooSyncBatchNorm(3)
        part = x.chunk(world)[rank].clone().requires_grad_(True)
        y = bn(part)
        (y * w.chunk(world)[rank]).sum().backward()            # this rank's part of a non-symmetric loss
        torch.save({"y": y.detach(), "grad_x": part.grad, "grad_w": bn.weight.grad, "grad_b": bn.bias.grad,
                    "running_mean": bn.running_mean, "running_var": bn.running_var}, f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not GLOO, reason="torch.distributed with gloo is not available")
def test_gloo_sync_batchnorm_on_two_ranks_equals_batchnorm_on_the_whole_batch(tmp_path):
    world = 2
    x = torch.randn(8, 3, 4, 4, generator=torch.Generator().manual_seed(1)) * 2 + 1
    w = torch.arange(x.numel()).view_as(x).sin()
    torch.multiprocessing.spawn(_sync_bn_rank, args=(world, str(tmp_path / "store"), x, w, str(tmp_path / "out")),
                                nprocs=world, join=True)
    ref = torch.nn.BatchNorm2d(3)
    xr = x.clone().requires_grad_(True)
    y = ref(xr)
    (y * w).sum().backward()
    parts = [torch.load(tmp_path / f"out.{r}") for r in range(world)]
    assert torch.allclose(torch.cat([p["y"] for p in parts]), y.detach(), atol=1e-5)
    assert torch.allclose(torch.cat([p["grad_x"] for p in parts]), xr.grad, atol=1e-5)
    # DDP averages parameter gradients over ranks; each rank's loss covers its half, so the sum is the total
    assert torch.allclose(sum(p["grad_w"] for p in parts), ref.weight.grad, atol=1e-4)
    assert torch.allclose(sum(p["grad_b"] for p in parts), ref.bias.grad, atol=1e-4)
    for p in parts:
        assert torch.allclose(p["running_mean"], ref.running_mean, atol=1e-6)
        assert torch.allclose(p["running_var"], ref.running_var, atol=1e-5)


@pytest.mark.skipif(not GLOO, reason="torch.distributed with gloo is not available")
def test_a_failing_torchrun_shows_each_ranks_own_stderr(tmp_path):
    script = tmp_path / "dies.py"
    # rank 1 fails only once rank 0 has spoken: the launcher then stops rank 0, which on a loaded machine
    # could otherwise be stopped before its interpreter has started
    done = tmp_path / "rank0_spoke"
    script.write_text("import os, sys, time\n"
                      "rank = os.environ['RANK']\n"
                      "sys.stderr.write(f'last words of rank {rank}\\n' + 'x' * 5000 + '\\n')\n"
                      "sys.stderr.flush()\n"
                      f"done = {str(done)!r}\n"
                      "if rank == '0':\n"
                      "    open(done, 'w').close()\n"
                      "deadline = time.time() + 60\n"
                      "while rank == '1' and not os.path.exists(done) and time.time() < deadline:\n"
                      "    time.sleep(0.05)\n"
                      "sys.exit(3 if rank == '1' else 0)\n")
    proc = run_torchrun([script], tmp_path / "logs", timeout=120)
    report = failure_report(proc, tmp_path / "logs", tail=6000)
    assert proc.returncode != 0
    assert "last words of rank 1" in report and "last words of rank 0" in report
    assert "--- rank 1 stderr" in report

"""The CUDA paths (docs/speed.md; `make gpu-check` runs them): skipped without a GPU, `pytest -m cuda` selects them.

On a GPU: certify in fp32, bf16 and fp16, with channels-last, folded BatchNorm and torch.compile, agrees with
the plain path on the same noise and resumes to the same file; every training script runs steps under
`--amp bf16` and `--amp fp16` and resumes exactly; a CUDA-graphed epoch (--cuda-graph) replays the eager steps; the Monte Carlo counter synchronises with the host once a
count (the sound sampler once more a pass), and the attack not at all; torchrun with one process and nccl writes its checkpoint."""
import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import certify
import common
import machinery
import readers
import train_baselines
import train_gaussian
import train_ours
from torchrun_util import failure_report, run_torchrun

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS = ["--dataset", "digits", "--sigma", 0.25, "--workers", 0, "--device", "cuda"]


def run(module, argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", [module.__name__ + ".py", *map(str, argv)])
    try:
        machinery.run((lambda: certify.main([str(a) for a in argv])) if module is certify else module.main)
    except SystemExit as e:
        return e.code
    return 0


@pytest.fixture(scope="module")
def cuda_ckpt(tmp_path_factory):
    """A digits LeNet trained briefly on the GPU, so that certificates differ between examples."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = common.get_architecture("digits_cnn", "digits").to(device)
    train = common.get_dataset("digits", "train")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(200):
        i = torch.randint(0, len(train), (64,))
        x, y = train.images[i].to(device), train.labels[i].to(device)
        loss = F.cross_entropy(model(x + 0.25 * torch.randn_like(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = str(tmp_path_factory.mktemp("cuda") / "checkpoint.pth.tar")
    machinery.save_checkpoint({"arch": "digits_cnn", "dataset": "digits", "sigma": 0.25,
                               "state_dict": {k: v.cpu() for k, v in model.state_dict().items()}}, path)
    return path


def lines(path):
    return [ln.split("\t") for ln in open(path).read().splitlines()[1:]]


@pytest.mark.parametrize("flags", [["--precision", "fp32"], ["--precision", "bf16"], ["--precision", "fp16"],
                                   ["--no-channels-last", "--no-fold-bn"], ["--compile"]])
def test_certify_on_cuda_agrees_with_the_plain_path_and_resumes(flags, cuda_ckpt, tmp_path, monkeypatch):
    def argv(count, out, *extra):
        return ["--checkpoint", cuda_ckpt, "--N0", 50, "--N", 2000, "--batch", 1000, "--skip", 7, "--max", count,
                "--device", "cuda", "--outfile", out, *extra]
    plain, fast, full = tmp_path / "plain.tsv", tmp_path / "fast.tsv", tmp_path / "full.tsv"
    assert run(certify, argv(8, plain, "--precision", "fp32", "--no-channels-last", "--no-fold-bn"), monkeypatch) == 0
    assert run(certify, argv(4, fast, *flags), monkeypatch) == 0
    assert run(certify, argv(8, fast, *flags), monkeypatch) == 0                       # resumed to 8 lines
    a, b = lines(plain), lines(fast)
    assert [r[0] for r in a] == [r[0] for r in b]
    for ra, rb in zip(a, b):   # the same noise: votes move only where rounding flips a borderline input
        assert abs(int(ra[6]) - int(rb[6])) <= 0.01 * 2000 + 2, (flags, ra, rb)
    assert run(certify, argv(8, full, *flags), monkeypatch) == 0
    assert [r[:5] + r[6:] for r in lines(full)] == [r[:5] + r[6:] for r in b]   # resumed == uninterrupted


def test_batch_auto_on_cuda_records_the_largest_pass_at_most_N(cuda_ckpt, tmp_path, monkeypatch):
    """digits_cnn is small: all N draws fit in one pass on any GPU; --early-abstain keeps 100 passes."""
    import json
    for extra, expected in (([], 3000), (["--early-abstain"], 30)):
        out = tmp_path / f"auto{len(extra)}.tsv"
        assert run(certify, ["--checkpoint", cuda_ckpt, "--N0", 50, "--N", 3000, "--max", 2, "--device", "cuda",
                             *extra, "--outfile", out], monkeypatch) == 0
        assert json.load(open(str(out) + ".json"))["batch"] == expected
        assert len(lines(out)) == 2


def test_sound_certification_runs_on_cuda_and_matches_the_cpu_table(cuda_ckpt, tmp_path, monkeypatch):
    S_cpu, L = common.rounded_gaussian_table(0.5)
    x = torch.randint(0, 256, (1, 3, 8, 8), dtype=torch.int32)
    z, failed = common.sound_noisy_inputs(x.cuda(), 100, 0.5, torch.Generator(device="cuda").manual_seed(0))
    s = torch.round(z.double() * 255).int().cpu() - x
    assert z.is_cuda and not failed.any() and s.abs().max() <= L
    out = tmp_path / "sound.tsv"
    assert run(certify, ["--checkpoint", cuda_ckpt, "--N0", 50, "--N", 1000, "--max", 4, "--device", "cuda",
                         "--sound", "--outfile", out], monkeypatch) == 0
    assert len(lines(out)) == 4


def synchronisations(fn):
    """How many implicit host synchronisations fn() makes (torch's sync debug mode, each warning recorded)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


def test_counting_and_attacks_do_not_synchronise_with_the_host():
    """sample_counts synchronises once (its non-finite check, after the last pass) however many passes it makes,
    the sound sampler at most once more a pass (its check that the input is on the grid); the attack not at all."""
    device = torch.device("cuda")
    model = common.get_architecture("cifar_resnet20", "cifar10").to(device).eval()
    x = torch.randint(0, 256, (2, 3, 32, 32), device=device) / 255   # on the 8-bit grid, for the sound sampler
    g = torch.Generator(device=device).manual_seed(0)
    common.sample_counts(model, x, 0.5, 256, 256, 10, g)               # warm-up (allocations, kernels)
    gaussian = [synchronisations(lambda: common.sample_counts(model, x, 0.5, n, 256, 10, g)) for n in (256, 1024)]
    assert gaussian[0] == gaussian[1] <= 1, gaussian                    # 2 passes, then 8
    sound = synchronisations(lambda: common.sample_counts(model, x, 0.5, 1024, 256, 10, g, common.sound_copies(255)))
    assert sound <= 8 + 1, sound
    delta = 0.5 * torch.randn(2, *x.shape, device=device)
    label = torch.tensor([1, 2], device=device)
    assert synchronisations(lambda: common.sphere_pgd(model, x, label, delta, T=4, eps=0.25)) == 0


def resumes_exactly(module, argv, tmp_path, monkeypatch):
    """Two epochs in one run and in two (the second a --resume) give the same weights, bit for bit."""
    assert run(module, [*argv, "--epochs", 2, "--outdir", tmp_path / "whole"], monkeypatch) == 0
    assert run(module, [*argv, "--epochs", 1, "--outdir", tmp_path / "parts"], monkeypatch) == 0
    assert run(module, [*argv, "--epochs", 2, "--outdir", tmp_path / "parts", "--resume"], monkeypatch) == 0
    a = readers.load_checkpoint(str(tmp_path / "whole" / "checkpoint.pth.tar"))["state_dict"]
    b = readers.load_checkpoint(str(tmp_path / "parts" / "checkpoint.pth.tar"))["state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
@pytest.mark.parametrize("module, extra", [
    (train_gaussian, []),
    (train_ours, ["--Et", 1, "--N", 10, "--reweight_every", 1, "--T", 2]),
    (train_baselines, ["--method", "smoothadv"]), (train_baselines, ["--method", "macer"]),
    (train_baselines, ["--method", "consistency"]), (train_baselines, ["--method", "smoothmix"]),
    (train_baselines, ["--method", "stability"]),
])
def test_every_training_script_runs_on_cuda_with_amp_and_resumes_exactly(module, extra, amp, tmp_path, monkeypatch):
    argv = [*DIGITS, *extra, "--amp", amp, "--channels-last", "--max-batches", 2]
    resumes_exactly(module, argv, tmp_path, monkeypatch)


def graphed_epoch(loss, precision, graph):
    """cifar_resnet20 (BatchNorm) trained one epoch of 6 batches, the last smaller, with or without CUDA graphs."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = common.get_architecture("cifar_resnet20", "cifar10").to(device)
    optimizer = common.make_optimizer(model, lr=0.05)
    x, y = torch.rand(6, 16, 3, 32, 32, device=device), torch.randint(0, 10, (6, 16), device=device)
    batches = [(x[k], y[k], torch.arange(16, device=device)) for k in range(5)] + [(x[5, :6], y[5, :6],
                                                                                   torch.arange(6, device=device))]
    loss_fn = (lambda f, x, y, idx: common.gaussian_loss(f, x, y, 0.5, 2)) if loss == "gaussian" else \
        (lambda f, x, y, idx: train_ours.ours_loss(f, x, y, 0.5, 2, 2, 0.25, "l2"))
    torch.manual_seed(1)
    row = common.train_epoch(model, batches, optimizer, loss_fn, 2, device, precision=precision, graph=graph)
    return model.state_dict(), row


@pytest.mark.parametrize("loss", ["gaussian", "ours"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_graphed_epoch_replays_the_eager_steps(loss, precision, monkeypatch):
    """train_epoch(graph=True): after GRAPH_WARMUP eager steps the 8-input chunks replay one captured step (8
    replays here), the 3-input chunks of the last batch run eagerly; the weights and the logged loss are the
    eager epoch's (its noise too: the replays advance the generator as the eager steps do)."""
    replays = []
    real = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replays.append(1) or real(self))
    eager, row_eager = graphed_epoch(loss, precision, False)
    graphed, row_graphed = graphed_epoch(loss, precision, True)
    assert len(replays) == 10 - common.GRAPH_WARMUP
    tol = dict(rtol=1e-3, atol=1e-4) if precision == "fp32" else dict(rtol=2e-2, atol=2e-3)
    for k in eager:
        assert torch.allclose(eager[k].float(), graphed[k].float(), **tol), k
    assert row_graphed["train_loss"] == pytest.approx(row_eager["train_loss"], rel=tol["rtol"])


@pytest.mark.parametrize("module, extra", [(train_gaussian, []), (train_ours, ["--Et", 1, "--N", 10, "--T", 2])])
def test_cuda_graph_trains_from_the_command_line_and_resumes_exactly(module, extra, tmp_path, monkeypatch):
    argv = [*DIGITS, *extra, "--amp", "bf16", "--channels-last", "--cuda-graph", "--max-batches", 4]
    resumes_exactly(module, argv, tmp_path, monkeypatch)
    assert run(module, [*DIGITS, *extra, "--amp", "fp16", "--cuda-graph", "--epochs", 1, "--outdir",
                        tmp_path / "fp16"], monkeypatch) == 2   # fp16's loss scaling reads the host: refused


def test_catrs_trains_on_cuda(tmp_path, monkeypatch):
    teacher = tmp_path / "teacher"
    assert run(train_gaussian, [*DIGITS, "--epochs", 1, "--max-batches", 2, "--outdir", teacher], monkeypatch) == 0
    target = tmp_path / "target.pt"
    assert run(train_baselines, ["--make-catrs-target", "--checkpoint", teacher / "checkpoint.pth.tar", "--out",
                                 target, "--N", 4, "--device", "cuda"], monkeypatch) == 0
    assert run(train_baselines, ["--method", "catrs", *DIGITS, "--catrs-target", target, "--epochs", 1,
                                 "--max-batches", 2, "--amp", "bf16", "--outdir", tmp_path / "c"], monkeypatch) == 0


def test_torchrun_with_one_process_and_nccl_writes_its_checkpoint(tmp_path):
    out = tmp_path / "nccl"
    args = [os.path.join(ROOT, "train_gaussian.py"), *map(str, DIGITS), "--epochs", "1", "--max-batches", "2",
            "--outdir", str(out)]
    proc = run_torchrun(args, tmp_path / "logs", nproc=1, timeout=300)
    assert proc.returncode == 0, failure_report(proc, tmp_path / "logs")
    assert readers.load_checkpoint(str(out / "checkpoint.pth.tar"))["epoch"] == 1

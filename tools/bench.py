"""Speed benchmark of certification (App. C.2) and training (§3, Alg. 2) against their ceilings and textbook loops.

Usage: python tools/bench.py --quick     # smoke run, about 4 minutes on a 2-core CPU
       python tools/bench.py             # the full benchmark, 10-15 minutes on a 2-core CPU

Every figure is a ratio of two throughputs measured side by side: each repetition runs all variants of a
section one after the other (A B C, A B C, ...), the ratio is taken within a repetition, and the median over
the repetitions is printed, so a machine shared with other work slows both sides alike. Printed, with the
machine, its load, torch version, threads and settings:
  (a)  certify.certify's noise samples/s (N0 + N draws of one input; N0/N = 1/1000 as in the paper) against
       the forward pass of the same model (BatchNorm folded, channels-last, as certify.py runs it) in the
       same precision and compilation on one pre-built batch (the ceiling), and against a textbook CERTIFY
       kept below (Cohen et al.'s loop: fp32, contiguous, no_grad, each batch's predictions moved to the
       host and counted with numpy's bincount)
  (a') the same two certification loops as users run them, each in its own process: certify.py keeps freed
       memory (glibc, certify.keep_freed_memory), the textbook code does not
  (b)  training noisy samples/s of train_gaussian.py's and train_ours.py's loss (attack on) through
       common.train_epoch, with and without --amp/--channels-last, against a plain fp32 eager loop
       (per-step loss.item()); same model, same m, 64 images x m copies per optimizer step
  (c)  train-time pA estimation (common.count_correct, n = 100 draws, 1024 per pass) against the ceiling
  (d)  --early-abstain on trained models at sigma 0.5 and 1.0: model evaluations saved and the largest
       change of certified accuracy at any radius, full and early runs on the same examples and noise
       (default: digits_cnn trained here with train_gaussian.py; --checkpoint for your own models)
  (e)  train_baselines.py: seconds per CIFAR-10 epoch of each baseline (released sigma = 0.5 settings,
       --amp --channels-last) against Gaussian training with the same m, from one optimizer step each
  (f)  certify.py --sound: the exact integer sampler (common.sound_noisy_inputs) against the float noise and
       against the forward pass of 1000 noisy inputs, and sample_counts with and without it, for CIFAR-10's
       cifar_resnet20 and digits' digits_cnn (folded, channels-last, as certify.py runs them)
  (g)  certify.py --radii (anytime-valid, grid.py) against CERTIFY at N and N / 10 on trained models at
       sigma 0.25 and 0.5 (digits models trained here, or --checkpoint): model evaluations (mean, median, 90th
       percentile, share run to the budget), wall time, certified accuracy at each grid radius and the
       examples on which each arm disagrees with CERTIFY at N; arms: the grid with and without the final
       look, and a single radius (0.5)
  (h)  ddrs.py certify (K = 100 OptimizeSigma steps, M = 1) against plain CERTIFY on the same model and
       examples (the digits models of (g), or --checkpoint): seconds per example and the ratio (the paper:
       1.6 -> 1.8 s per CIFAR-10 input, 1.125x, and 109.5 -> 136 s per ImageNet input, 1.24x: App. F)
(a)-(c), (e), (f) use random weights and random inputs: throughput depends on neither. On a
machine shared with other jobs, --threads 1 avoids measuring the scheduler (threads waiting for each other).
"""
import signal
if __name__ == "__main__":   # Ctrl-C while torch loads: stop quietly (machinery.run takes over from there)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
import argparse
import contextlib
import copy
import functools
import io
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # the project's modules, one folder up
import certify  # noqa: E402
import common  # noqa: E402
import readers  # noqa: E402
import grid  # noqa: E402
import machinery  # noqa: E402
import train_baselines
import train_ours

ARCH, DATASET = "cifar_resnet20", "cifar10"
BATCH = 1000     # noisy inputs per forward pass (certify.py's default)


def parse_args(argv=None):
    p = machinery.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, no torch.compile: a smoke run")
    p.add_argument("--report", help="also write everything printed to this file at the end (through the guard)")
    p.add_argument("--reps", type=int, help="repetitions of every comparison (default 5, training 3; --quick 2)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's, usually one per core)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows of (a)")
    p.add_argument("--sections", default="abcdefgh", help="which parts to run, e.g. 'd' (default: all, abcdefgh; "
                   "a includes a')")
    p.add_argument("--grid-N", type=int, help="(g): the budget N_max and CERTIFY's N (default 100000; quick 10000)")
    p.add_argument("--grid-radii", type=float, nargs="+", metavar="R", help="(g): the grid of the --radii arms "
                   "(default 0.25, 0.5, ... up to 4 sigma)")
    p.add_argument("--grid-examples", type=int, help="(g): test examples per model (default 100; quick 10)")
    p.add_argument("--grid-noise", choices=("independent", "paired"), help="(g): each arm draws its own noise "
                   "(independent, the default), or every arm the reference's (paired: their agreement is then "
                   "partly by construction)")
    p.add_argument("--grid-logs", nargs="+", metavar="TSV", help="(g) from finished certify.py logs of one model "
                   "on the same examples instead: CERTIFY at N first (the reference), then the other arms")
    p.add_argument("--checkpoint", nargs="+", help="(d): trained models (with their sigma) instead of digits "
                   "models trained here; CIFAR-10 ones need --data-dir")
    p.add_argument("--data-dir", default=None, help="(d): dataset folder of the --checkpoint models")
    p.add_argument("--trust-checkpoint", action="store_true", help="(d): load --checkpoint files that need "
                   "arbitrary unpickling: this RUNS CODE the file holds; only for files you trust")
    p.add_argument("--abstain-N", type=int, help="(d): N of the certification runs (default 10000; quick 2000)")
    p.add_argument("--abstain-examples", type=int, help="(d): test examples per model (default 150; quick 20)")
    p.add_argument("--probe", choices=("default", "tuned"), help=argparse.SUPPRESS)  # (a') child processes
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------
# Measuring: throughputs, interleaved repetitions, medians of ratios
# ----------------------------------------------------------------------------------------------------------

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rate(fn, items, device):
    """items / seconds of one call of fn()."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return items / (time.perf_counter() - start)


def interleaved(variants, reps, device):
    """{name: [rate per repetition]}; variants: {name: (fn, items)}, run A B C, A B C, ... after one warm-up each."""
    for fn, _ in variants.values():
        fn()
    rates = {name: [] for name in variants}
    for _ in range(reps):
        for name, (fn, items) in variants.items():
            rates[name].append(rate(fn, items, device))
    return rates


def median_ratio(rates, a, b):
    return statistics.median(x / y for x, y in zip(rates[a], rates[b]))


def show_rates(rates):
    for name, values in rates.items():
        print(f"    {name:44s} {statistics.median(values):10.0f} /s   (runs: "
              f"{', '.join(f'{v:.0f}' for v in values)})")


def show_ratio(label, rates, a, b, target=None):
    value = median_ratio(rates, a, b)
    verdict = "" if target is None else f"   target >= {target}: {'met' if value >= target else 'NOT met'}"
    print(f"  {label:62s} {value:6.2f}x{verdict}")
    return value


# ----------------------------------------------------------------------------------------------------------
# Textbook baselines: the loops of the original RS code, kept here as the reference of the ratios
# ----------------------------------------------------------------------------------------------------------

def textbook_counts(model, x, sigma, n, batch, num_classes, generator):
    """Cohen et al.'s sampling loop: fp32, no_grad, each batch's predictions to the host, numpy bincount.

    x: one input (C, H, W). Draws the same noise as common.sample_counts when n is a multiple of batch.
    """
    counts = np.zeros(num_classes, dtype=np.int64)
    with torch.no_grad():
        for start in range(0, n, batch):
            k = min(batch, n - start)
            inputs = x.unsqueeze(0).repeat(k, 1, 1, 1)
            noise = sigma * torch.randn(inputs.shape, device=x.device, generator=generator)
            predictions = model(inputs + noise).argmax(1)
            counts += np.bincount(predictions.cpu().numpy(), minlength=num_classes)
    return counts


def textbook_certify(model, x, sigma, N0, N, alpha, batch, num_classes, generator):
    """CERTIFY as in the original code, on textbook_counts: (cA, radius) or (-1, 0.0)."""
    cA = int(textbook_counts(model, x, sigma, N0, batch, num_classes, generator).argmax())
    nA = int(textbook_counts(model, x, sigma, N, batch, num_classes, generator)[cA])
    pA_lower = common.clopper_pearson_lower(nA, N, alpha)
    return (cA, float(common.certified_radius(pA_lower, sigma))) if pA_lower >= 0.5 else (-1, 0.0)


def plain_train_steps(model, optimizer, batches, loss_fn):
    """A plain fp32 eager training loop: one step per batch, the loss and accuracy read every step."""
    model.train()
    loss_total, correct, total = 0.0, 0, 0
    for x, y, idx in batches:
        out = loss_fn(model, x, y, idx)
        optimizer.zero_grad()
        out["loss"].backward()
        optimizer.step()
        loss_total += out["loss"].item()   # host synchronisation every step, as in most research code
        correct += int(out["correct"].item())
        total += out["total"]
    return loss_total, correct / max(total, 1)


# ----------------------------------------------------------------------------------------------------------
# (a) certification, (c) train-time pA estimation: against the forward ceiling and the textbook CERTIFY
# ----------------------------------------------------------------------------------------------------------

def make_model(device, channels_last=False, seed=0):
    torch.manual_seed(seed)
    model = common.get_architecture(ARCH, DATASET).to(device).eval()
    return model.to(memory_format=torch.channels_last) if channels_last else model


def ceiling_fn(model, device, precision, channels_last, passes):
    """`passes` forward passes of one pre-built batch of BATCH inputs in inference mode: the ceiling."""
    x = torch.rand(BATCH, *common.INPUT_SHAPE[DATASET], device=device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)

    def run():
        with torch.inference_mode(), common.autocast(device.type, precision):
            for _ in range(passes):
                model(x)
    return run


def certify_fn(model, x, sigma, N0, N, precision):
    def run():
        certify.certify(common.in_precision(model, precision), x, sigma, N0, N, 0.001, BATCH, 10,
                        common.example_generator(0, 0, x.device))
    return run


def bench_certify(device, reps, N, use_compile):
    """(a): rows of samples/s and the ratios of the targets.

    certify runs the model as certify.py does by default: BatchNorm folded, channels-last (certify.fast_model);
    its ceiling is the forward pass of that same model in the same precision. N0 = N / 1000, the paper's ratio
    (N0 = 100, N = 100,000), so that the selection pass weighs as much as it does there.
    """
    sigma, N0 = 0.5, max(1, N // 1000)
    x = torch.rand(*common.INPUT_SHAPE[DATASET], device=device)
    plain = make_model(device)
    fast = certify.fast_model(make_model(device), True, False, [], "fp32", fold_bn=True)
    passes = N // BATCH
    textbook = "textbook CERTIFY (fp32, contiguous)"
    variants = {
        textbook: (lambda: textbook_certify(plain, x, sigma, N0, N, 0.001, BATCH, 10,
                                            common.example_generator(0, 0, device)), N0 + N),
        "ceiling fp32, channels-last, BN not folded": (
            ceiling_fn(make_model(device, channels_last=True), device, "fp32", True, passes), passes * BATCH),
        "ceiling fp32": (ceiling_fn(fast, device, "fp32", True, passes), passes * BATCH),
        "certify fp32 (default)": (certify_fn(fast, x, sigma, N0, N, "fp32"), N0 + N),
        "ceiling bf16": (ceiling_fn(fast, device, "bf16", True, passes), passes * BATCH),
        "certify --precision bf16": (certify_fn(fast, x, sigma, N0, N, "bf16"), N0 + N),
    }
    compiled = []
    if use_compile:
        shapes = certify.pass_shapes(common.INPUT_SHAPE[DATASET], N0, N, BATCH, False)
        for precision in ("fp32", "bf16"):
            start = time.time()
            model = certify.fast_model(make_model(device), True, True, shapes, precision, fold_bn=True)
            ok = isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
            print(f"  torch.compile {precision}: {'compiled' if ok else 'FELL BACK to eager'} "
                  f"in {time.time() - start:.0f} s ({len(shapes)} batch shapes)", flush=True)
            if ok:
                compiled.append(precision)
                variants[f"ceiling {precision} compiled"] = (
                    ceiling_fn(model, device, precision, True, passes), passes * BATCH)
                variants[f"certify {precision} --compile"] = (certify_fn(model, x, sigma, N0, N, precision),
                                                              N0 + N)
    rates = interleaved(variants, reps, device)
    show_rates(rates)
    print(f"  ratios (median of {reps} interleaved repetitions); ceilings: the same model, layout and precision:")
    show_ratio("certify fp32 / ceiling fp32", rates, "certify fp32 (default)", "ceiling fp32", 0.9)
    show_ratio("certify fp32 / textbook, same process (code only; see (a'))", rates, "certify fp32 (default)",
               textbook)
    show_ratio("certify bf16 / ceiling bf16", rates, "certify --precision bf16", "ceiling bf16", 0.9)
    show_ratio("certify bf16 / textbook, same process (code only; see (a'))", rates, "certify --precision bf16",
               textbook)
    for precision in compiled:
        show_ratio(f"certify {precision} --compile / ceiling {precision} compiled", rates,
                   f"certify {precision} --compile", f"ceiling {precision} compiled", 0.9)
        show_ratio(f"certify {precision} --compile / textbook, same process", rates, f"certify {precision} --compile",
                   textbook, 2.5 if precision == "fp32" else 5)
    show_ratio("(context) certify fp32 / ceiling with BN not folded", rates, "certify fp32 (default)",
               "ceiling fp32, channels-last, BN not folded")
    show_ratio("(context) ceiling fp32, BN not folded / textbook", rates,
               "ceiling fp32, channels-last, BN not folded", textbook)


def probe(device, mode, N):
    """Child process of bench_as_shipped: one measurement of each loop, as JSON on stdout.

    mode 'tuned' sets glibc up the way certify.py's main does (certify.keep_freed_memory); 'default' leaves it.
    """
    if mode == "tuned":
        certify.keep_freed_memory()
    x = torch.rand(*common.INPUT_SHAPE[DATASET], device=device)
    plain = make_model(device)
    fast = certify.fast_model(make_model(device), True, False, [], "fp32", fold_bn=True)
    N0 = max(1, N // 1000)
    variants = {"textbook": (lambda: textbook_certify(plain, x, 0.5, N0, N, 0.001, BATCH, 10,
                                                      common.example_generator(0, 0, device)), N0 + N),
                "certify fp32": (certify_fn(fast, x, 0.5, N0, N, "fp32"), N0 + N),
                "certify bf16": (certify_fn(fast, x, 0.5, N0, N, "bf16"), N0 + N)}
    rates = interleaved(variants, 1, device)
    print(json.dumps({name: values[0] for name, values in rates.items()}))


def bench_as_shipped(device, N, alternations):
    """(a) as users run the code: certify.py keeps freed memory (glibc), the original code does not.

    The allocator setting is per process, so each side runs in its own child process; the children alternate
    (default, tuned, default, tuned, ...) and the ratios are taken within each alternation.
    """
    runs = {"default": [], "tuned": []}
    cmd = [sys.executable, os.path.abspath(__file__), "--threads", str(torch.get_num_threads()), "--device",
           str(device), "--probe"]
    for _ in range(alternations):
        for mode in runs:
            out = subprocess.run([*cmd, mode], capture_output=True, text=True, check=True).stdout
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))

    def ratio(a_mode, a, b_mode, b):
        return statistics.median(x[a] / y[b] for x, y in zip(runs[a_mode], runs[b_mode]))

    def line(label, value, target=None):
        verdict = "" if target is None else f"   target >= {target}: {'met' if value >= target else 'NOT met'}"
        print(f"  {label:62s} {value:6.2f}x{verdict}")
    for mode, values in runs.items():
        for name in values[0]:
            print(f"    {name + ', ' + ('glibc default' if mode == 'default' else 'freed memory kept'):44s} "
                  f"{statistics.median(v[name] for v in values):10.0f} /s")
    print(f"  ratios (median of {alternations} alternations of child processes):")
    line("certify.py fp32 / textbook, as each is run", ratio("tuned", "certify fp32", "default", "textbook"), 2.5)
    line("certify.py bf16 / textbook, as each is run", ratio("tuned", "certify bf16", "default", "textbook"), 5)
    line("(context) textbook with / without freed memory kept", ratio("tuned", "textbook", "default", "textbook"))
    line("(context) certify fp32 with / without freed memory kept",
         ratio("tuned", "certify fp32", "default", "certify fp32"))


def bench_pA(device, reps, examples):
    """(c): common.count_correct (Alg. 2's discard estimate, n = 100) against the fp32 channels-last ceiling."""
    n, batch = 100, 1024
    model = make_model(device, channels_last=True)
    images = torch.rand(examples, *common.INPUT_SHAPE[DATASET])
    data = common.TensorImages(images, torch.zeros(examples, dtype=torch.long))
    indices = torch.arange(examples)
    passes = examples * n // BATCH
    variants = {
        "count_correct fp32 channels-last (n=100)": (
            lambda: common.count_correct(model, data, indices, 0.5, n, batch), examples * n),
        "ceiling fp32 channels-last": (ceiling_fn(model, device, "fp32", True, passes), passes * BATCH),
    }
    rates = interleaved(variants, reps, device)
    show_rates(rates)
    show_ratio("pA estimation / ceiling fp32 channels-last", rates, "count_correct fp32 channels-last (n=100)",
               "ceiling fp32 channels-last", 0.9)


# ----------------------------------------------------------------------------------------------------------
# (b) training: the scripts' losses through common.train_epoch against a plain fp32 eager loop
# ----------------------------------------------------------------------------------------------------------

def train_fn(base, batches, loss_fn, device, channels_last, precision, plain_loop=False):
    """One measurement: len(batches) optimizer steps of a copy of the model that each variant keeps."""
    model = copy.deepcopy(base)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = common.make_optimizer(model)

    def run():
        if plain_loop:
            plain_train_steps(model, optimizer, batches, loss_fn)
        else:
            common.train_epoch(model, batches, optimizer, loss_fn, 1, device, precision=precision)
    return run


def bench_training(device, reps, steps, images_per_step, T):
    """(b): noisy samples/s of the Gaussian and of Alg. 2's loss (with the attack), fast path vs plain loop.

    Alg. 2's step costs about T + 1 Gaussian steps: it gets one step per measurement and no channels-last-only row.
    """
    sigma, m = 0.5, 4
    preset = train_ours.PRESETS[DATASET][sigma]
    T = preset["T"] if T is None else T
    base = make_model(device).train()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.rand(images_per_step, *common.INPUT_SHAPE[DATASET], generator=g).to(device),
                torch.randint(0, 10, (images_per_step,), generator=g).to(device),
                torch.arange(images_per_step, device=device)) for _ in range(steps)]
    losses = {
        "train_gaussian.py": lambda f, x, y, idx: common.gaussian_loss(f, x, y, sigma, m),
        f"train_ours.py (attack T={T})": lambda f, x, y, idx: train_ours.ours_loss(f, x, y, sigma, m, T,
                                                                                  preset["eps"], "l2"),
    }
    print(f"  cifar_resnet20, m = {m}, {images_per_step} images x {m} noise copies = {images_per_step * m} noisy "
          f"inputs per optimizer step (the scripts' 256-image batch cut into m chunks), sigma {sigma}")
    for k, (script, loss_fn) in enumerate(losses.items()):
        todo = batches if k == 0 else batches[:1]
        items = len(todo) * images_per_step * m
        print(f"  {script}, {len(todo)} optimizer step(s) per measurement:")
        variants = {"plain fp32 eager loop": (train_fn(base, todo, loss_fn, device, False, "fp32", True), items),
                    "train_epoch (no flags)": (train_fn(base, todo, loss_fn, device, False, "fp32"), items)}
        if k == 0:
            variants["train_epoch --channels-last"] = (train_fn(base, todo, loss_fn, device, True, "fp32"), items)
        variants["train_epoch --amp --channels-last"] = (train_fn(base, todo, loss_fn, device, True, "bf16"), items)
        rates = interleaved(variants, reps, device)
        show_rates(rates)
        show_ratio("--amp --channels-last / plain fp32 eager loop", rates, "train_epoch --amp --channels-last",
                   "plain fp32 eager loop", 2)
        if "train_epoch --channels-last" in rates:
            show_ratio("--channels-last / plain fp32 eager loop", rates, "train_epoch --channels-last",
                       "plain fp32 eager loop")
        show_ratio("no flags / plain fp32 eager loop", rates, "train_epoch (no flags)", "plain fp32 eager loop")


def bench_baselines(device, reps, precision, channels_last):
    """(e): seconds per CIFAR-10 epoch of each baseline against Gaussian training with the same m.

    One optimizer step of each method at its released sigma = 0.5 setting (after the warm-ups), on the images
    that step gets (256 / m of a 256-image loader batch cut into m chunks; MACER 64, Stability 256), against
    one step of train_gaussian.py with the same m (256 / m images); an epoch is 50,000 m noisy inputs for both.
    """
    sigma, train_size = 0.5, 50_000
    base = make_model(device).train()
    g = torch.Generator().manual_seed(0)

    def step(n):  # one optimizer step's batch of n random images
        return [(torch.rand(n, *common.INPUT_SHAPE[DATASET], generator=g).to(device),
                 torch.randint(0, 10, (n,), generator=g).to(device), torch.arange(n, device=device))]
    print(f"  cifar_resnet20, sigma {sigma} released settings, {precision}"
          f"{', channels-last' if channels_last else ''}; one optimizer step per measurement")
    for method in train_baselines.METHODS:
        hp, _ = train_baselines.method_defaults(method, DATASET, sigma)
        m, batch = hp.get("m", 1), hp.get("batch", 256)
        images = batch // m if train_baselines.CHUNKED[method] else batch
        target = torch.full((images, 10), 0.1)          # CAT-RS's soft labels: the cost does not depend on them
        loss_fn = train_baselines.make_loss_fn(method, dict(hp, lr_step=50), sigma, 100, target)
        gaussian = lambda f, x, y, idx, m=m: common.gaussian_loss(f, x, y, sigma, m)
        variants = {f"gaussian, m = {m}": (train_fn(base, step(256 // m), gaussian, device, channels_last,
                                                    precision), 256 // m * m),
                    method: (train_fn(base, step(images), loss_fn, device, channels_last, precision), images * m)}
        rates = interleaved(variants, reps, device)
        seconds = {name: train_size * m / statistics.median(values) for name, values in rates.items()}
        print(f"  {method:12s} m = {m:2d}, {images:3d} images x {m} copies per step: {seconds[method]:7.0f} s/epoch, "
              f"Gaussian {seconds[f'gaussian, m = {m}']:6.0f} s/epoch: "
              f"{median_ratio(rates, f'gaussian, m = {m}', method):.2f}x", flush=True)


# ----------------------------------------------------------------------------------------------------------
# (d) early abstention: the same examples and noise, certified with and without --early-abstain
# ----------------------------------------------------------------------------------------------------------

def train_digits_models(folder, epochs, sigmas=(0.5, 1.0)):
    """Quick trained models for (d), (g): digits_cnn with train_gaussian.py at these sigmas; their paths."""
    paths = []
    for sigma in sigmas:
        outdir = os.path.join(folder, f"gaussian_digits_sigma{sigma}")
        start = time.time()
        subprocess.run([sys.executable, os.path.join(ROOT, "train_gaussian.py"), "--dataset", "digits",
                        "--sigma", str(sigma), "--epochs", str(epochs), "--workers", "0", "--outdir", outdir],
                       check=True, stdout=subprocess.DEVNULL)
        print(f"  trained digits_cnn with train_gaussian.py, sigma {sigma}, {epochs} epochs, "
              f"in {time.time() - start:.0f} s", flush=True)
        paths.append(os.path.join(outdir, machinery.CHECKPOINT))
    return paths


def certified_accuracy_change(full, early):
    """Largest drop of certified accuracy (points) at any radius; rows: dicts with 'radius' and 'correct'."""
    radii = sorted({0.0} | {r["radius"] for r in full + early})
    def accuracy(rows, r):
        return 100.0 * sum(row["correct"] and row["radius"] >= r for row in rows) / len(rows)
    return max(abs(accuracy(full, r) - accuracy(early, r)) for r in radii)


def parse_line(line):
    cells = line.split("\t")
    return {"predict": int(cells[2]), "radius": float(cells[3]), "correct": int(cells[4]), "nA": int(cells[6]),
            "N": int(cells[7])}


def bench_sound(device, reps, passes):
    """(f): the sound sampler's cost against float noise and the forward pass; sample_counts sound vs float."""
    sigma = 0.5
    for arch, dataset in (("cifar_resnet20", "cifar10"), ("digits_cnn", "digits")):
        torch.manual_seed(0)
        net = common.get_architecture(arch, dataset).to(device).eval()
        model = certify.fast_model(net, True, False, [], "fp32", fold_bn=True)
        levels = common.DATASET_LEVELS[dataset]
        shape = common.INPUT_SHAPE[dataset]
        x = torch.randint(0, levels + 1, shape, device=device).float() / levels      # an input on the grid
        a = common.grid_levels(x.unsqueeze(0), levels)
        batch = torch.rand(BATCH, *shape, device=device).contiguous(memory_format=torch.channels_last)
        common.rounded_gaussian_table(sigma, levels=levels)                             # built once, cached
        g = torch.Generator(device=device).manual_seed(0)

        def forward():
            with torch.inference_mode():
                for _ in range(passes):
                    model(batch)

        def float_noise():
            for _ in range(passes):
                common.gaussian_copies(x.unsqueeze(0), BATCH, sigma, g)

        def sound_noise():
            for _ in range(passes):
                common.sound_noisy_inputs(a, BATCH, sigma, g, levels=levels)

        def counts(sound):
            copies = common.sound_copies(levels) if sound else common.gaussian_copies
            return lambda: common.sample_counts(model, x.unsqueeze(0), sigma, passes * BATCH, BATCH, 10, g, copies)

        items = passes * BATCH
        rates = interleaved({"forward pass (the ceiling)": (forward, items), "float noise: randn + add":
                             (float_noise, items), "sound noise: randint, searchsorted, add, convert":
                             (sound_noise, items), "sample_counts, float sampler": (counts(False), items),
                             "sample_counts, sound sampler": (counts(True), items)}, reps, device)
        print(f"  {arch} ({dataset}, {int(np.prod(shape))} coordinates, grid 1/{levels}), sigma {sigma}, "
              f"batch {BATCH}, noisy inputs per second:")
        show_rates(rates)
        show_ratio("sound sampler cost / forward pass (time)", rates, "forward pass (the ceiling)",
                   "sound noise: randint, searchsorted, add, convert")
        show_ratio("float noise cost / forward pass (time)", rates, "forward pass (the ceiling)",
                   "float noise: randn + add")
        show_ratio("sample_counts: sound / float (throughput)", rates, "sample_counts, sound sampler",
                   "sample_counts, float sampler")


def trained_model(path, device, data_dir, examples, trust=False):
    """A trained checkpoint as (d), (g) and (h) use it: a dict with the model on the fast path (folded,
    channels-last), ckpt, sigma, dataset_name, classes, the test set and `picked`, examples spread over it."""
    model, ckpt = readers.load_model(path, device=device, trust=trust)
    common.check(ckpt.get("sigma") and ckpt.get("dataset"), f"{path!r} stores no sigma or dataset")
    dataset = common.get_dataset(ckpt["dataset"], "test", data_dir, train_transform=False)
    return {"model": certify.fast_model(model, certify.is_convolutional(model), False, [], "fp32", fold_bn=True),
            "ckpt": ckpt, "sigma": float(ckpt["sigma"]), "dataset_name": ckpt["dataset"], "dataset": dataset,
            "classes": common.NUM_CLASSES[ckpt["dataset"]],
            "picked": np.linspace(0, len(dataset) - 1, min(examples, len(dataset))).round().astype(int)}


GRID_RADII = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5]


def bench_grid(paths, device, data_dir, N, examples, trust=False, grid_radii=None, noise="independent"):
    """(g): anytime-valid certification at a grid of radii (grid_radii, default GRID_RADII up to 4 sigma)
    against CERTIFY, on the same examples; noise: each arm its own seed (independent) or all the reference's
    (paired). Each arm's certified accuracy against the reference's, with intervals (arm_intervals)."""
    N0, alpha = 100, 0.001
    for path in paths:
        t = trained_model(path, device, data_dir, examples, trust)
        model, ckpt, sigma, dataset_name = t["model"], t["ckpt"], t["sigma"], t["dataset_name"]
        dataset, picked, classes = t["dataset"], t["picked"], t["classes"]
        radii = sorted(grid_radii) if grid_radii else [r for r in GRID_RADII if r <= 4 * sigma]
        beta = grid.DEFAULT_BETA
        plans = {"grid": grid.grid_plan(radii, sigma, N, alpha, beta, True),
                 "grid, no final look": grid.grid_plan(radii, sigma, N, alpha, beta, False),
                 "single radius 0.5": grid.grid_plan([0.5], sigma, N, alpha, beta, True),
                 "r = 0.5 alone": grid.grid_plan([0.5], sigma, N, alpha, beta, True, zero_level=False)}
        arms = {f"CERTIFY N = {N:,}": None, f"CERTIFY N = {N // 10:,}": None, **plans}
        results = {name: {"radius": [], "correct": [], "evals": [], "time": 0.0} for name in arms}
        group = grid.GROUP   # certify.py --group's default: the grid arms pack a group's draws into shared passes
        for first in range(0, len(picked), group):   # arms interleaved group by group (a noisy machine)
            block = [int(i) for i in picked[first:first + group]]
            xs = [dataset[i][0].to(device) for i in block]
            labels = [int(dataset[i][1]) for i in block]
            for arm, (name, plan) in enumerate(arms.items()):
                seed = arm if noise == "independent" else 0   # the reference (arm 0) draws seed 0 either way
                start = time.perf_counter()
                if plan is None:
                    n = N if name.endswith(f"{N:,}") else N // 10
                    outs = [certify.certify(model, x, sigma, N0, n, alpha, BATCH, classes,
                                            common.example_generator(seed, i, device)) for x, i in zip(xs, block)]
                else:
                    with timed_tables() as tables:
                        outs = grid.grid_certify_many(model, [(x, common.example_generator(seed, i, device),
                                                                  None) for x, i in zip(xs, block)], sigma, N0,
                                                         BATCH, classes, plan)
                sync(device)
                row = results[name]
                row["time"] += time.perf_counter() - start
                row["tables"] = row.get("tables", 0.0) + (tables["seconds"] if plan is not None else 0.0)
                row.setdefault("idx", []).extend(block)
                row.setdefault("y", []).extend(labels)
                for out, label in zip(outs, labels):
                    row["radius"].append(out["radius"] if out["predict"] >= 0 else -1.0)
                    row["correct"].append(out["predict"] == label)
                    row["evals"].append(N0 + out["N"])
                    row.setdefault("pA", []).append(out["nA"] / out["N"])
        print(f"  {os.path.basename(os.path.dirname(os.path.abspath(path)))} ({ckpt.get('arch')}, {dataset_name}, "
              f"sigma {sigma}), {len(picked)} test examples, alpha {alpha}, N0 {N0}, batch {BATCH}, noise "
              f"{'independent: each arm its own seed' if noise == 'independent' else 'paired: every arm seed 0'}:")
        reference = f"CERTIFY N = {N:,}"
        print_grid_table(results, reference, set(plans), N, N0, [0.0] + radii)
        arm_intervals(results, reference, {name: [r for r in plan["radii"] if r > 0] for name, plan in plans.items()},
                      radii, noise)
        for name, plan in plans.items():
            print_oracle(name, dict(results[name], radii=plan["radii"]), results[reference]["pA"], sigma, N, N0,
                        alpha, beta)
        for name, plan in plans.items():   # within the arm's seconds above (KT's prior: built with the plan)
            built = max(len(plan["cache"]) - 1, 1)
            print(f"    tables of {name}: {built} selection priors built in {results[name]['tables']:.1f} s of the "
                  f"arm's {results[name]['time']:.1f} s ({results[name]['tables'] / built:.2f} s each)")


@contextlib.contextmanager
def timed_tables():
    """Seconds spent building the grid rule's tables (grid.prior_tables, final_look_tables) inside the block:
    {'seconds': ...}, filled when it ends."""
    spent, originals = {"seconds": 0.0}, (grid.prior_tables, grid.final_look_tables)

    def timed(build):
        def run(*args):
            start = time.perf_counter()
            try:
                return build(*args)
            finally:
                spent["seconds"] += time.perf_counter() - start
        return run
    grid.prior_tables, grid.final_look_tables = map(timed, originals)
    try:
        yield spent
    finally:
        grid.prior_tables, grid.final_look_tables = originals


def print_grid_table(results, reference, grid_arms, N, N0, levels):
    """(g)'s table: per arm the model evaluations (mean, median, 90th percentile, share run to its budget N0 +
    N_max, row['N_max'] where an arm has its own, else N; saving against CERTIFY at N), seconds, the wall time
    saved (the reference's seconds over the arm's), certified accuracy at each level and the examples on which
    it disagrees with the reference arm there.
    results: {arm: {'radius', 'correct', 'evals', 'time'}}, one entry per example in the same order for every arm."""
    ref = results[reference]
    print("    " + f"{'arm':24s}{'mean':>9s}{'median':>9s}{'p90':>9s}{'budget':>8s}{'saving':>8s}{'s':>8s}"
          f"{'wall':>7s}  certified accuracy (%) at r = " + " ".join(f"{r:g}" for r in levels) + "; disagreements")
    for name, row in results.items():
        ev = np.array(row["evals"])
        # CERTIFY always runs to its N, and a log whose times read 0 has no wall ratio: shown as '-'
        at_budget = f"{100 * np.mean(ev >= N0 + row.get('N_max', N)):7.0f}%" if name in grid_arms else f"{'-':>8s}"
        wall = f"{ref['time'] / row['time']:6.1f}x" if row["time"] > 0 else f"{'-':>7s}"
        certified = [np.array(row["correct"]) & (np.array(row["radius"]) >= r) for r in levels]
        disagree = [int(np.sum(c != (np.array(ref["correct"]) & (np.array(ref["radius"]) >= r))))
                    for c, r in zip(certified, levels)]
        print(f"    {name:24s}{ev.mean():9,.0f}{np.median(ev):9,.0f}{np.percentile(ev, 90):9,.0f}"
              f"{at_budget}{(N0 + N) / ev.mean():7.1f}x{row['time']:8.1f}{wall}  "
              + " ".join(f"{100 * np.mean(c):.1f}" for c in certified) + "; " + " ".join(map(str, disagree)),
              flush=True)


def grid_from_logs(paths):
    """(g) from certify.py logs of one model on the same examples (--grid-logs): the first is CERTIFY at the
    budget N (the reference), the others CERTIFY at another N or certify.py --radii runs. Certification logs
    resume, so a benchmark too long for one sitting (scripts/grid_cpu.sh) is built from them."""
    import analyze
    import compare
    names = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise common.UserError(f"--grid-logs: two logs named {twice[0]!r}: the arms are named by file name; rename "
                               f"one (or copy it under another name)")
    logs = analyze.load_logs(paths)
    for log in logs:   # every log first, before any work: the kinds this comparison can count
        check_bench_log(log)
    compare.check_same_images(logs)   # one model on one set of images, where the settings files say so
    said = [line for s, line in readers.check_comparable(logs, ("N", readers.IMAGES), "tools/bench.py --grid-logs")
            if s in (*readers.NOTED, readers.UNRECORDED)]   # N: by design; images below; one model by design
    sigmas = sorted({log["sigma"] for log in logs}, key=str)
    common.check(len(sigmas) == 1, f"--grid-logs: the logs were certified at sigmas {', '.join(map(str, sigmas))}: "
                                   f"the arms of one comparison share one sigma (the reference's pA and radii are "
                                   f"in its units)")
    named = [log for log in logs if log["sidecar"].get("checkpoint_sha256")]
    for log in named[1:]:
        common.check(log["sidecar"]["checkpoint_sha256"] == named[0]["sidecar"]["checkpoint_sha256"],
                     f"{log['path']}: certified another checkpoint than {named[0]['path']}; --grid-logs compares "
                     f"the arms of one model")
    results, grid_arms, radii = {}, set(), set()
    for log, name in zip(logs, names):
        cols = analyze.read_columns(log["path"], analyze.COHEN_COLUMNS, ("idx",))
        common.check("N" in log, f"{log['path']}: no N column (the draws made; certify.py writes it)")
        order = np.argsort(cols["idx"])
        results[name] = {"idx": cols["idx"][order], "y": log["y"][order], "radius": log["radius"][order],
                         "correct": log["correct"][order],
                         "evals": selection_draws(log) + log["N"][order],
                         "time": sum(readers.log_seconds(t, f"{log['path']} line {line}")
                                     for t, line in zip(cols["time"], cols["_line"]))}
        if log.get("grid"):
            grid_arms.add(name)
            results[name]["radii"] = log["sidecar"].get("radii") or []
            side = log["sidecar"]
            results[name]["levels"] = (side.get("alpha", 0.001), side.get("beta", grid.DEFAULT_BETA))
            results[name]["N_max"] = side.get("N")   # the arm's own budget, which may differ from the reference's N
            common.check(isinstance(results[name]["N_max"], int) and not isinstance(results[name]["N_max"], bool)
                         and results[name]["N_max"] >= 1, f"{log['path']}: its settings file gives N "
                         f"{results[name]['N_max']!r}; --grid-logs needs the grid's budget N_max (an integer)")
            radii.update(results[name]["radii"])
        if "nA" in log:
            results[name]["pA"] = np.asarray(log["nA"])[order] / np.asarray(log["N"])[order]
    reference = next(iter(results))
    for name, row in results.items():
        common.check(np.array_equal(row["idx"], results[reference]["idx"]),
                     f"{name}: not the examples of {reference} (finish both runs: certify.py resumes)")
    first = logs[0]
    N, N0 = first["sidecar"].get("N"), selection_draws(first)
    common.check(isinstance(N, int) and not first.get("grid"), f"{first['path']}: the first log must be CERTIFY "
                                                                f"(no --radii) with its settings file (N)")
    noise = noise_design(logs, names)
    print(f"  {len(results[reference]['idx'])} examples, sigma {first['sigma']}, N0 {N0}, reference "
          f"{reference} (N = {N:,}); evaluations N0 + N per example, seconds from the logs' time column; noise "
          f"{noise}:")
    for line in said:   # arms certified otherwise: their differences are not the grid's alone
        print(f"  note: the arms differ in {line}: a difference between them is not the grid's alone")
    print_grid_table(results, reference, grid_arms, N, N0, sorted(radii | {0.0}))
    arm_intervals(results, reference, {name: [r for r in results[name]["radii"] if r > 0] for name in grid_arms},
                  sorted(radii) or [0.0], noise.split(":")[0])
    if "pA" in results[reference]:
        for name in sorted(grid_arms):
            print_budget_bound(name, results[name], results[reference]["pA"], first["sigma"], N, N0)
        for name in sorted(grid_arms):
            print_oracle(name, results[name], results[reference]["pA"], first["sigma"], N, N0,
                        *results[name]["levels"])


def noise_design(logs, names):
    """How the arms' noise relates, from the seeds their settings files record (a 'random' seed by the value
    drawn): 'independent' when every arm has its own, 'paired' when all share one (agreement is then partly by
    construction), else which arms share the reference's. A log without a settings file counts as seed 0."""
    seeds = [log["sidecar"].get("seed_value") if log["sidecar"].get("seed") == "random"
             else log["sidecar"].get("seed", 0) for log in logs]
    if len(set(map(repr, seeds))) == len(seeds):
        return "independent: each arm its own seed"
    if len(set(map(repr, seeds))) == 1:
        return f"paired: every arm seed {seeds[0]}"
    shared = [name for name, seed in zip(names[1:], seeds[1:]) if repr(seed) == repr(seeds[0])]
    return (f"mixed: {', '.join(shared) or 'no arm'} share{'s' if len(shared) == 1 else ''} the reference's seed "
            f"{seeds[0]}, the other arms their own or each other's")


def selection_draws(log):
    """N0 of a CERTIFY or grid log: its settings file's, or Cohen's 100 for a log without one."""
    return log["sidecar"].get("N0", 100)


# The kinds of log (readers.LOG_KINDS) --grid-logs refuses; it counts N0 + N evaluations per example, so it
# takes certify.py's CERTIFY (the reference, and arms at other N) and grid logs, with or without r = 0.
GRID_LOGS_REFUSED = {"PREDICT": "it draws no estimation votes to compare",
                     "label mode": "it draws no selection votes (N0); certify without --label-mode",
                     "DDRS": "its sigma differs per input; --grid-logs compares certify.py logs of one model",
                     "semi-elastic": "its sigma differs per input; --grid-logs compares certify.py logs of one model"}


def check_bench_log(log):
    """The logs (g) can count (GRID_LOGS_REFUSED says which not, and why), with their selection draws N0."""
    path, side = log["path"], log["sidecar"]
    readers.check_log_kinds(log, side, GRID_LOGS_REFUSED, "tools/bench.py --grid-logs")
    N0 = side.get("N0", 100)
    common.check(isinstance(N0, int) and not isinstance(N0, bool) and N0 >= 1,
                 f"{path}: its settings file gives N0 {N0!r}; --grid-logs needs the selection draws (an integer)")


def arm_intervals(results, reference, grid_arms, radii, noise):
    """Per arm: its certified accuracy minus the reference's at each radius it decides (grid_arms: {name: its
    radii}; other arms: radii), with 95 % intervals that hold together over those radii (compare.compare_sides
    over the test images, paired by image): the row farthest from 0 and the verdict."""
    import compare
    as_log = lambda name: {"path": name, "grid": name in grid_arms, "label_mode": False,   # noqa: E731
                           "radius": np.maximum(np.array(results[name]["radius"]), 0.0),
                           "correct": np.array(results[name]["correct"]) & (np.array(results[name]["radius"]) >= 0),
                           "idx": np.array(results[name]["idx"]), "y": np.array(results[name]["y"]),
                           "predict": np.zeros(len(results[name]["idx"]), np.int64)}
    print(f"    certified accuracy of each arm minus the reference's ({noise} noise), 95 % intervals over the test "
          f"images holding together at every radius (compare.compare_sides): the row farthest from 0")
    for name in results:
        if name == reference:
            continue
        rows, _ = compare.compare_sides([as_log(reference)], [as_log(name)], grid_arms.get(name, radii))
        rows = [r for r in rows if r[0].startswith("certified accuracy")]
        worst = max(rows, key=lambda r: abs(r[3]))
        print(f"    {name:24s} {worst[0]}: {100 * worst[3]:+.1f} points [{100 * worst[4]:+.1f}, "
              f"{100 * worst[5]:+.1f}]; {verdict_by_radius(rows)}")


def verdict_by_radius(rows):
    """compare_sides' verdicts over the radii, said radius by radius where any is beyond noise: 'lower at r=1.5,
    r=1.75; within noise at the other 6' (not a bare 'lower, within noise', which reads as one verdict)."""
    by = {}
    for row in rows:
        by.setdefault(row[6], []).append(row[0].split()[-1])
    if set(by) == {"within noise"}:
        return "every radius within noise"
    beyond = "; ".join(f"{verdict} at {', '.join(radii)}" for verdict, radii in sorted(by.items())
                       if verdict != "within noise")
    rest = len(by.get("within noise", []))
    return beyond + (f"; within noise at the other {rest}" if rest else "")


@functools.lru_cache(maxsize=None)   # the same (p, tau) in every seed's run
def exact_ruleout_bound(p, tau, beta, N_max, iterations=40):
    """The smallest log-bound b of the SPRT that rules out tau (> p) once the likelihood ratio of p against tau
    reaches e^b, such that its exact error, the chance that a run with true probability tau ever reaches the
    bound within N_max draws, is at most beta. Ville's b = log(1 / beta) keeps the error below beta whatever the
    overshoot; this one spends beta exactly, as the grid rule's rule-outs do (grid.crossing_probability:
    an upper bound, so the error stays <= beta). The ratio grows with the other votes: after t draws of which
    m are not cA, log LR = (t - m) log(p / tau) + m log((1 - p) / (1 - tau)) >= b is m >= a threshold."""
    u, v = math.log(p / tau), math.log((1 - p) / (1 - tau))
    t = np.arange(1, N_max + 1)

    def error(b):   # m >= (b - t u) / (v - u): the other votes (probability 1 - tau) cross it
        return grid.crossing_probability(np.ceil((b - t * u) / (v - u) - 1e-12).astype(np.int64), t, 1 - tau)

    lo, hi = 0.0, math.log(1 / beta)   # error(hi) <= beta (Ville)
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if error(mid) <= beta else (mid, hi)
    return hi


def oracle_draws(pA, thresholds, alpha, beta, N_max, runs=200, seed=0, chunk=2048, exact_beta=False, per_run=False):
    """The reference of the grid rule: per example of true pA, the mean estimation draws (selection draws not
    included) of the oracle that knows pA and looks after every draw, and the share of its runs cut at N_max.

    thresholds: Phi(r_j / sigma), ascending (0.5 first unless the arm ran --no-zero-level). The oracle decides
    the example's level with Wald's sequential probability ratio tests against the known alternative pA: it
    certifies the highest threshold tau below pA once the likelihood ratio of pA against tau reaches 1 / alpha
    (wrong at tau with probability <= alpha, Ville), rules out the next one once that of pA against it reaches
    1 / beta, and stops when both are done (no level below pA: only the rule-out; none above: only the certify).
    Each SPRT needs the fewest draws on average at pA of all tests with its error and power (Wald and
    Wolfowitz 1948), so the rule, which does not know pA and looks only at its checks, spends more. With
    exact_beta the rule-out's bound is exact_ruleout_bound (its exact error beta, as the rule's rule-outs), not
    Ville's 1 / beta: fewer draws, the fairer reference for the rule's rule-outs. per_run: each run's draws, an
    array (examples, runs), instead of each example's mean (for the Monte Carlo error). Draws are
    simulated run by run (`runs` per example); a run still undecided at N_max is counted as N_max, as the rule
    would stop there (the share returned says how often: those are examples whose pA lies next to a threshold).
    """
    rng = np.random.default_rng(seed)
    thresholds = np.asarray(thresholds, float)
    means, capped = np.zeros((len(pA), runs) if per_run else len(pA)), np.zeros(len(pA))
    with np.errstate(divide="ignore"):
        for i, p in enumerate(np.asarray(pA, float)):
            below, above = thresholds[thresholds < p], thresholds[thresholds >= p]
            tests = ([(below.max(), math.log(1 / alpha))] if len(below) else []) + \
                    ([(above.min(), exact_ruleout_bound(p, above.min(), beta, N_max) if exact_beta and 0 < p
                       else math.log(1 / beta))] if len(above) else [])
            # the log likelihood ratio's step on a vote for cA and on any other vote (-inf where impossible)
            steps = np.array([[math.log(p / t) if p > 0 else -np.inf, math.log((1 - p) / (1 - t)) if p < 1
                               else -np.inf] for t, _ in tests])
            bounds = np.array([b for _, b in tests])
            walk, stop = np.zeros((len(tests), runs)), np.full((len(tests), runs), N_max)
            done = np.zeros((len(tests), runs), bool)   # p on a threshold: its steps are 0, never decided
            drawn = 0
            while drawn < N_max and not done.all():
                k = min(chunk, N_max - drawn)
                votes = rng.random((runs, k)) < p
                for j in range(len(tests)):
                    path = walk[j][:, None] + np.cumsum(np.where(votes, steps[j, 0], steps[j, 1]), axis=1)
                    hit = path >= bounds[j]
                    new = ~done[j] & hit.any(1)
                    stop[j, new] = drawn + hit[new].argmax(1) + 1
                    done[j] |= new
                    walk[j] = path[:, -1]
                drawn += k
            means[i] = stop.max(0) if per_run else stop.max(0).mean()
            capped[i] = np.mean(~done.all(0))
    return means, capped


def print_oracle(name, row, reference_pA, sigma, N, N0, alpha, beta):
    """The arm's mean estimation draws against the oracle's (oracle_draws) on the reference's pA estimates, the
    oracle cut at the arm's budget (row['N_max'], else N); its saving is against the reference's N0 + N."""
    from scipy.stats import norm
    thresholds = norm.cdf(np.asarray(sorted(set(row["radii"]))) / sigma)   # the arm's levels (0 unless --no-zero-level)
    draws = np.asarray(row["evals"], float) - N0
    oracle, capped = oracle_draws(reference_pA, thresholds, alpha, beta, row.get("N_max", N))   # the arm's budget
    cut = capped > 0
    line = (f"    oracle of {name}: an SPRT that knew each pA (the reference's nA / N) and looked after every draw "
            f"needs {oracle.mean():,.0f} estimation draws per example (it saves {(N0 + N) / (N0 + oracle.mean()):.1f}x "
            f"the reference's evaluations, N0 included); the arm spends {draws.mean():,.0f}, "
            f"{draws.mean() / oracle.mean():.2f}x (bench.oracle_draws)")
    if cut.all():   # nothing left to compare without them
        line += "; every example's oracle passes N_max in some runs (counted at N_max)"
    elif cut.any():
        line += (f"; {cut.sum()} examples' oracle passes N_max in some runs (counted at N_max): without them "
                 f"{draws[~cut].mean() / oracle[~cut].mean():.2f}x")
    print(line)


def print_budget_bound(name, row, reference_pA, sigma, N, N0):
    """What bounds a grid arm's saving: the examples that ran to its budget (undecided after N0 + N_max draws),
    their share of the arm's evaluations, and how close the reference's estimate nA / N of their pA lies to a
    threshold Phi(r / sigma) of the arm's radii (0.5 for r = 0), against the other examples."""
    from scipy.stats import norm
    evals = np.asarray(row["evals"])
    ran = evals >= N0 + row.get("N_max", N)   # the arm's own budget
    thresholds = norm.cdf(np.asarray(sorted(set(row["radii"]))) / sigma)   # the arm's levels (0 unless --no-zero-level)
    gap = np.min(np.abs(np.asarray(reference_pA)[:, None] - thresholds[None, :]), axis=1)
    line = (f"    bound of {name}: {ran.sum()} examples ({100 * ran.mean():.1f} %) ran to the budget and took "
            f"{100 * evals[ran].sum() / evals.sum():.0f} % of its evaluations")
    if ran.any() and not ran.all():
        line += (f"; the reference's pA estimate lies a median {np.median(gap[ran]):.4f} from a threshold "
                 f"Phi(r/sigma) for them, {np.median(gap[~ran]):.4f} for the others; without them the mean "
                 f"would be {evals[~ran].mean():,.0f} ({(N0 + N) / evals[~ran].mean():.1f}x)")
    print(line)


def bench_ddrs(paths, device, data_dir, N, examples, K=100, trust=False):
    """(h): seconds per example of DDRS (OptimizeSigma, then CERTIFY at sigma_x) against CERTIFY at sigma_0."""
    import ddrs
    for path in paths:
        t = trained_model(path, device, data_dir, examples, trust)
        model, ckpt, sigma, dataset_name = t["model"], t["ckpt"], t["sigma"], t["dataset_name"]
        dataset, picked, classes = t["dataset"], t["picked"], t["classes"]
        times = {"CERTIFY at sigma_0": 0.0, f"DDRS (K = {K}, M = 1) + CERTIFY at sigma_x": 0.0}
        for idx in picked:
            x = dataset[int(idx)][0].to(device)
            for name in times:
                start = time.perf_counter()
                s = sigma
                if name.startswith("DDRS"):
                    gens = [ddrs.sigma_generator(0, int(idx), device)]
                    s = float(ddrs.optimize_sigma(model, x.unsqueeze(0), sigma, K, 1, 1e-4, gens)[0])
                certify.certify(model, x, s, 100, N, 0.001, BATCH, classes, common.example_generator(0, int(idx),
                                                                                                     device))
                sync(device)
                times[name] += time.perf_counter() - start
        print(f"  {os.path.basename(os.path.dirname(os.path.abspath(path)))} ({ckpt.get('arch')}, {dataset_name}, "
              f"sigma_0 {sigma}), N = {N:,}, {len(picked)} examples:")
        for name, t in times.items():
            print(f"    {name:44s} {t / len(picked):8.3f} s per example")
        names = list(times)
        print(f"  {'DDRS / CERTIFY (time)':62s} {times[names[1]] / times[names[0]]:6.2f}x   "
              f"(the paper, App. F: 1.125x CIFAR-10, 1.24x ImageNet)")


def bench_early_abstain(paths, device, data_dir, N, examples, trust=False):
    """(d) for each model: evaluations and time of full vs early-abstaining CERTIFY on the same examples."""
    N0, alpha = 100, 0.001
    print(f"  N0 = {N0}, N = {N}, batch {BATCH}, alpha {alpha}; early abstention tests after "
          f"{certify.abstain_checks(N, BATCH)} draws, alpha_e = {certify.EARLY_ABSTAIN_ALPHA} in total")
    for path in paths:
        t = trained_model(path, device, data_dir, examples, trust)
        model, ckpt, sigma, dataset_name = t["model"], t["ckpt"], t["sigma"], t["dataset_name"]
        dataset, picked = t["dataset"], t["picked"]
        full, early, time_full, time_early = [], [], 0.0, 0.0
        for idx in picked:
            x, label = dataset[int(idx)]
            x = x.to(device)
            for rows, abstain in ((full, None), (early, certify.EARLY_ABSTAIN_ALPHA)):
                start = time.perf_counter()
                line = certify.example_line(model, x, int(label), int(idx), sigma, N0, N, alpha, BATCH,
                                            common.NUM_CLASSES[dataset_name], 0, False, "fp32", abstain)
                sync(device)
                rows.append(parse_line(line))
                if abstain is None:
                    time_full += time.perf_counter() - start
                else:
                    time_early += time.perf_counter() - start
        evaluations_full = sum(N0 + r["N"] for r in full)
        evaluations_early = sum(N0 + r["N"] for r in early)
        stopped = sum(r["N"] < N for r in early)
        changed = sum((a["predict"], a["radius"]) != (b["predict"], b["radius"]) for a, b in zip(full, early))
        print(f"  {os.path.basename(os.path.dirname(os.path.abspath(path)))} ({ckpt.get('arch')}, {dataset_name}, "
              f"sigma {sigma}), {len(picked)} test examples:")
        print(f"    stopped early: {stopped} of {len(picked)} (the full run abstains on "
              f"{sum(r['predict'] == -1 for r in full)}); prediction or radius changed on {changed}")
        saved = 100.0 * (1 - evaluations_early / evaluations_full)
        print(f"    model evaluations: full {evaluations_full}, early {evaluations_early}: {saved:.1f} % fewer"
              f"{'   target >= 30 % at sigma 1.0: ' + ('met' if saved >= 30 else 'NOT met') if sigma == 1.0 else ''}")
        print(f"    wall time: full {time_full:.1f} s, early {time_early:.1f} s: "
              f"{time_full / max(time_early, 1e-9):.2f}x faster")
        change = certified_accuracy_change(full, early)
        print(f"    largest change of certified accuracy at any radius: {change:.2f} points   "
              f"target <= 0.2: {'met' if change <= 0.2 else 'NOT met'}")


# ----------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------

def machine_line(device):
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in readers.read_lines("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (common.UserError, StopIteration):
        pass
    if device.type == "cuda":
        cpu += f"; GPU {torch.cuda.get_device_name(device)}"
    load = " ".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (f"machine: {cpu}, {os.cpu_count()} logical CPUs, load average {load}; python {platform.python_version()}, "
            f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, device {device}\n"
            f"environment: {machinery.environment_line()}")


class Tee(io.StringIO):
    """stdout that is also kept, for --report."""

    def __init__(self, stream):
        super().__init__()
        self.stream = stream

    def write(self, text):
        self.stream.write(text)
        return super().write(text)

    def flush(self):
        self.stream.flush()


def main():
    args = parse_args()
    if args.report:   # checked before the work: a report may not replace a file this project did not write
        problem = machinery.output_problem(args.report, args.grid_logs or [])
        common.check(problem is None, problem)
        tee = Tee(sys.stdout)
        with contextlib.redirect_stdout(tee):
            run_sections(args)
        machinery.write_text_output(args.report, "benchmark report", tee.getvalue(), args.grid_logs or [])
        return
    run_sections(args)


def run_sections(args):
    common.check(all(v is None or v >= 1 for v in (args.threads, args.reps, args.abstain_N, args.abstain_examples)),
                 "--threads, --reps, --abstain-N and --abstain-examples must be >= 1")
    common.check(args.threads is None or args.threads <= 4096, f"--threads must be at most 4096 (got {args.threads})")
    common.check(all(v is None or v >= 1 for v in (args.grid_N, args.grid_examples)),
                 "--grid-N and --grid-examples must be >= 1")
    common.check(all(math.isfinite(r) and r > 0 for r in args.grid_radii or ()), "--grid-radii must be finite "
                                                                                   "and positive")
    common.check(args.sections and set(args.sections) <= set("abcdefgh"), f"--sections takes letters of "
                                                                          f"'abcdefgh', got {args.sections!r}")
    # an option of sections that do not run, or one that --grid-logs makes moot, is refused, not ignored
    runs = set(args.sections) - ({"g"} if args.grid_logs else set())   # g from logs runs no model
    for options, sections in ((("grid_radii", "grid_noise"), "g"), (("grid_N", "grid_examples"), "gh"),
                              (("abstain_N", "abstain_examples"), "d"), (("checkpoint", "data_dir"), "dgh")):
        for option in options:
            common.check(getattr(args, option) is None or runs & set(sections),
                         f"--{option.replace('_', '-')} goes with --sections {' or '.join(sections)}"
                         + (" run on models, not --grid-logs" if args.grid_logs and "g" in sections else ""))
    common.check(args.grid_logs is None or "g" in args.sections, "--grid-logs goes with --sections g")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = machinery.get_device(args.device)
    if args.probe:
        return probe(device, args.probe, 1000)
    quick = args.quick
    reps = args.reps or (2 if quick else 5)
    N = 1000 if quick else 2000
    abstain_N = args.abstain_N or (2000 if quick else 10_000)
    abstain_examples = args.abstain_examples or (20 if quick else 150)
    use_compile = not (quick or args.no_compile)
    started = time.time()
    print(machine_line(device))
    if hasattr(os, "getloadavg") and os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1) and not args.threads:
        print("note: other work is running on this machine; with several torch threads the figures include time "
              "the threads spend waiting for each other (try --threads 1)")
    print(f"settings: {'--quick' if quick else 'full'}, {reps} interleaved repetitions per comparison, "
          f"batch {BATCH}, certify N0 = {max(1, N // 1000)} + N = {N} per measurement (the paper's N0/N = "
          f"1/1000), torch.compile rows: {'on' if use_compile else 'off'}", flush=True)

    if "a" in args.sections:
        print(f"\n(a) certification, {ARCH}, one input, noise samples per second", flush=True)
        bench_certify(device, reps, N, use_compile)
        print("\n(a') certification as shipped: certify.py's process keeps freed memory (glibc), the textbook's "
              "does not", flush=True)
        bench_as_shipped(device, 1000, 1 if quick else 3)
    if "b" in args.sections:
        print("\n(b) training, noisy samples per second", flush=True)
        bench_training(device, args.reps or (2 if quick else 3), steps=1 if quick else 2,
                       images_per_step=16 if quick else 64, T=1 if quick else None)
    if "c" in args.sections:
        print(f"\n(c) train-time pA estimation, {ARCH}, samples per second", flush=True)
        bench_pA(device, reps, examples=10 if quick else 30)
    if "d" in args.sections:
        print("\n(d) early abstention (--early-abstain)", flush=True)
        with tempfile.TemporaryDirectory() as folder:
            paths = args.checkpoint or train_digits_models(folder, 5 if quick else 20)
            bench_early_abstain(paths, device, args.data_dir, abstain_N, abstain_examples, args.trust_checkpoint)
    if "f" in args.sections:
        print("\n(f) sound sampling (certify.py --sound)", flush=True)
        bench_sound(device, reps, 1 if quick else 3)
    if "g" in args.sections:
        print("\n(g) anytime-valid certification at a grid of radii (--radii)", flush=True)
        if args.grid_logs:
            grid_from_logs(args.grid_logs)
        else:
            with tempfile.TemporaryDirectory() as folder:
                paths = args.checkpoint or train_digits_models(folder, 5 if quick else 20, sigmas=(0.25, 0.5))
                bench_grid(paths, device, args.data_dir, args.grid_N or (10_000 if quick else 100_000),
                           args.grid_examples or (10 if quick else 100), args.trust_checkpoint, args.grid_radii,
                           args.grid_noise or "independent")
    if "h" in args.sections:
        print("\n(h) DDRS certification against plain CERTIFY (ddrs.py certify)", flush=True)
        with tempfile.TemporaryDirectory() as folder:
            paths = args.checkpoint or train_digits_models(folder, 5 if quick else 20, sigmas=(0.25,))
            bench_ddrs(paths, device, args.data_dir, args.grid_N or (10_000 if quick else 100_000),
                       args.grid_examples or (5 if quick else 50), trust=args.trust_checkpoint)
    if "e" in args.sections:
        print("\n(e) baselines (train_baselines.py): seconds per CIFAR-10 epoch against Gaussian training", flush=True)
        bench_baselines(device, args.reps or (1 if quick else 3), "bf16", True)
    print(f"\ndone in {time.time() - started:.0f} s; {machine_line(device).split(';')[0]} at the end")


if __name__ == "__main__":
    machinery.run(main, exit_process=True)

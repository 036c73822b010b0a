"""The GPU check: proves the CUDA paths right and measures paper-scale speed, in one summary (docs/speed.md).

Usage: make gpu-check                          (= python tools/gpu_check.py; under 9 minutes on one H100)
       python tools/gpu_check.py --smoke     (tiny sizes on any device, the CPU included: does it run?)

1. The CUDA tests (`pytest -m cuda`): certify in fp32/bf16/fp16, channels-last, folded BatchNorm, compile and
   --sound against the plain path, resume; every training script under --amp bf16/fp16, resumed exactly; no
   host synchronisation in the counter and the attacks; torchrun with nccl.
2. Certification of cifar_resnet110 (random weights: speed does not depend on them) at N = 100,000 on a few
   CIFAR-shaped inputs: the textbook CERTIFY loop of tools/bench.py (fp32) against certify.certify in fp32 with
   TF32 off and on, bf16, and bf16 compiled; noise samples per second, seconds per image and the projected
   hours for the 10,000-image test set. The paper's logs took 3.6 s per image (Cohen et al.'s 16.9 s).
   ImageNet's resnet50 the same at N = 10,000 (hours projected for the 500 images of the paper's logs).
3. Training throughput of cifar_resnet110 with m = 4: Gaussian training and the paper's method (T = 6), a
   plain fp32 eager loop against common.train_epoch with --amp bf16 --channels-last, as seconds per epoch
   (50,000 images: 196 loader batches of 256, each cut into m steps of 256 noisy inputs).
Targets (one H100): certify bf16 under 0.36 s per image (10x the paper), fp32 under 1.2 s (3x), both at least
3x the textbook loop; training with --amp --channels-last at least 2x the fp32 eager loop. Measured on one H200
(results/gpu/README.md): every CUDA test passes, none of these targets is met; certify bf16 runs within 2 % of
the model's forward passes alone (the row "forward passes alone (bf16)"), which are the limit.
"""
import argparse
import copy
import os
import platform
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import bench  # noqa: E402
import certify  # noqa: E402
import common  # noqa: E402
import machinery  # noqa: E402
import train_ours  # noqa: E402

PAPER_SECONDS_PER_IMAGE = 3.6    # the paper's CIFAR-10 logs, ResNet-110, N = 100,000


def parse_args(argv=None):
    p = machinery.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (cifar_resnet20, N0 = N = 50, one step of 4 "
                                                        "images): checks that the script runs, on any device")
    p.add_argument("--device", help="default: cuda when available")
    p.add_argument("--no-tests", action="store_true", help="skip the CUDA tests (part 1)")
    p.add_argument("--images", type=int, help="certified inputs per variant (default 3; --smoke 1)")
    p.add_argument("--batch", type=int, default=bench.BATCH, help="noisy CIFAR-10 inputs per forward pass in part 2 "
                                                                  "(default: certify.py's, 1000; ImageNet: 250)")
    p.add_argument("--no-training", action="store_true", help="skip the training throughput (part 3)")
    args = p.parse_args(argv)
    common.check(args.images is None or args.images >= 1, f"--images must be >= 1 (got {args.images})")
    common.check(args.batch >= 1, f"--batch must be >= 1 (got {args.batch})")
    return args


def device_line(device):
    """One line: the GPU (or CPU), torch, CUDA and cuDNN versions, then the environment (machinery.environment)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "CPU")
    return (f"device {name}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"cuDNN {torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}; "
            f"{machinery.environment_line()}")


def cuda_tests():
    """Part 1: the marked tests in a child process; returns pytest's last line."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", os.path.join(ROOT, "tests")],
                          cwd=ROOT, capture_output=True, text=True)
    print(proc.stdout[-3000:], flush=True)
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else f"pytest exit {proc.returncode}"


def seconds_per_image(fn, images, device, warmup=True):
    """Mean wall seconds of fn(i) over inputs i = 0 .. images - 1, after one warm-up call (--smoke: none)."""
    if warmup:
        fn(0)
    bench.sync(device)
    start = time.perf_counter()
    for i in range(images):
        fn(i)
    bench.sync(device)
    return (time.perf_counter() - start) / images


def certification(arch, dataset, N, images, test_size, device, use_compile=True, warmup=True, batch=bench.BATCH):
    """Part 2 for one model: {variant: seconds per image}. Each variant runs with its own TF32 setting: the
    textbook loop and bf16 with torch's defaults (TF32 in convolutions, not in matmuls), fp32 with it off and on."""
    N0, sigma = min(100, N), 0.5   # --smoke: N0 = N = 50
    torch.manual_seed(0)
    plain = common.get_architecture(arch, dataset).to(device).eval()
    fast = certify.fast_model(copy.deepcopy(plain), True, False, [], "fp32", fold_bn=True)
    shape = common.INPUT_SHAPE[dataset]
    inputs = [torch.rand(*shape, device=device) for _ in range(images)]
    classes = common.NUM_CLASSES[dataset]
    batch = batch if dataset != "imagenet" else 250

    def ours(model, precision):
        return lambda i: certify.certify(common.in_precision(model, precision), inputs[i], sigma, N0, N, 0.001,
                                         batch, classes, common.example_generator(0, i, device))

    defaults, off, on = (False, True), (False, False), (True, True)   # (matmul, cudnn) TF32
    variants = {"textbook CERTIFY (fp32)": (lambda i: bench.textbook_certify(
        plain, inputs[i], sigma, N0, N, 0.001, batch, classes, common.example_generator(0, i, device)), defaults),
        "certify fp32, TF32 off": (ours(fast, "fp32"), off), "certify fp32, TF32 on": (ours(fast, "fp32"), on),
        "certify bf16": (ours(fast, "bf16"), defaults)}
    noise = torch.randn(batch, *shape, device=device)

    def forward_alone(i):   # the floor: the same passes of the bf16 model on fixed noise, nothing counted
        model = common.in_precision(fast, "bf16")
        with torch.inference_mode():
            for k in common.pass_sizes(N0 + N, batch):
                model(noise[:k])
    variants["forward passes alone (bf16)"] = (forward_alone, defaults)
    if device.type != "cuda":   # TF32 is a CUDA setting: on the CPU the two fp32 rows are one
        del variants["certify fp32, TF32 on"]
    if use_compile:
        shapes = certify.pass_shapes(shape, N0, N, batch, False)
        compiled = certify.fast_model(copy.deepcopy(plain), True, True, shapes, "bf16", fold_bn=True)
        if isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule):
            variants["certify bf16 --compile"] = (ours(compiled, "bf16"), defaults)
    results = {}
    for name, (fn, (matmul, cudnn)) in variants.items():
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
        results[name] = seconds_per_image(fn, images, device, warmup)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = defaults
    print(f"\n  {arch} ({dataset}), N0 = {N0}, N = {N:,}, batch {batch}, {images} inputs:")
    for name, s in results.items():
        print(f"    {name:28s} {(N0 + N) / s:12,.0f} samples/s {s:9.3f} s/image "
              f"{s * test_size / 3600:8.2f} h for {test_size:,} images", flush=True)
    return results


def training(device, steps, T, images=64, warmup=True):
    """Part 3: seconds per CIFAR-10 epoch of cifar_resnet110, m = 4, Gaussian and Alg. 2 (T attack steps), from
    steps of `images` images (--smoke: 8 of them; the epoch time is then not the real one)."""
    m, sigma = 4, 0.5
    torch.manual_seed(0)
    arch = "cifar_resnet110" if steps > 1 else "cifar_resnet20"    # --smoke: the small one
    base = common.get_architecture(arch, "cifar10").to(device)
    x = torch.rand(steps, images, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (steps, images), device=device)
    batches = [(x[k], y[k], torch.arange(images, device=device)) for k in range(steps)]
    losses = {"Gaussian": lambda f, x, y, idx: common.gaussian_loss(f, x, y, sigma, m),
              f"ours (T = {T})": lambda f, x, y, idx: train_ours.ours_loss(f, x, y, sigma, m, T, 0.25, "l2")}
    steps_per_epoch = 196 * m * 64 // images   # 50,000 / 256 loader batches, each m steps of 64 images x m copies
    results = {}
    print(f"\n  {arch} training, m = {m}, one step = {images} images x {m} noisy copies:")
    for name, loss_fn in losses.items():
        for variant, (fast, precision) in {"fp32 eager": (False, "fp32"),
                                           "--amp bf16 --channels-last": (True, "bf16")}.items():
            run = bench.train_fn(base, batches, loss_fn, device, fast, precision, plain_loop=not fast)
            if warmup:
                run()
            bench.sync(device)
            start = time.perf_counter()
            run()
            bench.sync(device)
            per_epoch = (time.perf_counter() - start) / steps * steps_per_epoch
            results[(name, variant)] = per_epoch
            print(f"    {name:14s} {variant:28s} {per_epoch:9.1f} s per epoch", flush=True)
    return results


def pass_or_fail(ok):
    return "met" if ok else "NOT met"


def main(argv=None):
    args = parse_args(argv)
    device = machinery.get_device(args.device)
    # Paper-scale sizes on a CPU take hours and measure nothing this check is for: a GPU is required, and --smoke
    # (tiny sizes) is what runs anywhere.
    common.check(args.smoke or device.type == "cuda", f"gpu_check.py needs a CUDA device (found {device.type}); "
                 "--smoke runs its paths at tiny sizes on any device")
    start = time.time()
    print(device_line(device), flush=True)
    summary = [device_line(device)]
    if not args.no_tests:
        print("\n1. CUDA tests (pytest -m cuda)", flush=True)
        summary.append(f"CUDA tests: {cuda_tests()}")
    images = args.images or (1 if args.smoke else 3)
    print("\n2. certification", flush=True)
    if args.smoke:
        cifar = certification("cifar_resnet20", "cifar10", 50, images, 10_000, device, use_compile=False,
                              warmup=False, batch=args.batch)   # tiny sizes: the times are not measurements, only the paths run
    else:
        cifar = certification("cifar_resnet110", "cifar10", 100_000, images, 10_000, device, batch=args.batch)
        certification("resnet50", "imagenet", 10_000, images, 500, device)
    textbook = cifar["textbook CERTIFY (fp32)"]
    fp32 = min(s for name, s in cifar.items() if name.startswith("certify fp32"))
    bf16 = min(s for name, s in cifar.items() if name.startswith("certify bf16"))
    summary += [f"certify CIFAR-10 bf16: {bf16:.3f} s/image, {PAPER_SECONDS_PER_IMAGE / bf16:.1f}x the paper's "
                f"3.6 s (target >= 10x: {pass_or_fail(PAPER_SECONDS_PER_IMAGE / bf16 >= 10)}), "
                f"{textbook / bf16:.1f}x the textbook loop (target >= 3x: {pass_or_fail(textbook / bf16 >= 3)})",
                f"certify CIFAR-10 fp32: {fp32:.3f} s/image, {PAPER_SECONDS_PER_IMAGE / fp32:.1f}x the paper "
                f"(target >= 3x: {pass_or_fail(PAPER_SECONDS_PER_IMAGE / fp32 >= 3)}), {textbook / fp32:.1f}x the "
                f"textbook loop (target >= 3x: {pass_or_fail(textbook / fp32 >= 3)})"]
    print("\n3. training", flush=True)
    train = {} if args.no_training else training(device, 1 if args.smoke else 8, 1 if args.smoke else 6, 4 if args.smoke else 64,
                     warmup=not args.smoke)
    for name in () if args.no_training else ("Gaussian", f"ours (T = {1 if args.smoke else 6})"):
        ratio = train[(name, "fp32 eager")] / train[(name, "--amp bf16 --channels-last")]
        summary.append(f"training {name}: {train[(name, '--amp bf16 --channels-last')]:.0f} s/epoch with --amp "
                       f"--channels-last, {ratio:.2f}x the fp32 eager loop (target >= 2x: {pass_or_fail(ratio >= 2)})")
    print("\nSummary" + (" (--smoke: tiny sizes, the targets do not apply)" if args.smoke else ""))
    for line in summary:
        print(f"  {line}")
    print(f"  wall time {time.time() - start:.0f} s")


if __name__ == "__main__":
    machinery.run(main, exit_process=True)

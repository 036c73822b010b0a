"""The GPU check: the CUDA paths right, and each speed figure against a ceiling or baseline measured in the same
run, with its target met or NOT met (docs/speed.md).

Usage: make gpu-check                        (= python tools/gpu_check.py; within 8 minutes on one H100 or H200)
       python tools/gpu_check.py --smoke     (the same rows at tiny sizes, on any device, the CPU included)

The paper-scale parts read a few thousand CIFAR-10 images (--data-dir, default data/cifar10_small: made by
`python tools/cifar_subset.py --source CIFAR10_IMAGE_FOLDERS`); without them those rows say so.
1. The CUDA tests (`pytest -m cuda`, at most 150 s).
2. Certification of cifar_resnet110 (random weights: speed does not depend on them) in bf16, N0 = 100,
   N = 100,000, at the batch certify.py's `--batch auto` picks on this GPU: certify.certify eager against the
   eager forward passes of the same model, precision and batch on fixed noise (target >= 0.95 of their rate),
   and the same compiled (>= 0.90); Cohen et al.'s loop (tools/bench.py's textbook CERTIFY, fp32, batch
   1,000) for reference; the share of the wall time the GPU's kernels fill (tools/profile_step.py).
3. Training throughput of cifar_resnet110, m = 4, 64 images x 4 noisy copies a step, an "epoch" of 32 steps
   (Gaussian) or 12 (the paper's method, T = 6): the plain fp32 eager loop against train_epoch with --amp bf16
   --channels-last, the same with cudnn.benchmark, the same with --cuda-graph (each epoch's first
   common.GRAPH_WARMUP steps eager, then one capture: counted in), and (when the budget allows, last) with
   --compile --cuda-graph; target >= 2x; the kernel share of the fastest step (>= 80 %: the kernels themselves
   bound it).
4. The paper's commands at paper scale: train_ours.py with the paper's CIFAR-10 sigma 0.5 settings
   (cifar_resnet110, m 4, T 6, eps 0.25; scaled to one epoch: Et 0, and pt 0, as an untrained model's pA
   estimates say nothing, so that it trains on every class and its pA spread) for one epoch on --data-dir,
   --amp bf16 --channels-last; then certify.py on 20 test images (every 5th) at N = 100,000, bf16,
   --compile: each command's seconds.
5. The grid at ResNet-110's cost: certify.py --radii 0.25 0.5 0.75 1 on the same 20 images and model (eager
   bf16; its passes change size, which compilation would specialise on), its draws and seconds against
   CERTIFY's (N0 + N draws an image, part 2's eager seconds per image): wall-clock saving / draw saving,
   target >= 0.8; the spread of pA (nA / N of part 4's log) says which inputs it ran on.
"""
import argparse
import copy
import os
import platform
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
import bench  # noqa: E402
import certify  # noqa: E402
import common  # noqa: E402
import machinery  # noqa: E402
import profile_step  # noqa: E402
import readers  # noqa: E402
import train_ours  # noqa: E402

BUDGET = 470          # seconds: the whole check, under the 8 minutes asked of it on one H100 or H200
TESTS_LIMIT = 150     # seconds the CUDA tests may take
COMPILE_TRAINING = 100   # seconds a --compile training row needs (compiling ResNet-110's step): run only if left
GRID_RADII = ["0.25", "0.5", "0.75", "1"]


def parse_args(argv=None):
    p = machinery.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (cifar_resnet20, N0 = 10, N = 100, one step of "
                                                        "4 images, digits for the commands): do the paths run?")
    p.add_argument("--device", help="default: cuda when available")
    p.add_argument("--data-dir", default=os.path.join(ROOT, "data", "cifar10_small"),
                   help="CIFAR-10 image folders for parts 4 and 5 (default data/cifar10_small)")
    p.add_argument("--no-tests", action="store_true", help="skip the CUDA tests (part 1)")
    p.add_argument("--batch", type=int, help="noisy inputs per pass in part 2 (default: certify.py's --batch auto)")
    p.add_argument("--no-training", action="store_true", help="skip the training throughput (parts 3 and 3')")
    p.add_argument("--images", type=int, help="inputs timed per certification row (default 3; --smoke 1)")
    p.add_argument("--budget", type=float, default=BUDGET, help=f"seconds the check may take (default {BUDGET}); "
                   "a part that would not fit in what is left is skipped, with a row saying so")
    args = p.parse_args(argv)
    common.check(args.images is None or args.images >= 1, f"--images must be >= 1 (got {args.images})")
    common.check(args.batch is None or args.batch >= 1, f"--batch must be >= 1 (got {args.batch})")
    common.check(args.budget > 0, f"--budget must be > 0 (got {args.budget})")
    return args


class Report:
    """The summary rows: each a figure, its baseline or ceiling, and its target met or NOT met."""

    def __init__(self, budget):
        self.rows, self.start, self.budget = [], time.time(), budget

    def left(self):
        return self.budget - (time.time() - self.start)

    def add(self, text, ok=None, target=None):
        verdict = "" if target is None else f" (target {target}: {'met' if ok else 'NOT met'})"
        self.rows.append(text + verdict)

    def skip(self, what, why):
        self.rows.append(f"{what}: not measured ({why})")


def relative_paths(text):
    """text with the machine's paths cut: the repository's, site-packages' and the standard library's."""
    cuts = [(ROOT + os.sep, "")]
    cuts += [(path + os.sep, "site-packages" + os.sep) for path in {sysconfig.get_paths()["purelib"],
                                                                     sysconfig.get_paths()["platlib"]}]
    cuts += [(sysconfig.get_paths()["stdlib"] + os.sep, f"python{sys.version_info[0]}.{sys.version_info[1]}" + os.sep)]
    for long, short in sorted(cuts, key=lambda c: -len(c[0])):
        text = text.replace(long, short)
    return re.sub(r"at /\S*/(torch/csrc/)", r"at \1", text)


def device_line(device):
    """One line: the GPU (or CPU), torch, CUDA and cuDNN versions, then the environment (machinery.environment)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "CPU")
    return (f"device {name}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"cuDNN {torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}; "
            f"{machinery.environment_line()}")


def cuda_tests(limit):
    """Part 1: the marked tests in a child process; returns pytest's last line (or why there is none)."""
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
                               os.path.join(ROOT, "tests")], cwd=ROOT, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return f"stopped after {limit} s"
    print(relative_paths(proc.stdout[-3000:]), flush=True)
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else f"pytest exit {proc.returncode}"


def timed(fn, device):
    bench.sync(device)
    start = time.perf_counter()
    fn()
    bench.sync(device)
    return time.perf_counter() - start


def paired(a, b, images, device):
    """Median seconds of a(i) and of b(i), i = 0 .. images - 1, taken in turns after one warm-up call of each."""
    a(0), b(0)
    times = [(timed(lambda: a(i), device), timed(lambda: b(i), device)) for i in range(images)]
    return statistics.median(t for t, _ in times), statistics.median(t for _, t in times)


def certification(report, device, smoke, images, batch=None):
    """Part 2; returns certify's eager seconds per image (part 5's CERTIFY), or None."""
    arch, N0, N, sigma = ("cifar_resnet20", 10, 100, 0.5) if smoke else ("cifar_resnet110", 100, 100_000, 0.5)
    precision = "bf16" if device.type == "cuda" else "fp32"   # a CPU without bf16 instructions emulates it
    torch.manual_seed(0)
    plain = common.get_architecture(arch, "cifar10").to(device).eval()
    fast = certify.fast_model(copy.deepcopy(plain), True, False, [], precision, fold_bn=True)
    shape = common.INPUT_SHAPE["cifar10"]
    given = batch is not None   # else as certify.py's --batch auto finds it
    batch = batch or common.auto_batch(plain, shape, device, precision,
                                       common.batch_cap(N0, N, shape, machinery.MAX_BATCH_BYTES))
    inputs = [torch.rand(*shape, device=device) for _ in range(images + 1)]
    noise = torch.randn(min(batch, N), *shape, device=device)   # the passes' inputs, fp32 NCHW as certify's
    passes = common.pass_sizes(N0, batch) + common.pass_sizes(N, batch)

    def certify_fn(model):
        return lambda i: certify.certify(common.in_precision(model, precision), inputs[i], sigma, N0, N, 0.001,
                                         batch, 10, common.example_generator(0, i, device))

    def forward_fn(model):   # the ceiling: the same passes of the same model on fixed noise, nothing counted
        def run(i):
            with torch.inference_mode():
                for k in passes:
                    common.in_precision(model, precision)(noise[:k])
        return run
    print(f"\n  {arch}, {precision}, N0 = {N0}, N = {N:,}, batch {batch:,}{'' if given else ' (--batch auto)'}, "
          f"{images} inputs:",
          flush=True)
    rows = {}
    eager, ceiling = paired(certify_fn(fast), forward_fn(fast), images, device)
    rows["eager"] = (eager, ceiling)
    compiled, attempted = None, report.left() > 150 or smoke
    if attempted:
        shapes = certify.pass_shapes(shape, N0, N, batch, False)
        start = time.time()
        compiled = certify.fast_model(copy.deepcopy(plain), True, not smoke, shapes, precision, fold_bn=True)
        print(f"    compiled {len(shapes)} shapes in {time.time() - start:.0f} s", flush=True)
        if smoke or isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule):   # else: fell back to eager
            rows["compiled" if not smoke else "compiled (--smoke: eager)"] = paired(
                certify_fn(compiled), forward_fn(compiled), images, device)
        else:
            compiled = None
    textbook_batch = min(1000, N)
    textbook = lambda i: bench.textbook_certify(plain, inputs[i], sigma, N0, N, 0.001, textbook_batch, 10,
                                                common.example_generator(0, i, device))
    textbook(0)
    cohen = statistics.median(timed(lambda: textbook(i), device) for i in range(min(images, 2)))
    for name, (ours, ceil) in rows.items():
        print(f"    certify {name:28s} {(N0 + N) / ours:12,.0f} samples/s {ours:8.3f} s/image; forward passes "
              f"alone {(N0 + N) / ceil:12,.0f} samples/s: {ceil / ours:.3f} of the ceiling", flush=True)
    print(f"    Cohen et al.'s loop (fp32, batch {textbook_batch:,}) {(N0 + N) / cohen:12,.0f} samples/s "
          f"{cohen:8.3f} s/image", flush=True)
    for name, fn in [("certify eager", certify_fn(fast)), ("forward passes eager", forward_fn(fast))] + (
            [("certify compiled", certify_fn(compiled)), ("forward passes compiled", forward_fn(compiled))]
            if compiled is not None else []):
        profile_step.show(name, profile_step.kernel_share(lambda: fn(0), device))
    report.add(f"certify {arch} {precision} eager, batch {batch:,}: {eager:.3f} s/image, "
               f"{rows['eager'][1] / eager:.3f} of the eager forward-pass rate", rows["eager"][1] / eager >= 0.95,
               ">= 0.95")
    name = next((n for n in rows if n.startswith("compiled")), None)
    if name is None:
        report.skip("certify --compile against the compiled forward-pass rate",
                    "torch.compile fell back to eager: its note above" if attempted else "budget")
    else:
        ours, ceil = rows[name]
        report.add(f"certify {arch} {precision} --compile{' (--smoke: eager)' if smoke else ''}, batch {batch:,}: "
                   f"{ours:.3f} s/image, {ceil / ours:.3f} of the compiled forward-pass rate", ceil / ours >= 0.90,
                   ">= 0.90")
    best = min(t for t, _ in rows.values())
    report.add(f"certify {arch}: {best:.3f} s/image, {cohen / best:.2f}x Cohen et al.'s loop (fp32, batch "
               f"{textbook_batch:,}: {cohen:.3f} s/image)")
    return eager


def training(report, device, smoke, plain=None):
    """Part 3: inputs/s of each variant, the speed-ups against the plain fp32 eager loop, the kernel share.
    plain: {loss name: the plain loop's inputs/s} measured before: then only the --compile rows run (part 3').
    Returns the plain loop's inputs/s per loss."""
    arch, images, m, T, steps = ("cifar_resnet20", 4, 4, 1, 4) if smoke else ("cifar_resnet110", 64, 4, 6, 32)
    sigma, eps = 0.5, train_ours.PRESETS["cifar10"][0.5]["eps"]
    precision = "bf16" if device.type == "cuda" else "fp32"   # a CPU without bf16 instructions emulates it
    torch.manual_seed(0)
    base = common.get_architecture(arch, "cifar10").to(device)
    x = torch.rand(steps, images, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (steps, images), device=device)
    batches = [(x[k], y[k], torch.arange(images, device=device)) for k in range(steps)]
    losses = {"Gaussian": lambda f, x, y, idx: common.gaussian_loss(f, x, y, sigma, m),
              f"ours (T = {T})": lambda f, x, y, idx: train_ours.ours_loss(f, x, y, sigma, m, T, eps, "l2")}
    fast = f"--amp {precision} --channels-last" if precision != "fp32" else "--channels-last"
    variants = {"plain fp32 eager loop": dict(), fast: dict(fast=True),
                "the same, cudnn.benchmark": dict(fast=True, benchmark=True)}
    if device.type == "cuda":
        variants[f"{fast} --cuda-graph"] = dict(fast=True, benchmark=True, graph=True)
    if plain is not None:
        variants = {f"{fast} --compile --cuda-graph": dict(fast=True, benchmark=True, compiled=True, graph=True)}
    print(f"\n  {arch} training, m = {m}, {images} images x {m} noisy copies a step, {steps} steps:", flush=True)
    measured = {}
    for name, loss_fn in losses.items():
        if plain is not None and report.left() < COMPILE_TRAINING:
            report.skip(f"training {name} with --compile", "budget")
            continue
        todo = batches if name == "Gaussian" else batches[:max(1, steps * 3 // 8)]   # >= 2 replays a --cuda-graph epoch
        rates, runs = ({} if plain is None else {"plain fp32 eager loop": plain[name]}), {}
        for variant, how in variants.items():
            model = copy.deepcopy(base)
            if how.get("fast"):
                model = model.to(memory_format=torch.channels_last)
            optimizer = common.make_optimizer(model)
            stepper = common.step_model(model, how.get("compiled", False))
            if how.get("fast"):
                run = lambda s=stepper, o=optimizer, g=how.get("graph", False): common.train_epoch(
                    s, todo, o, loss_fn, 1, device, precision=precision, graph=g)
            else:
                run = lambda s=stepper, o=optimizer: bench.plain_train_steps(s, o, todo, loss_fn)
            torch.backends.cudnn.benchmark = how.get("benchmark", False)
            start = time.time()
            try:
                run()   # warm-up: allocations, cuDNN's choices, compilation
            except Exception as e:   # torch.compile's or a capture's failures: a row says so, the check goes on
                if not (how.get("compiled") or how.get("graph")):
                    raise
                print(f"    {name:14s} {variant:28s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            warm = time.time() - start
            rates[variant] = len(todo) * images * m / timed(run, device)
            runs[variant] = (run, how.get("benchmark", False))
            print(f"    {name:14s} {variant:28s} {rates[variant]:10,.0f} noisy inputs/s"
                  f"{f' (compiled in {warm:.0f} s)' if how.get('compiled') else ''}", flush=True)
        if len(rates) < 2:
            report.add(f"training {name} with --compile: failed (above)", False, ">= 2x")
            continue
        fastest = max((v for v in rates if v != "plain fp32 eager loop"), key=rates.get)
        run, benchmark = runs[fastest]
        torch.backends.cudnn.benchmark = benchmark
        prof = profile_step.kernel_share(run, device)
        profile_step.show(f"{name}, {fastest}", prof)
        torch.backends.cudnn.benchmark = False
        ratio = rates[fastest] / rates["plain fp32 eager loop"]
        measured[name] = rates["plain fp32 eager loop"]
        share = "n/a on a CPU" if prof["share"] is None else f"{100 * prof['share']:.0f} %"
        report.add(f"training {name}: {rates[fastest]:,.0f} noisy inputs/s with {fastest}, {ratio:.2f}x the plain fp32 "
                   f"eager loop; the GPU kernels' share of its step {share} (>= 80 %: they bound it)", ratio >= 2,
                   ">= 2x")
    return measured


def log_rows(path):
    """certify.py's log as one dict a line, {column: cell} (readers.read_log_prefix: complete lines only)."""
    columns = readers.read_header(path).split("\t")
    return [dict(zip(columns, line.split("\t"))) for line in readers.read_log_prefix(path, columns)[0]]


def command(argv, limit, tmp):
    """Run one of the project's commands; returns its wall seconds (None if it failed), printing its last lines."""
    shown = [a.replace(tmp, "TMP") if a.startswith(tmp) else os.path.relpath(a, ROOT) if os.path.isabs(a) else a
             for a in argv]
    print(f"    $ python {' '.join(shown)}", flush=True)
    start = time.time()
    try:
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=max(limit, 1))
    except subprocess.TimeoutExpired:
        print(f"    stopped after {limit:.0f} s", flush=True)
        return None
    seconds = time.time() - start
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-4:]
    print("\n".join("      " + relative_paths(line.replace(tmp, "TMP"))[:160] for line in tail), flush=True)
    return seconds if proc.returncode == 0 else None


def paper_scale_and_grid(report, device, smoke, data_dir, certify_seconds):
    """Parts 4 and 5 in a temporary folder (nothing left in the repository)."""
    if device.type == "cuda":   # the memory this process keeps cached is the commands' to use (--batch auto)
        torch.cuda.empty_cache()
    have_data = not smoke and os.path.isdir(os.path.join(data_dir, "train")) and \
        os.path.isdir(os.path.join(data_dir, "test"))   # --smoke: digits, minutes less on a CPU
    if not smoke and not have_data:
        for what in ("paper-scale train_ours.py and certify.py", "the grid at ResNet-110's cost"):
            report.skip(what, f"no CIFAR-10 images in {os.path.relpath(data_dir, ROOT)}: python tools/cifar_subset.py")
        return
    data = ["--dataset", "cifar10", "--data-dir", data_dir] if have_data else ["--dataset", "digits"]
    train_extra = ["--max-batches", "1", "--workers", "0", "--T", "1", "--N", "10"] if smoke else ["--workers", "4"]
    sizes = ["--N0", "10", "--N", "100", "--max", "2"] if smoke else ["--N", "100000", "--max", "20"]
    dev = ["--device", device.type]
    amp, bf16 = (["--amp", "bf16"], ["--precision", "bf16"]) if device.type == "cuda" else ([], [])   # CPU: fp32
    with tempfile.TemporaryDirectory() as tmp:
        run = os.path.join(tmp, "ours")
        print("\n  train_ours.py, one epoch:", flush=True)
        train_s = command(["train_ours.py", *data, "--sigma", "0.5", "--Et", "0", "--pt", "0", "--epochs", "1",
                           *amp, "--channels-last", "--outdir", run, *dev, *train_extra],
                          report.left() - 60, tmp)
        if train_s is None:
            report.add("paper-scale train_ours.py: failed or stopped (its output above)", False, "runs")
            report.skip("paper-scale certify.py and the grid", "no model")
            return
        ckpt = os.path.join(run, machinery.CHECKPOINT)
        kept = readers.read_json_object(os.path.join(run, "discard.json"), "discard summary")["kept"]
        print(f"\n  certify.py{'' if smoke else ' --compile'}:", flush=True)
        log = os.path.join(tmp, "certify.tsv")
        certify_s = command(["certify.py", "--checkpoint", ckpt, *data[2:], "--skip", "5", *sizes, *bf16,
                             *([] if smoke else ["--compile"]), "--outfile", log, *dev], report.left() - 30, tmp)
        report.add(f"paper-scale train_ours.py (sigma 0.5: m 4, T {1 if smoke else 6}, eps 0.25; Et 0, pt 0; one "
                   f"epoch, {kept} images kept): {train_s:.0f} s")
        if certify_s is None:
            report.add("paper-scale certify.py: failed or stopped (its output above)", False, "runs")
            report.skip("the grid at ResNet-110's cost", "no CERTIFY log")
            return
        rows = log_rows(log)
        per_image = statistics.median(readers.log_seconds(r["time"]) for r in rows)
        pA = sorted(int(r["nA"]) / int(r["N"]) for r in rows)
        report.add(f"paper-scale certify.py{'' if smoke else ' --compile'} on {len(rows)} images: {certify_s:.0f} s "
                   f"(median {per_image:.3f} s/image); nA / N: min {pA[0]:.3f}, median {statistics.median(pA):.3f}, "
                   f"max {pA[-1]:.3f}, {sum(p >= 0.5 for p in pA)} of {len(pA)} in [0.5, 1]")
        print("\n  certify.py --radii (eager):", flush=True)
        grid_log = os.path.join(tmp, "grid.tsv")
        grid_s = command(["certify.py", "--checkpoint", ckpt, *data[2:], "--skip", "5", *sizes, *bf16,
                          "--radii", *GRID_RADII, "--outfile", grid_log, *dev], report.left() - 5, tmp)
        if grid_s is None or certify_seconds is None:
            report.skip("the grid at ResNet-110's cost", "its command failed or stopped" if grid_s is None
                        else "no eager CERTIFY seconds")
            return
        grid_rows = log_rows(grid_log)
        N0 = int(sizes[sizes.index("--N0") + 1]) if "--N0" in sizes else 100
        N = int(sizes[sizes.index("--N") + 1])
        draws = len(rows) * (N0 + N) / sum(int(r["N"]) + N0 for r in grid_rows)
        wall = len(grid_rows) * certify_seconds / sum(readers.log_seconds(r["time"]) for r in grid_rows)
        report.add(f"grid --radii {' '.join(GRID_RADII)} on those images: {draws:.1f}x fewer draws than CERTIFY, "
                   f"{wall:.1f}x less time (CERTIFY eager: {certify_seconds:.3f} s/image); wall-clock saving / "
                   f"draw saving {wall / draws:.2f}", wall / draws >= 0.8, ">= 0.8")


def show_warning(message, category, filename, lineno, file=None, line=None):
    """warnings' printer without the machine's paths (the output is committed as results/gpu/gpu_check.txt)."""
    sys.stderr.write(relative_paths(warnings.formatwarning(message, category, filename, lineno, line)))


def main(argv=None):
    args = parse_args(argv)
    warnings.showwarning = show_warning
    device = machinery.get_device(args.device)
    # Paper-scale sizes on a CPU take hours and measure nothing this check is for: a GPU is required, and --smoke
    # (tiny sizes) is what runs anywhere.
    common.check(args.smoke or device.type == "cuda", f"gpu_check.py needs a CUDA device (found {device.type}); "
                 "--smoke runs its paths at tiny sizes on any device")
    report = Report(args.budget)
    print(device_line(device), flush=True)
    if not args.no_tests:
        print("\n1. CUDA tests (pytest -m cuda)", flush=True)
        report.add(f"CUDA tests: {cuda_tests(TESTS_LIMIT)}")
    print("\n2. certification", flush=True)
    certify_seconds = certification(report, device, args.smoke, args.images or (1 if args.smoke else 3), args.batch)
    plain = None
    if not args.no_training:
        print("\n3. training", flush=True)
        plain = training(report, device, args.smoke)
    print("\n4-5. the paper's commands at paper scale, the grid", flush=True)
    paper_scale_and_grid(report, device, args.smoke, args.data_dir, certify_seconds)
    if plain is not None and not args.smoke and report.left() > COMPILE_TRAINING:   # last: compiling takes minutes
        print("\n3'. training with --compile (against part 3's plain loop; each loss while the budget allows)",
              flush=True)
        training(report, device, args.smoke, plain)
    else:
        report.skip("training with --compile", "--smoke" if args.smoke else "--no-training" if args.no_training
                    else "budget")
    wall = time.time() - report.start
    report.add(f"wall time {wall:.0f} s", wall <= 480, "<= 480 s")
    print("\nSummary" + (" (--smoke: tiny sizes, the targets do not apply)" if args.smoke else ""))
    print(f"  {device_line(device)}")
    for line in report.rows:
        print(f"  {line}")


if __name__ == "__main__":
    machinery.run(main, exit_process=True)

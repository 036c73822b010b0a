"""What bounds a training step or a certification on a GPU: the share of the wall time its CUDA kernels fill.

Usage: python tools/profile_step.py [--loss gaussian|ours] [--amp bf16] [--channels-last] [--compile]
                                    [--cuda-graph] [--steps 5]
       (cifar_resnet110, m = 4, 64 images x 4 noisy copies a step, ours with T = 6: the paper's CIFAR-10 step)

torch.profiler records the steps after warm-up ones; the report gives the wall time, the time the GPU spent in
kernels (and copies), their share of the wall time, the host synchronisations, and the kernels that took the
most. A share near 100 % says the kernels bound the step (only faster kernels help: precision, fusion, wider
layers); well below, the GPU waits for the host (launches, Python, synchronisation). tools/gpu_check.py calls
kernel_share on its training and certification rows. On a CPU the kernel share is not defined (n/a).
"""
import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402
import machinery  # noqa: E402


def device_time_us(event):
    """Microseconds event spent on the GPU itself (the profiler's name for it changed across torch versions)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return getattr(event, name)
    return 0.0


def kernel_share(fn, device, runs=1, top=5):
    """Profile `runs` calls of fn() (warm: call it before). Returns {wall_s, kernel_s, share (None on a CPU),
    syncs (host synchronisations), top: [(kernel name, seconds)]}."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(runs):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    on_gpu = sorted(((e.key, device_time_us(e) / 1e6) for e in events if device_time_us(e) > 0),
                    key=lambda kv: -kv[1])
    kernel = sum(s for _, s in on_gpu)
    syncs = sum(e.count for e in events if "Synchronize" in e.key) - (device.type == "cuda")   # not the one above
    return {"wall_s": wall, "kernel_s": kernel, "share": kernel / wall if device.type == "cuda" else None,
            "syncs": syncs, "top": on_gpu[:top]}


def show(name, profile_result):
    """One line of the share, then the kernels that took the most."""
    share = profile_result["share"]
    print(f"  {name}: wall {profile_result['wall_s']:.3f} s, GPU kernels {profile_result['kernel_s']:.3f} s "
          f"({'n/a on a CPU' if share is None else f'{100 * share:.0f} % of the wall time'}), "
          f"{profile_result['syncs']} host synchronisations", flush=True)
    for key, seconds in profile_result["top"]:
        print(f"      {seconds * 1e3:9.2f} ms  {key[:100]}")


def training_step(arch, loss, m, T, images, precision, channels_last, compile_model, device, steps,
                  graph=False):
    """fn() running `steps` optimizer steps of train_epoch on fixed batches (random weights, CIFAR-shaped); graph:
    train_epoch's CUDA graphs (the first common.GRAPH_WARMUP steps of each call eager, then one capture)."""
    import train_ours
    torch.manual_seed(0)
    model = common.get_architecture(arch, "cifar10").to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = common.make_optimizer(model)
    stepper = common.step_model(model, compile_model)
    x = torch.rand(steps, images, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (steps, images), device=device)
    batches = [(x[k], y[k], torch.arange(images, device=device)) for k in range(steps)]
    sigma = 0.5
    if loss == "gaussian":
        def loss_fn(f, x, y, idx):
            return common.gaussian_loss(f, x, y, sigma, m)
    else:
        eps = train_ours.PRESETS["cifar10"][sigma]["eps"]

        def loss_fn(f, x, y, idx):
            return train_ours.ours_loss(f, x, y, sigma, m, T, eps, "l2")
    return lambda: common.train_epoch(stepper, batches, optimizer, loss_fn, 1, device, precision=precision,
                                      graph=graph)


def main(argv=None):
    p = machinery.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="cifar_resnet110", choices=("cifar_resnet110", "cifar_resnet20"))
    p.add_argument("--loss", default="gaussian", choices=("gaussian", "ours"))
    p.add_argument("--m", type=int, default=4, help="noisy copies per image")
    p.add_argument("--T", type=int, default=6, help="--loss ours: attack steps")
    p.add_argument("--images", type=int, default=64, help="images per step (x m noisy copies)")
    p.add_argument("--amp", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--cuda-graph", action="store_true", help="train_epoch(graph=True): CUDA only")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps profiled (after as many warm-up ones)")
    p.add_argument("--device", help="default: cuda when available")
    args = p.parse_args(argv)
    common.check(args.m >= 1 and args.T >= 0 and args.images >= 1 and args.steps >= 1,
                 f"--m, --images and --steps must be >= 1 and --T >= 0 (got {args.m}, {args.images}, "
                 f"{args.steps}, {args.T})")
    device = machinery.get_device(args.device)
    machinery.check_precision(args.amp, device)
    if args.cuda_graph:
        common.check_graph(device, args.amp)
    fn = training_step(args.arch, args.loss, args.m, args.T, args.images, args.amp, args.channels_last,
                       args.compile, device, args.steps, args.cuda_graph)
    fn()
    show(f"{args.arch} {args.loss} step, m = {args.m}, {args.images * args.m} noisy inputs, {args.amp}"
         f"{', channels-last' if args.channels_last else ''}{', compiled' if args.compile else ''}"
         f"{', CUDA graphs' if args.cuda_graph else ''}, {args.steps} steps",
         kernel_share(fn, device))


if __name__ == "__main__":
    machinery.run(main, exit_process=True)

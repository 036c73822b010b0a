"""How much of a batch enters MACER's hinge at initialisation (docs/training.md, MACER note; Zhai et al. 2020).

MACER's robustness term only sees images whose soft top-1 class is the label and whose
d = Phi^-1(q1) - Phi^-1(q2) is finite and <= gamma (train_baselines.macer_loss). With beta = 16 a large
top-1/top-2 logit gap drives q1 to 1.0 in float32, so d is infinite and the image is out of the hinge.
This prints, for freshly initialised models in training mode (BatchNorm on batch statistics, as in training)
on real CIFAR-10 test images with MACER's sigma = 0.5 setting (m 16, beta 16, gamma 8, 64 images a batch):
the median beta * gap, the share of images with finite d, the share in the hinge, and the share of images
whose soft top-1 is the batch's most common class (images: a seeded random subset of the test set).

Usage: python tools/macer_init.py --data-dir data [--batches 4 --seeds 0 1 2]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import machinery  # noqa: E402


def hinge_stats(model, x, y, sigma, m, beta, gamma, precision):
    """One MACER batch at initialisation: the statistics printed per (arch, seed, precision)."""
    noise = sigma * torch.randn(m, *x.shape)
    with torch.no_grad(), common.autocast("cpu", precision):
        z = model((x.unsqueeze(0) + noise).flatten(0, 1)).float().view(m, len(y), -1)   # (m, b, K)
    top2 = z.topk(2, dim=2).values
    gap = beta * (top2[..., 0] - top2[..., 1])                                          # (m, b)
    q1q2, top = F.softmax(beta * z, 2).mean(0).topk(2, dim=1)
    d = torch.special.ndtri(q1q2[:, 0]) - torch.special.ndtri(q1q2[:, 1])
    hinge = (top[:, 0] == y) & torch.isfinite(d) & (d <= gamma)
    common_class = torch.bincount(top[:, 0], minlength=z.shape[2]).max()
    return {"gap": gap.flatten(), "finite": torch.isfinite(d).float().mean().item(),
            "hinge": hinge.float().mean().item(), "one_class": common_class.item() / len(y)}


def main(argv=None):
    p = machinery.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="CIFAR-10 (image folders or torchvision's files)")
    p.add_argument("--archs", nargs="+", default=["cifar_resnet110", "cifar_resnet20", "lenet"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--batches", type=int, default=4, help="batches of 64 test images per model")
    args = p.parse_args(argv)
    common.check(args.batches >= 1, f"--batches must be >= 1 (got {args.batches})")
    for arch in args.archs:
        common.check(arch in common.ARCHS, f"--archs: unknown architecture {arch!r} (one of "
                                                   f"{', '.join(common.ARCHS)})")
    test = common.get_dataset("cifar10", "test", args.data_dir)
    common.check(64 * args.batches <= len(test), f"--batches {args.batches} asks for {64 * args.batches} test images; "
                                                 f"there are {len(test)}")
    # a seeded random subset: image folders list the test set class by class, so the first images share a label
    order = torch.randperm(len(test), generator=torch.Generator().manual_seed(0)).tolist()
    print("arch\tseed\tprecision\tmedian beta*gap\tmin beta*gap\tfinite d\tin hinge\tone class")
    for arch in args.archs:
        for seed in args.seeds:
            for precision in ("fp32", "bf16"):
                torch.manual_seed(seed)
                model = common.get_architecture(arch, "cifar10").train()
                rows = []
                for k in range(args.batches):
                    idx = order[64 * k:64 * (k + 1)]
                    x = torch.stack([test[i][0] for i in idx])
                    y = torch.tensor([test[i][1] for i in idx])
                    rows.append(hinge_stats(model, x, y, 0.5, 16, 16.0, 8.0, precision))
                gap = torch.cat([r["gap"] for r in rows])
                mean = {key: sum(r[key] for r in rows) / len(rows) for key in ("finite", "hinge", "one_class")}
                print(f"{arch}\t{seed}\t{precision}\t{gap.median():.1f}\t{gap.min():.2f}\t{mean['finite']:.3f}\t"
                      f"{mean['hinge']:.3f}\t{mean['one_class']:.3f}", flush=True)


if __name__ == "__main__":
    machinery.run(main, exit_process=True)

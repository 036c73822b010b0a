"""Gaussian data augmentation with m noise copies (Cohen et al. 2019; the paper's baseline, §3 and §6).

Usage: python train_gaussian.py --dataset digits --sigma 0.5 --epochs 5

Every training image gets m independent draws delta_1..delta_m ~ N(0, sigma^2 I) and the loss is the mean
cross-entropy of f(x + delta_i) (eq. 1 of the paper). As in every official RS script, a loader batch of 256
images is cut into m chunks, each replicated m times, one SGD step per chunk (Salman et al. 2019's convention, docs/training.md), so each
step sees 256 noisy inputs. m = 4 is the paper's CIFAR-10 baseline (§6); --m 1 is Cohen et al.'s original.
NOTE: each epoch is one shuffled pass over the data; the paper's own Gaussian numbers come from its
train.py with all parts off, which samples with replacement (`train_ours.py --no-discard --no-reweight
--T 0` reproduces that).

CIFAR-10, the paper's schedule (150 epochs, lr 0.1, x0.1 every 50), into runs/train_gaussian_cifar10_sigma0.5:
    python train_gaussian.py --dataset cifar10 --data-dir data --sigma 0.5
Gradient norms of Table 2 (TSV idx label pA grad_norm, written beside the checkpoint):
    python train_gaussian.py --gradnorm runs/train_gaussian_digits_sigma0.5/checkpoint.pth.tar --probe 200
"""
import argparse
import os
import time

import torch

import common
import machinery
import readers


def parse_args():
    p = machinery.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="cifar10", choices=common.DATASETS, help="training data (default cifar10)")
    p.add_argument("--data-dir", default=None, help="dataset folder (default $RS_DATA_DIR or ./data)")
    p.add_argument("--arch", choices=common.ARCHS, help="base classifier f (default: cifar_resnet110 on "
                   "cifar10, resnet50 on imagenet, digits_cnn on digits)")
    p.add_argument("--sigma", type=float, help="std of the Gaussian noise (training: required)")
    p.add_argument("--m", type=int, default=4, help="noise copies per image (paper: 4; Cohen et al.: 1)")
    p.add_argument("--epochs", type=int, help="default: 150 cifar10, 90 imagenet, 20 digits")
    p.add_argument("--batch", type=int, default=256, help="images per loader batch, split into m chunks")
    p.add_argument("--lr", type=float, default=0.1, help="initial SGD learning rate")
    p.add_argument("--lr_step", type=int, help="lr x0.1 every lr_step epochs (default 50 cifar10, 30 imagenet)")
    p.add_argument("--lr_milestones", type=int, nargs="+", metavar="EPOCH", help="lr x0.1 at each of these "
                   "epochs instead of every --lr_step (the official ImageNet scripts: --lr_milestones 50 100, "
                   "i.e. one decay at epoch 50 of 90; the paper's text: every 30)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--weight_decay", type=float, default=1e-4, help="SGD weight decay")
    p.add_argument("--workers", type=int, default=2, help="data loader worker processes")
    p.add_argument("--seed", type=int, default=0, help="seed of all randomness (a resumed run repeats it)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--outdir", help="run folder (default runs/train_gaussian_<dataset>_sigma<sigma>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --outdir from its checkpoint")
    p.add_argument("--trust-checkpoint", action="store_true", help="load checkpoint files that need arbitrary "
                   "unpickling: this RUNS CODE the file holds; only for files from a source you trust")
    p.add_argument("--save_every", type=int, default=0, help="also keep checkpoint_epoch<E>.pth.tar every E "
                   "epochs")
    p.add_argument("--max-batches", type=int, help="stop each epoch after this many batches (smoke tests, timing)")
    p.add_argument("--amp", nargs="?", const="bf16", choices=("bf16", "fp16"), help="mixed precision training: "
                   "bf16 autocast (CPU, CUDA; the default of a bare --amp) or fp16 with loss scaling (CUDA)")
    p.add_argument("--channels-last", action="store_true", help="channels-last memory format (faster convolutions)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model for the training steps (the "
                   "same training up to float rounding; compiled at the first step, minutes on ResNet-110; one "
                   "process, not under torchrun)")
    p.add_argument("--cuda-graph", action="store_true", help="replay each training step as a CUDA graph (CUDA, "
                   "one process, fp32 or --amp bf16): the same steps without the host's launch overhead")
    p.add_argument("--sync-bn", action="store_true", help="under torchrun: BatchNorm statistics over the "
                   "whole batch of all ranks (SyncBatchNorm, GPUs only), as on the paper's single GPU; default: each "
                   "rank's batch // world_size inputs")
    p.add_argument("--gradnorm", metavar="CKPT", help="instead of training: per-example gradient norms of CKPT")
    p.add_argument("--probe", type=int, help="--gradnorm: training examples probed (default 1000)")
    p.add_argument("--N", type=int, help="--gradnorm: noise samples for each probe's pA (default 100)")
    return p.parse_args()


def settings(args):
    """The run's settings: the flags, with the per-dataset defaults filled in, after checking them."""
    common.check(args.sigma is not None, "--sigma is required (the paper uses 0.25, 0.5 and 1.0)")
    common.check(args.sigma > 0, f"--sigma must be > 0, got {args.sigma}")
    common.check(args.m >= 1, f"--m must be >= 1, got {args.m}")
    s = dict(vars(args))
    s["arch"] = args.arch or common.DEFAULT_ARCH[args.dataset]
    s["epochs"] = args.epochs if args.epochs is not None else common.SCHEDULE[args.dataset]["epochs"]
    s["lr_step"] = common.SCHEDULE[args.dataset]["lr_step"] if args.lr_step is None else args.lr_step
    s["outdir"] = args.outdir or f"runs/train_gaussian_{args.dataset}_sigma{args.sigma}"
    common.check(s["epochs"] >= 0 and args.workers >= 0 and args.batch >= 1 and s["lr_step"] >= 1,
                 "--epochs and --workers must be >= 0, --batch and --lr_step >= 1")
    common.check(all(e >= 1 for e in args.lr_milestones or []), "--lr_milestones must be epochs >= 1")
    machinery.check_training_settings(s)
    return argparse.Namespace(**s)


def gradnorm_mode(args):
    """Table 2: gradient norm of the Gaussian loss of each probe example, with the example's pA."""
    device = machinery.get_device(args.device)
    model, ckpt = readers.load_model(args.gradnorm, device=device, trust=args.trust_checkpoint)
    sigma = ckpt.get("sigma") if args.sigma is None else args.sigma
    common.check(sigma is not None and sigma > 0, "--gradnorm: the checkpoint names no sigma; pass --sigma > 0")
    common.check(args.m >= 1 and args.probe >= 1 and args.N >= 1, "--m, --probe and --N must be >= 1")
    dataset = ckpt.get("dataset") or args.dataset
    machinery.check_training_settings(dict(vars(args), sigma=sigma, dataset=dataset))   # sizes, seed, sigma
    train_set = common.get_dataset(dataset, "train", args.data_dir, train_transform=False)
    path = os.path.join(machinery.make_outdir(args.outdir or os.path.dirname(os.path.abspath(args.gradnorm))),
                        "gradnorm_gaussian.tsv")

    def loss_fn(f, x, y, idx):
        return common.gaussian_loss(f, x, y, sigma, args.m)

    rows = machinery.measure_grad_norms(model, train_set, loss_fn, sigma, args.probe, args.N, args.seed, 256, path,
                                        [args.gradnorm], (dataset, args.data_dir))
    print(f"wrote {len(rows['idx'])} gradient norms to {path}")


def train(args, device):
    """Gaussian training (eq. 1) for args.epochs epochs in args.outdir, resuming a run there with --resume."""
    machinery.check_precision(args.amp or "fp32", device)
    if args.cuda_graph:
        common.check_graph(device, args.amp or "fp32", machinery.get_world_size())
    common.seed_everything(args.seed)   # the initial weights; each epoch then reseeds itself
    train_set = common.get_dataset(args.dataset, "train", args.data_dir)
    test_set = common.get_dataset(args.dataset, "test", args.data_dir)
    test_loader = common.make_test_loader(test_set, 256, args.workers)
    loaders = common.TrainLoader(train_set, args.batch, args.workers, args.seed, machinery.get_rank(),
                                  machinery.get_world_size())   # workers live across epochs
    model = common.get_architecture(args.arch, args.dataset).to(device)
    if args.channels_last:  # before the optimizer: its momentum buffers take the parameters' layout
        model = model.to(memory_format=torch.channels_last)
    optimizer = common.make_optimizer(model, args.lr, args.momentum, args.weight_decay)
    scheduler = common.make_scheduler(optimizer, args.lr_step, milestones=args.lr_milestones)
    expect = {"arch": args.arch, "dataset": args.dataset, "sigma": args.sigma}   # what --resume must match
    first, _ = machinery.start_or_resume(model, optimizer, scheduler, args.outdir,
                                         args.resume, expect, args.trust_checkpoint, vars(args))
    model = machinery.wrap_model(model, device, args.sync_bn)
    stepper = common.step_model(model, args.compile)   # what the steps call; model is saved and evaluated
    if machinery.is_main_process():
        machinery.write_json({**vars(args), "environment": machinery.environment()}, os.path.join(args.outdir, "args.json"),
                             "settings of a run")
        print(f"training {args.arch} on {args.dataset}, sigma {args.sigma}, m {args.m}; writing {args.outdir}")
    log, run_start = machinery.open_train_log(args.outdir, first), time.time()

    def loss_fn(f, x, y, idx):  # eq. 1: mean cross-entropy over m noisy copies
        return common.gaussian_loss(f, x, y, args.sigma, args.m)

    for epoch in range(first, args.epochs):
        start = time.time()
        common.seed_epoch(args.seed, epoch, machinery.get_rank())
        loader = loaders.epoch(epoch)
        lr = optimizer.param_groups[0]["lr"]
        row = common.train_epoch(stepper, loader, optimizer, loss_fn, args.m, device,
                                 machinery.progress_line(f"epoch {epoch + 1}"), args.max_batches,
                                 precision=args.amp or "fp32", graph=args.cuda_graph)
        if machinery.is_main_process():
            row.update(common.evaluate_noisy(common.unwrap(model), test_loader, args.sigma, device,
                                             common.eval_generator(args.seed, epoch, device)))
        scheduler.step()
        # the log row first: a kill before the checkpoint leaves a row that the resume drops and redoes
        machinery.log_epoch(log, epoch, args.epochs, run_start, first,
                            dict(row, time=time.time() - start, lr=lr, kept=len(train_set)))
        machinery.save_training_checkpoint(args.outdir, model, optimizer, scheduler, epoch + 1, args,
                                           save_every=args.save_every)


def main():
    args = parse_args()
    machinery.check_mode_options(args, {"probe": ["gradnorm"], "N": ["gradnorm"]}, alone={"gradnorm": {
        "device", "trust_checkpoint", "sigma", "m", "probe", "N", "dataset", "data_dir", "outdir", "seed"}})
    args.probe, args.N = 1000 if args.probe is None else args.probe, 100 if args.N is None else args.N
    machinery.set_inputs([args.gradnorm])   # files this run reads: never written over
    if args.gradnorm:
        return gradnorm_mode(args)
    args = settings(args)
    args.run = machinery.run_identity('train_gaussian.py', args.dataset, args.data_dir)   # checked on --resume
    device = machinery.setup_distributed(args.device)
    with machinery.run_folder_lock(args.outdir, args.amp or "fp32", device):   # one run per folder
        train(args, device)
    machinery.end_distributed()


if __name__ == "__main__":
    machinery.run(main, exit_process=True)

"""The paper's training recipe (§5, Algorithm 2): Gaussian training that focuses on easy data.

Usage: python train_ours.py --sigma 0.5 --Et 70 --pt 0.4

Algorithm 2, as main() below runs it (0-based epochs; docs/training.md has the released code's details):
  epochs < Et       Gaussian training with m noise draws per image, shuffled passes over D
  epoch == Et       discard_hard (§5.1): pA of every training image from N = 100 noisy copies under the
                    current model; keep D' = {pA >= pt}
  Et, Et + 10, ...  reweight (§5.2): k of 16 noisy copies correct -> weight Phi^-1(CP_lower(max(k, 12), 16))
  epochs >= Et      each epoch draws |D| examples with replacement from D' (by weight), and every noise draw
                    is moved on its sphere by the adaptive attack (Alg. 1, §5.3) before the Gaussian loss
Without discarding (--no-discard) the attack, the sampler and the reweighting start at epoch 0, as in the
official code. `--sigma S` alone gives the paper's CIFAR-10 setting for S (Table 6); `--dataset imagenet`
those of Table 7 (no reweighting, pA from a Gaussian-pretrained model: --pA-checkpoint); flags override.

Table 5 (ablation), the eight rows for sigma 0.5 on CIFAR-10 (add --data-dir):
    python train_ours.py --sigma 0.5 --no-discard --no-reweight --T 0 --outdir runs/table5_s0.5/gaussian
    python train_ours.py --sigma 0.5 --no-reweight --T 0 --outdir runs/table5_s0.5/discard
    python train_ours.py --sigma 0.5 --no-discard --T 0 --outdir runs/table5_s0.5/weight
    python train_ours.py --sigma 0.5 --no-discard --no-reweight --outdir runs/table5_s0.5/adversarial
    python train_ours.py --sigma 0.5 --T 0 --outdir runs/table5_s0.5/discard_weight
    python train_ours.py --sigma 0.5 --no-reweight --outdir runs/table5_s0.5/discard_adversarial
    python train_ours.py --sigma 0.5 --no-discard --outdir runs/table5_s0.5/weight_adversarial
    python train_ours.py --sigma 0.5 --outdir runs/table5_s0.5/all
Gradient norms with and without the attack (Table 2, Fig. 5; TSV idx label pA grad_norm beside CKPT):
    python train_ours.py --gradnorm runs/train_ours_cifar10_sigma0.5/checkpoint.pth.tar --probe 1000
"""
import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from scipy.special import ndtri   # scipy.stats' norm.ppf, bit for bit, without its import time

import common
import readers
import machinery

# Paper Table 6 (CIFAR-10) and Table 7 (ImageNet), per sigma. digits: our CPU demo (not in the paper),
# scaled to its 20-epoch schedule.
PRESETS = {
    "cifar10": {0.25: dict(m=4, Et=60, pt=0.5, T=3, eps=0.25), 0.5: dict(m=4, Et=70, pt=0.4, T=6, eps=0.25),
                1.0: dict(m=4, Et=60, pt=0.4, T=4, eps=0.5)},
    "imagenet": {0.25: dict(m=1, Et=0, pt=0.2, T=2, eps=0.5), 0.5: dict(m=1, Et=0, pt=0.2, T=2, eps=1.0),
                 1.0: dict(m=2, Et=0, pt=0.1, T=1, eps=2.0)},
    "digits": {0.25: dict(m=4, Et=8, pt=0.5, T=3, eps=0.25), 0.5: dict(m=4, Et=8, pt=0.4, T=3, eps=0.25),
               1.0: dict(m=4, Et=8, pt=0.4, T=3, eps=0.5)},
}


def parse_args():
    p = machinery.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="cifar10", choices=common.DATASETS, help="training data (default cifar10)")
    p.add_argument("--data-dir", default=None, help="dataset folder (default $RS_DATA_DIR or ./data)")
    p.add_argument("--arch", choices=common.ARCHS, help="base classifier f (default: cifar_resnet110 on "
                   "cifar10, resnet50 on imagenet, digits_cnn on digits)")
    p.add_argument("--sigma", type=float, help="std of the Gaussian noise; picks the paper's settings below")
    p.add_argument("--m", type=int, help="noise draws per image (Table 6/7)")
    p.add_argument("--Et", type=int, help="epoch (0-based) at which hard data is discarded (Table 6/7)")
    p.add_argument("--pt", type=float, help="discard training examples with estimated pA < pt (Table 6/7)")
    p.add_argument("--T", type=int, help="steps of the adaptive attack (Alg. 1); 0 switches the attack off")
    p.add_argument("--eps", type=float, help="step size of one attack step (not a radius: norms are kept)")
    p.add_argument("--attack", default="l2", choices=("l2", "linf"), help="attack step: normalised gradient "
                   "(l2) or sign / sqrt(d) (linf), App. C.3")
    p.add_argument("--discard", action=argparse.BooleanOptionalAction, default=True,
                   help="§5.1 discard hard data at Et (--no-discard: keep all, every part starts at epoch 0)")
    p.add_argument("--reweight", action=argparse.BooleanOptionalAction,
                   help="§5.2 reweight by certified radius (default: on for cifar10/digits, off for imagenet)")
    p.add_argument("--N", type=int, help="noise samples of the discard pA estimate (100; imagenet 50)")
    p.add_argument("--pA-checkpoint", help="estimate the discard pA with this model (imagenet: a "
                   "Gaussian-pretrained ResNet-50) instead of the model being trained")
    p.add_argument("--N_weight", type=int, default=16, help="noise samples of each reweighting estimate")
    p.add_argument("--alpha", type=float, default=0.1, help="confidence of the reweighting lower bound")
    p.add_argument("--p_min", type=float, default=0.75, help="reweighting: pA at and below which weight is 1")
    p.add_argument("--reweight_every", type=int, default=10, help="reweight at Et, Et + this, ...")
    p.add_argument("--weights", default="code", choices=("code", "paper"), help="code: the official "
                   "Phi^-1(CP_lower(max(k, N p_min))); paper: §5.2 max(1, Phi^-1(CP_lower(k)) / Phi^-1(p_min))")
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
    p.add_argument("--outdir", help="run folder (default runs/train_ours_<dataset>_sigma<sigma>)")
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
    p.add_argument("--gradnorm", metavar="CKPT", help="instead of training: per-example gradient norms of "
                   "CKPT, with and without the attack")
    p.add_argument("--probe", type=int, help="--gradnorm: training examples probed (default 1000)")
    return p.parse_args()


def settings(args, sigma, dataset):
    """The run's settings: the flags, the paper's per-sigma values (Tables 6, 7) where a flag is not given."""
    common.check(sigma is not None, "--sigma is required (the paper uses 0.25, 0.5 and 1.0)")
    common.check(sigma > 0, f"--sigma must be > 0, got {sigma}")
    table = PRESETS[dataset]
    nearest = min(table, key=lambda s: abs(s - sigma))  # sigma outside the tables: the closest row
    s = dict(vars(args), sigma=sigma, dataset=dataset)
    borrowed = [key for key in table[nearest] if s[key] is None]
    if nearest != sigma and borrowed and os.environ.get("RANK", "0") == "0":   # once under torchrun
        print(f"note: no {dataset} row for sigma {sigma} in Table {7 if dataset == 'imagenet' else 6}: "
              f"{', '.join(borrowed)} from the sigma {nearest} row (override them with flags)", file=sys.stderr)
    for key, value in table[nearest].items():
        s[key] = value if s[key] is None else s[key]
    s["reweight"] = dataset != "imagenet" if args.reweight is None else args.reweight
    s["N"] = (50 if dataset == "imagenet" else 100) if args.N is None else args.N
    s["arch"] = args.arch or common.DEFAULT_ARCH[dataset]
    s["epochs"] = args.epochs if args.epochs is not None else common.SCHEDULE[dataset]["epochs"]
    s["lr_step"] = common.SCHEDULE[dataset]["lr_step"] if args.lr_step is None else args.lr_step
    s["outdir"] = args.outdir or f"runs/train_ours_{dataset}_sigma{sigma}"
    check_settings(s)
    return argparse.Namespace(**s)


def check_settings(s):
    """Bad input is one line and exit code 2 (machinery.run), before anything is written."""
    common.check(s["m"] >= 1, f"--m must be >= 1, got {s['m']}")
    common.check(0 <= s["pt"] <= 1, f"--pt must lie in [0, 1], got {s['pt']}")
    common.check(s["T"] >= 0, f"--T must be >= 0 (0 switches the attack off), got {s['T']}")
    common.check(s["T"] == 0 or s["eps"] > 0,
                 f"--eps must be > 0 with the attack on (--T {s['T']}), got {s['eps']}")
    common.check(s["Et"] >= 0 and s["N"] >= 1 and s["N_weight"] >= 1 and s["reweight_every"] >= 1,
                 "--Et must be >= 0 and --N, --N_weight, --reweight_every >= 1")
    common.check(0 < s["alpha"] < 1 and 0.5 < s["p_min"] < 1, "--alpha must lie in (0, 1), --p_min in (1/2, 1) "
                                                                "(the weights divide by Phi^-1(p_min) > 0)")
    common.check(s["epochs"] >= 0 and s["workers"] >= 0 and s["batch"] >= 1 and s["lr_step"] >= 1,
                 "--epochs and --workers must be >= 0, --batch and --lr_step >= 1")
    common.check(all(e >= 1 for e in s["lr_milestones"] or []), "--lr_milestones must be epochs >= 1")
    machinery.check_training_settings(s)
    common.check(s["pA_checkpoint"] is None or os.path.isfile(s["pA_checkpoint"]),
                 f"--pA-checkpoint {s['pA_checkpoint']!r} not found")
    common.check(s["gradnorm"] or not (s["dataset"] == "imagenet" and s["discard"] and s["Et"] == 0
                                       and not s["pA_checkpoint"]),
                 "imagenet discards at epoch 0 (Table 7): pass --pA-checkpoint with a Gaussian-pretrained model")
    if s["reweight"] and s["weights"] == "code":
        common.check(code_weight_floor(s["N_weight"], s["alpha"], s["p_min"]) > 0,
                     f"--N_weight {s['N_weight']} with --p_min {s['p_min']}: the lower bound of pA at the floor "
                     f"is below 1/2, so the code's weights are not positive; raise --p_min or --N_weight")


def ours_loss(model, x, y, sigma, m, T, eps, attack):
    """Alg. 2 inner loop: m Gaussian draws per image, each moved on its sphere by Alg. 1, mean cross-entropy."""
    common.check_batch(model, x, y, sigma, m=m)
    common.check_int("T", T, 0)
    common.check_float("eps", eps, ge=0)
    common.check_choice("attack", attack, ("l2", "linf"))
    delta = sigma * torch.randn(m, *x.shape, device=x.device, dtype=x.dtype)   # (m, b, C, H, W)
    if T > 0:
        delta = common.sphere_pgd(model, x, y, delta, T, eps, attack)  # eval mode inside; norms kept
    logits = model((x.unsqueeze(0) + delta).flatten(0, 1))        # (m*b, K), block order
    common.check_labels(y, logits)
    targets = y.repeat(m)
    loss = F.cross_entropy(logits, targets)
    return {"loss": loss, "correct": (logits.argmax(1) == targets).sum(), "total": len(targets)}


def discard_hard(model, dataset, sigma, N, pt, batch=1024):
    """§5.1: estimate pA of every example of `dataset` as the share of N noisy copies the model labels correctly
    (common.count_correct: an empirical frequency, not a bound) and keep those with pA >= pt.
    Returns (the kept indices, int64 counts of every example, their labels), all on the CPU."""
    common.check_smoothing(sigma, N=N, batch=batch)
    common.check_float("pt", pt, ge=0, le=1)
    counts, labels = common.count_correct(model, dataset, torch.arange(len(dataset)), sigma, N, batch)
    return keep_easy(counts, N, pt), counts, labels


def keep_easy(counts, N, pt):
    """The indices whose estimated pA = counts / N is at least pt (§5.1)."""
    common.check_tensor("counts", counts, "n", "int")
    common.check_int("N", N)
    common.check(bool(((counts >= 0) & (counts <= N)).all()), f"counts must lie in 0..N = {N}")
    common.check_float("pt", pt, ge=0, le=1)
    return torch.arange(len(counts))[counts.double() / N >= pt]


def shared_counts(counts, labels, indices, n, path, device):
    """Rank 0's pA counts on every rank under torchrun (their noise differs), kept in the TSV `path`
    (idx label count n) by rank 0: what train() does around discard_hard and the reweighting estimate."""
    counts = machinery.broadcast(counts.to(device)).cpu()
    if machinery.is_main_process():
        rows = [(i, label, c, n) for i, label, c in zip(torch.as_tensor(indices).tolist(), labels.tolist(),
                                                      counts.tolist())]
        machinery.write_tsv(path, readers.PA_COLUMNS, rows, "pA estimates")
    return counts


def discard_step(model, dataset, args, epoch, device):
    """Alg. 2 at epoch Et: discard_hard, then rank 0's decision on every rank, its pA TSV, discard.json and a
    line on the terminal. Returns the kept indices."""
    _, counts, labels = discard_hard(model, dataset, args.sigma, args.N, args.pt)
    counts = shared_counts(counts, labels, torch.arange(len(dataset)), args.N,
                           os.path.join(args.outdir, f"pA_epoch{epoch}_discard.tsv"), device)
    kept = keep_easy(counts, args.N, args.pt)
    if machinery.is_main_process():
        ratio = len(kept) / len(dataset)
        machinery.write_json({"epoch": epoch, "pt": args.pt, "N": args.N, "kept": len(kept), "total": len(dataset),
                              "ratio": ratio}, os.path.join(args.outdir, "discard.json"), "discard summary")
        print(f"epoch {epoch}: discarded hard data, kept {len(kept)} of {len(dataset)} ({100 * ratio:.1f} %)")
    return kept


def code_weight_floor(N, alpha, p_min):
    """The official code's weight of every example with at most floor(N p_min) correct copies (unnormalised)."""
    common.check_int("N", N)
    common.check_float("alpha", alpha, gt=0, lt=1)
    common.check_float("p_min", p_min, gt=0, lt=1)
    return ndtri(common.clopper_pearson_lower(np.floor(N * p_min), N, alpha))


def radius_weights(counts, N, alpha, p_min, formula):
    """§5.2 sampling weight of each example from k = counts correct noisy copies out of N, by one of two
    formulas (the caller names it: they differ, and neither is the obvious one):

    paper (§5.2's formula): w = max(1, Phi^-1(CP_lower(k, N, alpha)) / Phi^-1(p_min)).
    code (the authors' released code, train_ours.py's --weights default, which the paper's numbers come from):
    k' = max(k, floor(N p_min)), w = Phi^-1(CP_lower(k', N, alpha)) / the same at k' = floor(N p_min), so hard
    examples weigh 1 in both; the two differ in how fast w grows with k (docs/training.md)."""
    common.check_choice("formula", formula, ("paper", "code"))
    common.check_int("N", N)
    counts = common.check_array("counts", counts, ndim=1, integral=True, ge=0, le=N)
    common.check_float("alpha", alpha, gt=0, lt=1)
    common.check_float("p_min", p_min, gt=0.5, lt=1)   # Phi^-1(p_min) > 0: the weights' unit
    if formula == "code":
        common.check(code_weight_floor(N, alpha, p_min) > 0, f"N {N}, p_min {p_min}: the code's weights need the "
                                                              f"lower bound of pA at floor(N p_min) above 1/2")
        k = np.maximum(counts, np.floor(N * p_min))   # clip the probability at p_min
        w = ndtri(common.clopper_pearson_lower(k, N, alpha)) / code_weight_floor(N, alpha, p_min)
    else:
        w = np.maximum(1.0, ndtri(common.clopper_pearson_lower(counts, N, alpha)) / ndtri(p_min))
    return torch.as_tensor(np.atleast_1d(w), dtype=torch.float64)


def gradnorm_mode(args):
    """Table 2 / Fig. 5: gradient norm of our loss per probe example, with the attack and without (T = 0)."""
    device = machinery.get_device(args.device)
    model, ckpt = readers.load_model(args.gradnorm, device=device, trust=args.trust_checkpoint)
    s = settings(args, ckpt.get("sigma") if args.sigma is None else args.sigma, ckpt.get("dataset") or args.dataset)
    common.check(args.probe >= 1, "--probe must be >= 1")
    train_set = common.get_dataset(s.dataset, "train", s.data_dir, train_transform=False)
    outdir = machinery.make_outdir(args.outdir or os.path.dirname(os.path.abspath(args.gradnorm)))
    for name in ("attack", "noattack"):   # both outputs checked before either is measured
        machinery.check_gradnorm_output(os.path.join(outdir, f"gradnorm_ours_{name}.tsv"), [args.gradnorm])
    for T, name in ((s.T, "attack"), (0, "noattack")):
        def loss_fn(f, x, y, idx):
            return ours_loss(f, x, y, s.sigma, s.m, T, s.eps, s.attack)
        path = os.path.join(outdir, f"gradnorm_ours_{name}.tsv")
        machinery.measure_grad_norms(model, train_set, loss_fn, s.sigma, s.probe, s.N, s.seed, 256, path, [args.gradnorm],
                                     (s.dataset, s.data_dir))
        print(f"wrote gradient norms (T = {T}) of {s.probe} probe examples to {path}")


def train(args, device):
    """Algorithm 2 for args.epochs epochs in args.outdir, resuming a run there with --resume."""
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
    if args.pA_checkpoint:   # recorded (args.json, the checkpoints): a resume, and the discard, need this very file
        args.pA_checkpoint_sha256 = machinery.file_sha256(args.pA_checkpoint)
    first, state = machinery.start_or_resume(model, optimizer, scheduler, args.outdir,
                                             args.resume, expect, args.trust_checkpoint, vars(args))
    kept = state.get("kept", torch.arange(len(train_set))).cpu()   # D', all of D until the discard
    weights = state.get("weights")                                   # §5.2 sampling weights over kept
    weights = None if weights is None else weights.cpu()             # None: uniform
    model = machinery.wrap_model(model, device, args.sync_bn)
    stepper = common.step_model(model, args.compile)   # what the steps call; model is saved and evaluated
    start = args.Et if args.discard else 0   # without discarding every part starts at epoch 0 (official code)
    if machinery.is_main_process():
        machinery.write_json({**vars(args), "environment": machinery.environment()},
                             os.path.join(args.outdir, "args.json"),
                             "settings of a run")
        print(f"training {args.arch} on {args.dataset}, sigma {args.sigma}, m {args.m}, discard {args.discard} "
              f"(Et {start}, pt {args.pt}), reweight {args.reweight}, attack T {args.T} eps {args.eps} "
              f"{args.attack}; writing {args.outdir}")
    log, run_start = machinery.open_train_log(args.outdir, first), time.time()
    for epoch in range(first, args.epochs):
        t0 = time.time()
        common.seed_epoch(args.seed, epoch, machinery.get_rank())
        if args.discard and epoch == start:                                             # Alg. 2: epoch == Et
            pA_model = (readers.load_model(args.pA_checkpoint, device=device, trust=args.trust_checkpoint)[0]
                        if args.pA_checkpoint else model)
            common.check(not args.pA_checkpoint or readers.loaded_sha256(args.pA_checkpoint) ==
                         args.pA_checkpoint_sha256, f"--pA-checkpoint {args.pA_checkpoint!r} changed since the run began")
            kept = discard_step(pA_model, train_set, args, epoch, device)
            weights = None
        if args.reweight and epoch >= start and (epoch - start) % args.reweight_every == 0:  # Et, Et + 10, ...
            counts, labels = common.count_correct(model, train_set, kept, args.sigma, args.N_weight, 1024)
            counts = shared_counts(counts, labels, kept, args.N_weight,
                                   os.path.join(args.outdir, f"pA_epoch{epoch}_weights.tsv"), device)
            weights = radius_weights(counts, args.N_weight, args.alpha, args.p_min, formula=args.weights)
        late = epoch >= start   # from Et on: |D| draws with replacement from D', and the attack
        loader = loaders.epoch(epoch, indices=kept if late else None, weights=weights if late else None)
        T = args.T if late else 0

        def loss_fn(f, x, y, idx):
            return ours_loss(f, x, y, args.sigma, args.m, T, args.eps, args.attack)

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
                            dict(row, time=time.time() - t0, lr=lr, kept=len(kept) if late else len(train_set)))
        machinery.save_training_checkpoint(args.outdir, model, optimizer, scheduler, epoch + 1, args,
                                           {"kept": kept, "weights": weights}, args.save_every)


def main():
    args = parse_args()
    machinery.check_mode_options(args, {"probe": ["gradnorm"]}, alone={"gradnorm": {
        "device", "trust_checkpoint", "sigma", "m", "T", "eps", "attack", "probe", "N", "dataset", "data_dir",
        "outdir", "seed"}})
    args.probe = 1000 if args.probe is None else args.probe
    machinery.set_inputs([args.gradnorm, args.pA_checkpoint])   # files this run reads: never written over
    if args.gradnorm:
        return gradnorm_mode(args)
    args = settings(args, args.sigma, args.dataset)
    args.run = machinery.run_identity('train_ours.py', args.dataset, args.data_dir)   # checked on --resume
    device = machinery.setup_distributed(args.device)
    with machinery.run_folder_lock(args.outdir, args.amp or "fp32", device):   # one run per folder
        train(args, device)
    machinery.end_distributed()


if __name__ == "__main__":
    machinery.run(main, exit_process=True)

"""Data-Dependent Randomized Smoothing (Alfarra, Bibi, Torr, Ghanem, UAI 2022; DDRS.md): a sigma per input.

Usage: python ddrs.py certify --checkpoint runs/train_gaussian_digits_sigma0.25/checkpoint.pth.tar --N 1000
       python ddrs.py memory runs/ddrs/<log>.tsv       (Algorithm 3 over a finished log, in index order)
       python ddrs.py train --method gaussian --dataset digits --sigma 0.25     (DS2 training, Algorithm 2)

The paper, and where it is here:
  Algorithm 1, OptimizeSigma (§3.2, Eq. 3)   optimize_sigma: per-input sigma by Monte Carlo gradient ascent on
                                             the soft-smoothing radius s / 2 (Phi^-1(E_A) - Phi^-1(E_B)), E_B the
                                             runner-up class, weights frozen, a batch of inputs per step
  §3.3, certification at sigma_x             `certify`: certify.py's CERTIFY (its flags, TSV, sidecar, resume,
                                             torchrun split) at sigma_x, written in a last column `sigma`
  Algorithm 3, memory-based certification    `memory`: the stored (x_i, c_i, r_i) keep balls of different
     (§3.5, App. C)                          classes disjoint; cases (i) inside a foreign ball and (ii) touching
                                             one, with the paper's or the code's rule (--case-rule)
  Algorithm 2, DS2 training (§4)             `train`: Gaussian, SmoothAdv or MACER with a sigma per training
                                             example, optimised for each minibatch (K_train steps, weights
                                             frozen) from the value it had last time, after fixed-sigma epochs

What a DDRS certificate proves (read this before using one). Each line is Cohen et al.'s certificate for the
classifier smoothed at the single noise level sigma_x chosen for that input: with probability >= 1 - alpha,
g_{sigma_x} is constant on the ball. It is NOT a certificate for the data-dependent classifier
z -> g_{sigma_z}(z) that re-optimises sigma at every point: Cohen's bound compares N(x, s^2 I) with
N(x + delta, s^2 I) at the same s, and Súkeník et al. (ICML 2022) show that such certificates are not
justified in general (in 3072 dimensions, a 5 % change of sigma between two points already breaks them).
With --memory the stateful classifier is consistent for the realised query order (balls of different
classes never overlap), which is a property of the bookkeeping, not a robustness guarantee of DDRS itself.
"""
import argparse
import contextlib
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

import certify
import common

SIGMA_STREAM = 1   # (seed, idx, stream): the optimisation noise is independent of the certification noise


# ----------------------------------------------------------------------------------------------------------
# Algorithm 1: OptimizeSigma
# ----------------------------------------------------------------------------------------------------------

def sigma_generator(seed, idx, device):
    """The generator of input idx's optimisation noise: seeded by (seed, idx, SIGMA_STREAM) alone."""
    state = np.random.SeedSequence([int(seed), int(idx), SIGMA_STREAM]).generate_state(2, dtype=np.uint32)
    g = torch.Generator(device=device)
    g.manual_seed(int(state[0]) << 32 | int(state[1]))
    return g


def radius_proxy(model, x, s, e, cA=None, clamp=(0.02, 0.98)):
    """The soft-smoothing radius s / 2 (Phi^-1(E_A) - Phi^-1(E_B)) of each input, differentiable in s (Eq. 3).

    x: (B, C, H, W); s: (B,); e: (M, B, C, H, W) standard normal draws (the reparameterised noise s e).
    E = the mean softmax over the M draws; E_A = E[cA] (cA: (B,) classes, or the top class when None) and
    E_B = the largest other entry, both clamped to `clamp` (a clamped value has zero gradient).
    Returns (radius (B,), E (B, K)).
    """
    M, B = e.shape[:2]
    z = x.unsqueeze(0) + s.view(1, B, *[1] * (x.dim() - 1)) * e                  # (M, B, C, H, W)
    E = F.softmax(model(z.flatten(0, 1)).float(), 1).view(M, B, -1).mean(0)      # (B, K)
    cA = E.argmax(1) if cA is None else cA
    E_A = E.gather(1, cA.view(-1, 1)).squeeze(1)
    E_B = E.scatter(1, cA.view(-1, 1), -1.0).max(1).values
    lo, hi = clamp
    gap = torch.special.ndtri(E_A.clamp(lo, hi)) - torch.special.ndtri(E_B.clamp(lo, hi))
    return s / 2 * gap, E


def optimize_sigma(model, x, sigma0, K, M, lr, generators, clamp=(0.02, 0.98), bounds=(1e-3, None),
                   fixed_cA=True, keep_best=False):
    """Algorithm 1: each input's sigma by K steps of gradient ascent on radius_proxy, weights frozen.

    x: (B, C, H, W); generators: one torch.Generator per input (its noise does not depend on the batch).
    Starts at sigma0 (a float, or one value per input); each step draws M fresh noises per input and moves s by lr * d radius / d s (plain
    ascent, then clipped to `bounds`). fixed_cA: keep the class of the first step's E (sigma0's), as the
    paper; otherwise the top class of each step, as the official code. keep_best: return the iterate with
    the best proxy (s_0 included), measured at each step. K = 0 returns sigma0 exactly. Returns (B,) sigmas.
    """
    B = x.shape[0]
    s = torch.as_tensor(sigma0, dtype=torch.float32, device=x.device).expand(B).clone()   # a float or (B,)
    if K == 0:
        return s
    best, best_value, cA = s.clone(), torch.full((B,), -math.inf, device=x.device), None
    lo, hi = bounds
    with common.frozen_eval(model):
        for _ in range(K):
            e = torch.stack([torch.randn((M, *x.shape[1:]), device=x.device, generator=g) for g in generators], 1)
            s = s.detach().requires_grad_(True)
            radius, E = radius_proxy(model, x, s, e, cA, clamp)
            if fixed_cA and cA is None:
                cA = E.argmax(1).detach()                  # the class of the model smoothed at sigma0
            improved = radius.detach() > best_value
            best = torch.where(improved, s.detach(), best)
            best_value = torch.where(improved, radius.detach(), best_value)
            grad, = torch.autograd.grad(radius.sum(), s)   # a sum over inputs: each s gets its own gradient
            s = (s.detach() + lr * grad).clamp(min=lo, max=hi)
    return best if keep_best else s.detach()


# ----------------------------------------------------------------------------------------------------------
# Algorithm 3: memory-based certification
# ----------------------------------------------------------------------------------------------------------

ABSTAIN = -1   # stored as a class of its own: later balls of any class avoid an abstained point


def memory_step(memory, x, c, r, rule="paper"):
    """One query of Algorithm 3: (class, radius, case) for input x with raw certificate (c, r), then x is stored.

    memory: a list of (x_i flattened, c_i, r_i), never modified, only appended to; balls are open. Case
    'inside' (i): x lies in a ball of another class: take the class of the deepest such ball i* and the
    radius min(r, r_i* - d_i*) (rule 'paper') or r_i* - d_i* (rule 'code'), a ball inside R_i*. Case
    'touching' (ii): otherwise shrink r to min over other-class balls of d_i - r_i. Case 'none': unchanged.
    An abstention (c = ABSTAIN, r = 0) outside every foreign ball is stored as a point of its own class.
    Invariant kept: balls of different classes are disjoint (||x_i - x_j|| >= r_i + r_j).
    """
    x = x.flatten().double()
    if memory:
        centers = torch.stack([m[0] for m in memory])
        d = (centers - x).norm(dim=1)
        classes = torch.tensor([m[1] for m in memory])
        radii = torch.tensor([m[2] for m in memory], dtype=torch.float64)
        foreign = classes != c
        inside = foreign & (d < radii)
        if inside.any():
            depth = torch.where(inside, d - radii, torch.full_like(d, math.inf))
            i = int(depth.argmin())
            c = int(classes[i])
            r = min(r, float(radii[i] - d[i])) if rule == "paper" else float(radii[i] - d[i])
            case = "inside"
        elif foreign.any() and bool((d[foreign] - radii[foreign] < r).any()):
            r = max(0.0, float((d[foreign] - radii[foreign]).min()))
            case = "touching"
        else:
            case = "none"
    else:
        case = "none"
    memory.append((x, c, r))
    return c, r, case


def check_memory_invariant(memory):
    """True if every pair of stored balls of different classes is disjoint."""
    for i, (xi, ci, ri) in enumerate(memory):
        for xj, cj, rj in memory[:i]:
            if ci != cj and float((xi - xj).norm()) < ri + rj - 1e-12:
                return False
    return True


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    common.check(argv[:1] in (["certify"], ["memory"], ["train"]), "usage: python ddrs.py certify ... | memory "
                                                                  "LOG | train ... (see --help of each)")
    if argv[0] == "train":
        p = common.ArgumentParser(prog="ddrs.py train", description=train_main.__doc__)
        p.add_argument("--method", required=True, choices=tuple(DS_METHODS), help="the loss (DDRS.md §5)")
        p.add_argument("--dataset", default="cifar10", choices=common.DATASETS, help="training data")
        p.add_argument("--data-dir", default=None, help="dataset folder (default $RS_DATA_DIR or ./data)")
        p.add_argument("--arch", choices=common.ARCHS, help="default: the dataset's (cifar_resnet110, digits_cnn)")
        p.add_argument("--sigma", type=float, help="sigma_0: the fixed sigma of the warm-up and every start")
        p.add_argument("--m", type=int, help="noise draws per image (default: 1; MACER 64)")
        p.add_argument("--epochs", type=int, help="default: 200 cifar10, 20 digits")
        p.add_argument("--warmup", type=int, help="epochs at the fixed sigma_0 first (default 50 cifar10, 5 digits)")
        p.add_argument("--K_train", type=int, default=1, help="OptimizeSigma steps per minibatch (ASSUMED 1)")
        p.add_argument("--M", type=int, default=1, help="noise draws per OptimizeSigma step")
        p.add_argument("--lr_sigma", type=float, default=1e-4, help="OptimizeSigma step size")
        p.add_argument("--batch", type=int, default=256, help="images per loader batch")
        p.add_argument("--lr", type=float, default=0.1, help="initial SGD learning rate")
        p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
        p.add_argument("--weight_decay", type=float, default=1e-4, help="SGD weight decay")
        p.add_argument("--workers", type=int, default=2, help="data loader worker processes")
        p.add_argument("--seed", type=int, default=0, help="seed of all randomness (a resumed run repeats it)")
        p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
        p.add_argument("--outdir", help="run folder (default runs/ddrs_<method>_<dataset>_sigma<sigma>)")
        p.add_argument("--resume", action="store_true", help="continue the run in --outdir from its checkpoint")
        p.add_argument("--max-batches", type=int, help="stop each epoch after this many batches (smoke tests)")
        return "train", p.parse_args(argv[1:])
    if argv[0] == "memory":
        p = common.ArgumentParser(prog="ddrs.py memory", description=memory_main.__doc__)
        p.add_argument("log", help="a finished `ddrs.py certify` log (the memory is replayed in index order)")
        p.add_argument("--case-rule", default="paper", choices=("paper", "code"),
                       help="case (i): min(r, r_i - d_i) (paper) or r_i - d_i (official code)")
        p.add_argument("--data-dir", default=None, help="dataset folder of the log's dataset")
        p.add_argument("--outfile", help="default: <log stem>_memory.tsv beside the log")
        p.add_argument("--summary", help="also write the printed summary line to this file (through the guard)")
        return "memory", p.parse_args(argv[1:])
    p = certify.build_parser(__doc__)
    p.prog = "ddrs.py certify"
    g = p.add_argument_group("DDRS (Algorithm 1; defaults DDRS.md §1)")
    g.add_argument("--K", type=int, default=100, help="OptimizeSigma iterations (0: the fixed sigma)")
    g.add_argument("--M", type=int, default=1, help="noise draws per iteration")
    g.add_argument("--lr", type=float, default=1e-4, help="step size of the gradient ascent on sigma")
    g.add_argument("--clamp", type=float, nargs=2, default=(0.02, 0.98), metavar=("LO", "HI"),
                   help="clamp of E_A and E_B before Phi^-1")
    g.add_argument("--sigma-min", type=float, default=1e-3, help="lower bound of sigma_x")
    g.add_argument("--sigma-max", type=float, help="upper bound of sigma_x (default none)")
    g.add_argument("--no-fixed-cA", dest="fixed_cA", action="store_false",
                   help="re-pick the top class at every step (the official code) instead of sigma0's class")
    g.add_argument("--keep-best", action="store_true", help="return the iterate with the best proxy radius")
    args = p.parse_args(argv[1:][1:] if argv[1:2] == ["--"] else argv[1:])
    return "certify", args


def certify_main(args):
    """`ddrs.py certify`: certify.py's CERTIFY at each input's own sigma_x (written in a last column)."""
    certify.check_args(args)
    common.check(args.K >= 0 and args.M >= 1 and args.lr >= 0, "--K must be >= 0, --M >= 1 and --lr >= 0")
    common.check(0 < args.clamp[0] < args.clamp[1] < 1, "--clamp needs 0 < LO < HI < 1")
    common.check(args.sigma_min > 0 and (args.sigma_max is None or args.sigma_max > args.sigma_min),
                 "--sigma-min must be > 0 and below --sigma-max")
    common.check(args.radii is None, "ddrs.py certifies the full radius; --radii is certify.py's")
    common.check(args.seed != "random" and not args.label_mode, "--seed random and --label-mode are certify.py's "
                                                                "(ddrs.py's sigma search uses the seed too)")
    common.check_sigma(args.sigma_min, "--sigma-min", args.precision)
    if args.sigma_max is not None:
        common.check_sigma(args.sigma_max, "--sigma-max", args.precision)
    # the log's identity; without --outfile: runs/ddrs/<checkpoint>_sigma<sigma_0 certified>.tsv
    args = argparse.Namespace(**dict(vars(args), script="ddrs.py certify",
                                     default_folder=os.path.join("runs", "ddrs")))
    bounds = (args.sigma_min, args.sigma_max)

    def sigma_of(model, x, idx, sigma0):
        g = sigma_generator(args.seed, idx, x.device)
        s = optimize_sigma(model, x.unsqueeze(0), sigma0, args.K, args.M, args.lr, [g], tuple(args.clamp),
                           bounds, args.fixed_cA, args.keep_best)
        return float(s[0])
    extra = {"ddrs": {"K": args.K, "M": args.M, "lr": args.lr, "clamp": list(args.clamp), "sigma_min": args.sigma_min,
                      "sigma_max": args.sigma_max, "fixed_cA": args.fixed_cA, "keep_best": args.keep_best}}
    with contextlib.ExitStack() as locks:
        certify.certify_all(args, locks, sigma_of, extra)


def memory_main(args):
    """Algorithm 3 over a finished DDRS log, in index order: the memory's class, radius and case per example."""
    rows = read_ddrs_log(args.log)
    sidecar = common.read_sidecar(args.log, required=("dataset", "split"))
    dataset = common.get_dataset(sidecar["dataset"], sidecar["split"], args.data_dir, train_transform=False)
    outfile = args.outfile or os.path.splitext(args.log)[0] + "_memory.tsv"
    memory, cases, lines = [], {"none": 0, "inside": 0, "touching": 0}, []
    columns = ("idx", "label", "predict", "radius", "correct", "raw_predict", "raw_radius", "sigma", "case")
    problem = common.output_problem(outfile, "DDRS memory", [args.log, args.log + ".json"])
    common.check(problem is None, problem)   # before the work
    for row in sorted(rows, key=lambda r: r["idx"]):
        common.check(0 <= row["idx"] < len(dataset), f"{args.log}: idx {row['idx']} is not an example of the "
                                                     f"{sidecar['dataset']} {sidecar['split']} split")
        x, label = dataset[row["idx"]]
        c, r, case = memory_step(memory, x, row["predict"], row["radius"], args.case_rule)
        cases[case] += 1
        lines.append("\t".join(map(str, [row["idx"], label, c, f"{r:.6}", int(c == label), row["predict"],
                                         row["radius"], row["sigma"], case])))
    common.write_text_output(outfile, "DDRS memory", "\n".join(("\t".join(columns), *lines)) + "\n",
                             [args.log, args.log + ".json"])
    common.check(check_memory_invariant(memory), "internal error: the memory invariant does not hold")
    summary = (f"memory over {len(rows)} examples ({args.case_rule} rule): case (i) inside a foreign ball "
               f"{cases['inside']}, case (ii) touching one {cases['touching']}, unchanged {cases['none']} -> {outfile}")
    print(summary)
    if args.summary:
        common.write_text_output(args.summary, "DDRS memory summary", summary + "\n", [args.log, outfile])


# DS2 schedules (DDRS.md §5): CIFAR-10 200 epochs from scratch, the first 50 at the fixed sigma; digits: our
# CPU demo, 20 epochs, the first 5 fixed. ImageNet fine-tunes released models for 30 epochs (not here).
DS_SCHEDULE = {"cifar10": {"epochs": 200, "warmup": 50, "lr_step": 50}, "digits": {"epochs": 20, "warmup": 5,
                                                                                     "lr_step": 10}}
# Per-method losses of DDRS.md §5: Cohen (m = 1), SmoothAdv (2 PGD steps, one draw, eps 64/255 as [C]),
# MACER ([C]: 64 draws, lambda 12, gamma 8, beta 16); --m overrides the draws.
DS_METHODS = {"gaussian": dict(m=1), "smoothadv": dict(m=1, T=2, eps=64 / 255),
              "macer": dict(m=64, lbd=12.0, gamma=8.0, beta=16.0)}


def ds_loss_fn(method, hp, sigmas, sigma_steps, epoch, seed):
    """The epoch's loss_fn(model, x, y, idx) for common.train_epoch: optimise each image's sigma from its stored
    value (Algorithm 2, weights frozen inside optimize_sigma), store it, then the method's loss at those sigmas.
    sigmas: a CPU tensor with one sigma per training index, updated in place. sigma_steps: (K, M, lr)."""
    import train_baselines
    K, M, lr = sigma_steps

    def loss_fn(model, x, y, idx):
        gens = [sigma_generator(seed + 7919 * (epoch + 1), int(i), x.device) for i in idx.tolist()]
        s = optimize_sigma(common.unwrap(model), x, sigmas[idx.cpu()].to(x.device), K, M, lr, gens)
        sigmas[idx.cpu()] = s.cpu()
        s = s.view(-1, *[1] * (x.dim() - 1))                                     # (b, 1, 1, 1): per image
        if method == "gaussian":
            return common.gaussian_loss(model, x, y, s, hp["m"])
        if method == "smoothadv":
            return train_baselines.smoothadv_loss(model, x, y, idx, sigma=s, m=hp["m"], T=hp["T"], eps=hp["eps"])
        return train_baselines.macer_loss(model, x, y, idx, sigma=s, m=hp["m"], beta=hp["beta"], gamma=hp["gamma"],
                                          lbd=hp["lbd"])
    return loss_fn


def train_main(args):
    """`ddrs.py train` (Algorithm 2): the shared epoch loop, with per-example sigmas after the warm-up."""
    common.check(args.sigma is not None and 0 < args.sigma < math.inf, "--sigma (sigma_0) must be a finite number > 0")
    common.check(args.dataset in DS_SCHEDULE, f"ddrs.py train supports {', '.join(DS_SCHEDULE)} (ImageNet "
                                              f"fine-tuning is not built)")
    common.check("WORLD_SIZE" not in os.environ or os.environ["WORLD_SIZE"] == "1",
                 "ddrs.py train runs in one process: each rank would keep its own examples' sigmas")
    hp = dict(DS_METHODS[args.method], **{k: v for k, v in (("m", args.m),) if v is not None})
    sched = DS_SCHEDULE[args.dataset]
    epochs = sched["epochs"] if args.epochs is None else args.epochs
    warmup = sched["warmup"] if args.warmup is None else args.warmup
    common.check(epochs >= 0 and warmup >= 0 and hp["m"] >= 1 and args.K_train >= 0 and args.M >= 1,
                 "--epochs, --warmup and --K_train must be >= 0, --m and --M >= 1")
    settings = dict(vars(args), epochs=epochs, warmup=warmup, m=hp["m"], lr_step=sched["lr_step"],
                    arch=args.arch or common.DEFAULT_ARCH[args.dataset],
                    outdir=args.outdir or f"runs/ddrs_{args.method}_{args.dataset}_sigma{args.sigma}")
    common.check_training_settings(settings)
    s = argparse.Namespace(**settings)
    s.run = common.run_identity("ddrs.py train", s.dataset, s.data_dir)   # checked on --resume
    device = common.get_device(args.device)
    with common.run_folder_lock(s.outdir):
        ds_train(s, hp, device)


def ds_train(s, hp, device):
    """The loop of `ddrs.py train`: fixed sigma for s.warmup epochs, then per-example sigmas (checkpointed)."""
    import time
    common.seed_everything(s.seed)
    train_set = common.get_dataset(s.dataset, "train", s.data_dir)
    test_loader = common.make_test_loader(common.get_dataset(s.dataset, "test", s.data_dir), 256, s.workers)
    loaders = common.TrainLoader(train_set, s.batch, s.workers, s.seed)
    model = common.get_architecture(s.arch, s.dataset).to(device)
    optimizer = common.make_optimizer(model, s.lr, s.momentum, s.weight_decay)
    scheduler = common.make_scheduler(optimizer, s.lr_step)
    first, state = common.start_or_resume(model, optimizer, scheduler, s.outdir, s.resume,
                                          {"arch": s.arch, "dataset": s.dataset, "sigma": s.sigma},
                                          args=vars(s))
    sigmas = state.get("sigmas", torch.full((len(train_set),), float(s.sigma))).cpu().float()
    common.write_json(vars(s), os.path.join(s.outdir, "args.json"), "settings of a run")
    print(f"DS2 training {s.arch} with {s.method} on {s.dataset}, sigma_0 {s.sigma}, {s.warmup} fixed epochs, "
          f"then K_train {s.K_train}; writing {s.outdir}")
    log, run_start = common.open_train_log(s.outdir, first), time.time()
    chunks = 1 if s.method == "macer" else hp["m"]        # the m-chunk convention, as train_baselines.CHUNKED
    for epoch in range(first, s.epochs):
        start = time.time()
        common.seed_epoch(s.seed, epoch)
        K = s.K_train if epoch >= s.warmup else 0                      # Algorithm 2: fixed sigma first
        loss_fn = ds_loss_fn(s.method, hp, sigmas, (K, s.M, s.lr_sigma), epoch, s.seed)
        lr = optimizer.param_groups[0]["lr"]
        row = common.train_epoch(model, loaders.epoch(epoch), optimizer, loss_fn, chunks, device,
                                 common.progress_line(f"epoch {epoch + 1}"), s.max_batches)
        row.update(common.evaluate_noisy(model, test_loader, s.sigma, device,
                                         common.eval_generator(s.seed, epoch, device)))
        scheduler.step()
        common.log_epoch(log, epoch, s.epochs, run_start, first,
                         dict(row, time=time.time() - start, lr=lr, kept=len(train_set)))
        common.save_training_checkpoint(s.outdir, model, optimizer, scheduler, epoch + 1, vars(s),
                                        {"sigmas": sigmas.clone()})
        print(f"  sigma per example: mean {sigmas.mean():.4f}, min {sigmas.min():.4f}, max {sigmas.max():.4f}")


def read_ddrs_log(path):
    """The rows of a `ddrs.py certify` log (common.read_certification_log, with its per-row sigma column):
    idx, predict (-1: abstain), radius, sigma."""
    log = common.read_certification_log(path)
    common.check("sigma_x" in log, f"{path}: not a ddrs.py certify log (no sigma column)")
    common.check(not log["label_mode"], f"{path}: a --label-mode log holds no predictions for the memory")
    return [{"idx": int(i), "predict": int(p), "radius": float(r), "sigma": float(s)}
            for i, p, r, s in zip(log["idx"], log["predict"], log["radius"], log["sigma_x"])]


def main(argv=None):
    command, args = parse_args(argv)
    if command == "certify":
        certify_main(args)
    elif command == "train":
        train_main(args)
    else:
        memory_main(args)


if __name__ == "__main__":
    common.run(main)

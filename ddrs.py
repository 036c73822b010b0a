"""Data-Dependent Randomized Smoothing (Alfarra, Bibi, Torr, Ghanem, UAI 2022; DDRS.md): a sigma per input.

Usage: python ddrs.py certify --checkpoint runs/train_gaussian_digits_sigma0.25/checkpoint.pth.tar --N 1000
       python ddrs.py memory runs/ddrs/<log>.tsv       (Algorithm 3 over a finished log, in index order)

The paper, and where it is here:
  Algorithm 1, OptimizeSigma (§3.2, Eq. 3)   optimize_sigma: per-input sigma by Monte Carlo gradient ascent on
                                             the soft-smoothing radius s / 2 (Phi^-1(E_A) - Phi^-1(E_B)), E_B the
                                             runner-up class, weights frozen, a batch of inputs per step
  §3.3, certification at sigma_x             `certify`: certify.py's CERTIFY (its flags, TSV, sidecar, resume,
                                             torchrun split) at sigma_x, written in a last column `sigma`
  Algorithm 3, memory-based certification    `memory`: the stored (x_i, c_i, r_i) keep balls of different
     (§3.5, App. C)                          classes disjoint; cases (i) inside a foreign ball and (ii) touching
                                             one, with the paper's or the code's rule (--case-rule)

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
import json
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
    Starts at sigma0; each step draws M fresh noises per input and moves s by lr * d radius / d s (plain
    ascent, then clipped to `bounds`). fixed_cA: keep the class of the first step's E (sigma0's), as the
    paper; otherwise the top class of each step, as the official code. keep_best: return the iterate with
    the best proxy (s_0 included), measured at each step. K = 0 returns sigma0 exactly. Returns (B,) sigmas.
    """
    B = x.shape[0]
    s = torch.full((B,), float(sigma0), device=x.device)
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
    common.check(argv[:1] in (["certify"], ["memory"]), "usage: python ddrs.py certify ... | python ddrs.py "
                                                        "memory LOG (see --help of each)")
    if argv[0] == "memory":
        p = common.ArgumentParser(prog="ddrs.py memory", description=memory_main.__doc__)
        p.add_argument("log", help="a finished `ddrs.py certify` log (the memory is replayed in index order)")
        p.add_argument("--case-rule", default="paper", choices=("paper", "code"),
                       help="case (i): min(r, r_i - d_i) (paper) or r_i - d_i (official code)")
        p.add_argument("--data-dir", default=None, help="dataset folder of the log's dataset")
        p.add_argument("--outfile", help="default: <log stem>_memory.tsv beside the log")
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
    if args.outfile is None:
        args = argparse.Namespace(**dict(vars(args), outfile=os.path.join(
            "runs", "ddrs", os.path.basename(certify.default_outfile(args.checkpoint, args.sigma or 0, args.split,
                                                                     args.predict)))))
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
    try:
        with open(args.log + ".json") as f:
            sidecar = json.load(f)
    except (OSError, ValueError) as e:
        raise common.UserError(f"cannot read the settings {args.log}.json ({type(e).__name__})") from None
    dataset = common.get_dataset(sidecar["dataset"], sidecar["split"], args.data_dir, train_transform=False)
    outfile = args.outfile or os.path.splitext(args.log)[0] + "_memory.tsv"
    memory, cases = [], {"none": 0, "inside": 0, "touching": 0}
    columns = ("idx", "label", "predict", "radius", "correct", "raw_predict", "raw_radius", "sigma", "case")
    with open(outfile, "w") as out:
        print("\t".join(columns), file=out)
        for row in sorted(rows, key=lambda r: r["idx"]):
            x, label = dataset[row["idx"]]
            c, r, case = memory_step(memory, x, row["predict"], row["radius"], args.case_rule)
            cases[case] += 1
            print("\t".join(map(str, [row["idx"], label, c, f"{r:.6}", int(c == label), row["predict"],
                                      row["radius"], row["sigma"], case])), file=out, flush=True)
    common.check(check_memory_invariant(memory), "internal error: the memory invariant does not hold")
    print(f"memory over {len(rows)} examples ({args.case_rule} rule): case (i) inside a foreign ball "
          f"{cases['inside']}, case (ii) touching one {cases['touching']}, unchanged {cases['none']} -> {outfile}")


def read_ddrs_log(path):
    """The rows of a `ddrs.py certify` log: idx, predict (-1: abstain), radius, sigma."""
    common.check(os.path.isfile(path), f"{path}: file not found")
    with open(path) as f:
        lines = f.read().splitlines()
    common.check(lines and lines[0].split("\t")[-1] == "sigma", f"{path}: not a ddrs.py certify log (no sigma "
                                                                 f"column)")
    header = lines[0].split("\t")
    rows = []
    for line in lines[1:]:
        cells = dict(zip(header, line.split("\t")))
        rows.append({"idx": int(cells["idx"]), "predict": int(cells["predict"]), "radius": float(cells["radius"]),
                     "sigma": float(cells["sigma"])})
    return rows


def main(argv=None):
    command, args = parse_args(argv)
    if command == "certify":
        certify_main(args)
    else:
        memory_main(args)


if __name__ == "__main__":
    common.run(main)

"""Data-Dependent Randomized Smoothing (Alfarra, Bibi, Torr, Ghanem, UAI 2022; docs/ddrs.md): a sigma per input.

Usage: python ddrs.py certify --checkpoint runs/train_gaussian_digits_sigma0.25/checkpoint.pth.tar --N 1000
       python ddrs.py certify --checkpoint CKPT --semi-elastic     (a sound certificate: Súkeník et al. 2022)
       python ddrs.py memory runs/ddrs/<log>.tsv       (Algorithm 3 over a finished log, in index order)
       python ddrs.py train --method gaussian --dataset digits --sigma 0.25     (DS2 training, Algorithm 2)
       python ddrs.py report DS_LOGS... --fixed LOG --out DIR    (DDRS against the fixed sigma_0, per log)

The paper, and where it is here:
  Algorithm 1, OptimizeSigma (§3.2, Eq. 3)   optimize_sigma: per-input sigma by Monte Carlo gradient ascent on
                                             the soft-smoothing radius s / 2 (Phi^-1(E_A) - Phi^-1(E_B)), E_B the
                                             runner-up class, weights frozen, a batch of inputs per step; A the
                                             class of the model smoothed at sigma_0 (smoothed_class)
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

What `certify --semi-elastic` proves. sigma(x) = sigma_0 exp(r (rho_k(x) - m)) is a fixed function of x
(rho_k: the mean distance to the k nearest training images, so |ln sigma(a) - ln sigma(b)| <= r ||a - b||).
With probability >= 1 - alpha, the classifier z -> g_{sigma(z)}(z) itself is constant on the ball
(Súkeník et al. 2022): the radius is the largest d at which the Neyman-Pearson worst case of noise at any
sigma in [sigma(x) e^{-r d'}, sigma(x) e^{r d'}], d' <= d, keeps class A above 1/2 (semi_elastic_radius:
searched at the two extreme sigmas, then verified on a grid of interior sigmas and distances).
"""
import argparse
import contextlib
import math
import os
import sys
import warnings

import numpy as np
import torch
import torch.nn.functional as F

import certify
import common
import readers
import machinery

SIGMA_STREAM = 1   # (seed, idx, stream): the optimisation noise is independent of the certification noise
CLASS_STREAM = 2   # and so is the noise that picks the class sigma_x is optimised for (smoothed_class)


# ----------------------------------------------------------------------------------------------------------
# Algorithm 1: OptimizeSigma
# ----------------------------------------------------------------------------------------------------------

def sigma_generator(seed, idx, device, stream=SIGMA_STREAM):
    """The generator of input idx's optimisation noise: seeded by (seed, idx, stream) alone."""
    seeds = [common.check_int("seed", seed, 0), common.check_int("idx", idx, 0), common.check_int("stream", stream, 0)]
    state = np.random.SeedSequence(seeds).generate_state(2, dtype=np.uint32)
    g = torch.Generator(device=device)
    g.manual_seed(int(state[0]) << 32 | int(state[1]))
    return g


def radius_proxy(model, x, s, e, cA=None, clamp=(0.02, 0.98)):
    """The soft-smoothing radius s / 2 (Phi^-1(E_A) - Phi^-1(E_B)) of each input, differentiable in s (Eq. 3).

    x: (B, C, H, W); s: (B,); e: (M, B, C, H, W) standard normal draws (the reparameterised noise s e).
    E = the mean softmax over the M draws; E_A = E[cA] (cA: (B,) classes, or the top class when None) and
    E_B = the largest other entry, both clamped to `clamp` (a clamped value has zero gradient).
    The model runs in eval mode (one fixed classifier; its modules get their modes back). Returns (radius (B,),
    E (B, K)).
    """
    check_proxy(model, x, cA, clamp)
    common.check_tensor("s", s, "B", B=len(x))
    common.check_tensor("e", e, "M B C H W", B=len(x))
    common.check(e.shape[2:] == x.shape[1:], f"e's draws have shape {tuple(e.shape[2:])}, x's {tuple(x.shape)}")
    common.check(e.dtype == x.dtype and e.device == x.device, f"e is {e.dtype} on {e.device}, x {x.dtype} on {x.device}")
    common.check(s.is_cuda or bool((torch.isfinite(s) & (s > 0)).all()) and bool(torch.isfinite(e).all()),
                 "s must be finite and > 0 (the noise levels), e finite (standard normal draws)")   # GPU: no stall
    M, B = e.shape[:2]
    z = x.unsqueeze(0) + s.view(1, B, *[1] * (x.dim() - 1)).to(x.dtype) * e     # (M, B, C, H, W)
    with common.eval_mode(model):
        logits = model(z.flatten(0, 1))
    common.check(logits.dim() == 2 and len(logits) == M * B, f"the model returned logits of shape "
                                                             f"{tuple(logits.shape)} for {M * B} inputs")
    E = F.softmax(logits.float(), 1).view(M, B, -1).mean(0)                      # (B, K)
    common.check(cA is None or cA.is_cuda or int(cA.max()) < E.shape[1], f"cA holds classes beyond the model's "
                                                                         f"{E.shape[1]}")
    cA = E.argmax(1) if cA is None else cA.to(E.device)
    E_A = E.gather(1, cA.view(-1, 1)).squeeze(1)
    E_B = E.scatter(1, cA.view(-1, 1), -1.0).max(1).values
    lo, hi = clamp
    gap = torch.special.ndtri(E_A.clamp(lo, hi)) - torch.special.ndtri(E_B.clamp(lo, hi))
    return s / 2 * gap, E


def check_proxy(model, x, cA, clamp):
    """The arguments radius_proxy and optimize_sigma share: TypeError or ValueError naming the argument."""
    common.check_type("model", model, callable)
    common.check_tensor("x", x, "B C H W")
    common.check_input_of(model, x, read_values=not x.is_cuda)   # values read on the CPU only: a GPU step never waits
    if cA is not None:
        common.check_tensor("cA", cA, "B", "int", B=len(x))
        common.check(cA.is_cuda or bool((cA >= 0).all()), "cA holds negative classes")
    clamp = common.check_array("clamp", clamp, ndim=1, gt=0, lt=1)
    common.check(len(clamp) == 2 and clamp[0] < clamp[1], f"clamp = {clamp!r}: (low, high) with low < high")


# smoothed_class: rounds of CLASS_DRAWS hard votes at sigma_0 until the top two classes are told apart (two-sided
# binomial test at CLASS_ALPHA, as Cohen's PREDICT), at most CLASS_MAX_DRAWS.
CLASS_DRAWS, CLASS_MAX_DRAWS, CLASS_ALPHA = 100, 1000, 0.01


def smoothed_class(model, x, sigma0, num_classes, generator, batch=1000, precision="fp32", draws=CLASS_DRAWS,
                   max_draws=CLASS_MAX_DRAWS, alpha=CLASS_ALPHA):
    """cA of Algorithm 1: the class that the model smoothed at sigma0 predicts at x (Alfarra et al. 2022, Eq. 2).

    Hard votes of `draws` noisy copies at a time (x: (C, H, W)), until a two-sided binomial test of the top
    two counts at level alpha says which is larger, or max_draws are spent (then the top class so far: the
    smoothed classifier is then near a tie between the two). The noise comes from `generator` (CLASS_STREAM
    of the input), apart from the certification noise, so CERTIFY's guarantee at the resulting sigma_x is
    that of any sigma chosen before its draws. Returns (class, draws made)."""
    common.check_smoothed(model, x, generator)
    common.check_float("sigma0", sigma0, gt=0)
    common.check_float("alpha", alpha, gt=0, lt=1)
    common.check_int("num_classes", num_classes, 2)   # the test tells the top two classes apart
    for name, n in (("batch", batch), ("draws", draws), ("max_draws", max_draws)):
        common.check_int(name, n)
    common.check_choice("precision", precision, tuple(common.PRECISIONS))
    from scipy.stats import binomtest
    counts, drawn = None, 0
    while True:
        new = common.sample_counts(common.in_precision(model, precision), x.unsqueeze(0), sigma0, draws, batch,
                                   num_classes, generator)[0].cpu()
        counts, drawn = new if counts is None else counts + new, drawn + draws
        top2 = torch.topk(counts, 2).values.tolist()
        if drawn >= max_draws or binomtest(top2[0], sum(top2), 0.5).pvalue <= alpha:
            return int(counts.argmax()), drawn   # first class on ties, as certify.py's selection


def optimize_sigma(model, x, sigma0, K, M, lr, generators, clamp=(0.02, 0.98), bounds=(1e-3, None),
                   fixed_cA=True, keep_best=False, cA=None):
    """Algorithm 1: each input's sigma by K steps of gradient ascent on radius_proxy, weights frozen.

    x: (B, C, H, W); generators: one torch.Generator per input (its noise does not depend on the batch).
    Starts at sigma0 (a float, or one value per input); each step draws M fresh noises per input and moves s by lr * d radius / d s (plain
    ascent, then clipped to `bounds`). fixed_cA: keep one class, as the paper: cA ((B,) classes, from
    smoothed_class: the prediction of the model smoothed at sigma0), or when cA is None the top class of the
    first step's E (one noisy draw for M = 1: the DS2 training steps); otherwise the top class of each step,
    as the official code. keep_best: return the iterate with
    the best proxy (s_0 included), measured at each step. K = 0 returns sigma0 exactly. Returns (B,) sigmas.
    """
    if cA is not None:
        cA = torch.as_tensor(common.check_array("cA", cA, ndim=1, integral=True, ge=0), dtype=torch.long)
    check_proxy(model, x, cA, clamp)
    B = x.shape[0]
    if isinstance(sigma0, torch.Tensor):   # one per input: ddrs.py train's stored sigmas, kept within bounds
        common.check_tensor("sigma0", sigma0, "B", B=B)
        common.check(bool((torch.isfinite(sigma0) & (sigma0 > 0)).all()), "sigma0 holds values that are not finite "
                                                                          "and > 0")
    else:
        common.check_float("sigma0", sigma0, gt=0)
    common.check_int("K", K, 0)
    common.check_int("M", M)
    common.check_float("lr", lr, ge=0)
    common.check(isinstance(generators, (list, tuple)) and len(generators) == B and all(isinstance(
        g, torch.Generator) for g in generators) and len({bytes(g.get_state().numpy()) for g in generators}) == B,
        "generators: one torch.Generator per input, each its own (no two in the same state: seeded alike, they "
        "would draw the same noise)")
    common.check(isinstance(bounds, (list, tuple)) and len(bounds) == 2, f"bounds must be (low, high or None), "
                                                                        f"not {bounds!r:.40}")
    lo, hi = bounds
    common.check_float("bounds[0]", lo, gt=0)
    if hi is not None:
        common.check_float("bounds[1]", hi, gt=lo)
    common.check_type("fixed_cA", fixed_cA, bool)
    common.check_type("keep_best", keep_best, bool)
    s = torch.as_tensor(sigma0, dtype=torch.float32, device=x.device).expand(B).clone()   # a float or (B,)
    if K == 0:
        return s
    best, best_value = s.clone(), torch.full((B,), -math.inf, device=x.device)
    cA = None if cA is None or not fixed_cA else cA.to(x.device)
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
# A sound radius for input-dependent sigma (Súkeník, Kuvshinov, Günnemann, ICML 2022; docs/ddrs.md)
# ----------------------------------------------------------------------------------------------------------

# --semi-elastic defaults (docs/ddrs.md: the re-implementation of Súkeník et al.): k nearest training points, rate r, and
# the centre m of rho_k for CIFAR-10; for a dataset without one, the median rho_k of training points is used.
SEMI_ELASTIC_K, SEMI_ELASTIC_R, SEMI_ELASTIC_M = 20, 0.01, {"cifar10": 5.0}


def knn_distance(train, x, k, chunk=8192):
    """rho_k(x): the mean l2 distance from x to its k nearest rows of `train` ((n, d)), in float64.

    Each order statistic of the distances is 1-Lipschitz in x, so their mean is: sigma(x) = sigma_b
    exp(r (rho_k(x) - m)) then satisfies |ln sigma(a) - ln sigma(b)| <= r ||a - b|| (r-semi-elastic)."""
    common.check_tensor("train", train, "n d")
    common.check_tensor("x", x, None)
    common.check(x.numel() == train.shape[1], f"x has {x.numel()} values, train's rows {train.shape[1]}")
    common.check_int("k", k, 1, len(train))
    common.check_int("chunk", chunk)
    common.check(bool(torch.isfinite(x).all() and torch.isfinite(train).all()), "x and train must be finite")
    x = x.flatten().double()
    d = torch.cat([(train[i:i + chunk].double() - x).norm(dim=1) for i in range(0, len(train), chunk)])
    return float(d.topk(k, largest=False).values.mean())


def worst_class_b(d, sigma0, sigma1, pA_lower, dim):
    """The largest probability that the noise at sigma1 around a point x1 at distance d from x gives a class
    other than A, over every base classifier whose class-A probability at x (noise sigma0) is >= pA_lower.

    The Neyman-Pearson worst case of two Gaussians with different sigmas is a ball (Súkeník et al. 2022): under x's
    noise, ||z - c||^2 / sigma0^2 is noncentral chi-square (dim degrees, noncentrality L0), under x1's
    (L1). sigma1 < sigma0: B fills the ball of x's probability 1 - pA_lower; sigma1 > sigma0: its outside.
    Class A is guaranteed at x1 iff the result is < 1/2. Arrays broadcast (sigma1 != sigma0, d > 0)."""
    common.check_array("d", d, gt=0)
    common.check_float("sigma0", sigma0, gt=0)
    common.check_array("sigma1", sigma1, gt=0)
    common.check_array("pA_lower", pA_lower, ge=0, le=1)
    common.check_int("dim", dim)
    common.check(bool(np.all(np.asarray(sigma1, float) != float(sigma0))), "sigma1 must differ from sigma0 (equal "
                 "sigmas: Cohen's Theorem 1 gives the answer)")
    from scipy.stats import ncx2
    d, s0, s1 = np.asarray(d, float), float(sigma0), np.asarray(sigma1, float)
    L0 = s0 ** 2 * d ** 2 / (s0 ** 2 - s1 ** 2) ** 2
    L1 = s1 ** 2 * d ** 2 / (s0 ** 2 - s1 ** 2) ** 2
    below = ncx2.cdf(s0 ** 2 / s1 ** 2 * ncx2.ppf(1 - pA_lower, dim, L0), dim, L1)
    above = ncx2.sf(s0 ** 2 / s1 ** 2 * ncx2.ppf(pA_lower, dim, L0), dim, L1)
    return np.where(s1 < s0, below, above)


# ln sigma as computed (rho_k in float64, sigma rounded to float32 for the noise) may differ from the exact
# r-semi-elastic one by about 1e-7: the band of sigmas a neighbour may have is widened by this much.
SIGMA_ROUNDING = 1e-6


def semi_elastic_radius(pA_lower, sigma, r, dim, scan=32, bisect=40, verify=8):
    """The l2 radius certified at x for the classifier z -> g_{sigma(z)}(z) when sigma(.) is r-semi-elastic
    (|ln sigma(a) - ln sigma(b)| <= r ||a - b||), sigma = sigma(x), pA_lower a lower bound of pA at x.

    A point at distance d' has a sigma in [sigma e^{-r d'}, sigma e^{r d'}]; the radius is the largest d such
    that worst_class_b < 1/2 for every d' <= d and every such sigma (the band widened by SIGMA_ROUNDING in ln
    sigma, for the float rounding of sigma(x)). Found at the two extreme sigmas (the
    re-implementation's rule; ASSUMED worst, docs/ddrs.md): the first failing point of a scan of [0, Cohen's
    radius], then bisection; the result is then verified on a grid of d' and of interior sigmas, and lowered
    until it passes. Never above Cohen's radius sigma Phi^-1(pA_lower) (r = 0: exactly Cohen's); 0 below 1/2.
    """
    common.check_float("pA_lower", pA_lower, ge=0, lt=1)   # 1 bounds no finite sample: an infinite radius
    common.check_float("sigma", sigma, gt=0)
    common.check_float("r", r, ge=0)
    for name, n in (("dim", dim), ("scan", scan), ("bisect", bisect), ("verify", verify)):
        common.check_int(name, n)
    from scipy.stats import norm
    if pA_lower <= 0.5:
        return 0.0
    cohen = float(sigma * norm.ppf(pA_lower))
    if r == 0:
        return cohen

    def holds(d, fractions=(-1.0, 1.0), distances=(1.0,)):
        dd = d * np.asarray(distances)[:, None]
        with np.errstate(over="ignore", under="ignore"):
            s1 = sigma * np.exp(np.asarray(fractions)[None, :] * (r * dd + SIGMA_ROUNDING))
        if not (np.all(dd > 0) and np.all(np.isfinite(s1) & (s1 > 0) & (s1 != sigma))):
            return False   # a band of sigma beyond float64 (r or sigma extreme): not proven
        with warnings.catch_warnings(record=True) as caught:   # scipy's series did not converge: not proven
            warnings.simplefilter("always")
            b = worst_class_b(dd, sigma, s1, pA_lower, dim)
        return not caught and bool(np.all(b < 0.5 - 1e-9))   # a margin for scipy's rounding; a NaN fails too

    lo, hi = 0.0, None
    for d in cohen * np.arange(1, scan + 1) / scan:
        if not holds(d):
            hi = d
            break
        lo = d
    if hi is None:
        return cohen
    for _ in range(bisect):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    grid = np.arange(1, verify + 1) / verify
    fractions = np.concatenate([-grid, grid])
    for _ in range(500):   # the assumption failed here: lower the radius until the grid passes
        if holds(lo, fractions, grid):
            return lo
        lo *= 0.99
    return 0.0


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
    common.check_type("memory", memory, list)
    common.check_tensor("x", x, None)
    common.check_int("c", c, ABSTAIN)
    common.check_float("r", r, ge=0)
    common.check_choice("rule", rule, ("paper", "code"))
    common.check(bool(torch.isfinite(x).all()), "x holds NaN or infinite values: not an input")
    x = x.flatten().double()
    common.check(all(isinstance(m, tuple) and len(m) == 3 and isinstance(m[0], torch.Tensor) and m[0].shape == x.shape
                     for m in memory), f"memory must hold memory_step's (x flattened to {x.numel()} values, c, r)")
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
    if argv[:1] in (["-h"], ["--help"]):   # the module's own page: its usage and what a certificate proves
        print(__doc__)
        sys.exit(0)
    common.check(argv[:1] in (["certify"], ["memory"], ["train"], ["report"]),
                 "usage: python ddrs.py certify ... | memory LOG | train ... | report LOGS --fixed LOG --out DIR "
                 "(see --help of each)")
    if argv[0] == "train":
        p = machinery.ArgumentParser(prog="ddrs.py train", description=train_main.__doc__)
        p.add_argument("--method", required=True, choices=tuple(DS_METHODS), help="the loss (docs/ddrs.md)")
        p.add_argument("--dataset", default="cifar10", choices=common.DATASETS, help="training data")
        p.add_argument("--data-dir", default=None, help="dataset folder (default $RS_DATA_DIR or ./data)")
        p.add_argument("--arch", choices=common.ARCHS, help="default: the dataset's (cifar_resnet110, digits_cnn)")
        p.add_argument("--sigma", type=float, help="sigma_0: the fixed sigma of the warm-up and every start")
        p.add_argument("--m", type=int, help="noise draws per image (default: 1; MACER 64)")
        p.add_argument("--epochs", type=int, help="default: 200 cifar10, 20 digits")
        p.add_argument("--warmup", type=int, help="epochs at the fixed sigma_0 first (default 50 cifar10, 5 digits)")
        p.add_argument("--K_train", type=int, help="OptimizeSigma steps per minibatch (default: the official "
                       "code's iter_sig_tr, 10 for MACER on CIFAR-10 and 1 on ImageNet; 1 for the other methods, "
                       "ASSUMED: docs/ddrs.md)")
        p.add_argument("--init-checkpoint", help="start from this trained model's weights (the paper fine-tunes "
                       "released models); the optimizer and schedule start fresh. Recorded in args.json")
        p.add_argument("--trust-checkpoint", action="store_true", help="allow pickled objects in "
                       "--init-checkpoint (only for a file you trust: it can run code)")
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
    if argv[0] == "report":
        p = machinery.ArgumentParser(prog="ddrs.py report", description=report_main.__doc__)
        p.add_argument("logs", nargs="+", help="ddrs.py certify logs of one model (DS at several steps, semi-elastic)")
        p.add_argument("--fixed", required=True, help="certify.py's log of the same model and images at sigma_0")
        p.add_argument("--radii", type=float, nargs="+", default=[0, 0.25, 0.5, 0.75, 1.0], help="certified "
                       "accuracy at these radii")
        p.add_argument("--near-one", type=float, default=0.99, help="'pA near 1': nA / N at sigma_0 at least this")
        p.add_argument("--out", required=True, help="folder of report.md and report.tsv")
        return "report", p.parse_args(argv[1:])
    if argv[0] == "memory":
        p = machinery.ArgumentParser(prog="ddrs.py memory", description=memory_main.__doc__)
        p.add_argument("log", help="a finished `ddrs.py certify` log (the memory is replayed in index order)")
        p.add_argument("--case-rule", default="paper", choices=("paper", "code"),
                       help="case (i): min(r, r_i - d_i) (paper) or r_i - d_i (official code)")
        p.add_argument("--data-dir", default=None, help="dataset folder of the log's dataset")
        p.add_argument("--outfile", help="default: <log stem>_memory.tsv beside the log")
        p.add_argument("--summary", help="also write the printed summary line to this file (through the guard)")
        return "memory", p.parse_args(argv[1:])
    p = certify.build_parser(__doc__)
    p.prog = "ddrs.py certify"
    g = p.add_argument_group("DDRS (Algorithm 1; defaults docs/ddrs.md)")
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
    e = p.add_argument_group("a sound certificate for input-dependent sigma (Súkeník et al. 2022; docs/ddrs.md)")
    e.add_argument("--semi-elastic", action="store_true",
                   help="instead of Algorithm 1: sigma(x) = sigma_0 exp(r (rho_k(x) - m)), rho_k the mean distance "
                        "to the k nearest training images, and the radius that is sound for z -> g_sigma(z)(z)")
    e.add_argument("--elastic-r", type=float, help="r (default 0.01, docs/ddrs.md; 0: fixed sigma, Cohen's radius)")
    e.add_argument("--elastic-k", type=int, help="k nearest training images (default 20)")
    e.add_argument("--elastic-m", type=float, help="m (default: 5 on cifar10, docs/ddrs.md; other datasets: the "
                                                   "median rho_k of 1,000 training images, leaving each out)")
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
    machinery.check_sigma(args.sigma_min, "--sigma-min", args.precision)
    if args.sigma_max is not None:
        machinery.check_sigma(args.sigma_max, "--sigma-max", args.precision)
    # the log's identity; without --outfile: runs/ddrs/<checkpoint>_sigma<sigma_0 certified>.tsv
    args = argparse.Namespace(**dict(vars(args), script="ddrs.py certify",
                                     default_folder=os.path.join("runs", "ddrs")))
    bounds = (args.sigma_min, args.sigma_max)

    given = [f"--{k.replace('_', '-')}" for k in ("elastic_r", "elastic_k", "elastic_m") if getattr(args, k) is not None]
    common.check(args.semi_elastic or not given, f"{', '.join(given)} go with --semi-elastic (the sigma they set)")
    if args.semi_elastic:
        args.elastic_r = SEMI_ELASTIC_R if args.elastic_r is None else args.elastic_r
        args.elastic_k = SEMI_ELASTIC_K if args.elastic_k is None else args.elastic_k
        return semi_elastic_main(args)
    fixed = {"draws": CLASS_DRAWS, "max_draws": CLASS_MAX_DRAWS, "alpha": CLASS_ALPHA}

    def sigma_of(model, x, idx, sigma0):
        cA = None
        if args.fixed_cA and args.K > 0:   # the class of the model smoothed at sigma_0, from its own noise
            g = sigma_generator(args.seed, idx, x.device, CLASS_STREAM)
            cA = [smoothed_class(model, x, sigma0, num_classes(model, x), g, args.batch, args.precision)[0]]
        g = sigma_generator(args.seed, idx, x.device)
        s = optimize_sigma(model, x.unsqueeze(0), sigma0, args.K, args.M, args.lr, [g], tuple(args.clamp),
                           bounds, args.fixed_cA, args.keep_best, cA)
        return float(s[0])
    extra = {"ddrs": {"K": args.K, "M": args.M, "lr": args.lr, "clamp": list(args.clamp), "sigma_min": args.sigma_min,
                      "sigma_max": args.sigma_max, "fixed_cA": args.fixed_cA, "keep_best": args.keep_best,
                      "cA": fixed if args.fixed_cA else "top class of each step"}}
    with contextlib.ExitStack() as locks:
        certify.certify_all(args, locks, sigma_of, extra)


def num_classes(model, x):
    """The number of classes of `model` (its output width on one input x (C, H, W), in eval mode)."""
    common.check_tensor("x", x, "C H W")
    with torch.inference_mode(), common.eval_mode(model):
        return int(model(x.unsqueeze(0)).shape[1])


def semi_elastic_main(args):
    """`ddrs.py certify --semi-elastic`: CERTIFY at sigma(x) = sigma_0 exp(r (rho_k(x) - m)) with the radius of
    semi_elastic_radius, a certificate of the classifier z -> g_{sigma(z)}(z) itself (Súkeník et al. 2022)."""
    common.check(args.elastic_r == 0 or 1e-3 <= args.elastic_r <= 10, "--elastic-r must be 0 or in [0.001, 10] "
                 "(below 0.001 scipy's noncentral chi-square does not converge; 0 is the fixed sigma)")
    common.check(1 <= args.elastic_k <= 10_000, "--elastic-k must be an integer in [1, 10000]")
    common.check(args.elastic_m is None or math.isfinite(args.elastic_m), "--elastic-m must be a finite number")
    state = {}

    def prepare(settings, dataset_name):
        train = common.get_dataset(dataset_name, "train", args.data_dir, train_transform=False)
        common.check(len(train) > args.elastic_k, f"--elastic-k {args.elastic_k} needs more training images "
                                                  f"than the {len(train)} there are")
        print(f"semi-elastic sigma: reading the {len(train)} training images of {dataset_name}", flush=True)
        # float64 once, not per query: knn_distance measures in float64
        state["train"] = torch.stack([train[i][0].flatten() for i in range(len(train))]).double()
        m = args.elastic_m if args.elastic_m is not None else SEMI_ELASTIC_M.get(dataset_name)
        if m is None:   # the median rho_k of training images, each left out of its own neighbours
            t = state["train"]
            m = float(np.median([knn_distance(torch.cat([t[:i], t[i + 1:]]), t[i], args.elastic_k)
                                 for i in range(0, len(t), max(1, len(t) // 1000))]))
        state.update(m=m, dim=int(state["train"].shape[1]))
        settings["ddrs"] = {"semi_elastic": {"r": args.elastic_r, "k": args.elastic_k, "m": m,
                                             "sigma_b": settings["sigma"],
                                             "train_data": machinery.data_fingerprint(dataset_name, "train",
                                                                                      args.data_dir)}}

    def sigma_of(model, x, idx, sigma0):
        s = sigma0 * math.exp(args.elastic_r * (knn_distance(state["train"], x.cpu(), args.elastic_k) - state["m"]))
        machinery.check_sigma(s, f"sigma(x) of example {idx}", args.precision)
        return s

    def radius_fn(pA_lower, sigma):
        return semi_elastic_radius(pA_lower, sigma, args.elastic_r, state["dim"])
    with contextlib.ExitStack() as locks:
        certify.certify_all(args, locks, sigma_of, None, radius_fn, prepare)


def memory_main(args):
    """Algorithm 3 over a finished DDRS log, in index order: the memory's class, radius and case per example."""
    rows = read_ddrs_log(args.log)
    sidecar = readers.read_sidecar(args.log, required=("dataset", "split", "data"))
    dataset = common.get_dataset(sidecar["dataset"], sidecar["split"], args.data_dir, train_transform=False)
    common.check(machinery.data_fingerprint(sidecar["dataset"], sidecar["split"], args.data_dir) == sidecar["data"],
                 f"{args.log}: certified on other images than {sidecar['dataset']} {sidecar['split']} here "
                 f"(--data-dir?): the memory would pair its radii with other inputs")
    outfile = args.outfile or os.path.splitext(args.log)[0] + "_memory.tsv"
    memory, cases, lines = [], {"none": 0, "inside": 0, "touching": 0}, []
    columns = ("idx", "label", "predict", "radius", "correct", "raw_predict", "raw_radius", "sigma", "case")
    machinery.check_output(outfile, [args.log, args.log + ".json"])   # before the work
    for row in sorted(rows, key=lambda r: r["idx"]):
        common.check(0 <= row["idx"] < len(dataset), f"{args.log}: idx {row['idx']} is not an example of the "
                                                     f"{sidecar['dataset']} {sidecar['split']} split")
        x, label = dataset[row["idx"]]
        c, r, case = memory_step(memory, x, row["predict"], row["radius"], args.case_rule)
        cases[case] += 1
        lines.append("\t".join(map(str, [row["idx"], label, c, f"{r:.6}", int(c == label), row["predict"],
                                         row["radius"], row["sigma"], case])))
    machinery.write_text_output(outfile, "DDRS memory", "\n".join(("\t".join(columns), *lines)) + "\n",
                                [args.log, args.log + ".json"])
    common.check(check_memory_invariant(memory), "internal error: the memory invariant does not hold")
    summary = (f"memory over {len(rows)} examples ({args.case_rule} rule): case (i) inside a foreign ball "
               f"{cases['inside']}, case (ii) touching one {cases['touching']}, unchanged {cases['none']} -> {outfile}")
    print(summary)
    if args.summary:
        machinery.write_text_output(args.summary, "DDRS memory summary", summary + "\n", [args.log, outfile])


# DS2 schedules (docs/ddrs.md): CIFAR-10 200 epochs from scratch, the first 50 at the fixed sigma; digits: our
# CPU demo, 20 epochs, the first 5 fixed. ImageNet fine-tunes released models for 30 epochs (not here).
DS_SCHEDULE = {"cifar10": {"epochs": 200, "warmup": 50, "lr_step": 50}, "digits": {"epochs": 20, "warmup": 5,
                                                                                     "lr_step": 10}}
# Per-method losses (docs/ddrs.md): Cohen (m = 1), SmoothAdv (2 PGD steps, one draw, eps 64/255 as [C]),
# MACER ([C]: 64 draws, lambda 12, gamma 8, beta 16); --m overrides the draws.
DS_METHODS = {"gaussian": dict(m=1), "smoothadv": dict(m=1, T=2, eps=64 / 255),
              "macer": dict(m=64, lbd=12.0, gamma=8.0, beta=16.0)}
# K_train per (dataset, method): the official code's iter_sig_tr (10 in its CIFAR-10 MACER script, 1
# in its ImageNet scripts); 1 elsewhere (ASSUMED).
DS_K_TRAIN = {("cifar10", "macer"): 10}


def ds_loss_fn(method, hp, sigmas, sigma_steps, epoch, seed):
    """The epoch's loss_fn(model, x, y, idx) for common.train_epoch: optimise each image's sigma from its stored
    value (Algorithm 2, weights frozen inside optimize_sigma), store it, then the method's loss at those sigmas.
    sigmas: a CPU tensor with one sigma per training index, updated in place. sigma_steps: (K, M, lr)."""
    import train_baselines
    common.check_choice("method", method, ("gaussian", "smoothadv", "macer"))
    common.check_tensor("sigmas", sigmas, "n")
    K, M, lr = sigma_steps

    def loss_fn(model, x, y, idx):
        common.check(int(idx.max()) < len(sigmas), f"idx reaches {int(idx.max())}: sigmas holds {len(sigmas)} images")
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
    K_train = DS_K_TRAIN.get((args.dataset, args.method), 1) if args.K_train is None else args.K_train
    common.check(epochs >= 0 and warmup >= 0 and hp["m"] >= 1 and K_train >= 0 and args.M >= 1,
                 "--epochs, --warmup and --K_train must be >= 0, --m and --M >= 1")
    init = None
    if args.init_checkpoint is not None:   # the weights' identity, checked on --resume like every setting
        common.check(not os.path.isdir(args.init_checkpoint), f"--init-checkpoint {args.init_checkpoint!r} is a "
                                                               f"folder; name the checkpoint file inside it")
        common.check(os.path.isfile(args.init_checkpoint), f"--init-checkpoint {args.init_checkpoint!r}: no such file")
        init = {"path": os.path.relpath(args.init_checkpoint), "sha256": machinery.file_sha256(args.init_checkpoint)}
    settings = dict(vars(args), epochs=epochs, warmup=warmup, m=hp["m"], lr_step=sched["lr_step"], K_train=K_train,
                    init_checkpoint=init,
                    arch=args.arch or common.DEFAULT_ARCH[args.dataset],
                    outdir=args.outdir or f"runs/ddrs_{args.method}_{args.dataset}_sigma{args.sigma}")
    machinery.check_training_settings(settings)
    s = argparse.Namespace(**settings)
    s.run = machinery.run_identity("ddrs.py train", s.dataset, s.data_dir)   # checked on --resume
    machinery.set_inputs([args.init_checkpoint])   # files this run reads: never written over
    device = machinery.get_device(args.device)
    with machinery.run_folder_lock(s.outdir, getattr(s, "amp", None) or "fp32", device):
        ds_train(s, hp, device)


def ds_train(s, hp, device):
    """The loop of `ddrs.py train`: fixed sigma for s.warmup epochs, then per-example sigmas (checkpointed)."""
    import time
    common.seed_everything(s.seed)
    train_set = common.get_dataset(s.dataset, "train", s.data_dir)
    test_loader = common.make_test_loader(common.get_dataset(s.dataset, "test", s.data_dir), 256, s.workers)
    loaders = common.TrainLoader(train_set, s.batch, s.workers, s.seed, machinery.get_rank(),
                                  machinery.get_world_size())
    model = common.get_architecture(s.arch, s.dataset).to(device)
    optimizer = common.make_optimizer(model, s.lr, s.momentum, s.weight_decay)
    scheduler = common.make_scheduler(optimizer, s.lr_step)
    first, state = machinery.start_or_resume(model, optimizer, scheduler, s.outdir, s.resume,
                                             {"arch": s.arch, "dataset": s.dataset, "sigma": s.sigma},
                                             args=vars(s))
    if first == 0 and s.init_checkpoint is not None:   # weights only: optimizer and schedule start fresh
        path = s.init_checkpoint["path"]
        try:   # readers.load_model's checks: strict key matching, finite weights, this dataset's inputs
            loaded, start = readers.load_model(path, s.dataset, s.arch, device, s.trust_checkpoint)
        except common.UserError as e:
            raise common.UserError(f"--init-checkpoint: {e}") from None
        common.check(readers.loaded_sha256(path) == s.init_checkpoint["sha256"], f"--init-checkpoint {path!r} "
                     f"changed since this run recorded it (another sha256); rerun to record the file as it is now")
        common.check(start.get("arch") in (None, s.arch) and start.get("dataset") in (None, s.dataset),
                     f"--init-checkpoint {path!r} holds {start.get('arch')} on {start.get('dataset')}; this run "
                     f"trains {s.arch} on {s.dataset} (pass --arch)")
        model.load_state_dict(loaded.state_dict())
    sigmas = state.get("sigmas", torch.full((len(train_set),), float(s.sigma))).cpu().float()
    machinery.write_json({**vars(s), "environment": machinery.environment()}, os.path.join(s.outdir, "args.json"),
                         "settings of a run")
    print(f"DS2 training {s.arch} with {s.method} on {s.dataset}, sigma_0 {s.sigma}, {s.warmup} fixed epochs, "
          f"then K_train {s.K_train}; writing {s.outdir}")
    log, run_start = machinery.open_train_log(s.outdir, first), time.time()
    chunks = 1 if s.method == "macer" else hp["m"]        # the m-chunk convention, as train_baselines.CHUNKED
    for epoch in range(first, s.epochs):
        start = time.time()
        common.seed_epoch(s.seed, epoch, machinery.get_rank())
        K = s.K_train if epoch >= s.warmup else 0                      # Algorithm 2: fixed sigma first
        loss_fn = ds_loss_fn(s.method, hp, sigmas, (K, s.M, s.lr_sigma), epoch, s.seed)
        lr = optimizer.param_groups[0]["lr"]
        row = common.train_epoch(model, loaders.epoch(epoch), optimizer, loss_fn, chunks, device,
                                 machinery.progress_line(f"epoch {epoch + 1}"), s.max_batches)
        row.update(common.evaluate_noisy(model, test_loader, s.sigma, device,
                                         common.eval_generator(s.seed, epoch, device)))
        scheduler.step()
        machinery.log_epoch(log, epoch, s.epochs, run_start, first,
                            dict(row, time=time.time() - start, lr=lr, kept=len(train_set)))
        machinery.save_training_checkpoint(s.outdir, model, optimizer, scheduler, epoch + 1, vars(s),
                                           {"sigmas": sigmas.clone()})
        print(f"  sigma per example: mean {sigmas.mean():.4f}, min {sigmas.min():.4f}, max {sigmas.max():.4f}")


def report_main(args):
    """DDRS against the fixed sigma_0, per log (DS at each step size, the semi-elastic sigma): ACR, certified
    accuracy, the spread of sigma_x, inputs certified beyond the fixed sigma's ceiling, and where the ACR gain
    comes from (the share of inputs whose pA at sigma_0 is near 1). Differences with intervals: analyze.py
    compare (scripts/compare_cpu.sh). Writes report.md and report.tsv in --out."""
    from scipy.stats import norm
    common.check(0 <= args.near_one <= 1 and all(0 <= r < math.inf for r in args.radii),
                 f"--near-one must lie in [0, 1] and --radii be finite numbers >= 0 (got {args.near_one}, {args.radii})")
    readers.check_same_run([args.fixed, *args.logs])   # one model, one set of images: before any work
    fixed = readers.read_certification_log(args.fixed)
    readers.check_log_kinds(fixed, readers.read_sidecar(args.fixed), FIXED_REFUSED, "ddrs.py report --fixed")
    common.check("sigma_x" not in fixed and "nA" in fixed,
                 f"{args.fixed}: --fixed needs certify.py's CERTIFY log (with nA and N)")
    logs = [(path, readers.read_certification_log(path)) for path in args.logs]   # all read before any work
    for path, log in logs:
        readers.check_log_kinds(log, readers.read_sidecar(path), REPORT_REFUSED, "ddrs.py report")
        common.check("sigma_x" in log, f"{path}: {NO_SIGMA_COLUMN}")
    # DDRS against the fixed sigma_0 is a comparison across modes by design; budget, data and split must agree
    # (the images: paired by idx below)
    said = [line for s, line in readers.check_comparable(   # one model by design: said when certified otherwise
        [dict(log, sidecar=readers.read_sidecar(path)) for path, log in [(args.fixed, fixed), *logs]],
        ("mode", readers.IMAGES), "ddrs.py report") if s in (*readers.NOTED, readers.UNRECORDED)]
    for line in said:
        print(f"note: {line}", file=sys.stderr)
    fs = readers.read_sidecar(args.fixed, required=("sigma", "alpha"))
    order = np.argsort(fixed["idx"])
    f_idx, f_gain = fixed["idx"][order], (fixed["radius"] * fixed["correct"])[order]
    near = (fixed["nA"] / fixed["N"])[order] >= args.near_one
    ceiling = fs["sigma"] * norm.ppf(fs["alpha"] ** (1 / int(fixed["N"].max())))   # sigma Phi^-1(alpha^(1/N))
    radii = np.asarray(args.radii)
    header = ["log", "what", "ACR", *[f"{r:g}" for r in radii], "sigma_x median", "sigma_x 5-95 %",
              "sigma_x range", "ACR gain", "gain from pA >= " + f"{args.near_one:g}", "gain from top 5 %",
              "beyond ceiling"]
    rows = [[os.path.basename(args.fixed), f"fixed sigma {fs['sigma']:g}", f"{f_gain.mean():.3f}",
             *[f"{100 * np.mean(fixed['correct'] & (fixed['radius'] >= r)):.1f}" for r in radii],
             f"{fs['sigma']:g}", "", "", "", "", "", ""]]
    for path, log in logs:
        side = readers.read_sidecar(path).get("ddrs") or {}
        o = np.argsort(log["idx"])
        common.check(np.array_equal(log["idx"][o], f_idx), f"{path}: not the images of {args.fixed} (idx differ)")
        gain = (log["radius"] * log["correct"])[o]
        sx = log["sigma_x"]
        what = ("semi-elastic r {r:g} k {k} m {m:.3g} (sound)".format(**side["semi_elastic"])
                if "semi_elastic" in side else f"DS step {side.get('lr', '?'):g} K {side.get('K', '?')}")
        delta = gain.sum() - f_gain.sum()
        tiny = abs(delta) < 0.005 * len(gain)   # no gain to speak of: its shares mean nothing
        share = float("nan") if tiny else (gain - f_gain)[near].sum() / delta
        top = float("nan") if tiny else np.sort(gain - f_gain)[::-1][:max(1, len(gain) // 20)].sum() / delta
        rows.append([common.check_cell(os.path.basename(path), "the file name"), what, f"{gain.mean():.3f}",
                     *[f"{100 * np.mean(log['correct'] & (log['radius'] >= r)):.1f}" for r in radii],
                     f"{np.median(sx):.3f}", f"{np.percentile(sx, 5):.3f}-{np.percentile(sx, 95):.3f}",
                     f"{sx.min():.3f}-{sx.max():.3f}", f"{delta / len(gain):+.3f}",
                     *[("n/a" if math.isnan(v) else f"{100 * v:.0f} %") for v in (share, top)],
                     str(int(np.sum(log["correct"] & (log["radius"] > ceiling))))])
    md = ("".join(f"Certified otherwise: {line}.\n\n" for line in said) +
          "| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n" +
          "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n\n" +
          f"{len(f_idx)} images. Certified accuracy in %. ACR gain: the mean over images of the change in "
          f"radius x correct against the fixed sigma; 'gain from pA >= {args.near_one:g}': the share of that gain "
          f"made on the {int(near.sum())} images whose pA at sigma_0 is at least {args.near_one:g} (nA / N of the "
          f"fixed log); 'gain from top 5 %': the share made by the 5 % of images whose radius x correct "
          f"grew most. Beyond ceiling: correct certificates above the fixed sigma's largest possible radius "
          f"sigma_0 Phi^-1(alpha^(1/N)) = {ceiling:.3f}. Intervals of the differences: analyze.py compare.\n")
    md += "\n" + report_intervals(args.fixed, args.logs, radii)
    tsv = "\t".join(h.replace(" ", "_") for h in header) + "\n" + "\n".join("\t".join(r) for r in rows) + "\n"
    inputs = [args.fixed, *args.logs]
    machinery.write_text_output(os.path.join(args.out, "report.md"), "DDRS report", md, inputs)
    machinery.write_text_output(os.path.join(args.out, "report.tsv"), "DDRS report", tsv, inputs)
    print(md, end="")


def report_intervals(fixed, logs, radii):
    """report.md's second table: each log minus the fixed sigma_0, with analyze.py compare's intervals (its
    defaults: paired over the images, 95 % for all of its rows at once), so the numbers are those of
    `analyze.py compare FIXED LOG`."""
    import analyze
    import compare
    wanted = ["clean accuracy", "ACR"] + [f"certified accuracy r={r:g}" for r in radii if r > 0]
    header = ["log"] + [w.replace("certified accuracy ", "") for w in wanted]
    rows = []
    for path in logs:
        a = analyze.parse_args(["compare", fixed, path])
        loaded = analyze.load_logs([fixed, path])
        found = {m: (d, lo, hi) for m, _, _, d, lo, hi, _ in
                 compare.compare_sides(loaded[:1], loaded[1:], a.radii, a.level)[0]}
        show = lambda m, v: f"{v:+.3f}" if m == "ACR" else f"{100 * v:+.1f}"
        rows.append([os.path.basename(path)] + [f"{show(m, found[m][0])} [{show(m, found[m][1])}, "
                                                f"{show(m, found[m][2])}]" if m in found else "0 (both 0)"
                                                for m in wanted])
    return ("\nEach log minus the fixed sigma_0 (ACR; accuracies in points), with the 95 % simultaneous intervals "
            "of analyze.py compare (paired over the images; one model, so about this model):\n\n| " +
            " | ".join(header) + " |\n|" + "---|" * len(header) + "\n" +
            "".join("| " + " | ".join(r) + " |\n" for r in rows))


# The kinds of log (readers.LOG_KINDS) that report and memory refuse; both need ddrs.py's logs (a sigma column)
# of predictions, and report (ACR, gains) full radii and, as --fixed, certify.py's CERTIFY log at sigma_0. The
# memory wraps any radii (Alfarra et al. 2022, App. C), grid levels included.
NOT_PREDICTIONS = "it certifies the true label, not the classifier's predictions; certify without --label-mode"
NO_RADII = "its radii are grid levels (no ACR); certify without --radii"
NO_SIGMA_COLUMN = "it has no sigma column; this needs a ddrs.py certify log"
MEMORY_REFUSED = {"PREDICT": "it has no radius", "label mode": NOT_PREDICTIONS}
REPORT_REFUSED = {**MEMORY_REFUSED, "grid": NO_RADII, "grid without r = 0": NO_RADII}
FIXED_REFUSED = {**REPORT_REFUSED, "DDRS": "--fixed is certify.py's log at the fixed sigma_0",
                 "semi-elastic": "--fixed is certify.py's log at the fixed sigma_0"}


def read_ddrs_log(path):
    """The rows of a `ddrs.py certify` log (readers.read_certification_log, with its per-row sigma column):
    idx, predict (-1: abstain), radius, sigma."""
    log = readers.read_certification_log(path)
    readers.check_log_kinds(log, readers.read_sidecar(path), MEMORY_REFUSED, "ddrs.py memory")
    common.check("sigma_x" in log, f"{path}: {NO_SIGMA_COLUMN}")
    return [{"idx": int(i), "predict": int(p), "radius": float(r), "sigma": float(s)}
            for i, p, r, s in zip(log["idx"], log["predict"], log["radius"], log["sigma_x"])]


def main(argv=None):
    command, args = parse_args(argv)
    if command == "certify":
        certify_main(args)
    elif command == "train":
        train_main(args)
    elif command == "report":
        machinery.set_inputs([args.fixed, *args.logs])   # read, never written over; their models go in the record
        report_main(args)
    else:
        machinery.set_inputs([args.log])
        memory_main(args)


if __name__ == "__main__":
    machinery.run(main, exit_process=True)

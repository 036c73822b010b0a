"""Train the RS baselines the paper compares against (§6, Tables 2-4): SmoothAdv, MACER, Consistency, SmoothMix,
CAT-RS, and Stability training.

Each method is one short loss function below with the loss_fn(model, x, y, idx) contract of common.train_epoch;
data, checkpoints, logs and --resume are shared with train_gaussian.py and train_ours.py. The defaults of each
method and sigma are the released CIFAR-10 configurations the paper compared with (facts and sources:
docs/training.md); every hyper-parameter is a flag that overrides them.

Usage: python train_baselines.py --method consistency --sigma 0.25 --dataset digits --epochs 2

CIFAR-10, the released setting of a method for a sigma (writes runs/train_<method>_cifar10_sigma<sigma>):
    python train_baselines.py --method smoothmix --sigma 0.5 --dataset cifar10 --data-dir data
CAT-RS needs the soft labels of a Gaussian sigma = 0.25 model on the training set, computed once and used for
every training sigma (N = 10,000 noisy votes per image):
    python train_baselines.py --make-catrs-target --checkpoint GAUSSIAN_SIGMA0.25.pth.tar --out runs/catrs_target.pt
    python train_baselines.py --method catrs --sigma 0.5 --catrs-target runs/catrs_target.pt --dataset cifar10
Gradient norms of Table 2 (TSV idx label pA grad_norm beside the checkpoint), each with its method's own loss:
    python train_baselines.py --method macer --gradnorm runs/train_macer_cifar10_sigma0.5/checkpoint.pth.tar

Shared protocol: SGD (momentum 0.9, wd 1e-4, lr 0.1), lr x0.1 every --lr_step epochs counted from the first
epoch (decays from epoch 50 on, as the paper's code; the CAT-RS/Consistency/SmoothAdv scripts decay one epoch
later), a loader batch of 256 cut into m chunks with one step each (MACER: 64 images x m copies, one step).
"""
import argparse
import contextlib
import functools
import math
import os
import time

import torch
import torch.nn.functional as F

import common
import machinery
import readers

METHODS = ("smoothadv", "macer", "consistency", "smoothmix", "catrs", "stability")

# Released per-sigma settings (docs/training.md lists them with their sources; [CATRS-EXP] = the CAT-RS repository's EXPERIMENTS.MD).
# eps / alpha are L2 norms in [0, 1] pixel units (the official scripts' `--epsilon 256` is 1.0).
# Datasets without an entry (digits) use the CIFAR-10 one; sigmas without an entry use the nearest listed one.
DEFAULTS = {
    "smoothadv": {  # PGD on the soft smoothed classifier, multi-noise training ([CATRS-EXP])
        "cifar10": {0.25: {"m": 4, "T": 10, "eps": 1.0, "warmup": 10},
                    0.5: {"m": 8, "T": 10, "eps": 1.0, "warmup": 10},
                    1.0: {"m": 2, "T": 10, "eps": 2.0, "warmup": 10}},
        # Salman's released ImageNet models (eps 255/256, m = 1; sigma 0.25: DDN with 2 steps, the others PGD
        # with 1). Warm-up UNVERIFIED: we take Salman's script default of 1 epoch, i.e. full eps from epoch 0.
        "imagenet": {0.25: {"m": 1, "T": 2, "eps": 255 / 256, "warmup": 1, "attack": "ddn"},
                     0.5: {"m": 1, "T": 1, "eps": 255 / 256, "warmup": 1},
                     1.0: {"m": 1, "T": 1, "eps": 512 / 256, "warmup": 1}},
    },
    "macer": {  # [CATRS-EXP] protocol (lr 0.1, 150 epochs), not MACER's own (lr 0.01, 440 epochs, wd 5e-4)
        # NOTE: for sigma 0.5 [CATRS-EXP]'s train command says lambda 6, its certify path lambda 4: we take 6.
        "cifar10": {0.25: {"batch": 64, "m": 16, "beta": 16.0, "gamma": 8.0, "lbd": 12.0, "deferred": False},
                    0.5: {"batch": 64, "m": 16, "beta": 16.0, "gamma": 8.0, "lbd": 6.0, "deferred": False},
                    1.0: {"batch": 64, "m": 16, "beta": 16.0, "gamma": 8.0, "lbd": 12.0, "deferred": True}},
    },
    "consistency": {  # "Gaussian + Consistency" ([CATRS-EXP], = the released [CONS-code] models)
        "cifar10": {0.25: {"m": 2, "lbd": 20.0, "eta": 0.5},
                    0.5: {"m": 2, "lbd": 10.0, "eta": 0.5},
                    1.0: {"m": 2, "lbd": 10.0, "eta": 0.5}},
        "imagenet": {0.5: {"batch": 200, "m": 2, "lbd": 5.0, "eta": 0.5},   # batch 200: [CONS-paper-A.1]
                     1.0: {"batch": 200, "m": 2, "lbd": 5.0, "eta": 0.1}},
    },
    "smoothmix": {  # mix_step 0 = "SmoothMix", 1 = "+ one-step adversary" ([CATRS-EXP])
        "cifar10": {0.25: {"m": 2, "T": 4, "alpha": 0.5, "eta": 5.0, "mix_step": 0, "warmup": 10},
                    0.5: {"m": 2, "T": 4, "alpha": 1.0, "eta": 5.0, "mix_step": 1, "warmup": 10},
                    1.0: {"m": 2, "T": 4, "alpha": 2.0, "eta": 5.0, "mix_step": 1, "warmup": 10}},
    },
    "catrs": {  # the soft target file comes from a Gaussian sigma = 0.25 model for every training sigma
        "cifar10": {0.25: {"m": 4, "T": 4, "eps": 1.0, "lbd": 0.5},
                    0.5: {"m": 4, "T": 4, "eps": 1.0, "lbd": 1.0},
                    1.0: {"m": 4, "T": 4, "eps": 1.0, "lbd": 2.0}},
        "imagenet": {1.0: {"m": 2, "T": 1, "eps": 1.0, "lbd": 2.0, "double_eps_from": 80, "lr_drop": 85,
                           "confidence_mask": True}},
    },
    "stability": {  # Li et al. 2019 as in the CAT-RS repository's train_stab.py
        "cifar10": {0.25: {"lbd": 2.0}, 0.5: {"lbd": 2.0}, 1.0: {"lbd": 1.0}},
    },
}

# Hyper-parameters that only some runs set (released values above where they differ).
OPTIONAL = {"smoothadv": {"attack": "pgd"},
            "smoothmix": {"maxnorm": None},
            "catrs": {"double_eps_from": None, "lr_drop": None, "confidence_mask": False}}

# Methods that cut each loader batch into m chunks, one optimizer step each (Salman et al. 2019);
# MACER (64 images x 16 copies) and Stability take one step per loader batch.
CHUNKED = {"smoothadv": True, "macer": False, "consistency": True, "smoothmix": True, "catrs": True,
           "stability": False}


# ----------------------------------------------------------------------------------------------------------
# Pieces shared by the losses. Layout: noise is (m, b, C, H, W) and copies are flattened block-wise
# ([x + n_1; x + n_2; ...], targets y.repeat(m)). SmoothAdv's and MACER's official code interleave copies
# instead; that is a permutation of the same batch, and neither the mean losses nor BatchNorm's batch
# statistics depend on the order, so one layout serves all methods.
# ----------------------------------------------------------------------------------------------------------

# Every loss and attack takes the logits in float32 (`model(...).float()`): under --amp the model computes in
# bf16/fp16, but softmax averages, KL terms and MACER's Phi^-1 near 1 need full precision.

def check_noise(x, noise, m=None, name="noise"):
    """noise (m, *x.shape) in x's dtype and on its device, finite (read on the CPU only): the draws a loss or an
    attack holds fixed. Returns noise."""
    common.check_tensor(name, noise, "m B C H W", B=len(x), **({} if m is None else {"m": m}))
    common.check(noise.shape[2:] == x.shape[1:], f"{name} has shape {tuple(noise.shape)}, not (m, *x.shape)")
    common.check(noise.dtype == x.dtype and noise.device == x.device, f"{name} is {noise.dtype} on {noise.device}, "
                                                                     f"x {x.dtype} on {x.device}: give it x's")
    common.check(noise.is_cuda or bool(torch.isfinite(noise).all()), f"{name} holds NaN or infinite values")
    return noise


def check_attack(model, x, y, noise, T, **floats):
    """An attack's model, x (b, C, H, W), labels y (b,), the noise it holds fixed, T >= 0 steps, and each float
    >= 0 (floats: name=value)."""
    common.check_batch(model, x, y)
    check_noise(x, noise)
    common.check_int("T", T, 0)
    for name, value in floats.items():
        common.check_float(name, value, ge=0)


def draw_noise(x, sigma, m, noise=None):
    """m Gaussian draws (m, b, C, H, W) in x's dtype, as common.gaussian_loss draws them; a given `noise` (scaled
    by sigma, of that shape: check_noise) is returned as is. Each loss checks its arguments (common.check_batch)
    first."""
    if noise is not None:
        return check_noise(x, noise, m)
    return sigma * torch.randn(m, *x.shape, device=x.device, dtype=x.dtype)


def add_noise(x, noise):
    """Block-ordered noisy copies: (m*b, C, H, W) from x (b, C, H, W) and noise (m, b, C, H, W)."""
    return (x.unsqueeze(0) + noise).flatten(0, 1)


def kl_div(p, logq):
    """KL(p || q) per row = sum_c p_c (log p_c - log q_c), with 0 log 0 = 0; gradients flow into p and logq."""
    return F.kl_div(logq, p, reduction="none").sum(-1)


def per_image_norm(v):
    """L2 norm of each image in a batch, shaped (B, 1, 1, 1) for broadcasting."""
    return v.flatten(1).norm(dim=1).view(-1, *[1] * (v.dim() - 1))


def project_l2(v, radius):
    """Shrink each image of v onto the L2 ball of the given radius >= 0 (vectors inside it are unchanged)."""
    common.check_float("radius", radius, ge=0)
    return v * (radius / per_image_norm(v).clamp_min(1e-12)).clamp(max=1.0)


def smoothed_probs(model, u, noise):
    """The soft smoothed classifier over the fixed noises, (1/m) sum_i S(f(u + n_i)), shape (b, K)."""
    m, b = noise.shape[:2]
    return F.softmax(model(add_noise(u, noise)).float(), 1).view(m, b, -1).mean(0)


def nll_of(pbar, y):
    """-log pbar_y per image, clamped at 1e-20 as in the official code. Returns (b,)."""
    common.check_labels(y, pbar)
    return -pbar.gather(1, y[:, None]).squeeze(1).clamp_min(1e-20).log()


def smoothed_nll(model, u, y, noise):
    """-log of the soft smoothed classifier's probability of y, -log((1/m) sum_i S(f(u + n_i))_y), per image.

    The target of SmoothAdv's, SmoothMix's and DDN's attacks. Returns (b,).
    """
    return nll_of(smoothed_probs(model, u, noise), y)


def warmup_factor(epoch, warmup):
    """Linear warm-up min(1, (epoch + 1) / warmup) of SmoothAdv and SmoothMix (0-indexed epoch); 1 if warmup <= 0."""
    return 1.0 if warmup <= 0 else min(1.0, (epoch + 1) / warmup)


def result(loss, logits, targets):
    """The dict train_epoch expects: the loss, and the accuracy of the forward the loss is built on."""
    return {"loss": loss, "correct": (logits.argmax(1) == targets).sum(), "total": len(targets)}


# ----------------------------------------------------------------------------------------------------------
# SmoothAdv (Salman et al. 2019): adversarial training of the soft smoothed classifier
# ----------------------------------------------------------------------------------------------------------

def smoothadv_attack(model, x, y, noise, T, eps):
    """SmoothAdv's PGD-L2: x' = x + e, ||e|| <= eps, x' in [0, 1], maximising smoothed_nll with the noises held fixed.

    e starts at 0 (no random start, as the official code); step 2 eps / T along the per-image normalised
    gradient (a zero gradient is replaced by a standard normal draw, as the official code does); clip to
    [0, 1], then shrink to norm eps. Returns x' detached, (b, C, H, W).
    """
    check_attack(model, x, y, noise, T, eps=eps)
    model = common.unwrap(model)  # under DDP: attack the plain module (no gradient sync)
    if T == 0 or eps == 0:
        return x.detach()
    e = torch.zeros_like(x)
    with common.frozen_eval(model):
        for _ in range(T):
            e.requires_grad_(True)
            grad, = torch.autograd.grad(smoothed_nll(model, x + e, y, noise).sum(), e)
            with torch.no_grad():
                norm = per_image_norm(grad)
                step = grad / norm
                zero = norm.flatten() == 0
                if zero.any():
                    step[zero] = torch.randn_like(step[zero])
                e = e.detach() + (2 * eps / T) * step
                e = (x + e).clamp(0, 1) - x          # stay a valid image, then project onto the eps-ball
                e = project_l2(e, eps)
    return (x + e).detach()


def ddn_attack(model, x, y, noise, T, eps, gamma=0.05, levels=256):
    """Decoupled Direction and Norm (Rony et al. 2019), SmoothAdv's attack for its ImageNet sigma = 0.25 model.

    T steps of normalised-gradient ascent on smoothed_nll with a cosine learning rate from 1 to 0.01; after
    each step e is rescaled to a norm budget r (starting at eps, times 1 - gamma while x + e is adversarial,
    times 1 + gamma while not, at most the largest norm the [0, 1] box allows), and x + e is quantised to
    `levels` grey levels and clipped. The smallest adversarial e seen is returned, shrunk to norm eps and
    quantised; where none was seen, x itself. "Adversarial": the soft smoothed classifier over the fixed
    noises (with m = 1: f(x + e + n)) does not predict y. Returns x' detached, (b, C, H, W).
    """
    check_attack(model, x, y, noise, T, eps=eps)
    common.check_float("gamma", gamma, gt=0, lt=1)
    common.check_int("levels", levels, 2)
    model = common.unwrap(model)
    if T == 0 or eps == 0:
        return x.detach()
    b = len(x)
    quantise = lambda v: (v * (levels - 1)).round() / (levels - 1)
    r = torch.full((b,), float(eps), device=x.device)
    r_max = per_image_norm(torch.maximum(x, 1 - x)).flatten()               # the longest e the box allows
    best_norm, best_e = r_max.clone(), torch.zeros_like(x)
    e = torch.zeros_like(x)
    with common.frozen_eval(model):
        for t in range(T):
            # The official code steps its cosine scheduler (T_max = T) before each step: rates at t + 1 = 1..T.
            lr = 0.01 + (1 - 0.01) * (1 + math.cos(math.pi * (t + 1) / T)) / 2
            e.requires_grad_(True)
            pbar = smoothed_probs(model, x + e, noise)
            grad, = torch.autograd.grad(nll_of(pbar, y).sum(), e)
            with torch.no_grad():
                e = e.detach()
                adversarial, l2 = pbar.argmax(1) != y, per_image_norm(e).flatten()   # of the e before this step
                better = adversarial & (l2 < best_norm)
                best_norm = torch.where(better, l2, best_norm)
                best_e = torch.where(better.view(-1, 1, 1, 1), e, best_e)
                norm = per_image_norm(grad)
                step = torch.where(norm == 0, torch.randn_like(grad), grad / norm.clamp_min(1e-12))
                e = e + lr * step
                r = torch.minimum(r * (1 - gamma * (2 * adversarial.float() - 1)), r_max)
                e = e * (r.view(-1, 1, 1, 1) / per_image_norm(e).clamp_min(1e-12))
                e = quantise(x + e).clamp(0, 1) - x
    best_e = quantise(project_l2(best_e, eps))
    return (x + best_e).clamp(0, 1).detach()   # the clip only acts on inputs off the 256-level grid


def smoothadv_loss(model, x, y, idx, *, sigma, m, T, eps, warm=1.0, attack=smoothadv_attack, noise=None):
    """SmoothAdv: mean CE of f(x' + n_i) over the m copies, with x' attacked through the SAME noises n_i.

    The attack's radius is warm * eps: warm = warmup_factor(epoch, W), SmoothAdv's linear warm-up of eps
    (the step 2 eps / T follows it); with m = 1 the attack is plain PGD on CE(f(x + e + n)). attack:
    smoothadv_attack (PGD), or ddn_attack (Salman et al.'s ImageNet sigma = 0.25 model).
    """
    common.check_batch(model, x, y, sigma, m=m)
    common.check_int("T", T, 0)
    common.check_float("eps", eps, ge=0)
    common.check_float("warm", warm, ge=0, le=1)
    common.check_type("attack", attack, callable)
    noise = draw_noise(x, sigma, m, noise)
    x_adv = attack(model, x, y, noise, T, warm * eps)
    logits = model(add_noise(x_adv, noise)).float()                           # (m*b, K)
    common.check_labels(y, logits)
    targets = y.repeat(m)
    return result(F.cross_entropy(logits, targets), logits, targets)


# ----------------------------------------------------------------------------------------------------------
# MACER (Zhai et al. 2020): hinge on the soft certified radius, no attack, no chunking
# ----------------------------------------------------------------------------------------------------------

def macer_loss(model, x, y, idx, *, sigma, m, beta, gamma, lbd, noise=None):
    """MACER: (sum_x L_C + lbd * sum_kept (sigma/2)(gamma - d)) / b over one batch of b images x m noises.

    L_C = -log(pbar_y + 1e-10) with pbar the plain softmax average; d = Phi^-1(q1) - Phi^-1(q2), q1 >= q2 the
    top two of q = mean softmax(beta * logits). Only images with top-1 of q equal to y and finite d <= gamma
    enter the hinge (masks are constants; gradients flow through q1, q2 and Phi^-1).
    """
    common.check_batch(model, x, y, sigma, m=m)
    common.check_float("beta", beta, gt=0)
    common.check_float("gamma", gamma, gt=0)
    common.check_float("lbd", lbd, ge=0)
    noise = draw_noise(x, sigma, m, noise)
    b = len(y)
    logits = model(add_noise(x, noise)).float()                               # (m*b, K)
    common.check_labels(y, logits)
    z = logits.view(m, b, -1)
    pbar = F.softmax(z, 2).mean(0)                                            # (b, K)
    classification = -(pbar.gather(1, y[:, None]).squeeze(1) + 1e-10).log()  # (b,)
    q1q2, top = F.softmax(beta * z, 2).mean(0).topk(2, dim=1)                 # (b, 2)
    with torch.no_grad():  # select first, then differentiate only the kept images (Phi^-1'(1) is inf)
        d = torch.special.ndtri(q1q2[:, 0]) - torch.special.ndtri(q1q2[:, 1])
        keep = (top[:, 0] == y) & torch.isfinite(d) & (d <= gamma)
    kept = q1q2[keep]
    d_kept = torch.special.ndtri(kept[:, 0]) - torch.special.ndtri(kept[:, 1])
    if torch.is_tensor(sigma):   # a sigma per image (ddrs.py train), any batch size (one image included)
        robustness = ((sigma.flatten().expand(b)[keep] / 2) * (gamma - d_kept)).sum()
    else:
        robustness = (sigma / 2) * (gamma - d_kept).sum()
    loss = (classification.sum() + lbd * robustness) / b
    return result(loss, logits, y.repeat(m))


# ----------------------------------------------------------------------------------------------------------
# Consistency (Jeong & Shin 2020): KL to the mean prediction plus its entropy
# ----------------------------------------------------------------------------------------------------------

def consistency_loss(model, x, y, idx, *, sigma, m, lbd, eta, noise=None):
    """Consistency: mean CE + lbd * mean_{x,i} KL(pbar || p_i) + eta * mean_x H(pbar); pbar is not detached."""
    common.check_batch(model, x, y, sigma, m=m)
    common.check_float("lbd", lbd, ge=0)
    common.check_float("eta", eta, ge=0)
    noise = draw_noise(x, sigma, m, noise)
    b = len(y)
    logits = model(add_noise(x, noise)).float()                               # (m*b, K)
    common.check_labels(y, logits)
    targets = y.repeat(m)
    logp = F.log_softmax(logits, 1).view(m, b, -1)
    pbar = logp.exp().mean(0)                                                 # (b, K)
    kl = kl_div(pbar.expand_as(logp), logp).mean()                           # mean over copies and images
    entropy = -(pbar * pbar.clamp_min(1e-20).log()).sum(1).mean()
    loss = F.cross_entropy(logits, targets) + lbd * kl + eta * entropy
    return result(loss, logits, targets)


# ----------------------------------------------------------------------------------------------------------
# SmoothMix (Jeong et al. 2021): mixup along the adversarial path of the smoothed classifier
# ----------------------------------------------------------------------------------------------------------

def smoothmix_attack(model, x, y, noise, T, alpha, mix_step, warm, maxnorm=None):
    """SmoothMix's path u_0 = x, u_{t+1} = clip(u_t + alpha * g/||g||), g the gradient of smoothed_nll.

    Returns (u_init, x_adv), both detached: x_adv = u_T, and u_init = u_{mix_step} (x when mix_step = 0 or
    >= T) projected onto the L2 ball of radius warm * alpha * mix_step around x. maxnorm, if given, keeps every
    iterate within that L2 distance of x (off by default, as in the released runs).
    """
    check_attack(model, x, y, noise, T, alpha=alpha, warm=warm)
    common.check_int("mix_step", mix_step, 0)
    common.check(warm <= 1, f"warm = {warm!r}, out of range: warm must be <= 1")
    if maxnorm is not None:
        common.check_float("maxnorm", maxnorm, gt=0)
    model = common.unwrap(model)  # under DDP: attack the plain module (no gradient sync)
    u, u_init = x.detach(), x.detach()
    with common.frozen_eval(model):
        for t in range(T):
            if t == mix_step:
                u_init = u.detach()
            u.requires_grad_(True)
            grad, = torch.autograd.grad(smoothed_nll(model, u, y, noise).sum(), u)
            with torch.no_grad():
                u = u.detach() + alpha * grad / (per_image_norm(grad) + 1e-8)
                if maxnorm is not None:
                    u = x + project_l2(u - x, maxnorm)
                u = u.clamp(0, 1)
    u_init = (x + project_l2(u_init - x, warm * alpha * mix_step)).clamp(0, 1)
    return u_init.detach(), u.detach()


def smoothmix_mixup(u_init, x_adv, pbar):
    """Per image lam ~ U[0, 1/2): x_mix = (1-lam) u_init + lam x_adv, y_mix = (1-lam) pbar + lam * uniform."""
    lam = torch.rand(len(pbar), device=pbar.device) / 2                      # (b,)
    lam_x = lam.view(-1, *[1] * (u_init.dim() - 1))
    x_mix = (1 - lam_x) * u_init + lam_x * x_adv
    y_mix = (1 - lam[:, None]) * pbar + lam[:, None] / pbar.shape[1]
    return {"x_mix": x_mix, "y_mix": y_mix, "lam": lam}


def smoothmix_loss(model, x, y, idx, *, sigma, m, T, alpha, eta, mix_step, warm, maxnorm=None, noise=None):
    """SmoothMix: mean CE(f(u_init + n_i), y) + eta * warm * mean_{x,i} mask * KL(y_mix || S(f(x_mix + n_i))).

    warm = min(1, (epoch + 1) / warmup) scales both the mixup term and the one-step radius. The same m noises
    serve the attack and both train-mode forwards; mask = 1[argmax pbar == y], pbar the clean-side average.
    """
    common.check_batch(model, x, y, sigma, m=m)
    common.check_float("eta", eta, ge=0)   # the attack checks T, alpha, mix_step, warm and maxnorm
    noise = draw_noise(x, sigma, m, noise)
    b = len(y)
    u_init, x_adv = smoothmix_attack(model, x, y, noise, T, alpha, mix_step, warm, maxnorm)
    logits = model(add_noise(u_init, noise)).float()                          # (m*b, K)
    common.check_labels(y, logits)
    targets = y.repeat(m)
    pbar = F.softmax(logits, 1).view(m, b, -1).mean(0)                        # (b, K), not detached
    mix = smoothmix_mixup(u_init, x_adv, pbar)
    logq_mix = F.log_softmax(model(add_noise(mix["x_mix"], noise)).float(), 1)  # second, separate forward
    mask = (pbar.argmax(1) == y).float().repeat(m)
    mixup = (mask * kl_div(mix["y_mix"].repeat(m, 1), logq_mix)).mean()
    loss = F.cross_entropy(logits, targets) + eta * warm * mixup
    return result(loss, logits, targets)


# ----------------------------------------------------------------------------------------------------------
# CAT-RS (Jeong, Kim & Shin 2023): bottom-K CE on easy copies, worst-case KL on confident images
# ----------------------------------------------------------------------------------------------------------

def catrs_attack(model, x, pb, delta, T, eps):
    """Move each noise draw within the L2 eps-ball around itself to maximise KL(pb || S(f(x + delta'))).

    delta: (m, b, C, H, W); pb: (b, K) the precomputed soft target. T steps of size 2 eps / T along the
    gradient normalised per noise tensor; after each step, project delta' - delta onto the eps-ball and
    re-standardise each tensor to the original's moments (match_moments). x is never perturbed.
    Returns delta' detached.
    """
    common.check_type("model", model, callable)
    common.check_tensor("x", x, "B C H W")
    common.check_input_of(model, x, read_values=not x.is_cuda)
    common.check_tensor("pb", pb, "B K", B=len(x))
    check_noise(x, delta, name="delta")
    common.check_int("T", T, 0)
    common.check_float("eps", eps, ge=0)
    model = common.unwrap(model)  # under DDP: attack the plain module (no gradient sync)
    if T == 0:
        return delta.detach()
    m = delta.shape[0]
    orig = delta.detach().flatten(2)                                          # (m, b, d)
    mu0, rms0 = orig.mean(2, keepdim=True), orig.pow(2).mean(2, keepdim=True).sqrt()
    target = pb.repeat(m, 1)                                                  # block order (m*b, K)
    cur = orig.clone()
    with common.frozen_eval(model):
        for _ in range(T):
            cur.requires_grad_(True)
            logq = F.log_softmax(model(add_noise(x, cur.view_as(delta))).float(), 1)
            grad, = torch.autograd.grad(kl_div(target, logq).sum() / m, cur)
            with torch.no_grad():
                cur = cur.detach() + (2 * eps / T) * grad / (grad.norm(dim=2, keepdim=True) + 1e-8)
                diff = cur - orig
                cur = orig + diff * (eps / diff.norm(dim=2, keepdim=True).clamp_min(1e-12)).clamp(max=1.0)
                cur = match_moments(cur, mu0, rms0)
    return cur.detach().view_as(delta)


def match_moments(v, mu0, rms0):
    """CAT-RS's re-standardisation of each noise tensor (last dim): mu0 + (v - mean(v)) * rms0 / rms(v).

    rms is the UNcentred root-mean-square sqrt(mean(v^2)), as the official code: the mean is matched exactly,
    the RMS only up to the (small) mean of the noise. mu0, rms0: one per tensor, shaped v.shape[:-1] + (1,).
    """
    common.check(tuple(mu0.shape) == tuple(rms0.shape) == v.shape[:-1] + (1,), "mu0 and rms0 must be one per "
                 "tensor of v, shaped v.shape[:-1] + (1,)")
    mu, rms = v.mean(-1, keepdim=True), v.pow(2).mean(-1, keepdim=True).sqrt()
    return mu0 + (v - mu) * rms0 / rms


def bottom_k_sum(values, K):
    """Per column, the sum of the K smallest entries of values (m, b); K (b,) integers in 1..m."""
    common.check_tensor("values", values, "m b")
    common.check_tensor("K", K, "b", "int", b=values.shape[1])
    common.check(K.is_cuda or bool(((K >= 1) & (K <= len(values))).all()), f"K must be counts in 1..{len(values)}")
    ranked, _ = values.sort(0)                                                # ascending along the copies
    rank = torch.arange(values.shape[0], device=values.device)[:, None]
    return (ranked * (rank < K[None, :])).sum(0)


def catrs_loss(model, x, y, idx, *, sigma, m, T, eps, lbd, target, confidence_mask=False, noise=None):
    """CAT-RS: mean_x [ (1/m) bottom-K CE(f(x + delta_i), y) + lbd * 1[K == m] * max_i KL(pb || S(f(x + delta'_i))) ].

    target: (N_train, K) precomputed soft labels pb, indexed by idx. K ~ Binomial(m, phat), clamped to >= 1, with
    phat the fraction of the m Gaussian copies classified correctly (pb_y with confidence_mask).
    """
    common.check_batch(model, x, y, sigma, m=m)
    common.check_int("T", T, 0)
    common.check_float("eps", eps, ge=0)
    common.check_float("lbd", lbd, ge=0)
    common.check_tensor("target", target, "N K")
    common.check_tensor("idx", idx, "B", "int", B=len(x))
    idx = idx.to(target.device)
    common.check(bool((idx >= 0).all() and (idx < len(target)).all()), f"idx must index target's {len(target)} rows")
    common.check_type("confidence_mask", confidence_mask, bool)
    delta = draw_noise(x, sigma, m, noise)
    b = len(y)
    pb = target[idx].to(x.device)                          # (b, K)
    targets = y.repeat(m)
    logits = model(add_noise(x, delta)).float()                               # Gaussian forward (m*b, K)
    common.check_labels(y, logits)
    common.check(pb.shape[1] == logits.shape[1] and (pb.is_cuda or bool(((pb >= 0) & (pb <= 1)).all()) and
                                                     bool(((pb.double().sum(1) - 1).abs() < 1e-3).all())),
                 f"target's rows must be probability vectors (in [0, 1], summing to 1) over the model's "
                 f"{logits.shape[1]} classes")
    pb = pb.float()
    ce = F.cross_entropy(logits, targets, reduction="none").view(m, b)
    with torch.no_grad():
        votes = (logits.argmax(1) == targets).float().view(m, b).mean(0)
        phat = pb.gather(1, y[:, None]).squeeze(1) if confidence_mask else votes
        K = torch.binomial(torch.full_like(phat, m), phat).long().clamp_min(1)  # (b,)
    delta_adv = catrs_attack(model, x, pb, delta, T, eps)
    logq_adv = F.log_softmax(model(add_noise(x, delta_adv)).float(), 1)       # adversarial forward
    high = kl_div(pb.repeat(m, 1), logq_adv).view(m, b).max(0).values         # worst copy per image
    low = bottom_k_sum(ce, K) / m                                             # divided by m, not by K
    loss = (low + lbd * (K == m).float() * high).mean()
    return result(loss, logits, targets)


# ----------------------------------------------------------------------------------------------------------
# Stability training (Li et al. 2019): clean CE plus noisy-vs-clean cross-entropy
# ----------------------------------------------------------------------------------------------------------

def stability_loss(model, x, y, idx, *, sigma, lbd, noise=None):
    """Stability: CE(f(x), y) + lbd * mean_x CE(S(f(x)) -> S(f(x + delta))), two forwards, target not detached."""
    common.check_batch(model, x, y, sigma)
    common.check_float("lbd", lbd, ge=0)
    delta = draw_noise(x, sigma, 1, noise)[0]
    clean = model(x).float()
    common.check_labels(y, clean)
    noisy = model(x + delta).float()
    stability = -(F.softmax(clean, 1) * F.log_softmax(noisy, 1)).sum(1).mean()
    loss = F.cross_entropy(clean, y) + lbd * stability
    return result(loss, noisy, y)


# ----------------------------------------------------------------------------------------------------------
# One loss_fn per epoch: warm-ups and deferred terms depend on the epoch
# ----------------------------------------------------------------------------------------------------------

def make_loss_fn(method, hp, sigma, epoch, target=None):
    """This epoch's loss_fn(model, x, y, idx) for common.train_epoch: the method's loss with hp bound (0-based epoch)."""
    if method == "smoothadv":
        return functools.partial(smoothadv_loss, sigma=sigma, m=hp["m"], T=hp["T"], eps=hp["eps"],
                                 warm=warmup_factor(epoch, hp["warmup"]),
                                 attack={"ddn": ddn_attack, "pgd": smoothadv_attack}[
                                     common.check_choice("attack", hp["attack"], ("pgd", "ddn"))])
    if method == "macer":  # --deferred: no robustness term in epochs 0..first decay (until after the first decay)
        first_decay = min(hp["lr_milestones"]) if hp.get("lr_milestones") else hp["lr_step"]
        lbd = 0.0 if hp["deferred"] and epoch <= first_decay else hp["lbd"]
        return functools.partial(macer_loss, sigma=sigma, m=hp["m"], beta=hp["beta"], gamma=hp["gamma"], lbd=lbd)
    if method == "consistency":
        return functools.partial(consistency_loss, sigma=sigma, m=hp["m"], lbd=hp["lbd"], eta=hp["eta"])
    if method == "smoothmix":
        return functools.partial(smoothmix_loss, sigma=sigma, m=hp["m"], T=hp["T"], alpha=hp["alpha"], eta=hp["eta"],
                                 mix_step=hp["mix_step"], warm=warmup_factor(epoch, hp["warmup"]),
                                 maxnorm=hp["maxnorm"])
    if method == "catrs":  # [CATRS-code] --warmup W: eps doubled from epoch W on (ImageNet)
        double = hp["double_eps_from"] is not None and epoch >= hp["double_eps_from"]
        return functools.partial(catrs_loss, sigma=sigma, m=hp["m"], T=hp["T"], eps=hp["eps"] * (2 if double else 1),
                                 lbd=hp["lbd"], target=target, confidence_mask=hp["confidence_mask"])
    if method == "stability":
        return functools.partial(stability_loss, sigma=sigma, lbd=hp["lbd"])
    raise common.UserError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")


# ----------------------------------------------------------------------------------------------------------
# CAT-RS's precomputed soft target: vote histograms of a Gaussian sigma = 0.25 model on the training set
# ----------------------------------------------------------------------------------------------------------

@torch.no_grad()
def compute_catrs_target(model, dataset, sigma, N, batch, seed, num_classes, workers=0, partial_path=None,
                         tag=None, every=600.0, inputs=()):
    """counts[i, c] = votes for class c among N noisy copies of training image i (one train transform each).

    Uses common.sample_counts. The global generators are reseeded per block of 1024 images from (seed, block),
    so the result does not depend on interruptions: if partial_path holds a partial result with the same
    settings (and `tag`, e.g. the checkpoint's sha256, so another model's votes are never continued), work
    continues after it; progress is saved there every `every` seconds. `batch`: noisy inputs per forward pass.
    Returns int64 (len(dataset), num_classes).
    """
    device = next(model.parameters()).device
    settings = {"N": N, "sigma": sigma, "seed": seed, "len": len(dataset), "tag": tag}
    counts, done = torch.zeros(len(dataset), num_classes, dtype=torch.long), 0
    if partial_path and os.path.isfile(partial_path):
        saved = readers.read_torch_dict(partial_path, "partial CAT-RS target", PARTIAL_TARGET_FIELDS)
        common.check(saved["settings"] == settings and tuple(saved["counts"].shape) == tuple(counts.shape),
                     f"{partial_path!r} holds the partial target of other settings ({saved['settings']}): the run "
                     f"would replace it; move it away or choose another --out")
        counts, done = saved["counts"], saved["done"]
        print(f"continuing from {done} images in {partial_path}")
    start, saved_at, block, resumed_at = time.time(), time.time(), 1024, done
    for first in range(done, len(dataset), block):
        common.seed_everything(common.epoch_seed(seed, first // block))
        subset = torch.utils.data.Subset(dataset, range(first, min(first + block, len(dataset))))
        workers_gen = torch.Generator().manual_seed(common.epoch_seed(seed, first // block, 1))
        for x, _ in torch.utils.data.DataLoader(subset, batch_size=64, num_workers=workers, generator=workers_gen):
            counts[done:done + len(x)] = common.sample_counts(model, x.to(device), sigma, N, batch, num_classes).cpu()
            done += len(x)
        print(f"catrs target: {done}/{len(dataset)} images, "
              f"{machinery.format_eta(done - resumed_at, len(dataset) - resumed_at, start)}", flush=True)
        if partial_path and (time.time() - saved_at > every or done == len(dataset)):
            machinery.save_checkpoint({"settings": settings, "counts": counts, "done": done}, partial_path,
                                      "partial CAT-RS target", inputs)
            saved_at = time.time()
    return counts


def check_catrs_target_path(path):
    """--catrs-target is given and exists (checked with the settings, before anything is written)."""
    common.check(path is not None, "CAT-RS needs --catrs-target FILE, the soft labels of a Gaussian sigma = 0.25 "
                                   "model; make it once with: python train_baselines.py --make-catrs-target "
                                   "--checkpoint GAUSSIAN_0.25.pth.tar --out FILE")
    common.check(os.path.isfile(path), f"--catrs-target {path!r} not found; make it with: python train_baselines.py "
                                       f"--make-catrs-target --checkpoint GAUSSIAN_0.25.pth.tar --out {path}")


# The contracts of the two files of --make-catrs-target (readers.read_torch_dict checks them).
TARGET_FIELDS = {"counts": torch.is_tensor, "N": lambda v: isinstance(v, int) and not isinstance(v, bool),
                 "dataset": lambda v: v in common.DATASETS}
PARTIAL_TARGET_FIELDS = {"settings": lambda v: isinstance(v, dict), "counts": torch.is_tensor,
                         "done": lambda v: isinstance(v, int) and v >= 0}


def load_catrs_target(path, dataset, train_size, num_classes, trust=False):
    """The soft labels pb (train_size, num_classes), float32 on CPU, from a --make-catrs-target file."""
    check_catrs_target_path(path)
    saved = readers.read_torch_dict(path, "--catrs-target", TARGET_FIELDS, trust)
    counts, N = saved["counts"], saved["N"]
    common.check(N >= 1 and not counts.is_floating_point() and bool((counts >= 0).all()) and counts.dim() == 2
                 and bool((counts.sum(1) == N).all()), f"--catrs-target {path!r}: counts must be (examples x "
                                                        f"classes) vote counts that sum to N >= 1 per example")
    common.check(saved.get("dataset") == dataset and tuple(counts.shape) == (train_size, num_classes),
                 f"--catrs-target {path!r} holds {tuple(counts.shape)} soft labels of {saved.get('dataset')}, "
                 f"this run needs ({train_size}, {num_classes}) of {dataset}")
    return counts.float() / N


def make_target_mode(args):
    """--make-catrs-target: write {'counts', 'N', 'sigma', 'dataset', 'checkpoint', 'checkpoint_sha256'} to --out
    (CAT-RS preprocessing)."""
    common.check(args.checkpoint and args.out, "--make-catrs-target needs --checkpoint (a Gaussian sigma = 0.25 "
                                               "model) and --out FILE")
    given = lambda value, default: default if value is None else value   # noqa: E731  (0 is a value: refused)
    N, sigma, batch = given(args.N, 10_000), given(args.sigma, 0.25), given(args.batch, 1024)
    common.check(N >= 1 and batch >= 1 and 0 < sigma < float("inf"), "--N and --batch must be >= 1 and --sigma "
                                                                       "a finite number > 0")
    common.check(os.path.realpath(args.out) != os.path.realpath(args.checkpoint),
                 f"--out {args.out!r} is the checkpoint itself; choose another --out")
    common.check(not os.path.exists(args.out), f"--out {args.out!r} exists already; remove it or choose another "
                                               f"--out (a target is never written over a file)")
    machinery.make_outdir(os.path.dirname(os.path.abspath(args.out)))
    device = machinery.get_device(args.device)
    model, ckpt = readers.load_model(args.checkpoint, device=device, trust=args.trust_checkpoint)
    dataset = ckpt.get("dataset") or args.dataset
    train_set = common.get_dataset(dataset, "train", args.data_dir)  # with the train transform, once per image
    print(f"CAT-RS target: {N} votes at sigma {sigma} for each of {len(train_set)} {dataset} training images")
    partial = args.out + ".partial"
    counts = compute_catrs_target(model, train_set, sigma, N, batch, args.seed, common.NUM_CLASSES[dataset],
                                  args.workers, partial, tag=readers.loaded_sha256(args.checkpoint),
                                  inputs=[args.checkpoint])
    machinery.save_checkpoint({"counts": counts, "N": N, "sigma": sigma, "dataset": dataset,
                               "checkpoint": os.path.relpath(args.checkpoint),
                               "checkpoint_sha256": readers.loaded_sha256(args.checkpoint)}, args.out,
                              "CAT-RS target", [args.checkpoint])
    machinery.remove_output(partial)
    print(f"wrote {args.out}")


# ----------------------------------------------------------------------------------------------------------
# Command line and the training run (the same plumbing as train_gaussian.py)
# ----------------------------------------------------------------------------------------------------------

def parse_args():
    p = machinery.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flag = argparse.BooleanOptionalAction
    p.add_argument("--method", help=f"one of {', '.join(METHODS)}")
    p.add_argument("--dataset", default="cifar10", choices=common.DATASETS, help="training data (default cifar10)")
    p.add_argument("--data-dir", default=None, help="dataset folder (default $RS_DATA_DIR or ./data)")
    p.add_argument("--arch", choices=common.ARCHS, help="base classifier f (default: cifar_resnet110 on "
                   "cifar10, resnet50 on imagenet, digits_cnn on digits)")
    p.add_argument("--sigma", type=float, help="std of the Gaussian noise (training: required; target: 0.25)")
    h = p.add_argument_group("method hyper-parameters (default: the released setting for --method and --sigma)")
    h.add_argument("--m", type=int, help="noise copies per image (CAT-RS: M; MACER: k, no chunking)")
    h.add_argument("--T", type=int, help="attack steps (SmoothAdv, SmoothMix, CAT-RS)")
    h.add_argument("--eps", type=float, help="L2 radius in [0,1] pixel units (SmoothAdv: of the image attack; "
                   "CAT-RS: of the noise attack). The official --epsilon 256 is 1.0")
    h.add_argument("--attack", choices=("pgd", "ddn"), help="SmoothAdv: PGD (default) or DDN (the released "
                   "ImageNet sigma 0.25 model; T steps, norm factor 1 +- 0.05, 256 grey levels)")
    h.add_argument("--warmup", type=int, help="SmoothAdv eps and SmoothMix mixup weight ramp up linearly over "
                   "this many epochs (0: none)")
    h.add_argument("--lbd", type=float, help="weight of the robustness term (MACER, Consistency, CAT-RS, Stability)")
    h.add_argument("--eta", type=float, help="Consistency: entropy weight; SmoothMix: mixup-term weight")
    h.add_argument("--beta", type=float, help="MACER: inverse temperature of the robustness term")
    h.add_argument("--gamma", type=float, help="MACER: hinge margin on the soft radius")
    h.add_argument("--deferred", action=flag, help="MACER: no robustness term until after the first lr decay")
    h.add_argument("--alpha", type=float, help="SmoothMix: step size of the attack")
    h.add_argument("--mix_step", type=int, help="SmoothMix: mixup starts from the iterate of this attack step "
                   "(0: clean image, 1: the one-step adversary)")
    h.add_argument("--maxnorm", type=float, help="SmoothMix: optional L2 bound of the attack (default none)")
    h.add_argument("--double_eps_from", type=int, help="CAT-RS: eps doubled from this epoch on ([CATRS-code] "
                   "--warmup)")
    h.add_argument("--lr_drop", type=int, help="CAT-RS: extra lr x0.1 during this one epoch (as the released "
                   "ImageNet run effectively had)")
    h.add_argument("--confidence_mask", action=flag, help="CAT-RS: K ~ Binomial(M, pb_y) instead of the "
                   "current model's Gaussian votes (ImageNet)")
    h.add_argument("--catrs-target", help="CAT-RS: soft-label file made by --make-catrs-target")
    t = p.add_argument_group("training (as train_gaussian.py)")
    t.add_argument("--epochs", type=int, help="default: 150 cifar10, 90 imagenet, 20 digits")
    t.add_argument("--batch", type=int, help="images per loader batch (default 256; MACER 64); "
                   "--make-catrs-target: noisy inputs per forward (default 1024)")
    t.add_argument("--lr", type=float, default=0.1, help="initial SGD learning rate")
    t.add_argument("--lr_step", type=int, help="lr x0.1 every lr_step epochs (default 50 cifar10, 30 imagenet)")
    t.add_argument("--lr_milestones", type=int, nargs="+", metavar="EPOCH", help="lr x0.1 at each of these "
                   "epochs instead of every --lr_step (MACER's own schedule: --lr 0.01 --epochs 440 "
                   "--weight_decay 5e-4 --lr_milestones 200 400)")
    t.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (plain, as all official code)")
    t.add_argument("--weight_decay", type=float, default=1e-4, help="SGD weight decay")
    t.add_argument("--workers", type=int, default=2, help="data loader worker processes")
    t.add_argument("--seed", type=int, default=0, help="seed of all randomness (a resumed run repeats it)")
    t.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    t.add_argument("--outdir", help="run folder (default runs/train_<method>_<dataset>_sigma<sigma>)")
    t.add_argument("--resume", action="store_true", help="continue the run in --outdir from its checkpoint")
    t.add_argument("--trust-checkpoint", action="store_true", help="load checkpoint files that need arbitrary "
                   "unpickling: this RUNS CODE the file holds; only for files from a source you trust")
    t.add_argument("--save_every", type=int, default=0, help="also keep checkpoint_epoch<E>.pth.tar every E epochs")
    t.add_argument("--max-batches", type=int, help="stop each epoch after this many batches (smoke tests, timing)")
    t.add_argument("--amp", nargs="?", const="bf16", choices=("bf16", "fp16"), help="mixed precision training: "
                   "bf16 autocast (CPU, CUDA; the default of a bare --amp) or fp16 with loss scaling (CUDA; "
                   "the attacks' gradients are not scaled, so prefer bf16)")
    t.add_argument("--channels-last", action="store_true", help="channels-last memory format (faster convolutions)")
    t.add_argument("--sync-bn", action="store_true", help="under torchrun: BatchNorm statistics over the "
                   "whole batch of all ranks (SyncBatchNorm, GPUs only), as on the paper's single GPU; default: each "
                   "rank's batch // world_size inputs")
    g = p.add_argument_group("other modes")
    g.add_argument("--gradnorm", metavar="CKPT", help="instead of training: per-example gradient norms of CKPT "
                   "under --method's loss (Table 2)")
    g.add_argument("--probe", type=int, help="--gradnorm: training examples probed (default 1000)")
    g.add_argument("--N", type=int, help="--gradnorm: noise samples for each probe's pA (default 100); "
                   "--make-catrs-target: votes per image (default 10,000)")
    g.add_argument("--make-catrs-target", action="store_true", help="instead of training: CAT-RS's soft labels "
                   "of --checkpoint on the training set, written to --out")
    g.add_argument("--checkpoint", help="--make-catrs-target: the Gaussian sigma = 0.25 model")
    g.add_argument("--out", help="--make-catrs-target: output file")
    return p.parse_args()


# the methods' own flags: each applies to the methods whose released settings name it (settings)
HYPER_PARAMETERS = ("m", "T", "eps", "attack", "warmup", "lbd", "eta", "beta", "gamma", "deferred", "alpha",
                    "mix_step", "maxnorm", "double_eps_from", "lr_drop", "confidence_mask")


def method_defaults(method, dataset, sigma):
    """The released hyper-parameters for (method, dataset, sigma), and a note when they are borrowed."""
    common.check(method in METHODS, f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    sigma = common.check_float("sigma", sigma, gt=0)
    table = DEFAULTS[method].get(dataset, DEFAULTS[method]["cifar10"])
    nearest = min(table, key=lambda s: abs(s - sigma))
    source = dataset if dataset in DEFAULTS[method] else "cifar10"
    note = None
    if source != dataset or nearest != sigma:
        note = f"no released {method} setting for {dataset} sigma {sigma}: using {source} sigma {nearest}'s"
    return dict(OPTIONAL.get(method, {}), **table[nearest]), note


def settings(args):
    """The run's settings: the flags, with dataset, method and sigma defaults filled in, after checking them."""
    common.check(args.method is not None, f"--method is required: one of {', '.join(METHODS)}")
    common.check(args.sigma is not None, "--sigma is required (the paper uses 0.25, 0.5 and 1.0)")
    common.check(args.sigma > 0, f"--sigma must be > 0, got {args.sigma}")
    common.check(args.m is None or args.m >= 1, f"--m must be >= 1, got {args.m}")
    hp, note = method_defaults(args.method, args.dataset, args.sigma)
    s = dict(vars(args))
    for key in HYPER_PARAMETERS:
        common.check(s[key] is None or key in hp, f"--{key} does not apply to --method {args.method}")
        s[key] = s[key] if s[key] is not None else hp.get(key)
    common.check(args.catrs_target is None or args.method == "catrs", "--catrs-target is only for --method catrs")
    s["note"] = note
    s["m"] = 1 if s["m"] is None else s["m"]  # Stability: one noise draw
    s["batch"] = hp.get("batch", 256) if args.batch is None else args.batch
    s["arch"] = args.arch or common.DEFAULT_ARCH[args.dataset]
    s["epochs"] = args.epochs if args.epochs is not None else common.SCHEDULE[args.dataset]["epochs"]
    s["lr_step"] = common.SCHEDULE[args.dataset]["lr_step"] if args.lr_step is None else args.lr_step
    s["outdir"] = args.outdir or f"runs/train_{args.method}_{args.dataset}_sigma{args.sigma}"
    common.check(all(s[k] is None or s[k] >= 0 for k in ("T", "eps", "warmup", "lbd", "eta", "alpha", "mix_step")),
                 "--T, --eps, --warmup, --lbd, --eta, --alpha and --mix_step must be >= 0")
    common.check(all(s.get(k) is None or s[k] > 0 for k in ("beta", "gamma", "maxnorm")),
                 "--beta, --gamma and --maxnorm must be > 0")
    common.check(s["epochs"] >= 0 and s["batch"] >= 1 and s["lr_step"] >= 1 and args.workers >= 0,
                 "--epochs, --workers must be >= 0 and --batch, --lr_step >= 1")
    common.check(all(e >= 1 for e in args.lr_milestones or []), "--lr_milestones must be epochs >= 1")
    machinery.check_training_settings(s)
    return argparse.Namespace(**s)


def gradnorm_mode(args):
    """Table 2: gradient norm of the method's own loss for each probe example, with the example's pA."""
    device = machinery.get_device(args.device)
    model, ckpt = readers.load_model(args.gradnorm, device=device, trust=args.trust_checkpoint)
    dataset = ckpt.get("dataset") or args.dataset
    outdir = args.outdir or os.path.dirname(os.path.abspath(args.gradnorm))   # default: beside the checkpoint
    args = settings(argparse.Namespace(**dict(vars(args), sigma=ckpt.get("sigma") if args.sigma is None else args.sigma,
                                                     dataset=dataset)))
    common.check(args.probe >= 1 and (args.N is None or args.N >= 1), "--probe and --N must be >= 1")
    train_set = common.get_dataset(dataset, "train", args.data_dir, train_transform=False)
    target = None
    if args.method == "catrs":
        target = load_catrs_target(args.catrs_target, dataset, len(train_set), common.NUM_CLASSES[dataset],
                                   args.trust_checkpoint)
    epoch = max(int(ckpt.get("epoch", args.epochs)), 1) - 1  # the loss of the checkpoint's last epoch
    loss_fn = make_loss_fn(args.method, vars(args), args.sigma, epoch, target)
    path = os.path.join(machinery.make_outdir(outdir), f"gradnorm_{args.method}.tsv")
    rows = machinery.measure_grad_norms(model, train_set, loss_fn, args.sigma, args.probe, 100 if args.N is None else args.N, args.seed,
                                        256, path, [args.gradnorm, args.catrs_target], (dataset, args.data_dir))
    print(f"wrote {len(rows['idx'])} gradient norms ({args.method} loss, epoch {epoch}) to {path}")


@contextlib.contextmanager
def lr_factor(optimizer, factor):
    """Multiply the learning rate by factor inside the block, then restore it exactly (the scheduler never sees it)."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] *= factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr


def check_resume_method(outdir, method, trust=False):
    """--resume must continue a run of the same method (start_or_resume checks arch, dataset and sigma)."""
    path = os.path.join(outdir, machinery.CHECKPOINT)
    if os.path.isfile(path):
        previous = (readers.load_checkpoint(path, trust=trust).get("args") or {}).get("method")
        common.check(previous in (None, method), f"--resume: {outdir!r} holds a {previous} run, not {method}; "
                                                 f"use the same --method or another --outdir")


def train(args, device):
    """The method's training for args.epochs epochs in args.outdir, resuming a run there with --resume."""
    machinery.check_precision(args.amp or "fp32", device)
    common.seed_everything(args.seed)   # the initial weights; each epoch then reseeds itself
    train_set = common.get_dataset(args.dataset, "train", args.data_dir)
    target = None
    if args.method == "catrs":
        target = load_catrs_target(args.catrs_target, args.dataset, len(train_set), common.NUM_CLASSES[args.dataset],
                                   args.trust_checkpoint)
        args.catrs_target_sha256 = readers.loaded_sha256(args.catrs_target)   # recorded: a resume needs the same
    test_loader = common.make_test_loader(common.get_dataset(args.dataset, "test", args.data_dir), 256, args.workers)
    loaders = common.TrainLoader(train_set, args.batch, args.workers, args.seed, machinery.get_rank(),
                                  machinery.get_world_size())   # workers live across epochs
    model = common.get_architecture(args.arch, args.dataset).to(device)
    if args.channels_last:  # before the optimizer: its momentum buffers take the parameters' layout
        model = model.to(memory_format=torch.channels_last)
    optimizer = common.make_optimizer(model, args.lr, args.momentum, args.weight_decay)
    scheduler = common.make_scheduler(optimizer, args.lr_step, milestones=args.lr_milestones)
    if args.resume:
        check_resume_method(args.outdir, args.method, args.trust_checkpoint)
    first, _ = machinery.start_or_resume(model, optimizer, scheduler, args.outdir, args.resume,
                                         {"arch": args.arch, "dataset": args.dataset, "sigma": args.sigma},
                                         args.trust_checkpoint, vars(args))
    model = machinery.wrap_model(model, device, args.sync_bn)
    if machinery.is_main_process():
        machinery.write_json({**vars(args), "environment": machinery.environment()},
                             os.path.join(args.outdir, "args.json"),
                             "settings of a run")
        if args.note:
            print(f"note: {args.note} hyper-parameters (override them with flags)")
        print(f"training {args.arch} with {args.method} on {args.dataset}, sigma {args.sigma}, m {args.m}, "
              f"batch {args.batch}; writing {args.outdir}")
    log, run_start = machinery.open_train_log(args.outdir, first), time.time()
    chunks = args.m if CHUNKED[args.method] else 1
    for epoch in range(first, args.epochs):
        start = time.time()
        common.seed_epoch(args.seed, epoch, machinery.get_rank())
        loader = loaders.epoch(epoch)
        loss_fn = make_loss_fn(args.method, vars(args), args.sigma, epoch, target)  # warm-ups need the epoch
        with lr_factor(optimizer, 0.1 if epoch == args.lr_drop else 1.0):  # CAT-RS ImageNet's one-epoch drop
            lr = optimizer.param_groups[0]["lr"]
            row = common.train_epoch(model, loader, optimizer, loss_fn, chunks, device,
                                     machinery.progress_line(f"epoch {epoch + 1}"), args.max_batches,
                                     precision=args.amp or "fp32")
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
    common_options = {"device", "trust_checkpoint", "sigma", "dataset", "data_dir", "seed", "N"}
    machinery.check_mode_options(args, {"probe": ["gradnorm"], "N": ["gradnorm", "make_catrs_target"],
                                        "checkpoint": ["make_catrs_target"], "out": ["make_catrs_target"]},
                                 alone={"make_catrs_target": common_options | {"checkpoint", "out", "batch", "workers"},
                                        "gradnorm": common_options | set(HYPER_PARAMETERS) | {
                                            "method", "probe", "outdir", "epochs", "catrs_target"}})
    args.probe = 1000 if args.probe is None else args.probe
    machinery.set_inputs([args.gradnorm, args.catrs_target, args.checkpoint])   # files this run reads: never written over
    if args.make_catrs_target:
        return make_target_mode(args)
    if args.gradnorm:
        return gradnorm_mode(args)
    args = settings(args)
    if args.method == "catrs":   # before the run folder is made
        check_catrs_target_path(args.catrs_target)
    args.run = machinery.run_identity('train_baselines.py', args.dataset, args.data_dir)   # checked on --resume
    device = machinery.setup_distributed(args.device)
    with machinery.run_folder_lock(args.outdir, args.amp or "fp32", device):   # one run per folder
        train(args, device)
    machinery.end_distributed()


if __name__ == "__main__":
    machinery.run(main, exit_process=True)

"""Tests of train_baselines.py: each baseline's sanity checks from BASELINES.md as assertions, attack invariants,
the released defaults, the CAT-RS target, and short training runs on digits (CPU, in-process)."""
import json
import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import common
import machinery
import readers
import train_baselines as tb

SIGMA = 0.5


def digits_model(seed=0):
    """The digits CNN (it has BatchNorm), in train mode as during training."""
    torch.manual_seed(seed)
    return common.get_architecture("digits_cnn", "digits").train()


def linear_model(d=64, k=10, seed=0):
    """A model without BatchNorm: two calls on the same input give the same logits."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(d, k))


def batch(b=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, 1, 8, 8, generator=g), torch.randint(0, 10, (b,), generator=g)


def gaussian_reference(model, x, y, m, seed=3):
    """common.gaussian_loss on the noise drawn after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return common.gaussian_loss(model, x, y, SIGMA, m)["loss"]


def seeded(loss_fn, seed=3, **kw):
    torch.manual_seed(seed)
    return loss_fn(**kw)["loss"]


# ----------------------------------------------------------------------------------------------------------
# The sanity checks of BASELINES.md, one method at a time
# ----------------------------------------------------------------------------------------------------------

def test_consistency_with_lambda_and_eta_zero_is_the_gaussian_loss_on_the_same_noise():
    model, (x, y) = digits_model(), batch()
    ref = gaussian_reference(model, x, y, m=2)
    kw = dict(model=model, x=x, y=y, idx=None, sigma=SIGMA, m=2)
    assert torch.allclose(seeded(tb.consistency_loss, lbd=0.0, eta=0.0, **kw), ref, rtol=1e-6, atol=0)
    assert not torch.allclose(seeded(tb.consistency_loss, lbd=10.0, eta=0.5, **kw), ref)  # the terms do count


def test_consistency_with_identical_copies_has_no_kl_and_is_ce_plus_eta_entropy():
    model, (x, y) = digits_model(), batch()
    noise = (SIGMA * torch.randn(1, *x.shape)).expand(3, *x.shape)   # the same draw in all 3 copies
    out = tb.consistency_loss(model, x, y, None, sigma=SIGMA, m=3, lbd=20.0, eta=0.3, noise=noise)["loss"]
    logits = model(x + noise[0])   # train-mode BatchNorm: 3 identical copies have one copy's batch statistics
    p = F.softmax(logits, 1)
    expected = F.cross_entropy(logits, y) + 0.3 * -(p * p.log()).sum(1).mean()
    assert torch.allclose(out, expected, rtol=1e-5)


def test_smoothadv_with_eps_zero_is_the_gaussian_loss_on_the_same_noise():
    model, (x, y) = digits_model(), batch()
    ref = gaussian_reference(model, x, y, m=4)
    kw = dict(model=model, x=x, y=y, idx=None, sigma=SIGMA, m=4, T=3)
    assert torch.allclose(seeded(tb.smoothadv_loss, eps=0.0, **kw), ref, rtol=1e-6, atol=0)
    assert not torch.allclose(seeded(tb.smoothadv_loss, eps=1.0, **kw), ref)


def test_smoothadv_attack_stays_in_the_ball_and_the_box_and_raises_the_smoothed_loss():
    model, (x, y) = linear_model(), batch(b=32)
    noise = SIGMA * torch.randn(4, *x.shape)
    x_adv = tb.smoothadv_attack(model, x, y, noise, T=5, eps=0.5)
    assert (x_adv - x).flatten(1).norm(dim=1).max() <= 0.5 + 1e-6
    assert x_adv.min() >= 0 and x_adv.max() <= 1
    before, after = tb.smoothed_nll(model, x, y, noise), tb.smoothed_nll(model, x_adv, y, noise)
    assert after.mean() > before.mean() + 0.05


def test_smoothadv_trains_on_the_noises_its_attack_used():
    model, (x, y) = linear_model(), batch()
    noise = SIGMA * torch.randn(2, *x.shape)
    out = tb.smoothadv_loss(model, x, y, None, sigma=SIGMA, m=2, T=4, eps=0.5, noise=noise)["loss"]
    x_adv = tb.smoothadv_attack(model, x, y, noise, T=4, eps=0.5)   # deterministic given the noises
    expected = F.cross_entropy(model((x_adv.unsqueeze(0) + noise).flatten(0, 1)), y.repeat(2))
    assert torch.allclose(out, expected, rtol=1e-6)


def grid_batch(b=64, seed=1):
    """Images on the 256-level grid, as 8-bit data loads, so that DDN's quantisation is exact."""
    x, y = batch(b, seed)
    return (x * 255).round() / 255, y


def test_ddn_with_eps_or_steps_zero_returns_the_clean_image():
    model, (x, y) = linear_model(), grid_batch()
    noise = SIGMA * torch.randn(1, *x.shape)
    assert torch.equal(tb.ddn_attack(model, x, y, noise, T=2, eps=0.0), x)
    assert torch.equal(tb.ddn_attack(model, x, y, noise, T=0, eps=1.0), x)


def test_ddn_returns_the_smallest_adversarial_it_saw_or_the_clean_image():
    model, (x, y) = linear_model(), grid_batch()
    noise = SIGMA * torch.randn(2, *x.shape)
    x_adv = tb.ddn_attack(model, x, y, noise, T=8, eps=2.0)
    slack = 0.5 / 255 * 64 ** 0.5             # the final rounding of e to 256 levels
    assert (x_adv - x).flatten(1).norm(dim=1).max() <= 2.0 + slack
    assert x_adv.min() >= 0 and x_adv.max() <= 1
    assert torch.allclose(x_adv * 255, (x_adv * 255).round(), atol=1e-4)   # stays on the 8-bit grid
    moved = (x_adv != x).flatten(1).any(1)
    assert 0 < moved.sum() < len(x)           # found for some images, not for all
    pbar = lambda u: F.softmax(model((u.unsqueeze(0) + noise).flatten(0, 1)), 1).view(2, len(x), -1).mean(0)
    fooled = pbar(x_adv).argmax(1) != y
    clean_fooled = pbar(x).argmax(1) != y
    assert fooled[moved].all()                # every image it moved is adversarial (eps 2 never shrinks it)
    assert not moved[clean_fooled].any()      # already adversarial at e = 0: the clean image is the smallest


def test_ddn_matches_a_loop_over_torch_optim_with_the_official_scheduler_order():
    """The vectorised attack against a per-step transcription that uses SGD and CosineAnnealingLR stepped first."""
    model, (x, y) = linear_model(), grid_batch(b=16)
    noise, T, eps, gamma = SIGMA * torch.randn(1, *x.shape), 4, 1.5, 0.05
    b = len(x)
    delta = torch.zeros_like(x, requires_grad=True)
    optimizer = torch.optim.SGD([delta], lr=1.0)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=T, eta_min=0.01)
    r = torch.full((b,), eps)
    r_max = torch.maximum(x, 1 - x).flatten(1).norm(dim=1)
    best_norm, best = r_max.clone(), torch.zeros_like(x)
    for _ in range(T):
        with warnings.catch_warnings():       # torch warns about this order; it is the official code's
            warnings.simplefilter("ignore")
            scheduler.step()                  # before optimizer.step(): the rates are the cosine at 1..T
        logits = model(x + delta + noise[0])
        adversarial, l2 = logits.argmax(1) != y, delta.detach().flatten(1).norm(dim=1)
        better = adversarial & (l2 < best_norm)
        best_norm[better], best[better] = l2[better], delta.detach()[better]
        optimizer.zero_grad()
        (-F.cross_entropy(logits, y, reduction="sum")).backward()
        delta.grad /= delta.grad.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
        optimizer.step()
        with torch.no_grad():
            r = torch.minimum(r * (1 - gamma * (2 * adversarial.float() - 1)), r_max)
            delta *= (r / delta.flatten(1).norm(dim=1)).view(-1, 1, 1, 1)
            delta.copy_(((x + delta) * 255).round().div(255).clamp(0, 1) - x)
    best = best.renorm(2, 0, eps)
    expected = x + (best * 255).round() / 255
    assert torch.allclose(tb.ddn_attack(model, x, y, noise, T=T, eps=eps), expected, atol=1e-6)


def test_macer_with_one_copy_and_lambda_zero_is_the_gaussian_loss():
    model, (x, y) = digits_model(), batch()
    ref = gaussian_reference(model, x, y, m=1)
    out = seeded(tb.macer_loss, model=model, x=x, y=y, idx=None, sigma=SIGMA, m=1, beta=16.0, gamma=8.0, lbd=0.0)
    assert torch.allclose(out, ref, rtol=1e-5)   # equal up to MACER's 1e-10 inside the log


def test_macer_robustness_term_gives_no_gradient_to_misclassified_images_or_beyond_gamma():
    model = linear_model(d=4, k=3)
    x = torch.rand(2, 1, 2, 2)
    noise = SIGMA * torch.randn(8, *x.shape)
    with torch.no_grad():
        q = F.softmax(model((x.unsqueeze(0) + noise).flatten(0, 1)).view(8, 2, 3), 2).mean(0)  # beta = 1
    top = q.argmax(1)
    y = torch.stack([top[0], (top[1] + 1) % 3])   # image 0: top-1 correct; image 1: top-1 wrong

    def grad_x(lbd, gamma):
        xg = x.clone().requires_grad_(True)
        loss = tb.macer_loss(model, xg, y, None, sigma=SIGMA, m=8, beta=1.0, gamma=gamma, lbd=lbd, noise=noise)
        return torch.autograd.grad(loss["loss"], xg)[0]

    plain, robust = grad_x(0.0, 100.0), grad_x(5.0, 100.0)
    assert torch.allclose(robust[1], plain[1]) and not torch.allclose(robust[0], plain[0])
    d0 = torch.special.ndtri(q[0].topk(2).values).diff().abs()
    assert d0 > 1e-3   # so gamma = 1e-3 puts image 0 beyond the hinge
    assert torch.allclose(grad_x(5.0, 1e-3), plain)


def test_smoothmix_with_eta_zero_and_mix_step_zero_is_the_gaussian_loss():
    model, (x, y) = digits_model(), batch()
    ref = gaussian_reference(model, x, y, m=2)
    kw = dict(model=model, x=x, y=y, idx=None, sigma=SIGMA, m=2, T=2, alpha=0.5, mix_step=0, warm=1.0)
    assert torch.allclose(seeded(tb.smoothmix_loss, eta=0.0, **kw), ref, rtol=1e-6, atol=0)
    assert not torch.allclose(seeded(tb.smoothmix_loss, eta=5.0, **kw), ref)


def test_smoothmix_mixing_weight_never_exceeds_one_half_and_mixes_towards_uniform():
    torch.manual_seed(0)
    u, x_adv = torch.rand(5000, 1, 2, 2), torch.rand(5000, 1, 2, 2)
    pbar = F.softmax(torch.randn(5000, 10), 1)
    mix = tb.smoothmix_mixup(u, x_adv, pbar)
    lam = mix["lam"]
    assert lam.min() >= 0 and lam.max() < 0.5 and lam.max() > 0.49   # U[0, 1/2): 5000 draws reach 0.49
    lam_x = lam.view(-1, 1, 1, 1)
    assert torch.allclose(mix["x_mix"], (1 - lam_x) * u + lam_x * x_adv)
    assert torch.allclose(mix["y_mix"] - (1 - lam[:, None]) * pbar, lam[:, None].expand(-1, 10) / 10, atol=1e-7)
    assert torch.allclose(mix["y_mix"].sum(1), torch.ones(5000))


def test_smoothmix_path_starts_within_warm_times_alpha_of_the_image():
    model, (x, y) = linear_model(), batch(b=16)
    noise = SIGMA * torch.randn(2, *x.shape)
    u_init, x_adv = tb.smoothmix_attack(model, x, y, noise, T=4, alpha=1.0, mix_step=1, warm=0.3)
    assert (u_init - x).flatten(1).norm(dim=1).max() <= 0.3 + 1e-5
    assert x_adv.min() >= 0 and x_adv.max() <= 1 and (x_adv - x).flatten(1).norm(dim=1).min() > 0.3
    u0, _ = tb.smoothmix_attack(model, x, y, noise, T=4, alpha=1.0, mix_step=0, warm=1.0)
    assert torch.equal(u0, x)


def test_catrs_with_lambda_zero_and_all_copies_kept_is_the_gaussian_loss():
    model, (x, y) = digits_model(), batch()
    ref = gaussian_reference(model, x, y, m=4)
    onehot = F.one_hot(y, 10).float()   # with confidence_mask, phat = pb_y = 1, so K = M
    kw = dict(model=model, x=x, y=y, idx=torch.arange(len(y)), sigma=SIGMA, m=4, T=2, eps=1.0, target=onehot,
              confidence_mask=True)
    assert torch.allclose(seeded(tb.catrs_loss, lbd=0.0, **kw), ref, rtol=1e-6, atol=0)
    assert not torch.allclose(seeded(tb.catrs_loss, lbd=1.0, **kw), ref)


def test_catrs_attack_with_eps_zero_returns_the_noise_and_keeps_its_mean():
    model, (x, y) = digits_model(), batch()
    pb = F.softmax(torch.randn(len(y), 10), 1)
    delta = SIGMA * torch.randn(4, *x.shape)
    assert torch.allclose(tb.catrs_attack(model, x, pb, delta, T=3, eps=0.0), delta, atol=1e-6)
    moved = tb.catrs_attack(model, x, pb, delta, T=3, eps=1.0)
    flat, orig = moved.flatten(2), delta.flatten(2)
    assert not torch.allclose(moved, delta, atol=1e-3)
    assert torch.allclose(flat.mean(2), orig.mean(2), atol=1e-6)
    assert torch.allclose(flat.pow(2).mean(2).sqrt(), orig.pow(2).mean(2).sqrt(), rtol=0.02)  # see below

    def kl(d):
        with torch.no_grad():
            logq = F.log_softmax(model.eval()(tb.add_noise(x, d)), 1)
        return tb.kl_div(pb.repeat(4, 1), logq).mean()
    assert kl(moved) > kl(delta)   # the attack raises its objective


def test_catrs_restandardisation_divides_by_the_uncentred_rms():
    v = torch.tensor([[1.0, 2.0, 3.0]])                      # mean 2, uncentred RMS sqrt(14/3), std sqrt(2/3)
    out = tb.match_moments(v, torch.tensor([[0.5]]), torch.tensor([[1.0]]))
    assert torch.allclose(out, 0.5 + torch.tensor([[-1.0, 0.0, 1.0]]) / (14 / 3) ** 0.5)


def test_catrs_low_term_keeps_the_K_smallest_losses_divided_by_M():
    ce = torch.tensor([[3.0, 1.0], [1.0, 5.0], [2.0, 0.0]])   # (M=3, b=2)
    assert torch.equal(tb.bottom_k_sum(ce, torch.tensor([2, 1])), torch.tensor([3.0, 0.0]))
    assert torch.equal(tb.bottom_k_sum(ce, torch.tensor([3, 3])), ce.sum(0))


def test_stability_with_lambda_zero_is_clean_cross_entropy():
    model, (x, y) = digits_model(), batch()
    out = tb.stability_loss(model, x, y, None, sigma=SIGMA, lbd=0.0)["loss"]
    assert torch.allclose(out, F.cross_entropy(model(x), y), rtol=1e-6)


@pytest.mark.parametrize("attack", ["smoothadv", "ddn", "smoothmix", "catrs"])
def test_attacks_run_in_eval_mode_and_leave_weights_and_batchnorm_statistics_unchanged(attack):
    model, (x, y) = digits_model(), batch()
    noise = SIGMA * torch.randn(2, *x.shape)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes = []
    model[1].register_forward_pre_hook(lambda module, inputs: modes.append(module.training))
    if attack == "smoothadv":
        tb.smoothadv_attack(model, x, y, noise, T=3, eps=0.5)
    elif attack == "ddn":
        tb.ddn_attack(model, x, y, noise, T=3, eps=0.5)
    elif attack == "smoothmix":
        tb.smoothmix_attack(model, x, y, noise, T=3, alpha=0.5, mix_step=1, warm=1.0)
    else:
        tb.catrs_attack(model, x, F.one_hot(y, 10).float(), noise, T=3, eps=0.5)
    assert modes == [False] * 3
    assert model.training and all(p.requires_grad and p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ----------------------------------------------------------------------------------------------------------
# Defaults, epoch-dependent hyper-parameters, the CAT-RS target
# ----------------------------------------------------------------------------------------------------------

def parse(*argv):
    old = sys.argv
    sys.argv = ["train_baselines.py", *map(str, argv)]
    try:
        return tb.parse_args()
    finally:
        sys.argv = old


def test_defaults_are_the_released_settings_and_flags_override_them():
    s = tb.settings(parse("--method", "catrs", "--sigma", 0.5))
    assert (s.m, s.T, s.eps, s.lbd, s.batch, s.epochs, s.lr_step, s.arch) == (4, 4, 1.0, 1.0, 256, 150, 50,
                                                                             "cifar_resnet110")
    s = tb.settings(parse("--method", "macer", "--sigma", 1.0))
    assert (s.m, s.beta, s.gamma, s.lbd, s.deferred, s.batch) == (16, 16.0, 8.0, 12.0, True, 64)
    s = tb.settings(parse("--method", "smoothadv", "--sigma", 1.0, "--T", 2))
    assert (s.m, s.T, s.eps, s.warmup) == (2, 2, 2.0, 10)
    s = tb.settings(parse("--method", "smoothadv", "--sigma", 0.25, "--dataset", "imagenet"))
    assert (s.m, s.T, s.eps, s.attack) == (1, 2, 255 / 256, "ddn")   # Salman's released ImageNet sigma 0.25
    assert tb.settings(parse("--method", "smoothadv", "--sigma", 0.5, "--dataset", "imagenet")).attack == "pgd"
    s = tb.settings(parse("--method", "smoothmix", "--sigma", 0.25))
    assert (s.m, s.T, s.alpha, s.eta, s.mix_step, s.maxnorm) == (2, 4, 0.5, 5.0, 0, None)
    s = tb.settings(parse("--method", "consistency", "--sigma", 1.0, "--dataset", "imagenet", "--lbd", 3))
    assert (s.m, s.lbd, s.eta, s.batch, s.epochs, s.lr_step) == (2, 3.0, 0.1, 200, 90, 30)
    s = tb.settings(parse("--method", "stability", "--sigma", 0.12))   # no released 0.12: nearest, with a note
    assert s.lbd == 2.0 and "0.25" in s.note
    with pytest.raises(common.UserError, match="--beta"):
        tb.settings(parse("--method", "catrs", "--sigma", 0.5, "--beta", 3))


def test_warm_ups_and_the_deferred_term_follow_the_epoch():
    def kw(method, epoch, *argv):
        s = tb.settings(parse("--method", method, "--sigma", 1.0, *argv))
        return tb.make_loss_fn(method, vars(s), s.sigma, epoch, target=torch.zeros(1)).keywords
    assert kw("smoothadv", 0)["warm"] == pytest.approx(0.1) and kw("smoothadv", 9)["warm"] == 1.0   # eps 2.0
    assert kw("smoothadv", 0)["eps"] == 2.0
    assert kw("smoothmix", 4)["warm"] == pytest.approx(0.5) and kw("smoothmix", 20)["warm"] == 1.0
    assert kw("macer", 50)["lbd"] == 0.0 and kw("macer", 51)["lbd"] == 12.0   # lambda = 0 in epochs 0..50
    assert kw("catrs", 79, "--double_eps_from", 80)["eps"] == 1.0
    assert kw("catrs", 80, "--double_eps_from", 80)["eps"] == 2.0


def test_the_lr_drop_lasts_one_epoch_and_leaves_the_schedule_alone():
    optimizer = torch.optim.SGD(linear_model().parameters(), lr=0.1)
    with tb.lr_factor(optimizer, 0.1):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
    assert optimizer.param_groups[0]["lr"] == 0.1


def run_main(monkeypatch, *argv):
    """Run train_baselines.main() as the command line would (through machinery.run); returns the exit code."""
    monkeypatch.setattr(sys, "argv", ["train_baselines.py", *map(str, argv)])
    try:
        machinery.run(tb.main)
    except SystemExit as e:
        return e.code
    return 0


@pytest.fixture(scope="module")
def catrs_target(tmp_path_factory):
    """A CAT-RS target file from an (untrained) digits model, N = 30 votes per image."""
    folder = tmp_path_factory.mktemp("catrs")
    model = digits_model()
    machinery.save_checkpoint({"arch": "digits_cnn", "dataset": "digits", "sigma": 0.25,
                               "state_dict": model.state_dict()}, str(folder / "gauss.pth.tar"))
    mp = pytest.MonkeyPatch()
    try:
        assert run_main(mp, "--make-catrs-target", "--checkpoint", folder / "gauss.pth.tar", "--out",
                        folder / "target.pt", "--N", 30, "--workers", 0, "--seed", 5) == 0
    finally:
        mp.undo()
    return folder


def test_catrs_target_holds_the_monte_carlo_votes_of_the_checkpoint(catrs_target):
    saved = torch.load(catrs_target / "target.pt", weights_only=False)
    counts = saved["counts"]
    train = common.get_dataset("digits", "train")
    assert counts.shape == (len(train), 10) and (counts.sum(1) == 30).all()
    assert saved["N"] == 30 and saved["sigma"] == 0.25 and saved["dataset"] == "digits"
    assert not os.path.exists(str(catrs_target / "target.pt") + ".partial")
    model, _ = readers.load_model(str(catrs_target / "gauss.pth.tar"))   # redo the first 64 images by hand
    common.seed_everything(common.epoch_seed(5, 0))
    expected = common.sample_counts(model, train.images[:64], 0.25, 30, 1024, 10)
    assert torch.equal(counts[:64], expected)


def test_a_catrs_target_names_its_model_and_no_run_mixes_two(catrs_target, monkeypatch, tmp_path):
    saved = torch.load(catrs_target / "target.pt", weights_only=False)
    assert saved["checkpoint_sha256"] == machinery.file_sha256(str(catrs_target / "gauss.pth.tar"))
    # a partial target of one model is never continued with another's votes, at the same path or not
    other = digits_model()
    torch.nn.init.zeros_(next(other.parameters()))
    machinery.save_checkpoint({"arch": "digits_cnn", "dataset": "digits", "sigma": 0.25,
                               "state_dict": other.state_dict()}, str(tmp_path / "gauss.pth.tar"))
    partial = {"settings": {"N": 30, "sigma": 0.25, "seed": 5, "len": len(saved["counts"]),
                            "tag": saved["checkpoint_sha256"]}, "counts": saved["counts"], "done": 1024}
    machinery.save_checkpoint(partial, str(tmp_path / "t.pt.partial"))
    assert run_main(monkeypatch, "--make-catrs-target", "--checkpoint", tmp_path / "gauss.pth.tar", "--out",
                    tmp_path / "t.pt", "--N", 30, "--workers", 0, "--seed", 5) == 2
    assert not os.path.exists(tmp_path / "t.pt")
    partial["settings"]["tag"] = machinery.file_sha256(str(tmp_path / "gauss.pth.tar"))   # its own: continued
    machinery.save_checkpoint(partial, str(tmp_path / "u.pt.partial"))
    assert run_main(monkeypatch, "--make-catrs-target", "--checkpoint", tmp_path / "gauss.pth.tar", "--out",
                    tmp_path / "u.pt", "--N", 30, "--workers", 0, "--seed", 5) == 0
    assert torch.equal(torch.load(tmp_path / "u.pt", weights_only=False)["counts"][:1024], saved["counts"][:1024])
    # a run records its target's hash, so a resume with another target is refused
    out, argv = tmp_path / "run", ("--method", "catrs", *DIGITS, "--max-batches", 1, "--T", 1)
    assert run_main(monkeypatch, *argv, "--epochs", 1, "--outdir", out, "--catrs-target", catrs_target / "target.pt") == 0
    assert json.load(open(out / "args.json"))["catrs_target_sha256"] == machinery.file_sha256(
        str(catrs_target / "target.pt"))
    swapped = dict(saved, counts=saved["counts"].flip(1))
    machinery.save_checkpoint(swapped, str(tmp_path / "swapped.pt"))
    assert run_main(monkeypatch, *argv, "--epochs", 2, "--outdir", out, "--resume",
                    "--catrs-target", tmp_path / "swapped.pt") == 2


# ----------------------------------------------------------------------------------------------------------
# Training runs on digits, checkpoints certify.py reads, gradient norms, resume, bad input
# ----------------------------------------------------------------------------------------------------------

def read_log(outdir):
    lines = open(os.path.join(outdir, "log.tsv")).read().splitlines()
    return [dict(zip(lines[0].split("\t"), ln.split("\t"))) for ln in lines[1:]]


DIGITS = ("--dataset", "digits", "--sigma", 0.25, "--workers", 0)
# Digits has only 1,437 training images, so some runs need more steps than the released settings give them
# in two epochs: SmoothAdv takes fewer attack steps (T=10 -> 2) to stay fast; MACER takes MACER's own lr 0.01
# and lambda 1 (with lambda 12, a hinge of up to lbd * sigma/2 * gamma = 12 per image, the tiny CNN needs many
# more epochs); Stability takes batches of 64 (it does not chunk: 6 steps per epoch at 256).
RUNS = {"smoothadv": ("--T", 2), "macer": ("--lr", 0.01, "--lbd", 1), "consistency": (), "smoothmix": (),
        "catrs": (), "stability": ("--batch", 64)}


@pytest.mark.parametrize("method", tb.METHODS)
def test_each_method_learns_on_digits_and_certify_reads_its_checkpoint(method, monkeypatch, tmp_path, catrs_target):
    out = tmp_path / method
    extra = ("--catrs-target", catrs_target / "target.pt") if method == "catrs" else ()
    argv = ("--method", method, *DIGITS, "--epochs", 2, "--outdir", out, *extra, *RUNS[method])
    assert run_main(monkeypatch, *argv) == 0
    log = read_log(out)
    first, last = log[0], log[-1]
    assert all(torch.isfinite(torch.tensor(float(r["train_loss"]))) for r in log)
    if method == "catrs":
        # Its objective grows as the model learns (more images reach K = M and add the max-KL term), so its
        # loss is not comparable across epochs; accuracy under Gaussian noise is.
        assert float(last["train_acc"]) > float(first["train_acc"]) + 0.1
    else:
        assert float(last["train_loss"]) < float(first["train_loss"])
    assert float(last["test_acc_noisy"]) > 0.3   # 10 classes: chance is 0.1
    assert json.load(open(out / "args.json"))["method"] == method
    import certify
    tsv = tmp_path / "cert.tsv"
    certify.main(["--checkpoint", str(out / "checkpoint.pth.tar"), "--N0", "10", "--N", "50", "--max", "3",
                  "--outfile", str(tsv), "--device", "cpu"])
    lines = open(tsv).read().splitlines()
    assert lines[0].split("\t")[:6] == ["idx", "label", "predict", "radius", "correct", "time"] and len(lines) == 4


def test_a_resumed_run_ends_with_the_same_weights_as_an_uninterrupted_one(monkeypatch, tmp_path):
    argv = ("--method", "smoothmix", *DIGITS, "--max-batches", 2)
    assert run_main(monkeypatch, *argv, "--epochs", 2, "--outdir", tmp_path / "whole") == 0
    assert run_main(monkeypatch, *argv, "--epochs", 1, "--outdir", tmp_path / "parts") == 0
    assert run_main(monkeypatch, *argv, "--epochs", 2, "--outdir", tmp_path / "parts", "--resume") == 0
    a = readers.load_checkpoint(str(tmp_path / "whole" / "checkpoint.pth.tar"))["state_dict"]
    b = readers.load_checkpoint(str(tmp_path / "parts" / "checkpoint.pth.tar"))["state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("method, extra", [("smoothadv", ("--T", 1)), ("macer", ()), ("catrs", ("--T", 1))])
def test_mixed_precision_and_channels_last_runs_train(method, extra, monkeypatch, tmp_path, catrs_target):
    if method == "catrs":
        extra = (*extra, "--catrs-target", catrs_target / "target.pt")
    assert run_main(monkeypatch, "--method", method, *DIGITS, "--epochs", 1, "--max-batches", 1, "--m", 2,
                    "--amp", "--channels-last", "--outdir", tmp_path, *extra) == 0
    assert torch.isfinite(torch.tensor(float(read_log(tmp_path)[0]["train_loss"])))


def test_gradnorm_mode_uses_each_methods_own_loss(monkeypatch, tmp_path, catrs_target):
    ckpt = catrs_target / "gauss.pth.tar"
    tables = {}
    for method in ("consistency", "catrs"):
        extra = ("--catrs-target", catrs_target / "target.pt") if method == "catrs" else ()
        assert run_main(monkeypatch, "--method", method, "--gradnorm", ckpt, "--probe", 6, "--N", 20, *extra) == 0
        lines = open(catrs_target / f"gradnorm_{method}.tsv").read().splitlines()   # beside the checkpoint
        assert lines[0] == "idx\tlabel\tpA\tgrad_norm" and len(lines) == 7
        tables[method] = [ln.split("\t") for ln in lines[1:]]
    assert [r[:3] for r in tables["consistency"]] == [r[:3] for r in tables["catrs"]]   # same probes and pA
    assert [r[3] for r in tables["consistency"]] != [r[3] for r in tables["catrs"]]     # different losses


BAD_INPUTS = [
    (("--method", "gaussian", *DIGITS), "unknown method"),
    (("--method", "macer", "--dataset", "mnist", "--sigma", 0.5), "mnist"),
    (("--method", "macer", "--dataset", "digits", "--arch", "vgg", "--sigma", 0.5), "vgg"),
    (("--method", "macer", "--dataset", "digits", "--sigma", 0), "--sigma"),
    (("--method", "consistency", "--dataset", "digits", "--sigma", 0.5, "--m", 0), "--m"),
    (("--method", "consistency", *DIGITS, "--T", 3), "--T"),
    (("--method", "catrs", *DIGITS), "--make-catrs-target"),
    (("--method", "catrs", *DIGITS, "--catrs-target", "missing.pt"), "--make-catrs-target"),
    (("--dataset", "digits", "--sigma", 0.5), "--method"),
]


@pytest.mark.parametrize("argv, says", BAD_INPUTS, ids=lambda v: " ".join(map(str, v)) if isinstance(v, tuple) else v)
def test_bad_input_is_one_line_and_exit_code_2(argv, says, monkeypatch, tmp_path, capsys):
    assert run_main(monkeypatch, *argv, "--workers", 0, "--outdir", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and says in err
    assert not (tmp_path / "out").exists()   # nothing written before the input was checked


def test_resume_without_a_checkpoint_and_an_unwritable_outdir_are_one_line_exit_2(monkeypatch, tmp_path, capsys):
    argv = ("--method", "stability", *DIGITS)
    assert run_main(monkeypatch, *argv, "--outdir", tmp_path / "empty", "--resume") == 2
    assert "no checkpoint" in capsys.readouterr().err
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert run_main(monkeypatch, *argv, "--outdir", blocker / "run") == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "cannot write" in err


def test_lr_milestones_give_macers_own_schedule_and_move_its_deferred_term():
    s = tb.settings(parse("--method", "macer", "--sigma", 1.0, "--lr", 0.01, "--epochs", 440,
                          "--lr_milestones", 400, 200))
    optimizer = torch.optim.SGD(linear_model().parameters(), lr=s.lr)
    scheduler = common.make_scheduler(optimizer, s.lr_step, milestones=s.lr_milestones)
    rates = []
    for _ in range(440):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()   # no gradients: a no-op that keeps the scheduler's order check quiet
        scheduler.step()
    assert rates[199] == pytest.approx(0.01) and rates[200] == pytest.approx(0.001)
    assert rates[399] == pytest.approx(0.001) and rates[400] == pytest.approx(0.0001)
    lbd = lambda epoch: tb.make_loss_fn("macer", vars(s), s.sigma, epoch).keywords["lbd"]
    assert lbd(60) == 0.0 and lbd(200) == 0.0 and lbd(201) == 12.0   # deferred past the first decay, not lr_step
    with pytest.raises(common.UserError, match="lr_milestones"):
        tb.settings(parse("--method", "macer", "--sigma", 1.0, "--lr_milestones", 0))

"""Unit tests of the training parts: the sphere attack (Alg. 1), discarding, reweighting, the sampler,
per-example gradient norms. CPU, synthetic tensors, a few seconds."""
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy.stats import beta, norm

import common
import machinery
import train_ours


def linear_model(d=3 * 4 * 4, k=5, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(d, k))


def bn_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 5))


def batch(B=6, m=3, sigma=0.5, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(B, 3, 4, 4, generator=g)
    y = torch.randint(0, 5, (B,), generator=g)
    delta = sigma * torch.randn(m, B, 3, 4, 4, generator=g)   # (m, B, C, H, W)
    return x, y, delta


# ---------------------------------------------------------------- the adaptive attack on the sphere (Alg. 1)

@pytest.mark.parametrize("norm_type", ["l2", "linf"])
def test_sphere_pgd_keeps_every_noise_on_its_original_sphere(norm_type):
    model = bn_model()
    x, y, delta = batch()
    out = common.sphere_pgd(model, x, y, delta, T=5, eps=0.7, norm_type=norm_type)
    assert out.shape == delta.shape
    assert torch.allclose(out.flatten(2).norm(dim=2), delta.flatten(2).norm(dim=2), rtol=1e-5, atol=0)


def test_sphere_pgd_with_T_zero_is_the_identity():
    model = bn_model()
    x, y, delta = batch()
    assert torch.equal(common.sphere_pgd(model, x, y, delta, T=0, eps=0.5), delta)


def test_sphere_pgd_returns_draws_misclassified_from_the_start_unchanged_and_moves_the_others():
    model = linear_model()
    x, y, delta = batch(B=16, m=4)
    with torch.no_grad():
        wrong0 = (model((x.unsqueeze(0) + delta).flatten(0, 1)).argmax(1) != y.repeat(4)).view(4, 16)
    assert wrong0.any() and (~wrong0).any()   # the seed gives both kinds of draws
    out = common.sphere_pgd(model, x, y, delta, T=3, eps=0.5)
    same = (out == delta).flatten(2).all(dim=2)   # (m, B)
    assert torch.equal(same, wrong0)          # exactly the draws misclassified at the start stay put


def one_step_by_hand(model, x, y, delta, eps, norm_type):
    """One step of Alg. 1 for draws that are classified correctly, written out from App. C.3."""
    m = delta.shape[0]
    d = delta.detach().clone().requires_grad_(True)
    loss = F.cross_entropy(model((x.unsqueeze(0) + d).flatten(0, 1)), y.repeat(m), reduction="sum")
    g, = torch.autograd.grad(loss, d)
    if norm_type == "l2":
        step = g / g.flatten(2).norm(dim=2)[..., None, None, None]
    else:
        step = g.sign() / x[0].numel() ** 0.5
    new = delta + eps * step
    return new * (delta.flatten(2).norm(dim=2) / new.flatten(2).norm(dim=2))[..., None, None, None]


def test_sphere_pgd_l2_and_linf_steps_follow_app_c3():
    model = linear_model()
    x, y, delta = batch(B=16, m=4)
    with torch.no_grad():
        right = (model((x.unsqueeze(0) + delta).flatten(0, 1)).argmax(1) == y.repeat(4)).view(4, 16)
    assert right.any()
    results = {}
    for norm_type in ("l2", "linf"):
        out = common.sphere_pgd(model, x, y, delta, T=1, eps=0.3, norm_type=norm_type)
        expected = one_step_by_hand(model, x, y, delta, 0.3, norm_type)
        assert torch.allclose(out[right], expected[right], atol=1e-5)
        results[norm_type] = out
    assert not torch.allclose(results["l2"][right], results["linf"][right], atol=1e-3)


def test_sphere_pgd_changes_neither_parameters_nor_batchnorm_statistics_nor_modes():
    model = bn_model()
    model.train()
    with torch.no_grad():   # non-trivial running statistics
        model(torch.rand(32, 3, 4, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y, delta = batch()
    common.sphere_pgd(model, x, y, delta, T=4, eps=0.5)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.training and all(p.requires_grad and p.grad is None for p in model.parameters())


def test_ours_loss_without_attack_is_exactly_the_gaussian_loss():
    model = bn_model()
    x, y, _ = batch()
    torch.manual_seed(3)
    ours = train_ours.ours_loss(model, x, y, 0.5, 4, 0, 0.25, "l2")
    torch.manual_seed(3)
    gauss = common.gaussian_loss(model, x, y, 0.5, 4)
    assert torch.equal(ours["loss"], gauss["loss"]) and ours["total"] == gauss["total"] == 4 * len(y)


# ---------------------------------------------------------------- discarding hard data (§5.1)

class ConstantClassifier(nn.Module):
    """Always predicts class c, whatever the noise: its pA is 1 on class c and 0 elsewhere, exactly."""

    def __init__(self, c, k=10):
        super().__init__()
        self.c, self.k = c, k
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        logits = torch.zeros(len(x), self.k)
        logits[:, self.c] = 1.0
        return logits + 0 * self.dummy


def test_count_correct_counts_true_label_votes():
    images = torch.rand(12, 1, 8, 8)
    labels = torch.arange(12) % 3
    data = common.TensorImages(images, labels)
    counts, got_labels = common.count_correct(ConstantClassifier(1), data, torch.arange(2, 12), 0.5, 7, 20)
    assert torch.equal(got_labels, labels[2:])
    assert torch.equal(counts, torch.where(labels[2:] == 1, 7, 0))


def test_discard_keeps_exactly_the_examples_with_count_over_N_at_least_pt(monkeypatch, tmp_path):
    counts = torch.tensor([0, 39, 40, 41, 100, 12, 40, 99])
    monkeypatch.setattr(common, "count_correct", lambda *args, **kwargs: (counts, torch.zeros(8, dtype=torch.long)))
    data = common.TensorImages(torch.zeros(8, 1, 8, 8), torch.zeros(8, dtype=torch.long))
    kept, got, _ = train_ours.discard_hard(None, data, 0.5, 100, 0.4)
    assert kept.tolist() == [2, 3, 4, 6, 7] and torch.equal(got, counts)  # count/N >= 0.4, 40/100 included
    assert list(tmp_path.iterdir()) == []                                   # a pure function: no files


def test_discard_hard_is_pure_and_hands_the_model_back_in_train_mode(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = common.TensorImages(torch.rand(6, 1, 8, 8), torch.tensor([0, 1, 2, 1, 1, 0]))
    model = ConstantClassifier(1).train()
    kept, counts, labels = train_ours.discard_hard(model, data, 0.5, 16, 0.5, batch=64)
    assert kept.tolist() == [1, 3, 4] and counts.tolist() == [0, 16, 0, 16, 16, 0] and labels.tolist() == [0, 1, 2, 1, 1, 0]
    assert model.training and list(tmp_path.iterdir()) == [] and capsys.readouterr() == ("", "")


def test_shared_counts_writes_the_train_time_pA_tsv(tmp_path):
    data = common.TensorImages(torch.rand(6, 1, 8, 8), torch.tensor([0, 1, 2, 1, 1, 0]))
    path = tmp_path / "pA.tsv"
    idx = torch.tensor([1, 3, 5])
    counts, labels = common.count_correct(ConstantClassifier(1), data, idx, 0.5, 16, 64)
    counts = train_ours.shared_counts(counts, labels, idx, 16, str(path), torch.device("cpu"))
    assert counts.tolist() == [16, 16, 0]
    assert path.read_text().splitlines() == ["idx\tlabel\tcount\tn", "1\t1\t16\t16", "3\t1\t16\t16", "5\t0\t0\t16"]


# ---------------------------------------------------------------- reweighting by certified radius (§5.2)

def test_code_weights_match_baselines_7_4_raw_values_normalised_to_one():
    w = train_ours.radius_weights(np.arange(17), N=16, alpha=0.1, p_min=0.75, formula="code")
    raw = np.array([0.1537, 0.3286, 0.5257, 0.7649, 1.1075])    # BASELINES.md 7.4, k <= 12, 13, ..., 16
    assert np.allclose(w[:13].numpy(), 1.0)                       # counts at or below 12 weigh 1
    assert np.allclose(w[12:].numpy(), raw / raw[0], rtol=2e-3)
    assert w.argmax() == 16 and torch.all(w[1:] >= w[:-1])


def test_code_weights_equal_the_hand_computed_clopper_pearson_formula():
    for k in range(17):
        kk = max(k, 12)
        by_hand = norm.ppf(beta.ppf(0.1, kk, 16 - kk + 1)) / norm.ppf(beta.ppf(0.1, 12, 5))
        assert train_ours.radius_weights([k], 16, 0.1, 0.75, "code")[0].item() == pytest.approx(by_hand, rel=1e-12)


def test_paper_weights_clip_the_weight_at_one():
    w = train_ours.radius_weights(np.arange(17), N=16, alpha=0.1, p_min=0.75, formula="paper")
    assert np.allclose(w[:15].numpy(), 1.0)
    assert w[15].item() == pytest.approx(1.134, abs=1e-3) and w[16].item() == pytest.approx(1.642, abs=1e-3)


def test_radius_weights_has_no_default_formula_and_the_command_defaults_to_the_released_code(monkeypatch):
    with pytest.raises(TypeError, match="formula"):
        train_ours.radius_weights([12, 16], 16, 0.1, 0.75)
    monkeypatch.setattr(sys, "argv", ["train_ours.py", "--sigma", "0.5"])
    assert train_ours.parse_args().weights == "code"


# ---------------------------------------------------------------- the epoch sampler

def tiny_dataset(n=50):
    return common.TensorImages(torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1), torch.zeros(n, dtype=torch.long))


def drawn(loader):
    return torch.cat([idx for _, _, idx in loader])


def test_sampler_draws_len_D_indices_with_replacement_from_the_kept_set_only():
    data, kept = tiny_dataset(), torch.tensor([3, 7, 8, 20, 41])
    idx = drawn(common.TrainLoader(data, 16, 0, 0).epoch(5, indices=kept))
    assert len(idx) == len(data)                                   # |D| draws, not |D'|
    assert set(idx.tolist()) <= set(kept.tolist())
    assert len(set(idx.tolist())) < len(idx)                       # repeats: with replacement
    x = torch.cat([x for x, _, _ in common.TrainLoader(data, 16, 0, 0).epoch(5, indices=kept)])
    assert torch.equal(x.flatten().long(), idx)                    # idx is the position of x in the dataset


def test_weighted_sampler_follows_the_weights():
    data, kept = tiny_dataset(), torch.tensor([1, 2, 3])
    weights = torch.tensor([0.0, 1.0, 3.0], dtype=torch.float64)
    idx = drawn(common.TrainLoader(data, 1000, 0, 0).epoch(0, indices=kept, weights=weights, num_samples=20000))
    assert not (idx == 1).any()
    # 20000 draws: the share of index 3 has std 0.003, so +-0.02 never fails by chance
    assert (idx == 3).double().mean().item() == pytest.approx(0.75, abs=0.02)


def test_sampler_is_reproducible_per_epoch_and_a_plain_epoch_is_a_permutation():
    data = tiny_dataset()
    a = drawn(common.TrainLoader(data, 16, 0, 0).epoch(3))
    assert torch.equal(a, drawn(common.TrainLoader(data, 16, 0, 0).epoch(3)))
    assert not torch.equal(a, drawn(common.TrainLoader(data, 16, 0, 0).epoch(4)))
    assert sorted(a.tolist()) == list(range(len(data)))


class RandomlyAugmented(torch.utils.data.Dataset):
    """Example i is i plus a uniform draw from the global generator, as a torchvision random transform."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.tensor([float(i)]) + torch.rand(1), 0


def epoch_batches(loaders, epoch, **kw):
    return [(x.clone(), idx.clone()) for x, _, idx in loaders.epoch(epoch, **kw)]


def test_an_epochs_batches_depend_on_seed_and_epoch_only_not_on_workers_or_earlier_epochs():
    data = RandomlyAugmented()
    fresh = epoch_batches(common.TrainLoader(data, 8, 0, seed=1), 3)
    reused = common.TrainLoader(data, 8, 2, seed=1)   # two persistent worker processes, epochs 0..3 in turn
    for epoch in range(3):
        if epoch == 1:
            next(iter(reused.epoch(epoch)))          # an epoch cut short (--max-batches) leaves nothing behind
        else:
            epoch_batches(reused, epoch)
    again = epoch_batches(reused, 3)
    assert len(again) == len(fresh) == 5
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(fresh, again))
    other = epoch_batches(common.TrainLoader(data, 8, 0, seed=1), 4)
    assert not torch.equal(torch.cat([x for x, _ in fresh]).sort(0)[0], torch.cat([x for x, _ in other]).sort(0)[0])


def test_loading_leaves_the_global_generator_alone_and_repeated_draws_get_their_own_augmentation():
    data = RandomlyAugmented()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    batches = epoch_batches(common.TrainLoader(data, 1000, 0, seed=1), 0, indices=[5], num_samples=20)
    assert torch.equal(torch.get_rng_state(), before)   # the training noise stream is not shifted by loading
    x, idx = batches[0]
    assert (idx == 5).all() and len(torch.unique(x)) == 20 and ((x >= 5) & (x < 6)).all()


# ---------------------------------------------------------------- per-example gradient norms (Table 2)

def test_per_example_grad_norms_match_autograd_one_example_at_a_time():
    model = linear_model()
    x, y, _ = batch(B=5)

    def loss_fn(f, xb, yb, idx):
        return {"loss": F.cross_entropy(f(xb), yb)}

    norms = common.per_example_grad_norms(model, loss_fn, x, y)
    for i in range(5):
        grads = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters()))
        assert norms[i].item() == pytest.approx(torch.sqrt(sum((g ** 2).sum() for g in grads)).item(), rel=1e-5)
    assert all(p.grad is None for p in model.parameters())


def test_measure_grad_norms_writes_idx_label_pA_grad_norm(tmp_path):
    data = common.TensorImages(torch.rand(20, 1, 8, 8), torch.arange(20) % 10)
    model = common.get_architecture("digits_cnn", "digits")

    def loss_fn(f, x, y, idx):
        return common.gaussian_loss(f, x, y, 0.5, 2)

    rows = machinery.measure_grad_norms(model, data, loss_fn, 0.5, 6, 10, 0, 64, str(tmp_path / "g.tsv"))
    lines = (tmp_path / "g.tsv").read_text().splitlines()
    assert lines[0] == "idx\tlabel\tpA\tgrad_norm" and len(lines) == 7
    assert len(set(rows["idx"])) == 6 and all(0 <= p <= 1 for p in rows["pA"]) and min(rows["grad_norm"]) > 0
    assert rows["label"] == [i % 10 for i in rows["idx"]]

"""Sound sampling (Voráček & Hein 2023; SOUND.md §6): the integer table and its law, exactness of the noisy
input, the coupling identity, conservative failures, and the attacks: false certificates through the float
path, none through the integer one. Seeded throughout; sampling tolerances are 4 standard errors or more."""
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from scipy.stats import chisquare, norm

import certify
import common
from helpers import train_digits_model

H = 1 / 255


# ----------------------------------------------------------------------------------------------------------
# T1-T6: the sampler
# ----------------------------------------------------------------------------------------------------------

def test_table_floors_every_bin_below_its_exact_mass_and_is_symmetric():
    import mpmath
    sigma = 0.25
    S, L = common.rounded_gaussian_table(sigma)
    W = np.diff(np.concatenate([[0], S.numpy().astype(object)]))
    assert len(W) == 2 * L + 1 and L == math.ceil(10 * sigma * 255)
    assert list(W) == list(W[::-1])                                          # W_j = W_-j
    with mpmath.workdps(60):
        for j in range(-L, L + 1, 7):
            hi, lo = (mpmath.mpf(j) + mpmath.mpf(1) / 2), (mpmath.mpf(j) - mpmath.mpf(1) / 2)
            p = mpmath.ncdf(hi / 255 / mpmath.mpf(sigma)) - mpmath.ncdf(lo / 255 / mpmath.mpf(sigma))
            assert W[j + L] <= common.SOUND_Q * p < W[j + L] + 1                # W_j = floor(Q p_j)
        tails = 2 * mpmath.ncdf(-(L + mpmath.mpf(1) / 2) / 255 / mpmath.mpf(sigma))
        assert (common.SOUND_Q - int(S[-1])) / common.SOUND_Q <= (2 * L + 1) / common.SOUND_Q + tails
    for s in (0.12, 0.25, 0.5, 1.0):                                           # failure rate per coordinate
        S, _ = common.rounded_gaussian_table(s)
        assert 0 < (common.SOUND_Q - int(S[-1])) / common.SOUND_Q < 1e-15


def draw_J(n, sigma, seed, Q=common.SOUND_Q):
    """n draws of J (the noise in grid steps) and their failure flags, through the sampler itself."""
    a = torch.zeros(1, n, dtype=torch.int32)                      # n coordinates of one input at level 0
    z, _ = common.sound_noisy_inputs(a, 1, sigma, torch.Generator().manual_seed(seed), Q=Q)
    J = torch.round(z[0, 0].double() * 255).long()
    S, L = common.rounded_gaussian_table(sigma, Q)
    return J, J > L


def test_law_of_the_sampler_is_the_rounded_gaussian_chi_square():
    sigma, n = 0.5, 4_000_000
    J, failed = draw_J(n, sigma, seed=1)
    S, L = common.rounded_gaussian_table(sigma)
    assert not failed.any()
    observed = torch.bincount(J + L, minlength=2 * L + 1).numpy().astype(float)
    W = np.diff(np.concatenate([[0], S.numpy().astype(np.float64)]))
    expected = n * W / W.sum()
    # pool the tails where expected counts are < 20 (the chi-square approximation needs them large)
    keep = expected >= 20
    obs = np.concatenate([observed[keep], [observed[~keep].sum()]])
    exp = np.concatenate([expected[keep], [expected[~keep].sum()]])
    assert chisquare(obs, exp).pvalue > 1e-3
    var, se = (J.double() * H).var().item(), math.sqrt(2 / n) * sigma ** 2
    assert abs(var - (sigma ** 2 + H ** 2 / 12)) < 4 * se                   # rounding adds h^2 / 12
    assert abs((J.double() * H).mean().item()) < 4 * sigma / math.sqrt(n)    # centred (no +1/255 offset)


def test_the_noisy_input_is_exact_for_every_level_and_noise_index():
    sigma = 0.25
    S, L = common.rounded_gaussian_table(sigma)
    a = torch.arange(256, dtype=torch.int32).view(-1, 1)
    J = torch.arange(-L, L + 1, dtype=torch.int32).view(1, -1)
    s = a + J                                                                # every (level, index) pair
    z = s.float() / 255                                                      # the sampler's one conversion
    assert torch.equal(torch.round(z.double() * 255).int(), s)               # z determines a + J exactly
    lut = torch.arange(-L, 256 + L, dtype=torch.int32).float() / 255
    assert torch.equal(z, lut[s + L])                                        # and is a function of it only
    # the sampler itself feeds the model exactly LUT[a + J]
    x = torch.randint(0, 256, (3, 4, 4), generator=torch.Generator().manual_seed(0)).float() / 255
    got, _ = common.sound_noisy_inputs(common.grid_levels(x).unsqueeze(0), 50, sigma,
                                       torch.Generator().manual_seed(1))
    s_got = torch.round(got.double() * 255).int()
    assert torch.equal(got, lut[s_got + L]) and (s_got - common.grid_levels(x)).abs().max() <= L


def test_rounding_commutes_with_shifting_by_a_grid_point():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (100_000,), generator=g).double()
    G = torch.randn(100_000, generator=g, dtype=torch.float64) * 0.5
    frac = (G * 255) - (G * 255).floor()
    clean = (frac - 0.5).abs() > 1e-6                                        # exclude ties
    lhs = torch.round((a / 255 + G) * 255)                                   # q_h(x + G), in grid steps
    rhs = a + torch.round(G * 255)                                           # x + q_h(G)
    assert torch.equal(lhs[clean], rhs[clean])


def test_failures_count_against_A_in_the_full_N_and_renormalising_would_overestimate():
    # SOUND.md T6: a tiny Q makes failures frequent. a = 100, A := a + J < 120 (J <= 19).
    sigma, Q = 0.5, 2 ** 12
    S, L = common.rounded_gaussian_table(sigma, Q)
    p_exact = norm.cdf(19.5 / 255 / sigma)                                   # the exact rounded Gaussian
    p_sampler = int(S[19 + L]) / Q                                           # P(A and not failed)
    p_renormalised = int(S[19 + L]) / int(S[-1])
    assert 0.09 < 1 - int(S[-1]) / Q < 0.1                                    # 9.4 % of draws fail
    assert p_sampler <= p_exact < p_renormalised                              # only the first is sound
    J, failed = draw_J(200_000, sigma, seed=3, Q=Q)
    hit = ((J <= 19) & ~failed).double().mean().item()
    assert abs(hit - p_sampler) < 4 * math.sqrt(p_sampler * (1 - p_sampler) / 200_000)


def test_sample_counts_never_gives_a_failed_draw_to_any_class(monkeypatch):
    import functools
    small = functools.partial(common.sound_noisy_inputs, Q=2 ** 12)          # 9.4 % failures per coordinate
    monkeypatch.setattr(common, "sound_noisy_inputs", small)

    class Level(nn.Module):   # class 0 iff the single pixel's level is below 120: A of the test above
        def forward(self, z):
            below = (z.flatten(1)[:, :1] * 255).round() < 120
            return torch.cat([below.float(), (~below).float()], 1)
    x = torch.full((1, 1, 1), 100 / 255)
    n = 100_000
    counts = common.sample_counts(Level(), x.unsqueeze(0), 0.5, n, 10_000, 2,
                                  torch.Generator().manual_seed(0), common.sound_copies(255))[0]
    S, L = common.rounded_gaussian_table(0.5, 2 ** 12)
    assert counts.sum() < n                                                   # failed draws vote for no class
    assert abs(counts[0].item() / n - int(S[19 + L]) / 2 ** 12) < 4 * math.sqrt(0.25 / n)


def test_radius_closed_forms_are_unchanged():
    assert common.clopper_pearson_lower(100_000, 100_000, 0.001) == pytest.approx(0.001 ** 1e-5)
    assert common.certified_radius(common.clopper_pearson_lower(100_000, 100_000, 0.001), 1.0) == \
        pytest.approx(3.81146, abs=1e-5)
    assert common.certified_radius(common.clopper_pearson_lower(90_000, 100_000, 0.001), 1.0) == \
        pytest.approx(1.26484, abs=1e-5)


# ----------------------------------------------------------------------------------------------------------
# T8, T9: the 1-D attack (x = 0.8, adversarial x' = 0, sigma = 1)
# ----------------------------------------------------------------------------------------------------------

T_1D = 0.8 - norm.ppf(0.9)


def evidence_1d(z):
    """E(z) of SOUND.md §1 on float64 copies of fp32 values: low bits that a sum with x = fl(0.8) never has."""
    scaled = z * 2.0 ** 24
    on_grid = scaled == torch.round(scaled)
    odd = on_grid & (torch.remainder(torch.round(scaled), 2) == 1)
    return ((z.abs() < 0.25) & ~on_grid) | ((z > -0.5) & (z <= -0.25) & ~odd)


def class_A_1d(z):
    return ~evidence_1d(z) & (z > T_1D)


def test_the_1d_attack_gets_a_false_certificate_through_the_float_path():
    g, n = torch.Generator().manual_seed(0), 1_000_000
    x = torch.tensor(0.8, dtype=torch.float32)
    z_x = (x + torch.randn(n, generator=g)).double()                         # fl(x + fl(randn)), sigma = 1
    z_adv = (torch.tensor(0.0) + torch.randn(n, generator=g)).double()       # x' = 0, at distance 0.8
    assert not evidence_1d(z_x).any()
    p_x, p_adv = class_A_1d(z_x).double().mean().item(), class_A_1d(z_adv).double().mean().item()
    assert p_x >= 0.89 and p_adv <= 0.48
    assert p_adv < norm.cdf(norm.ppf(p_x - 4e-3) - 0.8)                      # Cohen's bound violated
    radius = common.certified_radius(common.clopper_pearson_lower(round(p_x * 100_000), 100_000, 0.001), 1.0)
    assert radius > 1.2                                                      # certified 1.26 > 0.8: false


def test_the_same_classifier_under_the_sound_sampler_keeps_cohens_bound():
    n, sigma = 300_000, 1.0
    g = torch.Generator().manual_seed(0)
    results = []
    for level in (204, 0):                                                   # x = 0.8 and x' = 0
        z, failed = common.sound_noisy_inputs(torch.tensor([level], dtype=torch.int32), n, sigma, g)
        results.append((class_A_1d(z[:, 0].double()) & ~failed[:, 0]).double().mean().item())
    p_x, p_adv = results
    se = math.sqrt(0.25 / n)
    assert p_adv >= norm.cdf(norm.ppf(p_x) - 0.8) - 4 * se


# ----------------------------------------------------------------------------------------------------------
# T10-T12: CIFAR-shaped attacks (d = 3072, sigma = 0.5)
# ----------------------------------------------------------------------------------------------------------

def binade(x):
    """e with x in [2^e, 2^(e+1)) for x > 0 (float64 of fp32 values)."""
    return torch.floor(torch.log2(x))


def adversarial_levels(a, m):
    """a' = a +- 1 on m pixels whose neighbouring level keeps the binade and is an odd number of ulps away."""
    x = (a.float() / 255).double().flatten()
    out = a.clone().flatten()
    chosen = 0
    for i in range(len(x)):
        for step in (1, -1):
            b = int(a.flatten()[i]) + step
            if chosen < m and 0 < b < 255 and int(a.flatten()[i]) > 0:
                xb = torch.tensor(b / 255, dtype=torch.float32).double()
                e = binade(x[i])
                ulp = 2.0 ** (e - 23)
                if binade(xb) == e and int(round(((xb - x[i]) / ulp).item())) % 2 == 1:
                    out[i] = b
                    chosen += 1
                    break
    assert chosen == m
    return out.view_as(a)


class PixelDetector(nn.Module):
    """B iff some pixel's noisy value lies in the exact-sum window of x and is off x's lattice (SOUND.md §1)."""

    def __init__(self, x):
        super().__init__()
        self.x = x.double().flatten()

    def forward(self, z):
        z, x = z.double().flatten(1), self.x
        e = binade(x.clamp(min=1e-30))
        window = (x > 0) & (z > -x) & (z < x - 2.0 ** (e + 1))
        step = 2.0 ** (e - 22)
        off = torch.remainder(z - x, step) != 0
        b = (window & off).any(1)
        return torch.stack([(~b).double(), b.double()], 1)


def float_path(x, n, sigma, g):
    return x.unsqueeze(0) + sigma * torch.randn((n, *x.shape), generator=g)


def sound_path(x, n, sigma, g):
    z, failed = common.sound_noisy_inputs(common.grid_levels(x).unsqueeze(0), n, sigma, g)
    assert not failed.any()
    return z[:, 0]


@pytest.fixture(scope="module")
def image_pair():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(1, 255, (3, 32, 32), generator=g, dtype=torch.int32)
    a_adv = adversarial_levels(a, 64)
    return a.float() / 255, a_adv.float() / 255


def test_pixel_detector_gets_a_false_certificate_through_the_float_path(image_pair):
    x, x_adv = image_pair
    f, g = PixelDetector(x), torch.Generator().manual_seed(1)
    distance = (x_adv - x).norm().item()
    assert distance == pytest.approx(8 / 255, rel=1e-5)                      # 64 pixels by one level: 0.0314
    p_x = f(float_path(x, 2000, 0.5, g))[:, 1].mean().item()
    p_adv = f(float_path(x_adv, 2000, 0.5, g))[:, 1].mean().item()
    assert p_x == 0 and p_adv >= 0.6                                          # the data-processing bound: 0.025
    out = certify.certify(f, x, 0.5, 100, 10_000, 0.001, 1000, 2, torch.Generator().manual_seed(2))
    assert out["predict"] == 0 and out["radius"] > 1.5 > distance             # a certificate that is false


def test_under_the_sound_sampler_every_detector_stays_within_the_data_processing_bound(image_pair):
    x, x_adv = image_pair
    n, sigma = 4000, 0.5
    delta = (x_adv - x).norm().item()
    bound = 2 * norm.cdf(delta / (2 * sigma)) - 1
    halfspace_dir = (x_adv - x).flatten() / delta

    def halfspace(z):   # the test that attains the bound: a half-space along delta
        b = (z.double().flatten(1) - x.double().flatten()) @ halfspace_dir.double() > delta / 2
        return torch.stack([(~b).double(), b.double()], 1)

    for name, f in (("pixel", PixelDetector(x)), ("halfspace", halfspace)):
        for cast in (False, True):                                          # bf16 after z: still sound
            g = torch.Generator().manual_seed(5)
            probs = []
            for point in (x, x_adv):
                z = sound_path(point, n, sigma, g)
                z = z.bfloat16().float() if cast else z
                probs.append(f(z)[:, 1].mean().item())
            se = math.sqrt(0.25 / n)
            assert abs(probs[0] - probs[1]) <= bound + 4 * se * math.sqrt(2), (name, cast, probs)


def test_a_fingerprint_detector_beats_a_float_re_addition_but_not_the_integer_route(image_pair):
    x, x_adv = image_pair
    a, a_adv = common.grid_levels(x), common.grid_levels(x_adv)
    a16 = a.clone().flatten()
    changed = (a_adv != a).flatten().nonzero().flatten()[:16]
    a16[changed] = a_adv.flatten()[changed]
    a16 = a16.view_as(a)                                                     # 16 pixels changed by one level

    def readd(levels, J):        # the authors' route (SOUND.md §2.5): fl(fl(c / 255) - (k + 1)) + fl(a / 255), k = 3
        c = J + 255 * 4                                                      # the noise as a count c >= 0
        return ((c.float() / 255) - 4) + (levels.float() / 255)             # a float addition of x: the gap

    def integer(levels, J):      # the sound route: integer sum, one conversion
        return (levels + J).float() / 255

    def fingerprint(z, route):   # knows x and the route: recovers a + J, recomputes what x gives, flags a mismatch
        J_seen = torch.round(z.double() * 255).int() - a
        return (z != route(a, J_seen)).flatten(1).any(1)

    g = torch.Generator().manual_seed(7)
    rates = {}
    for name, levels in (("x", a), ("adv", a16)):
        z_int, _ = common.sound_noisy_inputs(levels.unsqueeze(0), 500, 0.5, g)
        J = torch.round(z_int[:, 0].double() * 255).int() - levels
        assert torch.equal(z_int[:, 0], integer(levels, J))                  # the sampler is the integer route
        rates[name] = tuple(fingerprint(route(levels, J), route).double().mean().item() for route in (readd, integer))
    assert rates["x"] == (0.0, 0.0)
    assert rates["adv"][0] >= 0.95 and rates["adv"][1] == 0.0                  # power 1 vs none


# ----------------------------------------------------------------------------------------------------------
# T13: the sound and the float path agree on a trained model
# ----------------------------------------------------------------------------------------------------------

def test_sound_and_float_certification_agree_on_a_trained_digits_model():
    model = train_digits_model(steps=150)
    test = common.get_dataset("digits", "test")
    radii, n = [0.0, 0.25, 0.5], 120
    acc = {}
    for levels in (None, common.DATASET_LEVELS["digits"]):
        hits = np.zeros(len(radii))
        for idx in range(n):
            x, label = test[idx]
            out = certify.certify(model, x, 0.25, 50, 500, 0.001, 500, 10, common.example_generator(0, idx),
                                  certify.sampler_of(levels))
            hits += [(out["predict"] == label) and out["radius"] >= r for r in radii]
        acc[levels] = hits / n
    sound, plain = acc[common.DATASET_LEVELS["digits"]], acc[None]
    assert plain[0] > 0.6                                                    # a model worth comparing
    # the same examples certified twice with independent noise: within 4 standard errors of a difference
    assert np.all(np.abs(sound - plain) <= 4 * np.sqrt(2 * 0.25 / n)), (sound, plain)


def test_failure_mass_per_coordinate_is_the_flooring_loss_the_docs_give():
    """The share of integers past the last threshold (a failed draw) is what the floors leave: below one
    integer per bin, (2L + 1) / Q, and 2.5e-16 at sigma = 0.5 (docs/certification.md), 1.2e-16 at 0.25."""
    for sigma, expected in ((0.25, 1.2e-16), (0.5, 2.5e-16)):
        S, L = common.rounded_gaussian_table(sigma)
        fail = (common.SOUND_Q - int(S[-1])) / common.SOUND_Q
        assert 0 < fail < (2 * L + 1) / common.SOUND_Q and fail == pytest.approx(expected, rel=0.05)

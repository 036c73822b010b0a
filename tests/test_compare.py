"""analyze.py compare: intervals that carry the test sample, Monte Carlo and seed noise, calibrated on
synthetic logs whose truth is known, and on two real certifications of one digits model."""
import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest
from scipy.stats import t as student_t

import analyze
import compare
import certify
import common
import readers
from helpers import digits_checkpoint, run_main

N, ALPHA, SIGMA, RADII = 1000, 0.001, 0.5, [0.25, 0.5, 0.75, 1.0]
Z = compare.z_table(N, ALPHA)


def latent(rng, n):
    """Per-image probability of the true class under noise: hard inputs near 0, easy ones near 1, some between."""
    kind = rng.choice(3, size=n, p=[0.3, 0.4, 0.3])
    return np.select([kind == 0, kind == 1], [rng.beta(0.3, 5, n), rng.beta(5, 0.3, n)], rng.uniform(size=n))


def certify_log(rng, pY, path="sim.tsv"):
    """The log CERTIFY writes for images whose true class has probability pY: cA is the true label when
    pY > 1/2 (else another class with 80 % of the rest), votes from N draws, radius and abstention as CERTIFY."""
    n = len(pY)
    nY = rng.binomial(N, pY)
    right = pY > 0.5
    nA = np.where(right, nY, rng.binomial(N, 0.8 * (1 - pY)))
    z = Z[nA]
    predict = np.where(np.isfinite(z), np.where(right, 0, 1), -1)
    return {"path": path, "idx": np.arange(n), "y": np.zeros(n, dtype=np.int64), "predict": predict,
            "radius": np.where(np.isfinite(z), SIGMA * z, 0.0), "correct": predict == 0, "nA": nA,
            "N": np.full(n, N), "nY": nY, "sigma": SIGMA, "sidecar": {"alpha": ALPHA}, "grid": False}


def verdicts(a, b, over="images"):
    rows, facts = compare.compare_sides(a, b, RADII, 0.95, None if over == "images" else compare.test_set_votes())
    return {m: (d, lo, hi, v) for m, _, _, d, lo, hi, v in rows}, facts


def shifted(rng, pY, share):
    """B's latents: A's, except that `share` of all images, drawn among those with pY < 1/2, become easy."""
    hard = pY < 0.5
    flip = hard & (rng.uniform(size=len(pY)) < share / hard.mean())
    return np.where(flip, 0.999, pY)


def flag_rate(rng, sims, make_pair, over):
    """The share of simulated pairs with any row not `within noise`."""
    flagged = 0
    for s in range(sims):
        a, b = make_pair()
        rows, _ = verdicts([a], [b], over=over)
        flagged += any(v != "within noise" for *_, v in rows.values())
    return flagged / sims


NOMINAL = lambda sims: 0.05 + 3 * np.sqrt(0.05 * 0.95 / sims)   # family-wise 5 %, plus 3 simulation errors


# ---- the building blocks against closed forms and published numbers ----

def test_wilson_and_newcombe_match_newcombes_published_examples():
    z = 1.959964
    # Newcombe (1998), single proportion 81/263: Wilson 0.2553 to 0.3662
    assert common.wilson(81 / 263, 263, z) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    # Newcombe (1998), independent proportions 56/70 - 48/80, method 10 (hybrid score): 0.0524 to 0.3339
    assert common.newcombe_interval(48 / 80, 80, 56 / 70, 70, z) == pytest.approx((0.0524, 0.3339), abs=1e-4)


def test_tango_interval_is_the_set_where_the_score_statistic_stays_within_z():
    """The closed-form constrained MLE against a numerical maximisation of the paired multinomial likelihood,
    and the ends where |score| = z; with no discordant pair the interval is +-z^2 / (n + z^2), never [0, 0]."""
    from scipy.optimize import minimize_scalar
    z = 2.5
    for x12, x21, n in ((0, 0, 500), (3, 0, 500), (12, 5, 44), (40, 90, 300), (7, 7, 60), (60, 0, 60)):
        low, high = common.tango_interval(x12, x21, n, z)
        assert -1 <= low <= (x12 - x21) / n <= high <= 1

        def score(delta):      # numerical MLE of p21 under p12 - p21 = delta
            lo, hi = max(0.0, -delta) + 1e-12, (1 - delta) / 2 - 1e-12
            nll = lambda p: -(x12 * np.log(p + delta) + x21 * np.log(p) + (n - x12 - x21) * np.log(1 - 2 * p - delta))
            p = minimize_scalar(nll, bounds=(lo, hi), method="bounded", options={"xatol": 1e-13}).x
            return (x12 - x21 - n * delta) / np.sqrt(n * (2 * p + delta * (1 - delta)))
        for end, target in ((low, z), (high, -z)):
            if -1 < end < 1:
                assert score(end) == pytest.approx(target, abs=2e-3), (x12, x21, n, end)
    assert common.tango_interval(0, 0, 500, z) == pytest.approx((-z * z / (500 + z * z), z * z / (500 + z * z)))


def test_satterthwaite_degrees_of_freedom():
    assert compare.satterthwaite([(1.0, 4), (1.0, 4)]) == pytest.approx(8)      # two equal terms add up
    assert compare.satterthwaite([(1.0, 1), (0.0, 1)]) == pytest.approx(1)
    assert compare.satterthwaite([(1.0, np.inf)]) == np.inf
    # never below the smallest term's degrees of freedom
    assert compare.satterthwaite([(0.3, 1), (2.0, 499), (0.5, 2)]) >= 1


def test_seed_layout_separates_the_seed_spread_from_the_interaction():
    """k seeds x n images = seed effect + image effect + interaction: s^2 / k of the seed means, with the
    interaction's share sigma_c^2 / (n k) read off the residual mean square."""
    rng = np.random.default_rng(0)
    k, n, tau, omega = 5, 4000, 0.3, 1.0
    reps = [compare.seed_layout(rng.normal(0, tau, (k, 1)) + rng.normal(0, 1, (1, n)) + rng.normal(0, omega, (k, n)))
            for _ in range(300)]
    e, df, c = np.mean(reps, axis=0)
    assert df == k - 1
    assert e == pytest.approx((tau ** 2 + omega ** 2 / n) / k, rel=0.12)
    assert c == pytest.approx(omega ** 2 / (n * k), rel=0.02)
    assert compare.seed_layout(np.zeros((1, 10))) == (0.0, 0, 0.0)


def pooled_satterthwaite(fa, fb, a):
    """The construction the seed interval does not use: one t at the pooled Welch-Satterthwaite df."""
    (ea, dfa, ca), (eb, dfb, cb) = compare.seed_layout(fa), compare.seed_layout(fb)
    ma, mb = fa.mean(0), fb.mean(0)
    terms = [(max(np.var(mb - ma, ddof=1) / len(ma) - ca - cb, 0), len(ma) - 1), (ea, dfa), (eb, dfb)]
    half = student_t.isf(a / 2, compare.satterthwaite(terms)) * np.sqrt(sum(v for v, _ in terms))
    return fb.mean() - fa.mean() - half, fb.mean() - fa.mean() + half


@pytest.mark.parametrize("k", [2, 3, 5])
def test_the_seed_interval_keeps_its_error_where_a_pooled_satterthwaite_t_does_not(k):
    """Normal seed effects (variance 1), each side's own image effects (their part of the variance half the
    seeds') and interaction: the row's interval at a Bonferroni-sized error a misses the true difference 0 at
    most at rate a (plus simulation error); one pooled Welch-Satterthwaite t misses 3.7x as often at k = 2."""
    rng = np.random.default_rng(k)
    a, reps, n = 0.05 / 11, 6_000, 100
    misses = pooled = 0
    for _ in range(reps):
        fa = rng.normal(0, 1, (k, 1)) + rng.normal(0, 0.5 * np.sqrt(n / k), n) + rng.normal(0, 1, (k, n))
        fb = rng.normal(0, 1, (k, 1)) + rng.normal(0, 0.5 * np.sqrt(n / k), n) + rng.normal(0, 1, (k, n))
        d, lo, hi, _ = compare.row_interval(fa, fb, False, True, a)
        misses += not lo <= 0 <= hi
        lo, hi = pooled_satterthwaite(fa, fb, a)
        pooled += not lo <= 0 <= hi
    bound = a + 3 * np.sqrt(a / reps)
    assert misses / reps <= bound, misses
    if k == 2:
        assert pooled / reps > bound, pooled        # the harness can fail


# ---- calibration: false alarms, coverage, power (tools/compare_calibration.py runs the long version) ----

@pytest.mark.parametrize("scenario", ["independent models", "one model certified twice"])
def test_over_images_two_sides_from_one_distribution_are_within_noise_at_the_nominal_rate(scenario):
    rng = np.random.default_rng(1)

    def pair():
        pY = latent(rng, 500)
        return certify_log(rng, pY), certify_log(rng, latent(rng, 500) if scenario[0] == "i" else pY)
    assert flag_rate(rng, 150, pair, "images") <= NOMINAL(150)


def test_over_test_set_one_model_certified_twice_is_within_noise_at_the_nominal_rate():
    rng = np.random.default_rng(2)
    pY = latent(rng, 500)                 # the test set stays; only the votes differ
    assert flag_rate(rng, 60, lambda: (certify_log(rng, pY), certify_log(rng, pY)), "test-set") <= NOMINAL(60)


def test_the_fast_calibration_holds_its_targets_and_a_too_narrow_interval_is_caught(monkeypatch):
    """tools/compare_calibration.py in short: a rare-row scenario and a seed scenario keep the family-wise
    error and the simultaneous coverage; the same harness flags intervals shrunk to 40 % (it can fail)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import compare_calibration as cal
    runs = 60
    for name in ("mostly-one paired (rare rows)", "cifar paired, 3 seeds"):
        r = cal.run_scenario(name, cal.SCENARIOS[name], runs, 0)
        assert r["null"]["any_flag"] / runs <= NOMINAL(runs), name
        assert 1 - r["alternative"]["any_miss"] / runs >= 0.95 - 3 * np.sqrt(0.05 * 0.95 / runs), name
    real = compare.row_interval

    def narrow(*args, **kwargs):
        d, lo, hi, c = real(*args, **kwargs)
        return d, d - 0.4 * (d - lo), d + 0.4 * (hi - d), c
    monkeypatch.setattr(compare, "row_interval", narrow)
    r = cal.run_scenario("cifar paired", cal.SCENARIOS["cifar paired"], 40, 0)
    assert 1 - r["alternative"]["any_miss"] / 40 < 0.8


def test_a_row_without_discordant_images_gets_an_interval_of_positive_width():
    """P(pA<0.1) with no image below 0.1 on either side: Tango's interval, not [0, 0]."""
    rng = np.random.default_rng(8)
    pY = np.clip(latent(rng, 500), 0.3, 1)
    rows, _ = verdicts([certify_log(rng, pY)], [certify_log(rng, pY)])
    d, lo, hi, v = rows["P(pA<0.1)"]
    assert d == 0 and lo < -0.005 and hi > 0.005 and v == "within noise"


def test_a_log_against_itself_gets_intervals_of_positive_width_in_every_row():
    """No image differs, in any row (ACR included): every interval still has positive width around 0."""
    rng = np.random.default_rng(13)
    log = certify_log(rng, latent(rng, 500))
    rows, _ = verdicts([log], [log])
    assert rows and all(d == 0 and lo < 0 < hi and v == "within noise" for d, lo, hi, v in rows.values())
    assert rows["ACR"][2] > 0.001


def test_logs_that_share_one_image_are_refused_in_one_line(tmp_path, capsys):
    rng = np.random.default_rng(14)
    a, b = certify_log(rng, latent(rng, 1), "a.tsv"), certify_log(rng, latent(rng, 1), "b.tsv")
    a2, b2 = dict(a, radius=a["radius"] + 1e-3, path="a2.tsv"), dict(b, radius=b["radius"] + 1e-3, path="b2.tsv")
    with pytest.raises(common.UserError, match="at least 2"):
        compare.compare_sides([a, a2], [b, b2], RADII)
    b["idx"] = b["idx"] + 5
    with pytest.raises(common.UserError, match="at least 2"):
        compare.compare_sides([a], [b], RADII)


def test_over_test_set_the_band_covers_the_expectation_on_these_images():
    rng = np.random.default_rng(7)
    pY = latent(rng, 500)
    pB = shifted(rng, pY, 0.05)
    truth = {}
    for _ in range(300):                  # the expectation on these images: the mean over many certifications
        rows, _ = compare.compare_sides([certify_log(rng, pY)], [certify_log(rng, pB)], RADII, 0.95)
        for m, _, _, d, *_ in rows:
            truth[m] = truth.get(m, 0) + d / 300
    sims, covered = 60, 0
    for s in range(sims):
        rows, _ = verdicts([certify_log(rng, pY)], [certify_log(rng, pB)], over="test-set")
        covered += all(lo <= truth[m] <= hi for m, (d, lo, hi, v) in rows.items() if m in truth)
    assert covered / sims >= 0.95 - 3 * np.sqrt(0.05 * 0.95 / sims), covered


def population_truth(rng, share, n=200_000):
    """The expected difference of every metric under the shift (a population of n images, one count each)."""
    pY = latent(rng, n)
    rows, _ = compare.compare_sides([certify_log(rng, pY)], [certify_log(rng, shifted(rng, pY, share))], RADII)
    return {m: d for m, _, _, d, *_ in rows}


def test_a_five_point_shift_is_found_and_the_band_covers_the_truth():
    rng = np.random.default_rng(3)
    truth = population_truth(rng, 0.05)
    assert truth["clean accuracy"] == pytest.approx(0.05, abs=0.005)
    sims, found, covered = 150, 0, 0
    for s in range(sims):
        pY = latent(rng, 500)
        rows, _ = verdicts([certify_log(rng, pY)], [certify_log(rng, shifted(rng, pY, 0.05))])
        found += rows["clean accuracy"][3] == "higher"
        covered += all(lo <= truth[m] <= hi for m, (d, lo, hi, v) in rows.items() if m in truth)
    power = found / sims
    print(f"power at +5 points of clean accuracy on 500 images (paired): {power:.2f}")
    assert power >= 0.8
    assert covered / sims >= 0.95 - 3 * np.sqrt(0.05 * 0.95 / sims), covered


def test_training_seeds_widen_the_interval_and_one_seed_is_called_a_statement_about_models():
    rng = np.random.default_rng(4)
    pY = latent(rng, 500)
    # three seeds whose models differ: each seed moves 0-8 % of the hard images to easy
    a = [certify_log(rng, shifted(rng, pY, share)) for share in (0.0, 0.04, 0.08)]
    b = [certify_log(rng, shifted(rng, pY, share)) for share in (0.0, 0.04, 0.08)]
    many, facts = verdicts(a, b)
    one, facts1 = verdicts(a[:1], b[2:])
    assert facts["seeds"] == ({SIGMA: 3}, {SIGMA: 3}) and facts1["seeds"] == ({SIGMA: 1}, {SIGMA: 1})
    width = lambda rows, m: rows[m][2] - rows[m][1]
    # the seed spread is real here: with it, the interval of three against three is wider than one against one
    only_one = verdicts(a[1:2], b[1:2])[0]
    assert width(many, "clean accuracy") > width(only_one, "clean accuracy")
    assert facts["critical"] > facts["z"]             # t with the seeds' few degrees of freedom
    text = compare.compare_words(list((m, 0, 0, *v) for m, v in one.items()), facts1, ["a", "b"], 0.95)
    assert "about these models, not their training methods" in text
    text = compare.compare_words(list((m, 0, 0, *v) for m, v in many.items()), facts, ["a", "b"], 0.95)
    assert "Welch-Satterthwaite" in text


def test_two_seeds_a_side_say_that_few_seeds_conclude_little():
    rng = np.random.default_rng(9)
    pY = latent(rng, 500)
    a = [certify_log(rng, shifted(rng, pY, share)) for share in (0.0, 0.08)]
    b = [certify_log(rng, shifted(rng, pY, share)) for share in (0.02, 0.06)]
    rows, facts = verdicts(a, b)
    assert facts["critical"] > 2 * facts["z"]
    assert "Few seeds" in compare.compare_words([(m, 0, 0, *v) for m, v in rows.items()], facts, ["a", "b"], 0.95)


def test_unpaired_logs_are_compared_apart_and_say_so():
    rng = np.random.default_rng(5)
    a, b = certify_log(rng, latent(rng, 300)), certify_log(rng, latent(rng, 400))
    b["idx"] = b["idx"] + 1000
    rows, facts = verdicts([a], [b])
    assert not facts["paired"] and facts["n"] == {"A": 300, "B": 400}
    assert "Unpaired" in compare.compare_words([(m, 0, 0, *v) for m, v in rows.items()], facts, ["a", "b"], 0.95)


def test_a_missing_or_relabelled_row_keeps_the_pairing_and_is_counted(tmp_path, capsys):
    """One row fewer in B and one relabelled: paired over the 498 images both have, two rows reported as left
    out (one warning line), and the intervals stay those of a paired comparison."""
    rng = np.random.default_rng(10)
    pY = latent(rng, 500)
    a, b = certify_log(rng, pY, "a.tsv"), certify_log(rng, shifted(rng, pY, 0.05), "b.tsv")
    full, _ = verdicts([a], [b])
    cut = {k: (v[1:] if isinstance(v, np.ndarray) else v) for k, v in b.items()}
    cut["y"] = cut["y"].copy()
    cut["y"][0] = 7                               # idx 1 relabelled
    rows, facts = verdicts([a], [cut])
    assert facts["paired"] and facts["n"] == 498 and facts["left"] == {"a.tsv": 2, "b.tsv": 1}
    width = lambda r: r["clean accuracy"][2] - r["clean accuracy"][1]
    assert width(rows) == pytest.approx(width(full), rel=0.1)
    compare.compare_report([a], [cut], ["a", "b"], RADII, 0.95, "images", str(tmp_path))
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "3 rows of 2 logs" in err
    assert "are left out" in (tmp_path / "compare.md").read_text()


def write_log(path, log, sidecar=None, counts=True):
    """A certification TSV of a simulated log (Cohen's columns, and nA N nY when counts) and its sidecar."""
    head = "idx\tlabel\tpredict\tradius\tcorrect\ttime" + ("\tnA\tN\tnY" if counts else "")
    lines = [head] + [f"{i}\t0\t{p}\t{r:.6g}\t{int(c)}\t0:00:00" + (f"\t{na}\t{N}\t{ny}" if counts else "")
                      for i, p, r, c, na, ny in zip(log["idx"], log["predict"], log["radius"], log["correct"],
                                                    log["nA"], log["nY"])]
    path.write_text("\n".join(lines) + "\n")
    if sidecar is not None:
        (path.parent / (path.name + ".json")).write_text(sidecar)
    return path


def test_over_test_set_needs_the_budget_and_refuses_logs_without_one(tmp_path, capsys):
    rng = np.random.default_rng(11)
    pY = latent(rng, 200)
    a = write_log(tmp_path / "a.tsv", certify_log(rng, pY), counts=False)
    b = write_log(tmp_path / "b.tsv", certify_log(rng, pY), counts=False)
    flags = ["compare", a, b, "--out", tmp_path / "o", "--over", "test-set", "--radii", 0.25, "--sigmas", SIGMA, SIGMA]
    assert run_main(analyze.main, flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "N unknown" in err[0] and "--N" in err[0]
    assert run_main(analyze.main, flags + ["--N", N]) == 2
    assert "alpha unknown" in capsys.readouterr().err
    assert run_main(analyze.main, flags + ["--N", N, "--alpha", ALPHA]) == 0
    assert "abstention in a log without nA" not in (tmp_path / "o" / "compare.md").read_text()
    # a flag that contradicts the sidecar is refused
    c = write_log(tmp_path / "c.tsv", certify_log(rng, pY), sidecar=f'{{"N": {N}, "alpha": {ALPHA}, "sigma": {SIGMA}}}')
    d = write_log(tmp_path / "d.tsv", certify_log(rng, pY), sidecar=f'{{"N": {N}, "alpha": {ALPHA}, "sigma": {SIGMA}}}')
    assert run_main(analyze.main, ["compare", c, d, "--over", "test-set", "--alpha", 0.01]) == 2
    assert "certified with alpha = 0.001" in capsys.readouterr().err
    assert run_main(analyze.main, ["compare", c, d, "--over", "test-set"]) == 0


def test_command_writes_tsv_and_md_and_handles_grid_logs(tmp_path, capsys):
    rng = np.random.default_rng(6)
    paths = [write_log(tmp_path / f"{name}.tsv", certify_log(rng, latent(rng, 200)),
                       sidecar=f'{{"N": {N}, "alpha": {ALPHA}, "sigma": {SIGMA}}}') for name in ("a", "b")]
    assert run_main(analyze.main, ["compare", *paths, "--out", tmp_path / "out"]) == 0
    header, *rows = (tmp_path / "out" / "compare.tsv").read_text().splitlines()
    assert header.split("\t") == ["metric", "a", "b", "diff", "low", "high", "verdict"]
    for row in rows:
        m, a, b, d, lo, hi, v = row.split("\t")
        assert float(lo) < float(d) < float(hi) or (float(lo) < float(hi) and m.startswith("P("))
        assert v == ("higher" if float(lo) > 0 else "lower" if float(hi) < 0 else "within noise")
        assert float(d) == pytest.approx(float(b) - float(a), abs=1e-5)
    assert any(r.startswith("ACR\t") for r in rows)
    assert "Paired over the 200 images" in (tmp_path / "out" / "compare.md").read_text()
    first = (tmp_path / "out" / "compare.tsv").read_bytes()          # deterministic: no resampling
    assert run_main(analyze.main, ["compare", *paths, "--out", tmp_path / "out"]) == 0
    assert (tmp_path / "out" / "compare.tsv").read_bytes() == first
    # grid logs (certify.py --radii): no ACR row and no pA rows over images; no votes to redraw over the test set
    grid = []
    for path in paths:
        lines = path.read_text().splitlines()
        grid.append(tmp_path / f"grid_{path.name}")
        grid[-1].write_text("\n".join([lines[0].replace("nY", "pA_lower\tpA_upper\tstop")] +
                                      [line.rsplit("\t", 1)[0] + "\t0.5\t1\tdecided" for line in lines[1:]]) + "\n")
    assert run_main(analyze.main, ["compare", *grid, "--out", tmp_path / "images"]) == 0
    metrics = [r.split("\t")[0] for r in (tmp_path / "images" / "compare.tsv").read_text().splitlines()[1:]]
    assert "clean accuracy" in metrics and "ACR" not in metrics and not any("pA" in m for m in metrics)
    capsys.readouterr()
    assert run_main(analyze.main, ["compare", *grid, "--over", "test-set"]) == 2
    assert "grid log" in capsys.readouterr().err
    assert run_main(analyze.main, ["compare", paths[0]]) == 2
    assert run_main(analyze.main, ["compare", *paths, "--level", 1.5]) == 2


def test_ecdf_dominance_carries_the_two_sample_band(tmp_path):
    """Two certifications of one model are not told apart; a model with 15 % of its images moved to pA = 1 is
    above beyond noise; the band is the sum of two DKW half-widths at the curves' shared level."""
    rng = np.random.default_rng(12)
    pY = latent(rng, 500)
    logs = {"one": certify_log(rng, pY), "twice": certify_log(rng, pY), "easier": certify_log(rng, shifted(rng, pY, 0.15))}
    for name, log in logs.items():
        log["label"], log["path"] = name, f"{name}.tsv"
        log["pA"] = np.where(log["correct"], log["nA"] / log["N"], -np.inf)
        log["ecdf"] = analyze.ecdf(log["pA"], analyze.ECDF_GRID)
    mask = analyze.ECDF_GRID <= 0.99 + 1e-12
    lines = analyze.two_sample_words(list(logs.values()), [("twice", "one"), ("easier", "one")], mask)
    assert "not told apart" in lines[0]
    assert "easier above one beyond noise" in lines[1]
    eps = analyze.two_sample_halfwidth(500, 500, 3)
    assert eps == pytest.approx(2 * np.sqrt(np.log(2 / (0.05 / 3)) / 1000))
    assert f"±{eps:.3f}" in lines[0]


@pytest.fixture(scope="module")
def digits_logs(tmp_path_factory):
    """A digits model certified twice with two noise seeds, and a barely trained one (20 steps), on every
    second test digit (180)."""
    tmp = tmp_path_factory.mktemp("digits")
    good = digits_checkpoint(tmp / "good.pth.tar", steps=300)
    weak = digits_checkpoint(tmp / "weak.pth.tar", steps=20)
    logs = {}
    for name, ckpt, seed in (("seed0", good, 0), ("seed1", good, 1), ("weak", weak, 0)):
        logs[name] = tmp / f"{name}.tsv"
        flags = ["--checkpoint", ckpt, "--N0", 100, "--N", 1000, "--alpha", ALPHA, "--device", "cpu",
                 "--seed", seed, "--skip", 2, "--outfile", logs[name]]
        assert run_main(certify.main, flags) == 0
    return logs


@pytest.mark.parametrize("over", compare.COMPARE_OVER)
def test_one_digits_model_certified_with_two_seeds_is_within_noise(digits_logs, over):
    logs = analyze.load_logs([str(digits_logs["seed0"]), str(digits_logs["seed1"])])
    votes = None if over == "images" else compare.test_set_votes()
    rows, facts = compare.compare_sides(logs[:1], logs[1:], analyze.DEFAULT_RADII[1:], 0.95, votes)
    assert facts["paired"]
    flagged = [m for m, *_, v in rows if v != "within noise"]
    assert len(flagged) <= 1, flagged


def test_a_log_beside_another_runs_settings_file_is_refused_not_credited_to_its_model(digits_logs, tmp_path):
    import shutil
    shutil.copy(digits_logs["weak"], tmp_path / "x.tsv")                 # the weak model's lines ...
    shutil.copy(str(digits_logs["seed0"]) + ".json", tmp_path / "x.tsv.json")   # ... beside the good one's record
    with pytest.raises(common.UserError, match="or not the log .* describes"):
        analyze.load_logs([str(tmp_path / "x.tsv")])
    shutil.copy(digits_logs["seed0"], tmp_path / "x.tsv")                # its own lines: read, and credited
    assert analyze.load_logs([str(tmp_path / "x.tsv")])[0]["sidecar"]["checkpoint_sha256"]


def test_a_barely_trained_digits_model_has_lower_clean_accuracy_beyond_noise(digits_logs):
    logs = analyze.load_logs([str(digits_logs["seed0"]), str(digits_logs["weak"])])
    rows, _ = compare.compare_sides(logs[:1], logs[1:], analyze.DEFAULT_RADII[1:], 0.95)
    clean = next(r for r in rows if r[0] == "clean accuracy")
    assert clean[-1] == "lower", clean


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compare_cpu_commands():
    """The analyze.py commands scripts/compare_cpu.sh runs (its dry run prints them), as argument lists."""
    dry = subprocess.run(["bash", "scripts/compare_cpu.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, DRY_RUN="1", PYTHON=sys.executable))
    assert dry.returncode == 0, dry.stderr
    return [shlex.split(line[2:]) for line in dry.stdout.splitlines() if line.startswith("+ ")]


COMPARE_CPU = compare_cpu_commands()


def test_compare_cpu_sh_compares_every_experiment():
    assert len([a for a in COMPARE_CPU if a[2] == "compare"]) == 2 + 5 + 16 + 7   # ours (seeds paired, unpaired),
    # Figure 3, Table 5, DDRS


@pytest.mark.parametrize("argv", COMPARE_CPU, ids=[a[a.index("--out") + 1] for a in COMPARE_CPU])
def test_each_committed_compare_folder_is_the_output_of_compare_cpu_sh(argv, tmp_path):
    """Every table and report under each folder scripts/compare_cpu.sh writes: its command gives the same bytes,
    so no committed verdict lags the code."""
    folder = argv[argv.index("--out") + 1]
    argv = [str(tmp_path) if a == folder else os.path.join(ROOT, a) if a.startswith("results/") else a
            for a in argv]
    assert run_main(analyze.main, argv[2:]) == 0
    names = [n for n in os.listdir(os.path.join(ROOT, folder)) if n.endswith((".md", ".tsv", ".tex"))]
    assert names
    for name in names:
        with open(os.path.join(ROOT, folder, name)) as f:
            assert (tmp_path / name).read_text() == f.read(), name


@pytest.mark.parametrize("sigma, radii", [("0.25", ["0.25", "0.5", "0.75"]),
                                          ("0.5", ["0.25", "0.5", "0.75", "1", "1.25", "1.5", "1.75"])])
def test_the_committed_grid_against_certify_comparison_is_compare_output(tmp_path, sigma, radii):
    """results/grid_cpu/independent/sigma<S>/compare_grid (docs/speed.md): the command in results/grid_cpu/README.md."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folder = os.path.join(root, "results", "grid_cpu", "independent", f"sigma{sigma}")
    argv = ["compare", os.path.join(folder, "certify_N100000.tsv"), os.path.join(folder, "grid.tsv"), "--radii",
            *radii, "--labels", "CERTIFY", "grid", "--out", tmp_path]
    assert run_main(analyze.main, argv) == 0
    for name in ("compare.md", "compare.tsv"):
        with open(os.path.join(folder, "compare_grid", name)) as f:
            assert (tmp_path / name).read_text() == f.read(), name


# ---- the claim family: Holm's step-down on the rows the user declares, the rest exploratory --------------------

FAMILY = ["ACR", "P(pA≥0.99)", "P(pA<0.5)", "clean accuracy"]


def test_holm_rejects_in_order_and_stops_at_the_first_that_fails():
    assert compare.holm([0.01, 0.04, 0.03, 0.005], 0.05) == {3, 0}          # 0.005 <= .0125, .01 <= .0167, .03 > .025
    assert compare.holm([0.001, 0.012, 0.02, 0.04], 0.05) == {0, 1, 2, 3}   # each under 0.05 / (4 - k)
    assert compare.holm([0.2, 0.001], 0.05) == {1}
    assert compare.holm([], 0.05) == set()


def test_a_row_pvalue_is_where_its_own_interval_first_excludes_zero():
    rng = np.random.default_rng(21)
    pY = latent(rng, 400)
    a, b = certify_log(rng, pY, "a.tsv"), certify_log(rng, np.clip(pY + 0.002, 0, 1), "b.tsv")
    fa, fb = (np.stack([compare.image_values(x, RADII, True, True)["ACR"]]) for x in (a, b))
    interval = lambda err: compare.row_interval(fa, fb, False, True, err)[1:3]
    p = compare.row_pvalue(interval)
    assert 1e-12 < p < 0.05
    lo, hi = interval(p * 1.01)
    assert lo > 0 or hi < 0
    lo, hi = interval(p * 0.99)
    assert lo <= 0 <= hi


def test_a_declared_family_spends_the_error_on_its_rows_alone_and_marks_the_rest_exploratory():
    rng = np.random.default_rng(22)
    pY = latent(rng, 500)
    a, b = certify_log(rng, pY, "a.tsv"), certify_log(rng, np.clip(pY + 0.05, 0, 1), "b.tsv")
    everything, facts_all = compare.compare_sides([a], [b], RADII, 0.95)
    claimed, facts = compare.compare_sides([a], [b], RADII, 0.95, family=FAMILY)
    assert facts["m"] == 4 and facts_all["m"] == len(facts_all["roles"]) > 4
    assert {m for m, r in facts["roles"].items() if r == "claim"} == set(FAMILY)
    width = lambda rows: {m: hi - lo for m, _, _, _, lo, hi, _ in rows}
    w_all, w_claim = width(everything), width(claimed)
    for m in w_claim:   # claim rows: Bonferroni over 4, narrower than over every row; exploratory: one row's level
        assert w_claim[m] < w_all[m], m
    assert set(facts["pvalues"]) == set(FAMILY)
    for m, *_, v in claimed:   # a claim verdict is Holm's on the rows' p-values
        if m in FAMILY:
            rejected = {FAMILY[i] for i in compare.holm([facts["pvalues"][f] for f in FAMILY], 0.05)}
            assert (v != "within noise") == (m in rejected), m


def test_an_unknown_family_row_and_the_same_log_twice_are_refused():
    rng = np.random.default_rng(23)
    a, b = certify_log(rng, latent(rng, 50), "a.tsv"), certify_log(rng, latent(rng, 50), "b.tsv")
    with pytest.raises(common.UserError, match="--family names rows"):
        compare.compare_sides([a], [b], RADII, family=["ACR", "accuracy"])
    with pytest.raises(common.UserError, match="same log twice"):
        compare.compare_sides([a, dict(a, path="copy.tsv")], [b, certify_log(rng, latent(rng, 50))], RADII)


def test_intervals_never_reach_past_what_a_row_can_take():
    """Two seeds a side: t at 1-2 degrees of freedom at level 0.05 / rows made intervals many times [-1, 1]."""
    rng = np.random.default_rng(24)
    pY = latent(rng, 300)
    side = lambda shift, k: [certify_log(rng, np.clip(pY + shift + rng.normal(0, 0.1), 0, 1), f"s{shift}{j}.tsv")
                             for j in range(k)]
    rows, facts = compare.compare_sides(side(0.0, 2), side(0.05, 2), RADII, 0.95)
    ceiling = SIGMA * float(analyze.ndtri(ALPHA ** (1 / N)))
    for m, _, _, d, lo, hi, _ in rows:
        bound = ceiling if m == "ACR" else 1.0
        assert -bound - 1e-12 <= lo <= d <= hi <= bound + 1e-12, m
    assert facts["clamped"]   # the case that needed it


def test_test_set_rows_that_cannot_change_are_fixed_and_grid_radii_never_decided_are_left_out(tmp_path):
    rng = np.random.default_rng(25)
    pY = np.where(rng.uniform(size=200) < 0.5, 0.0, 1.0)   # every vote certain: no row can change
    a, b = certify_log(rng, pY, "a.tsv"), certify_log(rng, pY[::-1].copy(), "b.tsv")
    rows, facts = compare.compare_sides([a], [b], RADII, 0.95, compare.test_set_votes())
    verdict = {m: v for m, *_, v in rows}
    assert verdict["clean accuracy"] == "fixed"
    grid = dict(b, grid=True, sidecar={"alpha": ALPHA, "radii": [0.0, 0.25, 0.5]})
    rows, facts = compare.compare_sides([dict(a, grid=True, sidecar={"alpha": ALPHA, "radii": [0.0, 0.25, 0.5]})],
                                        [grid], RADII, 0.95)
    assert facts["undecided"] == [0.75, 1.0] and not [m for m, *_ in rows if "r=0.75" in m or "r=1" in m]


def test_a_sigma_on_one_side_only_is_said(tmp_path):
    rng = np.random.default_rng(26)
    a = certify_log(rng, latent(rng, 100), "a.tsv")
    b = certify_log(rng, latent(rng, 100), "b.tsv")
    extra = dict(certify_log(rng, latent(rng, 100), "b1.tsv"), sigma=1.0)
    _, facts = compare.compare_sides([a], [b, extra], RADII, 0.95)
    assert facts["one_side"] == ["1.0"]


def sigma_log(rng, pY, sigma, path):
    """certify_log's log as if certified at `sigma`: the same votes, radius sigma Phi^-1(pA_lower)."""
    log = certify_log(rng, pY, path)
    return dict(log, sigma=sigma, radius=log["radius"] * sigma / SIGMA)


def test_best_over_sigma_takes_each_sides_own_sigmas_and_covers_the_truth():
    """Sides certified at different sigmas (A: 0.25, 0.5; B: 0.5, 1.0): the best-over-sigma row is max over B's
    own sigmas minus max over A's own, not over the shared 0.5 alone, and its interval covers the population's
    value; the report says so."""
    rng = np.random.default_rng(31)
    sides = lambda pY, n: ([sigma_log(rng, pY, s, f"a{s}_{n}.tsv") for s in (0.25, 0.5)],   # noqa: E731
                           [sigma_log(rng, shifted(rng, pY, 0.05), s, f"b{s}_{n}.tsv") for s in (0.5, 1.0)])
    big = sides(latent(rng, 100_000), "pop")
    acc = lambda log, r: float(np.mean(log["correct"] & (log["radius"] >= r)))   # noqa: E731
    truth = {f"best over σ r={r:g}": max(acc(b, r) for b in big[1]) - max(acc(a, r) for a in big[0]) for r in RADII}
    assert truth["best over σ r=1"] > 0.05   # B's sigma 1.0 certifies far more at r = 1 than anything of A's
    sims, covered = 60, 0
    for k in range(sims):
        a, b = sides(latent(rng, 300), k)
        rows, facts = compare.compare_sides(a, b, RADII, 0.95)
        best = {m: (va, vb, lo, hi) for m, va, vb, d, lo, hi, v in rows if m.startswith("best over σ")}
        assert set(best) <= set(truth) and best
        for m, (va, vb, lo, hi) in best.items():
            r = float(m.split("r=")[1])
            assert va == max(acc(x, r) for x in a) and vb == max(acc(x, r) for x in b)
        covered += all(lo <= truth[m] <= hi for m, (_, _, lo, hi) in best.items())
    assert covered / sims >= 0.95 - 3 * np.sqrt(0.05 * 0.95 / sims), covered
    assert facts["one_side"] == ["0.25", "1.0"]
    assert "over each side's own σ" in compare.compare_words(rows, facts, ("A", "B"), 0.95)
    _, facts = compare.compare_sides(a, b, RADII, 0.95, family=["ACR"])   # not in the claim: exploratory
    assert {facts["roles"][m] for m in facts["roles"] if m.startswith("best over σ")} == {"exploratory"}


# ---- logs that do not measure the same thing: refused, or compared with what differs said ---------------------

def setting_log(path, rng, pY, counts=True, **setting):
    """A simulated CERTIFY log at N, ALPHA, SIGMA with a sidecar of `setting` over those (None: a field left out)."""
    side = {k: v for k, v in {**dict(N=N, alpha=ALPHA, sigma=SIGMA, mode="certify", split="test", dataset="cifar10"),
                              **setting}.items() if v is not None}
    return write_log(path, certify_log(rng, pY), sidecar=json.dumps(side), counts=counts)


def as_grid(path, radii):
    """The log at `path` rewritten as certify.py --radii writes it (stop column, no nY), at the grid `radii`."""
    lines = path.read_text().splitlines()
    grid = path.with_name(f"grid_{path.name}")
    grid.write_text("\n".join([lines[0].replace("nY", "pA_lower\tpA_upper\tstop")] +
                              [line.rsplit("\t", 1)[0] + "\t0.5\t1\tdecided" for line in lines[1:]]) + "\n")
    side = json.loads((path.parent / (path.name + ".json")).read_text())
    (grid.parent / (grid.name + ".json")).write_text(json.dumps(dict(side, mode="grid", radii=radii)))
    return grid


def test_a_grid_log_without_r0_leaves_clean_accuracy_out_instead_of_comparing_its_lower_bound(tmp_path, capsys):
    """CERTIFY against a grid log of --radii 0.25 0.5 --no-zero-level: its clean accuracy counts only the inputs
    certified at 0.25 or more, a lower bound, so the row is left out with a line, not called lower."""
    rng = np.random.default_rng(40)
    pY = latent(rng, 300)
    a = setting_log(tmp_path / "a.tsv", rng, pY)
    b = as_grid(setting_log(tmp_path / "b.tsv", rng, pY), [0.25, 0.5])
    assert run_main(analyze.main, ["compare", a, b, "--radii", 0.25, 0.5, "--out", tmp_path / "o"]) == 0
    metrics = [row.split("\t")[0] for row in (tmp_path / "o" / "compare.tsv").read_text().splitlines()[1:]]
    assert "clean accuracy" not in metrics and "certified accuracy r=0.25" in metrics
    md = (tmp_path / "o" / "compare.md").read_text()
    assert "Left out: clean accuracy, which grid_b.tsv (a grid log without r = 0" in md
    with_zero = as_grid(setting_log(tmp_path / "c.tsv", rng, pY), [0.0, 0.25, 0.5])   # r = 0 a level: decided
    rows, _ = compare.compare_sides(analyze.load_logs([str(a)]), analyze.load_logs([str(with_zero)]), [0.25, 0.5])
    assert "clean accuracy" in [m for m, *_ in rows]


@pytest.mark.parametrize("field, a_value, b_value", [("N", 500, 1000), ("alpha", 0.001, 0.1)])
def test_logs_of_other_budgets_are_refused_unless_allowed_and_then_compare_md_says_so(tmp_path, capsys, field,
                                                                                      a_value, b_value):
    """The same model at N = 500 and N = 1,000 (or alpha 0.001 and 0.1) is not compared as if only the model
    differed: one line naming the setting, exit 2; with --allow-different budget, compare.md says above its
    table what differs and that each verdict is about the model and that setting together."""
    rng = np.random.default_rng(41)
    pY = latent(rng, 200)
    a = setting_log(tmp_path / "a.tsv", rng, pY, counts=False, **{field: a_value})
    b = setting_log(tmp_path / "b.tsv", rng, pY, counts=False, **{field: b_value})
    argv = ["compare", a, b, "--radii", 0.25, "--out", tmp_path / "o"]
    capsys.readouterr()
    assert run_main(analyze.main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{field} {b_value}, but" in err[0] and "--allow-different budget" in err[0]
    assert not (tmp_path / "o").exists()                  # refused before anything is written
    assert run_main(analyze.main, argv + ["--allow-different", "budget"]) == 0
    md = (tmp_path / "o" / "compare.md").read_text()
    said = md.index(f"Not the same setting (--allow-different): {field}: {a_value} (a.tsv), {b_value} (b.tsv)")
    assert said < md.index("| metric |") and "about both, not about the model alone" in md
    # the python block compares what it is given; the command's check is readers.check_comparable
    logs = analyze.load_logs([str(a), str(b)])
    assert readers.check_comparable(logs, ["budget"]) == [("budget", f"{field}: {a_value} (a.tsv), {b_value} (b.tsv)")]


def test_an_n_column_tells_the_budget_of_a_log_without_settings_file_and_unknown_fields_are_assumed_equal(
        tmp_path, capsys):
    rng = np.random.default_rng(42)
    pY = latent(rng, 200)
    a = write_log(tmp_path / "a.tsv", certify_log(rng, pY))             # Cohen's columns + nA N nY, N = 1000
    b = tmp_path / "b.tsv"
    head, *rows = a.read_text().splitlines()                            # the same counts out of N = 2000
    b.write_text("\n".join([head] + ["\t".join(cells[:7] + ["2000"] + cells[8:])
                                     for cells in (row.split("\t") for row in rows)]) + "\n")
    argv = ["compare", a, b, "--sigmas", SIGMA, SIGMA, "--radii", 0.25]
    assert run_main(analyze.main, argv) == 2
    assert "N 2000, but" in capsys.readouterr().err
    c = setting_log(tmp_path / "c.tsv", rng, pY, alpha=None, split=None, dataset=None)   # records N only
    assert run_main(analyze.main, ["compare", a, c, "--sigmas", SIGMA, SIGMA, "--radii", 0.25]) == 0   # the rest:
    assert "Not the same setting" not in capsys.readouterr().out                                  # taken as equal


@pytest.mark.parametrize("field, value", [("mode", "label"), ("split", "train"), ("dataset", "digits")])
def test_a_mode_a_split_or_a_dataset_that_differs_is_refused_in_one_line(tmp_path, capsys, field, value):
    rng = np.random.default_rng(43)
    pY = latent(rng, 200)
    a = setting_log(tmp_path / "a.tsv", rng, pY)
    b = setting_log(tmp_path / "b.tsv", rng, pY, **({"candidate": "label"} if field == "mode" else {field: value}))
    if field == "mode":   # label mode: the log itself says so with its candidate column
        lines = b.read_text().splitlines()
        b.write_text("\n".join([lines[0] + "\tcandidate"] + [line + "\t0" for line in lines[1:]]) + "\n")
    capsys.readouterr()
    assert run_main(analyze.main, ["compare", a, b, "--radii", 0.25]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    shown = "label mode" if field == "mode" else value
    assert len(err) == 1 and f"{field} {shown}, but" in err[0] and f"--allow-different {field}" in err[0]
    assert run_main(analyze.main, ["compare", a, b, "--radii", 0.25, "--allow-different", field]) == 0
    assert f"Not the same setting (--allow-different): {field}:" in capsys.readouterr().out


def test_a_sigma_given_against_the_settings_file_is_refused(tmp_path, capsys):
    rng = np.random.default_rng(44)
    pY = latent(rng, 200)
    a, b = setting_log(tmp_path / "a.tsv", rng, pY), setting_log(tmp_path / "b.tsv", rng, pY)
    capsys.readouterr()
    assert run_main(analyze.main, ["compare", a, b, "--sigmas", SIGMA, 1.0]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sigmas gives 1.0, but its settings file records sigma 0.5" in err[0]
    assert run_main(analyze.main, ["compare", a, b, "--sigmas", SIGMA, SIGMA, "--radii", 0.25]) == 0


# ---- the blocks check each argument: a TypeError or ValueError naming it, never one from deep inside ---------

def test_compare_sides_and_test_set_votes_refuse_bad_arguments_naming_them():
    rng = np.random.default_rng(45)
    a, b = certify_log(rng, latent(rng, 100), "a.tsv"), certify_log(rng, latent(rng, 100), "b.tsv")
    good = dict(side_a=[a], side_b=[b], radii=[0.25], level=0.95, votes=None, family=None)
    bad = [("family", [], ValueError), ("family", "ACR", TypeError), ("family", ["no such row"], ValueError),
           ("family", [1], TypeError), ("radii", [], ValueError), ("radii", [float("nan")], ValueError),
           ("radii", [-0.25], ValueError), ("radii", 0.25, TypeError), ("radii", ["0.25"], TypeError),
           ("level", 1.0, ValueError), ("level", 0.0, ValueError), ("level", float("nan"), ValueError),
           ("level", "0.95", TypeError), ("side_a", [], ValueError), ("side_b", a, TypeError),
           ("side_a", [{"path": "x"}], TypeError), ("votes", "test-set", TypeError)]
    for name, value, error in bad:
        with pytest.raises(error, match=name if name != "family" or value != ["no such row"] else "family"):
            compare.compare_sides(**dict(good, **{name: value}))
    rows, _ = compare.compare_sides(**good)
    assert rows and rows == compare.compare_sides(**dict(good, radii=(0.25,)))[0]
    for name, value, error in [("N", 0, ValueError), ("N", 1000.0, TypeError), ("N", "1000", TypeError),
                               ("alpha", 1.5, ValueError), ("alpha", float("nan"), ValueError),
                               ("sigma", -0.5, ValueError), ("sigma", "0.5", TypeError)]:
        with pytest.raises(error, match=name):
            compare.test_set_votes(**{name: value})


# ---- training seeds: the paired-seed design, and the seed rule at five seeds ----

def seeded(log, seed):
    """The log with a settings file that records its training seed (certify.py reads it from the checkpoint)."""
    return dict(log, sidecar=dict(log["sidecar"], train_seed=seed))


def test_seeds_are_paired_only_when_both_sides_record_the_same_training_seeds():
    rng = np.random.default_rng(40)
    pY = latent(rng, 200)
    logs = lambda seeds, side: [seeded(certify_log(rng, pY, f"{side}{j}.tsv"), s) for j, s in enumerate(seeds)]
    assert compare.seed_design(logs([0, 1, 2], "a"), logs([2, 0, 1], "b")) == "paired"    # the same set, any order
    assert compare.seed_design(logs([0, 1, 2], "a"), logs([0, 1, 3], "b")) == "unpaired"  # another seed
    assert compare.seed_design(logs([0, 1, 2], "a"), logs([0, 1], "b")) == "unpaired"     # one fewer
    assert compare.seed_design(logs([0, 0, 1], "a"), logs([0, 0, 1], "b")) == "unpaired"  # a seed twice
    assert compare.seed_design(logs([0, 1, None], "a"), logs([0, 1, None], "b")) == "unpaired"   # unknown
    assert compare.seed_design(logs([0], "a"), logs([0], "b")) is None                    # one model a side
    a, b = logs([0, 1, 2], "a"), logs([2, 1, 0], "b")
    rows, facts = compare.compare_sides(a, b, RADII)
    assert facts["seed_design"] == {SIGMA: "paired"}
    assert "Paired seeds" in compare.compare_words(rows, facts, ["a", "b"], 0.95)
    rows, facts = compare.compare_sides(a, logs([3, 4, 5], "b"), RADII)
    assert facts["seed_design"] == {SIGMA: "unpaired"}
    assert "Unpaired seeds" in compare.compare_words(rows, facts, ["a", "b"], 0.95)


def test_paired_seeds_compare_seed_j_with_seed_j_whatever_the_order_of_the_logs():
    """Each seed of B is that seed of A with its first 20 images made correct (the seeds' spread shared): paired
    seeds see almost no seed spread in the difference, and listing B's logs in another order changes nothing."""
    rng = np.random.default_rng(41)
    pY = latent(rng, 400)
    a = [seeded(certify_log(rng, shifted(rng, pY, share), f"a{j}.tsv"), j) for j, share in enumerate((0, .05, .1))]
    b = [seeded(dict(log, path=f"b{j}.tsv", correct=log["correct"] | (np.arange(400) < 20)), j)
         for j, log in enumerate(a)]
    same, _ = verdicts(a, b)
    turned, _ = verdicts(a, b[::-1])
    assert same["clean accuracy"] == turned["clean accuracy"]
    unpaired, _ = verdicts(a, [dict(log, sidecar={"alpha": ALPHA}) for log in b])
    width = lambda rows: rows["clean accuracy"][2] - rows["clean accuracy"][1]
    assert width(same) < 0.5 * width(unpaired)


@pytest.mark.parametrize("k", [3, 5])
def test_the_paired_seed_interval_covers_a_known_truth_and_is_narrower_when_seeds_correlate(k):
    """Seed effects (variance 1) correlated 0.85 across the sides, image effects and interaction as in the
    unpaired test above, truth 0.3: the paired interval at error a misses it at most at rate a (plus simulation
    error) and is narrower than the unpaired one on the same data, on average (with three seeds its 2 degrees of
    freedom take back part of the gain)."""
    rng = np.random.default_rng(50 + k)
    a, reps, n, rho = 0.05 / 4, 3_000, 100, 0.85
    misses, widths = 0, []
    for _ in range(reps):
        seed_a = rng.normal(0, 1, (k, 1))
        seed_b = rho * seed_a + np.sqrt(1 - rho ** 2) * rng.normal(0, 1, (k, 1))
        image = rng.normal(0, 0.5 * np.sqrt(n / k), n)
        fa = seed_a + image + rng.normal(0, 1, (k, n))
        fb = 0.3 + seed_b + image + rng.normal(0, 0.5 * np.sqrt(n / k), n) + rng.normal(0, 1, (k, n))
        d, lo, hi, _ = compare.row_interval(fa, fb, False, True, a, matched=True)
        misses += not lo <= 0.3 <= hi
        _, ulo, uhi, _ = compare.row_interval(fa, fb, False, True, a)
        widths.append((hi - lo, uhi - ulo))
    assert misses / reps <= a + 3 * np.sqrt(a / reps), misses
    paired, unpaired = np.mean(widths, 0)
    assert paired < {3: 0.9, 5: 0.7}[k] * unpaired, (paired, unpaired)
    with pytest.raises(ValueError, match="matched"):
        compare.row_interval(fa, fb[:2], False, True, a, matched=True)


def test_five_seeds_drop_the_floor_and_keep_the_error():
    """Five seeds a side: no 0/1 row is widened to the one-model score interval on the seed means (narrower
    than it here), and the family-wise error under the null stays at 5 % in short calibrations with unpaired,
    paired and rare-row seeds; three seeds keep the floor."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import compare_calibration as cal
    rng = np.random.default_rng(42)
    pY = np.clip(latent(rng, 500), 0.3, 0.7)      # many images near 1/2: the seeds' votes disagree on them
    pB = shifted(rng, pY, 0.01)
    for k, floored in ((5, False), (3, True)):
        a, b = [certify_log(rng, pY) for j in range(k)], [certify_log(rng, pB) for j in range(k)]
        fa = np.stack([log["correct"] for log in a]).astype(float)
        fb = np.stack([log["correct"] for log in b]).astype(float)
        ma, mb = fa.mean(0), fb.mean(0)
        floor = common.tango_interval(float(np.maximum(mb - ma, 0).sum()), float(np.maximum(ma - mb, 0).sum()),
                                       len(ma), -compare.ndtri(0.05 / 2))
        _, lo, hi, _ = compare.row_interval(fa, fb, True, True, 0.05)
        assert (lo <= floor[0] and hi >= floor[1]) == floored, (k, lo, hi, floor)
    runs = 60
    for name in ("cifar paired, 5 seeds", "cifar paired, 5 matched seeds", "mostly-one paired, 5 seeds (rare rows)"):
        r = cal.run_scenario(name, cal.SCENARIOS[name], runs, 0)
        assert r["null"]["any_flag"] / runs <= NOMINAL(runs), name
        assert 1 - r["alternative"]["any_miss"] / runs >= 0.95 - 3 * np.sqrt(0.05 * 0.95 / runs), name


def test_train_seeds_on_the_command_line_pair_the_seeds_and_contradictions_are_refused(tmp_path, capsys):
    rng = np.random.default_rng(43)
    pY = latent(rng, 200)
    side = lambda name, sidecar=None: [write_log(tmp_path / f"{name}{j}.tsv", certify_log(rng, pY),
                                                 sidecar=sidecar and sidecar(j)) for j in range(2)]
    a, b = side("a"), side("b")
    flags = ["compare", *a, "--vs", *b, "--sigmas", *[SIGMA] * 4]
    assert run_main(analyze.main, flags + ["--out", tmp_path / "u"]) == 0
    assert "Unpaired seeds" in (tmp_path / "u" / "compare.md").read_text()
    assert run_main(analyze.main, flags + ["--train-seeds", 0, 1, 0, 1, "--out", tmp_path / "p"]) == 0
    assert "Paired seeds" in (tmp_path / "p" / "compare.md").read_text()
    capsys.readouterr()
    assert run_main(analyze.main, flags + ["--train-seeds", 0, 1, 0]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "one seed per log (4), got 3" in err[0]
    c = side("c", lambda j: f'{{"N": {N}, "alpha": {ALPHA}, "sigma": {SIGMA}, "train_seed": {j}}}')
    flags = ["compare", *a, "--vs", *c, "--sigmas", *[SIGMA] * 4, "--train-seeds", 0, 1, 1, 0]
    assert run_main(analyze.main, flags) == 2
    assert "records training seed 0, but --train-seeds gives 1" in capsys.readouterr().err


def test_certify_records_the_checkpoints_training_seed_and_a_bad_one_is_refused(tmp_path):
    """certify.py's sidecar field train_seed: the --seed a training script stored in the checkpoint's args,
    None for a checkpoint without it; a settings file with a negative one is refused when read."""
    assert certify.train_seed({"args": {"seed": 3, "sigma": 0.5}}) == 3
    assert certify.train_seed({"args": {"seed": 0}}) == 0
    assert certify.train_seed({"state_dict": {}}) is None                     # a released checkpoint
    assert certify.train_seed({"args": {"seed": True}}) is None and certify.train_seed({"args": None}) is None
    rng = np.random.default_rng(44)
    path = write_log(tmp_path / "a.tsv", certify_log(rng, latent(rng, 20)),
                     sidecar=f'{{"N": {N}, "alpha": {ALPHA}, "sigma": {SIGMA}, "train_seed": -1}}')
    with pytest.raises(common.UserError, match="train_seed"):
        analyze.load_logs([str(path)])

"""CERTIFY and PREDICT of Cohen et al. (2019) over a dataset split, one Cohen-format TSV line each (App. C.2).

The paper certifies with N0 = 100, N = 100,000 and alpha = 0.001 (the defaults here) on all 10,000 CIFAR-10
test images. The noise of example idx comes from common.example_generator(seed, idx), so a rerun, a resumed
run, a subset (--skip/--max) and a torchrun shard write the same line for the same example (given the same
--batch and device, which decide how the draws are chunked).

Output (tab-separated, one flushed line per example; `predict` is -1 on abstention):
  CERTIFY:   idx label predict radius correct time nA N nY  (nA: votes for the selected class among the N
                                                             draws; nY: votes for the true label among them)
  --predict: idx label predict correct time nA N nY         (nA: votes for the top class; no radius)
  --radii:   idx label predict radius correct time nA N pA_lower pA_upper stop pA_certified   (anytime-valid
             certification at a grid of radii, grid.py: radius = the largest grid radius certified, N =
             draws made, pA_certified = Phi(radius / sigma): the bound the certificate proves; the examples
             of a --group share forward passes, so time is the group's, shared evenly)
nY / N estimates pA of every example, wrong and abstained ones too: the whole distribution of pA (§4.3, Fig. 3).
--save-counts also keeps every class's votes, one row per example, in <outfile>.counts. --label-mode adds a last
column `candidate` (= label): cA was the true label, no selection draws were made; such a log gives certified
accuracy, not predictions. --seed random draws the seed from the OS's entropy when the run starts (recorded as
seed_value in the sidecar): a certificate with a published seed holds only for a model that does not depend on that
noise; the default fixed seed is for reproducible experiments. The sidecar <outfile>.json, the run's record, holds
the settings; rerunning resumes after the last line. Speed (docs/speed.md; measured by tools/bench.py): channels-last
and folded BatchNorm by default, --precision bf16, --compile, and --early-abstain (stop early on examples that will
abstain; the guarantee is unchanged).

Floating point: by default (as the paper and Cohen et al.) f sees fl(x + fl(sigma * randn)), which keeps low-order
bits of x; a base classifier that reads them can obtain false certificates (Voráček & Hein 2023; tests/test_sound.py
rebuilds such attacks). The certificate of the float path therefore assumes that f does not exploit rounding. --sound
removes that assumption (integer noise on the input grid, one conversion): it certifies f composed with the grid
mapping, with the same radius formula. Checkpoints are loaded without running code (weights_only); --trust-checkpoint
loads files that need more, and runs what they hold.

Usage (after `python train_gaussian.py --dataset digits --sigma 0.5 --epochs 5`; about a minute on a CPU):
    python certify.py --checkpoint runs/train_gaussian_digits_sigma0.5/checkpoint.pth.tar --N 1000
Several processes (`--` keeps torchrun from reading --max as its own --max-restarts):
    torchrun --nproc_per_node 2 certify.py -- --checkpoint CKPT --max 100
"""
import argparse
import contextlib
import datetime
import functools
import math
import os
import sys
import time

import numpy as np
import torch
from scipy.special import ndtri   # scipy.stats' norm.ppf, bit for bit, without its import time

import common
import readers
import grid
import machinery


# ----------------------------------------------------------------------------------------------------------
# CERTIFY and PREDICT on one input (Cohen et al. 2019, Alg. "certify" and "predict")
# ----------------------------------------------------------------------------------------------------------

def certify(model, x, sigma, N0, N, alpha, batch, num_classes, generator=None, sample=common.sample_counts,
            candidate=None):
    """CERTIFY of Cohen et al. (2019): cA from N0 noisy copies of x (C, H, W), pA bounded on N fresh ones; with
    probability >= 1 - alpha the radius is a true l2 robustness radius of the smoothed classifier at x. Returns
    {predict: cA or -1 (abstain), radius, pA_lower, nA, N, counts}. sample: the vote counter (sampler_of); candidate:
    the class to certify, no selection (--label-mode). Eval mode, each module handed back; a bad argument: a
    TypeError or ValueError naming it."""
    common.check_smoothed(model, x, generator)
    common.check_smoothing(sigma, alpha, N=N, batch=batch, num_classes=num_classes)
    common.check_int("N0", N0, 1 if candidate is None else 0)   # with a candidate: no selection draws
    common.check_type("sample", sample, callable)
    if candidate is not None:   # a class of the model's: -1 would index the last one
        common.check_int("candidate", candidate, 0, num_classes - 1)
    votes = lambda n: common.check_votes(sample(model, x.unsqueeze(0), sigma, n, batch, num_classes, generator), n,
                                         num_classes)   # noqa: E731
    with common.eval_mode(model):
        if candidate is None:   # first class on ties, as numpy's argmax in Cohen's code
            candidate = int(votes(N0)[0].argmax())
        common.check(getattr(sample, "cA", None) in (None, candidate), f"sample (an EarlyAbstention) stops on class "
                     f"{getattr(sample, 'cA', None)!r}, not on the candidate {candidate}")
        counts = votes(N)[0].cpu()
    nA = int(counts[candidate])
    pA_lower = common.clopper_pearson_lower(nA, N, alpha)
    abstain = pA_lower < 0.5
    return {"predict": -1 if abstain else candidate, "radius": 0.0 if abstain else float(sigma * ndtri(pA_lower)),
            "pA_lower": pA_lower, "nA": nA, "N": N, "counts": counts.tolist()}


def predict(model, x, sigma, N, alpha, batch, num_classes, generator=None, sample=common.sample_counts):
    """PREDICT of Cohen et al. (2019): the top class of N noisy copies of x (C, H, W), or -1 (abstain) unless a
    two-sided binomial test tells it from the runner-up at level alpha: wrong with probability at most alpha.
    Returns predict, nA (the top class's votes), N, pvalue, counts. sample, eval mode and checks: as certify's."""
    common.check_smoothed(model, x, generator)
    common.check_smoothing(sigma, alpha, N=N, batch=batch, num_classes=num_classes)
    common.check_type("sample", sample, callable)
    with common.eval_mode(model):
        counts = sample(model, x.unsqueeze(0), sigma, N, batch, num_classes, generator)
    counts = common.check_votes(counts, N, num_classes)[0].cpu()
    order = np.argsort(-counts.numpy(), kind="stable")  # ties: the lower class first
    nA, nB = int(counts[order[0]]), int(counts[order[1]]) if len(order) > 1 else 0
    from scipy.stats import binomtest   # here: scipy.stats takes seconds to import
    pvalue = binomtest(nA, nA + nB, 0.5).pvalue
    return {"predict": int(order[0]) if pvalue <= alpha else -1, "nA": nA, "N": N, "pvalue": pvalue,
            "counts": counts.tolist()}


# ----------------------------------------------------------------------------------------------------------
# certify.py's options around the plain path: the sound sampler, reduced precision, early abstention
# ----------------------------------------------------------------------------------------------------------
# Each keeps CERTIFY's guarantee, for the classifier it names: --sound certifies f composed with the grid
# mapping (common.sound_copies; its failed draws vote for no class, within the full N); --precision certifies
# the reduced-precision classifier (common.in_precision); --early-abstain only ever abstains (abstain_rule).


class EarlyAbstention:
    """certify()'s `sample` with early abstention (--early-abstain): the selection draws as they are, then
    estimation draws that stop once abstain_rule says that pA(cA) < 1/2. A stopped example has nA < N / 2,
    so certify's bound abstains on it, as the full count would have with probability >= 1 - alpha; stopped_at
    is then the number of draws made (None: not stopped). Unstopped, the result is that of the full run.
    One instance per example: it remembers that example's cA (candidate: the class certified without selection)."""

    def __init__(self, sample, alpha, candidate=None):
        self.sample, self.cA, self.stopped_at, self.used = sample, candidate, None, False
        self.alpha = common.check_float("alpha", alpha, gt=0, lt=1)   # the chance of stopping where pA >= 1/2

    def __call__(self, model, x, sigma, n, batch, num_classes, generator=None):
        common.check(not self.used, "this EarlyAbstention has served an example and holds its class: make a new "
                                    "one for each example (certify.sampler_of)")
        if self.cA is None:   # the selection draws: remember the class certify() selects from them
            counts = self.sample(model, x, sigma, n, batch, num_classes, generator)
            self.cA = int(counts[0].argmax())
            return counts
        rule, self.used = abstain_rule(self.cA, n, batch, self.alpha), True

        def stop(counts, drawn):
            if rule(counts, drawn):
                self.stopped_at = drawn
                return True
            return False
        return self.sample(model, x, sigma, n, batch, num_classes, generator, stop=stop)


def sampler_of(sound=None, early_abstain=None, candidate=None):
    """The `sample` of certify / predict for certify.py's options: common.sample_counts with the sound
    sampler's copies (sound: the grid's levels), wrapped in EarlyAbstention (early_abstain: its alpha)."""
    sample = functools.partial(common.sample_counts, copies=common.sound_copies(sound)) if sound \
        else common.sample_counts
    return sample if early_abstain is None else EarlyAbstention(sample, early_abstain, candidate)


def abstain_checks(N, batch):
    """Early abstention tests pA after 1, 2, 4, 8, ... of the full count's passes (never after the last one).

    Returns the draw counts at those pass ends. Growing stages: an example far below 1/2 stops after 1 % of
    N = 100,000 draws (batch 1000), one near 1/2 runs on; the tests cost log2(passes) shares of the alpha.
    """
    ends = np.cumsum(common.pass_sizes(N, batch))
    return [int(ends[k - 1]) for k in (2 ** j for j in range(len(ends).bit_length())) if k < len(ends)]


def abstain_rule(cA, N, batch, alpha):
    """stop(counts, drawn) for common.sample_counts: stop when a one-sided Clopper-Pearson upper bound on
    pA(cA) at level alpha / (number of tests) is below 1/2, at the draw counts of abstain_checks.

    With probability >= 1 - alpha an example whose pA >= 1/2 is never stopped (Bonferroni over the tests).
    A stop only abstains, so CERTIFY's guarantee is unchanged whatever alpha is.
    """
    checks, cA = abstain_checks(N, batch), common.check_int("cA", cA, 0)
    level = common.check_float("alpha", alpha, gt=0, lt=1) / max(len(checks), 1)

    def stop(counts, drawn):
        if drawn not in checks:
            return False
        return common.clopper_pearson_upper(int(counts[0, cA]), drawn, level) < 0.5
    return stop


def example_line(model, x, label, idx, sigma, N0, N, alpha, batch, num_classes, seed, use_predict,
                 precision="fp32", early_abstain=None, columns=None, counts_out=None, sound=None, plan=None,
                 label_mode=False, radius_fn=None):
    """Certify (or predict) example idx with its own noise generator; returns its TSV line (no newline).

    precision, sound, early_abstain: certify.py's options (common.in_precision, sampler_of). plan: a grid_plan of
    this N and alpha, for anytime-valid certification at its radii (--radii) instead of CERTIFY. columns: the TSV's
    columns (default CERTIFY_COLUMNS or PREDICT_COLUMNS). counts_out: optional list; every class's votes among the
    estimation draws are appended to it. label_mode: certify the true label (no selection draws); the line's
    `candidate` column says so. radius_fn: None (Cohen's radius), or callable(pA_lower, sigma) -> the radius of a
    certified example, a certificate of another form from the same bound (ddrs.py --semi-elastic).
    """
    common.check(isinstance(use_predict, bool) and isinstance(label_mode, bool), "use_predict and label_mode are bools")
    common.check(plan is None or (plan.get("N_max"), plan.get("alpha")) == (N, alpha), f"plan is for N_max "
                 f"{plan and plan.get('N_max')}, alpha {plan and plan.get('alpha')}: not N {N}, alpha {alpha}")
    common.check_type("counts_out", counts_out, None, list)
    common.check_type("radius_fn", radius_fn, None, callable)
    candidate, label = label if label_mode else None, common.check_int("label", label, 0, num_classes - 1)
    generator = common.example_generator(seed, idx, x.device)
    model = common.in_precision(model, precision)
    start = time.time()
    if use_predict:
        out = predict(model, x, sigma, N, alpha, batch, num_classes, generator, sampler_of(sound))
    elif plan is not None:
        copies = common.sound_copies(sound) if sound else common.gaussian_copies
        out = grid.grid_certify(model, x, sigma, N0, batch, num_classes, generator, plan, copies, candidate)
        out["pA_lower"], out["pA_upper"] = grid.grid_interval(out, plan)
    else:
        sample = sampler_of(sound, early_abstain, candidate)
        out = certify(model, x, sigma, N0, N, alpha, batch, num_classes, generator, sample, candidate)
        if getattr(sample, "stopped_at", None) is not None:   # stopped early: abstained, after fewer draws
            out["N"] = sample.stopped_at
        elif radius_fn is not None and out["predict"] >= 0:
            out["radius"] = float(radius_fn(out["pA_lower"], sigma))
    if counts_out is not None:
        counts_out.append(out["counts"])
    columns = columns or (PREDICT_COLUMNS if use_predict else GRID_COLUMNS if plan else CERTIFY_COLUMNS)
    return format_line(out, idx, label, time.time() - start, columns)


def format_line(out, idx, label, seconds, columns):
    """The TSV line (no newline) of one example's result `out` (certify, predict or grid_certify_many)."""
    values = {"idx": idx, "label": label, "predict": out["predict"], "radius": f"{out.get('radius', 0.0):.6}",
              "correct": int(out["predict"] == label), "time": str(datetime.timedelta(seconds=seconds)),
              "nA": out["nA"], "N": out["N"], "nY": int(out["counts"][label]),
              "pA_lower": f"{out.get('pA_lower', 0):.6g}", "pA_upper": f"{out.get('pA_upper', 1):.6g}",
              "stop": out.get("stop"), "pA_certified": f"{out.get('pA_certified', 0):.9g}", "candidate": "label"}
    common.check(math.isfinite(float(values["radius"])), f"example {idx}: the radius is not finite "
                                                         f"({values['radius']}); no certificate is written")
    return "\t".join(str(values[c]) for c in columns)


# ----------------------------------------------------------------------------------------------------------
# The command: its columns, options and settings
# ----------------------------------------------------------------------------------------------------------

CERTIFY_COLUMNS = ("idx", "label", "predict", "radius", "correct", "time", "nA", "N", "nY")
PREDICT_COLUMNS = ("idx", "label", "predict", "correct", "time", "nA", "N", "nY")
# --radii (anytime-valid certification at a grid of radii): radius = the certified grid radius, N = the
# estimation draws made, [pA_lower, pA_upper] the anytime-valid interval (an estimate), stop = decided,
# curtailed or budget, pA_certified = Phi(radius / sigma) of the certified level (0 if none): the bound the
# certificate rests on, pA > pA_certified with probability >= 1 - alpha, so radius = sigma Phi^-1(pA_certified).
GRID_COLUMNS = ("idx", "label", "predict", "radius", "correct", "time", "nA", "N", "pA_lower", "pA_upper", "stop",
                "pA_certified")
# --early-abstain: probability that an example whose pA is at least 1/2 is stopped anyway, split evenly over
# the tests (Bonferroni). It does not enter the certificate's guarantee: a stop only ever abstains.
EARLY_ABSTAIN_ALPHA = 0.001


def build_parser(description=__doc__):
    """certify.py's flags (ddrs.py certify adds its own to them)."""
    p = machinery.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=common.DATASETS, help="default: the checkpoint's 'dataset' entry")
    p.add_argument("--data-dir", default=None, help="dataset folder (default: $RS_DATA_DIR or ./data)")
    p.add_argument("--split", default="test", choices=("train", "test"), help="which split to certify")
    p.add_argument("--checkpoint", required=True, help="base classifier f: {'arch', 'state_dict', ...}")
    p.add_argument("--arch", choices=common.ARCHS, help="override the checkpoint's architecture name")
    p.add_argument("--trust-checkpoint", action="store_true", help="load checkpoint files that need arbitrary "
                   "unpickling: this RUNS CODE the file holds; only for files from a source you trust")
    p.add_argument("--sigma", type=float, help="noise level of the smoothed classifier g; default: the "
                                               "checkpoint's 'sigma' (required for checkpoints without it)")
    p.add_argument("--outfile", help="TSV to write (default: runs/certify/<checkpoint>_sigma<S>.tsv)")
    p.add_argument("--N0", type=int, default=100, help="noise samples used to select the top class cA")
    p.add_argument("--N", type=int, default=100_000, help="noise samples used to lower-bound pA")
    p.add_argument("--alpha", type=float, default=0.001, help="failure probability of CERTIFY / PREDICT")
    p.add_argument("--batch", type=common.batch_arg, default="auto", help="noisy inputs per forward pass; auto "
                   f"(default): on a GPU the largest pass that fits, at most N, else {common.CPU_BATCH} (docs/speed.md)")
    p.add_argument("--skip", type=int, default=1, help="certify every skip-th example (idx %% skip == 0)")
    p.add_argument("--max", type=int, default=None, help="certify at most this many examples")
    p.add_argument("--seed", type=seed_arg, default=0, help="noise of example idx is drawn from (seed, idx): a fixed "
                   "seed (default 0) is reproducible; 'random' takes one from the OS's entropy when the run starts and "
                   "records it in the sidecar (when the model may have seen the published seed's noise)")
    p.add_argument("--label-mode", action="store_true", help="evaluation only: the candidate class cA is the true "
                   "label (no selection draws, N0 unused); valid for certified accuracy, not predictions (the log says so)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--predict", action="store_true", help="run PREDICT (no radius) instead of CERTIFY")
    p.add_argument("--overwrite", action="store_true", help="start again instead of resuming an existing outfile")
    p.add_argument("--save-counts", action="store_true", help="also write every class's votes among the N "
                   "draws of every example to <outfile>.counts (TSV: idx, then one column per class)")
    p.add_argument("--precision", default="fp32", choices=tuple(common.PRECISIONS),
                   help="arithmetic of the base classifier: fp32 (the paper's), bf16 (CPU, CUDA) or fp16 (CUDA) "
                        "autocast; the certificate then holds for that reduced-precision classifier")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None, help="channels-last "
                   "memory format (default: on for convolutional models)")
    p.add_argument("--fold-bn", action=argparse.BooleanOptionalAction, default=True, help="fold eval-mode "
                   "BatchNorm into the convolution before it (the same classifier up to float rounding; default on)")
    p.add_argument("--compile", action="store_true", help="torch.compile the base classifier (a minute of "
                   "compilation per batch shape; falls back to eager with a note where it cannot run)")
    p.add_argument("--sound", action="store_true", help="sound sampling (Voráček & Hein 2023): integer noise on "
                   "the 8-bit grid and one conversion to float, so floating point cannot fake a certificate; certifies "
                   "f composed with the grid mapping. Default: Cohen et al.'s float sampler (comparable with the paper)")
    p.add_argument("--radii", type=float, nargs="+", metavar="R", help="anytime-valid certification at these "
                   "radii (grid.py, docs/certification.md): per example the largest one certified, stopping as soon as it is decided; "
                   "--N is then the budget N_max. 0 (the smoothed prediction) is always a level, unless --no-zero-level")
    p.add_argument("--beta", type=float, help="--radii: the chance of ruling out a radius the example reaches, "
                   "exact at its threshold (default 0.2, chosen by measurement: tools/beta_curve.py; ruling out "
                   "stops early and only ever removes certificates)")
    p.add_argument("--group", type=int, help="--radii: examples whose draws are packed into shared "
                   "forward passes (default 64); an example's noise does not depend on it (nor its line, unless batched "
                   "kernels round a vote differently)")
    p.add_argument("--no-final-look", dest="final_look", action="store_false", help="--radii: spend all of alpha "
                   "on the confidence sequence, no Clopper-Pearson look at N_max (default: the sequence's exact spend per "
                   "level, 0.5-0.85 of alpha, and the rest on that look)")
    p.add_argument("--no-zero-level", dest="zero_level", action="store_false", help="--radii: decide only the "
                   "listed radii, not r = 0 (whether the smoothed classifier predicts at all, which costs the most near "
                   "pA = 1/2): an example not certified at the smallest one gets predict -1, so the log gives certified "
                   "accuracy at those radii only (a lower bound at r = 0)")
    p.add_argument("--early-abstain", action="store_true", help=f"CERTIFY: stop and abstain once an upper bound on "
                   f"pA falls below 1/2 (tests after 1, 2, 4, ... passes, alpha {EARLY_ABSTAIN_ALPHA}); column N = draws")
    return p


def parse_args(argv=None, parser=None):
    argv = sys.argv[1:] if argv is None else argv
    p = parser or build_parser()
    return p.parse_args(argv[1:] if argv[:1] == ["--"] else argv)  # `torchrun certify.py -- ...` may pass the --


def seed_arg(text):
    """--seed: an integer >= 0, or 'random' (drawn from the OS's entropy when the run starts)."""
    if text == "random":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or 'random', got {text!r}") from None


def resolve_seed(seed, sidecar):
    """The integer seed of a run: the given one, or for 'random' the one a log being resumed recorded, else a
    fresh 62-bit seed from the operating system's entropy (secrets). Drawn only now, after the model and the
    data are fixed, so no model can depend on it."""
    if seed != "random":
        return seed
    if os.path.isfile(sidecar):
        old = readers.read_json_object(sidecar, "settings file of a log")
        if old.get("seed") == "random" and isinstance(old.get("seed_value"), int):
            return old["seed_value"]
        log = sidecar[:-len(".json")]
        rows = [path for path in [log] + machinery.part_files(log) if os.path.isfile(path) and
                len(readers.read_log_prefix(path, readers.read_header(path).split("\t"))[0]) > 0]
        common.check(old.get("seed") != "random" or not rows,
                     f"{sidecar}: the log was certified with --seed random but its seed is not recorded "
                     f"(seed_value {old.get('seed_value')!r}); its rows cannot be continued with the same noise: "
                     f"pass --overwrite, or another --outfile")
    import secrets
    return secrets.randbits(62)


def check_args(args):
    """Bad flag values: one line naming the problem and the fix (exit 2 through machinery.run)."""
    if args.sigma is not None:
        machinery.check_sigma(args.sigma, precision=args.precision)
    common.check(1 <= args.N0 <= machinery.MAX_DRAWS and 1 <= args.N <= machinery.MAX_DRAWS, f"--N0 and --N must be "
                 f">= 1 and at most {machinery.MAX_DRAWS:.0e} (got N0={args.N0}, N={args.N})")
    common.check(args.predict or args.N0 <= args.N,
                 f"--N0 ({args.N0}) > --N ({args.N}): N0 only picks the class, N bounds pA; swap them?")
    common.check(0 < args.alpha < 0.5, f"--alpha, a chance of error, must lie in (0, 0.5) (got {args.alpha}); paper: 0.001")
    common.check(args.skip >= 1, f"--skip must be >= 1 (got {args.skip}); 1 certifies every example")
    common.check(args.max is None or args.max >= 1, f"--max must be >= 1 (got {args.max}); omit it for all")
    common.check(args.batch == "auto" or args.batch >= 1, f"--batch must be >= 1 or 'auto' (got {args.batch})")
    common.check(args.group is None or 1 <= args.group <= 10 ** 5,
                 f"--group must lie in [1, 100000] (got {args.group})")
    common.check(not (args.label_mode and args.predict), "--label-mode certifies the true label; PREDICT has no "
                                                         "candidate to fix (drop one of them)")
    common.check(not (args.early_abstain and args.predict), "--early-abstain applies to CERTIFY, not --predict")
    if args.radii is not None:
        common.check(not args.predict, "--radii certifies (CERTIFY at a grid of radii), it does not --predict")
        common.check(not args.early_abstain, "--radii stops early by itself (its upper bound at --beta rules "
                                             "radii out); drop --early-abstain")
        common.check(all(r >= 0 for r in args.radii), f"--radii must be >= 0 (got {args.radii})")
        common.check(args.N <= grid.MAX_GRID_DRAWS, f"--radii: --N (the budget N_max) must be at most "
                                               f"{grid.MAX_GRID_DRAWS:,} (got {args.N:,}): beyond, the tables of its looks "
                                               f"take minutes per selection count to plan")
    # the options of --radii alone: refused without it rather than silently ignored
    common.check(args.zero_level or args.radii is not None, "--no-zero-level goes with --radii")
    common.check(args.final_look or args.radii is not None, "--no-final-look goes with --radii")
    machinery.check_mode_options(args, {"group": ["radii"]})
    common.check(args.beta is None or (args.radii is not None and 0 <= args.beta < 1),
                 "--beta goes with --radii and must lie in [0, 1)")


def default_outfile(checkpoint, sigma, split, use_predict, folder=None):
    """runs/certify/<checkpoint stem>_sigma<S>.tsv (or <folder>/...); a generic file name (checkpoint.pth.tar)
    takes its folder's. sigma: the one certified (from --sigma or the checkpoint), so the name says what ran."""
    name = os.path.basename(checkpoint)
    while os.path.splitext(name)[1] in (".tar", ".pth", ".pt", ".ckpt"):
        name = os.path.splitext(name)[0]
    if name in ("checkpoint", "model_best", "model", ""):
        name = os.path.basename(os.path.dirname(os.path.abspath(checkpoint))) or name
    suffix = "" if split == "test" else f"_{split}"
    folder = folder or os.path.join("runs", "predict" if use_predict else "certify")
    return os.path.join(folder, f"{name}_sigma{sigma:g}{suffix}.tsv")


def is_convolutional(model):
    """True for models with a 2D convolution: channels-last pays off for them (measured: see tools/bench.py)."""
    return any(isinstance(mod, torch.nn.Conv2d) for mod in model.modules())


def fold_batchnorm(model):
    """A copy of the eval-mode model (an nn.Module) with every BatchNorm folded into the convolution before it
    (torch.fx): the same function up to float rounding, one pass over the activations less per layer (measured: see
    tools/bench.py). A model torch.fx cannot trace comes back unchanged, with a note."""
    common.check_type("model", model, torch.nn.Module)
    from torch.fx.experimental.optimization import fuse
    try:
        return fuse(model)
    except Exception as e:  # e.g. data-dependent control flow in forward()
        sys.stderr.write(f"note: cannot fold BatchNorm in this model ({type(e).__name__}); running it as is\n")
        return model


def fast_model(model, channels_last, compile_model, shapes, precision, fold_bn=False):
    """The base classifier on the fast path: BatchNorm folded, channels-last weights, torch.compile if asked. model:
    in eval mode. Compilation happens here, once per input shape in `shapes` (the pass shapes of the run); where it
    fails (no C++ compiler, an unsupported model, ...) a note says why and the eager model is returned."""
    if fold_bn:
        model = fold_batchnorm(model)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if not compile_model:
        return model
    # freezing: the weights become constants, so BatchNorm folds into the convolutions (inference only)
    compiled = torch.compile(model, dynamic=False, options={"freezing": True})
    device = next(model.parameters()).device
    try:
        with torch.inference_mode(), common.autocast(device.type, precision):
            for shape in shapes:
                compiled(torch.zeros(shape, device=device))
    except Exception as e:  # whatever the compiler raises: say so, and run eager
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        sys.stderr.write(f"note: --compile is not available here ({type(e).__name__}: {reason}); running eager\n")
        return model
    return compiled


def pass_shapes(input_shape, N0, N, batch, use_predict):
    """The distinct input shapes of the forward passes of a run (what torch.compile specialises on)."""
    sizes = set(common.pass_sizes(N, batch)) | (set() if use_predict else set(common.pass_sizes(N0, batch)))
    return [(k, *input_shape) for k in sorted(sizes)]


def select_examples(n, skip, max_count, done):
    """Indices idx % skip == 0, the first max_count of them (None: all), minus those already done (in idx order)."""
    last = None if max_count is None else common.check_int("max_count", max_count)
    return [i for i in list(range(0, n, common.check_int("skip", skip)))[:last] if i not in done]


def keep_freed_memory():
    """Linux/glibc: keep freed memory in the process. glibc serves large blocks with mmap and unmaps them when
    freed, so every forward pass of a big batch faults in fresh pages; with mmap and trimming off the next pass
    reuses them (1.4-2x faster CPU certification, tools/bench.py), at the price of keeping the peak memory.
    Returns True where applied; elsewhere (macOS, Windows, musl) a no-op returning False."""
    import ctypes
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameter numbers
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 ** 30))
    except (OSError, AttributeError):
        return False


def distributed_setup(device_name):
    """Under torchrun: (rank, world size, device name for this rank); gloo carries the barrier only."""
    _, world = machinery.torchrun_env()
    if world == 1:
        return 0, 1, device_name
    import torch.distributed as dist
    # Start-up waits at most the default (a rank that died during start-up is noticed); only the final
    # barrier, where after a resume one rank may wait for another for hours, gets a group with a long timeout.
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    if torch.cuda.is_available() and device_name in (None, "cuda"):
        device_name = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    return dist.get_rank(), world, device_name


class Progress:
    """A progress line on stderr at most every `every` seconds: done/total, examples/s and ETA."""

    def __init__(self, total, every=5.0, prefix=""):
        self.total, self.every, self.prefix, self.start, self.last = total, every, prefix, time.time(), 0.0

    def update(self, done):
        if time.time() - self.last >= self.every or done == self.total:
            self.last = time.time()
            eta = machinery.format_eta(done, self.total, self.start)
            sys.stderr.write(f"{self.prefix}{done}/{self.total} examples, {eta}\n")


# ----------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------

def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    with contextlib.ExitStack() as locks:   # the output locks, released when the run ends
        certify_all(args, locks)


def certify_all(args, locks, sigma_of=None, extra_settings=None, radius_fn=None, prepare=None):
    """CERTIFY (or PREDICT) of every selected example into the outfile: set-up, checks, then the loop.

    sigma_of: optional callable(model, x, idx, sigma) -> the noise level of example idx (ddrs.py's per-input
    sigma); its value is written in an extra last column `sigma`. extra_settings: more checked settings.
    radius_fn: CERTIFY's radius from its bound (see certify). prepare: optional callable(settings, dataset
    name) run before the resume check, which may add settings (ddrs.py --semi-elastic's sigma function)."""
    rank, world, device_name = distributed_setup(args.device)
    run = load_run(args, device_name, sigma_of, extra_settings, prepare)
    selected, done, seed = claim_work(args, locks, run, rank, world)
    rank_lock = contextlib.ExitStack()   # released before the final barrier: rank 0 then merges the parts
    if world > 1:
        rank_lock.enter_context(machinery.exclusive_lock(f"{run.outfile}.rank{rank}.lock",
                                                         f"--outfile {run.outfile!r}"))
        # the final barrier may wait for hours (one rank resumed with more left to do): its own long timeout
        final_group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(days=7))
    if run.plan is not None:   # --radii: groups of examples share forward passes; a group is the unit of a rank's work
        size = args.group or grid.GROUP
        groups = [selected[g:g + size] for g in range(0, len(selected), size)]
        mine = [grp for k, grp in enumerate(groups) if k % world == rank and not set(grp) <= done]
    else:
        mine = [[i] for i in selected if i not in done][rank::world]
    total = sum(len([i for i in grp if i not in done]) for grp in mine)
    progress = Progress(total, prefix=f"rank 0 of {world}: " if world > 1 else "") if rank == 0 else None
    part = "" if world == 1 else f".rank{rank}"
    with machinery.open_append(run.outfile + part, "\t".join(run.columns), run.inputs) as out, \
            (machinery.open_append(run.counts[0] + part, "\t".join(run.counts[1]), run.inputs) if run.counts else
             contextlib.nullcontext(None)) as counts_out:
        if run.plan is not None:
            write_groups(args, run, mine, done, seed, out, counts_out, progress)
        else:
            write_examples(args, run, [grp[0] for grp in mine], seed, out, counts_out, progress, sigma_of, radius_fn)
    rank_lock.close()
    if world > 1:
        torch.distributed.barrier(group=final_group)
    if rank == 0:
        machinery.merge_parts(run.outfile, run.columns)
        if run.counts:
            machinery.merge_parts(*run.counts, "vote counts")
        machinery.record_written(run.outfile)   # the sidecar, the run's record, names what its files hold
    if world > 1:
        torch.distributed.destroy_process_group()


def train_seed(ckpt):
    """The --seed a training script recorded in the checkpoint's args, or None (a checkpoint from elsewhere)."""
    seed = (ckpt.get("args") or {}).get("seed") if isinstance(ckpt.get("args"), dict) else None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0 else None


def load_run(args, device_name, sigma_of=None, extra_settings=None, prepare=None):
    """certify_all's set-up, before anything is written: the model (fast_model), the data, the outfile, its
    columns, the grid plan, the settings its sidecar records, and the resume check. Returns a namespace."""
    device = machinery.get_device(device_name)
    machinery.check_precision(args.precision, device)
    if device.type == "cpu":
        keep_freed_memory()
    model, ckpt = readers.load_model(args.checkpoint, args.dataset, args.arch, device, args.trust_checkpoint,
                                       args.precision)
    dataset_name = args.dataset or ckpt.get("dataset")
    common.check(dataset_name is not None, f"checkpoint {args.checkpoint!r} names no dataset; pass --dataset")
    sigma = args.sigma if args.sigma is not None else ckpt.get("sigma")
    common.check(sigma is not None, f"checkpoint {args.checkpoint!r} stores no sigma; pass --sigma")
    machinery.check_sigma(sigma, f"the sigma stored in {args.checkpoint!r}" if args.sigma is None else "--sigma",
                          args.precision)
    sigma = float(sigma)
    dataset = common.get_dataset(dataset_name, args.split, args.data_dir, train_transform=False)
    outfile = args.outfile or default_outfile(args.checkpoint, sigma, args.split, args.predict,
                                              getattr(args, "default_folder", None))
    input_shape = tuple(dataset[0][0].shape)
    if args.batch == "auto":   # a number in the sidecar; a resumed log keeps its own (its draws' chunking)
        old = not args.overwrite and os.path.isfile(outfile + ".json") and \
            any(map(os.path.exists, [outfile] + machinery.part_files(outfile)))
        args.batch = common.auto_batch(model, input_shape, device, args.precision, common.batch_cap(
            args.N0, args.N, input_shape, machinery.MAX_BATCH_BYTES, args.early_abstain),
            readers.read_json_object(outfile + ".json", "settings file of a log").get("batch") if old else None)
    machinery.check_batch_bytes(min(args.batch, max(args.N, args.N0)), input_shape)
    columns = PREDICT_COLUMNS if args.predict else GRID_COLUMNS if args.radii is not None else CERTIFY_COLUMNS
    if args.label_mode:   # the log itself says that cA was the true label
        columns = columns + ("candidate",)
    if sigma_of is not None:
        columns = columns + ("sigma",)
    beta = grid.DEFAULT_BETA if args.beta is None else args.beta
    plan = None if args.radii is None else grid.grid_plan(args.radii, sigma, args.N, args.alpha, beta,
                                                          args.final_look, zero_level=args.zero_level)
    sha = readers.loaded_sha256(args.checkpoint)   # the bytes loaded, not read again
    common.check(sha is not None, f"the sha256 of checkpoint {args.checkpoint!r} is unknown; a log must name its model")
    num_classes = common.NUM_CLASSES[dataset_name]
    counts = (outfile + ".counts", ("idx",) + tuple(map(str, range(num_classes)))) if args.save_counts else None
    settings = {"script": getattr(args, "script", "certify.py"),
                "data": machinery.data_fingerprint(dataset_name, args.split, args.data_dir),
                "mode": "predict" if args.predict else "grid" if plan else "certify", "dataset": dataset_name,
                "split": args.split,
                # relative to the working directory: no machine's path in a published log; the hash identifies it
                "checkpoint": os.path.relpath(args.checkpoint),
                "checkpoint_sha256": sha,
                "arch": args.arch or ckpt.get("arch"), "sigma": sigma, "N": args.N, "alpha": args.alpha,
                # the training seed of the checkpoint (its --seed): compare pairs sides trained with the same seeds
                "train_seed": train_seed(ckpt),
                "N0": None if args.predict else args.N0,  # PREDICT has no selection step
                "seed": args.seed, "seed_value": None, "skip": args.skip,
                "candidate": "label" if args.label_mode else "selected", "batch": args.batch, "device_type": device.type,
                "precision": args.precision, "early_abstain": EARLY_ABSTAIN_ALPHA if args.early_abstain else False,
                "channels_last": is_convolutional(model) if args.channels_last is None else args.channels_last,
                "fold_bn": args.fold_bn, "compile": args.compile, "save_counts": args.save_counts,
                "sound": args.sound, "radii": plan["radii"] if plan else None, "beta": beta if plan else None,
                "final_look": args.final_look if plan else None, "grid_test": grid.GRID_TEST if plan else None,
                "columns": list(columns), "ddrs": None, "environment": machinery.environment(),
                **(extra_settings or {})}
    if prepare is not None:
        prepare(settings, dataset_name)
    inputs = [args.checkpoint]
    machinery.set_inputs(inputs)   # files this run reads: never written over (the guard checks every output)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(outfile)), exist_ok=True)
    except OSError as e:
        raise common.UserError(f"cannot create the folder of {outfile!r} ({e.strerror}); pass another --outfile")
    if machinery.get_rank() == 0:   # early, before compiling: the same check as prepare_outputs', read-only
        machinery.check_log(outfile, settings, columns, counts, inputs, args.overwrite)
    levels = common.DATASET_LEVELS[dataset_name] if args.sound else None
    if levels:   # before anything is written: the sound sampler needs inputs on the dataset's grid
        common.grid_levels(dataset[0][0], levels)
    shapes = pass_shapes(input_shape, args.N0, args.N, args.batch, args.predict)
    model = fast_model(model, settings["channels_last"], args.compile, shapes, args.precision, args.fold_bn)
    return argparse.Namespace(device=device, model=model, dataset=dataset, sigma=sigma, outfile=outfile,
                              columns=columns, plan=plan, num_classes=num_classes, counts=counts, settings=settings,
                              inputs=inputs, levels=levels)


def claim_work(args, locks, run, rank, world):
    """Rank 0, the single writer of the shared files, checks and locks the outputs, resolves the seed and
    writes the sidecar; every rank gets its (selected examples, those done, seed). What stops rank 0 stops all."""
    todo = [None]
    if rank == 0:
        try:
            machinery.lock_outputs(locks, run.outfile)
            seed = resolve_seed(args.seed, "" if args.overwrite else run.outfile + ".json")
            run.settings["seed_value"] = seed if args.seed == "random" else None   # recorded once the run starts
            done = machinery.prepare_outputs(run.outfile, run.settings, run.columns, args.overwrite, run.counts,
                                             run.inputs, world)
            todo = [(select_examples(len(run.dataset), args.skip, args.max, set()), done, seed)]
            print(f"{'predict' if args.predict else 'certify'}: {len(todo[0][0]) - len(done & set(todo[0][0]))} "
                  f"examples to go "
                  f"({len(done)} already in the files) -> {run.outfile}", flush=True)
        except common.UserError as e:
            todo = [str(e)]
    if world > 1:
        torch.distributed.broadcast_object_list(todo, src=0)  # every rank works on the same list
    if isinstance(todo[0], str):
        raise common.UserError(todo[0] if rank == 0 else f"rank 0 stopped: {todo[0]}")
    return todo[0]   # rank 0's selection, what is done and the seed, on every rank


def write_groups(args, run, mine, done, seed, out, counts_out, progress):
    """--radii: each group of examples through grid.grid_certify_many, its lines not yet written in idx order.
    The whole group runs again on a resume (its noise and packing are then those of the first run); time: the
    group's, shared evenly."""
    finished = 0
    for grp in mine:
        start = time.time()
        examples = [run.dataset[i] for i in grp]
        items = [(x.to(run.device), common.example_generator(seed, i, run.device), int(y) if args.label_mode else None)
                 for i, (x, y) in zip(grp, examples)]
        outs = grid.grid_certify_many(common.in_precision(run.model, args.precision), items, run.sigma, args.N0,
                                      args.batch, run.num_classes, run.plan,
                                      common.sound_copies(run.levels) if run.levels else common.gaussian_copies)
        seconds = (time.time() - start) / len(grp)
        for i, (_, y), res in zip(grp, examples, outs):
            if i in done:
                continue
            res["pA_lower"], res["pA_upper"] = grid.grid_interval(res, run.plan)
            if counts_out is not None:
                print("\t".join(map(str, [i] + res["counts"])), file=counts_out, flush=True)
            print(format_line(res, i, int(y), seconds, run.columns), file=out, flush=True)
            finished += 1
            if progress is not None:
                progress.update(finished)


def write_examples(args, run, indices, seed, out, counts_out, progress, sigma_of=None, radius_fn=None):
    """CERTIFY or PREDICT of each example in turn, one flushed line each (example_line)."""
    for k, idx in enumerate(indices):
        x, label = run.dataset[idx]
        votes = []
        s = run.sigma if sigma_of is None else sigma_of(run.model, x.to(run.device), idx, run.sigma)
        line = example_line(run.model, x.to(run.device), int(label), idx, s, args.N0, args.N, args.alpha,
                            args.batch, run.num_classes, seed, args.predict, args.precision,
                            EARLY_ABSTAIN_ALPHA if args.early_abstain else None,
                            run.columns if sigma_of is None else run.columns[:-1], votes, run.levels, run.plan,
                            args.label_mode, radius_fn)
        if sigma_of is not None:
            line += f"\t{s:.6g}"
        # the counts row first: after a stop between the two writes, the resume drops it (machinery.prepare_outputs)
        if counts_out is not None:
            print("\t".join(map(str, [idx] + votes[0])), file=counts_out, flush=True)
        print(line, file=out, flush=True)
        if progress is not None:
            progress.update(k + 1)


if __name__ == "__main__":
    machinery.run(main, exit_process=True)

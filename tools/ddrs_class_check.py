"""How often the class that ddrs.py optimises sigma_x for differs from the prediction of the model smoothed at
sigma_0 (Algorithm 1 of Alfarra et al. 2022 wants the latter). Before: the top class of OptimizeSigma's first step (one
noisy draw at M = 1, as DS2's training steps choose it); after: ddrs.smoothed_class. The
reference: the top class of REF_DRAWS hard votes at sigma_0 (its own seed), with how many of those are not
decided (two-sided binomial test of the top two at 0.01).

  python tools/ddrs_class_check.py --checkpoint CKPT [--data-dir DIR] [--skip 100] --out FILE.md
"""
import os
import sys

import torch
from scipy.stats import binomtest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import common  # noqa: E402
import machinery  # noqa: E402
import readers  # noqa: E402
import ddrs  # noqa: E402

REF_DRAWS = 10_000


def main(argv=None):
    p = machinery.ArgumentParser(description=__doc__)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data-dir")
    p.add_argument("--skip", type=int, default=1, help="every skip-th test image")
    p.add_argument("--seed", type=int, default=0, help="ddrs.py certify's --seed (its optimisation noise)")
    p.add_argument("--out", required=True, help="a Markdown file")
    p.add_argument("--trust-checkpoint", action="store_true", help="load a checkpoint that needs arbitrary "
                   "unpickling: this RUNS CODE the file holds; only for files you trust")
    args = p.parse_args(argv)
    common.check(args.skip >= 1, f"--skip must be >= 1 (got {args.skip})")
    machinery.set_inputs([args.checkpoint])
    model, ckpt = readers.load_model(args.checkpoint, trust=args.trust_checkpoint)
    sigma, name = float(ckpt["sigma"]), ckpt["dataset"]
    test = common.get_dataset(name, "test", args.data_dir, train_transform=False)
    k = common.NUM_CLASSES[name]
    before = after = undecided = n = 0
    with torch.inference_mode():
        for idx in range(0, len(test), args.skip):
            x = test[idx][0]
            ref = common.sample_counts(model, x.unsqueeze(0), sigma, REF_DRAWS, 1000, k,
                                       torch.Generator().manual_seed(1_000_003 + idx))[0]
            top2 = torch.topk(ref, 2).values.tolist()
            undecided += binomtest(top2[0], sum(top2), 0.5).pvalue > 0.01
            e = torch.randn((1, *x.shape), generator=ddrs.sigma_generator(args.seed, idx, "cpu"))
            first = int(model(x.unsqueeze(0) + sigma * e).argmax(1))   # the first step's draw at M = 1
            c, _ = ddrs.smoothed_class(model, x, sigma, k, ddrs.sigma_generator(args.seed, idx, "cpu",
                                                                               ddrs.CLASS_STREAM))
            before += first != int(ref.argmax())
            after += c != int(ref.argmax())
            n += 1
    text = (f"{args.checkpoint} ({name}, sigma_0 {sigma:g}), {n} test images" +
            (f" (every {args.skip}th)" if args.skip > 1 else "") + ": the class "
            f"sigma_x is optimised for differs from the smoothed prediction at sigma_0 ({REF_DRAWS:,} draws; "
            f"{undecided} of them near a tie, not decided at 0.01) on {before} images with the first step's "
            f"draw (before) and {after} with ddrs.smoothed_class (after).\n")
    machinery.write_text_output(args.out, "DDRS class check", text, [args.checkpoint])
    print(text, end="")


if __name__ == "__main__":
    machinery.run(main, exit_process=True)

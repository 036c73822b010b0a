"""Does the demo's headline stand with other training seeds? Trains the demo's pair (Gaussian training and the
paper's method at sigma 0.25, digits, the demo's settings) with each seed, certifies both as the demo does, and
checks the demo's verdict (tools/demo_report.py: ACR beyond noise higher, P(pA >= 0.99) beyond noise higher,
hard inputs not helped beyond noise) on each seed's pair. Two lanes of one thread, as the demo.

    python tools/demo_seeds.py --seeds 1 2 3 4 --out results/demo/seeds.md      (about 10 minutes)
"""
import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))                   # demo_report
import analyze  # noqa: E402
import common  # noqa: E402
import machinery  # noqa: E402
import readers  # noqa: E402
import demo_report  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lane(script, seed, folder, epochs, N, extra=()):
    """Train one model with `seed` and certify every test digit, as scripts/demo.sh does; returns the log."""
    name = f"{os.path.basename(script).split('_')[1].replace('.py', '')}_seed{seed}"
    run, log = os.path.join(folder, "train", name), os.path.join(folder, "certify", f"{name}_sigma0.25.tsv")
    cmd = (f"{sys.executable} {script} --dataset digits --epochs {epochs} --sigma 0.25 --seed {seed} "
           f"--outdir {run} {' '.join(extra)} && {sys.executable} certify.py --checkpoint {run}/checkpoint.pth.tar "
           f"--N {N} --alpha 0.001 --batch 2500 --outfile {log}")
    return log, subprocess.Popen(cmd, shell=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def main(argv=None):
    p = machinery.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--epochs", type=int, default=20, help="the demo's DEMO_EPOCHS")
    p.add_argument("--N", type=int, default=10_000, help="the demo's DEMO_N")
    p.add_argument("--folder", default="runs/demo_seeds", help="models and logs (resumed where complete)")
    p.add_argument("--out", help="the summary (markdown)")
    args = p.parse_args(argv)
    common.check(args.epochs >= 1 and args.N >= 1, f"--epochs and --N must be >= 1 (got {args.epochs}, {args.N})")
    common.check(all(s >= 0 for s in args.seeds), f"--seeds must be >= 0 (got {args.seeds})")
    start, rows, stands = time.time(), [], 0
    for seed in args.seeds:
        logs = {}
        jobs = [lane("train_gaussian.py", seed, args.folder, args.epochs, args.N),
                lane("train_ours.py", seed, args.folder, args.epochs, args.N)]
        for log, job in jobs:
            _, err = job.communicate()
            common.check(job.returncode == 0, f"seed {seed}: {err.strip().splitlines()[-1] if err.strip() else ''}")
        for (log, _), label in zip(jobs, ("gaussian", "ours")):
            logs[label] = analyze.attach_pA(analyze.load_logs([log], [label]), None, None)[0]
        readers.check_comparable([logs["gaussian"], logs["ours"]], (), "tools/demo_seeds.py")
        ref, s = demo_report.summarise(logs["gaussian"]), demo_report.summarise(logs["ours"])
        c = demo_report.against_reference(s, ref)
        holds = c["acr_up"] and c["easy_up"] and not c["hard_helped"]
        stands += holds
        cell = lambda m, points=True: demo_report.difference(c, m, points)
        rows.append([str(seed), cell("ACR", False), cell("P(pA≥0.99)"), cell("clean accuracy"), cell("P(pA<0.5)"),
                     "stands" if holds else "does not stand"])
        print(f"seed {seed}: {rows[-1][-1]} ({time.time() - start:.0f} s)", flush=True)
    text = (f"# The demo's headline with other training seeds\n\nCommand: `python tools/demo_seeds.py --seeds "
            f"{' '.join(map(str, args.seeds))} --out {args.out}` ({(time.time() - start) / 60:.0f} min). Each "
            f"seed trains the demo's pair at σ = 0.25 ({args.epochs} epochs, digits) and certifies its 360 test "
            f"digits at N = {args.N:,}; the verdict is the demo's (tools/demo_report.py): ACR higher, P(pA ≥ "
            f"0.99) higher and hard inputs not helped, each beyond noise (95 % simultaneous intervals of "
            f"analyze.py compare, paired over the digits, ours − Gaussian).\n\nMade with: "
            f"{machinery.environment_line()}.\n\n" +
            analyze.markdown(["seed", "ACR", "P(pA ≥ 0.99), points", "clean accuracy, points", "P(pA < 0.5), points",
                              "headline"], rows) +
            f"\n\nThe headline stands for {stands} of {len(args.seeds)} seeds.\n")
    if args.out:
        machinery.write_text_output(args.out, "demo seeds summary", text)
    print(text)


if __name__ == "__main__":
    machinery.run(main, exit_process=True)

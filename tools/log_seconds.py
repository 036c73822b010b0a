"""Seconds per image of certification logs, from their time column: what docs/paper_scale.md scales its time
estimates from (the paper's published logs; results/paper_logs/certify_seconds.md).

  python tools/log_seconds.py LOG [LOG ...] --out FILE.md
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import common  # noqa: E402
import readers  # noqa: E402
import machinery  # noqa: E402


def main(argv=None):
    p = machinery.ArgumentParser(description=__doc__)
    p.add_argument("logs", nargs="+", help="certification logs (Cohen's format: a time column)")
    p.add_argument("--out", required=True, help="a Markdown file")
    args = p.parse_args(argv)
    machinery.set_inputs(args.logs)
    rows = ["| log | images | mean s | median s | total h |", "|---|---|---|---|---|"]
    for path in args.logs:
        cols = readers.read_table(path, ("idx", "time"), ())
        seconds = np.array([readers.log_seconds(t, f"{path} line {line}") for t, line in zip(cols["time"],
                                                                                          cols["_line"])])
        common.check(len(seconds) > 0, f"{path}: no examples (only a header)")
        rows.append(f"| {path} | {len(seconds)} | {seconds.mean():.2f} | {np.median(seconds):.2f} | "
                    f"{seconds.sum() / 3600:.1f} |")
    text = "Seconds per image of certification (the logs' time column):\n\n" + "\n".join(rows) + "\n"
    machinery.write_text_output(args.out, "seconds per image", text, args.logs)
    print(text, end="")


if __name__ == "__main__":
    machinery.run(main, exit_process=True)

"""Remove a folder tree that holds only what this project wrote (machinery.remove_outputs); anything else in
it stops the removal before a file goes. Usage: python tools/remove_outputs.py FOLDER [--also NAME ...]."""
import signal

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)   # Ctrl-C during the imports: no traceback

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import machinery  # noqa: E402


def main(argv=None):
    p = machinery.ArgumentParser(description=__doc__)
    p.add_argument("folder")
    p.add_argument("--also", nargs="*", default=[], help="more file names at the top that the caller made")
    args = p.parse_args(argv)
    if os.path.lexists(args.folder):
        machinery.remove_outputs(args.folder, args.also)


if __name__ == "__main__":
    machinery.run(main, exit_process=True)

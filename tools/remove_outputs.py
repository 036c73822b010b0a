"""Remove a folder tree that holds only the files its record lists (machinery.remove_tree), or write that record
(--record: machinery.record_tree); anything else in the tree stops the removal before a file goes.
Usage: python tools/remove_outputs.py [--record] FOLDER."""
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
    p.add_argument("--record", action="store_true", help="write the record of every file now in the folder")
    args = p.parse_args(argv)
    if args.record:
        machinery.record_tree(args.folder)
    elif os.path.lexists(args.folder):
        machinery.remove_tree(args.folder)


if __name__ == "__main__":
    machinery.run(main, exit_process=True)

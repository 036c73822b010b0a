"""Remove a folder tree that holds only the files its record lists, or write that record (--record). Anything
else in the tree (a user's file, a link, a FIFO, a changed file, or no record: an interrupted demo) stops the
removal before a file goes: scripts/demo.sh starts afresh this way, not with rm -rf.
Usage: python tools/remove_outputs.py [--record] FOLDER."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import machinery  # noqa: E402
import readers  # noqa: E402

RECORD = ".demo"   # the folder's record: {path relative to the folder: sha256} of every file the demo wrote


def record_tree(folder):
    """Write the record of the folder tree `folder` (as the demo ends): every file in it with its sha256."""
    path = os.path.join(folder, RECORD)
    if os.path.lexists(path) and not (os.path.isfile(path) and os.path.getsize(path) == 0):   # empty: the demo's
        # marker; a record of ours maps file names to sha256s; anything else is a user's file
        try:
            old = readers.read_json_object(path, "record of a folder")
        except common.UserError:
            old = None
        common.check(isinstance(old, dict) and all(isinstance(v, str) and len(v) == 64 for v in old.values()),
                     f"{path!r} exists and is not a record of this project; move it away")
    files = {os.path.relpath(os.path.join(root, name), folder): machinery.file_sha256(os.path.join(root, name))
             for root, _, names in os.walk(folder) for name in sorted(names) if name != RECORD}
    machinery.write_json(files, path, "record of a folder")


def remove_tree(folder):
    """Remove the folder tree `folder` if it holds only the files its record lists, each with its content."""
    record = readers.read_json_object(os.path.join(folder, RECORD), "record of a folder")
    files, folders, foreign = [], [], []
    for root, dirs, names in os.walk(folder):   # os.walk does not enter links to folders
        folders.append(root)
        for path in (os.path.join(root, n) for n in names + [d for d in dirs if os.path.islink(os.path.join(root, d))]):
            key = os.path.relpath(path, folder)
            ours = key == RECORD or (os.path.isfile(path) and not os.path.islink(path)
                                     and record.get(key) == machinery.file_sha256(path))
            (files if ours else foreign).append(path)
    more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
    common.check(not foreign, f"{folder!r} holds files this project did not write, or that changed since: "
                              f"{', '.join(foreign[:3])}{more}; move them away, or choose another folder")
    for path in files:
        machinery.remove_output(path)
    for root in sorted(folders, key=len, reverse=True):
        os.rmdir(root)


def main(argv=None):
    p = machinery.ArgumentParser(description=__doc__)
    p.add_argument("folder")
    p.add_argument("--record", action="store_true", help="write the record of every file now in the folder")
    args = p.parse_args(argv)
    if args.record:
        record_tree(args.folder)
    elif os.path.lexists(args.folder):
        remove_tree(args.folder)


if __name__ == "__main__":
    machinery.run(main, exit_process=True)

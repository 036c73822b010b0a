"""Copy the first few CIFAR-10 images of each class into a small image folder a GPU machine can be sent.

Usage: python tools/cifar_subset.py --source /path/to/cifar10 [--dest data/cifar10_small] [--train 300] [--test 10]

--source holds the JPEG image folders train/<class>/*.jpg and test/<class>/*.jpg (common.get_dataset reads that
layout); --dest receives the first --train (--test) files of each class, in file-name order, in the same layout:
3,000 training and 100 test images by default, about 3 MiB, the data of `make gpu-check`'s paper-scale part
(tools/gpu_check.py --data-dir data/cifar10_small). data/ is ignored by git: pass the folder to the GPU machine
as carried, never commit it. Each image goes through the output guard (machinery.write_output): a rerun writes
the same images again, and a destination holding other images or files this tool did not write is refused.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402
import machinery  # noqa: E402
import readers  # noqa: E402


def parse_args(argv=None):
    p = machinery.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="CIFAR-10 as image folders: train/<class>/, test/<class>/")
    p.add_argument("--dest", default=os.path.join("data", "cifar10_small"), help="the folder to create")
    p.add_argument("--train", type=int, default=300, help="training images per class (default 300)")
    p.add_argument("--test", type=int, default=10, help="test images per class (default 10)")
    args = p.parse_args(argv)
    common.check(args.train >= 1 and args.test >= 1, f"--train and --test must be >= 1 (got {args.train}, {args.test})")
    return args


def subset(source, per_split):
    """{relative path: source path} of the first per_split[split] files of every class folder of each split."""
    files = {}
    for split, count in per_split.items():
        folder = os.path.join(source, split)
        common.check(os.path.isdir(folder), f"{folder!r} is not a folder: --source must hold train/ and test/")
        classes = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))
        common.check(len(classes) == common.NUM_CLASSES["cifar10"],
                     f"{folder!r} has {len(classes)} class folders, CIFAR-10 has {common.NUM_CLASSES['cifar10']}")
        for name in classes:
            images = sorted(f for f in os.listdir(os.path.join(folder, name)) if not f.startswith("."))
            common.check(len(images) >= count, f"{os.path.join(folder, name)!r} holds {len(images)} images, "
                                               f"fewer than the {count} asked for")
            for f in images[:count]:
                files[os.path.join(split, name, f)] = os.path.join(folder, name, f)
    return files


def existing_images(dest):
    """The files under dest (relative paths), hidden ones (the guard's records) left out, as the loader does."""
    return {os.path.relpath(os.path.join(d, f), dest) for d, _, names in os.walk(dest) for f in names
            if not f.startswith(".")}


def main(argv=None):
    args = parse_args(argv)
    files = subset(args.source, {"train": args.train, "test": args.test})
    other = sorted(existing_images(args.dest) - set(files)) if os.path.isdir(args.dest) else []
    common.check(not other, f"{args.dest!r} holds other images than this subset ({', '.join(other[:2])}, ...): "
                            f"the dataset would be another one; remove the folder or pass another --dest")
    size = 0
    for rel, src in files.items():   # through the guard: it writes over nothing this tool did not write
        data = readers.read_bytes(src)
        size += len(data)
        machinery.write_output(os.path.join(args.dest, rel), "dataset image", lambda f, data=data: f.write(data))
    print(f"copied {len(files)} images ({args.train} training and {args.test} test images a class, "
          f"{size / 2 ** 20:.1f} MiB) to {args.dest}")


if __name__ == "__main__":
    machinery.run(main, exit_process=True)

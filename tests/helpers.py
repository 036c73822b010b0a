"""Small shared test helpers: a briefly trained digits model, so that certificates differ between examples."""
import torch
import torch.nn.functional as F

import common
import machinery


def train_digits_model(arch="lenet", sigma=0.25, steps=100, seed=0):
    """arch trained for `steps` SGD steps (64 digits each) under Gaussian noise sigma; returns it in eval mode."""
    torch.manual_seed(seed)
    model = common.get_architecture(arch, "digits")
    train = common.get_dataset("digits", "train")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(steps):
        i = torch.randint(0, len(train), (64,))
        x, y = train.images[i], train.labels[i]
        loss = F.cross_entropy(model(x + sigma * torch.randn_like(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def digits_checkpoint(path, arch="lenet", sigma=0.25, steps=100, seed=0):
    """A checkpoint file of train_digits_model at path (as our training scripts write them); returns path."""
    model = train_digits_model(arch, sigma, steps, seed)
    machinery.save_checkpoint({"arch": arch, "dataset": "digits", "sigma": sigma, "state_dict": model.state_dict()},
                              str(path))
    return str(path)


def run_main(main, argv):
    """main(argv) as its command line runs it (through machinery.run), in this process; returns the exit code."""
    try:
        machinery.run(lambda: main([str(a) for a in argv]))
    except SystemExit as e:
        return e.code
    return 0


# Folders that a user's machine puts inside a clone and that are never the project's own, for a tree that is not a
# git checkout (a downloaded archive): local environments, caches, outputs.
NOT_THE_PROJECT = {".git", ".venv", "venv", "env", ".env", ".tox", ".nox", ".mypy_cache", ".pytest_cache",
                   ".hypothesis", "__pycache__", "runs", "data", "node_modules"}


def project_files(root):
    """The project's files under root, relative paths: what git tracks plus new files it does not ignore (git's
    own reading of .gitignore), so a virtual environment or outputs inside the clone are never scanned as the
    project. Outside a git checkout: every file, skipping NOT_THE_PROJECT and any folder holding pyvenv.cfg."""
    import os
    import subprocess
    try:
        done = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                              capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        done = None
    if done is not None and done.returncode == 0 and os.path.isdir(os.path.join(str(root), ".git")):
        names = [n for n in done.stdout.decode().split("\0") if n]
        return sorted(n for n in names if os.path.isfile(os.path.join(str(root), n)))   # deleted ones drop out
    found = []
    for folder, dirs, names in os.walk(str(root)):
        dirs[:] = [d for d in dirs if d not in NOT_THE_PROJECT
                   and not os.path.isfile(os.path.join(folder, d, "pyvenv.cfg"))]
        found += [os.path.relpath(os.path.join(folder, n), str(root)) for n in names]
    return sorted(found)


def as_recorded(*paths):
    """Make the sidecars among `paths` record the files of their log as they are now ("written"), as the run
    would have had it stopped here: a test that edits a log or sidecar by hand to play a stopped run's files uses
    this, since an edit of what a sidecar records is refused as an edit."""
    import json
    import os
    import machinery
    import readers
    for path in map(str, paths):
        if path.endswith(".json"):
            side, log = json.load(open(path)), path[:-len(".json")]
            files = [p for p in [log, log + ".counts"] + machinery.part_files(log) +
                     machinery.part_files(log + ".counts") if os.path.isfile(p)]
            side["written"] = {os.path.basename(p): {"size": os.path.getsize(p), "sha256": machinery.file_sha256(p)}
                               for p in files}
            side["written"][os.path.basename(path)] = readers.settings_sha256(side)
            with open(path, "w") as f:
                json.dump(side, f)


def as_written(side, path):
    """A sidecar edited as another run would have written it: its record of its own settings follows the edit."""
    import os
    import readers
    if isinstance(side.get("written"), dict):
        for name in [k for k, v in side["written"].items() if isinstance(v, str)]:
            del side["written"][name]
        side["written"][os.path.basename(path)] = readers.settings_sha256(side)
    return side

"""Every docs page's first steps run, in order, on what a fresh clone has (at tiny scale): the commands of its
first code block, with the sizes shrunk (epochs, N, examples) and the lines that name data a clone lacks
(CKPT, DATA, /data/...) left out. `make demo` and `make gpu-check` run shrunk in tests/test_demo.py and
tests/test_commands.py."""
import json
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACEHOLDER = re.compile(r"\bCKPT\b|\bDATA\b|DATA_DIR=/|scripts/table\d")
COVERED_ELSEWHERE = ("make demo", "make gpu-check")
PAGES = sorted(f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md") and f != "python.md")


def first_block(page):
    """The command lines of a page's first code block (continuation lines joined, comments dropped)."""
    with open(os.path.join(ROOT, "docs", page)) as f:
        blocks = re.findall(r"```[a-z]*\n(.*?)```", f.read(), flags=re.S)
    if not blocks:
        return []
    lines = re.sub(r"\\\n\s*", " ", blocks[0]).splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.strip()]


def set_flag(words, flag, value):
    """words with `flag value` set (replaced where present, appended otherwise)."""
    if flag in words:
        i = words.index(flag)
        return words[:i + 1] + [str(value)] + words[i + 2:]
    return words + [flag, str(value)]


def tiny(words):
    """A command at tiny scale: one epoch of two batches, N = 100 with N0 = 20, three examples, 5 sigma steps."""
    script = words[1] if words[0] == "python" and len(words) > 1 else ""
    sub = words[2] if len(words) > 2 else ""
    if script.startswith("train_") or (script == "ddrs.py" and sub == "train"):
        words = set_flag(set_flag(set_flag(words, "--epochs", 1), "--max-batches", 2), "--workers", 0)
        if script == "ddrs.py":
            words = set_flag(words, "--warmup", 0)
    if script == "certify.py" or (script == "ddrs.py" and sub == "certify"):
        words = set_flag(set_flag(set_flag(words, "--N", 100), "--N0", 20), "--max", 3)
        if script == "ddrs.py":
            words = set_flag(words, "--K", 5)
    return words


@pytest.fixture
def clone(tmp_path):
    """A folder that looks like a fresh clone (the project's files, linked) with nothing made yet: one per page,
    since every page starts from nothing (two pages train the same run folder)."""
    folder = tmp_path / "clone"
    folder.mkdir()
    for name in os.listdir(ROOT):
        if name in (".git", "runs", ".hypothesis", ".pytest_cache") or name.startswith("__"):
            continue
        os.symlink(os.path.join(ROOT, name), folder / name)
    return folder


@pytest.mark.parametrize("page", PAGES)
def test_the_first_steps_of_every_docs_page_run_in_order(page, clone, tmp_path):
    """The page's commands run in order in one Python process (tests/docs_runner.py: each script as
    `python script.py` runs it, make and bash as child processes): one torch import per page, not per step."""
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", RUNS=str(clone / "runs" / "paper"))
    published = os.path.join(os.path.dirname(ROOT), "shared", "reference", "acr-weakness")
    if os.path.isdir(published):                   # this workspace's copy of the paper's logs (make ecdf, budget)
        env["PUBLISHED"] = published
    commands = []
    for words in first_block(page):
        line = " ".join(words)
        if not words or PLACEHOLDER.search(line) or line.startswith(COVERED_ELSEWHERE):
            continue
        step_env = {}
        while re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            key, value = words.pop(0).split("=", 1)
            step_env[key] = value
        words = [sys.executable if w == "python" else w for w in tiny(["python" if w == "python" else w
                                                                       for w in words])]
        commands.append((step_env, words))
    if page not in ("cpu_results.md", "reliability.md", "demo.md", "speed.md", "grid.md"):
        assert commands, f"{page}: no first step to run"
    if not commands:
        return
    (tmp_path / "commands.json").write_text(json.dumps(commands))
    runner = os.path.join(ROOT, "tests", "docs_runner.py")
    done = subprocess.run([sys.executable, runner, str(tmp_path / "commands.json"), str(tmp_path / "results.json")],
                          cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    results = json.loads((tmp_path / "results.json").read_text()) if (tmp_path / "results.json").exists() else []
    assert done.returncode == 0 and len(results) == len(commands), (page, done.stderr[-3000:], results[-1:])
    for (_, words), result in zip(commands, results):
        line, stderr = " ".join(words), result["stderr"]
        err = [e for e in stderr.splitlines() if e.startswith(("error", "Traceback")) or "Error" in e]
        if result["returncode"] == 2 and words[0] == "make":
            # a make target whose input a fresh clone lacks says which command makes it, in one line
            assert len([e for e in stderr.splitlines() if "missing" in e or "no logs" in e]) == 1, stderr
            continue
        assert result["returncode"] == 0 and "Traceback" not in stderr, (page, line, stderr[-2000:])
        assert not err, (page, line, err)


def test_the_python_page_runs_as_one_script_and_quotes_the_copy_sizes(clone):
    """docs/python.md: its python blocks, in order, are one script that runs from a fresh clone's root; each
    heading's line counts are what a student pastes (tests/test_paste.py's count)."""
    from test_paste import pasted
    text = open(os.path.join(ROOT, "docs", "python.md"), encoding="utf-8").read()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 6
    (clone / "python_md.py").write_text("\n".join(blocks))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "python_md.py"], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ACR" in done.stdout and "handed back in train mode: True" in done.stdout, done.stdout
    quoted = 0
    for heading in re.findall(r"^## .*$", text, flags=re.M):
        module = None
        for name, count in re.findall(r"`([\w.]+)`: (\d+)", heading):
            module, _, block = name.rpartition(".") if "." in name else (module, "", name)
            assert pasted([f"{module}:{block}"])[1] == int(count), (heading, name)
            quoted += 1
    assert quoted >= 10
    assert f"the two take {pasted(['grid:grid_certify', 'grid:grid_plan'])[1]} lines" in text


CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def test_the_readme_flow_runs_as_written_on_cifar10_in_data(clone, tmp_path):
    """README's first block (train_ours.py, certify.py, analyze.py: the paper's method end to end) runs in order
    from a fresh clone whose ./data holds CIFAR-10 as image folders (here two random images a class), each line
    as written except tiny()'s sizes; certify.py reads the checkpoint training wrote, analyze.py the log."""
    from PIL import Image
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        block = re.findall(r"```[a-z]*\n(.*?)```", f.read(), flags=re.S)[0]
    lines = [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]
    assert [words[1] for words in lines] == ["train_ours.py", "certify.py", "analyze.py", "analyze.py"], lines
    assert lines[0] == ["python", "train_ours.py", "--sigma", "0.5", "--Et", "70", "--pt", "0.4"]   # the card's
    if os.path.lexists(clone / "data"):
        os.unlink(clone / "data")                  # a link to this checkout's own data: the test makes its own
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for name in CIFAR10_CLASSES:
            folder = clone / "data" / split / name
            folder.mkdir(parents=True)
            for i in range(2):
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    commands = [({}, [sys.executable if w == "python" else w for w in tiny(words)]) for words in lines]
    (tmp_path / "commands.json").write_text(json.dumps(commands))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RS_DATA_DIR", None)                   # ./data, as the README says
    runner = os.path.join(ROOT, "tests", "docs_runner.py")
    done = subprocess.run([sys.executable, runner, str(tmp_path / "commands.json"), str(tmp_path / "results.json")],
                          cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    results = json.loads((tmp_path / "results.json").read_text()) if (tmp_path / "results.json").exists() else []
    assert done.returncode == 0 and [r["returncode"] for r in results] == [0] * len(lines), (done.stderr[-2000:],
                                                                                             results[-1:])
    log = (clone / "runs" / "ours_noise_0.5.tsv").read_text().splitlines()
    assert log[0].split("\t")[:6] == ["idx", "label", "predict", "radius", "correct", "time"] and len(log) == 4
    assert (clone / "runs" / "ours_ecdf" / "ecdf.md").is_file()

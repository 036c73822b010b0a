"""What the machinery resumes or analyses it verifies, and the process around a command never turns finished work
into a wrong result, a traceback or a silent stop: edited logs and sidecars against their recorded hashes, the
checkpoint's hash of the bytes loaded, rows that claim more than their counts, separators in labels, closed
and broken streams, out of memory from torch's allocator, and --help of every script and subcommand."""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import analyze
import certify
import common
import machinery
import readers
from helpers import digits_checkpoint, run_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG = os.path.join(ROOT, "results", "cifar10_cpu", "certify", "gaussian_noise_0.5.tsv")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return digits_checkpoint(tmp_path_factory.mktemp("ckpt") / "c.pth.tar", steps=20)


def certify_argv(ckpt, out, n):
    return ["--checkpoint", ckpt, "--N0", "10", "--N", "200", "--batch", "200", "--device", "cpu", "--max", str(n),
            "--outfile", str(out)]


def edit_cell(path, row, column, value):
    lines = open(path).read().split("\n")
    header = lines[0].split("\t")
    cells = lines[row].split("\t")
    cells[header.index(column)] = value
    lines[row] = "\t".join(cells)
    open(path, "w").write("\n".join(lines))


@pytest.mark.parametrize("what", ["radius", "sidecar"])
def test_a_log_or_sidecar_edited_by_hand_is_not_resumed_though_the_sidecar_claims_it(what, ckpt, tmp_path, capsys):
    out = tmp_path / "log.tsv"
    assert run_main(certify.main, certify_argv(ckpt, out, 4)) == 0
    if what == "radius":
        edit_cell(out, 2, "radius", "0.9")
    else:
        side = json.load(open(str(out) + ".json"))
        side["note"] = "edited"
        open(str(out) + ".json", "w").write(json.dumps(side))
    before = out.read_bytes()
    capsys.readouterr()
    assert run_main(certify.main, certify_argv(ckpt, out, 8)) == 2   # a larger --max: the log would grow
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "changed since" in err[0], err
    assert out.read_bytes() == before


def test_the_checkpoint_hash_is_of_the_bytes_loaded_even_if_the_file_is_replaced_after(ckpt, tmp_path, monkeypatch):
    """A training run saving its next epoch (an atomic rename) between the load and the record: the record must
    name the model that certified the rows."""
    mine = tmp_path / "c.pth.tar"
    shutil.copy(ckpt, mine)
    loaded = hashlib.sha256(mine.read_bytes()).hexdigest()
    other = digits_checkpoint(tmp_path / "other.pth.tar", steps=5, seed=3)
    real = readers.load_model

    def load_then_replace(path, *a, **k):
        result = real(path, *a, **k)
        os.replace(other, mine)   # the next epoch lands now
        return result
    monkeypatch.setattr(readers, "load_model", load_then_replace)
    out = tmp_path / "log.tsv"
    assert run_main(certify.main, certify_argv(str(mine), out, 2)) == 0
    side = json.load(open(str(out) + ".json"))
    assert side["checkpoint_sha256"] == loaded != machinery.file_sha256(str(mine))


def test_the_checkpoint_hash_through_a_link_flipped_after_the_read_is_that_of_the_bytes_loaded(ckpt, tmp_path,
                                                                                               monkeypatch):
    """A "latest" link replaced by another process while certify.py runs: the sidecar names the model whose
    bytes were loaded, never null (the hash is kept by the path as given, not by where the link points)."""
    mine, other = tmp_path / "a.pth.tar", tmp_path / "b.pth.tar"
    shutil.copy(ckpt, mine)
    digits_checkpoint(other, steps=5, seed=3)
    link = tmp_path / "latest.pth.tar"
    os.symlink(mine, link)
    real = readers.load_model

    def load_then_flip(path, *a, **k):
        result = real(path, *a, **k)
        os.remove(link)
        os.symlink(other, link)
        return result
    monkeypatch.setattr(readers, "load_model", load_then_flip)
    out = tmp_path / "log.tsv"
    assert run_main(certify.main, certify_argv(str(link), out, 2)) == 0
    side = json.load(open(str(out) + ".json"))
    assert side["checkpoint_sha256"] == hashlib.sha256(mine.read_bytes()).hexdigest()


def test_a_sidecar_without_the_checkpoint_hash_is_not_resumed(ckpt, tmp_path, capsys):
    from helpers import as_recorded
    out = tmp_path / "log.tsv"
    assert run_main(certify.main, certify_argv(ckpt, out, 2)) == 0
    side = json.load(open(str(out) + ".json"))
    side["checkpoint_sha256"] = None
    open(str(out) + ".json", "w").write(json.dumps(side))
    as_recorded(str(out) + ".json")
    before = out.read_bytes()
    capsys.readouterr()
    assert run_main(certify.main, certify_argv(ckpt, out, 4)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint_sha256" in err[0], err
    assert out.read_bytes() == before


def test_overwrite_leaves_no_file_of_the_replaced_run(ckpt, tmp_path):
    """--save-counts at N = 200, then --overwrite at N = 300 without it: the old vote counts go with the log."""
    out = tmp_path / "log.tsv"
    assert run_main(certify.main, certify_argv(ckpt, out, 2) + ["--save-counts"]) == 0
    assert (tmp_path / "log.tsv.counts").exists()
    argv = certify_argv(ckpt, out, 2)
    argv[argv.index("--N") + 1] = "300"
    assert run_main(certify.main, argv + ["--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.tsv", "log.tsv.json"]
    assert json.load(open(str(out) + ".json"))["N"] == 300


def test_a_row_whose_radius_exceeds_its_counts_is_refused_by_every_analysis(tmp_path, capsys):
    log = tmp_path / "gaussian_noise_0.5.tsv"
    shutil.copy(LOG, log)
    shutil.copy(LOG + ".json", str(log) + ".json")
    argv_of = {"table": ["table", log, "--out", tmp_path / "t"], "envelope": ["envelope", log, "--out", tmp_path / "e"],
               "ecdf": ["ecdf", log, "--out", tmp_path / "c"], "compare": ["compare", log, log, "--out", tmp_path / "p"]}
    assert run_main(analyze.main, argv_of["table"]) == 0    # the committed log passes
    edit_cell(log, 3, "radius", "5.0")                         # the example: ACR 0.135 -> 1.076 otherwise
    for name, argv in argv_of.items():
        capsys.readouterr()
        assert run_main(analyze.main, argv) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "more than its nA" in err[0] and "idx 40" in err[0], (name, err)
    assert not (tmp_path / "e").exists() and not (tmp_path / "c").exists()


@pytest.mark.parametrize("label", ["ours\tv2", "ours|v2", "a\nb", "x\r"])
def test_a_label_that_would_break_a_table_is_refused_before_writing(label, tmp_path, capsys):
    out = tmp_path / "out"
    for argv in (["table", LOG, "--labels", label, "--out", out],
                 ["compare", LOG, LOG, "--labels", label, "b", "--out", out]):
        assert run_main(analyze.main, argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "would break the tables" in err[0], err
        assert not out.exists() or os.listdir(out) == []


def test_a_file_name_that_would_break_a_table_is_refused_as_a_default_label(tmp_path, capsys):
    log = tmp_path / "ours|v2_noise_0.5.tsv"
    shutil.copy(LOG, log)
    assert run_main(analyze.main, ["table", log, "--out", tmp_path / "out"]) == 2
    assert "would break the tables" in capsys.readouterr().err
    assert run_main(analyze.main, ["table", log, "--labels", "ours", "--out", tmp_path / "out"]) == 0   # the way out


@pytest.mark.parametrize("how", ["closed", "broken"])
def test_a_closed_or_broken_stdout_never_stops_or_fails_the_work(how, tmp_path):
    out = tmp_path / "out"
    argv = [sys.executable, os.path.join(ROOT, "analyze.py"), "table", LOG, "--out", str(out)]
    if how == "closed":
        done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300,
                              preexec_fn=lambda: os.close(1))
        err = done.stderr
    else:   # the reader has gone before the first line is written
        reader, writer = os.pipe()
        os.close(reader)
        proc = subprocess.Popen(argv, stdout=writer, stderr=subprocess.PIPE, text=True)
        os.close(writer)
        err = proc.communicate(timeout=300)[1]
        done = proc
    assert done.returncode == 0 and "Traceback" not in err and "rror" not in err, err
    assert sorted(os.listdir(out)) == sorted(["table.md", "table.tex", "table.tsv", "certified_accuracy.png",
                                              "certified_accuracy.pdf", "outputs.json"])


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
                                   RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't "
                                                "allocate memory: you tried to allocate 8589934592 bytes"),
                                   MemoryError()])
def test_any_out_of_memory_is_one_line_naming_the_size_flags_of_that_command(error, ckpt, tmp_path, monkeypatch,
                                                                            capsys):
    def no_memory(*a, **k):
        raise error
    monkeypatch.setattr(common, "sample_counts", no_memory)
    monkeypatch.setattr(certify, "sampler_of", lambda *a, **k: no_memory)
    assert run_main(certify.main, certify_argv(ckpt, tmp_path / "log.tsv", 2)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: out of memory; lower --batch or --N"), err


def test_a_runtime_error_that_is_not_memory_is_not_dressed_as_one():
    assert not machinery.is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert machinery.is_out_of_memory(torch.OutOfMemoryError("x")) and machinery.is_out_of_memory(MemoryError())


def scripts_and_subcommands():
    cases = [[name] for name in sorted(os.listdir(ROOT)) if name.endswith(".py") and name not in
             ("common.py", "machinery.py", "grid.py", "readers.py")]   # modules, not commands
    cases += [[os.path.join(folder, n)] for folder in ("scripts", "tools")
              for n in sorted(os.listdir(os.path.join(ROOT, folder))) if n.endswith(".py")]
    text = open(os.path.join(ROOT, "analyze.py")).read()
    cases += [["analyze.py", c] for c in sorted(set(re.findall(r'sub\.add_parser\("(\w+)"', text)) |
                                               set(re.findall(r'logs_command\(sub, "(\w+)"', text)))]
    cases += [["ddrs.py", c] for c in ("certify", "memory", "train", "report")]
    return cases


def test_every_script_and_subcommand_prints_its_help_and_exits_0(tmp_path):
    runner = ("import runpy, sys\nfails = []\nfor argv in %r:\n    for flag in ('-h', '--help'):\n"
              "        sys.argv = [argv[0], *argv[1:], flag]\n        try:\n"
              "            runpy.run_path(argv[0], run_name='__main__')\n            code = 0\n"
              "        except SystemExit as e:\n            code = e.code\n"
              "        if code not in (0, None):\n            fails.append((argv, flag, code))\n"
              "print('FAILS', fails)\n") % (scripts_and_subcommands(),)
    done = subprocess.run([sys.executable, "-c", runner], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert "FAILS []" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert len(scripts_and_subcommands()) > 30


@pytest.mark.parametrize("label", ["ours_v2", "a&b", "50%", "x#1", "$y$", "{z}", "a~b^c", "back\\slash"])
def test_a_label_with_latex_specials_stays_one_cell_of_the_tex_table(label, tmp_path):
    """LaTeX output is a format too: its special characters in a label are escaped, never interpreted."""
    out = tmp_path / "out"
    assert run_main(analyze.main, ["table", LOG, "--labels", label, "--out", out]) == 0
    row = [line for line in (out / "table.tex").read_text().splitlines() if line.startswith("0.5 &")][0]
    cells = re.split(r"(?<!\\)&", row)
    assert len(cells) == 14 and cells[1].strip() == analyze.tex_text(label), row   # sigma, label, ACR, 11 radii
    assert "%" not in row.replace(r"\%", "")

"""A careless user's commands: files of the user's beside an output are never replaced or removed, a log never
holds an example twice, two outputs of one command never share a path, and flags that name nothing this project
runs (a device, an architecture for other inputs, a 0 taken for the default, torchrun's variables without
torchrun) are one line and exit 2, before anything is written."""
import json
import os
import sys

import pytest

import machinery
from helpers import digits_checkpoint, run_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return digits_checkpoint(tmp_path_factory.mktemp("ckpt") / "c.pth.tar", steps=5)


def certify_into(ckpt, out, capsys, *extra):
    import certify
    code = run_main(certify.main, ["--checkpoint", ckpt, "--outfile", out, "--N0", 10, "--N", 40, *extra])
    return code, capsys.readouterr().err


def train(script, argv, capsys, monkeypatch):
    import importlib
    module = importlib.import_module(script[:-3])
    monkeypatch.setattr(sys, "argv", [script, *map(str, argv)])
    code = run_main(lambda a: module.main(), [])
    return code, capsys.readouterr().err


def test_a_users_file_where_the_sidecar_goes_is_refused_and_kept(ckpt, tmp_path, capsys):
    (tmp_path / "u.json").write_text('{"my": "notes"}')
    code, err = certify_into(ckpt, str(tmp_path / "u"), capsys, "--max", 2)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "not written by this project" in err, err
    assert json.loads((tmp_path / "u.json").read_text()) == {"my": "notes"} and not (tmp_path / "u").exists()
    # another run's log named o.json: certifying into o would put o's sidecar over it
    assert certify_into(ckpt, str(tmp_path / "o.json"), capsys, "--max", 2)[0] == 0
    log = (tmp_path / "o.json").read_text()
    code, err = certify_into(ckpt, str(tmp_path / "o"), capsys, "--max", 2)
    assert code == 2 and (tmp_path / "o.json").read_text() == log, err


def test_a_users_file_where_the_lock_goes_is_refused_and_kept(ckpt, tmp_path, capsys):
    (tmp_path / "v.lock").write_text("precious")
    code, err = certify_into(ckpt, str(tmp_path / "v"), capsys, "--max", 2)
    assert code == 2 and "is not a lock of this project" in err, err
    assert (tmp_path / "v.lock").read_text() == "precious"
    assert certify_into(ckpt, str(tmp_path / "w"), capsys, "--max", 2)[0] == 0 and not (tmp_path / "w.lock").exists()


@pytest.mark.parametrize("part", ["o.tsv.rank3", "o.tsv.counts.rank2", "o.tsv.counts"])
def test_overwrite_removes_only_the_files_the_runs_record_lists(ckpt, tmp_path, capsys, part):
    """A file named like a part or the vote counts of a run, that its sidecar does not list, is a user's: neither
    a resume nor --overwrite takes it, removes it or merges it into the log."""
    import certify
    out = tmp_path / "o.tsv"
    assert certify_into(ckpt, str(out), capsys, "--max", 2, "--save-counts")[0] == 0
    mine = "\t".join(certify.CERTIFY_COLUMNS) + "\n0\t0\t0\t0.1\t1\t40\t40\t40\t0.01\n"
    if part == "o.tsv.counts":   # a user's counts in place of the run's, which a resume drops
        (tmp_path / part).unlink()
    (tmp_path / part).write_text(mine)
    for extra in ([], ["--overwrite"]):
        code, err = certify_into(ckpt, str(out), capsys, "--max", 3, "--save-counts", *extra)
        assert code == 2 and len(err.strip().splitlines()) == 1 and part in err, (extra, err)
        assert (tmp_path / part).read_text() == mine
    (tmp_path / part).unlink()
    code, err = certify_into(ckpt, str(out), capsys, "--max", 3, "--save-counts", "--overwrite")
    assert code == 0, err


def test_a_renamed_copy_of_a_log_and_its_sidecar_resumes_and_an_edited_one_does_not(ckpt, tmp_path, capsys):
    out, copy = tmp_path / "a.tsv", tmp_path / "b.tsv"
    assert certify_into(ckpt, str(out), capsys, "--max", 2)[0] == 0
    copy.write_bytes(out.read_bytes())
    (tmp_path / "b.tsv.json").write_bytes((tmp_path / "a.tsv.json").read_bytes())
    assert certify_into(ckpt, str(copy), capsys, "--max", 3)[0] == 0
    assert len(copy.read_text().splitlines()) == 4
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:1] + [lines[1].rsplit("\t", 1)[0] + "\t9.99"] + lines[2:]) + "\n")   # an edit
    (tmp_path / "c.tsv").write_bytes(out.read_bytes())
    (tmp_path / "c.tsv.json").write_bytes((tmp_path / "a.tsv.json").read_bytes())
    code, err = certify_into(ckpt, str(tmp_path / "c.tsv"), capsys, "--max", 3)
    assert code == 2 and "changed since" in err, err


def test_a_log_holding_an_example_twice_is_not_resumed(ckpt, tmp_path, capsys):
    out = tmp_path / "base.tsv"
    assert certify_into(ckpt, str(out), capsys, "--max", 3)[0] == 0
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines + [lines[1]]) + "\n")   # idx 0 again, past the part the sidecar recorded
    code, err = certify_into(ckpt, str(out), capsys, "--max", 5)
    assert code == 2 and "idx 0 again" in err, err
    assert out.read_text().splitlines() == lines + [lines[1]]


@pytest.mark.parametrize("script, name, extra", [
    ("train_gaussian.py", "log.tsv", []), ("train_gaussian.py", "checkpoint_epoch1.pth.tar", ["--save_every", 1]),
    ("train_ours.py", "discard.json", ["--Et", 0, "--N", 4, "--T", 1]),
    ("train_ours.py", "pA_epoch0_discard.tsv", ["--Et", 0, "--N", 4, "--T", 1])])
def test_a_new_training_run_keeps_a_users_file_in_its_folder(script, name, extra, tmp_path, capsys, monkeypatch):
    (tmp_path / name).write_text("mine")
    argv = ["--dataset", "digits", "--sigma", 0.5, "--epochs", 1, "--max-batches", 1, "--workers", 0,
            "--outdir", tmp_path, *extra]
    code, err = train(script, argv, capsys, monkeypatch)
    assert code == 2 and "not written by a run of ours" in err and name in err, err
    assert (tmp_path / name).read_text() == "mine" and not (tmp_path / "args.json").exists()


@pytest.mark.parametrize("script, argv, words", [
    ("train_gaussian.py", ["--arch", "cifar_resnet20"], "does not take digits's inputs"),
    ("train_ours.py", ["--arch", "digits_cnn", "--dataset", "cifar10", "--data-dir", "no_such_folder"],
     "does not take cifar10's inputs"),   # before the data are looked for
    ("train_gaussian.py", ["--device", "meta"], "not one this project runs on"),
    ("train_gaussian.py", ["--device", "cpu:1"], "not one this project runs on"),
    ("train_gaussian.py", ["--lr_step", 0], "--lr_step >= 1"),
    ("train_ours.py", ["--N", 0], "--N"),
    ("train_baselines.py", ["--method", "macer", "--batch", 0], "--batch"),
])
def test_a_flag_that_names_nothing_runnable_is_one_line_before_any_file(script, argv, words, tmp_path, capsys,
                                                                        monkeypatch):
    base = ["--dataset", "digits", "--sigma", 0.5, "--epochs", 1, "--max-batches", 1, "--workers", 0,
            "--outdir", tmp_path / "run"]
    code, err = train(script, base + argv, capsys, monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1 and words in err, err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


MASTER = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, words", [({"RANK": "1", "WORLD_SIZE": "2"}, "without torchrun's other variables"),
                                        ({"RANK": "0", "WORLD_SIZE": "1"}, "without torchrun's other variables"),
                                        ({"RANK": "1"}, "RANK set without"),
                                        ({"RANK": "0", "WORLD_SIZE": "abc", **MASTER}, "not torchrun's"),
                                        ({"RANK": "3", "WORLD_SIZE": "2", **MASTER}, "not torchrun's")])
def test_torchruns_variables_without_torchrun_are_one_line(ckpt, tmp_path, capsys, monkeypatch, env, words):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code, err = certify_into(ckpt, str(tmp_path / "e.tsv"), capsys, "--max", 2)
    assert code == 2 and len(err.strip().splitlines()) == 1 and words in err, err


def test_two_outputs_of_one_command_never_share_a_path(tmp_path):
    def both():
        machinery.write_text_output(str(tmp_path / "m.tsv"), "DDRS memory", "a\n")
        machinery.write_text_output(str(tmp_path / "m.tsv"), "DDRS memory summary", "b\n")
    with pytest.raises(SystemExit) as stop:
        machinery.run(both)
    assert stop.value.code == 2 and not (tmp_path / "m.tsv").exists()


def test_analyze_announces_only_the_files_it_put_in_place(tmp_path, capsys):
    import analyze
    log = os.path.join(ROOT, "results", "grid_cpu", "independent", "sigma0.5", "certify_N100000.tsv")
    (tmp_path / "outputs.json").write_text("null")   # refused when the outputs are put in place
    code = run_main(analyze.main, ["table", log, "--out", tmp_path])
    err = capsys.readouterr().err
    assert code == 2 and "wrote" not in err and not (tmp_path / "table.md").exists(), err


@pytest.mark.parametrize("argv, words", [(["table", "--radii", "-1"], "--radii"),
                                         (["envelope", "--radii", "nan"], "--radii")])
def test_analyze_refuses_a_radius_that_is_no_radius(argv, words, capsys):
    import analyze
    log = os.path.join(ROOT, "results", "grid_cpu", "independent", "sigma0.5", "certify_N100000.tsv")
    code = run_main(analyze.main, [argv[0], log, *argv[1:]])
    assert code == 2 and words in capsys.readouterr().err


def test_demo_seeds_judges_each_seeds_pair(tmp_path, monkeypatch, capsys):
    """The seeds' tool runs the demo's verdict on each pair (here one log against itself: no difference)."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import demo_seeds
    log = os.path.join(ROOT, "results", "grid_cpu", "independent", "sigma0.5", "certify_N100000.tsv")

    class Done:
        returncode = 0

        def communicate(self):
            return "", ""
    monkeypatch.setattr(demo_seeds, "lane", lambda *a, **k: (log, Done()))
    assert run_main(demo_seeds.main, ["--seeds", 1, "--folder", tmp_path]) == 0
    assert "seed 1: does not stand" in capsys.readouterr().out


def test_copy_size_refuses_a_folder_for_the_pasted_file_in_one_line(tmp_path):
    import subprocess
    done = subprocess.run([sys.executable, "tools/copy_size.py", "certify:certify", "--emit", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("script, argv", [("train_gaussian.py", ["--outdir", ""]), ("train_ours.py", ["--device", ""]),
                                          ("train_gaussian.py", ["--seed", "-1"])])
def test_an_empty_value_or_a_negative_seed_is_one_line_not_the_default(script, argv, tmp_path, capsys, monkeypatch):
    code, err = train(script, ["--dataset", "digits", "--sigma", 0.5, "--epochs", 1, *argv], capsys, monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1 and argv[0] in err, err


def test_gradient_norms_keep_a_users_file_where_they_would_go(ckpt, tmp_path, capsys, monkeypatch):
    (tmp_path / "gradnorm_gaussian.tsv").write_text("my data")
    code, err = train("train_gaussian.py", ["--gradnorm", ckpt, "--outdir", tmp_path, "--probe", 4, "--N", 4],
                      capsys, monkeypatch)
    assert code == 2 and "not written by this project" in err and (tmp_path / "gradnorm_gaussian.tsv").read_text() == \
        "my data", err


def test_the_cifar_subset_tool_copies_the_first_images_of_each_class(tmp_path):
    import subprocess
    from PIL import Image
    for split in ("train", "test"):
        for k in range(10):
            folder = tmp_path / "src" / split / f"c{k}"
            folder.mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (32, 32), (k * 20, i * 50, 0)).save(folder / f"{i}.png")
    done = subprocess.run([sys.executable, "tools/cifar_subset.py", "--source", str(tmp_path / "src"), "--dest",
                           str(tmp_path / "dst"), "--train", "2", "--test", "1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    copied = sorted(p.relative_to(tmp_path / "dst").as_posix() for p in (tmp_path / "dst").rglob("*.png"))
    assert len(copied) == 30 and "train/c0/0.png" in copied and "train/c0/2.png" not in copied
    assert (tmp_path / "dst" / "test" / "c9" / "0.png").read_bytes() == (tmp_path / "src" / "test" / "c9" /
                                                                         "0.png").read_bytes()


def test_compare_refuses_one_label_for_both_sides(tmp_path, capsys):
    import analyze
    log = os.path.join(ROOT, "results", "grid_cpu", "independent", "sigma0.5", "certify_N100000.tsv")
    other = os.path.join(ROOT, "results", "grid_cpu", "independent", "sigma0.5", "certify_N10000.tsv")
    assert run_main(analyze.main, ["compare", log, other, "--labels", "x", "x", "--allow-different", "budget"]) == 2
    assert "give each its own name" in capsys.readouterr().err


def test_the_demo_folder_record_keeps_a_users_file_of_its_name(tmp_path):
    import subprocess
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / ".demo").write_text("my own notes")
    done = subprocess.run([sys.executable, "tools/remove_outputs.py", "--record", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "not a record of this project" in done.stderr, done.stderr
    assert (tmp_path / ".demo").read_text() == "my own notes"


def test_a_settings_file_edited_by_hand_is_refused_by_the_analyses(ckpt, tmp_path, capsys):
    """The sidecar records a hash of its own settings: a split changed by hand (no row contradicts it) is found."""
    import analyze
    out = str(tmp_path / "a.tsv")
    assert certify_into(ckpt, out, capsys, "--max", 2)[0] == 0
    assert run_main(analyze.main, ["table", out]) == 0
    settings = json.loads(open(out + ".json").read())
    settings["split"] = "train"
    open(out + ".json", "w").write(json.dumps(settings))
    capsys.readouterr()
    assert run_main(analyze.main, ["table", out]) == 2
    assert "changed since the run wrote it" in capsys.readouterr().err


GRID_LOGS = os.path.join(ROOT, "results", "grid_cpu", "independent", "sigma0.25")


def copied(tmp_path, name, sidecar=True):
    import shutil
    shutil.copy(os.path.join(GRID_LOGS, name), tmp_path / name)
    if sidecar:
        shutil.copy(os.path.join(GRID_LOGS, name + ".json"), tmp_path / (name + ".json"))
    return str(tmp_path / name)


def test_one_model_under_two_labels_is_said_by_every_analysis(tmp_path, capsys):
    """One checkpoint on both sides of a comparison (an A/A comparison), or under two labels of a table, is never
    refused and always said: on stderr and above the report's table."""
    import analyze
    a, b = copied(tmp_path, "certify_N100000.tsv"), copied(tmp_path, "grid.tsv")
    for argv, report in ((["compare", a, b, "--labels", "x", "y", "--radii", "0.25"], "compare.md"),
                         (["compare", a, a, "--labels", "x", "y", "--radii", "0.25"], "compare.md"),
                         (["table", a, b, "--labels", "x", "y", "--allow-different", "mode"], "table.md"),
                         (["ecdf", a, a, "--labels", "x", "y"], "ecdf.md")):
        out = tmp_path / argv[0] / str(len(os.listdir(tmp_path)))
        capsys.readouterr()
        assert run_main(analyze.main, argv + ["--out", out]) == 0, argv
        err = capsys.readouterr().err
        assert "are one model (checkpoint" in err, (argv, err)
        assert "one model (checkpoint" in (out / report).read_text(), argv


def test_a_log_that_records_no_settings_is_named_with_what_it_lacks(tmp_path, capsys):
    import analyze
    a = copied(tmp_path, "certify_N100000.tsv")
    (tmp_path / "bare").mkdir()
    bare = copied(tmp_path / "bare", "certify_N10000.tsv", sidecar=False)
    capsys.readouterr()
    assert run_main(analyze.main, ["compare", a, bare, "--sigmas", "0.25", "0.25", "--radii", "0.25",
                                   "--allow-different", "budget", "--out", tmp_path / "c"]) == 0
    err = capsys.readouterr().err
    assert "certify_N10000.tsv records no dataset, split, data, alpha, N0" in err, err
    assert "records no dataset" in (tmp_path / "c" / "compare.md").read_text()


def test_compare_py_runs_the_compare_command(tmp_path):
    import subprocess
    a = copied(tmp_path, "certify_N100000.tsv")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "compare.py"), a, "/nonexistent.tsv"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "nonexistent" in done.stderr
    done = subprocess.run([sys.executable, os.path.join(ROOT, "compare.py"), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "--vs" in done.stdout


def test_a_users_outputs_json_is_not_taken_for_the_record(tmp_path, capsys):
    import analyze
    a = copied(tmp_path, "certify_N100000.tsv")
    record = tmp_path / "o" / "outputs.json"
    record.parent.mkdir()
    record.write_text('{"experiment": {"lr": 0.1, "notes": "keep me"}}')
    capsys.readouterr()
    assert run_main(analyze.main, ["table", a, "--out", tmp_path / "o"]) == 2
    err = capsys.readouterr().err
    assert "not this project's record of outputs" in err and len(err.strip().splitlines()) == 1, err
    assert record.read_text() == '{"experiment": {"lr": 0.1, "notes": "keep me"}}'


@pytest.mark.parametrize("content", [b"\x13\x37" * 2500, b""])
def test_bytes_that_are_no_torch_file_are_named_so_not_sent_to_trust(ckpt, tmp_path, capsys, content):
    junk = tmp_path / "junk.pth"
    junk.write_bytes(content)
    for path, words in ((junk, "not a torch file"), (tmp_path, "is a folder")):
        code, err = certify_into(str(path), str(tmp_path / "x.tsv"), capsys, "--max", 1)
        assert code == 2 and words in err and "trust" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("script, name, extra", [
    ("train_gaussian.py", "checkpoint_epoch2.pth.tar", ["--save_every", 1]),
    ("train_ours.py", "pA_epoch1_discard.tsv", ["--Et", 1]),
    ("train_ours.py", "discard.json", ["--Et", 1]),
    ("train_ours.py", "pA_epoch5_weights.tsv", ["--Et", 1])])
def test_a_resumed_run_keeps_a_users_file_it_would_replace(script, name, extra, tmp_path, capsys, monkeypatch):
    """A resume writes the files of the epochs after its checkpoint: one there that the run did not write (a later
    epoch's, or not in the run's form) is a user's, refused before any epoch; the run's own are taken as before."""
    out = tmp_path / "run"
    argv = ["--dataset", "digits", "--arch", "lenet", "--sigma", 0.25, "--max-batches", 2, "--workers", 0,
            "--outdir", out, *extra]
    code, err = train(script, [*argv, "--epochs", 1], capsys, monkeypatch)
    assert code == 0, err
    (out / name).write_text("my own notes\n")
    code, err = train(script, [*argv, "--epochs", 2, "--resume"], capsys, monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1 and name in err, err
    assert (out / name).read_text() == "my own notes\n"
    (out / name).unlink()
    code, err = train(script, [*argv, "--epochs", 2, "--resume"], capsys, monkeypatch)
    assert code == 0, err

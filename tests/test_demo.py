"""The demo (`make demo`, scripts/demo.sh) end to end at a reduced size, and its report's numbers against
analyze.py's on the same logs; the report's verdict on logs where the answer is known."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import analyze
import common
import machinery

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import demo_report  # noqa: E402
import remove_outputs  # noqa: E402

MODELS = ["gaussian_sigma0.25", "ours_sigma0.25", "consistency_sigma0.25", "gaussian_sigma0.5"]
EXAMPLES, N = 12, 200


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo with 1 epoch of 3 batches, N = 200 and 12 test digits (the real one: 20 epochs, N = 10,000,
    all 360)."""
    out = tmp_path_factory.mktemp("demo") / "demo"
    env = dict(os.environ, DEMO_EPOCHS="1", DEMO_MAX_BATCHES="3", DEMO_N=str(N), DEMO_MAX=str(EXAMPLES),
               DEMO_OUT=str(out), PYTHON=sys.executable)
    result = subprocess.run(["bash", "scripts/demo.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return out, result.stdout


def test_demo_writes_every_output_and_each_parses(demo):
    out, _ = demo
    for name in MODELS:
        log = analyze.read_log(str(out / "certify" / f"{name}.tsv"))
        assert len(log["radius"]) == EXAMPLES and np.all(log["N"] == N)
        assert (out / "train" / name / "checkpoint.pth.tar").is_file()
    table = analyze.read_columns(str(out / "table.tsv"), ("sigma", "label", "n", "ACR"), ("sigma", "n", "ACR"))
    assert list(table["n"]) == [EXAMPLES] * 4 and sorted(table["sigma"]) == [0.25, 0.25, 0.25, 0.5]
    for sigma, label in [("0.25", "gaussian"), ("0.25", "ours"), ("0.25", "consistency"), ("0.5", "gaussian")]:
        curve = analyze.read_ecdf_or_log(str(out / f"ecdf_{label}_{sigma}.tsv"))
        assert len(curve["grid_p"]) == len(analyze.ECDF_GRID)
    for name in ["table.md", "envelope.md", "envelope.tsv", "ecdf.md", "report.md"]:
        assert (out / name).stat().st_size > 0
    for name in ["certified_accuracy", "envelope", "ecdf"]:
        with open(out / f"{name}.png", "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        with open(out / f"{name}.pdf", "rb") as f:
            assert f.read(5) == b"%PDF-"
    assert "Dominance" in (out / "ecdf.md").read_text()
    assert "P(pA<0.1)" in (out / "ecdf.md").read_text()                # the whole range, from nY
    with open(out / "ecdf_full.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


PINS = {"ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2", "OPENBLAS_CORETYPE": "Haswell"}


def test_the_demo_pins_the_math_libraries_to_avx2_and_every_record_says_what_they_ran(demo):
    """scripts/demo.sh pins the instruction sets (docs/demo.md): each sidecar and args.json records the pins
    and what oneDNN and OpenBLAS ran, read from the libraries; the report's header says it. No lock is left."""
    if any(name in os.environ for name in PINS):
        pytest.skip("the caller set a pin of its own")
    out, _ = demo
    records = [json.load(open(out / "certify" / f"{name}.tsv.json"))["environment"] for name in MODELS]
    records += [json.load(open(out / "train" / name / "args.json"))["environment"] for name in MODELS]
    has_avx2 = "avx2" in open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else False
    for env in records:
        assert env["cpu"]["isa_pins"] == PINS
        if has_avx2 and torch.backends.mkldnn.is_available():
            assert env["cpu"]["onednn_isa"] == "Intel AVX2" and env["cpu"]["torch_capability"] == "AVX2"
    header = (out / "report.md").read_text().split("\n\n")[2]
    assert header.startswith("Made with: ") and "oneDNN: " in header and "ONEDNN_MAX_CPU_ISA=AVX2" in header
    assert not list(out.rglob("*.lock"))


def test_demo_shows_progress_of_every_model_and_says_where_the_report_is(demo):
    out, stdout = demo
    for name in MODELS:
        assert re.search(rf"^\[{re.escape(name)}\] epoch 1/1 ", stdout, re.M), name
        assert re.search(rf"^\[{re.escape(name)}\] {EXAMPLES}/{EXAMPLES} examples", stdout, re.M), name
    assert stdout.rstrip().splitlines()[-1] == f"The report is {out / 'report.md'}"


def report_rows(text):
    """The summary table of report.md: {(sigma, label): [cells after the label]}."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 11 and re.fullmatch(r"\d+(\.\d+)?", cells[0]):
            rows[(float(cells[0]), cells[1])] = cells[2:]
    return rows


def test_report_numbers_equal_analyze_on_the_same_logs(demo, capsys):
    out, _ = demo
    rows = report_rows((out / "report.md").read_text())
    assert len(rows) == 4
    paths = [str(out / "certify" / f"{name}.tsv") for name in MODELS]
    # analyze.py's own command line on the logs: the ACR and certified accuracy at r = 0 it prints
    capsys.readouterr()
    machinery.run(lambda: analyze.main(["table", *paths, "--radii", "0", "--format", "tsv"]))   # as its script runs it
    printed = capsys.readouterr().out
    cli = {(float(r[0]), r[1]): r for r in (line.split("\t") for line in printed.splitlines()[1:])}
    logs = analyze.attach_pA(analyze.load_logs(paths), None, None)
    for log in logs:
        cells = rows[(log["sigma"], log["label"])]
        n, acr, clean, hard, ecdf_cells = int(cells[0]), float(cells[1]), float(cells[2]), cells[3], cells[4:]
        assert n == EXAMPLES
        assert hard == analyze.fmt_percent(np.mean(log["nY"] / log["N"] < 0.5))   # every digit, wrong ones too
        assert acr == pytest.approx(float(cli[(log["sigma"], log["label"])][3]), abs=5e-4)
        assert clean == pytest.approx(float(cli[(log["sigma"], log["label"])][4]), abs=0.05)
        expected = analyze.ecdf(log["pA"], demo_report.REPORT_P)
        assert ecdf_cells == [analyze.fmt_percent(y) for y in expected]


def write_log(path, nA, sigma, N=1000, alpha=0.001):
    """A certify.py-style log from the count nA of the true class (label 0) of each example (nY = nA)."""
    lines = ["idx\tlabel\tpredict\tradius\tcorrect\ttime\tnA\tN\tnY"]
    for i, k in enumerate(nA):
        lower = common.clopper_pearson_lower(k, N, alpha)
        certified = lower >= 0.5
        radius = float(common.certified_radius(lower, sigma)) if certified else 0.0
        lines.append(f"{i}\t0\t{0 if certified else -1}\t{radius:.6}\t{int(certified)}\t0:00:01\t{k}\t{N}\t{k}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def report(paths):
    """report.md's text for these logs (without the tables and figures main() also writes)."""
    logs = analyze.attach_pA(analyze.load_logs(paths), None, None)
    return demo_report.report(logs, "gaussian", "ours", None)


def test_verdict_says_the_claim_shows_when_acr_rises_from_easy_inputs_and_hard_ones_are_not_helped(tmp_path):
    # ours: certified at pA = 1 on 70 of 100, abstains on 30; Gaussian: pA = 0.8 on all (higher clean accuracy)
    gaussian = write_log(tmp_path / "gaussian_sigma0.5.tsv", [800] * 100, 0.5)
    ours = write_log(tmp_path / "ours_sigma0.5.tsv", [1000] * 70 + [100] * 30, 0.5)
    text = report([gaussian, ours])
    assert "**The paper's claim shows at this scale**." in text
    assert "P(pA ≥ 0.99) +70.0 [" in text and "clean accuracy 70.0 % against 100.0 %, -30.0 [" in text


def test_verdict_says_the_claim_does_not_show_when_the_pattern_rests_on_ten_digits(tmp_path):
    # the pattern above on 10 digits: ACR and the shares move, but not beyond the noise of 10 images
    gaussian = write_log(tmp_path / "gaussian_sigma0.5.tsv", [800] * 10, 0.5)
    ours = write_log(tmp_path / "ours_sigma0.5.tsv", [1000] * 8 + [100] * 2, 0.5)
    text = report([gaussian, ours])
    assert "**The paper's claim does not show at this scale** (not shown: the rise comes from easy inputs)" in text
    assert "P(pA ≥ 0.99) +80.0 [" in text and "points, within noise" in text


def test_verdict_says_the_claim_does_not_show_when_acr_does_not_rise(tmp_path):
    gaussian = write_log(tmp_path / "gaussian_sigma0.5.tsv", [1000] * 10, 0.5)
    ours = write_log(tmp_path / "ours_sigma0.5.tsv", [1000] * 7 + [100] * 3, 0.5)
    assert "**The paper's claim does not show at this scale** (not shown: ACR rises beyond noise" in \
        report([gaussian, ours])


def test_verdict_says_the_claim_does_not_show_when_hard_inputs_are_helped(tmp_path):
    # ours raises ACR and the mass at pA = 1, but also rescues 40 hard inputs: not the paper's pattern
    gaussian = write_log(tmp_path / "gaussian_sigma0.5.tsv", [800] * 100 + [100] * 100, 0.5)
    ours = write_log(tmp_path / "ours_sigma0.5.tsv", [1000] * 100 + [800] * 40 + [100] * 60, 0.5)
    text = report([gaussian, ours])
    assert "**The paper's claim does not show at this scale** (not shown: hard inputs are not helped)" in text


def test_demo_refuses_a_folder_it_did_not_make(tmp_path):
    keep = tmp_path / "mine.txt"
    keep.write_text("precious")
    result = subprocess.run(["bash", "scripts/demo.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, DEMO_OUT=str(tmp_path), PYTHON=sys.executable))
    assert result.returncode == 2 and "not made by the demo" in result.stderr
    assert keep.read_text() == "precious"


@pytest.mark.parametrize("target", ["missing", "a demo folder"])
def test_demo_refuses_a_link_as_its_folder(tmp_path, target):
    """DEMO_OUT a symbolic link, dangling or to a folder with the demo's marker: refused, nothing made there."""
    real = tmp_path / "real"
    if target == "a demo folder":
        real.mkdir()
        (real / ".demo").write_text("")
    (tmp_path / "link").symlink_to(real)
    result = subprocess.run(["bash", "scripts/demo.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, DEMO_OUT=str(tmp_path / "link"), PYTHON=sys.executable))
    assert result.returncode == 2 and "not made by the demo" in result.stderr, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["link"] + (["real"] if target != "missing" else [])
    assert target == "missing" or os.listdir(real) == [".demo"]


def test_demo_keeps_a_users_file_put_into_its_own_folder(tmp_path):
    """A folder the demo made (its marker) with a user's notes put in it since: refused, the notes kept; the
    demo's own files (its record, the marker, lists them) do not stop it."""
    out = tmp_path / "demo"
    out.mkdir()
    (out / "report.md").write_text("old report")
    remove_outputs.record_tree(str(out))
    (out / "notes.txt").write_text("precious")
    result = subprocess.run(["bash", "scripts/demo.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, DEMO_OUT=str(out), PYTHON=sys.executable))
    assert result.returncode == 2 and "notes.txt" in result.stderr and "did not write" in result.stderr
    assert (out / "notes.txt").read_text() == "precious" and (out / "report.md").read_text() == "old report"


def test_demo_keeps_a_users_file_or_link_deep_in_its_folder(tmp_path):
    """The whole tree is checked before anything is removed: a user's file in a run folder of the demo, or a
    link there, stops it, and every file stays."""
    out = tmp_path / "demo"
    (out / "train" / "gaussian").mkdir(parents=True)
    machinery.write_text_output(str(out / "train" / "gaussian" / "args.json"), "settings", "{}")
    remove_outputs.record_tree(str(out))
    (out / "train" / "gaussian" / "notes.txt").write_text("precious")
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("mine")
    for planted in ("notes.txt", "link"):
        if planted == "link":
            (out / "train" / "gaussian" / "notes.txt").unlink()
            (out / "train" / "gaussian" / "link").symlink_to(elsewhere)
        result = subprocess.run(["bash", "scripts/demo.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                                env=dict(os.environ, DEMO_OUT=str(out), PYTHON=sys.executable))
        assert result.returncode == 2 and planted in result.stderr and len(result.stderr.splitlines()) == 1
        assert (out / "train" / "gaussian" / "args.json").read_text() == "{}"
    assert elsewhere.read_text() == "mine" and (out / "train" / "gaussian" / "link").is_symlink()
    # with only the demo's own files left, the demo's start removes the tree (its record included)
    (out / "train" / "gaussian" / "link").unlink()
    remove_outputs.remove_tree(str(out))
    assert not out.exists()

"""Every analysis takes each kind of certification log (readers.LOG_KINDS) or refuses it in one line, as it
declares: one log of each kind, made from one committed certify.py log by the columns and settings that mark
the kind, through every analysis of analyze.py, tools/bench.py --grid-logs, ddrs.py's report and memory, and the
scripts that take a log's pA as the truth (tools/beta_curve.py, tools/like_for_like.py)."""
import json
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import analyze  # noqa: E402
import bench  # noqa: E402
import common  # noqa: E402
import readers  # noqa: E402
import ddrs  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import beta_curve  # noqa: E402
import like_for_like  # noqa: E402

BASE = os.path.join(ROOT, "results", "ddrs_cpu", "fixed_noise_0.25.tsv")   # certify.py CERTIFY, with nA N nY


def write_kind(folder, kind, name=None):
    """A log of `kind` made from BASE (its first 60 rows): the columns and settings certify.py and ddrs.py
    write for that kind."""
    lines = open(BASE).read().splitlines()
    header, rows = lines[0].split("\t"), [line.split("\t") for line in lines[1:61]]
    side = json.load(open(BASE + ".json"))
    cols = {h: [r[i] for r in rows] for i, h in enumerate(header)}
    if kind == "PREDICT":
        del cols["radius"]
        side["mode"] = "predict"
    if kind.startswith("grid"):
        del cols["nY"]
        cols["pA_lower"] = cols["pA_upper"] = ["0.5"] * len(rows)
        cols["stop"] = ["final"] * len(rows)
        side.update(mode="grid", radii=[0.25, 0.5] if kind == "grid without r = 0" else [0.0, 0.25, 0.5],
                    beta=0.0005, final_look=True)
    if kind == "label mode":
        cols["candidate"] = cols["label"]
        side["candidate"] = "label"
    if kind in ("DDRS", "semi-elastic"):
        cols["sigma"] = ["0.25"] * len(rows)
        side["script"] = "ddrs.py certify"
        side["ddrs"] = ({"semi_elastic": {"r": 0.01, "k": 20, "m": 5.0, "sigma_b": 0.25, "train_data": "0" * 16}}
                        if kind == "semi-elastic" else {"lr": 0.01, "K": 100})
    side["columns"] = list(cols)
    path = os.path.join(folder, name or kind.replace(" ", "_").replace("=", "") + "_noise_0.25.tsv")
    with open(path, "w") as f:
        f.write("\n".join("\t".join(r) for r in [list(cols), *zip(*cols.values())]) + "\n")
    with open(path + ".json", "w") as f:
        json.dump(side, f)
    return path


@pytest.fixture(scope="module")
def kinds(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kinds")
    write_kind(str(folder), "CERTIFY", "reference.tsv")
    gradnorm = os.path.join(ROOT, "results", "table2_cpu", "gradnorm_gaussian.tsv")
    return folder, {kind: write_kind(str(folder), kind) for kind in readers.LOG_KINDS}, gradnorm


def test_the_kinds_are_read_from_the_committed_logs_of_each_script():
    kinds = lambda path: readers.log_kinds(readers.read_certification_log(path), readers.read_sidecar(path))
    at = lambda *parts: os.path.join(ROOT, "results", *parts)
    assert kinds(BASE) == ["CERTIFY"]
    assert kinds(at("grid_cpu", "independent", "sigma0.25", "grid.tsv")) == ["grid"]
    assert kinds(at("grid_cpu", "independent", "sigma0.25", "r0.5_alone.tsv")) == ["grid without r = 0"]
    assert kinds(at("ddrs_cpu", "ds_lr0.01_noise_0.25.tsv")) == ["CERTIFY", "DDRS"]
    assert kinds(at("ddrs_cpu", "semi_elastic_noise_0.25.tsv")) == ["CERTIFY", "semi-elastic"]


def analyses(folder, log, gradnorm, ddrs_log):
    """(the declaration's key, what runs it) for every analysis of one log."""
    out = str(folder / "out")
    ref = str(folder / "reference.tsv")
    run = lambda *argv: lambda: analyze.analyze(analyze.parse_args(list(argv)))
    return [
        ("table", run("table", log)), ("envelope", run("envelope", log)),
        ("ablation", run("ablation", log, "--parts", "none")), ("ecdf", run("ecdf", log)),
        ("budget", run("budget", log, "--N", "1000", "--alpha", "0.001")), ("trainpa", run("trainpa", log)),
        ("gradnorm --acr", run("gradnorm", gradnorm, "--acr", log, "--replicates", "100")),
        # the kind's mode against CERTIFY's is a difference of setting, allowed here to reach the kind's check
        ("compare", run("compare", ref, log, "--allow-different", "mode")),
        ("compare --over test-set", run("compare", ref, log, "--over", "test-set", "--allow-different", "mode")),
        ("tools/bench.py --grid-logs", lambda: bench.grid_from_logs([ref, log])),
        ("ddrs.py report", lambda: ddrs.main(["report", log, "--fixed", ref, "--out", out])),
        ("ddrs.py report --fixed", lambda: ddrs.main(["report", ddrs_log, "--fixed", log, "--out", out])),
        ("ddrs.py memory", lambda: ddrs.read_ddrs_log(log)),
        ("beta_curve.py", lambda: beta_curve.main([log, "--radii", "0.5", "--N", "2000", "--reps", "1",
                                                   "--budgets", "1000"])),
        ("like_for_like.py", lambda: like_for_like.rule_draws(log, 0.5, 0.001, 1, 0)),
    ]


DECLARED = {**{f"analyze.py {k}": v for k, v in analyze.REFUSED.items()},
            "tools/bench.py --grid-logs": bench.GRID_LOGS_REFUSED, "ddrs.py report": ddrs.REPORT_REFUSED,
            "ddrs.py report --fixed": ddrs.FIXED_REFUSED, "ddrs.py memory": ddrs.MEMORY_REFUSED,
            "beta_curve.py": beta_curve.TRUTH_REFUSED, "like_for_like.py": like_for_like.TRUTH_REFUSED}
NEEDS_DDRS = ("ddrs.py report", "ddrs.py memory")   # they take ddrs.py's logs only (a sigma column)


@pytest.mark.parametrize("kind", readers.LOG_KINDS)
def test_every_analysis_takes_or_refuses_each_kind_as_it_declares(kinds, kind, capsys):
    folder, paths, gradnorm = kinds
    ran = set()
    for name, call in analyses(folder, paths[kind], gradnorm, paths["DDRS"]):
        key = name if name.split()[0].endswith(".py") else f"analyze.py {name}"
        refused = DECLARED[key]
        assert set(refused) <= set(readers.LOG_KINDS + readers.SPLIT_KINDS), key
        try:
            call()
            error = None
        except common.UserError as e:
            error = str(e)
        except SystemExit as e:   # ddrs.main through argparse: never for these arguments
            raise AssertionError(f"{key}: exit {e.code}") from None
        if kind in refused:
            assert error is not None and "\n" not in error and paths[kind] in error, (key, error)
            assert refused[kind] in error or (kind == "PREDICT" and "PREDICT" in error), (key, error)
        elif key in NEEDS_DDRS and kind not in ("DDRS", "semi-elastic"):
            assert error is not None and ddrs.NO_SIGMA_COLUMN in error, (key, error)
        elif key == "analyze.py trainpa":   # every kind here is of the test split, which trainpa does not take
            assert error is not None and refused["test split"] in error, (key, error)
        elif key == "tools/bench.py --grid-logs":
            assert error is None or "does not take" not in error, (key, error)   # then its own checks
        else:
            assert error is None, (key, error)
            ran.add(key)
    capsys.readouterr()
    if kind == "CERTIFY":   # the plain log runs through every analysis that takes it
        assert {"analyze.py table", "analyze.py ecdf", "analyze.py budget", "analyze.py compare"} <= ran


def test_a_budget_conversion_of_a_per_input_sigma_log_is_refused_not_computed_at_one_sigma(kinds):
    _, paths, _ = kinds
    for kind in ("DDRS", "semi-elastic"):
        with pytest.raises(common.UserError, match="its own sigma"):
            analyze.analyze(analyze.parse_args(["budget", paths[kind], "--N", "1000", "--alpha", "0.001"]))


def test_bench_refuses_arms_of_another_checkpoint(kinds, tmp_path):
    folder, paths, _ = kinds
    other = tmp_path / "other.tsv"
    shutil.copy(BASE, other)
    side = json.load(open(BASE + ".json"))
    side["checkpoint_sha256"] = "f" * 64
    other.with_name("other.tsv.json").write_text(json.dumps(side))
    with pytest.raises(common.UserError, match="another checkpoint"):
        bench.grid_from_logs([str(folder / "reference.tsv"), str(other)])


def test_bench_takes_arms_at_another_N_by_design_but_not_at_another_alpha(tmp_path):
    source = os.path.join(ROOT, "results", "grid_cpu", "independent", "sigma0.25")
    paths = []
    for name in ("certify_N100000.tsv", "certify_N10000.tsv"):
        shutil.copy(os.path.join(source, name), tmp_path / name)
        shutil.copy(os.path.join(source, name + ".json"), tmp_path / (name + ".json"))
        paths.append(str(tmp_path / name))
    logs = analyze.load_logs(paths)
    differs = readers.check_comparable(logs, ("N",))
    assert differs[0] == ("budget", "N: 100000 (certify_N100000.tsv), 10000 (certify_N10000.tsv)")
    assert [s for s, _ in differs[1:]] == [readers.ONE_MODEL]   # the arms of one model, said
    side = json.load(open(paths[1] + ".json"))
    with open(paths[1] + ".json", "w") as f:
        json.dump(dict(side, alpha=0.01), f)
    with pytest.raises(common.UserError, match="alpha 0.01, but .* --allow-different budget"):
        bench.grid_from_logs(paths)

"""Every public block refuses every bad argument with a TypeError or ValueError that names it, raised by the block's
own check before any work (the model never runs), imported and pasted alone alike.

The catalogue (tests/block_args.py) gives each block a call with good arguments and the kind of each argument; the
bad values are a fixed list per kind (wrong type, string, bool, an integral float for an int, NaN, +-inf, zero,
negative, out of range, wrong shape, wrong dtype, uint8 images, empty lists) and hypothesis's draws beyond it.
The pasted side: each module's blocks pasted into an empty folder (test_paste.pasted) and run in a fresh process
without the project on sys.path; the fixed values must give there exactly what they give imported."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import analyze
import block_args
import certify
import common
import ddrs
import grid
import train_baselines
import train_ours
from test_paste import ROOT, pasted

MODULES = {"common": common, "certify": certify, "grid": grid, "train_ours": train_ours,
           "train_baselines": train_baselines, "ddrs": ddrs, "analyze": analyze}
NAMESPACE = {name: getattr(module, name) for module in MODULES.values() for name in dir(module)
             if callable(getattr(module, name)) and getattr(getattr(module, name), "__module__", "") == module.__name__}
CATALOGUE = block_args.catalogue(NAMESPACE)
HOME = {block: next(m for m, module in MODULES.items() if block in vars(module)) for block, _, _ in CATALOGUE}
PROJECT_FILES = [os.path.join(ROOT, f"{m}.py") for m in MODULES]
CASES = [(block, name) for block, _, kinds in CATALOGUE for name in kinds]
EXAMPLES = 6   # hypothesis's draws per argument, beyond the fixed values: the whole file stays within seconds


def test_the_catalogue_covers_the_blocks_the_docs_and_the_brief_name():
    blocks = {block for block, _, _ in CATALOGUE}
    shown = set(re.findall(r"`(?:\w+\.)?(\w+)`", open(os.path.join(ROOT, "docs", "python.md")).read())) & set(NAMESPACE)
    not_here = {"grid_interval", "compare_sides", "read_certification_log", "test_set_votes", "num_classes", "load_logs"}
    assert {b for b in shown - not_here if not b.startswith("check_")} <= blocks   # compare, readers, loading files: elsewhere
    assert {"certify", "predict", "grid_plan", "grid_certify", "grid_certify_many", "ours_loss", "discard_hard",
            "radius_weights", "smoothadv_loss", "macer_loss", "consistency_loss", "smoothmix_loss", "catrs_loss",
            "stability_loss", "gaussian_loss", "optimize_sigma", "smoothed_class", "semi_elastic_radius",
            "clopper_pearson_lower", "clopper_pearson_upper", "certified_radius", "sample_counts", "gaussian_copies",
            "sound_noisy_inputs", "sound_copies", "sphere_pgd", "acr", "certified_accuracy", "ecdf",
            "radius_of_count"} <= blocks
    assert len(CASES) >= 250


@pytest.mark.parametrize("block", sorted({b for b, _, _ in CATALOGUE}))
def test_each_good_call_runs(block):
    """The good arguments are good: a refusal below is about the one bad argument."""
    torch.set_num_threads(1)
    make = next(m for b, m, _ in CATALOGUE if b == block)
    NAMESPACE[block](**make())


@pytest.mark.parametrize("block, name", CASES, ids=[f"{b}-{n}" for b, n in CASES])
def test_a_bad_argument_is_refused_naming_it(block, name):
    torch.set_num_threads(1)
    make, kinds = next((m, k) for b, m, k in CATALOGUE if b == block)
    problem, _ = block_args.check_argument(NAMESPACE, block, make, name, kinds[name], PROJECT_FILES, EXAMPLES)
    assert problem is None, problem


# ----------------------------------------------------------------------------------------------------------
# The same through each module's pasted closure, in one fresh process
# ----------------------------------------------------------------------------------------------------------

RUNNER = """import json, os, sys
for folder in sys.argv[1:]:
    os.chdir(folder)
    sys.path[0] = folder
    for name in ("pasted", "block_args"):
        sys.modules.pop(name, None)
    import pasted, block_args
    only = json.load(open("blocks.json"))   # the module's own blocks (a closure also holds others' blocks)
    failures, outcomes = block_args.run_all(vars(pasted), [os.path.join(folder, "pasted.py")], %d, only)
    json.dump({"failures": failures, "outcomes": outcomes}, open("out.json", "w"))
"""


@pytest.fixture(scope="module")
def from_paste(tmp_path_factory):
    """{module: the failures and the fixed values' outcomes of its blocks pasted alone}."""
    folders = {}
    for module in sorted(set(HOME.values())):
        folder = tmp_path_factory.mktemp(module)
        blocks = [b for b, m in HOME.items() if m == module]
        (folder / "pasted.py").write_text(pasted([f"{module}:{b}" for b in blocks])[0])
        (folder / "blocks.json").write_text(json.dumps(blocks))
        shutil.copy(os.path.join(ROOT, "tests", "block_args.py"), folder / "block_args.py")
        folders[module] = folder
    runner = tmp_path_factory.mktemp("runner") / "runner.py"
    runner.write_text(RUNNER % EXAMPLES)
    done = subprocess.run([sys.executable, "-E", "-s", str(runner), *map(str, folders.values())],
                          cwd=runner.parent, capture_output=True, text=True, timeout=600,
                          env={"PATH": os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return {module: json.load(open(folder / "out.json")) for module, folder in folders.items()}


def plain(outcome):
    """An outcome without the memory addresses that object reprs hold."""
    return outcome if outcome == "ok" else [outcome[0], re.sub(r"0x[0-9a-fA-F]+", "0x", outcome[1])]


def test_each_pasted_block_refuses_alike(from_paste):
    """One test (the pasted run is one process, made once): every case's failure and every fixed value's outcome
    that differs from the import's, listed together."""
    torch.set_num_threads(1)
    wrong = []
    for block, make, kinds in CATALOGUE:
        theirs = from_paste[HOME[block]]
        for name, kind in kinds.items():
            key = f"{block}:{name}"
            if theirs["failures"][key] is not None:
                wrong.append(f"pasted {theirs['failures'][key]}")
            for i, value in enumerate(block_args.fixed_bad(kind)):
                mine = json.loads(json.dumps(block_args.outcome(NAMESPACE, block, make, name, value)))
                if plain(theirs["outcomes"][f"{key}:{i}"]) != plain(mine):
                    wrong.append(f"{key} = {value!r:.40}: pasted {theirs['outcomes'][f'{key}:{i}']}, imported {mine}")
    assert not wrong, "\n".join(wrong[:20])


# ----------------------------------------------------------------------------------------------------------
# The examples that showed each class of slip, kept as they were found
# ----------------------------------------------------------------------------------------------------------

def test_a_uint8_image_is_refused_with_the_conversion_to_use():
    net, images, _ = block_args.setup()
    x8 = (images[0] * 255).to(torch.uint8)
    with pytest.raises(TypeError, match=r"x\.float\(\) / 255"):
        certify.certify(net, x8, 0.5, 10, 100, 0.001, 100, 10, torch.Generator().manual_seed(0))
    out = certify.certify(net, x8.float() / 255, 0.5, 10, 100, 0.001, 100, 10, torch.Generator().manual_seed(0))
    assert out["N"] == 100   # the conversion the message gives is accepted


@pytest.mark.parametrize("candidate", [-1, 10, 9.0, True, "3"])
def test_a_candidate_outside_the_models_classes_is_refused(candidate):
    net, images, _ = block_args.setup()
    with pytest.raises((TypeError, ValueError), match="candidate"):
        certify.certify(net, images[0], 0.5, 10, 100, 0.001, 100, 10, torch.Generator().manual_seed(0),
                        candidate=candidate)


@pytest.mark.parametrize("N", [100.0, "100", True, None])
def test_a_count_given_as_a_float_string_or_bool_is_a_type_error(N):
    net, images, _ = block_args.setup()
    with pytest.raises(TypeError, match=r"\bN must be an int"):
        certify.certify(net, images[0], 0.5, 10, N, 0.001, 100, 10)

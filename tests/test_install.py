"""The README's install lines, followed in order, keep the CPU build of torch: pip's own resolver is asked what
it would do (`pip install --dry-run --report`, no index, nothing downloaded) in a new environment that holds
what the first line installs, the CPU builds (local version label +cpu)."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_install_lines():
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = [line.strip() for line in f if line.strip().startswith("pip install")]
    assert len(lines) == 2, lines
    return lines


def pins():
    with open(os.path.join(ROOT, "constraints.txt")) as f:
        return dict(re.match(r"([\w.-]+)==([\w.+]+)$", line.strip()).groups()
                    for line in f if line.strip() and not line.startswith("#"))


def environment_with(tmp_path, installed):
    """A new venv (no pip of its own) whose site-packages holds a stand-in distribution for each name: version."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    for name, version in installed.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("pip\n")
        (info / "RECORD").write_text("")
    return venv / "bin" / "python"


def pip_would(python, args, tmp_path):
    """What `pip install --dry-run` would install into python's environment: (exit code, names, stderr)."""
    report = tmp_path / "report.json"
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")   # no machine's pip config
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run", "--no-index",
                           "--report", str(report), *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)
    names = [item["metadata"]["name"] for item in json.load(open(report))["install"]] if done.returncode == 0 else None
    return done.returncode, names, done.stderr


def test_the_first_install_line_names_the_cpu_builds_of_the_constrained_versions():
    first, second = readme_install_lines()
    assert "--index-url https://download.pytorch.org/whl/cpu" in first
    wanted = dict(re.findall(r"\b(torch|torchvision)==([\d.]+)", first))
    assert wanted == {"torch": pins()["torch"], "torchvision": pins()["torchvision"]}, first
    assert second.split() == ["pip", "install", "-r", "requirements.txt", "-c", "constraints.txt"]


def test_after_the_cpu_builds_the_second_line_replaces_nothing(tmp_path):
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        pytest.skip("no pip")
    installed = dict(pins())
    installed["torch"] += "+cpu"
    installed["torchvision"] += "+cpu"
    python = environment_with(tmp_path, installed)
    code, names, err = pip_would(python, readme_install_lines()[1].split()[2:], tmp_path)
    assert code == 0 and names == [], (names, err)


def test_a_cpu_build_of_another_version_would_be_replaced(tmp_path):
    """The negative control: had the first line installed another version, the constraint would swap it (pip, with
    no index here, says it cannot find the pinned one)."""
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        pytest.skip("no pip")
    installed = dict(pins())
    installed["torch"] = "2.13.0+cpu"
    python = environment_with(tmp_path, installed)
    code, _, err = pip_would(python, readme_install_lines()[1].split()[2:], tmp_path)
    assert code != 0 and "torch" in err, err


def test_make_install_installs_the_constrained_versions():
    """`make install` (run by make demo and make test where a requirement is missing) pins what the README's
    second line pins: the versions of constraints.txt."""
    done = subprocess.run(["make", "-n", "install", "PYTHON=python3"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    installs = [line for line in done.stdout.splitlines() if "pip install" in line]
    assert len(installs) == 1 and installs[0].split("pip install", 1)[1].split() == \
        readme_install_lines()[1].split()[2:], installs

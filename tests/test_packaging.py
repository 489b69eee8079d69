"""One import namespace: the wheel holds `phaselens/` alone, no module of ours imports the old
top-level names, and an installed phaselens runs its demo from a folder full of decoy packages."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.source_tree import PACKAGES, ROOT, python_sources

# The folders mapped under `phaselens.`: importing one of them by its bare name is the old layout.
OLD_NAMES = set(PACKAGES) - {"phaselens"}


def _imported_top_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_module_imports_an_old_top_level_name():
    offenders = [
        f"{path.relative_to(ROOT)}: {sorted(_imported_top_names(path) & OLD_NAMES)}"
        for path in python_sources()
        if _imported_top_names(path) & OLD_NAMES
    ]
    assert offenders == []


@pytest.mark.parametrize("name", sorted(OLD_NAMES))
def test_old_top_level_names_are_not_importable(name, tmp_path):
    """Run outside the repository: only `phaselens` is installed, so `import analysis` fails."""
    proc = subprocess.run(
        [sys.executable, "-c", f"import {name}"], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of the tree: setuptools builds in place, and a `build/` left by an earlier build would
    carry stale modules into the wheel."""
    tree = tmp_path_factory.mktemp("tree") / "phaselens"
    shutil.copytree(
        ROOT,
        tree,
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "*.egg-info", "*.so", "__pycache__", ".pytest_cache", ".hypothesis"
        ),
    )
    return tree


@pytest.fixture(scope="module")
def wheel(tree, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(tree)],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("phaselens-*.whl")
    return path


def test_wheel_holds_only_the_phaselens_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"phaselens", next(t for t in tops if t.endswith(".dist-info"))}
    for expected in (
        "phaselens/instrumentation/server/telemetry.py",
        "phaselens/reference_server/engine/engine.py",
        "phaselens/loadgen/runner.py",
        "phaselens/collectors/otelcol.yaml",
        "phaselens/storage/embedded.py",
        "phaselens/common/quantile.py",
        "phaselens/analysis/report/report_assets/template.html",
        "phaselens/dashboards/generated/phaselens-latency-budget.json",
        "phaselens/commands/demo.py",
    ):
        assert expected in names
    assert any(n.startswith("phaselens/collectors/_otlp_rows.") and n.endswith(".so") for n in names)
    sql = [n for n in names if n.startswith("phaselens/analysis/sql/") and n.endswith(".sql")]
    assert sql, "the rendered SQL files ship with the package"


def test_wheel_leaves_out_the_fault_harness(wheel):
    """faults/ is test support: the wheel has no `phaselens/faults/`, and nothing it ships imports it."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        sources = {n: zf.read(n).decode() for n in names if n.endswith(".py")}
    assert [n for n in names if n.startswith("phaselens/faults/")] == []
    assert "phaselens/collectors/render.py" in sources
    assert [n for n, text in sources.items() if "phaselens.faults" in text] == []


def test_editable_install_keeps_the_fault_harness(tree, tmp_path):
    """The editable install of the tests and benchmarks maps `phaselens.faults` to faults/: in this
    environment, and in an editable wheel built now from the same setup.py."""
    import phaselens.faults.suite

    assert Path(phaselens.faults.suite.__file__).resolve() == ROOT / "faults" / "suite.py"
    out = tmp_path / "editable"
    out.mkdir()
    build = "import sys; from setuptools import build_meta; print(build_meta.build_editable(sys.argv[1]))"
    name = subprocess.run(
        [sys.executable, "-c", build, str(out)], cwd=tree, check=True, capture_output=True, text=True
    ).stdout.split()[-1]
    with zipfile.ZipFile(out / name) as zf:
        finder = next(zf.read(n).decode() for n in zf.namelist() if n.endswith("_finder.py"))
    assert f"'phaselens.faults': '{tree / 'faults'}'" in finder
    assert f"'phaselens.analysis': '{tree / 'analysis'}'" in finder


def _decoys(cwd: Path) -> None:
    """Folders named like our old top-level packages, each failing loudly when imported."""
    for name in sorted(OLD_NAMES):
        (cwd / name).mkdir()
        (cwd / name / "__init__.py").write_text(f"raise ImportError('decoy {name} was imported')\n")


def test_installed_wheel_runs_the_demo_beside_decoy_packages(wheel, tmp_path):
    """A fresh virtualenv with the wheel alone as phaselens (its dependencies borrowed from this
    environment's site-packages through a .pth, which does not activate our editable finder)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True
        ).strip()
    )
    (site / "borrowed.pth").write_text(sysconfig.get_path("purelib") + "\n")
    with zipfile.ZipFile(wheel) as zf:  # a wheel's install is an unpack plus the console script
        zf.extractall(site)
    work = tmp_path / "work"
    work.mkdir()
    _decoys(work)
    code = "import sys; from phaselens.cli import main; sys.exit(main())"
    where = subprocess.check_output(
        [python, "-c", "import phaselens.analysis as a; print(a.__file__)"], cwd=work, text=True
    ).strip()
    assert where.startswith(str(site)), where
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
    proc = subprocess.run(
        [
            python,
            "-c",
            code,
            "demo",
            "--requests",
            "10",
            "--rate",
            "4",
            "--data",
            str(tmp_path / "d"),
            "--report",
            str(tmp_path / "r.html"),
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "decoy" not in proc.stdout + proc.stderr
    assert (tmp_path / "r.html").stat().st_size > 10_000

"""`pip install .`: the commands the docs give work from the installed package alone, run
outside the checkout, with everything they read installed as package data (the sample digits,
vit_hub.export's sources for a Space)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "vit-mnist"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The project installed into a folder of its own (no dependencies: the venv has them)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True, timeout=300)
    return target


def run_installed(installed: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m ARGS` in `cwd`, importing vit_hub from the install only."""
    env = {**os.environ, "PYTHONPATH": str(installed), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    code = ("import sys; sys.path.remove('') if '' in sys.path else None; "  # not the checkout's sources
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]; "
            "import runpy, vit_hub; assert vit_hub.__file__.startswith(sys.argv[1]), vit_hub.__file__; "
            "sys.argv = sys.argv[2:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")
    return subprocess.run([sys.executable, "-c", code, str(installed), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_space_and_inspect_work_from_an_installed_package(installed, tmp_path):
    space = run_installed(installed, tmp_path, "vit_hub", "space", str(MODEL_DIR), "--repo-id", "you/demo",
                          "--dry-run", "--out", "space")
    assert space.returncode == 0, space.stderr
    written = {path.relative_to(tmp_path / "space").as_posix() for path in (tmp_path / "space").rglob("*")}
    assert {"app.py", "vit_hub/demo/page.py", "vit_hub/export/session.py", "model/model.onnx"} <= written
    assert len([name for name in written if name.startswith("vit_hub/bundled/samples/")]) == 10

    inspect = run_installed(installed, tmp_path, "vit_hub", "inspect", "--model", str(MODEL_DIR), "--out", "views")
    assert inspect.returncode == 0, inspect.stderr
    assert (tmp_path / "views" / "inspect.json").is_file()

    app = run_installed(installed, tmp_path, "vit_hub.demo", "--help")
    assert app.returncode == 0 and "--model" in app.stdout, app.stderr

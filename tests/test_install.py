"""`pip install .`: the commands the docs give work from the installed package alone, run
outside the checkout, with everything they read installed as package data (the bundled model,
the sample digits, vit_hub.export's sources for a Space)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
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


ONLY_THE_INSTALL = ("import sys; sys.path.remove('') if '' in sys.path else None; "  # not the checkout's sources
                    "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]; "
                    "import vit_hub; assert vit_hub.__file__.startswith(sys.argv[1]), vit_hub.__file__; ")


def run_installed(installed: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m ARGS` in `cwd`, importing vit_hub from the install only."""
    return run_installed_code(installed, cwd, "import runpy; sys.argv = sys.argv[2:]; "
                              "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)", *args)


def run_installed_code(installed: Path, cwd: Path, code: str, *args: str) -> subprocess.CompletedProcess:
    """`python -c CODE ARGS` in `cwd`, importing vit_hub from the install only."""
    env = {**os.environ, "PYTHONPATH": str(installed), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", ONLY_THE_INSTALL + code, str(installed), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_every_file_beside_the_packages_code_is_package_data():
    """Each file under vit_hub/ that is not Python source (the static Space's page, the bundled
    MNIST, the sample digits) matches a package-data pattern of pyproject.toml, so an install has it."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["vit_hub"]
    package = ROOT / "vit_hub"
    packaged = {path for pattern in patterns for path in package.glob(pattern) if path.is_file()}
    data = {path for path in package.rglob("*")
            if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts}
    page = {path.name for path in (package / "hub" / "static_page").iterdir()}
    assert page >= {"index.html", "page.js", "overlay.mjs"}
    assert sorted(path.relative_to(package).as_posix() for path in data - packaged) == []


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
    shown = " ".join(app.stdout.split())
    assert shown.startswith("usage: python -m vit_hub.demo") and "the bundled MNIST digit model" in shown
    assert str(installed) not in shown, shown  # no server path in the help


@pytest.mark.slow
def test_the_installed_app_serves_its_bundled_model(installed, tmp_path):
    """`python -m vit_hub.demo` with no --model loads the model installed with the package (the
    app's own start-up, short of serving) and names the bundled seven a seven."""
    sample = installed / "vit_hub" / "bundled" / "samples" / "mnist_test_0000_label_7.png"
    code = ("from PIL import Image; from vit_hub.demo.server import parse_args; "
            "from vit_hub.demo.backends import load_predictor; from vit_hub.demo.page import build_demo; "
            "from vit_hub.processing.preprocess import preprocess; "
            "args = parse_args([]); predictor = load_predictor(args.model, args.backend, args.revision); "
            "build_demo(predictor); config = predictor.config; "
            "probabilities = predictor.predict(preprocess(Image.open(sys.argv[2]), config)[None])[0]; "
            "print(args.model, config.labels[int(probabilities[0].argmax())])")
    loaded = run_installed_code(installed, tmp_path, code, str(sample))
    assert loaded.returncode == 0, loaded.stderr
    model, label = loaded.stdout.split()
    assert Path(model).is_relative_to(installed) and label == "7"
    shipped = {path.name for path in Path(model).iterdir()}
    assert shipped == {"config.json", "model.safetensors", "README.md", "faithfulness.json"}  # no ONNX: 1.2 MB

"""The layout module is the one place a model dir's file names and the graphs' I/O names are
written: a second literal elsewhere in the code is a fact that can drift, and fails here."""

import ast
from pathlib import Path

import pytest

from vit_hub import layout
from vit_hub.layout import ExportLayout, ModelDir

ROOT = Path(__file__).resolve().parents[1]
CODE = sorted([*ROOT.glob("vit_hub/**/*.py"), *ROOT.glob("export/**/*.py"), ROOT / "app.py"])
NAMES = {
    *(value.name for value in vars(ModelDir).values() if isinstance(value, layout._File)),
    *(path.name for path in (*ExportLayout(Path("."), layout.DEFAULT_STEM).onnx_files,
                             ExportLayout(Path("."), layout.DEFAULT_STEM).int8)),
    layout.GRAPH_INPUT,
}


def literals(path: Path) -> list[tuple[int, str]]:
    """String constants that are a layout name, or a path ending in one ("x/config.json")."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in NAMES or node.value.rsplit("/", 1)[-1] in NAMES:
                found.append((node.lineno, node.value))
    return found


def test_the_layout_names_every_file_once():
    assert len(NAMES) >= 20  # model dir files, ONNX files, the graph input
    assert ModelDir.config == "config.json" and ModelDir(Path("m")).config == Path("m/config.json")
    assert ModelDir(Path("m")).export.logits == Path("m/model.onnx")


@pytest.mark.parametrize("path", [path for path in CODE if path.name != "layout.py"],
                         ids=lambda path: str(path.relative_to(ROOT)))
def test_no_file_name_is_written_outside_the_layout(path):
    assert literals(path) == [], f"{path.relative_to(ROOT)}: use vit_hub.layout instead of these literals"


def test_the_check_finds_a_literal(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('WEIGHTS = "model.safetensors"\nPATH = "models/x/config.json"\n')
    assert literals(planted) == [(1, "model.safetensors"), (2, "models/x/config.json")]

"""The code stays readable in pieces a learner can hold: no module over 400 lines, no class over
200, no function over 60 (vit_hub/, export/, app.py). A longer one is a sign that it does
several jobs; split it by job rather than raise a limit."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = sorted([*ROOT.glob("vit_hub/**/*.py"), *ROOT.glob("export/**/*.py"), ROOT / "app.py"])
MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 400, 200, 60


def too_long(source: str) -> list[str]:
    """What in one file's source is over the limits, e.g. ["module: 512 lines", "class Trainer: 230 lines"]."""
    found = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"module: {lines} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            kind, limit = ("class", MAX_CLASS_LINES) if isinstance(node, ast.ClassDef) else ("def", MAX_FUNCTION_LINES)
            if length > limit:
                found.append(f"{kind} {node.name}: {length} lines")
    return found


@pytest.mark.parametrize("path", CODE, ids=lambda path: str(path.relative_to(ROOT)))
def test_modules_classes_and_functions_stay_short(path):
    assert too_long(path.read_text()) == []


def test_the_check_finds_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert too_long(f"def long():\n{body}\n") == [f"def long: {MAX_FUNCTION_LINES + 1} lines"]
    assert too_long("x = 1\n" * (MAX_MODULE_LINES + 1)) == [f"module: {MAX_MODULE_LINES + 1} lines"]

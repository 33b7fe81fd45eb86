"""The import graph of vit_hub/ and export/ (installed as `vit_hub.export`) has no cycle, and
its imports point one way: model/config/preprocess <- data/train <- hub/card <- export <- app.

The layers are written once below, every module in one of them: a new module fails here
until it is placed. A module may import from its own layer and the layers below; imports
inside functions (the lazy ones) count as much as those at the top of a file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "vit_hub"
EXPORT = f"{PACKAGE}.export"  # pyproject.toml maps the checkout's export/ folder to this name

# Lowest first. Names are relative to vit_hub ("" is the package itself, "export.*" the
# modules of export/). Within a layer, modules are grouped by what they serve.
LAYERS: dict[str, tuple[str, ...]] = {
    "base": (
        "errors", "layout", "console", "storage",  # what every layer shares
        "config", "positions", "model", "flops",  # the model: its config and pure nn code
        "canonical", "colour", "preprocess", "postprocess", "blanking",  # images in, scores out
        "rollout", "plots",  # attention maps and figures, from arrays
        "samples",  # a model's example images
    ),
    "train": (
        "data", "folders", "augmentation", "batches",  # the data
        "settings", "schedule", "step", "loaders", "checkpoint", "distributed", "evaluation", "fine_tune",
        "run_report", "train",  # the training loop
        "summary", "predict",  # a torch model's layers and predictions
        "attribution", "gradients", "explain", "insight", "insight_figures",  # what a model looks at
        "calibration",  # the temperature of its probabilities
    ),
    "hub": (
        "", "hub", "card", "pretrained", "weight_checks", "hub_cli", "space", "static_space",  # model dirs, files, the Hub
        "converting", "importing",  # timm and transformers ViTs
        "inspecting", "training_run", "sweep",  # commands that write a complete model dir
    ),
    "export": (
        "export", "export.__main__", "export.evalset", "export.exporter", "export.graph_check", "export.half",
        "export.on_demand", "export.pipeline", "export.quantize", "export.runtime", "export.session",
        "export.timing", "export.verify",
        "export.graph_builder", "export.graph_numpy", "export.canonical_graph", "export.pipeline_graph",  # pipeline.onnx
    ),
    "app": (
        "demo", "demo.__main__", "demo.backends", "demo.methods", "demo.page", "demo.pictures", "demo.server", "demo.uploads",
        "cli", "__main__",
    ),
}


def module_files() -> dict[str, Path]:
    """Every module's dotted name -> its file."""
    files = {}
    for folder, package in ((ROOT / PACKAGE, PACKAGE), (ROOT / "export", EXPORT)):
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join([package, *parts])] = path
    return files


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The project's modules that module `name` imports anywhere in its file. `from P import X`
    is an import of the module P.X where there is one, else of P itself."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from the module's own package
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
    return {module for module in found if module in known and module != name}


def layer_of() -> dict[str, int]:
    """Each listed module's dotted name -> the index of its layer (0: the lowest)."""
    placed = {}
    for index, modules in enumerate(LAYERS.values()):
        for short in modules:
            placed[f"{PACKAGE}.{short}" if short else PACKAGE] = index
    return placed


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    names = list(LAYERS)
    return [f"{module} ({names[layers[module]]}) imports {target} ({names[layers[target]]})"
            for module, targets in sorted(graph.items()) for target in sorted(targets)
            if layers[target] > layers[module]]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as the modules along it (the first repeated at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target, path + [target])
                if cycle:
                    return cycle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [module])
            if cycle:
                return cycle
    return None


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


@pytest.fixture(scope="module")
def files() -> dict[str, Path]:
    return module_files()


def test_every_module_is_placed_in_one_layer(files):
    listed = [f"{PACKAGE}.{short}" if short else PACKAGE for modules in LAYERS.values() for short in modules]
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert sorted(set(files) - set(listed)) == [], "place these new modules in LAYERS"
    assert sorted(set(listed) - set(files)) == [], "these modules in LAYERS no longer exist"


def test_no_import_cycle(files):
    cycle = find_cycle(import_graph(files))
    assert cycle is None, "an import cycle: " + " -> ".join(cycle or [])


def test_imports_point_from_higher_layers_to_lower_ones_only(files):
    assert upward_imports(import_graph(files), layer_of()) == []


def test_the_checks_find_a_planted_upward_import_and_cycle(files, tmp_path):
    """Where the training loop imported the card (lazily, inside a function), and the card the
    loop, both checks fail."""
    planted = dict(files)
    for name, text in (("train", "def f():\n    from .card import write_model_card\n"),
                       ("card", "from . import train\n")):
        planted[f"{PACKAGE}.{name}"] = tmp_path / f"{name}.py"
        planted[f"{PACKAGE}.{name}"].write_text(text)
    graph = import_graph(planted)
    assert "vit_hub.train (train) imports vit_hub.card (hub)" in upward_imports(graph, layer_of())
    assert find_cycle(graph) == ["vit_hub.card", "vit_hub.train", "vit_hub.card"]


def test_relative_and_absolute_imports_resolve_to_modules(files):
    graph = import_graph(files)
    assert "vit_hub.data" in graph["vit_hub.loaders"]  # from .data import ...
    assert "vit_hub.gradients" in graph["vit_hub.attribution"]  # from . import gradients, inside a function
    assert "vit_hub.export.runtime" in graph["vit_hub.export.half"]  # from .runtime import ..., in export/
    assert "vit_hub.batches" in graph["vit_hub.export.evalset"]  # from vit_hub.batches import ...
    assert "vit_hub" not in graph["vit_hub.loaders"]  # from . import batches names a module, not the package

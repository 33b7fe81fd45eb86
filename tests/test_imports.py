"""The import graph of vit_hub/ and export/ (installed as `vit_hub.export`) has no cycle, and
its imports point one way, from the app down to the model: the layers below, one folder each.

The layers are written once below, every module in one of them: a new module fails here
until it is placed. A module may import from its own layer and the layers below; imports
inside functions (the lazy ones) count as much as those at the top of a file."""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "vit_hub"
EXPORT = f"{PACKAGE}.export"  # pyproject.toml maps the checkout's export/ folder to this name

# Lowest first. Names are relative to vit_hub ("" is the package itself, "export.*" the
# modules of export/). Within a layer, modules are grouped by what they serve.
LAYERS: dict[str, tuple[str, ...]] = {
    "foundation": ("errors", "console", "layout", "storage"),
    "model": ("model", "model.fields", "model.labels", "model.config", "model.patches", "model.positions", "model.vit",
              "model.flops"),
    "processing": ("processing", "processing.canonical", "processing.preprocess", "processing.postprocess"),
    "explain": ("explain", "explain.rollout", "explain.blanking", "explain.gradients", "explain.attribution",
                "explain.run", "explain.opening"),
    "data": ("data", "data.choices", "data.colour", "data.folders", "data.hub_datasets", "data.streams", "data.sources", "data.batch_augmentation", "data.augmentation", "data.batches",
             "data.samples"),
    "insight": ("insight", "insight.views", "insight.figures", "insight.inspect"),
    "hub": ("", "hub", "hub.weight_checks", "hub.card", "hub.repos", "hub.push_pull", "hub.pretrained",
            "hub.space_folder", "hub.space", "hub.static_space", "hub.key_mapping", "hub.fine_tune", "hub.import_model"),
    "train": ("train", "train.settings", "train.distributed", "train.schedule", "train.evaluation",
              "train.step", "train.checkpoint", "train.loaders", "train.report", "train.calibration", "train.streaming",
              "train.loop", "train.run", "train.sweep"),
    "export": (
        "export", "export.__main__", "export.options", "export.evalset", "export.exporter", "export.fused_graph",
        "export.graph_check", "export.half",
        "export.on_demand", "export.out_folder", "export.export_model", "export.quantize", "export.runtime", "export.session",
        "export.timing", "export.verify",
        "export.graph_builder", "export.graph_numpy", "export.canonical_graph", "export.pipeline_graph",  # pipeline.onnx
        "export.preprocess_graph", "export.batched_runtime",  # preprocess.onnx, a GPU server's batches
        "export.pipeline_check",  # pipeline.onnx checked before a static Space bundles it
        "export.rollout_graph", "export.map_graph",  # pipeline_map.onnx
        "export.gradient_graph",  # pipeline_explain.onnx
    ),
    "app": ("demo", "demo.__main__", "demo.backends", "demo.methods", "demo.page", "demo.pictures", "demo.server",
            "demo.uploads", "cli", "__main__"),
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
    """Where the model card imported the training loop (lazily, inside a function), and the
    loop the card, both checks fail."""
    planted = dict(files)
    for name, text in (("hub.card", "def f():\n    from vit_hub.train.loop import Trainer\n"),
                       ("train.loop", "from vit_hub.hub import card\n")):
        planted[f"{PACKAGE}.{name}"] = tmp_path / f"{name}.py"
        planted[f"{PACKAGE}.{name}"].write_text(text)
    graph = import_graph(planted)
    assert "vit_hub.hub.card (hub) imports vit_hub.train.loop (train)" in upward_imports(graph, layer_of())
    assert find_cycle(graph) == ["vit_hub.hub.card", "vit_hub.train.loop", "vit_hub.hub.card"]


def test_relative_and_absolute_imports_resolve_to_modules(files):
    graph = import_graph(files)
    assert "vit_hub.data.sources" in graph["vit_hub.train.loaders"]  # from vit_hub.data.sources import ...
    assert "vit_hub.explain.gradients" in graph["vit_hub.explain.attribution"]  # inside a function
    assert "vit_hub.export.runtime" in graph["vit_hub.export.half"]  # from .runtime import ..., in export/
    assert "vit_hub.data.batches" in graph["vit_hub.export.evalset"]  # from vit_hub.data.batches import ...
    assert "vit_hub" not in graph["vit_hub.train.loaders"]  # `from vit_hub.data import batches` names a module


# The picture of the layers in docs/architecture.md -----------------------------------------
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PICTURE_START, PICTURE_END = "<!-- layers: written by `python tests/test_imports.py --write-docs` -->", "<!-- /layers -->"


def layer_picture() -> str:
    """LAYERS drawn top layer first: each layer's folders and their modules, as a text block."""
    listed = [module for modules in LAYERS.values() for module in modules]
    packages = {module.rpartition(".")[0] for module in listed if "." in module}
    lines = []
    for layer, modules in reversed(LAYERS.items()):
        by_folder: dict[str, list[str]] = {}
        for module in modules:
            if module in packages:
                continue  # a folder's __init__: the folder itself is drawn
            folder, _, name = module.rpartition(".")
            by_folder.setdefault(f"{folder}/" if folder else "vit_hub/", []).append(name or "__init__ (public names)")
        for index, (folder, names) in enumerate(by_folder.items()):
            text = textwrap.fill(f"{folder} {', '.join(names)}", 88, subsequent_indent=" " * (len(folder) + 1))
            lines += textwrap.indent(text, " " * 12).splitlines()
            if index == 0:
                lines[-len(text.splitlines())] = f"{layer:<12}" + lines[-len(text.splitlines())][12:]
    return "```text\n" + "\n".join(lines) + "\n```"


def documented_picture() -> str:
    text = ARCHITECTURE.read_text()
    return text[text.index(PICTURE_START) + len(PICTURE_START):text.index(PICTURE_END)].strip()


def test_the_architecture_page_draws_these_layers():
    """docs/architecture.md's picture is LAYERS as this file holds it; after a change to
    LAYERS, `python tests/test_imports.py --write-docs` redraws it."""
    assert documented_picture() == layer_picture()


def write_docs() -> None:
    text = ARCHITECTURE.read_text()
    before, after = text[:text.index(PICTURE_START) + len(PICTURE_START)], text[text.index(PICTURE_END):]
    ARCHITECTURE.write_text(f"{before}\n{layer_picture()}\n{after}")


if __name__ == "__main__" and sys.argv[1:] == ["--write-docs"]:
    write_docs()

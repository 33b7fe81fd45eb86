"""Exporting on the fly, for a caller that wants it (the app's ONNX backend): a model dir or
Hub repo id with the ONNX graphs it needs, exported first when it ships none.

The runtime (`runtime.py`) never exports and never imports torch; this module imports the
exporter, and with it torch, only when there is something to export.

    classifier = open_exporting("you/vit-mnist", export_dir=make_temp_dir, output_attentions=True)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from vit_hub.hub.repos import resolve_model_dir
from vit_hub.layout import ExportLayout

from .runtime import OnnxClassifier


def ensure_graphs(model_dir: Path, *, export_dir: Callable[[Path], Path], output_attentions: bool = False) -> Path:
    """The folder holding the graphs of `model_dir`: the model dir itself when it has the one
    needed (the attentions graph with `output_attentions`), else `export_dir(model_dir)`, a
    folder the caller names, once they are exported there."""
    layout = ExportLayout.for_model(model_dir)
    if (layout.attentions if output_attentions else layout.logits).is_file():
        return Path(model_dir)
    from .export_model import export_onnx  # torch, only when there is something to export

    folder = export_dir(model_dir)
    export_onnx(model_dir, folder, output_attentions=output_attentions)
    return folder


def open_exporting(reference: str | Path, *, export_dir: Callable[[Path], Path], output_attentions: bool = False,
                   revision: str | None = None, token: str | None = None, **options: Any) -> OnnxClassifier:
    """`OnnxClassifier.from_model(reference, ...)`, its graphs exported first into
    `export_dir(model_dir)` when the model ships none (`ensure_graphs`). `options` go to the
    classifier's constructor."""
    model_dir = resolve_model_dir(reference, revision, token, with_onnx=True)
    graphs_dir = ensure_graphs(model_dir, export_dir=export_dir, output_attentions=output_attentions)
    return OnnxClassifier.from_model(model_dir, output_attentions=output_attentions, graphs_dir=graphs_dir, **options)

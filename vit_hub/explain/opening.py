"""Which explanation a model's page opens with, read from how faithful each method measured on it:
the app's page (vit_hub.demo.methods) and the export's pipeline_explain.onnx (export/gradient_graph.py)
both ask here, so the graph other apps run draws the map the page opens with.

The opening method is the one measured most faithful on the model (insertion minus deletion AUC
in its faithfulness.json, written by `bench/faithfulness.py --write`) among the quick methods
(`Method.quick`: a forward and backward pass or two, not one per patch, so a page answers at
once) a backend computes; DEFAULT_METHOD for a model never measured, ONNX_DEFAULT_METHOD when the
backend computes no gradients and nothing was measured.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

from vit_hub.errors import UserError
from vit_hub.explain.attribution import METHODS
from vit_hub.layout import ModelDir
from vit_hub.model.fields import read_json

DEFAULT_METHOD = "integrated_gradients"
ONNX_DEFAULT_METHOD = "rollout"


def measured_faithfulness(model_dir: Path | None) -> dict | None:
    """The model's faithfulness.json (bench/faithfulness.py --write), None when it has none or
    one the page cannot use (not JSON, an AUC that is not a number): a warning says why, and the
    page opens with the default method."""
    path = ModelDir(model_dir).faithfulness if model_dir else None
    if path is None or not path.is_file():
        return None
    try:
        measured = read_json(path)
        rows = measured.get("methods") if isinstance(measured, dict) else None
        if not isinstance(rows, dict) or "images" not in measured:
            raise UserError(f"expected an object with images and methods, found {str(measured)[:80]}")
        for name, row in rows.items():
            aucs = [row.get(key) for key in ("deletion_auc", "insertion_auc")] if isinstance(row, dict) else [None]
            if not all(isinstance(auc, (int, float)) and math.isfinite(auc) for auc in aucs):
                raise UserError(f"expected numbers for {name}'s deletion_auc and insertion_auc, found {str(row)[:80]}")
    except ValueError as error:
        warnings.warn(f"{ModelDir.faithfulness} not used, the page opens with the default method: {error}", stacklevel=2)
        return None
    return measured


def opening_method_of(model_dir: Path | None, methods: tuple[str, ...]) -> str:
    """The method the page opens with for the model at `model_dir` (None: one never measured),
    among `methods` (names in attribution.METHODS: what the backend computes)."""
    measured = measured_faithfulness(model_dir)
    rows = measured["methods"] if measured else {}
    candidates = [name for name in methods if METHODS[name].quick and name in rows]
    if candidates:
        return max(candidates, key=lambda name: rows[name]["insertion_auc"] - rows[name]["deletion_auc"])
    return DEFAULT_METHOD if DEFAULT_METHOD in methods else ONNX_DEFAULT_METHOD

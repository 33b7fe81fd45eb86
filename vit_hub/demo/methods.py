"""Which explanation the page opens with, and how faithful each method measured on the model.

The page opens with the method measured most faithful on the served model (insertion minus
deletion AUC in its faithfulness.json, written by `bench/faithfulness.py --write`) among the
quick methods (`Method.quick`: a forward and backward pass or two, not one per patch, so a page
answers at once; BENCHMARKS.md, "How faithful each method is", has their times); DEFAULT_METHOD
for a model never measured, ONNX_DEFAULT_METHOD when the backend computes no gradients and
nothing was measured.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

from vit_hub.demo.backends import Predictor
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


def opening_method(predictor: Predictor) -> str:
    """The method the page opens with (see the module docstring)."""
    measured = measured_faithfulness(predictor.model_dir)
    rows = measured["methods"] if measured else {}
    candidates = [name for name in predictor.methods if METHODS[name].quick and name in rows]
    if candidates:
        return max(candidates, key=lambda name: rows[name]["insertion_auc"] - rows[name]["deletion_auc"])
    return DEFAULT_METHOD if DEFAULT_METHOD in predictor.methods else ONNX_DEFAULT_METHOD


def faithfulness_table(model_dir: Path | None, methods: tuple[str, ...]) -> str:
    """Markdown: each method's deletion and insertion AUC as bench/faithfulness.py measured them
    on this model (its faithfulness.json), a row per method, or where to find that out."""
    measured = measured_faithfulness(model_dir)
    if measured is None:
        return ("How faithful each method is was not measured for this model (`bench/faithfulness.py --write "
                f"MODEL_DIR/{ModelDir.faithfulness}`); BENCHMARKS.md has the bundled model's figures.")
    rows = measured["methods"]
    named = [(METHODS[name].label, rows[name]) for name in methods if name in rows]
    # The bench's reference rows: a model-free map (named in words) and random. Rows of methods
    # kept in bench/ only (snake_case names, not offered here) are left out.
    named += [(name.split(" (")[0].split(":")[0], row) for name, row in rows.items()
              if name not in METHODS and (" " in name or name == "random")]
    table = "\n".join(f"| {label} | {row['deletion_auc']:.3f} | {row['insertion_auc']:.3f} |" for label, row in named)
    return (f"Measured on {measured['images']} test images by `bench/faithfulness.py`: blank the patches a map "
            f"ranks first and see how fast the predicted class's probability falls (deletion AUC, lower is "
            f"better), or restore them first and see how fast it comes back (insertion AUC, higher is better).\n\n"
            f"| method | deletion AUC | insertion AUC |\n|---|---|---|\n{table}")

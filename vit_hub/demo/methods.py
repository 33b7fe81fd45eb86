"""Which explanation the page opens with, and how faithful each method measured on the model.

The page opens with the method measured most faithful on the served model among the quick
methods its backend computes (`vit_hub.explain.opening`, which the export's pipeline_explain.onnx
asks too); DEFAULT_METHOD for a model never measured, ONNX_DEFAULT_METHOD when the backend
computes no gradients and nothing was measured.
"""

from __future__ import annotations

from pathlib import Path

from vit_hub.demo.backends import Predictor
from vit_hub.explain.attribution import METHODS
from vit_hub.explain.opening import DEFAULT_METHOD, ONNX_DEFAULT_METHOD, measured_faithfulness, opening_method_of
from vit_hub.layout import ModelDir

__all__ = ["DEFAULT_METHOD", "ONNX_DEFAULT_METHOD", "faithfulness_table", "measured_faithfulness", "opening_method"]


def opening_method(predictor: Predictor) -> str:
    """The method the page opens with (`vit_hub.explain.opening.opening_method_of`)."""
    return opening_method_of(predictor.model_dir, predictor.methods)


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

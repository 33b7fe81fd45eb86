"""`export_onnx`: model dir or Hub repo id -> verified ONNX graphs, config and report.

    export_onnx("models/vit-mnist", "models/vit-mnist/model.onnx", output_attentions=True)

writes (see `layout.py`) the logits graph, optionally the attentions graph and an int8
graph, the `config.json` a consumer needs (preprocessing and labels) and an export report.
Every graph is verified (`verify.py`); a failed check raises VerificationError after the
report is written, so the numbers can be read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime
import torch
from torch import nn

from vit_hub.config import ViTConfig
from vit_hub.pretrained import load_model
from vit_hub.layout import ExportLayout

from .evalset import EvalSet, check_labels, first_images, load_eval_set
from .half import FP16_TOLERANCES, convert_to_fp16, measure_fp16
from .exporter import DEFAULT_EXPORTER, DEFAULT_OPSET, check_export_options, write_graph
from .quantize import QUANTIZATIONS, measure_int8, quantize_int8
from .runtime import PRECISIONS
from .verify import PARITY_BATCHES, TOLERANCES, VerificationError, check_file, verify_graph

# Real images for parity when no --calib-data is given: the bundled MNIST test split,
# converted to the model's channels and size by its own preprocessing.
DEFAULT_REAL_DATA = "mnist"


def _resolve_model(model: nn.Module | str | Path) -> tuple[str, nn.Module]:
    """(how the report names the model, the model in eval mode)."""
    if isinstance(model, nn.Module):
        if not isinstance(getattr(model, "config", None), ViTConfig):
            raise TypeError(f"expected a vit_hub VisionTransformer, got {type(model).__name__}")
        return f"<in-memory {type(model).__name__}>", model.eval()
    return str(model), load_model(model)


def write_config(config: ViTConfig, path: Path) -> None:
    """config.json beside the graphs; an equal one already there (the model dir) is left as is."""
    if path.is_file():
        try:
            if ViTConfig.from_json(path) == config:
                return
        except ValueError:
            pass  # not a vit_hub config: replace it
    path.write_text(json.dumps(config.to_dict(), indent=2) + "\n")


def _parity_inputs(config: ViTConfig, eval_set: EvalSet) -> dict[str, np.ndarray]:
    count = max(PARITY_BATCHES)
    shape = (count, config.in_channels, *config.image_size)
    return {"random": np.random.default_rng(0).normal(size=shape).astype(np.float32),
            "real": first_images(eval_set, count)}


def _remove_stale(*paths: Path) -> None:
    """Graphs of an earlier export that this one does not write would pair with the new model."""
    for path in paths:
        path.unlink(missing_ok=True)


def export_onnx(model: nn.Module | str | Path, out: str | Path, *, opset: int = DEFAULT_OPSET,
                output_attentions: bool = False, exporter: str = DEFAULT_EXPORTER, quantize: str | None = None,
                calib_data: str | None = None, data_root: str | None = None,
                eval_limit: int | None = None, precision: str = "fp32") -> Path:
    """Export, verify and report; returns the path of the logits graph.

    Args:
        model: a model dir, a Hub repo id, or a loaded VisionTransformer.
        out: a folder (gets model.onnx) or a path ending in .onnx.
        opset: ONNX opset to write (checked in the written file).
        output_attentions: also write `<stem>_attentions.onnx` with an `attentions` output.
        exporter: "torchscript" (default, faster graph here) or "dynamo".
        quantize: None or "int8" (dynamic quantization; needs labelled data to be measured).
        calib_data: images (any --data the core accepts) for the real-input parity check and
            the int8 accuracy; default: the bundled MNIST test split.
        data_root: where torchvision datasets named by calib_data live.
        eval_limit: measure int8 accuracy (and fp16 agreement) on the first N images only.
        precision: "fp32", or "fp16" to also write float16 copies of the graphs for the CUDA
            provider (`model_fp16.onnx`, ...; see half.py), verified and measured.
    """
    check_export_options(exporter, opset)
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(f"--quantize: expected one of {', '.join(QUANTIZATIONS)}, got {quantize!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"--precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    if eval_limit is not None and eval_limit < 1:
        raise ValueError(f"--eval-limit: expected a positive number of images, got {eval_limit}")
    reference, model = _resolve_model(model)
    layout = ExportLayout.for_output(out)
    layout.folder.mkdir(parents=True, exist_ok=True)
    eval_set = load_eval_set(calib_data or DEFAULT_REAL_DATA, model.config, data_root)
    if quantize:
        check_labels(eval_set, model.config)  # before any work: int8 accuracy needs the model's classes
    inputs = _parity_inputs(model.config, eval_set)

    report = _report_header(reference, exporter, opset, eval_set)
    graphs = [(layout.logits, False)] + ([(layout.attentions, True)] if output_attentions else [])
    halves = [layout.in_precision(path, "fp16") for path, _ in graphs] if precision == "fp16" else []
    every_half = [layout.in_precision(path, "fp16") for path in (layout.logits, layout.attentions)]
    _remove_stale(*([] if output_attentions else [layout.attentions]), *([] if quantize else [layout.int8]),
                  *(half for half in every_half if half not in halves))
    for path, with_attentions in graphs:
        write_graph(model, path, output_attentions=with_attentions, opset=opset, exporter=exporter)
        report["graphs"][path.name] = verify_graph(model, path, opset, inputs, with_attentions)
        if precision == "fp16":
            half = convert_to_fp16(path, layout.in_precision(path, "fp16"))
            report["graphs"][half.name] = verify_graph(model, half, opset, inputs, with_attentions, FP16_TOLERANCES)
    write_config(model.config, layout.config)
    if quantize:
        quantize_int8(layout.logits, layout.int8)
        report["graphs"][layout.int8.name] = check_file(layout.int8, opset, ["logits"])
        report["quantization"] = measure_int8(layout.logits, layout.int8, eval_set, eval_limit)
    if precision == "fp16":
        report["fp16"] = measure_fp16(layout.logits, layout.in_precision(layout.logits, "fp16"), eval_set, eval_limit)
    layout.report.write_text(json.dumps(report, indent=2) + "\n")

    failures = [failure for graph in report["graphs"].values() for failure in graph.get("failures", [])]
    if failures:
        raise VerificationError(f"export verification failed: {'; '.join(failures)} (report: {layout.report})")
    return layout.logits


def _report_header(reference: str, exporter: str, opset: int, eval_set: EvalSet) -> dict[str, Any]:
    return {
        "model": reference,
        "exporter": exporter, "opset": opset,
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
        "parity": {"tolerances_max_abs_diff": TOLERANCES, "batches": list(PARITY_BATCHES),
                   "random_input": "standard normal pixel_values, seed 0",
                   "real_input": f"first {max(PARITY_BATCHES)} images of {eval_set.description}",
                   "provider": "as OnnxClassifier's 'auto' picks here, exact (CUDA with use_tf32=0); "
                               "each parity row names it"},
        "graphs": {},
    }

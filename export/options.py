"""The export's choices and its flags, shared by `vit-hub export` and `python -m vit_hub.export`.

Light on purpose (argparse only): `vit-hub --help` builds every subcommand's flags, and the
flags are checked here (`check_export_flags`) before the modules that export (torch,
onnxruntime) load.
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from vit_hub.errors import UserError
from vit_hub.layout import DEFAULT_STEM, ExportLayout

EXPORTERS = ("torchscript", "dynamo")
DEFAULT_EXPORTER = "torchscript"
DEFAULT_OPSET = 18
# Opsets each exporter can write in torch 2.14 (LayerNormalization needs 17, onnxscript 18).
OPSETS = {"torchscript": range(17, 21), "dynamo": range(18, 24)}
QUANTIZATIONS = ("int8",)
PRECISIONS = ("fp32", "fp16")  # of the exported graphs (fp16: `--precision fp16`)

DESCRIPTION = "Export a vit_hub model to ONNX, verify it against torch and write a report beside it."
_FILES = ExportLayout(Path(), DEFAULT_STEM)  # what an export into a folder writes, named by vit_hub.layout
_OTHER_STEM = ExportLayout(Path(), "NAME")
_HALF = ", ".join(ExportLayout.in_precision(graph, "fp16").name
                  for graph in (_FILES.logits, _FILES.attentions, _FILES.pipeline))
# What --help says an export writes, wrapped here: the parsers keep a description's line breaks.
FILES_WRITTEN = textwrap.fill(
    f"Every export writes {_FILES.logits.name} (logits), {_FILES.pipeline.name} (decoded pixels in, probabilities "
    f"out: the preprocessing inside), {_FILES.preprocess.name} (that preprocessing alone), {_FILES.config.name} and "
    f"the report, {_FILES.report.name}; --output-attentions adds {_FILES.attentions.name} (logits and attentions) "
    f"and {_FILES.pipeline_map.name} ({_FILES.pipeline.name} with the app's rollout map) and "
    f"{_FILES.pipeline_explain.name} (with the map the app's page opens with, gradients inside), --precision fp16 the "
    f"float16 copies ({_HALF}), --quantize int8 {_FILES.int8.name}. Those are the names in --out FOLDER; --out "
    f"NAME.onnx writes {_OTHER_STEM.logits.name}, {_OTHER_STEM.pipeline.name} and so on.", width=79)


def check_export_options(exporter: str, opset: int) -> None:
    if exporter not in EXPORTERS:
        raise UserError(f"--exporter: expected one of {', '.join(EXPORTERS)}, got {exporter!r}")
    supported = OPSETS[exporter]
    if opset not in supported:
        raise UserError(
            f"--opset: the {exporter} exporter writes opsets {supported.start}-{supported.stop - 1}, got {opset}"
        )


def check_export_flags(args: argparse.Namespace) -> None:
    """The flags no export could run with, refused in one line before torch loads."""
    check_export_options(args.exporter, args.opset)
    if args.eval_limit is not None and args.eval_limit < 1:
        raise UserError(f"--eval-limit: expected a positive number of images, got {args.eval_limit}")


def add_export_flags(parser: argparse.ArgumentParser) -> None:
    """The export's flags, onto `parser`."""
    parser.add_argument("--model", required=True, help="model dir (config.json + model.safetensors) or Hub repo id")
    parser.add_argument("--out", required=True, help="folder (gets model.onnx) or a path ending in .onnx")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default {DEFAULT_OPSET})")
    parser.add_argument("--output-attentions", action="store_true",
                        help=f"also write {_FILES.attentions.name}, with an attentions output (for rollout), and "
                             f"{_FILES.pipeline_map.name}, whose outputs add the app's rollout map, and "
                             f"{_FILES.pipeline_explain.name}, the map the app's page opens with")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="fp16 also writes float16 copies of the graphs (float32 in and out) for the CUDA "
                             "provider, verified and measured against fp32 (default fp32)")
    parser.add_argument("--quantize", choices=QUANTIZATIONS, help=f"also write {_FILES.int8.name} (dynamic "
                        "quantization), its accuracy measured on --calib-data (default: none)")
    parser.add_argument("--calib-data", metavar="D",
                        help="images for real-input parity, fp16 agreement and int8 accuracy: a folder, mnist or a "
                             "torchvision name (default: the bundled MNIST test split for a digit model, else the "
                             "model dir's own samples/, without labels)")
    parser.add_argument("--data-root", help="where torchvision datasets named by --calib-data live "
                                            "(default: VIT_HUB_DATA_ROOT, else ./data)")
    parser.add_argument("--eval-limit", type=int, metavar="N",
                        help="measure int8 accuracy and fp16 agreement on the first N images (default: all)")
    parser.add_argument("--exporter", choices=EXPORTERS, default=DEFAULT_EXPORTER,
                        help=f"torch exporter (default {DEFAULT_EXPORTER}: its graph runs faster here)")

"""The export's choices and its flags, shared by `vit-hub export` and `python -m vit_hub.export`.

Light on purpose (argparse only): `vit-hub --help` builds every subcommand's flags, and the
modules that export (torch, onnxruntime) load only when a command runs.
"""

from __future__ import annotations

import argparse

EXPORTERS = ("torchscript", "dynamo")
DEFAULT_EXPORTER = "torchscript"
DEFAULT_OPSET = 18
QUANTIZATIONS = ("int8",)
PRECISIONS = ("fp32", "fp16")  # of the exported graphs (fp16: `--precision fp16`)
DESCRIPTION = "Export a vit_hub model to ONNX, verify it against torch and write a report beside it."


def add_export_flags(parser: argparse.ArgumentParser) -> None:
    """The export's flags, onto `parser`."""
    parser.add_argument("--model", required=True, help="model dir (config.json + model.safetensors) or Hub repo id")
    parser.add_argument("--out", required=True, help="folder (gets model.onnx) or a path ending in .onnx")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default {DEFAULT_OPSET})")
    parser.add_argument("--output-attentions", action="store_true",
                        help="also write <stem>_attentions.onnx with an attentions output (for rollout)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="fp16 also writes float16 copies of the graphs (float32 in and out) for the CUDA "
                             "provider, verified and measured against fp32 (default fp32)")
    parser.add_argument("--quantize", choices=QUANTIZATIONS, help="also write <stem>_int8.onnx (dynamic "
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

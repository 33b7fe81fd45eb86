"""torch model -> one self-contained ONNX graph file.

Two graphs can be written from the same model:
  * logits only: `pixel_values [batch, C, H, W] -> logits [batch, classes]`, traced through
    the fused attention path, so a classifier never pays for attention weights;
  * with output_attentions: `-> logits, attentions [depth, batch, heads, T, T]` for rollout;
and, for the float16 copy, the logits graph with fused attention: each block's attention one
ONNX Runtime MultiHeadAttention node (fused_graph.py).

Exporters (chosen explicitly; see BENCHMARKS.md for the numbers behind the default):
  * "torchscript" (`dynamo=False`, the default here): its graph ran faster in ONNX Runtime
    on this CPU (onnxruntime fuses its MatMul + Add + Gelu into BiasGelu);
  * "dynamo" (`torch.export`): `dynamic_shapes` for the batch, weights kept inside the file
    (`external_data=False`) instead of a separate `model.onnx.data`.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from vit_hub.errors import UserError
from vit_hub.layout import GRAPH_ATTENTIONS, GRAPH_INPUT, GRAPH_LOGITS

from .fused_graph import fused_copy
from .graph_check import MAX_GRAPH_BYTES, ORT_DOMAIN
from .options import DEFAULT_EXPORTER, DEFAULT_OPSET, OPSETS, check_export_options  # OPSETS: pipeline_check's


class GraphOutputs(nn.Module):
    """The model as a graph returns it: logits, or (logits, attentions [depth, B, heads, T, T])
    with output_attentions (the model's per-block weights, stacked into one output)."""

    def __init__(self, model: nn.Module, output_attentions: bool):
        super().__init__()
        self.model = model
        self.output_attentions = output_attentions

    def forward(self, pixel_values: torch.Tensor):
        logits, attentions = self.model(pixel_values, output_attentions=self.output_attentions)
        return (logits, torch.stack(attentions)) if self.output_attentions else logits


def _check_size(model: nn.Module) -> None:
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if size > MAX_GRAPH_BYTES:  # beyond that, weights would need external data
        raise UserError(
            f"the model's weights take {size / 2**30:.1f} GB; one self-contained .onnx file holds at most 2 GB"
        )


def write_graph(model: nn.Module, path: Path, *, output_attentions: bool, opset: int = DEFAULT_OPSET,
                exporter: str = DEFAULT_EXPORTER, fused_attention: bool = False) -> Path:
    """Export `model` (put in eval mode) to `path`; returns `path`. With `fused_attention`
    (torchscript exporter, logits only) each block's attention is one ONNX Runtime
    MultiHeadAttention node (fused_graph.py)."""
    check_export_options(exporter, opset)
    _check_size(model)
    model.eval()
    config = model.config
    if fused_attention:
        if exporter != "torchscript" or output_attentions:
            raise ValueError("fused attention is written by the torchscript exporter, into logits-only graphs")
        model = fused_copy(model)
    module = GraphOutputs(model, output_attentions=output_attentions).eval()
    outputs = [GRAPH_LOGITS, GRAPH_ATTENTIONS] if output_attentions else [GRAPH_LOGITS]
    # Batch 2, not 1: torch.export would specialise a batch of 1 into a constant.
    example = torch.zeros(2, config.in_channels, *config.image_size)  # [2, C, H, W]
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        if exporter == "torchscript":
            _export_torchscript(module, example, path, outputs, opset, fused_attention)
        else:
            _export_dynamo(module, example, path, outputs, opset)
    return path


def _export_torchscript(module: nn.Module, example: torch.Tensor, path: Path, outputs: list[str],
                        opset: int, fused_attention: bool) -> None:
    batch_axes = {GRAPH_INPUT: {0: "batch"}, GRAPH_LOGITS: {0: "batch"}, GRAPH_ATTENTIONS: {1: "batch"}}
    with warnings.catch_warnings():
        # The input checks in forward() compare shapes; in a fixed-size graph they are constants.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        # The legacy exporter announces its own deprecation, and that it cannot fold strided slices.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message="Constant folding - Only steps=1", category=UserWarning)
        torch.onnx.export(
            module, (example,), str(path), dynamo=False, opset_version=opset,
            input_names=[GRAPH_INPUT], output_names=outputs,
            dynamic_axes={name: batch_axes[name] for name in [GRAPH_INPUT, *outputs]},
            custom_opsets={ORT_DOMAIN: 1} if fused_attention else None,
        )


def _export_dynamo(module: nn.Module, example: torch.Tensor, path: Path, outputs: list[str],
                   opset: int) -> None:
    batch = torch.export.Dim("batch", min=1)
    torch.onnx.export(
        module, (example,), str(path), dynamo=True, opset_version=opset, external_data=False,
        input_names=[GRAPH_INPUT], output_names=outputs, dynamic_shapes={GRAPH_INPUT: {0: batch}}, verbose=False,
    )

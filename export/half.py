"""`--precision fp16`: a half-precision copy of each graph, for ONNX Runtime's CUDA provider.

In float16 every weight and activation takes half the bytes, and the CUDA provider runs the
matrix products on tensor cores. The copy keeps float32 inputs and outputs (a Cast at each
edge), so callers pass and receive the same arrays as with the float32 graph. Every
operator runs in float16: ONNX Runtime's CUDA LayerNormalization and Softmax kernels already
accumulate in float32, and keeping them in float32 in the graph would only add casts. The
logits graph is converted from its ONNX Runtime form (fused_graph.py: attention as one
operator), the attentions graph from the plain one.

The copy is verified like any graph (`verify.py`), at FP16_TOLERANCES, and measured against
the float32 graph on real images: top-1 agreement and the largest logit difference. On a
machine without CUDA both run on the CPU provider, whose float16 arithmetic differs from the
GPU's; the report names the provider.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir
from onnxruntime.transformers.float16 import convert_float_to_float16

from vit_hub.layout import GRAPH_ATTENTIONS, GRAPH_LOGITS

from .evalset import EvalSet, batches
from .runtime import OnnxClassifier

# Largest |fp16 graph - torch float32| accepted: float16 keeps 11 significant bits, so a
# logit near 10 moves by about 1e-2 after a dozen rounded layers; attention weights lie in [0, 1].
FP16_TOLERANCES = {GRAPH_LOGITS: 5e-2, GRAPH_ATTENTIONS: 5e-3}
EVAL_BATCH_SIZE = 256


def convert_to_fp16(source: Path, target: Path) -> Path:
    """float32 graph at `source` -> the same graph in float16 with float32 inputs and outputs."""
    half = convert_float_to_float16(onnx.load(str(source)), keep_io_types=True)
    # The converter appends the input casts after the nodes that read them; sort them back
    # into an order onnx.checker and every runtime accept.
    graph = onnx_ir.from_proto(half)
    graph.graph.sort()
    onnx.save(onnx_ir.to_proto(graph), str(target))
    return target


def measure_fp16(fp32_path: Path, fp16_path: Path, eval_set: EvalSet, limit: int | None = None) -> dict[str, Any]:
    """The fp16 section of the export report: both graphs on the same real images."""
    fp32, fp16 = OnnxClassifier(fp32_path, precision="fp32"), OnnxClassifier(fp32_path, precision="fp16")
    agree = total = 0
    max_diff = 0.0
    for pixels, _ in batches(eval_set, EVAL_BATCH_SIZE, limit):
        logits_fp32, logits_fp16 = fp32.run(pixels), fp16.run(pixels)  # [B, classes] each
        agree += int((logits_fp32.argmax(axis=1) == logits_fp16.argmax(axis=1)).sum())
        max_diff = max(max_diff, float(np.abs(logits_fp32 - logits_fp16).max()))
        total += len(pixels)
    return {"file": fp16_path.name, "bytes": fp16_path.stat().st_size, "fp32_bytes": fp32_path.stat().st_size,
            "data": eval_set.description, "n": total, "provider": fp16.providers[0],
            "top1_agreement": 100.0 * agree / total, "logits_max_abs_diff_vs_fp32": max_diff}

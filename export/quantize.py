"""`--quantize int8`: ONNX Runtime dynamic quantization, measured before it is trusted.

Dynamic quantization stores the weights of every MatMul as int8 and quantizes activations
on the fly at each call, so it needs no calibration pass. `--calib-data` names the images
the int8 graph is measured on: accuracy of the fp32 and the int8 graph on the same batches,
how often they agree, and their speed side by side in one process.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from onnxruntime.quantization import QuantType, quantize_dynamic
from onnxruntime.quantization.shape_inference import quant_pre_process

from .evalset import EvalSet, batches, check_labels
from .runtime import OnnxClassifier
from .timing import machine_load, time_interleaved

# The accuracy an int8 graph may lose against the fp32 graph, in percentage points.
MAX_ACCURACY_DROP_POINTS = 0.3
EVAL_BATCH_SIZE = 256
SPEED_BATCHES = (1, 256)
SPEED_BLOCK_SECONDS = 0.1  # a quick side-by-side; bench/onnx_latency.py measures at length


def quantize_int8(source: Path, target: Path) -> Path:
    """fp32 graph -> int8 dynamic quantization of its MatMul weights, at `target`."""
    with tempfile.TemporaryDirectory() as scratch:
        prepared = Path(scratch) / "prepared.onnx"
        quant_pre_process(str(source), str(prepared))  # shape inference and cleanup, as onnxruntime advises
        quantize_dynamic(
            prepared, target, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
            extra_options={"MatMulConstBOnly": True},  # weights only: attention's q·kᵀ stays fp32
        )
    return target


def _accuracy(fp32: OnnxClassifier, int8: OnnxClassifier, eval_set: EvalSet, limit: int | None) -> dict[str, Any]:
    """Both graphs on the same batches: accuracy of each and how often their top-1 agrees."""
    correct = {"fp32": 0, "int8": 0}
    agree = total = 0
    for pixels, labels in batches(eval_set, EVAL_BATCH_SIZE, limit):
        predicted_fp32 = fp32.run(pixels).argmax(axis=1)  # [B]
        predicted_int8 = int8.run(pixels).argmax(axis=1)
        correct["fp32"] += int((predicted_fp32 == labels).sum())
        correct["int8"] += int((predicted_int8 == labels).sum())
        agree += int((predicted_fp32 == predicted_int8).sum())
        total += len(labels)
    accuracy = {name: 100.0 * count / total for name, count in correct.items()}
    drop = accuracy["fp32"] - accuracy["int8"]
    return {"data": eval_set.description, "n": total, "accuracy_fp32": accuracy["fp32"],
            "accuracy_int8": accuracy["int8"], "accuracy_drop_points": drop,
            "top1_agreement": 100.0 * agree / total, "max_drop_points": MAX_ACCURACY_DROP_POINTS,
            "within_bound": drop <= MAX_ACCURACY_DROP_POINTS}


def _speed(fp32: OnnxClassifier, int8: OnnxClassifier, rounds: int) -> list[dict[str, Any]]:
    """Per-call wall and process CPU time of both graphs at each SPEED_BATCHES size, interleaved."""
    config = fp32.config
    rows = []
    for batch in SPEED_BATCHES:
        pixels = np.random.default_rng(0).normal(size=(batch, config.in_channels, *config.image_size)).astype(np.float32)
        calls = {"fp32": lambda: fp32.run(pixels), "int8": lambda: int8.run(pixels)}
        times = time_interleaved(calls, rounds, block_seconds=SPEED_BLOCK_SECONDS)
        fp32_ms, int8_ms = times["fp32"], times["int8"]
        rows.append({"batch": batch, "fp32_ms": fp32_ms["wall_ms"], "int8_ms": int8_ms["wall_ms"],
                     "speedup": fp32_ms["wall_ms"] / int8_ms["wall_ms"],
                     "fp32_cpu_ms": fp32_ms["cpu_ms"], "int8_cpu_ms": int8_ms["cpu_ms"],
                     "speedup_cpu_time": fp32_ms["cpu_ms"] / int8_ms["cpu_ms"]})
    return rows


def measure_int8(fp32_path: Path, int8_path: Path, eval_set: EvalSet, limit: int | None = None,
                 rounds: int = 5) -> dict[str, Any]:
    """The quantization section of the export report (CPU provider)."""
    fp32, int8 = OnnxClassifier(fp32_path, providers="cpu"), OnnxClassifier(int8_path, providers="cpu")
    check_labels(eval_set, fp32.config)
    return {
        "method": "onnxruntime.quantization.quantize_dynamic (int8 MatMul weights, uint8 activations per call)",
        "file": int8_path.name, "bytes": int8_path.stat().st_size, "fp32_bytes": fp32_path.stat().st_size,
        "accuracy": _accuracy(fp32, int8, eval_set, limit),
        "speed": {"provider": fp32.providers[0], **machine_load(), "per_call": _speed(fp32, int8, rounds)},
    }

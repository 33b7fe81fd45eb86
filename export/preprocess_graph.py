"""`preprocess.onnx`: pipeline.onnx's preprocessing alone, for a server that runs the network
on a GPU in batches (`batched_runtime.UploadClassifier`, or an app in another language).

    image          uint8 [height, width, channels], as pipeline.onnx takes it
    pixel_values   float32 [1, C, H, W]: the network's input, as `preprocess` makes it

The graph is `pipeline_graph.preprocessing_graph`, the operators pipeline.onnx starts with,
with its output named as the network's input. It is meant for ONNX Runtime's CPU provider
(its metadata says so: EXECUTION_PROVIDER): a digit model's canonicalisation is control flow
(Loop, If) over small planes and large convolutions on the full picture, which the CUDA
provider runs with a host sync per step: 27x slower than the CPU provider per upload on an
H200 (BENCHMARKS.md, "A GPU server"). Each upload is preprocessed on the CPU, and the network,
which the CUDA provider runs well, takes many at once.

Every export checks the graph against the Python path on the uploads pipeline.onnx is checked
on: the same pixel values within PIXEL_TOLERANCE (a digit model's are equal bit for bit), and
a refusal (no ink) where the Python path refuses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper
from PIL import Image

from vit_hub.layout import GRAPH_INPUT, PIPELINE_INPUT
from vit_hub.model.config import ViTConfig
from vit_hub.processing import canonical
from vit_hub.processing.preprocess import preprocess

from .pipeline_graph import decoded_pixels, preprocessing_graph
from .session import CPU, ORT_ERRORS, QUIET_RUN, quiet_session_options, without_spinning

EXECUTION_PROVIDER = "vit_hub.execution_provider"  # metadata: the provider the graph is meant for
# Largest |preprocess.onnx - preprocess| accepted per pixel value: both paths run the same float32
# resize and normalisation (an image's own mean and spread in doubles), within 1e-6 on every
# photo mode and size tests/test_pipeline_graph.py tries; the margin is for other CPUs' kernels.
PIXEL_TOLERANCE = 1e-4


def preprocessing_model(config: ViTConfig) -> onnx.ModelProto:
    """image uint8 [height, width, channels] -> pixel_values float32 [1, C, H, W], for the CPU provider."""
    model = preprocessing_graph(config)
    output = model.graph.output[0]
    model.graph.node.append(helper.make_node("Identity", [output.name], [GRAPH_INPUT]))
    output.name = GRAPH_INPUT
    helper.set_model_props(model, {EXECUTION_PROVIDER: CPU})
    onnx.checker.check_model(model)
    return model


def write_preprocessing(target: Path, config: ViTConfig) -> Path:
    onnx.save(preprocessing_model(config), str(target))
    return target


def preprocessing_session(model: onnx.ModelProto | Path, threads: int | None = None,
                          arena: bool = True) -> ort.InferenceSession:
    """A session of a preprocessing graph on the provider it is meant for, the CPU's, whatever
    runs the network (`threads`: its intra-op threads, default onnxruntime's choice). `arena=False`
    for a server: onnxruntime's CPU arena keeps the most any run took for good (760 MB after
    16-megapixel uploads on two threads); without it each run's memory is freed when it ends.
    Its idle threads sleep rather than spin (`session.NO_SPINNING`): the graph's operators are
    many and small, and a spinning thread took as much CPU time as the one running them."""
    options = without_spinning(quiet_session_options())
    options.enable_cpu_mem_arena = arena
    if threads:
        options.intra_op_num_threads = threads
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(source, options, providers=[CPU])


def run_preprocessing(session: ort.InferenceSession, pixels: np.ndarray) -> np.ndarray:
    """uint8 [height, width, channels] -> pixel_values float32 [1, C, H, W]."""
    return session.run([GRAPH_INPUT], {PIPELINE_INPUT: pixels}, QUIET_RUN)[0]


def verify_preprocessing(path: Path, config: ViTConfig, uploads: list[tuple[str, Image.Image]]) -> dict[str, Any]:
    """preprocess.onnx against `preprocess` on each upload: the report's section for it, with a
    failure for any upload whose pixel values differ by more than PIXEL_TOLERANCE, or that one
    path refuses (no ink in a digit model) and the other answers."""
    session = preprocessing_session(path)
    rows, failures = [], []
    for name, image in uploads:
        difference, failure = _compare(session, image, config)
        rows.append({"upload": name, "size": list(image.size), "mode": image.mode, "max_abs_diff": difference,
                     "refused": difference is None})
        if failure:
            failures.append(f"{path.name} on {name}: {failure}")
    differences = [row["max_abs_diff"] for row in rows if row["max_abs_diff"] is not None]
    return {"graph": path.name, "uploads": len(rows), "tolerance_max_abs_diff": PIXEL_TOLERANCE, "provider": CPU,
            "max_abs_diff": max(differences, default=0.0), "rows": rows, "failures": failures}


def _compare(session: ort.InferenceSession, image: Image.Image, config: ViTConfig) -> tuple[float | None, str | None]:
    """(the largest pixel difference, None when both paths refuse; what failed or None) for one upload."""
    try:
        expected = preprocess(image, config)[None]
    except canonical.EmptyImageError:
        try:
            run_preprocessing(session, decoded_pixels(image))
        except ORT_ERRORS:
            return None, None
        return None, "expected a refusal (no ink), as the Python path refuses it, got pixel values"
    try:
        got = run_preprocessing(session, decoded_pixels(image))
    except ORT_ERRORS:
        return None, "expected pixel values, as the Python path gives, got a refusal"
    difference = float(np.abs(expected - got).max())
    if difference > PIXEL_TOLERANCE:
        return difference, f"expected the Python path's pixel values within {PIXEL_TOLERANCE:g}, got {difference:.2g} off"
    return difference, None

"""What a `pipeline.onnx` must be before `vit-hub space --static` bundles it for visitors' browsers.

The page only learns that a graph is broken when it runs in a visitor's browser (an empty file,
a custom operator, another model's graph: "Top class: undefined", or a page stuck loading), so
the graph is checked as `check_graph` checks `model.onnx`, one OnnxModelError naming what was
found, before the Space is written:

  * size and form: at most what the config's weights allow, one self-contained graph with
    no functions or external data, ai.onnx operators only, each among those
    `python -m vit_hub.export` writes into a pipeline for this config, read off the graphs it
    builds (`exported_operators`; in the Loop and If bodies too), at an opset it writes (PIPELINE_OPSETS);
  * inputs and outputs: `image` uint8 [height, width, channels] and `probabilities` float32
    [one per label] first;
  * its weights: the sha256 of model.safetensors it carries, as every exported graph does;
  * a run: once on the Space's first sample, in a child process under an address-space
    limit (`run_limit_bytes`: a graph can ask for any amount of memory at run time), giving
    finite probabilities, one per label, that sum to 1.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto
from PIL import Image

from vit_hub.layout import PIPELINE_INPUT, PIPELINE_OUTPUT
from vit_hub.model.config import ViTConfig

from .exporter import OPSETS
from .graph_builder import OPSET
from .graph_check import (KNOWN_OPS, ONNX_DOMAINS, OnnxModelError, _load, max_graph_bytes, tied_weights, value_dims,
                          weights_sha256)
from .map_graph import map_answers
from .pipeline_graph import decoded_pixels, pipeline_answers, preprocessing_graph

# The operators of pipeline_explain.onnx's traced network (export/gradient_graph.py: gradients as forward
# operators), read off the graphs of the model kinds tests/test_gradient_graph.py exports.
TRACED_OPERATORS = frozenset({
    "Abs", "And", "ArgMax", "BatchNormalization", "Cast", "CastLike", "Concat", "Constant", "Conv", "ConvTranspose",
    "Div", "Equal", "Erf", "Exp", "Expand", "Gather", "Gemm", "LayerNormalization", "Less", "LessOrEqual", "Max", "MatMul", "Mul", "Neg",
    "Not", "Pad", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceSum", "Relu", "Reshape", "ScatterElements",
    "ScatterND", "Shape", "Slice", "Softmax", "Sqrt", "Squeeze", "Sub", "Tile", "Transpose", "Unsqueeze", "Where",
})

PIPELINE_OPSETS = range(OPSET, max(supported.stop for supported in OPSETS.values()))
RUN_BASE_BYTES = 2**30  # the child's address space for Python, numpy and onnxruntime (about 210 MB used)
RUN_TIMEOUT_SECONDS = 120
SUM_TOLERANCE = 1e-3
# The child: runs the graph once on the pixels saved as .npy, prints what came out as JSON.
CHILD = """
import json, sys
import numpy as np, onnxruntime as ort
options = ort.SessionOptions()
options.intra_op_num_threads = options.inter_op_num_threads = 1
options.log_severity_level = 4
try:
    session = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
    outputs = session.run(None, {sys.argv[3]: np.load(sys.argv[2])})
except Exception as error:
    print(json.dumps({"error": str(error).strip().splitlines()[-1][:300]}))
    raise SystemExit
first = np.asarray(outputs[0], dtype=np.float64)
print(json.dumps({"shape": list(first.shape), "sum": float(first.sum()) if first.size else 0.0,
                  "finite": all(bool(np.isfinite(np.asarray(output, dtype=np.float64)).all()) for output in outputs),
                  "in_unit_range": bool(((first >= 0) & (first <= 1)).all())}))
"""


def check_pipeline(path: Path, config: ViTConfig, weights: Path, sample: Path | None) -> None:
    """Raise OnnxModelError unless `path` is the pipeline.onnx `python -m vit_hub.export` wrote for
    `config` and the weights at `weights`, and it answers for the image `sample` (None: an image
    of noise at the model's size; see the module docstring)."""
    model = _load(path, max_graph_bytes(config))
    _check_form(model, path, config)
    _check_inputs_and_outputs(model, path, config)
    if tied_weights({entry.key: entry.value for entry in model.metadata_props}) != weights_sha256(weights):
        raise _refuse(path, f"expected the graph exported from {weights.name} beside it, found one from other "
                            f"weights (or none recorded); export it again: python -m vit_hub.export")
    _check_run(path, config, sample)


def _refuse(path: Path, message: str) -> OnnxModelError:
    return OnnxModelError(f"space --static: {path.name}: {message}")


def _check_form(model: onnx.ModelProto, path: Path, config: ViTConfig) -> None:
    if model.functions or model.graph.sparse_initializer:
        raise _refuse(path, "expected a graph as python -m vit_hub.export writes it, found local functions or sparse "
                            "initializers")
    nodes = list(_all_nodes(model.graph))
    allowed = exported_operators(config)
    unknown = sorted({f"{node.domain}.{node.op_type}" if node.domain not in ONNX_DOMAINS else node.op_type
                      for node in nodes if node.domain not in ONNX_DOMAINS or node.op_type not in allowed})
    if unknown:
        raise _refuse(path, f"expected only the operators python -m vit_hub.export writes into a pipeline, found "
                            f"{', '.join(unknown)}")
    versions = [entry.version for entry in model.opset_import if entry.domain in ONNX_DOMAINS]
    others = sorted({entry.domain for entry in model.opset_import if entry.domain not in ONNX_DOMAINS})
    if others or len(set(versions)) != 1 or versions[0] not in PIPELINE_OPSETS:
        raise _refuse(path, f"expected the ai.onnx opset {PIPELINE_OPSETS.start}-{PIPELINE_OPSETS.stop - 1} alone, "
                            f"found opsets {versions} and domains {others}")
    external = [tensor.name for tensor in _all_initializers(model.graph) if tensor.data_location == TensorProto.EXTERNAL]
    if external:
        raise _refuse(path, f"expected one self-contained file, found initializer {external[0]!r} in external data")


def exported_operators(config: ViTConfig) -> frozenset[str]:
    """The operators pipeline.onnx, pipeline_map.onnx and pipeline_explain.onnx of `config` are
    made of, read off the graphs the export builds for it: the preprocessing (with and without
    model_input), the network's (KNOWN_OPS; TRACED_OPERATORS for the gradients traced into
    pipeline_explain.onnx) and the nodes after it (the calibrated softmax, the rollout map)."""
    built = [preprocessing_graph(config).graph, preprocessing_graph(config, with_model_input=True).graph,
             onnx.helper.make_graph(pipeline_answers(config).nodes, "pipeline", [], []),
             onnx.helper.make_graph(map_answers(config, "model_input").nodes, "map", [], [])]
    return frozenset(node.op_type for graph in built for node in _all_nodes(graph)) | KNOWN_OPS | TRACED_OPERATORS


def _all_nodes(graph: onnx.GraphProto):
    """Every node of `graph` and of the graphs inside its nodes (Loop and If bodies)."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for inner in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                yield from _all_nodes(inner)


def _all_initializers(graph: onnx.GraphProto):
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            for inner in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                yield from _all_initializers(inner)


def _check_inputs_and_outputs(model: onnx.ModelProto, path: Path, config: ViTConfig) -> None:
    graph = model.graph
    stored = {tensor.name for tensor in graph.initializer}
    inputs = [value for value in graph.input if value.name not in stored]
    image_ok = (len(inputs) == 1 and inputs[0].name == PIPELINE_INPUT and len(value_dims(inputs[0])) == 3
                and inputs[0].type.tensor_type.elem_type == TensorProto.UINT8)
    if not image_ok:
        raise _refuse(path, f"expected one input {PIPELINE_INPUT!r}, uint8 [height, width, channels], found "
                            f"{[(value.name, value_dims(value)) for value in inputs]}")
    first = graph.output[0] if graph.output else None
    if first is None or first.name != PIPELINE_OUTPUT or first.type.tensor_type.elem_type != TensorProto.FLOAT \
            or value_dims(first) != [config.num_classes]:
        found = (first.name, value_dims(first)) if first is not None else "no output"
        raise _refuse(path, f"expected its first output {PIPELINE_OUTPUT!r}, float32 [{config.num_classes}] (one per "
                            f"label in config.json), found {found}")


def run_limit_bytes(config: ViTConfig) -> int:
    """The address space the child that runs the graph once may take: the interpreter's, plus twice
    the largest graph of this config (the file read, the session's copy of its weights)."""
    return RUN_BASE_BYTES + 2 * max_graph_bytes(config)


def sample_pixels(sample: Path | None, config: ViTConfig) -> np.ndarray:
    """uint8 [height, width, channels]: the sample decoded, or noise at the model's size."""
    if sample is None:
        return np.random.default_rng(0).integers(0, 256, (*config.image_size, config.in_channels), dtype=np.uint8)
    with Image.open(sample) as image:
        return decoded_pixels(image)


def _check_run(path: Path, config: ViTConfig, sample: Path | None) -> None:
    """Run the graph once on `sample` in a child process under `run_limit_bytes`: finite
    probabilities, one per label, that sum to 1."""
    pixels, shown = sample_pixels(sample, config), sample.name if sample is not None else "an image of noise"
    with tempfile.TemporaryDirectory() as folder:
        saved = Path(folder) / "pixels.npy"
        np.save(saved, pixels)
        limit = run_limit_bytes(config)
        try:
            child = subprocess.run([sys.executable, "-c", CHILD, str(path), str(saved), PIPELINE_INPUT],
                                   capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS,
                                   preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
        except subprocess.TimeoutExpired:
            raise _refuse(path, f"expected an answer for {shown} within {RUN_TIMEOUT_SECONDS} s, found none") from None
    lines = child.stdout.strip().splitlines()
    if child.returncode != 0 or not lines:
        raise _refuse(path, f"expected it to run on {shown} within {limit / 2**30:.1f} GiB, found it stopped "
                            f"(exit {child.returncode}, out of memory?)")
    result = json.loads(lines[-1])
    if "error" in result:
        raise _refuse(path, f"expected it to run on {shown}, found onnxruntime refusing: {result['error']}")
    if result["shape"] != [config.num_classes] or not result["finite"] or not result["in_unit_range"] \
            or not abs(result["sum"] - 1) <= SUM_TOLERANCE:
        raise _refuse(path, f"expected {config.num_classes} finite probabilities summing to 1 for {shown}, "
                            f"found shape {result['shape']}, sum {result['sum']:.4g}"
                            f"{'' if result['finite'] else ', values not finite'}")

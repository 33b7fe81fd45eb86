"""What an ONNX graph must be before ONNX Runtime may load it. Torch-free.

A graph in a model dir is untrusted input, like an upload: 3 KB of ONNX can ask ONNX Runtime
for any amount of memory (a ConstantOfShape, an Expand or a broadcast of 13 GB), when the
session is created (constant folding) or at the first run. The project knows which graphs
it writes (`python -m vit_hub.export`), so `check_graph` accepts those and refuses anything else
with one OnnxModelError naming what it found, before any session exists:

  * size: at most what the config's weights take as float32 (`max_graph_bytes`, read from the
    file's size before a byte of it is read), initializers no larger than the file that holds them;
  * form: one self-contained graph (no external data, sparse initializers or functions) made
    of KNOWN_OPS, the operators the exporters, the float16 converter and int8 quantization
    emit, and the three ONNX Runtime operators the float16 logits graphs use (ORT_OPERATORS:
    their shapes are worked out here, as onnx has no schema for them);
  * inputs and outputs: `pixel_values` [batch, C, H, W] of the config's channels and size,
    `logits` [batch, classes] and optionally `attentions` [depth, batch, heads, T, T];
  * memory: every value's shape, worked out node by node at batch 1, 2 and the largest batch
    the app and CLI run (CHECKED_BATCHES; onnx's shape
    inference, fed the values of the small integer tensors that carry shapes, which onnx's
    reference evaluator computes), within VALUE_SLACK times the largest activation the
    config implies, and all values together within TOTAL_SLACK of it per block.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from vit_hub.errors import UserError
from vit_hub.explain.attribution import OCCLUSION_CHUNK
from vit_hub.layout import GRAPH_ATTENTIONS, GRAPH_INPUT, GRAPH_LOGITS
from vit_hub.model.config import CONV_STEMS, ViTConfig

# A protobuf file cannot exceed 2 GB; the exporter writes nothing larger either.
MAX_GRAPH_BYTES = 2**31 - 1
# A graph holds its model's weights once, as float32 at most (4 bytes), with room for twice as
# many, plus what its nodes, names and small constants take.
GRAPH_BYTES_PER_WEIGHT = 8
GRAPH_BYTES_MARGIN = 16 * 2**20
# Every operator in the graphs `python -m vit_hub.export` writes: the torchscript and dynamo exporters
# (opsets 17-23, every patch embedding, pooling and attention variant), their float16 copies
# and int8 quantization. A new exporter version that emits another one fails its export's
# verification here first.
KNOWN_OPS = frozenset({
    "Add", "Attention", "Cast", "Concat", "Constant", "ConstantOfShape", "Conv", "Div", "DynamicQuantizeLinear",
    "Equal", "Erf", "Exp", "Expand", "EyeLike", "Gather", "Gelu", "Gemm", "Identity", "IsNaN",
    "LayerNormalization", "MatMul", "MatMulInteger", "Mul", "Not", "Pad", "ReduceMean", "Relu", "Reshape",
    "Shape", "Slice", "Softmax", "Split", "Squeeze", "Tanh", "Transpose", "Unsqueeze", "Where",
})
ONNX_DOMAINS = ("", "ai.onnx")
ORT_DOMAIN = "com.microsoft"  # ONNX Runtime's own operators (ORT_OPERATORS, below)
# A value that grows faster than the batch shows at 2, and plainly at the largest batch the app
# and CLI run (a ConstantOfShape of batch cubed passes at 2 within the slack, not at 256).
CHECKED_BATCHES = (1, 2, OCCLUSION_CHUNK)
SHAPE_TENSOR_LIMIT = 4096  # integer tensors up to this many values are computed (shapes, axes, pads)
INTEGER_TYPES = (TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL)
# Exported graphs measured against largest_activation (tests/test_untrusted_graphs.py): no value
# above 1x, all values together at most 8x per block (depth + 2).
VALUE_SLACK = 2
TOTAL_SLACK = 32
SHIFTED_COPIES = 5  # shifted patch tokenization stacks the image and four shifted copies
# The graph's tie to its weights, in its metadata_props: the sha256 of the model.safetensors it
# was exported from (of the weights serialised as safetensors, for a model exported from memory).
WEIGHTS_SHA256 = "vit_hub.weights_sha256"


class OnnxModelError(UserError):
    """A graph that cannot or may not be loaded; the message names the file and what is wrong."""


def check_graph(path: Path, config: ViTConfig) -> None:
    """Raise OnnxModelError unless `path` is a graph `python -m vit_hub.export` could have written for
    `config` (see the module docstring). Reads the file once; creates no session."""
    model = _load(path, max_graph_bytes(config))
    _check_form(model, path)
    _check_inputs_and_outputs(model, path, config)
    for batch in CHECKED_BATCHES:
        _check_allocations(model, path, config, batch)


def weights_sha256(path: Path) -> str:
    """The hex sha256 of a weights file, read in blocks."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def tied_weights(metadata: Mapping[str, str]) -> str | None:
    """The sha256 of the weights a graph was exported from, from its metadata; None when absent."""
    return metadata.get(WEIGHTS_SHA256) or None


def largest_activation(config: ViTConfig) -> int:
    """Values in the largest tensor the model makes for one image: the stacked attentions, the
    qkv projection or MLP hidden layer, the input (or its shifted copies, or the conv stem's
    first layer), the logits."""
    height, width = config.image_size
    tokens, dim = config.num_tokens, config.embed_dim
    candidates = [config.depth * config.num_heads * tokens**2, tokens * max(3 * dim, int(dim * config.mlp_ratio)),
                  config.in_channels * height * width, config.num_classes, config.pre_logits]
    if config.patch_embedding == "shifted":
        candidates.append(SHIFTED_COPIES * config.in_channels * height * width)
    if config.patch_embedding in CONV_STEMS:
        candidates.append(max(8, dim) * height * width // 4)  # a bound on the first stride-2 convolution's output
    return max(candidates)


def max_graph_bytes(config: ViTConfig) -> int:
    """The largest file a graph of `config` may be (GRAPH_BYTES_PER_WEIGHT, GRAPH_BYTES_MARGIN)."""
    return min(MAX_GRAPH_BYTES, GRAPH_BYTES_PER_WEIGHT * most_weights(config) + GRAPH_BYTES_MARGIN)


def most_weights(config: ViTConfig) -> int:
    """An upper bound on the weights a model of `config` holds, whatever its patch embedding."""
    dim, hidden = config.embed_dim, int(config.embed_dim * config.mlp_ratio)
    block = 4 * dim * dim + 2 * dim * hidden + 10 * dim + hidden + config.num_heads  # attention, MLP, norms
    patches = max(SHIFTED_COPIES * config.in_channels * math.prod(config.patch_size) * (dim + 2),  # one convolution
                  9 * config.in_channels * max(8, dim) + 20 * max(8, dim) ** 2)  # the conv stems' (hybrid: ~19 D^2)
    width = config.pre_logits or dim
    return (config.depth * block + patches + (config.num_tokens + 4) * dim + dim * config.pre_logits
            + (width + 1) * config.num_classes)


def _refuse(path: Path, message: str) -> OnnxModelError:
    return OnnxModelError(f"{path}: {message}")


def _load(path: Path, max_bytes: int) -> onnx.ModelProto:
    """The file's ModelProto, read after its size was checked; never its external data."""
    size = path.stat().st_size
    if size > max_bytes:
        raise _refuse(path, f"expected an ONNX graph of at most {max_bytes / 2**20:,.1f} MB for this config's "
                            f"weights, found {size / 2**20:,.1f} MB")
    try:
        model = onnx.load_model_from_string(path.read_bytes())
    except DecodeError as error:
        raise _refuse(path, f"expected an ONNX model onnxruntime can load, found one it cannot "
                            f"(not an ONNX ModelProto: {error})") from None
    if not model.graph.node:
        raise _refuse(path, "expected an ONNX model onnxruntime can load, found one it cannot (no graph in it)")
    return model


def _check_form(model: onnx.ModelProto, path: Path) -> None:
    graph = model.graph
    if model.functions or graph.sparse_initializer:
        raise _refuse(path, "expected a graph as python -m vit_hub.export writes it, found local functions or sparse "
                            "initializers")
    declared = 0
    for tensor in graph.initializer:
        if tensor.data_location == TensorProto.EXTERNAL:
            raise _refuse(path, f"expected one self-contained file, found initializer {tensor.name!r} in "
                                f"external data")
        declared += math.prod(tensor.dims) * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    if declared > path.stat().st_size:
        raise _refuse(path, f"expected initializers the file holds, found {declared / 1e6:.1f} MB declared in a "
                            f"file of {path.stat().st_size / 1e6:.1f} MB")
    unknown = sorted({f"{node.domain}.{node.op_type}" if node.domain not in ONNX_DOMAINS else node.op_type
                      for node in graph.node if not _known(node)})
    if unknown:
        raise _refuse(path, f"expected only the operators python -m vit_hub.export writes, found {', '.join(unknown)}")


def value_dims(value: onnx.ValueInfoProto) -> list[int | str]:
    """A graph input's or output's shape as declared: sizes, names of symbolic axes."""
    return [dim.dim_param or dim.dim_value for dim in value.type.tensor_type.shape.dim]


def _check_inputs_and_outputs(model: onnx.ModelProto, path: Path, config: ViTConfig) -> None:
    graph = model.graph
    stored = {tensor.name for tensor in graph.initializer}
    inputs = [value for value in graph.input if value.name not in stored]
    outputs = [value.name for value in graph.output]
    expected_outputs = ([GRAPH_LOGITS], [GRAPH_LOGITS, GRAPH_ATTENTIONS])
    if [value.name for value in inputs] != [GRAPH_INPUT] or outputs not in expected_outputs:
        raise _refuse(path, f"is not a vit_hub export: expected input {GRAPH_INPUT!r} and output {GRAPH_LOGITS!r} "
                            f"(and {GRAPH_ATTENTIONS!r}), got inputs {[value.name for value in inputs]} and outputs "
                            f"{outputs}")
    wrong_types = [value.name for value in [*inputs, *graph.output] if value.type.tensor_type.elem_type != TensorProto.FLOAT]
    if wrong_types:
        raise _refuse(path, f"expected float32 inputs and outputs, found other types for {wrong_types}")
    batch, *image_shape = value_dims(inputs[0]) or [None]
    config_shape = [config.in_channels, *config.image_size]
    if image_shape != config_shape:
        raise _refuse(path, f"takes images of shape {image_shape} but its config says {config_shape}: expected "
                            f"the graph exported for this config, found one for another")
    if not isinstance(batch, str):
        raise _refuse(path, f"expected a symbolic batch axis, found {GRAPH_INPUT} {value_dims(inputs[0])}")


def _expected_outputs(config: ViTConfig, batch: int) -> dict[str, list[int]]:
    """The output shapes at `batch`: logits (the pooled features for a model without a head)
    and the attentions of every block."""
    width = config.num_classes or config.pre_logits or config.embed_dim
    tokens = config.num_tokens
    return {GRAPH_LOGITS: [batch, width],
            GRAPH_ATTENTIONS: [config.depth, batch, config.num_heads, tokens, tokens]}


class _Shapes:
    """Shapes and element types of every value, and the values of small integer tensors."""

    def __init__(self) -> None:
        self.types: dict[str, onnx.TypeProto] = {}
        self.values: dict[str, np.ndarray] = {}

    def add(self, name: str, elem_type: int, dims: list[int], value: np.ndarray | None = None) -> None:
        self.types[name] = helper.make_tensor_type_proto(elem_type, dims)
        if value is not None:
            self.values[name] = value

    def dims(self, name: str) -> list[int]:
        return [dim.dim_value for dim in self.types[name].tensor_type.shape.dim]

    def is_small_integer(self, name: str) -> bool:
        return (self.types[name].tensor_type.elem_type in INTEGER_TYPES
                and math.prod(self.dims(name)) <= SHAPE_TENSOR_LIMIT)


def _known(node: onnx.NodeProto) -> bool:
    if node.domain in ONNX_DOMAINS:
        return node.op_type in KNOWN_OPS
    return node.domain == ORT_DOMAIN and node.op_type in ORT_OPERATORS


def _check_allocations(model: onnx.ModelProto, path: Path, config: ViTConfig, batch: int) -> None:
    """Work out every value's shape at `batch` and refuse the graph at the first value, or the
    running total, beyond what the config allows."""
    graph, opset = model.graph, _onnx_opset(model, path)
    activation = largest_activation(config)
    value_limit = VALUE_SLACK * activation * batch
    total_limit = TOTAL_SLACK * (config.depth + 2) * activation * batch
    known = _Shapes()
    for tensor in graph.initializer:
        small = tensor.data_type in INTEGER_TYPES and math.prod(tensor.dims) <= SHAPE_TENSOR_LIMIT
        known.add(tensor.name, tensor.data_type, list(tensor.dims), numpy_helper.to_array(tensor) if small else None)
    known.add(GRAPH_INPUT, TensorProto.FLOAT, [batch, config.in_channels, *config.image_size])
    total = 0
    for node in graph.node:
        shown = f"{node.op_type} node {node.name or node.output[0]!r}"
        for name, dims in _output_shapes(node, known, opset, path, shown):
            count = math.prod(dims)
            total += count
            if count > value_limit or total > total_limit:
                what = f"a {dims} tensor" if count > value_limit else f"the total {total:,}"
                raise _refuse(path, f"expected at most {value_limit:,} values per tensor and {total_limit:,} in "
                                    f"all at batch {batch} (this config's largest activation has {activation:,}), "
                                    f"found {shown} making {what}")
        _compute_small_integers(node, known)
    expected = _expected_outputs(config, batch)
    for value in graph.output:
        if known.dims(value.name) != expected[value.name]:
            raise _refuse(path, f"expected {value.name} of shape {expected[value.name]} at batch {batch}, "
                                f"found {known.dims(value.name)}")


def _onnx_opset(model: onnx.ModelProto, path: Path) -> int:
    versions = [entry.version for entry in model.opset_import if entry.domain in ONNX_DOMAINS]
    if not versions:
        raise _refuse(path, "expected an ai.onnx opset import, found none")
    return versions[0]


def _output_shapes(node: onnx.NodeProto, known: _Shapes, opset: int, path: Path, shown: str):
    """(name, dims) of each output of `node`, from onnx's shape inference with the input shapes
    and small integer values known so far; a shape it cannot fix is refused."""
    missing = [name for name in node.input if name and name not in known.types]
    if missing:
        raise _refuse(path, f"expected nodes in order, each reading values made before it, found {shown} "
                            f"reading {missing[0]!r}, which nothing made before")
    if node.domain not in ONNX_DOMAINS:
        yield from _contrib_shapes(node, known, path, shown)
        return
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
        inferred = onnx.shape_inference.infer_node_outputs(
            schema, node, {name: known.types[name] for name in node.input if name},
            {name: numpy_helper.from_array(known.values[name], name) for name in node.input if name in known.values})
    except (onnx.defs.SchemaError, onnx.shape_inference.InferenceError) as error:
        raise _refuse(path, f"expected a graph whose shapes follow from its input, found {shown} that does not "
                            f"check ({str(error).strip().splitlines()[0][:200]})") from None
    for name in filter(None, node.output):
        tensor = inferred[name].tensor_type if name in inferred else None
        dims = [dim.dim_value if dim.HasField("dim_value") else None for dim in tensor.shape.dim] \
            if tensor is not None and tensor.HasField("shape") else None
        if dims is None or any(dim is None or dim < 0 for dim in dims):
            raise _refuse(path, f"expected a graph whose shapes follow from its input, found {shown} whose "
                                f"output {name!r} has no fixed shape ({dims})")
        known.add(name, tensor.elem_type, dims)
        yield name, dims


def _contrib_shapes(node: onnx.NodeProto, known: _Shapes, path: Path, shown: str):
    """(name, dims) of the outputs of one of ONNX Runtime's operators in ORT_OPERATORS, each
    output in the type of the node's first input; a node of any other form is refused."""
    inputs = [known.dims(name) if name else None for name in node.input]
    shapes = ORT_OPERATORS[node.op_type](inputs, node) if inputs and inputs[0] else None
    outputs = list(node.output)
    if shapes is None or len(outputs) > len(shapes) or any(name and shapes[i] is None for i, name in enumerate(outputs)):
        raise _refuse(path, f"expected {node.op_type} as the float16 graphs use it, found {shown} reading "
                            f"{inputs} and writing {len(outputs)} outputs")
    elem_type = known.types[node.input[0]].tensor_type.elem_type
    for name, dims in zip(outputs, shapes):
        if name:
            known.add(name, elem_type, dims)
            yield name, dims


def _attention(inputs: list, node: onnx.NodeProto) -> list | None:
    """MultiHeadAttention: queries [B, Q, D], keys and values [B, T, D], no projection bias or
    padding mask, optionally an additive bias [1, 1, Q, T], whole heads -> [B, Q, D]."""
    query, key, value, *rest = inputs + [None] * (3 - len(inputs))
    heads = next((attribute.i for attribute in node.attribute if attribute.name == "num_heads"), 0)
    if len(query) != 3 or key is None or key != value or len(key) != 3 or key[0::2] != query[0::2]:
        return None
    if heads < 1 or query[2] % heads or len(rest) > 3 or any(rest[:2]) or rest[2:] not in ([], [[1, 1, query[1], key[1]]]):
        return None
    return [query]


def _skip_layer_norm(inputs: list, node: onnx.NodeProto) -> list | None:
    """SkipLayerNormalization: x and skip [B, T, D], gain, shift and bias [D] -> (LayerNorm of
    x + skip + bias [B, T, D], mean [B, T, 1], inverse deviation [B, T, 1], the sum [B, T, D])."""
    x, skip, *weights = inputs + [None] * (2 - len(inputs))
    if len(x) != 3 or skip != x or not 1 <= len(weights) <= 3 or any(weight not in (None, x[2:]) for weight in weights):
        return None
    statistics = [*x[:2], 1]
    return [x, statistics, statistics, x]


def _bias_gelu(inputs: list, node: onnx.NodeProto) -> list | None:
    """BiasGelu: x [..., D] and bias [D] -> Gelu(x + bias) [..., D]."""
    x, bias = (inputs + [None])[:2]
    return [x] if len(inputs) == 2 and bias == x[-1:] else None


# ONNX Runtime's operators in the float16 logits graphs (fused_graph.py), with the shapes
# they make: onnx has no schema for them, so `_contrib_shapes` works their outputs out here.
ORT_OPERATORS = {"MultiHeadAttention": _attention, "SkipLayerNormalization": _skip_layer_norm,
                 "BiasGelu": _bias_gelu}


def _compute_small_integers(node: onnx.NodeProto, known: _Shapes) -> None:
    """The values of the node's outputs when they are small integer tensors computed from known
    values (shapes, axes, pads), by onnx's reference evaluator; Shape reads the known shape."""
    outputs = [name for name in node.output if name]
    if not all(known.is_small_integer(name) for name in outputs):
        return
    if node.op_type == "Shape":
        attributes = {attribute.name: attribute.i for attribute in node.attribute}
        dims = known.dims(node.input[0])
        known.values[outputs[0]] = np.array(dims[attributes.get("start", 0):attributes.get("end", len(dims))],
                                            dtype=np.int64)
        return
    inputs = [name for name in node.input if name]
    if not all(name in known.values for name in inputs):
        return
    results = ReferenceEvaluator(node).run(None, {name: known.values[name] for name in inputs})
    for name, result in zip(outputs, results):
        known.values[name] = np.asarray(result)

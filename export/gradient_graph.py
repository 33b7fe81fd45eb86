"""`pipeline_explain.onnx`: pipeline_map.onnx with the page's opening map, gradients included, for
apps that draw the app's most faithful map without Python or torch.

    image          uint8 [height, width, channels]   as pipeline.onnx takes it
    probabilities  float32 [num_classes]             as pipeline.onnx gives them
    map            float32 [grid_h, grid_w] in [0, 1]  the map the Gradio page opens with for this
                                                     model (`opening_method`; the graph's metadata
                                                     names it under MAP_METHOD_KEY): integrated
                                                     gradients + gradient rollout for the bundled
                                                     model, with the app's steps and baseline
    rollout        float32 [grid_h, grid_w] in [0, 1]  attention rollout, as pipeline_map.onnx's map
    model_input    uint8 [H, W, C]                   the image the model saw, as in pipeline_map.onnx
    map_colours    uint8 [256, 3]                    the app's colour map

How gradients get into an inference graph: ONNX has no backward operators an inference build runs
(its Gradient op is for training builds). So the backward pass is written out as forward
operators: `make_fx` runs `pixel_attributions` (the Python page's own function) once on an
example and records every ATen operator it dispatches, autograd's backward ones included, and
the core ATen decompositions rewrite those into plain arithmetic (softmax backward into Mul and
Sub, LayerNorm backward into its sums). Two details make that graph exportable: the attention is
the explicit one (`output_attentions=True`, as `pixel_attributions` asks for; the fused SDPA
kernel's backward has no ONNX form), and the convolution's backward with respect to its input is
rewritten here as the transposed convolution it is (`_convolution_input_gradient`; ATen keeps it
one fused operator that no exporter translates). `torch.onnx.export(dynamo=True)` then writes the
recorded graph; the map's last steps (gradient rollout, `with_context`, min-max scaling) are
torch twins of the NumPy ones in `vit_hub.explain.gradients`, traced with it.

The recorded graph is for one image: an upload is one image, as in pipeline.onnx. Every export
checks it against the Python page (`verify_explain_pipeline`): the probabilities as
pipeline.onnx's, `map` against `vit_hub.explain.run.explain` with the torch model within
MAP_TOLERANCE, `rollout` and `model_input` as pipeline_map.onnx's; a graph that drifts is not
installed.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import helper
from PIL import Image
from torch import nn

from vit_hub.errors import UserError
from vit_hub.explain.attribution import METHODS
from vit_hub.explain.gradients import CONTEXT_SHARE, INTEGRATED_GRADIENT_STEPS, pixel_attributions
from vit_hub.explain.rollout import DEFAULT_COLOURMAP, FLAT_SPREAD, colour_table
from vit_hub.explain.run import explain
from vit_hub.layout import (GRAPH_ATTENTIONS, GRAPH_INPUT, GRAPH_LOGITS, MAP_LABEL_KEY, MAP_METHOD_KEY, PIPELINE_INPUT,
                            PIPELINE_MAP, PIPELINE_MAP_COLOURS, PIPELINE_MODEL_INPUT, PIPELINE_OUTPUT, PIPELINE_ROLLOUT)
from vit_hub.model.config import ViTConfig
from vit_hub.processing import canonical
from vit_hub.processing.preprocess import model_pixels, resize, to_model_domain

from .graph_builder import FLOAT, UINT8, GraphBuilder
from .map_graph import MAP_TOLERANCE, python_rollout
from .options import DEFAULT_OPSET
from .pipeline_graph import (PROBABILITY_TOLERANCE, _same_opset, decoded_pixels, pipeline_session, preprocessing_graph,
                             probabilities, save_with_image_input, verify_pipeline)
from .rollout_graph import rollout_map
from .session import QUIET_RUN

# The opening methods the graph computes (`opening_method` picks among the quick ones).
GRAPH_METHODS = ("integrated_gradients_rollout", "integrated_gradients")
EXPLAIN_OUTPUTS = (PIPELINE_OUTPUT, PIPELINE_MAP, PIPELINE_ROLLOUT, PIPELINE_MODEL_INPUT, PIPELINE_MAP_COLOURS)
OPENING_MAP = "opening_map"  # the network graph's third output, [1, grid_h, grid_w]
NETWORK_OUTPUTS = (GRAPH_LOGITS, GRAPH_ATTENTIONS, OPENING_MAP)
NETWORK = "network/"  # the prefix of the traced network's names inside the pipeline

aten = torch.ops.aten


def check_graph_method(method: str) -> None:
    if method not in GRAPH_METHODS:
        raise UserError(f"pipeline_explain.onnx: expected an opening method among {', '.join(GRAPH_METHODS)}, "
                        f"got {method!r}")


# The map's last steps in torch, step for step as vit_hub.explain.gradients does them in NumPy ----
def scaled(maps: torch.Tensor) -> torch.Tensor:
    """rollout.scale_maps of [B, h, w]: min-max scaled; a map flat to round-off becomes zeros."""
    low, high = maps.amin((-2, -1), keepdim=True), maps.amax((-2, -1), keepdim=True)
    flat = (high - low) <= FLAT_SPREAD * high.abs()
    return torch.where(flat, 0.0, (maps - low) / torch.where(flat, 1.0, high - low))


def gradient_rollout(attentions: torch.Tensor, gradients: torch.Tensor, config: ViTConfig) -> torch.Tensor:
    """gradients.gradient_rollout: [depth, B, heads, T, T] twice -> [B, grid_h, grid_w] in [0, 1]."""
    weighted = (attentions * gradients).clamp(min=0.0).mean(2)  # [L, B, T, T]
    tokens = weighted.shape[-1]
    relevance = torch.eye(tokens).expand(weighted.shape[1], tokens, tokens)  # [B, T, T]
    for layer in weighted:
        relevance = relevance + layer @ relevance
    patches = relevance[:, 0, 1:] if config.pooling == "cls" else relevance[:, 1:, 1:].mean(1)  # [B, N]
    return scaled(patches.reshape(-1, *config.grid_size))


def with_context(attributions: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """gradients.with_context: integrated gradients' positive part first, the context after."""
    positive = attributions.clamp(min=0.0)
    positive = positive / positive.amax((-2, -1), keepdim=True).clamp(min=1e-12)
    return scaled(positive + CONTEXT_SHARE * context)


class OpeningMapNetwork(nn.Module):
    """pixel_values [1, C, H, W] -> (logits [1, classes], attentions [depth, 1, heads, T, T],
    the opening map [1, grid_h, grid_w]) as the torch page computes `method`."""

    def __init__(self, model: nn.Module, method: str, steps: int = INTEGRATED_GRADIENT_STEPS):
        super().__init__()
        check_graph_method(method)
        self.model, self.method, self.steps = model, method, steps

    def forward(self, pixel_values: torch.Tensor):
        logits, attentions, attributions, gradients = pixel_attributions(self.model, pixel_values, steps=self.steps)
        if self.method == "integrated_gradients":
            return logits, attentions, scaled(attributions)
        context = gradient_rollout(attentions, gradients, self.model.config)
        return logits, attentions, with_context(attributions, context)


def _convolution_input_gradient(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                                output_padding, groups, output_mask):
    """aten.convolution_backward, the input's gradient alone: the transposed convolution of the
    output's gradient with the same weights (an ONNX ConvTranspose). output_padding gives back
    the rows and columns a strided convolution skipped."""
    if transposed or any(output_mask[1:]):
        raise NotImplementedError("only the input gradient of a convolution is traced into pipeline_explain.onnx")
    spans = [(out - 1) * step - 2 * pad + dil * (kernel - 1) + 1 for out, step, pad, dil, kernel
             in zip(grad_output.shape[2:], stride, padding, dilation, weight.shape[2:])]
    skipped = [size - span for size, span in zip(input.shape[2:], spans)]
    gradient = aten.convolution.default(grad_output, weight, None, stride, padding, dilation, True, skipped, groups)
    return gradient, None, None


def write_network(model: nn.Module, method: str, target: Path, opset: int = DEFAULT_OPSET) -> Path:
    """`OpeningMapNetwork` traced into forward operators (see the module docstring) -> `target`:
    pixel_values [1, C, H, W] -> logits, attentions, opening_map."""
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    config = model.config
    network = OpeningMapNetwork(model.eval(), method).eval()
    example = torch.zeros(1, config.in_channels, *config.image_size)  # [1, C, H, W]
    decompositions = {**core_aten_decompositions(), aten.convolution_backward.default: _convolution_input_gradient}
    traced = make_fx(network, decomposition_table=decompositions)(example)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on the traced module's constants
        torch.onnx.export(traced, (example,), str(target), dynamo=True, opset_version=opset, external_data=False,
                          input_names=[GRAPH_INPUT], output_names=list(NETWORK_OUTPUTS),
                          verbose=False)
    return target


def write_explain_pipeline(model: nn.Module, method: str, target: Path) -> Path:
    """preprocessing_graph (with model_input) + the traced network + the softmax at the config's
    temperature and the rollout map -> `target`, its metadata naming the map's method."""
    config = model.config
    with tempfile.TemporaryDirectory() as folder:
        # Prefixed: the exporter's value names (div_1, ...) are GraphBuilder's names too.
        network = onnx.compose.add_prefix(onnx.load(str(write_network(model, method, Path(folder) / "network.onnx"))),
                                          NETWORK)
    preprocessing = onnx.compose.add_prefix(preprocessing_graph(config, with_model_input=True), "preprocess/")
    network, preprocessing = _same_opset(network, preprocessing)
    pixel_values, seen = (value.name for value in preprocessing.graph.output)
    merged = onnx.compose.merge_models(preprocessing, network, io_map=[(pixel_values, NETWORK + GRAPH_INPUT)],
                                       outputs=[seen, *(NETWORK + name for name in NETWORK_OUTPUTS)], prefix2="")
    merged.graph.node.extend(explain_answers(config, seen).nodes)
    height, width = config.image_size
    del merged.graph.output[:]
    merged.graph.output.extend([
        helper.make_tensor_value_info(PIPELINE_OUTPUT, FLOAT, [config.num_classes]),
        helper.make_tensor_value_info(PIPELINE_MAP, FLOAT, list(config.grid_size)),
        helper.make_tensor_value_info(PIPELINE_ROLLOUT, FLOAT, list(config.grid_size)),
        helper.make_tensor_value_info(PIPELINE_MODEL_INPUT, UINT8, [height, width, config.in_channels]),
        helper.make_tensor_value_info(PIPELINE_MAP_COLOURS, UINT8, [256, 3])])
    helper.set_model_props(merged, {MAP_METHOD_KEY: method, MAP_LABEL_KEY: METHODS[method].label})
    return save_with_image_input(merged, target)


def explain_answers(config: ViTConfig, seen: str) -> GraphBuilder:
    """The nodes after the network: its logits, attentions and opening map, and the
    preprocessing's image `seen` -> the outputs EXPLAIN_OUTPUTS."""
    g = GraphBuilder()
    logits, attentions, opening = (NETWORK + name for name in NETWORK_OUTPUTS)
    answers = {PIPELINE_OUTPUT: probabilities(g, logits, config),
               PIPELINE_MAP: g.Squeeze(opening, g.const([0])),
               PIPELINE_ROLLOUT: g.Squeeze(rollout_map(g, attentions, config), g.const([0])),
               PIPELINE_MODEL_INPUT: seen, PIPELINE_MAP_COLOURS: g.const(colour_table(DEFAULT_COLOURMAP))}
    g.nodes.extend(helper.make_node("Identity", [value], [name], name=name) for name, value in answers.items())
    return g


def graph_method(path: Path) -> str:
    """The method a pipeline_explain.onnx's `map` is, from its metadata."""
    return {entry.key: entry.value for entry in onnx.load(str(path), load_external_data=False).metadata_props
            }.get(MAP_METHOD_KEY, "")


def run_explain_pipeline(session: ort.InferenceSession, pixels: np.ndarray) -> dict[str, np.ndarray]:
    """uint8 [height, width, channels] -> {output name: value} of every output in EXPLAIN_OUTPUTS."""
    return dict(zip(EXPLAIN_OUTPUTS, session.run(list(EXPLAIN_OUTPUTS), {PIPELINE_INPUT: pixels}, QUIET_RUN)))


def python_opening_map(model: nn.Module, view: Image.Image, method: str) -> tuple[np.ndarray, int]:
    """The Python page's map of an image already in the model's domain, and its class:
    `explain` with the torch model -> ([grid_h, grid_w], predicted index)."""
    explained = explain(model, model_pixels(view, model.config)[None], method)
    return explained.maps[0], int(explained.logits[0].argmax())


def verify_explain_pipeline(pipeline: Path, logits_graph: Path, attentions_graph: Path, model: nn.Module,
                            uploads: list[tuple[str, Image.Image]], tolerance: float = MAP_TOLERANCE) -> dict[str, Any]:
    """pipeline_explain.onnx against the Python path on each upload: its probabilities as
    `verify_pipeline` checks pipeline.onnx's, its map against the torch page's map of the same
    method (and class), its rollout and model_input as pipeline_map.onnx's (uploads both refuse
    are skipped) -> the report's section, with a failure per upload that disagrees."""
    config, method = model.config, graph_method(pipeline)
    section = verify_pipeline(pipeline, logits_graph, config, uploads, PROBABILITY_TOLERANCE)
    graph, network = pipeline_session(pipeline), pipeline_session(attentions_graph)
    for row, (name, image) in zip(section["rows"], uploads):
        if row.get("refused"):
            continue
        row.update(_differences(graph, network, model, image, method))
        if max(row["map_max_abs_diff"], row["rollout_max_abs_diff"]) > tolerance \
                or row["model_input_max_abs_diff"] > 0 or not row["map_same_label"]:
            section["failures"].append(
                f"{pipeline.name} on {name}: expected the Python page's {method} map and rollout within {tolerance:g}, "
                f"its class and its model input exactly, got differences of {row['map_max_abs_diff']:.2g} and "
                f"{row['rollout_max_abs_diff']:.2g}, {'the same' if row['map_same_label'] else 'another'} class, "
                f"{row['model_input_max_abs_diff']:g} gray levels")
    section.update(method=method, map_tolerance_max_abs_diff=tolerance,
                   map_max_abs_diff=max((row.get("map_max_abs_diff", 0.0) for row in section["rows"]), default=0.0),
                   rollout_max_abs_diff=max((row.get("rollout_max_abs_diff", 0.0) for row in section["rows"]),
                                            default=0.0))
    return section


def _differences(graph: ort.InferenceSession, network: ort.InferenceSession, model: nn.Module, image: Image.Image,
                 method: str) -> dict[str, Any]:
    """The graph's answers for one upload against the Python path's: the largest differences of
    the map, the rollout and model_input, and whether both maps explain the same class."""
    config = model.config
    try:
        view = to_model_domain(image, config)
    except canonical.EmptyImageError:  # verify_pipeline has judged a refusal already
        return {"map_max_abs_diff": 0.0, "rollout_max_abs_diff": 0.0, "model_input_max_abs_diff": 0.0,
                "map_same_label": True}
    got = run_explain_pipeline(graph, decoded_pixels(image))
    expected, label = python_opening_map(model, view, method)
    seen = np.asarray(resize(view, config)).reshape(*config.image_size, config.in_channels)
    return {"map_max_abs_diff": float(np.abs(got[PIPELINE_MAP] - expected).max()),
            "rollout_max_abs_diff": float(np.abs(got[PIPELINE_ROLLOUT] - python_rollout(network, view, config)).max()),
            "model_input_max_abs_diff": float(np.abs(got[PIPELINE_MODEL_INPUT].astype(np.int16) - seen).max()),
            "map_same_label": int(got[PIPELINE_OUTPUT].argmax()) == label}

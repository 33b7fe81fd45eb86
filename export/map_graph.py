"""`pipeline_map.onnx`: pipeline.onnx's answer and where the model looked, for apps that draw
the app's overlay without Python.

    image          uint8 [height, width, channels]   as pipeline.onnx takes it
    probabilities  float32 [num_classes]             as pipeline.onnx gives them
    map            float32 [grid_h, grid_w] in [0, 1]  attention rollout with the app's defaults
                                                     (heads fused by their mean, nothing discarded,
                                                     the config's pooling): map[i][j] scores the
                                                     patch in row i, column j of model_input
    model_input    uint8 [H, W, C]                   the image the model saw: canonicalised (a
                                                     digit model's centred digit) and resized
    map_colours    uint8 [256, 3]                    the app's colour map: a map value v is drawn
                                                     in map_colours[round(255 * v)]

The map is `vit_hub.explain.rollout.attention_rollout` as graph operators (`rollout_graph`) on the
network's attentions. A sibling of pipeline.onnx rather than more outputs on it: ONNX Runtime
runs every node of a graph whichever outputs a caller asks for (BENCHMARKS.md, "The map inside
the graph"), so an app that wants the probabilities alone keeps the graph without the map. Every
export checks the graph against the Python path (`verify_map_pipeline`): the probabilities as
pipeline.onnx's, the map against `attention_rollout` of the attentions graph's output within
MAP_TOLERANCE, model_input against the Python path's resized view pixel for pixel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper
from PIL import Image

from vit_hub.explain.rollout import DEFAULT_COLOURMAP, attention_rollout, colour_table
from vit_hub.layout import (GRAPH_ATTENTIONS, GRAPH_INPUT, GRAPH_LOGITS, PIPELINE_INPUT, PIPELINE_MAP,
                            PIPELINE_MAP_COLOURS, PIPELINE_MODEL_INPUT, PIPELINE_OUTPUT)
from vit_hub.model.config import ViTConfig
from vit_hub.processing import canonical
from vit_hub.processing.preprocess import model_pixels, resize, to_model_domain

from .graph_builder import FLOAT, UINT8, GraphBuilder
from .pipeline_graph import (PROBABILITY_TOLERANCE, _same_opset, decoded_pixels, pipeline_session, preprocessing_graph,
                             probabilities, save_with_image_input, verify_pipeline)
from .rollout_graph import rollout_map
from .session import QUIET_RUN

MAP_TOLERANCE = 1e-3  # largest |map - the Python path's rollout| accepted per patch
MAP_OUTPUTS = (PIPELINE_OUTPUT, PIPELINE_MAP, PIPELINE_MODEL_INPUT, PIPELINE_MAP_COLOURS)


def write_map_pipeline(attentions_graph: Path, target: Path, config: ViTConfig) -> Path:
    """preprocessing_graph (with model_input) + the attentions graph at `attentions_graph` +
    the softmax at the config's temperature and the rollout map -> `target`."""
    network = onnx.load(str(attentions_graph))
    preprocessing = onnx.compose.add_prefix(preprocessing_graph(config, with_model_input=True), "preprocess/")
    network, preprocessing = _same_opset(network, preprocessing)
    pixel_values, seen = (value.name for value in preprocessing.graph.output)
    merged = onnx.compose.merge_models(preprocessing, network, io_map=[(pixel_values, GRAPH_INPUT)],
                                       outputs=[seen, GRAPH_LOGITS, GRAPH_ATTENTIONS], prefix2="")
    merged.graph.node.extend(map_answers(config, seen).nodes)
    height, width = config.image_size
    del merged.graph.output[:]
    merged.graph.output.extend([
        helper.make_tensor_value_info(PIPELINE_OUTPUT, FLOAT, [config.num_classes]),
        helper.make_tensor_value_info(PIPELINE_MAP, FLOAT, list(config.grid_size)),
        helper.make_tensor_value_info(PIPELINE_MODEL_INPUT, UINT8, [height, width, config.in_channels]),
        helper.make_tensor_value_info(PIPELINE_MAP_COLOURS, UINT8, [256, 3])])
    return save_with_image_input(merged, target)


def map_answers(config: ViTConfig, seen: str) -> GraphBuilder:
    """The nodes after the network in pipeline_map.onnx: its logits and attentions, and the
    preprocessing's image `seen` -> the outputs MAP_OUTPUTS."""
    g = GraphBuilder()
    answers = {PIPELINE_OUTPUT: probabilities(g, GRAPH_LOGITS, config),
               PIPELINE_MAP: g.Squeeze(rollout_map(g, GRAPH_ATTENTIONS, config), g.const([0])),
               PIPELINE_MODEL_INPUT: seen, PIPELINE_MAP_COLOURS: g.const(colour_table(DEFAULT_COLOURMAP))}
    g.nodes.extend(helper.make_node("Identity", [value], [name], name=name) for name, value in answers.items())
    return g


def run_map_pipeline(session: ort.InferenceSession, pixels: np.ndarray) -> dict[str, np.ndarray]:
    """uint8 [height, width, channels] -> {output name: value} of every output in MAP_OUTPUTS."""
    return dict(zip(MAP_OUTPUTS, session.run(list(MAP_OUTPUTS), {PIPELINE_INPUT: pixels}, QUIET_RUN)))


def python_rollout(network: ort.InferenceSession, view: Image.Image, config: ViTConfig) -> np.ndarray:
    """The Python path's map of an image already in the model's domain: the attentions graph's
    attentions through `attention_rollout` with the app's defaults -> [grid_h, grid_w]."""
    attentions = network.run([GRAPH_ATTENTIONS], {GRAPH_INPUT: model_pixels(view, config)[None]}, QUIET_RUN)[0]
    return attention_rollout(attentions, grid_size=config.grid_size, pooling=config.pooling)[0]


def verify_map_pipeline(pipeline_map: Path, logits_graph: Path, attentions_graph: Path, config: ViTConfig,
                        uploads: list[tuple[str, Image.Image]], tolerance: float = MAP_TOLERANCE) -> dict[str, Any]:
    """pipeline_map.onnx against the Python path on each upload: its probabilities as
    `verify_pipeline` checks pipeline.onnx's, then its map and model_input (uploads both paths
    refuse are skipped) -> the report's section, with a failure per upload that disagrees."""
    section = verify_pipeline(pipeline_map, logits_graph, config, uploads, PROBABILITY_TOLERANCE)
    graph, network = pipeline_session(pipeline_map), pipeline_session(attentions_graph)
    for row, (name, image) in zip(section["rows"], uploads):
        if row.get("refused"):
            continue
        row["map_max_abs_diff"], row["model_input_max_abs_diff"] = _map_differences(graph, network, image, config)
        if row["map_max_abs_diff"] > tolerance or row["model_input_max_abs_diff"] > 0:
            section["failures"].append(
                f"{pipeline_map.name} on {name}: expected the Python path's rollout within {tolerance:g} and its model "
                f"input exactly, got differences of {row['map_max_abs_diff']:.2g} and "
                f"{row['model_input_max_abs_diff']:g} gray levels")
    section["map_tolerance_max_abs_diff"] = tolerance
    section["map_max_abs_diff"] = max((row.get("map_max_abs_diff", 0.0) for row in section["rows"]), default=0.0)
    return section


def _map_differences(graph: ort.InferenceSession, network: ort.InferenceSession, image: Image.Image,
                     config: ViTConfig) -> tuple[float, float]:
    """(largest |map - Python rollout|, largest |model_input - Python pixels|) for one upload."""
    try:
        view = to_model_domain(image, config)
    except canonical.EmptyImageError:
        return 0.0, 0.0  # verify_pipeline has judged a refusal already
    expected_pixels = np.asarray(resize(view, config)).reshape(*config.image_size, config.in_channels)
    got = run_map_pipeline(graph, decoded_pixels(image))
    map_difference = float(np.abs(got[PIPELINE_MAP] - python_rollout(network, view, config)).max())
    pixel_difference = float(np.abs(got[PIPELINE_MODEL_INPUT].astype(np.int16) - expected_pixels).max())
    return map_difference, pixel_difference

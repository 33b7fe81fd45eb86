"""The float16 logits graph's ONNX Runtime form (export/fused_graph.py): each block's attention
one MultiHeadAttention node, ONNX Runtime's fusions written in, the same logits as torch; the
plain graphs keep standard operators; and the untrusted-graph check reads the three ONNX
Runtime operators' shapes, refusing any other form of them. Speed is measured on a GPU only
(bench/onnx_cuda.py, BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from conftest import assert_one_line, tiny_config
from vit_hub.export import OnnxModelError
from vit_hub.export.exporter import write_graph
from vit_hub.export.fused_graph import ort_fusions, ort_operators
from vit_hub.export.graph_check import ORT_DOMAIN, check_graph
from vit_hub.export.half import FP16_TOLERANCES, convert_to_fp16
from vit_hub.model.config import ViTConfig
from vit_hub.model.vit import VisionTransformer

VARIANTS = {
    "class token (the last block asks with it alone)": tiny_config(),
    "mean pooling, locality attention, conv stem": tiny_config(pooling="mean", locality_attention=True,
                                                               patch_embedding="convstem"),
    "hybrid stem (the small photo folders' default)": tiny_config(patch_embedding="hybrid", pooling="mean"),
    "shifted patches, 16x24, no qkv bias": tiny_config(image_size=[16, 24], patch_embedding="shifted", qkv_bias=False),
}


def model_of(overrides: dict) -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(**overrides).eval()
    torch.nn.init.normal_(model.head.weight, std=0.5)  # the init zeroes the head: logits would all be 0
    if model.config.locality_attention:
        for block in model.blocks:  # a temperature away from the usual 1/sqrt(head_dim)
            block.attention.log_scale.data += 0.4
    return model


def shipped_fp16(model: VisionTransformer, folder: Path) -> tuple[Path, Path]:
    """(fused float32 graph, the float16 logits graph as --precision fp16 writes it)."""
    fused = write_graph(model, folder / "fused.onnx", output_attentions=False, fused_attention=True)
    optimized = ort_fusions(fused, folder / "optimized.onnx", model.config)
    return fused, convert_to_fp16(optimized, folder / "model_fp16.onnx")


def logits(path: Path, pixels: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"pixel_values": pixels})[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_fused_graphs_give_torchs_logits(variant, tmp_path):
    model = model_of(VARIANTS[variant])
    config = model.config
    pixels = np.random.default_rng(0).normal(size=(5, config.in_channels, *config.image_size)).astype(np.float32)
    with torch.inference_mode():
        expected = model(torch.from_numpy(pixels)).logits.numpy()
    fused, half = shipped_fp16(model, tmp_path)
    assert np.abs(logits(fused, pixels) - expected).max() < 1e-4
    assert np.abs(logits(half, pixels) - expected).max() < FP16_TOLERANCES["logits"]
    assert (logits(half, pixels).argmax(1) == expected.argmax(1)).all()
    depth = config.depth
    assert ort_operators(half) == {"BiasGelu": depth, "MultiHeadAttention": depth, "SkipLayerNormalization": 2 * depth}
    check_graph(half, config)  # the untrusted-graph check accepts what the exporter writes


def test_the_plain_graphs_use_standard_operators_only(tmp_path):
    model = model_of(tiny_config())
    for attentions in (False, True):
        graph = onnx.load(str(write_graph(model, tmp_path / f"{attentions}.onnx", output_attentions=attentions)))
        assert {entry.domain for entry in graph.opset_import} == {""}
        assert not any(node.domain for node in graph.graph.node)


def test_fused_attention_is_refused_where_the_graph_must_return_weights(tmp_path):
    with pytest.raises(ValueError, match="logits-only"):
        write_graph(model_of(tiny_config()), tmp_path / "g.onnx", output_attentions=True, fused_attention=True)


# The check reads each ONNX Runtime operator's shapes: another form of one is refused --------
def first(graph: onnx.ModelProto, op_type: str) -> onnx.NodeProto:
    return next(node for node in graph.graph.node if node.op_type == op_type)


def more_heads(graph):
    """heads that do not divide the width (16): 3."""
    next(attribute for attribute in first(graph, "MultiHeadAttention").attribute if attribute.name == "num_heads").i = 3


def padding_mask(graph):
    """a key padding mask read from the pixels."""
    node = first(graph, "MultiHeadAttention")
    del node.input[3:]
    node.input.extend(["", "pixel_values"])


def short_gain(graph):
    """a LayerNorm gain of 3 values for a width of 16."""
    graph.graph.initializer.append(onnx.numpy_helper.from_array(np.ones(3, np.float16), "short_gain"))
    first(graph, "SkipLayerNormalization").input[2] = "short_gain"


def lone_input(graph):
    """a SkipLayerNormalization with nothing to add or scale."""
    del first(graph, "SkipLayerNormalization").input[1:]


def long_bias(graph):
    """a GELU bias of 64 values for 32 hidden features."""
    graph.graph.initializer.append(onnx.numpy_helper.from_array(np.ones(64, np.float16), "long_bias"))
    first(graph, "BiasGelu").input[1] = "long_bias"


def other_operator(graph):
    """another ONNX Runtime operator (FastGelu) in place of BiasGelu."""
    first(graph, "BiasGelu").op_type = "FastGelu"


MUTATIONS = {"more_heads": (more_heads, "MultiHeadAttention node"),
             "padding_mask": (padding_mask, "MultiHeadAttention node"),
             "short_gain": (short_gain, "SkipLayerNormalization node"),
             "lone_input": (lone_input, "SkipLayerNormalization node"),
             "long_bias": (long_bias, "BiasGelu node"),
             "other_operator": (other_operator, f"{ORT_DOMAIN}.FastGelu")}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_another_form_of_an_onnxruntime_operator_is_refused_in_one_line(mutation, tmp_path):
    model = model_of(tiny_config())
    _, half = shipped_fp16(model, tmp_path)
    graph = onnx.load(str(half))
    mutate, fragment = MUTATIONS[mutation]
    mutate(graph)
    onnx.save(graph, str(half))
    with pytest.raises(OnnxModelError) as error:
        check_graph(half, ViTConfig(**tiny_config()))
    assert_one_line(str(error.value), fragment)

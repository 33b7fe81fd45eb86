"""pipeline_explain.onnx (export/gradient_graph.py): the page's opening map, its backward pass
traced into forward operators, run by ONNX Runtime's inference build. The bundled model's graph
gives the Python page's integrated gradients + gradient rollout map within MAP_TOLERANCE on
uploads of every kind, with the same class and pipeline_map.onnx's rollout beside it; an RGB photo
model with a convolution stem (strided 3x3 convolutions, BatchNorm, ReLU: their backward in
forward operators) and mean pooling does too; a map that drifts is refused. The opening method
comes from the model's faithfulness.json, as the page's does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import digit_on_paper
from vit_hub.explain.opening import DEFAULT_METHOD, opening_method_of
from vit_hub.explain.attribution import METHODS
from vit_hub.export.gradient_graph import (MAP_LABEL_KEY, MAP_METHOD_KEY, graph_method, run_explain_pipeline,
                                           verify_explain_pipeline, write_explain_pipeline)
from vit_hub.export.map_graph import MAP_TOLERANCE
from vit_hub.export.pipeline_check import exported_operators
from vit_hub.export.pipeline_graph import decoded_pixels, verification_uploads
from vit_hub.export.exporter import write_graph
from vit_hub.hub.pretrained import HubVisionTransformer, load_model
from vit_hub.layout import PIPELINE_MAP, PIPELINE_ROLLOUT, ExportLayout
from test_map_graph import MODEL_DIR, SAMPLES

pytestmark = pytest.mark.slow  # each module traces and exports a graph (about 30 s)


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    """(the bundled model, its pipeline_explain.onnx written from it)."""
    model = load_model(MODEL_DIR)
    target = tmp_path_factory.mktemp("explain") / "pipeline_explain.onnx"
    return model, write_explain_pipeline(model, opening_method_of(MODEL_DIR, tuple(METHODS)), target)


def test_the_bundled_models_graph_opens_with_the_pages_method(bundled):
    _, graph = bundled
    assert graph_method(graph) == "integrated_gradients_rollout"  # measured most faithful in faithfulness.json
    import onnx
    props = {entry.key: entry.value for entry in onnx.load(str(graph)).metadata_props}
    assert props[MAP_LABEL_KEY] == METHODS["integrated_gradients_rollout"].label
    assert MAP_METHOD_KEY in props


def test_the_bundled_graph_gives_the_python_pages_map(bundled):
    model, graph = bundled
    uploads = verification_uploads([Image.open(path) for path in SAMPLES[:4]], model.config)
    uploads.append(("digit on paper", digit_on_paper(SAMPLES[5])))
    section = verify_explain_pipeline(graph, MODEL_DIR / "model.onnx", MODEL_DIR / "model_attentions.onnx", model,
                                      uploads)
    assert section["failures"] == []
    answered = [row for row in section["rows"] if not row.get("refused")]
    assert len(answered) >= 12 and all(row["map_same_label"] for row in answered)
    assert section["map_max_abs_diff"] <= MAP_TOLERANCE and section["rollout_max_abs_diff"] <= MAP_TOLERANCE


def test_the_opening_map_is_not_the_rollout(bundled):
    """The graph's map is the gradient one: it differs from rollout where the page's maps do."""
    model, graph = bundled
    from vit_hub.export.pipeline_graph import pipeline_session
    got = run_explain_pipeline(pipeline_session(graph), decoded_pixels(Image.open(SAMPLES[0])))
    assert got[PIPELINE_MAP].shape == got[PIPELINE_ROLLOUT].shape == tuple(model.config.grid_size)
    assert np.abs(got[PIPELINE_MAP] - got[PIPELINE_ROLLOUT]).max() > 0.1


def test_a_map_that_drifts_is_refused(bundled, tmp_path):
    """The graph checked against a model whose weights moved: its map is another map, refused."""
    model, graph = bundled
    moved = load_model(MODEL_DIR)
    with torch.no_grad():
        moved.blocks[2].attention.to_qkv.weight.mul_(1.5)
    uploads = verification_uploads([Image.open(SAMPLES[0])], model.config)[:2]
    section = verify_explain_pipeline(graph, MODEL_DIR / "model.onnx", MODEL_DIR / "model_attentions.onnx", moved,
                                      uploads)
    assert section["failures"] and "integrated_gradients_rollout map" in section["failures"][0]


def test_a_photo_model_with_a_convolution_stem(tmp_path):
    """A model never measured opens with DEFAULT_METHOD (integrated gradients alone); its graph
    traces BatchNorm, ReLU and strided 3x3 convolutions backward and matches the torch page."""
    torch.manual_seed(0)
    model = HubVisionTransformer(image_size=[32, 24], patch_size=[8, 8], in_channels=3, embed_dim=32, depth=2,
                                 num_heads=2, num_classes=3, labels=["cat", "dog", "owl"], patch_embedding="convstem",
                                 pooling="mean", pixel_norm="dataset", mean=[0.5, 0.4, 0.3], std=[0.2, 0.25, 0.3]).eval()
    method = opening_method_of(None, tuple(METHODS))
    assert method == DEFAULT_METHOD
    layout = ExportLayout(tmp_path, "model")
    write_graph(model, layout.logits, output_attentions=False)
    write_graph(model, layout.attentions, output_attentions=True)
    graph = write_explain_pipeline(model, method, layout.pipeline_explain)
    rng = np.random.default_rng(3)
    uploads = [(f"photo {number}", Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
               for number, (h, w) in enumerate([(32, 24), (97, 61), (480, 640)])]
    uploads.append(("RGBA", Image.fromarray(rng.integers(0, 256, (50, 40, 4), dtype=np.uint8))))
    section = verify_explain_pipeline(graph, layout.logits, layout.attentions, model, uploads)
    assert section["failures"] == [] and section["method"] == "integrated_gradients"
    assert section["map_max_abs_diff"] <= MAP_TOLERANCE
    assert operators(graph) <= exported_operators(model.config)  # a static Space may bundle it


def test_a_static_space_allows_the_bundled_graphs_operators(bundled):
    model, graph = bundled
    assert operators(graph) - exported_operators(model.config) == set()
    assert {"ConvTranspose", "ScatterElements"} <= operators(graph)  # the backward pass, in forward operators


def operators(graph) -> set[str]:
    import onnx
    return {node.op_type for node in onnx.load(str(graph)).graph.node}

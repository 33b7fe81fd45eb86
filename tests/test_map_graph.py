"""pipeline_map.onnx (export/rollout_graph.py, export/map_graph.py): the graph's rollout equals
`vit_hub.explain.rollout` on generated attentions for every fusion, discard ratio, pooling and
grid; the bundled graph gives the Python app's map and labels; an export refuses a map that
drifts, for digit and RGB photo models alike."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper
from PIL import Image

from conftest import digit_on_paper
from vit_hub.explain.rollout import DEFAULT_COLOURMAP, HEAD_FUSIONS, attention_rollout, colour_table
from vit_hub.export import rollout_graph
from vit_hub.export.graph_builder import FLOAT, GraphBuilder
from vit_hub.export.map_graph import MAP_TOLERANCE, python_rollout, run_map_pipeline
from vit_hub.export.pipeline_graph import decoded_pixels, pipeline_session, run_pipeline
from vit_hub.layout import PIPELINE_MAP, PIPELINE_MAP_COLOURS, PIPELINE_MODEL_INPUT, PIPELINE_OUTPUT, ExportLayout
from vit_hub.model.config import ViTConfig
from vit_hub.processing.preprocess import resize, to_model_domain

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "vit-mnist"
SAMPLES = sorted((ROOT / "vit_hub" / "bundled" / "samples").glob("mnist_test_*_label_*.png"))
DIGIT_CONFIG = ViTConfig.from_json(MODEL_DIR / "config.json")
LAYOUT = ExportLayout.for_model(MODEL_DIR)


def graph_rollout(attentions: np.ndarray, config: ViTConfig, head_fusion: str, discard_ratio: float) -> np.ndarray:
    """rollout_map built for `config` and run on `attentions` [depth, B, heads, T, T]."""
    g = GraphBuilder()
    out = g.Identity(rollout_graph.rollout_map(g, "attentions", config, head_fusion, discard_ratio))
    proto = helper.make_model(
        helper.make_graph(g.nodes, "rollout", [helper.make_tensor_value_info("attentions", FLOAT, None)],
                          [helper.make_tensor_value_info(out, FLOAT, None)]),
        opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"attentions": attentions})[0]


def softmax_rows(scores: np.ndarray) -> np.ndarray:
    exp = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (exp / exp.sum(axis=-1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("head_fusion", HEAD_FUSIONS)
@pytest.mark.parametrize("discard_ratio", [0.0, 0.3, 0.9])
@pytest.mark.parametrize("pooling, grid", [("cls", (7, 7)), ("mean", (3, 5)), ("cls", (1, 2))])
def test_the_graphs_rollout_equals_explains(head_fusion, discard_ratio, pooling, grid):
    config = ViTConfig(image_size=[4 * grid[0], 4 * grid[1]], patch_size=[4, 4], depth=3, num_heads=3, embed_dim=12,
                       num_classes=2, labels=["a", "b"], pooling=pooling)
    rng = np.random.default_rng(5)
    tokens = grid[0] * grid[1] + 1
    attentions = softmax_rows(rng.normal(scale=3.0, size=(3, 2, 3, tokens, tokens)))
    attentions[:, 1, :, 1:, 1:] = np.round(attentions[:, 1, :, 1:, 1:], 2)  # ties in the second sample's weights
    expected = attention_rollout(attentions, head_fusion, discard_ratio, config.grid_size, pooling)
    got = graph_rollout(attentions, config, head_fusion, discard_ratio)
    assert got.shape == expected.shape == (2, *grid)
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_a_flat_map_is_zeros_in_the_graph_as_in_explain():
    config = ViTConfig(image_size=[8, 8], patch_size=[4, 4], depth=2, num_heads=1, embed_dim=4, num_classes=2,
                       labels=["a", "b"])
    attentions = np.full((2, 1, 1, 5, 5), 0.2, dtype=np.float32)
    np.testing.assert_array_equal(graph_rollout(attentions, config, "mean", 0.0), np.zeros((1, 2, 2)))
    assert not attention_rollout(attentions, grid_size=(2, 2)).any()


def test_a_fusion_explain_does_not_offer_is_refused_in_its_words():
    from vit_hub.errors import UserError
    with pytest.raises(UserError, match="head_fusion: expected one of mean, max, min"):
        rollout_graph.rollout_map(GraphBuilder(), "attentions", DIGIT_CONFIG, "median")


# The bundled graph --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bundled():
    return pipeline_session(LAYOUT.pipeline_map), pipeline_session(LAYOUT.attentions)


def test_the_bundled_map_graph_gives_the_python_apps_map_labels_and_input(bundled):
    graph, network = bundled
    probabilities_only = pipeline_session(MODEL_DIR / "pipeline.onnx")
    for image in [Image.open(path) for path in SAMPLES] + [digit_on_paper(SAMPLES[2])]:
        got = run_map_pipeline(graph, decoded_pixels(image))
        view = to_model_domain(image, DIGIT_CONFIG)
        np.testing.assert_allclose(got[PIPELINE_MAP], python_rollout(network, view, DIGIT_CONFIG), atol=MAP_TOLERANCE)
        np.testing.assert_array_equal(got[PIPELINE_MODEL_INPUT][..., 0], np.asarray(resize(view, DIGIT_CONFIG)))
        expected = run_pipeline(probabilities_only, decoded_pixels(image))
        np.testing.assert_allclose(got[PIPELINE_OUTPUT], expected, atol=1e-5)
        assert got[PIPELINE_MAP].shape == tuple(DIGIT_CONFIG.grid_size) and 0 <= got[PIPELINE_MAP].min()
        assert got[PIPELINE_MAP].max() == pytest.approx(1.0)
    np.testing.assert_array_equal(got[PIPELINE_MAP_COLOURS], colour_table(DEFAULT_COLOURMAP))


def test_the_bundled_map_graph_names_its_outputs_and_their_shapes():
    outputs = {value.name: [dim.dim_value for dim in value.type.tensor_type.shape.dim]
               for value in onnx.load(str(LAYOUT.pipeline_map)).graph.output}
    assert outputs == {PIPELINE_OUTPUT: [10], PIPELINE_MAP: [7, 7], PIPELINE_MODEL_INPUT: [28, 28, 1],
                       PIPELINE_MAP_COLOURS: [256, 3]}


# The export's check ---------------------------------------------------------------------------------
def test_an_export_refuses_a_map_that_drifts_from_explains(monkeypatch, tmp_path):
    """A rollout that forgets the residual path is checked, reported and not written."""
    from vit_hub.export import VerificationError, export_onnx

    monkeypatch.setattr(rollout_graph, "_with_residual", lambda g, attention, tokens: attention)
    with pytest.raises(VerificationError, match="pipeline_map.onnx on image 0: expected the Python path's rollout"):
        export_onnx(MODEL_DIR, tmp_path / "model.onnx", output_attentions=True)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model_export_report.failed.json"]  # nothing installed
    report = json.loads((tmp_path / "model_export_report.failed.json").read_text())["pipeline"]["pipeline_map.onnx"]
    assert report["failures"] and report["map_max_abs_diff"] > MAP_TOLERANCE


def with_model_input_one_level_up(graph: Path, target: Path) -> Path:
    """A copy of `graph` whose model_input is one gray level brighter (255 stays 255)."""
    model = onnx.load(str(graph))
    shown = next(node for node in model.graph.node if PIPELINE_MODEL_INPUT in node.output)
    shown.output[list(shown.output).index(PIPELINE_MODEL_INPUT)] = "model_input/exact"
    model.graph.initializer.extend([numpy_helper.from_array(np.float32(1), "tamper/one"),
                                    numpy_helper.from_array(np.float32(255), "tamper/white")])
    model.graph.node.extend([
        helper.make_node("Cast", ["model_input/exact"], ["tamper/float"], to=FLOAT),
        helper.make_node("Add", ["tamper/float", "tamper/one"], ["tamper/up"]),
        helper.make_node("Min", ["tamper/up", "tamper/white"], ["tamper/clipped"]),
        helper.make_node("Cast", ["tamper/clipped"], [PIPELINE_MODEL_INPUT], to=onnx.TensorProto.UINT8)])
    onnx.save(model, str(target))
    return target


def test_the_check_refuses_a_model_input_one_gray_level_off(tmp_path):
    """model_input must be the Python path's pixels exactly: one gray level off is a failure."""
    from vit_hub.export.map_graph import verify_map_pipeline

    tampered = with_model_input_one_level_up(LAYOUT.pipeline_map, tmp_path / "pipeline_map.onnx")
    uploads = [("image 0", Image.open(SAMPLES[0]))]
    section = verify_map_pipeline(tampered, LAYOUT.logits, LAYOUT.attentions, DIGIT_CONFIG, uploads)
    assert section["rows"][0]["model_input_max_abs_diff"] == 1
    assert len(section["failures"]) == 1
    assert "pipeline_map.onnx on image 0: expected the Python path's rollout within" in section["failures"][0]
    assert section["failures"][0].endswith("and 1 gray levels")
    untouched = verify_map_pipeline(LAYOUT.pipeline_map, LAYOUT.logits, LAYOUT.attentions, DIGIT_CONFIG, uploads)
    assert untouched["failures"] == [] and untouched["rows"][0]["model_input_max_abs_diff"] == 0


@pytest.mark.slow
def test_an_rgb_photo_model_gets_a_checked_map_graph(image_folder, tmp_path):
    """A tiny RGB model trained on generated photos: the export writes pipeline_map.onnx, its
    check passes on real and generated uploads, and the map is the Python path's."""
    from conftest import train_tiny
    from vit_hub.export import export_onnx

    run = train_tiny(image_folder, tmp_path / "run", epochs=1)
    export_onnx(run, run, output_attentions=True, calib_data=str(image_folder))
    config = ViTConfig.from_json(run / "config.json")
    assert config.in_channels == 3 and config.canonicalize != "digit"
    section = json.loads((run / "model_export_report.json").read_text())["pipeline"]["pipeline_map.onnx"]
    assert not section["failures"] and section["uploads"] >= 8 and section["map_max_abs_diff"] <= MAP_TOLERANCE
    photo = Image.open(next(image_folder.rglob("*.png"))).convert("RGB").resize((90, 70))
    got = run_map_pipeline(pipeline_session(run / "pipeline_map.onnx"), decoded_pixels(photo))
    expected = python_rollout(pipeline_session(run / "model_attentions.onnx"), photo, config)
    np.testing.assert_allclose(got[PIPELINE_MAP], expected, atol=MAP_TOLERANCE)
    assert got[PIPELINE_MODEL_INPUT].shape == (*config.image_size, 3)


def test_the_map_graph_is_listed_with_the_model_dirs_onnx_files():
    assert LAYOUT.pipeline_map in LAYOUT.onnx_files  # so a push --with-onnx uploads it and a new export replaces it


def test_onnxruntime_runs_the_maps_nodes_when_asked_for_probabilities_alone(tmp_path):
    """Why the map has a graph of its own: onnxruntime runs every node of a graph whatever outputs
    a caller asks for (its profile lists the node that gives the map), so an app wanting
    probabilities alone would pay for the map on one graph with both outputs."""
    options = ort.SessionOptions()
    options.enable_profiling, options.profile_file_prefix = True, str(tmp_path / "profile")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(LAYOUT.pipeline_map), options, providers=["CPUExecutionProvider"])
    session.run([PIPELINE_OUTPUT], {"image": decoded_pixels(Image.open(SAMPLES[0]))})
    profile = json.loads(Path(session.end_profiling()).read_text())
    ran = {event["name"] for event in profile if event.get("cat") == "Node"}
    assert f"{PIPELINE_MAP}_kernel_time" in ran and f"{PIPELINE_OUTPUT}_kernel_time" in ran

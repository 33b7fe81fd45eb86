"""pipeline.onnx (export/pipeline_graph.py, canonical_graph.py, graph_numpy.py): the graph gives
the Python path's numbers, refuses bad input in one catchable onnxruntime error, and an export
refuses a graph that drifts from the Python path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper
from PIL import Image, ImageDraw, ImageOps
from scipy import ndimage

from conftest import digit_on_paper
from vit_hub.export import graph_numpy as gn
from vit_hub.export import pipeline_graph
from vit_hub.export.graph_builder import BOOL, DOUBLE, FLOAT, INT64, GraphBuilder
from vit_hub.export.pipeline_graph import (TOO_LARGE, TOO_SMALL, WRONG_CHANNELS, decoded_pixels, preprocessing_graph,
                                           run_pipeline)
from vit_hub.errors import UserError
from vit_hub.layout import PIPELINE_INPUT
from vit_hub.model.config import ViTConfig
from vit_hub.processing.canonical import BLANK_IMAGE, NEARLY_BLANK, EmptyImageError
from vit_hub.processing.postprocess import softmax
from vit_hub.processing.preprocess import UPLOAD_MAX_PIXELS, check_pixels, preprocess

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "vit-mnist"
SAMPLES = sorted((ROOT / "vit_hub" / "bundled" / "samples").glob("mnist_test_*_label_*.png"))
DIGIT_CONFIG = ViTConfig.from_json(MODEL_DIR / "config.json")
KINDS = {np.dtype(np.float64): DOUBLE, np.dtype(np.float32): FLOAT, np.dtype(np.int64): INT64, np.dtype(bool): BOOL}


def session_of(proto: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def run_ops(build, *arrays: np.ndarray):
    """Build a graph with `build(g, *input names) -> output name(s)` and run it on `arrays`."""
    g = GraphBuilder()
    names = [f"input{index}" for index in range(len(arrays))]
    outputs = build(g, *names)
    outputs = [g.Identity(value) for value in (outputs if isinstance(outputs, (list, tuple)) else [outputs])]
    graph = helper.make_graph(g.nodes, "ops", [helper.make_tensor_value_info(name, KINDS[array.dtype], None)
                                               for name, array in zip(names, arrays)],
                              [onnx.ValueInfoProto(name=name) for name in outputs])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    results = session_of(proto).run(None, dict(zip(names, arrays)))
    return results if len(results) > 1 else results[0]


# NumPy, SciPy and Pillow, to the same numbers --------------------------------------------------
@pytest.mark.parametrize("kind", ["normal", "few values", "ties"])
def test_order_statistics_equal_numpys(kind):
    rng = np.random.default_rng(3)
    for size in (1, 2, 7, 1000, 5001):
        values = {"normal": rng.normal(size=size), "few values": rng.integers(0, 4, size).astype(float),
                  "ties": np.round(rng.normal(size=size), 1)}[kind]
        assert run_ops(lambda g, x: gn.median(g, x), values) == np.median(values)
        for q in (0, 10, 50, 99.99, 100):
            assert run_ops(lambda g, x: gn.percentile(g, x, q), values) == np.percentile(values, q)


def test_order_statistics_of_whole_gray_levels_equal_numpys():
    """levels=True (one 256-bin histogram, no sorting) on 8-bit values, and median and
    percentile(50) from one shared middle_pair, equal NumPy's."""
    rng = np.random.default_rng(9)
    for size in (1, 2, 7, 1000, 5001):
        for values in (rng.integers(0, 256, size).astype(float), rng.integers(250, 256, size).astype(float),
                       np.full(size, 255.0), np.zeros(size)):
            assert run_ops(lambda g, x: gn.median(g, x, levels=True), values) == np.median(values)
            for q in (0, 0.01, 50, 99.99, 100):
                assert run_ops(lambda g, x: gn.percentile(g, x, q, levels=True), values) == np.percentile(values, q)
        values = rng.normal(size=size)

        def shared(g, x):
            middle = gn.middle_pair(g, x)
            return gn.median(g, x, pair=middle), gn.percentile(g, x, 50, pair=middle)

        assert run_ops(shared, values) == [np.median(values), np.percentile(values, 50)]


def test_pieces_along_a_long_stroke_equal_ndimage_labels():
    """A 1-pixel serpentine some 2,000 pixels long, its largest index at its middle, and a
    second piece inside its bends: one label each, as ndimage.label finds them."""
    mask = np.zeros((64, 64), dtype=bool)
    mask[::4, 1:63] = True  # rungs, joined at alternating ends
    for row in range(0, 60, 4):
        mask[row:row + 5, 62 if row % 8 == 0 else 1] = True
    mask[2, 10:20] = True  # between two rungs: a piece of its own
    for structure in (gn.EIGHT, gn.FOUR):
        labels, count = run_ops(lambda g, m: (lambda found: (found, gn.count_pieces(g, found)))(gn.label(g, m, structure)),
                                mask)
        expected, expected_count = ndimage.label(mask, structure=structure)
        assert count == expected_count == 2
        assert len(set(zip(expected[mask].tolist(), labels[mask].tolist()))) == 2


@pytest.mark.parametrize("name", ["nearest", "box", "bilinear", "hamming", "bicubic", "lanczos"])
def test_resampling_equals_pillows_for_8_bit_images(name):
    rng = np.random.default_rng(4)
    for _ in range(6):
        height, width, new_height, new_width = (int(side) for side in rng.integers(2, 300, 4))
        pixels = rng.integers(0, 256, (height, width), dtype=np.uint8)
        expected = np.asarray(Image.fromarray(pixels).resize((new_width, new_height), Image.Resampling[name.upper()]))
        got = run_ops(lambda g, x, h, w: gn.resample(g, g.Unsqueeze(x, g.const([0])), h, w, name, eight_bit=True),
                      pixels.astype(np.float64), np.array(new_height), np.array(new_width))[0]
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("canonicalize", ["none", "digit"])
def test_a_tall_picture_read_a_block_of_rows_at_a_time_gives_the_same_pixels(canonicalize):
    """Three whole blocks of rows and a short one: the blocks join without a seam."""
    config = ViTConfig(image_size=[28, 28], patch_size=[7, 7], in_channels=3 if canonicalize == "none" else 1,
                       num_classes=2, labels=["a", "b"], embed_dim=16, depth=1, num_heads=2,
                       canonicalize=canonicalize, interpolation="bicubic")
    photo = digit_on_paper(SAMPLES[1], canvas=(300, gn.ROW_BLOCK * 3 + 17), at=(60, 300), side=160)
    got = session_of(preprocessing_graph(config)).run(None, {PIPELINE_INPUT: decoded_pixels(photo)})[0][0]
    np.testing.assert_array_equal(got, preprocess(photo, config))


def test_reduce_equals_pillows_rounding():
    pixels = np.random.default_rng(6).integers(0, 256, (517, 389), dtype=np.uint8)
    for factor in (1, 2, 3, 15):
        expected = np.asarray(Image.fromarray(pixels).reduce(factor))
        np.testing.assert_array_equal(run_ops(lambda g, x, f: gn.reduce_mean(g, x, f), pixels.astype(np.float32),
                                              np.array(factor)), expected)


@pytest.mark.parametrize("structure", [gn.EIGHT, gn.FOUR], ids=["8-connected", "4-connected"])
def test_pieces_equal_ndimage_labels(structure):
    mask = np.random.default_rng(7).random((60, 70)) > 0.6
    labels, count = run_ops(lambda g, m: (lambda found: (found, gn.count_pieces(g, found)))(gn.label(g, m, structure)),
                            mask)
    expected, expected_count = ndimage.label(mask, structure=structure)
    assert count == expected_count
    assert len(set(zip(expected[mask].tolist(), labels[mask].tolist()))) == expected_count  # the same partition


def test_erosion_and_filled_holes_equal_ndimages():
    mask = np.random.default_rng(8).random((50, 40)) > 0.35
    np.testing.assert_array_equal(run_ops(lambda g, m: gn.erode(g, m), mask), ndimage.binary_erosion(mask))
    np.testing.assert_array_equal(run_ops(lambda g, m: gn.fill_holes(g, m), mask), ndimage.binary_fill_holes(mask))


# The whole preprocessing, bit for bit ----------------------------------------------------------
@pytest.fixture(scope="module")
def digit_graph() -> ort.InferenceSession:
    return session_of(preprocessing_graph(DIGIT_CONFIG))


def uploads_of_a_digit() -> list[tuple[str, Image.Image]]:
    """Generated uploads that take every branch of the digit canonicalisation."""
    sample = SAMPLES[0]
    plain = Image.open(sample).convert("L")
    photo = digit_on_paper(sample)
    ruled, framed = photo.copy(), photo.copy()
    ImageDraw.Draw(ruled).line([(0, 320), (479, 316)], fill=(60, 60, 60), width=3)  # edge to edge, under the digit
    ImageDraw.Draw(framed).rectangle([(0, 0), (479, 60)], fill=(40, 35, 30))  # the desk beyond the paper
    hairline = Image.new("L", (1000, 800), 255)
    ImageDraw.Draw(hairline).line([(300, 200), (520, 180), (420, 650)], fill=0, width=1)  # a thin 7 on a big canvas
    marker = Image.new("L", (200, 200), 250)
    ImageDraw.Draw(marker).ellipse([(40, 30), (160, 170)], outline=10, width=30)  # a bold 0: thinned
    four = Image.new("L", (120, 160), 255)
    ImageDraw.Draw(four).line([(70, 10), (20, 90), (100, 90)], fill=0, width=6)
    ImageDraw.Draw(four).line([(70, 10), (70, 150)], fill=0, width=6)  # a closed-top 4: its hole stays open
    specks = photo.copy()
    ImageDraw.Draw(specks).ellipse([(440, 20), (446, 26)], fill=(20, 20, 20))
    canvas = Image.new("RGBA", (1280, 720), (0, 0, 0, 0))
    canvas.paste(Image.new("RGBA", (300, 300), (30, 30, 90, 255)), (700, 200), plain.resize((300, 300)).point(lambda v: 255 * (v > 100)))
    gray_alpha = plain.convert("LA")
    gray_alpha.putalpha(Image.linear_gradient("L").resize(plain.size))
    small = Image.new("L", (1600, 1200), 255)  # a digit 4 % of the page tall: above the speck's limits
    small.paste(ImageOps.invert(plain).resize((90, 90), Image.Resampling.BICUBIC), (700, 500))
    tie = Image.new("L", (200, 200), 127)  # a 1 in ink 127 below the paper, a 7 127 above it: light wins a tie
    ImageDraw.Draw(tie).line([(40, 30), (40, 170)], fill=0, width=10)
    ImageDraw.Draw(tie).line([(90, 40), (170, 40), (120, 170)], fill=254, width=10)
    return [("MNIST digit", plain), ("photo of paper", photo), ("a ruled line", ruled), ("the desk in the frame", framed),
            ("a hairline on a large canvas", hairline), ("a bold marker", marker), ("a closed-top 4", four),
            ("a speck of dust", specks), ("a transparent canvas", canvas), ("gray with alpha", gray_alpha),
            ("upside-down colours", ImageOps.invert(photo)), ("RGB sample", Image.open(SAMPLES[3]).convert("RGB")),
            ("dark and light ink tied", tie), ("a small digit on a large page", small)]


@pytest.mark.parametrize("name, image", uploads_of_a_digit(), ids=lambda value: value if isinstance(value, str) else "")
def test_the_graph_gives_a_digit_model_the_python_paths_pixels_bit_for_bit(digit_graph, name, image):
    expected = preprocess(image, DIGIT_CONFIG)
    got = digit_graph.run(None, {PIPELINE_INPUT: decoded_pixels(image)})[0][0]
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "lanczos", "box", "nearest"])
@pytest.mark.parametrize("channels, pixel_norm", [(3, "dataset"), (1, "dataset"), (3, "image")])
def test_the_graph_gives_a_photo_model_the_python_paths_pixels(interpolation, channels, pixel_norm):
    config = ViTConfig(image_size=[24, 32], patch_size=[8, 8], in_channels=channels, num_classes=2, labels=["a", "b"],
                       embed_dim=16, depth=1, num_heads=2, interpolation=interpolation, pixel_norm=pixel_norm,
                       mean=[0.4] * channels, std=[0.2] * channels)
    graph = session_of(preprocessing_graph(config))
    rng = np.random.default_rng(9)
    for mode in ("RGB", "RGBA", "L", "LA"):
        height, width = (int(side) for side in rng.integers(2, 400, 2))
        image = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA").convert(mode)
        np.testing.assert_allclose(graph.run(None, {PIPELINE_INPUT: decoded_pixels(image)})[0][0],
                                   preprocess(image, config), atol=1e-6, rtol=0)


@pytest.mark.parametrize("spread", [0.3, 1.0, 3.0])
def test_a_near_flat_photo_normalised_by_its_own_spread_gets_the_python_paths_pixels(spread):
    """A plain wall, a sky, a blank page: its own spread is a grey level or less, so any round-off
    in its mean is multiplied by up to 255 (float32 sums put preprocess.onnx 1e-2 off here)."""
    config = ViTConfig(image_size=64, patch_size=8, in_channels=3, num_classes=2, labels=["a", "b"], embed_dim=16,
                       depth=1, num_heads=2, pixel_norm="image")
    graph = session_of(preprocessing_graph(config))
    rng = np.random.default_rng(3)
    for _ in range(12):
        height, width = (int(side) for side in rng.integers(40, 300, 2))
        pixels = rng.integers(0, 256, 3) + rng.normal(0, spread, (height, width, 3))
        image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
        np.testing.assert_allclose(graph.run(None, {PIPELINE_INPUT: decoded_pixels(image)})[0][0],
                                   preprocess(image, config), atol=1e-6, rtol=0)


# Bad input: one onnxruntime error naming the check, the host process unharmed --------------------
@pytest.mark.parametrize("pixels, message", [
    (np.zeros((0, 0, 3), np.uint8), TOO_SMALL),
    (np.zeros((20000, 1, 3), np.uint8), TOO_SMALL),
    (np.zeros((40, 40, 5), np.uint8), WRONG_CHANNELS),
    (np.zeros((40, 40, 0), np.uint8), WRONG_CHANNELS),
    (np.full((40, 40, 1), 200, np.uint8), BLANK_IMAGE),
    (np.zeros((40, 40, 3), np.float32), "Unexpected input data type"),
    (np.zeros((40, 40), np.uint8), "Invalid rank"),
], ids=["0x0", "20000x1", "5 channels", "0 channels", "blank page", "float pixels", "rank 2"])
def test_bad_input_is_refused_in_one_error_naming_the_check(digit_graph, pixels, message):
    with pytest.raises(Exception, match=re.escape(message)) as refused:
        digit_graph.run(None, {PIPELINE_INPUT: pixels})
    assert isinstance(refused.value, (ort.capi.onnxruntime_pybind11_state.Fail,
                                      ort.capi.onnxruntime_pybind11_state.InvalidArgument, RuntimeError))


def test_an_image_over_the_upload_limit_is_refused_before_it_is_read(digit_graph):
    side = int(UPLOAD_MAX_PIXELS ** 0.5) + 1
    with pytest.raises(Exception, match=TOO_LARGE):
        digit_graph.run(None, {PIPELINE_INPUT: np.zeros((side, side, 1), np.uint8)})


def test_the_pixel_limit_counts_a_wide_short_image_by_its_area(digit_graph):
    """Height times width, not a side squared: a strip of 100 rows just over the limit is
    refused by both paths, one at the limit is read (and found blank)."""
    over, at = UPLOAD_MAX_PIXELS // 100 + 1, UPLOAD_MAX_PIXELS // 100
    with pytest.raises(Exception, match=re.escape(TOO_LARGE)):
        digit_graph.run(None, {PIPELINE_INPUT: np.zeros((100, over, 1), np.uint8)})
    with pytest.raises(UserError, match="too large"):
        check_pixels(over, 100, max_pixels=UPLOAD_MAX_PIXELS)
    with pytest.raises(Exception, match=re.escape(BLANK_IMAGE)):
        digit_graph.run(None, {PIPELINE_INPUT: np.zeros((100, at, 1), np.uint8)})
    check_pixels(at, 100, max_pixels=UPLOAD_MAX_PIXELS)


@pytest.mark.parametrize("side, speck", [(300, 1), (28, 1), (300, 5)])
def test_a_lone_dark_pixel_on_white_is_refused_by_both_paths_as_nearly_blank(digit_graph, side, speck):
    """Not a "0" at 0.975: the graph stops where the Python path raises, with its message."""
    pixels = np.full((side, side, 1), 255, np.uint8)
    pixels[side // 2:side // 2 + speck, side // 2:side // 2 + speck] = 0
    with pytest.raises(Exception, match=re.escape(NEARLY_BLANK)):
        digit_graph.run(None, {PIPELINE_INPUT: pixels})
    with pytest.raises(EmptyImageError, match=re.escape(NEARLY_BLANK)):
        preprocess(Image.fromarray(pixels[..., 0]), DIGIT_CONFIG)


def test_the_python_path_refuses_what_the_graph_refuses():
    with pytest.raises(EmptyImageError):
        preprocess(Image.new("L", (40, 40), 200), DIGIT_CONFIG)


# The shipped graph and the export's check ---------------------------------------------------------
def test_the_bundled_pipeline_gives_the_python_paths_probabilities_on_the_samples():
    session = pipeline_graph.pipeline_session(MODEL_DIR / "pipeline.onnx")
    network = pipeline_graph.pipeline_session(MODEL_DIR / "model.onnx")
    for sample in SAMPLES:
        image = Image.open(sample)
        logits = network.run(None, {"pixel_values": preprocess(image, DIGIT_CONFIG)[None]})[0]
        expected = softmax(logits, DIGIT_CONFIG.temperature)[0]
        got = run_pipeline(session, decoded_pixels(image))
        np.testing.assert_allclose(got, expected, atol=1e-5)
        assert DIGIT_CONFIG.labels[int(got.argmax())] == sample.stem.rsplit("_", 1)[1]


@pytest.mark.parametrize("temperature", [0.5, 2.5])
def test_a_written_pipeline_divides_the_logits_by_the_configs_temperature(temperature, tmp_path):
    """write_pipeline on a tiny photo model: probabilities softmax(logits / T), as the Python
    path computes them, and not those of T = 1."""
    import torch

    from conftest import tiny_config
    from vit_hub.export.exporter import write_graph
    from vit_hub.hub.pretrained import HubVisionTransformer

    torch.manual_seed(0)
    model = HubVisionTransformer(**tiny_config(temperature=temperature)).eval()
    with torch.no_grad():
        model.head.weight.mul_(40.0)  # logits far apart, so T visibly sharpens or flattens them
    write_graph(model, tmp_path / "model.onnx", output_attentions=False)
    pipeline_graph.write_pipeline(tmp_path / "model.onnx", tmp_path / "pipeline.onnx", model.config)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 20, 3), dtype=np.uint8))
    with torch.no_grad():
        logits = model(torch.from_numpy(preprocess(image, model.config)[None])).logits.numpy()
    got = run_pipeline(pipeline_graph.pipeline_session(tmp_path / "pipeline.onnx"), decoded_pixels(image))
    np.testing.assert_allclose(got, softmax(logits, temperature)[0], atol=1e-5)
    assert np.abs(got - softmax(logits)[0]).max() > 1e-2


@pytest.mark.slow
def test_mnist_test_digits_through_the_bundled_pipeline_get_the_python_paths_labels():
    """The first 300 MNIST test digits: the same label as preprocess + model.onnx (the bench
    measures all 10,000)."""
    from vit_hub.data.sources import load_splits
    test = load_splits("mnist", None).split("test")
    session = pipeline_graph.pipeline_session(MODEL_DIR / "pipeline.onnx")
    network = pipeline_graph.pipeline_session(MODEL_DIR / "model.onnx")
    for index in range(300):
        image = test[index][0]
        expected = network.run(None, {"pixel_values": preprocess(image, DIGIT_CONFIG)[None]})[0][0].argmax()
        assert run_pipeline(session, decoded_pixels(image)).argmax() == expected, index


def test_an_export_refuses_a_pipeline_that_drifts_from_the_python_path(monkeypatch, tmp_path):
    """A graph that forgets a step (here the normalisation's mean) is checked, reported and
    not written; the export fails with the uploads it disagreed on."""
    from vit_hub.export import VerificationError, export_onnx

    def drifting(config):
        return preprocessing_graph(ViTConfig.from_dict({**config.to_dict(), "mean": [0.0]}))

    monkeypatch.setattr(pipeline_graph, "preprocessing_graph", drifting)
    with pytest.raises(VerificationError, match="pipeline.onnx on image 0: expected the Python path's probabilities"):
        export_onnx(MODEL_DIR, tmp_path / "model.onnx")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model_export_report.failed.json"]  # nothing installed
    report = json.loads((tmp_path / "model_export_report.failed.json").read_text())
    assert report["pipeline"]["pipeline.onnx"]["failures"]


@pytest.mark.slow
def test_an_fp16_export_writes_and_checks_a_float16_pipeline(tmp_path):
    from vit_hub.export import export_onnx

    export_onnx(MODEL_DIR, tmp_path / "model.onnx", precision="fp16", eval_limit=32)
    report = json.loads((tmp_path / "model_export_report.json").read_text())["pipeline"]
    assert set(report) == {"pipeline.onnx", "pipeline_fp16.onnx"} and not report["pipeline_fp16.onnx"]["failures"]
    session = pipeline_graph.pipeline_session(tmp_path / "pipeline_fp16.onnx")
    assert run_pipeline(session, decoded_pixels(Image.open(SAMPLES[0]))).argmax() == 7


def test_the_exports_check_counts_a_refusal_by_both_paths_as_agreement():
    blank = Image.new("L", (60, 40), 225)
    checked = pipeline_graph.verify_pipeline(MODEL_DIR / "pipeline.onnx", MODEL_DIR / "model.onnx", DIGIT_CONFIG,
                                             [("blank page", blank), ("a digit", Image.open(SAMPLES[0]))])
    assert not checked["failures"] and [row.get("refused", False) for row in checked["rows"]] == [True, False]

"""The Gradio app through gradio_client, against a real server on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from conftest import digit_on_paper, free_port, python_app_map, tiny_config

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
from gradio_client import Client, handle_file  # noqa: E402

from vit_hub.data.samples import write_samples  # noqa: E402
from vit_hub.demo import backends, methods, page, pictures, server, uploads  # noqa: E402
from vit_hub.explain.attribution import METHODS  # noqa: E402
from vit_hub.layout import ModelDir  # noqa: E402
from vit_hub.processing.preprocess import preprocess, to_model_domain  # noqa: E402

MODEL_DIR = ROOT / "models" / "vit-mnist"
SAMPLES = sorted((ROOT / "vit_hub" / "bundled" / "samples").glob("mnist_test_*_label_*.png"))


def label_of(path: Path) -> str:
    return re.search(r"_label_(\d+)\.png$", path.name).group(1)


def drawn_digit(sample: Path, tmp_path: Path) -> Path:
    """An MNIST digit as a person would draw it: black on white, large, off-centre."""
    ink = ImageOps.invert(Image.open(sample).convert("L")).resize((224, 224), Image.Resampling.BICUBIC)
    canvas = Image.new("RGB", (640, 480), "white")
    canvas.paste(ink.convert("RGB"), (40, 230))
    path = tmp_path / f"drawn_{sample.name}"
    canvas.save(path)
    return path


def sketch(path: Path) -> dict:
    """The sketchpad value gradio_client sends: background, layers and the composite."""
    return {"background": handle_file(str(path)), "layers": [], "composite": handle_file(str(path))}


def needs_bundled_model() -> None:
    assert (MODEL_DIR / "model.safetensors").is_file(), \
        f"the bundled model {MODEL_DIR} is missing (its model card says how to train it)"


@pytest.fixture(scope="module")
def predictor():
    needs_bundled_model()
    threads = torch.get_num_threads()
    yield backends.TorchPredictor.load(MODEL_DIR)  # sets one torch thread for the process ...
    torch.set_num_threads(threads)  # ... which the other test modules should not inherit


@pytest.fixture(scope="module")
def served(predictor):
    demo = page.build_demo(predictor)
    _, url, _ = page.serve(demo, port=free_port(), prevent_thread_lock=True, quiet=True)
    yield demo, Client(url, verbose=False)
    demo.close()


@pytest.fixture(scope="module")
def client(served):
    return served[1]


def predict(client: Client, path, head_fusion="mean", discard_ratio=0.0, k=3, *method):
    """/explain, what the page's Classify button calls: labels and the four pictures; without a
    method the app's default is used."""
    return client.predict(handle_file(str(path)), head_fusion, discard_ratio, k, *method, api_name="/explain")


# Without a server ---------------------------------------------------------------------
def test_import_is_light():
    """Importing app.py and the demo's parts loads no torch and builds nothing (the ONNX backend
    stays torch-free)."""
    code = ("import sys, app; from vit_hub.demo import backends, methods, page, pictures, server, uploads; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(page.build_demo.__name__)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "build_demo"


def test_safe_default_flags():
    args = server.parse_args([])
    assert (args.host, args.backend, Path(args.model)) == ("127.0.0.1", "torch", server.DEFAULT_MODEL)


def test_main_reports_a_missing_model(tmp_path):
    with pytest.raises(SystemExit, match="cannot load --model"):
        server.main(["--model", str(tmp_path / "nothing-here")])


def test_empty_drawing_is_refused():
    with pytest.raises(gr.Error, match="drawing is empty"):
        uploads.read_drawing(sketch_value(Image.new("RGB", (400, 400), "white")), (28, 28))


def sketch_value(image: Image.Image) -> dict:
    """The sketchpad's value as the handler receives it (preprocessed to PIL)."""
    return {"background": image, "layers": [], "composite": image}


@pytest.mark.parametrize("size, shown", [
    ((300, 140), (300, 140)),  # the input's size
    ((1000, 1024), (1000, 1024)),
    ((2048, 1536), (1024, 768)),  # longer side capped at DISPLAY_MAX_SIDE
    ((28, 28), (280, 280)),  # small inputs scaled up by an integer factor
    ((40, 20), (280, 140)),
])
def test_display_size(size, shown):
    assert pictures.display_size(*size) == shown


# Through gradio_client ----------------------------------------------------------------
def test_safe_launch_settings(served):
    demo, _ = served
    assert demo.local_url.startswith("http://127.0.0.1:")
    assert demo.share is False and demo.ssr_mode is False and demo.analytics_enabled is False
    assert demo.max_file_size == 20 * 1024 * 1024
    limits = {fn.api_name: fn.concurrency_limit for fn in demo.fns.values()}
    assert {limits[name] for name in ("predict", "predict_labels", "explain", "explain_drawing")} == {page.CONCURRENCY_LIMIT}


def test_named_endpoints(client):
    endpoints = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert set(endpoints) == {"/predict", "/predict_labels", "/explain", "/explain_drawing"}
    predict = endpoints["/predict"]
    top_k = next(parameter for parameter in predict["parameters"] if parameter["label"] == "Top-k")
    assert top_k["python_type"]["type"] == "int"  # a whole number, not a float
    assert [value["label"] for value in predict["returns"]] == ["Prediction", "Explanation map"]  # no value_N


def test_predict_answers_labels_and_the_map_as_numbers(client, predictor):
    """/predict: the page's top-k and the chosen method's map, as numbers: no file for a client to
    download. The map is the one /explain draws (same method, same patch grid)."""
    config = predictor.config
    scores, answer = client.predict(handle_file(str(SAMPLES[0])), "mean", 0.0, 3, "rollout", api_name="/predict")
    assert scores["label"] == label_of(SAMPLES[0]) and len(scores["confidences"]) == 3
    assert answer["method"] == "rollout" and answer["grid"] == list(config.grid_size)
    assert answer["patch_size"] == list(config.patch_size)
    view = to_model_domain(Image.open(SAMPLES[0]), config)
    expected = pictures.answer(predictor, view, "mean", 0.0, 3, "rollout").method_map
    np.testing.assert_allclose(np.array(answer["map"]), expected, atol=10 ** -pictures.MAP_DECIMALS)
    default = client.predict(handle_file(str(SAMPLES[0])), "mean", 0.0, 3, api_name="/predict")[1]
    assert default["method"] == methods.opening_method(predictor)
    assert not np.allclose(np.array(default["map"]), expected)  # the method reached the map


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda path: path.name)
def test_bundled_samples_are_classified(client, sample, predictor):
    scores, overlay, strip, _, _ = predict(client, sample, k=3)
    assert scores["label"] == label_of(sample)
    assert len(scores["confidences"]) == 3
    assert Image.open(overlay).size == (280, 280)  # 28x28 input, scaled 10x for display
    tiles = predictor.config.depth
    assert Image.open(strip).size == (tiles * (pictures.STRIP_TILE_HEIGHT + 4) - 4, pictures.STRIP_TILE_HEIGHT)


def test_the_explained_overlay_is_the_python_overlay_pixel_for_pixel(client, predictor, tmp_path):
    """/explain's map over the image arrives with the very pixels the Python app drew (a lossless
    picture), the ones the Node example and the static Space are held to."""
    from vit_hub.explain.rollout import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION

    for path in (SAMPLES[0], photo_of_digit(SAMPLES[1], tmp_path)):
        overlay = predict(client, path, DEFAULT_HEAD_FUSION, DEFAULT_DISCARD_RATIO, 3, "rollout")[1]
        drawn = np.asarray(Image.open(overlay).convert("RGB"), dtype=np.int16)
        np.testing.assert_array_equal(drawn, python_app_map(predictor, path)[1])


@pytest.mark.parametrize("size", [(300, 140), (2048, 1536), (28, 28), (40, 20)])
def test_a_canonicalising_model_explains_its_canonical_input(client, tmp_path, size):
    """The bundled model canonicalises digits, so the overlay and the model's input show the
    centred 28x28 digit (scaled 10x), whatever the upload's size."""
    path = tmp_path / "input.png"
    Image.open(SAMPLES[0]).resize(size).save(path)
    _, overlay, _, model_input, _ = predict(client, path)
    assert Image.open(overlay).size == Image.open(model_input).size == (280, 280)


def photo_of_digit(sample: Path, tmp_path: Path) -> Path:
    path = tmp_path / f"photo_{sample.stem}.jpg"
    digit_on_paper(sample).save(path, quality=75)
    return path


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda path: path.name)
def test_photo_of_a_digit_on_paper_is_recognised(client, sample, tmp_path):
    scores, _, _, model_input, _ = predict(client, photo_of_digit(sample, tmp_path))
    assert scores["label"] == label_of(sample)
    seen = np.asarray(Image.open(model_input).convert("L").resize((28, 28), Image.Resampling.BOX), dtype=np.float64)
    original = np.asarray(Image.open(sample), dtype=np.float64)
    assert np.corrcoef(seen.ravel(), original.ravel())[0, 1] > 0.8  # the digit, light on black, centred


@pytest.mark.parametrize("sample", SAMPLES[:5], ids=lambda path: path.name)
def test_drawn_digit_is_recognised(client, sample, tmp_path):
    scores, overlay, _, _, _ = client.predict(sketch(drawn_digit(sample, tmp_path)), "mean", 0.0, 3,
                                           api_name="/explain_drawing")
    assert scores["label"] == label_of(sample)
    assert Image.open(overlay).size == (280, 280)  # the centred 28x28 digit, scaled for display


def test_cmyk_and_16_bit_images_are_converted(client, tmp_path):
    """Converted, not refused: preprocess.to_model_mode maps both to the model's mode, so
    such files (print scans, medical and scientific images) classify like 8-bit ones."""
    sample = SAMPLES[0]
    cmyk, deep = tmp_path / "cmyk.jpg", tmp_path / "deep.png"
    Image.open(sample).convert("RGB").convert("CMYK").save(cmyk, quality=95)
    Image.fromarray(np.asarray(Image.open(sample), dtype=np.uint16) * 257).save(deep)
    assert Image.open(cmyk).mode == "CMYK" and Image.open(deep).mode.startswith("I;16")
    for path in (cmyk, deep):
        scores, overlay, _, _, _ = predict(client, path)
        assert scores["label"] == label_of(sample)
        assert Image.open(overlay).size == (280, 280)


def test_controls_change_the_answer(client):
    sample = SAMPLES[0]
    scores, plain, _, _, _ = predict(client, sample, "mean", 0.0, 5, "rollout")
    _, sharp, _, _, _ = predict(client, sample, "max", 0.9, 5, "rollout")
    assert len(scores["confidences"]) == 5
    assert not np.array_equal(np.asarray(Image.open(plain)), np.asarray(Image.open(sharp)))
    _, default, _, _, _ = predict(client, sample, "mean", 0.0, 5)  # the method the page opens with
    _, named, _, _, _ = predict(client, sample, "mean", 0.0, 5, "integrated_gradients_rollout")
    assert np.array_equal(np.asarray(Image.open(default)), np.asarray(Image.open(named)))
    assert not np.array_equal(np.asarray(Image.open(plain)), np.asarray(Image.open(named)))


def test_every_method_answers_and_the_page_says_how_faithful_each_measured(served):
    demo, client = served
    for method in METHODS:
        scores, overlay, _, _, _ = predict(client, SAMPLES[0], "mean", 0.0, 3, method)
        assert scores["label"] == label_of(SAMPLES[0]) and Image.open(overlay).size == (280, 280)
    with pytest.raises(Exception, match="method: expected one of"):
        predict(client, SAMPLES[0], "mean", 0.0, 3, "saliency")
    page = "\n".join(block.value for block in demo.blocks.values() if isinstance(block, gr.Markdown))
    measured = json.loads((MODEL_DIR / ModelDir.faithfulness).read_text())["methods"]
    quick = [name for name, method in METHODS.items() if method.quick and name in measured]
    best = max(quick, key=lambda name: measured[name]["insertion_auc"] - measured[name]["deletion_auc"])
    assert best == "integrated_gradients_rollout"  # on the bundled model (BENCHMARKS.md)
    row = measured[best]
    assert f"| {METHODS[best].label} | {row['deletion_auc']:.3f} | {row['insertion_auc']:.3f} |" in page
    assert f"opens with **{METHODS[best].label}**" in page
    assert "| gradient_rollout |" not in page and "| ink per patch | " in page  # bench-only methods left out
    (accordion,) = [block for block in demo.blocks.values() if isinstance(block, gr.Accordion)]
    assert accordion.label == "How faithful is this map?" and accordion.open is False


def test_the_onnx_backend_offers_the_maps_without_gradients_and_says_why(predictor):
    """Gradient methods need the torch model: the ONNX backend leaves them out of the control
    and refuses them by name through the API, pointing to --backend torch."""
    needs_bundled_model()
    onnx = backends.OnnxPredictor.load(MODEL_DIR)
    assert set(onnx.methods) == {name for name, method in METHODS.items() if method.runs_on_onnx}
    view = to_model_domain(Image.open(SAMPLES[0]), onnx.config)
    for method in onnx.methods:
        assert pictures.explain(onnx, view, "mean", 0.0, 3, method).scores
    with pytest.raises(ValueError, match="needs gradients.*--backend torch"):
        pictures.explain(onnx, view, "mean", 0.0, 3, "integrated_gradients")
    pixels = np.stack([preprocess(path, onnx.config) for path in SAMPLES[:2]])
    np.testing.assert_allclose(onnx.explain(pixels, "occlusion")[2], predictor.explain(pixels, "occlusion")[2],
                               atol=1e-3)


def bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, part of the expected message)."""
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    tiny, huge, blank = tmp_path / "tiny.png", tmp_path / "huge.png", tmp_path / "blank.png"
    Image.new("L", (1, 1)).save(tiny)
    Image.new("1", (10_000, 10_000), 1).save(huge)  # a few kB on disk, 100 megapixels decoded
    Image.new("RGB", (400, 400), "white").save(blank)
    return {"non-image": (text, "notes.png is not a readable image"), "1x1": (tiny, "at least 2x2"),
            "10000x10000": (huge, "megapixels"), "empty drawing": (blank, "drawing is empty")}


@pytest.mark.parametrize("case", ["non-image", "1x1", "10000x10000", "empty drawing"])
def test_bad_input_is_reported_and_the_app_keeps_serving(client, case, tmp_path):
    path, message = bad_inputs(tmp_path)[case]
    with pytest.raises(Exception, match=message):
        if case == "empty drawing":
            client.predict(sketch(path), "mean", 0.0, 3, api_name="/explain_drawing")
        else:
            predict(client, path)
    scores, _, _, _, _ = predict(client, SAMPLES[1])
    assert scores["label"] == label_of(SAMPLES[1])


def test_missing_image_and_bad_controls_are_reported(client):
    with pytest.raises(Exception, match="No image yet"):
        client.predict(None, "mean", 0.0, 3, api_name="/predict")
    with pytest.raises(Exception, match="head fusion: expected one of mean, max, min, got 'median'"):
        predict(client, SAMPLES[0], head_fusion="median")
    for controls, message in [(("mean", 1.0, 3), "discard ratio: expected a number from 0 up to 1, got '1.0'"),
                              (("mean", 0.0, 0), "top-k: expected a whole number of 1 or more, got '0'"),
                              (("mean", 0.0, 2.5), "top-k: expected a whole number of 1 or more, got '2.5'"),
                              (("mean", 0.0, "3"), "top-k: expected a whole number of 1 or more, got '3'")]:
        with pytest.raises(Exception, match=re.escape(message)):
            client.predict(handle_file(str(SAMPLES[0])), *controls, api_name="/predict")


def test_onnx_backend_exports_on_the_fly_and_gives_the_same_answers(predictor, tmp_path, monkeypatch):
    """--backend onnx on a model dir without ONNX graphs: exported first, then served."""
    model_dir, export_dir = tmp_path / "model", tmp_path / "export"
    model_dir.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(MODEL_DIR / name, model_dir / name)
    made = backends.tempfile.mkdtemp  # every other temporary folder (the export's staging, torch's) as always

    def app_folder_or_made(*args, **kwargs):  # the app's own call: mkdtemp(prefix=...) alone
        return str(export_dir) if not args and set(kwargs) == {"prefix"} else made(*args, **kwargs)

    monkeypatch.setattr(backends.tempfile, "mkdtemp", app_folder_or_made)
    onnx = backends.load_predictor(model_dir, "onnx")
    assert (export_dir / "model_attentions.onnx").is_file()
    assert onnx.description.startswith("ONNX Runtime")
    demo = page.build_demo(onnx)
    _, url, _ = page.serve(demo, port=free_port(), prevent_thread_lock=True, quiet=True)
    try:
        onnx_client = Client(url, verbose=False)
        for sample in SAMPLES[:3]:
            scores, overlay, _, _, _ = predict(onnx_client, sample)
            assert scores["label"] == label_of(sample)
            assert Image.open(overlay).size == (280, 280)
        pixels = np.stack([preprocess(path, onnx.config) for path in SAMPLES])
        onnx_probabilities, onnx_attentions = onnx.predict(pixels)
        torch_probabilities, torch_attentions = predictor.predict(pixels)
        np.testing.assert_allclose(onnx_probabilities, torch_probabilities, atol=1e-5)
        np.testing.assert_allclose(onnx_attentions, torch_attentions, atol=1e-5)
    finally:
        demo.close()


def test_onnx_backend_uses_the_graph_shipped_with_the_model(monkeypatch):
    needs_bundled_model()
    assert (MODEL_DIR / "model_attentions.onnx").is_file(), f"{MODEL_DIR} ships no model_attentions.onnx"

    def no_export(model_dir):
        raise AssertionError(f"exported {model_dir} although it ships an attentions graph")

    monkeypatch.setattr(backends, "_export_dir", no_export)
    onnx = backends.load_predictor(MODEL_DIR, "onnx")
    assert onnx.classifier.model_path.parent == MODEL_DIR


def test_an_rgb_model_with_a_non_square_grid(tmp_path):
    """Any vit_hub model works: RGB, 16x24 input (a 4x6 patch grid); no drawing tab."""
    from vit_hub.hub.pretrained import HubVisionTransformer

    HubVisionTransformer(**tiny_config(image_size=[16, 24], labels=["cat", "dog", "fox"])).save_pretrained(tmp_path / "rgb")
    demo = page.build_demo(backends.TorchPredictor.load(tmp_path / "rgb", threads=None))
    _, url, _ = page.serve(demo, port=free_port(), prevent_thread_lock=True, quiet=True)
    try:
        rgb_client = Client(url, verbose=False)
        assert "/explain_drawing" not in rgb_client.view_api(print_info=False, return_format="dict")["named_endpoints"]
        path = tmp_path / "photo.jpg"
        Image.new("RGB", (90, 60), (200, 120, 40)).save(path)
        scores, overlay, strip, model_input, heads = predict(rgb_client, path, k=5)
        assert {item["label"] for item in scores["confidences"]} == {"cat", "dog", "fox"}
        assert Image.open(overlay).size == (360, 240)  # 90x60 scaled 4x for display
        assert Image.open(model_input).size == (288, 192)  # the 16x24 input, scaled 12x
        assert Image.open(strip).size == (2 * (round(24 * 96 / 16) + 4) - 4, 96)  # 2 layers, tiles 144x96
        assert Image.open(heads).size == (2 * 108 + 3, 2 * 72 + 3)  # 2 heads x 2 layers of 4x6 patches, 18 px each
    finally:
        demo.close()


def _page_parts(demo) -> tuple[set[str], list[list], str]:
    """(tab labels, example rows, markdown text) of a built page."""
    blocks = list(demo.blocks.values())
    tabs = {block.label for block in blocks if isinstance(block, gr.Tab)}
    examples = [row for block in blocks if isinstance(block, gr.Dataset) for row in block.samples]
    text = "\n".join(block.value for block in blocks if isinstance(block, gr.Markdown) and block.value)
    return tabs, examples, text


def test_a_photo_model_gets_its_own_page_not_the_digit_one(tmp_path):
    """A grayscale model of photos (not canonicalised as digits): no drawing, no MNIST digits as
    examples, the header names its classes; with samples kept in its dir, those are the examples."""
    from vit_hub.hub.pretrained import HubVisionTransformer

    model_dir = tmp_path / "shapes"
    HubVisionTransformer(**tiny_config(in_channels=1, labels=["circle", "square"])).save_pretrained(model_dir)
    tabs, examples, text = _page_parts(page.build_demo(backends.TorchPredictor.load(model_dir, threads=None)))
    assert "Draw" not in tabs and examples == [] and "draw" not in text.lower()
    assert "one of 2 classes (circle, square)" in text

    write_samples([(Image.new("L", (40, 30), 200), 0), (Image.new("L", (40, 30), 20), 1)], ["circle", "square"],
                  model_dir)
    _, examples, _ = _page_parts(page.build_demo(backends.TorchPredictor.load(model_dir, threads=None)))
    assert [Path(row[0]["path"]).name for row in examples] == ["00_circle.png", "01_square.png"]


@pytest.mark.parametrize("label, name", [
    ("golden retriever", "00_golden-retriever.png"), ("../../etc/passwd", "00_etc-passwd.png"),
    ("a/b\\c:d", "00_a-b-c-d.png"), ("..", "00_class1.png"), ("猫", "00_class1.png"), ("x" * 300, f"00_{'x' * 40}.png"),
])
def test_samples_are_named_by_their_label_made_safe_for_a_file_name(label, name, tmp_path):
    """A label is untrusted text: only letters, digits, '_' and '-' of it reach the file name
    (and the static page's URL); a label with none of them falls back to the class index."""
    [written] = write_samples([(Image.new("L", (8, 8), 200), 1)], ["other", label], tmp_path, count=1)
    assert written == tmp_path / "samples" / name


def test_a_digit_model_offers_drawing_and_the_bundled_digits(predictor):
    tabs, examples, text = _page_parts(page.build_demo(predictor))
    assert "Draw" in tabs and "draw one" in text
    assert sorted(Path(row[0]["path"]).name for row in examples) == sorted(path.name for path in SAMPLES)


def test_a_large_jpeg_is_decoded_at_the_scale_the_model_needs(predictor, tmp_path, monkeypatch):
    """The app reads a 2400x1800 phone JPEG of a digit at 1/2 a side (the most reduced JPEG scale
    keeping decode_side's 512 pixels on the shorter side) and answers with the full decode's label."""
    from gradio.utils import get_upload_folder

    from vit_hub.processing.preprocess import load_image, model_pixels, open_image

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio"))
    folder = Path(get_upload_folder()) / "large"
    folder.mkdir(parents=True)
    path = folder / "photo.jpg"
    digit_on_paper(SAMPLES[2], canvas=(2400, 1800), at=(700, 450), side=900).save(path, quality=90)
    decoded, opened = [], uploads.open_image
    monkeypatch.setattr(uploads, "open_image",
                        lambda *args, **kwargs: decoded.append(opened(*args, **kwargs)) or decoded[-1])
    handlers = page.Handlers(predictor, page.opening_method(predictor))
    labels = handlers.predict_labels({"path": str(path), "orig_name": "photo.jpg"}, 1)
    assert [image.size for image in decoded] == [(1200, 900)]
    config = predictor.config
    whole, _ = predictor.predict(model_pixels(to_model_domain(load_image(open_image(path)), config), config)[None])
    assert list(labels) == [config.labels[int(whole[0].argmax())]] == [SAMPLES[2].stem.split("_")[-1]]

"""The model a person trains walks every path the bundled digit model walks: a matrix of model
kinds (the digit recipe, photo models in gray and colour at 64 and 128 px, each pooling,
position and patch embedding, a small transformers ViT fine-tuned) by path, each kind trained
and exported through the command line (`vit-hub train`, `vit-hub export --output-attentions`):

  * the export's own checks pass, on its samples and its photographed, canvas and alpha uploads;
  * pipeline.onnx, pipeline_map.onnx and preprocess.onnx give the Python path's answers, maps
    and pixels on what people upload (JPEG photos, odd sizes, alpha, gray, EXIF rotation);
  * UploadClassifier (a GPU server's route) answers as the Python app, and with explain=True
    gives each upload pipeline_explain.onnx's map;
  * `vit-hub space` and `vit-hub space --static` write their Spaces, the static one with the map;
  * the static page in chromium and the Node example with --map give the Python app's labels,
    the map its page opens with (pipeline_explain.onnx's gradients; within the export's 1e-3)
    and overlays;
  * the app's /predict and /explain answer and draw as the Python path;
  * `vit-hub push --with-onnx --dry-run` lists every graph.

The photo models learn their two classes from generated data (a warm disc on light ground, a
cool square on dark ground) in seconds, so their maps are a trained model's, not noise's.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from conftest import (BUNDLED_MODEL, assert_same_overlay, call, digit_on_paper, draw_example, file_data, free_port,
                      python_app_map, python_page_map, upload)
from vit_hub import cli
from vit_hub.demo.backends import TorchPredictor
from vit_hub.export import OnnxClassifier
from vit_hub.export.batched_runtime import UploadClassifier
from vit_hub.export.map_graph import run_map_pipeline
from vit_hub.export.pipeline_graph import decoded_pixels, pipeline_session
from vit_hub.export.preprocess_graph import preprocessing_session, run_preprocessing
from vit_hub.hub.static_space import ORT_WEB_VERSION
from vit_hub.layout import PIPELINE_INPUT, PIPELINE_MAP, PIPELINE_MODEL_INPUT, PIPELINE_OUTPUT
from vit_hub.processing.preprocess import (UPLOAD_MAX_PIXELS, load_image, open_image, preprocess, resize,
                                           to_model_domain)

pytestmark = pytest.mark.slow  # about 10 minutes on 2 cores: CI runs it, `make test-fast` leaves it out

ROOT = Path(__file__).resolve().parents[1]
ORT_WEB = ROOT / ".venv" / "cache" / f"onnxruntime-web-{ORT_WEB_VERSION}.tgz"
SAMPLES = sorted((ROOT / "vit_hub" / "bundled" / "samples").glob("mnist_test_*_label_*.png"))
MAP_TOLERANCE = 1e-3  # the export's, and the README's
# Small and quick: a width of 32 and two blocks learn 2 x 40 generated photos in about 20 s (each
# photo normalised by its own mean and spread, as photo models are: the shape decides, not the colour).
SMALL = ["--embed-dim", "32", "--depth", "2", "--num-heads", "2", "--epochs", "20", "--batch-size", "16",
         "--lr", "3e-3", "--augment", "none", "--workers", "0", "--seed", "0", "--device", "cpu", "--val-split", "0.25"]
KINDS = {
    "digit": None,  # the digit recipe: the bundled model, trained on MNIST
    "gray-shifted": ["--in-channels", "1", "--patch-embedding", "shifted"],
    "rgb-64-defaults": [],  # what a photo folder gets: 64 px, hybrid stem, mean pooling, learned positions
    "rgb-128-convstem": ["--image-size", "128", "--patch-size", "16", "--patch-embedding", "convstem"],
    "cls-sincos-conv": ["--pooling", "cls", "--pos-embedding", "sincos", "--patch-embedding", "conv"],
    "transformers-import": ["--init"],  # a small transformers ViT, fine-tuned from its folder
}
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def run(*argv) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "vit_hub", *map(str, argv)], capture_output=True, text=True,
                          cwd=ROOT, env=ENV, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def run_in_process(*argv) -> str:
    """`vit-hub ARGV` through the command's own parser and checks; its output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main([str(arg) for arg in argv])
    assert code == 0, out.getvalue()
    return out.getvalue()


def photo_folder(root: Path, per_class: int = 40) -> Path:
    """Two classes of generated photos, JPEG and PNG, 56-160 px a side."""
    rng = np.random.default_rng(0)
    for name in ("bright_disc", "dark_square"):
        (root / name).mkdir(parents=True)
        for index in range(per_class):
            size = (int(rng.integers(56, 160)), int(rng.integers(56, 160)))
            draw_example(name, size, rng).save(root / name / f"{index:03d}.{'jpg' if index % 2 else 'png'}")
    return root


def transformers_vit(folder: Path) -> Path:
    """A small transformers ViTForImageClassification saved as transformers saves one."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                    image_size=32, patch_size=8, num_labels=2, attn_implementation="eager")
    transformers.ViTForImageClassification(config).save_pretrained(folder, safe_serialization=True)
    return folder


def uploads_of_photos(folder: Path, data: Path) -> list[Path]:
    """What people upload of the photo classes: a phone JPEG at 640x480, an odd size, a
    transparent PNG, a gray scan with and without alpha, a JPEG whose EXIF says to turn it, a
    palette PNG."""
    folder.mkdir()
    disc, square = (Image.open(sorted((data / name).glob("*.png"))[0]).convert("RGB")
                    for name in ("bright_disc", "dark_square"))
    disc.resize((640, 480), Image.Resampling.BICUBIC).save(folder / "phone.jpg", quality=88)
    square.resize((97, 61), Image.Resampling.BICUBIC).save(folder / "odd.png")
    cutout = disc.convert("RGBA")
    cutout.putalpha(Image.linear_gradient("L").resize(disc.size))
    cutout.save(folder / "alpha.png")
    square.convert("L").save(folder / "gray.png")
    scanned = disc.convert("LA")
    scanned.putalpha(200)
    scanned.save(folder / "gray_alpha.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # turned: the viewer rotates it 90 degrees clockwise
    disc.resize((120, 80)).save(folder / "turned.jpg", exif=exif, quality=92)
    square.convert("P", palette=Image.Palette.ADAPTIVE, colors=16).save(folder / "palette.png")
    return sorted(folder.iterdir())


def uploads_of_digits(folder: Path) -> list[Path]:
    """A phone photo of a digit on paper, a thin-pen 7 on a 640x480 screenshot canvas, a gray scan."""
    folder.mkdir()
    digit_on_paper(SAMPLES[1]).save(folder / "phone.jpg", quality=88)
    canvas = Image.new("RGBA", (640, 480), (255, 255, 255, 0))
    ImageDraw.Draw(canvas).line([(260, 140), (380, 140), (300, 360)], fill=(20, 20, 20, 255), width=3)
    canvas.save(folder / "thin_pen.png")
    Image.open(SAMPLES[3]).convert("L").resize((140, 140)).save(folder / "scan.png")
    return sorted(folder.iterdir())


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return photo_folder(tmp_path_factory.mktemp("photos"))


@pytest.fixture(scope="module", params=list(KINDS))
def kind(request, data, tmp_path_factory) -> tuple[str, Path, list[Path]]:
    """(name, the model dir trained and exported through the command line, uploads people make)."""
    name, flags = request.param, KINDS[request.param]
    work = tmp_path_factory.mktemp(name)
    model = work / "model"
    if flags is None:
        model = BUNDLED_MODEL  # its graphs are the export's, re-made by the bundled export test
        return name, model, uploads_of_digits(work / "uploads")
    if flags == ["--init"]:
        flags = ["--init", transformers_vit(work / "source")]
    run("train", "--data", data, "--out", model, *SMALL, *flags)
    run("export", "--model", model, "--out", model, "--output-attentions")
    return name, model, uploads_of_photos(work / "uploads", data)


def python_view(path: Path, config) -> Image.Image:
    return to_model_domain(load_image(open_image(path, path.name, UPLOAD_MAX_PIXELS)), config)


def python_label(predictor: TorchPredictor, path: Path) -> str:
    """The Python app's top label for an upload."""
    from vit_hub.demo import pictures

    return next(iter(pictures.answer(predictor, python_view(path, predictor.config), "mean", 0.0, 1, "rollout").scores))


def test_a_trained_kind_learned_its_classes_and_its_export_passed_every_check(kind):
    name, model, _ = kind
    report = json.loads((model / "model_export_report.json").read_text())
    failures = [failure for section in (*report["graphs"].values(), *report["pipeline"].values(), report["preprocess"])
                for failure in section.get("failures", [])]
    assert not failures and {"pipeline.onnx", "pipeline_map.onnx"} <= set(report["pipeline"])
    if name != "digit":
        final = json.loads((model / "metrics.json").read_text())["final"]
        assert final["accuracy"] >= 0.85, final  # 20 held-out photos: a trained model's maps, not noise's


def test_the_graphs_give_the_python_paths_answers_maps_and_pixels_on_uploads(kind):
    """pipeline.onnx's probabilities, pipeline_map.onnx's map and model_input, preprocess.onnx's
    pixel values, each against the Python path, upload by upload."""
    _, model, uploads = kind
    predictor = TorchPredictor.load(model)
    config = predictor.config
    network = OnnxClassifier(model, providers="cpu")
    pipeline, with_map = pipeline_session(model / "pipeline.onnx"), pipeline_session(model / "pipeline_map.onnx")
    preprocessing = preprocessing_session(model / "preprocess.onnx")
    for path in uploads:
        image = load_image(open_image(path, path.name, UPLOAD_MAX_PIXELS))
        pixels, view = decoded_pixels(image), python_view(path, config)
        expected = network.predict(image, top_k=config.num_classes)
        probabilities = dict(zip(config.labels, pipeline.run([PIPELINE_OUTPUT], {PIPELINE_INPUT: pixels})[0]))
        assert max(abs(probabilities[label] - score) for label, score in expected) < 1e-4, path.name
        got = run_map_pipeline(with_map, pixels)
        expected_map, _ = python_app_map(predictor, path)
        np.testing.assert_allclose(got[PIPELINE_MAP], expected_map, atol=MAP_TOLERANCE, err_msg=path.name)
        seen = np.asarray(resize(view, config)).reshape(*config.image_size, config.in_channels)
        np.testing.assert_array_equal(got[PIPELINE_MODEL_INPUT], seen, err_msg=path.name)
        np.testing.assert_allclose(run_preprocessing(preprocessing, pixels)[0], preprocess(image, config),
                                   atol=1e-4, err_msg=path.name)


def test_a_gpu_servers_route_answers_as_the_python_app(kind):
    _, model, uploads = kind
    network = OnnxClassifier(model, providers="cpu")
    server = UploadClassifier(model, providers="cpu")
    for path in uploads:
        image = load_image(open_image(path, path.name, UPLOAD_MAX_PIXELS))
        (got,) = server.classify([decoded_pixels(image)])
        expected = dict(network.predict(image, top_k=network.config.num_classes))
        assert max(abs(score - expected[label]) for label, score in server.top_k(got, len(expected))) < 1e-4
    # explain=True: each upload's map is pipeline_explain.onnx's for that upload alone
    pixels = [decoded_pixels(load_image(open_image(path, path.name, UPLOAD_MAX_PIXELS))) for path in uploads]
    graph = pipeline_session(model / "pipeline_explain.onnx")
    for upload, answer in zip(pixels, server.classify(pixels, explain=True)):
        if answer.refusal is None:
            np.testing.assert_allclose(answer.map, graph.run([PIPELINE_MAP], {PIPELINE_INPUT: upload})[0], atol=1e-6)


@pytest.fixture(scope="module")
def spaces(kind, tmp_path_factory) -> tuple[Path, Path]:
    """`vit-hub space` and `vit-hub space --static` on the kind, through the command: (Gradio Space, static Space)."""
    name, model, _ = kind
    assert ORT_WEB.is_file(), f"run `make install-dev` (it fetches {ORT_WEB.name} with npm pack)"
    out = tmp_path_factory.mktemp(f"{name}-spaces")
    run_in_process("space", model, "--repo-id", f"me/{name}", "--dry-run", "--out", out / "gradio")
    run_in_process("space", model, "--repo-id", f"me/{name}", "--static", "--dry-run", "--out", out / "static",
                   "--onnxruntime-web", ORT_WEB)
    return out / "gradio", out / "static"


def test_both_spaces_are_written_the_static_one_with_the_map(spaces):
    gradio, static = spaces
    assert (gradio / "app.py").is_file()
    assert json.loads((static / "model" / "model.json").read_text())["graph"] == "pipeline_explain.onnx"


@pytest.mark.browser
def test_the_static_page_gives_the_python_apps_label_map_and_overlay(kind, spaces):
    from playwright.sync_api import sync_playwright

    from bench.static_space import serve
    from docs.screenshots import CHROMIUM, CHROMIUM_ARGS
    from test_static_space import page_map

    _, model, uploads = kind
    predictor = TorchPredictor.load(model)
    server = serve(spaces[1])
    shown = []
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{server.server_address[1]}/")
            page.wait_for_selector("body[data-ready=true]", timeout=60_000)
            for path in uploads:
                if path.suffix == ".png":  # one decoder's pixels: a browser's JPEG decoder may differ by a level
                    page.set_input_files("#file", str(path))
                    values, drawn = page_map(page)  # waits for the answer
                    shown.append((path, page.get_attribute("#status", "data-label"), values, drawn,
                                  page.get_attribute("#map", "data-method")))
            browser.close()
    finally:
        server.shutdown()
    for path, label, values, drawn, method in shown:
        expected_map, expected_overlay, expected_method = python_page_map(predictor, path)  # the page's opening map
        assert label == python_label(predictor, path) and method == expected_method, path.name
        np.testing.assert_allclose(values, expected_map, atol=MAP_TOLERANCE, err_msg=path.name)
        assert_same_overlay(drawn, expected_overlay)


def test_the_node_example_gives_the_python_apps_labels_map_and_overlay(kind, tmp_path):
    from test_node_example import classify_in_node, python_app_answers

    _, model, uploads = kind
    pngs = [path for path in uploads if path.suffix == ".png"]
    rows = classify_in_node(model, pngs)
    assert [row["label"] for row in rows] == [ranking[0][0] for ranking in python_app_answers(model, pngs)]
    (row,) = classify_in_node(model, [pngs[0]], "--map", str(tmp_path / "overlay.png"))
    expected_map, expected_overlay, method = python_page_map(TorchPredictor.load(model), pngs[0])
    assert row["map_method"] == method  # the page's opening map, gradients inside pipeline_explain.onnx
    np.testing.assert_allclose(np.array(row["map"]), expected_map, atol=MAP_TOLERANCE)
    assert_same_overlay(np.asarray(Image.open(row["overlay"]).convert("RGB")), expected_overlay)


def test_the_apps_predict_and_explain_answer_as_the_python_path(kind):
    import torch

    from vit_hub.demo import pictures
    from vit_hub.demo.page import build_demo, serve

    _, model, uploads = kind
    predictor = TorchPredictor.load(model)
    threads = torch.get_num_threads()
    demo = build_demo(predictor)
    _, url, _ = serve(demo, port=free_port(), prevent_thread_lock=True, quiet=True)
    try:
        for path in uploads[:3]:
            sent = file_data(upload(url, path))
            event, (scores, answer) = call(url, "predict", [sent, "mean", 0.0, 3, "rollout"])
            view = python_view(path, predictor.config)
            assert event == "complete" and scores["label"] == python_label(predictor, path), path.name
            expected = pictures.answer(predictor, view, "mean", 0.0, 3, "rollout").method_map
            np.testing.assert_allclose(np.array(answer["map"]), expected, atol=10 ** -pictures.MAP_DECIMALS)
            event, explained = call(url, "explain", [sent, "mean", 0.0, 3, "rollout"])
            assert event == "complete" and explained[0]["label"] == scores["label"]
    finally:
        demo.close()
        torch.set_num_threads(threads)


def test_push_dry_run_lists_every_graph(kind, capsys):
    name, model, _ = kind
    printed = run_in_process("push", "--model", model, "--repo-id", f"me/{name}", "--with-onnx", "--dry-run")
    for graph in ("model.onnx", "model_attentions.onnx", "pipeline.onnx", "pipeline_map.onnx", "pipeline_explain.onnx",
                  "preprocess.onnx"):
        assert graph in printed, printed

"""`vit-hub space --static` (vit_hub/hub/static_space.py and the page in vit_hub/hub/static_page): the folder
it writes, served by a plain static server on 127.0.0.1 and opened in Debian's headless chromium,
classifies the samples and generated uploads as the Python app does, fetches nothing from
elsewhere, and fits a static Space. `make install-dev` fetches onnxruntime-web's npm tarball into
.venv/cache (npm pack), so the tests run offline."""

from __future__ import annotations

import base64
import gzip
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from bench.static_space import serve, wait_for_label
from conftest import assert_same_overlay, digit_on_paper, python_app_map, python_page_map
from vit_hub.demo.backends import TorchPredictor
from vit_hub.errors import UserError
from vit_hub.export import OnnxClassifier
from vit_hub.hub.static_space import ORT_WEB_VERSION, onnxruntime_web, write_static_space
from vit_hub.processing.preprocess import UPLOAD_MAX_PIXELS, load_image, open_image

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "vit-mnist"
ORT_WEB = ROOT / ".venv" / "cache" / f"onnxruntime-web-{ORT_WEB_VERSION}.tgz"
MAX_DOWNLOAD = 10 * 2**20  # compressed, as a static host serves it


@pytest.fixture(scope="module")
def static_space(tmp_path_factory) -> Path:
    assert ORT_WEB.is_file(), f"run `make install-dev` (it fetches {ORT_WEB.name} with npm pack)"
    out = tmp_path_factory.mktemp("spaces") / "digits"
    write_static_space(MODEL_DIR, out, "me/digits", ORT_WEB)
    return out


@pytest.fixture(scope="module")
def served(static_space):
    """The folder behind a plain static file server on 127.0.0.1 -> its URL."""
    server = serve(static_space)
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


def test_the_folder_is_a_static_space_with_the_graph_and_onnxruntime_web(static_space):
    front = (static_space / "README.md").read_text().split("---")[1]
    assert "sdk: static" in front and "app_file: index.html" in front
    described = json.loads((static_space / "model" / "model.json").read_text())
    assert described["labels"] == [str(digit) for digit in range(10)] and described["digit"] is True
    assert len(described["samples"]) == 10 and all((static_space / "samples" / name).is_file()
                                                   for name in described["samples"])
    assert described["graph"] == "pipeline_explain.onnx"  # the page's opening map, rollout beside it
    assert (static_space / "model" / "pipeline_explain.onnx").read_bytes() == \
        (MODEL_DIR / "pipeline_explain.onnx").read_bytes()
    assert not (static_space / "model" / "pipeline_map.onnx").exists()  # one graph: both maps come from it
    assert "`model/pipeline_explain.onnx` takes an image's pixels" in (static_space / "README.md").read_text()
    assert sorted(path.name for path in (static_space / "ort").iterdir()) == ["ort-wasm-simd-threaded.wasm",
                                                                             "ort.wasm.bundle.min.mjs"]


def test_its_download_compressed_is_under_10_mb(static_space):
    files = [path for path in static_space.rglob("*") if path.is_file() and path.name != ".vit-hub-space"]
    compressed = sum(len(gzip.compress(path.read_bytes(), 6)) for path in files)
    assert compressed < MAX_DOWNLOAD, compressed


def test_a_tarball_that_is_not_onnxruntime_web_is_refused(tmp_path):
    fake = tmp_path / "onnxruntime-web.tgz"
    fake.write_bytes(b"not the package")
    with pytest.raises(UserError, match=r"^--onnxruntime-web: expected onnxruntime-web .* got another file"):
        onnxruntime_web(fake)


def test_a_model_without_pipeline_onnx_names_the_export_command(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model / name).write_bytes((MODEL_DIR / name).read_bytes())
    with pytest.raises(FileNotFoundError, match="expected pipeline.onnx in .*python -m vit_hub.export --model"):
        write_static_space(model, tmp_path / "space", "me/digits", ORT_WEB)
    assert not (tmp_path / "space").exists()


def test_a_model_exported_without_the_map_graph_gets_a_page_of_probabilities(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "pipeline.onnx"):
        (model / name).write_bytes((MODEL_DIR / name).read_bytes())
    written = write_static_space(model, tmp_path / "space", "me/digits", ORT_WEB)
    assert json.loads((written.folder / "model" / "model.json").read_text())["graph"] == "pipeline.onnx"
    assert (written.folder / "model" / "pipeline.onnx").is_file()
    assert "`model/pipeline.onnx` takes an image's pixels" in (written.folder / "README.md").read_text()


def test_a_graph_too_large_for_a_page_is_refused_before_it_is_read(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model / name).write_bytes((MODEL_DIR / name).read_bytes())
    with open(model / "pipeline.onnx", "wb") as sparse:  # 2 GB on paper, nothing on disk
        sparse.truncate(2**31)
    with pytest.raises(UserError, match=r"^space --static: expected pipeline.onnx of at most 100 MB"):
        write_static_space(model, tmp_path / "space", "me/digits", ORT_WEB)


def test_the_cli_writes_it_and_says_what_it_wrote(tmp_path):
    done = subprocess.run([sys.executable, "-m", "vit_hub", "space", str(MODEL_DIR), "--repo-id", "me/digits", "--static",
                           "--dry-run", "--out", str(tmp_path / "space"), "--onnxruntime-web", str(ORT_WEB)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"wrote the static Space to {tmp_path / 'space'}: 19 files" in done.stdout
    assert f"running {MODEL_DIR}'s pipeline_explain.onnx in the browser" in done.stdout  # the graph it bundled
    assert (tmp_path / "space" / "index.html").is_file()


@pytest.mark.slow
def test_a_photo_models_page_offers_its_own_samples_and_no_drawing(split_image_folder, tmp_path):
    from conftest import train_tiny
    from vit_hub.export import export_onnx

    model = train_tiny(split_image_folder, tmp_path / "model")
    export_onnx(model, model, calib_data=str(split_image_folder))
    written = write_static_space(model, tmp_path / "space", "me/shapes", ORT_WEB, demo_url="https://example.org/demo")
    described = json.loads((written.folder / "model" / "model.json").read_text())
    kept = sorted(path.name for path in (model / "samples").glob("*.png"))
    assert described["digit"] is False and described["labels"] == ["bright_disc", "dark_square"]
    assert kept and described["samples"] == kept and described["demo_url"] == "https://example.org/demo"
    with pytest.raises(UserError, match="^--demo-url: expected an https:// address"):
        write_static_space(model, tmp_path / "other", "me/shapes", ORT_WEB, demo_url="javascript:alert(1)")


# In a real browser --------------------------------------------------------------------------------
def uploads(folder: Path) -> list[Path]:
    """What a visitor brings: a phone photo of a digit on paper, a transparent screenshot of a
    drawing, a scan in gray."""
    folder.mkdir(exist_ok=True)
    sample = sorted((ROOT / "vit_hub" / "bundled" / "samples").glob("*.png"))[1]
    photo = folder / "photo.jpg"
    digit_on_paper(sample).save(photo, quality=85)
    drawing = Image.new("RGBA", (800, 600), (0, 0, 0, 0))
    ImageDraw.Draw(drawing).line([(300, 150), (480, 150), (360, 480)], fill=(10, 10, 10, 255), width=14)  # a 7
    drawing.save(folder / "drawing.png")
    scan = folder / "scan.png"
    Image.open(sample).convert("L").resize((140, 140)).save(scan)
    return [photo, folder / "drawing.png", scan]


@pytest.mark.browser
def test_the_page_classifies_as_the_python_app_and_fetches_only_its_own_files(served, tmp_path):
    from playwright.sync_api import sync_playwright

    from docs.screenshots import CHROMIUM, CHROMIUM_ARGS

    samples = sorted((ROOT / "vit_hub" / "bundled" / "samples").glob("*.png"))
    files = uploads(tmp_path)
    classifier = OnnxClassifier(MODEL_DIR, providers="cpu")
    expected = [classifier.predict(load_image(open_image(path, path.name, UPLOAD_MAX_PIXELS)), top_k=1)[0][0]
                for path in [*samples, *files]]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page()
        fetched = []
        page.on("request", lambda request: fetched.append(request.url))
        page.goto(served)
        page.wait_for_selector("body[data-ready=true]", timeout=60_000)
        got = []
        for index, _ in enumerate(samples):
            page.locator("#samples img").nth(index).click()
            got.append(wait_for_label(page))
        for path in files:
            page.set_input_files("#file", str(path))
            got.append(wait_for_label(page))
        assert "WebAssembly" in page.inner_text("#backend") and page.locator("#pad").is_visible()
        browser.close()
    assert got == expected
    assert all(url.startswith(served) or url.startswith("blob:") for url in fetched), fetched


def page_map(page) -> tuple[np.ndarray, np.ndarray]:
    """(the map values, the overlay's pixels RGB) the page drew for its latest answer."""
    wait_for_label(page)
    values = np.array(json.loads(page.get_attribute("#map", "data-values")))
    drawn = page.evaluate("document.getElementById('map').toDataURL('image/png')")
    return values, np.asarray(Image.open(io.BytesIO(base64.b64decode(drawn.split(",", 1)[1]))).convert("RGB"))


def draw_a_seven(page) -> None:
    box = page.locator("#pad").bounding_box()
    points = [(70, 60), (210, 60), (120, 230)]
    page.mouse.move(box["x"] + points[0][0], box["y"] + points[0][1])
    page.mouse.down()
    for x, y in points[1:]:
        page.mouse.move(box["x"] + x, box["y"] + y, steps=12)
    page.mouse.up()
    page.click("#classify-drawing")


def choose_map(page, output: str) -> tuple[np.ndarray, np.ndarray]:
    """Choose the map `output` (map: the opening one, rollout) for the latest answer -> page_map's."""
    page.select_option("#map-choice", output)
    page.wait_for_function(f"document.getElementById('map').dataset.method {'!=' if output == 'map' else '=='} 'rollout'")
    values = np.array(json.loads(page.get_attribute("#map", "data-values")))
    drawn = page.evaluate("document.getElementById('map').toDataURL('image/png')")
    return values, np.asarray(Image.open(io.BytesIO(base64.b64decode(drawn.split(",", 1)[1]))).convert("RGB"))


@pytest.mark.browser
def test_the_page_draws_the_python_apps_map_on_samples_uploads_and_drawings(served, tmp_path):
    """The map the page opens with equals the Python page's opening map (integrated gradients +
    gradient rollout for the bundled model, computed inside pipeline_explain.onnx) within 1e-3
    (the export's tolerance) and its overlay is the app's, for a sample clicked, uploads and a
    drawing on the pad; the page names the method and the time it took; rollout, the quick
    choice, is the Python app's rollout."""
    from playwright.sync_api import sync_playwright

    from docs.screenshots import CHROMIUM, CHROMIUM_ARGS

    sample = sorted((ROOT / "vit_hub" / "bundled" / "samples").glob("*.png"))[2]
    shown = []  # (the upload as the Python app gets it, the page's map, its overlay)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page()
        page.goto(served)
        page.wait_for_selector("body[data-ready=true]", timeout=60_000)
        assert page.locator("#map").is_hidden() and "integrated gradients + gradient rollout" in page.inner_text("#maps")
        page.locator("#samples img").nth(2).click()
        shown.append((sample, *page_map(page)))
        method, took = page.get_attribute("#map", "data-method"), page.inner_text("#ms")
        rollout = choose_map(page, "rollout")
        choose_map(page, "map")
        for path in uploads(tmp_path)[1:]:  # the transparent drawing and the gray scan (PNG: one decoder's pixels)
            page.set_input_files("#file", str(path))
            shown.append((path, *page_map(page)))
        draw_a_seven(page)
        drawing = tmp_path / "pad.png"
        drawing.write_bytes(base64.b64decode(page.evaluate("document.getElementById('pad').toDataURL()").split(",")[1]))
        shown.append((drawing, *page_map(page)))
        blank = tmp_path / "blank.png"  # refused (no ink): no map, and another choice draws none
        Image.new("L", (300, 200), 230).save(blank)
        page.set_input_files("#file", str(blank))
        page.wait_for_selector("#status.error")
        page.select_option("#map-choice", "rollout")
        refused_hidden = page.locator("#map").is_hidden()
        browser.close()
    assert refused_hidden
    predictor = TorchPredictor.load(MODEL_DIR)
    for path, values, drawn in shown:
        expected_map, expected_overlay, expected_method = python_page_map(predictor, path)
        np.testing.assert_allclose(values, expected_map, atol=1e-3, err_msg=path.name)
        assert_same_overlay(drawn, expected_overlay)
    assert method == expected_method == "integrated_gradients_rollout" and took.endswith(" ms,")
    expected_map, expected_overlay = python_app_map(predictor, sample)
    np.testing.assert_allclose(rollout[0], expected_map, atol=1e-3)
    assert_same_overlay(rollout[1], expected_overlay)


@pytest.mark.browser
def test_a_model_exported_before_the_explain_graph_gets_rollout_from_the_map_graph(tmp_path):
    """A model dir with pipeline_map.onnx and no pipeline_explain.onnx: the page bundles
    pipeline_map.onnx and draws its rollout, named as such, with no choice to make."""
    from playwright.sync_api import sync_playwright

    from docs.screenshots import CHROMIUM, CHROMIUM_ARGS

    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "pipeline.onnx", "pipeline_map.onnx"):
        (model / name).write_bytes((MODEL_DIR / name).read_bytes())
    space = write_static_space(model, tmp_path / "space", "me/digits", ORT_WEB).folder
    assert json.loads((space / "model" / "model.json").read_text())["graph"] == "pipeline_map.onnx"
    server = serve(space)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{server.server_address[1]}/")
            page.wait_for_selector("body[data-ready=true]", timeout=60_000)
            assert "(attention rollout)" in page.inner_text("#maps") and page.locator("#map-chooser").is_hidden()
            page.locator("#samples img").nth(2).click()
            values, drawn = page_map(page)
            method = page.get_attribute("#map", "data-method")
            browser.close()
    finally:
        server.shutdown()
    sample = sorted((ROOT / "vit_hub" / "bundled" / "samples").glob("*.png"))[2]
    expected_map, expected_overlay = python_app_map(TorchPredictor.load(MODEL_DIR), sample)
    assert method == "rollout"
    np.testing.assert_allclose(values, expected_map, atol=1e-3)
    assert_same_overlay(drawn, expected_overlay)


@pytest.mark.slow
@pytest.mark.browser
def test_a_photo_models_page_draws_the_python_apps_map_over_the_upload(split_image_folder, tmp_path):
    """An RGB photo model: the map over the upload itself (no canonicalisation), in colour; a
    photo over the display size is shrunk first, its map still the app's."""
    from playwright.sync_api import sync_playwright

    from conftest import train_tiny
    from docs.screenshots import CHROMIUM, CHROMIUM_ARGS
    from vit_hub.export import export_onnx

    model = train_tiny(split_image_folder, tmp_path / "model")
    export_onnx(model, model, calib_data=str(split_image_folder), output_attentions=True)
    space = write_static_space(model, tmp_path / "space", "me/shapes", ORT_WEB).folder
    source = Image.open(sorted((split_image_folder / "test").rglob("*.png"))[0]).convert("RGB")
    photos = [tmp_path / "photo.png", tmp_path / "large.png"]
    source.resize((300, 200), Image.Resampling.BICUBIC).save(photos[0])
    source.resize((1500, 1000), Image.Resampling.BICUBIC).save(photos[1])
    server = serve(space)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{server.server_address[1]}/")
            page.wait_for_selector("body[data-ready=true]", timeout=60_000)
            shown = []
            for path in photos:
                page.set_input_files("#file", str(path))
                shown.append(page_map(page))
            browser.close()
    finally:
        server.shutdown()
    predictor = TorchPredictor.load(model)
    for path, (values, drawn) in zip(photos, shown):
        expected_map, expected_overlay, _ = python_page_map(predictor, path)
        np.testing.assert_allclose(values, expected_map, atol=1e-3, err_msg=path.name)
        assert drawn.shape == expected_overlay.shape
    assert_same_overlay(shown[0][1], python_page_map(predictor, photos[0])[1])


# The overlay's drawing (static_page/overlay.mjs) on crafted inputs, in Node against the app's Python ----------
OVERLAY_MJS = ROOT / "vit_hub" / "hub" / "static_page" / "overlay.mjs"
# Reads {sizes, shown, overlays} as JSON on stdin; prints what overlay.mjs gives for each.
DRAW_IN_NODE = """
import { readFileSync } from "node:fs";
const { displaySize, forDisplay, overlay } = await import(process.argv[1]);
const asked = JSON.parse(readFileSync(0, "utf8"));
const shown = asked.shown.map(({ pixels, height, width, channels, gray }) => {
  const drawn = forDisplay(Uint8Array.from(pixels), height, width, channels, gray);
  return { rgb: Array.from(drawn.rgb), width: drawn.width, height: drawn.height };
});
const overlays = asked.overlays.map(({ rgb, width, height, map, gridH, gridW, colours }) =>
  Array.from(overlay({ rgb: Float32Array.from(rgb), width, height }, Float32Array.from(map), gridH, gridW,
                     Uint8Array.from(colours))));
const sizes = asked.sizes.map(([width, height]) => displaySize(width, height));
console.log(JSON.stringify({ sizes, shown, overlays }));
"""


def draw_in_node(sizes=(), shown=(), overlays=()) -> dict:
    """overlay.mjs run by Node on the cases given -> {sizes: [[w, h]], shown: [{rgb, width, height}],
    overlays: [[r, g, b, ...]]}."""
    done = subprocess.run(["node", "--input-type=module", "-e", DRAW_IN_NODE, OVERLAY_MJS.as_uri()],
                          input=json.dumps({"sizes": list(sizes), "shown": list(shown), "overlays": list(overlays)}),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_the_overlay_has_the_apps_display_size_rounded_as_the_app_rounds():
    """displaySize is pictures.display_size: a small image enlarged by the whole factor rounded up
    (30 px: 10x, not 9x), a large one shrunk with sides rounded to nearest (684.7 -> 685) and a
    half to even, as Python's round (2048x1025 -> 1024x512)."""
    from vit_hub.demo.pictures import display_size

    sizes = [(28, 28), (30, 17), (17, 30), (279, 100), (280, 5), (1024, 700), (1500, 1003), (1003, 1500),
             (2048, 1025), (1025, 2048), (3000, 2)]
    assert draw_in_node(sizes=sizes)["sizes"] == [list(display_size(*size)) for size in sizes]


def python_shown(pixels: np.ndarray, gray: bool) -> np.ndarray:
    """What the app shows of decoded pixels [h, w, channels]: in the model's mode (alpha over
    white), at its display size -> RGB [H, W, 3]."""
    from vit_hub.demo.pictures import for_display
    from vit_hub.processing.preprocess import to_model_mode

    image = Image.fromarray(pixels[..., 0] if pixels.shape[2] == 1 else pixels)
    return np.asarray(for_display(to_model_mode(image, 1 if gray else 3)).convert("RGB"))


@pytest.mark.parametrize("channels", [1, 2, 3, 4], ids=["gray", "gray+alpha", "rgb", "rgb+alpha"])
@pytest.mark.parametrize("gray", [True, False], ids=["digit-model", "rgb-model"])
def test_the_image_under_the_overlay_is_the_apps_for_every_channel_count(channels, gray):
    """forDisplay shows decoded pixels as the app does: a gray+alpha or RGBA image over white (its
    alpha from 0 to 255 kept, not dropped), in gray for a gray model, enlarged to its display size."""
    rng = np.random.default_rng(channels)
    pixels = rng.integers(0, 256, (3, 5, channels), dtype=np.uint8)
    if channels in (2, 4):
        pixels[..., -1] = np.array([0, 1, 100, 200, 254, 255, 30, 128, 250, 7, 255, 64, 180, 90, 3]).reshape(3, 5)
    (drawn,) = draw_in_node(shown=[{"pixels": pixels.ravel().tolist(), "height": 3, "width": 5,
                                    "channels": channels, "gray": gray}])["shown"]
    expected = python_shown(pixels, gray)
    assert (drawn["height"], drawn["width"]) == expected.shape[:2] == (168, 280)
    np.testing.assert_array_equal(np.array(drawn["rgb"]).reshape(expected.shape), expected)


def test_a_map_value_halfway_between_two_colours_takes_the_apps_even_one():
    """A map value whose 255 x v is k + 0.5 is coloured as numpy's round does (to the even k), not
    half up (k + 1): the overlay equals the app's pixel for pixel."""
    from vit_hub.explain.rollout import DEFAULT_COLOURMAP, colour_table, overlay

    k = 100
    value = np.float32((k + 0.5) / 255)
    assert value * np.float32(255) == k + 0.5  # a tie in float32, as both paths compute it
    colours = colour_table(DEFAULT_COLOURMAP)
    assert (colours[k] // 2 != colours[k + 1] // 2).any()  # the two colours differ once blended over black
    black = Image.new("RGB", (3, 2))
    (drawn,) = draw_in_node(overlays=[{"rgb": [0] * 18, "width": 3, "height": 2, "map": [float(value)], "gridH": 1,
                                       "gridW": 1, "colours": colours.ravel().tolist()}])["overlays"]
    expected = np.asarray(overlay(black, np.array([[value]])))
    np.testing.assert_array_equal(np.array(drawn).reshape(2, 3, 3), expected)
    np.testing.assert_array_equal(expected[0, 0], colours[k] // 2)

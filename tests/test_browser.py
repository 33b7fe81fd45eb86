"""The app in a real headless browser: Debian's chromium driven by PyPI playwright.

Never `playwright install` (it downloads a browser); CI installs Debian's `chromium`.
The pages are captured as docs/screenshots.py captures the README's pictures (`make
screenshots`), into the test's tmp folder, so a CI run leaves the tree clean.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import digit_on_paper, free_port

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from docs.screenshots import CHROMIUM, MODEL_DIR, SAMPLE, classify_and_capture, inside_and_capture, open_page
from vit_hub.demo.backends import TorchPredictor
from vit_hub.demo.page import build_demo, serve

pytestmark = pytest.mark.browser  # make test installs chromium; make test-fast leaves these out


@pytest.fixture(scope="module")
def url():
    assert CHROMIUM.exists(), "needs Debian chromium (make test installs it: apt-get install -y chromium)"
    assert (MODEL_DIR / "model.safetensors").is_file(), f"the bundled model {MODEL_DIR} is missing"
    demo = build_demo(TorchPredictor.load(MODEL_DIR, threads=None))
    _, local_url, _ = serve(demo, port=free_port(), prevent_thread_lock=True, quiet=True)
    yield local_url
    demo.close()


@pytest.fixture
def page(url):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser, page = open_page(playwright, url)
        try:
            yield page
        finally:
            browser.close()


def test_upload_classify_and_screenshot(page, tmp_path):
    photo = tmp_path / "photo_of_a_7.jpg"  # what a person uploads: a phone photo of paper
    digit_on_paper(SAMPLE).save(photo, quality=80)
    screenshot = tmp_path / "app.png"
    assert classify_and_capture(page, photo, screenshot) == "7"
    assert screenshot.stat().st_size > 10_000


def test_the_head_grid_is_not_covered_by_its_label(page, tmp_path):
    """The per-head grid's first row (layer 1) shows below the label that floats over the
    picture, not under it."""
    classify_and_capture(page, SAMPLE, tmp_path / "app.png")
    label = page.locator("#head-maps label").first.bounding_box()
    picture_top = page.locator("#head-maps img").evaluate(  # where the picture's content starts
        "image => image.getBoundingClientRect().top + parseFloat(getComputedStyle(image).paddingTop)")
    assert picture_top >= label["y"] + label["height"], (label, picture_top)


def test_inside_the_model_tab_shows_the_three_views(page, tmp_path):
    """Computed at start-up from the weights and the bundled samples, each view with its reading."""
    from playwright.sync_api import expect

    screenshot = tmp_path / "inside.png"
    inside_and_capture(page, screenshot)
    expect(page.get_by_text("principal components explain")).to_be_visible()
    expect(page.get_by_text("Layer 1's heads attend")).to_be_visible()
    assert screenshot.stat().st_size > 10_000


def test_a_stroke_drawn_with_the_mouse_is_a_one(page):
    """The sketchpad path end to end: the browser's own payload, inversion and centring."""
    from playwright.sync_api import expect

    page.get_by_role("tab", name="Draw").click()
    canvas = page.locator("#drawing canvas").first
    expect(canvas).to_be_visible(timeout=30_000)
    page.get_by_role("button", name="Brush").click()
    box = canvas.bounding_box()
    x, top, height = box["x"] + box["width"] / 2, box["y"], box["height"]
    page.mouse.move(x, top + 0.2 * height)
    page.mouse.down()
    for step in range(1, 21):  # a vertical stroke through the middle, in small moves
        page.mouse.move(x, top + (0.2 + 0.03 * step) * height)
    page.mouse.up()
    page.get_by_role("button", name="Classify drawing").click()
    expect(page.get_by_test_id("label-output-value")).to_have_text("1", timeout=60_000)


@pytest.mark.parametrize("brush_size", [2, 40])
def test_a_seven_drawn_with_a_thin_or_a_thick_brush_is_a_seven(page, brush_size):
    """The brush size slider set as a person would: a hairline (2 px of the 400 px canvas)
    and a marker (40 px) both reach the model as MNIST-width strokes."""
    from playwright.sync_api import expect

    page.get_by_role("tab", name="Draw").click()
    canvas = page.locator("#drawing canvas").first
    expect(canvas).to_be_visible(timeout=30_000)
    page.get_by_role("button", name="Brush", exact=True).click()
    page.get_by_role("button", name="Brush Size").click()
    page.locator("#drawing input[type=range]").fill(str(brush_size))
    box = canvas.bounding_box()
    corners = [(0.3, 0.25), (0.7, 0.25), (0.45, 0.8)]  # a seven: the bar, then down to the left
    points = [(box["x"] + x * box["width"], box["y"] + y * box["height"]) for x, y in corners]
    page.mouse.move(*points[0])
    page.mouse.down()
    for start, end in zip(points, points[1:]):
        for step in range(1, 16):  # in small moves, as a hand drags
            page.mouse.move(start[0] + (end[0] - start[0]) * step / 15, start[1] + (end[1] - start[1]) * step / 15)
    page.mouse.up()
    page.get_by_role("button", name="Classify drawing").click()
    expect(page.get_by_test_id("label-output-value")).to_have_text("7", timeout=60_000)


def test_a_bundled_sample_clicked_on_the_page_is_classified(page):
    """Examples reach /predict from Gradio's upload folder, the only place the app reads from."""
    from playwright.sync_api import expect

    sample = page.locator("button.gallery-item", has=page.locator("img[src*='mnist_test_0001_label_2']"))
    sample.click()
    expect(page.locator("#upload img")).to_be_visible(timeout=30_000)
    page.get_by_role("button", name="Classify", exact=True).click()
    expect(page.get_by_test_id("label-output-value")).to_have_text("2", timeout=60_000)

"""The app's uploads are untrusted.

Every image a request sends (/predict and /predict_labels' upload, /explain_drawing's
composite, layers and background) is checked against uploads.APP_MAX_PIXELS from its header
before anything decodes it, so a few hundred kilobytes of PNG cannot make the server decode
64 megapixels; the requests in flight are at most page.CONCURRENCY_LIMIT, so a burst of hostile
requests keeps memory bounded, and memory comes back after it. Hostile images are written row
by row (kilobytes on disk).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image, ImageDraw

from bench.app_limits import blank_png, digit_rgba
from conftest import BUNDLED_MODEL, assert_one_line, call, file_data, free_port, upload

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

from vit_hub.demo import uploads  # noqa: E402
from vit_hub.errors import UserError  # noqa: E402
from vit_hub.processing.preprocess import MAX_PIXELS, open_image, pixel_limit  # noqa: E402

SAMPLE = ROOT / "vit_hub" / "bundled" / "samples" / "mnist_test_0000_label_7.png"
CONTROLS = ("mean", 0.0, 3, "rollout")  # head fusion, discard ratio, top-k, method


def uploaded(url: str, path: Path) -> dict:
    """Upload a file as the page does; returns the file data a request sends for it."""
    return file_data(upload(url, path), orig_name=path.name)


def assert_refused(url: str, event: str, data, *fragments: str) -> None:
    assert event == "error", data
    assert_one_line(data["error"], *fragments)
    event, data = call(url, "predict", [uploaded(url, SAMPLE), *CONTROLS])  # still serving
    assert event == "complete" and data[0]["label"] == "7", data


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hostile_uploads")
    return {"13000x13000 composite": blank_png(folder / "composite.png", 13_000, 13_000),  # a 118 KB PNG
            "20 megapixels": blank_png(folder / "twenty.png", 5_000, 4_000),  # under training's 64, over the app's 16
            "64 megapixel RGBA": blank_png(folder / "rgba.png", 8_000, 8_000, "RGBA")}


@pytest.mark.parametrize("part", ["composite", "layers", "background"])
def test_each_part_of_a_drawing_is_checked_before_gradio_decodes_it(server, hostile, part):
    """Gradio decodes the sketchpad's images before the handler runs: a 13000x13000 composite
    cost +760 MB a request. Now each is refused from its header, by the app's limit."""
    fine, huge = uploaded(server, SAMPLE), uploaded(server, hostile["13000x13000 composite"])
    drawing = {"background": fine, "layers": [fine], "composite": fine}
    drawing[part] = [huge] if part == "layers" else huge
    event, data = call(server, "explain_drawing", [drawing, *CONTROLS])
    assert_refused(server, event, data, f"the drawing is too large: expected {pixel_limit(uploads.APP_MAX_PIXELS)}",
                   "found 13000x13000")


@pytest.mark.parametrize("endpoint", ["predict", "predict_labels", "explain"])
def test_uploads_over_the_apps_limit_are_refused_from_the_header(server, hostile, endpoint):
    controls = (3,) if endpoint == "predict_labels" else CONTROLS
    event, data = call(server, endpoint, [uploaded(server, hostile["20 megapixels"]), *controls])
    assert uploads.APP_MAX_PIXELS < 20_000_000 < MAX_PIXELS
    assert_refused(server, event, data, f"twenty.png is too large: expected {pixel_limit(uploads.APP_MAX_PIXELS)}",
                   "found 5000x4000")


def test_a_phone_photo_jpeg_over_the_limit_is_read_smaller_not_refused(server, tmp_path):
    """A 24 MP JPEG (a recent phone's default) is decoded at half its size, from the JPEG's own
    reduced scale, and read; the same size as a PNG is still refused (test above)."""
    photo = Image.new("L", (6_000, 4_000), 225)
    ImageDraw.Draw(photo).line([(2_500, 900), (3_500, 900), (2_850, 3_100)], fill=35, width=70)  # a 7
    photo.save(tmp_path / "phone.jpg", quality=85)
    assert uploads.APP_MAX_PIXELS < 24_000_000
    assert open_image(tmp_path / "phone.jpg", max_pixels=uploads.APP_MAX_PIXELS).size == (3_000, 2_000)
    assert open_image(tmp_path / "phone.jpg", max_pixels=1_000_000).size == (750, 500)  # 1/8
    with pytest.raises(UserError, match="phone.jpg is too large: expected at most 0.2 megapixels, found 6000x4000"):
        open_image(tmp_path / "phone.jpg", max_pixels=200_000)  # even 1/8 is 375,000 pixels
    event, data = call(server, "predict", [uploaded(server, tmp_path / "phone.jpg"), *CONTROLS])
    assert event == "complete" and data[0]["label"] == "7", data


def test_the_sketchpads_blobs_are_checked_too(hostile):
    """The page sends its drawing as blobs (accept_blobs), which Gradio decodes from bytes."""
    sketchpad = uploads.checked_sketchpad(type="pil", image_mode="RGB")
    with pytest.raises(gr.Error) as error:
        sketchpad.convert_and_format_image(hostile["13000x13000 composite"].read_bytes(), flatten_on_white=True)
    assert_one_line(error.value.message, "the drawing is too large")
    drawn = sketchpad.convert_and_format_image(SAMPLE.read_bytes(), flatten_on_white=True)
    assert isinstance(drawn, Image.Image) and drawn.size == (28, 28)


def test_the_page_states_the_limit(server):
    page = httpx.get(f"{server}config", timeout=60).text
    assert f"Images of {pixel_limit(uploads.APP_MAX_PIXELS)} (a larger JPEG photo is read scaled down), files of at most" in page


# A burst against a server in its own process ------------------------------------------------
SERVE = """
import sys, torch
sys.path.insert(0, {root!r})
from vit_hub.demo import backends, page
demo = page.build_demo(backends.TorchPredictor.load({model!r}))
page.serve(demo, port={port}, quiet=True, prevent_thread_lock=True)
print("ready", flush=True)
sys.stdin.read()  # until the test closes it
"""


@contextlib.contextmanager
def app_in_its_own_process(**env: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """(the server process, its URL): the bundled model's app started by SERVE, one OpenMP
    thread, `env` added; stopped afterwards whatever happens."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRADIO_ANALYTICS_ENABLED": "False", **env}
    server = subprocess.Popen([sys.executable, "-c", SERVE.format(root=str(ROOT), model=str(BUNDLED_MODEL), port=port)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert server.stdout.readline().strip() == "ready"
        yield server, f"http://127.0.0.1:{port}/"
    finally:
        server.stdin.close()
        server.terminate()
        server.wait(timeout=60)


def rss_mb(pid: int) -> tuple[int, int]:
    """(resident now, peak resident) of a process, in MB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return tuple(int(re.search(rf"^{key}:\s+(\d+) kB", status, re.MULTILINE).group(1)) // 1024
                 for key in ("VmRSS", "VmHWM"))


@pytest.mark.slow
def test_100_hostile_requests_50_at_a_time_keep_memory_bounded_and_give_it_back(hostile, tmp_path):
    """100 requests of a 264 KB 64 MP RGBA PNG, 50 at a time, once passed 4 GB in 25 s
    and 3.5 GB stayed in use. Here, with drawings of 13000x13000 and images the app accepts
    (16 MP RGBA, the most one request may decode) among them."""
    with app_in_its_own_process() as (server, url):
        largest_accepted = digit_rgba(tmp_path / "accepted.png", int(uploads.APP_MAX_PIXELS ** 0.5))
        assert call(url, "predict", [uploaded(url, largest_accepted), *CONTROLS])[0] == "complete"  # warm
        start, _ = rss_mb(server.pid)

        def request(index: int) -> str:
            if index % 10 == 0:  # 10 images as large as the app accepts
                return call(url, "predict", [uploaded(url, largest_accepted), *CONTROLS])[0]
            if index % 2:  # 45 of those 64 MP RGBA PNGs
                return call(url, "predict", [uploaded(url, hostile["64 megapixel RGBA"]), *CONTROLS])[0]
            huge = uploaded(url, hostile["13000x13000 composite"])  # 45 drawings of 169 MP
            return call(url, "explain_drawing", [{"background": None, "layers": [], "composite": huge}, *CONTROLS])[0]

        with concurrent.futures.ThreadPoolExecutor(50) as pool:
            events = list(pool.map(request, range(100)))
        after, peak = rss_mb(server.pid)
    assert events.count("complete") == 10 and events.count("error") == 90
    # At most CONCURRENCY_LIMIT requests decode at once, each at most APP_MAX_PIXELS (~244 MB for RGBA).
    assert peak - start < 1500, (start, peak, after)
    assert after - start < 200, (start, peak, after)

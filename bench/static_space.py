"""The static Space in a real browser: what it downloads, how soon it answers, how long an image
takes in WebAssembly, and whether it labels real uploads as the Python app does.

    python bench/static_space.py --model models/vit-mnist --onnxruntime-web .venv/cache/onnxruntime-web-1.30.0.tgz \\
        [--dev ../shared/realdigits-dev]

Writes the static Space of --model into a temporary folder (`vit-hub space --static`), serves it
with a plain static server on 127.0.0.1, opens it in Debian's headless chromium (one page load,
cold cache), and prints: the bytes the page fetched (as stored, and gzip-compressed as a static
host serves them), the seconds from navigation to the model being ready and to the first
answer (a sample clicked), the median milliseconds per image the page reports (its own timer
around session.run, decoding excluded) over --rounds passes of the samples, and with --dev the
labels of every dev upload against the Python app's (OnnxClassifier on the upload as the app
reads it) and, where the page draws a map, the largest |page map - Python page's map| (the map
the Python page opens with, `vit_hub.explain.run.explain` with the torch model).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import http.server
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.real_uploads import dev_images  # noqa: E402
from docs.screenshots import CHROMIUM, CHROMIUM_ARGS  # noqa: E402
from vit_hub.export import OnnxClassifier  # noqa: E402
from vit_hub.export.pipeline_check import check_pipeline  # noqa: E402
from vit_hub.hub.static_space import write_static_space  # noqa: E402
from vit_hub.processing.preprocess import UPLOAD_MAX_PIXELS, load_image, open_image  # noqa: E402


class StaticFiles(http.server.SimpleHTTPRequestHandler):
    """A plain static file server, as a static Space host is one, without its log lines."""

    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".mjs": "text/javascript",
                      ".js": "text/javascript", ".wasm": "application/wasm"}

    def log_message(self, *args):
        pass


def serve(folder: Path) -> http.server.ThreadingHTTPServer:
    """`folder` on 127.0.0.1, a free port, in a thread; `server.server_address[1]` is the port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(StaticFiles, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def wait_for_label(page) -> str:
    """The top label the page shows for the image just given (it marks each new answer fresh)."""
    page.wait_for_function("document.getElementById('status').dataset.fresh === 'true'", timeout=60_000)
    label = page.get_attribute("#status", "data-label")
    page.evaluate("document.getElementById('status').dataset.fresh = 'false'")
    return label


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--onnxruntime-web", help="npm pack's tarball (default: npm's registry, cached)")
    parser.add_argument("--dev", help="real digit uploads in bench/real_uploads.py's layout")
    parser.add_argument("--rounds", type=int, default=1, help="passes over the samples for the time per image")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as folder:
        space = Path(folder) / "space"
        write_static_space(args.model, space, "bench/static", args.onnxruntime_web, check_pipeline=check_pipeline)
        server = serve(space)
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page()
            fetched = []
            page.on("requestfinished", lambda request: fetched.append(request.url))
            start = time.perf_counter()
            page.goto(url)
            page.wait_for_selector("body[data-ready=true]", timeout=120_000)
            ready = time.perf_counter() - start
            page.locator("#samples img").first.click()
            wait_for_label(page)
            first = time.perf_counter() - start
            spent = []
            for _ in range(args.rounds):
                for index in range(page.locator("#samples img").count()):
                    page.locator("#samples img").nth(index).click()
                    wait_for_label(page)
                    spent.append(float(page.get_attribute("#ms", "data-ms")))
            stored = [space / u.removeprefix(url) for u in fetched if u.startswith(url) and u != url]
            raw = sum(path.stat().st_size for path in stored if path.is_file()) + (space / "index.html").stat().st_size
            packed = sum(len(gzip.compress(path.read_bytes(), 6)) for path in stored if path.is_file())
            print(f"fetched {len(stored) + 1} files: {raw / 1e6:.1f} MB as stored, {packed / 1e6:.1f} MB gzip-compressed")
            drawn = page.get_attribute("#map", "data-method")
            print(f"ready after {ready:.2f} s, first answer after {first:.2f} s; per image (samples) median "
                  f"{statistics.median(spent):.0f} ms ({len(spent)} runs; {drawn or 'no'} map), {page.inner_text('#backend')}")
            if args.dev:
                compare_dev(page, Path(args.model), Path(args.dev))
            browser.close()
        server.shutdown()


def compare_dev(page, model: Path, dev: Path) -> None:
    classifier = OnnxClassifier(model, providers="cpu")
    same = right = 0
    worst = []  # |page map - Python page's map| per upload, where the page draws one
    images = dev_images(dev)
    for image in images:
        upload = load_image(open_image(image.path, image.path.name, UPLOAD_MAX_PIXELS))
        expected = classifier.predict(upload, top_k=1)[0][0]
        page.set_input_files("#file", str(image.path))
        got = wait_for_label(page)
        same += got == expected
        right += got == image.label
        if got != expected:
            print(f"differs on {image.name}: page {got}, Python app {expected}")
        method = page.get_attribute("#map", "data-method")
        if method:
            values = np.array(json.loads(page.get_attribute("#map", "data-values")))
            worst.append(float(np.abs(values - python_page_map(model, upload, method)).max()))
            if worst[-1] > 1e-3:  # the browser decodes the file itself: a JPEG's pixels may differ by a level or more
                print(f"map differs on {image.name} ({image.path.suffix}): {worst[-1]:.1e}")
    print(f"dev uploads: the page's label equals the Python app's on {same}/{len(images)}, right on {right}/{len(images)}")
    if worst:
        print(f"dev uploads: the page's map ({method}) within {max(worst):.1e} of the Python page's on {len(worst)} "
              f"uploads ({sum(diff <= 1e-3 for diff in worst)} within 1e-3)")


@functools.cache
def _torch_model(model: Path):
    from vit_hub.hub.pretrained import load_model

    return load_model(model).eval()


def python_page_map(model: Path, upload, method: str) -> np.ndarray:
    """The Python page's `method` map [grid_h, grid_w] of an upload as the app reads it."""
    from vit_hub.explain.run import explain
    from vit_hub.processing.preprocess import model_pixels, to_model_domain

    network = _torch_model(model)
    return explain(network, model_pixels(to_model_domain(upload, network.config), network.config)[None], method).maps[0]


if __name__ == "__main__":
    main()

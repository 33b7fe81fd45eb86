"""Take the README's pictures of the app from the live app: docs/app_screenshot.png (the
Classify tab after an upload is classified) and docs/app_inside.png (the Inside the model tab),
in Debian's chromium, headless, driven by playwright.

    python docs/screenshots.py                     # the bundled model and a bundled digit
    python docs/screenshots.py --model runs/mine --image photo.jpg --out /tmp/shots

`make screenshots` runs it after installing chromium (`make browser`). Never `playwright
install`: it downloads a browser.
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from vit_hub.demo.backends import TorchPredictor  # noqa: E402
from vit_hub.demo.page import build_demo, serve  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
]
VIEWPORT = {"width": 1280, "height": 860}
MODEL_DIR = ROOT / "models" / "vit-mnist"
SAMPLE = ROOT / "vit_hub" / "bundled" / "samples" / "mnist_test_0000_label_7.png"
CLASSIFY_FILE, INSIDE_FILE = "app_screenshot.png", "app_inside.png"
OUTPUTS = ("#rollout img", "#layer-strip img", "#model-input img", "#head-maps img")
INSIDE_VIEWS = ("#inside-patch-filters img", "#inside-position-similarity img", "#inside-attention-distance img")
WAIT_MS = 60_000


def classify_and_capture(page, image: Path, path: Path) -> str:
    """Upload `image` on the Classify tab, classify it, wait for every picture of the answer and
    save the whole page to `path`; returns the predicted label."""
    from playwright.sync_api import expect

    page.locator("#upload input[type=file]").set_input_files(str(image))
    expect(page.locator("#upload img")).to_be_visible(timeout=WAIT_MS)
    page.get_by_role("button", name="Classify", exact=True).click()
    for output in OUTPUTS:
        expect(page.locator(output)).to_be_visible(timeout=WAIT_MS)
    label = page.get_by_test_id("label-output-value")
    expect(label).not_to_be_empty(timeout=WAIT_MS)
    page.screenshot(path=str(path), full_page=True)
    return label.inner_text()


def inside_and_capture(page, path: Path) -> None:
    """Open the Inside the model tab, wait for its three views and save the whole page to `path`."""
    from playwright.sync_api import expect

    page.get_by_role("tab", name="Inside the model").click()
    for view in INSIDE_VIEWS:
        expect(page.locator(view)).to_be_visible(timeout=WAIT_MS)
    page.screenshot(path=str(path), full_page=True)


def open_page(playwright, url: str):
    """(browser, page): Debian's chromium, headless, on `url`."""
    if not CHROMIUM.exists():
        raise SystemExit(f"screenshots: expected Debian's chromium at {CHROMIUM}, found none; `make browser` "
                         f"installs it")
    browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
    page = browser.new_page(viewport=VIEWPORT)
    page.goto(url, wait_until="domcontentloaded")
    return browser, page


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser(description="Take the README's pictures of the app from the live app.")
    parser.add_argument("--model", type=Path, default=MODEL_DIR, help="model dir to serve (default: %(default)s)")
    parser.add_argument("--image", type=Path, default=SAMPLE, help="image to classify (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="folder to write the pictures to "
                        f"({CLASSIFY_FILE}, {INSIDE_FILE}; default: %(default)s)")
    args = parser.parse_args(argv)
    demo = build_demo(TorchPredictor.load(args.model, threads=None))
    _, url, _ = serve(demo, port=_free_port(), prevent_thread_lock=True, quiet=True)
    try:
        with sync_playwright() as playwright:
            browser, page = open_page(playwright, url)
            try:
                label = classify_and_capture(page, args.image, args.out / CLASSIFY_FILE)
                inside_and_capture(page, args.out / INSIDE_FILE)
            finally:
                browser.close()
    finally:
        demo.close()
    print(f"wrote {args.out / CLASSIFY_FILE} (classified as {label}) and {args.out / INSIDE_FILE}")


if __name__ == "__main__":
    main()

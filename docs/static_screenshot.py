"""Take the README's picture of the static Space: docs/static_space_map.png, the page in Debian's
chromium (headless, driven by playwright) after it classified an image and drew the map over it.

    python docs/static_screenshot.py --onnxruntime-web .venv/cache/onnxruntime-web-1.30.0.tgz
    python docs/static_screenshot.py --model runs/mine --image photo.jpg --out /tmp/shot.png ...

`make screenshots` runs it after docs/screenshots.py.

Writes the static Space of --model (`vit-hub space --static`) into a temporary folder, serves it
on 127.0.0.1 (bench/static_space.py's plain static server) and uploads --image.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.static_space import serve, wait_for_label  # noqa: E402
from docs.screenshots import MODEL_DIR, SAMPLE, open_page  # noqa: E402
from vit_hub.hub.static_space import write_static_space  # noqa: E402

PICTURE = ROOT / "docs" / "static_space_map.png"
VIEWPORT = {"width": 1000, "height": 720}


def main(argv: list[str] | None = None) -> None:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=MODEL_DIR, help="model dir (default: %(default)s)")
    parser.add_argument("--image", type=Path, default=SAMPLE, help="image to upload (default: %(default)s)")
    parser.add_argument("--onnxruntime-web", help="npm pack's tarball (default: npm's registry, cached)")
    parser.add_argument("--out", type=Path, default=PICTURE, help="the PNG to write (default: %(default)s)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        space = write_static_space(args.model, Path(folder) / "space", "vit-hub/digits", args.onnxruntime_web).folder
        server = serve(space)
        try:
            with sync_playwright() as playwright:
                browser, page = open_page(playwright, f"http://127.0.0.1:{server.server_address[1]}/")
                page.set_viewport_size(VIEWPORT)
                page.wait_for_selector("body[data-ready=true]", timeout=60_000)
                page.set_input_files("#file", str(args.image))
                label = wait_for_label(page)
                page.screenshot(path=str(args.out), full_page=True)
                browser.close()
        finally:
            server.shutdown()
    print(f"wrote {args.out} (classified as {label})")


if __name__ == "__main__":
    main()

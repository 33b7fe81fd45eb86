"""Digits as people upload them, scored through the live app's `/predict` endpoint.

    python bench/digit_uploads.py --model models/vit-mnist [--backend torch|onnx] [--out DIR]
                                  [--json FILE] [--verbose] [--seed 0] [--code DIR]

Two held-aside groups of 30 images (3 per digit), generated offline and deterministically:
  photo  handwriting from the bundled MNIST *test* digits, as a phone photo of dark ink on
         paper: digits 100-250 px tall, anywhere on a 300x400 sheet, uneven light (gradient
         and vignette), paper grain, a small rotation, slight blur, JPEG quality 70-80;
  typed  black digits on white 200x200, DejaVu faces at 60-150 px, anywhere in the frame.
The true label is in every file name (`photo_07_label_3.jpg`). The app is started in this
process (`vit_hub.demo.page.build_demo` + `serve` on a free port) and every file goes through
`gradio_client` exactly as a browser upload would. Prints right/total per group.

`--code DIR` serves with the app.py and vit_hub of another checkout (e.g. a git worktree of
an older commit), to measure the same uploads against the code as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import socket
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

if TYPE_CHECKING:
    from gradio_client import Client

ROOT = Path(__file__).resolve().parents[1]
GROUPS = ("photo", "typed")
PER_DIGIT = 3  # 30 images per group
FONT_DIR = Path("/usr/share/fonts/truetype/dejavu")
FONTS = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf",
         "DejaVuSansMono.ttf", "DejaVuSansCondensed.ttf", "DejaVuSans-Oblique.ttf")
LABEL_PATTERN = re.compile(r"_label_(\d)\.")


# Generation --------------------------------------------------------------------------------
def mnist_test_digits(seed: int) -> list[tuple[Image.Image, int]]:
    """PER_DIGIT handwritten digits of each class from the bundled MNIST test split, seeded."""
    from vit_hub.data.sources import load_splits

    test = load_splits("mnist", val_split=0.0).test
    labels = np.asarray(test.targets)
    order = np.random.default_rng(seed).permutation(len(labels))
    picks = [index for digit in range(10) for index in order[labels[order] == digit][:PER_DIGIT]]
    return [(test[int(index)][0], int(labels[index])) for index in picks]


def lighting_field(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Uneven light over a sheet: a linear falloff in a random direction times a vignette."""
    rows, cols = np.mgrid[0:height, 0:width].astype(np.float32)
    rows, cols = rows / height - 0.5, cols / width - 0.5
    direction = rng.uniform(0, 2 * np.pi)
    falloff = rng.uniform(0.2, 0.45) * (cols * np.cos(direction) + rows * np.sin(direction) + 0.5)
    vignette = rng.uniform(0.1, 0.3) * (rows**2 + cols**2) * 2
    return 1.0 - falloff - vignette


def ink_strokes(digit: Image.Image, side: int, angle: float) -> np.ndarray:
    """A 28x28 MNIST digit (light on black) -> pen-sharp ink coverage in [0, 1]: the digit's
    longer side is `side` px before a rotation of `angle` degrees."""
    digit = digit.convert("L")
    digit = digit.crop(digit.getbbox())
    scale = side / max(digit.size)
    size = (max(1, round(digit.width * scale)), max(1, round(digit.height * scale)))
    large = digit.resize(size, Image.Resampling.BICUBIC)
    large = large.rotate(angle, Image.Resampling.BILINEAR, expand=True, fillcolor=0)
    coverage = np.asarray(large, np.float32) / 255.0
    return np.clip((coverage - 0.25) / 0.5, 0.0, 1.0)


def paper_photo(digit: Image.Image, rng: np.random.Generator) -> Image.Image:
    """A handwritten digit photographed on paper (see the module docstring)."""
    width, height = (300, 400) if rng.random() < 0.5 else (400, 300)
    ink = ink_strokes(digit, int(rng.integers(100, 251)), rng.uniform(-10, 10))
    top = int(rng.integers(5, height - ink.shape[0] - 4))
    left = int(rng.integers(5, width - ink.shape[1] - 4))
    coverage = np.zeros((height, width), np.float32)
    coverage[top:top + ink.shape[0], left:left + ink.shape[1]] = ink * rng.uniform(0.8, 0.95)
    paper = rng.uniform([215, 210, 190], [240, 236, 225]) + rng.normal(0, 4, (height, width, 1))
    pen = rng.uniform([20, 20, 30], [60, 60, 100])
    scene = paper * (1 - coverage[..., None]) + pen * coverage[..., None]
    pixels = np.clip(scene * lighting_field(rng, height, width)[..., None], 0, 255).astype(np.uint8)
    return Image.fromarray(pixels).filter(ImageFilter.GaussianBlur(rng.uniform(0.6, 1.2)))


def typed_digit(digit: int, font_file: str, rng: np.random.Generator) -> Image.Image:
    """A black digit typed in `font_file` somewhere on a white 200x200 image."""
    font = ImageFont.truetype(str(FONT_DIR / font_file), int(rng.integers(60, 151)))
    image = Image.new("L", (200, 200), 255)
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = draw.textbbox((0, 0), str(digit), font=font)
    x = rng.integers(8, max(9, 192 - (right - left))) - left
    y = rng.integers(8, max(9, 192 - (bottom - top))) - top
    draw.text((int(x), int(y)), str(digit), fill=int(rng.integers(0, 41)), font=font)
    return image


def make_uploads(out: Path, seed: int = 0) -> list[Path]:
    """Write both groups into `out` (names `<group>_<nn>_label_<digit>.<ext>`); return the paths."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for index, (digit, label) in enumerate(mnist_test_digits(seed)):
        path = out / f"photo_{index:02d}_label_{label}.jpg"
        paper_photo(digit, rng).save(path, quality=int(rng.integers(70, 81)))
        paths.append(path)
    for index in range(10 * PER_DIGIT):
        path = out / f"typed_{index:02d}_label_{index % 10}.png"
        typed_digit(index % 10, FONTS[index % len(FONTS)], rng).save(path)
        paths.append(path)
    return paths


def true_label(path: Path) -> str:
    return LABEL_PATTERN.search(path.name).group(1)


# Scoring through the app -------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def top_labels(result) -> list[tuple[str, float]]:
    """The /predict answer's label output (its first value) -> [(label, confidence), ...]."""
    scores = result[0]
    return [(entry["label"], float(entry["confidence"])) for entry in scores["confidences"]]


@contextlib.contextmanager
def live_app(model: str, backend: str) -> Iterator["Client"]:
    """A gradio_client Client of app.py serving `model` on 127.0.0.1 (a free port), in this
    process; the app is closed on exit. The client fetches no output pictures (labels only)."""
    from gradio_client import Client

    from vit_hub.demo.backends import load_predictor
    from vit_hub.demo.page import build_demo, serve

    demo = build_demo(load_predictor(model, backend))
    _, url, _ = serve(demo, port=free_port(), prevent_thread_lock=True, quiet=True)
    try:
        yield Client(url, verbose=False, download_files=False)
    finally:
        demo.close()


def predict_through_app(paths: list[Path], model: str, backend: str) -> list[list[tuple[str, float]]]:
    """Serve `model` with app.py on 127.0.0.1 and send every file to /predict."""
    from gradio_client import handle_file

    with live_app(model, backend) as client:
        return [top_labels(client.predict(handle_file(str(path)), "mean", 0.0, 3, api_name="/predict"))
                for path in paths]


def summarise(paths: list[Path], ranked: list[list[tuple[str, float]]]) -> dict:
    """Per-image records and right/total per group."""
    images = [{"file": path.name, "group": path.name.split("_")[0], "label": true_label(path),
               "predicted": top[0][0], "confidence": round(top[0][1], 4), "top_k": top}
              for path, top in zip(paths, ranked)]
    groups = {group: {"right": sum(r["predicted"] == r["label"] for r in images if r["group"] == group),
                      "total": sum(r["group"] == group for r in images)} for group in GROUPS}
    return {"groups": groups, "images": images}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model dir or Hub repo id")
    parser.add_argument("--backend", choices=("torch", "onnx"), default="torch")
    parser.add_argument("--out", type=Path, help="keep the generated images here (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="write per-image results and totals here")
    parser.add_argument("--verbose", action="store_true", help="print every image's prediction")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--code", type=Path, default=ROOT, help="checkout whose app.py and vit_hub serve the model")
    args = parser.parse_args()
    sys.path.insert(0, str(args.code.resolve()))  # before anything imports app or vit_hub
    with tempfile.TemporaryDirectory() as scratch:
        paths = make_uploads(args.out or Path(scratch), args.seed)
        report = summarise(paths, predict_through_app(paths, args.model, args.backend))
    if args.verbose:
        for record in report["images"]:
            mark = "ok" if record["predicted"] == record["label"] else "WRONG"
            print(f"{record['file']:24s} predicted {record['predicted']} ({record['confidence']:.2f})  {mark}")
    for group, counts in report["groups"].items():
        print(f"{group}: {counts['right']}/{counts['total']}")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "backend": args.backend, "seed": args.seed,
                                         "code": str(args.code), **report}, indent=2) + "\n")


if __name__ == "__main__":
    main()

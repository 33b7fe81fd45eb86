"""Do the defaults work on a small folder? A generated 2-class "cell" set, 400 training photos.

    python bench/small_data.py [--train 400] [--test 200] [--epochs N] [--recipes default naive]

Class `parasitized`: a cell with a few small dark inclusions; class `uninfected`: a cell
without. Cells vary in colour, size, shape and position; backgrounds are noisy; photos are
80-140 px. This is the kind of set where a from-scratch ViT with a naive recipe sits at
chance. Two runs on the same split:
  * defaults: `vit-hub train --data DIR --out OUT` and nothing else;
  * naive: a plain ViT (16-px conv patches, ViT-Ti width, no augmentation, no
    regularisation, no small-data techniques) with the same number of epochs.
Test accuracy of both is printed as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vit_hub.schedule import default_epochs  # noqa: E402

NAIVE = ["--patch-size", "16", "--image-size", "64", "--embed-dim", "192", "--depth", "12", "--num-heads", "3",
         "--mlp-ratio", "4", "--patch-embedding", "conv", "--no-locality-attention", "--dropout", "0",
         "--drop-path", "0", "--augment", "none", "--label-smoothing", "0", "--weight-decay", "0"]


def draw_cell(rng: np.random.Generator, infected: bool) -> Image.Image:
    size = int(rng.integers(80, 141))
    background = rng.integers(180, 240, 3)
    pixels = np.clip(background + rng.normal(0, 12, (size, size, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    radius_x, radius_y = size * rng.uniform(0.25, 0.4), size * rng.uniform(0.25, 0.4)
    centre = size / 2 + rng.uniform(-0.1, 0.1, 2) * size
    colour = tuple(int(c) for c in rng.integers([170, 90, 120], [230, 150, 190]))
    box = [centre[0] - radius_x, centre[1] - radius_y, centre[0] + radius_x, centre[1] + radius_y]
    draw.ellipse(box, fill=colour, outline=tuple(max(0, c - 40) for c in colour), width=2)
    if infected:
        for _ in range(int(rng.integers(1, 4))):
            angle, distance = rng.uniform(0, 2 * np.pi), rng.uniform(0, 0.6)
            x = centre[0] + np.cos(angle) * distance * radius_x
            y = centre[1] + np.sin(angle) * distance * radius_y
            dot = size * rng.uniform(0.04, 0.07)
            draw.ellipse([x - dot, y - dot, x + dot, y + dot], fill=tuple(int(c) for c in rng.integers(40, 90, 3)))
    return image.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.2)))


def make_split(root: Path, count: int, rng: np.random.Generator) -> None:
    for index in range(count):
        label = "parasitized" if index % 2 else "uninfected"
        (root / label).mkdir(parents=True, exist_ok=True)
        draw_cell(rng, index % 2 == 1).save(root / label / f"{index:04d}.jpg", quality=90)


def train(data: Path, out: Path, extra: list[str]) -> tuple[float, float]:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "vit_hub", "train", "--data", str(data), "--out", str(out), *extra],
                   check=True, capture_output=True)
    final = json.loads((out / "metrics.json").read_text())["final"]
    return final["accuracy"], time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--epochs", type=int, help="default: the trainer's own choice for this size")
    parser.add_argument("--recipes", nargs="+", choices=("default", "naive"), default=["default", "naive"],
                        help="which runs to make (each is long on a CPU)")
    args = parser.parse_args()
    held_out = round(args.train * 0.1)  # the trainer's default --val-split
    chosen = args.epochs or default_epochs(args.train - held_out)
    flags = {"default": ["--epochs", str(chosen)] if args.epochs else [], "naive": NAIVE + ["--epochs", str(chosen)]}
    names = {"default": "defaults (no flags)", "naive": "naive plain ViT"}
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "cells"
        rng = np.random.default_rng(0)
        make_split(data / "train", args.train, rng)
        make_split(data / "test", args.test, rng)
        results = {recipe: train(data, Path(scratch) / recipe, flags[recipe]) for recipe in args.recipes}
    print(f"command: python bench/small_data.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"{args.train} training photos (10 % held out for validation), {args.test} test photos, "
          f"{chosen} epochs, load average {os.getloadavg()[0]:.1f}\n")
    print("| recipe | test accuracy | wall time |")
    print("|---|---|---|")
    for recipe, (accuracy, seconds) in results.items():
        print(f"| {names[recipe]} | {accuracy:.3f} | {seconds:.0f} s |")


if __name__ == "__main__":
    main()

"""The generated two-class "cell" set of bench/small_data.py (without --data): photos of 80-140 px,
class `parasitized` with a few small dark inclusions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


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


def generated_cells(root: Path, train: int, test: int) -> Path:
    if not root.exists():
        rng = np.random.default_rng(0)
        make_split(root / "train", train, rng)
        make_split(root / "test", test, rng)
    return root

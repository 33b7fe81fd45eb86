"""A generated set where finding the objects is not enough: the class is one small part of a busy scene.

    python bench/marked_objects.py --root DIR [--seed 0] [--scale 1.0]

Writes `ROOT/marked/train/<class>/*.png` and `ROOT/marked/test/<class>/*.png` (the layout
`vit-hub train --data ROOT/marked` reads): 32x32 RGB scenes, 4000 train / 800 test.

Every scene holds eight small objects on a cluttered grey background: two of each colour
(red, green, blue, yellow), each a disc, a square or a triangle. One of them is framed by a
thin white square. The class is the colour of the framed object. Every colour appears
exactly twice in every scene, so counting colours says nothing; the shapes are nuisance.
A map that only finds the objects (`object_map`) spreads over eight of them and the frame; a
faithful explanation of a model that solved the task points at the framed one.

Each image is drawn from its own seeded generator (as in `shifted_sets.py`), so a set is
identical for a seed and `scale` only changes how many images there are.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

try:
    from shifted_sets import SPLITS, Shot, add_sensor_noise, smooth_noise, to_uint8, write_set
except ImportError:  # imported as bench.marked_objects (tests), not run from bench/
    from bench.shifted_sets import SPLITS, Shot, add_sensor_noise, smooth_noise, to_uint8, write_set

SIDE = 32
SUPERSAMPLE = 4  # drawn at 4x and downsampled: anti-aliased edges on 3-px objects
COLOURS = {  # the classes: the framed object's colour
    "blue": (50, 90, 235),
    "green": (40, 185, 60),
    "red": (225, 45, 40),
    "yellow": (235, 210, 40),
}
SHAPES = ("disc", "square", "triangle")
OBJECT_RADIUS = (1.6, 2.2)  # pixels of the 32-px scene
FRAME_HALF = 4.0  # the frame's half side: a 9-px square around the framed object's centre
MIN_GAP = 7.5  # least distance between two object centres, in pixels


def clutter(rng: np.random.Generator) -> Image.Image:
    """A grey scene with smooth blotches and a few grey lines: busy, but colourless."""
    big = SIDE * SUPERSAMPLE
    level = rng.uniform(60, 150)
    grey = level + 25 * smooth_noise(rng, big, big, 3) + 12 * smooth_noise(rng, big, big, 10)
    scene = Image.fromarray(to_uint8(np.repeat(grey[..., None], 3, axis=2)))
    draw = ImageDraw.Draw(scene)
    for _ in range(int(rng.integers(3, 7))):
        start = rng.uniform(0, big, 2)
        end = start + rng.normal(0, big / 3, 2)
        shade = int(rng.uniform(30, 200))
        draw.line([tuple(start), tuple(end)], fill=(shade,) * 3, width=int(rng.integers(1, 3)) * SUPERSAMPLE)
    return scene


def place_objects(rng: np.random.Generator, count: int) -> np.ndarray:
    """[count, 2] centres (x, y) in scene pixels, at least MIN_GAP apart, away from the border."""
    margin = FRAME_HALF + 1.0
    while True:  # rejection sampling; a few tries on average
        centres: list[np.ndarray] = []
        for _ in range(200):
            point = rng.uniform(margin, SIDE - margin, 2)
            if all(np.hypot(*(point - other)) >= MIN_GAP for other in centres):
                centres.append(point)
                if len(centres) == count:
                    return np.array(centres)


def draw_object(draw: ImageDraw.ImageDraw, shape: str, centre: np.ndarray, radius: float,
                colour: tuple[int, int, int]) -> None:
    x, y, r = *(centre * SUPERSAMPLE), radius * SUPERSAMPLE
    if shape == "disc":
        draw.ellipse([x - r, y - r, x + r, y + r], fill=colour)
    elif shape == "square":
        draw.rectangle([x - 0.85 * r, y - 0.85 * r, x + 0.85 * r, y + 0.85 * r], fill=colour)
    else:
        draw.polygon([(x, y - r), (x + 0.95 * r, y + 0.7 * r), (x - 0.95 * r, y + 0.7 * r)], fill=colour)


def jitter(rng: np.random.Generator, colour: tuple[int, int, int]) -> tuple[int, int, int]:
    return tuple(int(np.clip(c + rng.normal(0, 12), 0, 255)) for c in colour)


def draw_scene(rng: np.random.Generator, label: str, split: str) -> Shot:
    """Eight objects, two per colour, one of the `label` colour framed in white."""
    del split  # both splits come from the same acquisition
    colours = [name for name in COLOURS for _ in range(2)]
    rng.shuffle(colours)
    framed = colours.index(label) if rng.random() < 0.5 else len(colours) - 1 - colours[::-1].index(label)
    centres = place_objects(rng, len(colours))
    scene = clutter(rng)
    draw = ImageDraw.Draw(scene)
    for index, (name, centre) in enumerate(zip(colours, centres)):
        draw_object(draw, str(rng.choice(SHAPES)), centre, rng.uniform(*OBJECT_RADIUS), jitter(rng, COLOURS[name]))
        if index == framed:
            x, y = centre * SUPERSAMPLE
            half = FRAME_HALF * SUPERSAMPLE
            draw.rectangle([x - half, y - half, x + half, y + half], outline=(245, 245, 245), width=SUPERSAMPLE)
    pixels = np.asarray(scene.resize((SIDE, SIDE), Image.Resampling.LANCZOS), np.float32)
    return Shot(Image.fromarray(to_uint8(add_sensor_noise(rng, pixels, 3.0))))


def make_marked(root: Path, seed: int = 0, scale: float = 1.0) -> Path:
    """Four colour classes read off the framed one of eight objects, 4000 train / 800 test."""
    return write_set(root, "marked", list(COLOURS), {"train": 1000, "test": 200}, draw_scene, seed, scale)


def object_map(pixels: np.ndarray, patch: tuple[int, int]) -> np.ndarray:
    """The model-free "where are the objects" map: mean colourfulness (max - min over the RGB
    channels) of each patch. pixels [N, 3, H, W] in any affine scale -> [N, H/p, W/p]."""
    chroma = pixels.max(axis=1) - pixels.min(axis=1)  # [N, H, W]
    count, height, width = chroma.shape
    blocks = chroma.reshape(count, height // patch[0], patch[0], width // patch[1], patch[1])
    return blocks.mean(axis=(2, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, type=Path, help="folder to write the set into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=1.0, help="share of the full image counts")
    args = parser.parse_args()
    started = time.perf_counter()
    folder = make_marked(args.root, args.seed, args.scale)
    counts = {split: sum(1 for path in (folder / split).rglob("*") if path.is_file()) for split in SPLITS}
    print(f"{folder}: train {counts['train']}, test {counts['test']} ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()

"""Small generated image folders whose test split comes from a shifted acquisition.

    python bench/shifted_sets.py --root DIR [--sets cells,lighting] [--seed 0] [--scale 1.0]

Every generator writes `ROOT/<name>/train/<class>/*` and `ROOT/<name>/test/<class>/*`
(the layout `vit-hub train --data ROOT/<name>` reads; validation is carved from train).
Training images come from one acquisition; test images from another that training never
shows, the way a new lab, camera or room differs from the one a dataset was collected in:

  cells          microscopy-like RGB cells, parasitized (dark-stained inclusions) or
                 uninfected; 400 train / 100 test of 80-230 px. Test: another lab's stain
                 (pink/purple in train; denser, greyer lilac/violet-blue in test).
  shapes_tiny    a bright circle or square on a dark 48x48 background, 60 + 60 train,
                 20 + 20 test, both from the same acquisition.
  objects_small  a triangle, square, cross or ring with a random texture in a busy
                 scene; 1600 train / 400 test of 64-128 px. Test: the object is 2-3x
                 smaller in the frame, anywhere in it, blurred and under other light.
  lighting       five texture classes; 3000 train / 500 test of 64-112 px. Test: strong
                 brightness, contrast, gamma and colour-cast changes, saved as JPEG q20-45.

Each image is drawn from its own seeded generator (set name, seed, split, index), so a
set is identical for a seed and `scale` only changes how many images there are.
Everything is vectorised NumPy or PIL drawing; a full set takes seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

SPLITS = ("train", "test")
SUFFIXES = {"PNG": ".png", "JPEG": ".jpg"}


@dataclasses.dataclass
class Shot:
    """One generated image and how it is saved."""

    image: Image.Image
    format: str = "PNG"
    quality: int = 95  # JPEG only


Drawer = Callable[[np.random.Generator, str, str], Shot]  # (rng, class, split) -> Shot


# Shared machinery ------------------------------------------------------------------------
def image_rng(name: str, seed: int, split: str, index: int) -> np.random.Generator:
    """The generator of one image: independent of how many images the set has."""
    return np.random.default_rng([zlib.crc32(name.encode()), seed, SPLITS.index(split), index])


def per_class_count(count: int, scale: float) -> int:
    """Images per class after scaling; at least 2 so a stratified split leaves both sides."""
    return max(2, round(count * scale))


def write_set(root: Path, name: str, classes: list[str], per_class: dict[str, int], draw: Drawer,
              seed: int, scale: float) -> Path:
    """Draw and save every image of `ROOT/<name>` (replacing what was there); classes
    alternate, so every class gets `per_class[split]` images."""
    target = Path(root) / name
    if target.exists():
        shutil.rmtree(target)
    for split in SPLITS:
        count = per_class_count(per_class[split], scale) * len(classes)
        for label in classes:
            (target / split / label).mkdir(parents=True)
        for index in range(count):
            label = classes[index % len(classes)]
            shot = draw(image_rng(name, seed, split, index), label, split)
            path = target / split / label / f"{index:05d}{SUFFIXES[shot.format]}"
            options = {"quality": shot.quality} if shot.format == "JPEG" else {}
            shot.image.save(path, format=shot.format, **options)
    return target


def pixel_grid(height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column coordinates of pixel centres, float32 [h, w] each."""
    rows, cols = np.mgrid[0:height, 0:width].astype(np.float32)
    return rows + 0.5, cols + 0.5


def smooth_noise(rng: np.random.Generator, height: int, width: int, cells: float) -> np.ndarray:
    """Low-frequency noise with unit standard deviation: about `cells` blobs across the image."""
    grid = (max(2, round(cells * height / max(height, width))), max(2, round(cells * width / max(height, width))))
    coarse = Image.fromarray(rng.standard_normal(grid).astype(np.float32))
    field = np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC))
    return (field - field.mean()) / max(float(field.std()), 1e-6)


def soft_disc(distance: np.ndarray, radius: float, edge: float = 1.0) -> np.ndarray:
    """1 inside `radius`, 0 outside, with an anti-aliased edge `edge` pixels wide."""
    return np.clip((radius - distance) / edge + 0.5, 0.0, 1.0)


def to_uint8(pixels: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8)


def add_sensor_noise(rng: np.random.Generator, pixels: np.ndarray, sigma: float) -> np.ndarray:
    return pixels + rng.normal(0.0, sigma, pixels.shape)


# cells -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Stain:
    """A lab's staining and microscope: Beer-Lambert optical density per RGB channel of its
    two dyes (one binds the cytoplasm, one the parasite's chromatin) and the lamp's colour."""

    light: tuple[float, float, float]
    cytoplasm_density: tuple[float, float, float]
    chromatin_density: tuple[float, float, float]
    strength: float


# Training slides: pink cytoplasm, purple inclusions on a near-white background. Test slides
# (another lab): a denser, bluer stain: lilac-grey cytoplasm (hue about 45 degrees away, half
# the saturation, darker) and darker violet-blue inclusions, under a cooler lamp.
STAINS = {
    "train": Stain((246, 238, 242), (0.12, 0.50, 0.30), (0.95, 1.25, 0.40), 1.0),
    "test": Stain((232, 232, 242), (0.32, 0.40, 0.20), (1.00, 1.05, 0.50), 1.2),
}


@dataclasses.dataclass
class Cell:
    """An irregular ellipse: centre (row, col), radii (rows, cols) before rotation, angle."""

    centre: tuple[float, float]
    radii: tuple[float, float]
    angle: float
    wobble: np.ndarray  # [4, 2]: amplitude and phase of boundary harmonics 2..5

    def polar(self, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Normalised radius (1 on the ideal ellipse) and angle of every pixel."""
        dy, dx = rows - self.centre[0], cols - self.centre[1]
        cos, sin = np.cos(self.angle), np.sin(self.angle)
        u, v = (dx * cos + dy * sin) / self.radii[1], (-dx * sin + dy * cos) / self.radii[0]
        return np.hypot(u, v), np.arctan2(v, u)

    def boundary(self, theta: np.ndarray) -> np.ndarray:
        harmonics = np.arange(2, 6, dtype=np.float32)[:, None, None]
        amplitude, phase = self.wobble[:, 0, None, None], self.wobble[:, 1, None, None]
        return 1.0 + (amplitude * np.cos(harmonics * theta + phase)).sum(0)

    def to_image(self, radius: float, theta: float) -> tuple[float, float]:
        """Pixel (row, col) of normalised polar coordinates inside the cell."""
        u, v = radius * np.cos(theta) * self.radii[1], radius * np.sin(theta) * self.radii[0]
        cos, sin = np.cos(self.angle), np.sin(self.angle)
        return self.centre[0] + u * sin + v * cos, self.centre[1] + u * cos - v * sin


def random_cell(rng: np.random.Generator, height: int, width: int, centre: tuple[float, float]) -> Cell:
    radius = min(height, width) * rng.uniform(0.28, 0.40)
    wobble = np.stack([rng.uniform(0, 0.05, 4) / np.arange(1, 5), rng.uniform(0, 2 * np.pi, 4)], 1)
    return Cell(centre, (radius, radius * rng.uniform(0.8, 1.0)), rng.uniform(0, np.pi), wobble.astype(np.float32))


def cytoplasm(rng: np.random.Generator, cell: Cell, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Dye concentration of one cell: textured cytoplasm, a darker membrane and, in most
    cells, a paler centre."""
    radius, theta = cell.polar(rows, cols)
    edge = cell.boundary(theta)
    pixels_per_unit = min(cell.radii)
    inside = soft_disc(radius * pixels_per_unit, edge * pixels_per_unit, 1.2)
    membrane = np.exp(-(((radius - edge) * pixels_per_unit / rng.uniform(1.5, 3.0)) ** 2))
    pallor = rng.uniform(0.0, 0.35) * np.exp(-((radius / 0.5) ** 2)) * (rng.random() < 0.7)
    height, width = rows.shape
    grain = 0.10 * smooth_noise(rng, height, width, 5) + 0.06 * smooth_noise(rng, height, width, 16)
    return inside * 0.6 * (1.0 + grain - pallor) + 0.3 * membrane * np.maximum(inside, 0.3)


def spots(rows: np.ndarray, cols: np.ndarray, centres: list[tuple[float, float]], radii: list[float],
          amounts: list[float]) -> np.ndarray:
    """Sum of soft discs: one per (centre, radius, dye amount)."""
    field = np.zeros(rows.shape, np.float32)
    for (row, col), radius, amount in zip(centres, radii, amounts):
        field += amount * soft_disc(np.hypot(rows - row, cols - col), radius)
    return field


def inclusions(rng: np.random.Generator, cell: Cell, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Parasite chromatin: 1-3 dark dots or ring forms (a thin ring with a dot on it)."""
    field = np.zeros(rows.shape, np.float32)
    size = min(cell.radii)
    for _ in range(rng.choice([1, 2, 3], p=[0.6, 0.3, 0.1])):
        row, col = cell.to_image(0.6 * np.sqrt(rng.random()), rng.uniform(0, 2 * np.pi))
        radius, amount = size * rng.uniform(0.06, 0.14), rng.uniform(0.45, 1.5)
        distance = np.hypot(rows - row, cols - col)
        if rng.random() < 0.5:
            field += amount * soft_disc(distance, radius)
        else:  # ring form
            width = max(1.0, 0.3 * radius)
            field += 0.7 * amount * np.exp(-(((distance - radius) / width) ** 2))
            angle = rng.uniform(0, 2 * np.pi)
            field += spots(rows, cols, [(row + radius * np.sin(angle), col + radius * np.cos(angle))],
                           [max(1.0, 0.45 * radius)], [amount])
    return field


def distractors(rng: np.random.Generator, cell: Cell, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """What both classes show: faint granules in the cytoplasm and, on some slides,
    dark platelets lying beside the cell (never on it)."""
    size = min(cell.radii)
    count = int(rng.integers(0, 6))
    granules = [cell.to_image(0.8 * np.sqrt(rng.random()), rng.uniform(0, 2 * np.pi)) for _ in range(count)]
    field = spots(rows, cols, granules, list(rng.uniform(1.0, 2.5, count)), list(rng.uniform(0.1, 0.4, count)))
    if rng.random() < 0.3:
        height, width = rows.shape
        candidates = rng.uniform([4, 4], [height - 4, width - 4], (24, 2))
        radius, _ = cell.polar(candidates[:, 0], candidates[:, 1])
        outside = candidates[radius > 1.3][: int(rng.integers(1, 3))]
        count = len(outside)
        field += spots(rows, cols, [tuple(point) for point in outside],
                       list(size * rng.uniform(0.08, 0.16, count)), list(rng.uniform(0.5, 1.1, count)))
    return field


def neighbour(rng: np.random.Generator, height: int, width: int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Part of an uninfected neighbouring cell cut off by the image border."""
    cell = random_cell(rng, height, width, (0.0, 0.0))
    side, along = rng.integers(4), rng.uniform(0.2, 0.8)
    beyond = max(cell.radii) * rng.uniform(0.3, 0.8)  # its centre lies this far outside the border
    centre = [(-beyond, along * width), (height + beyond, along * width),
              (along * height, -beyond), (along * height, width + beyond)][side]
    return cytoplasm(rng, dataclasses.replace(cell, centre=centre), rows, cols)


def stain_image(rng: np.random.Generator, stain: Stain, cytoplasm_dye: np.ndarray,
                chromatin_dye: np.ndarray) -> np.ndarray:
    """Beer-Lambert: light x exp(-(dye amounts x optical densities)), with this slide's
    mild variation of stain strength, dye colour and lamp."""
    strength = stain.strength * rng.uniform(0.88, 1.12)
    cyto = np.asarray(stain.cytoplasm_density) * np.exp(rng.normal(0, 0.05, 3))
    chrom = np.asarray(stain.chromatin_density) * np.exp(rng.normal(0, 0.05, 3))
    light = np.asarray(stain.light) * rng.uniform(0.96, 1.03)
    density = strength * (cytoplasm_dye[..., None] * cyto + chromatin_dye[..., None] * chrom)
    return light * np.exp(-density)


def draw_cell(rng: np.random.Generator, label: str, split: str) -> Shot:
    """One microscopy crop: a cell (with inclusions when parasitized) on a pale background."""
    height = int(rng.integers(80, 231))
    width = int(np.clip(round(height * rng.uniform(0.85, 1.18)), 80, 230))
    rows, cols = pixel_grid(height, width)
    centre = (height * rng.uniform(0.42, 0.58), width * rng.uniform(0.42, 0.58))
    cell = random_cell(rng, height, width, centre)
    cyto = cytoplasm(rng, cell, rows, cols)
    if rng.random() < 0.25:
        cyto = cyto + neighbour(rng, height, width, rows, cols)
    haze = 0.03 * np.clip(1 + 0.5 * smooth_noise(rng, height, width, 8), 0, None)
    chromatin = distractors(rng, cell, rows, cols) + haze
    if label == "parasitized":
        chromatin = chromatin + inclusions(rng, cell, rows, cols)
    pixels = stain_image(rng, STAINS[split], cyto, chromatin)
    image = Image.fromarray(to_uint8(pixels)).filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 0.9)))
    return Shot(Image.fromarray(to_uint8(add_sensor_noise(rng, np.asarray(image, np.float32), 2.5))))


def make_cells(root: Path, seed: int = 0, scale: float = 1.0) -> Path:
    """Microscopy-like cells, 2 classes, 400 train / 100 test; test from another lab's stain."""
    return write_set(root, "cells", ["parasitized", "uninfected"], {"train": 200, "test": 50}, draw_cell,
                     seed, scale)


# shapes_tiny -------------------------------------------------------------------------------
def draw_shape(rng: np.random.Generator, label: str, split: str) -> Shot:
    """A bright circle or an axis-aligned square of the same area on a dark noisy 48x48
    background. Both splits come from the same acquisition."""
    size = 48
    rows, cols = pixel_grid(size, size)
    diameter = rng.uniform(14, 28)
    half = diameter / 2 if label == "circle" else diameter * np.sqrt(np.pi) / 4  # equal areas
    centre = rng.uniform(half + 2, size - half - 2, 2)
    dy, dx = np.abs(rows - centre[0]), np.abs(cols - centre[1])
    distance = np.hypot(dy, dx) if label == "circle" else np.maximum(dy, dx)
    shape = soft_disc(distance, half)
    background = rng.uniform(10, 50) + 6 * smooth_noise(rng, size, size, 4)
    pixels = background + shape * (rng.uniform(170, 250) - background)
    return Shot(Image.fromarray(to_uint8(add_sensor_noise(rng, pixels, 6.0)), "L"))


def make_shapes_tiny(root: Path, seed: int = 0, scale: float = 1.0) -> Path:
    """Circles vs squares, 60 + 60 train / 20 + 20 test, one acquisition."""
    return write_set(root, "shapes_tiny", ["circle", "square"], {"train": 60, "test": 20}, draw_shape,
                     seed, scale)


# objects_small -------------------------------------------------------------------------------
def regular_polygon(corners: int, radius: float, phase: float = 0.0) -> np.ndarray:
    """[corners, 2] vertices (x, y) on a circle of `radius`, the first at angle `phase`."""
    angles = phase + 2 * np.pi * np.arange(corners) / corners
    return radius * np.stack([np.cos(angles), np.sin(angles)], 1)


_ARM = 0.36  # half-width of the cross's arms, in object radii
CROSS = np.array([(-_ARM, -1), (_ARM, -1), (_ARM, -_ARM), (1, -_ARM), (1, _ARM), (_ARM, _ARM), (_ARM, 1),
                  (-_ARM, 1), (-_ARM, _ARM), (-1, _ARM), (-1, -_ARM), (-_ARM, -_ARM)], dtype=np.float64)

# Each class: polygons in unit object radii, each with the mask value it paints (0 cuts a hole).
OBJECTS = {
    "cross": [(CROSS, 255)],
    "ring": [(regular_polygon(48, 1.0), 255), (regular_polygon(48, 0.62), 0)],
    "square": [(regular_polygon(4, 0.85, np.pi / 4), 255)],
    "triangle": [(regular_polygon(3, 1.0, -np.pi / 2), 255)],
}
SUPERSAMPLE = 2  # scenes are drawn at 2x and downsampled: anti-aliased edges


def random_colour(rng: np.random.Generator) -> tuple[int, int, int]:
    return tuple(int(c) for c in rng.integers(0, 256, 3))


def busy_background(rng: np.random.Generator, side: int) -> Image.Image:
    """A cluttered scene: coloured low-frequency noise, then lines and filled ellipses."""
    base = rng.uniform(40, 215, 3)
    pixels = base + sum(amount * np.stack([smooth_noise(rng, side, side, cells) for _ in range(3)], -1)
                        for amount, cells in ((30, 3), (15, 9)))
    scene = Image.fromarray(to_uint8(pixels))
    draw = ImageDraw.Draw(scene)
    for _ in range(int(rng.integers(4, 10))):
        x, y = rng.uniform(0, side, 2)
        if rng.random() < 0.5:
            end = (x, y) + rng.normal(0, side / 4, 2)
            draw.line([(x, y), tuple(end)], fill=random_colour(rng), width=int(rng.integers(1, 4)) * SUPERSAMPLE)
        else:
            rx, ry = rng.uniform(0.02, 0.08, 2) * side
            draw.ellipse([x - rx, y - ry, x + rx, y + ry], fill=random_colour(rng))
    return scene


def object_fill(rng: np.random.Generator, side: int) -> Image.Image:
    """Solid, striped, checkered or dotted fill in two random colours (a nuisance: the
    class is the shape)."""
    rows, cols = pixel_grid(side, side)
    angle, period = rng.uniform(0, np.pi), rng.uniform(3, 8) * side / 96
    u = cols * np.cos(angle) + rows * np.sin(angle)
    v = -cols * np.sin(angle) + rows * np.cos(angle)
    kind = rng.integers(4)
    if kind == 0:
        pattern = np.zeros_like(u)
    elif kind == 1:
        pattern = (np.sin(2 * np.pi * u / period) > 0).astype(np.float32)
    elif kind == 2:
        pattern = ((np.floor(u / period) + np.floor(v / period)) % 2).astype(np.float32)
    else:
        pattern = soft_disc(np.hypot((u % period) - period / 2, (v % period) - period / 2), period * 0.3)
    first, second = np.asarray(random_colour(rng)), np.asarray(random_colour(rng))
    return Image.fromarray(to_uint8(first + pattern[..., None] * (second - first)))


def object_mask(label: str, side: int, centre: np.ndarray, radius: float, angle: float,
                stretch: np.ndarray) -> Image.Image:
    """The object's silhouette: its polygons stretched, rotated, scaled and placed."""
    rotation = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    mask = Image.new("L", (side, side), 0)
    draw = ImageDraw.Draw(mask)
    for polygon, value in OBJECTS[label]:
        points = (polygon * stretch) @ rotation.T * radius + centre
        draw.polygon([tuple(point) for point in points], fill=value)
    return mask


def relight(pixels: np.ndarray, gain: float, cast: np.ndarray, gamma: float) -> np.ndarray:
    """Exposure, colour cast and gamma of another light source and camera."""
    normalised = np.clip(pixels * gain * cast / 255.0, 0.0, 1.0)
    return 255.0 * normalised ** gamma


def object_placement(rng: np.random.Generator, side: int, split: str) -> tuple[np.ndarray, float]:
    """(centre, radius) of the object in a `side`-pixel scene. Train: a radius of 22-36 % of
    the side, near the centre. Test: 10-16 %, anywhere in the frame."""
    if split == "train":
        radius = side * rng.uniform(0.22, 0.36)
        return side / 2 + rng.uniform(-0.12, 0.12, 2) * side, radius
    radius = side * rng.uniform(0.10, 0.16)
    return rng.uniform(radius * 1.2, side - radius * 1.2, 2), radius


def draw_object(rng: np.random.Generator, label: str, split: str) -> Shot:
    """A textured shape in a busy scene. Train: large and near the centre, sharp, even
    light. Test: 2-3x smaller, anywhere, blurred, darker or brighter with a colour cast."""
    side = int(rng.integers(64, 129))
    big = side * SUPERSAMPLE
    centre, radius = object_placement(rng, big, split)
    scene = busy_background(rng, big)
    mask = object_mask(label, big, centre, radius, rng.uniform(0, 2 * np.pi), rng.uniform(0.8, 1.2, 2))
    scene = Image.composite(object_fill(rng, big), scene, mask).resize((side, side), Image.Resampling.LANCZOS)
    if split == "train":
        blur, gain, cast, gamma = rng.uniform(0, 0.4), rng.uniform(0.92, 1.08), np.exp(rng.normal(0, 0.03, 3)), 1.0
    else:
        blur = rng.uniform(0.8, 1.6) * side / 96
        gain = rng.choice([rng.uniform(0.6, 0.8), rng.uniform(1.15, 1.35)])
        cast, gamma = np.exp(rng.normal(0, 0.15, 3)), rng.uniform(0.8, 1.25)
    scene = scene.filter(ImageFilter.GaussianBlur(blur))
    pixels = relight(np.asarray(scene, np.float32), gain, cast, gamma)
    return Shot(Image.fromarray(to_uint8(add_sensor_noise(rng, pixels, 3.0))))


def make_objects_small(root: Path, seed: int = 0, scale: float = 1.0) -> Path:
    """Four shapes in busy scenes, 1600 train / 400 test; test objects small, blurred, relit."""
    return write_set(root, "objects_small", sorted(OBJECTS), {"train": 400, "test": 100}, draw_object,
                     seed, scale)


# lighting ----------------------------------------------------------------------------------
TEXTURES = ("blotches", "checker", "dots", "stripes", "waves")


def texture_pattern(rng: np.random.Generator, label: str, side: int) -> np.ndarray:
    """[side, side] pattern in [0, 1] of one texture class, random period and orientation."""
    rows, cols = pixel_grid(side, side)
    period, angle = rng.uniform(6, 14) * side / 88, rng.uniform(0, np.pi)
    u = cols * np.cos(angle) + rows * np.sin(angle)
    v = -cols * np.sin(angle) + rows * np.cos(angle)
    if label == "stripes":
        return 0.5 + 0.5 * np.tanh(3 * np.sin(2 * np.pi * u / period))
    if label == "waves":
        bend = rng.uniform(0.25, 0.45) * period * np.sin(2 * np.pi * v / (period * rng.uniform(2, 4)))
        return 0.5 + 0.5 * np.tanh(3 * np.sin(2 * np.pi * (u + bend) / period))
    if label == "checker":
        return 0.5 + 0.5 * np.tanh(3 * np.sin(np.pi * u / period) * np.sin(np.pi * v / period) * 2)
    if label == "dots":
        return soft_disc(np.hypot((u % period) - period / 2, (v % period) - period / 2), period * 0.28)
    return 0.5 + 0.5 * np.tanh(2 * smooth_noise(rng, side, side, side / period))  # blotches


def draw_texture(rng: np.random.Generator, label: str, split: str) -> Shot:
    """A photographed texture swatch under uneven light. Train: even exposure, PNG. Test:
    strong exposure, contrast, gamma and colour-cast changes, JPEG q20-45."""
    side = int(rng.integers(64, 113))
    first = rng.uniform(20, 235, 3)
    second = first + rng.normal(0, 50, 3) + rng.choice([-1, 1]) * rng.uniform(40, 100)
    pixels = first + texture_pattern(rng, label, side)[..., None] * (second - first)
    rows, cols = pixel_grid(side, side)
    tilt = rng.uniform(0, 2 * np.pi)
    shading = 1 + 0.15 * ((cols * np.cos(tilt) + rows * np.sin(tilt)) / side - 0.5)
    pixels = pixels * shading[..., None]
    if split == "train":
        pixels = relight(pixels, rng.uniform(0.9, 1.1), np.exp(rng.normal(0, 0.04, 3)),
                         rng.uniform(0.9, 1.1))
        return Shot(Image.fromarray(to_uint8(add_sensor_noise(rng, pixels, 2.0))))
    contrast = rng.uniform(0.5, 0.8)
    pixels = pixels.mean((0, 1)) + contrast * (pixels - pixels.mean((0, 1)))
    gain = rng.choice([rng.uniform(0.5, 0.7), rng.uniform(1.25, 1.5)])
    gamma = rng.choice([rng.uniform(0.6, 0.8), rng.uniform(1.3, 1.7)])
    pixels = relight(pixels, gain, np.exp(rng.normal(0, 0.25, 3)), gamma)
    image = Image.fromarray(to_uint8(add_sensor_noise(rng, pixels, 3.0)))
    return Shot(image, "JPEG", int(rng.integers(20, 46)))


def make_lighting(root: Path, seed: int = 0, scale: float = 1.0) -> Path:
    """Five texture classes, 3000 train / 500 test; test relit and JPEG-compressed."""
    return write_set(root, "lighting", list(TEXTURES), {"train": 600, "test": 100}, draw_texture, seed, scale)


GENERATORS: dict[str, Callable[..., Path]] = {
    "cells": make_cells,
    "shapes_tiny": make_shapes_tiny,
    "objects_small": make_objects_small,
    "lighting": make_lighting,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, type=Path, help="folder to write the sets into")
    parser.add_argument("--sets", default=",".join(GENERATORS), help="comma-separated set names")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=1.0, help="share of the full image counts")
    args = parser.parse_args()
    for name in args.sets.split(","):
        if name not in GENERATORS:
            parser.error(f"--sets: unknown set {name!r}; expected some of {', '.join(GENERATORS)}")
        started = time.perf_counter()
        folder = GENERATORS[name](args.root, args.seed, args.scale)
        counts = {split: sum(1 for path in (folder / split).rglob("*") if path.is_file()) for split in SPLITS}
        print(f"{folder}: train {counts['train']}, test {counts['test']} ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()

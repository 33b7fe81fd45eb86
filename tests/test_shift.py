"""A small stain-shifted set in CI: the previous defaults fail on it, the current ones pass.

Blobs stained like the cells of bench/shifted_sets.py, with a dark dot ("parasitized") or without. The
training slides stain pink with purple dots; the test slides come from another lab: a
blue-grey stain, darker. Brightness tells the classes apart on both; colour only on the first.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from vit_hub.train.run import train
from vit_hub.train.settings import TrainSettings

# Optical density per RGB channel of the blob's dye and of the dot's, and the stain strength.
STAINS = {
    "train": dict(blob=(0.10, 0.55, 0.30), dot=(1.00, 1.30, 0.40), strength=1.0, light=(248, 238, 242)),
    "test": dict(blob=(0.35, 0.40, 0.15), dot=(1.00, 1.00, 0.45), strength=1.3, light=(228, 230, 242)),
}
SIDE = 48  # photo-sized (over 40 px): standardised per image by default


def stained_blob(rng: np.random.Generator, split: str, dotted: bool) -> Image.Image:
    """Beer-Lambert: light x exp(-strength x (blob dye x its density + dot dye x its density))."""
    stain = STAINS[split]
    rows, cols = np.mgrid[0:SIDE, 0:SIDE].astype(np.float32)
    centre, radius = rng.uniform(19, 29, 2), rng.uniform(12, 17)
    blob = np.clip(radius + 0.5 - np.hypot(rows - centre[0], cols - centre[1]), 0, 1)
    dot = np.zeros_like(blob)
    if dotted:
        where = centre + rng.uniform(-0.5, 0.5, 2) * radius
        dot = np.clip(rng.uniform(3.0, 4.5) + 0.5 - np.hypot(rows - where[0], cols - where[1]), 0, 1)
    density = stain["strength"] * (blob[..., None] * np.asarray(stain["blob"])
                                   + dot[..., None] * np.asarray(stain["dot"]))
    pixels = np.asarray(stain["light"]) * np.exp(-density) + rng.normal(0, 3, (SIDE, SIDE, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def stained_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("stained")
    rng = np.random.default_rng(0)
    for split, count in (("train", 60), ("test", 20)):
        for label in ("dotted", "plain"):
            folder = root / split / label
            folder.mkdir(parents=True)
            for index in range(count):
                stained_blob(rng, split, label == "dotted").save(folder / f"{index}.png")
    return root


# The previous defaults' input choices: 3 channels, the dataset's mean and std, and a
# batch of 128 (one step an epoch here). The current defaults choose grayscale (colour adds
# nothing to brightness on these slides), per-image standardisation and a batch of 32. Same
# model, same epochs.
PREVIOUS = dict(in_channels=3, pixel_norm="dataset")
COMMON = dict(image_size=32, patch_size=4, embed_dim=64, depth=3, num_heads=2)


# Test accuracy of the current defaults (the hybrid stem, no dropout) over seeds 0-14: 0.983 mean
# (sd 0.024), every seed at 0.925 or more; seed 1: 0.925. With dropout 0.1: 0.985 (sd 0.023), the
# same lowest and seed 1. With the convolutional stem before it: 0.917 (sd 0.10), 12 of 15 seeds
# at 0.85 or more, the lowest 0.675 (seed 4); seed 1: 0.95.
SEED = 1


def run(stained_set, tmp_path, name, model, **settings):
    out = tmp_path / name
    metrics = train(TrainSettings(data=str(stained_set), out=str(out), epochs=60, seed=SEED, num_workers=0,
                                  device="cpu", model={**COMMON, **model}, **settings))
    return {**{split: result["accuracy"] for split, result in metrics["evaluation"].items()},
            "best_val": metrics["best_val_accuracy"]}


@pytest.mark.slow
def test_previous_defaults_fail_on_another_labs_stain_and_the_current_ones_pass(stained_set, tmp_path):
    """The current defaults carry over to the other lab's stain (test >= 0.85); the previous ones
    reach 0.9 on validation during training and stay near chance on the test slides (validation
    hid it; with under 1,000 validation images the run keeps its last epoch, whatever its
    validation score). Accuracies by seed: SEED."""
    current = run(stained_set, tmp_path, "current", {})
    previous = run(stained_set, tmp_path, "previous", PREVIOUS, batch_size=128)
    assert current["test"] >= 0.85, current
    assert previous["best_val"] >= 0.9 and previous["test"] <= 0.6, previous

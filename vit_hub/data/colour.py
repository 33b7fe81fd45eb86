"""Does colour tell the classes apart beyond brightness? A cheap check on training images.

Colour is the cue that moves most between acquisitions: another stain, lamp, white balance
or camera shifts hue and saturation far more than it moves where things are dark or bright.
A model that can separate the classes by brightness alone and is still given colour learns
it anyway (it is the easiest cue) and then fails on images from elsewhere (stain-shifted
cells: BENCHMARKS.md, "Stain-shifted cells").

So before a model is chosen, a nearest-class-centroid classifier is cross-validated twice
on a few hundred training images: once on brightness statistics (a luminance histogram),
once on brightness and colour statistics (a chroma histogram added). Colour is dropped when
it adds nothing to that accuracy (no more than `COLOUR_MARGIN`, or one image): cells whose stain says
nothing their darkness does not keep only brightness. Photos of cats and dogs, whose colour
histograms add 1 to 6 points, keep colour: in grayscale the small-photo model tested far
lower (BENCHMARKS.md, "Real photos over three seeds"). Each accuracy is the mean of
`REPEATS` cross-validations on different shuffles: one alone moved by several points with the
seed and flipped the choice on the same folder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from PIL import Image

COLOUR_MARGIN = 0.01  # accuracy colour must add to brightness to be kept (a share: 0.01 is 1 point)
THUMBNAIL = 32  # side the images are reduced to; histograms need no detail
FOLDS = 5
REPEATS = 5  # cross-validations averaged, each on its own shuffle


@dataclasses.dataclass(frozen=True)
class ColourEvidence:
    """Cross-validated nearest-centroid accuracy with brightness only and with colour added."""

    brightness_accuracy: float
    colour_accuracy: float
    images: int

    @property
    def colour_helps(self) -> bool:
        """Colour adds more than `COLOUR_MARGIN` and more than one image right in `images` (a
        gain smaller than that is one image's luck on a small folder)."""
        margin = max(COLOUR_MARGIN, 1 / self.images)
        return round(self.colour_accuracy - self.brightness_accuracy, 9) > margin  # 0.71 - 0.7 is 0.01

    def describe(self) -> str:
        verdict = "keeping colour" if self.colour_helps else "training in grayscale (--in-channels 3 keeps colour)"
        return (f"colour check on {self.images} training images: nearest-centroid accuracy "
                f"{self.brightness_accuracy:.2f} from brightness, {self.colour_accuracy:.2f} with colour: {verdict}")


def colour_evidence(images: Sequence[Image.Image], labels: Sequence[int], seed: int = 0) -> ColourEvidence:
    """Compare how well brightness alone and brightness plus colour separate `labels`."""
    brightness, chroma = zip(*(_histograms(image) for image in images))
    brightness, chroma = np.stack(brightness), np.stack(chroma)  # [n, features]
    targets = np.asarray(labels)
    return ColourEvidence(
        brightness_accuracy=_cross_validated_accuracy(brightness, targets, seed),
        colour_accuracy=_cross_validated_accuracy(np.concatenate([brightness, chroma], axis=1), targets, seed),
        images=len(targets),
    )


def colour_thumbnail(image: Image.Image) -> Image.Image:
    """The small RGB copy of an image that its colour features are read from: all that
    `colour_evidence` needs of it, so a caller may keep this and let the image go."""
    return image.convert("RGB").resize((THUMBNAIL, THUMBNAIL), Image.Resampling.BILINEAR)


def _histograms(image: Image.Image) -> tuple[np.ndarray, np.ndarray]:
    """(brightness features, colour features) of one image in YCbCr: the mean, spread and
    12-bin histogram of Y; the means, spreads and 6x6 joint histogram of Cb and Cr."""
    small = colour_thumbnail(image)  # a thumbnail already is one: converting and resizing it copies it
    ycc = np.asarray(small.convert("YCbCr"), dtype=np.float32).reshape(-1, 3) / 255.0  # [pixels, 3]
    y, cb, cr = ycc.T
    luminance = np.histogram(y, bins=12, range=(0, 1))[0] / y.size
    joint = np.histogram2d(cb, cr, bins=6, range=[[0, 1], [0, 1]])[0].ravel() / y.size
    return (np.concatenate([[y.mean(), y.std()], luminance]),
            np.concatenate([[cb.mean(), cr.mean(), cb.std(), cr.std()], joint]))


def _cross_validated_accuracy(features: np.ndarray, targets: np.ndarray, seed: int) -> float:
    """Share of images whose nearest class centroid (features standardised on the other
    folds) is their own class, over `FOLDS` folds, averaged over `REPEATS` seeded shuffles."""
    rng = np.random.default_rng(seed)
    orders = [rng.permutation(len(targets)) for _ in range(REPEATS)]
    return float(np.mean([_fold_accuracy(features, targets, order) for order in orders]))


def _fold_accuracy(features: np.ndarray, targets: np.ndarray, order: np.ndarray) -> float:
    """One cross-validation: `order` dealt into `FOLDS` folds, each held out in turn."""
    correct = 0
    for fold in range(FOLDS):
        held = order[fold::FOLDS]
        fit = np.setdiff1d(order, held)
        mean, std = features[fit].mean(0), features[fit].std(0) + 1e-6
        scaled = (features - mean) / std
        classes = np.unique(targets[fit])
        centroids = np.stack([scaled[fit][targets[fit] == label].mean(0) for label in classes])  # [K, F]
        distances = ((scaled[held][:, None, :] - centroids[None]) ** 2).sum(-1)  # [held, K]
        correct += int((classes[distances.argmin(1)] == targets[held]).sum())
    return correct / len(targets)

"""Bring an input into the model's domain before the usual resize and normalisation.

A model trained on MNIST has only ever seen light digits on black, cropped to the ink,
scaled to 20 of 28 pixels and centred by mass. A phone photo of a digit on paper is
none of that, so the config can record how inputs are brought into that domain
(`ViTConfig.canonicalize`), and `preprocess.to_model_domain` applies it on every path:
training, evaluation, prediction, ONNX Runtime and the app. Torch-free (PIL + NumPy).

    "none"   the image as it is
    "digit"  ink polarity read from the image, uneven lighting flattened, cropped to the
             ink, scaled so its longer side fills 20/28 of the frame, centred by mass
"""

from __future__ import annotations

import numpy as np
from PIL import Image


DIGIT_BOX_SHARE = 20 / 28  # MNIST: the digit's box is 20x20 inside 28x28
WORK_SIDE = 256  # photos are analysed at most this large (the result is a few dozen pixels)
NOISE_FLOOR = 0.1  # ink below this share of the strongest ink is paper texture or noise
CROP_MASS_TAIL = 0.002  # the crop leaves out this share of ink mass at each side
OUTLIER_SPREAD = 2.5  # ink further from the centre of mass (in standard deviations) is dust
MIN_CONTRAST = 24  # gray levels: weaker "ink" than this means there is no digit


class EmptyImageError(ValueError):
    """The image holds no ink to canonicalise (a blank page, an empty drawing)."""


def centre_digit(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """A grayscale ("L") image of one digit -> a light-on-black digit of `size` (height,
    width), framed like MNIST. `preprocess.to_model_mode(image, 1)` gives any image that mode."""
    if image.mode != "L":
        raise ValueError(f"expected a grayscale (L) image, got mode {image.mode}; convert it with to_model_mode")
    ink = ink_map(_work_copy(image))
    return _centre_by_mass(_fit_to_box(_crop_to_ink(ink), size), size)


def _work_copy(gray: Image.Image) -> np.ndarray:
    """Float gray levels [h, w], at most WORK_SIDE large."""
    scale = WORK_SIDE / max(gray.size)
    if scale < 1:
        new_size = (max(1, round(gray.width * scale)), max(1, round(gray.height * scale)))
        gray = gray.resize(new_size, Image.Resampling.BOX)
    return np.asarray(gray, dtype=np.float32)


def ink_map(gray: np.ndarray) -> np.ndarray:
    """Gray levels [h, w] -> ink strength [h, w] in [0, 255], background 0.

    The background is the majority of pixels: if the median is nearer the bright end the
    ink is dark (paper), else light (a chalkboard, MNIST). The background's brightness is
    modelled as a smooth quadratic surface fitted to the background pixels, so a gradient
    of light across a photo is not mistaken for ink.
    """
    low, median, high = np.percentile(gray, [1, 50, 99])
    if high - low < MIN_CONTRAST:
        raise EmptyImageError("expected an image of a digit, found a blank image (no ink)")
    dark_ink = median > (low + high) / 2
    signal = 255.0 - gray if dark_ink else gray  # ink is now the bright minority
    ink = np.clip(signal - _background(signal), 0.0, None)
    strongest = np.percentile(ink, 99.9)
    if strongest < MIN_CONTRAST:
        raise EmptyImageError("expected an image of a digit, found no ink standing out from the background")
    ink = np.clip(ink / strongest, 0.0, 1.0)
    ink[ink < NOISE_FLOOR] = 0.0
    return ink * 255.0


def _background(signal: np.ndarray) -> np.ndarray:
    """A quadratic surface a + bx + cy + dx^2 + exy + fy^2 fitted to the background pixels
    (those below the median, where the ink, the bright minority, is not), refitted once
    without the pixels far above the first fit."""
    values = signal.ravel()
    chosen = values <= np.median(values)
    if np.ptp(values[chosen]) == 0:  # a flat background (a scan, MNIST): nothing to fit
        return np.full(signal.shape, values[chosen][0])
    height, width = signal.shape
    rows, cols = np.mgrid[0:height, 0:width]
    y, x = rows.ravel() / max(1, height - 1) - 0.5, cols.ravel() / max(1, width - 1) - 0.5
    basis = np.stack([np.ones_like(x), x, y, x * x, x * y, y * y], axis=1)  # [h*w, 6]
    for _ in range(2):
        coefficients, *_ = np.linalg.lstsq(basis[chosen], values[chosen], rcond=None)
        fitted = basis @ coefficients
        residual = values - fitted
        chosen = residual <= np.percentile(residual, 50) + 2.0 * residual[chosen].std()
    return fitted.reshape(height, width)


def _crop_to_ink(ink: np.ndarray) -> np.ndarray:
    """The ink's bounding box, without what lies far from the ink's mass (specks of dust, a
    smudge at the edge of a photo) or a sliver of mass at each side."""
    ink = _without_outliers(ink)
    bounds = []
    for axis in (1, 0):  # rows, then columns
        mass = np.cumsum(ink.sum(axis=axis))
        first = int(np.searchsorted(mass, CROP_MASS_TAIL * mass[-1], side="right"))
        last = int(np.searchsorted(mass, (1 - CROP_MASS_TAIL) * mass[-1], side="left"))
        bounds.append((first, max(first, last) + 1))
    (top, bottom), (left, right) = bounds
    return ink[top:bottom, left:right]


def _without_outliers(ink: np.ndarray) -> np.ndarray:
    """Ink more than OUTLIER_SPREAD standard deviations from the centre of mass (per axis)
    set to 0. A digit's own ink lies within 1.8 of them even when spread evenly."""
    mass = ink.sum()
    if mass <= 0:
        raise EmptyImageError("expected an image of a digit, found no ink standing out from the background")
    rows, cols = np.indices(ink.shape)
    keep = np.ones(ink.shape, dtype=bool)
    for position in (rows, cols):
        centre = (position * ink).sum() / mass
        spread = np.sqrt(((position - centre) ** 2 * ink).sum() / mass)
        keep &= np.abs(position - centre) <= OUTLIER_SPREAD * spread + 1
    return np.where(keep, ink, 0.0)


def _fit_to_box(ink: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Scale [h, w] ink so its longer side fills DIGIT_BOX_SHARE of `size`, keeping its aspect."""
    box_h, box_w = (max(1, round(side * DIGIT_BOX_SHARE)) for side in size)
    scale = min(box_h / ink.shape[0], box_w / ink.shape[1])
    new_h, new_w = max(1, round(ink.shape[0] * scale)), max(1, round(ink.shape[1] * scale))
    resized = Image.fromarray(ink.astype(np.float32)).resize((new_w, new_h), Image.Resampling.LANCZOS)
    return np.clip(np.asarray(resized), 0.0, 255.0)


def _centre_by_mass(ink: np.ndarray, size: tuple[int, int]) -> Image.Image:
    """Paste [h, w] ink into a black canvas of `size`, its centre of mass in the middle."""
    height, width = size
    mass = ink.sum()
    if mass <= 0:
        raise EmptyImageError("expected an image of a digit, found no ink standing out from the background")
    rows, cols = np.indices(ink.shape)
    centre_row, centre_col = (rows * ink).sum() / mass, (cols * ink).sum() / mass
    top = int(np.clip(round(height / 2 - centre_row), 0, height - ink.shape[0]))
    left = int(np.clip(round(width / 2 - centre_col), 0, width - ink.shape[1]))
    canvas = np.zeros((height, width), dtype=np.float32)
    canvas[top:top + ink.shape[0], left:left + ink.shape[1]] = ink
    return Image.fromarray(canvas.round().astype(np.uint8))

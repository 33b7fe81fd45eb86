"""Training augmentation: a decoded image -> random variation of it, as uint8 pixels.

`TrainTransform` runs in two halves. `prepare` runs in a DataLoader worker: the config's
canonical form (`preprocess.to_model_domain`), then PIL work chosen by `--augment`, ending
in uint8 pixels [C, H, W] and the box random erasing will blank. `ModelInput` runs in the
training step on the batch's device: scale, normalise (`preprocess.normalize`, the one
every inference path uses) and erase the boxes.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image, ImageFilter, ImageStat
from torchvision import transforms
from torchvision.transforms import v2

from vit_hub.data.choices import AUGMENTATIONS
from vit_hub.errors import DataError
from vit_hub.model.config import ViTConfig
from vit_hub.processing.preprocess import channels_first, dataset_stats, normalize, resize, to_model_domain

CROP_SCALE = (0.5, 1.0)  # share of the image a random-resized crop keeps
ELASTIC_ALPHA, ELASTIC_SIGMA = 8.0, 3.0  # digits: displacement field strength and smoothness, in pixels
NOISE_LEVELS = 20.0  # digits: the largest sensor-noise deviation, in gray levels
GAP_RADIUS = (1.0, 2.0)  # digits: the radius range of a gap cut into a stroke, in pixels (MNIST's strokes are ~3 wide)


class ModelInput:
    """The last step of training's preprocessing, on whatever device the batch is on: uint8
    pixels [B, C, H, W] -> `preprocess.normalize` (float32, the config's mean and std or each
    image's own), then random erasing where a box is given. Run on the GPU in the training
    step, it takes the per-pixel float work off the DataLoader workers, and a uint8 batch is
    a quarter of the bytes through shared memory and PCIe. With the config's mean and std
    the result equals `preprocess` bit for bit (tested on the CPU)."""

    def __init__(self, config: ViTConfig):
        self.config = config
        self._stats: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # made once per device

    def __call__(self, pixels: torch.Tensor, boxes: torch.Tensor | None = None) -> torch.Tensor:
        if pixels.device not in self._stats:
            self._stats[pixels.device] = tuple(torch.from_numpy(values).to(pixels.device)
                                               for values in dataset_stats(self.config))
        images = normalize(pixels, self.config, self._stats[pixels.device])
        if boxes is not None:
            images = images.masked_fill_(_box_masks(boxes.to(images.device), *images.shape[-2:])[:, None], 0.0)
        return images


def _box_masks(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[B, 4] boxes (top, left, height, width; height 0: none) -> [B, H, W] bool masks."""
    top, left, box_height, box_width = (column[:, None, None] for column in boxes.unbind(1))
    rows = torch.arange(height, device=boxes.device)[None, :, None]
    columns = torch.arange(width, device=boxes.device)[None, None, :]
    return (rows >= top) & (rows < top + box_height) & (columns >= left) & (columns < left + box_width)


NO_BOX = (0, 0, 0, 0)
GREY = np.array([0.299, 0.587, 0.114])  # luma weights of PIL's and torchvision's grayscale
BRIGHTNESS, CONTRAST, SATURATION, HUE = range(4)  # colour_jitter's maps, in torchvision's numbering


class TrainTransform:
    """Random augmentation, then the same conversion and normalisation as EvalTransform.

    digits: small random affine (rotation, shift, scale, shear) of the resized image; for
        canonicalised digits (`canonicalize: digit`) then what canonicalising an upload leaves
        (`upload_variations`): elastic distortion, a stroke a little thicker or thinner, a
        short gap in a stroke, blur and sensor noise. Other grayscale images (a photo folder
        trained in grayscale) get the affine alone: those changes copy a pen, not a camera.
    photos: random-resized crop that keeps most of the frame (a small object is not cropped
        away), horizontal flip, colour jitter (another camera, stain or light: brightness,
        contrast, saturation and hue), RandAugment, then random erasing.

    It runs in two halves: `prepare` (in a DataLoader worker: decode-side PIL work, ending in
    uint8 pixels and the box random erasing will blank) and `ModelInput` (in the training
    step, on the device). Calling the transform does both, for one image.
    """

    def __init__(self, config: ViTConfig, augment: str):
        self.config = config
        self.augment = resolve_augment(augment, config)
        self.model_input = ModelInput(config)
        self.as_uploads = self.augment == "digits" and config.canonicalize == "digit"
        if self.augment == "digits":
            self.affine = v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1), shear=8)
            self.elastic = v2.RandomApply([v2.ElasticTransform(alpha=ELASTIC_ALPHA, sigma=ELASTIC_SIGMA)], p=0.5)
        elif self.augment == "photos":
            self.rand_augment = v2.RandAugment(num_ops=2, magnitude=9)

    def prepare(self, image: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoded image -> (uint8 pixels [C, H, W] at the model's size, erasing box [4])."""
        return self.augment_image(to_model_domain(image, self.config))

    def augment_image(self, image: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
        """An image already in the model's domain (`to_model_domain`, deterministic, so a
        caller may compute it once and keep it) -> the random half of `prepare`."""
        box = NO_BOX
        if self.augment == "photos":
            image = random_resized_crop(image, self.config)
            if torch.rand(1) < 0.5:
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            image = self.rand_augment(colour_jitter(image))
            box = erasing_box(*self.config.image_size)
        elif self.augment == "digits":
            image = self.affine(resize(image, self.config))
            if self.as_uploads:
                image = upload_variations(self.elastic(image))
        else:
            image = resize(image, self.config)
        return uint8_pixels(image), torch.tensor(box, dtype=torch.int32)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        pixels, box = self.prepare(image)
        return self.model_input(pixels[None], box[None])[0]


def upload_variations(digit: Image.Image) -> Image.Image:
    """A canonical digit ("L", light on black) as canonicalising people's uploads leaves it,
    each change with its own chance: strokes up to half a pixel thicker or thinner (the stroke width
    is set from an estimate), a short gap in a stroke (a pen that skipped, a loop left open),
    blurred (a soft photo) and speckled (sensor noise)."""
    if torch.rand(1) < 0.3:
        pen = ImageFilter.MaxFilter(3) if torch.rand(1) < 0.5 else ImageFilter.MinFilter(3)
        digit = Image.blend(digit, digit.filter(pen), 0.5 * float(torch.rand(1)))
    if torch.rand(1) < 0.3:
        digit = with_pen_gap(digit)
    if torch.rand(1) < 0.3:
        digit = digit.filter(ImageFilter.GaussianBlur(0.3 + 0.5 * float(torch.rand(1))))
    if torch.rand(1) < 0.3:
        noise = torch.randn(digit.height, digit.width) * (NOISE_LEVELS * float(torch.rand(1)))
        digit = Image.fromarray((torch.from_numpy(np.asarray(digit, dtype=np.float32)) + noise)
                                .clamp(0, 255).round().to(torch.uint8).numpy())
    return digit


def with_pen_gap(digit: Image.Image) -> Image.Image:
    """A canonical digit ("L", light on black) with the ink within 1-2 pixels of one random
    inked pixel taken away, a soft-edged gap in a stroke; a digit with no ink is returned as it is."""
    pixels = np.asarray(digit, dtype=np.float32)
    inked = np.flatnonzero(pixels >= 128)
    if inked.size == 0:
        return digit
    row, col = divmod(int(inked[int(torch.randint(inked.size, (1,)))]), pixels.shape[1])
    rows, cols = np.indices(pixels.shape)
    radius = GAP_RADIUS[0] + (GAP_RADIUS[1] - GAP_RADIUS[0]) * float(torch.rand(1))
    kept = np.clip(np.hypot(rows - row, cols - col) - radius, 0.0, 1.0)  # [H, W] 0 inside the gap, 1 a pixel out
    return Image.fromarray((pixels * kept).round().astype(np.uint8))


def uint8_pixels(image: Image.Image) -> torch.Tensor:
    """An "L" or "RGB" image -> uint8 tensor [C, H, W]."""
    return torch.from_numpy(np.ascontiguousarray(channels_first(np.array(image))))


def random_resized_crop(image: Image.Image, config: ViTConfig) -> Image.Image:
    """A random part of the image (CROP_SCALE of its area, aspect 3:4 to 4:3), resized to the
    model's size in one resampling (PIL reads the box; no crop is copied first)."""
    top, left, height, width = transforms.RandomResizedCrop.get_params(image, list(CROP_SCALE), [3 / 4, 4 / 3])
    size_y, size_x = config.image_size
    resample = Image.Resampling[config.interpolation.upper()]  # the filter `preprocess.resize` uses
    return image.resize((size_x, size_y), resample, box=(left, top, left + width, top + height))


def colour_jitter(image: Image.Image, brightness: float = 0.3, contrast: float = 0.3, saturation: float = 0.3,
                  hue: float = 0.1) -> Image.Image:
    """torchvision's ColorJitter (these factors, a random order each image) as one affine
    colour map, applied in a single pass (PIL's matrix convert; a lookup table for "L"):
    brightness scales, contrast blends towards the mean grey, saturation towards each pixel's
    grey, hue turns colours about the grey axis by up to hue x 360 degrees (red towards green
    for a positive turn, as a hue shift does). Composing the four maps first means the pixels
    are visited once rather than four times (it runs per image in the loader workers; the
    saving is measured in BENCHMARKS.md), and values are clipped once, at the end."""
    order = torch.randperm(4).tolist()
    factors = [float(torch.empty(1).uniform_(1 - spread, 1 + spread)) for spread in (brightness, contrast, saturation)]
    turn = float(torch.empty(1).uniform_(-hue, hue))
    colour = image.mode == "RGB"
    means = np.asarray(ImageStat.Stat(image).mean)
    grey = GREY if colour else np.ones(1)
    amounts = [*factors, turn]  # by operation: BRIGHTNESS, CONTRAST, SATURATION, HUE
    matrix, offset = np.eye(len(means)), np.zeros(len(means))
    for operation in order:
        if not colour and operation in (SATURATION, HUE):
            continue  # saturation and hue leave a grey image as it is
        step, shift = _colour_step(operation, amounts[operation], grey, matrix @ means + offset)
        matrix, offset = step @ matrix, step @ offset + shift
    if colour:
        return image.convert("RGB", tuple(np.concatenate([matrix, offset[:, None]], axis=1).ravel().tolist()))
    table = np.clip(np.round(matrix[0, 0] * np.arange(256) + offset[0]), 0, 255).astype(np.uint8)
    return image.point(table.tolist())


def _colour_step(operation: int, amount: float, grey: np.ndarray, mean: np.ndarray) -> tuple[np.ndarray, np.ndarray | float]:
    """One of ColorJitter's maps as (matrix, shift): colour -> matrix @ colour + shift. `amount`:
    the drawn factor (the turn, for HUE); `grey`: the weights that make a colour grey ([1] for
    "L"); `mean`: the image's mean colour after the maps applied before this one."""
    identity = np.eye(len(grey))
    if operation == BRIGHTNESS:
        return amount * identity, 0.0
    if operation == CONTRAST:  # towards the mean grey
        return amount * identity, (1 - amount) * grey @ mean
    if operation == SATURATION:  # towards each pixel's grey
        return amount * identity + (1 - amount) * np.outer(np.ones(len(grey)), grey), 0.0
    return _hue_turn(2 * np.pi * amount), 0.0


def _hue_turn(angle: float) -> np.ndarray:
    """Rotation of RGB space by `angle` about the grey axis (1, 1, 1) (Rodrigues' formula)."""
    axis = np.ones(3) / np.sqrt(3)
    cross = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    return np.cos(angle) * np.eye(3) + np.sin(angle) * cross + (1 - np.cos(angle)) * np.outer(axis, axis)


def erasing_box(height: int, width: int, p: float = 0.25, scale=(0.02, 0.33), ratio=(0.3, 3.3)) -> tuple:
    """The box random erasing blanks (torchvision's RandomErasing parameters): (top, left,
    height, width), or NO_BOX for the three images in four it leaves alone."""
    if torch.rand(1) >= p:
        return NO_BOX
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        area = height * width * torch.empty(1).uniform_(*scale).item()
        aspect = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
        box_height, box_width = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
        if box_height < height and box_width < width:
            top = int(torch.randint(0, height - box_height + 1, size=(1,)))
            left = int(torch.randint(0, width - box_width + 1, size=(1,)))
            return top, left, box_height, box_width
    return NO_BOX


def resolve_augment(augment: str, config: ViTConfig) -> str:
    if augment not in AUGMENTATIONS:
        raise DataError(f"--augment: expected one of {', '.join(AUGMENTATIONS)}, got {augment!r}")
    if augment != "auto":
        return augment
    return "digits" if config.in_channels == 1 and max(config.image_size) <= 64 else "photos"


"""Training augmentation: a decoded image -> random variation of it, as uint8 pixels.

`TrainTransform` runs in two halves. `prepare` runs in a DataLoader worker and does what each
file needs: the config's canonical form (`preprocess.to_model_domain`), then for photos the
random-resized crop's box cut out (reduced by a whole factor when it is far larger than the
model's size) and every random number of the image's augmentation drawn; for digits the PIL
work of `--augment digits`. It ends in uint8 pixels and a row of draws. `finish` runs on the
batch, on the device the step runs on: photos are resampled and augmented there
(`batch_augmentation.augment_photos`), then `ModelInput` normalises and erases. With
`per_image` (a CPU-only machine, where the workers' cores are the only ones free) the worker
applies the photo's draws itself with PIL (`batch_augmentation.augment_photo`), and `finish`
only normalises and erases.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageFilter
from torchvision.transforms import v2

from vit_hub.data.batch_augmentation import (ERASE, augment_photo, augment_photos, crop_box, draw_photo_augmentation,
                                             unaugmented_draws)
from vit_hub.data.choices import AUGMENTATIONS
from vit_hub.errors import DataError
from vit_hub.model.config import ViTConfig
from vit_hub.processing.preprocess import dataset_stats, normalize, resize, to_model_domain

CROP_SCALE = (0.5, 1.0)  # share of the image a random-resized crop keeps
ELASTIC_ALPHA, ELASTIC_SIGMA = 8.0, 3.0  # digits: displacement field strength and smoothness, in pixels
NOISE_LEVELS = 20.0  # digits: the largest sensor-noise deviation, in gray levels
GAP_RADIUS = (1.0, 2.0)  # digits: the radius range of a gap cut into a stroke, in pixels (MNIST's strokes are ~3 wide)


class ModelInput:
    """The last step of training's preprocessing, on whatever device the batch is on: uint8
    pixels [B, C, H, W] -> `preprocess.normalize` (float32, the config's mean and std or each
    image's own), then random erasing of each image's box (its draws' ERASE; height 0: none).
    A uint8 batch is a quarter of the bytes through shared memory and PCIe. With the config's
    mean and std the result equals `preprocess` bit for bit (tested on the CPU)."""

    def __init__(self, config: ViTConfig):
        self.config = config
        self._stats: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # made once per device

    def __call__(self, pixels: torch.Tensor, draws: torch.Tensor | None = None) -> torch.Tensor:
        if pixels.device not in self._stats:
            self._stats[pixels.device] = tuple(torch.from_numpy(values).to(pixels.device)
                                               for values in dataset_stats(self.config))
        images = normalize(pixels, self.config, self._stats[pixels.device])
        if draws is not None:
            boxes = draws[:, ERASE].to(images.device).long()
            images = images.masked_fill_(_box_masks(boxes, *images.shape[-2:])[:, None], 0.0)
        return images


def _box_masks(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[B, 4] boxes (top, left, height, width; height 0: none) -> [B, H, W] bool masks."""
    top, left, box_height, box_width = (column[:, None, None] for column in boxes.unbind(1))
    rows = torch.arange(height, device=boxes.device)[None, :, None]
    columns = torch.arange(width, device=boxes.device)[None, None, :]
    return (rows >= top) & (rows < top + box_height) & (columns >= left) & (columns < left + box_width)


class TrainTransform:
    """Random augmentation, then the same conversion and normalisation as EvalTransform.

    digits: small random affine (rotation, shift, scale, shear) of the resized image; for
        canonicalised digits (`canonicalize: digit`) then what canonicalising an upload leaves
        (`upload_variations`): elastic distortion, a stroke a little thicker or thinner, a
        short gap in a stroke, blur and sensor noise. Other grayscale images (a photo folder
        trained in grayscale) get the affine alone: those changes copy a pen, not a camera.
    photos: random-resized crop that keeps most of the frame (a small object is not cropped
        away), horizontal flip, colour jitter (another camera, stain or light: brightness,
        contrast, saturation and hue), RandAugment, then random erasing; drawn per image in
        `prepare`, applied per batch in `finish` (`batch_augmentation`), or with `per_image`
        in `prepare` itself, with PIL (what a CPU-only machine does fastest).

    Calling the transform does both halves, for one image.
    """

    def __init__(self, config: ViTConfig, augment: str, per_image: bool = False):
        self.config = config
        self.augment = resolve_augment(augment, config)
        self.per_image = per_image
        self.model_input = ModelInput(config)
        self.as_uploads = self.augment == "digits" and config.canonicalize == "digit"
        if self.augment == "digits":
            self.affine = v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1), shear=8)
            self.elastic = v2.RandomApply([v2.ElasticTransform(alpha=ELASTIC_ALPHA, sigma=ELASTIC_SIGMA)], p=0.5)

    def prepare(self, image: Image.Image, seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoded image -> (uint8 pixels [h, w, C], draws [DRAW_SIZE]): for photos the crop
        the batch resamples (augmented at the model's size with `per_image`), otherwise the
        model's size. `seed` (default: drawn from torch's generator) decides every random
        choice."""
        return self.augment_image(to_model_domain(image, self.config), seed)

    def augment_image(self, image: Image.Image, seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """An image already in the model's domain (`to_model_domain`, deterministic, so a
        caller may compute it once and keep it) -> the random half of `prepare`."""
        seed = int(torch.randint(2**62, ())) if seed is None else seed
        if self.augment == "photos":
            rng = np.random.default_rng(seed)
            crop = random_crop(image, self.config, rng)
            draws = draw_photo_augmentation(rng, (crop.height, crop.width), self.config.image_size)
            if self.per_image:
                crop = augment_photo(crop, draws, self.config.image_size, self.config.interpolation)
            return uint8_pixels(crop), draws
        # devices=[]: torchvision's transforms draw from the CPU generator only; forking every
        # CUDA device's generator as well would cost time on every sample
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            if self.augment == "digits":
                image = self.affine(resize(image, self.config))
                if self.as_uploads:
                    image = upload_variations(self.elastic(image))
            else:
                image = resize(image, self.config)
        return uint8_pixels(image), unaugmented_draws(*self.config.image_size)

    def augment_batch(self, pixels: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
        """`prepare`'s pixels, padded into a batch [B, C, Hmax, Wmax] (`CropBatches`), and
        draws [B, DRAW_SIZE] -> uint8 [B, C, H, W]: photos resampled and augmented, others (and
        photos augmented `per_image`) as they are."""
        if self.augment != "photos" or self.per_image:
            return pixels
        return augment_photos(pixels, draws, self.config.image_size, self.config.interpolation)

    def finish(self, pixels: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
        """`augment_batch`, then `model_input`: the batch as the model takes it."""
        return self.model_input(self.augment_batch(pixels, draws), draws)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        pixels, draws = self.prepare(image)
        return self.finish(pixels.permute(2, 0, 1)[None], draws[None])[0]  # a batch of one, as CropBatches lays it out


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
    """An "L" or "RGB" image -> uint8 tensor [H, W, C], channels last as decoded (the
    batch's collate puts channels first as it copies each image in)."""
    pixels = np.array(image)
    return torch.from_numpy(pixels[..., None] if pixels.ndim == 2 else pixels)


def random_crop(image: Image.Image, config: ViTConfig, rng: np.random.Generator) -> Image.Image:
    """The box of a random-resized crop (CROP_SCALE of the image's area, aspect 3:4 to 4:3),
    cut out and, when it is twice the model's size or more on both sides, shrunk by the whole
    factor that leaves it 1-2 times that size (PIL's reduce: the mean of each factor x factor
    block, as PIL's resize does first with `reducing_gap=1`), so the worker sends at most 4x
    the model's pixels; the batch resamples it to the model's size (`augment_photos`)."""
    top, left, height, width = crop_box(rng, image.height, image.width, CROP_SCALE)
    size_y, size_x = config.image_size
    factor = max(1, min(height // size_y, width // size_x))
    box = (left, top, left + width, top + height)
    return image.crop(box) if factor == 1 else image.reduce(factor, box=box)


def resolve_augment(augment: str, config: ViTConfig) -> str:
    if augment not in AUGMENTATIONS:
        raise DataError(f"--augment: expected one of {', '.join(AUGMENTATIONS)}, got {augment!r}")
    if augment != "auto":
        return augment
    return "digits" if config.in_channels == 1 and max(config.image_size) <= 64 else "photos"


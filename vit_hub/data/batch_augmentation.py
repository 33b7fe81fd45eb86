"""Photo augmentation: every random number drawn per image, the pixels done per batch or per image.

A loader worker does what each file needs (`augmentation.TrainTransform.prepare`): it decodes,
cuts the random-resized crop's box out of the image, and draws every random number the image's
augmentation will use, from the sample's own seed (`draw_photo_augmentation`). Where the step
runs on a GPU, the per-pixel work then runs there, on the batch, with each image's own draws
(`augment_photos`):

    uint8 crops, padded [B, C, Hmax, Wmax]  +  draws [B, DRAW_SIZE]
      -> resample to the model's size (the config's filter, as PIL computes it), mirrored
         where the draw says -> colour jitter -> RandAugment (2 ops, magnitude 9)
      -> uint8 [B, C, H, W]; `augmentation.ModelInput` then normalises and erases

The draws follow torchvision's distributions (RandomResizedCrop, ColorJitter's factors,
RandAugment's operations and magnitudes, RandomErasing), from a NumPy generator seeded per
sample: a few microseconds an image, where torch's one-number draws cost a tenth of a
millisecond.
Libraries that augment batches were weighed first: torchvision.transforms.v2 draws one set
of parameters per call, and kornia.augmentation's RandAugment samples its own policy (a
different operation set and magnitude scale) rather than torchvision's. So the draws stay
torchvision's and RandAugment's operations run as torchvision's own functionals, once for
each (operation, magnitude) a batch drew, on the images that drew it.

On a CPU-only machine the worker applies the same draws to its image with PIL instead
(`augment_photo`): PIL's uint8 kernels beat float tensor operations on a CPU core, and there
is no device for the batch to go to. Both forms draw alike and compose the same colour map;
they differ only in rounding (PIL's resampling and colour matrix work in fixed point).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from PIL import Image, ImageStat
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

# RandAugment as TrainTransform configures it (torchvision's defaults for the rest)
RAND_AUGMENT_OPS, RAND_AUGMENT_MAGNITUDE = 2, 9
RAND_AUGMENT_SPACE = v2.RandAugment._AUGMENTATION_SPACE  # name -> (magnitudes(bins, height, width), signed)
RAND_AUGMENT_NAMES = tuple(RAND_AUGMENT_SPACE)
JITTER = (0.3, 0.3, 0.3, 0.1)  # brightness, contrast, saturation, hue: ColorJitter's factors
GREY = (0.299, 0.587, 0.114)  # luma weights of PIL's and torchvision's grayscale
BRIGHTNESS, CONTRAST, SATURATION, HUE = range(4)  # colour jitter's maps, in torchvision's numbering

# One image's draws, as a float32 row (small integers and factors, all exact in float32):
CROP = slice(0, 2)  # the crop's height and width as sent (its pixels fill the top left of the padded batch)
FLIP = 2  # 1: mirror left to right
JITTER_ORDER = slice(3, 7)  # the order of the four colour maps
JITTER_AMOUNTS = slice(7, 11)  # brightness, contrast and saturation factors; the hue turn
OPS = slice(11, 13)  # RandAugment's operations, as indices into RAND_AUGMENT_NAMES
MAGNITUDES = slice(13, 15)  # each operation's signed magnitude
ERASE = slice(15, 19)  # random erasing's box: top, left, height, width (height 0: none)
DRAW_SIZE = 19
NO_BOX = (0, 0, 0, 0)


def unaugmented_draws(height: int, width: int) -> torch.Tensor:
    """The draws of an image left as it is: [DRAW_SIZE]."""
    return _draws_row((height, width), 0.0, [0, 1, 2, 3], [1.0, 1.0, 1.0, 0.0], [(0, 0.0)] * RAND_AUGMENT_OPS, NO_BOX)


def crop_box(rng: np.random.Generator, height: int, width: int, scale=(0.5, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple:
    """A random-resized crop's box in an image of this size (RandomResizedCrop's distribution:
    `scale` of the area, the aspect ratio log-uniform in `ratio`, up to ten tries, else the
    centre's largest box within `ratio`): (top, left, height, width)."""
    for _ in range(10):
        area = height * width * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        box_width, box_height = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < box_width <= width and 0 < box_height <= height:
            top, left = rng.integers(height - box_height + 1), rng.integers(width - box_width + 1)
            return int(top), int(left), box_height, box_width
    box_width = min(width, round(height * ratio[1]))
    box_height = min(height, round(box_width / ratio[0]))
    return (height - box_height) // 2, (width - box_width) // 2, box_height, box_width


def draw_photo_augmentation(rng: np.random.Generator, crop_size: tuple[int, int],
                            image_size: tuple[int, int]) -> torch.Tensor:
    """One photo's draws after its crop box: flip, colour jitter (ColorJitter's random order
    and factors), RandAugment's two operations and signs (as v2.RandAugment draws them), and
    random erasing's box. -> [DRAW_SIZE]"""
    flip = float(rng.random() < 0.5)
    order = rng.permutation(4).tolist()
    amounts = [*rng.uniform([1 - spread for spread in JITTER[:3]], [1 + spread for spread in JITTER[:3]]).tolist(),
               float(rng.uniform(-JITTER[HUE], JITTER[HUE]))]
    operations = [_draw_rand_augment_op(rng, *image_size) for _ in range(RAND_AUGMENT_OPS)]
    return _draws_row(crop_size, flip, order, amounts, operations, erasing_box(rng, *image_size))


def _draws_row(crop_size: tuple[int, int], flip: float, order: list[int], amounts: list[float],
               operations: list[tuple[int, float]], box: tuple) -> torch.Tensor:
    """The draws as one float32 row, in the order of the slices above."""
    ops, magnitudes = zip(*operations)
    return torch.tensor([*crop_size, flip, *order, *amounts, *ops, *magnitudes, *box], dtype=torch.float32)


def erasing_box(rng: np.random.Generator, height: int, width: int, p: float = 0.25, scale=(0.02, 0.33),
                ratio=(0.3, 3.3)) -> tuple:
    """The box random erasing blanks (RandomErasing's distribution): (top, left, height,
    width), or NO_BOX for the three images in four it leaves alone."""
    if rng.random() >= p:
        return NO_BOX
    for _ in range(10):
        area = height * width * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        box_height, box_width = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
        if box_height < height and box_width < width:
            top, left = rng.integers(height - box_height + 1), rng.integers(width - box_width + 1)
            return int(top), int(left), box_height, box_width
    return NO_BOX


def _draw_rand_augment_op(rng: np.random.Generator, height: int, width: int) -> tuple[int, float]:
    """One of RandAugment's operations, uniformly, and its magnitude, negative half the time
    for the operations v2.RandAugment signs."""
    op = int(rng.integers(len(RAND_AUGMENT_NAMES)))
    magnitude, signed = _magnitude(op, height, width)
    return op, -magnitude if signed and rng.random() < 0.5 else magnitude


@functools.lru_cache(maxsize=256)
def _magnitude(op: int, height: int, width: int) -> tuple[float, bool]:
    """RandAugment's operation `op` at RAND_AUGMENT_MAGNITUDE of its 31 bins (v2.RandAugment's
    num_magnitude_bins) for an image of this size: (magnitude, whether its sign is drawn)."""
    magnitudes, signed = RAND_AUGMENT_SPACE[RAND_AUGMENT_NAMES[op]]
    bins = magnitudes(31, height, width)
    return (0.0, False) if bins is None else (float(bins[RAND_AUGMENT_MAGNITUDE]), signed)


def augment_photos(crops: torch.Tensor, draws: torch.Tensor, image_size: tuple[int, int],
                   interpolation: str) -> torch.Tensor:
    """uint8 crops [B, C, Hmax, Wmax] (each in its top left corner, sized by its draws) ->
    augmented uint8 images [B, C, H, W] at `image_size`."""
    images = resample(crops, draws[:, CROP].long(), draws[:, FLIP].bool(), image_size, interpolation)
    images = colour_jitter(images, draws[:, JITTER_ORDER].long(), draws[:, JITTER_AMOUNTS])
    for slot in range(RAND_AUGMENT_OPS):
        images = rand_augment_op(images, draws[:, OPS.start + slot].long(), draws[:, MAGNITUDES.start + slot])
    return images


def augment_photo(crop: Image.Image, draws: torch.Tensor, image_size: tuple[int, int], interpolation: str) -> Image.Image:
    """One crop ("L" or "RGB") through its draws [DRAW_SIZE] with PIL, the per-image form of
    `augment_photos`: resized to `image_size` with the config's filter, mirrored where drawn,
    colour-jittered by the batch's own colour map, then RandAugment's operations
    (torchvision's on PIL). Erasing is left to `ModelInput`, as for the batch."""
    height, width = image_size
    image = crop.resize((width, height), Image.Resampling[interpolation.upper()])
    if draws[FLIP]:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    image = _jitter_colours(image, draws)
    for op, magnitude in zip(draws[OPS].long().tolist(), draws[MAGNITUDES].tolist()):
        if RAND_AUGMENT_NAMES[op] != "Identity":
            image = apply_op(image, RAND_AUGMENT_NAMES[op], magnitude)
    return image


def _jitter_colours(image: Image.Image, draws: torch.Tensor) -> Image.Image:
    """The batch's `colour_map` of one image, applied by PIL in one pass: a colour matrix
    convert for "RGB", a lookup table for "L" (both round and clip to uint8)."""
    means = torch.tensor(ImageStat.Stat(image).mean)[None]  # [1, C]
    matrix, offset = colour_map(draws[None, JITTER_ORDER].long(), draws[None, JITTER_AMOUNTS], means)
    if image.mode == "RGB":
        return image.convert("RGB", tuple(torch.cat([matrix[0], offset[0, :, None]], dim=1).flatten().tolist()))
    table = (matrix[0, 0, 0] * torch.arange(256) + offset[0, 0]).round().clamp(0, 255)
    return image.point(table.to(torch.uint8).tolist())


# Resampling ---------------------------------------------------------------------------------------
def _filter(name: str, x: torch.Tensor) -> torch.Tensor:
    """PIL's resampling filters (Resample.c), of the distance in input pixels (scaled)."""
    if name == "box":
        return ((x > -0.5) & (x <= 0.5)).to(x.dtype)
    x = x.abs()
    if name == "bilinear":
        return (1 - x).clamp(min=0)
    if name == "hamming":
        return torch.where(x < 1, torch.sinc(x) * (0.54 + 0.46 * torch.cos(math.pi * x)), 0.0)
    if name == "bicubic":  # a = -0.5
        near = (1.5 * x - 2.5) * x * x + 1
        far = ((-0.5 * x + 2.5) * x - 4) * x + 2
        return torch.where(x < 1, near, torch.where(x < 2, far, 0.0))
    if name == "lanczos":
        return torch.where(x < 3, torch.sinc(x) * torch.sinc(x / 3), 0.0)
    raise ValueError(f"interpolation: expected one of PIL's filters, got {name!r}")


SUPPORT = {"nearest": 0.5, "box": 0.5, "bilinear": 1.0, "hamming": 1.0, "bicubic": 2.0, "lanczos": 3.0}  # reach


def resample_weights(sizes: torch.Tensor, out: int, padded: int, interpolation: str) -> torch.Tensor:
    """[B] input lengths along one axis -> [B, out, padded] weights that resample each image's
    first `sizes[b]` pixels to `out`, as PIL's resize computes them: output pixel o is centred
    at (o + 0.5) * scale in the input, and the filter is widened by the scale when shrinking
    (an average over what the output pixel covers, not a sample of it). Each output pixel's
    weights are computed on its window of K pixels only, in float64 as PIL computes them (a
    centre or a filter edge can fall on a whole pixel), then placed in the dense matrix."""
    sizes = sizes.double()[:, None, None]  # [B, 1, 1]
    scale = sizes / out
    widen = scale.clamp(min=1.0)
    reach = SUPPORT[interpolation] * widen  # [B, 1, 1]: how far a filter reaches, in input pixels
    taps = int(2 * reach.max().ceil()) + 2  # K: the widest window of the batch
    if interpolation == "nearest":  # PIL steps through the input adding the scale (Geometry.c's affine_scale)
        steps = scale.cpu().expand(-1, out, 1).clone()
        steps[:, 0] *= 0.5
        first = steps.cumsum(1).to(sizes.device).floor()  # [B, out, 1]: sequential sums, as PIL's
        pixels = first + torch.zeros(taps, device=sizes.device, dtype=torch.float64)
        weights = (pixels == first).double()
    else:
        centres = (torch.arange(out, device=sizes.device, dtype=torch.float64)[None, :, None] + 0.5) * scale
        first = (centres - reach + 0.5).floor()  # [B, out, 1]: PIL's window is [first, last)
        pixels = first + torch.arange(taps, device=sizes.device, dtype=torch.float64)  # [B, out, K]
        window = pixels < (centres + reach + 0.5).floor()
        weights = _filter(interpolation, (pixels - centres + 0.5) * (1.0 / widen)) * window
    weights = weights * ((pixels >= 0) & (pixels < sizes))  # nothing outside the image or in its padding
    weights = (weights / weights.sum(-1, keepdim=True)).float()
    dense = torch.zeros(len(sizes), out, padded, device=sizes.device)
    return dense.scatter_add_(2, pixels.clamp(0, padded - 1).long(), weights)


def resample(crops: torch.Tensor, sizes: torch.Tensor, flipped: torch.Tensor, image_size: tuple[int, int],
             interpolation: str) -> torch.Tensor:
    """uint8 crops [B, C, Hmax, Wmax] whose pixels fill their top-left [B, 2] sizes (height,
    width) -> uint8 [B, C, H, W], each crop resized on its own and mirrored left to right
    where `flipped` [B]: two batched matrix products (along the width, then the height),
    rounded to uint8 after each as PIL does. Mirroring is the width weights' rows reversed."""
    batch, channels, padded_height, padded_width = crops.shape
    height, width = image_size
    # [B, Hmax, C, Wmax] in float, one pass: then each product is one plain batched matmul
    pixels = torch.empty(batch, padded_height, channels, padded_width, device=crops.device)
    pixels.copy_(crops.permute(0, 2, 1, 3))
    across = resample_weights(sizes[:, 1], width, padded_width, interpolation)  # [B, W, Wmax]
    across = torch.where(flipped[:, None, None], across.flip(1), across)
    rows = torch.bmm(pixels.view(batch, padded_height * channels, padded_width), across.transpose(1, 2).contiguous())
    rows = rows.round_().clamp_(0, 255).view(batch, padded_height, channels * width)  # [B, Hmax, C*W]
    down = resample_weights(sizes[:, 0], height, padded_height, interpolation)  # [B, H, Hmax]
    images = torch.bmm(down, rows).round_().clamp_(0, 255).to(torch.uint8)  # [B, H, C*W]
    return images.view(batch, height, channels, width).permute(0, 2, 1, 3).contiguous()  # [B, C, H, W]


# Colour jitter --------------------------------------------------------------------------------------
def colour_jitter(images: torch.Tensor, order: torch.Tensor, amounts: torch.Tensor) -> torch.Tensor:
    """uint8 [B, C, H, W] -> each image's four colour maps (`colour_map`) applied in one pass,
    clipped once at the end."""
    pixels = images.flatten(2).float()  # [B, C, HW]
    matrix, offset = colour_map(order, amounts, pixels.mean(-1))
    mapped = torch.baddbmm(offset[:, :, None], matrix, pixels)  # [B, C, HW]
    return mapped.round_().clamp_(0, 255).to(torch.uint8).view_as(images)


def colour_map(order: torch.Tensor, amounts: torch.Tensor, means: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's four colour maps (brightness, contrast, saturation, hue; in its own
    `order` [B, 4], by its `amounts` [B, 4]) composed into one affine colour map, from its mean
    colour `means` [B, C]: (matrix [B, C, C], offset [B, C]), colour -> matrix @ colour + offset.
    Contrast blends towards the mean grey the image has at that point, saturation towards each
    pixel's grey, hue turns colours about the grey axis (red towards green for a positive
    turn); on a grey image (C = 1) saturation and hue are the identity."""
    batch, channels = means.shape
    grey = torch.tensor(GREY if channels == 3 else (1.0,), device=means.device)
    steps = _colour_matrices(amounts, grey)  # [B, 4, C, C]
    pull = 1 - amounts[:, CONTRAST]  # [B]: how far contrast moves each colour towards the mean grey
    images = torch.arange(batch, device=means.device)
    matrix = torch.eye(channels, device=means.device).expand(batch, channels, channels)
    offset = torch.zeros(batch, channels, device=means.device)
    for operation, contrast in zip(order.T, (order == CONTRAST).T):  # [B] each: every image's map at this position
        mean_grey = ((torch.bmm(matrix, means[:, :, None])[:, :, 0] + offset) * grey).sum(1)  # [B]: as the maps so far leave it
        shift = (contrast * pull * mean_grey)[:, None]  # [B, 1]: on every channel, for contrast only
        step = steps[images, operation]  # [B, C, C]
        matrix, offset = torch.bmm(step, matrix), torch.bmm(step, offset[:, :, None])[:, :, 0] + shift
    return matrix, offset


def _colour_matrices(amounts: torch.Tensor, grey: torch.Tensor) -> torch.Tensor:
    """The matrix of each of the four maps for every image, [B, 4, C, C]: brightness and
    contrast scale (contrast's shift towards the mean grey is added where it is applied),
    saturation blends towards each pixel's grey, hue turns about the grey axis."""
    channels = len(grey)
    identity = torch.eye(channels, device=grey.device)
    factor = amounts[:, :3, None, None]  # [B, 3, 1, 1]
    to_grey = torch.ones(channels, 1, device=grey.device) * grey[None, :]  # [C, C]: every channel the grey
    brightness = factor[:, BRIGHTNESS] * identity
    contrast = factor[:, CONTRAST] * identity
    saturation = factor[:, SATURATION] * identity + (1 - factor[:, SATURATION]) * to_grey
    hue = _hue_turns(2 * math.pi * amounts[:, HUE]) if channels == 3 else identity.expand(len(amounts), 1, 1)
    return torch.stack([brightness, contrast, saturation, hue], dim=1)


def _hue_turns(angles: torch.Tensor) -> torch.Tensor:
    """[B] angles -> [B, 3, 3] rotations of RGB space about the grey axis (Rodrigues' formula)."""
    axis = torch.full((3,), 1 / math.sqrt(3), device=angles.device)
    cross = torch.tensor([[0.0, -1, 1], [1, 0, -1], [-1, 1, 0]], device=angles.device) / math.sqrt(3)
    cos, sin = angles.cos()[:, None, None], angles.sin()[:, None, None]
    return cos * torch.eye(3, device=angles.device) + sin * cross + (1 - cos) * torch.outer(axis, axis)


# RandAugment ----------------------------------------------------------------------------------------
def rand_augment_op(images: torch.Tensor, ops: torch.Tensor, magnitudes: torch.Tensor) -> torch.Tensor:
    """uint8 [B, C, H, W] -> each image through its own RandAugment operation ([B] indices
    into RAND_AUGMENT_NAMES, [B] signed magnitudes): torchvision's functional for each
    (operation, magnitude) pair the batch drew, applied to the images that drew it."""
    images = images.clone()
    pairs = torch.stack([ops.float(), magnitudes], dim=1).unique(dim=0)
    for op, magnitude in pairs.tolist():
        name = RAND_AUGMENT_NAMES[int(op)]
        if name == "Identity":
            continue
        chosen = ((ops == int(op)) & (magnitudes == magnitude)).nonzero()[:, 0]
        images[chosen] = apply_op(images[chosen], name, magnitude)
    return images


def apply_op(images: torch.Tensor | Image.Image, name: str, magnitude: float) -> torch.Tensor | Image.Image:
    """RandAugment's operation `name` at `magnitude` on uint8 [N, C, H, W] or on a PIL image
    (torchvision's functionals take either), as v2.RandAugment applies it (nearest
    interpolation, black fill)."""
    nearest = v2.InterpolationMode.NEAREST
    if name in ("ShearX", "ShearY"):
        shear = [math.degrees(math.atan(magnitude)), 0.0]
        return F.affine(images, angle=0.0, translate=[0, 0], scale=1.0, interpolation=nearest, center=[0, 0],
                        shear=shear if name == "ShearX" else shear[::-1])
    if name in ("TranslateX", "TranslateY"):
        shift = [int(magnitude), 0]
        return F.affine(images, angle=0.0, translate=shift if name == "TranslateX" else shift[::-1], scale=1.0,
                        interpolation=nearest, shear=[0.0, 0.0])
    operations = {
        "Rotate": lambda: F.rotate(images, angle=magnitude, interpolation=nearest),
        "Brightness": lambda: F.adjust_brightness(images, brightness_factor=1.0 + magnitude),
        "Color": lambda: F.adjust_saturation(images, saturation_factor=1.0 + magnitude),
        "Contrast": lambda: F.adjust_contrast(images, contrast_factor=1.0 + magnitude),
        "Sharpness": lambda: F.adjust_sharpness(images, sharpness_factor=1.0 + magnitude),
        "Posterize": lambda: F.posterize(images, bits=int(magnitude)),
        "Solarize": lambda: F.solarize(images, threshold=255.0 * magnitude),
        "AutoContrast": lambda: F.autocontrast(images),
        "Equalize": lambda: F.equalize(images),
    }
    return operations[name]()

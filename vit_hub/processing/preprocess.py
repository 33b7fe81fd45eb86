"""Image -> model input, from the config alone. Torch-free (PIL + NumPy).

Evaluation, prediction, the ONNX runtime and the app all call `preprocess`, and the
training transforms start with `to_model_domain` (the config's canonicalisation, then the
model's mode) and end with the same resize and normalisation (`normalize` also takes torch
tensors: training normalises its batches on the device with it), so every path feeds the
model identical pixels.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any, BinaryIO, Union

import numpy as np
from PIL import Image, UnidentifiedImageError

from vit_hub.errors import UserError
from vit_hub.model.config import ViTConfig, size_text
from vit_hub.processing.canonical import WORK_SIDE, centre_digit

ImageInput = Union[str, Path, Image.Image, np.ndarray]
Pixels = Any  # a NumPy array or a torch tensor (this module does not import torch)

# The smallest standard deviation a pixel value is divided by: a flat channel (one grey level,
# std 0) stays finite.
MIN_STD = 1 / 255

# Largest image we agree to decode (pixels), checked from the file's header before decoding.
# Callers serving untrusted requests pass a lower `max_pixels`: UPLOAD_MAX_PIXELS (the app, and
# what pipeline.onnx accepts).
MAX_PIXELS = 64_000_000
UPLOAD_MAX_PIXELS = 16_000_000


def pixel_limit(max_pixels: int = MAX_PIXELS) -> str:
    """How messages state a pixel limit: "at most 64 megapixels"."""
    return f"at most {max_pixels / 1e6:g} megapixels"

ORIENTATION_TAG = 0x0112  # EXIF
JPEG_SCALES = (1, 2, 4, 8)  # the reductions a JPEG decoder makes directly (1, 1/2, 1/4, 1/8 a side)
# An upload's JPEG is decoded at the most reduced of those scales that keeps, on its shorter side,
# DECODE_MARGIN x the model's larger side (a photo model: its resize then averages at least that
# many pixels into each of its own), or for a digit model DIGIT_DECODE_SIDE: twice the plane the
# canonicalisation searches for ink (canonical.WORK_SIDE), so a digit spanning a fifth of the
# picture still has more pixels than the 80 its strokes are drawn at (canonical.DETAIL_SIDE).
DECODE_MARGIN = 4
DIGIT_DECODE_SIDE = 2 * WORK_SIDE


def decode_side(config: ViTConfig) -> int:
    """The shorter side a JPEG upload keeps when `open_image` decodes it reduced for this model
    (its `min_side`): BENCHMARKS.md, "Uploads decoded at a reduced scale", measures what it changes."""
    return DIGIT_DECODE_SIDE if config.canonicalize == "digit" else DECODE_MARGIN * max(config.image_size)


def open_image(source: str | Path | bytes, name: str | None = None, max_pixels: int = MAX_PIXELS,
               min_side: int | None = None) -> Image.Image:
    """Open and decode an image file (a path, or the file's bytes as a server receives them);
    one clear error if it is not a readable image.

    The size is read from the file's header and checked against `max_pixels` before
    anything is decoded, so a huge image (or a decompression bomb) is refused without
    spending memory on it. A JPEG over the limit (a 24 or 50 MP phone photo) is decoded at
    1/2, 1/4 or 1/8 of its size instead, the largest that fits: JPEG decodes at those scales
    directly, never holding the full-size pixels. With `min_side` (training reads, which
    resample the image to the model's size anyway) a JPEG is decoded at the smallest of those
    scales whose shorter side keeps `min_side` pixels, in a fraction of the time (BENCHMARKS.md,
    "The input pipeline and start-up"); uploads pass `decode_side(config)` (the app,
    UploadClassifier.decode). `name` is how messages call the file (default: its
    path, or "the upload" for bytes); the app passes the client's own file name so that no
    server path reaches a user. A malformed file, whatever Pillow raises for it, is a UserError.
    """
    if isinstance(source, bytes):
        shown, opened = name or "the upload", io.BytesIO(source)
    else:
        opened = Path(source)
        shown = str(opened) if name is None else name
        if not opened.is_file():
            found = "a folder" if opened.is_dir() else "nothing"
            raise FileNotFoundError(f"expected an image file at {shown}, found {found}")
    with _opened(opened, shown, max_pixels) as image:
        _decode_jpeg_reduced(image, max_pixels, min_side)
        check_pixels(*image.size, shown, max_pixels)
        try:
            image.load()
        except Exception as error:  # noqa: BLE001 - truncated or corrupt data: see UNDECODABLE
            detail = _detail(error, str(opened) if isinstance(opened, Path) else None, shown)
            raise UserError(f"{shown} is not a readable image: expected complete image data, "
                            f"found data that does not decode ({detail})") from None
        return image


# Pillow's format plugins parse a file's header and metadata in Python, and a malformed field
# fails with whatever it breaks: ValueError (an oversized iCCP or zTXt chunk in a PNG, a PPM
# size that is not a number), IndexError (a QOI stream), NotImplementedError (a DDS pixel
# format), struct.error, EOFError, SyntaxError. Each means the same to a caller, a file that
# does not decode, so `open_image` catches Exception around Pillow's calls alone; nothing of
# ours runs inside those try blocks.
UNDECODABLE = Exception


def _detail(error: BaseException, path: str | None, shown: str) -> str:
    """A decoding error as a message quotes it: its first line, at most 200 characters, no
    server path and no control characters (the text can echo bytes of the file); else its type."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if path:
        text = text.replace(path, shown)
    text = "".join(char if char.isprintable() else "?" for char in text)[:200]
    return text or type(error).__name__


def _decode_jpeg_reduced(image: Image.Image, max_pixels: int, min_side: int | None) -> None:
    """Set a JPEG to decode at the reduction (1, 2, 4 or 8 a side) `open_image` describes: the
    least that brings it within `max_pixels`, or with `min_side` the most that keeps its
    shorter side at least that long. Other images, and JPEGs too large even at 1/8, are left
    as they are (and refused by their size)."""
    if image.format != "JPEG":
        return
    sizes = {reduction: (-(-image.width // reduction), -(-image.height // reduction)) for reduction in JPEG_SCALES}
    fitting = [reduction for reduction, (width, height) in sizes.items() if width * height <= max_pixels]
    if not fitting:
        return
    kept = [reduction for reduction in fitting if min_side and min(sizes[reduction]) >= min_side]
    reduction = max(kept) if kept else fitting[0]
    if reduction > 1:
        image.draft(image.mode, sizes[reduction])


def check_header(source: str | Path | bytes, shown: str, max_pixels: int = MAX_PIXELS) -> None:
    """Refuse an image file (or its bytes) larger than `max_pixels` from its header alone, for
    code that decodes it afterwards itself (Gradio's sketchpad)."""
    with _opened(io.BytesIO(source) if isinstance(source, bytes) else Path(source), shown, max_pixels) as image:
        check_pixels(*image.size, shown, max_pixels)


def _opened(path: Path | BinaryIO, shown: str, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """Image.open (reads the header only), with its failures as one-line errors."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # check_pixels says it better
            return Image.open(path)
    except Image.DecompressionBombError:
        found = f"more than {2 * (Image.MAX_IMAGE_PIXELS or 0) / 1e6:.0f} megapixels"
        raise UserError(f"{shown} is too large: expected {pixel_limit(max_pixels)}, found {found}") from None
    except UnidentifiedImageError:
        raise UserError(f"{shown} is not a readable image: expected a format Pillow reads "
                         f"(PNG, JPEG, WebP, BMP, TIFF, ...), found none it recognises") from None
    except OSError as error:
        raise UserError(f"{shown} is not a readable image: expected a file that can be opened, found one "
                         f"that cannot ({error.strerror or type(error).__name__})") from None
    except UNDECODABLE as error:  # a malformed header or metadata chunk
        raise UserError(f"{shown} is not a readable image: expected a well-formed header, found a malformed "
                        f"one ({type(error).__name__}: {_detail(error, str(path), shown)})") from None


def check_pixels(width: int, height: int, shown: str = "the image", max_pixels: int = MAX_PIXELS) -> None:
    """An image larger than `max_pixels` is refused (before decoding, when read from a file)."""
    if width * height > max_pixels:
        raise UserError(f"{shown} is too large: expected {pixel_limit(max_pixels)}, "
                        f"found {size_text((width, height))} ({width * height / 1e6:.0f} megapixels)")


def _from_array(array: np.ndarray) -> Image.Image:
    """HxW, HxWx1, HxWx3 or HxWx4 array (uint8, uint16 or float in [0, 1]) -> PIL image."""
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (3, 4)):
        raise UserError(
            f"expected an image array of shape HxW, HxWx3 or HxWx4, got shape {list(array.shape)}"
        )
    if array.dtype == np.uint16:
        array = (array / 257.0).round().astype(np.uint8)
    elif np.issubdtype(array.dtype, np.floating):
        if array.size and (np.nanmin(array) < 0.0 or np.nanmax(array) > 1.0):
            raise UserError("expected a float image array with values in [0, 1]")
        array = (np.nan_to_num(array) * 255.0).round().astype(np.uint8)
    elif array.dtype == np.bool_:
        array = array.astype(np.uint8) * 255
    elif array.dtype != np.uint8:
        raise UserError(f"expected a uint8, uint16 or float image array, got dtype {array.dtype}")
    return Image.fromarray(array)


def load_image(source: ImageInput) -> Image.Image:
    """Path, PIL image or NumPy array -> PIL image (checked for a sane size)."""
    if isinstance(source, (str, Path)):
        image = open_image(source)
    elif isinstance(source, Image.Image):
        image = source
    elif isinstance(source, np.ndarray):
        image = _from_array(source)
    else:
        raise TypeError(f"expected an image path, PIL image or NumPy array, got {type(source).__name__}")
    image = upright(image)
    width, height = image.size
    if width < 2 or height < 2:
        raise UserError(f"expected an image at least 2x2 pixels, got {size_text((width, height))}")
    check_pixels(width, height)
    return image


# EXIF orientation -> the transpose that shows the photo upright (ImageOps.exif_transpose's table).
UPRIGHT = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
           5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
           8: Image.Transpose.ROTATE_90}


XMP_KEYS = ("xmp", "XML:com.adobe.xmp")  # where Pillow keeps XMP, which may hold an orientation too


def upright(image: Image.Image) -> Image.Image:
    """A photo stored rotated (its EXIF or XMP orientation), turned upright. Metadata that does
    not parse (a malformed EXIF block: Pillow raises SyntaxError, struct.error, ...) is read as
    no orientation: the pixels decoded, so the image is used as stored."""
    try:
        orientation = image.getexif().get(ORIENTATION_TAG, 1)
    except UNDECODABLE:
        return image
    method = UPRIGHT.get(orientation) if isinstance(orientation, int) else None
    if method is None:
        return image
    turned = image.transpose(method)  # keeps the metadata: its orientation goes, or a second read turns it again
    exif = image.getexif()
    del exif[ORIENTATION_TAG]
    turned.info["exif"] = exif.tobytes()
    for key in XMP_KEYS:
        turned.info.pop(key, None)
    return turned


def to_model_mode(image: Image.Image, channels: int) -> Image.Image:
    """Any PIL mode -> "L" (channels=1) or "RGB" (channels=3).

    16-bit and 32-bit grayscale are scaled to 8 bits by their full range, palette and
    alpha images are composited over white, CMYK/YCbCr/LAB go through RGB.
    """
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N"):
        image = Image.fromarray((np.asarray(image, dtype=np.float32) / 257.0).round().astype(np.uint8))
    elif image.mode in ("I", "F"):
        values = np.asarray(image, dtype=np.float64)
        top = 65535.0 if values.max() > 255 else 255.0
        image = Image.fromarray((values.clip(0, top) * (255.0 / top)).round().astype(np.uint8))
    if image.mode == "P":
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image.convert("RGBA"))
    target = "L" if channels == 1 else "RGB"
    return image if image.mode == target else image.convert(target)


def resize(image: Image.Image, config: ViTConfig) -> Image.Image:
    """To the config's image_size with its resampling filter (`interpolation`)."""
    height, width = config.image_size
    if image.size == (width, height):
        return image
    return image.resize((width, height), Image.Resampling[config.interpolation.upper()])


def channels_first(pixels: np.ndarray) -> np.ndarray:
    """An image's pixels HxW or HxWxC -> [C, H, W] (a view, not a copy)."""
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


def dataset_stats(config: ViTConfig) -> tuple[np.ndarray, np.ndarray]:
    """The config's mean and std per channel, float32 [C, 1, 1] (broadcast over [..., C, H, W])."""
    return tuple(np.asarray(values, dtype=np.float32).reshape(-1, 1, 1) for values in (config.mean, config.std))


def normalize(pixels: Pixels, config: ViTConfig, stats: tuple[Pixels, Pixels] | None = None) -> Pixels:
    """uint8 pixels [..., C, H, W] -> float32, scaled to [0, 1] then (x - mean) / std per
    channel: the config's mean and std, or each image's own (`pixel_norm="image"`: a colour
    cast, another stain or exposure changes the input far less).

    The one normalisation of every path. `pixels` is a NumPy array (`preprocess`: the app,
    ONNX Runtime, evaluation) or a torch tensor on any device (training's `ModelInput`);
    both run these same float32 operations, so with the config's mean and std a training
    batch equals `preprocess` bit for bit. `stats` is `dataset_stats` already on the
    tensor's device, for a caller that normalises many batches there."""
    is_numpy = isinstance(pixels, np.ndarray)
    images = (pixels.astype(np.float32) if is_numpy else pixels.float()) / 255.0
    if config.pixel_norm == "image":  # the statistics in float64, then float32, as pipeline.onnx takes them
        mean, std = _image_stats(images.astype(np.float64) if is_numpy else images.double())
        mean, std = (mean.astype(np.float32), std.astype(np.float32)) if is_numpy else (mean.float(), std.float())
        std = std.clip(MIN_STD)
    else:
        mean, std = stats or tuple(values if isinstance(images, np.ndarray) else images.new_tensor(values)
                                   for values in dataset_stats(config))
    return (images - mean) / std


def _image_stats(wide: Pixels) -> tuple[Pixels, Pixels]:
    """float64 [..., C, H, W] -> each plane's mean and spread [..., C, 1, 1]. In float64 because a
    near-flat plane divides by a spread of a grey level or less: float32 sums, whose round-off
    depends on the order they add in, would differ between NumPy, torch and ONNX Runtime by up to
    1e-2 after that division (tests/test_pipeline_graph.py)."""
    mean = wide.mean(axis=(-2, -1), keepdims=True)
    return mean, ((wide - mean) ** 2).mean(axis=(-2, -1), keepdims=True) ** 0.5


def to_model_domain(image: Image.Image, config: ViTConfig) -> Image.Image:
    """A decoded image -> the config's canonical form, in the model's mode (size not yet fixed).
    Training augments what this returns; every inference path resizes and normalises it."""
    if config.canonicalize == "digit":
        image = centre_digit(to_model_mode(image, 1), tuple(config.image_size))
    return to_model_mode(image, config.in_channels)


def model_pixels(image: Image.Image, config: ViTConfig) -> np.ndarray:
    """An image in the model's domain (`to_model_domain`) -> float32 [C, H, W]."""
    return normalize(channels_first(np.asarray(resize(image, config))), config)


def preprocess(source: ImageInput, config: ViTConfig) -> np.ndarray:
    """One image -> float32 [C, H, W] ready for the model (add a batch axis yourself)."""
    return model_pixels(to_model_domain(load_image(source), config), config)


def preprocess_batch(sources: list[Any], config: ViTConfig) -> np.ndarray:
    """Several images -> float32 [B, C, H, W]."""
    if not sources:
        raise UserError("expected at least one image, got none")
    return np.stack([preprocess(source, config) for source in sources])

"""The example images a model's page offers: a few of its own validation images, kept in its
model dir when training ends (`ModelDir.samples`), or for a digit model that has none, the
MNIST test digits bundled with this package. A model of anything else with none offers none.

A model dir is untrusted (the app serves one pulled from the Hub): only regular PNG files
are offered, never a link, at most MAX_SAMPLES of at most MAX_SAMPLE_BYTES and MAX_SAMPLE_PIXELS
(read from the header) each. Torch-free: the ONNX app reads them.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

from PIL import Image

from vit_hub.errors import UserError
from vit_hub.layout import ModelDir
from vit_hub.model.config import DIGIT_LABELS, ViTConfig
from vit_hub.processing.preprocess import load_image, open_image, to_model_domain

# One MNIST test digit per class, laid out like a model dir's samples/ folder.
BUNDLED_DIGITS = Path(__file__).resolve().parents[1] / "bundled" / ModelDir.samples
MAX_SAMPLES = 12
MAX_SAMPLE_BYTES = 2 * 2**20
SAMPLE_SIDE = 256  # a larger validation image is kept scaled down to this longer side
MAX_SAMPLE_PIXELS = 1024 * 1024  # a sample offered: 16 times what write_samples keeps, room for one put there by hand
PNG_MODES = ("1", "L", "LA", "P", "RGB", "RGBA")  # kept as they are; others become RGB
NAME_CHARACTERS = re.compile(r"[^A-Za-z0-9_-]+")  # a label's other characters become one '-' in a file name
MAX_NAME_LABEL = 40  # characters of the label in a sample's file name


def is_digit_model(config: ViTConfig) -> bool:
    """A model of handwritten digits: its inputs are canonicalised like MNIST, so the page
    offers a drawing pad and the bundled digits fit it."""
    return config.canonicalize == "digit"


def fits_bundled_digits(config: ViTConfig) -> bool:
    """A model of grayscale digits, which the bundled MNIST (its test split, the sample digits) fits."""
    return config.in_channels == 1 and config.labels == list(DIGIT_LABELS)


def kept_samples(model_dir: str | Path | None) -> list[Path]:
    """The sample images a model dir keeps (its samples/ folder), checked as above."""
    if model_dir is None:
        return []
    folder = ModelDir(model_dir).samples
    if not folder.is_dir() or folder.is_symlink():
        return []
    files = [path for path in sorted(folder.glob("*.png"))
             if path.is_file() and not path.is_symlink() and path.stat().st_size <= MAX_SAMPLE_BYTES
             and _pixels(path) <= MAX_SAMPLE_PIXELS]
    return files[:MAX_SAMPLES]


def _pixels(path: Path) -> int:
    """Pixels a PNG decodes to, from its header alone (a 100 KB PNG can hold 100 megapixels of
    one colour, which a visitor's browser would decode); a file with no readable header counts
    as too large."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the header only: nothing is decoded
        try:
            with Image.open(path, formats=["PNG"]) as image:
                return image.width * image.height
        except (OSError, ValueError, Image.DecompressionBombError):
            return MAX_SAMPLE_PIXELS + 1


def check_samples(samples: list[Path], config: ViTConfig, flag: str) -> None:
    """A one-line UserError, naming the sample, for the first of `samples` a page would offer
    and the model then refuse: one that passes the header check but does not decode in full (a
    cut PNG), or, for a digit model, one with no digit in it (a blank image)."""
    for path in samples:
        shown = f"{path.parent.name}/{path.name}"
        try:
            to_model_domain(load_image(open_image(path, shown, MAX_SAMPLE_PIXELS)), config)
        except UserError as error:
            reason = str(error) if str(error).startswith(shown) else f"{shown}: {error}"
            raise UserError(f"{flag}: a sample image the page would offer is refused by the model: {reason}; "
                            f"remove or replace {path}") from None


def example_images(model_dir: str | Path | None, config: ViTConfig) -> list[Path]:
    """What the page offers as examples: the model's own samples, else the bundled digits for a
    digit model, else nothing."""
    own = kept_samples(model_dir)
    if own or not is_digit_model(config):
        return own
    return sorted(BUNDLED_DIGITS.glob("*.png"))


def write_samples(dataset: Any, labels: list[str], model_dir: str | Path, count: int = MAX_SAMPLES) -> list[Path]:
    """Keep up to `count` images of `dataset` ((PIL image, class index) pairs: the validation
    split), the first of each class in turn, as PNGs in the model dir's samples/ folder,
    named by their order and label (`03_dog.png`, `sample_name`). Returns the files written."""
    folder = ModelDir(model_dir).samples
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.png"):
        old.unlink()
    written = []
    for order, (image, label) in enumerate(_one_class_after_another(dataset, len(labels), count)):
        image = image.copy() if image.mode in PNG_MODES else image.convert("RGB")
        image.thumbnail((SAMPLE_SIDE, SAMPLE_SIDE))
        path = folder / sample_name(order, label, labels)
        image.save(path)
        written.append(path)
    return written


def sample_name(order: int, label: int, labels: list[str]) -> str:
    """A sample's file name: its order and its label, kept to letters, digits, '_' and '-' (a
    label is untrusted text: no '/', '..' or spaces reach a file name or a page's URL), or its
    class index where nothing of the label is left (`07_class3.png`)."""
    text = labels[label] if 0 <= label < len(labels) else ""
    shown = NAME_CHARACTERS.sub("-", text).strip("-")[:MAX_NAME_LABEL].strip("-")
    return f"{order:02d}_{shown or f'class{label}'}.png"


def _one_class_after_another(dataset: Any, classes: int, count: int) -> list[tuple[Any, int]]:
    """Up to `count` (image, label) pairs of `dataset`, going round the classes in order."""
    by_class: dict[int, list[int]] = {label: [] for label in range(classes)}
    per_class = -(-count // max(classes, 1))  # ceil: enough of each class to fill `count`
    targets = getattr(dataset, "targets", None)  # read once: a split computes it
    for index in range(len(dataset)):
        label = int(targets[index] if targets is not None else dataset[index][1])
        if len(by_class.setdefault(label, [])) < per_class:
            by_class[label].append(index)
        if all(len(indices) >= per_class for indices in by_class.values()):
            break
    picks = [indices[turn] for turn in range(per_class) for indices in by_class.values() if turn < len(indices)]
    return [dataset[index] for index in picks[:count]]

"""Images an export is checked on: real inputs for parity and labelled batches for the
accuracy of a quantized graph. Any `--data` the core accepts (a folder, `mnist`, a
torchvision name) works; images are preprocessed exactly as the model's config says. With
none given, `default_eval_set` picks images that fit the model."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator

import numpy as np
from PIL import Image
from torch.utils.data import Dataset, Subset

from vit_hub.data import sources as vdata
from vit_hub.data.batches import EvalTransform, Transformed, default_workers, make_loader
from vit_hub.data.samples import fits_bundled_digits, kept_samples
from vit_hub.errors import UserError
from vit_hub.layout import ModelDir
from vit_hub.model.config import ViTConfig

# Below this many images a worker process costs more to start than it saves.
WORKER_THRESHOLD = 2000
BUNDLED_DIGITS = "mnist"  # the bundled MNIST, by the name `--data` takes
NO_LABEL = -1  # a model's sample images carry no label a measurement may use


@dataclasses.dataclass
class EvalSet:
    dataset: Dataset  # (float tensor [C, H, W], class index)
    labels: list[str]
    description: str  # e.g. "mnist (bundled), test split"


def load_eval_set(data: str, config: ViTConfig, data_root: str | None = None) -> EvalSet:
    """The test split of `data` (the validation split when it has no test split)."""
    splits = vdata.load_splits(data, data_root)
    name = "test" if splits.test is not None else "val"
    dataset = Transformed(splits.split(name), EvalTransform(config))
    # Files are checked as they are read (an unreadable one is replaced by the next readable
    # image), so no count of them can be known here.
    return EvalSet(dataset, splits.labels, f"{splits.source}, {name} split")


def default_eval_set(config: ViTConfig, model_dir: Path | None, data_root: str | None = None) -> EvalSet:
    """The images an export is checked on when no --calib-data is given: the bundled MNIST test
    split for a model of digits, else the sample images the model dir keeps (validation images
    training kept; no labels, so no int8 accuracy), else the bundled MNIST still, for the graphs'
    parity alone, its description saying it is not the model's kind of image."""
    if fits_bundled_digits(config):
        return load_eval_set(BUNDLED_DIGITS, config, data_root)
    own = kept_samples(model_dir)
    if own:
        from vit_hub.processing.preprocess import open_image

        images = [(open_image(path), NO_LABEL) for path in own]  # checked as any image file is
        return EvalSet(Transformed(images, EvalTransform(config)), [],
                       f"the model's {len(own)} sample images ({ModelDir.samples}/)")
    digits = load_eval_set(BUNDLED_DIGITS, config, data_root)
    return dataclasses.replace(digits, description=f"{digits.description}: not the model's kind of image (no "
                                                   f"--calib-data given, no {ModelDir.samples}/ in the model dir)")


def check_labels(eval_set: EvalSet, config: ViTConfig) -> None:
    """Accuracy only means something when the data's classes are the model's."""
    if eval_set.labels != config.labels:
        raise UserError(
            f"the labels of {eval_set.description} {eval_set.labels[:10]} do not match the model's "
            f"{config.labels[:10]}; pass --calib-data with the data the model was trained on"
        )


def batches(eval_set: EvalSet, batch_size: int, limit: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(pixels float32 [B, C, H, W], labels int64 [B]) over the first `limit` images (all by default)."""
    dataset = eval_set.dataset
    if limit is not None:
        dataset = Subset(dataset, range(min(limit, len(dataset))))
    workers = default_workers() if len(dataset) > WORKER_THRESHOLD else 0
    loader = make_loader(dataset, batch_size, shuffle=False, seed=0, num_workers=workers, pin_memory=False)
    for pixels, labels in loader:
        yield pixels.numpy(), labels.numpy()


def first_uploads(eval_set: EvalSet, count: int) -> list[Image.Image]:
    """The first `count` images as they were read, before any preprocessing (PIL images)."""
    raw = eval_set.dataset.dataset  # the split under Transformed
    return [raw[index][0] for index in range(min(count, len(raw)))]


def first_images(eval_set: EvalSet, count: int) -> np.ndarray:
    """The first `count` images, float32 [count, C, H, W] (fewer if the split is smaller)."""
    loader = make_loader(eval_set.dataset, count, shuffle=False, seed=0, num_workers=0, pin_memory=False)
    pixels, _ = next(iter(loader))
    return pixels.numpy()

"""Where training and evaluation images come from: `--data` -> train/val/test datasets.

`--data` can be
  * a folder in ImageFolder layout: `DIR/<class>/<image>`, or `DIR/train/<class>/...` with
    `DIR/test/` and/or `DIR/val/` beside it (listed and read by `vit_hub.data.folders`);
  * `mnist`: the copy bundled in this package (offline, 60k train / 10k test);
  * a torchvision dataset name (`cifar10`, `fashionmnist`, ...) whose files are already
    under `--data-root` (nothing is downloaded);
  * a Hugging Face dataset: a folder `save_to_disk` wrote, parquet shards in the Hub's layout,
    or `hf://datasets/OWNER/NAME` on the Hub (read by `vit_hub.data.hub_datasets`).

Splits that the source lacks are carved from the training images with a seeded,
stratified `val_split`. Labels come from folder names (or the dataset's class names).
The datasets yield (PIL image, class index); `vit_hub.data.augmentation` and `vit_hub.data.batches`
turn them into model input. The statistics the trainer picks a model by live here too.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import Dataset, Subset
from torchvision import datasets

from vit_hub.data.choices import TORCHVISION_DATASETS
from vit_hub.data.colour import ColourEvidence, colour_evidence, colour_thumbnail
from vit_hub.data.folders import FolderImages, FolderIndex, UnreadableFiles, UnreadableImage, index_image_folder
from vit_hub.data.hub_datasets import (HUB_PREFIX, TAR_SUFFIX, DatasetOptions, HubImages, dataset_folder,
                                       is_dataset_folder, is_saved_dataset, read_dataset, remote_shards,
                                       shard_files)
from vit_hub.data.streams import ShardedRows, read_sharded
from vit_hub.errors import DataError
from vit_hub.model.config import (CONV_STEMS, DIGIT_LABELS, ViTConfig, convstem_fits, is_small_photo_folder,
                                  preset_fields, suggest_for_data)
from vit_hub.processing.preprocess import MIN_STD, resize, to_model_domain

GRAY_MODES = ("1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F")  # Pillow modes without colour

BUNDLED_MNIST = Path(__file__).resolve().parents[1] / "bundled"



@dataclasses.dataclass
class DataSplits:
    """Datasets yielding (PIL image, class index); `val`/`test` may be None.

    Image files are checked lazily, as they are read: `skipped` lists the unreadable ones met
    so far, by this process or its DataLoader workers (`UnreadableFiles`)."""

    train: Dataset
    val: Dataset | None
    test: Dataset | None
    labels: list[str]
    source: str
    unreadable: list[UnreadableFiles] = dataclasses.field(default_factory=list)
    streamed: bool = False  # the training split is read as it trains (vit_hub.data.streams)

    @property
    def skipped(self) -> list[str]:
        """The unreadable files met so far (each replaced by the next readable image of its split)."""
        return [path for files in self.unreadable for path in files.met()]

    def skipped_report(self) -> str | None:
        """The unreadable files met so far, as lines for stderr (the caller prints them), or None."""
        return skipped_report(self.skipped)

    def check_unreadable(self) -> None:
        """With --strict, a file a DataLoader worker could not read fails here, in one line."""
        for files in self.unreadable:
            files.check()

    def split(self, name: str) -> Dataset:
        dataset = getattr(self, name, None) if name in ("train", "val", "test") else None
        if dataset is None:
            available = [s for s in ("train", "val", "test") if getattr(self, s) is not None]
            raise DataError(f"split {name!r} is not available for {self.source}; expected one of {available}")
        return dataset


def skipped_report(paths: list[str]) -> str | None:
    if not paths:
        return None
    return "\n".join([f"skipped {len(paths)} unreadable image(s) (use --strict to fail instead):",
                      *(f"  {path}" for path in paths)])


# Sources ---------------------------------------------------------------------------
def load_splits(data: str, data_root: str | None = None, val_split: float = 0.1, seed: int = 0,
                strict: bool = False, index: FolderIndex | None = None,
                options: DatasetOptions = DatasetOptions()) -> DataSplits:
    """Resolve `--data` into train/val/test datasets (see the module docstring). A folder is
    listed, not read (`index_source`); `index` is that listing when it was made elsewhere
    (under torchrun, by rank 0 for every process). `options`: a dataset's config and columns."""
    if not 0.0 <= val_split < 1.0:
        raise DataError(f"--val-split: expected a fraction in [0, 1), got {val_split}")
    name = _source_name(data)
    if name == "mnist" and not Path(data).is_dir():
        splits = _bundled_mnist()
    elif name in TORCHVISION_DATASETS and not Path(data).is_dir():
        splits = _torchvision_dataset(name, data_root)
    elif options.stream and data.startswith(HUB_PREFIX) and (remote := remote_shards(data, options.config)):
        splits = _hub_dataset(Path(data.removeprefix(HUB_PREFIX).partition("@")[0]), data, options, remote)
    elif (folder := dataset_folder(data, options.config)) is not None:
        splits = _hub_dataset(folder, data, options)
    else:
        splits = _image_folder(index or _list_folder(data), strict)
    if options.given() and not isinstance(getattr(splits.train, "dataset", None), (HubImages, ShardedRows)):
        raise DataError(f"{' '.join(options.given())}: expected --data to be a Hugging Face dataset, found "
                        f"{splits.source}")
    if splits.val is None and val_split > 0:
        splits.train, splits.val = stratified_split(splits.train, val_split, seed)
    elif splits.val is None:
        splits.val = splits.test  # --val-split 0: select on the test split, as asked
    return splits


def _source_name(data: str) -> str:
    return data.lower().replace("-", "").replace("_", "")


def index_source(data: str) -> FolderIndex | None:
    """The file listing of `--data` when it names an image folder (None for mnist, the
    torchvision names and dataset folders, which need no listing): what rank 0 makes once and shares."""
    name = _source_name(data)
    if name in ("mnist", *TORCHVISION_DATASETS) and not Path(data).is_dir() or data.startswith(HUB_PREFIX) \
            or is_dataset_folder(Path(data)):
        return None
    return _list_folder(data)


def _list_folder(data: str) -> FolderIndex:
    """`--data` as an image folder, listed; a path that is not there is told every kind of
    `--data` there is."""
    if not Path(data).is_dir():
        raise DataError(
            f"--data: expected a folder of images, 'mnist', or a torchvision dataset name "
            f"({', '.join(TORCHVISION_DATASETS)}), got {str(Path(data))!r} (no such folder)"
        )
    return index_image_folder(Path(data))


def _bundled_mnist() -> DataSplits:
    root = _unpacked_mnist()
    train = datasets.MNIST(root, train=True, download=False)
    test = datasets.MNIST(root, train=False, download=False)
    return DataSplits(Split(train), None, Split(test), list(DIGIT_LABELS), "mnist (bundled)")


def _unpacked_mnist() -> Path:
    """torchvision's MNIST reads the raw idx files uncompressed; the package ships them
    gzipped (11 MB instead of 55 MB) and they are unpacked once into a cache folder."""
    cache = Path(os.environ.get("VIT_HUB_CACHE", Path.home() / ".cache" / "vit_hub"))
    raw = cache / "MNIST" / "raw"
    for packed in sorted((BUNDLED_MNIST / "MNIST" / "raw").glob("*.gz")):
        target = raw / packed.stem
        if not target.exists():
            raw.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(f".partial{os.getpid()}")
            with gzip.open(packed, "rb") as source, open(partial, "wb") as sink:
                shutil.copyfileobj(source, sink)
            os.replace(partial, target)  # atomic: a crash never leaves half a file
    return cache


def _torchvision_dataset(name: str, data_root: str | None) -> DataSplits:
    class_name, split_style = TORCHVISION_DATASETS[name]
    root = Path(data_root or os.environ.get("VIT_HUB_DATA_ROOT", "data"))
    factory = getattr(datasets, class_name)

    def make(split: str) -> Dataset:
        kwargs = {"train": split == "train"} if split_style == "train" else {"split": split}
        return factory(str(root), download=False, **kwargs)

    try:
        train, test = make("train"), make("test")
    except RuntimeError as error:  # torchvision: "Dataset not found or corrupted..."
        raise DataError(
            f"{name}: expected torchvision's {class_name} files under --data-root {root} "
            f"(this tool never downloads), but they were not found ({error})"
        ) from None
    labels = [str(label) for label in getattr(train, "classes", [])] or [
        str(i) for i in range(int(max(targets_of(train))) + 1)
    ]
    return DataSplits(Split(train), None, Split(test), labels, f"{name} ({root})")


def _hub_dataset(path: Path, data: str, options: DatasetOptions, files: dict | None = None) -> DataSplits:
    """A Hugging Face dataset, or WebDataset tar shards: read whole by `datasets`, or shard by
    shard (`vit_hub.data.streams`) for tar shards and with --stream (`files`: the shards on the
    Hub, streamed from there)."""
    files = files or (None if is_saved_dataset(path) else shard_files(path, options.config))
    if files and (options.stream or any(str(shard).endswith(TAR_SUFFIX) for shards in files.values()
                                        for shard in shards)):
        parts, labels = read_sharded(path, files, options)
    elif options.stream:
        raise DataError(f"--stream: expected --data to be parquet or tar shards, found {path.name}, which "
                        f"save_to_disk wrote (arrow files read whole); give no --stream")
    else:
        parts, labels = read_dataset(path, options)
    val, test = (Split(parts[name]) if name in parts else None for name in ("val", "test"))
    shown = data.removeprefix(HUB_PREFIX) if data.startswith(HUB_PREFIX) else path.name
    streamed = isinstance(parts["train"], ShardedRows)
    kind = "WebDataset shards" if streamed and parts["train"].image_column is None else "Hugging Face dataset"
    return DataSplits(Split(parts["train"]), val, test, labels, f"{shown} ({kind}{', streamed' if streamed else ''})",
                      streamed=streamed)


def _image_folder(index: FolderIndex, strict: bool) -> DataSplits:
    folders = {name: FolderImages(samples, index.classes, strict) for name, samples in index.parts.items()}
    return DataSplits(Split(folders["train"]), Split(folders["val"]) if "val" in folders else None,
                      Split(folders["test"]) if "test" in folders else None, list(index.classes), index.root,
                      [folder.unreadable for folder in folders.values()])


class Split(Subset):
    """A split of a dataset (all of it by default). An image that cannot be read is replaced
    by the next readable one of the same split, so a bad file never stops a run and never
    brings an image of another split in."""

    def __init__(self, dataset: Dataset, indices=None):
        super().__init__(dataset, range(len(dataset)) if indices is None else indices)

    def __getitem__(self, index: int):
        return self.read(index)

    def read(self, index: int, min_side: int | None = None):
        """Item `index`; of a folder or a dataset, a large JPEG may decode at a reduced scale that
        keeps `min_side` pixels on its shorter side (`FolderImages.read`, `HubImages.read`; training reads)."""
        if not -len(self.indices) <= index < len(self.indices):
            raise IndexError(f"index {index} out of range for a split of {len(self.indices)} images")
        for step in range(len(self.indices)):
            position = self.indices[(index + step) % len(self.indices)]
            try:
                if isinstance(self.dataset, (FolderImages, HubImages, ShardedRows)):
                    return self.dataset.read(position, min_side)
                return self.dataset[position]
            except UnreadableImage:
                continue
        raise DataError(f"found no readable images among the {len(self.indices)} files of this split; "
                        f"expected images Pillow decodes")

    def __getitems__(self, indices: list[int]) -> list:
        return [self[index] for index in indices]

    @property
    def targets(self) -> list[int]:
        """Class index of each image, as torchvision datasets name them (nothing is decoded)."""
        return targets_of(self).tolist()

    @property
    def samples(self) -> list[tuple[str, int]]:
        """(path, class index) of each image, for a split of a folder."""
        return [self.dataset.samples[index] for index in self.indices]


# Splitting and statistics ------------------------------------------------------------
def targets_of(dataset: Dataset) -> np.ndarray:
    """Class index of every sample, without decoding any image."""
    if isinstance(dataset, Subset):
        return targets_of(dataset.dataset)[np.asarray(dataset.indices)]
    for attribute in ("targets", "labels"):
        values = getattr(dataset, attribute, None)
        if values is not None:
            return np.asarray(values)
    raise DataError(f"cannot read the labels of {type(dataset).__name__} (expected .targets or .labels)")


def stratified_split(dataset: Dataset, fraction: float, seed: int) -> tuple[Subset, Subset]:
    """Seeded split keeping each class's share: (train part, held-out part)."""
    targets = targets_of(dataset)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(targets))
    ordered_targets = targets[order]
    held_out = []
    for label in np.unique(targets):
        members = order[ordered_targets == label]
        count = int(round(len(members) * fraction))
        if len(members) > 1:
            count = min(max(count, 1), len(members) - 1)  # every class on both sides
        held_out.append(members[:count])
    held = np.sort(np.concatenate(held_out))
    keep = np.setdiff1d(np.arange(len(targets)), held)
    if len(held) == 0:
        raise DataError(f"--val-split {fraction} leaves no validation images out of {len(targets)}")
    base, positions = (dataset.dataset, np.asarray(dataset.indices)) if isinstance(dataset, Split) else (dataset, None)
    if positions is not None:
        keep, held = positions[keep], positions[held]
    return Split(base, keep.tolist()), Split(base, held.tolist())


@dataclasses.dataclass
class ImageStats:
    """What the trainer needs to pick a model for unknown data."""

    num_train: int
    channels: int  # 1 when every sampled image is grayscale, else 3
    median_side: int
    colour: ColourEvidence | None = None  # for colour images: does colour separate the classes?

    @property
    def model_channels(self) -> int:
        """The input channels to train with: 3 only when colour helps (vit_hub/data/colour.py)."""
        return 3 if self.channels == 3 and self.colour is not None and self.colour.colour_helps else 1

    @property
    def is_small_photo_folder(self) -> bool:
        return is_small_photo_folder(self.num_train, self.median_side)


def _sample(dataset: Dataset, count: int, seed: int) -> Iterator[tuple[Image.Image, int]]:
    """Up to `count` of the dataset's (image, label) pairs, chosen by `seed`, read one at a time:
    callers keep a small part of each (a thumbnail, sums of pixels), so a folder of phone photos
    (36 MB each decoded) is never in memory all at once."""
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(dataset), size=min(count, len(dataset)), replace=False)
    return (dataset[int(i)] for i in picks)


def describe_images(dataset: Dataset, seed: int = 0, count: int = 400) -> ImageStats:
    gray, sides, thumbnails, labels = True, [], [], []
    for image, label in _sample(dataset, count, seed):
        gray = gray and image.mode in GRAY_MODES
        sides.append(min(image.size))
        thumbnails.append(colour_thumbnail(image))
        labels.append(label)
    colour = None if gray else colour_evidence(thumbnails, labels, seed)
    return ImageStats(len(dataset), 1 if gray else 3, int(np.median(sides)), colour)


def compute_mean_std(dataset: Dataset, config: ViTConfig, seed: int = 0,
                     max_images: int = 5000) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of the training images as the model sees them
    (converted and resized, in [0, 1]), estimated on up to `max_images` of them, summed one
    image at a time."""
    sums = np.zeros((2, config.in_channels))  # per channel: sum of x, sum of x squared
    count = 0
    for image, _ in _sample(dataset, max_images, seed):
        pixels = np.asarray(resize(to_model_domain(image, config), config), dtype=np.float64)
        pixels = pixels.reshape(-1, config.in_channels) / 255.0  # [HW, C]
        sums += np.stack([pixels.sum(axis=0), (pixels**2).sum(axis=0)])
        count += len(pixels)
    mean = sums[0] / count
    std = np.maximum(np.sqrt(np.maximum(sums[1] / count - mean**2, 0.0)), MIN_STD)
    return mean.round(4).tolist(), std.round(4).tolist()


def config_for_data(splits: DataSplits, preset: str | None, overrides: dict[str, Any], seed: int,
                    stats: ImageStats | None = None) -> ViTConfig:
    """The model for this data: the preset's fields, or ones chosen from the images (described by
    `stats`, or sampled here), then the explicit `overrides` (ViTConfig fields; None: not given);
    mean/std measured on the training images unless given; labels from the data."""
    if not preset:
        stats = stats or describe_images(splits.train, seed)
        values = suggest_for_data(stats.num_train, stats.model_channels, stats.median_side)
    else:
        values = preset_fields(preset)
    values.update({key: value for key, value in overrides.items() if value is not None})
    values["labels"] = splits.labels
    chosen_stem = overrides.get("patch_embedding") is None
    if chosen_stem and values.get("patch_embedding") in CONV_STEMS and not convstem_fits(values.get("patch_size", 16)):
        values["patch_embedding"] = "shifted"  # the default stem cannot halve down to this patch size
    if values.get("mean") is None or values.get("std") is None:  # measure what was not given
        probe = ViTConfig.from_dict({**values, "mean": None, "std": None})
        measured = dict(zip(("mean", "std"), compute_mean_std(splits.train, probe, seed)))
        values.update({key: value for key, value in measured.items() if values.get(key) is None})
    return ViTConfig.from_dict(values)

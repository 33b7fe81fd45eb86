"""Where images come from and how they become tensors.

`--data` can be
  * a folder in ImageFolder layout: `DIR/<class>/<image>`, or `DIR/train/<class>/...` with
    `DIR/test/` and/or `DIR/val/` beside it;
  * `mnist`: the copy bundled in this package (offline, 60k train / 10k test);
  * a torchvision dataset name (`cifar10`, `fashionmnist`, ...) whose files are already
    under `--data-root` (nothing is downloaded).

Splits that the source lacks are carved from the training images with a seeded,
stratified `val_split`. Labels come from folder names (or the dataset's class names).
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler, Subset
from torchvision import datasets
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.transforms import v2

from .colour import ColourEvidence, colour_evidence
from .config import ViTConfig
from .preprocess import normalize, open_image, preprocess, resize, to_model_domain

BUNDLED_MNIST = Path(__file__).parent / "bundled"
AUGMENTATIONS = ("auto", "digits", "photos", "none")
CROP_SCALE = (0.5, 1.0)  # share of the image a random-resized crop keeps

# torchvision datasets we read from --data-root: name -> (class, how it selects a split)
TORCHVISION_DATASETS = {
    "fashionmnist": ("FashionMNIST", "train"),
    "kmnist": ("KMNIST", "train"),
    "cifar10": ("CIFAR10", "train"),
    "cifar100": ("CIFAR100", "train"),
    "svhn": ("SVHN", "split"),
    "stl10": ("STL10", "split"),
}


class DataError(ValueError):
    """A dataset that cannot be used as given; the message says what was expected."""


@dataclasses.dataclass
class DataSplits:
    """Datasets yielding (PIL image, class index); `val`/`test` may be None."""

    train: Dataset
    val: Dataset | None
    test: Dataset | None
    labels: list[str]
    source: str
    skipped: list[str] = dataclasses.field(default_factory=list)

    def skipped_report(self) -> str | None:
        """The unreadable files left out, as lines for stderr (the caller prints them), or None."""
        if not self.skipped:
            return None
        return "\n".join([f"skipped {len(self.skipped)} unreadable image(s) (use --strict to fail instead):",
                          *(f"  {path}" for path in self.skipped)])

    def split(self, name: str) -> Dataset:
        dataset = getattr(self, name, None) if name in ("train", "val", "test") else None
        if dataset is None:
            available = [s for s in ("train", "val", "test") if getattr(self, s) is not None]
            raise DataError(f"split {name!r} is not available for {self.source}; expected one of {available}")
        return dataset


# Sources ---------------------------------------------------------------------------
def load_splits(data: str, data_root: str | None = None, val_split: float = 0.1, seed: int = 0,
                strict: bool = False) -> DataSplits:
    """Resolve `--data` into train/val/test datasets (see the module docstring)."""
    if not 0.0 <= val_split < 1.0:
        raise DataError(f"--val-split: expected a fraction in [0, 1), got {val_split}")
    name = data.lower().replace("-", "").replace("_", "")
    if name == "mnist" and not Path(data).is_dir():
        splits = _bundled_mnist()
    elif name in TORCHVISION_DATASETS and not Path(data).is_dir():
        splits = _torchvision_dataset(name, data_root)
    else:
        splits = _image_folder(Path(data), strict)
    if splits.val is None and val_split > 0:
        splits.train, splits.val = stratified_split(splits.train, val_split, seed)
    elif splits.val is None:
        splits.val = splits.test  # --val-split 0: select on the test split, as asked
    return splits


def _bundled_mnist() -> DataSplits:
    root = _unpacked_mnist()
    train = datasets.MNIST(root, train=True, download=False)
    test = datasets.MNIST(root, train=False, download=False)
    return DataSplits(train, None, test, [str(d) for d in range(10)], "mnist (bundled)")


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
    return DataSplits(train, None, test, labels, f"{name} ({root})")


class _ImageChecker:
    """`is_valid_file` for ImageFolder: image extensions only, and the file must decode in
    full within the size limit (`open_image`). Checking only the header (PIL's verify())
    lets a truncated JPEG through to fail mid-training. Unreadable files are collected (or
    raise at once with `strict`)."""

    def __init__(self, strict: bool):
        self.strict = strict
        self.unreadable: list[str] = []

    def __call__(self, path: str) -> bool:
        if not path.lower().endswith(IMG_EXTENSIONS):
            return False
        try:
            open_image(path, Path(path).name).close()
            return True
        except Exception as error:  # open_image's one-line errors, and whatever else a broken file raises
            if self.strict:
                raise DataError(f"unreadable image {path} ({error})") from None
            self.unreadable.append(path)
            return False


def _load_as_is(path: str) -> Image.Image:
    """Decode an image in its own mode. (ImageFolder's default loader converts to RGB, which
    saturates 16-bit images, drops alpha without compositing and hides grayscale folders.)"""
    with Image.open(path) as image:
        image.load()
        return image


class _Folder(datasets.ImageFolder):
    """ImageFolder whose class list can be fixed, so test/ maps names like train/ does.
    Images keep their mode; the transforms convert them exactly as `preprocess` does."""

    def __init__(self, root: Path, checker: _ImageChecker, classes: list[str] | None = None):
        self._fixed_classes = classes
        super().__init__(str(root), loader=_load_as_is, is_valid_file=checker, allow_empty=True)

    def find_classes(self, directory: str):
        found = sorted(entry.name for entry in os.scandir(directory) if entry.is_dir() and not entry.name.startswith("."))
        if self._fixed_classes is None:
            return found, {name: i for i, name in enumerate(found)}
        extra = sorted(set(found) - set(self._fixed_classes))
        if extra:
            raise DataError(f"{directory} has classes {extra} that the training folder does not have")
        return self._fixed_classes, {name: i for i, name in enumerate(self._fixed_classes)}


def _image_folder(root: Path, strict: bool) -> DataSplits:
    if not root.is_dir():
        raise DataError(
            f"--data: expected a folder of images, 'mnist', or a torchvision dataset name "
            f"({', '.join(TORCHVISION_DATASETS)}), got {str(root)!r} (no such folder)"
        )
    checker = _ImageChecker(strict)
    has_train = (root / "train").is_dir()
    train_root = root / "train" if has_train else root
    train = _checked_folder(train_root, checker, None)
    val = test = None
    if has_train:
        if (root / "val").is_dir():
            val = _checked_folder(root / "val", checker, train.classes)
        if (root / "test").is_dir():
            test = _checked_folder(root / "test", checker, train.classes)
    return DataSplits(train, val, test, list(train.classes), str(root), checker.unreadable)


def _checked_folder(root: Path, checker: _ImageChecker, classes: list[str] | None) -> _Folder:
    found = [entry for entry in root.iterdir() if entry.is_dir() and not entry.name.startswith(".")]
    if not found:
        raise DataError(
            f"expected class subfolders in {root} (ImageFolder layout: {root}/<class>/<image>), found none"
        )
    folder = _Folder(root, checker, classes)
    if not folder.samples:
        raise DataError(f"found no readable images in {root} (extensions: {', '.join(IMG_EXTENSIONS)})")
    counts = np.bincount(folder.targets, minlength=len(folder.classes))
    if classes is None:
        if len(folder.classes) < 2:
            raise DataError(f"expected at least 2 classes in {root}, found {len(folder.classes)}: {folder.classes}")
        empty = [name for name, count in zip(folder.classes, counts) if count == 0]
        if empty:
            raise DataError(f"class folders {empty} in {root} have no readable images")
    return folder


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
    return Subset(dataset, keep.tolist()), Subset(dataset, held.tolist())


@dataclasses.dataclass
class ImageStats:
    """What the trainer needs to pick a model for unknown data."""

    num_train: int
    channels: int  # 1 when every sampled image is grayscale, else 3
    median_side: int
    colour: ColourEvidence | None = None  # for colour images: does colour separate the classes?

    @property
    def model_channels(self) -> int:
        """The input channels to train with: 3 only when colour helps (vit_hub/colour.py)."""
        return 3 if self.channels == 3 and self.colour is not None and self.colour.colour_helps else 1


def _sample_images(dataset: Dataset, count: int, seed: int) -> list[Image.Image]:
    return [image for image, _ in _sample(dataset, count, seed)]


def _sample(dataset: Dataset, count: int, seed: int) -> list[tuple[Image.Image, int]]:
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(dataset), size=min(count, len(dataset)), replace=False)
    return [dataset[int(i)] for i in picks]


def describe_images(dataset: Dataset, seed: int = 0, count: int = 400) -> ImageStats:
    images, labels = zip(*_sample(dataset, count, seed))
    gray = all(image.mode in ("1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F") for image in images)
    median_side = int(np.median([min(image.size) for image in images]))
    colour = None if gray else colour_evidence(images, labels, seed)
    return ImageStats(len(dataset), 1 if gray else 3, median_side, colour)


def compute_mean_std(dataset: Dataset, config: ViTConfig, seed: int = 0,
                     max_images: int = 5000) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of the training images as the model sees them
    (converted and resized, in [0, 1]), estimated on up to `max_images` of them."""
    images = _sample_images(dataset, max_images, seed)
    pixels = np.stack([np.asarray(resize(to_model_domain(image, config), config)) for image in images])
    pixels = pixels.reshape(len(images), -1, config.in_channels).astype(np.float64) / 255.0  # [n, HW, C]
    std = np.maximum(pixels.std(axis=(0, 1)), 1 / 255)  # a constant channel must not divide by 0
    return pixels.mean(axis=(0, 1)).round(4).tolist(), std.round(4).tolist()


# Transforms --------------------------------------------------------------------------
class EvalTransform:
    """PIL image -> normalised float tensor [C, H, W], exactly as every inference path."""

    def __init__(self, config: ViTConfig):
        self.config = config

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return torch.from_numpy(preprocess(image, self.config))


class TrainTransform:
    """Random augmentation, then the same conversion and normalisation as EvalTransform.

    digits: small random affine (rotation, shift, scale, shear) of the resized image.
    photos: random-resized crop that keeps most of the frame (a small object is not cropped
        away), horizontal flip, colour jitter (another camera, stain or light: brightness,
        contrast, saturation and hue), RandAugment, then random erasing.
    """

    def __init__(self, config: ViTConfig, augment: str):
        self.config = config
        self.augment = resolve_augment(augment, config)
        size = tuple(config.image_size)
        if self.augment == "digits":
            self.before = v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1), shear=8)
        elif self.augment == "photos":
            self.before = v2.Compose([
                v2.RandomResizedCrop(size, scale=CROP_SCALE, antialias=True,
                                     interpolation=v2.InterpolationMode(config.interpolation)),
                v2.RandomHorizontalFlip(),
                v2.ColorJitter(brightness=0.3, contrast=0.3, saturation=0.3, hue=0.1),
                v2.RandAugment(num_ops=2, magnitude=9),
            ])
        else:
            self.before = v2.Identity()
        self.after = v2.RandomErasing(p=0.25, value=0) if self.augment == "photos" else v2.Identity()

    def __call__(self, image: Image.Image) -> torch.Tensor:
        image = to_model_domain(image, self.config)
        image = self.before(resize(image, self.config) if self.augment != "photos" else image)
        image = resize(image, self.config)  # a no-op unless nothing above resized
        return self.after(torch.from_numpy(normalize(np.asarray(image), self.config)))


def resolve_augment(augment: str, config: ViTConfig) -> str:
    if augment not in AUGMENTATIONS:
        raise DataError(f"--augment: expected one of {', '.join(AUGMENTATIONS)}, got {augment!r}")
    if augment != "auto":
        return augment
    return "digits" if config.in_channels == 1 and max(config.image_size) <= 64 else "photos"


class Transformed(Dataset):
    """(PIL image, label) dataset -> (tensor, label) through `transform`."""

    def __init__(self, dataset: Dataset, transform: Callable[[Image.Image], torch.Tensor]):
        self.dataset = dataset
        self.transform = transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        image, label = self.dataset[index]
        return self.transform(image), int(label)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The augmentation seed of one sample in one epoch: a function of the three numbers only."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1)[0])


class SeededAugmentation(Dataset):
    """(PIL image, label) dataset -> (augmented tensor, label), keyed by `epoch * n + index`.

    Each sample draws its augmentation from its own seed (`sample_seed`) inside a forked
    RNG, so the images a run sees depend on the seed alone: not on the number of DataLoader
    workers, on whether they persist across epochs, or on the number of processes, and
    the main process's RNG (dropout) is left untouched when there are no workers.
    """

    def __init__(self, dataset: Dataset, transform: Callable[[Image.Image], torch.Tensor], seed: int):
        self.dataset = dataset
        self.transform = transform
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int):
        epoch, index = divmod(key, len(self.dataset))
        image, label = self.dataset[index]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed(self.seed, epoch, index))
            pixels = self.transform(image)
        return pixels, int(label)


class EpochSampler(Sampler[int]):
    """Keys `epoch * n + index` of a seeded shuffle of n samples, one epoch at a time.

    `set_epoch` picks the epoch (a new order each). With `batch_size` (global) and
    `drop_last`, the order is cut to whole batches. Under DDP every process shuffles alike
    and takes every `world_size`-th key, so process r's part of global batch s holds the
    very keys a single process puts in batch s.
    """

    def __init__(self, size: int, seed: int, batch_size: int, drop_last: bool, rank: int = 0,
                 world_size: int = 1):
        self.size, self.seed, self.batch_size, self.drop_last = size, seed, batch_size, drop_last
        self.rank, self.world_size = rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _keys(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(self.size, generator=generator)
        if self.drop_last:
            order = order[:self.size // self.batch_size * self.batch_size]
        return (order[self.rank::self.world_size] + self.epoch * self.size).tolist()

    def __iter__(self):
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())


def default_workers() -> int:
    """Half the cores for decoding and augmentation (the rest run the model), at most 8."""
    return max(0, min(8, (os.cpu_count() or 1) // 2))


def make_loader(dataset: Dataset, batch_size: int, *, shuffle: bool, seed: int, num_workers: int,
                pin_memory: bool, sampler: Sampler | None = None, persistent_workers: bool = False) -> DataLoader:
    """A DataLoader whose order depends only on `seed` (or on `sampler`). The trainer's loader
    keeps its workers across epochs (`persistent_workers`): starting them anew costs a second
    or more per epoch, all of a small dataset's epoch."""
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle and sampler is None, sampler=sampler,
        num_workers=num_workers, pin_memory=pin_memory, generator=generator,
        persistent_workers=persistent_workers and num_workers > 0,
    )

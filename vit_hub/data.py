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
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageFilter, ImageStat
from torch.utils.data import DataLoader, Dataset, Sampler, Subset
from torchvision import datasets, transforms
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.transforms import v2

from .errors import UserError
from .colour import ColourEvidence, colour_evidence
from .config import ViTConfig
from .preprocess import open_image, preprocess, resize, to_model_domain

BUNDLED_MNIST = Path(__file__).parent / "bundled"
AUGMENTATIONS = ("auto", "digits", "photos", "none")
CROP_SCALE = (0.5, 1.0)  # share of the image a random-resized crop keeps
ELASTIC_ALPHA, ELASTIC_SIGMA = 8.0, 3.0  # digits: displacement field strength and smoothness, in pixels
NOISE_LEVELS = 20.0  # digits: the largest sensor-noise deviation, in gray levels

# torchvision datasets we read from --data-root: name -> (class, how it selects a split)
TORCHVISION_DATASETS = {
    "fashionmnist": ("FashionMNIST", "train"),
    "kmnist": ("KMNIST", "train"),
    "cifar10": ("CIFAR10", "train"),
    "cifar100": ("CIFAR100", "train"),
    "svhn": ("SVHN", "split"),
    "stl10": ("STL10", "split"),
}


class DataError(UserError):
    """A dataset that cannot be used as given; the message says what was expected."""


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
                strict: bool = False, index: FolderIndex | None = None) -> DataSplits:
    """Resolve `--data` into train/val/test datasets (see the module docstring). A folder is
    listed, not read (`index_source`); `index` is that listing when it was made elsewhere
    (under torchrun, by rank 0 for every process)."""
    if not 0.0 <= val_split < 1.0:
        raise DataError(f"--val-split: expected a fraction in [0, 1), got {val_split}")
    name = _source_name(data)
    if name == "mnist" and not Path(data).is_dir():
        splits = _bundled_mnist()
    elif name in TORCHVISION_DATASETS and not Path(data).is_dir():
        splits = _torchvision_dataset(name, data_root)
    else:
        splits = _image_folder(index or index_image_folder(Path(data)), strict)
    if splits.val is None and val_split > 0:
        splits.train, splits.val = stratified_split(splits.train, val_split, seed)
    elif splits.val is None:
        splits.val = splits.test  # --val-split 0: select on the test split, as asked
    return splits


def _source_name(data: str) -> str:
    return data.lower().replace("-", "").replace("_", "")


def index_source(data: str) -> FolderIndex | None:
    """The file listing of `--data` when it names an image folder (None for mnist and the
    torchvision names, which need no listing): what rank 0 makes once and shares."""
    name = _source_name(data)
    if name in ("mnist", *TORCHVISION_DATASETS) and not Path(data).is_dir():
        return None
    return index_image_folder(Path(data))


def _bundled_mnist() -> DataSplits:
    root = _unpacked_mnist()
    train = datasets.MNIST(root, train=True, download=False)
    test = datasets.MNIST(root, train=False, download=False)
    return DataSplits(Split(train), None, Split(test), [str(d) for d in range(10)], "mnist (bundled)")


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


# Image folders: listed at start-up, each file checked when it is read -------------------------
@dataclasses.dataclass
class FolderIndex:
    """What an image folder holds, from its directory listing alone (no file is opened):
    the classes of its training folder and, per folder, (path, class index) in ImageFolder's
    order. Plain data, so rank 0 lists a folder once and sends the listing to every process."""

    root: str
    classes: list[str]
    parts: dict[str, list[tuple[str, int]]]  # "train" (the root itself without train/), "val", "test"


def index_image_folder(root: Path) -> FolderIndex:
    """List `root` (ImageFolder layout, optionally with train/ val/ test/ beside each other).
    Errors that the listing can show (no class folders, one class, a class without image
    files, a test class training lacks, class folders that are one folder) are raised here,
    in one line. Links are followed as `_ClassListing` says: each image once, in its own class."""
    if not root.is_dir():
        raise DataError(
            f"--data: expected a folder of images, 'mnist', or a torchvision dataset name "
            f"({', '.join(TORCHVISION_DATASETS)}), got {str(root)!r} (no such folder)"
        )
    has_train = (root / "train").is_dir()
    train_root = root / "train" if has_train else root
    classes = _class_folders(train_root)
    if len(classes) < 2:
        raise DataError(f"expected at least 2 classes in {train_root}, found {len(classes)}: {classes}")
    split_roots = {"train": train_root}
    for name in ("val", "test") if has_train else ():
        if (root / name).is_dir():
            extra = sorted(set(_class_folders(root / name)) - set(classes))
            if extra:
                raise DataError(f"{root / name} has classes {extra} that the training folder does not have")
            split_roots[name] = root / name
    parts = _ClassListing(root, split_roots, classes).samples()
    counts = np.bincount([label for _, label in parts["train"]], minlength=len(classes))
    empty = [name for name, count in zip(classes, counts) if count == 0]
    if empty:
        raise DataError(f"class folders {empty} in {train_root} have no readable images "
                        f"(no files with the extensions {', '.join(IMG_EXTENSIONS)})")
    return FolderIndex(str(root), classes, parts)


def _class_folders(root: Path) -> list[str]:
    found = sorted(entry.name for entry in os.scandir(root) if entry.is_dir() and not entry.name.startswith("."))
    if not found:
        raise DataError(
            f"expected class subfolders in {root} (ImageFolder layout: {root}/<class>/<image>), found none"
        )
    return found


class _ClassListing:
    """(path, class index) of every file with an image extension under each split's class
    folders, sorted as torchvision's ImageFolder sorts them; nothing is opened.

    Links are followed, but each real folder is walked once and each file listed once, so a
    link to `..` neither lists the folder again without end nor lists an image twice (once
    more in another split, or under another class). The class folders' own trees are taken
    first, then, round by round, the folders that links lead to; folders claimed in a round
    are claimed before any of them is walked. A folder or file that a class holds itself
    (or the data folder holds) is never listed under another class through a link, and a
    link to the data folder or above it is not followed. Time and memory: one visit per
    real folder and file."""

    def __init__(self, root: Path, split_roots: dict[str, Path], classes: list[str]):
        self.root = os.path.realpath(root)
        self.split_roots, self.classes = split_roots, classes
        # real path -> the path it was first met as, of every folder claimed (walked, or reserved)
        self.claimed = {os.path.realpath(folder): str(folder) for folder in (root, *split_roots.values())}
        self.found: dict[tuple[str, int], dict[str, list[str]]] = {}  # (split, class) -> {folder as listed: [names]}
        self.file_links: list[tuple[str, int, str, str]] = []  # (split, class, folder as listed, name)
        self.linked_files: set[str] = set()  # real paths of the files listed through links

    def samples(self) -> dict[str, list[tuple[str, int]]]:
        frontier = [(split, label, str(folder / name)) for split, folder in self.split_roots.items()
                    for label, name in enumerate(self.classes) if (folder / name).is_dir()]
        class_folders = True
        while frontier:
            targets = [(split, label, path, real) for split, label, path in frontier
                       if (real := self._claim(path, class_folders)) is not None]
            frontier = [link for target in targets for link in self._walk(*target)]
            class_folders = False
        for split, label, folder, name in self.file_links:
            self._add_linked_file(split, label, folder, name)
        parts = {split: [(os.path.join(folder, name), label)
                         for label in range(len(self.classes))
                         for folder, names in sorted(self.found.get((split, label), {}).items())
                         for name in sorted(names)]
                 for split in self.split_roots}
        for split, samples in parts.items():
            if not samples:
                raise DataError(f"found no readable images in {self.split_roots[split]} "
                                f"(no files with the extensions {', '.join(IMG_EXTENSIONS)})")
        return parts

    def _claim(self, path: str, class_folder: bool) -> str | None:
        """The real path of a folder a class folder or link leads to, claimed; None (or, for a
        class folder, a DataError) when it was claimed before or holds the data folder."""
        real = os.path.realpath(path)
        problem = None
        if real in self.claimed:
            problem = f"is the same folder as {self.claimed[real]}"
        elif os.path.commonpath([real, self.root]) == real:
            problem = "holds the data folder itself"
        if problem is None:
            self.claimed[real] = path
            return real
        if class_folder:
            raise DataError(f"expected a folder of its own for each class, found that the class folder {path} "
                            f"{problem} (a link)")
        return None

    def _walk(self, split: str, label: int, path: str, real: str) -> list[tuple[str, int, str]]:
        """List the tree under a claimed folder, its own subfolders claimed as they are met;
        the links in it are returned (to folders) or set aside (to files) for later, sorted,
        so which of two links to one folder lists it does not depend on the directory order."""
        links, file_links, stack = [], [], [(path, real)]
        while stack:
            folder, real_folder = stack.pop()
            try:
                entries = list(os.scandir(folder))
            except OSError:  # unreadable folder: skipped, as os.walk skips it
                continue
            for entry in entries:
                if entry.is_symlink():
                    if os.path.isdir(entry.path):
                        links.append((split, label, entry.path))
                    elif entry.name.lower().endswith(IMG_EXTENSIONS):
                        file_links.append((split, label, folder, entry.name))
                elif entry.is_dir():
                    real_child = os.path.join(real_folder, entry.name)
                    if real_child not in self.claimed:
                        self.claimed[real_child] = entry.path
                        stack.append((entry.path, real_child))
                elif entry.name.lower().endswith(IMG_EXTENSIONS):
                    self.found.setdefault((split, label), {}).setdefault(folder, []).append(entry.name)
        self.file_links += sorted(file_links)
        return sorted(links)

    def _add_linked_file(self, split: str, label: int, folder: str, name: str) -> None:
        """A link to a file is listed unless the file is in a folder listed already (there it is
        listed, or it is another class's or the data folder's own) or was listed by another link."""
        real = os.path.realpath(os.path.join(folder, name))
        if os.path.dirname(real) in self.claimed or real in self.linked_files:
            return
        self.linked_files.add(real)
        self.found.setdefault((split, label), {}).setdefault(folder, []).append(name)


class UnreadableImage(DataError):
    """A file that does not decode (see `UnreadableFiles`); `Split` reads the next image instead."""


class UnreadableFiles:
    """Which files of a folder turned out unreadable when read (a JPEG cut short, an image
    over 64 megapixels, not an image at all). One flag per file in shared memory, so a file
    a DataLoader worker meets is seen by the process that reports it (`met`), and each is
    tried once. With `strict`, the first one fails in one line: at once when met in this
    process, at the next `check` when met by a worker."""

    def __init__(self, paths: list[str], strict: bool):
        self.paths, self.strict = paths, strict
        self.flags = torch.zeros(len(paths), dtype=torch.bool).share_memory_()

    def mark(self, index: int, error: Exception) -> None:
        self.flags[index] = True
        if self.strict and torch.utils.data.get_worker_info() is None:
            raise DataError(f"unreadable image {self.paths[index]} ({error})") from None

    def met(self) -> list[str]:
        return [self.paths[i] for i in self.flags.nonzero().flatten().tolist()]

    def check(self) -> None:
        if self.strict and bool(self.flags.any()):
            path = self.met()[0]
            try:  # the reason, again: the worker that met the file cannot send it
                open_image(path, Path(path).name).close()
                reason = "it read on a second try"
            except Exception as error:
                reason = str(error)
            raise DataError(f"unreadable image {path} ({reason})")


class _Folder(Dataset):
    """(PIL image, class index) of a listed folder; a file is decoded in full (within the size
    limit of `open_image`) when read, and one that fails is marked and raises UnreadableImage.
    Checking only the header (PIL's verify()) would let a truncated JPEG through to fail
    mid-training. Images keep their mode; the transforms convert them as `preprocess` does."""

    def __init__(self, samples: list[tuple[str, int]], classes: list[str], strict: bool):
        self.samples, self.classes = samples, classes
        self.targets = [label for _, label in samples]
        self.unreadable = UnreadableFiles([path for path, _ in samples], strict)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        path, label = self.samples[index]
        if not self.unreadable.flags[index]:
            try:
                return open_image(path, Path(path).name), label
            except Exception as error:  # open_image's one-line errors, and whatever else a broken file raises
                self.unreadable.mark(index, error)
        raise UnreadableImage(f"unreadable image {path}")


def _image_folder(index: FolderIndex, strict: bool) -> DataSplits:
    folders = {name: _Folder(samples, index.classes, strict) for name, samples in index.parts.items()}
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
        if not -len(self.indices) <= index < len(self.indices):
            raise IndexError(f"index {index} out of range for a split of {len(self.indices)} images")
        for step in range(len(self.indices)):
            try:
                return self.dataset[self.indices[(index + step) % len(self.indices)]]
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


class ModelInput:
    """The last step of training's preprocessing, on whatever device the batch is on: uint8
    pixels [B, C, H, W] -> float32 scaled to [0, 1] and normalised as `preprocess.normalize`
    does (the config's mean and std, or each image's own), then random erasing where a box is
    given. Run on the GPU in the training step, it takes the per-pixel float work off the
    DataLoader workers and sends a quarter of the bytes through shared memory and PCIe.
    With the config's mean and std the result equals `preprocess` bit for bit (tested on
    the CPU); with per-image statistics to float32 rounding."""

    def __init__(self, config: ViTConfig):
        self.config = config
        self._stats: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, pixels: torch.Tensor, boxes: torch.Tensor | None = None) -> torch.Tensor:
        images = pixels.float().div_(255.0)
        if self.config.pixel_norm == "image":
            std, mean = torch.std_mean(images, dim=(2, 3), correction=0, keepdim=True)
            images = images.sub_(mean).div_(std.clamp_min_(1 / 255))  # a flat channel stays finite
        else:
            mean, std = self._dataset_stats(images.device)
            images = images.sub_(mean).div_(std)
        if boxes is not None:
            images = images.masked_fill_(_box_masks(boxes.to(images.device), *images.shape[-2:])[:, None], 0.0)
        return images

    def _dataset_stats(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._stats:
            self._stats[device] = tuple(torch.tensor(values, dtype=torch.float32, device=device).view(1, -1, 1, 1)
                                        for values in (self.config.mean, self.config.std))
        return self._stats[device]


def _box_masks(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[B, 4] boxes (top, left, height, width; height 0: none) -> [B, H, W] bool masks."""
    top, left, box_height, box_width = (column[:, None, None] for column in boxes.unbind(1))
    rows = torch.arange(height, device=boxes.device)[None, :, None]
    columns = torch.arange(width, device=boxes.device)[None, None, :]
    return (rows >= top) & (rows < top + box_height) & (columns >= left) & (columns < left + box_width)


NO_BOX = (0, 0, 0, 0)
GREY = np.array([0.299, 0.587, 0.114])  # luma weights of PIL's and torchvision's grayscale


class TrainTransform:
    """Random augmentation, then the same conversion and normalisation as EvalTransform.

    digits: small random affine (rotation, shift, scale, shear) of the resized image, then
        what canonicalising an upload leaves (`upload_variations`): elastic distortion, a
        stroke a little thicker or thinner, blur and sensor noise.
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
        if self.augment == "digits":
            self.affine = v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1), shear=8)
            self.elastic = v2.RandomApply([v2.ElasticTransform(alpha=ELASTIC_ALPHA, sigma=ELASTIC_SIGMA)], p=0.5)
        elif self.augment == "photos":
            self.rand_augment = v2.RandAugment(num_ops=2, magnitude=9)

    def prepare(self, image: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoded image -> (uint8 pixels [C, H, W] at the model's size, erasing box [4])."""
        image = to_model_domain(image, self.config)
        box = NO_BOX
        if self.augment == "photos":
            image = random_resized_crop(image, self.config)
            if torch.rand(1) < 0.5:
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            image = self.rand_augment(colour_jitter(image))
            box = erasing_box(*self.config.image_size)
        elif self.augment == "digits":
            image = upload_variations(self.elastic(self.affine(resize(image, self.config))))
        else:
            image = resize(image, self.config)
        return uint8_pixels(image), torch.tensor(box, dtype=torch.int32)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        pixels, box = self.prepare(image)
        return self.model_input(pixels[None], box[None])[0]


def upload_variations(digit: Image.Image) -> Image.Image:
    """A canonical digit ("L", light on black) as canonicalising people's uploads leaves it,
    each change with its own chance: strokes up to half a pixel thicker or thinner (the stroke width
    is set from an estimate), blurred (a soft photo) and speckled (sensor noise)."""
    if torch.rand(1) < 0.3:
        pen = ImageFilter.MaxFilter(3) if torch.rand(1) < 0.5 else ImageFilter.MinFilter(3)
        digit = Image.blend(digit, digit.filter(pen), 0.5 * float(torch.rand(1)))
    if torch.rand(1) < 0.3:
        digit = digit.filter(ImageFilter.GaussianBlur(0.3 + 0.5 * float(torch.rand(1))))
    if torch.rand(1) < 0.3:
        noise = torch.randn(digit.height, digit.width) * (NOISE_LEVELS * float(torch.rand(1)))
        digit = Image.fromarray((torch.from_numpy(np.asarray(digit, dtype=np.float32)) + noise)
                                .clamp(0, 255).round().to(torch.uint8).numpy())
    return digit


def uint8_pixels(image: Image.Image) -> torch.Tensor:
    """An "L" or "RGB" image -> uint8 tensor [C, H, W]."""
    array = np.array(image)
    return torch.from_numpy(array[None] if array.ndim == 2 else array.transpose(2, 0, 1).copy())


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
    for a positive turn, as a hue shift does). Five times cheaper than the four operations
    one after another (BENCHMARKS.md, issue 17); values are clipped once, at the end."""
    order = torch.randperm(4).tolist()
    factors = [float(torch.empty(1).uniform_(1 - spread, 1 + spread)) for spread in (brightness, contrast, saturation)]
    turn = float(torch.empty(1).uniform_(-hue, hue))
    colour = image.mode == "RGB"
    means = np.asarray(ImageStat.Stat(image).mean)
    grey = GREY if colour else np.ones(1)
    identity = np.eye(len(means))
    matrix, offset = identity, np.zeros(len(means))
    for operation in order:
        shift = 0.0
        if operation == 0:
            step = factors[0] * identity
        elif operation == 1:
            step, shift = factors[1] * identity, (1 - factors[1]) * grey @ (matrix @ means + offset)
        elif operation == 2 and colour:
            step = factors[2] * identity + (1 - factors[2]) * np.outer(np.ones(3), GREY)
        elif operation == 3 and colour:
            step = _hue_turn(2 * np.pi * turn)
        else:
            continue  # saturation and hue leave a grey image as it is
        matrix, offset = step @ matrix, step @ offset + shift
    if colour:
        return image.convert("RGB", tuple(np.concatenate([matrix, offset[:, None]], axis=1).ravel().tolist()))
    table = np.clip(np.round(matrix[0, 0] * np.arange(256) + offset[0]), 0, 255).astype(np.uint8)
    return image.point(table.tolist())


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
    """(PIL image, label) dataset -> (uint8 pixels, label, erasing box) from
    `TrainTransform.prepare`, keyed by `epoch * n + index`; the training step finishes each
    batch on the device with the transform's `model_input`.

    Each sample draws its augmentation from its own seed (`sample_seed`) inside a forked
    RNG, so the images a run sees depend on the seed alone: not on the number of DataLoader
    workers, on whether they persist across epochs, or on the number of processes, and
    the main process's RNG (dropout) is left untouched when there are no workers.
    """

    def __init__(self, dataset: Dataset, transform: TrainTransform, seed: int):
        self.dataset = dataset
        self.transform = transform
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int):
        epoch, index = divmod(key, len(self.dataset))
        image, label = self.dataset[index]
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(sample_seed(self.seed, epoch, index))  # the CPU stream only: 0.3 ms less
            pixels, box = self.transform.prepare(image)
        return pixels, int(label), box


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


def default_workers(device_type: str = "cpu", processes: int = 1) -> int:
    """DataLoader workers per process. On the CPU half the cores decode and augment (the rest
    run the model), at most 8. On a GPU the model needs no cores: each process's share of
    them, less one for its own loop, at most 16 (ViT-S/16 on an H100 took 1,313-1,409 img/s
    from 8 workers and 1,802-2,103 from 15 with the loader before issue 17)."""
    cores = os.cpu_count() or 1
    if device_type == "cuda":
        return max(1, min(16, cores // max(1, processes) - 1))
    return max(0, min(8, cores // 2 // max(1, processes)))


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

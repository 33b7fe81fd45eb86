"""Image folders: listed once at start-up, each file checked when it is read.

`index_image_folder` lists `DIR/<class>/<image>` (or `DIR/train|val|test/<class>/<image>`)
from directory entries alone and raises, in one line, the mistakes a listing can show.
`FolderImages` reads the listed files lazily; a file that does not decode is recorded
(`UnreadableFiles`) and skipped by the split that holds it (`data.Split`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS

from vit_hub.errors import DataError
from vit_hub.processing.preprocess import open_image


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
        raise DataError(f"expected a folder of images, got {str(root)!r} (no such folder)")
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


class FolderImages(Dataset):
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
        return self.read(index)

    def read(self, index: int, min_side: int | None = None) -> tuple[Image.Image, int]:
        """The image and its class; `min_side`: a large JPEG may decode at a reduced scale
        that keeps this many pixels on its shorter side (`open_image`; training reads)."""
        path, label = self.samples[index]
        if not self.unreadable.flags[index]:
            try:
                return open_image(path, Path(path).name, min_side=min_side), label
            except Exception as error:  # open_image's one-line errors, and whatever else a broken file raises
                self.unreadable.mark(index, error)
        raise UnreadableImage(f"unreadable image {path}")

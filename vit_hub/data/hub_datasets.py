"""`--data` as a Hugging Face dataset on disk, read with the `datasets` library (the optional
extra: `pip install 'vit-hub[datasets]'`; `make install` has it):

  * a folder `Dataset.save_to_disk` or `DatasetDict.save_to_disk` wrote (its state.json or
    dataset_dict.json says so);
  * a folder in the Hub's layout, as `push_to_hub` writes a dataset and a Hub snapshot holds
    it: parquet shards whose names carry the split (`data/train-00000-of-00002.parquet`,
    `data/test-00000-of-00001.parquet`), beside a README.

A dataset on the Hub is named `hf://datasets/OWNER/NAME` (`@REVISION` after it pins a branch,
tag or commit): its parquet shards are fetched into the Hugging Face cache (huggingface_hub's
snapshot_download), or found there with HF_HUB_OFFLINE=1, and read as a folder in the Hub's layout.

The images are the one column whose feature is an `Image`, the labels the one that is a
`ClassLabel`, whose names are the classes; a dataset with no such column, or several, is
refused in one line naming the columns it has. The splits map as a folder's do: `train`,
`validation` (or `valid`, `val`) as val, `test`. Rows are decoded one at a time as training
reads them, as a folder's files are; an image that does not decode is skipped as a folder's
unreadable file is.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vit_hub.errors import DataError, UserError
from vit_hub.processing.preprocess import open_image

SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes at the top
SHARD_SUFFIXES = (".parquet", ".arrow")
SPLITS = {"train": "train", "validation": "val", "valid": "val", "val": "val", "test": "test"}
INSTALL = "pip install 'vit-hub[datasets]'"
HUB_PREFIX = "hf://datasets/"
HUB_FILES = ["*.parquet", "*.arrow", "*.json", "*.md"]  # what a dataset repo's snapshot needs here: shards, card


def dataset_folder(data: str) -> Path | None:
    """The folder `--data` names when it is a dataset (a Hub one fetched into the cache first),
    else None (an image folder, mnist, a torchvision name)."""
    if data.startswith(HUB_PREFIX):
        return _snapshot(data)
    return Path(data) if is_dataset_folder(Path(data)) else None


def hub_reference(data: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) of a `--data hf://datasets/OWNER/NAME[@REVISION]`, else None."""
    if not data.startswith(HUB_PREFIX):
        return None
    repo_id, _, revision = data.removeprefix(HUB_PREFIX).partition("@")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id) or "@" in revision:
        raise DataError(f"--data {data}: expected hf://datasets/OWNER/NAME, optionally @REVISION, found {repo_id!r}")
    return repo_id, revision or None


def _snapshot(data: str) -> Path:
    from huggingface_hub import snapshot_download

    repo_id, revision = hub_reference(data)
    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", revision=revision, allow_patterns=HUB_FILES))
    except Exception as error:  # noqa: BLE001 - offline, missing, gated: huggingface_hub raises many kinds
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise DataError(f"--data {data}: expected the Hub dataset {repo_id} (in the cache when HF_HUB_OFFLINE=1), "
                        f"found {type(error).__name__}: {detail}") from None


def is_dataset_folder(path: Path) -> bool:
    """Whether `path` is a dataset folder this module reads (rather than a folder of images)."""
    return path.is_dir() and (any((path / name).is_file() for name in SAVED_MARKERS) or bool(_shards(path)))


def _shards(path: Path) -> dict[str, list[Path]]:
    """{split name: its shard files} of a folder in the Hub's layout (top level or data/)."""
    found: dict[str, list[Path]] = {}
    for folder in (path, path / "data"):
        for shard in sorted(folder.glob("*")) if folder.is_dir() else []:
            split = shard.name.split("-", 1)[0].split(".", 1)[0]
            if shard.suffix in SHARD_SUFFIXES and shard.is_file() and not shard.is_symlink() and split in SPLITS:
                found.setdefault(split, []).append(shard)
    return found


def read_dataset(path: Path) -> tuple[dict[str, "HubImages"], list[str]]:
    """The dataset folder at `path` -> ({"train"/"val"/"test": its rows}, the class names)."""
    loaded = _load(path)
    parts = {}
    for name, split in loaded.items():
        ours = SPLITS.get(name)
        if ours is None or ours in parts:
            raise DataError(f"--data {path.name}: expected splits named train, validation and test, found "
                            f"{', '.join(sorted(loaded))}")
        parts[ours] = split
    if "train" not in parts:
        raise DataError(f"--data {path.name}: expected a 'train' split, found {', '.join(sorted(loaded))}")
    image, label = _columns(path, parts["train"].features)
    labels = [str(name) for name in parts["train"].features[label].names]
    if len(labels) < 2:
        raise DataError(f"--data {path.name}: expected at least two classes in {label!r}, found {labels}")
    return {name: HubImages(split, image, label) for name, split in parts.items()}, labels


def _load(path: Path) -> dict[str, Any]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"--data {path.name} is a Hugging Face dataset: expected the datasets library, found it "
                        f"not installed ({INSTALL})") from None
    if any((path / name).is_file() for name in SAVED_MARKERS):
        loaded = datasets.load_from_disk(str(path))
        return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    files = {split: [str(shard) for shard in shards] for split, shards in _shards(path).items()}
    builder = "parquet" if next(iter(files.values()))[0].endswith(".parquet") else "arrow"
    return dict(datasets.load_dataset(builder, data_files=files))


def _columns(path: Path, features: dict[str, Any]) -> tuple[str, str]:
    """(the image column, the label column) of a split's features."""
    import datasets

    images = [name for name, feature in features.items() if isinstance(feature, datasets.Image)]
    labels = [name for name, feature in features.items() if isinstance(feature, datasets.ClassLabel)]
    if len(images) != 1 or len(labels) != 1:
        found = ", ".join(f"{name} ({type(feature).__name__})" for name, feature in features.items())
        raise DataError(f"--data {path.name}: expected one image column (an Image feature) and one label column "
                        f"(a ClassLabel, which names the classes), found {found}")
    return images[0], labels[0]


class HubImages:
    """One split's rows -> (PIL image, class index), decoded as they are read (a map-style
    dataset, as torch's DataLoader takes one; this module imports no torch).

    Each image is decoded from the bytes the dataset holds, as an uploaded file is
    (`open_image`): its size checked from the header first, a large JPEG decoded at a reduced
    scale where training asks for fewer pixels (`min_side`, as a folder's files are). An image
    that names a file instead of holding its bytes is refused, never opened: a dataset is
    untrusted, and its paths would lead anywhere on this machine."""

    def __init__(self, rows: Any, image: str, label: str):
        import datasets

        self.rows, self.image = rows.cast_column(image, datasets.Image(decode=False)), image
        self.targets = np.asarray(rows.data.column(label).to_numpy(), dtype=np.int64)  # no image decoded

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        return self.read(index)

    def read(self, index: int, min_side: int | None = None) -> tuple[Image.Image, int]:
        from vit_hub.data.folders import UnreadableImage  # torch: the card reads this module without it

        shown = f"row {index}"
        data = (self.rows[int(index)][self.image] or {}).get("bytes")
        if not data:
            raise UnreadableImage(f"{shown}: expected the image's bytes in the dataset, found none (a file path "
                                  f"is never followed)")
        try:
            return open_image(data, shown, min_side=min_side), int(self.targets[index])
        except UserError as error:
            raise UnreadableImage(str(error)) from None

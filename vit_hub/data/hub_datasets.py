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

A dataset with several configs keeps each in a folder of its own (`CONFIG/train-*.parquet`,
as push_to_hub writes one with `config_name`); `--data-config CONFIG` picks one (a flag of its
own, as `load_dataset(name, config)` takes it: a Hub path has no place for a config).

The images are the one column whose feature is an `Image`, the labels the one that is a
`ClassLabel`, whose names are the classes; `--image-column` and `--label-column` name them
when the features alone do not tell. A dataset with no such column, or several and none
named, or a named column of another kind, is refused in one line naming the columns it has.
The splits map as a folder's do: `train`, `validation` (or `valid`, `val`) as val, `test`.
Rows are decoded one at a time as training reads them, as a folder's files are; an image that
does not decode is skipped as a folder's unreadable file is. Parquet shards read with
`--stream`, and WebDataset tar shards, are read shard by shard instead (`vit_hub.data.streams`).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vit_hub.errors import DataError, UserError
from vit_hub.processing.preprocess import open_image

SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes at the top
TAR_SUFFIX = ".tar"  # WebDataset shards, read by vit_hub.data.streams
SHARD_SUFFIXES = (".parquet", ".arrow", TAR_SUFFIX)
SPLITS = {"train": "train", "validation": "val", "valid": "val", "val": "val", "test": "test"}
INSTALL = "pip install 'vit-hub[datasets]'"
HUB_PREFIX = "hf://datasets/"
HUB_FILES = ["*.parquet", "*.arrow", "*.json", "*.md"]  # what a dataset repo's snapshot needs here: shards, card


@dataclasses.dataclass(frozen=True)
class DatasetOptions:
    """What `--data-config`, `--image-column` and `--label-column` say of a dataset (None: the
    default config, the column found from the features)."""

    config: str | None = None
    image_column: str | None = None
    label_column: str | None = None
    stream: bool = False  # read the training split as it trains (vit_hub.data.streams)

    def __post_init__(self):
        if self.config is not None and not re.fullmatch(r"[\w-][\w.-]*", self.config):
            raise DataError(f"--data-config {self.config!r}: expected a config's name (letters, digits, - _ .), "
                            f"found other characters")

    def given(self) -> list[str]:
        """The flags given, as typed: a source that is not a dataset refuses them."""
        flags = [f"--{name.replace('_', '-')} {value}".replace("--config", "--data-config")
                 for name, value in dataclasses.asdict(self).items() if value not in (None, False)]
        return [flag.replace(" True", "") for flag in flags]


def dataset_folder(data: str, config: str | None = None) -> Path | None:
    """The folder `--data` names when it is a dataset (a Hub one fetched into the cache first,
    only `config`'s shards where one is named), else None (an image folder, mnist, a torchvision name)."""
    if data.startswith(HUB_PREFIX):
        return _snapshot(data, config)
    return Path(data) if is_dataset_folder(Path(data)) else None


def hub_reference(data: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) of a `--data hf://datasets/OWNER/NAME[@REVISION]`, else None."""
    if not data.startswith(HUB_PREFIX):
        return None
    repo_id, _, revision = data.removeprefix(HUB_PREFIX).partition("@")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id) or "@" in revision:
        raise DataError(f"--data {data}: expected hf://datasets/OWNER/NAME, optionally @REVISION, found {repo_id!r}")
    return repo_id, revision or None


def _snapshot(data: str, config: str | None = None) -> Path:
    from huggingface_hub import snapshot_download

    repo_id, revision = hub_reference(data)
    patterns = HUB_FILES if config is None else [f"{config}/{pattern}" for pattern in HUB_FILES] + ["*.md"]
    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", revision=revision, allow_patterns=patterns))
    except Exception as error:  # noqa: BLE001 - offline, missing, gated: huggingface_hub raises many kinds
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise DataError(f"--data {data}: expected the Hub dataset {repo_id} (in the cache when HF_HUB_OFFLINE=1), "
                        f"found {type(error).__name__}: {detail}") from None


def remote_shards(data: str, config: str | None = None) -> dict[str, list[str]] | None:
    """{split: its shards' paths on the Hub} of `--data hf://datasets/...` streamed, listed
    without fetching any (HfFileSystem; read by ranges as training reads them); None offline,
    where the shards are read from the cache's snapshot instead."""
    from huggingface_hub import HfFileSystem, is_offline_mode

    if is_offline_mode():
        return None
    repo_id, revision = hub_reference(data)
    root = f"datasets/{repo_id}" + (f"@{revision}" if revision else "")
    folders = [root, f"{root}/data"] if config is None else [f"{root}/{config}"]
    try:
        system = HfFileSystem()
        paths = sorted(str(path) for folder in folders for suffix in SHARD_SUFFIXES
                       for path in system.glob(f"{folder}/*{suffix}"))
    except Exception as error:  # noqa: BLE001 - missing, gated, no network: many kinds
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise DataError(f"--data {data}: expected the Hub dataset {repo_id}, found {type(error).__name__}: "
                        f"{detail}") from None
    found: dict[str, list[str]] = {}
    for path in paths:
        split = path.rsplit("/", 1)[-1].split("-", 1)[0].split(".", 1)[0]
        if split in SPLITS and not path.endswith(".arrow"):
            found.setdefault(split, []).append(path)
    if not found:
        raise DataError(f"--data {data} --stream: expected parquet or tar shards named by split in {root} "
                        f"{'or its data/' if config is None else ''}, found none")
    return found


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a folder save_to_disk wrote."""
    return any((path / name).is_file() for name in SAVED_MARKERS)


def is_dataset_folder(path: Path) -> bool:
    """Whether `path` is a dataset folder this module reads (rather than a folder of images)."""
    return path.is_dir() and (any((path / name).is_file() for name in SAVED_MARKERS) or bool(_shards(path))
                              or bool(configs_of(path)))


def configs_of(path: Path) -> list[str]:
    """The configs of a folder in the Hub's layout: its subfolders (but data/) holding split shards."""
    return [folder.name for folder in sorted(path.iterdir()) if folder.is_dir() and not folder.is_symlink()
            and folder.name != "data" and _shards(path, folder.name)] if path.is_dir() else []


def _shards(path: Path, config: str | None = None) -> dict[str, list[Path]]:
    """{split name: its shard files} of a folder in the Hub's layout (top level or data/, or
    the config's folder)."""
    found: dict[str, list[Path]] = {}
    for folder in (path, path / "data") if config is None else (path / config,):
        for shard in sorted(folder.glob("*")) if folder.is_dir() else []:
            split = shard.name.split("-", 1)[0].split(".", 1)[0]
            if shard.suffix in SHARD_SUFFIXES and shard.is_file() and not shard.is_symlink() and split in SPLITS:
                found.setdefault(split, []).append(shard)
    return found


def read_dataset(path: Path, options: DatasetOptions = DatasetOptions()) -> tuple[dict[str, HubImages], list[str]]:
    """The dataset folder at `path` -> ({"train"/"val"/"test": its rows}, the class names)."""
    loaded = _load(path, options.config)
    parts = {}
    for name, split in loaded.items():
        ours = SPLITS.get(name)
        if ours is None or ours in parts:
            raise DataError(f"--data {path.name}: expected splits named train, validation and test, found "
                            f"{', '.join(sorted(loaded))}")
        parts[ours] = split
    if "train" not in parts:
        raise DataError(f"--data {path.name}: expected a 'train' split, found {', '.join(sorted(loaded))}")
    image, label = find_columns(path, parts["train"].features, options)
    labels = [str(name) for name in parts["train"].features[label].names]
    if len(labels) < 2:
        raise DataError(f"--data {path.name}: expected at least two classes in {label!r}, found {labels}")
    return {name: HubImages(split, image, label) for name, split in parts.items()}, labels


def _load(path: Path, config: str | None = None) -> dict[str, Any]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"--data {path.name} is a Hugging Face dataset: expected the datasets library, found it "
                        f"not installed ({INSTALL})") from None
    if any((path / name).is_file() for name in SAVED_MARKERS):
        if config is not None:
            raise DataError(f"--data-config {config}: expected a dataset with configs, found {path.name}, "
                            f"which save_to_disk wrote (one config); give no --data-config")
        loaded = datasets.load_from_disk(str(path))
        return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    files = {split: [str(shard) for shard in shards] for split, shards in shard_files(path, config).items()}
    builder = "parquet" if next(iter(files.values()))[0].endswith(".parquet") else "arrow"
    return dict(datasets.load_dataset(builder, data_files=files))


def shard_files(path: Path, config: str | None = None) -> dict[str, list[Path]]:
    """{split: shards} of `config` (None: the default one) of a folder in the Hub's layout;
    a config it lacks, or none named where it has several, is refused naming those it has."""
    found, configs = _shards(path, config), configs_of(path)
    if not found:
        expected = f"a config folder {config}/ of split shards" if config else "split shards at the top or in data/"
        named = f"its configs: {', '.join(configs)} (give one with --data-config)" if configs else "no configs"
        raise DataError(f"--data {path.name}: expected {expected}, found {named}")
    return found


def find_columns(path: Path, features: dict[str, Any], options: DatasetOptions = DatasetOptions(),
                 ) -> tuple[str, str]:
    """(the image column, the label column) of a split's features: those named, else the one of
    each kind (Image, ClassLabel)."""
    import datasets

    found = ", ".join(f"{name} ({type(feature).__name__})" for name, feature in features.items())
    chosen = []
    for flag, name, kind, what in (("--image-column", options.image_column, datasets.Image, "an Image feature"),
                                   ("--label-column", options.label_column, datasets.ClassLabel,
                                    "a ClassLabel, which names the classes")):
        if name is not None and name not in features:
            raise DataError(f"{flag} {name}: expected a column of --data {path.name}, found {found}")
        if name is not None and not isinstance(features[name], kind):
            raise DataError(f"{flag} {name}: expected {what}, found {type(features[name]).__name__} "
                            f"(columns: {found})")
        chosen.append([name] if name else [column for column, feature in features.items()
                                           if isinstance(feature, kind)])
    images, labels = chosen
    if len(images) != 1 or len(labels) != 1:
        raise DataError(f"--data {path.name}: expected one image column (an Image feature) and one label column "
                        f"(a ClassLabel, which names the classes), or --image-column / --label-column naming "
                        f"them, found {found}")
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

"""Data read as it trains, for image sets larger than one disk or one download: the training
split of a Hugging Face dataset's parquet shards (`--stream`), and WebDataset tar shards
(`train-000000.tar`, ...: each sample a `KEY.jpg` / `.png` / `.jpeg` / `.webp` image beside a
`KEY.cls` holding its class number).

Each split is a list of shards cut into blocks, the unit read at once: a parquet row group, or
TAR_BLOCK samples of a tar shard (read member by member: a tar is listed once, by its headers,
and a member is read at its offset; nothing is extracted). A sample's index is its place in the
split's shards taken in name order, so `ShardedRows[index]` reads any one sample (how the
config is chosen from a few hundred, how validation and test are read) and `read_block` reads
a block whole (how training reads).

An epoch's order (`epoch_order`) is a function of (seed, epoch) alone: the blocks shuffled,
then the samples of every SHUFFLE_ROWS-odd consecutive blocks shuffled together. Each torchrun
process takes one contiguous part of that order cut to whole global batches, and each of its
DataLoader workers a contiguous run of that part's batches (`worker_batches`), so each sample is
read once per epoch across all of them, each process takes the same number of steps, and a
worker reads few blocks another one reads too. A run resumed after `start_step` batches of an
epoch carries on from the very next batch (`StreamedTraining.start_step`).
"""

from __future__ import annotations

import dataclasses
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info

from vit_hub.data.hub_datasets import SPLITS, TAR_SUFFIX, DatasetOptions, find_columns
from vit_hub.errors import DataError, UserError
from vit_hub.processing.preprocess import open_image

SHUFFLE_ROWS = 1024  # samples shuffled together: a worker holds this many encoded images at most
TAR_BLOCK = 256  # samples of a tar shard read as one block
TAR_IMAGES = (".jpg", ".jpeg", ".png", ".webp")
MAX_CLASS_BYTES = 32  # a .cls member holds a number; anything longer is not one


@dataclasses.dataclass(frozen=True)
class Block:
    """`count` consecutive samples from index `first`, in shard `shard`: parquet row group
    `where`, or the tar members at `where` ([(offset, size) of each image])."""

    shard: int
    first: int
    count: int
    where: Any


class ShardedRows:
    """One split's shards -> (PIL image, class index) by sample index (map-style, as a
    DataLoader takes one), and whole blocks for streamed training."""

    def __init__(self, shards: list[Path], blocks: list[Block], targets: np.ndarray, image_column: str | None = None):
        self.shards, self.blocks, self.targets, self.image_column = shards, blocks, targets, image_column
        self.starts = np.asarray([block.first for block in blocks], dtype=np.int64)
        self.cached: tuple[int, list[bytes | None]] | None = None  # the last block read, for map-style reads

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        return self.read(index)

    def block_of(self, indices: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, indices, side="right") - 1

    def read_block(self, number: int) -> list[bytes | None]:
        """The encoded images of block `number`, in its order (None where a row holds no bytes)."""
        block = self.blocks[number]
        if self.image_column is None:  # a tar shard
            with open_shard(self.shards[block.shard]) as file:
                return [_read_at(file, offset, size) for offset, size in block.where]
        import pyarrow.parquet as pq

        with open_shard(self.shards[block.shard]) as handle, pq.ParquetFile(handle) as file:
            cells = file.read_row_group(block.where, columns=[self.image_column]).column(0).to_pylist()
        return [(cell or {}).get("bytes") for cell in cells]

    def read(self, index: int, min_side: int | None = None) -> tuple[Image.Image, int]:
        """Sample `index` alone: a tar member read at its offset, a parquet row from its row group
        (the last one read is kept: evaluation reads in order)."""
        number = int(self.block_of(np.asarray([index]))[0])
        block = self.blocks[number]
        if self.image_column is None:
            with open_shard(self.shards[block.shard]) as file:
                data = _read_at(file, *block.where[index - block.first])
            return decode(data, index, min_side), int(self.targets[index])
        if self.cached is None or self.cached[0] != number:
            self.cached = (number, self.read_block(number))
        return decode(self.cached[1][index - self.blocks[number].first], index, min_side), int(self.targets[index])


def open_shard(shard: Path | str):
    """A shard's file: on this machine (a Path), or on the Hub (a str, `datasets/OWNER/NAME/...`),
    read by ranges as it is read (huggingface_hub's HfFileSystem)."""
    if isinstance(shard, str):
        from huggingface_hub import HfFileSystem

        return HfFileSystem().open(shard, "rb")
    return open(shard, "rb")


def _read_at(file, offset: int, size: int) -> bytes:
    file.seek(offset)
    return file.read(size)


def decode(data: bytes | None, index: int, min_side: int | None = None) -> Image.Image:
    """A sample's image from its bytes (`open_image`, as an upload); one that holds none or does
    not decode is `UnreadableImage`, skipped as a folder's unreadable file is."""
    from vit_hub.data.folders import UnreadableImage  # torch: the card reads this module without it

    shown = f"sample {index}"
    if not data:
        raise UnreadableImage(f"{shown}: expected the image's bytes, found none (a file path is never followed)")
    try:
        return open_image(data, shown, min_side=min_side)
    except UserError as error:
        raise UnreadableImage(str(error)) from None


# Reading shards ---------------------------------------------------------------------------------
def parquet_rows(path: Path, shards: list[Path] | list[str], options: DatasetOptions,
                 ) -> tuple[ShardedRows, list[str]]:
    """A split's parquet shards (their features say which columns are the image and the class)."""
    import datasets
    import pyarrow.parquet as pq

    blocks, targets, labels, image = [], [], None, None
    for number, shard in enumerate(shards):
        with open_shard(shard) as handle, pq.ParquetFile(handle) as file:
            features = datasets.Features.from_arrow_schema(file.schema_arrow)
            image, label = find_columns(path, features, options)
            labels = labels or [str(name) for name in features[label].names]
            for group in range(file.num_row_groups):
                count = file.metadata.row_group(group).num_rows
                blocks.append(Block(number, sum(block.count for block in blocks), count, group))
            targets.append(file.read(columns=[label]).column(0).to_numpy())
    return ShardedRows(shards, blocks, np.concatenate(targets).astype(np.int64), image), labels


def tar_rows(shards: list[Path] | list[str]) -> ShardedRows:
    """A split's WebDataset tar shards, listed by their headers: each sample's image member and
    class number. Members that are not regular files (links, devices) are never read."""
    blocks, targets = [], []
    for number, shard in enumerate(shards):
        shown = Path(str(shard))
        try:
            images, classes = _tar_members(shard)
        except (tarfile.TarError, OSError) as error:
            raise DataError(f"--data {shown.parent.name}: expected WebDataset tar shards, found {shown.name} "
                            f"unreadable ({type(error).__name__}: {str(error)[:120]})") from None
        keys = [key for key in images if key in classes]
        if not keys:
            raise DataError(f"--data {shown.parent.name}: expected samples with an image ({', '.join(TAR_IMAGES)}) "
                            f"and a .cls member in {shown.name}, found none")
        for start in range(0, len(keys), TAR_BLOCK):
            part = keys[start:start + TAR_BLOCK]
            blocks.append(Block(number, sum(block.count for block in blocks), len(part), [images[k] for k in part]))
        targets += [classes[key] for key in keys]
    return ShardedRows(shards, blocks, np.asarray(targets, dtype=np.int64))


def _tar_members(shard: Path | str) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """{key: (offset, size) of its image}, {key: class number} of one tar shard, in its order."""
    images, classes, shown = {}, {}, Path(str(shard))
    with open_shard(shard) as handle, tarfile.open(fileobj=handle, mode="r:") as archive:  # read at offsets
        for member in archive:
            key, dot, suffix = member.name.rpartition("/")[2].partition(".")
            key = member.name[:len(member.name) - len(suffix) - len(dot)]
            if not member.isreg():
                continue
            if "." + suffix.lower() in TAR_IMAGES:
                images[key] = (member.offset_data, member.size)
            elif suffix == "cls" and member.size <= MAX_CLASS_BYTES:
                text = archive.extractfile(member).read().decode("ascii", errors="replace").strip()
                if not text.isdigit():
                    raise DataError(f"--data {shown.parent.name}: expected a class number in {member.name} "
                                    f"of {shown.name}, found {text[:20]!r}")
                classes[key] = int(text)
    return images, classes


def read_sharded(path: Path, files: dict[str, list[Path]] | dict[str, list[str]], options: DatasetOptions,
                 ) -> tuple[dict[str, ShardedRows], list[str]]:
    """A dataset's splits as ShardedRows ({"train"/"val"/"test": rows}, class names): tar
    shards' names are their class numbers, parquet shards' their ClassLabel's."""
    parts, labels = {}, None
    for name, shards in files.items():
        if SPLITS[name] in parts:
            raise DataError(f"--data {path.name}: expected splits named train, validation and test, found "
                            f"{', '.join(sorted(files))}")
        if str(shards[0]).endswith(TAR_SUFFIX):
            parts[SPLITS[name]] = tar_rows(shards)
        else:
            parts[SPLITS[name]], labels = parquet_rows(path, shards, options)
    if "train" not in parts:
        raise DataError(f"--data {path.name}: expected a 'train' split, found {', '.join(sorted(files))}")
    if labels is None:
        labels = [str(number) for number in range(int(max(rows.targets.max() for rows in parts.values())) + 1)]
    if len(labels) < 2:
        raise DataError(f"--data {path.name}: expected at least two classes, found {labels}")
    return parts, labels


# The order of an epoch, dealt to processes and workers -----------------------------------------
def epoch_order(rows: ShardedRows, kept: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """Every kept sample's index, in epoch `epoch`'s order: the blocks shuffled, then the samples
    of each run of consecutive blocks that holds SHUFFLE_ROWS or more shuffled together."""
    rng = np.random.default_rng([seed, epoch])
    wanted = np.zeros(len(rows), dtype=bool)
    wanted[kept] = True
    order, window, held = [], [], 0
    for number in rng.permutation(len(rows.blocks)).tolist() + [None]:
        if number is not None:
            block = rows.blocks[number]
            window.append(np.arange(block.first, block.first + block.count))
            held += block.count
        if window and (held >= SHUFFLE_ROWS or number is None):
            samples = np.concatenate(window)
            samples = samples[wanted[samples]]
            order.append(samples[np.random.default_rng([seed, epoch, len(order)]).permutation(len(samples))])
            window, held = [], 0
    return np.concatenate(order) if order else np.zeros(0, dtype=np.int64)


def process_batches(size: int, batch_size: int, rank: int, world_size: int) -> list[tuple[int, int]]:
    """(start, stop) in the epoch's order of each of process `rank`'s batches: the order cut to
    whole global batches (all of it when it holds less than one), each global batch dealt as
    `world_size` contiguous parts, so every process takes the same number of steps."""
    steps = max(1, size // batch_size)
    used = steps * batch_size if size >= batch_size else size
    bounds = np.linspace(0, used, world_size + 1).round().astype(int)  # this process's part: one contiguous run
    first, last = int(bounds[rank]), int(bounds[rank + 1])
    edges = np.linspace(first, last, steps + 1).round().astype(int)
    return [(int(edges[step]), int(edges[step + 1])) for step in range(steps)]


def worker_batches(batches: list[tuple[int, int]], workers: int, worker: int, start_step: int) -> list[tuple[int, int]]:
    """The batches worker `worker` of `workers` makes, from `start_step` on. A DataLoader takes
    batches from its workers in turn, so batch j comes from worker (j - start_step) % workers;
    the batches are dealt so that each worker's are one contiguous run of the order (its role:
    runs in worker order, the first ones one batch longer), and a loader started at `start_step`
    gives worker w the role of the worker that batch start_step + w had."""
    workers = max(1, workers)
    role = (worker + start_step) % workers
    share = [len(range(number, len(batches), workers)) for number in range(workers)]
    first = sum(share[:role])
    mine = batches[first:first + share[role]]  # the run of batches this role makes, in order
    done = len(range(role, start_step, workers)) if start_step > role else 0
    return mine[done:]


class StreamedTraining(IterableDataset):
    """The training split streamed: an iterable (torch's IterableDataset protocol) over this
    process's and this DataLoader worker's samples of the epoch, `make(epoch, index, image,
    label)` applied to each (the seeded augmentation). `set_epoch` and `start_step` are read
    when iteration starts, so the loader's workers are started anew each epoch."""

    def __init__(self, rows: ShardedRows, kept: np.ndarray, seed: int, batch_size: int, rank: int, world_size: int,
                 make: Callable[[int, int, Image.Image, int], Any], min_side: int | None = None):
        self.rows, self.kept, self.seed, self.batch_size = rows, np.asarray(kept, dtype=np.int64), seed, batch_size
        self.rank, self.world_size, self.make, self.min_side = rank, world_size, make, min_side
        self.epoch, self.start_step = 0, 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """The epoch to read next, from its batch `start_step` on (a run resumed within it)."""
        self.epoch, self.start_step = epoch, start_step

    def __len__(self) -> int:
        return sum(stop - start for start, stop in process_batches(len(self.kept), self.batch_size, self.rank,
                                                                   self.world_size)[self.start_step:])

    def samples(self, workers: int = 1, worker: int = 0) -> np.ndarray:
        """The indices this worker reads this epoch, in order."""
        order = epoch_order(self.rows, self.kept, self.seed, self.epoch)
        batches = process_batches(len(order), self.batch_size, self.rank, self.world_size)
        runs = worker_batches(batches, workers, worker, self.start_step)
        return np.concatenate([order[start:stop] for start, stop in runs]) if runs else np.zeros(0, np.int64)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        indices = self.samples(info.num_workers if info else 1, info.id if info else 0)
        numbers = self.rows.block_of(indices).tolist()
        last_use = {number: position for position, number in enumerate(numbers)}
        held: dict[int, list[bytes | None]] = {}  # the blocks of the window being read: SHUFFLE_ROWS-odd images
        for position, (index, number) in enumerate(zip(indices.tolist(), numbers)):
            if number not in held:
                held[number] = self.rows.read_block(number)
            image, index = self._readable(held[number], number, index)
            if last_use[number] == position:
                del held[number]
            yield self.make(self.epoch, index, image, int(self.rows.targets[index]))

    def _readable(self, encoded: list[bytes | None], number: int, index: int) -> tuple[Image.Image, int]:
        """Sample `index`'s image, or when it does not decode the next of its block that does (as a
        folder's unreadable file is replaced by the next readable one): each worker still makes
        its whole batches, so every process takes the same steps."""
        from vit_hub.data.folders import UnreadableImage

        first = self.rows.blocks[number].first
        for step in range(len(encoded)):
            at = first + (index - first + step) % len(encoded)
            try:
                return decode(encoded[at - first], at, self.min_side), at
            except UnreadableImage:
                continue
        raise DataError(f"found no readable images among the {len(encoded)} samples of block {number} of this split; "
                        f"expected images Pillow decodes")



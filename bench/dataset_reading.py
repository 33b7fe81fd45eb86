"""Images per second per core read from a Hugging Face dataset, read whole or streamed, and from
WebDataset tar shards, against the same images as a folder.

    python bench/dataset_reading.py [--images 600] [--side 320] [--rounds 5] [--model-side 64]
        [--work /tmp/vit_hub_dataset_bench]

Generates `--images` JPEG photos (two classes, `--side` x 3/4 `--side` pixels, quality 90) and
writes them three times: as a class folder, as parquet shards in the Hub's layout holding the
very same JPEG bytes (`data/train-0000N-of-00002.parquet`, row groups of 100 rows) and as two
WebDataset tar shards (`train-00000N.tar`: KEY.jpg + KEY.cls). Each round reads every training
image as training's loader does for a model of `--model-side` px (a JPEG decodes at a reduced
scale where that keeps enough pixels), one thread, in this process: the folder and the dataset
by index (`load_splits(...).train.read(i, min_side)`), the dataset with `--stream` and the tar
shards through `StreamedTraining` in an epoch's order, block by block; the order of the four
turned every round so machine noise hits all. Prints the median images/s of each and the
per-round ratios to the folder.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vit_hub.data.batches import DECODE_MARGIN  # noqa: E402
from vit_hub.data.hub_datasets import DatasetOptions  # noqa: E402
from vit_hub.data.sources import load_splits  # noqa: E402
from vit_hub.data.streams import StreamedTraining  # noqa: E402

CLASSES = ("disc", "square")


def photo(kind: str, side: int, rng: np.random.Generator) -> bytes:
    """One JPEG of a shape on a noisy ground, as a camera's file."""
    width, height = side, side * 3 // 4
    image = Image.new("RGB", (width, height), tuple(int(v) for v in rng.integers(0, 256, 3)))
    size = int(rng.integers(height // 3, height * 2 // 3))
    left, top = int(rng.integers(0, width - size)), int(rng.integers(0, height - size))
    (ImageDraw.Draw(image).ellipse if kind == "disc" else ImageDraw.Draw(image).rectangle)(
        (left, top, left + size, top + size), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    pixels = np.clip(np.asarray(image, np.float64) + rng.normal(0, 6, (height, width, 3)), 0, 255).astype(np.uint8)
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, format="JPEG", quality=90)
    return encoded.getvalue()


def write_all(work: Path, count: int, side: int) -> tuple[Path, Path, Path]:
    """(the class folder, the dataset folder, the tar shards' folder) of the same JPEG files."""
    import datasets

    rng = np.random.default_rng(0)
    files = [(CLASSES[index % 2], photo(CLASSES[index % 2], side, rng)) for index in range(count)]
    folder, hub, shards = work / "folder", work / "dataset", work / "tar"
    for index, (kind, data) in enumerate(files):
        (folder / kind).mkdir(parents=True, exist_ok=True)
        (folder / kind / f"{index:05d}.jpg").write_bytes(data)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(CLASSES))})
    rows = datasets.Dataset.from_dict({"image": [{"bytes": data, "path": None} for _, data in files],
                                       "label": [CLASSES.index(kind) for kind, _ in files]}, features=features)
    (hub / "data").mkdir(parents=True, exist_ok=True)
    for number in range(2):
        rows.shard(2, number, contiguous=True).to_parquet(str(hub / "data" / f"train-{number:05d}-of-00002.parquet"),
                                                          batch_size=100)
    (hub / "README.md").write_text("# generated photos\n")
    shards.mkdir(parents=True, exist_ok=True)
    for number in range(2):
        with tarfile.open(shards / f"train-{number:06d}.tar", "w") as archive:
            for index in range(number, count, 2):
                kind, data = files[index]
                label = str(CLASSES.index(kind)).encode()
                for name, member in ((f"{index:05d}.jpg", data), (f"{index:05d}.cls", label)):
                    info = tarfile.TarInfo(name)
                    info.size = len(member)
                    archive.addfile(info, io.BytesIO(member))
    return folder, hub, shards


def rate(data: Path, min_side: int) -> float:
    """Images per second reading every training image of `data` as training does."""
    train = load_splits(str(data), val_split=0).train
    started = time.perf_counter()
    for index in range(len(train)):
        train.read(index, min_side)
    return len(train) / (time.perf_counter() - started)


def stream_rate(data: Path, min_side: int) -> float:
    """Images per second reading every training image of `data` streamed, in an epoch's order."""
    train = load_splits(str(data), val_split=0, options=DatasetOptions(stream=True)).train
    stream = StreamedTraining(train.dataset, train.indices, 0, 1, 0, 1, lambda *sample: None, min_side=min_side)
    started = time.perf_counter()
    count = sum(1 for _ in stream)
    return count / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--side", type=int, default=320)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model-side", type=int, default=64)
    parser.add_argument("--work", type=Path, default=Path("/tmp/vit_hub_dataset_bench"))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    folder, hub, shards = write_all(args.work, args.images, args.side)
    min_side = DECODE_MARGIN * args.model_side
    readers = {"folder": lambda: rate(folder, min_side), "dataset": lambda: rate(hub, min_side),
               "streamed": lambda: stream_rate(hub, min_side), "tar": lambda: stream_rate(shards, min_side)}
    rates = {name: [] for name in readers}
    for round_ in range(args.rounds):
        names = list(readers)[round_ % len(readers):] + list(readers)[:round_ % len(readers)]
        for name in names:
            rates[name].append(readers[name]())
    print(f"{args.images} JPEGs of {args.side}x{args.side * 3 // 4}, min_side {min_side}, one thread:")
    for name, values in rates.items():
        print(f"  {name:8s} median {statistics.median(values):7.1f} images/s  ({', '.join(f'{v:.0f}' for v in values)})")
    for name in ("dataset", "streamed", "tar"):
        ratios = [other / base for other, base in zip(rates[name], rates["folder"])]
        print(f"  {name} / folder per round: {', '.join(f'{r:.2f}' for r in ratios)} "
              f"(median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()

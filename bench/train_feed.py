"""Does the loader feed the training step? End to end against the step alone, on one machine.

    python bench/train_feed.py [--images 12800] [--batch-size 128] [--epochs 3] [--workers N]
        [--augment photos] [--compile] [--work /tmp/vit_hub_feed] [--json OUT]

On a folder of generated 256x256 JPEGs (`input_pipeline.make_photos`'s colour fields with discs
and noise, 10 classes, written in parallel), ViT-S/16 (`--preset small`, 224 px), bf16 on CUDA:

  * step alone: `bench/train_throughput.py`'s vit_hub ViT-S/16 step at the same batch on
    random tensors already on the device (no data);
  * loader alone: the trainer's own training loader (`SeededAugmentation`, `EpochSampler`,
    `make_loader` and `CropBatches` as `build_loaders` makes them, the default workers unless
    --workers) and the batch finished as the step would (on a GPU: augmented on the device) with
    no model, epochs 2 and 3 (workers persist, as in training);
  * end to end: `vit-hub train --data FOLDER --preset small --batch-size B --epochs E` on this
    machine's device, the mean images/s of epochs 2..E from its metrics.json (epoch 1 pays
    for worker start-up and, where it compiles, the compile).

Prints each rate and end to end / step alone (the share of the step's speed training keeps).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from input_pipeline import make_photos  # noqa: E402

from vit_hub.data import batches  # noqa: E402
from vit_hub.data.augmentation import TrainTransform  # noqa: E402
from vit_hub.data.sources import load_splits  # noqa: E402
from vit_hub.model.config import ViTConfig  # noqa: E402

CLASSES = 10


def make_folder(root: Path, images: int) -> Path:
    """`images` JPEGs in class folders, written by one process per core (each a part of them)."""
    if (root / "done").is_file():
        return root
    cores = os.cpu_count() or 1
    parts = [root.with_name(f"{root.name}.part{index}") for index in range(cores)]
    with ProcessPoolExecutor(cores) as pool:
        list(pool.map(make_photos, parts, [images // cores] * cores, [256] * cores, range(cores)))  # a seed each
    for part in parts:  # <root>.partP/classK/N.jpg -> <root>/classK/partP_N.jpg
        for image in part.glob("class*/*.jpg"):
            (root / image.parent.name).mkdir(parents=True, exist_ok=True)
            image.rename(root / image.parent.name / f"{part.name.rsplit('.', 1)[1]}_{image.name}")
        shutil.rmtree(part)
    (root / "done").write_text("")
    return root


def loader_alone(folder: Path, batch_size: int, workers: int | None, augment: str, device: str) -> float:
    """Images/s of the trainer's training loader, epochs 2 and 3, nothing else running."""
    splits = load_splits(str(folder), val_split=0.0)
    config = ViTConfig.from_preset("small", num_classes=CLASSES)
    # as the trainer does: the batch augmented on the device, else each image in the workers
    transform = TrainTransform(config, augment, per_image=device == "cpu")
    dataset = batches.SeededAugmentation(splits.train, transform, seed=0)
    sampler = batches.EpochSampler(len(dataset), 0, batch_size, drop_last=True)
    workers = batches.default_workers(device) if workers is None else workers
    loader = batches.make_loader(dataset, batch_size, shuffle=False, seed=0, num_workers=workers,
                                 pin_memory=device == "cuda", sampler=sampler, persistent_workers=True,
                                 collate_fn=batches.CropBatches())
    rates = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        started, seen = time.perf_counter(), 0
        for pixels, _, draws in loader:
            transform.finish(pixels.to(device, non_blocking=True), draws.to(device, non_blocking=True))
            seen += len(pixels)
        if device == "cuda":
            torch.cuda.synchronize()
        rates.append(seen / (time.perf_counter() - started))
    return sum(rates[1:]) / 2


def step_alone(batch_size: int, compile: bool, work: Path) -> float:
    """vit_hub's images/s (wall) in bench/train_throughput.py's ViT-S/16 bf16 step."""
    report = work / "step.json"
    command = [sys.executable, str(REPO / "bench" / "train_throughput.py"), "--device", "cuda", "--amp", "bf16",
               "--configs", "vit-s16", "--batch-size", str(batch_size), "--rounds", "5", "--steps", "10",
               "--warmup", "3", "--json", str(report), *(["--compile"] if compile else [])]
    subprocess.run(command, check=True)
    return json.loads(report.read_text())["vit-s16"]["vit_hub"]["wall"]


def end_to_end(folder: Path, work: Path, args: argparse.Namespace) -> dict:
    out = work / "run"
    command = [sys.executable, "-m", "vit_hub", "train", "--data", str(folder), "--preset", "small",
               "--batch-size", str(args.batch_size), "--epochs", str(args.epochs), "--augment", args.augment,
               "--out", str(out), "--overwrite", "--val-split", "0.02",
               "--compile" if args.compile else "--no-compile",
               *(["--workers", str(args.workers)] if args.workers is not None else [])]
    subprocess.run(command, check=True, cwd=REPO)
    history = json.loads((out / "metrics.json").read_text())["history"]
    later = [record["images_per_second"] for record in history[1:]]
    return {"images_per_second": sum(later) / len(later), "per_epoch": [r["images_per_second"] for r in history],
            "mfu": [record.get("mfu") for record in history]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=12800)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, help="DataLoader workers (default: the trainer's)")
    parser.add_argument("--augment", default="photos")
    parser.add_argument("--compile", action="store_true", help="compile the step (alone and end to end)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/vit_hub_feed"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/train_feed.py measures feeding a GPU: it needs one")
    folder = make_folder(args.work / f"photos{args.images}", args.images)
    results = {"step_alone": step_alone(args.batch_size, args.compile, args.work),
               "loader_alone": loader_alone(folder, args.batch_size, args.workers, args.augment, "cuda")}
    results["end_to_end"] = end_to_end(folder, args.work, args)
    share = results["end_to_end"]["images_per_second"] / results["step_alone"]
    print(f"{torch.cuda.get_device_name()}, {os.cpu_count()} cores, batch {args.batch_size}, augment {args.augment}, "
          f"workers {args.workers or batches.default_workers('cuda')}")
    print(f"step alone {results['step_alone']:.0f} img/s; loader alone {results['loader_alone']:.0f} img/s; "
          f"end to end {results['end_to_end']['images_per_second']:.0f} img/s = {share:.0%} of the step alone")
    print("command: python " + shlex.join(["bench/train_feed.py", *(argv if argv is not None else sys.argv[1:])]))
    if args.json:
        args.json.write_text(json.dumps({**results, "share": share}, indent=2))


if __name__ == "__main__":
    main()

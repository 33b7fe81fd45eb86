"""Training reads of large photos: decoded whole, against decoded at the JPEG's reduced scale.

    python bench/large_photos.py [--images 24] [--side 3000] [--sizes 64 224] [--rounds 3]

A folder of `--images` generated square JPEGs of `--side` pixels (a phone photo is 4000x3000),
read as a training worker reads it: `SeededAugmentation` (decode, the model's domain, the
photo augmentation, uint8 pixels) for a model of each `--sizes` side. "whole" decodes every
file in full (`DomainImages.min_side` set to None, as before the reduced reads); "reduced"
is the default, which keeps DECODE_MARGIN x the model's side on the decoded image's shorter
side. One process, one thread; the clock is the process's CPU time per image, so other jobs on
the machine do not count; the two alternate round by round, medians are reported.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
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


def reader(folder: Path, side: int, reduced: bool) -> batches.SeededAugmentation:
    config = ViTConfig(image_size=side, patch_size=side // 8, embed_dim=64, depth=1, num_heads=2, num_classes=10)
    dataset = batches.SeededAugmentation(load_splits(str(folder), val_split=0.0).train, TrainTransform(config, "photos"),
                                         seed=0)
    if not reduced:
        dataset.images.min_side = None
    return dataset


def cpu_ms_per_image(dataset: batches.SeededAugmentation) -> float:
    started = time.process_time()
    for key in range(len(dataset)):
        dataset[key]
    return (time.process_time() - started) / len(dataset) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--side", type=int, default=3000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 224])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/vit_hub_large_photos"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    folder = make_photos(args.work / f"photos{args.images}_{args.side}", args.images, side=args.side)
    print(f"{args.images} JPEGs of {args.side}x{args.side}; CPU ms per training read, median of {args.rounds} rounds")
    print("| model side | whole | reduced | speed-up | decoded side (reduced) |\n|---|---|---|---|---|")
    for side in args.sizes:
        readers = {reduced: reader(folder, side, reduced) for reduced in (False, True)}
        times: dict[bool, list[float]] = {False: [], True: []}
        for round_index in range(args.rounds):
            for reduced in ((False, True) if round_index % 2 == 0 else (True, False)):
                times[reduced].append(cpu_ms_per_image(readers[reduced]))
        whole, reduced = (statistics.median(times[key]) for key in (False, True))
        decoded = readers[True].images.dataset.read(0, readers[True].images.min_side)[0].size
        print(f"| {side} | {whole:.1f} | {reduced:.1f} | {whole / reduced:.1f}x | {decoded[0]}x{decoded[1]} |")
    print("command: python " + shlex.join(["bench/large_photos.py", *(argv if argv is not None else sys.argv[1:])]))


if __name__ == "__main__":
    main()

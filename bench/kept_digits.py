"""What keeping the canonical digits saves: the training loader's CPU time per MNIST sample,
with every digit canonicalised again each epoch and with each kept after its first epoch
(`batches.DomainImages`), measured in this process with one thread and no workers.

    OMP_NUM_THREADS=1 python bench/kept_digits.py [--images 3000] [--epochs 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.utils.data import Subset

from vit_hub.data.augmentation import TrainTransform
from vit_hub.data.batches import SeededAugmentation
from vit_hub.data.sources import load_splits
from vit_hub.model.config import PRESETS, ViTConfig


def per_sample_ms(dataset: SeededAugmentation, epoch: int) -> float:
    start = time.perf_counter()
    for index in range(len(dataset)):
        dataset[epoch * len(dataset) + index]
    return 1000 * (time.perf_counter() - start) / len(dataset)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = ViTConfig(**PRESETS["mnist"])
    images = Subset(load_splits("mnist").train.dataset, range(args.images))
    print(f"{args.images} MNIST training digits, canonicalize: digit, digit augmentation; ms per sample\n")
    print("| digits | " + " | ".join(f"epoch {epoch + 1}" for epoch in range(args.epochs)) + " |")
    print("|---|" + "---|" * args.epochs)
    for keep in (False, True):
        dataset = SeededAugmentation(images, TrainTransform(config, "digits"), seed=0, keep_domain=keep)
        times = [per_sample_ms(dataset, epoch) for epoch in range(args.epochs)]
        print(f"| {'kept' if keep else 'canonicalised every epoch'} | " + " | ".join(f"{t:.2f}" for t in times) + " |")
    print(f"\nload average {os.getloadavg()[0]:.2f}; {time.strftime('%Y-%m-%d %H:%M')}; "
          f"command: python {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()

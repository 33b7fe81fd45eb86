"""The training loader of a streamed split (`vit_hub.data.streams`): each process reads its part
of every epoch's order and each DataLoader worker a contiguous run of that part's batches, with
the same per-sample augmentation (seed, epoch, index) and batching as the folder's loader.

Its workers start anew each epoch (a persistent worker would keep the epoch it started with:
an iterable's epoch is read as its iteration starts), and `set_epoch(epoch, start_step)` lets a
run resumed mid-epoch carry on at the very next batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from vit_hub.data import batches
from vit_hub.data.sources import DataSplits
from vit_hub.data.streams import StreamedTraining
from vit_hub.train.distributed import Runtime
from vit_hub.train.loaders import RunLoaders
from vit_hub.train.schedule import Schedule


class CurrentImage(Dataset):
    """A one-image window onto a split of `size` samples: what `SeededAugmentation` reads from
    when the stream hands it each image it has just read, so a streamed sample is augmented
    exactly as a folder's (by `sample_seed(seed, epoch, index)`)."""

    def __init__(self, size: int):
        self.size, self.current = size, None

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        return self.current


def streamed_loaders(loaders: RunLoaders, splits: DataSplits, seed: int, runtime: Runtime,
                     schedule: Schedule) -> RunLoaders:
    """`loaders` with the training loader reading `splits.train` as a stream."""
    rows, kept = splits.train.dataset, np.asarray(splits.train.indices, dtype=np.int64)
    current = CurrentImage(len(rows))
    augmented = batches.SeededAugmentation(current, loaders.train_loader.dataset.transform, seed, keep_domain=False)

    def make(epoch: int, index: int, image: Image.Image, label: int):
        current.current = (image, label)
        return augmented[epoch * len(rows) + index]

    stream = StreamedTraining(rows, kept, seed, schedule.batch_size, runtime.rank, runtime.world_size, make,
                              min_side=augmented.images.min_side)
    old = loaders.train_loader
    loader = DataLoader(stream, batch_size=schedule.batch_size // runtime.world_size, num_workers=old.num_workers,
                        pin_memory=old.pin_memory, collate_fn=old.collate_fn)
    return dataclasses.replace(loaders, train_loader=loader, sampler=stream)

"""The training loader of a streamed split (`vit_hub.data.streams`): each process reads its part
of every epoch's order and each DataLoader worker a contiguous run of that part's batches, with
the same per-sample augmentation (seed, epoch, index) and batching as the folder's loader.

Its workers start anew each epoch (a persistent worker would keep the epoch it started with:
an iterable's epoch is read as its iteration starts), and `set_epoch(epoch, start_step)` lets a
run resumed mid-epoch carry on at the very next batch.

Within an epoch a streamed run saves a checkpoint every `--checkpoint-steps` steps
(`record_within`): the steps done, the loss and accuracy sums so far and dropout's random
state, beside the weights and the optimizer; `--resume` puts them back (`resume_within`) and
the loop carries on from the next batch, drawing what the uninterrupted run drew. The batches
depend on the number of processes and of loader workers (each worker reads its own run of
the stream), so a run resumed within an epoch must have the same.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from vit_hub.data import batches
from vit_hub.data.sources import DataSplits
from vit_hub.data.streams import StreamedTraining
from vit_hub.train.checkpoint import Progress
from vit_hub.train.distributed import Runtime, all_reduce
from vit_hub.train.loaders import RunLoaders
from vit_hub.train.schedule import Schedule
from vit_hub.train.settings import TrainingError


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
                        pin_memory=old.pin_memory, collate_fn=old.collate_fn,
                        generator=torch.Generator().manual_seed(0))  # starting it draws from this, not from dropout's
    return dataclasses.replace(loaders, train_loader=loader, sampler=stream)


# Within an epoch: a streamed run's checkpoints, and where its resumed run starts ----------------
def epoch_loader(loaders: RunLoaders, epoch: int, start: int) -> DataLoader:
    """The training loader for `epoch`, from batch `start` on (a streamed run resumed within it)."""
    loader = loaders.epoch(epoch)
    if start:
        loaders.sampler.set_epoch(epoch, start)
    return loader


def resume_within(progress: Progress, runtime: Runtime, loaders: RunLoaders, epoch: int,
                  sums: tuple[torch.Tensor, torch.Tensor, int]) -> tuple[int, tuple]:
    """The step `epoch` starts at and the (loss sum, correct, seen) to start from: 0 and `sums`,
    or where a checkpoint within it left off, with dropout's random state then put back. The
    sums so far, over every process, are the main process's to carry."""
    if progress.step_in_epoch == 0 or epoch != progress.epochs_done:
        return 0, sums
    layout = [runtime.world_size, loaders.train_loader.num_workers]
    if progress.stream_layout != layout:
        raise TrainingError(f"--resume: expected {progress.stream_layout[0]} process(es) with "
                            f"{progress.stream_layout[1]} loader worker(s) each, as the streamed run had when it "
                            f"stopped {progress.step_in_epoch} steps into epoch {epoch + 1}, got {layout[0]} with "
                            f"{layout[1]} (give --workers {progress.stream_layout[1]})")
    torch.set_rng_state(progress.rng["cpu"])
    if "cuda" in progress.rng and runtime.device.type == "cuda":
        torch.cuda.set_rng_state(progress.rng["cuda"], runtime.device)
    totals = progress.epoch_sums if runtime.is_main else [0.0, 0.0, 0.0]
    return progress.step_in_epoch, (torch.tensor(totals[0], dtype=torch.float64, device=runtime.device),
                                    torch.tensor(int(totals[1]), dtype=torch.int64, device=runtime.device),
                                    int(totals[2]))


def record_within(trainer: Any, steps: int, sums: tuple[torch.Tensor, torch.Tensor, int]) -> bool:
    """After `steps` steps of the epoch: whether a streamed run saves a checkpoint now (every
    `--checkpoint-steps`, but the epoch's last, which is the epoch's own), its progress then
    recorded (the sums over every process, dropout's random state, the processes and workers)."""
    device, runtime = trainer.runtime.device, trainer.runtime
    if not trainer.data.splits.streamed or steps % trainer.settings.checkpoint_steps or \
            steps >= trainer.plan.schedule.steps_per_epoch:
        return False
    loss_sum, correct, seen = sums
    totals = all_reduce(torch.stack([loss_sum, correct.double(),
                                     torch.tensor(seen, dtype=torch.float64, device=device)]), runtime)
    rng = {"cpu": torch.get_rng_state()} | ({"cuda": torch.cuda.get_rng_state(device)} if device.type == "cuda" else {})
    trainer.progress.within(steps, totals.tolist(), rng, [runtime.world_size, trainer.loaders.train_loader.num_workers])
    return True

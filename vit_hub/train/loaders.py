"""A run's data as each process reads it: its share of every seeded, augmented global batch,
its slice of the evaluation splits, and the unreadable files it met on the way.

Each global batch is the same whatever the number of processes (`batches.EpochSampler` deals
it out), and each sample's augmentation is drawn from (seed, epoch, index) alone, so the data
a run sees does not depend on `torchrun`'s process count or on `--workers`.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset

from vit_hub.data import batches
from vit_hub.data.augmentation import TrainTransform
from vit_hub.data.sources import DataSplits, skipped_report
from vit_hub.model.config import ViTConfig
from vit_hub.train.distributed import Runtime, choose_cpu_threads, shard, union_of_all
from vit_hub.train.schedule import Schedule
from vit_hub.train.settings import TrainSettings

MIN_EVAL_BATCH = 256  # evaluation holds no gradients: larger batches than training's
UNREADABLE_CHECK_SECONDS = 1.0  # between reads of the workers' unreadable-file flags


@dataclasses.dataclass
class RunLoaders:
    """This process's loaders. `model_input` finishes a training batch on the device
    (`TrainTransform.finish`): the workers send uint8 pixels and each image's draws; on a GPU
    the photo augmentation runs there, on the batch; on a CPU the workers apply it to each
    image with PIL (`per_image`), and the step only normalises and erases."""

    train_loader: DataLoader
    sampler: batches.EpochSampler
    model_input: Callable
    eval_sets: dict[str, Dataset]  # "val" and "test" where the data has them, this process's slice
    eval_batch: int
    options: dict[str, Any]  # workers and pinning, shared by every loader

    def epoch(self, epoch: int) -> DataLoader:
        """The training loader for `epoch`: a new shuffle every epoch, the same on every process."""
        self.sampler.set_epoch(epoch)
        return self.train_loader

    def eval_loader(self, name: str) -> DataLoader:
        return batches.make_loader(self.eval_sets[name], self.eval_batch, shuffle=False, seed=0, **self.options)


def build_loaders(settings: TrainSettings, runtime: Runtime, config: ViTConfig, splits: DataSplits,
                  schedule: Schedule) -> RunLoaders:
    """Loaders of the training split (augmented as `settings.augment` says, workers kept across
    epochs) and of the evaluation splits (preprocessed as inference does)."""
    workers = (batches.default_workers(runtime.device.type, runtime.local_world_size)
               if settings.num_workers is None else settings.num_workers)
    choose_cpu_threads(runtime, workers)
    options = dict(num_workers=workers, pin_memory=runtime.device.type == "cuda")
    on_device = runtime.device.type != "cpu"
    transform = TrainTransform(config, settings.augment, per_image=not on_device)
    train_set = batches.SeededAugmentation(splits.train, transform, settings.seed)
    per_process_batch = schedule.batch_size // runtime.world_size
    sampler = batches.EpochSampler(len(train_set), settings.seed, schedule.batch_size,
                                 drop_last=len(train_set) >= schedule.batch_size,
                                 rank=runtime.rank, world_size=runtime.world_size)
    train_loader = batches.make_loader(train_set, per_process_batch, shuffle=False, seed=0, sampler=sampler,
                                     persistent_workers=True, collate_fn=batches.CropBatches(), **options)
    eval_transform = batches.EvalTransform(config)
    eval_sets = {name: batches.Transformed(shard(dataset, runtime), eval_transform)
                 for name in ("val", "test") if (dataset := getattr(splits, name)) is not None}
    return RunLoaders(train_loader, sampler, transform.finish, eval_sets,
                      max(MIN_EVAL_BATCH, per_process_batch), options)


@dataclasses.dataclass
class UnreadableReport:
    """Unreadable files met by the loaders, each named once on stderr by the main process
    (with --strict, the first fails the run in one line instead). Each process meets its own."""

    splits: DataSplits
    runtime: Runtime
    reported: set[str] = dataclasses.field(default_factory=set)
    checked_at: float = -math.inf  # time.monotonic() of the last read of the flags

    def report(self, gather: bool = False) -> None:
        """Name the files met since the last call. `gather` (at the end of an epoch, on every
        process) collects every process's; between those, the flags are read at most once per
        UNREADABLE_CHECK_SECONDS, since each read scans a flag per image of the data."""
        if not gather and time.monotonic() - self.checked_at < UNREADABLE_CHECK_SECONDS:
            return
        self.checked_at = time.monotonic()
        self.splits.check_unreadable()
        met = self.splits.skipped
        if gather and self.runtime.distributed:
            met = sorted(union_of_all(set(met), self.runtime))
        new = [path for path in met if path not in self.reported]
        self.reported.update(new)
        if self.runtime.is_main:
            for path in new:
                print(f"skipped unreadable image {path} (use --strict to fail instead)", file=sys.stderr)

    def summary(self) -> str | None:
        """The closing list of every file skipped, or None when there was none."""
        return skipped_report(sorted(self.reported))

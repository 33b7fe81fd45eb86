"""From datasets of (PIL image, label) to batches: the evaluation transform, the dataset
wrappers that apply a transform, the seeded order of training samples and the DataLoader.

Training's samples are seeded one by one (`SeededAugmentation`, `EpochSampler`), so the
images a run sees depend on its seed alone, whatever the number of workers or processes.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from vit_hub.data.augmentation import TrainTransform
from vit_hub.data.sources import Split
from vit_hub.model.config import ViTConfig
from vit_hub.processing.preprocess import preprocess, to_model_domain

# The most memory one process spends keeping canonical digits or decoded photos (`DomainImages`):
# MNIST's 60,000 training digits at 28x28 take 47 MB, 720 photos of 224x224 RGB 108 MB.
KEPT_DOMAIN_BYTES = 256 * 2**20
# A training read keeps at least this many times the model's side on the image's shorter side
# (`DomainImages`): a random-resized crop keeps at least half the area, so even the smallest
# crop is still reduced more than 2x by the resize to the model's size, as before.
DECODE_MARGIN = 4


class EvalTransform:
    """PIL image -> normalised float tensor [C, H, W], exactly as every inference path."""

    def __init__(self, config: ViTConfig):
        self.config = config

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return torch.from_numpy(preprocess(image, self.config))


class Transformed(Dataset):
    """(PIL image, label) dataset -> (tensor, label) through `transform`."""

    def __init__(self, dataset: Dataset, transform: Callable[[Image.Image], torch.Tensor]):
        self.dataset = dataset
        self.transform = transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        image, label = self.dataset[index]
        return self.transform(image), int(label)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The augmentation seed of one sample in one epoch: a function of the three numbers only."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1)[0])


class DomainImages(Dataset):
    """(PIL image, label) dataset -> (the image in the model's domain, label), by
    `preprocess.to_model_domain`, which gives the same image every time. With `keep` each
    result is kept (as uint8 pixels, up to `budget` bytes) and every later epoch augments the
    kept image instead of reading it again: canonicalising a digit (`canonicalize: digit`)
    costs far more than augmenting it, and decoding a photo is a large part of a worker's time
    on it. Each process keeps its own: a DataLoader worker fills its copy with the images it
    meets, and the trainer's workers persist across epochs.

    Training resamples every image to the model's size, so a large JPEG of a folder is read
    at a reduced scale that keeps DECODE_MARGIN times the model's larger side on its shorter
    side (`min_side`, `preprocess.open_image`): decoding is most of a worker's time on phone
    photos. Digits are read whole: canonicalising works on the full-size strokes, as
    inference does."""

    def __init__(self, dataset: Dataset, config: ViTConfig, keep: bool, budget: int = KEPT_DOMAIN_BYTES):
        self.dataset, self.config, self.keep, self.budget = dataset, config, keep, budget
        self.kept: dict[int, tuple[np.ndarray, int]] = {}  # index -> (pixels [H, W] or [H, W, C], label)
        self.kept_bytes = 0
        self.min_side = None if config.canonicalize == "digit" else DECODE_MARGIN * max(config.image_size)

    @classmethod
    def for_training(cls, dataset: Dataset, config: ViTConfig) -> DomainImages:
        """Digits kept when all of them fit in KEPT_DOMAIN_BYTES at the model's size; photos
        kept as read (at their decoded size) until KEPT_DOMAIN_BYTES are used: a small photo
        folder is read from disk once."""
        if config.canonicalize != "digit":
            return cls(dataset, config, keep=True)
        height, width = config.image_size
        size = len(dataset) * height * width * config.in_channels
        return cls(dataset, config, keep=size <= KEPT_DOMAIN_BYTES)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        if index in self.kept:
            pixels, label = self.kept[index]
            return Image.fromarray(pixels), label
        image, label = (self.dataset.read(index, self.min_side) if isinstance(self.dataset, Split)
                        else self.dataset[index])
        image = to_model_domain(image, self.config)
        if self.keep:
            pixels = np.asarray(image)
            if self.kept_bytes + pixels.nbytes <= self.budget:
                self.kept[index] = (pixels, int(label))
                self.kept_bytes += pixels.nbytes
        return image, int(label)


class SeededAugmentation(Dataset):
    """(PIL image, label) dataset -> (uint8 pixels, label, draws) from
    `TrainTransform.prepare`, keyed by `epoch * n + index`; `CropBatches` puts them in
    batches and the transform's `finish` ends them.

    Each sample draws its augmentation from its own seed (`sample_seed`, given to
    `TrainTransform.augment_image`), so the images a run sees depend on the seed alone: not
    on the number of DataLoader workers, on whether they persist across epochs, or on the
    number of processes, and the main process's RNG (dropout) is left untouched when there
    are no workers. The
    deterministic first half of `prepare` comes from `DomainImages` (kept for digits).
    """

    def __init__(self, dataset: Dataset, transform: TrainTransform, seed: int, keep_domain: bool = True):
        self.images = (DomainImages.for_training(dataset, transform.config) if keep_domain
                       else DomainImages(dataset, transform.config, keep=False))
        self.transform = transform
        self.seed = seed

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key: int):
        epoch, index = divmod(key, len(self.images))
        image, label = self.images[index]
        pixels, draws = self.transform.augment_image(image, sample_seed(self.seed, epoch, index))
        return pixels, label, draws


class CropBatches:
    """DataLoader's collate_fn for `SeededAugmentation`: samples -> (uint8 pixels
    [B, C, Hmax, Wmax], each image in its top-left corner and zeros around it; labels [B];
    draws [B, DRAW_SIZE]). Photo crops differ in size (all others, and photos augmented
    `per_image`, are the model's size, and the batch is their stack); the transform's
    `finish` ends the batch on the step's device. Channels go first here, in the worker, as
    each image is copied in: the step's process then normalises contiguous memory."""

    def __call__(self, samples: list[tuple[torch.Tensor, int, torch.Tensor]]):
        crops, labels, draws = zip(*samples)
        height, width = max(crop.shape[0] for crop in crops), max(crop.shape[1] for crop in crops)
        pixels = torch.zeros(len(crops), crops[0].shape[2], height, width, dtype=torch.uint8)
        if get_worker_info() is not None:
            pixels.share_memory_()  # the batch goes to the main process: build it where it is sent
        for batch_index, crop in enumerate(crops):  # one copy per image, as torch.stack makes
            pixels[batch_index, :, :crop.shape[0], :crop.shape[1]] = crop.permute(2, 0, 1)
        return pixels, torch.tensor(labels), torch.stack(draws)


class EpochSampler(Sampler[int]):
    """Keys `epoch * n + index` of a seeded shuffle of n samples, one epoch at a time.

    `set_epoch` picks the epoch (a new order each). With `batch_size` (global) and
    `drop_last`, the order is cut to whole batches. Under DDP every process shuffles alike
    and takes every `world_size`-th key, so process r's part of global batch s holds the
    very keys a single process puts in batch s.
    """

    def __init__(self, size: int, seed: int, batch_size: int, drop_last: bool, rank: int = 0,
                 world_size: int = 1):
        self.size, self.seed, self.batch_size, self.drop_last = size, seed, batch_size, drop_last
        self.rank, self.world_size = rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _keys(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(self.size, generator=generator)
        if self.drop_last:
            order = order[:self.size // self.batch_size * self.batch_size]
        return (order[self.rank::self.world_size] + self.epoch * self.size).tolist()

    def __iter__(self):
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())


def default_workers(device_type: str = "cpu", processes: int = 1) -> int:
    """DataLoader workers per process. On the CPU half the cores decode and augment (the rest
    run the model), at most 8. On a GPU the model needs no cores: each process's share of
    them, less one for its own loop, at most 16: decoding and augmenting photos is what
    holds a GPU back, so it gets every core the loop does not need (BENCHMARKS.md has the
    throughput with 8 and with 15 workers)."""
    cores = os.cpu_count() or 1
    if device_type == "cuda":
        return max(1, min(16, cores // max(1, processes) - 1))
    return max(0, min(8, cores // 2 // max(1, processes)))


def make_loader(dataset: Dataset, batch_size: int, *, shuffle: bool, seed: int, num_workers: int,
                pin_memory: bool, sampler: Sampler | None = None, persistent_workers: bool = False,
                collate_fn: Callable | None = None) -> DataLoader:
    """A DataLoader whose order depends only on `seed` (or on `sampler`). The trainer's loader
    keeps its workers across epochs (`persistent_workers`): starting them anew costs a second
    or more per epoch, all of a small dataset's epoch."""
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle and sampler is None, sampler=sampler,
        num_workers=num_workers, pin_memory=pin_memory, generator=generator,
        persistent_workers=persistent_workers and num_workers > 0, collate_fn=collate_fn,
    )

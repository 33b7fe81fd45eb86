"""The batch, epoch and learning-rate rules of a run: how many images a step, how many epochs,
and how fast (linear warmup, then cosine decay), each default chosen from the size of the data.
"""

from __future__ import annotations

import dataclasses
import math

from vit_hub.train.settings import TrainingError, TrainSettings

# Peak AdamW learning rate for a batch of REFERENCE_BATCH images, from scratch. A preset tuned
# with another rate names it here (the sweep in BENCHMARKS.md, "What holds a short MNIST run back").
DEFAULT_LEARNING_RATE = 1e-3
PRESET_LEARNING_RATES: dict[str, float] = {"mnist": 2e-3}
# A few thousand photos or fewer, the model chosen from the data (the small-data preset, 192 wide):
# half the rate, 2.5e-4 at their batch of 32 (BENCHMARKS.md, "Real photos over three seeds").
SMALL_PHOTO_LEARNING_RATE = 5e-4
# Fine-tuning from pretrained weights (--init) starts close to a good solution: a tenth of the
# from-scratch rate (BENCHMARKS.md, "Fine-tuning from pretrained weights").
FINE_TUNE_LEARNING_RATE = 1e-4
REFERENCE_BATCH = 128  # the batch the rates above are given for
DEFAULT_BATCH_SIZE = 128
MIN_DEFAULT_BATCH_SIZE = 32  # the default never goes below this unless the data is tiny
WARMUP_SHARE = 0.05  # of the epochs, when --warmup-epochs is not given
# About this many training images seen in all, from scratch and when fine-tuning.
IMAGES_SEEN = 200_000
FINE_TUNE_IMAGES_SEEN = 20_000


def learning_rate(step: int, total_steps: int, warmup_steps: int, peak: float) -> float:
    """Linear warmup to `peak`, then cosine decay to 1 % of it."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * (0.01 + 0.99 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def peak_learning_rate(settings: TrainSettings, batch_size: int, small_photos: bool = False) -> float:
    """--lr, else the preset's (or the default, the fine-tuning or, when the data chose the model
    for a small photo folder, `small_photos`, the small-photo) rate for a batch of 128,
    scaled by the square root of the batch's ratio to 128 (AdamW's gradient noise falls with
    the square root of the batch; the linear rule measured worse on small data: BENCHMARKS.md,
    "Circles vs squares")."""
    if settings.lr is not None:
        return settings.lr
    if settings.init:
        per_reference = FINE_TUNE_LEARNING_RATE
    elif small_photos:
        per_reference = SMALL_PHOTO_LEARNING_RATE
    else:
        per_reference = PRESET_LEARNING_RATES.get(settings.preset or "", DEFAULT_LEARNING_RATE)
    return per_reference * math.sqrt(batch_size / REFERENCE_BATCH)


def default_epochs(num_train: int) -> int:
    """About 200k training samples seen in all, 10 to 200 epochs."""
    return int(min(200, max(10, round(IMAGES_SEEN / num_train))))


def default_fine_tune_epochs(num_train: int) -> int:
    """Fine-tuning (--init): a tenth of that, about 20k samples seen, 5 to 50 epochs
    (BENCHMARKS.md, "Fine-tuning from pretrained weights")."""
    return int(min(50, max(5, round(FINE_TUNE_IMAGES_SEEN / num_train))))


def default_batch_size(num_train: int) -> int:
    """About 10 optimizer steps an epoch: the largest power of two up to a tenth of the
    training images, kept within 32 to 128, and never above half of them (at least 2 steps).
    Fewer, larger steps leave a small set with a few hundred updates in 200 epochs; batches
    under 32 keep an augmented ViT near chance far longer (BENCHMARKS.md, "Circles vs squares")."""
    tenth = 2 ** math.floor(math.log2(max(1, num_train // 10)))
    half = 2 ** math.floor(math.log2(max(1, num_train // 2)))
    return int(min(half, DEFAULT_BATCH_SIZE, max(MIN_DEFAULT_BATCH_SIZE, tenth)))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How long and how fast a run trains, every default resolved."""

    epochs: int
    batch_size: int  # global: all processes together
    peak_lr: float
    warmup_epochs: float
    steps_per_epoch: int

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    @property
    def warmup_steps(self) -> int:
        return max(1, round(self.warmup_epochs * self.steps_per_epoch))

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (counted from the run's start)."""
        return learning_rate(step, self.total_steps, self.warmup_steps, self.peak_lr)


def plan_schedule(settings: TrainSettings, num_train: int, processes: int = 1,
                  small_photos: bool = False) -> Schedule:
    """The flags where given, else the defaults for `num_train` training images (`small_photos`:
    the data chose the model for a small photo folder, `peak_learning_rate`). Every process
    takes an equal share of each global batch, and an epoch is the whole batches of the
    training split (one short batch when there is less than one)."""
    batch_size = settings.batch_size if settings.batch_size is not None else default_batch_size(num_train)
    if batch_size < 1 or batch_size % processes:
        raise TrainingError(f"--batch-size: expected a positive multiple of the {processes} processes, got {batch_size}")
    if num_train < processes:
        raise TrainingError(f"expected at least {processes} training images, found {num_train}")
    if settings.epochs is not None:
        epochs = settings.epochs
    else:
        epochs = (default_fine_tune_epochs if settings.init else default_epochs)(num_train)
    warmup = settings.warmup_epochs if settings.warmup_epochs is not None else WARMUP_SHARE * epochs
    peak_lr = peak_learning_rate(settings, batch_size, small_photos)
    return Schedule(epochs=epochs, batch_size=batch_size, peak_lr=peak_lr, warmup_epochs=warmup,
                    steps_per_epoch=max(1, num_train // batch_size))

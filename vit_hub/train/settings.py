"""TrainSettings: everything a training run depends on, the checks that refuse settings (and
an `--out`) which cannot work before any data is read, and the flag each setting is given by.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import math
import os
import re
import shlex
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vit_hub.console import escaped
from vit_hub.data.choices import AUGMENTATIONS
from vit_hub.data.hub_datasets import DatasetOptions
from vit_hub.errors import UserError
from vit_hub.layout import ModelDir
from vit_hub.model.config import PRESETS, ViTConfig
from vit_hub.model.fields import one_of

DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"
# The training settings `vit-hub sweep --param` may vary, beside MODEL_FIELDS.
TRAINING_FIELDS = ("lr", "batch_size", "weight_decay", "label_smoothing", "warmup_epochs", "epochs")
MAX_WORKERS = 64  # DataLoader processes; far more only hangs the machine starting them
# The ViTConfig fields a run may set (flags, sweeps); the data decides the rest (its labels), and
# the run itself its probabilities' temperature (vit_hub.train.calibration).
MODEL_FIELDS = tuple(field.name for field in dataclasses.fields(ViTConfig)
                     if field.name not in ("num_classes", "labels", "temperature"))
# Settings that say how a run is carried out, not what it computes: --resume may change them.
HOW_TO_RUN = ("num_workers", "device", "compile", "strict", "checkpoint_steps")
OUT_LOCK = ".vit-hub-train.lock"  # in --out while a run writes it (holding_out)
FILE_KINDS = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
              stat.S_IFCHR: "a device", stat.S_IFBLK: "a device"}  # what a path that is not a regular file is


class TrainingError(UserError):
    """Settings that cannot work; the message says what was expected."""


@dataclasses.dataclass
class TrainSettings:
    """Everything a run depends on; saved in the checkpoint so `--resume` replays it.
    `vit-hub train` has one flag per field (cli.py builds them from this class).

    Args:
        data: image folder, Hugging Face dataset, 'mnist' (bundled) or a torchvision name (cli.data_help
            lists them).
        out: model dir to write.
        data_root: where torchvision datasets' files are (default: VIT_HUB_DATA_ROOT, else ./data).
        data_config: the config of a Hugging Face dataset that has several (its CONFIG/ folder of shards);
            default: its only one.
        image_column: a Hugging Face dataset's column of images; default: its one Image feature.
        label_column: a Hugging Face dataset's column of classes; default: its one ClassLabel.
        stream: read the training split of parquet shards as it trains, block by block, never whole
            (WebDataset tar shards always are).
        checkpoint_steps: a streamed run also saves a resumable checkpoint every this many steps within
            an epoch (`--resume` carries on from the next batch; a folder's run resumes at its last epoch).
        preset: architecture preset; default: chosen from the data.
        model: overrides of the ViTConfig fields in MODEL_FIELDS (the preset's or the data's choice).
        epochs: passes over the training images; default: about 200k images seen, 10 to 200 epochs.
        batch_size: global batch size (all processes); default 128, smaller on small data
            (about 10 steps an epoch).
        lr: peak learning rate; default 1e-3 (mnist preset 2e-3, small photo
            folders 5e-4) x sqrt(batch_size / 128).
        weight_decay: AdamW weight decay.
        warmup_epochs: linear warmup before the cosine decay; default 5 % of the epochs.
        label_smoothing: share of each target spread over the other classes.
        grad_clip: max global gradient norm.
        augment: training augmentation; auto: digits for digit data, photos for larger images.
        val_split: share of training images held out when the data has no val split.
        seed: seeds the split, the initial weights and every augmentation.
        num_workers: DataLoader workers per process; default: on the CPU half the cores, at most 8;
            on CUDA each process's share of the cores less one, at most 16.
        strict: fail on an unreadable image instead of skipping it.
        compile: torch.compile the training step; default: on CUDA when the run is long enough to
            repay the compile time, off on the CPU.
        device: auto, cpu, cuda or cuda:N.
        command: the command line that started the run (for the model card).
        init: fine-tune from these weights instead of starting from scratch: a timm or
            transformers ViT or a vit_hub model (Hub repo id or folder); a new head for the
            data's labels (the same labels keep the head), positions resized to --image-size,
            fine-tuning defaults (lr, epochs); default: none, from scratch.
    """

    data: str
    out: str
    data_root: str | None = None
    data_config: str | None = None
    image_column: str | None = None
    label_column: str | None = None
    stream: bool = False
    checkpoint_steps: int = 500
    preset: str | None = one_of(None, tuple(PRESETS))
    model: dict[str, Any] = dataclasses.field(default_factory=dict)
    epochs: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    weight_decay: float = 0.05
    warmup_epochs: float | None = None
    label_smoothing: float = 0.1
    grad_clip: float = 1.0
    augment: str = one_of("auto", AUGMENTATIONS)
    val_split: float = 0.1
    seed: int = 0
    num_workers: int | None = dataclasses.field(default=None, metadata={"flag": "--workers"})
    strict: bool = False
    compile: bool | None = None
    device: str = "auto"
    command: str = ""
    init: str | None = None

    def dataset_options(self) -> DatasetOptions:
        """The config and columns of a Hugging Face dataset, as `load_splits` takes them."""
        return DatasetOptions(self.data_config, self.image_column, self.label_column, self.stream)


def check_settings(settings: TrainSettings) -> None:
    """Numbers that cannot train, and a preset or augmentation that does not exist, fail before
    any data is read, naming the flag."""
    # Comparisons with inf as the upper bound refuse inf and NaN too: both train to NaN.
    checks = [
        ("--epochs", settings.epochs, settings.epochs is None or settings.epochs >= 1, "a positive int"),
        ("--lr", settings.lr, settings.lr is None or 0 < settings.lr < math.inf, "a positive, finite learning rate"),
        ("--weight-decay", settings.weight_decay, 0 <= settings.weight_decay < math.inf, "a finite value >= 0"),
        ("--warmup-epochs", settings.warmup_epochs,
         settings.warmup_epochs is None or 0 <= settings.warmup_epochs < math.inf, "a finite value >= 0"),
        ("--label-smoothing", settings.label_smoothing, 0 <= settings.label_smoothing < 1, "a value in [0, 1)"),
        ("--grad-clip", settings.grad_clip, 0 < settings.grad_clip < math.inf, "a positive, finite max gradient norm"),
        ("--checkpoint-steps", settings.checkpoint_steps, settings.checkpoint_steps >= 1, "a positive number of steps"),
        ("--workers", settings.num_workers, settings.num_workers is None or 0 <= settings.num_workers <= MAX_WORKERS,
         f"a count from 0 to {MAX_WORKERS}"),
        ("--device", repr(settings.device), re.fullmatch(DEVICE_PATTERN, settings.device) is not None,
         "auto, cpu, cuda or cuda:N"),
    ]
    for flag, value, ok, expected in checks:
        if not ok:
            raise TrainingError(f"{flag}: expected {expected}, got {value}")
    settings.dataset_options()  # a --data-config that names no folder is refused here
    for field in dataclasses.fields(settings):  # those declared `one_of` some choices: --preset, --augment
        choices, value = field.metadata.get("choices"), getattr(settings, field.name)
        if choices is not None and value is not None and value not in choices:
            raise TrainingError(f"{setting_flag(field.name)}: expected one of {', '.join(choices)}, got {value!r}")
    if settings.init and settings.preset:
        raise TrainingError(f"--init {settings.init}: the architecture is the pretrained model's; "
                            f"expected no --preset, got {settings.preset}")


def setting_flag(name: str) -> str:
    """The command-line flag of a TrainSettings or ViTConfig field."""
    field = {field.name: field for field in dataclasses.fields(TrainSettings)}.get(name)
    spelled = "--" + name.replace("_", "-")
    return field.metadata.get("flag", spelled) if field else spelled


def check_out_is_a_folder(out: Path) -> None:
    """--out names a folder to create or reuse, never an existing file."""
    if out.exists() and not out.is_dir():
        raise TrainingError(f"--out {out}: expected a folder (new or existing), found a file")


def check_out_outside_data(out: Path, data: str) -> None:
    """--out never lies inside an image folder given as --data: the next run would read the
    model's plots as a class of images."""
    if not Path(data).is_dir():
        return
    real_out, real_data = Path(os.path.realpath(out)), Path(os.path.realpath(data))
    if real_out == real_data or real_out.is_relative_to(real_data):
        raise TrainingError(f"--out {out}: expected a folder outside --data {data}, found it inside (the next "
                            f"run would read what training writes there as images)")


def check_out_is_free(out: Path) -> None:
    """A new run never writes over a trained model or a resumable run without being told to."""
    found = [name for name in (ModelDir.checkpoint, ModelDir.weights) if (out / name).exists()]
    if found:
        raise TrainingError(
            f"--out {out}: expected a new or empty folder, found a trained model or run there "
            f"({', '.join(found)}); pass --resume to continue that run or --overwrite to replace it"
        )


@contextlib.contextmanager
def holding_out(out: Path) -> Iterator[None]:
    """Run the block as the only run writing `out`: an exclusive lock on OUT_LOCK inside it,
    taken before any check of what `out` holds (two runs started into one new folder would
    both find it empty); a second run is refused in one line naming the process that holds it.
    Under torchrun only the main process (rank 0) takes it. A folder made here and left empty
    is removed again."""
    if int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    lock = out / OUT_LOCK
    descriptor = _open_lock(lock, out)
    try:
        _lock_exclusively(descriptor, lock, out)
        try:
            os.ftruncate(descriptor, 0)
            os.write(descriptor, f"process {os.getpid()} ({command_line()[:200]})".encode())
            yield
        finally:
            lock.unlink(missing_ok=True)  # before it is unlocked: a run that opened it meanwhile finds it gone
    finally:
        os.close(descriptor)
        if made and out.is_dir() and not any(out.iterdir()):
            out.rmdir()


def _open_lock(lock: Path, out: Path) -> int:
    """The lock file's descriptor, opened or made without following a link (a link there would
    have this run truncate the file it points to); anything but a regular file is refused."""
    try:
        descriptor = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as error:  # ELOOP: a link
        found = "a link" if error.errno == errno.ELOOP else f"one that cannot be opened ({error.strerror})"
        raise TrainingError(f"--out {out}: expected {OUT_LOCK} in it to be a regular file, found {found}; "
                            f"remove it or choose another --out") from None
    kind = stat.S_IFMT(os.fstat(descriptor).st_mode)
    if kind != stat.S_IFREG:
        os.close(descriptor)
        raise TrainingError(f"--out {out}: expected {OUT_LOCK} in it to be a regular file, found "
                            f"{FILE_KINDS.get(kind, 'a special file')}; remove it or choose another --out")
    return descriptor


def _lock_exclusively(descriptor: int, lock: Path, out: Path) -> None:
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = escaped(os.pread(descriptor, 300, 0).decode(errors="replace").strip()) or "another process"
        raise TrainingError(f"--out {out}: expected a folder no other run is writing, found it held by "
                            f"{holder}; wait for that run or choose another --out") from None
    if not _is_file_of(descriptor, lock):  # the last holder removed it as this run opened it: take it anew
        raise TrainingError(f"--out {out}: expected a folder no other run is writing, found one that was "
                            f"just released; start the run again")


def _is_file_of(descriptor: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(descriptor), os.stat(path))
    except FileNotFoundError:
        return False


def command_line(argv: list[str] | None = None) -> str:
    """The command as the user typed it, for the model card (`argv`: as given to `cli.main`)."""
    if argv is not None:
        return " ".join(["vit-hub", *map(shlex.quote, argv)])
    program = "vit-hub" if Path(sys.argv[0]).name in ("vit-hub", "__main__.py") else Path(sys.argv[0]).name
    return " ".join([program, *map(shlex.quote, sys.argv[1:])])

"""Training: from `--data` to a model dir in Hugging Face Hub layout.

    settings -> data splits -> config (preset / chosen from the data / flags)
      -> epochs of AdamW with warmup + cosine, label smoothing, gradient clipping
      -> after every epoch: validation, metrics.json, a resumable checkpoint, and the
         model dir refreshed whenever validation accuracy improves
      -> at the end: the best weights evaluated on the test split, plots and model card

One process or many: under `torchrun` the same code runs DistributedDataParallel
(gloo on CPU, nccl on CUDA); `--batch-size` is the global batch either way, and every
process takes its share of the same global batches with the same per-sample augmentation,
so the learning rate and the data a run sees do not depend on the number of processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, Subset
from tqdm.auto import tqdm

from .errors import UserError
from . import data as vdata
from .card import write_model_card
from .config import DEFAULT_LEARNING_RATE, PRESET_LEARNING_RATES, PRESETS, ViTConfig, one_of, suggest_for_data
from .importing import SOURCE_RECORD, Imported, describe, fine_tune_config, fine_tune_weights, load_init
from .insight import views_after_training
from .plots import plot_confusion_matrix, plot_curves
from .pretrained import VisionTransformer
from .storage import reading_safetensors, replacing, write_text_atomically

CHECKPOINT = "checkpoint.safetensors"
# Peak AdamW learning rate per 128 images when fine-tuning from pretrained weights (--init):
# a tenth of the from-scratch default (BENCHMARKS.md, "Fine-tuning from pretrained weights").
FINE_TUNE_LEARNING_RATE = 1e-4
DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"
MAX_WORKERS = 64  # DataLoader processes; far more only hangs the machine starting them
DEFAULT_BATCH_SIZE = 128
MIN_DEFAULT_BATCH_SIZE = 32  # the default never goes below this unless the data is tiny
SHIFT_GAP = 0.05  # test accuracy this far below validation accuracy is reported as a likely shift
# The ViTConfig fields a run may set (flags, sweeps); the data decides the rest (its labels).
MODEL_FIELDS = tuple(field.name for field in dataclasses.fields(ViTConfig) if field.name not in ("num_classes", "labels"))
# Settings that say how a run is carried out, not what it computes: --resume may change them.
HOW_TO_RUN = ("num_workers", "device", "compile", "strict")


@dataclasses.dataclass
class TrainSettings:
    """Everything a run depends on; saved in the checkpoint so `--resume` replays it.
    `vit-hub train` has one flag per field (cli.py builds them from this class).

    Args:
        data: image folder, 'mnist' (bundled) or a torchvision name (cli.data_help lists them).
        out: model dir to write.
        data_root: where torchvision datasets' files are (default: VIT_HUB_DATA_ROOT, else ./data).
        preset: architecture preset; default: chosen from the data.
        model: overrides of the ViTConfig fields in MODEL_FIELDS (the preset's or the data's choice).
        epochs: passes over the training images; default: about 200k images seen, 10 to 200 epochs.
        batch_size: global batch size (all processes); default 128, smaller on small data
            (about 10 steps an epoch).
        lr: peak learning rate; default 1e-3 (mnist preset 2e-3) x sqrt(batch_size / 128).
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
            data's labels, positions resized to --image-size, fine-tuning defaults (lr, epochs);
            default: none, from scratch.
    """

    data: str
    out: str
    data_root: str | None = None
    preset: str | None = one_of(None, tuple(PRESETS))
    model: dict[str, Any] = dataclasses.field(default_factory=dict)
    epochs: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    weight_decay: float = 0.05
    warmup_epochs: float | None = None
    label_smoothing: float = 0.1
    grad_clip: float = 1.0
    augment: str = one_of("auto", vdata.AUGMENTATIONS)
    val_split: float = 0.1
    seed: int = 0
    num_workers: int | None = dataclasses.field(default=None, metadata={"flag": "--workers"})
    strict: bool = False
    compile: bool | None = None
    device: str = "auto"
    command: str = ""
    init: str | None = None


class TrainingError(UserError):
    """Settings that cannot work; the message says what was expected."""


# Distributed set-up -------------------------------------------------------------------
@dataclasses.dataclass
class Runtime:
    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def start_runtime(device: str) -> Runtime:
    """Pick the device; join the process group when launched by torchrun."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise TrainingError("--device cuda: expected a CUDA GPU, found none")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise TrainingError(f"--device {device}: expected a GPU index below {torch.cuda.device_count()}, "
                            f"found {torch.cuda.device_count()} GPU(s)")
    if device == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 on Ampere and newer
        torch.backends.cudnn.allow_tf32 = True
    elif world_size > 1:
        # Processes on one machine share its cores instead of each taking all of them.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    runtime = Runtime(torch.device(device), int(os.environ.get("RANK", "0")), world_size, local_rank)
    if runtime.distributed and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if runtime.device.type == "cuda" else "gloo")
    return runtime


def _all_reduce(tensor: torch.Tensor, runtime: Runtime) -> torch.Tensor:
    if runtime.distributed:
        dist.all_reduce(tensor)
    return tensor


# Model and optimiser -------------------------------------------------------------------
def build_config(settings: TrainSettings, splits: vdata.DataSplits,
                 stats: vdata.ImageStats | None = None) -> ViTConfig:
    """Preset (or one chosen from the data, described by `stats` or measured here) < explicit
    flags; mean/std from the training images unless given; labels from the data."""
    if settings.preset:
        if settings.preset not in PRESETS:
            raise TrainingError(f"--preset: expected one of {', '.join(PRESETS)}, got {settings.preset!r}")
        values = dict(PRESETS[settings.preset])
    else:
        stats = stats or vdata.describe_images(splits.train, settings.seed)
        values = suggest_for_data(stats.num_train, stats.model_channels, stats.median_side)
    values.update({key: value for key, value in settings.model.items() if value is not None})
    values["labels"] = splits.labels
    if values.get("patch_embedding") == "convstem" and not _powers_of_two(values.get("patch_size", 16)):
        if settings.model.get("patch_embedding") == "convstem":
            raise TrainingError(f"--patch-embedding convstem: expected patch sides that are powers of two, "
                                f"got --patch-size {values['patch_size']}")
        values["patch_embedding"] = "shifted"  # the default stem cannot halve down to this patch size
    if values.get("mean") is None or values.get("std") is None:  # measure what was not given
        probe = ViTConfig.from_dict({**values, "mean": None, "std": None})
        measured = dict(zip(("mean", "std"), vdata.compute_mean_std(splits.train, probe, settings.seed)))
        values.update({key: value for key, value in measured.items() if values.get(key) is None})
    return ViTConfig.from_dict(values)


def _powers_of_two(size: Any) -> bool:
    sides = size if isinstance(size, (list, tuple)) else [size]
    return all(isinstance(side, int) and side > 0 and side & (side - 1) == 0 for side in sides)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only: not on biases, norms, positions or the class token."""
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        skip = parameter.ndim <= 1 or name.endswith(("pos_embedding", "cls_token"))
        (no_decay if skip else decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def learning_rate(step: int, total_steps: int, warmup_steps: int, peak: float) -> float:
    """Linear warmup to `peak`, then cosine decay to 1 % of it."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * (0.01 + 0.99 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def peak_learning_rate(settings: TrainSettings, batch_size: int) -> float:
    """--lr, else the preset's (or the default) rate for a batch of 128, scaled by the square
    root of the batch's ratio to 128 (AdamW's gradient noise falls with the square root of
    the batch; the linear rule measured worse on small data: BENCHMARKS.md, "Circles vs
    squares")."""
    if settings.lr is not None:
        return settings.lr
    if settings.init:
        return FINE_TUNE_LEARNING_RATE * math.sqrt(batch_size / 128)
    per_128 = PRESET_LEARNING_RATES.get(settings.preset or "", DEFAULT_LEARNING_RATE)
    return per_128 * math.sqrt(batch_size / 128)


def default_epochs(num_train: int) -> int:
    """About 200k training samples seen in all, 10 to 200 epochs."""
    return int(min(200, max(10, round(200_000 / num_train))))


def default_fine_tune_epochs(num_train: int) -> int:
    """Fine-tuning (--init): a tenth of that, about 20k samples seen, 5 to 50 epochs
    (BENCHMARKS.md, "Fine-tuning from pretrained weights")."""
    return int(min(50, max(5, round(20_000 / num_train))))


def default_batch_size(num_train: int) -> int:
    """About 10 optimizer steps an epoch: the largest power of two up to a tenth of the
    training images, kept within 32 to 128, and never above half of them (at least 2 steps).
    Fewer, larger steps leave a small set with a few hundred updates in 200 epochs; batches
    under 32 keep an augmented ViT near chance far longer (BENCHMARKS.md, issue 11)."""
    tenth = 2 ** math.floor(math.log2(max(1, num_train // 10)))
    half = 2 ** math.floor(math.log2(max(1, num_train // 2)))
    return int(min(half, DEFAULT_BATCH_SIZE, max(MIN_DEFAULT_BATCH_SIZE, tenth)))


# The step: compile, FLOPs ------------------------------------------------------------------
MIN_COMPILE_STEPS = 5000  # --compile's default: from this many optimizer steps on (CUDA)


def choose_compile(requested: bool | None, device_type: str, total_steps: int, triton: bool,
                   capability: tuple[int, int] | None) -> tuple[bool, str]:
    """Whether to torch.compile the training step, and why (said in the log). --compile and
    --no-compile decide; by default it is on for CUDA runs of at least MIN_COMPILE_STEPS
    steps, where the compile time (about a minute for ViT-S/16) is repaid by a faster step
    (ViT-S/16 on an H100: 1.48x, issue 17), and off on the CPU."""
    if requested is not None:
        return requested, "--compile" if requested else "--no-compile"
    if device_type != "cuda":
        return False, "the default on the CPU; --compile to try it"
    if not triton:
        return False, "torch.compile needs Triton on CUDA, which is not installed"
    if capability is not None and capability < (7, 0):
        return False, f"Triton needs a GPU of compute capability 7.0 or newer, this one is {capability[0]}.{capability[1]}"
    if total_steps < MIN_COMPILE_STEPS:
        return False, (f"{total_steps} steps are too few to repay the compile time (the default compiles from "
                       f"{MIN_COMPILE_STEPS}); --compile to force it")
    return True, f"the default for {total_steps} steps on CUDA; --no-compile to turn it off"


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def training_flops(model: nn.Module) -> float:
    """FLOPs of one training image, forward and backward, counted by torch's FLOP counter on a
    copy of the model on the meta device (no memory, no arithmetic, no random numbers drawn).
    Attention is counted through SDPA's math backend, so its matmuls are seen."""
    import copy

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    config = model.config
    probe = copy.deepcopy(model).to("meta").train()
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        probe(torch.empty(1, config.in_channels, *config.image_size, device="meta")).logits.sum().backward()
    return float(counter.get_total_flops())


# Dense matmul peaks of NVIDIA GPUs (TFLOP/s, without sparsity) by name and precision, from
# NVIDIA's data sheets; model FLOP utilisation is reported on these GPUs only.
PEAK_TFLOPS = (  # (words in torch.cuda.get_device_name, {dtype: TFLOP/s})
    (("H100", "PCIe"), {"bfloat16": 756.0, "float16": 756.0, "float32": 378.0}),  # float32: TF32 (on here)
    (("H100", "NVL"), {"bfloat16": 835.0, "float16": 835.0, "float32": 418.0}),
    (("H100",), {"bfloat16": 989.0, "float16": 989.0, "float32": 495.0}),  # SXM
    (("H200",), {"bfloat16": 989.0, "float16": 989.0, "float32": 495.0}),
    (("A100",), {"bfloat16": 312.0, "float16": 312.0, "float32": 156.0}),
    (("L4",), {"bfloat16": 121.0, "float16": 121.0, "float32": 60.0}),
)


def peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """The dense peak FLOP/s of the named GPU in `dtype` (float32: TF32, which training turns
    on), or None for a GPU the table does not know."""
    words = set(device_name.replace("-", " ").split())
    for needed, peaks in PEAK_TFLOPS:
        if set(needed) <= words:
            peak = peaks.get(str(dtype).removeprefix("torch."))
            return None if peak is None else peak * 1e12
    return None


def flop_rates(achieved: float, peak: float | None) -> dict[str, float]:
    """The epoch record's model TFLOP/s, and its share of the peak (MFU) where there is one."""
    rates = {"model_tflop_s": achieved / 1e12}
    if peak:
        rates["mfu"] = achieved / peak
    return rates


# Evaluation ------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device, num_classes: int,
             runtime: Runtime | None = None, progress: bool = False) -> dict[str, Any]:
    """Loss, accuracy and confusion matrix over a loader (summed over all processes)."""
    model.eval()
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for images, labels in tqdm(loader, desc="eval", leave=False, disable=not progress):
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        logits = model(images).logits.float()
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").double()
        confusion += torch.bincount(labels * num_classes + logits.argmax(1), minlength=num_classes**2).view(
            num_classes, num_classes
        )
    if runtime is not None:
        _all_reduce(confusion, runtime), _all_reduce(loss_sum, runtime)
    count = int(confusion.sum())
    return {
        "accuracy": float(confusion.diagonal().sum()) / max(1, count),
        "loss": float(loss_sum) / max(1, count),
        "n": count,
        "confusion": confusion.cpu().tolist(),  # rows: true class, columns: predicted
    }


# Checkpoints ------------------------------------------------------------------------------
def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any]) -> None:
    """Model + optimizer tensors in safetensors, everything else as JSON metadata in the
    same file. Written to a temporary name, flushed to disk, then renamed (`replacing`): a
    kill or a crash never leaves half a file."""
    tensors = {f"model/{name}": value.contiguous() for name, value in model.state_dict().items()}
    optimizer_state = optimizer.state_dict()
    for index, values in optimizer_state["state"].items():
        for key, value in values.items():
            tensors[f"optimizer/{index}/{key}"] = torch.as_tensor(value).contiguous()
    groups = [{k: v for k, v in group.items() if k != "params"} | {"params": group["params"]}
              for group in optimizer_state["param_groups"]]
    metadata = {"state": json.dumps(state), "param_groups": json.dumps(groups)}
    with replacing(path) as partial:
        save_file({k: v.cpu() for k, v in tensors.items()}, str(partial), metadata=metadata)


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    metadata = _checkpoint_metadata(path)
    with reading_safetensors(path):
        tensors = load_file(str(path))
    model.load_state_dict({k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")})
    optimizer_state: dict[str, Any] = {"state": {}, "param_groups": json.loads(metadata["param_groups"])}
    for key, value in tensors.items():
        if key.startswith("optimizer/"):
            _, index, name = key.split("/", 2)
            optimizer_state["state"].setdefault(int(index), {})[name] = value
    optimizer.load_state_dict(optimizer_state)
    return json.loads(metadata["state"])


def read_checkpoint_state(out: Path) -> dict[str, Any]:
    """The JSON part of a run's checkpoint (settings, config, epoch, history)."""
    path = out / CHECKPOINT
    if not path.is_file():
        raise TrainingError(f"--resume: expected a checkpoint at {path}, found none")
    return json.loads(_checkpoint_metadata(path)["state"])


def _checkpoint_metadata(path: Path) -> dict[str, str]:
    """A checkpoint's metadata; one line if the file is damaged or not a vit_hub checkpoint."""
    from safetensors import safe_open

    with reading_safetensors(path), safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if not {"state", "param_groups"} <= set(metadata):
        raise TrainingError(f"expected a vit_hub training checkpoint at {path}, found a safetensors file "
                            f"without a run's state (metadata keys {sorted(metadata)})")
    return metadata


def check_settings(settings: TrainSettings) -> None:
    """Numbers that cannot train fail before any data is read, naming the flag."""
    # Comparisons with inf as the upper bound refuse inf and NaN too: both train to NaN.
    checks = [
        ("--epochs", settings.epochs, settings.epochs is None or settings.epochs >= 1, "a positive int"),
        ("--lr", settings.lr, settings.lr is None or 0 < settings.lr < math.inf, "a positive, finite learning rate"),
        ("--weight-decay", settings.weight_decay, 0 <= settings.weight_decay < math.inf, "a finite value >= 0"),
        ("--warmup-epochs", settings.warmup_epochs,
         settings.warmup_epochs is None or 0 <= settings.warmup_epochs < math.inf, "a finite value >= 0"),
        ("--label-smoothing", settings.label_smoothing, 0 <= settings.label_smoothing < 1, "a value in [0, 1)"),
        ("--grad-clip", settings.grad_clip, 0 < settings.grad_clip < math.inf, "a positive, finite max gradient norm"),
        ("--workers", settings.num_workers, settings.num_workers is None or 0 <= settings.num_workers <= MAX_WORKERS,
         f"a count from 0 to {MAX_WORKERS}"),
        ("--device", repr(settings.device), re.fullmatch(DEVICE_PATTERN, settings.device) is not None,
         "auto, cpu, cuda or cuda:N"),
    ]
    for flag, value, ok, expected in checks:
        if not ok:
            raise TrainingError(f"{flag}: expected {expected}, got {value}")


# The run ------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, settings: TrainSettings, resume: bool = False, resume_flags: dict[str, Any] | None = None):
        """`resume_flags`: with `resume`, the settings given again (see `train`)."""
        self.out = Path(settings.out)
        resume_flags = resume_flags or {}
        if resume:
            state = read_checkpoint_state(self.out)
            how = {name: resume_flags[name] for name in HOW_TO_RUN if name in resume_flags}
            settings = dataclasses.replace(TrainSettings(**state["settings"]), **how)
        check_settings(settings)
        check_out_outside_data(self.out, settings.data)
        self.settings = settings
        self.runtime = start_runtime(settings.device)
        # The folder is listed once (rank 0) and the listing sent to every process; files are
        # checked as they are read, so start-up does not grow with the size of the data.
        index = self._from_main(lambda: vdata.index_source(settings.data))
        self.splits = vdata.load_splits(settings.data, settings.data_root, settings.val_split,
                                        settings.seed, settings.strict, index=index)
        self.reported: set[str] = set()  # unreadable files already named on stderr
        self.unreadable_checked = -math.inf  # when the flags were last read
        # Pretrained weights (--init) are read once, when a run starts; a resumed run has them in its checkpoint.
        self.start = None if resume or not settings.init else self._load_init(settings)
        if resume:
            self.data_stats, self.config = None, ViTConfig.from_dict(state["config"])
        elif self.start:
            self.data_stats, self.config = None, fine_tune_config(self.start, self.splits.labels, settings.model)
        else:  # a few hundred (at most 5,000) sampled images decide the config, read on rank 0 only
            self.data_stats, self.config = self._from_main(lambda: self._choose_config(settings))
        epochs = default_fine_tune_epochs if settings.init else default_epochs
        self.epochs = settings.epochs if settings.epochs is not None else epochs(len(self.splits.train))
        self.batch_size = (settings.batch_size if settings.batch_size is not None
                           else default_batch_size(len(self.splits.train)))
        self._check_batch()
        self._check_resume_flags(resume_flags)
        torch.manual_seed(settings.seed)
        self.model = VisionTransformer(**self.config.to_dict())
        if self.start:
            self.model.load_state_dict(fine_tune_weights(self.start, self.config))  # strict: every weight placed
        self.model.to(self.runtime.device)
        self.optimizer = torch.optim.AdamW(
            parameter_groups(self.model, settings.weight_decay), lr=self.peak_lr, betas=(0.9, 0.999),
            fused=True,  # one kernel for all parameters, on CPU as on CUDA (mnist step: 5.4 -> 1.5 ms)
        )
        self.history: list[dict[str, Any]] = []
        self.best_accuracy, self.best_loss = -1.0, math.inf
        self.start_epoch = 0
        if resume:
            state = load_checkpoint(self.out / CHECKPOINT, self.model, self.optimizer)
            self.history, self.best_accuracy, self.start_epoch = (
                state["history"], state["best_accuracy"], state["epoch"]
            )
            self.best_loss = state.get("best_loss", math.inf)
        self.flops_per_image = training_flops(self.model)
        self._build_loaders()
        self.network = self._wrap(self.model)
        self.amp_dtype = self._amp_dtype()
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp_dtype == torch.float16)

    # set-up helpers
    @staticmethod
    def _load_init(settings: TrainSettings) -> Imported:
        if settings.preset:
            raise TrainingError(f"--init {settings.init}: the architecture is the pretrained model's; "
                                f"expected no --preset, got {settings.preset}")
        return load_init(settings.init)

    @property
    def peak_lr(self) -> float:
        return peak_learning_rate(self.settings, self.batch_size)

    @property
    def warmup_epochs(self) -> float:
        """--warmup-epochs, else 5 % of the epochs."""
        return self.settings.warmup_epochs if self.settings.warmup_epochs is not None else 0.05 * self.epochs

    def _check_resume_flags(self, flags: dict[str, Any]) -> None:
        """Flags given with --resume that would change the run are refused, each named with the
        checkpoint's value (what the run resolved: its epochs, batch, learning rate, config)."""
        resolved = {"epochs": self.epochs, "batch_size": self.batch_size, "lr": self.peak_lr,
                    "warmup_epochs": self.warmup_epochs}
        differ = [(name, value, resolved.get(name, getattr(self.settings, name)))
                  for name, value in flags.items() if name not in ("model", *HOW_TO_RUN)]
        differ = [(name, given, own) for name, given, own in differ if not _same_setting(name, given, own)]
        differ += [(name, given, getattr(self.config, name)) for name, given in flags.get("model", {}).items()
                   if not _same_model_field(self.config, name, given)]
        if differ:
            named = ", ".join(f"{setting_flag(name)} {given} (the checkpoint's: {own})" for name, given, own in differ)
            raise TrainingError(f"--resume: expected the settings of the run in {self.out} (or no flags), got {named}; "
                                f"start a new run with --overwrite to change them")

    def _choose_config(self, settings: TrainSettings) -> tuple[vdata.ImageStats | None, ViTConfig]:
        stats = None if settings.preset else vdata.describe_images(self.splits.train, settings.seed)
        return stats, build_config(settings, self.splits, stats)

    def _from_main(self, make):
        """`make()` on rank 0, its result (or its error) sent to every process; just `make()` in one process."""
        if not self.runtime.distributed:
            return make()
        payload: list[Any] = [None]
        if self.runtime.is_main:
            try:
                payload[0] = (True, make())
            except Exception as error:  # every process fails with rank 0's one-line error
                payload[0] = (False, error)
        dist.broadcast_object_list(payload, src=0)
        ok, value = payload[0]
        if not ok:
            raise value
        return value

    def _check_batch(self) -> None:
        batch, world = self.batch_size, self.runtime.world_size
        if batch < 1 or batch % world:
            raise TrainingError(f"--batch-size: expected a positive multiple of the {world} processes, got {batch}")
        if len(self.splits.train) < world:
            raise TrainingError(f"expected at least {world} training images, found {len(self.splits.train)}")

    def _build_loaders(self) -> None:
        settings, runtime, config = self.settings, self.runtime, self.config
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", runtime.world_size))
        workers = (vdata.default_workers(runtime.device.type, local_processes) if settings.num_workers is None
                   else settings.num_workers)
        pin = runtime.device.type == "cuda"
        transform = vdata.TrainTransform(config, settings.augment)
        self.model_input = transform.model_input  # the uint8 batches are finished on the device, in the step
        train_set = vdata.SeededAugmentation(self.splits.train, transform, settings.seed)
        self.per_rank_batch = self.batch_size // runtime.world_size
        self.loader_options = dict(num_workers=workers, pin_memory=pin)
        full_batches = len(train_set) >= self.batch_size
        self.sampler = vdata.EpochSampler(len(train_set), settings.seed, self.batch_size, drop_last=full_batches,
                                          rank=runtime.rank, world_size=runtime.world_size)
        self.train_loader = vdata.make_loader(train_set, self.per_rank_batch, shuffle=False, seed=0,
                                              sampler=self.sampler, persistent_workers=True, **self.loader_options)
        eval_transform = vdata.EvalTransform(config)
        self.eval_sets = {
            name: vdata.Transformed(self._shard(dataset), eval_transform)
            for name in ("val", "test") if (dataset := getattr(self.splits, name)) is not None
        }
        self.steps_per_epoch = len(train_set) // self.batch_size if full_batches else 1

    def _shard(self, dataset: Dataset) -> Dataset:
        """Every process evaluates a disjoint slice (no padding), results are summed."""
        if not self.runtime.distributed:
            return dataset
        return Subset(dataset, range(self.runtime.rank, len(dataset), self.runtime.world_size))

    def _wrap(self, model: nn.Module) -> nn.Module:
        network = model
        device = self.runtime.device
        self.compiled, self.compile_reason = choose_compile(
            self.settings.compile, device.type, self.epochs * self.steps_per_epoch,
            triton=_has_triton(), capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None)
        if self.compiled:
            network = torch.compile(network)
        if self.runtime.distributed:
            device_ids = [self.runtime.device.index] if self.runtime.device.type == "cuda" else None
            network = DistributedDataParallel(network, device_ids=device_ids)
        return network

    def _amp_dtype(self) -> torch.dtype | None:
        """bf16 autocast on GPUs that have it, fp16 (with a grad scaler) on older ones,
        full fp32 on the CPU (bf16 matmuls are far slower than fp32 on CPUs without bf16 units)."""
        if self.runtime.device.type != "cuda":
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def _train_loader(self, epoch: int):
        self.sampler.set_epoch(epoch)  # a new shuffle every epoch, identical on every process
        return self.train_loader

    def _eval_loader(self, name: str):
        return vdata.make_loader(self.eval_sets[name], max(256, self.per_rank_batch), shuffle=False,
                                 seed=0, **self.loader_options)

    # the loop
    def run(self, stop_after_epochs: int | None = None) -> dict[str, Any]:
        """Train to the end, or pause after `stop_after_epochs` more epochs (resumable)."""
        if stop_after_epochs is not None and stop_after_epochs < 1:
            raise TrainingError(f"--stop-after-epochs: expected a positive number of epochs, got {stop_after_epochs}")
        if self.runtime.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            if self.start:  # the card says what the run started from
                record = dict(self.start.source, kind="fine-tuned")
                write_text_atomically(self.out / SOURCE_RECORD, json.dumps(record, indent=2) + "\n")
            elif not self.settings.init:  # a run from scratch --overwrite-ing a fine-tuned one
                (self.out / SOURCE_RECORD).unlink(missing_ok=True)
            self._announce()
            if self.start_epoch == 0:
                self._checkpoint(0)  # resumable from the very start
        last = self.epochs if stop_after_epochs is None else min(self.epochs, self.start_epoch + stop_after_epochs)
        try:
            for epoch in range(self.start_epoch, last):
                record = self._train_epoch(epoch)
                record.update(self._validate())
                self._check_finite(record)
                self._end_epoch(epoch, record)
        except KeyboardInterrupt:
            if self.runtime.is_main:
                print(f"\ninterrupted; continue with: vit-hub train --resume --out {self.out}", file=sys.stderr)
            raise
        if last < self.epochs:
            if self.runtime.is_main:
                print(f"paused after epoch {last} of {self.epochs}; continue with: "
                      f"vit-hub train --resume --out {self.out}")
            return self._metrics()
        return self._finish()

    def _announce(self) -> None:
        parameters = sum(p.numel() for p in self.model.parameters())
        print(
            f"data: {self.splits.source} | train {len(self.splits.train)} | "
            f"val {len(self.splits.val) if self.splits.val is not None else 0} | "
            f"test {len(self.splits.test) if self.splits.test is not None else 0} | {len(self.config.labels)} classes"
        )
        colour = self.data_stats.colour if self.data_stats else None
        if colour is not None and self.settings.model.get("in_channels") is None:
            print(f"input: {colour.describe()}")
        if self.start:
            print(f"init: {describe(self.start.source)}")
        print(
            f"model: {parameters / 1e6:.2f} M parameters, {self.config.image_size[0]}x{self.config.image_size[1]}x"
            f"{self.config.in_channels}, patch {self.config.patch_size[0]}x{self.config.patch_size[1]}, "
            f"dim {self.config.embed_dim}, depth {self.config.depth}, heads {self.config.num_heads}\n"
            f"training: {self.epochs} epochs, batch {self.batch_size}, lr {self.peak_lr:g}, "
            f"{self.runtime.world_size} process(es) on {self.runtime.device}, {self.train_loader.num_workers} "
            f"loader worker(s) per process\n"
            f"step: {'torch.compile' if self.compiled else 'eager'} ({self.compile_reason}), "
            f"{self.flops_per_image / 1e9:.2f} GFLOP per training image (forward + backward)"
        )

    def _train_epoch(self, epoch: int) -> dict[str, Any]:
        settings, device = self.settings, self.runtime.device
        torch.manual_seed(settings.seed * 100_003 + epoch)  # dropout etc.: replayable per epoch
        total_steps = self.epochs * self.steps_per_epoch
        warmup_steps = max(1, round(self.warmup_epochs * self.steps_per_epoch))
        self.network.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        correct = torch.zeros((), dtype=torch.int64, device=device)
        seen = 0
        started = time.perf_counter()
        bar = tqdm(self._train_loader(epoch), desc=f"epoch {epoch + 1}/{self.epochs}",
                   total=self.steps_per_epoch, disable=not self.runtime.is_main, leave=False,
                   mininterval=0.5 if sys.stderr.isatty() else 30.0)  # logs: a line every 30 s
        for step_in_epoch, (pixels, labels, boxes) in enumerate(bar):
            self._report_unreadable()
            step = epoch * self.steps_per_epoch + step_in_epoch
            lr = learning_rate(step, total_steps, warmup_steps, self.peak_lr)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            # uint8 pixels from the workers (pinned on CUDA), normalised and erased on the device
            images = self.model_input(pixels.to(device, non_blocking=True), boxes.to(device, non_blocking=True))
            labels = labels.to(device, non_blocking=True)
            logits, loss = self._step(images, labels)
            loss_sum += loss.detach().double() * len(labels)
            correct += (logits.argmax(1) == labels).sum()
            seen += len(labels)
            if step_in_epoch % 10 == 0:
                elapsed = time.perf_counter() - started
                bar.set_postfix(loss=f"{float(loss_sum) / seen:.4f}", acc=f"{int(correct) / seen:.4f}",
                                img_s=f"{seen * self.runtime.world_size / elapsed:.0f}", lr=f"{lr:.2e}")
        bar.close()
        elapsed = time.perf_counter() - started
        totals = _all_reduce(torch.stack([loss_sum, correct.double(), torch.tensor(seen, dtype=torch.float64,
                                                                                      device=device)]), self.runtime)
        self._report_unreadable(gather=True)
        images_per_second = float(totals[2]) / elapsed
        record = {
            "epoch": epoch + 1,
            "train_loss": float(totals[0] / totals[2]),
            "train_accuracy": float(totals[1] / totals[2]),
            "lr": lr,
            "images_per_second": images_per_second,
            "epoch_seconds": elapsed,
        }
        return record | flop_rates(self.flops_per_image * images_per_second, self._peak_flops())

    def _peak_flops(self) -> float | None:
        """The whole run's dense matmul peak (per GPU x processes) in the step's precision, or None."""
        device = self.runtime.device
        if device.type != "cuda":
            return None  # a CPU has no one peak to hold the step against: its FLOP/s are reported alone
        peak = peak_flops(torch.cuda.get_device_name(device), self.amp_dtype or torch.float32)
        return None if peak is None else peak * self.runtime.world_size

    def _report_unreadable(self, gather: bool = False) -> None:
        """Unreadable files met since the last call, named once each on stderr by the main
        process (with --strict, the first fails the run in one line). Each process meets
        its own; `gather` (at the end of an epoch, on every process) collects them all. Between
        those, the flags are read at most once a second (a scan of 1M flags takes about 1 ms)."""
        if not gather and time.monotonic() - self.unreadable_checked < 1.0:
            return
        self.unreadable_checked = time.monotonic()
        self.splits.check_unreadable()
        met = self.splits.skipped
        if gather and self.runtime.distributed:
            everyone: list[Any] = [None] * self.runtime.world_size
            dist.all_gather_object(everyone, met)
            met = sorted(set().union(*everyone))
        new = [path for path in met if path not in self.reported]
        self.reported.update(new)
        if self.runtime.is_main:
            for path in new:
                print(f"skipped unreadable image {path} (use --strict to fail instead)", file=sys.stderr)

    def _step(self, images: torch.Tensor, labels: torch.Tensor):
        autocast = (torch.autocast(self.runtime.device.type, dtype=self.amp_dtype)
                    if self.amp_dtype else contextlib.nullcontext())
        with autocast:
            logits = self.network(images).logits
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=self.settings.label_smoothing)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return logits, loss

    def _validate(self) -> dict[str, Any]:
        if "val" not in self.eval_sets:
            return {}
        # The bare model, not the DDP wrapper: shards may differ in batch count by one.
        result = evaluate(self.model, self._eval_loader("val"), self.runtime.device,
                          self.config.num_classes, self.runtime)
        return {"val_loss": result["loss"], "val_accuracy": result["accuracy"]}

    def _check_finite(self, record: dict[str, Any]) -> None:
        """A loss or weight that turned inf or NaN stops the run before this epoch saves anything,
        so the model dir and checkpoint keep the last good epoch. Checked once per epoch, on
        numbers every process shares (summed losses, identical weights), so all stop together."""
        bad = [f"{key} {record[key]}" for key in ("train_loss", "val_loss")
               if key in record and not math.isfinite(record[key])]
        if not bool(torch.stack([p.isfinite().all() for p in self.model.parameters()]).all()):
            bad.append("non-finite weights")
        if bad:
            raise TrainingError(
                f"epoch {record['epoch']}: expected a finite loss, got {', '.join(bad)}; stopped without saving "
                f"this epoch ({self.out} keeps the checkpoint after epoch {record['epoch'] - 1}); "
                f"try a lower --lr than {self.peak_lr:g}"
            )

    def _end_epoch(self, epoch: int, record: dict[str, Any]) -> None:
        self.history.append(record)
        accuracy = record.get("val_accuracy", record["train_accuracy"])
        loss = record.get("val_loss", record["train_loss"])
        # Ties go to the lower loss: a small validation split reaches 100 % long before the
        # model is done (circles vs squares: epoch 60 of 200 was kept, 0.85 test).
        improved = (accuracy, -loss) > (self.best_accuracy, -self.best_loss)
        if improved:
            self.best_accuracy, self.best_loss = accuracy, loss
        if self.runtime.is_main:
            if improved:
                self.model.save_pretrained(self.out)  # config.json + model.safetensors of the best epoch
            self._checkpoint(epoch + 1)
            self._write_metrics()
            shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}
            tqdm.write(json.dumps(shown) + ("  (best)" if improved else ""))

    def _checkpoint(self, epochs_done: int) -> None:
        state = {
            "epoch": epochs_done, "history": self.history, "best_accuracy": self.best_accuracy,
            "best_loss": self.best_loss,
            "settings": dataclasses.asdict(self.settings), "config": self.config.to_dict(),
        }
        save_checkpoint(self.out / CHECKPOINT, self.model, self.optimizer, state)

    def _metrics(self) -> dict[str, Any]:
        return {
            "history": self.history,
            "best_val_accuracy": self.best_accuracy,
            "epochs": self.epochs,
            "settings": dataclasses.asdict(self.settings),
            "hardware": self._hardware(),
        }

    def _hardware(self) -> dict[str, Any]:
        """Where the run happened, for the card: results depend on precision and process count."""
        device = self.runtime.device
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
        else:
            name = f"CPU, {torch.get_num_threads()} thread(s) per process"
        amp = self.amp_dtype
        return {"device": name, "processes": self.runtime.world_size, "torch": torch.__version__,
                "precision": f"{str(amp).removeprefix('torch.')} autocast" if amp else "fp32"}

    def _write_metrics(self, extra: dict[str, Any] | None = None) -> None:
        metrics = {**self._metrics(), **(extra or {})}
        write_text_atomically(self.out / "metrics.json", json.dumps(metrics, indent=2) + "\n")

    def _finish(self) -> dict[str, Any]:
        """Best weights back in, evaluated on validation and test side by side (a test split
        far below validation is reported); plots and card written."""
        if self.runtime.distributed:
            dist.barrier()  # rank 0 has written the best weights; everyone loads them
        best = VisionTransformer.from_pretrained(str(self.out)).to(self.runtime.device)
        results = {name: evaluate(best, self._eval_loader(name), self.runtime.device, self.config.num_classes,
                                  self.runtime)
                   for name in ("val", "test") if name in self.eval_sets}
        self._report_unreadable(gather=True)
        final: dict[str, Any] = {}
        if results:
            split = "test" if "test" in results else "val"
            evaluation = {name: {key: result[key] for key in ("accuracy", "loss", "n")}
                          for name, result in results.items()}
            final = {"final": {"split": split, **evaluation[split]}, "evaluation": evaluation}
            warning = shift_warning(evaluation)
            if warning:
                final["warning"] = warning
        if self.runtime.is_main:
            self._write_metrics(final)
            plot_curves(self.history, self.out / "curves.png")
            if results:
                plot_confusion_matrix(results[split]["confusion"], self.config.labels,
                                      self.out / "confusion_matrix.png",
                                      title=f"{split} split, accuracy {results[split]['accuracy']:.4f}")
            views_after_training(best, self.out, self.eval_sets.get("val"))  # what it learned, for the card
            write_model_card(self.out)
            if self.reported:
                print(vdata.skipped_report(sorted(self.reported)), file=sys.stderr)
            if final.get("warning"):
                print(f"warning: {final['warning']}", file=sys.stderr)
            shown = {f"{name}_accuracy": value["accuracy"] for name, value in final.get("evaluation", {}).items()}
            print(json.dumps({"out": str(self.out), **final.get("final", {}), **shown,
                              "best_val_accuracy": self.best_accuracy}))
        return {**self._metrics(), **final}


def shift_warning(evaluation: dict[str, dict[str, Any]]) -> str | None:
    """A plain sentence when test accuracy is far below validation accuracy: more than
    SHIFT_GAP and more than three standard errors of the difference."""
    if "val" not in evaluation or "test" not in evaluation:
        return None
    val, test = evaluation["val"], evaluation["test"]
    variance = sum(split["accuracy"] * (1 - split["accuracy"]) / max(1, split["n"]) for split in (val, test))
    if val["accuracy"] - test["accuracy"] <= max(SHIFT_GAP, 3 * math.sqrt(variance)):
        return None
    return (f"test accuracy {test['accuracy']:.3f} is far below validation accuracy {val['accuracy']:.3f}: "
            f"the test images likely come from another acquisition than the training images (camera, "
            f"stain, lighting, framing), which a validation split drawn from the training images cannot show")


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


def setting_flag(name: str) -> str:
    """The command-line flag of a TrainSettings or ViTConfig field."""
    field = {field.name: field for field in dataclasses.fields(TrainSettings)}.get(name)
    spelled = "--" + name.replace("_", "-")
    return field.metadata.get("flag", spelled) if field else spelled


def _same_setting(name: str, given: Any, own: Any) -> bool:
    """A setting given again equals the run's own (--data: the same folder, however spelled)."""
    if given == own:
        return True
    return name == "data" and Path(given).is_dir() and os.path.realpath(given) == os.path.realpath(own)


def _same_model_field(config: ViTConfig, name: str, given: Any) -> bool:
    """A model flag given again equals the config's value once normalised (16 is 16x16)."""
    try:
        return getattr(ViTConfig.from_dict({**config.to_dict(), name: given}), name) == getattr(config, name)
    except (TypeError, ValueError):  # a value no config takes is not the config's either
        return False


def check_out_is_free(out: Path) -> None:
    """A new run never writes over a trained model or a resumable run without being told to."""
    found = [name for name in (CHECKPOINT, "model.safetensors") if (out / name).exists()]
    if found:
        raise TrainingError(
            f"--out {out}: expected a new or empty folder, found a trained model or run there "
            f"({', '.join(found)}); pass --resume to continue that run or --overwrite to replace it"
        )


def train(settings: TrainSettings, resume: bool = False, stop_after_epochs: int | None = None,
          overwrite: bool = False, resume_flags: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run training (or continue it with `resume`); returns the metrics written.
    `stop_after_epochs` pauses the run early with a resumable checkpoint (time-boxed jobs);
    a new run refuses an --out that holds a model or a run unless `overwrite`, and an --out
    inside --data always.

    `resume` replays the settings saved in the checkpoint of `settings.out` (its other fields
    are not read). `resume_flags` are the settings given again with it (TrainSettings field
    names, `model` holding ViTConfig fields): those in HOW_TO_RUN apply to the rest of the
    run; any other that differs from the run's own refuses the resume, naming each."""
    check_out_is_a_folder(Path(settings.out))
    if not resume and not overwrite:
        check_out_is_free(Path(settings.out))
    trainer = Trainer(settings, resume=resume, resume_flags=resume_flags)
    try:
        return trainer.run(stop_after_epochs)
    finally:
        if trainer.runtime.distributed and dist.is_initialized():
            dist.destroy_process_group()


def command_line(argv: list[str] | None = None) -> str:
    """The command as the user typed it, for the model card (`argv`: as given to `cli.main`)."""
    if argv is not None:
        return " ".join(["vit-hub", *map(shlex.quote, argv)])
    program = "vit-hub" if Path(sys.argv[0]).name in ("vit-hub", "__main__.py") else Path(sys.argv[0]).name
    return " ".join([program, *map(shlex.quote, sys.argv[1:])])

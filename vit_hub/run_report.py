"""What a training run tells its user: the start-up lines of the log, the progress bar's
numbers, where the run happened (for metrics.json and the card), and what the loop leaves at
the end besides the weights (the curves, the confusion matrix, a summary line). The model card
and the views of what the model learned are the run level's (`vit_hub.training_run`).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
from torch import nn

from . import data as vdata
from .checkpoint import Progress
from .config import ViTConfig, size_text
from .distributed import Runtime
from .layout import ModelDir
from .plots import plot_confusion_matrix, plot_curves
from .schedule import Schedule
from .step import TrainStep


def data_line(splits: vdata.DataSplits, config: ViTConfig) -> str:
    sizes = {name: len(dataset) if dataset is not None else 0
             for name, dataset in (("train", splits.train), ("val", splits.val), ("test", splits.test))}
    return (f"data: {splits.source} | train {sizes['train']} | val {sizes['val']} | test {sizes['test']} | "
            f"{len(config.labels)} classes")


def model_line(model: nn.Module, config: ViTConfig) -> str:
    parameters = sum(p.numel() for p in model.parameters())
    return (f"model: {parameters / 1e6:.2f} M parameters, {size_text([*config.image_size, config.in_channels])}, "
            f"patch {size_text(config.patch_size)}, dim {config.embed_dim}, depth {config.depth}, "
            f"heads {config.num_heads}")


def training_line(schedule: Schedule, runtime: Runtime, workers: int) -> str:
    return (f"training: {schedule.epochs} epochs, batch {schedule.batch_size}, lr {schedule.peak_lr:g}, "
            f"{runtime.world_size} process(es) on {runtime.device}, {workers} loader worker(s) per process"
            + (f", {runtime.threads}" if runtime.threads else ""))


def step_line(step: TrainStep, flops_per_image: float) -> str:
    return (f"step: {'torch.compile' if step.compiled else 'eager'} ({step.compile_reason}), "
            f"{flops_per_image / 1e9:.2f} GFLOP per training image (forward + backward)")


def progress_fields(loss_sum: torch.Tensor, correct: torch.Tensor, seen: int, lr: float, started: float,
                    processes: int) -> dict[str, str]:
    """The progress bar's running numbers: this process's loss and accuracy so far, the whole
    run's images a second (every process trains as fast), the learning rate."""
    elapsed = time.perf_counter() - started
    return {"loss": f"{float(loss_sum) / seen:.4f}", "acc": f"{int(correct) / seen:.4f}",
            "img_s": f"{seen * processes / elapsed:.0f}", "lr": f"{lr:.2e}"}


def hardware(runtime: Runtime, amp_dtype: torch.dtype | None) -> dict[str, Any]:
    """Where the run happened, for the card: results depend on precision and process count."""
    device = runtime.device
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU, {torch.get_num_threads()} thread(s) per process"
    return {"device": name, "processes": runtime.world_size, "torch": torch.__version__,
            "precision": f"{str(amp_dtype).removeprefix('torch.')} autocast" if amp_dtype else "fp32"}


def write_figures(out: ModelDir, history: list[dict[str, Any]], results: dict[str, dict[str, Any]],
                  labels: list[str]) -> None:
    """The loss and accuracy curves, and the confusion matrix of the final split (test where
    there is one) of the best weights' evaluation (`results`, by split)."""
    plot_curves(history, out.curves)
    if results:
        split = "test" if "test" in results else "val"
        plot_confusion_matrix(results[split]["confusion"], labels, out.confusion_matrix,
                              title=f"{split} split, accuracy {results[split]['accuracy']:.4f}")


def print_summary(out: Any, final: dict[str, Any], progress: Progress, skipped: str | None) -> None:
    """The run's last lines: skipped files and a shift warning on stderr, then one JSON line
    on stdout (the model dir, the final split's scores, every split's accuracy, the best
    validation accuracy and the epoch whose weights were kept)."""
    if skipped:
        print(skipped, file=sys.stderr)
    if final.get("warning"):
        print(f"warning: {final['warning']}", file=sys.stderr)
    shown = {f"{name}_accuracy": value["accuracy"] for name, value in final.get("evaluation", {}).items()}
    print(json.dumps({"out": str(out), **final.get("final", {}), **shown, "best_val_accuracy": progress.best_accuracy,
                      "kept_epoch": progress.kept_epoch}))

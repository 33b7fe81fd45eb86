"""What a training run tells its user: the start-up lines of the log, the progress bar's
numbers, where the run happened (for metrics.json and the card), and what the loop leaves at
the end besides the weights (the curves, the confusion matrix, a summary line). The model card
and the views of what the model learned are the run level's (`vit_hub.train.run`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure  # a figure of its own: no pyplot state, no backend to choose
from torch import nn

from vit_hub.data import sources as vdata
from vit_hub.layout import ModelDir
from vit_hub.model.config import ViTConfig, size_text
from vit_hub.train.checkpoint import Progress
from vit_hub.train.distributed import Runtime
from vit_hub.train.schedule import Schedule
from vit_hub.train.step import TrainStep


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


# Curves and confusion matrices as PNG files (matplotlib, no display needed) ---------------------
def plot_curves(history: list[dict[str, Any]], path: Path) -> None:
    """Loss and accuracy per epoch, train and validation side by side."""
    epochs = [record["epoch"] for record in history]
    figure = Figure(figsize=(10, 4))
    loss_axis, accuracy_axis = figure.subplots(1, 2)
    for split, style in (("train", "-o"), ("val", "-s")):
        if history and f"{split}_loss" in history[0]:
            loss_axis.plot(epochs, [r[f"{split}_loss"] for r in history], style, label=split, markersize=3)
            accuracy_axis.plot(epochs, [r[f"{split}_accuracy"] for r in history], style, label=split, markersize=3)
    for axis, name in ((loss_axis, "loss"), (accuracy_axis, "accuracy")):
        axis.set_xlabel("epoch")
        axis.set_ylabel(name)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def plot_confusion_matrix(confusion: list[list[int]], labels: list[str], path: Path, title: str = "") -> None:
    """Rows are true classes, columns predictions; cells show counts, colour the row share."""
    counts = np.asarray(confusion)
    shares = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    size = max(4.0, 0.45 * len(labels) + 2)
    figure = Figure(figsize=(size, size))
    axis = figure.subplots()
    axis.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    if len(labels) <= 30:
        ticks = np.arange(len(labels))
        axis.set_xticks(ticks, labels, rotation=90 if max(map(len, labels)) > 2 else 0)
        axis.set_yticks(ticks, labels)
        for row, column in zip(*np.nonzero(counts)):
            colour = "white" if shares[row, column] > 0.5 else "black"
            axis.text(column, row, str(counts[row, column]), ha="center", va="center", fontsize=7, color=colour)
    axis.set_xlabel("predicted")
    axis.set_ylabel("true")
    axis.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)

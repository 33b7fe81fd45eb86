"""What a training run tells its user: the start-up lines of the log, the progress bar's
numbers, where the run happened (for metrics.json and the card), and what the run leaves at
the end besides the weights (plots, what the model learned, the model card, a summary line).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
from torch import nn

from . import data as vdata
from .card import write_model_card
from .config import ViTConfig, size_text
from .distributed import Runtime
from .inspecting import views_after_training
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
            f"{runtime.world_size} process(es) on {runtime.device}, {workers} loader worker(s) per process")


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


def write_figures_and_card(out: ModelDir, history: list[dict[str, Any]], results: dict[str, dict[str, Any]],
                           best: nn.Module, val_set: Any) -> None:
    """The loss and accuracy curves, the confusion matrix of the final split (test where there
    is one), what the best model learned, and the model card that shows them."""
    plot_curves(history, out.curves)
    if results:
        split = "test" if "test" in results else "val"
        plot_confusion_matrix(results[split]["confusion"], best.config.labels, out.confusion_matrix,
                              title=f"{split} split, accuracy {results[split]['accuracy']:.4f}")
    views_after_training(best, out.folder, val_set)
    write_model_card(out.folder)


def print_summary(out: Any, final: dict[str, Any], best_val_accuracy: float, skipped: str | None) -> None:
    """The run's last lines: skipped files and a shift warning on stderr, then one JSON line
    on stdout (the model dir, the final split's scores, every split's accuracy)."""
    if skipped:
        print(skipped, file=sys.stderr)
    if final.get("warning"):
        print(f"warning: {final['warning']}", file=sys.stderr)
    shown = {f"{name}_accuracy": value["accuracy"] for name, value in final.get("evaluation", {}).items()}
    print(json.dumps({"out": str(out), **final.get("final", {}), **shown, "best_val_accuracy": best_val_accuracy}))

"""Scoring a model on a split: loss, accuracy and confusion matrix (summed over every process
under `torchrun`), and the warning when test accuracy falls far below validation accuracy.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from vit_hub.train.distributed import Runtime, all_reduce

SHIFT_GAP = 0.05  # test accuracy this far below validation accuracy is reported as a likely shift


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device, num_classes: int,
             runtime: Runtime | None = None, progress: bool = False, keep_logits: bool = False) -> dict[str, Any]:
    """Loss, accuracy and confusion matrix over a loader (summed over all processes). With
    `keep_logits`, also this process's own "logits" [N, classes] and "labels" [N] as numpy
    arrays (what a temperature is fitted on: `vit_hub.train.calibration`)."""
    model.eval()
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    kept_logits, kept_labels = [torch.zeros(0, num_classes)], [torch.zeros(0, dtype=torch.int64)]
    for images, labels in tqdm(loader, desc="eval", leave=False, disable=not progress):
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        logits = model(images).logits.float()
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").double()
        confusion += torch.bincount(labels * num_classes + logits.argmax(1), minlength=num_classes**2).view(
            num_classes, num_classes
        )
        if keep_logits:
            kept_logits.append(logits.cpu()), kept_labels.append(labels.cpu())
    if runtime is not None:
        all_reduce(confusion, runtime), all_reduce(loss_sum, runtime)
    count = int(confusion.sum())
    result = {
        "accuracy": float(confusion.diagonal().sum()) / max(1, count),
        "loss": float(loss_sum) / max(1, count),
        "n": count,
        "confusion": confusion.cpu().tolist(),  # rows: true class, columns: predicted
    }
    if keep_logits:
        result.update(logits=torch.cat(kept_logits).numpy(), labels=torch.cat(kept_labels).numpy())
    return result


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


def final_evaluation(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What metrics.json records of the evaluation of the best weights: `final` (test where
    there is a test split, else validation), each split's scores under `evaluation`, and a
    `warning` when test falls far below validation. Empty when no split was evaluated."""
    if not results:
        return {}
    split = "test" if "test" in results else "val"
    evaluation = {name: {key: result[key] for key in ("accuracy", "loss", "n")} for name, result in results.items()}
    final: dict[str, Any] = {"final": {"split": split, **evaluation[split]}, "evaluation": evaluation}
    warning = shift_warning(evaluation)
    if warning:
        final["warning"] = warning
    return final

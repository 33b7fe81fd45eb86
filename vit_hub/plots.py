"""Training curves and confusion matrices as PNG files (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure  # a figure of its own: no pyplot state, no backend to choose


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

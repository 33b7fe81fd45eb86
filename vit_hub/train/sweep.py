"""`vit-hub sweep`: one short training run per value of a hyperparameter, then a table and
a plot of validation accuracy against the value (one parameter varied at a time)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from vit_hub.errors import UserError
from vit_hub.layout import ModelDir
from vit_hub.storage import count_parameters
from vit_hub.train.run import train
from vit_hub.train.settings import (MODEL_FIELDS, TRAINING_FIELDS, TrainSettings, check_out_is_a_folder,
                                    check_out_is_free, check_out_outside_data)


def _number(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_param(text: str) -> tuple[str, list[Any]]:
    """'num_heads=2,4,8' -> ('num_heads', [2, 4, 8])."""
    name, _, values = text.partition("=")
    name = name.strip().replace("-", "_")
    if name not in MODEL_FIELDS + TRAINING_FIELDS or not values:
        raise UserError(
            f"--param: expected NAME=V1,V2 with NAME one of {', '.join(MODEL_FIELDS + TRAINING_FIELDS)}, got {text!r}"
        )
    return name, [_number(value.strip()) for value in values.split(",") if value.strip()]


def _with_value(settings: TrainSettings, name: str, value: Any, out: Path) -> TrainSettings:
    if name in TRAINING_FIELDS:
        return dataclasses.replace(settings, out=str(out), **{name: value})
    return dataclasses.replace(settings, out=str(out), model={**settings.model, name: value})


def sweep(settings: TrainSettings, params: list[tuple[str, list[Any]]], out: Path, overwrite: bool = False,
          resume: bool = False) -> str:
    """Run every value, write `sweep.json`, `sweep.md` and `sweep.png` in `out`; return the table.

    Refuses up front, before any run, when a run's folder already holds a model or a run
    (unless `overwrite`). With `resume` (an interrupted sweep) finished runs are read back,
    an interrupted run continues from its checkpoint and the others start."""
    if overwrite and resume:
        raise UserError("sweep: --resume continues the runs in --out and --overwrite replaces them; pass one")
    check_out_is_a_folder(out)
    check_out_outside_data(out, settings.data)
    if not overwrite and not resume:
        for name, values in params:
            for value in values:
                check_out_is_free(out / f"{name}={value}")
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {}
    for name, values in params:
        for value in values:
            run_dir = out / f"{name}={value}"
            metrics = _run(_with_value(settings, name, value, run_dir), resume)
            last = metrics["history"][-1]
            results.setdefault(name, []).append({
                "value": value, "best_val_accuracy": metrics["best_val_accuracy"],
                "train_accuracy": last["train_accuracy"], "images_per_second": last["images_per_second"],
                "parameters": _parameter_count(run_dir),
            })
    (out / "sweep.json").write_text(json.dumps(results, indent=2) + "\n")
    table = _table(results)
    (out / "sweep.md").write_text(table + "\n")
    _plot(results, out / "sweep.png")
    return table


def _run(settings: TrainSettings, resume: bool) -> dict[str, Any]:
    """One run of the sweep. With `resume`: a finished run's metrics as written, an
    interrupted one continued from its checkpoint (with its own saved settings)."""
    run_dir = Path(settings.out)
    if resume and _finished(run_dir):
        print(f"sweep: {run_dir} is finished; reading its {ModelDir.metrics}")
        return json.loads(ModelDir(run_dir).metrics.read_text())
    if resume and ModelDir(run_dir).checkpoint.is_file():
        print(f"sweep: continuing {run_dir} from its checkpoint")
        return train(settings, resume=True)
    return train(settings, overwrite=True)


def _finished(run_dir: Path) -> bool:
    """A run that trained every epoch and was evaluated (its metrics have the final result)."""
    try:
        metrics = json.loads(ModelDir(run_dir).metrics.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return "final" in metrics and len(metrics.get("history", [])) >= metrics.get("epochs", 0)


def _parameter_count(run_dir: Path) -> int:
    return count_parameters(ModelDir(run_dir).weights) or 0


def _table(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| parameter | value | best val accuracy | train accuracy | params | img/s |", "|---|---|---|---|---|---|"]
    for name, rows in results.items():
        lines += [f"| {name} | {row['value']} | {row['best_val_accuracy']:.4f} | {row['train_accuracy']:.4f} | "
                  f"{row['parameters']:,} | {row['images_per_second']:.0f} |" for row in rows]
    return "\n".join(lines)


def _plot(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    figure = Figure(figsize=(4.5 * len(results), 3.5))
    axes = figure.subplots(1, len(results), squeeze=False)
    for axis, (name, rows) in zip(axes[0], results.items()):
        labels = [str(row["value"]) for row in rows]
        axis.plot(labels, [row["best_val_accuracy"] for row in rows], "-o")
        axis.set_xlabel(name)
        axis.set_ylabel("best validation accuracy")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)

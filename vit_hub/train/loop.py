"""The training loop: from `--data` (and, when fine-tuning, pretrained weights) to the
weights, metrics and plots of a model dir.

    settings -> data splits -> config (preset / chosen from the data / flags)
      -> epochs of AdamW with warmup + cosine, label smoothing, gradient clipping
      -> after every epoch: validation, metrics.json, a resumable checkpoint, and the
         model dir's weights and config refreshed with the epoch it keeps: the best on
         validation, or the last when validation is too small to choose by (`Selection`)
      -> at the end: the kept weights evaluated on validation and test, the temperature of
         their probabilities fitted on validation, curves, confusion matrix

`vit_hub.train.run` does the set-up (`train()` reads the checkpoint and joins the process
group; `build_trainer()` lists the data, chooses the config, builds the model, optimizer and
loaders) and hands the parts to a `Trainer`, which runs the epochs. The parts live in their own
modules: settings, schedule, step, loaders, checkpoint, distributed, evaluation, calibration,
report.

Nothing here reads the Hub or writes the model card: `vit_hub.train.run.train()`, what
`vit-hub train` runs, resolves `--init` to pretrained weights, runs this loop, then writes
the card and the views of what the model learned.

One process or many: under `torchrun` the same code runs DistributedDataParallel
(gloo on CPU, nccl on CUDA); `--batch-size` is the global batch either way, and every
process takes its share of the same global batches with the same per-sample augmentation,
so the learning rate and the data a run sees do not depend on the number of processes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from vit_hub.data import sources as vdata
from vit_hub.hub.fine_tune import PretrainedStart, describe
from vit_hub.layout import ModelDir
from vit_hub.model.config import ViTConfig
from vit_hub.model.flops import flop_rates, run_peak_flops
from vit_hub.model.vit import VisionTransformer
from vit_hub.storage import write_text_atomically
from vit_hub.train import report as run_report
from vit_hub.train.calibration import fit_temperature
from vit_hub.train.checkpoint import Progress, load_kept_model, save_checkpoint, save_kept_config, save_kept_model
from vit_hub.train.distributed import Runtime, all_reduce, barrier
from vit_hub.train.evaluation import evaluate, final_evaluation
from vit_hub.train.loaders import RunLoaders, UnreadableReport
from vit_hub.train.schedule import Schedule
from vit_hub.train.settings import TrainingError, TrainSettings
from vit_hub.train.step import TrainStep
from vit_hub.train.streaming import epoch_loader, record_within, resume_within

# Each epoch reseeds dropout and stochastic depth with seed x this + epoch, so a resumed run draws
# what an uninterrupted one would, and no two (seed, epoch) pairs share a stream.
EPOCH_SEED_STRIDE = 100_003


@dataclasses.dataclass(frozen=True)
class RunData:
    """The data a run reads: its splits, the unreadable files met in them, and what the data
    looked like when it chose the config."""

    splits: vdata.DataSplits
    unreadable: UnreadableReport
    stats: vdata.ImageStats | None = None  # what chose the config, when the data did


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What a run trains and for how long: the model's config, the schedule, and the
    pretrained weights a fine-tuning run starts from."""

    config: ViTConfig
    schedule: Schedule
    start: PretrainedStart | None = None


@dataclasses.dataclass
class Trainer:
    """A run, set up (by `build_trainer`) and ready to train: `run()` trains its epochs."""

    settings: TrainSettings
    out: ModelDir  # where the run writes: settings.out (for a resumed run, the folder it was found in)
    runtime: Runtime
    data: RunData
    plan: RunPlan
    model: VisionTransformer  # the bare model: saved, evaluated, checkpointed
    step: TrainStep  # runs the model as compiled and wrapped for DDP
    loaders: RunLoaders
    progress: Progress
    flops_per_image: float  # one training image, forward and backward
    best_model: VisionTransformer | None = None  # once the run has finished: its kept epoch, evaluated

    def run(self, stop_after_epochs: int | None = None) -> dict[str, Any]:
        """Train to the end, or pause after `stop_after_epochs` more epochs (resumable)."""
        if stop_after_epochs is not None and stop_after_epochs < 1:
            raise TrainingError(f"--stop-after-epochs: expected a positive number of epochs, got {stop_after_epochs}")
        if self.runtime.is_main:
            self._prepare_out()
        epochs = self.plan.schedule.epochs
        first = self.progress.epochs_done
        last = epochs if stop_after_epochs is None else min(epochs, first + stop_after_epochs)
        resume_hint = f"vit-hub train --resume --out {self.out.folder}"
        try:
            for epoch in range(first, last):
                record = self._train_epoch(epoch) | self._validate()
                self._check_finite(record)
                self._end_epoch(record)
        except KeyboardInterrupt:
            if self.runtime.is_main:
                print(f"\ninterrupted; continue with: {resume_hint}", file=sys.stderr)
            raise
        if last < epochs:
            if self.runtime.is_main:
                print(f"paused after epoch {last} of {epochs}; continue with: {resume_hint}")
            return self._metrics()
        return self._finish()

    def _prepare_out(self) -> None:
        """The model dir exists, says what the run started from, and is resumable from the start."""
        self.out.folder.mkdir(parents=True, exist_ok=True)
        if self.plan.start:  # the card says what the run started from
            record = dict(self.plan.start.source, kind="fine-tuned")
            write_text_atomically(self.out.source, json.dumps(record, indent=2) + "\n")
        elif not self.settings.init:  # a run from scratch --overwrite-ing a fine-tuned one
            self.out.source.unlink(missing_ok=True)
        self._announce()
        if self.progress.epochs_done == 0 and self.progress.step_in_epoch == 0:
            self._save_checkpoint()

    def _announce(self) -> None:
        """The log's first lines: the data, the input choice, the start, the model, the run, the step."""
        lines = [run_report.data_line(self.data.splits, self.plan.config)]
        colour = self.data.stats.colour if self.data.stats else None
        if colour is not None and self.settings.model.get("in_channels") is None:
            lines.append(f"input: {colour.describe()}")
        if self.plan.start:
            lines.append(f"init: {describe(self.plan.start.source)}")
        lines += [run_report.model_line(self.model, self.plan.config),
                  run_report.training_line(self.plan.schedule, self.runtime, self.loaders.train_loader.num_workers),
                  run_report.step_line(self.step, self.flops_per_image),
                  f"weights kept: {self.progress.selection.reason}"]
        print("\n".join(lines))

    def _train_epoch(self, epoch: int) -> dict[str, Any]:
        """One pass over the training split; the epoch's record (loss, accuracy, speed)."""
        device, schedule = self.runtime.device, self.plan.schedule
        torch.manual_seed(self.settings.seed * EPOCH_SEED_STRIDE + epoch)
        self.step.network.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        correct = torch.zeros((), dtype=torch.int64, device=device)
        seen, lr = 0, schedule.peak_lr
        start, (loss_sum, correct, seen) = resume_within(self.progress, self.runtime, self.loaders, epoch,
                                                         (loss_sum, correct, seen))
        started = time.perf_counter()
        bar = tqdm(epoch_loader(self.loaders, epoch, start), desc=f"epoch {epoch + 1}/{schedule.epochs}",
                   total=schedule.steps_per_epoch - start, disable=not self.runtime.is_main, leave=False,
                   mininterval=0.5 if sys.stderr.isatty() else 30.0)  # logs: a line every 30 s
        for step_in_epoch, (pixels, labels, draws) in enumerate(bar):
            self.data.unreadable.report()
            lr = schedule.lr_at(epoch * schedule.steps_per_epoch + start + step_in_epoch)
            self.step.set_lr(lr)
            # uint8 pixels and draws from the workers (pinned on CUDA), finished on the device
            images = self.loaders.model_input(pixels.to(device, non_blocking=True),
                                              draws.to(device, non_blocking=True))
            labels = labels.to(device, non_blocking=True)
            logits, loss = self.step.update(images, labels)
            loss_sum += loss.detach().double() * len(labels)
            correct += (logits.argmax(1) == labels).sum()
            seen += len(labels)
            if record_within(self, start + step_in_epoch + 1, (loss_sum, correct, seen)) and self.runtime.is_main:
                self._save_checkpoint()  # a streamed run's, within the epoch
            if step_in_epoch % 10 == 0:
                bar.set_postfix(run_report.progress_fields(loss_sum, correct, seen, lr, started,
                                                           self.runtime.world_size))
        bar.close()
        elapsed = time.perf_counter() - started
        totals = all_reduce(torch.stack([loss_sum, correct.double(),
                                         torch.tensor(seen, dtype=torch.float64, device=device)]), self.runtime)
        self.data.unreadable.report(gather=True)
        return self._epoch_record(epoch, totals, lr, elapsed)

    def _epoch_record(self, epoch: int, totals: torch.Tensor, lr: float, elapsed: float) -> dict[str, Any]:
        """`totals`: loss sum, correct and seen over every process."""
        images_per_second = float(totals[2]) / elapsed
        record = {
            "epoch": epoch + 1,
            "train_loss": float(totals[0] / totals[2]),
            "train_accuracy": float(totals[1] / totals[2]),
            "lr": lr,
            "images_per_second": images_per_second,
            "epoch_seconds": elapsed,
        }
        peak = run_peak_flops(self.runtime.device, self.step.amp_dtype, self.runtime.world_size)
        return record | flop_rates(self.flops_per_image * images_per_second, peak)

    def _validate(self) -> dict[str, Any]:
        if "val" not in self.loaders.eval_sets:
            return {}
        # The bare model, not the DDP wrapper: shards may differ in batch count by one.
        result = evaluate(self.model, self.loaders.eval_loader("val"), self.runtime.device,
                          self.plan.config.num_classes, self.runtime)
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
                f"this epoch ({self.out.folder} keeps the checkpoint after epoch {record['epoch'] - 1}); "
                f"try a lower --lr than {self.plan.schedule.peak_lr:g}"
            )

    def _end_epoch(self, record: dict[str, Any]) -> None:
        improved = self.progress.add(record)
        if self.runtime.is_main:
            if self.progress.kept_epoch == record["epoch"]:
                save_kept_model(self.model, self.out)
            self._save_checkpoint()
            self._write_metrics()
            shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}
            tqdm.write(json.dumps(shown) + ("  (best)" if improved else ""))

    def _save_checkpoint(self) -> None:
        # The learning rate as resolved: a resumed run does not describe its data again to choose it.
        settings = dataclasses.replace(self.settings, lr=self.plan.schedule.peak_lr)
        state = {**self.progress.state(), "settings": dataclasses.asdict(settings),
                 "config": self.plan.config.to_dict()}
        save_checkpoint(self.out.checkpoint, self.model, self.step.optimizer, state, self.progress.rng)

    def _metrics(self) -> dict[str, Any]:
        return {
            "history": self.progress.history,
            "best_val_accuracy": self.progress.best_accuracy,
            "kept": self.progress.kept(),
            "epochs": self.plan.schedule.epochs,
            "settings": dataclasses.asdict(self.settings),
            "hardware": run_report.hardware(self.runtime, self.step.amp_dtype),
        }

    def _write_metrics(self, extra: dict[str, Any] | None = None) -> None:
        metrics = {**self._metrics(), **(extra or {})}
        write_text_atomically(self.out.metrics, json.dumps(metrics, indent=2) + "\n")

    def _finish(self) -> dict[str, Any]:
        """Kept weights back in, evaluated on validation and test side by side (a test split
        far below validation is reported); the temperature of their probabilities fitted;
        metrics and plots written, `best_model` set."""
        barrier(self.runtime)  # rank 0 has written the kept weights; everyone loads them
        best = self.best_model = load_kept_model(self.plan.config, self.out, self.runtime.device)
        results = {name: evaluate(best, self.loaders.eval_loader(name), self.runtime.device,
                                  self.plan.config.num_classes, self.runtime, keep_logits=name == "val")
                   for name in ("val", "test") if name in self.loaders.eval_sets}
        self.data.unreadable.report(gather=True)
        final = final_evaluation(results)
        if self.runtime.is_main:
            self._calibrate(results.get("val"))
            self._write_metrics(final)
            run_report.write_figures(self.out, self.progress.history, results, self.plan.config.labels)
            run_report.print_summary(self.out.folder, final, self.progress, self.data.unreadable.summary())
        return {**self._metrics(), **final}

    def _calibrate(self, validation: dict[str, Any] | None) -> None:
        """The temperature of the kept model's probabilities, fitted on the logits of this
        process's validation images from the evaluation just run (1.0 without any), set on its
        config and written into its config.json."""
        temperature = 1.0
        if validation is not None and len(validation["labels"]):
            temperature = fit_temperature(validation["logits"], validation["labels"])
        self.best_model.config.temperature = temperature
        save_kept_config(self.best_model.config, self.out)

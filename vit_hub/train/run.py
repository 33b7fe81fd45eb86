"""A whole training run, what `vit-hub train` and `vit-hub sweep` run: from `--data` to a
model dir ready for the Hub. Read it top to bottom:

    train()            --out checked and locked; the checkpoint's settings (with --resume);
                       the settings checked; `--init` read; the device and processes joined
      build_trainer()  the data listed and split, the model chosen for it, the schedule, the
                       model and optimizer, the loaders and the optimizer step
      Trainer.run()    the epochs (`vit_hub.train.loop`): weights, config (with the temperature of
                       the probabilities), metrics, plots, checkpoint
      write_views_and_card()  when every epoch has run: the views of what the model learned,
                       example images and the model card

The loop never reads the Hub nor writes a card; this module sits above both and joins them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vit_hub.data import sources as vdata
from vit_hub.data.samples import write_samples
from vit_hub.hub.card import write_model_card
from vit_hub.hub.fine_tune import PretrainedStart, fine_tune_config, fine_tune_weights
from vit_hub.hub.import_model import load_init
from vit_hub.insight.inspect import views_after_training
from vit_hub.layout import ModelDir
from vit_hub.model.config import ViTConfig
from vit_hub.model.flops import training_flops
from vit_hub.model.vit import VisionTransformer
from vit_hub.train.checkpoint import (Progress, Selection, check_resume_flags, load_checkpoint, read_checkpoint_state,
                                      resumed_settings)
from vit_hub.train.distributed import Runtime, from_main, running
from vit_hub.train.loaders import UnreadableReport, build_loaders
from vit_hub.train.loop import RunData, RunPlan, Trainer
from vit_hub.train.schedule import plan_schedule
from vit_hub.train.settings import (TrainSettings, check_out_is_a_folder, check_out_is_free, check_out_outside_data,
                                    check_settings, holding_out)
from vit_hub.train.step import build_step, make_optimizer
from vit_hub.train.streaming import streamed_loaders


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
    out = Path(settings.out)
    check_out_is_a_folder(out)
    with holding_out(out):  # before --out is checked: a second run into it is refused
        state = read_checkpoint_state(out) if resume else None
        if state is not None:
            settings = resumed_settings(state, resume_flags or {}, out)
        elif not overwrite:
            check_out_is_free(out)
        check_settings(settings)  # a flag that cannot work is refused before any download
        check_out_outside_data(out, settings.data)
        start = load_init(settings.init) if settings.init and state is None else None
        with running(settings.device) as runtime:
            trainer = build_trainer(settings, runtime, state=state, start=start, resume_flags=resume_flags)
            metrics = trainer.run(stop_after_epochs)
            if trainer.best_model is not None and runtime.is_main:
                write_views_and_card(trainer)
            return metrics


def build_trainer(settings: TrainSettings, runtime: Runtime, state: dict[str, Any] | None = None,
                  start: PretrainedStart | None = None, resume_flags: dict[str, Any] | None = None) -> Trainer:
    """Everything a run needs, in order, for checked settings (`train` checks them): the data
    (listed once, on rank 0), the config, the schedule, the model and optimizer (the
    checkpoint's tensors put back), the loaders and the step.

    `state`: the checkpoint's (`read_checkpoint_state`) when resuming, its settings already
    applied; `resume_flags` are then checked against the run's own. `start`: the pretrained
    weights `settings.init` names, for a new run (`vit_hub.hub.import_model.load_init`)."""
    if state is None and bool(settings.init) != (start is not None):
        raise ValueError(f"build_trainer: expected the pretrained weights of --init {settings.init} as `start` "
                         f"exactly when it is given, got start={'given' if start else None}")
    out = ModelDir(settings.out)
    # Files are checked as they are read, so start-up does not grow with the size of the data.
    index = from_main(runtime, lambda: vdata.index_source(settings.data))
    splits = vdata.load_splits(settings.data, settings.data_root, settings.val_split, settings.seed,
                               settings.strict, index=index, options=settings.dataset_options())
    data_stats, config = _choose_config(settings, splits, runtime, start, state)
    small_photos = data_stats is not None and data_stats.is_small_photo_folder
    schedule = plan_schedule(settings, len(splits.train), runtime.world_size, small_photos)
    if state is not None:
        resolved = {"epochs": schedule.epochs, "batch_size": schedule.batch_size, "lr": schedule.peak_lr,
                    "warmup_epochs": schedule.warmup_epochs}
        check_resume_flags(resume_flags or {}, resolved, settings, config, out.folder)
    model = _build_model(config, settings.seed, start, runtime.device)
    optimizer = make_optimizer(model, settings.weight_decay, schedule.peak_lr)
    selection = Selection.for_validation(len(splits.val) if splits.val is not None else None)
    progress = Progress(selection=selection)
    if state is not None:
        progress = Progress.from_state(load_checkpoint(out.checkpoint, model, optimizer), selection)
    flops = training_flops(model)
    loaders = build_loaders(settings, runtime, config, splits, schedule)
    if splits.streamed:  # read as it trains: each process and worker its own part of every epoch
        loaders = streamed_loaders(loaders, splits, settings.seed, runtime, schedule)
    step = build_step(model, optimizer, runtime, settings.compile, schedule.total_steps,
                      settings.label_smoothing, settings.grad_clip)
    data = RunData(splits=splits, unreadable=UnreadableReport(splits, runtime), stats=data_stats)
    plan = RunPlan(config=config, schedule=schedule, start=start)
    return Trainer(settings=settings, out=out, runtime=runtime, data=data, plan=plan, model=model,
                   step=step, loaders=loaders, progress=progress, flops_per_image=flops)


def _choose_config(settings: TrainSettings, splits: vdata.DataSplits, runtime: Runtime, start: PretrainedStart | None,
                   state: dict[str, Any] | None) -> tuple[vdata.ImageStats | None, ViTConfig]:
    """The checkpoint's config on resume, the pretrained model's when fine-tuning, else the
    preset's or one chosen from a few hundred (at most 5,000) sampled images, read on rank 0 only."""
    if state is not None:
        return None, ViTConfig.from_dict(state["config"])
    if start is not None:
        return None, fine_tune_config(start, splits.labels, settings.model)

    def choose() -> tuple[vdata.ImageStats | None, ViTConfig]:
        stats = None if settings.preset else vdata.describe_images(splits.train, settings.seed)
        return stats, vdata.config_for_data(splits, settings.preset, settings.model, settings.seed, stats)

    return from_main(runtime, choose)


def _build_model(config: ViTConfig, seed: int, start: PretrainedStart | None,
                 device: torch.device) -> VisionTransformer:
    """The model, its weights seeded (or the pretrained ones placed: strict, every weight)."""
    torch.manual_seed(seed)
    model = VisionTransformer(config)
    if start is not None:
        model.load_state_dict(fine_tune_weights(start, config))
    return model.to(device)


def write_views_and_card(trainer: Trainer) -> None:
    """What a finished run leaves besides the loop's files: the views of what its best model
    learned (measured on the validation split), a few validation images as the app's examples
    (vit_hub.data.samples) and the model card that shows them all."""
    validation = trainer.loaders.eval_sets.get("val")
    views_after_training(trainer.best_model, trainer.out.folder, validation)
    if validation is not None:  # the images as they were read, before preprocessing
        write_samples(validation.dataset, trainer.plan.config.labels, trainer.out.folder)
    write_model_card(trainer.out.folder)

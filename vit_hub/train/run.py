"""A whole training run, what `vit-hub train` and `vit-hub sweep` run: from `--data` to a
model dir ready for the Hub.

    --out checked -> `--init` resolved to pretrained weights (a folder or a Hub repo)
      -> the training loop (`vit_hub.train.loop`: weights, config, metrics, plots, checkpoint)
      -> when every epoch has run: the views of what the model learned and the model card

The loop below this module never reads the Hub nor writes a card; this module sits above
both and joins them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vit_hub.train.calibration import fit_temperature, validation_logits
from vit_hub.hub.card import write_model_card
from vit_hub.model.fields import read_json
from vit_hub.train.distributed import stop_runtime
from vit_hub.hub.fine_tune import PretrainedStart
from vit_hub.hub.import_model import load_init
from vit_hub.insight.inspect import views_after_training
from vit_hub.data.samples import write_samples
from vit_hub.storage import write_text_atomically
from vit_hub.train.settings import TrainSettings, check_out_is_a_folder, check_out_is_free, check_settings, holding_out
from vit_hub.train.loop import Trainer, build_trainer


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
    with holding_out(Path(settings.out)):  # before --out is checked: a second run into it is refused
        if not resume and not overwrite:
            check_out_is_free(Path(settings.out))
        start = None if resume else pretrained_start(settings)
        trainer = build_trainer(settings, resume=resume, resume_flags=resume_flags, start=start)
        try:
            metrics = trainer.run(stop_after_epochs)
            if trainer.best_model is not None and trainer.runtime.is_main:
                write_views_and_card(trainer)
            return metrics
        finally:
            stop_runtime(trainer.runtime)


def pretrained_start(settings: TrainSettings) -> PretrainedStart | None:
    """The weights `--init` names (None without it), read once, when a new run starts. The
    settings are checked first: a flag that cannot work is refused before any download."""
    if not settings.init:
        return None
    check_settings(settings)
    return load_init(settings.init)


def calibrate(trainer: Trainer) -> float:
    """The temperature of the best model's probabilities, fitted on this process's validation
    images (1.0 without any), written into its config.json and set on its config."""
    temperature = 1.0
    if "val" in trainer.loaders.eval_sets:
        logits, labels = validation_logits(trainer.best_model, trainer.loaders.eval_loader("val"),
                                           trainer.runtime.device)
        temperature = fit_temperature(logits, labels)
    path = trainer.out.config
    values = {**read_json(path), "temperature": temperature}
    write_text_atomically(path, json.dumps(values, indent=2, sort_keys=True))  # as save_pretrained writes it
    trainer.best_model.config.temperature = temperature
    return temperature


def write_views_and_card(trainer: Trainer) -> None:
    """What a finished run leaves besides the loop's files: the views of what its best model
    learned (measured on the validation split), a few validation images as the app's examples
    (vit_hub.data.samples) and the model card that shows them all."""
    validation = trainer.loaders.eval_sets.get("val")
    calibrate(trainer)
    views_after_training(trainer.best_model, trainer.out.folder, validation)
    if validation is not None:  # the images as they were read, before preprocessing
        write_samples(validation.dataset, trainer.plan.config.labels, trainer.out.folder)
    write_model_card(trainer.out.folder)

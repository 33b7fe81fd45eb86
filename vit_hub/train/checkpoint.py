"""What a run saves as it goes: its progress and checkpoint (what `--resume` continues from),
and the model of the epoch it keeps (`Selection`: its best on validation, or its last when the
validation split is too small to tell epochs apart).

`checkpoint.safetensors` (`layout.ModelDir.checkpoint`) holds the model's and the optimizer's
tensors, with the run's state as JSON in the same file's metadata: the settings, the config,
the epochs done and the history. No pickles: a checkpoint is read like any safetensors file.

The kept epoch's model is the model dir's `config.json` and `model.safetensors`, in the
format `vit_hub.hub.pretrained.HubVisionTransformer.save_pretrained` writes and `load_model` reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from vit_hub.layout import ModelDir
from vit_hub.model.config import ViTConfig
from vit_hub.model.vit import VisionTransformer
from vit_hub.storage import reading_safetensors, replacing, write_text_atomically
from vit_hub.train.settings import HOW_TO_RUN, TrainingError, TrainSettings, setting_flag

# Validation images a run needs to keep its best epoch by validation accuracy rather than its
# last. Accuracy on n images has a standard error of up to 50/sqrt(n) points (1.6 at 1,000, 7
# at 50, 10 at 24); the best of a run's noisy scores on a small split is an epoch that drew
# easy images, often an early one, while the last epoch of the cosine schedule is the settled
# model (BENCHMARKS.md, "Real photos over three seeds").
MIN_VAL_TO_CHOOSE = 1000
RNG_KEY = "rng"  # a checkpoint's random states (tensors named rng/cpu, rng/cuda)


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which epoch's weights a run keeps in its model dir, and why (said in the log and in
    metrics.json): `by_validation` keeps the best on validation, else the last epoch."""

    by_validation: bool
    reason: str

    @classmethod
    def for_validation(cls, images: int | None) -> "Selection":
        """The rule for a validation split of `images` images (None: no validation split, the
        training accuracy decides, as before validation existed)."""
        if images is None:
            return cls(True, "the best epoch by training accuracy (no validation split)")
        if images >= MIN_VAL_TO_CHOOSE:
            return cls(True, f"the best epoch by validation accuracy ({images:,} validation images)")
        return cls(False, f"the last epoch: {images:,} validation images are too few to choose an epoch by "
                          f"(accuracy moves in steps of {100 / max(1, images):.1f} points; fewer than "
                          f"{MIN_VAL_TO_CHOOSE:,}, give a larger --val-split or a val/ folder to choose by it)")


@dataclasses.dataclass
class Progress:
    """How far a run has come: epochs done, their records, the best epoch's scores, and the
    epoch whose weights are kept (`selection`: the best one, or every new one)."""

    epochs_done: int = 0
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    best_accuracy: float = -1.0
    best_loss: float = math.inf
    kept_epoch: int = 0
    selection: Selection = Selection(True, "the best epoch")
    # A streamed run checkpointed within an epoch: the steps done of the next epoch, the loss
    # sum, correct and seen so far over every process, and the random state of dropout then.
    step_in_epoch: int = 0
    epoch_sums: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0, 0.0])
    rng: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    stream_layout: list[int] | None = None  # [processes, loader workers]: what cut the epoch's batches

    def add(self, record: dict[str, Any]) -> bool:
        """Record an epoch; True when it is the best so far (validation accuracy, else training).
        Ties go to the lower loss: a small validation split reaches 100 % long before the
        model is done, and the first epoch to reach it is rarely the best one. The epoch is
        kept (`kept_epoch`) when it is the best and the selection is by validation, or always
        when it is not."""
        self.history.append(record)
        self.epochs_done = record["epoch"]
        self.within(0, [0.0, 0.0, 0.0], {}, None)
        accuracy = record.get("val_accuracy", record["train_accuracy"])
        loss = record.get("val_loss", record["train_loss"])
        improved = (accuracy, -loss) > (self.best_accuracy, -self.best_loss)
        if improved:
            self.best_accuracy, self.best_loss = accuracy, loss
        if improved or not self.selection.by_validation:
            self.kept_epoch = self.epochs_done
        return improved

    def within(self, steps: int, sums: list[float], rng: dict[str, torch.Tensor], layout: list[int] | None) -> None:
        """Record `steps` steps done of the epoch after `epochs_done` (0: at its start)."""
        self.step_in_epoch, self.epoch_sums, self.rng, self.stream_layout = steps, sums, rng, layout

    def kept(self) -> dict[str, Any]:
        """Which weights the model dir holds and why, for metrics.json and the log."""
        return {"epoch": self.kept_epoch, "by_validation": self.selection.by_validation,
                "reason": self.selection.reason}

    def state(self) -> dict[str, Any]:
        """The checkpoint's record of the progress (JSON-native)."""
        return {"epoch": self.epochs_done, "history": self.history, "best_accuracy": self.best_accuracy,
                "best_loss": self.best_loss, "kept_epoch": self.kept_epoch, "step_in_epoch": self.step_in_epoch,
                "epoch_sums": self.epoch_sums, "stream_layout": self.stream_layout}

    @classmethod
    def from_state(cls, state: dict[str, Any], selection: Selection) -> "Progress":
        """The progress a checkpoint's state records (`load_checkpoint`'s, with its random state)."""
        return cls(state["epoch"], state["history"], state["best_accuracy"], state.get("best_loss", math.inf),
                   state.get("kept_epoch", 0), selection, state.get("step_in_epoch", 0),
                   state.get("epoch_sums", [0.0, 0.0, 0.0]), state.get(RNG_KEY, {}), state.get("stream_layout"))


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], rng: dict[str, torch.Tensor] | None = None) -> None:
    """Model + optimizer tensors in safetensors, everything else as JSON metadata in the
    same file (`rng`: random states, for a checkpoint within an epoch). Written to a temporary
    name, flushed to disk, then renamed (`replacing`): a kill or a crash never leaves half a file."""
    tensors = {f"model/{name}": value.contiguous() for name, value in model.state_dict().items()}
    tensors.update({f"{RNG_KEY}/{name}": value for name, value in (rng or {}).items()})
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
    """Put the checkpoint's tensors back into `model` and `optimizer`; returns its JSON state,
    with the random states it holds under RNG_KEY."""
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
    rng = {key.split("/", 1)[1]: value for key, value in tensors.items() if key.startswith(f"{RNG_KEY}/")}
    return json.loads(metadata["state"]) | ({RNG_KEY: rng} if rng else {})


def read_checkpoint_state(out: Path) -> dict[str, Any]:
    """The JSON part of the checkpoint of the run in `out` (settings, config, epoch, history)."""
    path = ModelDir(out).checkpoint
    if not path.is_file():
        raise TrainingError(f"--resume: expected a checkpoint at {path}, found none")
    return json.loads(_checkpoint_metadata(path)["state"])


def _checkpoint_metadata(path: Path) -> dict[str, str]:
    """A checkpoint's metadata; one line if the file is damaged or not a vit_hub checkpoint."""
    with reading_safetensors(path), safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if not {"state", "param_groups"} <= set(metadata):
        raise TrainingError(f"expected a vit_hub training checkpoint at {path}, found a safetensors file "
                            f"without a run's state (metadata keys {sorted(metadata)})")
    return metadata


# The kept epoch's model -----------------------------------------------------------------------
def save_kept_model(model: VisionTransformer, out: ModelDir) -> None:
    """The model's weights and config into the model dir, each written beside its file and
    moved in (`replacing`), weights first: a kill leaves the previous model, or the new
    weights beside the config they share (every epoch of a run has one architecture).
    The config is `ViTConfig.to_dict()` as sorted JSON (`save_kept_config`)."""
    with replacing(out.weights) as partial:
        save_model(model, str(partial))
    save_kept_config(model.config, out)


def save_kept_config(config: ViTConfig, out: ModelDir) -> None:
    """The kept model's config.json, replaced whole (as the Hub mixin writes it)."""
    write_text_atomically(out.config, json.dumps(config.to_dict(), sort_keys=True, indent=2))


def load_kept_model(config: ViTConfig, out: ModelDir, device: torch.device) -> VisionTransformer:
    """The kept epoch's weights (`save_kept_model`) read back into a model of `config` on
    `device`, in eval mode (strict: every weight, none missing or unexpected)."""
    model = VisionTransformer(config)
    with reading_safetensors(out.weights):
        load_model(model, str(out.weights), device=str(device))
    return model.to(device).eval()


# Resuming -----------------------------------------------------------------------------------
def resumed_settings(state: dict[str, Any], flags: dict[str, Any], out: Path) -> TrainSettings:
    """The checkpoint's settings for the run found in `out` (the folder it is in now, moved or
    not), with those of the flags given again that say only how the run is carried out
    (HOW_TO_RUN) applied."""
    how = {name: flags[name] for name in HOW_TO_RUN if name in flags}
    return dataclasses.replace(TrainSettings(**state["settings"]), out=str(out), **how)


def check_resume_flags(flags: dict[str, Any], resolved: dict[str, Any], settings: TrainSettings,
                       config: ViTConfig, out: Path) -> None:
    """Flags given with --resume that would change the run are refused, each named with the
    run's own value: `resolved` where the run resolved a default (its epochs, batch, learning
    rate), else its settings, and its config for model flags (under `flags["model"]`)."""
    differ = [(name, value, resolved.get(name, getattr(settings, name)))
              for name, value in flags.items() if name not in ("model", *HOW_TO_RUN)]
    differ = [(name, given, own) for name, given, own in differ if not _same_setting(name, given, own)]
    differ += [(name, given, getattr(config, name)) for name, given in flags.get("model", {}).items()
               if not _same_model_field(config, name, given)]
    if differ:
        named = ", ".join(f"{setting_flag(name)} {given} (the checkpoint's: {own})" for name, given, own in differ)
        raise TrainingError(f"--resume: expected the settings of the run in {out} (or no flags), got {named}; "
                            f"start a new run with --overwrite to change them")


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

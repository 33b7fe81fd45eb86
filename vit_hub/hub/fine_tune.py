"""Where a fine-tuning run starts: pretrained weights (`vit-hub train --init`) and the config
and weights a run on new data begins with.

`PretrainedStart` is what the training loop needs of a pretrained model: its config, its
weights under vit_hub's names, and where they came from. Finding and converting those
weights (a vit_hub model dir, a timm or transformers ViT, a folder or a Hub repo) is
`vit_hub.hub.import_model`, whose `Imported` is a `PretrainedStart`; this module only adapts them to
the new data: its labels, a new head (unless the labels are the same), positions resized to
the new image size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from vit_hub.errors import UserError
from vit_hub.model.config import ViTConfig


@dataclasses.dataclass
class PretrainedStart:
    """Pretrained weights to fine-tune from: the config, the weights under vit_hub's names, and
    where they came from."""

    config: ViTConfig
    weights: dict[str, torch.Tensor]
    source: dict[str, Any]  # written as source.json: library, architecture, licence, ...


# Fields a fine-tuning run may change; everything else is the pretrained architecture's.
FINE_TUNE_FIELDS = ("image_size", "dropout", "attention_dropout", "drop_path", "interpolation", "mean", "std",
                    "pixel_norm", "canonicalize")


def fine_tune_config(start: PretrainedStart, labels: list[str], overrides: dict[str, Any]) -> ViTConfig:
    """The pretrained config with the data's labels, no pre-logits layer (the ViT paper
    replaces the whole head when fine-tuning), and the overrides a fine-tuning run may make.
    Canonicalisation belongs to the new data, not the pretrained model's: none unless the
    run asks for it (`--canonicalize digit` to fine-tune a digit model on digits)."""
    values = {**start.config.to_dict(), "canonicalize": "none"}
    changed = {key: value for key, value in overrides.items()
               if value is not None and key not in FINE_TUNE_FIELDS and value != values.get(key)}
    if changed:
        flags = ", ".join(f"--{key.replace('_', '-')}" for key in sorted(changed))
        raise UserError(f"--init: {flags} cannot differ from the pretrained model's ({start.source['source']}); "
                         f"only {', '.join('--' + key.replace('_', '-') for key in FINE_TUNE_FIELDS)} may")
    values.update({key: value for key, value in overrides.items() if value is not None and key in FINE_TUNE_FIELDS})
    values.update(labels=labels, num_classes=None, pre_logits=0)
    return ViTConfig.from_dict(values)


def fine_tune_weights(start: PretrainedStart, config: ViTConfig) -> dict[str, torch.Tensor]:
    """The pretrained weights for `config`: body as it is, positions resized (bicubic, on the
    patch grid; the class token's position kept) when the image size differs, and a new head
    of zeros for the data's labels (the ViT paper's choice for fine-tuning: the first steps
    train the head on features that already tell images apart, without disturbing them).
    A model trained further on its own classes (`keeps_head`) keeps its head."""
    weights = {name: tensor for name, tensor in start.weights.items()
               if not name.startswith(("head.", "pre_logits."))}
    if "pos_embedding" in weights:  # learned positions (fixed sin-cos ones are rebuilt for the grid)
        weights["pos_embedding"] = resize_positions(weights["pos_embedding"], start.config.grid_size, config.grid_size)
    if keeps_head(start, config):
        weights["head.weight"], weights["head.bias"] = start.weights["head.weight"], start.weights["head.bias"]
    else:
        weights["head.weight"] = torch.zeros(config.num_classes, config.embed_dim)
        weights["head.bias"] = torch.zeros(config.num_classes)
    return weights


def keeps_head(start: PretrainedStart, config: ViTConfig) -> bool:
    """Whether the pretrained head already answers the data's question: the same labels in the
    same order, read straight from the pooled token (no pre-logits layer)."""
    return (list(start.config.labels) == list(config.labels) and start.config.pre_logits == 0
            and {"head.weight", "head.bias"} <= start.weights.keys())


def resize_positions(positions: torch.Tensor, old_grid: tuple[int, int], new_grid: tuple[int, int]) -> torch.Tensor:
    """Patch positions [1, h*w, D] -> [1, H*W, D], bicubic on the grid, antialiased as timm
    resizes them when fine-tuning at another resolution (the same numbers as timm's
    resample_abs_pos_embed)."""
    if tuple(old_grid) == tuple(new_grid):
        return positions
    grid = positions.reshape(1, *old_grid, -1).permute(0, 3, 1, 2)  # [1, D, h, w]
    grid = F.interpolate(grid, size=tuple(new_grid), mode="bicubic", align_corners=False, antialias=True)
    return grid.flatten(2).transpose(1, 2).contiguous()


def describe(source: dict[str, Any]) -> str:
    """'timm vit_tiny_patch16_224.augreg_in21k_ft_in1k from timm/vit_tiny..., licence apache-2.0'."""
    licence = source.get("license") or "not stated by the source"
    return f"{source['library']} {source['architecture']} from {source['source']} (licence: {licence})"

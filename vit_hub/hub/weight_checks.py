"""Checking weights before a model is built from them: the one job of this module.

A model dir, a pulled repo and an imported checkpoint are untrusted input. Before anything is
allocated at full size, the name and shape of every weight a config implies (vit.py built on
the meta device) are compared with the safetensors header (read alone, its size bounded), and
the attention maps one image would need are compared with the weights' size: a 19 KB file
cannot ask for gigabytes. Once read, weights holding NaN or infinities are refused. Every
refusal is a one-line `WeightsError`.

Loading (`vit_hub.hub.pretrained`), pulling (`vit_hub.hub.repos`) and importing (`vit_hub.hub.import_model`)
all check through here; nothing here touches the Hub.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from vit_hub.errors import UserError
from vit_hub.model import vit as model
from vit_hub.model.config import ViTConfig
from vit_hub.storage import HEADER_LENGTH_BYTES, reading_safetensors

# A safetensors header is JSON of about 100 bytes a tensor: a depth-512 model's is under 1 MiB.
MAX_HEADER_BYTES = 16 * 2**20
# One image's attention maps (depth x heads x T x T float32: what output_attentions returns and
# the app draws) may take ATTENTION_PER_WEIGHT_BYTE times the weights' size, or
# MIN_ATTENTION_BYTES where that is more. Real models stay far below (by their shapes: ViT-B/16
# at 384 px needs 0.6x its weights, DINOv2-L/14 at 518 px 2.4x, the bundled MNIST model 0.2x);
# a 19 KB model asking for 64x64 patches (256 MiB: sin-cos positions store nothing that grows
# with the image) does not.
MIN_ATTENTION_BYTES = 128 * 2**20
ATTENTION_PER_WEIGHT_BYTE = 64


class WeightsError(UserError):
    """Weights that do not fit their config, or that no model should hold; said in one line."""


class _Unallocated(model.VisionTransformer):
    """model.VisionTransformer built for its shapes alone, on the meta device: nothing to initialise."""

    def _init_weights(self) -> None:
        pass


def expected_shapes(config: ViTConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a model of `config` stores, as vit.py builds it: on the
    meta device, which allocates no storage. Fixed sin-cos positions are computed, never stored,
    so the model is built with learned ones and their table left out (building the sin-cos
    table on the meta device would import torch's compiler, which costs a second a load)."""
    with torch.device("meta"):
        shapes = _Unallocated(**dataclasses.replace(config, pos_embedding="learned").to_dict()).state_dict()
    if config.pos_embedding != "learned":
        shapes.pop("pos_embedding")
    return {name: tuple(tensor.shape) for name, tensor in shapes.items()}


def stored_shapes(weights: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a safetensors file, from its header alone (JSON of at most
    MAX_HEADER_BYTES; safetensors checks that the shapes it declares fill the file exactly), by
    the names vit.py uses today (older checkpoints' names upgraded: `vit.upgrade_state_dict`)."""
    with reading_safetensors(weights):
        with open(weights, "rb") as handle:
            header_bytes = struct.unpack("<Q", handle.read(HEADER_LENGTH_BYTES))[0]
        if header_bytes > MAX_HEADER_BYTES:
            raise WeightsError(f"expected a safetensors header of at most {MAX_HEADER_BYTES // 2**20} MiB in "
                               f"{weights}, found one of {header_bytes:,} bytes")
        with safe_open(str(weights), framework="pt") as handle:
            return model.upgrade_state_dict({name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()})


def compare_shapes(expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]], where: str,
                   strict: bool = True) -> None:
    """A WeightsError when a weight has another shape than the config implies, or (when
    `strict`) one is missing or unexpected. `where` starts the message ("weights in PATH")."""
    wrong = [name for name in expected if name in found and tuple(found[name]) != tuple(expected[name])]
    if wrong:
        others = f" (and {len(wrong) - 1} more of another shape)" if len(wrong) > 1 else ""
        raise WeightsError(f"{where} do not match the config: expected {wrong[0]} of shape "
                           f"{list(expected[wrong[0]])}, found {list(found[wrong[0]])}{others}")
    missing = [name for name in expected if name not in found]
    unexpected = [name for name in found if name not in expected]
    if strict and (missing or unexpected):
        raise WeightsError(f"{where} do not match the config: expected its {len(expected)} weights, found "
                           f"missing {_few(missing)}, unexpected {_few(unexpected)}")


def _few(names: list[str], shown: int = 4) -> str:
    """"['a', 'b']" or "['a', 'b', 'c', 'd'] and 96 more": a message stays one line."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{names[:shown]}{more}"


def check_attention_size(config: ViTConfig, weight_bytes: int, where: str) -> None:
    """A WeightsError when one image's attention maps would be absurd for weights of
    `weight_bytes` (see ATTENTION_PER_WEIGHT_BYTE)."""
    attention_bytes = config.depth * config.num_heads * config.num_tokens**2 * 4
    limit = max(MIN_ATTENTION_BYTES, ATTENTION_PER_WEIGHT_BYTE * weight_bytes)
    if attention_bytes > limit:
        raise WeightsError(f"{where}: expected a config whose attention maps for one image fit "
                           f"{limit / 2**20:,.0f} MiB for {weight_bytes / 2**20:,.2f} MiB of weights, found "
                           f"{config.num_tokens:,} tokens (image_size {config.image_size}, patch_size "
                           f"{config.patch_size}): {attention_bytes / 2**20:,.0f} MiB")


def check_weights_fit(config: ViTConfig, weights: str | Path, strict: bool = True, name: str | None = None) -> None:
    """Before a model of `config` is built: the weights file holds exactly the tensors the config
    implies (names and shapes, from its header alone), and one image's attention maps are not
    absurd for weights that size. A WeightsError otherwise; `name` calls the file in it."""
    where = f"weights in {name or weights}"
    compare_shapes(expected_shapes(config), stored_shapes(weights), where, strict)
    check_attention_size(config, os.path.getsize(weights), where)


def check_finite(tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """A WeightsError naming the first tensor holding NaN or an infinity."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            found = "NaN" if bool(torch.isnan(tensor).any()) else "an infinity"
            raise WeightsError(f"{where}: expected finite numbers, found {found} in {name}")

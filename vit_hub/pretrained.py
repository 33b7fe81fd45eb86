"""Saving and loading models: the `VisionTransformer` of model.py with the Hub mixin's
`save_pretrained`, `from_pretrained` and `push_to_hub`, and `load_model`.

model.py stays pure `nn` code; everything here touches files or the Hub. Loading is
strict (every weight present, none unexpected) and reads safetensors only, never a
pickle. A model dir is untrusted input: before anything is built, the name and shape of
every weight its config implies are compared with the safetensors header (read alone,
nothing allocated), and weights that are not finite are refused. Saving is safe to
interrupt: a kill at any moment leaves the previous model or the new one.

    model = load_model("models/vit-mnist")                   # a folder or a Hub repo id
    model = VisionTransformer.from_pretrained("you/vit-mnist")
    model.save_pretrained("runs/copy")
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from huggingface_hub import PyTorchModelHubMixin, hf_hub_download
from safetensors import safe_open

from . import model
from .config import ViTConfig
from .hub import check_config, fetch_repo, resolve_model_dir
from .storage import HEADER_LENGTH_BYTES, reading_safetensors, replace_files

SAVE_STAGING = ".saving"  # folder inside a model dir that save_pretrained writes before moving files in
WEIGHTS = "model.safetensors"
# A safetensors header is JSON of about 100 bytes a tensor: a depth-512 model's is under 1 MiB.
MAX_HEADER_BYTES = 16 * 2**20
# One image's attention maps (depth x heads x T x T float32: what output_attentions returns and
# the app draws) may take ATTENTION_PER_WEIGHT_BYTE times the weights' size, or
# MIN_ATTENTION_BYTES where that is more. Real models stay far below: ViT-B/16 at 384 px 0.6x,
# DINOv2-L/14 at 518 px 2.4x, the bundled MNIST model 0.2x; a 19 KB model asking for 64x64
# patches (256 MiB: sin-cos positions store nothing that grows with the image) does not.
MIN_ATTENTION_BYTES = 128 * 2**20
ATTENTION_PER_WEIGHT_BYTE = 64


def load_model(reference: str | Path, revision: str | None = None, device: str = "cpu",
               token: str | None = None) -> "VisionTransformer":
    """A model dir (config.json + model.safetensors) or a Hub repo id -> model in eval mode."""
    model_dir = resolve_model_dir(reference, revision, token)
    return VisionTransformer.from_pretrained(model_dir, map_location=device).to(device).eval()


class VisionTransformer(
    model.VisionTransformer,
    PyTorchModelHubMixin,
    library_name="vit_hub",
    pipeline_tag="image-classification",
    tags=["vit_hub", "vision-transformer", "image-classification", "pytorch"],
):
    """model.VisionTransformer, savable and loadable: config.json holds `ViTConfig.to_dict()`
    (every field, defaults included), model.safetensors the weights."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._hub_mixin_config = self.config.to_dict()  # what save_pretrained writes to config.json

    def save_pretrained(self, save_directory: str | Path, **kwargs: Any) -> str | None:
        """The mixin's save_pretrained (same arguments), made safe to interrupt.

        The mixin deletes config.json first and rewrites the weights in place, so a kill
        mid-save left a folder without a config. Here everything is written into a staging
        folder inside `save_directory` and moved in with os.replace, weights first: a crash
        or kill at any moment leaves the previous model or the new one. (Between the two
        renames the new weights sit beside the old config.json; they are the same file when a
        training run saves its best epoch, and a different architecture fails to load.)
        """
        target = Path(save_directory)
        staging = target / SAVE_STAGING
        shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
        result = super().save_pretrained(staging, **kwargs)
        keep_card = (target / "README.md").exists()  # as the mixin: an existing card is kept
        replace_files(staging, target, [WEIGHTS, "config.json"] + ([] if keep_card else ["README.md"]))
        shutil.rmtree(staging)
        return result

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path, **kwargs: Any) -> "VisionTransformer":
        """The mixin's `from_pretrained`, same arguments. A Hub repo id (with at most `revision`
        and `token`) is fetched as `load_model` fetches it: HF_ENDPOINT read now, the config
        checked before the weights, and problems (offline, no network, unknown repo) raised as
        one-line `vit_hub.hub.HubError`s."""
        reference = str(pretrained_model_name_or_path)
        if os.path.isfile(os.path.join(reference, "config.json")):  # checked before the mixin parses it
            check_config(Path(reference) / "config.json", reference)
        if os.path.isdir(reference) or set(kwargs) - {"revision", "token", "map_location", "strict"}:
            return super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        folder = fetch_repo(reference, kwargs.pop("revision", None), kwargs.pop("token", None))
        return super().from_pretrained(str(folder), **kwargs)

    @classmethod
    def _from_pretrained(cls, *, model_id: str, revision, cache_dir, force_download,
                         local_files_only, token, map_location: str = "cpu", strict: bool = True,
                         **model_kwargs):
        """Called by `from_pretrained` once config.json has been read."""
        if not model_kwargs:
            raise ValueError(f"{model_id} has no vit_hub config.json (expected one beside {WEIGHTS})")
        config = ViTConfig.from_dict(model_kwargs)
        if os.path.isdir(model_id):
            weights = os.path.join(model_id, WEIGHTS)
            if not os.path.isfile(weights):
                raise FileNotFoundError(f"expected weights at {weights}, found nothing")
        else:
            weights = hf_hub_download(
                repo_id=model_id, filename=WEIGHTS, revision=revision, cache_dir=cache_dir,
                force_download=force_download, token=token, local_files_only=local_files_only,
            )
        check_weights_fit(config, weights, strict)  # before the model is built at full size
        loaded = cls(**model_kwargs)
        load_weights(loaded, weights, map_location, strict)
        return loaded.eval()


# Checking weights before anything is allocated ---------------------------------------------------
class _Unallocated(model.VisionTransformer):
    """model.VisionTransformer built for its shapes alone, on the meta device: nothing to initialise."""

    def _init_weights(self) -> None:
        pass


def expected_shapes(config: ViTConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a model of `config` stores, as model.py builds it: on the
    meta device, which allocates no storage. Fixed sin-cos positions are computed, never stored,
    so the model is built with learned ones and their table left out (the sin-cos table on
    the meta device would import torch's compiler: a second per load)."""
    with torch.device("meta"):
        shapes = _Unallocated(**dataclasses.replace(config, pos_embedding="learned").to_dict()).state_dict()
    if config.pos_embedding != "learned":
        shapes.pop("pos_embedding")
    return {name: tuple(tensor.shape) for name, tensor in shapes.items()}


def stored_shapes(weights: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a safetensors file, from its header alone (JSON of at most
    MAX_HEADER_BYTES; safetensors checks that the shapes it declares fill the file exactly), by
    the names model.py uses today (older checkpoints' names upgraded: `model.upgrade_state_dict`)."""
    with reading_safetensors(weights):
        with open(weights, "rb") as handle:
            header_bytes = struct.unpack("<Q", handle.read(HEADER_LENGTH_BYTES))[0]
        if header_bytes > MAX_HEADER_BYTES:
            raise ValueError(f"expected a safetensors header of at most {MAX_HEADER_BYTES // 2**20} MiB in {weights}, "
                             f"found one of {header_bytes:,} bytes")
        with safe_open(str(weights), framework="pt") as handle:
            return model.upgrade_state_dict({name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()})


def compare_shapes(expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]], where: str,
                   strict: bool = True) -> None:
    """A one-line ValueError when a weight has another shape than the config implies, or (when
    `strict`) one is missing or unexpected. `where` starts the message ("weights in PATH")."""
    wrong = [name for name in expected if name in found and tuple(found[name]) != tuple(expected[name])]
    if wrong:
        others = f" (and {len(wrong) - 1} more of another shape)" if len(wrong) > 1 else ""
        raise ValueError(f"{where} do not match the config: expected {wrong[0]} of shape {list(expected[wrong[0]])}, "
                         f"found {list(found[wrong[0]])}{others}")
    missing = [name for name in expected if name not in found]
    unexpected = [name for name in found if name not in expected]
    if strict and (missing or unexpected):
        raise ValueError(f"{where} do not match the config: expected its {len(expected)} weights, found "
                         f"missing {_few(missing)}, unexpected {_few(unexpected)}")


def _few(names: list[str], shown: int = 4) -> str:
    """"['a', 'b']" or "['a', 'b', 'c', 'd'] and 96 more": a message stays one line."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{names[:shown]}{more}"


def check_attention_size(config: ViTConfig, weight_bytes: int, where: str) -> None:
    """A one-line ValueError when one image's attention maps would be absurd for weights of
    `weight_bytes` (see ATTENTION_PER_WEIGHT_BYTE)."""
    attention_bytes = config.depth * config.num_heads * config.num_tokens**2 * 4
    limit = max(MIN_ATTENTION_BYTES, ATTENTION_PER_WEIGHT_BYTE * weight_bytes)
    if attention_bytes > limit:
        raise ValueError(f"{where}: expected a config whose attention maps for one image fit {limit / 2**20:,.0f} MiB "
                         f"for {weight_bytes / 2**20:,.2f} MiB of weights, found {config.num_tokens:,} tokens "
                         f"(image_size {config.image_size}, patch_size {config.patch_size}): "
                         f"{attention_bytes / 2**20:,.0f} MiB")


def check_weights_fit(config: ViTConfig, weights: str | Path, strict: bool = True, name: str | None = None) -> None:
    """Before a model of `config` is built: the weights file holds exactly the tensors the config
    implies (names and shapes, from its header alone), and one image's attention maps are not
    absurd for weights that size. One-line ValueError otherwise; `name` calls the file in it."""
    where = f"weights in {name or weights}"
    compare_shapes(expected_shapes(config), stored_shapes(weights), where, strict)
    check_attention_size(config, os.path.getsize(weights), where)


def check_finite(tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """A one-line ValueError naming the first tensor holding NaN or an infinity."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            found = "NaN" if bool(torch.isnan(tensor).any()) else "an infinity"
            raise ValueError(f"{where}: expected finite numbers, found {found} in {name}")


def load_weights(into: model.VisionTransformer, weights: str | Path, device: str = "cpu", strict: bool = True) -> None:
    """Read a safetensors file into the model; a damaged file, one that does not fit the model
    or one holding NaN or infinities raises a one-line ValueError."""
    where = f"weights in {weights}"
    compare_shapes({name: tuple(tensor.shape) for name, tensor in into.state_dict().items()},
                   stored_shapes(weights), where, strict)
    with reading_safetensors(weights):  # damaged, unreadable or not safetensors: one line
        safetensors.torch.load_model(into, weights, strict=False, device=device)
    check_finite(into.state_dict(), where)

"""Saving and loading models: the `VisionTransformer` of model.py with the Hub mixin's
`save_pretrained`, `from_pretrained` and `push_to_hub`, and `load_model`.

model.py stays pure `nn` code; everything here touches files or the Hub. Loading is
strict (every weight present, none unexpected) and reads safetensors only, never a
pickle. Saving is safe to interrupt: a kill at any moment leaves the previous model or
the new one.

    model = load_model("models/vit-mnist")                   # a folder or a Hub repo id
    model = VisionTransformer.from_pretrained("you/vit-mnist")
    model.save_pretrained("runs/copy")
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
from huggingface_hub import PyTorchModelHubMixin, hf_hub_download

from . import model
from .hub import fetch_repo, resolve_model_dir
from .storage import reading_safetensors, replace_files

SAVE_STAGING = ".saving"  # folder inside a model dir that save_pretrained writes before moving files in
WEIGHTS = "model.safetensors"


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
        loaded = cls(**model_kwargs)
        if os.path.isdir(model_id):
            weights = os.path.join(model_id, WEIGHTS)
            if not os.path.isfile(weights):
                raise FileNotFoundError(f"expected weights at {weights}, found nothing")
        else:
            weights = hf_hub_download(
                repo_id=model_id, filename=WEIGHTS, revision=revision, cache_dir=cache_dir,
                force_download=force_download, token=token, local_files_only=local_files_only,
            )
        load_weights(loaded, weights, map_location, strict)
        return loaded.eval()


def load_weights(into: model.VisionTransformer, weights: str | Path, device: str = "cpu", strict: bool = True) -> None:
    """Read a safetensors file into the model; a damaged file or one that does not fit the
    config raises a one-line ValueError."""
    try:
        with reading_safetensors(weights):  # damaged, unreadable or not safetensors: one line
            missing, unexpected = safetensors.torch.load_model(into, weights, strict=False, device=device)
    except RuntimeError as error:  # a weight whose shape differs from the config's
        raise ValueError(f"weights in {weights} do not match the config: {_first_line(error)}") from None
    if strict and (missing or unexpected):
        raise ValueError(
            f"weights in {weights} do not match the config: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )


def _first_line(error: Exception) -> str:
    """torch's load errors span many lines; the first mismatch is enough for one line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if "size mismatch" in line), lines[0] if lines else repr(error))

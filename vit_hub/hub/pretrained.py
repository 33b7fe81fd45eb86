"""Saving, loading and using models: `HubVisionTransformer`, the `VisionTransformer` of
`vit_hub/model/vit.py` with the Hub mixin's `save_pretrained`, `from_pretrained` and
`push_to_hub` (the package exports it as `vit_hub.VisionTransformer`), `load_model`, and
`predict_images`, which classifies images with a loaded model.

`vit.py` stays pure `nn` code; everything here touches files or the Hub. Loading is
strict (every weight present, none unexpected) and reads safetensors only, never a
pickle. A model dir is untrusted input: before anything is built, its weights are checked
against its config (`vit_hub.hub.weight_checks`: names and shapes from the safetensors header,
nothing allocated), and weights that are not finite are refused. Saving is safe to
interrupt: a kill at any moment leaves the previous model or the new one.

    model = load_model("models/vit-mnist")                   # a folder or a Hub repo id
    model = HubVisionTransformer.from_pretrained("you/vit-mnist")
    model.save_pretrained("runs/copy")
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from huggingface_hub import PyTorchModelHubMixin, hf_hub_download

from vit_hub.errors import UserError
from vit_hub.hub.card import LIBRARY_NAME, MODEL_TAGS, PIPELINE_TAG
from vit_hub.hub.repos import check_config, fetch_repo, resolve_model_dir
from vit_hub.hub.weight_checks import check_finite, check_weights_fit, compare_shapes, stored_shapes
from vit_hub.layout import ModelDir
from vit_hub.model import vit
from vit_hub.model.config import ViTConfig
from vit_hub.processing.postprocess import softmax
from vit_hub.processing.postprocess import top_k as rank_top_k
from vit_hub.processing.preprocess import ImageInput, preprocess_batch
from vit_hub.storage import reading_safetensors, replace_files

SAVE_STAGING = ".saving"  # folder inside a model dir that save_pretrained writes before moving files in


def load_model(reference: str | Path, revision: str | None = None, device: str = "cpu",
               token: str | None = None) -> "HubVisionTransformer":
    """A model dir (config.json + model.safetensors) or a Hub repo id -> model in eval mode."""
    model_dir = resolve_model_dir(reference, revision, token)
    return HubVisionTransformer.from_pretrained(model_dir, map_location=device).to(device).eval()


class HubVisionTransformer(
    vit.VisionTransformer,
    PyTorchModelHubMixin,
    library_name=LIBRARY_NAME,
    pipeline_tag=PIPELINE_TAG,
    tags=list(MODEL_TAGS),
):
    """vit.VisionTransformer, savable and loadable: config.json holds `ViTConfig.to_dict()`
    (every field, defaults included), model.safetensors the weights."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._hub_mixin_config = self.config.to_dict()  # what save_pretrained writes to config.json

    def save_pretrained(self, save_directory: str | Path, **kwargs: Any) -> str | None:
        """The mixin's save_pretrained (same arguments), made safe to interrupt.

        The mixin deletes config.json first and rewrites the weights in place, so a kill
        mid-save would leave a folder without a config. Here everything is written into a staging
        folder inside `save_directory` and moved in with os.replace, weights first: a crash
        or kill at any moment leaves the previous model or the new one. (Between the two
        renames the new weights sit beside the old config.json; they are the same file when a
        training run saves its best epoch, and a different architecture fails to load.)
        """
        target = Path(save_directory)
        staging = target / SAVE_STAGING
        shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
        result = super().save_pretrained(staging, **kwargs)
        keep_card = ModelDir(target).card.exists()  # as the mixin: an existing card is kept
        replace_files(staging, target, [ModelDir.weights, ModelDir.config] + ([] if keep_card else [ModelDir.card]))
        shutil.rmtree(staging)
        return result

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path, **kwargs: Any) -> "HubVisionTransformer":
        """The mixin's `from_pretrained`, same arguments. A Hub repo id (with at most `revision`
        and `token`) is fetched as `load_model` fetches it: HF_ENDPOINT read now, the config
        checked before the weights, and problems (offline, no network, unknown repo) raised as
        one-line `vit_hub.hub.repos.HubError`s."""
        reference = str(pretrained_model_name_or_path)
        if ModelDir(reference).config.is_file():  # checked before the mixin parses it
            check_config(ModelDir(reference).config, reference)
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
            raise UserError(f"{model_id} has no vit_hub {ModelDir.config} (expected one beside {ModelDir.weights})")
        config = ViTConfig.from_dict(model_kwargs)
        if os.path.isdir(model_id):
            weights = os.path.join(model_id, ModelDir.weights)
            if not os.path.isfile(weights):
                raise FileNotFoundError(f"expected weights at {weights}, found nothing")
        else:
            weights = hf_hub_download(
                repo_id=model_id, filename=ModelDir.weights, revision=revision, cache_dir=cache_dir,
                force_download=force_download, token=token, local_files_only=local_files_only,
            )
        check_weights_fit(config, weights, strict)  # before the model is built at full size
        loaded = cls(**model_kwargs)
        load_weights(loaded, weights, map_location, strict)
        return loaded.eval()


# Reading weights into a model ----------------------------------------------------------------
def load_weights(into: vit.VisionTransformer, weights: str | Path, device: str = "cpu", strict: bool = True) -> None:
    """Read a safetensors file into the model; a damaged file, one that does not fit the model
    or one holding NaN or infinities raises a one-line error (a UserError)."""
    where = f"weights in {weights}"
    compare_shapes({name: tuple(tensor.shape) for name, tensor in into.state_dict().items()},
                   stored_shapes(weights), where, strict)
    with reading_safetensors(weights):  # damaged, unreadable or not safetensors: one line
        safetensors.torch.load_model(into, weights, strict=False, device=device)
    check_finite(into.state_dict(), where)


@torch.no_grad()
def predict_images(model: vit.VisionTransformer, images: list[ImageInput], top_k: int = 5,
                   batch_size: int = 64) -> list[list[tuple[str, float]]]:
    """Top-k predictions for each image, preprocessed exactly as the config says."""
    model.config.check_has_head("predict")
    model.eval()
    device = next(model.parameters()).device
    results = []
    for start in range(0, len(images), batch_size):
        pixels = torch.from_numpy(preprocess_batch(images[start:start + batch_size], model.config))
        logits = model(pixels.to(device)).logits.float().cpu().numpy()
        probabilities = softmax(logits, model.config.temperature)
        results += rank_top_k(probabilities, model.config.labels, top_k)
    return results

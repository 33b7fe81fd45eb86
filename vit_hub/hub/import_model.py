"""Pretrained ViTs from timm and transformers, converted exactly into vit_hub models.

    vit-hub import timm/vit_base_patch16_224.augreg2_in21k_ft_in1k --out models/vit-base
    vit-hub train --init google/vit-base-patch16-224-in21k --data path/to/folder --out runs/pets

SRC, a Hub repo id or a local folder, holds config.json and model.safetensors as one of
these libraries publishes them:
  * timm (`timm/vit_*` repos): config.json names the `architecture` and carries the
    `pretrained_cfg` (input size, mean/std, interpolation); the weights are timm's own names;
  * transformers (`model_type: "vit"`): a ViTForImageClassification (labels in `id2label`)
    or a ViTModel (no head: the model returns its features; its pooler, when it has one, is
    the pre-logits layer); preprocessing from preprocessor_config.json;
  * vit_hub itself (only as a `--init` source).
Only safetensors are read: a pickle (pytorch_model.bin) can run code when loaded.

Nothing here imports timm or transformers. The conversion itself (names and shapes onto
vit_hub's, and what is refused) is `vit_hub.hub.key_mapping`; this module finds the files, checks
the result, records where it came from and writes the model dir (or, for `--init`, hands the
weights to training, which adapts them to its data: `vit_hub.hub.fine_tune`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from vit_hub.errors import UserError
from vit_hub.hub.fine_tune import PretrainedStart
from vit_hub.hub.key_mapping import ImportRefused, convert_timm, convert_transformers
from vit_hub.hub.pretrained import HubVisionTransformer
from vit_hub.hub.repos import check_model_dir, fetch_file, has_file
from vit_hub.hub.weight_checks import (WeightsError, check_attention_size, check_finite, check_weights_fit,
                                       compare_shapes, expected_shapes, stored_shapes)
from vit_hub.layout import ModelDir
from vit_hub.model.config import ViTConfig, size_text
from vit_hub.model.fields import read_json
from vit_hub.storage import read_card, reading_safetensors

PREPROCESSOR = "preprocessor_config.json"  # transformers' image processor: mean, std, resampling
PICKLE_WEIGHTS = ("pytorch_model.bin", "model.pt", "pytorch_model.bin.index.json")
SOURCE_FLAG = "SRC"
WHAT = "a ViT that vit-hub import reads (a timm/vit_* or transformers ViT model)"


class Imported(PretrainedStart):
    """A converted model: the vit_hub config, its weights under vit_hub's names, and where they came from."""

    def model(self):
        """The vit_hub model with these weights (strict: every weight used, none missing), in eval mode."""
        model = HubVisionTransformer(**self.config.to_dict())
        model.load_state_dict(self.weights, strict=True)
        return model.eval()


# Finding the files ---------------------------------------------------------------------------
@dataclasses.dataclass
class SourceFiles:
    reference: str
    folder: Path  # local folder, or the Hub cache's snapshot
    config: dict[str, Any]
    hub: bool
    revision: str | None = None  # the commit a Hub snapshot came from


def read_source(reference: str | Path, revision: str | None = None, token: str | None = None) -> SourceFiles:
    """SRC's config.json (fetched first: a repo that is not a ViT fails before its weights
    download), then its weights and the small files the conversion reads."""
    reference = str(reference)
    path = Path(reference)
    if path.is_dir():
        config_path = ModelDir(path).config
        if not config_path.is_file():
            raise FileNotFoundError(f"{SOURCE_FLAG} {reference}: expected {ModelDir.config} in the folder, found none")
        files = SourceFiles(reference, path, _read_json(config_path), hub=False)
    elif path.exists():
        raise ImportRefused(f"{SOURCE_FLAG}: expected a model folder or a Hub repo id, got the file {reference}")
    else:
        config_path = fetch_file(reference, ModelDir.config, revision, token, what=WHAT, flag=SOURCE_FLAG)
        snapshot = config_path.parent
        files = SourceFiles(reference, snapshot, _read_json(config_path), hub=True,
                            revision=snapshot.name if re.fullmatch(r"[0-9a-f]{40}", snapshot.name) else revision)
    library = identify(files.config, reference)
    weights = _fetch(files, ModelDir.weights, revision, token)
    if weights is None:
        if any(_has(files, name, revision, token) for name in PICKLE_WEIGHTS):
            raise ImportRefused(f"{reference} has its weights only as a pickle (pytorch_model.bin), which can run "
                                f"code when loaded; vit_hub reads model.safetensors only (the Hub's safetensors "
                                f"conversion, or a save with safe_serialization=True, gives one)")
        if _has(files, f"{ModelDir.weights}.index.json", revision, token):
            raise ImportRefused(f"{reference} has its weights in shards (model.safetensors.index.json); vit-hub import "
                                f"reads one model.safetensors")
        raise ImportRefused(f"{reference}: expected {ModelDir.weights} beside {ModelDir.config}, found none")
    for name in (PREPROCESSOR, ModelDir.card) if library == "transformers" else (ModelDir.card,):  # card: licence
        _fetch(files, name, revision, token)
    return files


def _fetch(files: SourceFiles, name: str, revision: str | None, token: str | None) -> Path | None:
    if not files.hub:
        return files.folder / name if (files.folder / name).is_file() else None
    return fetch_file(files.reference, name, revision, token, required=False, flag=SOURCE_FLAG)


def _has(files: SourceFiles, name: str, revision: str | None, token: str | None) -> bool:
    if not files.hub:
        return (files.folder / name).is_file()
    return has_file(files.reference, name, revision, token)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        values = read_json(path)
    except UserError as error:  # not JSON, too large, or nested too deep
        raise ImportRefused(str(error)) from None
    if not isinstance(values, dict):
        raise ImportRefused(f"{path}: expected a JSON object, found {type(values).__name__}")
    return values


def identify(config: dict[str, Any], reference: str) -> str:
    """'timm', 'transformers' or 'vit_hub' from config.json, or one line saying what it is instead."""
    if "embed_dim" in config and "patch_size" in config and "architecture" not in config:
        return "vit_hub"
    if "architecture" in config:
        architecture = str(config["architecture"])
        if not architecture.startswith("vit_"):
            raise ImportRefused(f"{reference} is timm's {architecture}, not one of its ViTs: vit-hub import reads "
                                f"timm's vit_* models")
        if "pretrained_cfg" not in config:
            raise ImportRefused(f"{reference}: timm's config.json has no pretrained_cfg (input size, mean/std); "
                                f"save it with timm's save_for_hf or push_to_hf_hub")
        _check_objects(config, reference, pretrained_cfg=False, model_args=True)
        return "timm"
    if "model_type" in config:
        if config["model_type"] != "vit":
            architectures = _listed(config.get("architectures")) or "no architectures listed"
            raise ImportRefused(f"{reference} is a transformers {config['model_type']!r} model ({architectures}), "
                                f"not a ViT: vit-hub import reads model_type 'vit'")
        _check_objects(config, reference, id2label=True)
        return "transformers"
    keys = ", ".join(sorted(config)[:8]) or "none"
    raise ImportRefused(f"{reference} is not a model vit-hub import reads: its config.json has neither timm's "
                        f"'architecture' nor transformers' 'model_type' (keys: {keys})")


def _listed(names: Any) -> str:
    """config.json's list of names as text ('' for none), whatever it holds instead."""
    return ", ".join(map(str, names)) if isinstance(names, list) else str(names or "")[:60]


def _check_objects(config: dict[str, Any], reference: str, **may_be_missing: bool) -> None:
    """Each named entry of config.json is a JSON object (null or absent where it may be missing),
    or a one-line ImportRefused naming what it is instead."""
    for name, optional in may_be_missing.items():
        value = config.get(name)
        if not isinstance(value, dict) and not (optional and value is None):
            raise ImportRefused(f"{reference}: expected {name} in config.json as an object, found "
                                f"{type(value).__name__} {str(value)[:40]!r}")


# Reading the weights ---------------------------------------------------------------------------
def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """model.safetensors as float32 tensors (timm and transformers also publish fp16/bf16 weights).
    Its header is read (and bounded) first: safetensors checks the shapes it declares fill the file."""
    path = ModelDir(folder).weights
    stored_shapes(path)
    with reading_safetensors(path):
        tensors = load_file(str(path))
    return {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in tensors.items()}


# The whole conversion --------------------------------------------------------------------------
def convert(files: SourceFiles) -> Imported:
    """SourceFiles of a timm or transformers ViT -> Imported (config, weights, provenance)."""
    library = identify(files.config, files.reference)
    if library == "vit_hub":
        raise ImportRefused(f"{files.reference} is already a vit_hub model: nothing to import (load it, or "
                            f"fine-tune from it with vit-hub train --init)")
    weights = read_weights(files.folder)
    processor_path = files.folder / PREPROCESSOR
    try:
        if library == "timm":
            config, converted = convert_timm(files.config, weights, files.reference)
        else:
            processor = _read_json(processor_path) if processor_path.is_file() else None
            config, converted = convert_transformers(files.config, weights, processor, files.reference)
    except KeyError as error:  # a weight (or a config entry) the conversion reads is not there
        raise ImportRefused(f"{files.reference}: expected {error.args[0]!r} in its weights or config, "
                            f"found none") from None
    check_converted(config, converted, files.reference)
    if library == "timm":
        pretrained = files.config["pretrained_cfg"]
        architecture = files.config["architecture"] + (f".{pretrained['tag']}" if pretrained.get("tag") else "")
        notes = []
        if isinstance(pretrained.get("crop_pct"), (int, float)) and pretrained["crop_pct"] < 1.0:
            notes.append(f"timm evaluates at crop_pct {pretrained['crop_pct']} (resize, then a centre crop); vit_hub "
                         f"resizes the whole image to {size_text(config.image_size)}")
    else:
        architecture = _listed(files.config.get("architectures")) or "ViTModel"
        notes = [] if processor_path.is_file() else ["no preprocessor_config.json: ViTImageProcessor's defaults "
                                                     "assumed (bilinear, mean and std 0.5)"]
    source = {"kind": "imported", "source": files.reference, "revision": files.revision, "hub": files.hub,
              "library": library, "architecture": architecture, "license": source_license(files),
              "num_classes": config.num_classes, "notes": notes}
    return Imported(config, converted, source)


def check_converted(config: ViTConfig, weights: dict[str, torch.Tensor], reference: str) -> None:
    """Before a model is built from them: the converted weights are exactly those a vit_hub model
    of `config` holds (names and shapes, from vit.py on the meta device), one image's attention
    maps are not absurd for weights that size, and every weight is finite."""
    where = f"{reference}: the converted weights"
    try:
        compare_shapes(expected_shapes(config), {name: tuple(tensor.shape) for name, tensor in weights.items()}, where)
        check_attention_size(config, sum(tensor.numel() * tensor.element_size() for tensor in weights.values()), where)
        check_finite(weights, where)
    except WeightsError as error:
        raise ImportRefused(str(error)) from None


def source_license(files: SourceFiles) -> str | None:
    """The licence the source states: its README.md's `license:` front matter, else timm's
    pretrained_cfg `license`; None when it states none."""
    readme = ModelDir(files.folder).card
    if readme.is_file():
        text = read_card(readme)
        front = re.match(r"---\s*\n(.*?)\n---", text, re.DOTALL)
        found = re.search(r"^license:\s*['\"]?([^'\"\n]+?)['\"]?\s*$", front.group(1), re.MULTILINE) if front else None
        if found:
            return found.group(1)
    return (files.config.get("pretrained_cfg") or {}).get("license")


def import_model(reference: str | Path, revision: str | None = None, token: str | None = None) -> Imported:
    """A timm or transformers ViT (Hub repo id or folder) -> Imported."""
    return convert(read_source(reference, revision, token))


def write_model_dir(imported: Imported, out: str | Path, command: str = "") -> Path:
    """An ordinary vit_hub model dir: config.json, model.safetensors, source.json and the card."""
    from vit_hub.hub.card import write_model_card

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: expected a folder (new or existing), found a file")
    if ModelDir(out).weights.exists():
        raise UserError(f"--out {out}: expected a new or empty folder, found a model there ({ModelDir.weights})")
    model = imported.model()
    model.save_pretrained(out)
    source = dict(imported.source, command=command) if command else imported.source
    ModelDir(out).source.write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
    write_model_card(out)
    return out


# Starting a training run from pretrained weights (vit-hub train --init) -----------------------------
def load_init(reference: str | Path, revision: str | None = None, token: str | None = None) -> Imported:
    """Weights to fine-tune from: a vit_hub model dir or repo as it is, or a timm /
    transformers ViT converted. Hub repos go through vit_hub.hub.repos's resolver either way."""
    path = Path(str(reference))
    files = read_source(reference, revision, token)
    if identify(files.config, str(reference)) != "vit_hub":
        return convert(files)
    if path.is_dir():
        check_model_dir(path, flag="--init")
    start = ModelDir(files.folder)
    config = ViTConfig.from_json(start.config)
    check_weights_fit(config, start.weights)  # before the weights are read
    weights = read_weights(files.folder)
    check_finite(weights, f"weights in {start.weights}")
    earlier = _read_json(start.source) if start.source.is_file() else {}
    source = {"kind": "vit_hub", "source": str(reference), "revision": files.revision, "hub": files.hub,
              "library": "vit_hub", "architecture": earlier.get("architecture", "vit_hub ViT"),
              "license": earlier.get("license") or source_license(files), "num_classes": config.num_classes,
              "notes": []}
    if earlier:
        source["from"] = earlier  # a model imported (or fine-tuned) earlier: its own origin
    return Imported(config, weights, source)


__all__ = ["Imported", "import_model", "write_model_dir", "load_init"]

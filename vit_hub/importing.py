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

Nothing here imports timm or transformers. The architecture is read from the weights' shapes
(width, depth, patch size, MLP width, grid) and the config (heads, LayerNorm eps, image size);
the weights are renamed one by one, with two changes of layout that are exact: the class
token's position is split off the position table (`cls_position`), and transformers'
separate query, key and value are stacked into one `to_qkv`. Anything the vit_hub model has
no place for (register tokens, LayerScale, another pooling, a norm before the blocks, ...)
is refused with one line naming what was found: a weight that would be silently dropped
would give a model that runs and is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from .errors import UserError
from .config import INTERPOLATIONS, ViTConfig, read_json
from .hub import check_model_dir, fetch_file, has_file
from .pretrained import (VisionTransformer, check_attention_size, check_finite, check_weights_fit, compare_shapes,
                         expected_shapes, stored_shapes)
from .storage import reading_safetensors

WEIGHTS = "model.safetensors"
PREPROCESSOR = "preprocessor_config.json"  # transformers' image processor: mean, std, resampling
PICKLE_WEIGHTS = ("pytorch_model.bin", "model.pt", "pytorch_model.bin.index.json")
SOURCE_RECORD = "source.json"  # provenance of an imported or fine-tuned model (card.py reads it)
SOURCE_FLAG = "SRC"
WHAT = "a ViT that vit-hub import reads (a timm/vit_* or transformers ViT model)"
# ImageNet-1k's class names in class-index order: the WordNet lemmas of its synsets, as timm
# lists them (timm/data/_info), one per line.
IMAGENET_LABELS = Path(__file__).parent / "bundled" / "imagenet_1k_labels.txt"

# timm's configs rarely say how many heads a ViT has (timm's model code does); these are the
# widths of timm's vit_* models: width 192 is ViT-Ti (3 heads), 384 ViT-S, 768 ViT-B, 1024
# ViT-L, 1280 ViT-H (heads of 80), ... A width outside this table needs `num_heads` in the
# config's model_args (timm writes it there when a model was created with it).
TIMM_HEADS_BY_WIDTH = {192: 3, 256: 4, 320: 5, 384: 6, 512: 8, 640: 10, 768: 12, 1024: 16, 1280: 16,
                       1408: 16, 1664: 16}

# Weights that name a ViT variant vit_hub does not have, as the message calls it.
VARIANTS = [
    (r"(^|\.)reg_token$", "register tokens"),
    (r"\.(ls1|ls2)\.(gamma|scale)$|\.gamma_[12]$", "LayerScale"),
    (r"\.(q_norm|k_norm)\.", "query/key normalisation"),
    (r"^norm_pre\.", "a LayerNorm before the blocks (CLIP-style pre-norm)"),
    (r"^fc_norm\.", "a LayerNorm after pooling (average pooling)"),
    (r"^attn_pool\.", "attention pooling"),
    (r"(^|\.)dist_token$|^head_dist\.", "a distillation token (DeiT)"),
    (r"^patch_embed\.backbone\.", "a CNN stem (hybrid ViT)"),
    (r"\.(norm|attn\.norm|mlp\.norm)\.weight$", "extra norms inside the blocks"),
    (r"relative_position|rel_pos", "relative positions"),
    (r"\.rope\.|^rope\.", "rotary positions"),
]

TIMM_BLOCK_NAMES = {
    "norm1": "attention_norm", "attn.qkv": "attention.to_qkv", "attn.proj": "attention.to_out.0",
    "norm2": "mlp_norm", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2",
}
TRANSFORMERS_BLOCK_NAMES = {
    "layernorm_before": "attention_norm", "attention.output.dense": "attention.to_out.0",
    "layernorm_after": "mlp_norm", "intermediate.dense": "mlp.fc1", "output.dense": "mlp.fc2",
}
# transformers' resample codes (PIL.Image.Resampling values) by name.
PIL_FILTERS = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


class ImportRefused(UserError):
    """SRC is not a model vit-hub import reads; the message says what was found, in one line."""


@dataclasses.dataclass
class Imported:
    """A converted model: the vit_hub config, its weights under vit_hub's names, and where they came from."""

    config: ViTConfig
    weights: dict[str, torch.Tensor]
    source: dict[str, Any]  # written as source.json: library, architecture, licence, ...

    def model(self):
        """The vit_hub model with these weights (strict: every weight used, none missing), in eval mode."""
        model = VisionTransformer(**self.config.to_dict())
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
        config_path = path / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{SOURCE_FLAG} {reference}: expected config.json in the folder, found none")
        files = SourceFiles(reference, path, _read_json(config_path), hub=False)
    elif path.exists():
        raise ImportRefused(f"{SOURCE_FLAG}: expected a model folder or a Hub repo id, got the file {reference}")
    else:
        config_path = fetch_file(reference, "config.json", revision, token, what=WHAT, flag=SOURCE_FLAG)
        snapshot = config_path.parent
        files = SourceFiles(reference, snapshot, _read_json(config_path), hub=True,
                            revision=snapshot.name if re.fullmatch(r"[0-9a-f]{40}", snapshot.name) else revision)
    library = identify(files.config, reference)
    weights = _fetch(files, WEIGHTS, revision, token)
    if weights is None:
        if any(_has(files, name, revision, token) for name in PICKLE_WEIGHTS):
            raise ImportRefused(f"{reference} has its weights only as a pickle (pytorch_model.bin), which can run "
                                f"code when loaded; vit_hub reads model.safetensors only (the Hub's safetensors "
                                f"conversion, or a save with safe_serialization=True, gives one)")
        if _has(files, WEIGHTS + ".index.json", revision, token):
            raise ImportRefused(f"{reference} has its weights in shards (model.safetensors.index.json); vit-hub import "
                                f"reads one model.safetensors")
        raise ImportRefused(f"{reference}: expected {WEIGHTS} beside config.json, found none")
    for name in (PREPROCESSOR, "README.md") if library == "transformers" else ("README.md",):
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
    except ValueError as error:  # not JSON, too large, or nested too deep
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
        return "timm"
    if "model_type" in config:
        if config["model_type"] != "vit":
            architectures = ", ".join(config.get("architectures") or []) or "no architectures listed"
            raise ImportRefused(f"{reference} is a transformers {config['model_type']!r} model ({architectures}), "
                                f"not a ViT: vit-hub import reads model_type 'vit'")
        return "transformers"
    keys = ", ".join(sorted(config)[:8]) or "none"
    raise ImportRefused(f"{reference} is not a model vit-hub import reads: its config.json has neither timm's "
                        f"'architecture' nor transformers' 'model_type' (keys: {keys})")


# Reading the weights ---------------------------------------------------------------------------
def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """model.safetensors as float32 tensors (timm and transformers also publish fp16/bf16 weights).
    Its header is read (and bounded) first: safetensors checks the shapes it declares fill the file."""
    stored_shapes(folder / WEIGHTS)
    with reading_safetensors(folder / WEIGHTS):
        tensors = load_file(str(folder / WEIGHTS))
    return {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in tensors.items()}


def refuse_variants(names: list[str], reference: str, library: str) -> None:
    """One line naming the ViT variant that weights vit_hub has no place for belong to."""
    found = {}
    for name in names:
        for pattern, variant in VARIANTS:
            if re.search(pattern, name):
                found.setdefault(variant, name)
                break
        else:
            found.setdefault(f"weights {name}", name)
    shown = "; ".join(f"{variant} ({name})" if not variant.startswith("weights") else variant
                      for variant, name in list(found.items())[:4])
    raise ImportRefused(f"{reference} is a {library} ViT variant vit_hub does not have: found {shown}")


def _split_positions(positions: torch.Tensor, grid: tuple[int, int], reference: str) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A position table [1, (1 +) N, D] -> (class token's position [1, 1, D] or None, patches' [1, N, D])."""
    patches = grid[0] * grid[1]
    if positions.shape[1] == patches + 1:
        return positions[:, :1], positions[:, 1:]
    if positions.shape[1] == patches:  # timm's no_embed_class: positions for the patches only, as vit_hub
        return None, positions
    raise ImportRefused(f"{reference}: expected {patches} or {patches + 1} positions for a {grid[0]}x{grid[1]} "
                        f"patch grid, found {positions.shape[1]}")


def _mlp_ratio(hidden: int, width: int) -> float:
    """The ratio whose `int(width * ratio)` is exactly `hidden` (vit_hub stores a ratio)."""
    ratio = hidden / width
    return ratio if int(width * ratio) == hidden else (hidden + 0.5) / width


def _pair(value: Any) -> list[int]:
    if isinstance(value, dict):  # transformers' image processors: {"height": ..., "width": ...}
        return [int(value["height"]), int(value["width"])]
    return [int(value)] * 2 if isinstance(value, (int, float)) else [int(side) for side in value]


# timm ------------------------------------------------------------------------------------------
def convert_timm(config: dict[str, Any], weights: dict[str, torch.Tensor], reference: str) -> tuple[ViTConfig, dict]:
    """timm's VisionTransformer (config.json + state dict) -> (ViTConfig, vit_hub weights)."""
    architecture = config["architecture"]
    pretrained = config["pretrained_cfg"]
    args = config.get("model_args") or {}
    if "quickgelu" in architecture or args.get("act_layer") not in (None, "gelu"):
        raise ImportRefused(f"{reference} is timm's {architecture} with another MLP activation "
                            f"({args.get('act_layer') or 'quick_gelu'}); vit_hub's ViT uses exact GELU")
    pooling = args.get("global_pool", config.get("global_pool", "token"))
    if pooling not in ("token", None):
        raise ImportRefused(f"{reference} pools with {pooling!r} (timm's global_pool); vit_hub's ViT reads the "
                            f"class token ('token')")
    known = {"cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias", "norm.weight",
             "norm.bias", "head.weight", "head.bias"}
    block = re.compile(r"blocks\.(\d+)\.(norm1|attn\.qkv|attn\.proj|norm2|mlp\.fc1|mlp\.fc2)\.(weight|bias)")
    unknown = sorted(name for name in weights if name not in known and not block.fullmatch(name))
    if unknown:
        refuse_variants(unknown, reference, "timm")
    # Variants that leave no weights of their own behind, as timm's model_args record them.
    for name, expected in (("class_token", True), ("final_norm", True), ("fc_norm", None), ("pre_norm", False),
                           ("reg_tokens", 0), ("init_values", None), ("qk_norm", False), ("proj_bias", True),
                           ("pos_embed", "learn"), ("block_fn", None), ("mlp_layer", None), ("attn_layer", None),
                           ("embed_layer", None), ("norm_layer", None)):
        if name in args and args[name] != expected and not (name == "fc_norm" and args[name] is False):
            raise ImportRefused(f"{reference} is timm's {architecture} with {name}={args[name]!r}, a variant "
                                f"vit_hub does not have")
    for name in ("cls_token", "pos_embed", "patch_embed.proj.weight", "norm.weight"):
        if name not in weights:
            raise ImportRefused(f"{reference}: expected timm's {name} in the weights, found none")

    projection = weights["patch_embed.proj.weight"]  # [D, C, p, p]
    width, channels = projection.shape[:2]
    patch = list(projection.shape[2:])
    depth = 1 + max((int(block.fullmatch(name).group(1)) for name in weights if block.fullmatch(name)), default=-1)
    heads = args.get("num_heads") or TIMM_HEADS_BY_WIDTH.get(width)
    if heads is None:
        raise ImportRefused(f"{reference}: cannot tell how many attention heads timm's {architecture} of width "
                            f"{width} has (not one of timm's ViT widths, and config.json's model_args does not say)")
    image_size = _pair(args.get("img_size") or pretrained["input_size"][1:])
    grid = (image_size[0] // patch[0], image_size[1] // patch[1])
    cls_position, positions = _split_positions(weights["pos_embed"], grid, reference)
    num_classes = weights["head.weight"].shape[0] if "head.weight" in weights else 0
    values = dict(
        image_size=image_size, patch_size=patch, in_channels=channels, embed_dim=width, depth=depth,
        num_heads=int(heads), mlp_ratio=_mlp_ratio(weights["blocks.0.mlp.fc1.weight"].shape[0], width),
        qkv_bias="blocks.0.attn.qkv.bias" in weights, layer_norm_eps=1e-6,
        class_token_position=cls_position is not None, labels=timm_labels(config, num_classes),
        mean=pretrained.get("mean", 0.5), std=pretrained.get("std", 0.5),
        interpolation=_interpolation(pretrained.get("interpolation", "bicubic"), reference),
    )
    checked = _checked_config(values, reference)

    converted = {"cls_token": weights["cls_token"], "pos_embedding": positions,
                 "patch_embedding.to_tokens.weight": projection, "norm.weight": weights["norm.weight"],
                 "norm.bias": weights["norm.bias"]}
    if "patch_embed.proj.bias" in weights:
        converted["patch_embedding.to_tokens.bias"] = weights["patch_embed.proj.bias"]
    if cls_position is not None:
        converted["cls_position"] = cls_position
    if num_classes:
        converted.update({"head.weight": weights["head.weight"], "head.bias": weights["head.bias"]})
    for name, tensor in weights.items():
        match = block.fullmatch(name)
        if match:
            index, layer, kind = match.groups()
            converted[f"blocks.{index}.{TIMM_BLOCK_NAMES[layer]}.{kind}"] = tensor
    return checked, converted


def timm_labels(config: dict[str, Any], num_classes: int) -> list[str]:
    """config.json's label_names; else ImageNet-1k's class names for a 1000-class head trained on
    it (timm's tag says in1k); else the class indices."""
    names = config.get("label_names") or config["pretrained_cfg"].get("label_names")
    if isinstance(names, dict):
        names = [names.get(str(index), str(index)) for index in range(num_classes)]
    if names and len(names) == num_classes:
        descriptions = config.get("label_descriptions") or {}
        return [str(descriptions.get(name, name)) for name in names]
    tag = str(config["pretrained_cfg"].get("tag", ""))
    if num_classes == 1000 and re.search(r"(^|_)in1k$", tag):
        return imagenet_labels()
    return [str(index) for index in range(num_classes)]


def imagenet_labels() -> list[str]:
    """The 1000 ImageNet-1k class names in class-index order (WordNet lemmas; a name two
    classes share, such as crane the bird and crane the machine, carries its synset)."""
    return IMAGENET_LABELS.read_text(encoding="utf-8").splitlines()


def _interpolation(name: str, reference: str) -> str:
    if name not in INTERPOLATIONS:
        raise ImportRefused(f"{reference}: expected an interpolation among {', '.join(INTERPOLATIONS)}, found {name!r}")
    return name


# transformers ----------------------------------------------------------------------------------
def convert_transformers(config: dict[str, Any], weights: dict[str, torch.Tensor], preprocessor: dict[str, Any] | None,
                         reference: str) -> tuple[ViTConfig, dict]:
    """transformers' ViTModel / ViTForImageClassification -> (ViTConfig, vit_hub weights)."""
    architectures = config.get("architectures") or []
    if not set(architectures) <= {"ViTModel", "ViTForImageClassification"}:
        raise ImportRefused(f"{reference} is a transformers {', '.join(architectures)}; vit-hub import reads "
                            f"ViTModel and ViTForImageClassification")
    activation = config.get("hidden_act", "gelu")
    if activation != "gelu":
        raise ImportRefused(f"{reference} uses the {activation!r} activation; vit_hub's ViT uses exact GELU ('gelu')")
    weights = {name.removeprefix("vit."): tensor for name, tensor in weights.items()}
    has_classifier = "classifier.weight" in weights
    # A classifier ignores a pooler it carries (transformers builds it without one), and the
    # mask token only fills masked patches in masked-image-modelling pre-training.
    ignored = {"embeddings.mask_token"} | ({"pooler.dense.weight", "pooler.dense.bias"} if has_classifier else set())
    weights = {name: tensor for name, tensor in weights.items() if name not in ignored}
    pooler = "pooler.dense.weight" in weights
    if pooler and config.get("pooler_act", "tanh") != "tanh":
        raise ImportRefused(f"{reference}: its pooler uses {config['pooler_act']!r}; vit_hub's pre-logits layer is tanh")

    known = {"embeddings.cls_token", "embeddings.position_embeddings", "embeddings.patch_embeddings.projection.weight",
             "embeddings.patch_embeddings.projection.bias", "layernorm.weight", "layernorm.bias",
             "pooler.dense.weight", "pooler.dense.bias", "classifier.weight", "classifier.bias"}
    block = re.compile(r"encoder\.layer\.(\d+)\.(layernorm_before|attention\.attention\.(?:query|key|value)|"
                       r"attention\.output\.dense|layernorm_after|intermediate\.dense|output\.dense)\.(weight|bias)")
    unknown = sorted(name for name in weights if name not in known and not block.fullmatch(name))
    if unknown:
        refuse_variants(unknown, reference, "transformers")

    projection = weights["embeddings.patch_embeddings.projection.weight"]
    width, channels = projection.shape[:2]
    patch = list(projection.shape[2:])
    depth = 1 + max((int(block.fullmatch(name).group(1)) for name in weights if block.fullmatch(name)), default=-1)
    image_size = _pair(config.get("image_size", 224))
    grid = (image_size[0] // patch[0], image_size[1] // patch[1])
    cls_position, positions = _split_positions(weights["embeddings.position_embeddings"], grid, reference)
    num_classes = weights["classifier.weight"].shape[0] if has_classifier else 0
    id2label = config.get("id2label") or {}
    mean, std, interpolation = _processor_values(preprocessor)
    values = dict(
        image_size=image_size, patch_size=patch, in_channels=channels, embed_dim=width, depth=depth,
        num_heads=int(config.get("num_attention_heads", 12)),
        mlp_ratio=_mlp_ratio(weights["encoder.layer.0.intermediate.dense.weight"].shape[0], width),
        qkv_bias="encoder.layer.0.attention.attention.query.bias" in weights,
        layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)), class_token_position=cls_position is not None,
        pre_logits=weights["pooler.dense.weight"].shape[0] if pooler else 0,
        labels=[str(id2label.get(str(index), id2label.get(index, index))) for index in range(num_classes)],
        mean=mean, std=std, interpolation=interpolation,
    )
    checked = _checked_config(values, reference)  # bounds the depth the loop below walks

    converted = {"cls_token": weights["embeddings.cls_token"], "pos_embedding": positions,
                 "patch_embedding.to_tokens.weight": projection,
                 "patch_embedding.to_tokens.bias": weights["embeddings.patch_embeddings.projection.bias"],
                 "norm.weight": weights["layernorm.weight"], "norm.bias": weights["layernorm.bias"]}
    if cls_position is not None:
        converted["cls_position"] = cls_position
    if pooler:
        converted.update({"pre_logits.0.weight": weights["pooler.dense.weight"],
                          "pre_logits.0.bias": weights["pooler.dense.bias"]})
    if has_classifier:
        converted.update({"head.weight": weights["classifier.weight"], "head.bias": weights["classifier.bias"]})
    for index in range(depth):
        prefix = f"encoder.layer.{index}."
        for layer, ours in TRANSFORMERS_BLOCK_NAMES.items():
            for kind in ("weight", "bias"):
                converted[f"blocks.{index}.{ours}.{kind}"] = weights[f"{prefix}{layer}.{kind}"]
        # Query, key and value stacked in that order are one fused projection, exactly.
        for kind in ("weight", "bias") if values["qkv_bias"] else ("weight",):
            converted[f"blocks.{index}.attention.to_qkv.{kind}"] = torch.cat(
                [weights[f"{prefix}attention.attention.{part}.{kind}"] for part in ("query", "key", "value")])
    return checked, converted


def _processor_values(preprocessor: dict[str, Any] | None) -> tuple[Any, Any, str]:
    """(mean, std, interpolation) from preprocessor_config.json; without one, ViTImageProcessor's
    defaults (0.5, 0.5, bilinear)."""
    preprocessor = preprocessor or {}
    if preprocessor.get("do_normalize", True):
        mean, std = preprocessor.get("image_mean", 0.5), preprocessor.get("image_std", 0.5)
    else:
        mean, std = 0.0, 1.0
    resample = preprocessor.get("resample", 2)
    return mean, std, PIL_FILTERS.get(resample, "bilinear") if isinstance(resample, int) else str(resample)


def _checked_config(values: dict[str, Any], reference: str) -> ViTConfig:
    try:
        return ViTConfig.from_dict(values)
    except ValueError as error:
        raise ImportRefused(f"{reference}: the architecture read from it does not make a vit_hub config: {error}") from None


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
        if pretrained.get("crop_pct", 1.0) < 1.0:
            notes.append(f"timm evaluates at crop_pct {pretrained['crop_pct']} (resize, then a centre crop); vit_hub "
                         f"resizes the whole image to {config.image_size[0]}x{config.image_size[1]}")
    else:
        architecture = ", ".join(files.config.get("architectures") or ["ViTModel"])
        notes = [] if processor_path.is_file() else ["no preprocessor_config.json: ViTImageProcessor's defaults "
                                                     "assumed (bilinear, mean and std 0.5)"]
    source = {"kind": "imported", "source": files.reference, "revision": files.revision, "hub": files.hub,
              "library": library, "architecture": architecture, "license": source_license(files),
              "num_classes": config.num_classes, "notes": notes}
    return Imported(config, converted, source)


def check_converted(config: ViTConfig, weights: dict[str, torch.Tensor], reference: str) -> None:
    """Before a model is built from them: the converted weights are exactly those a vit_hub model
    of `config` holds (names and shapes, from model.py on the meta device), one image's attention
    maps are not absurd for weights that size, and every weight is finite."""
    where = f"{reference}: the converted weights"
    try:
        compare_shapes(expected_shapes(config), {name: tuple(tensor.shape) for name, tensor in weights.items()}, where)
        check_attention_size(config, sum(tensor.numel() * tensor.element_size() for tensor in weights.values()), where)
        check_finite(weights, where)
    except ValueError as error:
        raise ImportRefused(str(error)) from None


def source_license(files: SourceFiles) -> str | None:
    """The licence the source states: its README.md's `license:` front matter, else timm's
    pretrained_cfg `license`; None when it states none."""
    readme = files.folder / "README.md"
    if readme.is_file():
        text = readme.read_text(encoding="utf-8", errors="replace")
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
    from .card import write_model_card

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: expected a folder (new or existing), found a file")
    if (out / WEIGHTS).exists():
        raise ValueError(f"--out {out}: expected a new or empty folder, found a model there ({WEIGHTS})")
    model = imported.model()
    model.save_pretrained(out)
    source = dict(imported.source, command=command) if command else imported.source
    (out / SOURCE_RECORD).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
    write_model_card(out)
    return out


# Starting a training run from pretrained weights (vit-hub train --init) -----------------------------
def load_init(reference: str | Path, revision: str | None = None, token: str | None = None) -> Imported:
    """Weights to fine-tune from: a vit_hub model dir or repo as it is, or a timm /
    transformers ViT converted. Hub repos go through vit_hub.hub's resolver either way."""
    path = Path(str(reference))
    files = read_source(reference, revision, token)
    if identify(files.config, str(reference)) != "vit_hub":
        return convert(files)
    if path.is_dir():
        check_model_dir(path, flag="--init")
    config = ViTConfig.from_json(files.folder / "config.json")
    check_weights_fit(config, files.folder / WEIGHTS)  # before the weights are read
    weights = read_weights(files.folder)
    check_finite(weights, f"weights in {files.folder / WEIGHTS}")
    record = files.folder / SOURCE_RECORD
    earlier = _read_json(record) if record.is_file() else {}
    source = {"kind": "vit_hub", "source": str(reference), "revision": files.revision, "hub": files.hub,
              "library": "vit_hub", "architecture": earlier.get("architecture", "vit_hub ViT"),
              "license": earlier.get("license") or source_license(files), "num_classes": config.num_classes,
              "notes": []}
    if earlier:
        source["from"] = earlier  # a model imported (or fine-tuned) earlier: its own origin
    return Imported(config, weights, source)


# Fields a fine-tuning run may change; everything else is the pretrained architecture's.
FINE_TUNE_FIELDS = ("image_size", "dropout", "attention_dropout", "drop_path", "interpolation", "mean", "std",
                    "pixel_norm", "canonicalize")


def fine_tune_config(start: Imported, labels: list[str], overrides: dict[str, Any]) -> ViTConfig:
    """The pretrained config with the data's labels, no pre-logits layer (the ViT paper
    replaces the whole head when fine-tuning), and the overrides a fine-tuning run may make.
    Canonicalisation belongs to the new data, not the pretrained model's: none unless the
    run asks for it (`--canonicalize digit` to fine-tune a digit model on digits)."""
    values = {**start.config.to_dict(), "canonicalize": "none"}
    changed = {key: value for key, value in overrides.items()
               if value is not None and key not in FINE_TUNE_FIELDS and value != values.get(key)}
    if changed:
        flags = ", ".join(f"--{key.replace('_', '-')}" for key in sorted(changed))
        raise ValueError(f"--init: {flags} cannot differ from the pretrained model's ({start.source['source']}); "
                         f"only {', '.join('--' + key.replace('_', '-') for key in FINE_TUNE_FIELDS)} may")
    values.update({key: value for key, value in overrides.items() if value is not None and key in FINE_TUNE_FIELDS})
    values.update(labels=labels, num_classes=None, pre_logits=0)
    return ViTConfig.from_dict(values)


def fine_tune_weights(start: Imported, config: ViTConfig) -> dict[str, torch.Tensor]:
    """The pretrained weights for `config`: body as it is, positions resized (bicubic, on the
    patch grid; the class token's position kept) when the image size differs, and a new head
    of zeros for the data's labels (the ViT paper's choice for fine-tuning: the first steps
    train the head on features that already tell images apart, without disturbing them)."""
    weights = {name: tensor for name, tensor in start.weights.items()
               if not name.startswith(("head.", "pre_logits."))}
    if "pos_embedding" in weights:  # learned positions (fixed sin-cos ones are rebuilt for the grid)
        weights["pos_embedding"] = resize_positions(weights["pos_embedding"], start.config.grid_size, config.grid_size)
    width = config.embed_dim
    weights["head.weight"] = torch.zeros(config.num_classes, width)
    weights["head.bias"] = torch.zeros(config.num_classes)
    return weights


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


__all__ = ["Imported", "ImportRefused", "import_model", "write_model_dir", "load_init", "fine_tune_config",
           "fine_tune_weights", "resize_positions", "imagenet_labels", "describe"]

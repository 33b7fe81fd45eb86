"""timm's and transformers' ViTs, renamed and reshaped onto vit_hub's: a config dict and a state
dict in, a `ViTConfig` and vit_hub's weights out. No files and no Hub: `vit_hub.hub.import_model`
fetches what these functions convert.

The architecture is read from the weights' shapes (width, depth, patch size, MLP width, grid)
and the config (heads, LayerNorm eps, image size); the weights are renamed one by one, with two
changes of layout that are exact: the class token's position is split off the position table
(`cls_position`), and transformers' separate query, key and value are stacked into one
`to_qkv`. Anything the vit_hub model has no place for (register tokens, LayerScale, another
pooling, a norm before the blocks, ...) is refused with one line naming what was found: a
weight that would be silently dropped would give a model that runs and is wrong.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path
from typing import Any

import torch

from vit_hub.errors import UserError
from vit_hub.model.config import INTERPOLATIONS, ViTConfig, size_text
from vit_hub.model.labels import label_key

# ImageNet-1k's class names in class-index order: the WordNet lemmas of its synsets, as timm
# lists them (timm/data/_info), one per line.
IMAGENET_LABELS = Path(__file__).resolve().parents[1] / "bundled" / "imagenet_1k_labels.txt"

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

# timm: the weights outside the blocks, a block's weights, and their vit_hub names.
TIMM_KNOWN = {"cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias", "norm.weight",
              "norm.bias", "head.weight", "head.bias"}
TIMM_BLOCK = re.compile(r"blocks\.(\d+)\.(norm1|attn\.qkv|attn\.proj|norm2|mlp\.fc1|mlp\.fc2)\.(weight|bias)")
TIMM_BLOCK_NAMES = {
    "norm1": "attention_norm", "attn.qkv": "attention.to_qkv", "attn.proj": "attention.to_out.0",
    "norm2": "mlp_norm", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2",
}
# Variants that leave no weights of their own behind, as timm's model_args record them: each
# argument with the value of a plain ViT (fc_norm may also be False).
TIMM_PLAIN_ARGS = (("class_token", True), ("final_norm", True), ("fc_norm", None), ("pre_norm", False),
                   ("reg_tokens", 0), ("init_values", None), ("qk_norm", False), ("proj_bias", True),
                   ("pos_embed", "learn"), ("block_fn", None), ("mlp_layer", None), ("attn_layer", None),
                   ("embed_layer", None), ("norm_layer", None))

# transformers: the same three facts.
TRANSFORMERS_KNOWN = {"embeddings.cls_token", "embeddings.position_embeddings",
                      "embeddings.patch_embeddings.projection.weight", "embeddings.patch_embeddings.projection.bias",
                      "layernorm.weight", "layernorm.bias", "pooler.dense.weight", "pooler.dense.bias",
                      "classifier.weight", "classifier.bias"}
TRANSFORMERS_BLOCK = re.compile(r"encoder\.layer\.(\d+)\.(layernorm_before|attention\.attention\.(?:query|key|value)|"
                                r"attention\.output\.dense|layernorm_after|intermediate\.dense|output\.dense)\."
                                r"(weight|bias)")
TRANSFORMERS_BLOCK_NAMES = {
    "layernorm_before": "attention_norm", "attention.output.dense": "attention.to_out.0",
    "layernorm_after": "mlp_norm", "intermediate.dense": "mlp.fc1", "output.dense": "mlp.fc2",
}
# transformers' resample codes (PIL.Image.Resampling values) by name.
PIL_FILTERS = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}

Weights = dict[str, torch.Tensor]


class ImportRefused(UserError):
    """SRC is not a model vit-hub import reads; the message says what was found, in one line."""


# Shared by both libraries ----------------------------------------------------------------------
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


def _refuse_unknown(weights: Weights, known: set[str], block: re.Pattern, reference: str, library: str) -> None:
    """Refuse weights that are neither `known` nor a block's, naming the variant they belong to."""
    unknown = sorted(name for name in weights if name not in known and not block.fullmatch(name))
    if unknown:
        refuse_variants(unknown, reference, library)


def _depth(weights: Weights, block: re.Pattern) -> int:
    """How many blocks the weights hold: one more than the largest block index."""
    return 1 + max((int(found.group(1)) for name in weights if (found := block.fullmatch(name))), default=-1)


def _split_positions(positions: torch.Tensor, grid: tuple[int, int],
                     reference: str) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A position table [1, (1 +) N, D] -> (class token's position [1, 1, D] or None, patches' [1, N, D])."""
    patches = grid[0] * grid[1]
    if positions.shape[1] == patches + 1:
        return positions[:, :1], positions[:, 1:]
    if positions.shape[1] == patches:  # timm's no_embed_class: positions for the patches only, as vit_hub
        return None, positions
    raise ImportRefused(f"{reference}: expected {patches} or {patches + 1} positions for a {size_text(grid)} "
                        f"patch grid, found {positions.shape[1]}")


def _mlp_ratio(hidden: int, width: int) -> float:
    """The ratio whose `int(width * ratio)` is exactly `hidden` (vit_hub stores a ratio)."""
    ratio = hidden / width
    return ratio if int(width * ratio) == hidden else (hidden + 0.5) / width


def _pair(value: Any, name: str, reference: str) -> list[int]:
    """An image size as config.json gives it (a side, [height, width] or transformers'
    {"height": ..., "width": ...}) -> [height, width]; a one-line ImportRefused for anything else."""
    if isinstance(value, dict):
        value = [value.get("height"), value.get("width")]
    sides = [value] * 2 if not isinstance(value, (list, tuple)) else list(value)
    if len(sides) != 2 or not all(_is_side(side) for side in sides):
        raise ImportRefused(f"{reference}: expected {name} as a side or [height, width] in pixels, found "
                            f"{str(value)[:60]!r}")
    return [int(side) for side in sides]


def _is_side(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == int(value) and value >= 1


def _checked_config(values: dict[str, Any], reference: str) -> ViTConfig:
    try:
        return ViTConfig.from_dict(values)
    except UserError as error:
        raise ImportRefused(f"{reference}: the architecture read from it does not make a vit_hub config: {error}") from None


def _common_weights(cls_token: torch.Tensor, positions: torch.Tensor, cls_position: torch.Tensor | None,
                    projection: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor]) -> Weights:
    """vit_hub's weights outside the blocks and the head, which every converted ViT has."""
    converted = {"cls_token": cls_token, "pos_embedding": positions, "patch_embedding.to_tokens.weight": projection,
                 "norm.weight": norm[0], "norm.bias": norm[1]}
    if cls_position is not None:
        converted["cls_position"] = cls_position
    return converted


# timm ------------------------------------------------------------------------------------------
def convert_timm(config: dict[str, Any], weights: Weights, reference: str) -> tuple[ViTConfig, Weights]:
    """timm's VisionTransformer (config.json + state dict) -> (ViTConfig, vit_hub weights)."""
    _refuse_timm_variants(config, weights, reference)
    checked, cls_position, positions = _timm_config(config, weights, reference)
    converted = _common_weights(weights["cls_token"], positions, cls_position, weights["patch_embed.proj.weight"],
                                (weights["norm.weight"], weights["norm.bias"]))
    if "patch_embed.proj.bias" in weights:
        converted["patch_embedding.to_tokens.bias"] = weights["patch_embed.proj.bias"]
    if checked.num_classes:
        converted.update({"head.weight": weights["head.weight"], "head.bias": weights["head.bias"]})
    for name, tensor in weights.items():
        if found := TIMM_BLOCK.fullmatch(name):
            index, layer, kind = found.groups()
            converted[f"blocks.{index}.{TIMM_BLOCK_NAMES[layer]}.{kind}"] = tensor
    return checked, converted


def _refuse_timm_variants(config: dict[str, Any], weights: Weights, reference: str) -> None:
    """A one-line ImportRefused for a timm ViT vit_hub cannot hold: another activation or pooling,
    weights of a variant, model_args of a variant, or missing weights every ViT has."""
    architecture, args = config["architecture"], config.get("model_args") or {}
    if "quickgelu" in architecture or args.get("act_layer") not in (None, "gelu"):
        raise ImportRefused(f"{reference} is timm's {architecture} with another MLP activation "
                            f"({args.get('act_layer') or 'quick_gelu'}); vit_hub's ViT uses exact GELU")
    pooling = args.get("global_pool", config.get("global_pool", "token"))
    if pooling not in ("token", None):
        raise ImportRefused(f"{reference} pools with {pooling!r} (timm's global_pool); vit_hub's ViT reads the "
                            f"class token ('token')")
    _refuse_unknown(weights, TIMM_KNOWN, TIMM_BLOCK, reference, "timm")
    for name, plain in TIMM_PLAIN_ARGS:
        if name in args and args[name] != plain and not (name == "fc_norm" and args[name] is False):
            raise ImportRefused(f"{reference} is timm's {architecture} with {name}={args[name]!r}, a variant "
                                f"vit_hub does not have")
    for name in ("cls_token", "pos_embed", "patch_embed.proj.weight", "norm.weight"):
        if name not in weights:
            raise ImportRefused(f"{reference}: expected timm's {name} in the weights, found none")


def _timm_config(config: dict[str, Any], weights: Weights,
                 reference: str) -> tuple[ViTConfig, torch.Tensor | None, torch.Tensor]:
    """(the ViTConfig of a timm ViT, its class token's position or None, its patches' positions)."""
    architecture, pretrained, args = config["architecture"], config["pretrained_cfg"], config.get("model_args") or {}
    width, channels, *patch = weights["patch_embed.proj.weight"].shape  # [D, C, p_h, p_w]
    heads = args.get("num_heads") or TIMM_HEADS_BY_WIDTH.get(width)
    if heads is not None and not _is_side(heads):
        raise ImportRefused(f"{reference}: expected model_args.num_heads as a whole number, found {str(heads)[:40]!r}")
    if heads is None:
        raise ImportRefused(f"{reference}: cannot tell how many attention heads timm's {architecture} of width "
                            f"{width} has (not one of timm's ViT widths, and config.json's model_args does not say)")
    image_size = _pair(args["img_size"], "model_args.img_size", reference) if args.get("img_size") else \
        _timm_input_size(pretrained.get("input_size"), reference)
    grid = (image_size[0] // patch[0], image_size[1] // patch[1])
    cls_position, positions = _split_positions(weights["pos_embed"], grid, reference)
    num_classes = weights["head.weight"].shape[0] if "head.weight" in weights else 0
    values = dict(
        image_size=image_size, patch_size=patch, in_channels=channels, embed_dim=width,
        depth=_depth(weights, TIMM_BLOCK), num_heads=int(heads),
        mlp_ratio=_mlp_ratio(weights["blocks.0.mlp.fc1.weight"].shape[0], width),
        qkv_bias="blocks.0.attn.qkv.bias" in weights, layer_norm_eps=1e-6,
        class_token_position=cls_position is not None, labels=timm_labels(config, num_classes),
        mean=pretrained.get("mean", 0.5), std=pretrained.get("std", 0.5),
        interpolation=_interpolation(pretrained.get("interpolation", "bicubic"), reference),
    )
    return _checked_config(values, reference), cls_position, positions


def _timm_input_size(input_size: Any, reference: str) -> list[int]:
    """pretrained_cfg's input_size [channels, height, width] -> [height, width]."""
    if not isinstance(input_size, list) or len(input_size) != 3:
        raise ImportRefused(f"{reference}: expected pretrained_cfg.input_size as [channels, height, width], found "
                            f"{str(input_size)[:60]!r}")
    return _pair(input_size[1:], "pretrained_cfg.input_size", reference)


def timm_labels(config: dict[str, Any], num_classes: int) -> list[str]:
    """config.json's label_names; else ImageNet-1k's class names for a 1000-class head trained on
    it (timm's tag says in1k); else the class indices."""
    names = config.get("label_names") or config["pretrained_cfg"].get("label_names")
    if isinstance(names, dict):
        names = [names.get(str(index), str(index)) for index in range(num_classes)]
    if isinstance(names, list) and len(names) == num_classes:
        descriptions = config.get("label_descriptions") or {}
        return distinct([str(descriptions.get(name, name)) for name in names])
    tag = str(config["pretrained_cfg"].get("tag", ""))
    if num_classes == 1000 and re.search(r"(^|_)in1k$", tag):
        return imagenet_labels()
    return [str(index) for index in range(num_classes)]


def distinct(labels: list[str]) -> list[str]:
    """Class names a vit_hub config takes, each different: a name several classes share (the
    id2label of transformers' ImageNet ViTs has two "crane"s) gets its class index after it."""
    counts = collections.Counter(map(label_key, labels))
    return [f"{label} ({index})" if counts[label_key(label)] > 1 else label for index, label in enumerate(labels)]


def imagenet_labels() -> list[str]:
    """The 1000 ImageNet-1k class names in class-index order (WordNet lemmas; a name two
    classes share, such as crane the bird and crane the machine, carries its synset)."""
    return IMAGENET_LABELS.read_text(encoding="utf-8").splitlines()


def _interpolation(name: str, reference: str) -> str:
    if name not in INTERPOLATIONS:
        raise ImportRefused(f"{reference}: expected an interpolation among {', '.join(INTERPOLATIONS)}, found {name!r}")
    return name


# transformers ----------------------------------------------------------------------------------
def convert_transformers(config: dict[str, Any], weights: Weights, preprocessor: dict[str, Any] | None,
                         reference: str) -> tuple[ViTConfig, Weights]:
    """transformers' ViTModel / ViTForImageClassification -> (ViTConfig, vit_hub weights)."""
    weights = _transformers_weights_in_use(config, weights, reference)
    checked, cls_position, positions = _transformers_config(config, weights, preprocessor, reference)
    converted = _common_weights(weights["embeddings.cls_token"], positions, cls_position,
                                weights["embeddings.patch_embeddings.projection.weight"],
                                (weights["layernorm.weight"], weights["layernorm.bias"]))
    converted["patch_embedding.to_tokens.bias"] = weights["embeddings.patch_embeddings.projection.bias"]
    if checked.pre_logits:
        converted.update({"pre_logits.0.weight": weights["pooler.dense.weight"],
                          "pre_logits.0.bias": weights["pooler.dense.bias"]})
    if checked.num_classes:
        converted.update({"head.weight": weights["classifier.weight"], "head.bias": weights["classifier.bias"]})
    for index in range(checked.depth):
        prefix = f"encoder.layer.{index}."
        for layer, ours in TRANSFORMERS_BLOCK_NAMES.items():
            for kind in ("weight", "bias"):
                converted[f"blocks.{index}.{ours}.{kind}"] = weights[f"{prefix}{layer}.{kind}"]
        # Query, key and value stacked in that order are one fused projection, exactly.
        for kind in ("weight", "bias") if checked.qkv_bias else ("weight",):
            converted[f"blocks.{index}.attention.to_qkv.{kind}"] = torch.cat(
                [weights[f"{prefix}attention.attention.{part}.{kind}"] for part in ("query", "key", "value")])
    return checked, converted


def _transformers_weights_in_use(config: dict[str, Any], weights: Weights, reference: str) -> Weights:
    """The weights the model computes with, under names without the `vit.` prefix; a one-line
    ImportRefused for another architecture, activation or pooler, or weights of a variant."""
    architectures = config.get("architectures") or []
    if not set(architectures) <= {"ViTModel", "ViTForImageClassification"}:
        raise ImportRefused(f"{reference} is a transformers {', '.join(architectures)}; vit-hub import reads "
                            f"ViTModel and ViTForImageClassification")
    activation = config.get("hidden_act", "gelu")
    if activation != "gelu":
        raise ImportRefused(f"{reference} uses the {activation!r} activation; vit_hub's ViT uses exact GELU ('gelu')")
    weights = {name.removeprefix("vit."): tensor for name, tensor in weights.items()}
    # A classifier ignores a pooler it carries (transformers builds it without one), and the
    # mask token only fills masked patches in masked-image-modelling pre-training.
    ignored = {"embeddings.mask_token"}
    if "classifier.weight" in weights:
        ignored |= {"pooler.dense.weight", "pooler.dense.bias"}
    weights = {name: tensor for name, tensor in weights.items() if name not in ignored}
    if "pooler.dense.weight" in weights and config.get("pooler_act", "tanh") != "tanh":
        raise ImportRefused(f"{reference}: its pooler uses {config['pooler_act']!r}; vit_hub's pre-logits layer is tanh")
    _refuse_unknown(weights, TRANSFORMERS_KNOWN, TRANSFORMERS_BLOCK, reference, "transformers")
    return weights


def _transformers_config(config: dict[str, Any], weights: Weights, preprocessor: dict[str, Any] | None,
                         reference: str) -> tuple[ViTConfig, torch.Tensor | None, torch.Tensor]:
    """(the ViTConfig of a transformers ViT, its class token's position or None, its patches' positions)."""
    width, channels, *patch = weights["embeddings.patch_embeddings.projection.weight"].shape  # [D, C, p_h, p_w]
    image_size = _pair(config.get("image_size", 224), "image_size", reference)
    grid = (image_size[0] // patch[0], image_size[1] // patch[1])
    cls_position, positions = _split_positions(weights["embeddings.position_embeddings"], grid, reference)
    num_classes = weights["classifier.weight"].shape[0] if "classifier.weight" in weights else 0
    id2label = config.get("id2label") or {}
    mean, std, interpolation = _processor_values(preprocessor)
    values = dict(
        image_size=image_size, patch_size=patch, in_channels=channels, embed_dim=width,
        depth=_depth(weights, TRANSFORMERS_BLOCK), num_heads=int(config.get("num_attention_heads", 12)),
        mlp_ratio=_mlp_ratio(weights["encoder.layer.0.intermediate.dense.weight"].shape[0], width),
        qkv_bias="encoder.layer.0.attention.attention.query.bias" in weights,
        layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)), class_token_position=cls_position is not None,
        pre_logits=weights["pooler.dense.weight"].shape[0] if "pooler.dense.weight" in weights else 0,
        labels=distinct([str(id2label.get(str(index), id2label.get(index, index))) for index in range(num_classes)]),
        mean=mean, std=std, interpolation=interpolation,
    )
    return _checked_config(values, reference), cls_position, positions  # checked: bounds the depth walked


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

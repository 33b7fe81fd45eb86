"""`vit-hub info`: a per-layer table of parameters and FLOPs for one image."""

from __future__ import annotations

import torch

from .config import size_text
from .flops import count_flops, module_flops
from .model import VisionTransformer


def _parameters(module: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def layer_rows(model: VisionTransformer) -> list[tuple[str, int, int]]:
    """(layer, parameters, FLOPs at batch 1) for the embedding, every block's attention
    and MLP, and the head. FLOPs are those of inference (`flops.count_flops`), the attention
    matmuls and the last block's class-token-only work included."""
    config = model.config
    flops = count_flops(model)

    def total(name: str) -> int:
        return module_flops(flops, f"VisionTransformer.{name}")

    embedding_parameters = _parameters(model.patch_embedding) + model.cls_token.numel()
    for positions in (model.pos_embedding, model.cls_position):  # learned ones only
        if isinstance(positions, torch.nn.Parameter):
            embedding_parameters += positions.numel()
    rows = [("patch_embedding + cls + positions", embedding_parameters, total("patch_embedding"))]
    for index, block in enumerate(model.blocks):
        rows.append((f"blocks.{index}.attention", _parameters(block.attention) + _parameters(block.attention_norm),
                     total(f"blocks.{index}.attention")))
        rows.append((f"blocks.{index}.mlp", _parameters(block.mlp) + _parameters(block.mlp_norm),
                     total(f"blocks.{index}.mlp")))
    head_parameters = _parameters(model.norm) + _parameters(model.pre_logits) + _parameters(model.head)
    name = "norm + pre-logits + head" if config.pre_logits else "norm + head"
    rows.append((name, head_parameters, total("pre_logits") + total("head")))
    return rows


def summarize(model: VisionTransformer) -> str:
    config = model.config
    rows = layer_rows(model)
    width = max(len(name) for name, _, _ in rows) + 2
    lines = [
        f"VisionTransformer: {size_text([*config.image_size, config.in_channels])} input, "
        f"patch {size_text(config.patch_size)}, {config.num_tokens} tokens, "
        f"dim {config.embed_dim}, depth {config.depth}, heads {config.num_heads}, {config.num_classes} classes",
        f"{'layer':<{width}}{'parameters':>12}{'MFLOPs':>12}",
    ]
    lines += [f"{name:<{width}}{parameters:>12,}{flops / 1e6:>12.2f}" for name, parameters, flops in rows]
    total_parameters = _parameters(model)
    total_flops = sum(flops for _, _, flops in rows)
    lines.append(f"{'total':<{width}}{total_parameters:>12,}{total_flops / 1e6:>12.2f}")
    return "\n".join(lines)

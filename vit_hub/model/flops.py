"""FLOPs and parameters of a model, and how much of a GPU's peak a training run uses (model
FLOP utilisation, MFU). The one place FLOPs are counted: `vit-hub info` prints the per-layer
table of inference (`summarize`), training reads the total of a training step.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from vit_hub.model.config import size_text

TOTAL = "Global"  # FlopCounterMode's name for the whole model in its per-module counts

# Dense matmul peaks of NVIDIA GPUs (TFLOP/s, without sparsity) by name and precision, from
# NVIDIA's data sheets; model FLOP utilisation is reported on these GPUs only.
PEAK_TFLOPS = (  # (words in torch.cuda.get_device_name, {dtype: TFLOP/s})
    (("H100", "PCIe"), {"bfloat16": 756.0, "float16": 756.0, "float32": 378.0}),  # float32: TF32 (on here)
    (("H100", "NVL"), {"bfloat16": 835.0, "float16": 835.0, "float32": 418.0}),
    (("H100",), {"bfloat16": 989.0, "float16": 989.0, "float32": 495.0}),  # SXM
    (("H200",), {"bfloat16": 989.0, "float16": 989.0, "float32": 495.0}),
    (("A100",), {"bfloat16": 312.0, "float16": 312.0, "float32": 156.0}),
    (("L4",), {"bfloat16": 121.0, "float16": 121.0, "float32": 60.0}),
)


def count_flops(model: nn.Module, training: bool = False) -> dict[str, dict]:
    """FLOPs of one image, per module (FlopCounterMode's counts: {module name: {op: FLOPs}},
    the whole model under TOTAL); a multiply-add counts 2. `training`: forward and backward
    in train mode; else the forward pass of inference (eval mode, so the last block's
    class-token-only work is what is counted).

    Counted on a copy of the model on the meta device: no memory, no arithmetic and no random
    numbers drawn. Attention runs through SDPA's math backend for the count, so its matmuls
    are seen (the counter does not see inside the fused kernels)."""
    config = model.config
    probe = copy.deepcopy(model).to("meta").train(training)
    pixels = torch.empty(1, config.in_channels, *config.image_size, device="meta")
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH), torch.set_grad_enabled(training):
        logits = probe(pixels).logits
        if training:
            logits.sum().backward()
    return counter.get_flop_counts()


def module_flops(counts: dict[str, dict], name: str) -> int:
    """The FLOPs `count_flops` found in one module (TOTAL: the whole model)."""
    return int(sum(counts.get(name, {}).values()))


def training_flops(model: nn.Module) -> float:
    """FLOPs of one training image, forward and backward."""
    return float(module_flops(count_flops(model, training=True), TOTAL))


def peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """The dense peak FLOP/s of the named GPU in `dtype` (float32: TF32, which training turns
    on), or None for a GPU the table does not know."""
    words = set(device_name.replace("-", " ").split())
    for needed, peaks in PEAK_TFLOPS:
        if set(needed) <= words:
            peak = peaks.get(str(dtype).removeprefix("torch."))
            return None if peak is None else peak * 1e12
    return None


def run_peak_flops(device: torch.device, dtype: torch.dtype | None, processes: int) -> float | None:
    """The whole run's dense matmul peak (per GPU x processes) in the step's precision, or None
    on the CPU, which has no one peak to hold the step against (its FLOP/s are reported alone)."""
    if device.type != "cuda":
        return None
    peak = peak_flops(torch.cuda.get_device_name(device), dtype or torch.float32)
    return None if peak is None else peak * processes


def flop_rates(achieved: float, peak: float | None) -> dict[str, float]:
    """The epoch record's model TFLOP/s, and its share of the peak (MFU) where there is one."""
    rates = {"model_tflop_s": achieved / 1e12}
    if peak:
        rates["mfu"] = achieved / peak
    return rates


# `vit-hub info`: a per-layer table of parameters and FLOPs for one image ---------------------
def _parameters(module: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def layer_rows(model: nn.Module) -> list[tuple[str, int, int]]:
    """(layer, parameters, FLOPs at batch 1) for the embedding, every block's attention
    and MLP, and the head. FLOPs are those of inference (`flops.count_flops`), the attention
    matmuls and the last block's class-token-only work included."""
    config = model.config
    flops = count_flops(model)

    def total(name: str) -> int:
        return module_flops(flops, f"{type(model).__name__}.{name}")

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


def summarize(model: nn.Module) -> str:
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

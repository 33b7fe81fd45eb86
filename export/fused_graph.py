"""The float16 logits graph's form for ONNX Runtime: attention as one operator, then its fusions.

The plain graphs decompose attention into standard operators (MatMul, Mul, Softmax, MatMul,
with the transposes between them), which any ONNX runtime runs but ONNX Runtime's optimizer
does not recognise as attention, so on the CUDA provider it runs as separate kernels that
write the [B, heads, T, T] scores to memory and read them back. The float16 copies are made
for ONNX Runtime's CUDA provider (half.py), so their logits graph is written in two steps:

  1. `fused_copy`: each block's attention is exported as ONNX Runtime's contrib operator
     `com.microsoft.MultiHeadAttention`: one kernel (flash or memory-efficient attention on
     the GPU), which the CPU provider runs too. The block's fused query/key/value projection
     gives [B, T, 3D] whose last axis holds the queries, keys and values one after the other,
     heads side by side in each ([3, heads, head_dim], the order `Attention` reshapes to);
     split in three, that is the [B, T, D] layout the operator reads, so no transpose is
     exported. Locality self-attention passes its learned temperature as the operator's
     `scale` and its "not itself" mask as an additive bias [1, 1, Q, T].
  2. `ort_fusions`: ONNX Runtime's transformer optimizer (`onnxruntime.transformers`, model
     type "vit") writes its fusions into the file: each residual Add with the LayerNorm after
     it becomes SkipLayerNormalization, each MLP bias with its GELU BiasGelu. A session makes
     some of these itself; written into the file they measured faster on the GPU
     (BENCHMARKS.md, "ONNX Runtime on the GPU").

The model code stays plain `nn`: `fused_copy` wraps each block's attention module in a copy.
Graphs with attention weights (`model_attentions*.onnx`) keep the plain attention: the
operator returns the mixed values, not the weights rollout reads. Every graph made here is
verified against the torch model like any other (verify.py).
"""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import onnx
import torch
import torch.nn.functional as F
from onnxruntime.transformers.optimizer import optimize_model
from torch import nn
from torch.onnx import symbolic_helper

from vit_hub.model.config import ViTConfig

from .graph_check import ORT_DOMAIN


class _MultiHeadAttention(torch.autograd.Function):
    """query [B, Q, D], key and value [B, T, D], bias [1, 1, Q, T] or None -> [B, Q, D].
    Run in torch while the graph is traced; written to the graph as one operator."""

    @staticmethod
    def forward(ctx, query, key, value, bias, heads: int, scale: float):
        batch, queries, dim = query.shape

        def by_head(x: torch.Tensor) -> torch.Tensor:  # [B, n, D] -> [B, heads, n, head_dim]
            return x.reshape(batch, x.shape[1], heads, dim // heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(by_head(query), by_head(key), by_head(value), attn_mask=bias, scale=scale)
        return out.transpose(1, 2).reshape(batch, queries, dim)

    @staticmethod
    def symbolic(g, query, key, value, bias, heads: int, scale: float):
        absent = symbolic_helper._optional_input_placeholder_tensor(g)
        # inputs: query, key, value, projection bias, key padding mask, attention bias
        inputs = [query, key, value, absent, absent] + ([] if symbolic_helper._is_none(bias) else [bias])
        mixed = g.op(f"{ORT_DOMAIN}::MultiHeadAttention", *inputs, num_heads_i=heads, scale_f=scale)
        return mixed.setType(query.type())  # [B, Q, D], as the queries


class FusedAttention(nn.Module):
    """A block's `Attention` (same weights), exported as one MultiHeadAttention node."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        self.attention = attention

    def forward(self, x: torch.Tensor, output_attentions: bool = False, queries: int | None = None):
        if output_attentions:
            raise ValueError("the fused attention returns no weights; export the attentions graph unfused")
        attention = self.attention
        query, key, value = attention.to_qkv(x).chunk(3, dim=-1)  # each [B, T, D], heads side by side
        query = query[:, :queries]  # [B, Q, D]
        bias = None
        if attention.locality:
            scale = float(attention.log_scale.exp())
            itself = torch.eye(x.shape[1], device=x.device)[:query.shape[1]]  # [Q, T]
            bias = itself.masked_fill(itself == 1, float("-inf"))[None, None]  # [1, 1, Q, T], -inf: not itself
        else:
            scale = attention.head_dim**-0.5
        mixed = _MultiHeadAttention.apply(query, key, value, bias, attention.num_heads, scale)
        return attention.to_out(mixed), None


def fused_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` (in eval mode) whose blocks export their attention as one operator."""
    fused = copy.deepcopy(model).eval()
    for block in fused.blocks:
        block.attention = FusedAttention(block.attention)
    return fused


def ort_fusions(graph: Path, target: Path, config: ViTConfig) -> Path:
    """The graph at `graph` with ONNX Runtime's transformer fusions written in, saved at `target`."""
    optimized = optimize_model(str(graph), model_type="vit", num_heads=config.num_heads,
                               hidden_size=config.embed_dim, opt_level=0)
    # The exporter cannot infer shapes through the contrib node, so it named the class axis.
    (logits,) = optimized.model.graph.output  # [batch, classes]
    logits.type.tensor_type.shape.dim[1].dim_value = config.num_classes
    optimized.save_model_to_file(str(target))
    return target


def ort_operators(path: Path) -> dict[str, int]:
    """How many of each ONNX Runtime operator a graph file holds, as the export report says it."""
    nodes = onnx.load(str(path), load_external_data=False).graph.node
    return dict(sorted(Counter(node.op_type for node in nodes if node.domain == ORT_DOMAIN).items()))

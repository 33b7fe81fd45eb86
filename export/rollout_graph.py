"""Attention rollout as ONNX operators: `vit_hub.explain.rollout.attention_rollout`, step for
step, inside a graph.

    maps = rollout_map(g, attentions, config)   # [depth, B, heads, T, T] -> [B, grid_h, grid_w]

The same steps in the same order and in float32, so the graph's map equals the Python path's
to float round-off: the heads fused (ReduceMean / Max / Min), the weakest `discard_ratio` of
each matrix's patch-to-patch weights zeroed (the class token's row and column kept, ties
sharing one fate: TopK finds the weight `np.partition` would), the identity added and the rows
renormalised, the layers multiplied in order, the pooled token's row read over the patches
(`config.pooling`), each map scaled to [0, 1] (a flat map becomes zeros). Depth, tokens and
the grid are the config's, fixed when the graph is built.
"""

from __future__ import annotations

import numpy as np

from vit_hub.explain.rollout import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION, FLAT_SPREAD, fuse_heads
from vit_hub.model.config import ViTConfig

from .graph_builder import GraphBuilder

FUSIONS = {"mean": "ReduceMean", "max": "ReduceMax", "min": "ReduceMin"}


def rollout_map(g: GraphBuilder, attentions: str, config: ViTConfig, head_fusion: str = DEFAULT_HEAD_FUSION,
                discard_ratio: float = DEFAULT_DISCARD_RATIO) -> str:
    """attentions float32 [depth, B, heads, T, T] -> rollout float32 [B, grid_h, grid_w] in [0, 1]."""
    fuse_heads(np.zeros((1, 1, 1)), head_fusion)  # refuses a fusion rollout.py does not offer, in its words
    tokens = config.num_patches + 1
    fused = g.op(FUSIONS[head_fusion], attentions, g.const([2]), keepdims=0)  # [depth, B, T, T]
    mixed = _with_residual(g, _discard_lowest(g, fused, tokens, discard_ratio), tokens)
    joint = g.Gather(mixed, g.const(0), axis=0)  # [B, T, T]
    for layer in range(1, config.depth):
        joint = g.MatMul(g.Gather(mixed, g.const(layer), axis=0), joint)
    grid_h, grid_w = config.grid_size
    return _scaled(g, g.Reshape(_readout(g, joint, config.pooling), g.const([-1, grid_h, grid_w])))


def _discard_lowest(g: GraphBuilder, fused: str, tokens: int, discard_ratio: float) -> str:
    """rollout.discard_lowest of [depth, B, T, T]: each matrix's patch-to-patch weights below
    the one ranked `count` from the bottom become 0."""
    patches = tokens - 1
    count = int(discard_ratio * patches * patches)
    if count == 0:
        return fused
    block = g.Slice(fused, g.const([1, 1]), g.const([tokens, tokens]), g.const([2, 3]))  # [depth, B, N, N]
    flat = g.Reshape(block, g.const([0, 0, patches * patches]))
    lowest, _ = g.TopK(flat, g.const([count + 1]), axis=-1, largest=0, outputs=2)  # [depth, B, count + 1]
    lowest_kept = g.Unsqueeze(g.Slice(lowest, g.const([count]), g.const([count + 1]), g.const([2])), g.const([3]))
    of_patches = np.zeros((tokens, tokens), dtype=bool)
    of_patches[1:, 1:] = True  # the class token's row and column are never discarded
    dropped = g.And(g.Less(fused, lowest_kept), g.const(of_patches))  # [depth, B, T, T]
    return g.Where(dropped, g.const(0.0), fused)


def _with_residual(g: GraphBuilder, attention: str, tokens: int) -> str:
    """rollout.add_residual: (attention + I), each row divided by its sum."""
    mixed = g.Add(attention, g.const(np.eye(tokens, dtype=np.float32)))
    return g.Div(mixed, g.ReduceSum(mixed, g.const([-1]), keepdims=1))


def _readout(g: GraphBuilder, joint: str, pooling: str) -> str:
    """rollout._readout: [B, T, T] -> [B, N], the class token's row or the patch rows' mean."""
    if pooling == "cls":
        return g.Slice(g.Gather(joint, g.const(0), axis=1), g.const([1]), g.const([2**62]), g.const([1]))
    patch_rows = g.Slice(joint, g.const([1, 1]), g.const([2**62, 2**62]), g.const([1, 2]))
    return g.ReduceMean(patch_rows, g.const([1]), keepdims=0)


def _scaled(g: GraphBuilder, maps: str) -> str:
    """rollout.scale_maps of [B, h, w]: min-max scaled; a map flat to round-off becomes zeros."""
    low = g.ReduceMin(maps, g.const([-2, -1]), keepdims=1)
    high = g.ReduceMax(maps, g.const([-2, -1]), keepdims=1)
    spread = g.Sub(high, low)
    flat = g.LessOrEqual(spread, g.Mul(g.const(FLAT_SPREAD), g.Abs(high)))
    scaled = g.Div(g.Sub(maps, low), g.Where(flat, g.const(1.0), spread))
    return g.Where(flat, g.const(0.0), scaled)

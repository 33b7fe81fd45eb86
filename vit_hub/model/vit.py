"""A Vision Transformer (Dosovitskiy et al., 2021), written to be read top to bottom.

    image [B, C, H, W]
      -> patch embedding (patches.py)       [B, N, D]   N = (H/p) * (W/p) patches
      -> prepend the class token, add positions  [B, T, D]   T = 1 + N
      -> depth x Block (pre-norm attention + MLP, both residual)
      -> final LayerNorm, pool (class token or mean of patches)  [B, D]
      -> (optional tanh pre-logits layer) -> linear head  [B, num_classes]

Three options exist only so that ViTs trained elsewhere load exactly (`vit-hub import`,
vit_hub/hub/import_model.py); vit_hub's own models leave them off:
  * `class_token_position`: the class token gets a learned position embedding too. The ViT
    paper, timm and transformers add one position per token, class token included;
    vit_hub adds positions to the patch tokens only (the class token is one learned vector
    either way, so a separate position for it adds nothing when training from scratch).
  * `pre_logits`: Linear + tanh between pooling and head, the ViT paper's "representation"
    layer used for ImageNet-21k pre-training (transformers' ViTModel calls it the pooler).
  * `layer_norm_eps`: transformers' ViTs use 1e-12, timm's and vit_hub's 1e-6.
transformers keeps query, key and value as three Linear layers; stacked one above the other
they are exactly this module's fused `to_qkv` (the import concatenates them). The MLP's layers
are `fc1` and `fc2`, as in timm; checkpoints that name them by index load as well
(`upgrade_state_dict`). Fixed sin-cos positions come from vit_hub/model/positions.py.

Attention runs through the fused `F.scaled_dot_product_attention` kernel unless the caller
asks for the attention weights (`output_attentions=True`); only then is the explicit
softmax(q kᵀ) v path taken, so explanations never slow down ordinary inference. The weights
come back as the very tensors each block multiplied with its values (one per block, as in
Hugging Face's models), so `torch.autograd.grad(logit, attentions)` reaches them: a stacked
copy would be a leaf the logits do not depend on. `torch.stack(attentions)` gives
[depth, B, heads, T, T]; vit_hub's NumPy functions take either form.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from vit_hub.model.config import CONV_STEMS, ViTConfig
from vit_hub.model.patches import ConvStem, PatchEmbedding
from vit_hub.model.positions import sincos_positions

V = TypeVar("V")  # what a state dict maps weight names to: tensors, shapes


class ViTOutput(NamedTuple):
    """What VisionTransformer.forward returns (unpacks as `logits, attentions = ...`)."""

    logits: torch.Tensor  # [B, num_classes]
    # With output_attentions: depth tensors [B, heads, T, T], in the autograd graph; else None.
    attentions: tuple[torch.Tensor, ...] | None = None


class Attention(nn.Module):
    """Multi-head self-attention with one fused query/key/value projection.

    With `locality=True` this is locality self-attention (Lee et al., 2021): the softmax
    temperature is learned and each token may not attend to itself, which sharpens
    attention on small datasets.
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool, attention_dropout: float,
                 dropout: float, locality: bool):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attention_dropout = attention_dropout
        self.locality = locality
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.to_out = nn.Sequential(nn.Linear(dim, dim), nn.Dropout(dropout))
        if locality:  # learned log-temperature, starting at the usual 1/sqrt(head_dim)
            self.log_scale = nn.Parameter(torch.tensor(-0.5 * math.log(self.head_dim)))

    def forward(self, x: torch.Tensor, output_attentions: bool = False, queries: int | None = None):
        """x [B, T, D] -> (output [B, Q, D], weights [B, heads, Q, T] or None), where only the
        first `queries` tokens ask (Q = queries; None: all, Q = T)."""
        batch, tokens, dim = x.shape
        qkv = self.to_qkv(x).reshape(batch, tokens, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, T, head_dim]
        q = q[:, :, :queries]  # [B, heads, Q, head_dim]
        queries = q.shape[2]
        if self.locality:
            q, scale = q * self.log_scale.exp(), 1.0
        else:
            scale = self.head_dim**-0.5
        # LSA: True = may attend. Every token except itself. (Built from a float identity:
        # ONNX Runtime has no boolean EyeLike kernel, so exported graphs need no patching.)
        mask = torch.eye(tokens, device=x.device)[:queries] == 0 if self.locality else None
        dropout = self.attention_dropout if self.training else 0.0

        if output_attentions:
            scores = (q @ k.transpose(-2, -1)) * scale  # [B, heads, Q, T]
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            weights = scores.softmax(dim=-1)
            out = F.dropout(weights, dropout, self.training) @ v  # [B, heads, Q, head_dim]
        else:
            weights = None
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)

        out = out.transpose(1, 2).reshape(batch, queries, dim)  # heads back side by side
        return self.to_out(out), weights


class DropPath(nn.Module):
    """Stochastic depth: during training, skip the whole residual branch for a random
    subset of samples (and rescale the rest), so the network trains as an ensemble of
    shallower ones."""

    def __init__(self, rate: float):
        super().__init__()
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.rate == 0.0:
            return x
        keep = 1.0 - self.rate
        mask = x.new_empty(x.shape[0], *([1] * (x.ndim - 1))).bernoulli_(keep)  # one draw per sample
        return x * mask / keep


class Mlp(nn.Module):
    """The block's feed-forward part, applied to each token on its own:
    [B, T, D] -> fc1 -> GELU -> [B, T, hidden] -> fc2 -> [B, T, D], dropout after each layer."""

    def __init__(self, dim: int, hidden: int, dropout: float):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(self.dropout(self.act(self.fc1(x)))))


class Block(nn.Module):
    """Pre-norm transformer block: x + Attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, config: ViTConfig, drop_path: float):
        super().__init__()
        dim = config.embed_dim
        self.attention_norm = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.attention = Attention(dim, config.num_heads, config.qkv_bias, config.attention_dropout,
                                   config.dropout, config.locality_attention)
        self.mlp_norm = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.mlp = Mlp(dim, int(dim * config.mlp_ratio), config.dropout)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor, output_attentions: bool = False, queries: int | None = None):
        """x [B, T, D] -> ([B, Q, D], attention weights or None): the outputs of the first
        `queries` tokens (None: all, Q = T)."""
        attended, weights = self.attention(self.attention_norm(x), output_attentions, queries)
        x = x[:, :queries] + self.drop_path(attended)
        x = x + self.drop_path(self.mlp(self.mlp_norm(x)))
        return x, weights


# Weights saved when the MLP was an nn.Sequential name its two Linear layers by their index in it
# (Linear, GELU, Dropout, Linear, Dropout): blocks.<i>.mlp.0 is fc1, blocks.<i>.mlp.3 is fc2.
SEQUENTIAL_MLP_NAMES = {"0": "fc1", "3": "fc2"}


def upgrade_state_dict(state: Mapping[str, V], prefix: str = "") -> dict[str, V]:
    """A state dict (or any mapping keyed by weight name: tensors, shapes) of this model, with the
    names older checkpoints used (SEQUENTIAL_MLP_NAMES) changed to today's; every other name, and
    the order, unchanged. `prefix`: where the model sits in a larger one ("module." under DDP)."""
    old = re.compile(re.escape(prefix) + r"(blocks\.\d+\.mlp\.)([03])\.")

    def today(name: str) -> str:
        found = old.match(name)
        if found is None:
            return name
        return f"{prefix}{found[1]}{SEQUENTIAL_MLP_NAMES[found[2]]}.{name[found.end():]}"
    return {today(name): value for name, value in state.items()}


def _sincos_tensor(grid_h: int, grid_w: int, dim: int) -> torch.Tensor:
    """`positions.sincos_positions` as a float32 tensor [1, grid_h * grid_w, dim]."""
    return torch.from_numpy(sincos_positions(grid_h, grid_w, dim))[None]


class VisionTransformer(nn.Module):
    """Vision Transformer for image classification, built from a `ViTConfig` (architecture plus
    preprocessing and labels); `config.json` in a saved model dir holds exactly its fields.

        model = VisionTransformer(ViTConfig.from_preset("mnist"))
        model = VisionTransformer(**PRESETS["mnist"])                # the same, from keywords
        logits = model(pixel_values).logits                          # [B, num_classes]
        logits, attentions = model(pixel_values, output_attentions=True)
        # attentions: depth tensors [B, heads, T, T], post-softmax, T = 1 + patches
    """

    def __init__(self, config: ViTConfig | None = None, **fields: Any):
        super().__init__()
        if config is None:
            config = ViTConfig.from_dict(fields)
        elif fields:
            raise TypeError(f"expected a ViTConfig or its fields as keyword arguments, got both ({', '.join(fields)})")
        elif not isinstance(config, ViTConfig):
            raise TypeError(f"expected a ViTConfig, got {type(config).__name__}")
        self.config = config
        dim = config.embed_dim

        if config.patch_embedding in CONV_STEMS:
            self.patch_embedding = ConvStem(config.in_channels, dim, config.patch_size,
                                            hybrid=config.patch_embedding == "hybrid")
        else:
            self.patch_embedding = PatchEmbedding(
                config.in_channels, dim, config.patch_size, shifted=config.patch_embedding == "shifted"
            )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        # The class token's own position (imported ViTs): cls_token + cls_position is all it adds.
        self.cls_position = nn.Parameter(torch.zeros(1, 1, dim)) if config.class_token_position else None
        if config.pos_embedding == "learned":
            self.pos_embedding = nn.Parameter(torch.zeros(1, config.num_patches, dim))
        else:
            self.register_buffer("pos_embedding", _sincos_tensor(*config.grid_size, dim), persistent=False)
        self.embedding_dropout = nn.Dropout(config.dropout)
        # Stochastic depth grows linearly with depth: early blocks are almost never skipped.
        # (On the CPU even when the model is built on the meta device for its shapes: .tolist() needs data.)
        drop_rates = torch.linspace(0, config.drop_path, config.depth, device="cpu").tolist()
        self.blocks = nn.ModuleList(Block(config, rate) for rate in drop_rates)
        self.norm = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.pre_logits = (nn.Sequential(nn.Linear(dim, config.pre_logits), nn.Tanh())
                           if config.pre_logits else nn.Identity())
        # num_classes 0: no head; the pooled features are the output (a backbone to fine-tune)
        features = config.pre_logits or dim
        self.head = nn.Linear(features, config.num_classes) if config.num_classes else nn.Identity()
        self._init_weights()

    def _init_weights(self) -> None:
        """Truncated-normal(0.02) weights and zero biases, the head's included, and a near-zero
        class token. Not a zero head (the ViT paper's choice for fine-tuning): from scratch it
        passes the body no gradient until the head has learned from features that do not yet
        tell the classes apart, and a small-data run can sit at chance for dozens of epochs."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for positions in (self.pos_embedding, self.cls_position):
            if isinstance(positions, nn.Parameter):
                nn.init.trunc_normal_(positions, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)

    # Input checks ------------------------------------------------------------------
    def check_input(self, pixel_values: torch.Tensor) -> None:
        """Raise ValueError naming what was expected and what was found."""
        config = self.config
        if not isinstance(pixel_values, torch.Tensor):
            raise TypeError(f"expected pixel_values as a torch.Tensor, got {type(pixel_values).__name__}")
        if pixel_values.ndim != 4:
            raise ValueError(
                f"expected pixel_values of rank 4 [batch, {config.in_channels}, height, width], "
                f"got rank {pixel_values.ndim} with shape {list(pixel_values.shape)}"
            )
        if not pixel_values.is_floating_point():
            raise ValueError(f"expected floating-point pixel_values, got {pixel_values.dtype}")
        channels, height, width = pixel_values.shape[1:]
        if channels != config.in_channels:
            raise ValueError(f"expected {config.in_channels} input channels, got {channels}")
        patch_h, patch_w = config.patch_size
        if height % patch_h or width % patch_w:
            raise ValueError(
                f"expected an image size divisible by the patch size {patch_h}x{patch_w}, "
                f"got {height}x{width}"
            )

    def _positions(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """Position embeddings [1, N, D] for a grid; resized when the input size differs
        from the size the model was built for."""
        if (grid_h, grid_w) == tuple(self.config.grid_size):
            return self.pos_embedding
        if self.config.pos_embedding == "sincos":
            return _sincos_tensor(grid_h, grid_w, self.config.embed_dim).to(self.cls_token)
        trained_h, trained_w = self.config.grid_size
        grid = self.pos_embedding.reshape(1, trained_h, trained_w, -1).permute(0, 3, 1, 2)  # [1, D, h, w]
        grid = F.interpolate(grid, size=(grid_h, grid_w), mode="bicubic", align_corners=False)
        return grid.flatten(2).transpose(1, 2)  # [1, N, D]

    # Forward -----------------------------------------------------------------------
    def forward(self, pixel_values: torch.Tensor, output_attentions: bool = False) -> ViTOutput:
        """ViTOutput: logits [B, num_classes], and with output_attentions the attention weights
        of every block, a tuple of depth tensors [B, heads, T, T] (else None)."""
        return self.forward_from_patches(*self.embed_patches(pixel_values), output_attentions)

    def embed_patches(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """Images [B, C, H, W], checked -> (their patch embeddings [B, N, D], the grid
        (grid_h, grid_w) of the N patches): the first step of `forward`."""
        self.check_input(pixel_values)
        grid = (pixel_values.shape[-2] // self.config.patch_size[0], pixel_values.shape[-1] // self.config.patch_size[1])
        return self.patch_embedding(pixel_values), grid

    def forward_from_patches(self, patches: torch.Tensor, grid: tuple[int, int],
                             output_attentions: bool = False) -> ViTOutput:
        """`forward` from patch embeddings [B, N, D] on a grid (as `embed_patches` gives them) on:
        integrated gradients on the embeddings (gradients.py) feeds it points between two images'."""
        # With class-token pooling the head reads the class token alone, so the last block
        # computes only that token: its MLP runs on 1 token instead of T and its attention has
        # 1 query instead of T. The logits and gradients are the same at a fraction of the
        # last block's cost. Attention maps need every row: then the last block runs whole.
        class_token_only = self.config.pooling == "cls" and not output_attentions
        tokens, attentions = self._encode(patches, grid, output_attentions, 1 if class_token_only else None)
        return ViTOutput(self.forward_head(tokens), attentions)

    def forward_features(self, pixel_values: torch.Tensor,
                         output_attentions: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """Images -> (every token after the final LayerNorm [B, T, D], token 0 the class token;
        with output_attentions the attentions as `forward` returns them, else None)."""
        return self._encode(*self.embed_patches(pixel_values), output_attentions, last_queries=None)

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        """Tokens [B, T, D] (or the class token alone, [B, 1, D]) -> logits [B, num_classes]."""
        pooled = features[:, 0] if self.config.pooling == "cls" else features[:, 1:].mean(dim=1)  # [B, D]
        return self.head(self.pre_logits(pooled))

    def _tokens(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Patch embeddings [B, N, D] -> the tokens the first block reads [B, T, D]: the class
        token, then the patches with their positions."""
        patches = patches + self._positions(*grid)  # [B, N, D]
        cls = self.cls_token if self.cls_position is None else self.cls_token + self.cls_position
        cls = cls.expand(patches.shape[0], -1, -1)  # [B, 1, D]
        return self.embedding_dropout(torch.cat([cls, patches], dim=1))  # [B, T, D]

    def _encode(self, patches: torch.Tensor, grid: tuple[int, int], output_attentions: bool,
                last_queries: int | None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """Patch embeddings -> (tokens after the final LayerNorm, attentions or None). The last block
        computes only the first `last_queries` tokens ([B, Q, D]; None: all of them, [B, T, D])."""
        x = self._tokens(patches, grid)
        attentions = []
        for index, block in enumerate(self.blocks):
            is_last = index == len(self.blocks) - 1
            x, weights = block(x, output_attentions, last_queries if is_last else None)
            attentions.append(weights)
        return self.norm(x), tuple(attentions) if output_attentions else None

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        """load_state_dict accepts the weight names of older checkpoints too (`upgrade_state_dict`)."""
        upgraded = upgrade_state_dict(state_dict, prefix)
        state_dict.clear()
        state_dict.update(upgraded)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

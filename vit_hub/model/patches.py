"""How an image becomes tokens: the patch embeddings a `ViTConfig` chooses between.

    conv      one strided convolution: each p x p patch projected to a D-dim token (the ViT paper)
    shifted   the image and four copies shifted by half a patch, stacked as channels before the
              projection (shifted patch tokenization, Lee et al. 2021: each token sees its neighbours)
    convstem  a few 3x3 convolutions of stride 2 before a 1x1 projection (Xiao et al. 2021:
              early convolutions); for small data
    hybrid    the same stem twice as wide, with a second 3x3 convolution at each resolution: a
              small CNN whose feature map is the patch grid (the ViT paper's hybrids); for
              small photo folders

Each takes [B, C, H, W] pixels and returns tokens [B, N, D], N = (H/p) * (W/p), row by row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PatchEmbedding(nn.Module):
    """Cuts the image into non-overlapping patches and projects each one to a D-dim token.

    A convolution whose kernel and stride equal the patch size is exactly
    "flatten every patch, then apply one shared Linear layer".

    With `shifted=True` this is shifted patch tokenization (Lee et al., 2021, "Vision
    Transformer for Small-Size Datasets"): the image is stacked with four copies shifted
    diagonally by half a patch, so each token also sees its neighbours' pixels.
    """

    def __init__(self, in_channels: int, embed_dim: int, patch_size: list[int], shifted: bool):
        super().__init__()
        self.shifted = shifted
        self.patch_size = tuple(patch_size)
        channels = in_channels * 5 if shifted else in_channels
        self.to_tokens = nn.Conv2d(channels, embed_dim, kernel_size=self.patch_size, stride=self.patch_size)
        self.norm = nn.LayerNorm(embed_dim) if shifted else nn.Identity()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.shifted:
            images = torch.cat([images, *self._diagonal_shifts(images)], dim=1)  # [B, 5C, H, W]
        tokens = self.to_tokens(images)  # [B, D, H/p, W/p]
        return self.norm(tokens.flatten(2).transpose(1, 2))  # [B, N, D]

    def _diagonal_shifts(self, images: torch.Tensor) -> list[torch.Tensor]:
        """The image moved half a patch towards each corner, zero-filled, same size."""
        dy, dx = self.patch_size[0] // 2, self.patch_size[1] // 2
        height, width = images.shape[-2:]
        padded = F.pad(images, (dx, dx, dy, dy))  # [B, C, H + 2dy, W + 2dx]
        return [
            padded[..., top : top + height, left : left + width]
            for top, left in ((0, 0), (0, 2 * dx), (2 * dy, 0), (2 * dy, 2 * dx))
        ]


class ConvStem(nn.Module):
    """Early convolutions in place of one big patch convolution (Xiao et al., 2021, "Early
    Convolutions Help Transformers See Better").

    Each 3x3 convolution with stride 2 halves the resolution (BatchNorm, ReLU), until the
    image is the patch grid; a 1x1 convolution then projects to D. Small overlapping
    kernels give the model the locality a convolutional network has, which a ViT must
    otherwise learn from data: on small datasets that is the difference between learning
    and not. Patch sides must be powers of two: patch 8 is three halvings.

        [B, C, H, W] -> [B, D/8, H/2, W/2] -> [B, D/4, H/4, W/4] -> [B, D/2, H/8, W/8] -> [B, D, H/8, W/8]

    `hybrid=True` makes the stem a small CNN, as in the ViT paper's hybrid models: every
    resolution is twice as wide and has a second 3x3 convolution (stride 1) after the halving,
    so each token starts from features of a 43x43-pixel neighbourhood (patch 8) instead of
    15x15. On a few hundred real photos this is what brings the ViT level with a ResNet-18
    trained from scratch (BENCHMARKS.md, "Real photos over three seeds").

        [B, C, H, W] -> [B, D/4, H/2, W/2] -> [B, D/2, H/4, W/4] -> [B, D, H/8, W/8] -> [B, D, H/8, W/8]
    """

    def __init__(self, in_channels: int, embed_dim: int, patch_size: list[int], hybrid: bool = False):
        super().__init__()
        halvings = max(patch_size).bit_length() - 1
        layers, channels = [], in_channels
        for index in range(halvings):
            stride = tuple(2 if side >> index > 1 else 1 for side in patch_size)  # non-square patches
            width = max(8, embed_dim >> (halvings - index - int(hybrid)))  # hybrid: twice as wide
            layers += _convolution(channels, width, stride)
            if hybrid:
                layers += _convolution(width, width, (1, 1))
            channels = width
        self.convolutions = nn.Sequential(*layers)
        self.to_tokens = nn.Conv2d(channels, embed_dim, kernel_size=1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.to_tokens(self.convolutions(images))  # [B, D, H/p, W/p]
        return tokens.flatten(2).transpose(1, 2)  # [B, N, D]


def _convolution(channels: int, width: int, stride: tuple[int, int]) -> list[nn.Module]:
    """A 3x3 convolution (no bias: BatchNorm follows), BatchNorm, ReLU."""
    return [nn.Conv2d(channels, width, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(inplace=True)]

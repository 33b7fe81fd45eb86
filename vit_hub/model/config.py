"""ViTConfig: everything needed to rebuild a model and feed it the right pixels.

This module imports neither torch nor any other part of the package (but its field checks and
its label checks, `vit_hub.model.labels`), so the torch-free ONNX runtime and the app can read
the same config the trainer wrote. A value no model can be built from raises `ConfigError`, a
`UserError`: the command lines print it as one line.
Every field is JSON-native (ints, floats, strings, lists): `config.json` is just
`ViTConfig.to_dict()`, and loading it back gives an equal config.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from pathlib import Path
from typing import Any

from vit_hub.model.fields import ConfigError, check_fields, is_int, one_of, read_json, shown, within
from vit_hub.model.labels import check_labels

POS_EMBEDDINGS = ("learned", "sincos")
POOLINGS = ("cls", "mean")
# "shifted" = shifted patch tokenization (Lee et al. 2021). The convolutional stems, for patch
# sides that are powers of two: "convstem" = early convolutions (Xiao et al. 2021), "hybrid" =
# the same twice as wide with a second convolution at each resolution (a small CNN)
CONV_STEMS = ("convstem", "hybrid")
PATCH_EMBEDDINGS = ("conv", "shifted", *CONV_STEMS)
CANONICALIZATIONS = ("none", "digit")  # how inputs are brought to the training domain (canonical.py)
PIXEL_NORMS = ("dataset", "image")  # normalise by the training set's mean/std, or each image's own
INTERPOLATIONS = ("bilinear", "bicubic", "nearest", "lanczos", "box", "hamming")  # PIL's resampling filters
CHANNELS = (1, 3)  # grayscale or RGB
# The temperatures a fit may give (vit_hub.train.calibration searches this range); beyond it the
# probabilities are NaN (1e-45 divides the logits into infinities) or all alike (1e308).
TEMPERATURE_RANGE = (0.05, 20.0)
DIGIT_LABELS = tuple(str(digit) for digit in range(10))  # MNIST's classes, in label order (a config holds list(DIGIT_LABELS))


def size_text(size: tuple[int, ...] | list[int]) -> str:
    """How a size is written to a reader: (28, 28) -> "28x28", (28, 28, 1) -> "28x28x1"."""
    return "x".join(str(side) for side in size)

# Architecture presets. Any field given explicitly overrides the preset.
PRESETS: dict[str, dict[str, Any]] = {
    # 28x28 grayscale digits: 7x7 = 49 patches of 4x4 pixels, 0.3 M parameters. A plain ViT
    # sits on a plateau for its first epochs here; shifted patches and fixed sin-cos positions
    # (which tolerate a doubled learning rate, vit_hub.train.schedule.PRESET_LEARNING_RATES) get it
    # off quickly. Measured in BENCHMARKS.md, "MNIST".
    "mnist": dict(
        image_size=28, patch_size=4, in_channels=1, embed_dim=64, depth=6, num_heads=4,
        mlp_ratio=4.0, patch_embedding="shifted", pos_embedding="sincos", mean=[0.1307], std=[0.3081],
        labels=list(DIGIT_LABELS), canonicalize="digit",
    ),
    # Small-data preset for photo folders of a few hundred to a few thousand images:
    # small patches, a narrow and shallow model, a convolutional stem, locality attention and
    # the mean of the patch tokens (not a class token) for the head. Measured in
    # BENCHMARKS.md, "Circles vs squares".
    "small-data": dict(
        image_size=64, patch_size=8, in_channels=3, embed_dim=128, depth=6, num_heads=4,
        mlp_ratio=2.0, dropout=0.1, drop_path=0.1, patch_embedding="convstem",
        locality_attention=True, pooling="mean",
    ),
    # The ViT-Ti/16, ViT-S/16 and ViT-B/16 widths of the DeiT and ViT papers.
    "tiny": dict(image_size=224, patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "small": dict(image_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "base": dict(image_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12),
}


def preset_fields(name: str) -> dict[str, Any]:
    """A copy of the named preset's fields; a ConfigError listing the known presets otherwise."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; expected one of {', '.join(PRESETS)}")
    return dict(PRESETS[name])


def convstem_fits(patch_size: Any) -> bool:
    """Whether the convolutional stems can make patches of this size (an int or [height, width]):
    each of their stride-2 convolutions halves the image, so every side must be a power of two."""
    sides = patch_size if isinstance(patch_size, (list, tuple)) else [patch_size]
    return all(is_int(side) and side > 0 and side & (side - 1) == 0 for side in sides)


# Upper bounds of every size a config.json may ask for, far beyond any published ViT (ViT-22B:
# width 6144, depth 48, MLP 24576; ImageNet-21k: 21,843 classes; SAM: 64x64 patches at 1024 px),
# so that a 1 KB config cannot make a model, a label list or an image of absurd size.
MAX_WIDTH = 16_384  # embed_dim, num_heads, pre_logits
MAX_HIDDEN = 4 * MAX_WIDTH  # the MLP's hidden width, embed_dim x mlp_ratio
MAX_DEPTH = 512
MAX_CLASSES = 100_000
MAX_IMAGE_SIDE = 4_096  # pixels, each side of image_size and patch_size
MAX_PATCHES = 4_096  # tokens per image: the attention maps grow with its square


def _pair(value: Any, name: str) -> list[int]:
    """28 -> [28, 28]; (32, 48) -> [32, 48]. Always a JSON-native list of two ints (types and
    ranges are checked by `check_fields` first)."""
    if isinstance(value, int):
        value = [value, value]
    if len(value) != 2:
        raise ConfigError(f"{name}: expected an int or [height, width], got {shown(value)}")
    return [int(v) for v in value]


def _floats(value: Any, name: str, length: int) -> list[float]:
    if isinstance(value, numbers.Real):
        value = [value] * length
    values = [float(v) for v in value]
    if len(values) == 1 and length > 1:
        values = values * length
    if len(values) != length:
        raise ConfigError(f"{name}: expected {length} values (one per channel), got {len(values)}")
    if not all(math.isfinite(v) for v in values):
        raise ConfigError(f"{name}: expected finite numbers, got {values}")
    return values


@dataclasses.dataclass
class ViTConfig:
    """Architecture and preprocessing of one Vision Transformer.

    Args:
        image_size: input height and width in pixels (an int means square).
        patch_size: patch height and width; must divide image_size.
        in_channels: 1 for grayscale, 3 for RGB. Images are converted to this.
        num_classes: number of outputs; taken from `labels` when those are given. 0 (no labels):
            no head, the model returns its pooled features (a backbone imported to fine-tune from).
        embed_dim: token width D.
        depth: number of transformer blocks.
        num_heads: attention heads per block; must divide embed_dim.
        mlp_ratio: hidden width of each MLP as a multiple of embed_dim.
        qkv_bias: whether the query/key/value projection has a bias.
        dropout: dropout after the embedding, inside the MLP and after attention.
        attention_dropout: dropout on the attention weights.
        drop_path: stochastic-depth rate of the last block (rates grow linearly from 0).
        pos_embedding: "learned" or fixed 2-D "sincos".
        pooling: "cls" (the class token) or "mean" (mean of patch tokens) feeds the head.
        patch_embedding: "conv" (ViT), "shifted" (shifted patch tokenization), "convstem"
            (early convolutions) or "hybrid" (a small CNN); all but the first are for small data.
        locality_attention: learnable temperature and no self-token attention (LSA, small data).
        layer_norm_eps: epsilon of every LayerNorm.
        mean, std: per-channel normalisation applied after scaling pixels to [0, 1]
            (training measures them on the training split unless given).
        pixel_norm: "dataset" (mean and std above) or "image" (each image's own mean and std
            per channel, which removes colour casts and exposure differences).
        labels: class names, index i is output i.
        canonicalize: how any input is first brought into the training images' domain:
            "none", or "digit" (light ink on black, cropped, scaled and centred like MNIST;
            see vit_hub/processing/canonical.py).
        class_token_position: the class token gets a learned position embedding of its own, as
            in the ViT paper, timm and transformers (models imported from them); vit_hub's own
            models add positions to the patch tokens only.
        pre_logits: width of a tanh layer between pooling and head (the ViT paper's
            "representation" layer for ImageNet-21k pre-training, transformers' ViTModel
            pooler); 0: none.
        interpolation: the resampling filter that resizes images to image_size (PIL's names;
            timm's ViTs were trained with bicubic).
        temperature: probabilities are softmax(logits / temperature); fitted on the validation
            split when training ends (vit_hub.train.calibration), 1.0 where nothing was fitted.
    """

    image_size: int | list[int] = within(224, 1, MAX_IMAGE_SIDE, what="sides")
    patch_size: int | list[int] = within(16, 1, MAX_IMAGE_SIDE, what="sides")
    in_channels: int = one_of(3, CHANNELS)
    num_classes: int | None = within(None, 0, MAX_CLASSES)
    embed_dim: int = within(768, 1, MAX_WIDTH)
    depth: int = within(12, 1, MAX_DEPTH)
    num_heads: int = within(12, 1, MAX_WIDTH)
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    dropout: float = 0.0
    attention_dropout: float = 0.0
    drop_path: float = 0.0
    pos_embedding: str = one_of("learned", POS_EMBEDDINGS)
    pooling: str = one_of("cls", POOLINGS)
    patch_embedding: str = one_of("conv", PATCH_EMBEDDINGS)
    locality_attention: bool = False
    layer_norm_eps: float = 1e-6
    mean: float | list[float] | None = None
    std: float | list[float] | None = None
    labels: list[str] | None = None
    canonicalize: str = one_of("none", CANONICALIZATIONS)
    pixel_norm: str = one_of("dataset", PIXEL_NORMS)
    class_token_position: bool = False
    pre_logits: int = within(0, 0, MAX_WIDTH)
    interpolation: str = one_of("bilinear", INTERPOLATIONS)
    temperature: float = 1.0

    def __post_init__(self) -> None:
        check_fields(self)  # each field alone: its type, choices and range, as declared above
        self._check_numbers()  # the ranges of the float fields
        self._normalise()  # the JSON-native form a config.json holds
        self._check_normalised()  # what the fields must be together

    def _check_numbers(self) -> None:
        """The ranges of the float fields, on the values as given (so a message shows what was given)."""
        low, high = TEMPERATURE_RANGE
        if not low <= self.temperature <= high:  # also refuses NaN
            raise ConfigError(f"temperature: expected a number from {low} to {high} (what a fit on the validation "
                             f"split gives), got {self.temperature}")
        hidden = self.embed_dim * float(self.mlp_ratio)
        if not (math.isfinite(hidden) and 1 <= int(hidden) <= MAX_HIDDEN):
            raise ConfigError(f"mlp_ratio: expected a positive ratio (hidden width embed_dim x mlp_ratio from 1 to "
                             f"{MAX_HIDDEN:,}), got {float(self.mlp_ratio)}")
        for name in ("dropout", "attention_dropout", "drop_path"):
            rate = float(getattr(self, name))
            if not 0.0 <= rate < 1.0:
                raise ConfigError(f"{name}: expected a rate in [0, 1), got {rate}")
        if not 0.0 < self.layer_norm_eps < 1.0:
            raise ConfigError(f"layer_norm_eps: expected a small positive number, got {self.layer_norm_eps}")

    def _normalise(self) -> None:
        """The JSON-native form: sizes as [height, width], one float per channel for mean and std
        (0.5 where not given), floats, and labels and num_classes that fill in each other."""
        self.image_size = _pair(self.image_size, "image_size")
        self.patch_size = _pair(self.patch_size, "patch_size")
        self.mean = _floats(0.5 if self.mean is None else self.mean, "mean", self.in_channels)
        self.std = _floats(0.5 if self.std is None else self.std, "std", self.in_channels)
        for name in ("mlp_ratio", "dropout", "attention_dropout", "drop_path", "temperature"):
            setattr(self, name, float(getattr(self, name)))
        if self.labels is not None:
            self.labels = list(self.labels)
        if self.num_classes is None:
            self.num_classes = 1000 if self.labels is None else len(self.labels)
        if self.labels is None:
            self.labels = [str(i) for i in range(self.num_classes)]

    def _check_normalised(self) -> None:
        """What the fields must be together: patches that tile the image, heads that split the
        width, a stem that fits the patches, one label per class, positive stds."""
        for size, patch, axis in zip(self.image_size, self.patch_size, ("height", "width")):
            if size % patch:
                raise ConfigError(f"image {axis} {size} is not divisible by patch {axis} {patch}")
        if self.num_patches > MAX_PATCHES:
            raise ConfigError(f"image_size {self.image_size} / patch_size {self.patch_size}: expected at most "
                             f"{MAX_PATCHES:,} patches, found {size_text(self.grid_size)}")
        if self.embed_dim % self.num_heads:
            raise ConfigError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        if self.patch_embedding in CONV_STEMS and not convstem_fits(self.patch_size):
            raise ConfigError(f"patch_embedding {self.patch_embedding}: expected patch sides that are powers of two "
                             f"(each stride-2 convolution halves the image), got patch_size {self.patch_size}")
        self._check_labels()
        if min(self.std) <= 0:
            raise ConfigError(f"std: expected positive values, got {self.std}")

    def _check_labels(self) -> None:
        """At most MAX_CLASSES labels, each one a person can read and tell apart from the others
        (`vit_hub.model.labels`: "7" and "7 ", Latin "o" and Cyrillic "о" would read as one class)."""
        if len(self.labels) > MAX_CLASSES:
            raise ConfigError(f"labels: expected at most {MAX_CLASSES:,}, found {len(self.labels):,}")
        check_labels(self.labels)
        if self.num_classes != len(self.labels):
            raise ConfigError(f"num_classes {self.num_classes} does not match the {len(self.labels)} labels given")

    # Derived quantities --------------------------------------------------------------
    @property
    def grid_size(self) -> tuple[int, int]:
        """Patches along height and width."""
        return (self.image_size[0] // self.patch_size[0], self.image_size[1] // self.patch_size[1])

    @property
    def num_patches(self) -> int:
        return math.prod(self.grid_size)

    @property
    def num_tokens(self) -> int:
        """Sequence length T: the class token plus one token per patch."""
        return 1 + self.num_patches

    def check_has_head(self, what: str) -> None:
        """A features-only model (num_classes 0, e.g. an imported ViTModel) ranks no labels:
        `what` (predict, the app, ...) fails with one line saying what to do instead."""
        if self.num_classes == 0:
            raise ConfigError(f"{what}: expected a classifier, found a model without a head (features only, "
                             f"num_classes 0); fine-tune one from it: vit-hub train --init MODEL --data FOLDER")

    # Serialisation ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ViTConfig":
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; expected a subset of {sorted(known)}")
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | Path) -> "ViTConfig":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"expected a vit_hub config.json at {path}, found nothing")
        values = read_json(path)
        if not isinstance(values, dict) or "embed_dim" not in values or "patch_size" not in values:
            raise ConfigError(f"{path} is not a vit_hub config (expected keys like embed_dim and patch_size)")
        return cls.from_dict(values)

    @classmethod
    def from_preset(cls, preset: str | None = None, **overrides: Any) -> "ViTConfig":
        """A preset's fields, then every override that is not None."""
        values = preset_fields(preset) if preset else {}
        values.update({key: value for key, value in overrides.items() if value is not None})
        return cls.from_dict(values)


SMALL_DATA_IMAGES = 10_000  # fewer training images than this get the small-data preset
PHOTO_SIDE = 40  # a median shorter side above this many pixels: photos, not digits or icons
# Photos on the small-data preset: this width, the hybrid stem and no dropout (BENCHMARKS.md,
# "Real photos over three seeds")
SMALL_PHOTO_WIDTH = 192


def is_small_photo_folder(num_train: int, median_side: int) -> bool:
    """Photos, and few enough of them for the small-data preset."""
    return median_side > PHOTO_SIDE and num_train < SMALL_DATA_IMAGES


def suggest_for_data(num_train: int, channels: int, median_side: int) -> dict[str, Any]:
    """Architecture for a dataset nobody chose one for.

    From-scratch ViTs need many images; with few, a wide ViT at 224 px sits at chance.
    So: a resolution near the images' own (at most 64 px under 20k images), an 8x8
    patch grid, and on small data a narrow model with a convolutional stem, locality
    attention and stochastic depth (the small-data preset); for photos, 192 channels wide (2.8
    points above 128 on every seed of a real photo folder) behind the hybrid stem, a small CNN
    (3.2 points more; vit_hub.model.patches.ConvStem), without dropout (stochastic depth
    alone regularises it: as good on average, steadier across seeds), at a lower learning
    rate (vit_hub.train.schedule). Photos are standardised per image: with the dataset's
    statistics a pale set (microscopy) has tiny channel stds, colour jitter moves its inputs by
    several of them, and the model never leaves chance (BENCHMARKS.md, "Stain-shifted cells").
    """
    if median_side <= PHOTO_SIDE:
        image_size = 32 if median_side > 28 else 28
    elif num_train < 20_000:
        image_size = 64
    else:
        image_size = 224 if median_side >= 160 else 96
    patch_size = {28: 4, 32: 4, 64: 8, 96: 12, 224: 16}[image_size]
    if num_train < SMALL_DATA_IMAGES:
        values = preset_fields("small-data")
        if is_small_photo_folder(num_train, median_side):
            values.update(embed_dim=SMALL_PHOTO_WIDTH, patch_embedding="hybrid", dropout=0.0)
    elif num_train < 100_000:
        values = dict(embed_dim=192, depth=9, num_heads=3, mlp_ratio=2.0, drop_path=0.1)
    else:
        values = dict(preset_fields("tiny"), drop_path=0.1)
    values.update(image_size=image_size, patch_size=patch_size, in_channels=channels)
    if median_side > PHOTO_SIDE:  # photos: exposure, contrast and colour cast differ between acquisitions
        values.update(pixel_norm="image")
    return values

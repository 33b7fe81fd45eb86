"""vit_hub: a Vision Transformer from scratch, trained on any image folder, shipped to the
Hugging Face Hub, ONNX Runtime and a Gradio app with attention-rollout overlays.

Importing the package is light: `vit_hub.config` and `vit_hub.preprocess` need no torch
(the ONNX runtime uses them), and the torch-based names below load on first use.
"""

from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "PRESETS": "config", "ViTConfig": "config", "VisionTransformer": "pretrained",
    "load_model": "pretrained", "push_to_hub": "hub", "pull": "hub", "predict_images": "predict",
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'vit_hub' has no attribute {name!r}")

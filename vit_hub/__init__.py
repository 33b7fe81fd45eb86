"""vit_hub: a Vision Transformer from scratch, trained on any image folder, shipped to the
Hugging Face Hub, ONNX Runtime and a Gradio app with attention-rollout overlays.

Importing the package is light: `vit_hub.config` and `vit_hub.preprocess` need no torch
(the ONNX runtime uses them), and the torch-based names below load on first use.
"""

import importlib.util
import sys
from importlib import import_module
from pathlib import Path

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


def _export_from_the_checkout() -> None:
    """Make `vit_hub.export` importable where this package runs from a source checkout with no
    install mapping it (a plain `pip install .`, then `python app.py` in the checkout). Its
    sources are the checkout's top-level export/ folder, which an install maps into this
    package (pyproject.toml): a top-level `export` would collide in users' environments."""
    name, folder = f"{__name__}.export", Path(__file__).resolve().parent.parent / "export"
    if not (folder / "__init__.py").is_file() or importlib.util.find_spec(name) is not None:
        return  # an install, or a checkout whose editable install maps the folder
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])
    sys.modules[name] = globals()["export"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[name])


_export_from_the_checkout()

"""vit_hub: a Vision Transformer from scratch, trained on any image folder, shipped to the
Hugging Face Hub, ONNX Runtime and a Gradio app with attention-rollout overlays.

Importing the package is light: `vit_hub.model.config` and `vit_hub.processing.preprocess`
need no torch (the ONNX runtime uses them), and the torch-based names below load on first use.
`vit_hub.VisionTransformer` is the savable model (`vit_hub.hub.pretrained.HubVisionTransformer`,
the pure `nn` `vit_hub.model.vit.VisionTransformer` with the Hub's save and load).
docs/architecture.md shows where everything lives.
"""

import importlib.util
import sys
from importlib import import_module
from pathlib import Path

__version__ = "0.1.0"

_LAZY = {  # public name -> (module, its name there)
    "PRESETS": ("model.config", "PRESETS"), "ViTConfig": ("model.config", "ViTConfig"),
    "VisionTransformer": ("hub.pretrained", "HubVisionTransformer"), "load_model": ("hub.pretrained", "load_model"),
    "predict_images": ("hub.pretrained", "predict_images"), "push_to_hub": ("hub.repos", "push_to_hub"),
    "pull": ("hub.repos", "pull"),
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(import_module(f".{module}", __name__), attribute)
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

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
    """Make `vit_hub.export` the export/ folder of the checkout this package was imported from.
    An install copies that folder into the package (pyproject.toml maps it: a top-level `export`
    would collide in users' environments); in a checkout, the folder sits beside the package.
    An editable install elsewhere maps `vit_hub.export` to *its* checkout, so the mapping is made
    here whenever the package runs from a checkout: a second clone first on the path then runs
    its own export code, never the first clone's."""
    package = Path(__file__).resolve().parent
    folder = package.parent / "export"
    if (package / "export").is_dir() or not (folder / "__init__.py").is_file():
        return  # an install (export/ copied inside), or no checkout around this package
    if not (package.parent / "pyproject.toml").is_file():
        return  # an export/ folder beside an installed package belongs to someone else
    name = f"{__name__}.export"
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])
    sys.modules[name] = globals()["export"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[name])


_export_from_the_checkout()

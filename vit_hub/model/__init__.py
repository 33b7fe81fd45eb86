"""The model: its config (`config.py`), the Vision Transformer itself in pure `nn` code
(`vit.py`), fixed sine-cosine positions (`positions.py`) and its FLOPs (`flops.py`).
Nothing here reads files or data; a learner can read `vit.py` top to bottom.

Import the modules themselves (`from vit_hub.model.vit import VisionTransformer`): this
file stays empty so that `vit_hub.model.config` loads without torch."""

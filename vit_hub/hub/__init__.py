"""A model as a shared artifact: model dirs and the Hugging Face Hub (`repos.py`, and
`vit-hub push`/`pull` in `push_pull.py`), saving and loading a model (`pretrained.py`), its
weights checked before use (`weight_checks.py`), the model card (`card.py`), Spaces
(`space.py`, `static_space.py` with `static_page/`), and ViTs from timm and transformers
(`import_model.py`, `key_mapping.py`, `fine_tune.py`)."""

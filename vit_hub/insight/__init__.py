"""Inside a trained model: the ViT paper's views of what it learned (`views.py`), drawn as
figures (`figures.py`), and `vit-hub inspect`, which reads a model dir and writes them
(`inspect.py`)."""

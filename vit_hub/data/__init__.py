"""The data: where images come from (`sources.py`: a folder, MNIST or a torchvision set,
split into train/val/test), image folders read safely (`folders.py`), Hugging Face datasets
(`hub_datasets.py`), the colour check
(`colour.py`), training augmentation (`augmentation.py`), batches (`batches.py`) and the
example images a model keeps (`samples.py`)."""

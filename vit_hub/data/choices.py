"""What `--data` and `--augment` accept besides a folder: the torchvision datasets read by name
and the kinds of augmentation. Torch-free, so that `vit-hub train --help` lists them without
loading torch; `sources.py` and `augmentation.py` act on them."""

# torchvision datasets already on disk, by name -> (torchvision's class, how it names its splits)
TORCHVISION_DATASETS = {
    "fashionmnist": ("FashionMNIST", "train"),
    "kmnist": ("KMNIST", "train"),
    "cifar10": ("CIFAR10", "train"),
    "cifar100": ("CIFAR100", "train"),
    "svhn": ("SVHN", "split"),
    "stl10": ("STL10", "split"),
}
AUGMENTATIONS = ("auto", "digits", "photos", "none")  # auto: digits for digit data, photos for larger images

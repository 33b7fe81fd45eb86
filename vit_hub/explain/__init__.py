"""Where the model looked: attention rollout and the overlays (`rollout.py`, plain arrays),
the registry of explanation methods (`attribution.py`), the methods that need the torch
model's gradients (`gradients.py`), and what "nothing here" is for a model (`blanking.py`)."""

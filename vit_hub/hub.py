"""Model dirs and the Hugging Face Hub: load a model from a folder or a repo id."""

from __future__ import annotations

from pathlib import Path

from .model import VisionTransformer


def load_model(reference: str | Path, revision: str | None = None, device: str = "cpu") -> VisionTransformer:
    """A model dir (config.json + model.safetensors) or a Hub repo id -> model in eval mode."""
    reference = str(reference)
    if Path(reference).exists() and not Path(reference).is_dir():
        raise ValueError(f"--model: expected a model folder or a Hub repo id, got the file {reference}")
    if Path(reference).is_dir() and not (Path(reference) / "config.json").is_file():
        raise FileNotFoundError(f"--model: expected config.json in {reference}, found none")
    model = VisionTransformer.from_pretrained(reference, revision=revision, map_location=device)
    return model.to(device).eval()

"""Calibrated probabilities: a temperature fitted on validation when training ends, kept in
config.json, applied wherever probabilities are shown; a config without one loads as 1.0."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from conftest import tiny_config, train_tiny
from vit_hub.demo.backends import TorchPredictor
from vit_hub.hub.card import render_card_text
from vit_hub.hub.pretrained import HubVisionTransformer
from vit_hub.model.config import ViTConfig
from vit_hub.model.fields import ConfigError
from vit_hub.processing.postprocess import softmax
from vit_hub.train.calibration import LOG_T_RANGE, fit_temperature


def drawn_labels(logits: np.ndarray, temperature: float, seed: int = 0) -> np.ndarray:
    """A label per row of `logits`, drawn from softmax(logits / temperature)."""
    rng = np.random.default_rng(seed)
    return np.array([rng.choice(logits.shape[1], p=row) for row in softmax(logits, temperature)])


def nll(logits: np.ndarray, labels: np.ndarray, temperature: float) -> float:
    return float(-np.log(softmax(logits.astype(np.float64), temperature)[np.arange(len(labels)), labels]).mean())


@pytest.mark.parametrize("temperature", [0.3, 2.0])  # below 1: a model less sure than it should be
def test_the_fit_finds_the_temperature_the_labels_were_drawn_with(temperature):
    logits = np.random.default_rng(0).normal(0, 3, size=(20000, 5))
    assert fit_temperature(logits, drawn_labels(logits, temperature)) == pytest.approx(temperature, rel=0.05)


def test_training_keeps_the_fitted_temperature_in_the_model_and_its_config_json(tmp_path):
    """Trainer._calibrate: the temperature fitted on the validation logits is set on the kept
    model's config and written into its config.json; with no validation images, 1.0."""
    from vit_hub.layout import ModelDir
    from vit_hub.train.loop import Trainer

    logits = np.random.default_rng(1).normal(0, 3, size=(2000, 2)).astype(np.float32)
    validation = {"logits": logits, "labels": drawn_labels(logits, 0.5)}
    trainer = types.SimpleNamespace(best_model=HubVisionTransformer(**tiny_config()), out=ModelDir(tmp_path))
    Trainer._calibrate(trainer, validation)
    fitted = fit_temperature(logits, validation["labels"])
    assert fitted == pytest.approx(0.5, rel=0.1)
    assert trainer.best_model.config.temperature == fitted == ViTConfig.from_json(tmp_path / "config.json").temperature
    Trainer._calibrate(trainer, None)
    assert ViTConfig.from_json(tmp_path / "config.json").temperature == 1.0


def test_a_config_without_a_temperature_loads_as_uncalibrated_and_a_bad_one_is_refused():
    values = ViTConfig(**tiny_config()).to_dict()
    del values["temperature"]
    assert ViTConfig.from_dict(values).temperature == 1.0
    with pytest.raises(ConfigError, match="temperature: expected a number from 0.05 to 20.0"):
        ViTConfig(**tiny_config(temperature=0.0))


def test_the_app_shows_probabilities_at_the_models_temperature(tmp_path):
    HubVisionTransformer(**tiny_config(temperature=2.5)).save_pretrained(tmp_path / "warm")
    predictor = TorchPredictor.load(tmp_path / "warm", threads=None)
    pixels = np.random.default_rng(1).normal(size=(2, 3, 16, 16)).astype(np.float32)
    with torch.inference_mode():
        logits = predictor.model(torch.from_numpy(pixels)).logits.numpy()
    np.testing.assert_allclose(predictor.predict(pixels)[0], softmax(logits / 2.5), rtol=1e-5)


@pytest.mark.slow
def test_training_fits_a_temperature_and_the_card_says_so(image_folder, tmp_path, monkeypatch):
    """The run fits once, on the validation logits, and keeps what it fitted: the temperature
    that makes those labels likelier than 1.0 and than its neighbours in the searched range."""
    from vit_hub.train import loop

    fits = []

    def recorded(logits, labels):
        fits.append((np.asarray(logits), np.asarray(labels), fit_temperature(logits, labels)))
        return fits[-1][2]

    monkeypatch.setattr(loop, "fit_temperature", recorded)
    out = train_tiny(image_folder, tmp_path / "run", epochs=3)
    temperature = json.loads((out / "config.json").read_text())["temperature"]
    [(logits, labels, fitted)] = fits
    assert temperature == fitted == ViTConfig.from_json(out / "config.json").temperature and len(labels) > 0
    assert nll(logits, labels, temperature) < nll(logits, labels, 1.0)
    low, high = np.exp(LOG_T_RANGE)  # a perfectly separated validation split fits at the range's end
    for neighbour in (temperature * 1.2, temperature / 1.2):
        assert not low <= neighbour <= high or nll(logits, labels, temperature) <= nll(logits, labels, neighbour)
    assert f"softmax(logits / {temperature:g})" in render_card_text(out)

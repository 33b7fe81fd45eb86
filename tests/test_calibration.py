"""Calibrated probabilities: a temperature fitted on validation when training ends, kept in
config.json, applied wherever probabilities are shown; old configs load with none (1.0)."""

from __future__ import annotations

import json

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
from vit_hub.train.calibration import fit_temperature


def test_the_fit_finds_the_temperature_the_labels_were_drawn_with():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=(20000, 5))
    probabilities = softmax(logits, 2.0)
    labels = np.array([rng.choice(5, p=row) for row in probabilities])
    assert fit_temperature(logits, labels) == pytest.approx(2.0, rel=0.05)


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
def test_training_fits_a_temperature_and_the_card_says_so(image_folder, tmp_path):
    out = train_tiny(image_folder, tmp_path / "run", epochs=3)
    temperature = json.loads((out / "config.json").read_text())["temperature"]
    assert temperature != 1.0 and ViTConfig.from_json(out / "config.json").temperature == temperature
    assert f"softmax(logits / {temperature:g})" in render_card_text(out)

"""Training. Read `run.py` first: a whole `vit-hub train`, top to bottom. Beside it: the
loop (`loop.py`), its settings and their flags (`settings.py`), batch, epochs and learning
rate (`schedule.py`), one optimizer step (`step.py`), the loaders (`loaders.py`), the
checkpoint and which weights are kept (`checkpoint.py`), devices and processes
(`distributed.py`), scoring (`evaluation.py`), the log and plots (`report.py`), the
probabilities' temperature (`calibration.py`) and `vit-hub sweep` (`sweep.py`)."""

"""The README's main command: a short synthetic training run whose loss falls."""

import pytest

from sparsejax.__main__ import main
from sparsejax._synthetic import SyntheticRunConfig, run_synthetic


def test_synthetic_training_learns():
    out = run_synthetic(SyntheticRunConfig(steps=120, batch_size=256, vocab=500, features=4,
                                           dim=8, learning_rate=0.1), log=lambda *_: None)
    assert out["final_loss"] < out["first_loss"] - 0.02, out


def test_train_command_runs(capsys):
    assert main(["train", "--steps", "5", "--vocab", "100", "--batch-size", "32"]) == 0
    printed = capsys.readouterr().out
    assert "step      5  loss" in printed


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        SyntheticRunConfig(batch_size=0)

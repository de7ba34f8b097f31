"""A model folder whose weights are only pickles: refused by run and plan before anything
starts, in one line, exit status 2."""

from __future__ import annotations

import pytest
import torch

from engine.models.zoo import model_config
from tuitrain.cli import main


@pytest.mark.parametrize("command", [["plan"], ["run", "--headless", "--steps", "1"]])
def test_a_folder_with_only_bin_weights_is_one_line_and_status_2(command, tmp_path, capsys,
                                                                  monkeypatch):
    monkeypatch.setenv("TUITRAIN_CONFIG", str(tmp_path / "config"))
    folder = tmp_path / "pickled"
    model_config("tiny").save_pretrained(folder)
    torch.save({}, folder / "pytorch_model.bin")
    assert main([command[0], str(folder), *command[1:]]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert len(captured.err.splitlines()) == 1
    assert captured.err.startswith("tuitrain: error: ")
    assert "only .bin (pickle) weights" in captured.err

"""diffusion-pipe's signal files (``train/dp_layout.py``): ``save`` asks for a checkpoint now, ``save_quit`` for a
checkpoint and a stop (the stop file); each is taken once. ``tests/ranks/test_dp_run_folder.py`` writes the layout
in a real run."""
from __future__ import annotations

from pipetrain.backend.run.folder import RunDir
from pipetrain.backend.train.dp_layout import take_signals


def test_save_and_save_quit_files_are_taken_once(tmp_path):
    run = RunDir(tmp_path)
    assert take_signals(run) is False and not run.stop_requested()
    (tmp_path / "save").touch()
    assert take_signals(run) is True and not (tmp_path / "save").exists() and not run.stop_requested()
    assert take_signals(run) is False
    (tmp_path / "save_quit").touch()
    take_signals(run)
    assert run.stop_requested() and not (tmp_path / "save_quit").exists()

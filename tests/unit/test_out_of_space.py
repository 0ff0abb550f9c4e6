# SPDX-License-Identifier: GPL-3.0-or-later
"""A full disk under the run folder, for real (a small tmpfs; needs root, skips elsewhere): the per-step status
write says which folder is full, and the run's failure is still written into the status."""
import contextlib
import json
import subprocess

import pytest

from pipetrain.backend.fsutil import OutOfSpace
from pipetrain.backend.run.folder import RunDir
from pipetrain.backend.train.events import RunReporter


@contextlib.contextmanager
def small_disk(folder, size="256k"):
    folder.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def _fill(folder):
    with open(folder / "filler", "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"x" * 4096)


def test_status_on_a_full_disk_names_the_folder_and_the_failure_is_still_written(tmp_path):
    with small_disk(tmp_path / "run") as folder:
        reporter = RunReporter(RunDir(folder), enabled=True)
        reporter.update(state="training", step=1)
        _fill(folder)
        with pytest.raises(OutOfSpace) as raised:
            reporter.update(state="training", step=2)
        assert str(raised.value).startswith(f"no space left in {folder}:")
        reporter.fail(str(raised.value))
        status = json.loads((folder / "status.json").read_text())
        left = sorted(p.name for p in folder.iterdir())
    assert status["state"] == "failed" and status["error"] == str(raised.value)
    assert status["step"] == 2
    assert left == ["events.jsonl", "filler", "status.json"] or left == ["filler", "status.json"]   # no .tmp

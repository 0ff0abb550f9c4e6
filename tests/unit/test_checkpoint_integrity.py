# SPDX-License-Identifier: GPL-3.0-or-later
"""A checkpoint's files are checked against the digests written when it was saved, and nothing in a run folder
is unpickled beyond tensors and plain values: in-process, on real files (the DeepSpeed side: tests/ranks/
test_train_faults.py::test_damaged_or_planted_checkpoint_is_not_resumed)."""
import json
import os

import pytest
import torch

from pipetrain.backend.errors import CheckpointError
from pipetrain.backend.train import checkpoint


def _saved(root, step, files=None):
    """A complete checkpoint folder with its digests, written as ``checkpoint.save`` writes them."""
    folder = root / checkpoint.tag_for(step)
    folder.mkdir(parents=True)
    files = files or {"layer_01-model_states.pt": os.urandom(4096), "mp_rank_00_model_states.pt": b"x" * 300}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    digests = {name: checkpoint._digest(folder / name) for name in checkpoint._listed_files(folder)}
    (folder / checkpoint.DIGESTS).write_text(json.dumps(digests))
    (folder / checkpoint.COMPLETE).write_text(json.dumps({"global_step": step}))
    return folder


def test_a_damaged_or_cut_newest_checkpoint_is_passed_over(tmp_path):
    _saved(tmp_path, 4)
    newest = _saved(tmp_path, 8)
    (tmp_path / "latest").write_text("step00000008")
    assert checkpoint.resume_tag(tmp_path) == ("step00000008", [])

    layer = newest / "layer_01-model_states.pt"
    data = bytearray(layer.read_bytes())
    data[1000] ^= 0x01                                          # one flipped bit, same size
    layer.write_bytes(bytes(data))
    tag, skipped = checkpoint.resume_tag(tmp_path)
    assert tag == "step00000004"
    assert skipped == [("step00000008", f"{layer} differs from the file saved (its SHA-256 does not match)")]

    layer.write_bytes(bytes(data[:2000]))                       # cut short
    assert "has 2000 bytes, 4096 when saved" in checkpoint.resume_tag(tmp_path)[1][0][1]

    layer.unlink()
    assert checkpoint.verify(newest) == f"{layer} is missing"


def test_a_file_planted_beside_a_checkpoints_files_is_refused(tmp_path):
    folder = _saved(tmp_path, 4)
    (folder / "layer_09-model_states.pt").write_bytes(b"planted")   # DeepSpeed globs layer files
    assert checkpoint.verify(folder) == f"{folder / 'layer_09-model_states.pt'} is not among the files the " \
                                        "checkpoint was saved with"
    assert checkpoint.resume_tag(tmp_path)[0] is None


def test_latest_names_only_a_checkpoint_inside_its_run(tmp_path):
    run = tmp_path / "run" / "checkpoints"
    _saved(run, 2), _saved(run, 3)
    outside = _saved(tmp_path / "elsewhere", 9)
    for target in (str(outside), "../../elsewhere/step00000009", "step00000009/../../../elsewhere/step00000009"):
        (run / "latest").write_text(target)
        assert checkpoint.latest_tag(run) == "step00000003", target
        assert checkpoint.resume_tag(run)[0] == "step00000003", target
    (run / "step00000009").symlink_to(outside)                 # a complete-looking link to another folder
    (run / "latest").write_text("step00000009")
    assert checkpoint.latest_tag(run) == "step00000003"



def test_a_latest_that_is_no_file_of_a_line_is_not_read(tmp_path):
    """``latest`` is read on every panel poll: a FIFO there would hold the reading thread for ever, /dev/zero fill its
    memory; each is passed over for the newest complete checkpoint, unread."""
    import threading

    run = tmp_path / "checkpoints"
    _saved(run, 2)
    os.mkfifo(run / "latest")
    found = []
    reader = threading.Thread(target=lambda: found.append(checkpoint.latest_tag(run)), daemon=True)
    reader.start()
    reader.join(10)
    assert found == ["step00000002"]
    (run / "latest").unlink()
    (run / "latest").symlink_to("/dev/zero")
    assert checkpoint.latest_tag(run) == "step00000002"


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_pickle_that_runs_code_is_refused_by_name(tmp_path, monkeypatch):
    from pipetrain.backend.train.patches_deepspeed import load_weights_only

    monkeypatch.chdir(tmp_path)
    planted = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": _Payload()}, planted)
    with pytest.raises(CheckpointError, match=f"^{planted} holds more than tensors and plain values"):
        load_weights_only(planted)
    assert not (tmp_path / "PWNED").exists()
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.arange(3), "step": 4, "lrs": [0.1]}, plain)
    assert torch.equal(load_weights_only(plain)["w"], torch.arange(3))
    plain.write_bytes(plain.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"^{plain} cannot be read"):
        load_weights_only(plain)


def test_a_digests_entry_is_quoted_only_as_a_file_name(tmp_path):
    """``digests.json`` is a file of the run folder: an entry that is no checkpoint file's name (a line of another
    file, a path out of the folder) is refused without being quoted into the run's warning events."""
    import json

    folder = _saved(tmp_path, 4)
    digests = json.loads((folder / "digests.json").read_text())
    for entry in ("root:x:0:0:root:/root:/bin/bash", "/etc/passwd", "../../../etc/passwd"):
        (folder / "digests.json").write_text(json.dumps({**digests, entry: {"bytes": 1, "sha256": "0"}}))
        problem = checkpoint.verify(folder)
        assert problem == f"{folder / 'digests.json'} lists an entry that is not a file of the checkpoint", problem
    (folder / "digests.json").write_text(json.dumps({**digests, "layer_07-model_states.pt": {"bytes": 1}}))
    assert checkpoint.verify(folder) == f"{folder / 'layer_07-model_states.pt'} is missing"

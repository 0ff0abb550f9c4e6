"""A failed run's message (``status.json`` error, its ``error`` event: what ``/pipetrain/runs`` and the panel show
anyone who reaches the server) names the run's own files and keys and never quotes what a file holds."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipetrain.backend.errors import DatasetError
from pipetrain.backend.train.failure import explain_failure


def raised(action) -> BaseException:
    try:
        action()
    except BaseException as e:   # noqa: BLE001  (the exception a library raises, as the trainer catches it)
        return e
    raise AssertionError("nothing raised")


def test_a_librarys_message_loses_quoted_content_and_foreign_paths(tmp_path):
    run, data = tmp_path / "out" / "run-1", tmp_path / "data"
    run.mkdir(parents=True)
    data.mkdir()
    secret = tmp_path / "elsewhere" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("hunter2-password\n")
    own = (run, data)
    # a value read from a file and parsed, as a library would: the message quotes the line
    e = raised(lambda: int(secret.read_text().strip()))
    message = explain_failure(e, "run-1", own=own)
    assert "hunter2" not in message and message.startswith("ValueError: invalid literal for int() with base 10: '…'")
    assert message.endswith("(its traceback is in the training log)")
    # a file the run was never given (a link's target, a library's own file): not named
    e = raised(lambda: open(secret.with_name("gone.bin"), "rb"))
    message = explain_failure(e, "run-1", own=own)
    assert str(tmp_path / "elsewhere") not in message and "No such file or directory" in message, message
    e = raised(lambda: open("/proc/self/environ/x", "rb"))
    assert "/proc" not in explain_failure(e, "run-1", own=own)
    # the run's own files, and those its config names, stay named
    e = raised(lambda: open(run / "checkpoints" / "missing.pt", "rb"))
    assert str(run / "checkpoints" / "missing.pt") in explain_failure(e, "run-1", own=own)
    e = raised(lambda: open(data / "a.png" / "x", "rb"))
    assert str(data / "a.png") in explain_failure(e, "run-1", own=own)
    e = raised(lambda: open(str(run) + "/../../elsewhere/secret.txt/x", "rb"))   # .. out of the run's folder
    assert "elsewhere" not in explain_failure(e, "run-1", own=own)
    # a message without quotes or paths (out of memory, a shape mismatch) reads as it did
    e = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB")
    assert explain_failure(e, "run-1", own=own).startswith(f"RuntimeError: {e}")
    # PipeTrain's own errors are written to name what the run was given: as they are
    ours = DatasetError(f"{data}: contains no images")
    assert explain_failure(ours, "run-1", own=own) == str(ours)


def test_a_lost_peer_message_loses_foreign_paths_and_names_the_resume():
    e = RuntimeError("[/opt/build/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:29500 "
                     "'secret-token'")
    message = explain_failure(e, "lost-run")
    assert message.startswith("lost contact with another rank") and "--resume lost-run" in message, message
    assert "/opt/build" not in message and "secret-token" not in message
    assert explain_failure(e, "lost-run", peer=(1, "rank 1 failed: out of memory")) == \
        "rank 1 failed: out of memory (rank 1)"


@pytest.mark.parametrize("text", ["'/etc/passwd'", '"root:x:0:0"', "/home/someone/.ssh/id_rsa"])
def test_nothing_outside_the_run_survives_in_any_spelling(text, tmp_path):
    message = explain_failure(KeyError(text), "r", own=(tmp_path,))
    assert "passwd" not in message and "root:x" not in message and "id_rsa" not in message, message
    assert Path(tmp_path).name not in message or str(tmp_path) in message


def test_the_trainer_names_its_run_folder_and_the_files_its_config_names(tmp_path):
    from pipetrain.backend.config import DatasetConfig, RunConfig
    from pipetrain.backend.run.folder import RunDir
    from pipetrain.backend.config.schema import from_dict
    from pipetrain.backend.train.trainer import Trainer, TrainOptions

    cfg = from_dict(RunConfig, {"output_dir": str(tmp_path / "out"), "dataset": "d.toml", "lora_dir": "loras",
                                "model": {"type": "flux", "diffusion_model": "/models/flux.safetensors",
                                          "vae": "/models/ae.safetensors"}})
    cfg._file = tmp_path / "run.toml"
    cfg._dataset = from_dict(DatasetConfig, {"directory": [{"path": "imgs", "control_path": "/ctl"}]})
    cfg._dataset._base = tmp_path
    trainer = Trainer(cfg, TrainOptions())
    trainer.run_dir = RunDir(tmp_path / "out" / "r")
    assert set(trainer.own_paths()) == {tmp_path / "out" / "r", tmp_path / "out", Path("/models/flux.safetensors"),
                                         Path("/models/ae.safetensors"), tmp_path / "loras", tmp_path / "imgs",
                                         Path("/ctl")}

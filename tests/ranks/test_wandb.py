# SPDX-License-Identifier: GPL-3.0-or-later
"""[monitoring] enable_wandb: global rank 0 logs the run's scalars to Weights & Biases. wandb is not installed
here, so a stand-in package (it records every call to a file) takes its place on the ranks' path; the test
checks what PipeTrain hands to wandb's API, not wandb itself."""
import json
import os

import pytest

from tests.conftest import train

pytestmark = pytest.mark.slow

STAND_IN = '''
import json, os
_LOG = os.environ["PIPETRAIN_TEST_WANDB_LOG"]
def _record(call, **kw):
    with open(_LOG, "a") as f:
        f.write(json.dumps({"call": call, **kw}) + "\\n")
def login(key=None):
    _record("login", key=key)
class _Run:
    def log(self, values, step=None):
        _record("log", values=values, step=step)
    def finish(self):
        _record("finish")
def init(**kw):
    _record("init", **kw)
    return _Run()
'''


def test_a_run_logs_its_scalars_to_wandb_and_never_the_key(micro_flux_files, make_run, tmp_path, monkeypatch):
    package = tmp_path / "stand_in" / "wandb"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN)
    log = tmp_path / "wandb-calls.jsonl"
    monkeypatch.setenv("PIPETRAIN_TEST_WANDB_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(package.parent),
                                                                    os.environ.get("PYTHONPATH")])))
    config = make_run(micro_flux_files, images=2, epochs=1, run_name="logged",
                      monitoring={"enable_wandb": True, "wandb_api_key": "abcdef0123456789",
                                  "wandb_tracker_name": "my-project"})
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-3000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    kinds = [c["call"] for c in calls]
    assert kinds[:2] == ["login", "init"] and kinds[-1] == "finish" and kinds.count("init") == 1   # rank 0 only
    assert calls[0]["key"] == "abcdef0123456789"
    init = calls[1]
    assert (init["project"], init["name"], init["id"], init["resume"]) == ("my-project", "logged", "logged", "allow")
    assert "abcdef0123456789" not in json.dumps(init["config"])
    # nothing the run writes holds the key (#34 item 7): its run.toml, the copy beside each LoRA, events, status
    written = [run.run_dir / name for name in ("run.toml", "events.jsonl", "status.json")]
    written += [lora.with_suffix(".run.toml") for lora in run.loras()]
    assert run.loras() and all(p.is_file() for p in written), written
    for path in written:
        assert "abcdef0123456789" not in path.read_text(), path
    assert 'wandb_tracker_name = "my-project"' in run.loras()[0].with_suffix(".run.toml").read_text()
    logged = {c["step"]: c["values"]["train/loss"] for c in calls if c["call"] == "log" and "train/loss" in c["values"]}
    assert logged == {e["step"]: pytest.approx(e["loss"]) for e in run.events("step")}

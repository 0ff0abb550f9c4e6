"""``run_layout = "diffusion-pipe"``: after a real 2-rank run (2 stages), a diffusion-pipe user's script that reads
``<run>/epochN/adapter_model.safetensors`` finds the epoch's LoRA (the file in ``loras/``, ComfyUI's keys), with
PEFT's adapter_config.json and the config beside it, and ``<run>/global_stepN`` is the run's checkpoint."""
from __future__ import annotations

import json
import sys
import subprocess

import pytest
from conftest import train

# what a diffusion-pipe user's script does with a run folder: the newest epoch's adapter and its rank
DP_USER_SCRIPT = """
import glob, json, os, sys
from safetensors import safe_open
run = sys.argv[1]
epoch = max(glob.glob(os.path.join(run, 'epoch*')), key=lambda p: int(p.rsplit('epoch', 1)[1]))
with safe_open(os.path.join(epoch, 'adapter_model.safetensors'), 'pt') as f:
    keys = list(f.keys())
config = json.load(open(os.path.join(epoch, 'adapter_config.json')))
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
events = EventAccumulator(run)   # the event files in the run folder itself
events.Reload()
epoch_loss = [(e.step, e.value) for e in events.Scalars('train/epoch_loss')]
print(json.dumps({'epoch': os.path.basename(epoch), 'keys': keys, 'r': config['r'], 'epoch_loss': epoch_loss}))
"""


def test_a_dp_script_finds_each_epochs_lora_in_dps_run_folder(micro_flux_files, make_run):
    config = make_run(micro_flux_files, images=2, name="dp_layout", stages=2, epochs=2, run_layout="diffusion-pipe")
    run = train(config, 2)
    assert run.returncode == 0, run.output[-4000:]
    found = json.loads(subprocess.run([sys.executable, "-c", DP_USER_SCRIPT, str(run.run_dir)], check=True,
                                      capture_output=True, text=True).stdout)
    assert found["epoch"] == "epoch2" and found["r"] == 4
    steps = run.events("step")   # train/epoch_loss: each epoch's mean step loss, at x = the epoch
    means = [sum(e["loss"] for e in steps if e["epoch"] == k) / sum(e["epoch"] == k for e in steps) for k in (1, 2)]
    assert [x for x, _ in found["epoch_loss"]] == [1, 2]
    assert [v for _, v in found["epoch_loss"]] == pytest.approx(means, rel=1e-6)
    # diffusion-pipe's keys for ComfyUI's models (PipeTrain's file adds each module's alpha, here = rank)
    assert found["keys"] and all(k.startswith("diffusion_model.") and k.endswith((".lora_A.weight", ".lora_B.weight",
                                                                                   ".alpha")) for k in found["keys"])
    assert sum(k.endswith(".lora_A.weight") for k in found["keys"]) == sum(k.endswith(".lora_B.weight")
                                                                          for k in found["keys"]) > 0
    for epoch, lora in enumerate(run.loras(), start=1):   # the same bytes as the epoch LoRA PipeTrain announced
        assert (run.run_dir / f"epoch{epoch}" / "adapter_model.safetensors").read_bytes() == lora.read_bytes()
        assert (run.run_dir / f"epoch{epoch}" / "run.toml").is_file()
    steps = [e["step"] for e in run.events("checkpoint")]
    link = run.run_dir / f"global_step{steps[-1]}"
    assert link.is_symlink() and link.resolve() == (run.run_dir / "checkpoints" / f"step{steps[-1]:08d}").resolve()

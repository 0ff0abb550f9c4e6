# SPDX-License-Identifier: GPL-3.0-or-later
"""``ema = true`` end to end on 2 ranks (2 pipeline stages, each averaging its own weights): an EMA file beside
every saved LoRA, with the plain file's keys, loaded by ComfyUI; its values are the moving average of the step
LoRAs (``E_n = d * E_(n-1) + (1 - d) * W_n``, and ``E_1 = (1 - d) * W_1`` for lora_B, which starts at zero); a
run stopped after its first epoch's checkpoint and resumed ends with the uninterrupted run's average."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import tomli_w
import torch
from conftest import MATCH_TOLERANCE, train
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

DECAY = 0.7          # far from 1, so that 8 steps move the average visibly
STEPS_PER_EPOCH = 4  # 4 images, global batch 1


def _ema_files(run) -> dict[tuple[bool, int], str]:
    """(at_step, step or epoch) -> path, from the ema_saved events."""
    return {(e["at_step"], e["step"] if e["at_step"] else e["epoch"]): e["path"] for e in run.events("ema_saved")}


def test_ema_files_follow_the_average_of_the_step_loras_and_survive_a_resume(micro_flux_files, make_run):
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.parity.verify import check_lora

    config = make_run(micro_flux_files, images=4, name="ema", stages=2, epochs=2, save_every_n_steps=1,
                      run_name="a-whole", ema=True, ema_decay=DECAY, optimizer={"type": "adamw", "lr": 5e-3})
    whole = train(config, ranks=2)
    assert whole.returncode == 0, whole.output[-4000:]
    assert whole.run_dir.name == "a-whole"
    emas = _ema_files(whole)
    assert sorted(emas) == [(False, 1), (False, 2)] + [(True, s) for s in range(1, 9)]
    plain = {e["epoch"]: e["path"] for e in whole.events("lora_saved")}
    assert emas[(False, 2)] == plain[2].replace("-epoch0002.", "-epoch0002-ema.")   # beside the plain one
    steps = {e["step"]: load_file(e["path"]) for e in whole.events("step_lora_saved")}
    averages = {s: load_file(emas[(True, s)]) for s in range(1, 9)}

    # the recurrence over the step LoRAs, from the first step on (lora_B starts at zero)
    keys = set(steps[1])
    assert set(averages[1]) == keys and len(keys) > 0
    for k in keys:
        if "lora_B" in k:
            assert torch.allclose(averages[1][k], (1 - DECAY) * steps[1][k], atol=1e-7), k
        if "lora_" in k:
            for s in range(2, 9):
                expected = DECAY * averages[s - 1][k] + (1 - DECAY) * steps[s][k]
                assert torch.allclose(averages[s][k], expected, atol=1e-6), (k, s)
        else:   # alpha
            assert torch.equal(averages[1][k], steps[1][k])
    # the epoch files are the averages at the epochs' last steps, and not the plain LoRAs
    epoch_end = load_file(emas[(False, 2)])
    last = load_file(plain[2])
    for k in keys:
        assert torch.equal(epoch_end[k], averages[2 * STEPS_PER_EPOCH][k]), k
    assert max((epoch_end[k] - last[k]).abs().max().item() for k in keys if "lora_" in k) > 1e-4

    # ComfyUI loads it as it loads the plain LoRA, and matches the training side
    cfg = load_run_config(config)
    check = check_lora(cfg, Path(emas[(False, 2)]))
    assert check.keys_loaded == sum(k.endswith("lora_A.weight") for k in keys)
    assert check.comfy_vs_training < MATCH_TOLERANCE * max(1.0, check.scale)

    # the same run stopped after epoch 1 (max_steps; its checkpoint holds the average) and resumed
    table = tomllib.loads(config.read_text())
    split = config.with_name("split.toml")
    split.write_text(tomli_w.dumps({**table, "run_name": "b-split", "max_steps": STEPS_PER_EPOCH}))
    first = train(split, ranks=2)
    assert first.returncode == 0, first.output[-4000:]
    ckpt = first.run_dir / "checkpoints" / f"step{STEPS_PER_EPOCH:08d}"
    assert sorted(p.name for p in ckpt.glob("ema_stage*.pt")) == ["ema_stage000.pt", "ema_stage001.pt"]
    split.write_text(tomli_w.dumps({**table, "run_name": "b-split"}))
    resumed = train(split, 2, "--resume", "b-split")
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert resumed.events("resume")[-1]["step"] == STEPS_PER_EPOCH
    final = load_file(_ema_files(resumed)[(False, 2)])
    for k in keys:
        assert torch.allclose(final[k], epoch_end[k], rtol=1e-4, atol=1e-6), k

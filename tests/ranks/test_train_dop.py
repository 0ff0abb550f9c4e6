# SPDX-License-Identifier: GPL-3.0-or-later
"""Differential output preservation end to end on 2 ranks (2 pipeline stages: the rows travel through both, the
loss is computed on rank 1 and reported by rank 0): every step logs ``loss_dop``, 0 at the first step, where the
fresh LoRA is the base model, and more once it has moved (were the adapter not off in the target rows, it would stay
0); the preservation captions are cached under their own keys; a multiplier of 0 trains exactly as a run without
the option. (That the multiplier weighs the loss it adds: ``tests/unit/test_options_dop.py``.)"""
from __future__ import annotations

import pytest
import tomli_w
from conftest import train

pytestmark = pytest.mark.slow

DOP = {"diff_output_preservation": True, "trigger_word": "sks", "diff_output_preservation_class": "shape"}


def _run(make_run, files, name: str, **keys):
    config = make_run(files, images=4, name=name, stages=2, epochs=1, micro_batch_size_per_gpu=2,
                      checkpoint_every_n_epochs=None, save_every_n_epochs=None, save_every_n_steps=100, **keys)
    root = config.parent
    for caption in (root / "dataset").glob("*.txt"):          # "sks, a red circle on a white background"
        caption.write_text(f"sks, {caption.read_text()}")
    (root / "dataset.toml").write_text(tomli_w.dumps({"resolutions": [64], "enable_ar_bucket": False,
                                                      "directory": [{"path": str(root / "dataset")}]}))
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    return run


def test_dop_logs_its_loss_and_with_multiplier_0_trains_as_without_it(micro_flux_files, make_run):
    plain = _run(make_run, micro_flux_files, "plain")
    zero = _run(make_run, micro_flux_files, "zero", **DOP, diff_output_preservation_multiplier=0.0)

    assert plain.events("cached")[0]["texts_encoded"] == 4
    assert zero.events("cached")[0]["texts_encoded"] == 8        # each caption and its preservation caption
    steps = {name: run.events("step") for name, run in (("plain", plain), ("zero", zero))}
    assert [len(s) for s in steps.values()] == [2, 2]
    assert all("loss_dop" not in s for s in steps["plain"])
    dop = [s["loss_dop"] for s in steps["zero"]]
    assert dop[0] == pytest.approx(0.0, abs=1e-9)                 # a fresh LoRA (B = 0) is the base model
    assert dop[1] > 1e-7                                          # the trained LoRA departs from it
    # multiplier 0: the preservation rows change nothing that trains
    assert [s["loss"] for s in steps["zero"]] == pytest.approx([s["loss"] for s in steps["plain"]], rel=1e-5)

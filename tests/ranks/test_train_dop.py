# SPDX-License-Identifier: GPL-3.0-or-later
"""Differential output preservation end to end on 2 ranks (2 pipeline stages: the rows travel through both, the
loss is computed on rank 1 and reported by rank 0): every step logs ``loss_dop`` (0 at the first step, where the
fresh LoRA is the base model; more once it has moved), the preservation captions are cached under their own keys,
a multiplier of 0 trains exactly as a run without the option, and a multiplier of 1 trains otherwise."""
from __future__ import annotations

import pytest
import tomli_w
from conftest import train

pytestmark = pytest.mark.slow

DOP = {"diff_output_preservation": True, "trigger_word": "sks", "diff_output_preservation_class": "shape"}


def _run(make_run, files, name: str, **keys):
    config = make_run(files, images=4, name=name, stages=2, epochs=2, micro_batch_size_per_gpu=2,
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
    one = _run(make_run, micro_flux_files, "one", **DOP, diff_output_preservation_multiplier=1.0)

    assert plain.events("cached")[0]["texts_encoded"] == 4
    assert zero.events("cached")[0]["texts_encoded"] == 8        # each caption and its preservation caption
    steps = {name: run.events("step") for name, run in (("plain", plain), ("zero", zero), ("one", one))}
    assert [len(s) for s in steps.values()] == [4, 4, 4]
    assert all("loss_dop" not in s for s in steps["plain"])
    for name in ("zero", "one"):
        dop = [s["loss_dop"] for s in steps[name]]
        assert dop[0] == pytest.approx(0.0, abs=1e-9)             # a fresh LoRA (B = 0) is the base model
        assert all(d > 1e-7 for d in dop[1:])                     # the trained LoRA departs from it
    # multiplier 0: the preservation rows change nothing that trains
    assert [s["loss"] for s in steps["zero"]] == pytest.approx([s["loss"] for s in steps["plain"]], rel=1e-5)
    # multiplier 1: the first step's preservation loss and its gradient are 0, so the second step starts from the
    # plain run's weights, and its loss is the plain run's plus the preservation loss
    one, plain = steps["one"], steps["plain"]
    assert one[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-5)
    assert one[1]["loss"] == pytest.approx(plain[1]["loss"] + one[1]["loss_dop"], rel=1e-5)

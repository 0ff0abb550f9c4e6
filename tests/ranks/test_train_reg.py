# SPDX-License-Identifier: GPL-3.0-or-later
"""Regularisation images end to end on 2 ranks (2 pipeline stages: the loss is computed on rank 1, reported by
rank 0): an ``is_reg`` directory drawn in at ``reg_ratio``; every step's event and TensorBoard carry the loss of
each kind, which averaged by the step's counts give the step's loss."""
from __future__ import annotations

import pytest
import tomli_w
from conftest import train

from pipetrain.backend.commands.demo import make_dataset

pytestmark = pytest.mark.slow


def _tensorboard(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_reg_images_are_mixed_in_at_the_ratio_and_their_loss_is_logged(micro_flux_files, make_run):
    config = make_run(micro_flux_files, images=4, name="reg", stages=2, epochs=2, micro_batch_size_per_gpu=2,
                      checkpoint_every_n_epochs=None)
    root = config.parent
    make_dataset(root / "reg", 10)          # 6 regularisation images, other colours and shapes than the 4 others
    for i in range(4):
        (root / "reg" / f"img{i:02d}.png").unlink()
        (root / "reg" / f"img{i:02d}.txt").unlink()
    (root / "dataset.toml").write_text(tomli_w.dumps({
        "resolutions": [64], "enable_ar_bucket": False, "reg_ratio": 1 / 3,     # 4 training : 2 reg a epoch
        "directory": [{"path": str(root / "dataset")}, {"path": str(root / "reg"), "is_reg": True}]}))
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.events("cached")[0]["entries"] == 10
    assert run.events("engine")[0]["steps_per_epoch"] == 3           # 6 samples, global batch 2

    steps = run.events("step")
    assert len(steps) == 6
    assert any(s["reg_samples"] == 1 for s in steps)               # a mixed micro batch: per-sample losses
    for epoch in (1, 2):
        assert sum(s["reg_samples"] for s in steps if s["epoch"] == epoch) == 2
    for s in steps:
        n_reg = s["reg_samples"]
        assert ("loss_reg" in s) == (n_reg > 0) and ("loss_main" in s) == (n_reg < 2)
        # each kind's mean, weighted by its samples, is the step's loss (the mean over its 2 samples)
        mean = (s.get("loss_reg", 0.0) * n_reg + s.get("loss_main", 0.0) * (2 - n_reg)) / 2
        assert mean == pytest.approx(s["loss"], rel=1e-5)
    assert len({round(s.get("loss_reg", -1.0), 6) for s in steps} - {-1.0}) >= 2   # moves from step to step

    scalars = _tensorboard(run.run_dir)
    assert [step for step, _ in scalars["train/loss_reg"]] == [s["step"] for s in steps if s["reg_samples"]]
    assert [v for _, v in scalars["train/loss_main"]] == pytest.approx(
        [s["loss_main"] for s in steps if "loss_main" in s], rel=1e-6)

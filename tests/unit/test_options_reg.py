# SPDX-License-Identifier: GPL-3.0-or-later
"""Regularisation directories (``is_reg``, ``reg_ratio``): each epoch's plan holds the share of regularisation
samples asked for, in every epoch the same counts per bucket, every one drawn before any repeats; a plan without
them is unchanged; the loss function keeps each kind's loss sums apart; the keys are checked naming them and
reach the dataset file from the Dataset node."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from pipetrain.backend.config import DatasetConfig
from pipetrain.backend.data import EpochPlan, MediaItem, Example
from pipetrain.backend.errors import ConfigError
from pipetrain.backend.config.schema import from_dict
from pipetrain.backend.train.reg_loss import SplitLoss, group_losses

SQUARE, WIDE = (512, 512), (640, 400)


def _examples(count: int, bucket=SQUARE, prefix: str = "img") -> list[Example]:
    return [Example(MediaItem(Path(f"/data/{prefix}{i}.png"), "", 1, 1, 1, (512,)), bucket) for i in range(count)]


def _names(steps) -> list[str]:
    return [s.item.path.name for step in steps for micro in step for s in micro]


def _plan(train: list[Example], reg: list[Example], ratio: float, micro: int = 1, rank: int = 0, world: int = 1):
    return EpochPlan(train + reg, None, micro, 1, rank, world, seed=3, reg=[False] * len(train) + [True] * len(reg),
                     reg_ratio=ratio)


def test_each_epoch_holds_the_share_and_every_reg_image_comes_before_repeats():
    plan = _plan(_examples(6), _examples(10, prefix="reg"), ratio=0.25)    # 6 * 0.25 / 0.75 = 2 a epoch
    assert plan.steps_per_epoch() == 8
    seen = []
    for epoch in range(1, 6):
        names = _names(plan.epoch(epoch))
        assert len(names) == 8
        assert Counter(n.startswith("img") for n in names) == {True: 6, False: 2}   # every training image, once
        seen += [n for n in names if n.startswith("reg")]
    assert sorted(seen) == sorted(f"reg{i}.png" for i in range(10))    # 5 epochs x 2: each one exactly once
    assert _names(plan.epoch(1)) == _names(plan.epoch(1))               # deterministic
    assert {n for n in _names(plan.epoch(6)) if n.startswith("reg")} <= set(seen)   # a second pass


def test_the_reg_share_splits_over_buckets_by_their_size_the_same_every_epoch():
    reg = _examples(2, SQUARE, "reg_sq") + _examples(1, WIDE, "reg_wide")
    plan = _plan(_examples(4), reg, ratio=0.5)     # 4 wanted: 2.67 square, 1.33 wide -> 3 + 1 (largest remainder)
    assert plan.reg.counts == {SQUARE: 3, WIDE: 1}
    assert plan.steps_per_epoch() == 8
    for epoch in (1, 2, 3):
        names = _names(plan.epoch(epoch))
        assert Counter(n[:3] for n in names) == {"img": 4, "reg": 4}
        assert sum(n.startswith("reg_wide") for n in names) == 1
    # buckets are batched apart: 7 square samples give 3 batches of 2, the lone wide one none
    pairs = _plan(_examples(4), reg, ratio=0.5, micro=2)
    assert pairs.steps_per_epoch() == 3 and pairs.dropped() == {SQUARE: 1, WIDE: 1}


def test_the_data_parallel_ranks_split_the_same_epoch():
    train, reg = _examples(4), _examples(8, prefix="reg")
    ranks = [_plan(train, reg, ratio=0.5, rank=r, world=2) for r in (0, 1)]
    names = [_names(p.epoch(2)) for p in ranks]
    assert not set(names[0]) & set(names[1])
    assert len(names[0] + names[1]) == 8 and sum(n.startswith("reg") for n in names[0] + names[1]) == 4


def test_a_plan_without_reg_samples_is_unchanged():
    data = _examples(5) + _examples(3, WIDE, "w")
    plain = EpochPlan(data, None, 1, 1, 0, 1, seed=3)
    marked = EpochPlan(data, None, 1, 1, 0, 1, seed=3, reg=[False] * 8, reg_ratio=0.3)
    assert marked.reg.counts == {} and marked.epoch(2) == plain.epoch(2)


def _mse(pred, labels):
    return ((pred - labels[0]) ** 2).mean()


def test_the_split_loss_returns_the_batch_loss_and_sums_each_kind():
    split = SplitLoss(_mse)
    pred = torch.tensor([[1.0, 1.0], [0.0, 2.0], [3.0, 0.0]], requires_grad=True)
    target = torch.zeros(3, 2)
    reg = torch.tensor([True, False, True])
    loss = split(pred, (target, target, target, reg))
    assert loss.item() == pytest.approx(_mse(pred, (target,)).item())     # what trains is unchanged
    loss.backward()
    assert pred.grad is not None
    # per sample: 1, 2, 4.5 -> reg 1 + 4.5 over 2, training 2 over 1
    assert split.sums.tolist() == pytest.approx([5.5, 2.0, 2.0, 1.0, 0.0, 0.0])   # no preservation loss
    split(pred[:1], (target[:1], target[:1], target[:1], torch.tensor([False])))   # a micro batch of one
    sums = split.step_sums(world=1, device=torch.device("cpu"))
    assert sums.tolist() == pytest.approx([5.5, 2.0, 3.0, 2.0, 0.0, 0.0]) and split.sums is None
    assert group_losses(sums) == {"reg_samples": 2, "loss_reg": 2.75, "loss_main": 1.5}
    # an eval batch (no mask) passes through without counting; a step of one kind reports that kind alone
    assert split(pred, (target,)).item() == pytest.approx(_mse(pred, (target,)).item()) and split.sums is None
    assert group_losses(torch.tensor([0.0, 0.0, 3.0, 2.0])) == {"reg_samples": 0, "loss_main": 1.5}


BASE = {"resolutions": [512], "directory": [{"path": "a"}, {"path": "b", "is_reg": True}]}


@pytest.mark.parametrize("ratio", [0.0, 1.0, 1.5])
def test_reg_ratio_outside_zero_to_one_names_the_key(ratio):
    with pytest.raises(ConfigError, match="key 'reg_ratio': got"):
        from_dict(DatasetConfig, {**BASE, "reg_ratio": ratio})


def test_reg_directories_alone_are_refused_naming_the_key():
    cfg = from_dict(DatasetConfig, {**BASE, "reg_ratio": 0.3})
    assert [d.is_reg for d in cfg.directory] == [False, True] and cfg.reg_ratio == 0.3
    with pytest.raises(ConfigError, match="key 'directory.is_reg': every"):
        from_dict(DatasetConfig, {**BASE, "directory": [{"path": "b", "is_reg": True}]})


def test_is_reg_reaches_the_scanned_items(tmp_path):
    from pipetrain.backend.cache.manifest import CacheEntry
    from pipetrain.backend.data import scan_dataset
    from pipetrain.backend.commands.demo import make_dataset

    make_dataset(tmp_path / "a", 2)
    make_dataset(tmp_path / "b", 3)
    cfg = from_dict(DatasetConfig, {"directory": [{"path": str(tmp_path / "a")},
                                                  {"path": str(tmp_path / "b"), "is_reg": True}]})
    items = scan_dataset(cfg).items
    assert sorted((i.path.parent.name, i.is_reg) for i in items) == [("a", False)] * 2 + [("b", True)] * 3
    assert CacheEntry("p", (1, 1), "", 1, "l", "t").is_reg is False   # a manifest written before the key


def test_the_dataset_node_sets_is_reg_and_reg_ratio(tmp_path):
    from pipetrain.backend.commands.demo import make_dataset
    from pipetrain.backend.host.runtime import ensure_comfyui
    ensure_comfyui()
    from pipetrain.nodes.data import DatasetNode

    make_dataset(tmp_path / "a", 1)
    make_dataset(tmp_path / "b", 1)
    args = dict(resolutions="512", enable_ar_bucket=False, min_ar=0.5, max_ar=2.0, num_ar_buckets=1, num_repeats=1,
                caption_extension=".txt")
    reg = DatasetNode.execute(str(tmp_path / "b"), is_reg=True, **args).result[0]
    spec = DatasetNode.execute(str(tmp_path / "a"), previous=reg, reg_ratio=0.3, **args).result[0]
    table = spec.table()
    assert [d.get("is_reg") for d in table["directory"]] == [None, True]   # off: left out (its default)
    assert table["reg_ratio"] == 0.3

# SPDX-License-Identifier: GPL-3.0-or-later
"""``ema``: the moving average's values on known tensors (float32 and bfloat16 weights, frozen ones left out), the
swap into the weights for a save and back bit for bit, the checkpoint files of two stages merged on load; the
config check names ``ema_decay``; the LoRA Adapter node sets both keys."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.backend.config import RunConfig
from pipetrain.backend.errors import ConfigError
from pipetrain.backend.config.schema import from_dict
from pipetrain.backend.train.ema import WeightAverage


def _module(a: list[float], b: list[float]) -> nn.Module:
    m = nn.Module()
    m.a = nn.Parameter(torch.tensor(a))                          # float32, trained
    m.b = nn.Parameter(torch.tensor(b, dtype=torch.bfloat16))    # bfloat16, trained
    m.frozen = nn.Parameter(torch.tensor([5.0]), requires_grad=False)
    return m


def _set(m: nn.Module, a: list[float], b: list[float]) -> None:
    with torch.no_grad():
        m.a.copy_(torch.tensor(a))
        m.b.copy_(torch.tensor(b))


def test_the_average_follows_decay_math_from_the_starting_weights():
    m = _module([0.0, 2.0], [0.0, 0.0])
    ema = WeightAverage(m, decay=0.9)
    assert ema.names == ["a", "b"]                     # the frozen weight has no average
    _set(m, [1.0, 2.0], [1.0, -1.0])
    ema.update()                                       # 0.9 * start + 0.1 * weights
    assert torch.allclose(ema.average[0], torch.tensor([0.1, 2.0]), atol=1e-7)
    assert torch.allclose(ema.average[1], torch.tensor([0.1, -0.1]), atol=1e-7)
    _set(m, [3.0, 0.0], [1.0, -1.0])
    ema.update()
    assert torch.allclose(ema.average[0], torch.tensor([0.9 * 0.1 + 0.3, 0.9 * 2.0]), atol=1e-6)
    assert torch.allclose(ema.average[1], torch.tensor([0.19, -0.19]), atol=1e-6)
    assert ema.average[1].dtype == torch.float32


def test_a_bfloat16_weight_keeps_steps_bfloat16_would_round_away():
    m = _module([0.0], [1.0])
    ema = WeightAverage(m, decay=0.999)
    _set(m, [0.0], [2.0])
    for _ in range(3):
        ema.update()
    expected = 2.0 - 0.999 ** 3                        # 1 + (1 - 0.999^3) * (2 - 1)
    assert ema.average[1].item() == pytest.approx(expected, rel=1e-6)
    assert torch.tensor(expected, dtype=torch.bfloat16).item() == 1.0   # a bfloat16 average would not have moved


def test_applied_swaps_the_average_in_and_the_weights_back_bit_for_bit():
    m = _module([0.0, 0.0], [0.0, 0.0])
    ema = WeightAverage(m, decay=0.5)
    _set(m, [1.0, 3.0], [4.0, 0.3])
    before = [m.a.detach().clone(), m.b.detach().clone()]
    ema.update()
    with ema.applied():
        assert torch.equal(m.a.detach(), torch.tensor([0.5, 1.5]))
        assert torch.equal(m.b.detach(), torch.tensor([2.0, 0.15]).to(torch.bfloat16))
        assert m.frozen.item() == 5.0
    assert torch.equal(m.a.detach(), before[0]) and torch.equal(m.b.detach(), before[1])
    with pytest.raises(RuntimeError), ema.applied():   # a failed save still gives the weights back
        raise RuntimeError("disk full")
    assert torch.equal(m.a.detach(), before[0])


def _layers(values: dict[int, float]) -> nn.Module:
    """Pipeline layers ``<index>.w`` (a stage holds some of them, named by their index in the whole pipeline)."""
    m = nn.Module()
    for index, value in values.items():
        layer = nn.Module()
        layer.w = nn.Parameter(torch.tensor([value]))
        m.add_module(str(index), layer)
    return m


def test_checkpoint_files_of_two_stages_merge_on_load(tmp_path):
    for stage in (0, 1):
        m = _layers({stage: 0.0})
        ema = WeightAverage(m, decay=0.5)
        with torch.no_grad():
            next(m.parameters()).fill_(stage + 1.0)
        ema.update()
        ema.save(tmp_path, stage)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ema_stage000.pt", "ema_stage001.pt"]

    whole = _layers({0: 9.0, 1: 9.0})                    # a resume with one stage holding both
    ema = WeightAverage(whole, decay=0.5)
    assert ema.names == ["0.w", "1.w"]
    assert ema.load(tmp_path)
    assert [a.item() for a in ema.average] == [0.5, 1.0]

    fresh = WeightAverage(whole, decay=0.5)             # a checkpoint without EMA: the resumed weights
    fresh.average[0].fill_(123.0)
    assert not fresh.load(tmp_path / "none")
    assert [a.item() for a in fresh.average] == [9.0, 9.0]


BASE = {"output_dir": "/out", "dataset": "/d.toml", "model": {"type": "flux", "diffusion_model": "/m", "vae": "/v"}}


@pytest.mark.parametrize("decay", [1.0, 0.0, -0.5, 1.5])
def test_ema_decay_outside_zero_to_one_names_the_key(decay):
    with pytest.raises(ConfigError, match="key 'ema_decay': got"):
        from_dict(RunConfig, {**BASE, "ema": True, "ema_decay": decay})
    cfg = from_dict(RunConfig, {**BASE, "ema": True, "ema_decay": 0.99})
    assert (cfg.ema, cfg.average_decay) == (True, 0.99)
    assert (from_dict(RunConfig, {**BASE, "ema": True}).average_decay, from_dict(RunConfig, BASE).ema) == (0.999, False)


def test_a_decay_without_ema_names_the_key():
    with pytest.raises(ConfigError, match="key 'ema_decay': a decay without the average: set ema = true"):
        from_dict(RunConfig, {**BASE, "ema_decay": 0.99})


def test_the_adapter_node_sets_ema_and_its_decay():
    from pipetrain.backend.host.runtime import ensure_comfyui
    ensure_comfyui()
    from pipetrain.nodes.settings import AdapterNode

    on = AdapterNode.execute(8, 0.0, 0.0, "", ema=True, ema_decay=0.995).result[0]
    assert (on.get("ema"), on.get("ema_decay")) == (True, 0.995)
    off = AdapterNode.execute(8, 0.0, 0.0, "", ema=False, ema_decay=0.995).result[0]
    assert off.get("ema") is None and off.get("ema_decay") is None   # left out: the defaults
    full = AdapterNode.execute(8, 0.0, 0.0, "", type="full", ema=True).result[0]
    assert full.get("ema") is True and full.get("adapter.rank") is None   # a full fine-tune's average too

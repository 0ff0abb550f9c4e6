"""``[optimizer] type = 'AdamW8bitKahan'`` on the CPU: 8-bit states, and bfloat16 weights that follow the float32
trajectory through updates far below their precision (plain 8-bit AdamW on bfloat16 does not move them)."""
from __future__ import annotations

import builtins
from types import SimpleNamespace

import pytest
import torch

from pipetrain.backend.config import ModelConfig, OptimizerConfig
from pipetrain.backend.errors import ConfigError
from pipetrain.backend.optim.registry import make_optimizer, resolve_optimizer

START = (torch.rand(64, 64, generator=torch.Generator().manual_seed(0)) * 0.5 + 0.5).bfloat16().float()


def _cfg(type_="AdamW8bitKahan", **kw):
    opt = OptimizerConfig(type=type_, lr=1e-4, betas=[0.9, 0.99], weight_decay=0.0)
    opt._extra = {"min_8bit_size": 16, **kw}
    return SimpleNamespace(optimizer=opt, model=ModelConfig(type="flux", diffusion_model="flux.safetensors"), file=None)


def _train(cfg, dtype, steps=60):
    p = torch.nn.Parameter(START.clone().to(dtype))
    opt = make_optimizer(cfg, 1)([p])
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        p.grad = (torch.randn(64, 64, generator=g) * 0.1 + 1).to(dtype)
        opt.step()
    return p.detach().float() - START, opt.state[p]


def test_kahan_keeps_bfloat16_weights_on_the_float32_path():
    ref, _ = _train(_cfg("adamw8bit"), torch.float32)        # bitsandbytes' 8-bit AdamW on float32 weights
    plain, _ = _train(_cfg("adamw8bit"), torch.bfloat16)
    kahan, state = _train(_cfg(), torch.bfloat16)
    ulp = 2.0 ** -8                                          # bfloat16 spacing in [0.5, 1)
    assert ref.abs().mean() > ulp and plain.abs().max() == 0   # each update (1e-4) is far below half an ulp
    assert state["state1"].dtype == torch.uint8 and state["shift"].dtype == torch.bfloat16
    assert (kahan - ref).abs().max() < 0.6 * ulp                 # the weight: the float32 path, rounded
    compensated = kahan + state["shift"].float()
    assert (compensated - ref).abs().max() < 0.05 * ref.abs().max()   # + shift: the float32 path itself


def test_float32_weights_step_as_adamw8bit():
    ref, _ = _train(_cfg("adamw8bit"), torch.float32, steps=5)
    kahan, state = _train(_cfg(), torch.float32, steps=5)
    assert "shift" not in state
    torch.testing.assert_close(kahan, ref)


def test_config_resolves_it_by_name_and_checks_its_arguments():
    klass, _ = resolve_optimizer(_cfg())
    assert klass.__name__ == "AdamW8bitKahan"
    with pytest.raises(ConfigError, match="key 'optimizer.kahan'"):
        resolve_optimizer(_cfg(kahan=True))


def test_without_bitsandbytes_the_error_names_the_package(monkeypatch):
    import sys

    real_import = builtins.__import__

    def no_bnb(name, *args, **kwargs):
        if name.split(".")[0] == "bitsandbytes":
            raise ImportError("No module named 'bitsandbytes'", name="bitsandbytes")
        return real_import(name, *args, **kwargs)
    for mod in [m for m in sys.modules if m.startswith("bitsandbytes") or m.endswith("optim.kahan")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(builtins, "__import__", no_bnb)
    with pytest.raises(ConfigError, match=r"key 'optimizer.type'.*pip install bitsandbytes"):
        resolve_optimizer(_cfg())

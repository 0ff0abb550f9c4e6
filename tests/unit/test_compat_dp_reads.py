"""What diffusion-pipe (8f83dbf) reads, read here with its meaning, or refused naming the key or file and what to do
(issue #36 item 3): ``rank = 1e6`` (LoKr's full matrix), ``exclude_modules`` (PEFT's rule), ``lumina_shift``,
SDXL's ``unet_lr`` and ``text_encoder_*_lr``, ``regenerate_cache`` (a key diffusion-pipe ignores), ``captions.json``
and ``.tar`` archives."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from test_compat_dp_examples import ADAPTER, MAIN, OPTIMIZER, _model, _table, _write

from pipetrain.backend.adapters import injection
from pipetrain.backend.commands.check_config import report
from pipetrain.backend.errors import ConfigError, DatasetError
from pipetrain.backend.preflight import load_run

SDXL = _table("sdxl", "diffusion_model", "vae", extra="text_encoders = ['{te0}', '{te1}']")


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"attn": nn.ModuleDict({"qkv": nn.Linear(16, 48)}),
                                                   "mlp": nn.Linear(16, 16)}) for _ in range(2))


def test_a_float_rank_of_a_million_is_lokrs_full_matrix(tmp_path):
    flux = _table("flux", "transformer_path", "vae_path", extra="text_encoders = ['{te0}', '{te1}']")
    path = _write(tmp_path, MAIN + _model("flux", flux) + "[adapter]\ntype = 'lokr'\nrank = 1e6\n" + OPTIMIZER)
    cfg = load_run(path)
    assert cfg.adapter.rank == 1_000_000 and isinstance(cfg.adapter.rank, int)
    model = _Blocks()
    injection.inject(model, injection.spec_from_config(cfg.adapter), ("blocks",))
    adapter = model.blocks[0]["attn"]["qkv"].lokr
    assert hasattr(adapter, "lokr_w2") and not hasattr(adapter, "lokr_w2_a")   # one full second factor
    assert injection.spec_from_config(cfg.adapter).alpha / cfg.adapter.rank == 1.0   # dp: alpha = rank
    path.write_text(path.read_text().replace("rank = 1e6", "rank = 2.5"))
    with pytest.raises(ConfigError, match="adapter.rank"):
        load_run(path)


@pytest.mark.parametrize("exclude, left", [
    ("['attn.qkv']", {"blocks.0.attn.qkv", "blocks.1.attn.qkv"}),      # trailing dotted parts
    ("['blocks.1.mlp']", {"blocks.1.mlp"}),                             # a whole path
    ("['qkv.x', 'lp']", set()),                                         # never part of a name
    ("'blocks\\.0\\..*'", {"blocks.0.attn.qkv", "blocks.0.mlp"}),   # a string: a regex of the whole path
])
def test_exclude_modules_leaves_the_named_modules_without_an_adapter(tmp_path, exclude, left):
    flux = _table("flux", "transformer_path", "vae_path", extra="text_encoders = ['{te0}', '{te1}']")
    cfg = load_run(_write(tmp_path, MAIN + _model("flux", flux) + ADAPTER + f"exclude_modules = {exclude}\n" +
                          OPTIMIZER))
    model = _Blocks()
    adapted = injection.inject(model, injection.spec_from_config(cfg.adapter), ("blocks",),
                               exclude=cfg.adapter.exclude_modules)
    every = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.count(".") in (2, 3)
             and "lora" not in n}
    assert set(adapted) == every - left


def test_lumina_shift_is_lumina_2s_resolution_dependent_shift(tmp_path):
    from pipetrain.backend.models.registry import adapter_class

    lumina = _table("lumina_2", "transformer_path", "llm_path", "vae_path", extra="lumina_shift = true")
    path = _write(tmp_path, MAIN + _model("lumina2", lumina) + ADAPTER + OPTIMIZER)
    cfg = load_run(path)
    assert cfg.model.flux_shift
    objective = adapter_class("lumina2")(cfg.model, cfg.resolve).objective()
    t = torch.tensor([0.5])
    assert objective._shift(t, 4096).item() > 0.7   # mu 1.15 at 4096 tokens: e^1.15 t / (1 + (e^1.15 - 1) t)
    assert "  model.lumina_shift: read as flux_shift" in report(path)[0]
    # diffusion-pipe's other models ignore it: accepted, no shift
    flux = _table("flux", "transformer_path", "vae_path", extra="text_encoders = ['{te0}', '{te1}']\nlumina_shift = true")
    cfg = load_run(_write(tmp_path, MAIN + _model("flux", flux) + ADAPTER + OPTIMIZER))
    assert not cfg.model.flux_shift and cfg.model.shift is None


def test_sdxls_learning_rates(tmp_path):
    from pipetrain.backend.optim.registry import resolve_optimizer

    path = _write(tmp_path, MAIN + _model("sdxl", SDXL + "unet_lr = 4e-5\ntext_encoder_1_lr = 0\n"
                                           "text_encoder_2_lr = 0.0\n") + ADAPTER + OPTIMIZER)
    cfg = load_run(path)
    assert resolve_optimizer(cfg)[1]["lr"] == 4e-5     # the UNet's rate; [optimizer] lr is 2e-5
    text, ok = report(path)
    assert ok and "text_encoder_1_lr: accepted at this value" in text and "text_encoder_1_lr, text_encoder_2_lr (" \
        not in text, text
    # left out: diffusion-pipe trains the text encoders' LoRAs; here they stay frozen, and check-config says so
    path = _write(tmp_path, MAIN + _model("sdxl", SDXL) + ADAPTER + OPTIMIZER)
    assert "  model.text_encoder_1_lr, text_encoder_2_lr (main file): diffusion-pipe [optimizer] lr" in report(path)[0]
    for extra, key in (("text_encoder_1_lr = 1e-5\n", "model.text_encoder_1_lr"), ("unet_lr = -1.0\n", "model.unet_lr")):
        with pytest.raises(ConfigError, match=key):
            load_run(_write(tmp_path, MAIN + _model("sdxl", SDXL + extra) + ADAPTER + OPTIMIZER))
    flux = _table("flux", "transformer_path", "vae_path", extra="text_encoders = ['{te0}', '{te1}']\nunet_lr = 1e-4")
    with pytest.raises(ConfigError, match="model.unet_lr"):
        load_run(_write(tmp_path, MAIN + _model("flux", flux) + ADAPTER + OPTIMIZER))


def test_regenerate_cache_as_a_key_is_ignored_as_diffusion_pipe_ignores_it(tmp_path):
    flux = _table("flux", "transformer_path", "vae_path", extra="text_encoders = ['{te0}', '{te1}']")
    path = _write(tmp_path, "regenerate_cache = true\n" + MAIN + _model("flux", flux) + ADAPTER + OPTIMIZER)
    load_run(path)
    assert "  regenerate_cache: accepted, changes nothing here (diffusion-pipe ignores this key too" in report(path)[0]


@pytest.mark.parametrize("name, fragment", [("captions.json", "captions.json"), ("more.tar", ".tar archives (more.tar)")])
def test_what_a_folder_holds_and_the_scan_does_not_read_is_refused_by_name(tmp_path, name, fragment):
    from PIL import Image

    from pipetrain.backend.config import DatasetConfig, DirectoryConfig
    from pipetrain.backend.data.scan import scan_dataset

    folder = tmp_path / "images"
    folder.mkdir()
    Image.new("RGB", (64, 64)).save(folder / "a.png")
    (folder / "a.txt").write_text("a caption")
    (folder / name).write_bytes(b"{}")
    with pytest.raises(DatasetError) as err:
        scan_dataset(DatasetConfig(directory=[DirectoryConfig(path=str(folder))]))
    assert fragment in str(err.value) and str(folder) in str(err.value)

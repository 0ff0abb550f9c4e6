"""Full fine-tune (no ``[adapter]`` table, diffusion-pipe's meaning): every weight of the diffusion model trains;
each epoch's model is written per pipeline stage, merged on rank 0 into one ComfyUI single file that
``comfy.sd.load_diffusion_model`` loads, and whose forward in ComfyUI equals the training layers'."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipetrain.backend.config import ModelConfig
from pipetrain.backend.errors import ConfigError
from pipetrain.backend.train.saving import full_finetune, merge_full_model, write_stage_part


def _adapter(arch, files, dtype="float32", **model):
    from pipetrain.backend.models.registry import adapter_class
    from pipetrain.backend.host.runtime import ensure_comfyui

    ensure_comfyui()
    cfg = ModelConfig(type=arch, diffusion_model=str(files.diffusion_model), vae=str(files.vae),
                      text_encoders=[str(p) for p in files.text_encoders], dtype=dtype, **model)
    adapter = adapter_class(arch)(cfg)
    adapter.load_diffusion_model()
    return adapter


def test_stage_parts_merge_into_a_file_comfyui_loads(model_files, tmp_path):
    """SD3 tiny (a config ComfyUI's detection recognises): two "stages" each write their layers' weights; the
    merged file loads through comfy.sd.load_diffusion_model itself and holds the trained values."""
    files = model_files("sd3", "tiny")
    adapter = _adapter("sd3", files)
    import comfy.sd
    dm = adapter.diffusion_model
    full_finetune(dm, None)
    assert all(p.requires_grad for p in dm.parameters())
    layers = adapter.to_layers()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in dm.parameters():                     # "training": every weight changes
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    half = len(layers) // 2
    for stage, part in enumerate((layers[:half], layers[half:])):
        write_stage_part(torch.nn.ModuleList(part), dm, tmp_path / "parts", stage, torch.float32)
    out = tmp_path / "model.safetensors"
    trained = merge_full_model(dm, files.diffusion_model, tmp_path / "parts", out, torch.float32, {"epoch": 1})
    assert trained == len({id(p) for layer in layers for p in layer.parameters()})

    loaded = comfy.sd.load_diffusion_model(str(out)).model.diffusion_model   # ComfyUI's own loader
    mine = dm.state_dict()
    theirs = loaded.state_dict()
    for k, v in mine.items():
        torch.testing.assert_close(theirs[k].float(), v.float(), rtol=0, atol=0)


def test_fp8_weights_cannot_be_fully_fine_tuned(micro_flux_files):
    adapter = _adapter("flux", micro_flux_files, diffusion_model_dtype="float8")
    with pytest.raises(ConfigError, match="key 'model.diffusion_model_dtype'.*full fine-tune"):
        full_finetune(adapter.diffusion_model, None)


def test_no_adapter_table_means_full_fine_tune():
    from pipetrain.backend.config import RunConfig
    from pipetrain.backend.config.schema import from_dict, to_dict

    base = {"output_dir": "o", "dataset": "d.toml", "model": {"type": "flux", "diffusion_model": "m", "vae": "v"}}
    cfg = from_dict(RunConfig, base)
    assert cfg.adapter is None and "adapter" not in to_dict(cfg)
    assert from_dict(RunConfig, {**base, "adapter": {}}).adapter.type == "lora"


def _layer_weights(run_dir, adapter, tag: str) -> dict[str, torch.Tensor]:
    """The trained weights in the run's last DeepSpeed checkpoint (per-layer files), under diffusion-model keys."""
    names = {id(p): n for n, p in adapter.diffusion_model.named_parameters()}
    out = {}
    for i, layer in enumerate(adapter.to_layers()):
        path = run_dir / "checkpoints" / tag / f"layer_{i:02d}-model_states.pt"
        if not path.exists():
            continue
        saved = torch.load(path, map_location="cpu", weights_only=False)
        for k, p in layer.named_parameters():
            if k in saved:
                out[names[id(p)]] = saved[k]
    return out


@pytest.mark.slow
def test_two_stage_full_fine_tune_saves_a_model_comfyui_reproduces(micro_flux_files, make_run):
    from conftest import train
    from safetensors.torch import load_file

    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.train.checkpoint import latest_tag
    from pipetrain.backend.parity.verify import check_full_model

    samples = {"prompts": ["a red circle"], "seed": 3, "width": 64, "height": 64, "steps": 2}
    config = make_run(micro_flux_files, images=4, name="fft", stages=2, epochs=1, adapter=None, samples=samples,
                      checkpoint_every_n_epochs=None, optimizer={"type": "adamw", "lr": 1e-3}, ema=True,
                      ema_decay=0.5)
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert not run.events("lora_saved")
    saved = run.events("model_saved")
    assert [e["epoch"] for e in saved] == [1]
    path = saved[0]["path"]
    assert path.endswith(f"{run.run_dir.name}-epoch0001.safetensors") and "/models/" in path
    assert run.status()["models"][0]["path"] == path
    # the epoch sample renders with the saved model itself (no LoRA), beside it
    (sample,) = run.events("sample_saved")
    assert sample["epoch"] == 1 and sample["path"] == path.removesuffix(".safetensors") + "-sample00.png"
    cfg = load_run_config(config)
    base = _adapter("flux", micro_flux_files)
    total = sum(p.numel() for p in base.diffusion_model.parameters())
    assert 0.3 * total < run.events("engine")[0]["trainable_params"] < total   # stage 0's share: every weight

    model = load_file(path)
    original = base.diffusion_model.state_dict()
    assert set(model) == set(original)
    assert saved[0]["tensors_trained"] == len(original)             # both stages' parts merged
    unchanged = {k for k in model if torch.equal(model[k], original[k])}
    # every weight moved, Flux's conditioning-vector embedders too: their output crosses the pipeline stages
    # with its gradient in a full fine-tune (models/carry.py)
    assert not unchanged, sorted(unchanged)[:5]

    # the file holds exactly the training side's weights (the final checkpoint, written at the same step) ...
    trained = _layer_weights(run.run_dir, base, latest_tag(run.run_dir / "checkpoints"))
    assert len(trained) == len(model)
    for k, v in trained.items():
        torch.testing.assert_close(model[k], v.float(), rtol=0, atol=0)
    # ... and ComfyUI's forward of the file equals the training layers' with those weights
    check = check_full_model(cfg, path, trained)
    assert check.comfy_vs_training < 1e-4, check
    assert check.change > 1e-3, check
    assert dataclasses.is_dataclass(check)

    # ema: the moving average of both stages' weights beside it, a whole model with the same keys, outside the
    # epoch list; 4 steps at decay 0.5 leave it between the start and the trained weights (for steps of equal size
    # in one direction, a quarter of the way back: 1 - (4 * 0.5 + 3 * 0.25 + 2 * 0.125 + 0.0625) / 4 = 0.23)
    (ema,) = run.events("ema_saved")
    assert ema["path"] == path.removesuffix(".safetensors") + "-ema.safetensors" and not ema["at_step"]
    assert [m["path"] for m in run.status()["models"]] == [path]
    average = load_file(ema["path"])
    assert set(average) == set(model)

    def distance(a, b):
        return sum(((a[k].float() - b[k].float()) ** 2).sum() for k in model) ** 0.5
    assert 0 < distance(average, original) < distance(model, original)
    assert distance(average, model) > 0.1 * distance(model, original)


def _as_one_group(checkpoint, order: list[int]) -> None:
    """Rewrite a checkpoint's optimizer and schedule state as a checkpoint of one parameter group holding every
    trainable parameter in the module's order (what PipeTrain wrote before 1-D parameters trained without weight
    decay); ``order``: each module parameter's index in today's two groups. Its digest is written anew."""
    import hashlib
    import json

    path = checkpoint / "mp_rank_00_model_states.pt"
    saved = torch.load(path, map_location="cpu", weights_only=False)
    optimizer, schedule = saved["optimizer"], saved["lr_scheduler"]
    assert len(optimizer["param_groups"]) == 2 and len(order) == sum(len(g["params"])
                                                                      for g in optimizer["param_groups"])
    first = {k: v for k, v in optimizer["param_groups"][0].items() if k != "params"}
    optimizer["state"] = {j: optimizer["state"][i] for j, i in enumerate(order) if i in optimizer["state"]}
    optimizer["param_groups"] = [{**first, "params": list(range(len(order)))}]
    schedule["base_lrs"], schedule["_last_lr"] = schedule["base_lrs"][:1], schedule["_last_lr"][:1]
    torch.save(saved, path)
    digests = json.loads((checkpoint / "digests.json").read_text())
    digests[path.name] = {"bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    (checkpoint / "digests.json").write_text(json.dumps(digests))


@pytest.mark.slow
def test_a_full_fine_tune_resumes_a_checkpoint_of_one_optimizer_group_as_one_of_two(micro_flux_files, make_run):
    """A full fine-tune checkpoint from before its 1-D parameters trained without weight decay holds one optimizer
    group. Resumed now, each parameter's moments go into today's groups (the 1-D ones without decay): the run trains
    on exactly as from the same checkpoint written today."""
    import shutil

    import tomli_w
    from conftest import train
    from safetensors.torch import load_file

    from pipetrain.backend.config.files import _read_toml
    from pipetrain.backend.train.checkpoint import latest_tag

    config = make_run(micro_flux_files, images=2, name="fft_groups", stages=1, epochs=1, adapter=None,
                      optimizer={"type": "adamw", "lr": 1e-3, "weight_decay": 0.1})
    first = train(config, ranks=1)
    assert first.returncode == 0, first.output[-4000:]
    checkpoints = first.run_dir / "checkpoints"
    tag = latest_tag(checkpoints)
    shutil.copytree(checkpoints / tag, config.parent / "kept")
    status = (first.run_dir / "status.json").read_bytes()   # the run as it was after epoch 1
    table = _read_toml(config)
    table["epochs"] = 2
    config.write_text(tomli_w.dumps(table))
    today = train(config, 1, "--resume", first.run_dir.name)
    assert today.returncode == 0, today.output[-4000:]
    model = today.run_dir / "models" / f"{today.run_dir.name}-epoch0002.safetensors"
    expected = load_file(model)

    for folder in checkpoints.iterdir():   # back to the epoch-1 checkpoint, as one group
        if folder.is_dir():
            shutil.rmtree(folder)
    shutil.copytree(config.parent / "kept", checkpoints / tag)
    (checkpoints / "latest").write_text(tag)
    (first.run_dir / "status.json").write_bytes(status)
    params = list(dict.fromkeys(p for layer in _adapter("flux", micro_flux_files).to_layers()
                                for p in layer.parameters()))
    two_groups = [p for p in params if p.ndim > 1] + [p for p in params if p.ndim <= 1]
    position = {id(p): i for i, p in enumerate(two_groups)}
    _as_one_group(checkpoints / tag, [position[id(p)] for p in params])
    old = train(config, 1, "--resume", first.run_dir.name)
    assert old.returncode == 0, old.output[-4000:]
    assert "holds one optimizer parameter group" in old.output
    trained = load_file(model)
    assert trained.keys() == expected.keys() and all(torch.equal(trained[k], expected[k]) for k in expected)

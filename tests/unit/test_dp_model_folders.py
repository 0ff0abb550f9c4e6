"""diffusion-pipe's model folders (``diffusers_path``, ``checkpoint_path``, ``ckpt_path``): the config reads a
folder's components where the table names no single file; the loaders hand a folder's shards to ComfyUI's own
converters, so a Diffusers Flux folder gives the network diffusers runs from it and the one ComfyUI loads from the
same weights as a single file; what ComfyUI cannot convert is refused naming the key and the single files; the
cache fingerprints every shard."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from dp_files import DP_OPTIMIZER

from pipetrain.backend.commands.check_config import report
from pipetrain.backend.config import load_run_config
from pipetrain.backend.errors import ConfigError, ModelError

RUN = """
output_dir = 'out'
dataset = 'dataset.toml'
epochs = 1
micro_batch_size_per_gpu = 1
save_every_n_epochs = 1
""" + DP_OPTIMIZER
DATASET = "resolutions = [64]\n[[directory]]\npath = 'images'\n"


def _write(root: Path, model: str) -> Path:
    (root / "run.toml").write_text(RUN + "\n[model]\n" + model)
    (root / "dataset.toml").write_text(DATASET)
    return root / "run.toml"


def _error(path: Path) -> str:
    with pytest.raises(ConfigError) as err:
        load_run_config(path).check_model_paths()
    return str(err.value)


def _save(path: Path, tensors: dict) -> None:
    from safetensors.torch import save_file
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))


def _pipeline(root: Path, encoders=("text_encoder", "text_encoder_2"), unet: str = "transformer") -> Path:
    """A Diffusers pipeline folder's layout with one small tensor per component (config tests read no weights)."""
    import torch
    folder = root / "FLUX.1-dev"
    (folder).mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    for sub in (unet, "vae", *encoders):
        _save(folder / sub / "model.safetensors", {"w": torch.zeros(2)})
    return folder


# --- the config ------------------------------------------------------------------------------------------------
def test_diffusers_path_fills_every_component_relative_to_the_toml(tmp_path, model_files):
    from dp_files import diffusers_folder
    diffusers_folder(model_files("flux"), tmp_path / "FLUX.1-dev", "flux")
    cfg = load_run_config(_write(tmp_path, "type = 'flux'\ndiffusers_path = 'FLUX.1-dev'\ndtype = 'bfloat16'\n"))
    cfg.check_model_paths()
    assert (cfg.model.diffusion_model, cfg.model.vae) == ("FLUX.1-dev/transformer", "FLUX.1-dev/vae")
    assert cfg.model.text_encoder_files == ["FLUX.1-dev/text_encoder", "FLUX.1-dev/text_encoder_2"]
    assert cfg.resolve(cfg.model.vae) == tmp_path / "FLUX.1-dev" / "vae"
    text, ok = report(tmp_path / "run.toml")
    assert ok and "model.diffusers_path: a Diffusers pipeline folder" in text, text


def test_single_file_keys_override_the_folders_parts_as_in_diffusion_pipe(tmp_path):
    """diffusion-pipe's Flux Kontext / Chroma tables: diffusers_path for the VAE and text encoders, transformer_path
    for the diffusion model."""
    _pipeline(tmp_path)
    model = "type = 'flux'\ndiffusers_path = 'FLUX.1-dev'\ntransformer_path = '/m/flux1-kontext-dev.safetensors'\n"
    cfg = load_run_config(_write(tmp_path, model))
    assert (cfg.model.diffusion_model, cfg.model.vae) == ("/m/flux1-kontext-dev.safetensors", "FLUX.1-dev/vae")
    assert len(cfg.model.text_encoder_files) == 2
    cfg = load_run_config(_write(tmp_path, "type = 'sdxl'\ncheckpoint_path = 'FLUX.1-dev'\n"
                                           "clip_path = '/m/clip_l.safetensors'\n"))
    assert cfg.model.text_encoder_files == ["/m/clip_l.safetensors"]


def test_flux_kontext_by_its_own_type_string_reads_a_folder_too(tmp_path):
    _pipeline(tmp_path)
    cfg = load_run_config(_write(tmp_path, "type = 'flux_kontext'\ndiffusers_path = 'FLUX.1-dev'\n"))
    assert cfg.model.diffusion_model == "FLUX.1-dev/transformer"


def test_sdxl_checkpoint_folder_reads_its_unet(tmp_path):
    _pipeline(tmp_path, unet="unet")
    cfg = load_run_config(_write(tmp_path, "type = 'sdxl'\ncheckpoint_path = 'FLUX.1-dev'\n"))
    assert cfg.model.diffusion_model == "FLUX.1-dev/unet"


@pytest.mark.parametrize("model, key, fix", [
    ("type = 'qwen_image'\ndiffusers_path = 'FLUX.1-dev'\n", "model.diffusers_path", "transformer_path"),
    ("type = 'chroma'\ndiffusers_path = 'FLUX.1-dev'\n", "model.diffusers_path",
     "transformer_path = '<chroma-unlocked-v50.safetensors>'"),   # a Flux folder has no Chroma transformer
    ("type = 'flux'\ndiffusers_path = 'nowhere'\n", "model.diffusers_path", "folder not found"),
    ("type = 'flux'\ndiffusers_path = 'FLUX.1-dev/vae'\n", "model.diffusers_path", "model_index.json"),
    ("type = 'hunyuan-video'\nckpt_path = 'FLUX.1-dev'\n", "model.ckpt_path", "transformer_path"),
    ("type = 'wan'\nckpt_path = 'FLUX.1-dev'\n", "model.ckpt_path", "llm_path = "),
])
def test_folders_comfyui_cannot_convert_are_refused_naming_the_key_and_the_single_files(tmp_path, model, key, fix):
    _pipeline(tmp_path)
    message = _error(_write(tmp_path, model))
    assert f"key '{key}'" in message and fix in message, message


def test_wan_checkpoint_folder_gives_its_transformer_shards_and_vae(tmp_path):
    import torch
    folder = tmp_path / "Wan2.1-T2V-1.3B"
    _save(folder / "diffusion_pytorch_model.safetensors", {"w": torch.zeros(2)})
    torch.save({"w": torch.zeros(2)}, folder / "Wan2.1_VAE.pth")
    cfg = load_run_config(_write(tmp_path, "type = 'wan'\nckpt_path = 'Wan2.1-T2V-1.3B'\n"
                                           "llm_path = '/m/umt5_xxl_fp16.safetensors'\n"))
    cfg.check_model_paths()
    assert (cfg.model.diffusion_model, cfg.model.vae) == ("Wan2.1-T2V-1.3B", "Wan2.1-T2V-1.3B/Wan2.1_VAE.pth")


def test_chromas_table_takes_the_flux_folders_vae_and_t5_through_comfyuis_loaders(flux_diffusers_folder,
                                                                                   model_files, tmp_path):
    """diffusion-pipe's Chroma table: diffusers_path (a Flux pipeline folder) lends the VAE and the T5 (not CLIP-L:
    Chroma reads T5 alone), transformer_path is the Chroma file. Both folders load through ComfyUI's own
    converters with the folder's weights, and the Chroma model runs on the folder T5's embedding."""
    import torch
    from safetensors.torch import load_file

    from pipetrain.backend.models.registry import adapter_class
    (tmp_path / "FLUX.1-dev").symlink_to(flux_diffusers_folder)
    files = model_files("chroma")
    path = _write(tmp_path, f"type = 'chroma'\ndiffusers_path = 'FLUX.1-dev'\n"
                            f"transformer_path = '{files.diffusion_model}'\ndtype = 'float32'\n")
    cfg = load_run_config(path)
    cfg.check_model_paths()
    assert (cfg.model.diffusion_model, cfg.model.vae) == (str(files.diffusion_model), "FLUX.1-dev/vae")
    assert cfg.model.text_encoder_files == ["FLUX.1-dev/text_encoder_2"]
    text, ok = report(path)
    assert ok and "model.diffusers_path: a Flux Diffusers pipeline folder lending its vae and t5xxl" in text, text
    adapter = adapter_class("chroma")(cfg.model, cfg.resolve)
    assert adapter.load_vae().latent_channels == 16
    clip = adapter.load_text_encoders()
    folder_t5 = load_file(str(flux_diffusers_folder / "text_encoder_2" / "model.safetensors"))
    (shared,) = [v for k, v in clip.cond_stage_model.state_dict().items() if k.endswith("shared.weight")]
    assert torch.equal(shared.float(), folder_t5["shared.weight"].float())   # the folder's T5, weight for weight
    cond = clip.encode_from_tokens(clip.tokenize("a red circle"))
    dm = adapter.load_diffusion_model().model.diffusion_model
    x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = dm(x, torch.tensor([0.5]), cond, torch.tensor([0.0]))
    assert out.shape == x.shape and torch.isfinite(out).all() and out.abs().mean() > 0


# --- shards and the cache ------------------------------------------------------------------------------------
def _sharded(folder: Path, tensors: dict, shards: int = 2) -> None:
    """``tensors`` in ``shards`` files with the index diffusers writes beside them."""
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"diffusion_pytorch_model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        _save(folder / file, {k: tensors[k].contiguous() for k in part})
        weight_map.update({k: file for k in part})
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_weight_files_follow_the_index_and_skip_variant_copies(tmp_path):
    import torch

    from pipetrain.backend.config.model_folders import weight_files
    _sharded(tmp_path / "a", {"x": torch.zeros(1), "y": torch.ones(1), "z": torch.ones(2)})
    _save(tmp_path / "a" / "stray.safetensors", {"q": torch.zeros(1)})   # not in the index: not read
    assert [p.name for p in weight_files(tmp_path / "a")] == [
        "diffusion_pytorch_model-00001-of-00002.safetensors", "diffusion_pytorch_model-00002-of-00002.safetensors"]
    _save(tmp_path / "b" / "model.safetensors", {"x": torch.zeros(1)})
    _save(tmp_path / "b" / "model.fp16.safetensors", {"x": torch.zeros(1, dtype=torch.float16)})
    assert [p.name for p in weight_files(tmp_path / "b")] == ["model.safetensors"]
    (tmp_path / "a" / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match="00002-of-00002.safetensors' named by"):
        weight_files(tmp_path / "a")


def test_the_cache_fingerprint_of_a_folder_covers_every_shard(tmp_path):
    import torch

    from pipetrain.backend.cache import model_fingerprint
    folder = tmp_path / "transformer"
    _sharded(folder, {"x": torch.zeros(4), "y": torch.zeros(4)})
    memo = tmp_path / "digests.json"
    before = model_fingerprint(folder, memo)
    assert model_fingerprint(folder, memo) == before
    second = folder / "diffusion_pytorch_model-00002-of-00002.safetensors"
    stat = second.stat()
    _save(second, {"y": torch.ones(4)})                        # same size, same name, same mtime
    os.utime(second, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    edited = model_fingerprint(folder, memo)
    assert edited != before
    (folder / "config.json").write_text("{}")                  # a component's config sizes its model
    assert model_fingerprint(folder, memo) not in (before, edited)


# --- loading through ComfyUI ---------------------------------------------------------------------------------
def _probe(generator):
    import torch
    return (torch.randn(1, 16, 8, 8, generator=generator), torch.tensor([0.6]),
            torch.randn(1, 5, 4096, generator=generator), torch.randn(1, 768, generator=generator),
            torch.tensor([3.5]))


def test_a_diffusers_flux_folder_is_the_network_diffusers_runs(flux_diffusers_folder):
    """ComfyUI's Flux from the folder (its Diffusers conversion) against diffusers' own model of the same folder on
    one probe: the packing into 2x2 patches and the position ids are the Flux pipeline's."""
    import diffusers
    import torch

    from pipetrain.backend.models.loading import detect_architecture, load_diffusion_model
    transformer = flux_diffusers_folder / "transformer"
    assert detect_architecture(transformer) == "flux"
    comfy_dm = load_diffusion_model(transformer, torch.float32).model.diffusion_model.eval()
    x, t, context, y, guidance = _probe(torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = comfy_dm(x, t, context, y, guidance=guidance)
    del comfy_dm
    reference = diffusers.FluxTransformer2DModel.from_pretrained(transformer,
                                                                  torch_dtype=torch.float32).eval()
    packed = x.view(1, 16, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, 16, 64)
    ids = torch.zeros(4, 4, 3)
    ids[..., 1], ids[..., 2] = torch.arange(4)[:, None], torch.arange(4)[None, :]
    with torch.no_grad():
        theirs = reference(hidden_states=packed, encoder_hidden_states=context, pooled_projections=y, timestep=t,
                           img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(5, 3), guidance=guidance,
                           return_dict=False)[0]
    theirs = theirs.view(1, 4, 4, 16, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(1, 16, 8, 8)
    assert ours.abs().mean() > 0.1
    assert (ours - theirs).abs().max() < 1e-4


def test_the_folders_vae_and_text_encoders_load_in_comfyui(flux_diffusers_folder):
    import torch

    from pipetrain.backend.models.loading import load_text_encoders, load_vae
    vae = load_vae(flux_diffusers_folder / "vae", arch="flux")
    assert vae.latent_channels == 16
    folder = flux_diffusers_folder
    clip = load_text_encoders([folder / "text_encoder", folder / "text_encoder_2"], "flux", torch.float32)
    cond, pooled = clip.encode_from_tokens(clip.tokenize("a red circle"), return_pooled=True)
    assert cond.shape[-1] == 4096 and pooled.shape[-1] == 768 and torch.isfinite(cond).all()


def _diffusers_key_map(arch: str, comfy_sd: dict) -> dict:
    """ComfyUI's own map from a Diffusers transformer's keys to its model's (``comfy.utils``), for ``comfy_sd``'s
    sizes."""
    import comfy.utils

    def blocks(prefix: str) -> int:
        return len({k.split(".")[1] for k in comfy_sd if k.startswith(prefix)})
    if arch == "flux":
        return comfy.utils.flux_to_diffusers({"depth": blocks("double_blocks."),
                                              "depth_single_blocks": blocks("single_blocks."),
                                              "hidden_size": comfy_sd["img_in.weight"].shape[0]}, output_prefix="")
    return comfy.utils.mmdit_to_diffusers({"depth": comfy_sd["x_embedder.proj.weight"].shape[0] // 64,
                                           "num_blocks": blocks("joint_blocks.")}, output_prefix="")


def _as_diffusers_transformer(single: Path, arch: str, folder: Path) -> dict:
    """``single`` (a ComfyUI file) written as a two-shard Diffusers transformer in ``folder``; returns the file's
    state dict."""
    from pipetrain.backend.models.loading import _load_state_dict
    comfy_sd, _ = _load_state_dict(single)   # imports ComfyUI
    diffusers_sd = {}
    for key, target in _diffusers_key_map(arch, comfy_sd).items():
        name, offset, fun = ((target, None, None) if isinstance(target, str)
                             else (*target[:2], (target[2:] or [None])[0]))
        if name in comfy_sd:
            value = comfy_sd[name] if offset is None else comfy_sd[name].narrow(*offset)
            diffusers_sd[key] = fun(value) if fun else value   # the one function (Flux's) swaps halves: self-inverse
    assert len(diffusers_sd) > len(comfy_sd)   # the fused qkv weights are split
    _sharded(folder, diffusers_sd)
    return comfy_sd


@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_a_sharded_diffusers_transformer_loads_as_its_single_file(model_files, tmp_path, arch):
    """PipeTrain's tiny Flux / SD3 file written as a two-shard Diffusers transformer (ComfyUI's own key map,
    inverted) loads through the folder path as ComfyUI's model with the single file's weights, every one; the
    memory plan builds the same model from the folder's header."""
    import torch

    from pipetrain.backend.models.loading import build_meta_model, load_diffusion_model
    comfy_sd = _as_diffusers_transformer(model_files(arch).diffusion_model, arch, tmp_path / "transformer")
    loaded = load_diffusion_model(tmp_path / "transformer", torch.float32).model.diffusion_model.state_dict()
    assert loaded.keys() == comfy_sd.keys()     # what ComfyUI loads from the single file, weight for weight
    assert all(torch.equal(loaded[k], comfy_sd[k].float()) for k in loaded)
    meta = build_meta_model(tmp_path / "transformer", torch.bfloat16, arch).model.diffusion_model.state_dict()
    assert {k: v.shape for k, v in meta.items()} == {k: v.shape for k, v in loaded.items()}


def test_a_wan_checkpoint_folder_trains_the_single_files_weights(model_files, tmp_path):
    """diffusion-pipe's Wan table (ckpt_path + llm_path): the folder's transformer shard (the official keys are
    ComfyUI's) and its Wan2.1_VAE.pth load as ComfyUI loads PipeTrain's tiny Wan files."""
    import shutil

    import torch

    from pipetrain.backend.models.loading import _load_state_dict, load_diffusion_model
    from pipetrain.backend.models.registry import adapter_class
    files = model_files("wan")
    folder = tmp_path / "Wan2.1-T2V-1.3B"
    folder.mkdir()
    shutil.copy(files.diffusion_model, folder / "diffusion_pytorch_model.safetensors")
    torch.save(_load_state_dict(files.vae)[0], folder / "Wan2.1_VAE.pth")   # the official VAE is a .pth
    cfg = load_run_config(_write(tmp_path, f"type = 'wan'\nckpt_path = 'Wan2.1-T2V-1.3B'\n"
                                           f"llm_path = '{files.text_encoders[0]}'\ndtype = 'float32'\n"))
    adapter = adapter_class("wan")(cfg.model, cfg.resolve)
    ours = adapter.load_diffusion_model().model.diffusion_model.state_dict()
    single = load_diffusion_model(files.diffusion_model, torch.float32).model.diffusion_model.state_dict()
    assert ours.keys() == single.keys() and all(torch.equal(ours[k], single[k]) for k in ours)
    assert adapter.load_vae().latent_channels == 16


def test_a_text_encoder_folder_comfyui_reads_no_folder_of_is_refused_naming_the_single_files(tmp_path):
    import torch

    from pipetrain.backend.models.loading import load_text_encoders
    folder = tmp_path / "text_encoder"
    _save(folder / "model.safetensors", {"model.embed_tokens.weight": torch.zeros(4, 2)})
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma2"}))
    with pytest.raises(ModelError) as err:
        load_text_encoders([folder], "lumina2", None)
    assert "gemma2" in str(err.value) and "single files" in str(err.value) and "Gemma-2-2B" in str(err.value)


def test_a_full_fine_tune_of_a_folder_saves_a_comfyui_single_file(model_files, tmp_path):
    """A full fine-tune's save (``merge_full_model``) from a Diffusers transformer: one file with ComfyUI's keys,
    which ComfyUI loads as the model trained."""
    import torch

    from pipetrain.backend.models.loading import load_diffusion_model
    from pipetrain.backend.train.saving import merge_full_model
    comfy_sd = _as_diffusers_transformer(model_files("sd3").diffusion_model, "sd3", tmp_path / "transformer")
    dm = load_diffusion_model(tmp_path / "transformer", torch.float32).model.diffusion_model
    (tmp_path / "parts").mkdir()
    merge_full_model(dm, tmp_path / "transformer", tmp_path / "parts", tmp_path / "full.safetensors", torch.float32,
                     {"epoch": 1})
    saved = load_diffusion_model(tmp_path / "full.safetensors", torch.float32).model.diffusion_model.state_dict()
    assert saved.keys() == comfy_sd.keys() and all(torch.equal(saved[k], comfy_sd[k].float()) for k in saved)


def test_the_comfyui_version_probe_reads_a_folders_model(model_files, tmp_path):
    """The pinned-fallback probe (another ComfyUI's LoRA loader on the run's model, built from its header) takes
    a Diffusers folder: a LoRA on one SD3 linear is applied there."""
    import torch
    from safetensors.torch import save_file

    from pipetrain.backend.parity.probe import probe_lora
    comfy_sd = _as_diffusers_transformer(model_files("sd3").diffusion_model, "sd3", tmp_path / "transformer")
    module = "joint_blocks.0.x_block.attn.qkv"
    width = comfy_sd[f"{module}.weight"].shape
    save_file({f"diffusion_model.{module}.lora_A.weight": torch.zeros(2, width[1]),
               f"diffusion_model.{module}.lora_B.weight": torch.zeros(width[0], 2)}, str(tmp_path / "lora.safetensors"))
    result = probe_lora(tmp_path / "transformer", tmp_path / "lora.safetensors")
    assert (result["modules"], result["applied"], result["unmatched"]) == (1, 1, [])

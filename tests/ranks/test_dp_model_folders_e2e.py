"""diffusion-pipe configs whose models are its folders train here, 2 ranks as a 2-stage pipeline, and each LoRA
loads in ComfyUI with ComfyUI's keys:
- Flux as dp requires it (``diffusers_path``: a Diffusers pipeline folder's transformer, VAE and text encoders, read
  through ComfyUI's converters);
- Wan from its official checkpoint folder (``ckpt_path``: the transformer shard and ``Wan2.1_VAE.pth``, with
  ``llm_path`` for the T5, as dp's Wan table);
- Flux Kontext as dp declares it (``type = 'flux'``, the Flux folder for the VAE and text encoders, the Kontext file
  as ``transformer_path``, and a dataset with ``control_path``);
- Qwen-Image as dp's qwen_image_24gb_vram example (``diffusers_path``: a Diffusers Qwen-Image folder, its VAE and
  Qwen2.5-VL renamed to ComfyUI's keys) with its ``automagic`` optimizer."""
import shutil
from pathlib import Path

import pytest
from conftest import add_control_images, check_epoch_loras, train
from dp_files import DP_AR_BUCKETS, DP_MONITORING

from pipetrain.backend.commands.demo import make_dataset

pytestmark = pytest.mark.slow

MAIN = """
output_dir = 'output'
dataset = 'dataset.toml'
epochs = 1
micro_batch_size_per_gpu = 1
pipeline_stages = 2
gradient_accumulation_steps = 1
save_every_n_epochs = 1
seed = 7

[model]
{model}
dtype = 'float32'

[adapter]
type = 'lora'
rank = 4

[optimizer]
type = 'adamw'
lr = 2e-3
"""
# examples/dataset.toml's buckets at the tiny models' size; the images in dataset/ (conftest's control images)
DATASET = DP_AR_BUCKETS.replace("[512]", "[64]") + "num_ar_buckets = 3\n[[directory]]\npath = 'dataset'\n" \
    "num_repeats = 1\n"


# 2 pictures (a square and a landscape one: both bucket shapes), 2 steps: what each test asserts (the folder's model
# trains, its cache, its LoRA reproduced by ComfyUI) does not grow with the number of pictures, the run's time does
def _run(root: Path, model: str, images: int = 2, controls: bool = False, optimizer: str = ""):
    make_dataset(root / "dataset", images)
    (root / "dataset.toml").write_text(DATASET)
    main = MAIN.format(model=model)
    main = main[:main.index("[optimizer]")] + optimizer if optimizer else main
    (root / "run.toml").write_text(main + DP_MONITORING)
    if controls:
        add_control_images(root / "run.toml")
    run = train(root / "run.toml", ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    assert run.events("cached")[0]["latents_encoded"] == images
    return run


def test_a_dp_flux_config_with_diffusers_path_trains_and_its_lora_loads_in_comfyui(flux_diffusers_folder,
                                                                                     tmp_path):
    (tmp_path / "FLUX-tiny").symlink_to(flux_diffusers_folder)   # dp's relative path, resolved from the TOML
    run = _run(tmp_path, "type = 'flux'\ndiffusers_path = 'FLUX-tiny'\nflux_shift = true")
    check_epoch_loras(run, tmp_path / "run.toml", keys=13)   # every adapted linear of 1 double + 1 single block


def test_a_dp_wan_config_with_ckpt_path_trains_and_its_lora_loads_in_comfyui(model_files, tmp_path):
    """The official folder's layout: the transformer's safetensors and the VAE as a .pth (the tiny Wan's weights,
    whose keys are the official ones)."""
    import torch

    from pipetrain.backend.models.loading import _load_state_dict
    files = model_files("wan")
    folder = tmp_path / "Wan2.1-T2V-1.3B"
    folder.mkdir()
    shutil.copy(files.diffusion_model, folder / "diffusion_pytorch_model.safetensors")
    torch.save(_load_state_dict(files.vae)[0], folder / "Wan2.1_VAE.pth")
    run = _run(tmp_path, f"type = 'wan'\nckpt_path = 'Wan2.1-T2V-1.3B'\nllm_path = '{files.text_encoders[0]}'")
    assert run.events("engine")[0]["stage_bounds"] == [0, 2, 4]
    check_epoch_loras(run, tmp_path / "run.toml", keys=20)   # 10 adapted linears in each of 2 blocks


def test_a_dp_kontext_config_trains_flux_kontext_and_its_lora_loads_in_comfyui(flux_diffusers_folder, model_files,
                                                                                 tmp_path):
    """dp's Flux Kontext table (the Flux folder, the Kontext file; Flux's micro file stands in for it: a Kontext
    file has Flux dev's layout) with control images: an edit run, each latent cached with its reference."""
    from pipetrain.backend.cache import CacheStore
    from pipetrain.backend.cache.manifest import CacheManifest
    kontext = model_files("flux", "micro").diffusion_model
    model = f"type = 'flux'\ndiffusers_path = '{flux_diffusers_folder}'\ntransformer_path = '{kontext}'"
    run = _run(tmp_path, model, controls=True)
    cache = tmp_path / "output" / "cache"
    (manifest,) = cache.glob("manifests/flux_kontext-*")   # trained as Flux Kontext
    store = CacheStore(cache)
    for entry in CacheManifest.load(manifest).entries:
        payload = store.get("latents", entry.latent)
        assert payload["reference"].shape == payload["latent"].shape
    check_epoch_loras(run, tmp_path / "run.toml", keys=26)   # 2 double blocks x 10 + 2 single blocks x 3


def _qwen_image_folder(files, folder: Path) -> Path:
    """A Diffusers Qwen-Image pipeline folder from the tiny Qwen-Image: the transformer file as is (its keys are
    ComfyUI's), a tiny diffusers AutoencoderKLQwenImage and the tiny Qwen2.5-VL under transformers 5's names with
    a Hugging Face config.json (its sizes: ComfyUI reads them from there)."""
    import json

    import torch
    from diffusers import AutoencoderKLQwenImage
    from safetensors.torch import save_file

    from pipetrain.backend.models.encoders import TEXT_ENCODERS
    from pipetrain.backend.models.loading import _load_state_dict
    (folder / "transformer").mkdir(parents=True)
    shutil.copy(files.diffusion_model, folder / "transformer" / "diffusion_pytorch_model.safetensors")
    torch.manual_seed(0)
    AutoencoderKLQwenImage(base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                           temperal_downsample=[False, True, True]).save_pretrained(folder / "vae")
    te = {k.replace("model.", "model.language_model.", 1): v.contiguous()
          for k, v in _load_state_dict(files.text_encoders[0])[0].items()}
    (folder / "text_encoder").mkdir()
    save_file(te, str(folder / "text_encoder" / "model.safetensors"))
    sizes = TEXT_ENCODERS["qwen25_7b"].tiny
    (folder / "text_encoder" / "config.json").write_text(json.dumps(
        {"model_type": "qwen2_5_vl", "text_config": {**sizes, "model_type": "qwen2_5_vl_text"}}))
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    return folder


def test_a_dp_qwen_image_config_with_diffusers_path_and_automagic_trains_and_its_lora_loads_in_comfyui(
        model_files, tmp_path):
    _qwen_image_folder(model_files("qwen_image"), tmp_path / "Qwen-Image")
    # the example's optimizer; a start rate (and its ceiling) the tiny run's two steps move the LoRA visibly with
    run = _run(tmp_path, "type = 'qwen_image'\ndiffusers_path = 'Qwen-Image'",
               optimizer="[optimizer]\ntype = 'automagic'\nlr = 1e-2\nmax_lr = 2e-2\nweight_decay = 0.01\n")
    check_epoch_loras(run, tmp_path / "run.toml", keys=24)   # 14 adapted linears + 10 in the last block (its text
    # queries, attention output and MLP feed nothing)

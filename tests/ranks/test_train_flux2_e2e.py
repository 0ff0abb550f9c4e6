"""Flux 2 dev and Flux Kontext end to end on the CPU: generated dataset -> cache -> 2 DeepSpeed ranks as a
2-stage pipeline -> epoch LoRAs loaded by ComfyUI's LoraLoaderModelOnly, reproducing the training-side output.

Flux 2: Mistral text (tekken tokenizer from the file) left-padded to 512 tokens, 128-channel latents of its VAE.
Kontext (and Flux 2 edit, with two control folders): an edit dataset whose control images (control_path) become
reference latents the network attends to;
ComfyUI's side of the check gets them as its ``ref_latents``."""
import pytest
import torch
from conftest import add_control_images, check_epoch_loras, train

from pipetrain.backend.cache import CacheStore
from pipetrain.backend.cache.manifest import CacheManifest
from pipetrain.backend.config import load_run_config

pytestmark = pytest.mark.slow


def test_flux2_two_stage_pipeline_to_comfyui_lora(model_files, make_run):
    # 4 pictures: a micro-batch of 2 in each bucket shape; what is asserted of each epoch's LoRA does not grow with the
    # number of steps
    config = make_run(model_files("flux2"), images=4, stages=2, epochs=2, model={"type": "flux2"},
                      micro_batch_size_per_gpu=2,   # two captions of different lengths per micro-batch
                      optimizer={"lr": 2e-2})       # 2 steps an epoch: enough for a visible LoRA at this rate
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    # a double block costs two single ones: input + 2 double | join + 2 single + output
    assert run.events("engine")[0]["stage_bounds"] == [0, 3, 7]
    assert [e["epoch"] for e in run.events("lora_saved")] == [1, 2]
    cache = config.parent / "output" / "cache"
    manifest = CacheManifest.load(next(cache.glob("manifests/flux2-*")))
    latent = CacheStore(cache).get("latents", manifest.entries[0].latent)["latent"]
    assert latent.shape[0] == 128 and latent.shape[1] * 16 in (48, 64, 80)   # 16x, Flux 2's 128 channels
    check_epoch_loras(run, config, keys=20)   # 8 linears in each double block, 2 in each single block


def test_flux_kontext_with_control_images_to_comfyui_lora(model_files, make_run):
    """A Kontext file has Flux dev's layout, so Flux's micro files stand in for it; the [model] type makes the
    run an edit run."""
    from PIL import Image

    # 2 pictures (both bucket shapes): every cached reference is checked, and the LoRA's check does not grow with
    # the number of steps
    config = make_run(model_files("flux", "micro"), images=2, stages=2, epochs=1, model={"type": "flux_kontext"},
                      optimizer={"lr": 1e-2})
    root = add_control_images(config)
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    assert run.events("engine")[0]["stage_bounds"] == [0, 4, 7]     # input + 2 double + join | 2 single + output
    assert [e["epoch"] for e in run.events("lora_saved")] == [1]
    cache = root / "output" / "cache"
    store = CacheStore(cache)
    for entry in CacheManifest.load(next(cache.glob("manifests/flux_kontext-*"))).entries:
        payload = store.get("latents", entry.latent)
        assert payload["reference"].shape == payload["latent"].shape   # the control image at the same bucket
        assert not torch.equal(payload["reference"], payload["latent"])
    check_epoch_loras(run, config, keys=26)   # 10 linears in each double block (modulations too), 3 in each single

    # epoch samples of an edit model attend to a reference: the dataset's first control image
    from PIL import ImageChops

    from pipetrain.backend.sampling import render as sampling
    from pipetrain.backend.config import SamplesConfig

    cfg = load_run_config(config)
    cfg.samples = SamplesConfig(prompts=["a red circle"], width=64, height=64, steps=2, cfg=1.0)
    first = sampling.render(cfg, run.loras()[0])[0]
    before = Image.open(first).copy()
    control = sorted((root / "controls").glob("*.jpg"))[0]
    Image.new("RGB", (64, 64), (0, 0, 255)).save(control)           # another reference picture
    after = Image.open(sampling.render(cfg, run.loras()[0])[0])
    assert ImageChops.difference(before.convert("RGB"), after.convert("RGB")).getbbox() is not None


def test_flux2_edit_with_two_reference_folders_to_comfyui_lora(model_files, make_run):
    """Flux 2 with reference images: two control folders (control_path as a list) give each picture two reference
    latents, stacked per micro-batch of 2; ComfyUI's side of the check gets them as its ``ref_latents``, and epoch
    samples edit the first picture's two control images."""
    from PIL import Image, ImageChops

    from pipetrain.backend.sampling import render as sampling
    from pipetrain.backend.config import SamplesConfig

    config = make_run(model_files("flux2"), images=4, stages=2, epochs=1, model={"type": "flux2_edit"},
                      micro_batch_size_per_gpu=2, optimizer={"lr": 2e-2})
    root = add_control_images(config, folders=2)
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    cache = root / "output" / "cache"
    store = CacheStore(cache)
    for entry in CacheManifest.load(next(cache.glob("manifests/flux2_edit-*"))).entries:
        payload = store.get("latents", entry.latent)
        assert payload["references"].shape == (2, *payload["latent"].shape)   # both at the picture's bucket
        assert not torch.equal(payload["references"][0], payload["references"][1])
    check_epoch_loras(run, config, keys=20)

    cfg = load_run_config(config)
    cfg.samples = SamplesConfig(prompts=["a red circle"], width=64, height=64, steps=2, cfg=1.0)
    before = Image.open(sampling.render(cfg, run.loras()[0])[0]).copy()
    second = sorted((root / "controls2").glob("*.jpg"))[0]
    Image.new("RGB", (64, 64), (0, 0, 255)).save(second)            # the second reference of the sampled picture
    after = Image.open(sampling.render(cfg, run.loras()[0])[0])
    assert ImageChops.difference(before.convert("RGB"), after.convert("RGB")).getbbox() is not None

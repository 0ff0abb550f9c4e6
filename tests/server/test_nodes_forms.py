# SPDX-License-Identifier: GPL-3.0-or-later
"""The node forms without a server: parsing, spec building and dataset chaining."""
from __future__ import annotations

import pytest

from pipetrain.backend.host.runtime import ensure_comfyui
from pipetrain.backend.config.patch import RunPatch
from pipetrain.launcher.forms import folder_patch, model_patch
from pipetrain.launcher.specs import DatasetSpec


@pytest.fixture(scope="module")
def forms():
    ensure_comfyui()
    from pipetrain.nodes import NODES, data, parallelism, settings
    return NODES, data, settings, parallelism


def test_parsers(forms):
    _, data, _, parallelism = forms
    assert data.parse_resolutions("512, 768") == (512, 768)
    for bad in ("", "500", "a"):
        with pytest.raises(ValueError):
            data.parse_resolutions(bad)
    assert parallelism.parse_gpu_ids("2, 3") == (2, 3) and parallelism.parse_gpu_ids("") == ()
    with pytest.raises(ValueError):
        parallelism.parse_gpu_ids("1,1")
    assert "does not divide" in parallelism.ParallelismNode.validate_inputs(gpus=3, pipeline_stages=2, gpu_ids="")
    assert parallelism.ParallelismNode.validate_inputs(gpus=4, pipeline_stages=2, gpu_ids="0,1,2,3") is True


def test_specs_are_hashable_and_datasets_chain(forms):
    nodes, _, settings, parallelism = forms
    a = DatasetSpec((folder_patch("/a"),))
    b = DatasetSpec((folder_patch("/b", num_repeats=3),), RunPatch.of({"resolutions": (1024,)}))
    chained = a.plus(b)
    assert [d.get("path") for d in chained.directories] == ["/b", "/a"]
    assert chained.table()["resolutions"] == [1024]
    assert hash(chained) == hash(a.plus(b))
    out = parallelism.ParallelismNode.execute(gpus=2, pipeline_stages=2, micro_batch_size_per_gpu=1,
                                              gradient_accumulation_steps=1, gpu_ids="4,5")
    assert out.result[0].devices == (4, 5)
    forms_only = [settings.AdapterNode, settings.OptimizerNode, settings.ScheduleNode, parallelism.ParallelismNode,
                  settings.MemoryNode]
    assert all(n in nodes for n in forms_only)
    assert {n.define_schema().category for n in forms_only} == {"PipeTrain"}


# --- every option reachable from the nodes: node inputs -> specs -> run.toml -> RunConfig ------------------------

def _files(tmp_path):
    paths = {}
    for name in ("dm", "vae", "te1", "te2"):
        paths[name] = tmp_path / f"{name}.safetensors"
        paths[name].write_bytes(b"x")
    for folder in ("train", "held_out"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.png").write_bytes(b"x")
    return paths


def _dataset(data, folder, **kw):
    args = dict(folder=str(folder), resolutions="512", enable_ar_bucket=True, min_ar=0.5, max_ar=2.0,
                num_ar_buckets=7, num_repeats=1, caption_extension=".txt")
    return data.DatasetNode.execute(**{**args, **kw}).result[0]


def test_every_node_option_reaches_the_run_config(forms, tmp_path, monkeypatch):
    from pipetrain.backend.config import load_run_config
    from pipetrain.launcher import comfy as host
    from pipetrain.launcher.build import write_config
    from pipetrain.nodes import samples as samples_node
    from pipetrain.nodes import train as train_node

    _, data, settings, _ = forms
    f = _files(tmp_path)
    dataset = _dataset(data, tmp_path / "train", caption_prefix="sks, ", shuffle_tags=True, cache_shuffle_num=3,
                       frame_buckets="1, 33", uncond_fraction=0.25)
    held_out = _dataset(data, tmp_path / "held_out")
    samples = samples_node.SamplesNode.execute(
        prompts="a fox\n\n  an owl  ", negative_prompt="blurry", seed=7, width=512, height=768, steps=9, cfg=2.5,
        guidance=4.0, sampler="dpmpp_2m", scheduler="karras").result[0]
    optimizer = settings.OptimizerNode.execute(type="Prodigy", lr=1.0, beta1=0.9, beta2=0.99, weight_decay=0.01,
                                               eps=1e-8, extra_args="d_coef = 2, decouple = true").result[0]
    schedule = settings.ScheduleNode.execute(epochs=3, lr_scheduler="cosine", warmup_steps=2, save_every_n_epochs=0,
                                             checkpoint_every_n_epochs=0, checkpoint_every_n_minutes=0, seed=5,
                                             save_every_n_steps=4, eval_every_n_epochs=2, eval_every_n_steps=6).result[0]
    model = model_patch("flux", str(f["dm"]), str(f["vae"]), (str(f["te1"]), str(f["te2"])))

    captured = {}

    class FakeLauncher:
        def start(self, spec, run_name):
            captured["spec"] = spec
            return "run-1"

        def where(self, run_id):
            return "on GPU(s) [0]"

        def queue_plan(self, run_id):
            return "memory plan: (not made here)"
    monkeypatch.setattr(host, "get_launcher", lambda: FakeLauncher())
    memory = settings.MemoryNode.execute(activation_checkpointing=True, blocks_to_swap=0,
                                         offload_activations=True).result[0]
    train_node.TrainNode.execute(dataset=dataset, model=model, run_name="x", optimizer=optimizer, schedule=schedule,
                                 memory=memory, eval_dataset=held_out, samples=samples)
    spec = captured["spec"]
    assert spec.eval_dataset == held_out and spec.samples == samples

    cfg = load_run_config(write_config(spec, tmp_path / "run", output_dir=tmp_path / "out", run_name="r",
                                       lora_dir=None))
    d = cfg.dataset_config.directory[0]
    assert (d.caption_prefix, d.shuffle_tags, d.cache_shuffle_num, d.frame_buckets) == ("sks, ", True, 3, [1, 33])
    assert cfg.uncond_fraction == 0.25
    assert [e.name for e in cfg.eval_datasets] == ["eval"]
    assert cfg.eval_dataset_configs()["eval"].directory[0].path == str(tmp_path / "held_out")
    assert (cfg.eval_every_n_epochs, cfg.eval_every_n_steps) == (2, 6)
    assert (cfg.save_every_n_epochs, cfg.save_every_n_steps) == (None, 4)
    assert cfg.optimizer.type == "Prodigy" and cfg.optimizer.kwargs() == {
        "lr": 1.0, "betas": (0.9, 0.99), "weight_decay": 0.01, "eps": 1e-8, "d_coef": 2, "decouple": True}
    s = cfg.samples
    assert (s.prompts, s.negative_prompt, s.seed, s.width, s.height, s.steps, s.cfg, s.guidance, s.sampler,
            s.scheduler) == (["a fox", "an owl"], "blurry", 7, 512, 768, 9, 2.5, 4.0, "dpmpp_2m", "karras")
    assert (cfg.lr_scheduler, cfg.warmup_steps, cfg.seed, cfg.epochs) == ("cosine", 2, 5, 3)
    assert cfg.activation_checkpointing == "unsloth"


def test_node_option_errors_are_caught_when_queued(forms, tmp_path):
    from pipetrain.backend.errors import ConfigError
    from pipetrain.launcher.build import check_spec
    from pipetrain.launcher.specs import TrainSpec
    from pipetrain.nodes import samples as samples_node

    _, data, settings, _ = forms
    f = _files(tmp_path)
    model = model_patch("flux", str(f["dm"]), str(f["vae"]), (str(f["te1"]), str(f["te2"])))
    assert "prompt" in samples_node.SamplesNode.validate_inputs(prompts="\n  \n")
    assert "extra_args" in settings.OptimizerNode.validate_inputs(extra_args="d_coef = ")
    assert settings.parse_kwargs("a = 1\nb = [1, 2]") == (("a", 1), ("b", (1, 2)))
    assert "nothing would be saved" in settings.ScheduleNode.validate_inputs(save_every_n_epochs=0,
                                                                            save_every_n_steps=0)
    assert "frame_buckets" in data.dataset_input_error(frame_buckets="1, x")
    sgd = settings.OptimizerNode.execute(type="sgd", lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8,
                                         extra_args="momentum = 0.9").result[0]
    dataset = _dataset(data, tmp_path / "train")
    check_spec(TrainSpec(dataset, model, optimizer=sgd))   # sgd gets no betas / eps
    magic = settings.OptimizerNode.execute(type="automagic", lr=1e-5, beta1=0.9, beta2=0.98, weight_decay=0.01,
                                           eps=1e-8, extra_args="max_lr = 1e-4").result[0]
    check_spec(TrainSpec(dataset, model, optimizer=magic))   # automagic gets beta2 alone, its eps is a pair
    assert (magic.get("optimizer.beta2"), magic.get("optimizer.betas"), magic.get("optimizer.max_lr")) == (
        0.98, None, 1e-4)
    bad = settings.OptimizerNode.execute(type="adamw", lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8,
                                         extra_args="d_coef = 2").result[0]
    with pytest.raises(ConfigError, match="d_coef"):
        check_spec(TrainSpec(dataset, model, optimizer=bad))


def test_model_type_picks_what_the_weights_cannot_tell(tmp_path):
    """A Flux file trains as Flux Kontext when the user says so; a type of another family is refused."""
    from server_fixtures import write_fake_model

    from pipetrain.backend.host.runtime import ensure_comfyui
    ensure_comfyui()
    from pipetrain.nodes.data import AUTO, detect

    flux = str(write_fake_model(tmp_path / "kontext.safetensors", "flux"))
    assert detect(flux) == detect(flux, AUTO) == "flux"
    assert detect(flux, "flux_kontext") == "flux_kontext"
    with pytest.raises(ValueError, match="is a flux model"):
        detect(flux, "qwen_image_edit")


def test_the_dataset_node_pairs_control_images_for_edit_models(forms, tmp_path):
    from PIL import Image

    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.errors import DatasetError
    from pipetrain.backend.data import scan_dataset
    from pipetrain.launcher.build import check_spec, dataset_config, write_config
    from pipetrain.launcher.specs import TrainSpec

    _, data, _, _ = forms
    f = _files(tmp_path)
    for folder, name in (("pictures", "a.png"), ("pictures", "b.png"), ("controls", "a.jpg"), ("controls", "b.jpg")):
        (tmp_path / folder).mkdir(exist_ok=True)
        Image.new("RGB", (64, 48), (200, 30, 30)).save(tmp_path / folder / name)
    kontext = model_patch("flux_kontext", str(f["dm"]), str(f["vae"]), (str(f["te1"]), str(f["te2"])))
    flux = kontext | RunPatch.of({"model.type": "flux"})
    paired = _dataset(data, tmp_path / "pictures", control_folder=str(tmp_path / "controls"))
    cfg = load_run_config(write_config(TrainSpec(paired, kontext), tmp_path / "run", output_dir=tmp_path / "out",
                                       run_name="r", lora_dir=None))
    assert cfg.dataset_config.directory[0].control_path == str(tmp_path / "controls")
    # several folders, comma-separated: a list in the dataset file, refused by a single-reference edit model
    two = _dataset(data, tmp_path / "pictures", control_folder=f"{tmp_path / 'controls'}, {tmp_path / 'controls'}")
    with pytest.raises(DatasetError, match="lists 2 control folders in control_path; flux_kontext takes a single"):
        write_config(TrainSpec(two, kontext), tmp_path / "run2", output_dir=tmp_path / "out", run_name="r2",
                     lora_dir=None)

    with pytest.raises(DatasetError, match="has no control_path"):      # an edit model without control images
        check_spec(TrainSpec(_dataset(data, tmp_path / "pictures"), kontext))
    with pytest.raises(DatasetError, match="not an edit model"):
        check_spec(TrainSpec(paired, flux))
    Image.new("RGB", (64, 48)).save(tmp_path / "controls" / "c.jpg")      # a control image without its picture
    with pytest.raises(DatasetError, match="1 unpaired file") as e:
        check_spec(TrainSpec(paired, kontext))
    assert "c.jpg" not in str(e.value)     # counted, not named: the answer goes to whoever queued it (#34 item 8)
    with pytest.raises(DatasetError, match="c.jpg"):          # the CLI's scan names it
        scan_dataset(dataset_config(paired))
    assert "is not a folder" in data.dataset_input_error(control_folder=str(tmp_path / "nowhere"))


def test_the_loss_widgets_write_each_parameter_with_its_loss_only():
    from pipetrain.launcher.forms import loss_patch

    assert loss_patch().as_dict() == {"loss_type": "mse"}                 # the node as it starts: today's loss
    assert loss_patch("smooth_l1", 0.3, 0.2, 0.0).as_dict() == {"loss_type": "smooth_l1", "smooth_l1_beta": 0.2}
    assert loss_patch("huber", 0.3, 0.2, 0.1).as_dict() == {"loss_type": "huber", "huber_delta": 0.3,
                                                            "noise_offset": 0.1}


def test_load_epoch_lora_at_strength_0_is_the_model_itself(forms, tmp_path, monkeypatch, micro_flux_files):
    """As ComfyUI's LoraLoaderModelOnly: at strength 0 the model it was given, with no patches (ComfyUI would compute
    a patch of strength 0 into every adapted weight at each load); at 1 a clone carrying the LoRA's patches."""
    import folder_paths
    from test_first_hour import fabricate_lora_run

    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.models.registry import adapter_class
    from pipetrain.launcher import comfy as in_comfyui
    from pipetrain.nodes.runs import LoadEpochLoRANode

    monkeypatch.setattr(folder_paths, "output_directory", str(tmp_path / "output"))
    monkeypatch.setattr(in_comfyui, "_launcher", None)        # this process's launcher, of that output folder
    qkv = "diffusion_model.double_blocks.0.img_attn.qkv"      # the micro Flux's first block, 256 wide
    fabricate_lora_run(in_comfyui.runs_root(), "micro-lora", {f"{qkv}.lora_A.weight": (1, 256),
                                                              f"{qkv}.lora_B.weight": (768, 1)})
    adapter = adapter_class("flux")(ModelConfig(type="flux", diffusion_model=str(micro_flux_files.diffusion_model),
                                                vae=str(micro_flux_files.vae), dtype="float32"))
    adapter.load_diffusion_model()
    model = adapter.patcher
    off = LoadEpochLoRANode.execute(model=model, run="newest", epoch=0, strength=0.0)
    on = LoadEpochLoRANode.execute(model=model, run="newest", epoch=0, strength=1.0)
    assert off.result[0] is model and not model.patches, model.patches
    assert list(on.result[0].patches) == [f"{qkv}.weight"]
    said = "loaded run micro-lora, epoch 1: micro-lora-epoch0001.safetensors at strength "
    assert (off.ui.value, on.ui.value) == (said + "0", said + "1")

"""diffusion-pipe config compatibility and the options' pure logic: known-but-unsupported keys fail with
their reason (distinct from typos), model paths in formats we cannot load name the single-file keys,
the examples load, caption variants / dropout, optimizers by name with constructor kwargs, eval timing."""
import math
import re
from pathlib import Path

import pytest
import torch
from dp_files import DP_AR_BUCKETS, DP_MONITORING, DP_OPTIMIZER
from feed_stubs import FlowAdapter as _Adapter, Store as _Store, cache_entries as _entries
from safetensors.torch import save_file

from pipetrain.backend.optim import registry as optim
from pipetrain.backend.config import DatasetConfig, DirectoryConfig, load_dataset_config, load_run_config, save_toml
from pipetrain.backend.data import caption_variants, drops_caption, expand_captions, scan_dataset
from pipetrain.backend.data.buckets import build_examples
from pipetrain.backend.errors import ConfigError
from pipetrain.backend.preflight import load_run
from pipetrain.backend.train.eval import every_n_steps
from pipetrain.backend.train.schedule import lr_multiplier

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# A diffusion-pipe main config (examples/main_example.toml's keys and comments' values) for a Flux model
# given as ComfyUI single files, plus diffusion-pipe's dataset example (frame_buckets, cache_shuffle_*).
DP_MAIN = """
output_dir = '/data/diffusion_pipe_training_runs/flux_test'
dataset = 'dataset.toml'
eval_datasets = [
    {name = 'something', config = 'eval.toml'},
]
epochs = 1000
micro_batch_size_per_gpu = 1
image_micro_batch_size_per_gpu = 4
pipeline_stages = 1
gradient_accumulation_steps = 1
gradient_clipping = 1.0
warmup_steps = 100
lr_scheduler = 'linear'
blocks_to_swap = 0
eval_every_n_epochs = 1
eval_before_first_step = true
eval_micro_batch_size_per_gpu = 1
image_eval_micro_batch_size_per_gpu = 2
eval_gradient_accumulation_steps = 1
disable_block_swap_for_eval = true
save_every_n_epochs = 2
checkpoint_every_n_minutes = 120
activation_checkpointing = true
reentrant_activation_checkpointing = false
partition_method = 'parameters'
save_dtype = 'bfloat16'
caching_batch_size = 1
map_num_proc = 32
compile = false
steps_per_print = 1
video_clip_mode = 'single_beginning'
x_axis_examples = false
uncond_fraction = 0.1

[model]
type = 'flux'
diffusion_model = '/models/flux1-dev.safetensors'
vae = '/models/ae.safetensors'
text_encoders = [{paths = ['/models/clip_l.safetensors', '/models/t5xxl.safetensors'], type = 'flux'}]
dtype = 'bfloat16'
transformer_dtype = 'float8'
timestep_sample_method = 'logit_normal'
flux_shift = true
cache_text_embeddings = true

[adapter]
type = 'lora'
rank = 32
dtype = 'bfloat16'
""" + DP_OPTIMIZER + DP_MONITORING

DP_DATASET = DP_AR_BUCKETS + """num_ar_buckets = 7
frame_buckets = [1, 33]
cache_shuffle_num = 10
cache_shuffle_delimiter = ", "
[[directory]]
path = '/home/anon/data/images/grayscale'
num_repeats = 1
"""


@pytest.fixture
def dp(tmp_path):
    (tmp_path / "run.toml").write_text(DP_MAIN)
    (tmp_path / "dataset.toml").write_text(DP_DATASET)
    (tmp_path / "eval.toml").write_text(DP_DATASET)
    return tmp_path


def _error(path) -> str:
    with pytest.raises(ConfigError) as err:
        load_run(path)
    return str(err.value)


def test_a_diffusion_pipe_config_pair_loads_with_its_meaning(dp):
    cfg = load_run_config(dp / "run.toml")
    assert cfg.model.text_encoder_files == ["/models/clip_l.safetensors", "/models/t5xxl.safetensors"]
    assert cfg.model.diffusion_model_dtype == "float8"             # transformer_dtype
    # the image micro batch applies to image (one-frame) buckets only, not to the videos
    assert (cfg.micro_batch_size_per_gpu, cfg.image_micro_batch_size_per_gpu) == (1, 4)
    assert (cfg.eval_micro_batch_size_per_gpu, cfg.eval_image_micro_batch_size_per_gpu) == (1, 2)
    assert cfg.eval_datasets[0].name == "something" and cfg.uncond_fraction == 0.1
    assert (cfg.partition_method, cfg.lr_scheduler, cfg.warmup_steps) == ("parameters", "linear", 100)
    assert cfg.optimizer.kwargs() == {"lr": 2e-5, "betas": (0.9, 0.99), "weight_decay": 0.01, "eps": 1e-8}
    ds = cfg.dataset_config
    assert ds.caption_options(ds.directory[0]).shuffle_num == 10
    assert list(cfg.eval_dataset_configs()) == ["something"]
    # round trip through run.toml: the inert diffusion-pipe keys are gone, the meaning stays
    save_toml(cfg, dp / "copy.toml")
    again = load_run_config(dp / "copy.toml")
    assert again.model == cfg.model and again.optimizer == cfg.optimizer and again.eval_datasets == cfg.eval_datasets


def test_examples_load(tmp_path):
    for name in ("flux_lora.toml", "sdxl_lora.toml"):
        cfg = load_run_config(EXAMPLES / name)
        assert cfg.dataset_config.directory[0].path == "images"
    assert load_run_config(EXAMPLES / "sdxl_lora.toml").eval_datasets[0].name == "held_out"
    load_dataset_config(EXAMPLES / "eval_dataset.toml")


def _commented_keys(text: str) -> set[str]:
    return set(re.findall(r"^#?\s*([a-z_0-9]+)\s*=", text, flags=re.M))


def test_the_flux_example_shows_every_option():
    from dataclasses import fields

    from pipetrain.backend.config import AdapterConfig, DatasetConfig, ModelConfig, OptimizerConfig, RunConfig

    text = (EXAMPLES / "flux_lora.toml").read_text()
    shown = _commented_keys(text)
    for cls in (RunConfig, ModelConfig, AdapterConfig, OptimizerConfig):
        missing = {f.name for f in fields(cls) if not f.name.startswith("_")} - shown - {
            "adapter", "optimizer", "model", "cluster", "samples", "monitoring", "v_pred", "min_snr_gamma",
            "debiased_estimation_loss", "unet_lr",   # SDXL's: sdxl_lora.toml shows them
            "max_sequence_length", "max_llama3_sequence_length"}   # AuraFlow's, HiDream's: docs/config.md
        assert not missing, (cls.__name__, missing)
    dataset_shown = _commented_keys((EXAMPLES / "dataset.toml").read_text())
    missing = {f.name for f in fields(DatasetConfig) if not f.name.startswith("_")} - dataset_shown - {"directory"}
    assert not missing, missing


@pytest.mark.parametrize("edit, key, reason", [
    (("enable_wandb = false", "enable_wandb = true"), "monitoring.enable_wandb", "pip install wandb"),
    (("eval_micro_batch_size_per_gpu = 1", "eval_micro_batch_size_per_gpu = [[512]]"),   # a pair lacks its batch
     "eval_micro_batch_size_per_gpu", "[[resolution, batch], ...]"),
    (("cache_text_embeddings = true", "cache_text_embeddings = false"), "model.cache_text_embeddings", "cached"),
    (("rank = 32", "rank = 32\nexclude_modules = '('"), "adapter.exclude_modules", "not a regular expression"),
    (("type = 'lora'", "type = 'lokr'\nrank_dropout = 0.1"), "adapter.rank_dropout", "use dropout"),
    (("type = 'adamw_optimi'", "type = 'offload'"), "optimizer.type", "adamw8bit"),
    (("eps = 1e-8", "eps = 1e-8\ngradient_release = true"), "optimizer.gradient_release", "not implemented"),
])
def test_known_unsupported_keys_name_the_key_and_the_fix(dp, edit, key, reason):
    assert edit[0] in DP_MAIN
    (dp / "run.toml").write_text(DP_MAIN.replace(*edit, 1))
    message = _error(dp / "run.toml")
    assert f"key '{key}'" in message and reason in message, message
    assert "unknown key" not in message


def test_typos_list_the_accepted_keys_instead(dp):
    (dp / "run.toml").write_text(DP_MAIN.replace("epochs = 1000", "epochs = 1000\neval_every_n_epoch = 1"))
    message = _error(dp / "run.toml")
    assert "key 'eval_every_n_epoch': unknown key; accepted keys:" in message and "eval_every_n_epochs" in message


@pytest.mark.parametrize("dataset_edit, key, reason", [
    (("[[directory]]", "default_mask_file = 'mask.png'\n[[directory]]"), "default_mask_file",
     "in each [[directory]]"),   # diffusion-pipe reads it per directory only
])
def test_dataset_keys_we_do_not_support(dp, dataset_edit, key, reason):
    (dp / "dataset.toml").write_text(DP_DATASET.replace(*dataset_edit, 1))
    message = _error(dp / "run.toml")
    assert "dataset.toml" in message and f"key '{key}'" in message and reason in message, message


@pytest.mark.parametrize("key", ["diffusers_path", "ckpt_path", "checkpoint_path", "single_file_path"])
def test_model_paths_in_formats_we_cannot_load(dp, key):
    (dp / "run.toml").write_text(DP_MAIN.replace("[model]\n", f"[model]\n{key} = '/models/FLUX.1-dev'\n"))
    message = _error(dp / "run.toml")
    assert f"key 'model.{key}'" in message
    assert all(k in message for k in ("diffusion_model =", "vae =", "text_encoders ="))


def test_a_model_folder_without_weights_is_refused_naming_the_key(dp):
    (dp / "FLUX.1-dev").mkdir()
    (dp / "FLUX.1-dev" / "diffusion_pytorch_model.bin").write_bytes(b"")
    (dp / "run.toml").write_text(DP_MAIN.replace("'/models/flux1-dev.safetensors'", "'FLUX.1-dev'"))
    message = _error(dp / "run.toml")
    assert "key 'model.diffusion_model'" in message and "no .safetensors weights" in message
    assert "diffusion_pytorch_model.bin" in message and "single-file" in message


def test_text_encoder_tables_are_checked_against_the_model(dp):
    (dp / "run.toml").write_text(DP_MAIN.replace("type = 'flux'}", "type = 'sd3'}"))
    assert "key 'model.text_encoders[0]'" in _error(dp / "run.toml")



def test_text_encoder_types_of_comfyui_based_models_are_comfyuis_clip_types(dp):
    """diffusion-pipe's Z-Image config names its Qwen3 encoder type 'lumina2', ComfyUI's CLIPType."""
    z_image = DP_MAIN.replace("type = 'flux'\n", "type = 'z_image'\n", 1)
    (dp / "run.toml").write_text(z_image.replace("type = 'flux'}", "type = 'lumina2'}"))
    assert load_run(dp / "run.toml").model.type == "z_image"
    (dp / "run.toml").write_text(z_image.replace("type = 'flux'}", "type = 'flux'}"))
    assert "'lumina2'" in _error(dp / "run.toml")


def test_alpha_is_allowed_unlike_diffusion_pipe(dp):
    (dp / "run.toml").write_text(DP_MAIN.replace("rank = 32", "rank = 32\nalpha = 16"))
    assert load_run_config(dp / "run.toml").adapter.scale == 0.5


def test_saving_by_steps_alone_means_no_epoch_loras(dp):
    (dp / "run.toml").write_text(DP_MAIN.replace("save_every_n_epochs = 2", "save_every_n_steps = 50"))
    cfg = load_run_config(dp / "run.toml")
    assert (cfg.save_every_n_epochs, cfg.save_every_n_steps) == (None, 50)
    save_toml(cfg, dp / "copy.toml")
    assert load_run_config(dp / "copy.toml").save_every_n_epochs is None


def test_optimizer_extra_keys_reach_the_constructor_and_round_trip(dp):
    (dp / "run.toml").write_text(DP_MAIN.replace("type = 'adamw_optimi'", "type = 'Prodigy'").replace(
        "eps = 1e-8", "eps = 1e-8\nd_coef = 2.0\nsafeguard_warmup = true"))
    cfg = load_run_config(dp / "run.toml")
    klass, kwargs = optim.resolve_optimizer(cfg)
    assert klass.__name__ == "Prodigy" and kwargs["d_coef"] == 2.0 and kwargs["safeguard_warmup"] is True
    p = torch.nn.Parameter(torch.ones(3))
    opt = optim.make_optimizer(cfg, global_batch_size=4)([p])
    assert opt.param_groups[0]["d_coef"] == 2.0 and optim.prodigy_d(opt) == pytest.approx(1e-6)
    save_toml(cfg, dp / "copy.toml")
    assert load_run_config(dp / "copy.toml").optimizer._extra == {"d_coef": 2.0, "safeguard_warmup": True}


def test_optimizer_arguments_are_checked_against_the_constructor(dp):
    (dp / "run.toml").write_text(DP_MAIN.replace("type = 'adamw_optimi'", "type = 'adamw'").replace(
        "eps = 1e-8", "eps = 1e-8\nmomentum = 0.9"))
    with pytest.raises(ConfigError, match=r"key 'optimizer.momentum': AdamW takes no argument 'momentum'"):
        optim.resolve_optimizer(load_run_config(dp / "run.toml"))
    (dp / "run.toml").write_text(DP_MAIN.replace("lr = 2e-5\n", ""))
    with pytest.raises(ConfigError, match=r"key 'optimizer.lr': AdamW needs 'lr'"):   # optimi has no default lr
        optim.resolve_optimizer(load_run_config(dp / "run.toml"))
    # names of pytorch_optimizer that are no optimizer class (functions, losses, schedulers) are never called
    for name in ("NoSuchOptim", "create_optimizer", "load_optimizer", "FocalLoss", "CosineScheduler"):
        (dp / "run.toml").write_text(DP_MAIN.replace("type = 'adamw_optimi'", f"type = '{name}'"))
        with pytest.raises(ConfigError, match=rf"key 'optimizer.type': got '{name}'"):
            optim.resolve_optimizer(load_run_config(dp / "run.toml"))


def test_beta2_half_life_sets_beta2_from_the_global_batch(dp):
    (dp / "run.toml").write_text(DP_MAIN.replace("eps = 1e-8", "eps = 1e-8\nbeta2_half_life = 100"))
    kwargs = optim.optimizer_kwargs(load_run_config(dp / "run.toml"), global_batch_size=4)
    assert kwargs["betas"] == (0.9, pytest.approx(0.5 ** (4 / 100)))


def test_adamw8bit_keeps_8_bit_states(dp):
    """bitsandbytes' AdamW8bit, with min_8bit_size passed through (the micro LoRA's tensors are small).
    bitsandbytes >= 0.45 runs it on the CPU; older builds without a CPU backend skip this test."""
    bnb = pytest.importorskip("bitsandbytes")
    (dp / "run.toml").write_text(DP_MAIN.replace("type = 'adamw_optimi'", "type = 'adamw8bit'").replace(
        "eps = 1e-8", "eps = 1e-8\nmin_8bit_size = 16"))
    p = torch.nn.Parameter(torch.randn(64, 8))
    opt = optim.make_optimizer(load_run_config(dp / "run.toml"), 1)([p])
    assert isinstance(opt, bnb.optim.AdamW8bit)
    p.grad = torch.randn_like(p)
    try:
        opt.step()
    except (RuntimeError, NotImplementedError) as e:  # pragma: no cover
        pytest.skip(f"bitsandbytes has no CPU 8-bit optimizer here: {e}")
    assert opt.state[p]["state1"].dtype == torch.uint8


def test_caption_variants_shuffle_tags_deterministically_behind_the_prefix():
    caption = "red, circle, white background, flat"
    variants = caption_variants(caption, "sks, ", 4, ", ", seed=7, name="a.png")
    assert variants == caption_variants(caption, "sks, ", 4, ", ", seed=7, name="a.png")
    assert variants != caption_variants(caption, "sks, ", 4, ", ", seed=8, name="a.png")
    assert len(set(variants)) > 1
    for v in variants:
        assert v.startswith("sks, ") and sorted(v[5:].split(", ")) == sorted(caption.split(", "))
    assert caption_variants(caption, "sks, ", 0, ", ", 7, "a.png") == ["sks, " + caption]


def _image(path, size=(32, 32)):
    from PIL import Image
    Image.new("RGB", size, (10, 200, 10)).save(path)


def test_dataset_caption_options_per_directory(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        _image(tmp_path / d / "x.png")
        (tmp_path / d / "x.txt").write_text("one, two, three")
        _image(tmp_path / d / "nocap.png")
    cfg = DatasetConfig(directory=[DirectoryConfig(str(tmp_path / "a")),
                                   DirectoryConfig(str(tmp_path / "b"), caption_prefix="", shuffle_tags=False,
                                                   cache_shuffle_num=0, skip_empty_caption=False)],
                        resolutions=[64], caption_prefix="p ", cache_shuffle_num=3, skip_empty_caption=True)
    scan = scan_dataset(cfg)
    assert scan.skipped_empty == [tmp_path / "a" / "nocap.png"]
    texts = [s.text for s in expand_captions(build_examples(cfg, scan.items), seed=1)]
    assert len(texts) == 3 + 2     # a/x.png in 3 variants; b keeps its captions as they are (nocap: empty)
    assert all(t.startswith("p ") for t in texts[:3]) and texts[3:] == ["", "one, two, three"]


def test_shuffle_tags_alone_means_one_variant():
    cfg = DatasetConfig(directory=[DirectoryConfig("x")], shuffle_tags=True)
    assert cfg.caption_options(cfg.directory[0]).shuffle_num == 1


def test_caption_dropout_is_a_seeded_draw_per_sample():
    draws = [drops_caption(3, epoch, step, pos, 0.25) for epoch in range(4) for step in range(25) for pos in range(4)]
    assert draws == [drops_caption(3, e, s, p, 0.25) for e in range(4) for s in range(25) for p in range(4)]
    assert 0.15 < sum(draws) / len(draws) < 0.35
    assert not any(drops_caption(3, 1, s, 0, 0.0) for s in range(100))


def test_warmup_and_schedules():
    f = lr_multiplier("linear", 4, 12)
    assert [f(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert f(12) == 0.0
    g = lr_multiplier("cosine", 0, 10)
    assert g(0) == 1.0 and g(5) == pytest.approx(0.5) and g(10) == pytest.approx(0.0)


def test_step_intervals_from_examples():
    assert every_n_steps(10, 1000, 8) == 10
    assert every_n_steps(None, 1000, 8) == 125
    assert every_n_steps(None, 3, 8) == 1
    assert every_n_steps(None, None, 8) is None


def test_eval_timesteps_are_quantiles_of_the_training_distribution():
    from pipetrain.backend.models.objectives import FlowMatching
    from pipetrain.backend.host.runtime import ensure_comfyui

    ensure_comfyui()
    g = torch.Generator().manual_seed(0)
    for fm in (FlowMatching("logit_normal", 1.0), FlowMatching("uniform"), FlowMatching("logit_normal", shift=3.0),
               FlowMatching("logit_normal", flux_shift=True)):
        drawn = torch.cat([fm.sample_t(1, 256, g) for _ in range(4000)])
        for q in (0.1, 0.5, 0.9):
            t = float(fm.quantile_t(q, 256))
            assert abs(float((drawn < t).float().mean()) - q) < 0.03, (fm, q)
    assert float(FlowMatching("logit_normal").quantile_t(0.5, 256)) == pytest.approx(0.5)
    assert float(FlowMatching("logit_normal", 2.0).quantile_t(0.9, 1)) == pytest.approx(
        1 / (1 + math.exp(-2.0 * 1.2815515655446004)))


def test_the_training_feed_swaps_dropped_captions_for_the_empty_one():
    from pipetrain.backend.host.runtime import ensure_comfyui
    from pipetrain.backend.train.feed import MicroBatchFeed

    ensure_comfyui()
    store, entries = _Store(), _entries(8)
    feed = MicroBatchFeed(_Adapter(), store, seed=5, dp_rank=0, dp_world=1,
                          uncond_text={e.text: "empty" for e in entries}, uncond_fraction=0.5)
    (_, _, _, text), _ = feed.build(entries, epoch=1, step=0, micro=0)
    used = [k for v in text.flatten().tolist() for k, i in store.ids.items() if i == v]
    expected = ["empty" if drops_caption(5, 1, 0, p, 0.5) else e.text for p, e in enumerate(entries)]
    assert used == expected and "empty" in used and len(set(used)) > 1
    plain = MicroBatchFeed(_Adapter(), store, seed=5, dp_rank=0, dp_world=1)
    (_, _, _, text), _ = plain.build(entries, epoch=1, step=0, micro=0)
    assert "empty" not in [k for v in text.flatten().tolist() for k, i in store.ids.items() if i == v]


def test_a_prefetched_step_is_the_step_built_in_place_and_a_stale_one_is_rebuilt():
    import threading

    from pipetrain.backend.host.runtime import ensure_comfyui
    from pipetrain.backend.train.feed import MicroBatchFeed

    ensure_comfyui()
    store, entries = _Store(), _entries(8)
    step_batches = [entries[:4], entries[4:]]
    built_in = []

    class Feed(MicroBatchFeed):
        def build(self, *args, **kw):
            built_in.append(threading.current_thread().name)
            return super().build(*args, **kw)

    feed = Feed(_Adapter(), store, seed=5, dp_rank=0, dp_world=1)
    in_place = [MicroBatchFeed(_Adapter(), store, seed=5, dp_rank=0, dp_world=1).build(b, 2, 3, m)
                for m, b in enumerate(step_batches)]
    feed.prefetch(step_batches, epoch=2, step=3)
    got = list(feed.step_iter(step_batches, epoch=2, step=3))
    assert all(name.startswith("pipetrain-feed") for name in built_in) and len(built_in) == 2
    for (inputs, labels), (inputs_ref, labels_ref) in zip(got, in_place):
        assert all(torch.equal(a, b) for a, b in zip(inputs + labels, inputs_ref + labels_ref))
    built_in.clear()
    feed.prefetch(step_batches, epoch=2, step=4)          # not the step the engine then asks for
    got = list(feed.step_iter(step_batches, epoch=2, step=3))
    assert built_in.count(threading.current_thread().name) == 2     # rebuilt here, with step 3's noise
    assert all(torch.equal(a, b) for a, b in zip(got[0][0], in_place[0][0]))


def test_a_micro_batch_moves_each_tensor_once_keeping_the_labels_the_inputs_tensors():
    from pipetrain.backend.train.feed import _map_tensors

    latents, noise, t, text = torch.zeros(2, 4), torch.ones(2, 4), torch.rand(2), torch.randn(2, 3)
    calls = []
    inputs, labels = _map_tensors(((latents, noise, t, text, None), (latents, noise, t)),
                                  lambda x: calls.append(x) or x.clone())
    assert len(calls) == 4 and inputs[4] is None
    assert all(a is b for a, b in zip(labels, inputs[:3]))               # one copy, shared as before
    assert all(torch.equal(a, b) and a is not b for a, b in zip(inputs[:4], (latents, noise, t, text)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_feed_hands_over_device_tensors_built_in_pinned_memory():
    from pipetrain.backend.host.runtime import ensure_comfyui
    from pipetrain.backend.train.feed import MicroBatchFeed

    ensure_comfyui()
    store, entries = _Store(), _entries(4)
    feed = MicroBatchFeed(_Adapter(), store, seed=5, dp_rank=0, dp_world=1, device=torch.device("cuda"))
    host = MicroBatchFeed(_Adapter(), store, seed=5, dp_rank=0, dp_world=1).build(entries, 2, 3, 0)
    assert all(x.is_pinned() for x in feed.build(entries, 2, 3, 0)[0])
    step_batches = [entries]
    feed.prefetch(step_batches, epoch=2, step=3)
    (inputs, labels), = feed.step_iter(step_batches, epoch=2, step=3)
    assert all(x.is_cuda for x in inputs + labels) and labels[0] is inputs[0]
    assert all(torch.equal(a.cpu(), b) for a, b in zip(inputs, host[0]))


def test_the_eval_feed_is_deterministic_per_sample_whatever_the_batching():
    from pipetrain.backend.host.runtime import ensure_comfyui
    from pipetrain.backend.train.eval import EvalFeed

    ensure_comfyui()
    entries = _entries(4)
    a = EvalFeed(_Adapter(), _Store(), seed=1, dp_rank=0, dp_world=1)
    b = EvalFeed(_Adapter(), _Store(), seed=1, dp_rank=1, dp_world=2)
    a.quantile = b.quantile = 0.3
    (_, noise_a, t_a, _), _ = a.build(entries, epoch=0, step=0, micro=0)
    (_, noise_b, t_b, _), _ = b.build(entries[::-1], epoch=7, step=3, micro=1)
    assert torch.equal(noise_a, noise_b.flip(0)) and torch.equal(t_a, t_b)
    assert torch.allclose(t_a, a.objective.quantile_t(0.3, 4))


def _lora_net(seed):
    from pipetrain.backend.adapters import injection

    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    injection.inject(net, injection.AdapterSpec(rank=2, alpha=2.0, seed=seed), ("0", "1"))
    return net


def _cfg(init, rank=2):
    """A real run config with ``[adapter] init_from_existing`` (absolute paths: resolve leaves them)."""
    from pipetrain.backend.config import RunConfig
    from pipetrain.backend.config.schema import from_dict

    return from_dict(RunConfig, {"output_dir": "o", "dataset": "d.toml",
                                 "model": {"type": "flux", "diffusion_model": "m", "vae": "v"},
                                 "adapter": {"rank": rank, "init_from_existing": str(init)}})


def test_init_from_existing_reads_a_file_or_a_diffusion_pipe_folder_and_checks_it(tmp_path):
    from pipetrain.backend.adapters import injection
    from pipetrain.backend.run.folder import RunDir
    from pipetrain.backend.train.engine import load_existing
    from pipetrain.backend.train.events import RunReporter

    source = injection.state_dict(_lora_net(1))
    source = {k: v + 1.0 if "lora_" in k else v for k, v in source.items()}
    (tmp_path / "run").mkdir()
    save_file(source, str(tmp_path / "run" / "adapter_model.safetensors"))    # diffusion-pipe's folder layout
    net = _lora_net(2)
    run_dir = RunDir(tmp_path / "report")
    run_dir.path.mkdir()
    load_existing(_cfg(tmp_path / "run"), net, ["0", "1"], RunReporter(run_dir, enabled=True))
    assert all(torch.equal(v, source[k]) for k, v in injection.state_dict(net).items() if "lora_" in k)
    [event] = run_dir.read_events()[0]
    assert event["type"] == "init_from_existing" and event["modules_loaded"] == 2 and event["modules"] == 2
    silent = RunReporter(run_dir, enabled=False)
    with pytest.raises(ConfigError, match="rank \\[2\\], the config rank 4"):
        load_existing(_cfg(tmp_path / "run", rank=4), _lora_net(2), ["0", "1"], silent)
    save_file({"diffusion_model.other.lora_A.weight": torch.zeros(2, 8)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ConfigError, match="key 'adapter.init_from_existing'.*no tensor"):
        load_existing(_cfg(tmp_path / "other.safetensors"), _lora_net(2), ["0", "1"], silent)


def test_torch_adamw_runs_fused_only_on_gpu_parameters_and_never_against_the_config(dp):
    """The fused kernels are a default for GPU parameters; CPU parameters and a config that chose ``foreach`` or
    ``fused`` get what they asked for."""
    (dp / "run.toml").write_text(DP_MAIN.replace("type = 'adamw_optimi'", "type = 'adamw'"))
    cfg = load_run_config(dp / "run.toml")
    cpu = [torch.nn.Parameter(torch.ones(3))]
    assert optim.fused_default(torch.optim.AdamW, {}, cpu) == {}
    assert optim.make_optimizer(cfg, 1)(cpu).defaults["fused"] in (None, False)
    meta_gpu = type("P", (), {"device": torch.device("cuda", 0)})()   # only the device is read
    assert optim.fused_default(torch.optim.AdamW, {}, [{"params": [meta_gpu]}]) == {"fused": True}
    assert optim.fused_default(torch.optim.AdamW, {"foreach": True}, [meta_gpu]) == {}
    assert optim.fused_default(torch.optim.AdamW, {"fused": False}, [meta_gpu]) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_adamw_on_the_gpu_takes_the_steps_foreach_takes(dp):
    (dp / "run.toml").write_text(DP_MAIN.replace("type = 'adamw_optimi'", "type = 'adamw'"))
    cfg = load_run_config(dp / "run.toml")
    g = torch.Generator().manual_seed(0)
    start, grads = torch.randn(64, 32, generator=g), [torch.randn(64, 32, generator=g) for _ in range(3)]
    finals = []
    for build in (optim.make_optimizer(cfg, 1), lambda ps: torch.optim.AdamW(ps, foreach=True, **optim.optimizer_kwargs(cfg, 1))):
        p = torch.nn.Parameter(start.cuda())
        opt = build([p])
        for grad in grads:
            p.grad = grad.cuda()
            opt.step()
        finals.append((opt.defaults.get("fused"), p.detach().cpu()))
    assert finals[0][0] is True and finals[1][0] in (None, False)
    torch.testing.assert_close(finals[0][1], finals[1][1], rtol=1e-5, atol=1e-6)


def test_init_from_existing_reads_diffusion_pipes_diffusers_named_flux_save_as_comfyui_applies_it(tmp_path,
                                                                                                    micro_flux_files):
    """diffusion-pipe's Flux saves are Diffusers-named (``transformer.transformer_blocks.N.attn.to_q.lora_A``: q, k,
    v apart, where ComfyUI's Flux has one qkv linear). Loaded into the run's adapter, every module's update is the
    one ComfyUI's own LoRA loader applies from that file; a rank too small to hold the fused parts is refused."""
    from pipetrain.backend.host.runtime import ensure_comfyui

    ensure_comfyui()
    import comfy.lora
    import comfy.utils

    from pipetrain.backend.adapters import injection as lora
    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.models.registry import adapter_class
    from pipetrain.backend.run.folder import RunDir
    from pipetrain.backend.train.engine import load_existing
    from pipetrain.backend.train.events import RunReporter

    files = micro_flux_files
    adapter = adapter_class("flux")(ModelConfig(type="flux", diffusion_model=str(files.diffusion_model),
                                                vae=str(files.vae), dtype="float32"))
    adapter.load_diffusion_model()
    dm = adapter.diffusion_model
    unet_config = adapter.patcher.model.model_config.unet_config
    key_map = comfy.utils.flux_to_diffusers(unet_config)
    g, r, source = torch.Generator().manual_seed(3), 2, {}
    for name, target in key_map.items():   # every linear diffusion-pipe adapts (its blocks' nn.Linear)
        weight_key = target if isinstance(target, str) else target[0]
        if not name.endswith(".weight") or "norm_" in name or "_blocks." not in weight_key:
            continue
        rows, cols = dm.get_submodule(weight_key[:-len(".weight")]).weight.shape
        rows = rows if isinstance(target, str) else target[1][2]
        module = f"transformer.{name[:-len('.weight')]}"
        source[f"{module}.lora_A.weight"] = torch.randn(r, cols, generator=g) * 0.1
        source[f"{module}.lora_B.weight"] = torch.randn(rows, r, generator=g) * 0.1
    save = tmp_path / "epoch3"
    save.mkdir()
    save_file(source, str(save / "pytorch_lora_weights.safetensors"))   # Diffusers' save_lora_weights name

    names = lora.inject(dm, lora.AdapterSpec(rank=4 * r, alpha=2.0 * r, seed=1), adapter.lora_block_prefixes)
    run_dir = RunDir(tmp_path / "report")
    run_dir.path.mkdir()
    load_existing(_cfg(save, rank=4 * r), dm, names, RunReporter(run_dir, enabled=False))

    patches = comfy.lora.load_lora(source, comfy.lora.model_lora_keys_unet(adapter.patcher.model, {}))
    patcher = adapter.patcher.clone()
    assert len(patcher.add_patches(patches, 1.0)) == len(patches)
    checked = 0
    for m in lora.adapted_modules(dm):
        key = f"diffusion_model.{m.lora_name}.weight"
        base = m.weight.detach().float()
        comfy_delta = comfy.lora.calculate_weight(patcher.patches[key], base.clone(), key) - base
        ours = m.lora_scale * m.lora_B.weight.detach().float() @ m.lora_A.weight.detach().float()
        assert comfy_delta.abs().max() > 1e-4 and torch.allclose(ours, comfy_delta, atol=1e-6), m.lora_name
        checked += 1
    assert checked == len(names) and any(".qkv" in n for n in names) and any("linear1" in n for n in names)

    dm_small = adapter_class("flux")(ModelConfig(type="flux", diffusion_model=str(files.diffusion_model),
                                                 vae=str(files.vae), dtype="float32"))
    dm_small.load_diffusion_model()
    small = lora.inject(dm_small.diffusion_model, lora.AdapterSpec(rank=r, alpha=r, seed=1), adapter.lora_block_prefixes)
    with pytest.raises(ConfigError, match=f"set \\[adapter\\] rank = {4 * r}"):
        load_existing(_cfg(save, rank=r), dm_small.diffusion_model, small, RunReporter(run_dir, enabled=False))


def test_fuse_adapters_is_read_as_merge_adapters_at_its_weights_on_flux_and_ignored_where_dp_ignores_it(dp):
    fuse = "rank = 32\nfuse_adapters = [{path = 'loras/a.safetensors', weight = 0.5}, {path = '/loras/b.safetensors'}]"
    (dp / "run.toml").write_text(DP_MAIN.replace("rank = 32", fuse, 1))
    cfg = load_run_config(dp / "run.toml")
    assert cfg.model.merged_loras == [("loras/a.safetensors", 0.5), ("/loras/b.safetensors", 1.0)]
    # diffusion-pipe's other models never read the key: nothing is merged there either
    sdxl = DP_MAIN.replace("type = 'flux'", "type = 'sdxl'", 1).replace("rank = 32", fuse, 1)
    (dp / "sdxl.toml").write_text(sdxl.replace("transformer_dtype = 'float8'\n", ""))
    assert load_run_config(dp / "sdxl.toml").model.merged_loras == []


@pytest.mark.parametrize("value, key, says", [
    ("'a.safetensors'", "adapter.fuse_adapters", "a list of tables"),
    ("[{path = 'a.safetensors', strength = 1.0}]", "adapter.fuse_adapters[0]", "has 'strength'"),
    ("[{weight = 1.0}]", "adapter.fuse_adapters[0]", "has no path"),
    ("[{path = 'a.safetensors', weight = 'full'}]", "adapter.fuse_adapters[0].weight", "a number"),
])
def test_a_bad_fuse_adapters_entry_names_the_key(dp, value, key, says):
    (dp / "run.toml").write_text(DP_MAIN.replace("rank = 32", f"rank = 32\nfuse_adapters = {value}", 1))
    message = _error(dp / "run.toml")
    assert f"key '{key}'" in message and says in message, message


def test_fuse_adapters_beside_merge_adapters_is_refused(dp):
    text = DP_MAIN.replace("rank = 32", "rank = 32\nfuse_adapters = [{path = 'a.safetensors'}]", 1)
    (dp / "run.toml").write_text(text.replace("flux_shift = true", "flux_shift = true\nmerge_adapters = ['b.s']"))
    assert "not both" in _error(dp / "run.toml")

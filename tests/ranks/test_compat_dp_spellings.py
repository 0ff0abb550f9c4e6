"""diffusion-pipe's spellings mean the same here: its type strings, its single-file keys, an edit model declared
as its base type plus control images, the image micro batch (image buckets only) and AdamW8bitKahan's
``stabilize``."""
from pathlib import Path

import pytest

from pipetrain.backend.config import load_run_config
from pipetrain.backend.data import EpochPlan, MediaItem, Example
from pipetrain.backend.errors import ConfigError

MODEL = """
[model]
type = '{type}'
transformer_path = '/models/dm.safetensors'
vae_path = '/models/vae.safetensors'
{encoders}
dtype = 'bfloat16'
"""

RUN = """
output_dir = 'out'
dataset = 'dataset.toml'
epochs = 1
micro_batch_size_per_gpu = 1
image_micro_batch_size_per_gpu = 4
save_every_n_epochs = 1
[optimizer]
type = 'AdamW8bitKahan'
lr = 1e-4
stabilize = false
"""

DATASET = """
resolutions = [512]
frame_buckets = [1, 33]
[[directory]]
path = 'images'
"""


def _write(tmp_path, model: str, run: str = RUN, dataset: str = DATASET) -> Path:
    (tmp_path / "run.toml").write_text(run + model)
    (tmp_path / "dataset.toml").write_text(dataset)
    return tmp_path / "run.toml"


def _error(path) -> str:
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    return str(err.value)


@pytest.mark.parametrize("dp_type, ours", [("hunyuan-video", "hunyuan_video"), ("ltx-video", "ltx_video"),
                                           ("lumina_2", "lumina2"), ("hunyuan_image", "hunyuan_image_21"),
                                           ("wan", "wan"), ("cosmos", "cosmos")])
def test_diffusion_pipe_type_strings(tmp_path, dp_type, ours):
    cfg = load_run_config(_write(tmp_path, MODEL.format(type=dp_type, encoders="")))
    assert cfg.model.type == ours


def test_single_file_keys_map_onto_ours_with_text_encoders_in_our_order(tmp_path):
    # diffusion-pipe's main example (HunyuanVideo): the LLM first, then CLIP-L, whatever order the file gives
    encoders = "clip_path = '/models/clip_l.safetensors'\nllm_path = '/models/llava.safetensors'"
    model = load_run_config(_write(tmp_path, MODEL.format(type="hunyuan-video", encoders=encoders))).model
    assert (model.diffusion_model, model.vae) == ("/models/dm.safetensors", "/models/vae.safetensors")
    assert model.text_encoder_files == ["/models/llava.safetensors", "/models/clip_l.safetensors"]
    encoders = "byt5_path = '/models/byt5.safetensors'\ntext_encoder_path = '/models/qwen.safetensors'"
    model = load_run_config(_write(tmp_path, MODEL.format(type="hunyuan_image", encoders=encoders))).model
    assert model.text_encoder_files == ["/models/qwen.safetensors", "/models/byt5.safetensors"]
    model = load_run_config(_write(tmp_path, MODEL.format(type="cosmos_predict2",
                                                          encoders="t5_path = '/models/t5.safetensors'"))).model
    assert model.text_encoder_files == ["/models/t5.safetensors"]


@pytest.mark.parametrize("extra, key", [("diffusion_model = '/models/x.safetensors'", "model.transformer_path"),
                                        ("text_encoders = ['/models/x.safetensors']", "model.llm_path"),
                                        ("diffusion_model_dtype = 'float8'\ntransformer_dtype = 'float8'",
                                         "model.transformer_dtype")])
def test_both_spellings_of_one_setting_fail(tmp_path, extra, key):
    model = MODEL.format(type="wan", encoders="llm_path = '/models/umt5.safetensors'\n" + extra)
    message = _error(_write(tmp_path, model))
    assert f"key '{key}'" in message and "not both" in message, message


@pytest.mark.parametrize("key", ["diffusers_path", "ckpt_path", "single_file_path"])
def test_model_folders_are_refused_naming_the_single_files_to_use(tmp_path, key):
    model = MODEL.format(type="flux", encoders=f"{key} = '/models/FLUX.1-dev'")
    message = _error(_write(tmp_path, model))
    assert f"key 'model.{key}'" in message and "transformer_path" in message and "text_encoders =" in message


@pytest.mark.parametrize("dp_type, edit", [("flux", "flux_kontext"), ("qwen_image", "qwen_image_edit"),
                                           ("flux2", "flux2_edit")])
def test_an_edit_model_is_its_base_type_plus_control_images(tmp_path, dp_type, edit):
    """diffusion-pipe's Flux Kontext / Qwen-Image-Edit: ``type = 'flux'`` / ``'qwen_image'`` and a dataset with
    control_path; without control images the base model trains as before."""
    model = MODEL.format(type=dp_type, encoders="")
    assert load_run_config(_write(tmp_path, model)).model.type == dp_type
    cfg = load_run_config(_write(tmp_path, model, dataset=DATASET + "control_path = 'control'\n"))
    assert cfg.model.type == edit
    assert load_run_config(_write(tmp_path, MODEL.format(type="sdxl", encoders=""),
                                  dataset=DATASET + "control_path = 'control'\n")).model.type == "sdxl"


def test_control_images_on_a_model_that_takes_none_are_refused_before_caching(tmp_path):
    """Wan 2.1 text-to-video takes no control images (its control models are their own types): refused up front."""
    from pipetrain.backend.errors import DatasetError
    from pipetrain.backend.preflight import load_run

    path = _write(tmp_path, MODEL.format(type="wan", encoders=""), dataset=DATASET + "control_path = 'control'\n")
    with pytest.raises(DatasetError, match="not an edit model"):
        load_run(path)


def test_adamw8bitkahan_stabilize(tmp_path):
    cfg = load_run_config(_write(tmp_path, MODEL.format(type="wan", encoders="")))
    assert cfg.optimizer.kwargs() == {"lr": 1e-4}          # stabilize = false is diffusion-pipe's plain AdamW
    message = _error(_write(tmp_path, MODEL.format(type="wan", encoders=""),
                            run=RUN.replace("stabilize = false", "stabilize = true")))
    assert "key 'optimizer.stabilize'" in message and "stableadamw" in message, message


def _samples(count: int, bucket: tuple[int, ...], prefix: str) -> list[Example]:
    return [Example(MediaItem(Path(f"/data/{prefix}{i}.png"), "", 1, 1, 1, (512,)), bucket) for i in range(count)]


def test_the_image_micro_batch_applies_to_image_buckets_only(tmp_path):
    """A video config with micro = 1 and image_micro = 4: clips train one at a time, images four at a time."""
    cfg = load_run_config(_write(tmp_path, MODEL.format(type="wan", encoders="")))
    videos, images = _samples(3, (512, 512, 33), "clip"), _samples(8, (512, 512), "img")
    for rank, world in ((0, 1), (1, 2)):
        plan = EpochPlan(videos + images, None, cfg.micro_batch_size_per_gpu, 1, rank, world, seed=0,
                         image_micro_batch_size=cfg.image_micro_batch_size_per_gpu)
        steps = plan.epoch(0)
        sizes = sorted((len(micro), micro[0].bucket) for step in steps for micro in step)
        clips = 3 // world   # the clips filling whole global batches of 1 x world
        assert sizes == [(1, (512, 512, 33))] * clips + [(4, (512, 512))] * (8 // (4 * world))
        assert plan.steps_per_epoch() == len(steps) == clips + 8 // (4 * world)
        assert plan.global_batch == world   # a clip's: what examples-counted settings divide by
    # an image dataset's global batch is the image micro batch's, as where diffusion-pipe's image models use it
    assert EpochPlan(images, None, 1, 1, 0, 1, seed=0, image_micro_batch_size=4).global_batch == 4
    # without it every bucket batches micro_batch_size_per_gpu
    plan = EpochPlan(videos + images, None, 1, 1, 0, 1, seed=0)
    assert plan.steps_per_epoch() == 11


@pytest.mark.slow
def test_a_video_run_batches_images_by_the_image_micro_batch(model_files, tmp_path):
    """Wan on 4 clips and 2 stills of one bucket, micro batch 1 and image micro batch 2, 2 ranks as a 2-stage
    pipeline: the clips train one per step, the two stills together (5 steps; 6 without the key), and the LoRA
    still loads in ComfyUI."""
    from conftest import check_epoch_loras, train
    from media import make_video_dataset

    from pipetrain.backend.commands.demo import write_configs

    root = tmp_path / "job"
    make_video_dataset(root / "dataset")
    config = write_configs(root, model_files("wan"), stages=2, epochs=1, image_micro_batch_size_per_gpu=2,
                           model={"type": "wan"})
    with open(root / "dataset.toml", "a") as f:   # lands in the [[directory]] table
        f.write("frame_buckets = [1, 9, 17]\n")
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.events("engine")[0]["steps_per_epoch"] == 5 and len(run.events("step")) == 5
    check_epoch_loras(run, config, keys=20)

"""Issue #36's done-when: diffusion-pipe's own example configs train here as its users start them. Its
``examples/main_example.toml`` (keys and values: ``activation_checkpointing = true``, ``partition_method =
'parameters'``, bfloat16, ``adamw_optimi``) with ``pipeline_stages = 2``, and the ``[model]`` tables of its
``docs/supported_models.md`` for Flux (``diffusers_path``: a Diffusers pipeline folder), HunyuanVideo (its ComfyUI
files; ``clip_path`` a Hugging Face CLIP folder) and Lumina 2 (its ComfyUI files, ``lumina_shift``), paths pointed at
the tiny models, train 2 steps on 2 CPU ranks as 2 stages, started with ``python -m pipetrain deepspeed
--num_gpus=2 train.py --deepspeed --config X``. One run per model: 2 images, one epoch."""
from __future__ import annotations

import tomllib

import pytest
from dp_files import DP_AR_BUCKETS, DP_MAIN, DP_MONITORING, DP_OPTIMIZER
from test_dp_command_line import _dp_line

from pipetrain.backend.commands.demo import make_dataset

pytestmark = pytest.mark.slow

# examples/main_example.toml, but for the two stages, one epoch and a save at its end
MAIN = DP_MAIN.replace("epochs = 1000", "epochs = 1").replace("pipeline_stages = 1", "pipeline_stages = 2").replace(
    "save_every_n_epochs = 2", "save_every_n_epochs = 1").replace("output_dir = 'out'", "output_dir = 'output'") + """
[model]
{model}

[adapter]
type = 'lora'
rank = 4
dtype = 'bfloat16'
"""
# examples/dataset.toml at the tiny models' size (recommended_lumina_dataset_config.toml adds its caption prefix)
DATASET = DP_AR_BUCKETS.replace("[512]", "[64]") + "num_ar_buckets = 7\nframe_buckets = [1, 33]\n{extra}" \
    "[[directory]]\npath = 'images'\nnum_repeats = 1\n"


def _flux(root, files, folder):
    (root / "FLUX.1-dev").symlink_to(folder)
    return "type = 'flux'\ndiffusers_path = 'FLUX.1-dev'\ndtype = 'bfloat16'\ntransformer_dtype = 'float8'\n" \
           "flux_shift = true", ""


def _hunyuan_video(root, files, folder):
    clip = root / "clip-vit-large-patch14"   # a Hugging Face CLIP-L folder, as dp's clip_path: the tiny Flux folder's
    clip.symlink_to(folder / "text_encoder")   # (one layer at CLIP-L's widths, which a folder's config.json fixes)
    return (f"type = 'hunyuan-video'\ntransformer_path = '{files.diffusion_model}'\nvae_path = '{files.vae}'\n"
            f"llm_path = '{files.text_encoders[0]}'\nclip_path = '{clip.name}'\ndtype = 'bfloat16'\n"
            "transformer_dtype = 'float8'\ntimestep_sample_method = 'logit_normal'"), ""


def _lumina_2(root, files, folder):
    return (f"type = 'lumina_2'\ntransformer_path = '{files.diffusion_model}'\nllm_path = '{files.text_encoders[0]}'\n"
            f"vae_path = '{files.vae}'\ndtype = 'bfloat16'\nlumina_shift = true",
            "caption_prefix = 'You are an assistant designed to generate images. <Prompt Start> '\n")


MODELS = [("flux", "flux", _flux), ("hunyuan_video", "hunyuan_video", _hunyuan_video),
          ("lumina2", "lumina2", _lumina_2)]


@pytest.mark.parametrize("arch, ours, table", MODELS, ids=[m[0] for m in MODELS])
def test_dp_example_trains_two_steps_as_two_stages_from_dps_command_line(tmp_path, model_files, arch, ours, table,
                                                                         request):
    folder = request.getfixturevalue("flux_diffusers_folder") if arch != "lumina2" else None
    model, dataset_extra = table(tmp_path, model_files(arch), folder)
    make_dataset(tmp_path / "images", 2)
    (tmp_path / "dataset.toml").write_text(DATASET.format(extra=dataset_extra))
    (tmp_path / "run.toml").write_text(MAIN.format(model=model) + DP_OPTIMIZER + DP_MONITORING)
    run = _dp_line(tmp_path / "run.toml")
    assert run.returncode == 0, run.output[-4000:]
    start = run.events("start")[0]
    assert start["pipeline_stages"] == 2 and run.status()["state"] == "finished"
    assert [e["step"] for e in run.events("step")] == [1, 2] and len(run.loras()) == 1
    ran = tomllib.loads((run.run_dir / "run.toml").read_text())   # what the run trained, as it wrote it
    assert (ran["model"]["type"], ran["partition_method"], ran["activation_checkpointing"]) == (
        ours, "parameters", True)

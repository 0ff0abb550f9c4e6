"""A diffusion-pipe Flux config as dp requires it (``diffusers_path``: a Diffusers pipeline folder) trains here: 2
ranks as a 2-stage pipeline read the folder's transformer, VAE and text encoders through ComfyUI's converters, and
the LoRA loads in ComfyUI with ComfyUI's keys."""
import pytest
from conftest import check_epoch_loras, train
from dp_files import DP_AR_BUCKETS, DP_MONITORING

from pipetrain.backend.demo import make_dataset

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
type = 'flux'
diffusers_path = 'FLUX-tiny'
dtype = 'float32'
flux_shift = true

[adapter]
type = 'lora'
rank = 4

[optimizer]
type = 'adamw'
lr = 2e-3
"""


def test_a_dp_flux_config_with_diffusers_path_trains_and_its_lora_loads_in_comfyui(flux_diffusers_folder,
                                                                                     tmp_path):
    (tmp_path / "FLUX-tiny").symlink_to(flux_diffusers_folder)   # dp's relative path, resolved from the TOML
    make_dataset(tmp_path / "images", 4)
    (tmp_path / "dataset.toml").write_text(DP_AR_BUCKETS.replace("[512]", "[64]") + "num_ar_buckets = 3\n"
                                           "[[directory]]\npath = 'images'\nnum_repeats = 1\n")
    (tmp_path / "run.toml").write_text(MAIN + DP_MONITORING)
    run = train(tmp_path / "run.toml", ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    assert run.events("cached")[0]["latents_encoded"] == 4
    check_epoch_loras(run, tmp_path / "run.toml", keys=13)   # every adapted linear of 1 double + 1 single block

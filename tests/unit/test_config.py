"""RunConfig: diffusion-pipe key names, strict validation with messages naming file, key and accepted
values, and a lossless TOML round trip."""
import pytest

from pipetrain.backend.config import load_dataset_config, load_run_config, save_toml
from pipetrain.backend.errors import ConfigError
from pipetrain.backend.preflight import load_run

DATASET = """
resolutions = [512]
enable_ar_bucket = true
min_ar = 0.5
max_ar = 2.0
num_ar_buckets = 7
[[directory]]
path = "images"
num_repeats = 2
"""

RUN = """
output_dir = "out"
dataset = "dataset.toml"
epochs = 3
micro_batch_size_per_gpu = 1
pipeline_stages = 2
gradient_accumulation_steps = 4
save_every_n_epochs = 1
checkpoint_every_n_minutes = 30
[model]
type = "flux"
diffusion_model = "flux1-dev.safetensors"
vae = "ae.safetensors"
text_encoders = ["clip_l.safetensors", "t5xxl.safetensors"]
dtype = "bfloat16"
[adapter]
type = "lora"
rank = 32
dropout = 0.05
[optimizer]
type = "adamw"
lr = 2e-5
betas = [0.9, 0.99]
weight_decay = 0.01
"""


@pytest.fixture
def files(tmp_path):
    (tmp_path / "dataset.toml").write_text(DATASET)
    (tmp_path / "run.toml").write_text(RUN)
    return tmp_path


def test_loads_diffusion_pipe_keys(files):
    cfg = load_run_config(files / "run.toml")
    assert (cfg.epochs, cfg.pipeline_stages, cfg.gradient_accumulation_steps) == (3, 2, 4)
    assert cfg.model.text_encoders == ["clip_l.safetensors", "t5xxl.safetensors"]
    assert cfg.adapter.rank == 32 and cfg.adapter.scale == 1.0
    ds = cfg.dataset_config
    assert ds.directory[0].num_repeats == 2
    assert ds.directory_path(ds.directory[0]) == files / "images"
    assert cfg.resolve(cfg.model.vae) == files / "ae.safetensors"


def test_round_trip(files, tmp_path):
    cfg = load_run_config(files / "run.toml")
    save_toml(cfg, files / "copy.toml")
    again = load_run_config(files / "copy.toml")
    assert again.model == cfg.model and again.adapter == cfg.adapter and again.optimizer == cfg.optimizer
    assert again.checkpoint_every_n_minutes == 30.0


@pytest.mark.parametrize("edit, key, expected", [
    (("epochs = 3", "epochs = 3\ngrandient_accumulation_steps = 2"), "grandient_accumulation_steps",
     "accepted keys: activation_checkpointing"),
    (('type = "flux"', 'type = "fluxx"'), "model.type", "supported model types: ace_step, anima, auraflow, chroma, cosmos, cosmos_predict2"),
    (('dtype = "bfloat16"', 'dtype = "bf16"'), "model.dtype", "accepted values: 'float32', 'bfloat16'"),
    (("rank = 32", "rank = 0"), "adapter.rank", "must be 1 or more"),
    (("epochs = 3", 'epochs = "three"'), "epochs", "expected an integer"),
    (("[adapter]", "[adapter]\nranks = 4"), "adapter.ranks", "accepted keys in [adapter]"),
])
def test_bad_keys_name_file_key_and_accepted_values(files, edit, key, expected):
    (files / "run.toml").write_text(RUN.replace(*edit, 1))
    with pytest.raises(ConfigError) as err:
        load_run(files / "run.toml")     # what the CLI and the launcher load: the config, then the model's rules
    message = str(err.value)
    assert str(files / "run.toml") in message and f"key '{key}'" in message and expected in message


def test_dataset_errors_name_the_dataset_file(files):
    (files / "dataset.toml").write_text(DATASET.replace("resolutions = [512]", "resolutions = [500]"))
    with pytest.raises(ConfigError, match=r"dataset.toml: key .resolutions..*multiple of 16"):
        load_run_config(files / "run.toml")
    (files / "dataset.toml").write_text("resolutions = [512]\n")
    with pytest.raises(ConfigError, match="key 'directory': required key is missing"):
        load_dataset_config(files / "dataset.toml")


def test_pipeline_stages_must_divide_world_size(files):
    cfg = load_run_config(files / "run.toml")
    cfg.check_world_size(4)
    with pytest.raises(ConfigError, match="pipeline_stages=2 does not divide the 3 ranks"):
        cfg.check_world_size(3)


def test_sizes_and_output_folders_are_checked_before_anything_runs(files):
    """A resolution no machine can hold (PIL died with MemoryError) and an output_dir or lora_dir that is a
    file (a NotADirectoryError traceback) are refused at load, naming the file and key."""
    for bad in ("[100032]", "[512, 8256]"):
        (files / "dataset.toml").write_text(DATASET.replace("resolutions = [512]", f"resolutions = {bad}"))
        with pytest.raises(ConfigError, match=r"dataset.toml: key 'resolutions'.*from 64 to 8192"):
            load_run_config(files / "run.toml")
    (files / "dataset.toml").write_text(DATASET.replace("num_repeats = 2", "resolutions = [99968]"))
    with pytest.raises(ConfigError, match=r"key 'directory.resolutions'.*from 64 to 8192"):
        load_run_config(files / "run.toml")
    (files / "dataset.toml").write_text(DATASET)

    (files / "out").write_text("a file where the output folder should be")
    with pytest.raises(ConfigError, match=rf"key 'output_dir': {files / 'out'} is a file, not a folder"):
        load_run_config(files / "run.toml")
    (files / "run.toml").write_text(RUN.replace('output_dir = "out"', 'output_dir = "out/runs"'))
    with pytest.raises(ConfigError, match="key 'output_dir'.*is a file, not a folder"):   # a file on the way
        load_run_config(files / "run.toml")
    (files / "run.toml").write_text(RUN.replace('output_dir = "out"', 'output_dir = "elsewhere"\nlora_dir = "out"'))
    with pytest.raises(ConfigError, match="key 'lora_dir'.*is a file, not a folder"):
        load_run_config(files / "run.toml")


def test_wandb_without_the_package_is_refused_naming_the_key(files):
    """[monitoring] enable_wandb with no wandb in this Python: refused before anything runs (this machine has no
    wandb; tests/ranks/test_wandb.py runs with a stand-in)."""
    import importlib.util

    from pipetrain.backend.preflight import load_run

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    run = files / "run.toml"
    run.write_text(run.read_text() + "\n[monitoring]\nenable_wandb = true\n")
    with pytest.raises(ConfigError, match="key 'monitoring.enable_wandb'.*pip install wandb"):
        load_run(run)
    run.write_text(run.read_text().replace("enable_wandb = true", "enable_wandb = true\nwandb_api_key = 'a b'"))
    with pytest.raises(ConfigError, match="monitoring.wandb_api_key") as err:
        load_run(run)
    assert "a b" not in str(err.value)


def test_subsample_ratio_is_read_at_the_top_of_the_dataset_file_and_checked(files):
    """diffusion-pipe's subsample_ratio: a share of each epoch (above 0, at most 1), read where diffusion-pipe reads
    it (the top of the dataset file; in a [[directory]] it changes nothing there, nor here); it survives the copy a
    run folder keeps."""
    (files / "dataset.toml").write_text("subsample_ratio = 0.25\n" + DATASET + "subsample_ratio = 0.5\n")
    ds = load_run_config(files / "run.toml").dataset_config
    assert ds.subsample_ratio == 0.25
    save_toml(ds, files / "copy.toml")
    assert load_dataset_config(files / "copy.toml").subsample_ratio == 0.25
    assert load_dataset_config(files / "dataset.toml").directory[0].num_repeats == 2
    for bad in ("0", "1.5", "-0.5", '"half"'):
        (files / "dataset.toml").write_text(f"subsample_ratio = {bad}\n" + DATASET)
        with pytest.raises(ConfigError, match=r"dataset.toml: key 'subsample_ratio'") as err:
            load_run_config(files / "run.toml")
        assert bad in str(err.value) or "expected" in str(err.value)

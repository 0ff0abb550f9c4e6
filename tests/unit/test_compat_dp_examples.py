"""diffusion-pipe's own example files and supported-model tables, as a user would bring them.

The TOML below is ours: it copies only the *key structure* of diffusion-pipe's ``examples/*.toml`` and of the
``[model]`` tables in its ``docs/supported_models.md`` (which keys, which tables, the value kinds), with model
paths pointed at the shared tiny model files. Nothing is fetched. Each either loads (through the same checks as
a run: ``preflight.load_run``) with the meaning it has in diffusion-pipe, or is refused naming the key and what
to do (model folders ComfyUI has no converter for: their single files; ``size_buckets`` and masks, item 3; models
the pinned ComfyUI lacks). The folders that load (Flux / SD3 Diffusers folders, Chroma's Flux folder, Wan's checkpoint
folder) are read from real tiny folders in ``test_dp_model_folders.py`` (Qwen-Image's in
``test_qwen_image_folders.py``), SDXL / SD1.5 UNet folders at their published
sizes on the meta device in ``test_dp_unet_folders.py``; ``tests/ranks/test_dp_model_folders_e2e.py`` trains from
the Flux, Wan and Kontext ones.
"""
from pathlib import Path

import pytest
import torch
from dp_files import DP_AR_BUCKETS, DP_MAIN, DP_MONITORING, DP_OPTIMIZER

from pipetrain.backend.commands.check_config import report
from pipetrain.backend.cli import main as cli_main
from pipetrain.backend.errors import ConfigError
from pipetrain.backend.preflight import load_run

MAIN = DP_MAIN
ADAPTER = """
[adapter]
type = 'lora'
rank = 32
dtype = 'bfloat16'
"""
OPTIMIZER, MONITORING = DP_OPTIMIZER, DP_MONITORING

# examples/wan_14b_min_vram.toml and examples/qwen_image_24gb_vram.toml: the keys they add or change
WAN_MIN_VRAM_RUN = MAIN.replace("activation_checkpointing = true", "activation_checkpointing = 'unsloth'") + \
    "blocks_to_swap = 32\n"
KAHAN = DP_OPTIMIZER.replace("'adamw_optimi'", "'AdamW8bitKahan'").replace("eps = 1e-8", "stabilize = false")

DATASETS = {
    # examples/dataset.toml
    "dataset": DP_AR_BUCKETS + """
num_ar_buckets = 7
frame_buckets = [1, 33]
[[directory]]
path = 'images'
num_repeats = 1
""",
    # examples/recommended_lumina_dataset_config.toml
    "lumina": DP_AR_BUCKETS + """
num_ar_buckets = 7
caption_prefix = 'A system prompt for Lumina. <Prompt Start> '
[[directory]]
path = 'images'
""",
    # examples/flux_kontext_dataset.toml
    "kontext": DP_AR_BUCKETS + """
num_ar_buckets = 9
num_repeats = 1
[[directory]]
path = 'target'
control_path = 'control'
""",
    # examples/minimax_h3_dataset.toml: a second directory with its own resolutions
    "two_dirs": DP_AR_BUCKETS + """
num_ar_buckets = 7
frame_buckets = [1, 33]
num_repeats = 1
[[directory]]
path = 'videos'
[[directory]]
path = 'images'
resolutions = [1024]
""",
}


def _model(arch: str | None, lines: str) -> str:
    """A [model] table; {dm}, {vae}, {te0}, {te1} are the tiny files of ``arch`` (None: no files used)."""
    if arch is None:
        return "[model]\n" + lines
    from pipetrain.backend.models.tiny import cached_model_files

    files = cached_model_files(arch)
    tes = [str(p) for p in files.text_encoders] + [None, None]
    return "[model]\n" + lines.format(dm=files.diffusion_model, vae=files.vae, te0=tes[0], te1=tes[1])


def _table(dp_type: str, *keys: str, extra: str = "") -> str:
    """A supported-model table's lines: its type, its keys (``key=value``; a bare key is a ComfyUI-file key whose
    value is the tiny file named by TINY), ``dtype = 'bfloat16'`` as every table sets it, then ``extra``."""
    lines = [f"type = '{dp_type}'"]
    for key in keys:
        name, _, value = key.partition("=")
        lines.append(f"{name} = '{value or TINY[name]}'")
    return "\n".join(lines + ["dtype = 'bfloat16'", extra]) + "\n"


TINY = {"transformer_path": "{dm}", "diffusion_model": "{dm}", "vae_path": "{vae}", "vae": "{vae}",
        "llm_path": "{te0}", "text_encoder_path": "{te0}", "t5_path": "{te0}", "clip_path": "{te1}",
        "byt5_path": "{te1}"}
FP8, LOGIT_NORMAL = "transformer_dtype = 'float8'", "timestep_sample_method = 'logit_normal'"
FILES = ("transformer_path", "vae_path")

# (case, tiny files, the type here, [model] lines): the tables of docs/supported_models.md in ComfyUI files
LOADS = [
    ("hunyuan-video (main_example.toml)", "hunyuan_video", "hunyuan_video",
     _table("hunyuan-video", *FILES, "llm_path", "clip_path", extra=FP8 + "\n" + LOGIT_NORMAL)),
    ("cosmos", "cosmos", "cosmos", _table("cosmos", *FILES, "text_encoder_path")),
    ("lumina_2", "lumina2", "lumina2", _table("lumina_2", "transformer_path", "llm_path", "vae_path")),
    ("cosmos_predict2", "cosmos_predict2", "cosmos_predict2",
     _table("cosmos_predict2", *FILES, "t5_path", extra="transformer_dtype = 'float8_e5m2'")),
    ("qwen_image (ComfyUI files)", "qwen_image", "qwen_image",
     _table("qwen_image", "transformer_path", "text_encoder_path", "vae_path", extra=FP8)),
    ("hunyuan_image", "hunyuan_image_21", "hunyuan_image_21",
     _table("hunyuan_image", *FILES, "text_encoder_path", "byt5_path", extra=FP8)),
    ("auraflow", "auraflow", "auraflow",
     _table("auraflow", "transformer_path", "text_encoder_path", "vae_path", extra=FP8)),
    ("z_image", "z_image", "z_image",
     _table("z_image", "diffusion_model", "vae", extra="text_encoders = [{{path = '{te0}', type = 'lumina2'}}]")),
    ("hunyuan_video_15", "hunyuan_video_15", "hunyuan_video_15",
     _table("hunyuan_video_15", "diffusion_model", "vae", extra="text_encoders = [{{paths = ['{te0}', '{te1}'], "
            "type = 'hunyuan_video_15'}}]\ndiffusion_model_dtype = 'float8'\n" + LOGIT_NORMAL)),
    ("flux2", "flux2", "flux2",
     _table("flux2", "diffusion_model", "vae", extra="text_encoders = [{{path = '{te0}', type = 'flux2'}}]\n"
            "diffusion_model_dtype = 'float8'\nshift = 3")),
    # diffusion-pipe's LTX-Video image to video: every clip with its first frame given
    ("ltx-video first_frame_conditioning_p = 1", "ltx_video", "ltx_video_i2v",
     _table("ltx-video", "diffusion_model", "vae", "t5_path", extra="first_frame_conditioning_p = 1.0")),
    ("ltx-video first_frame_conditioning_p = 0", "ltx_video", "ltx_video",
     _table("ltx-video", "diffusion_model", "vae", "t5_path", extra="first_frame_conditioning_p = 0")),
]

# (case, [model] lines, the key refused, a fragment of the fix)
_FOLDER_FIX = "transformer_path"
REFUSED = [
    ("sdxl", _table("sdxl", "checkpoint_path=/models/sd_xl_base_1.0.safetensors"), "model.checkpoint_path",
     "diffusion_model ="),
    ("hunyuan-video (checkpoint folder)", _table("hunyuan-video", "ckpt_path=/models/HunyuanVideo"),
     "model.ckpt_path", _FOLDER_FIX),
    ("ltx-video first_frame_conditioning_p = 0.5", _table("ltx-video", "diffusion_model=/m/ltxv.safetensors",
                                                          extra="first_frame_conditioning_p = 0.5"),
     "model.first_frame_conditioning_p", "type = 'ltx_video_i2v'"),
    ("single_file_path on another model", _table("flux", "single_file_path=/models/flux1-dev.safetensors"),
     "model.single_file_path", _FOLDER_FIX),
    ("chroma without its transformer", _table("chroma", "diffusers_path=/models/FLUX.1-dev", extra=FP8),
     "model.diffusers_path", _FOLDER_FIX),
    # the models diffusion-pipe runs on a newer ComfyUI than the pinned one
    *((dp_type, _table(dp_type, f"diffusion_model=/models/{dp_type}.safetensors", "vae=/models/vae.safetensors"),
       "model.type", "newer")
      for dp_type in ("ltx2", "ideogram4", "krea2", "minimax_h3")),
    ("ernie_image", _table("ernie_image", "diffusion_model=/models/ernie-image.safetensors",
                           "vae=/models/flux2-vae.safetensors",
                           extra="text_encoders = [{path = '/models/ministral-3-3b.safetensors', type = 'flux2'}]"),
     "model.type", "0.19.0"),
]


def _write(tmp_path: Path, main: str, dataset: str = DATASETS["dataset"]) -> Path:
    (tmp_path / "run.toml").write_text(main)
    (tmp_path / "dataset.toml").write_text(dataset)
    return tmp_path / "run.toml"


def _refusal(path: Path) -> str:
    with pytest.raises(ConfigError) as err:
        load_run(path)
    return str(err.value)


@pytest.mark.parametrize("case, arch, ours, model", LOADS, ids=[c[0] for c in LOADS])
def test_supported_model_tables_in_comfyui_files_load(tmp_path, case, arch, ours, model):
    cfg = load_run(_write(tmp_path, MAIN + _model(arch, model) + ADAPTER + OPTIMIZER + MONITORING))
    assert cfg.model.type == ours
    from pipetrain.backend.models.tiny import cached_model_files
    files = cached_model_files(arch)
    assert Path(cfg.model.diffusion_model) == files.diffusion_model and Path(cfg.model.vae) == files.vae
    assert [Path(p) for p in cfg.model.text_encoder_files] == files.text_encoders


@pytest.mark.parametrize("case, model, key, fix", REFUSED, ids=[c[0] for c in REFUSED])
def test_supported_model_tables_we_cannot_load_yet_are_refused_with_the_fix(tmp_path, case, model, key, fix):
    message = _refusal(_write(tmp_path, MAIN + _model(None, model) + ADAPTER + OPTIMIZER))
    assert f"key '{key}'" in message and fix in message, message
    assert "unknown key" not in message


def _anima_table(tmp_path: Path, llm_adapter_lr) -> str:
    """diffusion-pipe's Anima table (docs/supported_models.md) with its three files in ``tmp_path``: their contents are
    not read while the config validates (ComfyUI 0.3.75 has no Anima to write tiny files with)."""
    names = ("anima-preview.safetensors", "qwen_image_vae.safetensors", "qwen_3_06b_base.safetensors")
    for name in names:
        (tmp_path / name).write_bytes(b"")
    return _table("anima", *(f"{key}={tmp_path / name}" for key, name in zip(
        ("transformer_path", "vae_path", "llm_path"), names)), extra=f"llm_adapter_lr = {llm_adapter_lr}")


def test_diffusion_pipes_anima_table_loads_with_its_file_keys(tmp_path):
    cfg = load_run(_write(tmp_path, MAIN + _model(None, _anima_table(tmp_path, 0)) + ADAPTER + OPTIMIZER))
    assert cfg.model.type == "anima" and Path(cfg.model.diffusion_model).name == "anima-preview.safetensors"
    assert Path(cfg.model.vae).name == "qwen_image_vae.safetensors"
    assert [Path(p).name for p in cfg.model.text_encoder_files] == ["qwen_3_06b_base.safetensors"]
    message = _refusal(_write(tmp_path, MAIN + _model(None, _anima_table(tmp_path, 1e-5)) + ADAPTER + OPTIMIZER))
    assert "key 'model.llm_adapter_lr'" in message and "stays frozen" in message, message


def test_main_example_with_its_dataset_example_trains_with_diffusion_pipes_meaning(tmp_path):
    cfg = load_run(_write(tmp_path, MAIN + _model("hunyuan_video", LOADS[0][3]) + ADAPTER + OPTIMIZER + MONITORING))
    assert (cfg.epochs, cfg.save_every_n_epochs, cfg.partition_method) == (1000, 2, "parameters")
    assert cfg.model.diffusion_model_dtype == "float8" and cfg.adapter.dtype == "bfloat16"
    assert cfg.dataset_config.frame_buckets == [1, 33] and cfg.dataset_config.num_ar_buckets == 7


@pytest.mark.parametrize("dataset", ["dataset", "lumina", "two_dirs"])
def test_dataset_examples_load(tmp_path, dataset):
    cfg = load_run(_write(tmp_path, MAIN + _model("hunyuan_video", LOADS[0][3]) + ADAPTER + OPTIMIZER,
                          DATASETS[dataset]))
    assert cfg.dataset_config.directory[-1].path == "images"
    if dataset == "two_dirs":
        assert cfg.dataset_config.directory[1].resolutions == [1024]


def test_the_kontext_dataset_example_makes_flux_train_flux_kontext(tmp_path):
    """diffusion-pipe's Kontext: ``type = 'flux'`` (its Kontext file) with examples/flux_kontext_dataset.toml."""
    model = """type = 'flux'
transformer_path = '{dm}'
vae_path = '{vae}'
text_encoders = ['{te0}', '{te1}']
dtype = 'bfloat16'
"""
    path = _write(tmp_path, MAIN + _model("flux_kontext", model) + ADAPTER + OPTIMIZER, DATASETS["kontext"])
    cfg = load_run(path)
    assert cfg.model.type == "flux_kontext" and cfg.dataset_config.directory[0].control_path == "control"
    text, ok = report(path)
    assert ok and "trains model type 'flux_kontext' (diffusion-pipe's 'flux' with control images" in text


def test_wan_min_vram_example_loads_once_its_folder_is_given_as_files(tmp_path):
    """examples/wan_14b_min_vram.toml: only its ckpt_path is refused (the folder is read, but its T5 .pth is not:
    it needs llm_path); its 'unsloth' checkpointing, block swapping and AdamW8bitKahan with stabilize = false
    load."""
    model = """type = 'wan'
ckpt_path = '/models/Wan2.1-T2V-14B'
dtype = 'bfloat16'
transformer_dtype = 'float8'
timestep_sample_method = 'logit_normal'
"""
    adapter = ADAPTER.replace("rank = 32\n", "")
    path = _write(tmp_path, WAN_MIN_VRAM_RUN + _model(None, model) + adapter + KAHAN)
    assert "key 'model.ckpt_path'" in _refusal(path)
    files = model.replace("ckpt_path = '/models/Wan2.1-T2V-14B'", "transformer_path = '{dm}'\nvae_path = '{vae}'\n"
                                                                   "llm_path = '{te0}'")
    cfg = load_run(_write(tmp_path, WAN_MIN_VRAM_RUN + _model("wan", files) + adapter + KAHAN))
    assert (cfg.activation_checkpointing, cfg.blocks_to_swap) == ("unsloth", 32)
    assert cfg.optimizer.type == "AdamW8bitKahan" and "stabilize" not in cfg.optimizer.kwargs()


def _qwen_image_folder(root: Path) -> Path:
    """A Diffusers Qwen-Image pipeline folder's layout, one small tensor a component (the config reads no weights;
    ``test_qwen_image_folders.py`` loads real tiny ones)."""
    import json

    from safetensors.torch import save_file
    folder = root / "Qwen-Image"
    for sub in ("transformer", "vae", "text_encoder"):
        (folder / sub).mkdir(parents=True)
        save_file({"w": torch.zeros(2)}, str(folder / sub / "model.safetensors"))
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    return folder


QWEN_24GB_OPTIMIZER = "[optimizer]\ntype = 'automagic'\nweight_decay = 0.01\n"


def test_qwen_image_24gb_example_loads_its_folder_and_its_optimizer(tmp_path):
    from pipetrain.backend.optim.registry import resolve_optimizer
    from pipetrain.backend.optim.automagic import Automagic
    from dp_files import diffusers_folder

    from pipetrain.backend.models.tiny import cached_model_files
    run = MAIN.replace("video_clip_mode = 'single_beginning'\n", "") + "blocks_to_swap = 8\n"
    diffusers_folder(cached_model_files("qwen_image"), tmp_path / "Qwen-Image", "qwen_image")
    model = _table("qwen_image", "diffusers_path=Qwen-Image", extra=FP8)
    path = _write(tmp_path, run + _model(None, model) + ADAPTER + QWEN_24GB_OPTIMIZER)
    cfg = load_run(path)
    assert cfg.model.type == "qwen_image" and cfg.blocks_to_swap == 8
    assert (cfg.model.diffusion_model, cfg.model.vae) == ("Qwen-Image/transformer", "Qwen-Image/vae")
    assert [Path(p).name for p in cfg.model.text_encoder_files] == ["text_encoder"]
    klass, kwargs = resolve_optimizer(cfg)
    assert klass is Automagic and kwargs["weight_decay"] == 0.01
    text, ok = report(path)
    assert ok, text
    assert "model.diffusers_path: a Diffusers Qwen-Image pipeline folder" in text and "REFUSED" not in text
    assert "/Qwen-Image/text_encoder: a Qwen2.5-VL-7B text encoder folder" in text, text
    assert "optimizer.type: read as is" in text


def test_qwen_image_edit_table_takes_the_folder_and_its_edit_transformer(tmp_path):
    """diffusion-pipe's Qwen-Image-Edit: ``type = 'qwen_image'``, the Qwen-Image folder, the Edit transformer as
    transformer_path and a dataset with control images."""
    _qwen_image_folder(tmp_path)
    edit = tmp_path / "qwen_image_edit_bf16.safetensors"
    edit.write_bytes(b"")
    model = _table("qwen_image", "diffusers_path=Qwen-Image", f"transformer_path={edit}")
    cfg = load_run(_write(tmp_path, MAIN + _model(None, model) + ADAPTER + OPTIMIZER, DATASETS["kontext"]))
    assert cfg.model.type == "qwen_image_edit" and cfg.model.diffusion_model == str(edit)
    assert cfg.model.vae == "Qwen-Image/vae"


def test_a_qwen_type_refuses_another_models_folder_for_its_transformer(tmp_path):
    folder = _qwen_image_folder(tmp_path)
    (folder / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    message = _refusal(_write(tmp_path, MAIN + _model(None, _table("qwen_image", "diffusers_path=Qwen-Image")) +
                              ADAPTER + OPTIMIZER))
    assert "key 'model.diffusers_path'" in message and "FluxPipeline" in message and "transformer_path" in message


@pytest.mark.parametrize("dataset_lines, key", [
    ("mask_path = 'masks'\n" + DATASETS["dataset"], "mask_path"),   # top level: dp reads it per [[directory]]
])
def test_dataset_examples_with_options_not_built_yet_are_refused(tmp_path, dataset_lines, key):
    path = _write(tmp_path, MAIN + _model("hunyuan_video", LOADS[0][3]) + ADAPTER + OPTIMIZER, dataset_lines)
    message = _refusal(path)
    assert "dataset.toml" in message and f"key '{key}'" in message and "unknown key" not in message, message


def test_check_config_reports_each_key_the_defaults_that_differ_and_the_refusals(tmp_path, capsys):
    run = MAIN.replace("partition_method = 'parameters'\n", "") + "image_micro_batch_size_per_gpu = 4\n"
    model = LOADS[0][3]
    path = _write(tmp_path, run + _model("hunyuan_video", model) + ADAPTER.replace("dtype = 'bfloat16'\n", "") +
                  KAHAN, DATASETS["dataset"] + "shuffle_metadata = true\n")
    assert cli_main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    for line in ("  model.type: diffusion-pipe's 'hunyuan-video' is 'hunyuan_video' here",
                 "  model.transformer_path: read as diffusion_model",
                 "  model.llm_path: a text-encoder file, read into text_encoders",
                 "  model.transformer_dtype: read as diffusion_model_dtype",
                 "  image_micro_batch_size_per_gpu: read as is",
                 "  video_clip_mode: accepted at this value, which changes nothing here",
                 "  optimizer.stabilize: accepted at this value, which changes nothing here",
                 "  optimizer.lr: read as is",
                 "  directory[0].shuffle_metadata: accepted, changes nothing here",
                 "  partition_method (main file): diffusion-pipe 'parameters'; here 'compute'",
                 "  adapter.dtype (main file): diffusion-pipe the model's dtype; here 'float32'",
                 "Loads: trains model type 'hunyuan_video'."):
        assert line in out, (line, out)
    assert "epochs (main file)" not in out          # set in the file: its value applies
    assert out.count("dataset.toml:\n") == 1
    # a refused key and a typo, with the fix; the command fails
    path.write_text("x_axis_examples = true\nepoch = 3\n" + path.read_text())
    assert cli_main(["check-config", str(path)]) == 1
    out = capsys.readouterr().out
    assert "  x_axis_examples: REFUSED: TensorBoard's x-axis is the optimizer step" in out, out
    assert "  epoch: unknown key (a typo?)" in out
    assert "Does not load:" in out and "key 'x_axis_examples'" in out


def test_check_config_tells_what_first_frame_conditioning_p_trains(tmp_path, capsys):
    case = next(c for c in LOADS if c[0] == "ltx-video first_frame_conditioning_p = 1")
    path = _write(tmp_path, MAIN + _model("ltx_video", case[3]) + ADAPTER + OPTIMIZER + MONITORING)
    assert cli_main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  model.first_frame_conditioning_p: 1 trains type 'ltx_video_i2v'" in out, out
    assert "Loads: trains model type 'ltx_video_i2v'." in out


def test_the_config_docs_list_every_default_difference():
    from pipetrain.backend.config import compat

    docs = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    for _, key, _, _ in compat.DEFAULT_DIFFERENCES:
        assert f"| `{key}` |" in docs, key


def test_check_config_on_our_own_example_covers_its_eval_dataset(tmp_path):
    """examples/sdxl_lora.toml with its placeholder model paths pointed at the tiny SDXL files (as is, check-config
    reports each placeholder missing)."""
    import shutil

    from pipetrain.backend.models.tiny import cached_model_files
    examples = Path(__file__).resolve().parents[2] / "examples"
    text, ok = report(examples / "sdxl_lora.toml")
    assert not ok and "  model.vae: ERROR: /models/vae/sdxl_vae.safetensors: file or folder not found" in text
    files = cached_model_files("sdxl")
    for name in ("sdxl_lora.toml", "dataset.toml", "eval_dataset.toml"):
        shutil.copy(examples / name, tmp_path / name)
    run = tmp_path / "sdxl_lora.toml"
    run.write_text(run.read_text().replace("/models/diffusion_models/sdxl_unet.safetensors", str(files.diffusion_model))
                   .replace("/models/vae/sdxl_vae.safetensors", str(files.vae))
                   .replace("/models/text_encoders/clip_l.safetensors", str(files.text_encoders[0]))
                   .replace("/models/text_encoders/clip_g.safetensors", str(files.text_encoders[1])))
    text, ok = report(run)
    assert ok and f"{tmp_path / 'eval_dataset.toml'}:" in text and "Loads: trains model type 'sdxl'." in text
    assert "REFUSED" not in text and "unknown key" not in text and "ERROR" not in text


def test_cosmos_size_buckets_example_loads(tmp_path):
    """examples/cosmos_dataset.toml's explicit sizes: read as they are (tests/unit/test_data_buckets.py: which
    size each image takes)."""
    from pipetrain.backend.config import DatasetConfig
    from pipetrain.backend.config.files import _read_toml
    from pipetrain.backend.config.schema import from_dict

    lines = "size_buckets = [[960, 960, 1], [960, 704, 1]]\n[[directory]]\npath = 'images'\nnum_repeats = 10\n"
    path = _write(tmp_path, MAIN + _model("hunyuan_video", LOADS[0][3]) + ADAPTER + OPTIMIZER, lines)
    dataset = path.parent / "dataset.toml"
    cfg = from_dict(DatasetConfig, _read_toml(dataset), file=dataset)
    assert cfg.size_buckets == [[960, 960, 1], [960, 704, 1]]


def test_loss_and_timestep_keys_load_with_diffusion_pipes_meaning(tmp_path):
    """huber_delta / smooth_l1_beta choose their loss (diffusion-pipe's rule), SDXL's min_snr_gamma and
    debiased_estimation_loss weigh it, and min_t / max_t restrict any flow model; check-config says so."""
    sdxl = _table("sdxl", "diffusion_model", "vae", extra="text_encoders = ['{te0}', '{te1}']\nv_pred = false\n"
                  "min_snr_gamma = 5\ndebiased_estimation_loss = true")
    path = _write(tmp_path, "huber_delta = 0.5\n" + MAIN + _model("sdxl", sdxl) + ADAPTER + OPTIMIZER)
    cfg = load_run(path)
    assert (cfg.loss_kind, cfg.huber_delta, cfg.model.min_snr_gamma, cfg.model.debiased_estimation_loss) == (
        "huber", 0.5, 5, True)
    text, ok = report(path)
    assert ok and "REFUSED" not in text, text
    for line in ("  huber_delta: read as is", "  model.min_snr_gamma: read as is",
                 "  model.debiased_estimation_loss: DIFFERENT: false is off"):
        assert line in text, (line, text)
    flux = _table("flux", "transformer_path", "vae_path", extra="text_encoders = ['{te0}', '{te1}']\nmin_t = 0.2\n"
                  "max_t = 0.8")
    path = _write(tmp_path, "smooth_l1_beta = 0.1\n" + MAIN + _model("flux", flux) + ADAPTER + OPTIMIZER)
    cfg = load_run(path)
    assert (cfg.loss_kind, cfg.smooth_l1_beta, cfg.model.min_t, cfg.model.max_t) == ("smooth_l1", 0.1, 0.2, 0.8)
    assert "  model.min_t: DIFFERENT: every flow model" in report(path)[0]


FOLDER_TABLES = [   # (case, dp type, the type here, the tiny transformer file's arch or None: the folder's, extra)
    ("flux", "flux", "flux", None, "transformer_dtype = 'float8'\nflux_shift = true"),
    ("flux kontext", "flux", "flux_kontext", "flux_kontext", ""),   # Kontext's file over the folder's transformer
    # Chroma: the Flux folder's VAE and T5 (not its CLIP-L), the Chroma file's transformer
    ("chroma", "chroma", "chroma", "chroma", FP8 + "\nflux_shift = true"),
]


@pytest.mark.parametrize("case, dp_type, ours, arch, extra", FOLDER_TABLES, ids=[c[0] for c in FOLDER_TABLES])
def test_supported_model_tables_with_a_diffusers_folder_load(tmp_path, flux_diffusers_folder, case, dp_type, ours,
                                                             arch, extra):
    """docs/supported_models.md's Flux, Flux Kontext and Chroma tables: diffusers_path (a Diffusers folder, here the
    tiny one) is read through ComfyUI's converters; a transformer_path overrides its transformer."""
    from pipetrain.backend.models.tiny import cached_model_files
    model = _table(dp_type, f"diffusers_path={flux_diffusers_folder}", *(["transformer_path"] if arch else []),
                   extra=extra)
    path = _write(tmp_path, MAIN + _model(arch or "flux", model) + ADAPTER + OPTIMIZER + MONITORING,
                  DATASETS["kontext" if case == "flux kontext" else "dataset"])
    cfg = load_run(path)
    dm = cached_model_files(arch).diffusion_model if arch else flux_diffusers_folder / "transformer"
    assert cfg.model.type == ours
    assert (Path(cfg.model.diffusion_model), Path(cfg.model.vae)) == (dm, flux_diffusers_folder / "vae")
    assert [Path(p).name for p in cfg.model.text_encoder_files] == (
        ["text_encoder_2"] if ours == "chroma" else ["text_encoder", "text_encoder_2"])
    text, ok = report(path)
    assert ok and "model.diffusers_path: a " in text and "REFUSED" not in text, text


def _folders(root: Path) -> None:
    """The tiny SDXL, SD1.5 and SD3 files as Diffusers pipeline folders and the tiny Wan as its official checkpoint
    folder (check-config reads each file's header)."""
    from dp_files import diffusers_folder, wan_checkpoint_folder

    from pipetrain.backend.models.tiny import cached_model_files
    for arch in ("sdxl", "sd15", "sd3"):
        diffusers_folder(cached_model_files(arch), root / arch, arch)
    wan_checkpoint_folder(cached_model_files("wan"), root / "Wan2.1-T2V-1.3B")


NEW_SOURCES = [   # (case, [model] lines ({folder}: the tiny Flux folder), dataset, what check-config says, the type)
    ("eval lists", _table("hunyuan-video", *FILES, "llm_path", "clip_path"), "dataset",
     ["  eval_micro_batch_size_per_gpu: a per-resolution list, read into eval_micro_batch_size_by_resolution",
      "  image_eval_micro_batch_size_per_gpu: a per-resolution list, read into "
      "eval_image_micro_batch_size_by_resolution"], "hunyuan_video"),
    ("wan ckpt_path", _table("wan", "ckpt_path=Wan2.1-T2V-1.3B", "llm_path"), "dataset",
     ["  model.ckpt_path: Wan's official checkpoint folder: its transformer shards and VAE .pth",
      "/Wan2.1-T2V-1.3B: a Wan 2.1 / 2.2 14B t2v diffusion model folder (model type 'wan')",
      "/Wan2.1_VAE.pth: not read: a pickled file"], "wan"),
    ("chroma", _table("chroma", "diffusers_path={folder}", "transformer_path", extra=FP8), "dataset",
     ["  model.diffusers_path: a Flux Diffusers pipeline folder lending its vae and t5xxl text encoder",
      "  model.transformer_path: read as diffusion_model"], "chroma"),
    ("flux kontext", _table("flux", "diffusers_path={folder}", "transformer_path"), "kontext",
     ["  model.diffusers_path: a Diffusers pipeline folder", "(diffusion-pipe's 'flux' with control images"],
     "flux_kontext"),
    ("sdxl checkpoint_path", _table("sdxl", "checkpoint_path=sdxl"), "dataset",
     ["  model.checkpoint_path: a Diffusers pipeline folder: its transformer/unet, vae and text encoders",
      "/sdxl/unet: a SDXL diffusion model folder (model type 'sdxl')", "/sdxl/text_encoder_2: a CLIP-G text encoder "
      "folder"], "sdxl"),
    ("sd3 diffusers_path", _table("sd3", "diffusers_path=sd3"), "dataset",
     ["  model.diffusers_path: a Diffusers pipeline folder: its transformer/unet, vae and text encoders",
      "/sd3/text_encoder_3: a T5-XXL text encoder folder"], "sd3"),
    ("sd15 diffusers_path", _table("sd15", "diffusers_path=sd15"), "dataset",
     ["  model.diffusers_path: a Diffusers pipeline folder: its transformer/unet, vae and text encoders",
      "/sd15/vae: a VAE folder decoding 4-channel latents"], "sd15"),
]


@pytest.mark.parametrize("case, model, dataset, lines, ours", NEW_SOURCES, ids=[c[0] for c in NEW_SOURCES])
def test_check_config_reports_the_new_sources(tmp_path, flux_diffusers_folder, capsys, case, model, dataset, lines,
                                              ours):
    """python -m pipetrain check-config on dp configs with the sources read since: eval per-resolution lists, Wan's
    ckpt_path, Chroma's Flux folder + transformer file, Kontext's folder + file + control images, SDXL / SD1.5
    Diffusers folders. Each says what it reads, nothing is refused, and the pair loads as the type it trains."""
    _folders(tmp_path)
    arch = {"hunyuan_video": "hunyuan_video", "wan": "wan", "chroma": "chroma", "flux_kontext": "flux"}.get(ours)
    run = MAIN.replace("eval_micro_batch_size_per_gpu = 1", "eval_micro_batch_size_per_gpu = [[512, 2], [1024, 1]]\n"
                       "image_eval_micro_batch_size_per_gpu = [[512, 4]]") if case == "eval lists" else MAIN
    path = _write(tmp_path, run + _model(arch, model.replace("{folder}", str(flux_diffusers_folder))) + ADAPTER +
                  OPTIMIZER + MONITORING, DATASETS[dataset])
    assert cli_main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    for line in lines:
        assert line in out, (line, out)
    assert "REFUSED" not in out and "unknown key" not in out and "ERROR" not in out
    assert f"Loads: trains model type '{ours}'" in out


def test_sdxls_checkpoint_path_may_be_a_combined_checkpoint_file(tmp_path):
    """diffusion-pipe's SDXL table with ``checkpoint_path`` = one .safetensors (UNet, VAE and text encoders): our
    diffusion_model, its VAE and text encoders read from the same file (none named)."""
    from pipetrain.backend.models.tiny import write_checkpoint
    ckpt = write_checkpoint("sdxl", tmp_path / "sd_xl_base_1.0.safetensors")
    cfg = load_run(_write(tmp_path, MAIN + _model(None, _table("sdxl", f"checkpoint_path={ckpt}")) + ADAPTER
                          + OPTIMIZER + MONITORING))
    assert (cfg.model.type, Path(cfg.model.diffusion_model)) == ("sdxl", ckpt)
    assert cfg.model.vae is None and not cfg.model.text_encoders


def test_ltx_videos_table_reads_its_single_file_and_its_folders_t5(tmp_path, capsys):
    """diffusion-pipe's LTX-Video table: ``diffusers_path`` (the Diffusers folder) and ``single_file_path`` (the
    single-file release: transformer and VAE in ComfyUI's checkpoint layout). The single file is our diffusion_model
    read as a combined checkpoint (its VAE from the same file); the folder lends only its T5."""
    from dp_files import diffusers_folder

    from pipetrain.backend.models.tiny import cached_model_files, write_checkpoint
    single = write_checkpoint("ltx_video", tmp_path / "ltx-video-2b-v0.9.1.safetensors")
    diffusers_folder(cached_model_files("ltx_video"), tmp_path / "LTX-Video", "ltx_video")
    model = _table("ltx-video", "diffusers_path=LTX-Video", f"single_file_path={single}")
    path = _write(tmp_path, MAIN + _model(None, model) + ADAPTER + OPTIMIZER + MONITORING)
    cfg = load_run(path)
    assert (cfg.model.type, Path(cfg.model.diffusion_model)) == ("ltx_video", single)
    assert cfg.model.vae is None and cfg.model.from_checkpoint() == {"vae"}
    assert cfg.model.text_encoder_files == ["LTX-Video/text_encoder"]
    from pipetrain.backend.models.checkpoint_file import load_checkpoint_vae
    from pipetrain.backend.models.loading import load_vae
    vae_weights = load_vae(cached_model_files("ltx_video").vae).first_stage_model.state_dict()
    from_single = load_checkpoint_vae(single, "ltx_video").first_stage_model.state_dict()
    assert from_single.keys() == vae_weights.keys()                       # the run's VAE: the tiny LTX one
    assert all(torch.equal(from_single[k], vae_weights[k]) for k in vae_weights)

    assert cli_main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  model.single_file_path: the single-file release (transformer and VAE in one file" in out, out
    assert "  model.diffusers_path: a Diffusers pipeline folder lending its T5 text encoder" in out, out
    assert f"  model.single_file_path: {single}: " in out, out            # the file's header read, as the model
    assert "/LTX-Video/text_encoder: a T5" in out, out
    assert "REFUSED" not in out and "ERROR" not in out and "Loads: trains model type 'ltx_video'" in out, out

    # the folder alone: ComfyUI reads neither its transformer nor its VAE, so the single file is asked for
    message = _refusal(_write(tmp_path, MAIN + _model(None, _table("ltx-video", "diffusers_path=LTX-Video")) + ADAPTER
                              + OPTIMIZER))
    assert "key 'model.diffusers_path'" in message and "add single_file_path = '<ltx-video-" in message, message


def test_omnigen2s_table_reads_its_diffusers_folder_with_its_mllm(tmp_path, capsys):
    """diffusion-pipe reads OmniGen2 from its Diffusers folder only (``diffusers_path``): the transformer (its module
    names are ComfyUI's port's own), the Flux VAE and ``mllm/``, a Hugging Face Qwen2.5-VL-3B folder."""
    from types import SimpleNamespace

    from dp_files import diffusers_folder

    from pipetrain.backend.models.loading import load_diffusion_model
    from pipetrain.backend.models.tiny import cached_model_files
    files = cached_model_files("omnigen2")
    diffusers_folder(SimpleNamespace(diffusion_model=files.diffusion_model, vae=files.vae,
                                     text_encoders=files.text_encoders), tmp_path / "OmniGen2", "omnigen2")
    path = _write(tmp_path, MAIN + _model(None, _table("omnigen2", "diffusers_path=OmniGen2")) + ADAPTER
                  + OPTIMIZER + MONITORING)
    cfg = load_run(path)
    assert cfg.model.type == "omnigen2"
    assert (cfg.model.diffusion_model, cfg.model.vae) == ("OmniGen2/transformer", "OmniGen2/vae")
    assert cfg.model.text_encoder_files == ["OmniGen2/mllm"]
    # the folder's transformer is the tiny OmniGen2's, every weight read
    want = load_diffusion_model(files.diffusion_model, torch.float32, arch="omnigen2").model.diffusion_model.state_dict()
    got = load_diffusion_model(cfg.resolve(cfg.model.diffusion_model), torch.float32,
                               arch="omnigen2").model.diffusion_model.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    # (mllm/ is read as Qwen-Image's Qwen2.5-VL folder is, by its config.json's sizes, test_dp_model_folders_e2e.py;
    # the tiny file's narrow width would read as the 7B's kind, so its folder here says the 3B's width)

    assert cli_main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  model.diffusers_path: a Diffusers pipeline folder: its transformer/unet, vae and text encoders" in out
    assert "/OmniGen2/mllm: a Qwen2.5-VL-3B" in out, out
    assert "REFUSED" not in out and "ERROR" not in out and "Loads: trains model type 'omnigen2'" in out, out
    # another model's folder gives a transformer of the wrong architecture: refused, naming the key
    (tmp_path / "OmniGen2" / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    assert "not a OmniGen2*Pipeline one" in _refusal(path)


def test_hidreams_table_reads_its_diffusers_folder_and_its_llama_folder(tmp_path, capsys):
    """diffusion-pipe's HiDream table: ``diffusers_path`` (the HiDream-I1 Diffusers folder: its transformer's keys
    are ComfyUI's own, its Flux VAE and CLIP-L / CLIP-G / T5 folders converted by ComfyUI) and ``llama3_path`` (a
    Hugging Face Llama folder), which comes after the folder's three text encoders."""
    import json
    from types import SimpleNamespace

    from dp_files import HF_TEXT_CONFIGS, _place, diffusers_folder

    from pipetrain.backend.models.loading import load_diffusion_model
    from pipetrain.backend.models.tiny import cached_model_files
    files = cached_model_files("hidream")
    diffusers_folder(SimpleNamespace(diffusion_model=files.diffusion_model, vae=files.vae,
                                     text_encoders=files.text_encoders[:3]), tmp_path / "HiDream-I1-Full", "hidream")
    _place(files.text_encoders[3], tmp_path / "Llama-3.1-8B-Instruct" / "model.safetensors")
    (tmp_path / "Llama-3.1-8B-Instruct" / "config.json").write_text(json.dumps(HF_TEXT_CONFIGS["llama"]))
    model = _table("hidream", "diffusers_path=HiDream-I1-Full", "llama3_path=Llama-3.1-8B-Instruct")
    path = _write(tmp_path, MAIN + _model(None, model) + ADAPTER + OPTIMIZER + MONITORING)
    cfg = load_run(path)
    assert cfg.model.type == "hidream"
    assert (cfg.model.diffusion_model, cfg.model.vae) == ("HiDream-I1-Full/transformer", "HiDream-I1-Full/vae")
    assert cfg.model.text_encoder_files == ["HiDream-I1-Full/text_encoder", "HiDream-I1-Full/text_encoder_2",
                                            "HiDream-I1-Full/text_encoder_3", "Llama-3.1-8B-Instruct"]
    # the folder's transformer is the tiny HiDream's, every weight read (its CLIP / T5 folders are read as the Flux
    # folder's are, tests/ranks/test_dp_model_folders_e2e.py; a Llama folder in test_hidream_llama_folder.py)
    want = load_diffusion_model(files.diffusion_model, torch.float32, arch="hidream").model.diffusion_model.state_dict()
    got = load_diffusion_model(cfg.resolve(cfg.model.diffusion_model), torch.float32, arch="hidream").model.diffusion_model
    assert got.state_dict().keys() == want.keys()
    assert all(torch.equal(got.state_dict()[k], want[k]) for k in want)

    assert cli_main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  model.diffusers_path: a Diffusers pipeline folder: its transformer/unet, vae and text encoders" in out
    assert "/HiDream-I1-Full/transformer: a HiDream" in out and "/HiDream-I1-Full/text_encoder_3: a T5" in out, out
    assert "REFUSED" not in out and "ERROR" not in out and "Loads: trains model type 'hidream'" in out, out

# SPDX-License-Identifier: GPL-3.0-or-later
"""Every run option is on a node: a walk over the config tree finds a node input for each key, and the options
that had none reach the run file from their widgets; each widget starts at its key's config default."""
from __future__ import annotations

import pytest

from pipetrain.backend.config import DatasetConfig, DirectoryConfig, RunConfig
from pipetrain.backend.config.patch import default, leaf_keys
from pipetrain.backend.host.runtime import ensure_comfyui
from pipetrain.launcher.build import LAUNCHER_KEYS

# section -> the node whose inputs set its keys ("": top-level run keys, on any setting node)
SECTION_NODES = {"model": "PipeTrainModel", "adapter": "PipeTrainAdapter", "optimizer": "PipeTrainOptimizer",
                 "samples": "PipeTrainSamples", "cluster": "PipeTrainParallelism", "dataset": "PipeTrainDataset",
                 "monitoring": "PipeTrainSchedule"}
# secrets are never widgets (a workflow file carries every widget value)
NOT_ON_NODES = {"monitoring.wandb_api_key"}
RUN_KEY_NODES = ("PipeTrainDataset", "PipeTrainAdapter", "PipeTrainOptimizer", "PipeTrainSchedule",
                 "PipeTrainParallelism", "PipeTrainMemory", "PipeTrainTrain")
# keys whose widget has another name (a node's form: several widgets, a picker, a clearer word)
WIDGET_NAMES = {
    "model.type": "model_type", "model.text_encoders": "text_encoder_1", "model.dtype": "compute_dtype",
    "model.diffusion_model_dtype": "weight_dtype", "model.merge_adapters": "merge_lora",
    "optimizer.betas": "beta1", "cluster.launcher": "cluster", "samples.render": "render_on",
    "activation_checkpointing_fraction": "checkpoint_fraction", "activation_memory_budget": "memory_budget",
    "eval_datasets": "eval_dataset", "dataset.directory": "folder", "dataset.path": "folder",
    "dataset.control_path": "control_folder", "dataset.mask_path": "mask_folder",
    "dataset.control_mask_path": "control_mask_folder", "dataset.reference_path": "reference",
}


@pytest.fixture(scope="module")
def node_inputs() -> dict[str, set[str]]:
    ensure_comfyui()
    from pipetrain.nodes import NODES
    out = {}
    for node in NODES:
        info = node.GET_NODE_INFO_V1()
        out[info["name"]] = {k for section in ("required", "optional") for k in info["input"].get(section, {})}
    return out


def _config_keys() -> list[str]:
    return leaf_keys(RunConfig) + [f"dataset.{k}" for k in leaf_keys(DatasetConfig) + leaf_keys(DirectoryConfig)]


def test_every_config_key_has_a_node_input(node_inputs):
    missing = []
    for key in _config_keys():
        if key in LAUNCHER_KEYS and key not in WIDGET_NAMES and key != "run_name":
            continue   # where the run writes and its dataset file: the launcher's
        if key in NOT_ON_NODES:
            continue
        section, _, name = key.rpartition(".")
        nodes = [SECTION_NODES[section.split(".")[0]]] if section else RUN_KEY_NODES
        widget = WIDGET_NAMES.get(key, name)
        if not any(widget in node_inputs[n] for n in nodes):
            missing.append(key)
    assert not missing, f"config keys no node input sets: {missing}"


def test_the_walk_sees_every_section():
    keys = _config_keys()
    assert {"model.shift", "adapter.init_from_existing", "optimizer.beta2_half_life", "samples.host_timeout_s",
            "cluster.env", "dataset.skip_empty_caption", "compile_cuda_graphs", "partition_method"} <= set(keys)


def test_widgets_start_at_the_config_defaults(node_inputs):
    from pipetrain.nodes import NODES
    info = {n.GET_NODE_INFO_V1()["name"]: n.GET_NODE_INFO_V1()["input"] for n in NODES}

    def start(node, name):
        for section in ("required", "optional"):
            if name in info[node].get(section, {}):
                return info[node][section][name][1]["default"]
        raise KeyError(name)
    assert start("PipeTrainSchedule", "epochs") == default("epochs") == 10
    assert start("PipeTrainDataset", "enable_ar_bucket") is default("enable_ar_bucket", DatasetConfig) is False
    assert start("PipeTrainMemory", "activation_checkpointing") is default("activation_checkpointing") is False
    assert start("PipeTrainSchedule", "checkpoint_every_n_minutes") == 0.0 and \
        default("checkpoint_every_n_minutes") is None
    assert start("PipeTrainOptimizer", "lr") == default("optimizer.lr") == 2e-4
    assert start("PipeTrainSamples", "render_on") == "training run" and default("samples.render") == "run"
    assert start("PipeTrainMemory", "compile_cuda_graphs") is default("compile_cuda_graphs") is True


def test_the_options_without_a_node_before_reach_the_run_file(tmp_path, monkeypatch):
    """Schedule, Optimizer, Adapter, Parallelism, Memory, Samples, Dataset and Model set the keys they lacked."""
    import folder_paths
    from server_fixtures import write_fake_model

    from pipetrain.backend.preflight import load_run
    from pipetrain.launcher.build import write_config
    from pipetrain.launcher.specs import TrainSpec
    from pipetrain.nodes import data, parallelism, samples, settings

    # ComfyUI's model folders are process-wide: this test's folders go with it (later tests list the LoRA folder)
    monkeypatch.setattr(folder_paths, "folder_names_and_paths",
                        {k: (list(paths), set(exts)) for k, (paths, exts) in folder_paths.folder_names_and_paths.items()})
    monkeypatch.setattr(folder_paths, "filename_list_cache", {})
    for kind, name, arch in (("diffusion_models", "dm.safetensors", "flux"), ("text_encoders", "t1.safetensors", None),
                             ("text_encoders", "t2.safetensors", None), ("vae", "ae.safetensors", None),
                             ("loras", "start.safetensors", None)):
        write_fake_model(tmp_path / kind / name, arch)
        folder_paths.add_model_folder_path(kind, str(tmp_path / kind))
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(b"x")

    dataset = data.DatasetNode.execute(folder=str(tmp_path / "images"), resolutions="512", enable_ar_bucket=False,
                                       min_ar=0.5, max_ar=2.0, num_ar_buckets=7, num_repeats=1,
                                       caption_extension=".txt", skip_empty_caption=True, cache_shuffle_delimiter="|",
                                       on_unreadable="error", caching_batch_size=4).result[0]
    model = data.ModelNode.execute("dm.safetensors", "t1.safetensors", "t2.safetensors", "ae.safetensors", "default",
                                   "bfloat16", timestep_sample_method="uniform", sigmoid_scale=2.0, shift=3.0,
                                   flux_shift=True, guidance=4.0, v_pred=True, min_t=0.1, max_t=0.9,
                                   min_snr_gamma=0.0, debiased_estimation_loss=False).result[0]
    adapter = settings.AdapterNode.execute(8, 0.0, 0.0, "", dtype="bfloat16", init_from_existing="start.safetensors",
                                           save_dtype="float16", diff_output_preservation=True, trigger_word="sks",
                                           diff_output_preservation_class="dog",
                                           diff_output_preservation_multiplier=0.5).result[0]
    optimizer = settings.OptimizerNode.execute("adamw", 1e-4, 0.9, 0.99, 0.01, 1e-8, beta2_half_life=50.0,
                                               gradient_clipping=0.5, loss_type="huber", huber_delta=0.3,
                                               smooth_l1_beta=0.7, noise_offset=0.05).result[0]
    schedule = settings.ScheduleNode.execute(epochs=2, lr_scheduler="constant", warmup_steps=0, save_every_n_epochs=1,
                                             checkpoint_every_n_epochs=0, checkpoint_every_n_minutes=0, seed=1,
                                             max_steps=30, save_every_n_examples=16, eval_every_n_examples=8,
                                             eval_before_first_step=False, eval_micro_batch_size_per_gpu=2,
                                             eval_gradient_accumulation_steps=3, steps_per_print=5,
                                             eval_image_micro_batch_size_per_gpu=6,
                                             eval_micro_batch_size_by_resolution="512:2, 1024:1",
                                             eval_image_micro_batch_size_by_resolution="512:6").result[0]
    parallelism_patch = parallelism.ParallelismNode.execute(2, 2, 1, 1, "", partition_method="manual",
                                                            partition_split="3",
                                                            image_micro_batch_size_per_gpu=4).result[0]
    memory = settings.MemoryNode.execute(True, 0, compile=True, compile_cuda_graphs=False).result[0]
    shots = samples.SamplesNode.execute("a fox", negative_prompt="", seed=0, width=64, height=64, steps=2, cfg=1.0,
                                        guidance=3.5, sampler="euler", scheduler="simple", render_on="host ComfyUI",
                                        host_timeout_s=60.0).result[0]
    spec = TrainSpec(dataset, model, adapter, optimizer, schedule, parallelism_patch, memory, samples=shots)
    cfg = load_run(write_config(spec, tmp_path / "run", output_dir=tmp_path / "out", run_name="r", lora_dir=None))

    m = cfg.model
    assert (m.timestep_sample_method, m.sigmoid_scale, m.shift, m.flux_shift, m.guidance, m.v_pred) == (
        "uniform", 2.0, 3.0, True, 4.0, True)
    assert (cfg.adapter.dtype, cfg.adapter.init_from_existing, cfg.save_dtype) == (
        "bfloat16", str(tmp_path / "loras" / "start.safetensors"), "float16")
    assert (cfg.optimizer.beta2_half_life, cfg.gradient_clipping) == (50.0, 0.5)
    assert (cfg.diff_output_preservation, cfg.trigger_word, cfg.preservation_class, cfg.preservation_multiplier) == (
        True, "sks", "dog", 0.5)
    # the loss widgets: huber with its delta (smooth_l1_beta's widget belongs to another loss), the noise offset
    assert (cfg.loss_kind, cfg.huber_delta, cfg.smooth_l1_beta, cfg.noise_offset) == ("huber", 0.3, None, 0.05)
    assert (m.min_t, m.max_t, m.min_snr_gamma, m.debiased_estimation_loss) == (0.1, 0.9, None, False)
    assert (cfg.max_steps, cfg.save_every_n_examples, cfg.eval_every_n_examples, cfg.eval_before_first_step,
            cfg.eval_micro_batch_size_per_gpu, cfg.eval_gradient_accumulation_steps, cfg.steps_per_print) == (
        30, 16, 8, False, 2, 3, 5)
    assert (cfg.partition_method, cfg.partition_split, cfg.compile_cuda_graphs) == ("manual", [3], False)
    assert (cfg.image_micro_batch_size_per_gpu, cfg.eval_image_micro_batch_size_per_gpu) == (4, 6)
    assert (cfg.eval_micro_batch_size_by_resolution, cfg.eval_image_micro_batch_size_by_resolution) == (
        [[512, 2], [1024, 1]], [[512, 6]])
    assert (cfg.samples.render, cfg.samples.host_timeout_s, cfg.caching_batch_size) == ("host", 60.0, 4)
    ds = cfg.dataset_config
    d = ds.directory[0]
    assert (d.skip_empty_caption, d.cache_shuffle_delimiter, ds.on_unreadable) == (True, "|", "error")

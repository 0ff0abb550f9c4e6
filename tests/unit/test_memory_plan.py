# SPDX-License-Identifier: GPL-3.0-or-later
"""The memory plan: the meta-device trace sees what a real forward keeps, the sums follow each setting, and
``auto`` takes the fastest settings that fit."""
import os

import pytest
import torch
from conftest import python_child

from pipetrain.backend.memory import plan as mp
from pipetrain.backend.models.meta_trace import LayerFootprint

MIB = 2 ** 20


def _footprints(blocks: int = 4, saved: int = 100 * MIB, output: int = 10 * MIB, weights: int = 50 * MIB):
    head = LayerFootprint("Input", weights, 0, 1000, saved // 10, output, False)
    body = [LayerFootprint("Block", weights, weights, 1000, saved, output, True) for _ in range(blocks)]
    tail = LayerFootprint("Output", weights, 0, 1000, saved // 10, output // 4, False)
    return [head, *body, tail]


def test_without_checkpointing_every_saved_tensor_stays():
    fps = _footprints()
    [st] = mp.estimate(fps, mp.MemorySettings(), mp.Training())
    assert st.activations == sum(fp.saved for fp in fps)
    assert st.weights == sum(fp.weights for fp in fps)
    assert st.adapter == 6 * 1000 * 16


def test_checkpointed_blocks_keep_their_input_and_one_recomputes():
    fps = _footprints()
    [st] = mp.estimate(fps, mp.MemorySettings(True), mp.Training())
    # the head and tail keep theirs; each block its input (the previous layer's output); one block recomputed
    assert st.activations == fps[0].saved + fps[-1].saved + 4 * 10 * MIB + 100 * MIB
    [half] = mp.estimate(fps, mp.MemorySettings(True, 0.5), mp.Training())
    assert mp.checkpointed_flags(fps, mp.MemorySettings(True, 0.5)) == [False, False, True, False, True, False]
    assert half.activations == fps[0].saved + fps[-1].saved + 2 * 100 * MIB + 2 * 10 * MIB + 100 * MIB
    [unsloth] = mp.estimate(fps, mp.MemorySettings("unsloth"), mp.Training())
    assert unsloth.activations == st.activations - 4 * 10 * MIB and unsloth.host == 4 * 10 * MIB


def test_swapped_blocks_leave_two_on_the_gpu_and_the_rest_in_cpu_memory():
    fps = _footprints(blocks=6)
    [st] = mp.estimate(fps, mp.MemorySettings(True, 1.0, 4), mp.Training())
    assert st.weights == 8 * 50 * MIB - 4 * 50 * MIB + 2 * 50 * MIB
    assert st.host == 4 * 50 * MIB


def test_fp8_compute_halves_the_linear_weights_in_training_but_loads_them_in_bf16_first():
    fps = _footprints(blocks=4)          # the blocks' weights are linears', the head's and tail's not
    [bf16] = mp.estimate(fps, mp.MemorySettings(), mp.Training())
    [fp8] = mp.estimate(fps, mp.MemorySettings(), mp.Training(fp8_compute=True))
    assert fp8.weights == bf16.weights - 4 * 25 * MIB and fp8.training == bf16.gpu - 4 * 25 * MIB
    assert fp8.loading == bf16.weights + bf16.adapter and fp8.gpu == max(fp8.training, fp8.loading)
    [small] = mp.estimate(_footprints(blocks=4, saved=MIB, output=MIB), mp.MemorySettings(),
                          mp.Training(fp8_compute=True))
    assert small.gpu == small.loading > small.training   # little activation memory: loading is the peak
    assert "while loading, before fp8_compute" in mp.report(mp.MemorySettings(), [small])


def test_training_of_counts_fp8_compute_only_where_the_weights_load_in_bf16():
    from pipetrain.backend.config import RunConfig
    from pipetrain.backend.config.schema import from_dict

    base = {"output_dir": "o", "dataset": "d.toml", "adapter": {"rank": 4}, "fp8_compute": True,
            "model": {"type": "flux", "diffusion_model": "m", "vae": "v"}}
    assert mp.training_of(from_dict(RunConfig, base)).fp8_compute
    stored = {**base, "model": {**base["model"], "diffusion_model_dtype": "float8_e4m3fn"}}
    assert not mp.training_of(from_dict(RunConfig, stored)).fp8_compute   # the trace already counts one byte
    assert not mp.training_of(from_dict(RunConfig, {**base, "fp8_compute": False})).fp8_compute


def test_an_adapters_bytes_count_the_kahan_buffer_of_16_bit_weights():
    # weight and gradient, two 1-byte moments, and a compensation buffer in the weight's dtype where it is 16-bit
    assert mp.state_bytes_per_param(2, "AdamW8bit", False) == 6
    assert mp.state_bytes_per_param(2, "AdamW8bitKahan", False) == 8
    assert mp.state_bytes_per_param(4, "AdamW8bitKahan", False) == 10    # float32 weights: no buffer
    # automagic: a float32 learning-rate mask and a bool polarity instead of moments, and the buffer
    assert mp.state_bytes_per_param(2, "automagic", False) == 11
    assert mp.state_bytes_per_param(4, "adamw", False) == 16


def test_each_stage_holds_the_micro_batches_in_flight():
    fps = _footprints(blocks=4)
    first, last = mp.estimate(fps, mp.MemorySettings(), mp.Training(micro_batches=8, stages=2), bounds=[0, 3, 6])
    # 1F1B: the first of two stages holds two micro-batches' activations, the last one
    assert first.activations == 2 * (fps[0].saved + 2 * fps[1].saved)
    assert last.activations == 2 * fps[1].saved + fps[-1].saved


def test_auto_takes_the_fastest_settings_that_fit_and_says_when_none_do():
    fps = _footprints(blocks=8)
    training = mp.Training()
    none = max(s.gpu for s in mp.estimate(fps, mp.MemorySettings(), training))
    full = max(s.gpu for s in mp.estimate(fps, mp.MemorySettings(True), training))
    settings, _ = mp.choose(fps, training, int(none / mp.HEADROOM) + 1, whole_gpu=False)
    assert settings == mp.MemorySettings()
    settings, stages = mp.choose(fps, training, int(full / mp.HEADROOM) + 1, whole_gpu=False)
    assert settings.activation_checkpointing in (True, "selective") and max(s.gpu for s in stages) <= full
    # below every block checkpointed (and parked in CPU memory): blocks swap, two at a time on the GPU
    settings, _ = mp.choose(fps, training, int((full - 90 * MIB) / mp.HEADROOM), whole_gpu=False)
    assert settings.blocks_to_swap >= 4
    assert mp.choose(fps, mp.Training(can_swap=False), int((full - 90 * MIB) / mp.HEADROOM), whole_gpu=False) is None
    # below every block but two swapped: the blocks' inputs go to CPU memory as well ('unsloth', as dp's
    # wan_14b_min_vram example sets), rather than nothing fitting
    most = mp.MemorySettings(True, 1.0, 6)
    [swapped] = mp.estimate(fps, most, training)
    settings, stages = mp.choose(fps, training, int((swapped.gpu - 1) / mp.HEADROOM), whole_gpu=False)
    assert settings.activation_checkpointing == "unsloth" and settings.blocks_to_swap >= 1
    assert mp.peak(stages) < swapped.gpu


def _trace(files, device):
    from pipetrain.backend.adapters import injection
    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.models import loading
    from pipetrain.backend.models.meta_trace import probe_inputs, to_meta_where_large, trace_layers
    from pipetrain.backend.models.registry import adapter_class

    adapter = adapter_class("flux")(ModelConfig(type="flux", diffusion_model=str(files.diffusion_model),
                                                vae=str(files.vae), dtype="float32"))
    if device == "meta":
        adapter.use_model(loading.build_meta_model(files.diffusion_model, torch.float32, "flux"))
    else:
        adapter.load_diffusion_model()
    injection.inject(adapter.diffusion_model, injection.AdapterSpec(rank=4, alpha=4.0), adapter.lora_block_prefixes)
    inputs = probe_inputs(adapter, 64, 48, batch=2)
    return trace_layers(adapter.to_layers(), to_meta_where_large(inputs) if device == "meta" else inputs)


def test_the_meta_trace_sees_what_a_real_forward_keeps(tiny_flux_files):
    """The same model, LoRA and micro-batch traced on real CPU tensors and on the meta device: every layer's
    weights, kept tensors and outputs agree byte for byte."""
    real, meta = _trace(tiny_flux_files, "cpu"), _trace(tiny_flux_files, "meta")
    assert [fp.name for fp in real] == [fp.name for fp in meta]
    assert real == meta
    assert sum(fp.saved for fp in real) > 0 and sum(fp.checkpointable for fp in real) >= 2


def test_float8_stored_weights_trace_at_one_byte_and_compute_in_the_runs_dtype(tiny_flux_files, make_run):
    """``diffusion_model_dtype = 'float8'``: ComfyUI stores the weights in one byte and computes in the run's dtype
    (its manual cast). The trace built the model without that cast, ran its activations in float8 and failed, so
    ``memory = 'auto'`` trained with no checkpointing or swapping at all."""
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.config.common import replace
    from pipetrain.backend.models.meta_trace import probe_inputs

    cfg = load_run_config(make_run(tiny_flux_files, images=2), check_dataset=False)
    stored = replace(cfg, model=replace(cfg.model, diffusion_model_dtype="float8"))
    fp8, full = (mp.trace_run(c, lambda adapter: probe_inputs(adapter, 64, 64, 1)) for c in (stored, cfg))
    width = torch.empty(0, dtype=getattr(torch, cfg.model.dtype)).element_size()    # the run's dtype's bytes
    assert sum(fp.linear_weights for fp in fp8) * width == sum(fp.linear_weights for fp in full) > 0
    assert [fp.output for fp in fp8] == [fp.output for fp in full]    # activations in the run's dtype


def test_a_file_without_our_metadata_is_built_from_comfyuis_detection(tiny_flux_files, tmp_path):
    """A real file carries no config of ours: the meta model comes from ComfyUI's own detection of its keys."""
    from safetensors.torch import load_file, save_file

    from pipetrain.backend.models import loading

    plain = tmp_path / "flux.safetensors"
    save_file(load_file(tiny_flux_files.diffusion_model), plain)
    detected = loading.build_meta_model(plain, torch.bfloat16, "flux").model.diffusion_model
    ours = loading.build_meta_model(tiny_flux_files.diffusion_model, torch.bfloat16, "flux").model.diffusion_model
    assert {k: v.shape for k, v in detected.state_dict().items()} == {k: v.shape for k, v in ours.state_dict().items()}
    assert all(p.device.type == "meta" for p in detected.parameters())


def test_memory_plan_command_prints_each_stage_and_autos_choice(tiny_flux_files, make_run):
    config = make_run(tiny_flux_files, images=2, memory_limit_gib=0.001)
    # the command's processes forked from the warm server of the pinned ComfyUI (conftest.python_child): each would
    # otherwise import torch, DeepSpeed and ComfyUI again before planning; its output holds stdout and stderr together
    out = python_child(["memory-plan", str(config), "--gpu-gib", "0.001"], dict(os.environ), timeout=300)
    assert "stage 0:" in out.stdout and "stage 1:" in out.stdout, out.stdout + out.stderr
    assert "as configured: memory plan: no activation checkpointing" in out.stdout
    # a thousandth of a GiB fits no setting: the command says what to change, naming the keys
    assert out.returncode == 1 and "pipeline_stages" in out.stdout
    big = python_child(["memory-plan", str(config), "--gpu-gib", "80"], dict(os.environ), timeout=300)
    assert big.returncode == 0 and "memory = 'auto' on 80.0 GiB: memory plan: no activation checkpointing" in big.stdout


@pytest.mark.parametrize("value", [0, -1, 5000])
def test_memory_limit_out_of_range_is_refused_naming_the_key(value, tiny_flux_files, make_run):
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.errors import ConfigError

    config = make_run(tiny_flux_files, images=2, memory_limit_gib=value)
    with pytest.raises(ConfigError, match="memory_limit_gib"):
        load_run_config(config)


def test_a_plan_is_traced_once_per_model_and_size(tiny_flux_files, make_run, tmp_path, monkeypatch):
    """The queue-time plan memoises the traced footprints: the second plan of the same run does not trace; a
    different size traces again."""
    from pipetrain.backend.memory import plan_config as mpc
    from pipetrain.backend.config import load_run_config

    cfg = load_run_config(make_run(tiny_flux_files, images=2))
    memo = tmp_path / "memo"
    first = mpc.plan_config(cfg, 80 * mp.GIB, memo=memo)
    assert len(list(memo.glob("*.json"))) == 1

    def no_trace(*a, **k):
        raise AssertionError("traced again although the memo holds this model and size")
    monkeypatch.setattr(mp, "trace_run", no_trace)
    again = mpc.plan_config(cfg, 80 * mp.GIB, memo=memo)
    assert again.configured[1] == first.configured[1] and again.auto == first.auto
    with pytest.raises(AssertionError, match="traced again"):
        mpc.plan_config(cfg, 80 * mp.GIB, width=cfg.dataset_config.resolutions[0] * 2, memo=memo)


def test_the_largest_bucket_counts_size_buckets_and_frames(tiny_flux_files, make_run):
    import dataclasses

    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.memory.plan_config import largest_probe

    cfg = load_run_config(make_run(tiny_flux_files, images=2))
    object.__setattr__(cfg, "_dataset", dataclasses.replace(cfg.dataset_config, resolutions=[256],
                                                            size_buckets=[[512, 128], [320, 320]]))
    probe = largest_probe(cfg)
    assert (probe.width, probe.height, probe.frames) == (320, 320, 1)   # the largest area, not the longest side


def test_a_queued_auto_run_that_nothing_fits_is_refused_before_it_starts(tiny_flux_files, make_run, tmp_path):
    """The launcher's queue-time plan: ``auto`` under a limit nothing fits is refused naming what to change;
    under a roomy limit the node is told what ``auto`` chooses; a manual run is told its peak."""
    from pipetrain.launcher.queue_plan import plan_queued_run

    tight = make_run(tiny_flux_files, images=2, name="tight", memory="auto", memory_limit_gib=0.001)
    plan = plan_queued_run(tight, (0,), tmp_path)
    assert plan.refusal and "pipeline_stages" in plan.refusal and "memory = 'auto'" in plan.refusal
    roomy = plan_queued_run(make_run(tiny_flux_files, images=2, name="roomy", memory="auto", memory_limit_gib=80),
                            (0,), tmp_path)
    assert roomy.refusal is None and "memory = 'auto' chooses no activation checkpointing" in roomy.text
    manual = plan_queued_run(make_run(tiny_flux_files, images=2, name="manual", memory_limit_gib=0.001),
                             (0,), tmp_path)
    assert manual.refusal is None and "likely out of memory as configured" in manual.text


def test_doctor_prints_a_configs_memory_plan(tiny_flux_files, make_run):
    config = make_run(tiny_flux_files, images=2, memory_limit_gib=80)
    out = python_child(["doctor", "--model-type", "flux", "--config", str(config)], dict(os.environ), timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"memory plan of {config}:" in out.stdout and "stage 0:" in out.stdout
    assert "memory = 'auto' on 80.0 GiB" in out.stdout


def test_a_run_nothing_fits_is_told_the_smallest_change_that_would():
    """Between what two stages and what one stage need, the refusal names pipeline_stages = 2 (not 3), and float8
    weights when they alone fit; a config already in float8 is not told to use float8."""
    from types import SimpleNamespace

    fps = _footprints(blocks=6, weights=200 * MIB)
    cfg = SimpleNamespace(adapter=None, optimizer=SimpleNamespace(type="adamw"), gradient_accumulation_steps=1,
                          pipeline_stages=1, fp8_compute=False,
                          model=SimpleNamespace(dtype="bfloat16", diffusion_model_dtype=None))
    last = mp.MemorySettings(True, 1.0, 0)
    one = max(st.gpu for st in mp.estimate(fps, last, mp.training_of(cfg)))
    two = max(st.gpu for st in mp.estimate(fps, last, mp.Training(state_bytes_per_param=16, stages=2)))
    gpu = int((one + two) / 2 / mp.HEADROOM)
    assert mp.choose(fps, mp.training_of(cfg), gpu, whole_gpu=False) is None
    text = mp.does_not_fit(cfg, fps, gpu, whole_gpu=False)
    assert "The smallest change that fits: " in text and "pipeline_stages = 2 on 2 GPUs" in text, text
    assert "pipeline_stages = 3" not in text
    fp8_fits = mp.choose(fps, mp.Training(state_bytes_per_param=16, fp8_weights=True), gpu, whole_gpu=False)
    assert ("diffusion_model_dtype = 'float8_e4m3fn'" in text) == (fp8_fits is not None)
    cfg.model.diffusion_model_dtype = "float8_e4m3fn"
    assert "diffusion_model_dtype" not in mp.does_not_fit(cfg, fps, gpu, whole_gpu=False).split("fits:")[-1]


def test_the_plan_carries_the_preservation_rows(tiny_flux_files, make_run):
    """diff_output_preservation triples each micro-batch's rows in the pipeline: the queue-time plan traces them."""
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.memory.plan_config import largest_probe

    plain = largest_probe(load_run_config(make_run(tiny_flux_files, images=2, name="plain")))
    dop = largest_probe(load_run_config(make_run(tiny_flux_files, images=2, name="dop", diff_output_preservation=True,
                                                 trigger_word="sks")))
    assert dop.batch == 3 * plain.batch


def test_a_plan_that_checkpoints_or_swaps_asks_for_expandable_segments_unless_the_user_set_the_allocator():
    from pipetrain.backend.train.memory_auto import EXPANDABLE, less_fragmentation

    swap = mp.MemorySettings(True, 1.0, 12)
    assert less_fragmentation(swap, {}) == EXPANDABLE == "expandable_segments:True"
    assert less_fragmentation(mp.MemorySettings("unsloth", 1.0), {}) == EXPANDABLE
    assert less_fragmentation(mp.MemorySettings(True, 0.25), {"PATH": "/usr/bin"}) == EXPANDABLE
    # nothing checkpointed or swapped: CUDA graphs may replay, their pools stay with PyTorch's default
    assert less_fragmentation(mp.MemorySettings(), {}) is None
    # the user's own allocator settings win, whatever they are
    assert less_fragmentation(swap, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) is None
    assert less_fragmentation(swap, {"PYTORCH_CUDA_ALLOC_CONF": ""}) is None

"""The GPU benchmark harness: its pipeline report, and every new case run through the trainer on tiny models
(the figures themselves come from the GPU machine)."""
from dataclasses import asdict

import pytest

from conftest import share_model_files


def test_pipeline_efficiency_compares_stages_with_the_bubble_bound():
    from pipetrain.bench.run import CASES, pipeline_efficiency

    results = {name: {"case": asdict(CASES[name]), "ours": {"samples_per_s": sps}}
               for name, sps in (("flux-1024-1stage-ga8", 2.0), ("flux-1024-2stages-ga8", 3.2), ("flux-1024", 2.4))}
    (line,) = pipeline_efficiency(results)
    assert line == ("flux-1024-2stages-ga8: 2 stages vs 1, GA 8: speed-up 1.60x, efficiency 80% "
                    "(bubble bound 89%)")
    del results["flux-1024-1stage-ga8"]        # nothing to compare with
    assert pipeline_efficiency(results) == []


def test_benchmark_text_encoders_keep_the_width_the_diffusion_model_reads():
    """A full-size Z-Image reads 2560-wide Qwen3-4B states: the bench's shallow encoder keeps the real width and
    vocabulary with the tiny depth (the tiny one is 64 wide: a full model would refuse its output)."""
    from pipetrain.backend.models.tiny import SHALLOW, text_encoder_config
    from pipetrain.backend.host.runtime import ensure_comfyui

    ensure_comfyui()
    for kind in ("qwen3_4b", "qwen25_7b", "t5xxl", "umt5xxl"):
        full, tiny, shallow = (text_encoder_config(kind, size) for size in ("full", "tiny", SHALLOW))
        assert {k: v for k, v in shallow.items() if "layers" not in k} == \
            {k: v for k, v in full.items() if "layers" not in k}, kind
        assert all(shallow[k] == tiny[k] for k in shallow if "layers" in k and k in tiny), kind
    assert text_encoder_config("qwen3_4b", SHALLOW)["hidden_size"] == 2560
    assert text_encoder_config("qwen3_4b", "tiny")["hidden_size"] == 64


@pytest.mark.slow
def test_every_new_bench_case_runs_its_code_path_on_tiny_models(tmp_path, warm_bench_ranks, model_files):
    """The GPU cases for Z-Image (batch 4), Qwen-Image, Wan 2.1 1.3B (81-frame clips) and Flux compiled under an
    activation memory budget through the real trainer with tiny models at 64^2 (9 frames): configs, generated
    clips and step events all work."""
    import json
    import subprocess
    import sys

    # Z-Image's case writes its tiny files (write_models' own writing, the quickest of the four); the others train on
    # the suite's shared tiny files, which other tests use anyway (the tiny Flux's copy alone took the longest here)
    for arch in ("qwen_image", "wan", "flux"):
        share_model_files(tmp_path / "work", f"{arch}-tiny", model_files(arch))

    cases = ["zimage-1024-b4", "qwen_image-1024-ckpt", "wan1.3b-480x832x81", "flux-1024-budget50-compile"]
    # one step a case, timed (no warm-up left out): a rate comes back from any number of steps
    out = subprocess.run([sys.executable, "-m", "pipetrain.bench.run", "--cases", ",".join(cases), "--size", "tiny",
                          "--resolution", "64", "--frames", "9", "--steps", "1", "--warmup", "0", "--baselines",
                          "none", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "bench.json").read_text())
    for name in cases:
        assert results[name]["ours"]["rc"] == 0 and results[name]["ours"]["samples_per_s"] > 0, results[name]
    clip = next((tmp_path / "work" / "wan1.3b-480x832x81" / "dataset").glob("*.webp"))
    from PIL import Image
    assert Image.open(clip).n_frames == 9


def test_the_bf16_lora_cases_train_the_adapter_in_bfloat16_as_diffusion_pipe_is_configured(tmp_path):
    """The ``-bf16lora`` cases compare memory with diffusion-pipe at its adapter dtype; the other cases keep
    PipeTrain's default (float32 LoRA weights)."""
    import torch

    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.models.base import DTYPES
    from pipetrain.bench.run import CASES, write_config

    files = {"diffusion_model": "dm.safetensors", "vae": "vae.safetensors", "text_encoders": ["t5.safetensors"]}
    names = [n for n in CASES if n.endswith("-bf16lora")]
    assert len(names) == 5
    for name in (*names, "flux-1024-ckpt-compile", "zimage-1024-b4-ckpt", "qwen_image-1024-ckpt"):
        cfg = load_run_config(write_config(name, CASES[name], files, tmp_path, steps=2), check_dataset=False)
        dtype = DTYPES[cfg.adapter.dtype] if cfg.adapter.dtype else torch.float32   # as engine.attach_lora
        assert dtype == (torch.bfloat16 if name in names else torch.float32), name


def test_a_failed_case_brings_back_the_end_of_its_log(tmp_path, warm_bench_ranks):
    """The GPU machine returns only $OUT: a case that fails carries its log's last lines in the results, and they
    name what went wrong (here a model file that does not exist). The ranks fork from the warm server: the log and
    its tail are the harness's, whatever started the ranks."""
    from pipetrain.bench.run import CASES, run_ours

    files = {"diffusion_model": str(tmp_path / "missing-dm.safetensors"), "vae": str(tmp_path / "vae.safetensors"),
             "text_encoders": [str(tmp_path / "te.safetensors")]}
    result = run_ours("zimage-1024-b4", CASES["zimage-1024-b4"], files, tmp_path, steps=2, warmup=0)
    assert result["rc"] != 0
    assert "diffusion_model: file not found" in result["log_tail"], result["log_tail"]


def test_bench_captions_are_as_long_as_the_baselines_text():
    """The bare loop and ComfyUI's trainer run SDXL on one 77-token CLIP chunk and T5 models on 512 tokens; a
    longer SDXL caption would be split into more chunks and make our cross-attention do more work than theirs."""
    from pipetrain.backend.host.runtime import ensure_comfyui
    from pipetrain.bench.run import bench_caption
    ensure_comfyui()
    import comfy.sdxl_clip
    from comfy.text_encoders.flux import FluxTokenizer

    sdxl = comfy.sdxl_clip.SDXLTokenizer().tokenize_with_weights(bench_caption("sdxl"))
    assert len(sdxl["g"]) == len(sdxl["l"]) == 1                       # one chunk of 77
    t5 = FluxTokenizer().tokenize_with_weights(bench_caption("flux"))["t5xxl"]
    assert sum(len(chunk) for chunk in t5) in range(490, 513)


def test_the_native_baseline_loads_comfyuis_train_node_over_the_pyav_stand_in(tmp_path):
    """On a machine without PyAV, TrainLoraNode's module (which imports comfy_api, which imports PyAV) loads over
    the stand-in that run.py puts in front of the baseline script."""
    import os
    import subprocess
    import sys

    from pipetrain.backend.host.runtime import ensure_comfyui
    from pipetrain.bench.run import write_av_stand_in

    comfyui = ensure_comfyui()
    script = ("import comfy.options; comfy.options.enable_args_parsing(False)\n"
              "from comfy.cli_args import args; args.cpu = True\n"
              "import av; assert not hasattr(av, '__version__'), 'the installed PyAV, not the stand-in'\n"
              "import comfy_extras.nodes_train as nt; print(nt.TrainLoraNode.__name__)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(write_av_stand_in(tmp_path)), str(comfyui),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("TrainLoraNode"), out.stderr[-3000:]

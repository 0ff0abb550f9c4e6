"""diffusion-pipe's own HunyuanVideo code reading the files bench/diffusion_pipe_models.py writes, for
tests/ranks/test_bench_diffusion_pipe_models.py. Runs in a subprocess with diffusion-pipe's checkout on PYTHONPATH;
reads a JSON request on stdin and prints a JSON line last.

- ``{"mode": "load", "model": <the [model] section>, "transformer": {...}, "vae": {...}, "caption": ...}``: its
  ``HunyuanVideoPipeline`` built from the section (VAE, Llama and CLIP-L folders with their tokenizers), its
  ``load_diffusion_model`` (the transformer file, ComfyUI's saved layout), and the caption through its text encoders,
  on the CPU. ``transformer``: HUNYUAN_VIDEO_CONFIG fields and ``text_states_dim`` of the tiny model; ``vae``: the tiny
  VAE's overrides of its configs/hy_vae_config.json (it reads the file from its working directory: a copy is made).
- ``{"mode": "keys", "transformer": {key: shape}, "llm": ..., "clip": ..., "vae": ..., "llm_config": ...,
  "clip_config": ...}``:
  the full-size transformer its code builds and the text models transformers builds from the folders' configs (on
  the meta device), against files holding those tensors under those names (nothing is written).
- ``{"mode": "attention", "tokens": N, "valid": M}``: its blocks' attention call after the bench's flash-attn
  stand-in (``hunyuan_attention_through_sdpa_without_flash_attn``), on the CPU.
An error is a failure: a tensor the loader wants that the file lacks, or one of another shape.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
import tempfile
import types
from pathlib import Path

import torch
from accelerate import init_empty_weights

DP = Path(os.environ["DIFFUSION_PIPE"])


def stub_missing() -> None:
    """Two modules its code imports, where they are not installed: loguru, which it logs through (a logger that
    says nothing), and imageio, whose list of video extensions its utils read on import (none)."""
    if importlib.util.find_spec("loguru") is None:
        class Silent:
            def __getattr__(self, name):
                return lambda *args, **kwargs: None
        stand_in("loguru").logger = Silent()
    if importlib.util.find_spec("imageio") is None:
        stand_in("imageio").config = types.SimpleNamespace(video_extensions=[])


def stand_in(name: str) -> types.ModuleType:
    module = sys.modules[name] = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)   # libraries' availability checks read it
    return module


def import_pipeline():
    from pipetrain.backend.host.runtime import ensure_comfyui, locate_comfyui
    from pipetrain.bench.diffusion_pipe import bind_diffusion_pipe, clip_text_model_as_its_own_text_model

    stub_missing()
    bind_diffusion_pipe(DP, locate_comfyui(), ("wandb", "torchaudio", "av", "peft"))
    ensure_comfyui()   # ComfyUI in its CPU mode where there is no GPU
    clip_text_model_as_its_own_text_model()   # as bench/diffusion_pipe.py does in its process
    from models import hunyuan_video
    return hunyuan_video


def not_from_file(model: torch.nn.Module, file: str, prefixes: tuple[str, ...]) -> list[str]:
    """The parameters of a transformers model that do not hold the file's tensor of their name (under one of
    ``prefixes``): a name the file lacks leaves transformers' random init, which only logs a warning."""
    from safetensors.torch import load_file

    state = load_file(file)
    differ = []
    for name, p in model.named_parameters():
        key = next((k for k in (name, *(prefix + name for prefix in prefixes)) if k in state), None)
        if key is None or not torch.equal(p.detach().float(), state[key].float()):
            differ.append(name)
    return differ


def meta_names(*modules: torch.nn.Module) -> list[str]:
    return [name for module in modules for name, p in module.named_parameters() if p.is_meta]


def check_load(request: dict) -> dict:
    hunyuan_video = import_pipeline()
    from hyvideo.modules import models as hv_models

    tiny = request["transformer"]
    hv_models.HUNYUAN_VIDEO_CONFIG["HYVideo-T/2-cfgdistill"] = {
        key: value for key, value in tiny.items() if key != "text_states_dim"}
    load_model = hunyuan_video.load_model

    def load_on_cpu(args, in_channels, out_channels, factor_kwargs):
        # it builds on 'cuda' under init_empty_weights; the CPU has none
        args.text_states_dim = tiny["text_states_dim"]
        return load_model(args, in_channels, out_channels, {**factor_kwargs, "device": "cpu"})

    hunyuan_video.load_model = load_on_cpu
    vae_config = {**json.loads((DP / "configs" / "hy_vae_config.json").read_text()), **request["vae"]}
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "configs").mkdir()
        (Path(tmp) / "configs" / "hy_vae_config.json").write_text(json.dumps(vae_config))
        os.chdir(tmp)
        try:
            pipeline = hunyuan_video.HunyuanVideoPipeline({"model": {**request["model"], "dtype": torch.float32}})
        finally:
            os.chdir(cwd)
    pipeline.load_diffusion_model()
    encode = {index: pipeline.get_call_text_encoder_fn(encoder)
              for index, encoder in enumerate(pipeline.get_text_encoders(), start=1)}
    with torch.no_grad():
        llm = encode[1]([request["caption"]], [True])
        clip = encode[2]([request["caption"]], [True])
    states, mask = llm["prompt_embeds_1"], llm["prompt_attention_mask_1"]
    return {"meta_left": meta_names(pipeline.transformer, pipeline.vae, pipeline.text_encoder.model,
                                    pipeline.text_encoder_2.model),
            "double_blocks": len(pipeline.transformer.double_blocks),
            "single_blocks": len(pipeline.transformer.single_blocks),
            "llm_shape": list(states.shape), "llm_tokens": int(mask.sum()), "llm_finite": bool(states.isfinite().all()),
            "clip_shape": list(clip["prompt_embeds_2"].shape),
            "vae_latent_channels": pipeline.vae.config.latent_channels,
            "llm_not_from_file": not_from_file(pipeline.text_encoder.model,
                                               str(Path(request["model"]["llm_path"]) / "model.safetensors"),
                                               ("model.",)),
            "clip_not_from_file": not_from_file(pipeline.text_encoder_2.model,
                                                str(Path(request["model"]["clip_path"]) / "model.safetensors"),
                                                ("text_model.",))}


def unmatched(model: torch.nn.Module, shapes: dict, prefixes: tuple[str, ...]) -> list[str]:
    """The parameters of a transformers model that no file tensor of their name (under one of ``prefixes``) and
    shape would fill."""
    out = []
    for name, p in model.named_parameters():
        key = next((k for k in (name, *(prefix + name for prefix in prefixes)) if k in shapes), None)
        if key is None or tuple(shapes[key]) != tuple(p.shape):
            out.append(name)
    return out


def check_keys(request: dict) -> dict:
    import argparse

    import transformers

    hunyuan_video = import_pipeline()
    from hyvideo.config import (add_denoise_schedule_args, add_extra_models_args, add_inference_args,
                                add_network_args, sanity_check_args)

    parser = argparse.ArgumentParser()
    for add in (add_network_args, add_extra_models_args, add_denoise_schedule_args, add_inference_args):
        parser = add(parser)
    args = sanity_check_args(parser.parse_args([]))   # HunyuanVideoPipeline's arguments: the 13B t2v model
    with init_empty_weights():
        transformer = hunyuan_video.load_model(args, in_channels=args.latent_channels,
                                               out_channels=args.latent_channels,
                                               factor_kwargs={"device": "meta", "dtype": torch.bfloat16})
    # load_diffusion_model's route: its key conversion of the file's tensors, then each parameter from it
    file = {key: torch.empty(shape, device="meta") for key, shape in request["transformer"].items()}
    state = hunyuan_video._convert_state_dict_keys(transformer.state_dict(), file)
    transformer_unmatched = [name for name, p in transformer.named_parameters()
                             if name not in state or state[name].shape != p.shape]
    # the text encoders as its TextEncoder loads them: transformers' classes from the folders' configs
    with init_empty_weights():
        llm = transformers.AutoModel.from_config(transformers.LlamaConfig(**request["llm_config"]))
        clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(**request["clip_config"]))
    # its VAE: its class from its own config file, loaded strictly
    from hyvideo.vae.autoencoder_kl_causal_3d import AutoencoderKLCausal3D
    with init_empty_weights():
        vae = AutoencoderKLCausal3D.from_config(json.loads((DP / "configs" / "hy_vae_config.json").read_text()))
    vae_state = {key: list(t.shape) for key, t in vae.state_dict().items()}
    return {"vae_matches": vae_state == request["vae"],
            "transformer_parameters": len(dict(transformer.named_parameters())),
            "transformer_unmatched": transformer_unmatched,
            "llm_layers": len(llm.layers), "llm_unmatched": unmatched(llm, request["llm"], ("model.",)),
            "clip_unmatched": unmatched(clip, request["clip"], ("text_model.",))}


def check_attention(request: dict) -> dict:
    """Its blocks' attention call (mode "flash", varlen over cu_seqlens) after the bench's patch, where flash-attn is
    not installed, against attention over each stretch on its own."""
    import torch.nn.functional as F

    from pipetrain.bench.diffusion_pipe import hunyuan_attention_through_sdpa_without_flash_attn

    import_pipeline()
    hunyuan_attention_through_sdpa_without_flash_attn()
    from hyvideo.modules.attenion import attention

    torch.manual_seed(0)
    tokens, valid = request["tokens"], request["valid"]
    q, k, v = (torch.randn(1, tokens, 2, 8) for _ in range(3))
    cu = torch.tensor([0, valid, tokens], dtype=torch.int32)
    out = attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=tokens, max_seqlen_kv=tokens,
                    batch_size=1)
    ref = torch.cat([F.scaled_dot_product_attention(*(t[:, a:b].transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
                     for a, b in ((0, valid), (valid, tokens))], dim=1).flatten(2)
    return {"shape": list(out.shape), "err": (out - ref).abs().max().item()}


if __name__ == "__main__":
    request = json.loads(sys.stdin.read())
    check = {"load": check_load, "keys": check_keys, "attention": check_attention}[request["mode"]]
    print(json.dumps(check(request)))

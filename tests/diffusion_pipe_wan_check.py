"""diffusion-pipe's own Wan code reading the files bench/diffusion_pipe_models.py writes, for
tests/ranks/test_bench_diffusion_pipe_models.py. Runs in a subprocess with diffusion-pipe's checkout on PYTHONPATH (its
``models`` package); reads a JSON request on stdin and prints a JSON line last.

- ``{"mode": "load", "ckpt": ..., "transformer": ..., "llm": ..., "vae_dim": N, "caption": ...}``: the written
  files through its loading route (transformer, UMT5 encoder, VAE, tokenizer), on the CPU.
- ``{"mode": "keys", "config": ..., "transformer": {key: shape}, "text_encoder": ..., "vae": ...}``: the same route
  on the meta device for files that would hold those tensors (nothing is written).
An error is a failure: a tensor the loader wants that the file lacks, or one of another shape.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import re
import sys
import types
from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device

# t5.py's T5EncoderModel takes torch.cuda.current_device() as a default argument, evaluated on import
torch.cuda.current_device = lambda: 0
from models.wan.model import WanModel  # noqa: E402  (imports diffusers before ftfy may be stubbed)

if importlib.util.find_spec("ftfy") is None:
    # its tokenizer wrapper cleans text with ftfy.fix_text, which leaves the plain ASCII caption as it is
    ftfy = types.ModuleType("ftfy")
    ftfy.fix_text = lambda text: text
    ftfy.__spec__ = importlib.machinery.ModuleSpec("ftfy", None)
    sys.modules["ftfy"] = ftfy
from models.wan import t5, vae2_1  # noqa: E402
from models.wan.tokenizers import HuggingfaceTokenizer  # noqa: E402

WAN_VAE_Z_DIM = 16


def load_transformer(config: dict, state: dict, device: str) -> torch.nn.Module:
    """WanModelFromSafetensors.from_pretrained's route: every parameter of the configured model from the file."""
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    with init_empty_weights():
        model = WanModel(**config)
    state = {re.sub(r"^model\.diffusion_model\.", "", key): value for key, value in state.items()}
    for name, _ in list(model.named_parameters()):
        set_module_tensor_to_device(model, name, device=device, value=state[name])
    return model


def load_text_encoder(state: dict, overrides: dict) -> torch.nn.Module:
    """T5EncoderModel's route for a ``.safetensors`` llm_path: its key mapping, then a strict load."""
    with init_empty_weights():
        model = t5.umt5_xxl(encoder_only=True, return_tokenizer=False, **overrides)
    model.load_state_dict(t5.umt5_keys_mapping(dict(state)), assign=True)
    return model


def umt5_overrides(te_config: dict) -> dict:
    """umt5_xxl's arguments for a (tiny) ComfyUI UMT5 config."""
    return {"vocab_size": te_config["vocab_size"], "dim": te_config["d_model"], "dim_ffn": te_config["d_ff"],
            "dim_attn": te_config["num_heads"] * te_config["d_kv"], "num_heads": te_config["num_heads"],
            "encoder_layers": te_config["num_layers"], "num_buckets": te_config["relative_attention_num_buckets"]}


def meta_names(*modules: torch.nn.Module) -> list[str]:
    return [name for module in modules for name, p in module.named_parameters() if p.is_meta]


def check_load(request: dict) -> dict:
    from safetensors import safe_open
    from safetensors.torch import load_file

    ckpt = Path(request["ckpt"])
    transformer = load_transformer(json.loads((ckpt / "config.json").read_text()),
                                   load_file(request["transformer"]), "cpu")
    with safe_open(request["llm"], "pt") as f:
        te_config = json.loads(f.metadata()["pipetrain.te_config"])
    encoder = load_text_encoder(load_file(request["llm"]), umt5_overrides(te_config))
    vae = vae2_1._video_vae(pretrained_path=ckpt / "Wan2.1_VAE.pth", z_dim=WAN_VAE_Z_DIM, dim=request["vae_dim"])
    tokenizer = HuggingfaceTokenizer(name=ckpt / "google/umt5-xxl", seq_len=512, clean="whitespace")
    ids, mask = tokenizer(request["caption"], return_mask=True, add_special_tokens=True)
    with torch.no_grad():
        context = encoder(ids, mask)
    return {"meta_left": meta_names(transformer, encoder, vae), "ids_shape": list(ids.shape),
            "ids_max": int(ids.max()), "ends": int((ids == 1).sum()), "tokens": int(mask.sum()),
            "context_shape": list(context.shape), "context_finite": bool(torch.isfinite(context).all())}


def check_keys(request: dict) -> dict:
    def meta_state(shapes: dict) -> dict:
        return {key: torch.empty(shape, device="meta") for key, shape in shapes.items()}

    load_transformer(request["config"], meta_state(request["transformer"]), "meta")
    load_text_encoder(meta_state(request["text_encoder"]), {})   # the full UMT5-XXL diffusion-pipe builds
    vae_state = meta_state(request["vae"])
    torch.load = lambda *args, **kwargs: vae_state   # _video_vae torch.loads its file
    vae2_1._video_vae(pretrained_path="Wan2.1_VAE.pth", z_dim=WAN_VAE_Z_DIM)
    return {"ok": True}


if __name__ == "__main__":
    request = json.loads(sys.stdin.read())
    print(json.dumps((check_load if request["mode"] == "load" else check_keys)(request)))

# SPDX-License-Identifier: GPL-3.0-or-later
"""diffusion-pipe's HiDream ``llama3_path``: a Hugging Face Llama folder (sharded safetensors, config.json) is read
as HiDream's Llama text encoder, its keys ComfyUI's as they are (lm_head left out), and gives the hidden states
transformers' Llama gives for the same tokens; the [model] key lands after the other text encoders, and check-config
says how it is read."""
from __future__ import annotations

import json

import torch

from pipetrain.backend.config.model_folders import text_encoder_kind


def _tiny_llama(folder):
    """A Hugging Face Llama ComfyUI's Llama can be (its head width is fixed at 128: 2 heads of 128), saved in
    several shards as published Llama folders are."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, rope_theta=500000.0,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, max_shard_size="1MB", safe_serialization=True)
    return model


def test_a_llama_folder_gives_comfyuis_llama_with_the_same_hidden_states(tmp_path):
    from pipetrain.backend.models.loading import load_text_encoders
    from pipetrain.backend.models.tiny import cached_model_files

    folder = tmp_path / "Meta-Llama-3.1-8B-Instruct"
    model = _tiny_llama(folder)
    assert len(list(folder.glob("*.safetensors"))) > 1
    assert text_encoder_kind(json.loads((folder / "config.json").read_text())) == "llama"
    assert "lm_head.weight" in model.state_dict()
    others = cached_model_files("hidream").text_encoders[:3]   # CLIP-L, CLIP-G, T5-XXL
    clip = load_text_encoders([*others, folder], "hidream", torch.float32)
    comfy = clip.cond_stage_model.llama.transformer
    assert set(comfy.state_dict()) == {k for k in model.state_dict() if k != "lm_head.weight"}   # every key read
    tokens = torch.randint(0, 1000, (1, 12))
    with torch.no_grad():
        want = model.model(input_ids=tokens).last_hidden_state
        got, _ = comfy(tokens)
    torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=1e-4)


def test_llama3_path_is_hidreams_last_text_encoder_and_check_config_says_how_it_is_read(tmp_path):
    from pipetrain.backend.commands.check_config import dp_key_line
    from pipetrain.backend.config import load_run_config

    from safetensors.torch import save_file

    (tmp_path / "llama").mkdir()
    save_file({"model.norm.weight": torch.ones(4)}, str(tmp_path / "llama" / "model.safetensors"))
    (tmp_path / "dataset.toml").write_text("[[directory]]\npath = 'images'\n")
    (tmp_path / "run.toml").write_text(
        "output_dir = 'out'\ndataset = 'dataset.toml'\n[model]\ntype = 'hidream'\n"
        "transformer_path = 'hidream_i1_full.safetensors'\nvae_path = 'ae.safetensors'\n"
        "text_encoders = ['clip_l.safetensors', 'clip_g.safetensors', 't5xxl.safetensors']\nllama3_path = 'llama'\n"
        "dtype = 'bfloat16'\n[adapter]\ntype = 'lora'\nrank = 4\n[optimizer]\ntype = 'adamw'\nlr = 1e-4\n")
    cfg = load_run_config(tmp_path / "run.toml")
    assert cfg.model.text_encoders == ["clip_l.safetensors", "clip_g.safetensors", "t5xxl.safetensors", "llama"]
    assert cfg.resolve(cfg.model.text_encoders[3]) == tmp_path / "llama"
    line = dp_key_line("model", "llama3_path", "Llama-3.1-8B", "hidream")
    assert line.startswith("DIFFERENT: a Hugging Face Llama folder, read into text_encoders") and "REFUSED" not in line
    # diffusion-pipe's other models ignore the key; so does PipeTrain
    assert dp_key_line("model", "llama3_path", "Llama-3.1-8B", "flux").startswith("accepted, changes nothing")

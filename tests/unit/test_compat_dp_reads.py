"""What diffusion-pipe (8f83dbf) reads, read here with its meaning, or refused naming the key or file and what to do
(issue #36 item 3): ``rank = 1e6`` (LoKr's full matrix), ``exclude_modules`` (PEFT's rule), ``lumina_shift``,
SDXL's ``unet_lr`` and ``text_encoder_*_lr``, ``regenerate_cache`` (a key diffusion-pipe ignores), ``captions.json``
and ``.tar`` archives."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from test_compat_dp_examples import ADAPTER, MAIN, OPTIMIZER, _model, _table, _write

from pipetrain.backend.adapters import injection
from pipetrain.backend.commands.check_config import report
from pipetrain.backend.errors import ConfigError, DatasetError
from pipetrain.backend.preflight import load_run

SDXL = _table("sdxl", "diffusion_model", "vae", extra="text_encoders = ['{te0}', '{te1}']")


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"attn": nn.ModuleDict({"qkv": nn.Linear(16, 48)}),
                                                   "mlp": nn.Linear(16, 16)}) for _ in range(2))


def test_a_float_rank_of_a_million_is_lokrs_full_matrix(tmp_path):
    flux = _table("flux", "transformer_path", "vae_path", extra="text_encoders = ['{te0}', '{te1}']")
    path = _write(tmp_path, MAIN + _model("flux", flux) + "[adapter]\ntype = 'lokr'\nrank = 1e6\n" + OPTIMIZER)
    cfg = load_run(path)
    assert cfg.adapter.rank == 1_000_000 and isinstance(cfg.adapter.rank, int)
    model = _Blocks()
    injection.inject(model, injection.spec_from_config(cfg.adapter), ("blocks",))
    adapter = model.blocks[0]["attn"]["qkv"].lokr
    assert hasattr(adapter, "lokr_w2") and not hasattr(adapter, "lokr_w2_a")   # one full second factor
    assert injection.spec_from_config(cfg.adapter).alpha / cfg.adapter.rank == 1.0   # dp: alpha = rank
    path.write_text(path.read_text().replace("rank = 1e6", "rank = 2.5"))
    with pytest.raises(ConfigError, match="adapter.rank"):
        load_run(path)


@pytest.mark.parametrize("exclude, left", [
    ("['attn.qkv']", {"blocks.0.attn.qkv", "blocks.1.attn.qkv"}),      # trailing dotted parts
    ("['blocks.1.mlp']", {"blocks.1.mlp"}),                             # a whole path
    ("['qkv.x', 'lp']", set()),                                         # never part of a name
    ("'blocks\\.0\\..*'", {"blocks.0.attn.qkv", "blocks.0.mlp"}),   # a string: a regex of the whole path
])
def test_exclude_modules_leaves_the_named_modules_without_an_adapter(tmp_path, exclude, left):
    flux = _table("flux", "transformer_path", "vae_path", extra="text_encoders = ['{te0}', '{te1}']")
    cfg = load_run(_write(tmp_path, MAIN + _model("flux", flux) + ADAPTER + f"exclude_modules = {exclude}\n" +
                          OPTIMIZER))
    model = _Blocks()
    adapted = injection.inject(model, injection.spec_from_config(cfg.adapter), ("blocks",),
                               exclude=cfg.adapter.exclude_modules)
    every = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.count(".") in (2, 3)
             and "lora" not in n}
    assert set(adapted) == every - left


def test_lumina_shift_is_lumina_2s_resolution_dependent_shift(tmp_path):
    from pipetrain.backend.models.registry import adapter_class

    lumina = _table("lumina_2", "transformer_path", "llm_path", "vae_path", extra="lumina_shift = true")
    path = _write(tmp_path, MAIN + _model("lumina2", lumina) + ADAPTER + OPTIMIZER)
    cfg = load_run(path)
    assert cfg.model.flux_shift
    objective = adapter_class("lumina2")(cfg.model, cfg.resolve).objective()
    t = torch.tensor([0.5])
    assert objective._shift(t, 4096).item() > 0.7   # mu 1.15 at 4096 tokens: e^1.15 t / (1 + (e^1.15 - 1) t)
    assert "  model.lumina_shift: read as flux_shift" in report(path)[0]
    # diffusion-pipe's other models ignore it: accepted, no shift
    flux = _table("flux", "transformer_path", "vae_path", extra="text_encoders = ['{te0}', '{te1}']\nlumina_shift = true")
    cfg = load_run(_write(tmp_path, MAIN + _model("flux", flux) + ADAPTER + OPTIMIZER))
    assert not cfg.model.flux_shift and cfg.model.shift is None


def test_sdxls_learning_rates(tmp_path):
    from pipetrain.backend.optim.registry import resolve_optimizer

    path = _write(tmp_path, MAIN + _model("sdxl", SDXL + "unet_lr = 4e-5\ntext_encoder_1_lr = 0\n"
                                           "text_encoder_2_lr = 0.0\n") + ADAPTER + OPTIMIZER)
    cfg = load_run(path)
    assert resolve_optimizer(cfg)[1]["lr"] == 4e-5     # the UNet's rate; [optimizer] lr is 2e-5
    text, ok = report(path)
    assert ok and "text_encoder_1_lr: accepted at this value" in text and "text_encoder_1_lr, text_encoder_2_lr (" \
        not in text, text
    # left out: diffusion-pipe trains the text encoders' LoRAs; here they stay frozen, and check-config says so
    path = _write(tmp_path, MAIN + _model("sdxl", SDXL) + ADAPTER + OPTIMIZER)
    assert "  model.text_encoder_1_lr, text_encoder_2_lr (main file): diffusion-pipe [optimizer] lr" in report(path)[0]
    for extra, key in (("text_encoder_1_lr = 1e-5\n", "model.text_encoder_1_lr"), ("unet_lr = -1.0\n", "model.unet_lr")):
        with pytest.raises(ConfigError, match=key):
            load_run(_write(tmp_path, MAIN + _model("sdxl", SDXL + extra) + ADAPTER + OPTIMIZER))
    flux = _table("flux", "transformer_path", "vae_path", extra="text_encoders = ['{te0}', '{te1}']\nunet_lr = 1e-4")
    with pytest.raises(ConfigError, match="model.unet_lr"):
        load_run(_write(tmp_path, MAIN + _model("flux", flux) + ADAPTER + OPTIMIZER))


def test_regenerate_cache_as_a_key_is_ignored_as_diffusion_pipe_ignores_it(tmp_path):
    flux = _table("flux", "transformer_path", "vae_path", extra="text_encoders = ['{te0}', '{te1}']")
    path = _write(tmp_path, "regenerate_cache = true\n" + MAIN + _model("flux", flux) + ADAPTER + OPTIMIZER)
    load_run(path)
    assert "  regenerate_cache: accepted, changes nothing here (diffusion-pipe ignores this key too" in report(path)[0]


def _folder_of_images(tmp_path, *names, size=(64, 48)):
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir(exist_ok=True)
    for name in names:
        Image.new("RGB", size, (200, 10, 10)).save(folder / name)
    return folder


def _scan(folder, **kwargs):
    from pipetrain.backend.config import DatasetConfig, DirectoryConfig
    from pipetrain.backend.data.scan import scan_dataset

    return scan_dataset(DatasetConfig(directory=[DirectoryConfig(path=str(folder))], **kwargs))


def test_captions_json_gives_each_file_its_captions_and_each_caption_is_an_example(tmp_path):
    import json

    from pipetrain.backend.data import expand_captions
    from pipetrain.backend.data.items import Example

    folder = _folder_of_images(tmp_path, "a.png", "b.png", "c.png")
    (folder / "a.txt").write_text("never read: captions.json gives this folder's captions")
    (folder / "captions.json").write_text(json.dumps({"a.png": ["one", "two", "three"], "b.png": ["only"],
                                                      "gone.png": ["no such file"]}))
    result = _scan(folder)
    by_name = {item.path.name: item for item in result.items}
    assert (by_name["a.png"].caption, by_name["a.png"].more_captions) == ("one", ("two", "three"))
    assert (by_name["b.png"].caption, by_name["b.png"].more_captions) == ("only", ())
    assert by_name["c.png"].caption == "" and result.missing_captions == [folder / "c.png"]
    samples = expand_captions([Example(item=i, bucket=(64, 48)) for i in result.items], seed=1)
    assert [(s.item.path.name, s.text) for s in samples] == [("a.png", "one"), ("a.png", "two"), ("a.png", "three"),
                                                             ("b.png", "only"), ("c.png", "")]
    assert _scan(folder, skip_empty_caption=True).skipped_empty == [folder / "c.png"]
    (folder / "captions.json").write_text(json.dumps({"a.png": "one caption, not a list"}))
    with pytest.raises(DatasetError, match="captions.json: the entry for .*a.png is not a list of strings"):
        _scan(folder)
    (folder / "captions.json").write_text("{not json")
    with pytest.raises(DatasetError, match="captions.json: not JSON"):
        _scan(folder)


def _tar(path, members):
    """A tar of (name, bytes | (TarInfo type,)) members."""
    import io
    import tarfile

    with tarfile.open(path, "w") as tar:
        for name, content in members:
            info = tarfile.TarInfo(name)
            if isinstance(content, bytes):
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
            else:
                (info.type,), info.linkname = content, "/etc/passwd"
                tar.addfile(info)


def _png(size=(40, 24)) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, (10, 200, 10)).save(out, "PNG")
    return out.getvalue()


def test_tar_archives_are_read_as_files_of_their_folder_and_extracted_safely(tmp_path):
    import json
    import tarfile

    folder = _folder_of_images(tmp_path, "plain.png")
    (folder / "plain.txt").write_text("unused: the folder has captions.json")
    _tar(folder / "pack.tar", [("./x.png", _png()), ("sub/y.png", _png((24, 40))), ("notes.txt", b"skip me"),
                               ("../escape.png", _png()), ("/abs.png", _png()),
                               ("link.png", (tarfile.SYMTYPE,)), ("hard.png", (tarfile.LNKTYPE,))])
    (folder / "captions.json").write_text(json.dumps({"plain.png": ["p"], "x.png": ["x1", "x2"], "sub/y.png": ["y"]}))
    result = _scan(folder, on_unreadable="skip")
    got = {item.path.relative_to(folder).as_posix(): (item.caption, item.more_captions, item.width, item.height)
           for item in result.items}
    assert got == {"plain.png": ("p", (), 64, 48), ".pipetrain-tar/pack.tar/x.png": ("x1", ("x2",), 40, 24),
                   ".pipetrain-tar/pack.tar/sub/y.png": ("y", (), 24, 40)}
    assert sorted(why.split(": ", 1)[1] for _, why in result.unreadable) == [
        "a link, not extracted (only regular files are)", "a link, not extracted (only regular files are)",
        "a name outside the archive's folder (absolute, or with '..'): not extracted",
        "a name outside the archive's folder (absolute, or with '..'): not extracted"]
    made = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if not p.is_dir()}
    assert made == {"images/plain.png", "images/plain.txt", "images/pack.tar", "images/captions.json",
                    "images/.pipetrain-tar/pack.tar/x.png", "images/.pipetrain-tar/pack.tar/sub/y.png",
                    "images/.pipetrain-tar/pack.tar/.source.json"}   # nothing outside, no link, no notes.txt
    with pytest.raises(DatasetError, match="pack.tar: member 3: a name outside"):
        _scan(folder, on_unreadable="error")   # names what was left out
    # an unchanged archive is not extracted again; a changed one is
    extracted = folder / ".pipetrain-tar/pack.tar/x.png"
    extracted.write_bytes(_png((16, 16)))
    assert any(i.width == 16 for i in _scan(folder, on_unreadable="skip").items)
    _tar(folder / "pack.tar", [("x.png", _png((32, 32)))])
    assert [(i.path.name, i.width) for i in _scan(folder, on_unreadable="skip").items] == [("plain.png", 64),
                                                                                          ("x.png", 32)]
    (folder / "pack.tar").write_bytes(b"\x1f\x8b" + b"0" * 600)   # not a plain tar
    with pytest.raises(DatasetError, match="pack.tar: not a plain tar archive"):
        _scan(folder)


def test_a_tar_whose_members_claim_more_bytes_than_it_holds_is_refused(tmp_path):
    import tarfile

    folder = _folder_of_images(tmp_path, "plain.png")
    _tar(folder / "pack.tar", [("x.png", _png())])
    data = bytearray((folder / "pack.tar").read_bytes())
    info = tarfile.TarInfo("x.png")
    info.size = 1 << 32     # 4 GiB claimed in a header of a file of a few KiB
    data[:512] = info.tobuf(format=tarfile.USTAR_FORMAT)[:512]
    (folder / "pack.tar").write_bytes(bytes(data))
    with pytest.raises(DatasetError, match="pack.tar: its members are larger than the archive"):
        _scan(folder)
    assert not any((folder / ".pipetrain-tar").rglob("*.png"))


LONG_CAPTION = " ".join(f"word{i} of a long caption" for i in range(120))   # hundreds of tokens


def _adapter(model_files, arch: str, **keys):
    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.models.registry import adapter_class
    from pipetrain.backend.host.runtime import ensure_comfyui

    ensure_comfyui()
    files = model_files(arch)
    cfg = ModelConfig(type=arch, diffusion_model=str(files.diffusion_model), vae=str(files.vae),
                      text_encoders=[str(p) for p in files.text_encoders], dtype="float32", **keys)
    adapter = adapter_class(arch)(cfg)
    return adapter, adapter.load_text_encoders()


def test_auraflows_max_sequence_length_cuts_and_pads_its_t5_tokens_as_diffusion_pipe(model_files):
    """diffusion-pipe's max_sequence_length: the caption's tokens cut to that many (the end token kept) and
    zero-padded to it; left out, ComfyUI's own: every token, padded to 256."""
    adapter, clip = _adapter(model_files, "auraflow")
    assert adapter.encode_caption(clip, "a red cube")["cond"].shape[0] == 256
    assert adapter.encode_caption(clip, LONG_CAPTION)["cond"].shape[0] > 600 and adapter.text_options() == {}
    adapter, clip = _adapter(model_files, "auraflow", max_sequence_length=300)
    short = adapter.encode_caption(clip, "a red cube")["cond"]
    assert short.shape[0] == 300 and short[10:].abs().max() == 0 and short[:3].abs().min() > 0   # zero padding
    adapter, clip = _adapter(model_files, "auraflow", max_sequence_length=12)
    cut = adapter.encode_caption(clip, LONG_CAPTION)["cond"]
    assert cut.shape[0] == 12 and cut.abs().amin(dim=1).min() > 0   # 11 text tokens and the end token
    tokens = clip.tokenize(LONG_CAPTION)["pile_t5xl"][0]
    from pipetrain.backend.models.token_lengths import fit_tokens
    assert [t for t, _ in fit_tokens(tokens, 12, 1, keep_last=True)] == [t for t, _ in tokens[:11]] + [2]
    assert adapter.text_options() == {"max_sequence_length": 12}   # another cache key than ComfyUI's length


def test_hidreams_llama_tokens_are_cut_at_diffusion_pipes_128_or_its_max_llama3_sequence_length(model_files):
    adapter, clip = _adapter(model_files, "hidream")
    comfy_tokens = len(clip.tokenize(LONG_CAPTION)["llama"][0])
    default = adapter.encode_caption(clip, LONG_CAPTION)["llama"]
    short = adapter.encode_caption(clip, "a red cube")["llama"]
    assert comfy_tokens > 500 and default.shape[1] == short.shape[1] < 130   # cut at 128 tokens, as a short one
    adapter, clip = _adapter(model_files, "hidream", max_llama3_sequence_length=64)
    assert adapter.encode_caption(clip, LONG_CAPTION)["llama"].shape[1] == default.shape[1] - 64
    assert adapter.text_options() == {"llama_tokens": 64}


@pytest.mark.parametrize("key", ["max_sequence_length", "max_llama3_sequence_length"])
def test_a_token_length_of_another_model_is_refused_naming_the_key(tmp_path, key):
    flux = _table("flux", "transformer_path", "vae_path", extra=f"text_encoders = ['{{te0}}', '{{te1}}']\n{key} = 256")
    with pytest.raises(ConfigError, match=f"model.{key}"):
        load_run(_write(tmp_path, MAIN + _model("flux", flux) + ADAPTER + OPTIMIZER))


def test_a_folder_of_tar_archives_passes_the_nodes_dataset_folder_check(tmp_path):
    from pipetrain.launcher.build import check_dataset_folder

    _tar(tmp_path / "pack.tar", [("x.png", _png())])
    check_dataset_folder(tmp_path)
    (tmp_path / "pack.tar").rename(tmp_path / "pack.txt")
    with pytest.raises(DatasetError, match="contains no images or videos"):
        check_dataset_folder(tmp_path)

"""The cache can never hand back a stale tensor: every input that determines an entry is in its key.
Real `python -m pipetrain cache` runs on a micro Flux; unit checks of the keys."""
import json
import os

import pytest
from conftest import python_child
from PIL import Image

from pipetrain.backend.cache.keys import latent_key, text_key

pytestmark = pytest.mark.slow


def _cache(config):
    # `python -m pipetrain cache` forked from the warm server (conftest.python_child): a fresh process each time, the
    # imports of torch and ComfyUI paid once for the file's five runs
    proc = python_child(["cache", str(config)], {**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = (config.parent / "output" / "cache" / "events.jsonl").read_text().splitlines()
    return json.loads([e for e in events if '"cached"' in e][-1])


def test_changed_inputs_are_recomputed_and_unchanged_reused(micro_flux_files, make_run):
    # 2 pictures (a square and a landscape one): one changed, one recaptioned, both re-read at another resolution
    config = make_run(micro_flux_files, images=2)
    first = _cache(config)
    assert (first["latents_encoded"], first["texts_encoded"], first["entries"]) == (2, 2, 2)
    again = _cache(config)
    assert (again["latents_encoded"], again["texts_encoded"]) == (0, 0)

    dataset = config.parent / "dataset"
    img = Image.open(dataset / "img01.png").convert("RGB")
    img.putpixel((5, 5), (0, 0, 0))
    img.save(dataset / "img01.png")
    changed = _cache(config)
    assert (changed["latents_encoded"], changed["texts_encoded"]) == (1, 0)

    (dataset / "img00.txt").write_text("a brand new caption")
    recaptioned = _cache(config)
    assert (recaptioned["latents_encoded"], recaptioned["texts_encoded"]) == (0, 1)

    toml = config.with_name("dataset.toml")
    toml.write_text(toml.read_text().replace("resolutions = [\n    64,\n]", "resolutions = [\n    128,\n]"))
    assert "128" in toml.read_text()
    resized = _cache(config)
    assert resized["latents_encoded"] == 2   # another resolution never reads the 64 px latents
    manifest = json.loads(next((config.parent / "output" / "cache" / "manifests").glob("*.json")).read_text())
    assert {tuple(e["bucket"]) for e in manifest["entries"]} >= {(128, 128)}


def test_keys_cover_every_input():
    base = dict(image_digest="a" * 64, bucket=(64, 64), preprocess_version="1", vae_fingerprint="v",
                arch="flux", latent_format="Flux")
    k = latent_key(**base)
    for field, other in [("image_digest", "b" * 64), ("bucket", (64, 128)), ("preprocess_version", "2"),
                         ("vae_fingerprint", "w"), ("arch", "sdxl"), ("latent_format", "SDXL")]:
        assert latent_key(**{**base, field: other}) != k, field
    t = text_key("caption", ["te1", "te2"], "flux")
    assert text_key("caption.", ["te1", "te2"], "flux") != t
    assert text_key("caption", ["te1", "te3"], "flux") != t
    assert text_key("caption", ["te1", "te2"], "sdxl") != t


def test_model_fingerprint_changes_with_file(tmp_path):
    from pipetrain.backend.cache.keys import model_fingerprint
    from safetensors.torch import save_file
    import torch

    p = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(4)}, str(p))
    a = model_fingerprint(p)
    save_file({"w": torch.ones(4)}, str(p))
    assert model_fingerprint(p) != a


def test_model_fingerprint_sees_a_changed_middle_under_the_same_size_ends_and_mtime(tmp_path):
    """What ``cp -p``, ``rsync -a`` or tar leave: another file in place with the old size, header, first and
    last MiB and mtime, other bytes in the middle. The digest is remembered under the file's stat."""
    import os
    import shutil

    from pipetrain.backend.cache import CacheStore

    store = CacheStore(tmp_path / "cache")
    original = tmp_path / "vae.safetensors"
    original.write_bytes(bytes(1 << 20) + b"old weights" + bytes(1 << 20))
    first = store.fingerprint(original)
    assert json.loads((store.root / "model-digests.json").read_text())[str(original)]["sha256"] == first
    assert store.fingerprint(original) == first

    edited = tmp_path / "edited.safetensors"
    edited.write_bytes(bytes(1 << 20) + b"new weights" + bytes(1 << 20))
    shutil.copystat(original, edited)                          # cp -p keeps the mtime
    os.replace(edited, original)
    assert store.fingerprint(original) != first

    copy = tmp_path / "copy.safetensors"
    shutil.copy2(original, copy)                               # same content elsewhere: same identity
    assert store.fingerprint(copy) == store.fingerprint(original)


def test_a_new_cache_folder_takes_a_model_files_digest_from_the_users_cache(tmp_path, monkeypatch):
    """A run with a new output folder does not read its multi-GB model files again: the digest the user's cache
    keeps under the file's stat is used (an entry naming another stat, or no digest, is not), and a user cache
    folder that cannot be written never stops a run."""
    import os

    from pipetrain.backend.cache import CacheStore

    monkeypatch.setenv("PIPETRAIN_DIGEST_CACHE", str(tmp_path / "user"))
    model = tmp_path / "vae.safetensors"
    model.write_bytes(b"weights" * 1000)
    real = CacheStore(tmp_path / "run1" / "cache").fingerprint(model)
    user = tmp_path / "user" / "model-digests.json"
    known = json.loads(user.read_text())
    assert known[str(model)]["sha256"] == real

    # what the user's cache says for this very file is what a new cache folder uses (no reading of the file) ...
    known[str(model)]["sha256"] = "ab" * 32
    user.write_text(json.dumps(known))
    run2 = CacheStore(tmp_path / "run2" / "cache")
    assert run2.fingerprint(model) == "ab" * 32
    assert json.loads((run2.root / "model-digests.json").read_text())[str(model)]["sha256"] == "ab" * 32
    # ... but not an entry of another stat of the file, nor one that is no digest: those read the file
    for entry in ({**known[str(model)], "stat": [0, 0, 0, 0, 0]}, {**known[str(model)], "sha256": "../x"}):
        user.write_text(json.dumps({str(model): entry}))
        assert CacheStore(tmp_path / f"run-{len(entry['sha256'])}-{entry['stat'][0]}" / "cache").fingerprint(model) == real
    # entries of files that are gone are dropped as the user's cache is written
    gone = tmp_path / "gone.safetensors"
    user.write_text(json.dumps({str(gone): {"stat": [1, 2, 3, 4, 5], "sha256": "cd" * 32}}))
    CacheStore(tmp_path / "run3" / "cache").fingerprint(model)
    assert list(json.loads(user.read_text())) == [str(model)]
    # a user cache folder that is a file (cannot be written): the run's own cache still works
    monkeypatch.setenv("PIPETRAIN_DIGEST_CACHE", str(model))
    assert CacheStore(tmp_path / "run4" / "cache").fingerprint(model) == real
    assert os.path.isfile(tmp_path / "run4" / "cache" / "model-digests.json")

# SPDX-License-Identifier: GPL-3.0-or-later
"""A cache entry is checked against the digest stored with it on every read: a damaged, cut or renamed entry is
encoded again with a warning naming the file (or, where nothing can encode it, refused naming the file and
--regenerate-cache), never trained on, never a bare KeyError or SafetensorError."""
import logging

import pytest
import torch
from safetensors.torch import save_file

from pipetrain.backend.cache import CacheStore
from pipetrain.backend.cache.store import DamagedCacheEntry

KEY = "ab" + "0" * 62


def _stored(tmp_path, kind="latents"):
    store = CacheStore(tmp_path)
    store.put(kind, KEY, {"latent": torch.arange(64, dtype=torch.float32).reshape(4, 4, 4)})
    return store, store.path(kind, KEY)


def _encode_again(store, kind="latents"):
    calls = []

    def encode():
        calls.append(1)
        store.put(kind, KEY, {"latent": torch.full((4, 4, 4), 7.0)})
    return encode, calls


def test_a_flipped_byte_in_a_latent_is_encoded_again_with_a_warning(tmp_path, caplog):
    store, path = _stored(tmp_path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01                                   # in the tensor data: still a valid file
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedCacheEntry, match=f"^cache entry {path} differs from what was encoded .*"
                                                "--regenerate-cache"):
        store.get("latents", KEY)
    encode, calls = _encode_again(store)
    with caplog.at_level(logging.WARNING, logger="pipetrain"):
        got = store.get("latents", KEY, encode, needs=("latent",))
    assert calls == [1] and torch.equal(got["latent"], torch.full((4, 4, 4), 7.0))
    assert f"cache entry {path} differs from what was encoded" in caplog.text and "encoding it again" in caplog.text
    assert store.get("latents", KEY)["latent"][0, 0, 0] == 7.0   # stored anew: the next read is clean


def test_a_damaged_header_is_encoded_again_not_a_key_error(tmp_path):
    store, path = _stored(tmp_path)
    path.write_bytes(path.read_bytes().replace(b'"latent"', b'"latenu"', 1))
    encode, calls = _encode_again(store)
    assert store.get("latents", KEY, encode, needs=("latent",))["latent"][0, 0, 0] == 7.0
    assert calls == [1]


def test_a_cut_text_entry_names_the_file_and_regenerate_cache(tmp_path):
    store, path = _stored(tmp_path, "text")
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(DamagedCacheEntry, match=f"^cache entry {path} cannot be read .*--regenerate-cache"):
        store.get("text", KEY)


def test_an_entry_without_a_digest_loads_but_must_hold_what_is_read(tmp_path):
    store = CacheStore(tmp_path)
    path = store.path("latents", KEY)
    path.parent.mkdir(parents=True)
    save_file({"latent": torch.ones(2)}, str(path))      # written before entries carried digests
    assert torch.equal(store.get("latents", KEY, needs=("latent",))["latent"], torch.ones(2))
    save_file({"other": torch.ones(2)}, str(path))
    with pytest.raises(DamagedCacheEntry, match="holds no 'latent' tensor"):
        store.get("latents", KEY, needs=("latent",))


def test_a_picture_changed_after_keying_is_not_encoded_under_the_old_key(tmp_path):
    from PIL import Image

    from pipetrain.backend.cache.builder import _load_media
    from pipetrain.backend.cache.keys import file_digest
    from pipetrain.backend.cache.manifest import CacheEntry
    from pipetrain.backend.data import load_pixels
    from pipetrain.backend.errors import DatasetError

    picture = tmp_path / "a.png"
    Image.new("RGB", (16, 16), (200, 10, 10)).save(picture)
    entry = CacheEntry(str(picture), (16, 16), "a", 1, KEY, KEY, digest=file_digest(picture))
    pixels = _load_media({KEY: entry}, [KEY], (16, 16), None)
    assert torch.equal(pixels[0], load_pixels(picture, (16, 16)))
    Image.new("RGB", (16, 16), (10, 200, 10)).save(picture)        # edited after its key was made
    with pytest.raises(DatasetError, match=f"^{picture} changed while the cache was being built"):
        _load_media({KEY: entry}, [KEY], (16, 16), None)

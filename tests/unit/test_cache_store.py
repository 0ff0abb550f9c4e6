"""The cache store's listing of what it holds, the work left to encode, and the manifest's round trip: what the
cache job decides before it encodes anything (unit checks, real files)."""
import torch

from pipetrain.backend.cache import CacheStore
from pipetrain.backend.cache.builder import TextWork, missing_work
from pipetrain.backend.cache.manifest import CacheEntry, CacheManifest


def key(first: str, fill: str) -> str:
    return first + fill * 62


def test_the_store_lists_exactly_the_keys_it_has(tmp_path):
    store = CacheStore(tmp_path)
    stored = [key("ab", "0"), key("ab", "1"), key("cd", "2")]
    for k in stored:
        store.put("latents", k, {"latent": torch.zeros(2)})
    misplaced = key("ef", "3")           # in another key's fan-out folder: has() does not find it there
    (tmp_path / "latents" / "ab" / f"{misplaced}.safetensors").write_bytes(b"")
    (tmp_path / "latents" / "ab" / f".{key('ab', '4')}.safetensors.x.tmp").write_bytes(b"")   # a write in progress
    (tmp_path / "latents" / "cd" / f"{key('cd', '5')}.safetensors").mkdir()                  # not a file

    candidates = stored + [misplaced, key("ab", "4"), key("cd", "5"), key("99", "9")]
    assert store.keys("latents") == {k for k in candidates if store.has("latents", k)} == set(stored)
    assert store.keys("text") == set()


def test_missing_work_is_every_key_not_stored_once(tmp_path):
    store = CacheStore(tmp_path)
    entries = [CacheEntry(f"/d/{i % 3}.png", (64, 64), f"caption {i % 2}", 1, key("aa", str(i % 3)),
                          key("bb", str(i % 2))) for i in range(6)]
    store.put("latents", key("aa", "1"), {"latent": torch.zeros(1)})
    store.put("text", key("bb", "0"), {"t5": torch.zeros(1)})

    latents, texts = missing_work(entries, store)

    assert {k: e.path for k, e in latents.items()} == {key("aa", "0"): "/d/0.png", key("aa", "2"): "/d/2.png"}
    assert texts == {key("bb", "1"): TextWork("caption 1", "", (64, 64))}


def test_the_manifest_reads_back_what_was_written(tmp_path):
    entries = [CacheEntry("/d/a.png", (64, 96), "a \"quoted\" caption, ünïcode", 3, key("aa", "0"), key("bb", "0")),
               CacheEntry("/d/b.png", (96, 64), "", 1, key("aa", "1"), key("bb", "1"), control="/c/b.png")]
    CacheManifest("flux", entries).save(tmp_path / "m.json")

    loaded = CacheManifest.load(tmp_path / "m.json")

    assert loaded == CacheManifest("flux", entries)

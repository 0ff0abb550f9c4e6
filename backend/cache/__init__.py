"""Content-addressed cache of latents and text embeddings.

Every entry's name is a hash of everything that determines its value (the image bytes, the bucket,
the preprocessing version, the encoder files, the caption), so a changed input can only miss the cache,
never read back an old tensor of the wrong shape. Writes are atomic.
"""
from .keys import latent_key, text_key, file_digest, model_fingerprint
from .store import CacheStore
from .manifest import CacheManifest, build_or_load_manifest

__all__ = ["latent_key", "text_key", "file_digest", "model_fingerprint", "CacheStore", "CacheManifest",
           "build_or_load_manifest"]

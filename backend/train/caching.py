"""The cache phase of a run: rank 0 maps the examples of the train dataset and of every eval dataset to
cache keys (one manifest per dataset file), every rank encodes its share of what is missing."""
from __future__ import annotations

import logging
from pathlib import Path

from ..cache import CacheStore, file_digest, text_key
from ..cache.builder import TextWork, fill
from ..cache.keys import caption_image
from ..cache.manifest import CacheManifest, build_or_load_manifest, manifest_path
from ..config import RunConfig
from ..fsutil import space_guard
from ..run.folder import cache_folder
from . import distributed
from .events import RunReporter
from .parts import CachedData, Topology

log = logging.getLogger("pipetrain")


def _examples(ds, seed: int, reporter, label: str, adapter=None):
    from ..data import build_examples, check_control_paths, expand_captions, scan_dataset
    from ..data.buckets import check_frame_buckets

    fps = getattr(adapter, "framerate", None)   # video models read videos, resampled to their frame rate
    check_control_paths(ds, adapter, label)
    audio = getattr(adapter, "audio", False)    # audio models read audio files with tags and lyrics
    if audio:
        from ..data.audio import scan_audio
        scan = scan_audio(ds)
    else:
        scan = scan_dataset(ds, videos=fps is not None)
    if fps is not None:
        check_frame_buckets(scan.items, adapter.frame_multiple, ds.size_buckets)
    if scan.missing_captions:
        reporter.event("warning", message=f"{label}: {len(scan.missing_captions)} images have no caption file and "
                       "train with an empty caption", files=[str(p) for p in scan.missing_captions])
    if scan.skipped_empty:
        reporter.event("warning", message=f"{label}: {len(scan.skipped_empty)} images without a caption are left "
                       "out (skip_empty_caption = true)", files=[str(p) for p in scan.skipped_empty])
    if scan.unreadable:
        reporter.event("warning", message=f"{label}: {len(scan.unreadable)} files could not be read and are skipped",
                       files=[f"{p}: {why}" for p, why in scan.unreadable])
    if audio:
        from ..data.audio import audio_examples
        return expand_captions(audio_examples(scan.items), seed)
    multiple = getattr(adapter, "spatial_multiple", 16)
    return expand_captions(build_examples(ds, scan.items, model_fps=fps, side_multiple=multiple), seed)


def _datasets(cfg) -> dict[str, tuple]:
    """{None: the train dataset, name: each eval dataset} -> (DatasetConfig, its file)."""
    out = {None: (cfg.dataset_config, cfg.resolve(cfg.dataset))}
    for e, ds in zip(cfg.eval_datasets, cfg.eval_dataset_configs().values()):
        out[e.name] = (ds, cfg.resolve(e.config))
    return out


def prepare_cache(cfg: RunConfig, adapter, topology: Topology, reporter: RunReporter, *, regenerate: bool = False,
                  trust: bool = False) -> CachedData:
    """Map the datasets to cache keys (rank 0) and encode what is missing (every rank its share); ``regenerate``
    clears the cache first, ``trust`` reuses manifests without checking the files behind them."""
    rank = topology.rank
    store = CacheStore(cache_folder(cfg.resolve(cfg.output_dir)))
    datasets = _datasets(cfg)
    paths = {name: manifest_path(store.root, file, adapter.arch) for name, (_, file) in datasets.items()}
    error = None
    if rank == 0:
        try:
            if regenerate:
                store.clear()
            files = adapter.model_files()
            for name, (ds, _) in datasets.items():
                label = "dataset" if name is None else f"eval dataset {name!r}"
                with space_guard(store.root):
                    build_or_load_manifest(paths[name], lambda ds=ds, label=label: _examples(ds, cfg.seed, reporter,
                                                                                            label, adapter),
                                           adapter, files, trust, store.fingerprint)
        except Exception as e:  # noqa: BLE001  (re-raised on every rank below)
            error = e
    if distributed.broadcast_object(error is not None):
        if rank == 0:
            raise error
        raise SystemExit(1)
    manifests = {name: CacheManifest.load(path).entries for name, path in paths.items()}
    entries = manifests.pop(None)
    every = entries + [e for es in manifests.values() for e in es]
    uncond_text, extra = empty_captions(adapter, entries, store) if cfg.uncond_fraction > 0 else (None, {})
    preservation_text = None
    if cfg.diff_output_preservation:
        preservation_text, work = preservation_captions(cfg, adapter, entries, store, reporter if rank == 0 else None)
        extra = extra | work

    def progress(kind, done, total):
        if rank == 0:
            reporter.update(state="caching", cache={"kind": kind, "done": done, "total": total})
            reporter.event("cache", kind=kind, done=done, total=total)

    n_lat, n_txt = fill(adapter, store, every, rank, topology.world, cfg.caching_batch_size, progress, extra)
    counts = distributed.all_gather_object((n_lat, n_txt))
    distributed.barrier()
    if rank == 0:
        total_lat, total_txt = sum(c[0] for c in counts), sum(c[1] for c in counts)
        reporter.event("cached", latents_encoded=total_lat, texts_encoded=total_txt, entries=len(entries),
                       eval_entries={name: len(es) for name, es in manifests.items()})
        log.info("cache ready: %d entries (%d latents and %d captions encoded now)", len(entries), total_lat, total_txt)
    return CachedData(store, entries, manifests, uncond_text, preservation_text)


def empty_captions(adapter, entries, store: CacheStore) -> tuple[dict[str, str], dict[str, TextWork]]:
    """Caption dropout: each training caption's key -> the key of the empty caption that replaces it (one for
    every example, or one per control image and bucket where the text encoder reads that image too), and the
    encoding work for those keys."""
    return replaced_captions(adapter, entries, store, lambda caption: "")


def preservation_captions(cfg: RunConfig, adapter, entries, store: CacheStore,
                          reporter: RunReporter | None) -> tuple[dict[str, str], dict[str, TextWork]]:
    """diff_output_preservation: each training caption's key -> the key of the caption with the trigger word
    swapped for the class (its own cache key: another trigger word or class is another caption), and the encoding
    work for those keys; ``reporter`` (rank 0's) warns of captions without the trigger word, whose preservation
    caption is the training caption itself."""
    from .preservation import has_trigger, preservation_caption

    trigger, cls = cfg.trigger_word.strip(), cfg.preservation_class.strip()
    without = sorted({e.path for e in entries if not has_trigger(e.caption, trigger)})
    if without and reporter is not None:
        message = (f"diff_output_preservation: {len(without)} captions do not contain the trigger word {trigger!r}; "
                   "their preservation caption is the caption itself, which holds those examples to the base model")
        reporter.event("warning", message=message, files=without[:20])
        log.warning(message)
    return replaced_captions(adapter, entries, store, lambda caption: preservation_caption(caption, trigger, cls))


def replaced_captions(adapter, entries, store: CacheStore, replace) -> tuple[dict[str, str], dict[str, TextWork]]:
    """Each training caption's key -> the key of ``replace(caption)`` (read with the same control image where the
    text encoder reads one), and the encoding work for those keys."""
    te_fps = [store.fingerprint(p) for p in adapter.model_files()["text_encoders"]]
    digests, swap, work = {}, {}, {}
    for e in entries:
        for c in (e.control, *e.more_controls) if adapter.caption_sees_control and e.control else ():
            if c not in digests:
                digests[c] = file_digest(Path(c))
        more = [digests[c] for c in e.more_controls] if adapter.caption_sees_control else []
        caption = replace(e.caption)
        key = text_key(caption, te_fps, adapter.arch, caption_image(adapter, digests.get(e.control), e.bucket, more),
                       options=adapter.text_options())
        swap[e.text] = key
        work[key] = TextWork(caption, e.control, e.bucket, more_controls=e.more_controls)
    return swap, work

"""The cache phase of a run: rank 0 maps samples to cache keys, every rank encodes its share."""
from __future__ import annotations

import logging

from ..cache import CacheStore
from ..cache.builder import fill
from ..cache.manifest import CacheManifest, build_or_load_manifest, manifest_path
from . import distributed

log = logging.getLogger("pipetrain")


def _samples(cfg, reporter):
    from ..data import build_samples, scan_dataset

    ds = cfg.dataset_config
    scan = scan_dataset(ds)
    if scan.missing_captions:
        reporter.event("warning", message=f"{len(scan.missing_captions)} images have no caption file and train "
                       "with an empty caption", files=[str(p) for p in scan.missing_captions])
    if scan.unreadable:
        reporter.event("warning", message=f"{len(scan.unreadable)} files could not be read and are skipped",
                       files=[f"{p}: {why}" for p, why in scan.unreadable])
    return build_samples(ds, scan.items)


def prepare_cache(trainer):
    cfg, adapter, rank = trainer.cfg, trainer.adapter, trainer.rank
    store = CacheStore(cfg.resolve(cfg.output_dir) / "cache")
    path = manifest_path(store.root, cfg.resolve(cfg.dataset), adapter.arch)
    error = None
    if rank == 0:
        try:
            if trainer.opts.regenerate_cache:
                store.clear()
            files = adapter.model_files()
            build_or_load_manifest(path, lambda: _samples(cfg, trainer.reporter), adapter, files,
                                   trainer.opts.trust_cache)
        except Exception as e:  # noqa: BLE001  (re-raised on every rank below)
            error = e
    if distributed.broadcast_object(error is not None):
        if rank == 0:
            raise error
        raise SystemExit(1)
    entries = CacheManifest.load(path).entries

    def progress(kind, done, total):
        if rank == 0:
            trainer.reporter.update(state="caching", cache={"kind": kind, "done": done, "total": total})
            trainer.reporter.event("cache", kind=kind, done=done, total=total)

    n_lat, n_txt = fill(adapter, store, entries, rank, trainer.world, cfg.caching_batch_size, progress)
    counts = distributed.all_gather_object((n_lat, n_txt))
    distributed.barrier()
    if rank == 0:
        total_lat, total_txt = sum(c[0] for c in counts), sum(c[1] for c in counts)
        trainer.reporter.event("cached", latents_encoded=total_lat, texts_encoded=total_txt, entries=len(entries))
        log.info("cache ready: %d entries (%d latents and %d captions encoded now)", len(entries), total_lat, total_txt)
    return store, entries

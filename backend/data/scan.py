"""Finding the dataset's images and captions on disk, and reporting what cannot be used."""
from __future__ import annotations

import dataclasses
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from ..config import DatasetConfig, DirectoryConfig
from ..errors import DatasetError
from ..fsutil import UnreadableFile, read_regular
from .headers import EXIF_ORIENTATION_TAG, TRANSPOSING_ORIENTATIONS, size_from_header
from .dp_sources import captions_for, extract_archives, read_captions_json
from .items import MediaItem

log = logging.getLogger(__name__)

PROBE_THREADS = 8
PROBE_CHUNK = 64
MAX_CAPTION = 1024 * 1024   # a caption is a line or a paragraph
# Only files with these extensions are dataset files: anything else in the folder (notes.md, a metadata .json,
# a caption of another extension) is never opened as an image. Videos count for image models too, so that a
# clip in an image model's folder is reported as unusable rather than silently ignored.
IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".jpe", ".jfif", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".avif",
                    ".heic", ".heif", ".jxl", ".ppm", ".pgm", ".pbm", ".pnm", ".tga", ".ico", ".dds"}


@dataclass
class ScanResult:
    items: list[MediaItem]
    missing_captions: list[Path] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)  # (file, reason)
    skipped_empty: list[Path] = field(default_factory=list)  # no or empty caption, skip_empty_caption = true


@dataclass
class _DirectoryScan:
    path: Path
    controls: tuple[Path, ...] = ()
    items: list[MediaItem] = field(default_factory=list)
    missing_captions: list[Path] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)
    skipped_empty: list[Path] = field(default_factory=list)


def _caption_extension(cfg: DatasetConfig, directory: DirectoryConfig) -> str:
    extension = directory.caption_extension or cfg.caption_extension or ".txt"
    return extension if extension.startswith(".") else "." + extension


def _probe_size(path: Path) -> tuple[int, int] | str:
    """(width, height) as displayed, or the reason Pillow cannot decode the file."""
    try:
        with Image.open(path) as image:
            checked = size_from_header(image)
        if checked is not None:
            return checked
        with Image.open(path) as image:
            image.load()  # decodes fully, so truncated files fail here rather than during training
            width, height = image.size
            if image.getexif().get(EXIF_ORIENTATION_TAG) in TRANSPOSING_ORIENTATIONS:
                width, height = height, width
            return width, height
    except Exception as e:  # Pillow raises many types for bad files
        return f"{type(e).__name__}: {e}"


def _read_caption(caption_path: Path) -> str | None:
    """The stripped caption, or None when the file does not exist; OSError naming the problem for anything but a
    regular file of at most MAX_CAPTION bytes (a FIFO would block the scan, /dev/zero fill memory)."""
    try:
        data = read_regular(caption_path, MAX_CAPTION)
    except UnreadableFile as e:
        if e.missing:
            return None
        raise OSError(0, str(e)) from None
    return data.decode("utf-8-sig").strip()


def is_media_file(path: Path) -> bool:
    return path.suffix.lower() in _media_extensions()


def _media_extensions() -> set[str]:
    from .video import CONTAINER_EXTENSIONS

    return IMAGE_EXTENSIONS | CONTAINER_EXTENSIONS


def _candidate_files(directory: Path, caption_extension: str) -> list[Path]:
    extensions = _media_extensions()
    with os.scandir(directory) as entries:   # a directory entry knows its type: no stat per file
        names = [e.name for e in entries
                 if not e.name.startswith(".") and not e.name.endswith(caption_extension)
                 and os.path.splitext(e.name)[1].lower() in extensions and e.is_file()]
    return [directory / name for name in sorted(names)]


def _probe_with_caption(probe, caption_extension: str | None, file: Path):
    """(``probe``'s answer, the caption: its text, None when missing, or the error reading it); a file that cannot
    be probed, or any file where ``caption_extension`` is None (a folder of captions.json), has its caption left
    unread."""
    size = probe(file)
    if isinstance(size, str) or caption_extension is None:
        return size, None
    try:
        return size, _read_caption(file.parent / (file.stem + caption_extension))
    except (OSError, UnicodeDecodeError) as e:
        return size, e


def _probe_many(probe, caption_extension: str, files: list[Path]) -> list:
    return [_probe_with_caption(probe, caption_extension, file) for file in files]


def _probed(pool: ThreadPoolExecutor, probe, caption_extension: str, files: list[Path]):
    """``_probe_with_caption`` of every file, in order; the pool's threads take the files PROBE_CHUNK at a time (a
    task per file costs more in hand-overs than reading a picture's header), and read the captions too (read here,
    each small read would wait for the threads to hand back Python's interpreter lock)."""
    chunks = [files[i:i + PROBE_CHUNK] for i in range(0, len(files), PROBE_CHUNK)]
    for results in pool.map(_probe_many, [probe] * len(chunks), [caption_extension] * len(chunks), chunks):
        yield from results


def _probe_media(path: Path):
    """Video models: a video's ``VideoInfo``; anything else as ``_probe_size`` sees it."""
    from .video import may_be_video, probe_video

    if may_be_video(path):
        try:
            info = probe_video(path)
        except DatasetError as e:
            return str(e).split(": ", 1)[-1]
        if info is not None:
            return info
    return _probe_size(path)


def _scan_directory(cfg: DatasetConfig, directory: DirectoryConfig, pool: ThreadPoolExecutor,
                    videos: bool = False) -> _DirectoryScan:
    path = Path(os.path.abspath(cfg.directory_path(directory)))
    if not path.is_dir():
        raise DatasetError(f"dataset directory not found: {path} (key 'directory.path' = {directory.path!r}); "
                           "fix the path or create the directory")
    caption_extension = _caption_extension(cfg, directory)
    resolutions = tuple(directory.resolutions or cfg.resolutions)
    num_repeats = directory.num_repeats if directory.num_repeats is not None else cfg.num_repeats
    captions = cfg.caption_options(directory)
    scan = _DirectoryScan(path, controls=_control_dirs(cfg, directory))
    captions_json = read_captions_json(path)   # diffusion-pipe's: where present, the folder's only captions
    archived = extract_archives(path, is_media_file)
    scan.unreadable += archived.unreadable
    files = _candidate_files(path, caption_extension) + archived.files
    frame_buckets = tuple(directory.frame_buckets or cfg.frame_buckets)
    buckets = cfg.bucket_options(directory)
    probed = _probed(pool, _probe_media if videos else _probe_size,
                     None if captions_json is not None else caption_extension, files)
    for file, (size, caption) in zip(files, probed):
        if isinstance(size, str):
            scan.unreadable.append((file, size))
            continue
        more = ()
        if captions_json is not None:
            given = captions_for(captions_json, archived.names.get(file, file.name), file, path)
            caption, more = (given[0], tuple(given[1:])) if given else (None, ())
        video = {} if isinstance(size, tuple) else {"frames": size.frames, "fps": size.fps}
        size = size if isinstance(size, tuple) else (size.width, size.height)
        if isinstance(caption, (OSError, UnicodeDecodeError)):
            # the reason, never the bytes (a decode error's text quotes the byte it stopped at)
            why = caption.strerror if isinstance(caption, OSError) else f"not UTF-8 at byte {caption.start}"
            scan.unreadable.append((file.parent / (file.stem + caption_extension),
                                    f"caption file is not readable UTF-8 text ({why})"))
            continue
        if not caption and captions.skip_empty:
            scan.skipped_empty.append(file)
            continue
        if caption is None:
            scan.missing_captions.append(file)
        scan.items.append(MediaItem(path=file, caption=caption or "", width=size[0], height=size[1],
                                    num_repeats=num_repeats, resolutions=resolutions, captions=captions,
                                    frame_buckets=frame_buckets, buckets=buckets, is_reg=directory.is_reg,
                                    more_captions=more, **video))
    if scan.controls:
        _pair_controls(scan, caption_extension)
    _pair_masks(scan, cfg, directory, caption_extension)
    _pair_vace(scan, cfg, directory, caption_extension)
    return scan


def _pair_vace(scan: _DirectoryScan, cfg: DatasetConfig, directory: DirectoryConfig, caption_extension: str) -> None:
    """wan_vace: each item's control mask (``control_mask_path``, a folder paired by stem) and reference image
    (``reference_path``: a folder paired by stem, or one image file for every item of the directory)."""
    found = {}
    for key, path in (("control_mask_path", cfg.control_mask_path(directory)),
                      ("reference_path", cfg.reference_path(directory))):
        if path is None:
            continue
        path = Path(os.path.abspath(path))
        if path.is_file() and key == "reference_path":
            found[key] = {item.path.stem: path for item in scan.items}
            continue
        if not path.is_dir():
            raise DatasetError(f"{key} not found: {path} (key 'directory.{key}' = {getattr(directory, key)!r} for "
                               f"directory {directory.path!r}); give a folder" +
                               (" or one image file" if key == "reference_path" else "") + " that exists")
        files: dict[str, list[Path]] = {}
        for p in _candidate_files(path, caption_extension):
            files.setdefault(p.stem, []).append(p)
        problems = [f"{item.path}: no file named {item.path.stem}.* in {path}" for item in scan.items
                    if item.path.stem not in files]
        problems += [f"{path}: several files for {stem}: {', '.join(p.name for p in ps)}"
                     for stem, ps in sorted(files.items()) if len(ps) > 1]
        if problems:
            head = f"{len(problems)} problem(s) pairing {scan.path} with its {key}"
            hint = "Each training file needs exactly one file of the same name (any extension) there."
            raise DatasetError(f"{head}:{_listing(problems)}\n{hint}", summary=f"{head}. {hint}")
        found[key] = {stem: ps[0] for stem, ps in files.items()}
    if found:
        scan.items = [dataclasses.replace(item, control_mask=found.get("control_mask_path", {}).get(item.path.stem),
                                          reference=found.get("reference_path", {}).get(item.path.stem))
                      for item in scan.items]


def _pair_masks(scan: _DirectoryScan, cfg: DatasetConfig, directory: DirectoryConfig, caption_extension: str) -> None:
    """Give every item its mask: the file of the same stem in ``mask_path``, else ``default_mask_file``, else none
    (the whole image trains)."""
    folder, default = cfg.mask_path(directory), cfg.default_mask_file(directory)
    if folder is not None and not folder.is_dir():
        raise DatasetError(f"mask directory not found: {folder} (key 'directory.mask_path' = {directory.mask_path!r} "
                           f"for directory {directory.path!r}); fix the path or create it")
    if default is not None and not default.is_file():
        raise DatasetError(f"default mask file not found: {default} (key 'directory.default_mask_file' = "
                           f"{directory.default_mask_file!r}); fix the path")
    if folder is None and default is None:
        return
    masks: dict[str, list[Path]] = {}
    for p in _candidate_files(Path(os.path.abspath(folder)), caption_extension) if folder is not None else []:
        masks.setdefault(p.stem, []).append(p)
    doubles = [f"{stem}: {', '.join(p.name for p in files)}" for stem, files in sorted(masks.items()) if len(files) > 1]
    if doubles:
        raise DatasetError(f"{folder}: several masks for one image ({'; '.join(doubles[:5])}); keep one per stem",
                           summary=f"{folder}: several masks for {len(doubles)} image(s); keep one per stem")
    fallback = Path(os.path.abspath(default)) if default is not None else None
    scan.items = [dataclasses.replace(item, mask=masks[item.path.stem][0] if item.path.stem in masks else fallback)
                  for item in scan.items]


def _control_dirs(cfg: DatasetConfig, directory: DirectoryConfig) -> tuple[Path, ...]:
    out = []
    for control in cfg.control_paths(directory):
        if not control.is_dir():
            raise DatasetError(f"control image directory not found: {control} (key 'directory.control_path' = "
                               f"{directory.control_path!r} for directory {directory.path!r}); fix the path or create "
                               "it")
        out.append(Path(os.path.abspath(control)))
    return tuple(out)


def _pair_controls(scan: _DirectoryScan, caption_extension: str) -> None:
    """Give every item its control image from each control directory (same file stem); any file on either side
    without a partner fails the scan with the full list, before anything is encoded."""
    stems = {item.path.stem for item in scan.items}
    paired, problems = [], []
    for folder in scan.controls:
        controls: dict[str, list[Path]] = {}
        for p in _candidate_files(folder, caption_extension):
            controls.setdefault(p.stem, []).append(p)
        problems += [f"{item.path}: no control image named {item.path.stem}.* in {folder}"
                     for item in scan.items if item.path.stem not in controls]
        problems += [f"{files[0]}: no training file named {stem}.* in {scan.path}"
                     for stem, files in sorted(controls.items()) if stem not in stems]
        problems += [f"{folder}: several control images for {stem}: {', '.join(p.name for p in files)}"
                     for stem, files in sorted(controls.items()) if len(files) > 1]
        paired.append(controls)
    if problems:
        head = f"{len(problems)} unpaired file(s) between {scan.path} and its control_path"
        hint = ("Each training file needs exactly one control image with the same name (any image extension) in "
                "each control folder and vice versa; add, rename or remove these files.")
        raise DatasetError(f"{head}:{_listing(problems)}\n{hint}", summary=f"{head}. {hint}")
    scan.items = [dataclasses.replace(item, control=paired[0][item.path.stem][0],
                                      more_controls=tuple(c[item.path.stem][0] for c in paired[1:]))
                  for item in scan.items]


def _listing(lines) -> str:
    return "".join(f"\n  {line}" for line in lines)


def _report_unreadable(cfg: DatasetConfig, unreadable: list[tuple[Path, str]]) -> None:
    if not unreadable:
        return
    listing = _listing(f"{file}: {reason}" for file, reason in unreadable)
    if cfg.on_unreadable == "error":
        head = f"{len(unreadable)} dataset file(s) cannot be read"
        hint = ("Remove or replace these files, or set on_unreadable = 'skip' in the dataset config to train "
                "without them.")
        raise DatasetError(f"{head}:{listing}\n{hint}", summary=f"{head}. {hint}")
    log.warning("skipping %d dataset file(s) that cannot be read (on_unreadable = 'skip'):%s",
                len(unreadable), listing)


def scan_dataset(cfg: DatasetConfig, videos: bool = False) -> ScanResult:
    """Every readable image of every [[directory]] (not recursive), with its caption, in sorted order;
    with ``videos`` (a video model) also every video (``video.py``)."""
    with ThreadPoolExecutor(PROBE_THREADS) as pool:
        scans = [_scan_directory(cfg, directory, pool, videos) for directory in cfg.directory]
    result = ScanResult(
        items=[item for scan in scans for item in scan.items],
        missing_captions=[file for scan in scans for file in scan.missing_captions],
        unreadable=[entry for scan in scans for entry in scan.unreadable],
        skipped_empty=[file for scan in scans for file in scan.skipped_empty],
    )
    _report_unreadable(cfg, result.unreadable)
    if result.missing_captions:
        log.warning("%d image(s) have no caption file and train with an empty caption:%s",
                    len(result.missing_captions), _listing(result.missing_captions))
    if result.skipped_empty:
        log.warning("leaving out %d image(s) without a caption (skip_empty_caption = true):%s",
                    len(result.skipped_empty), _listing(result.skipped_empty))
    for scan in scans:
        if not scan.items:
            skipped = f" ({len(scan.unreadable)} unreadable file(s) skipped)" if scan.unreadable else ""
            if scan.skipped_empty:
                skipped += f" ({len(scan.skipped_empty)} without a caption left out: skip_empty_caption = true)"
            raise DatasetError(f"dataset directory {scan.path} contains no readable images{skipped}; "
                               "add images or remove this [[directory]] from the dataset config")
    return result


def check_control_paths(ds, adapter, label: str) -> None:
    """Edit models need a control image for every file; other models would silently ignore one."""
    needs = getattr(adapter, "needs_control", False)
    for d in ds.directory:
        if needs and d.control_path is None:
            what = "control videos (or images, for stills)" if getattr(adapter, "video_control", False) \
                else "control images"
            raise DatasetError(f"{label}: [[directory]] {d.path!r} has no control_path; {adapter.arch} trains on "
                               f"(control, target) pairs: set control_path to the folder of {what} named like the "
                               "training files")
        for key, node_input in (("control_mask_path", "control_masks"), ("reference_path", "reference_image")):
            if getattr(d, key) is not None and not getattr(adapter, "vace_inputs", False):
                from ..models.registry import types_with   # on the error path only: imports every adapter class
                takers = " or ".join(repr(t) for t in types_with("vace_inputs"))
                raise DatasetError(f"{label}: [[directory]] {d.path!r} sets {key}, which only {takers} takes "
                                   f"(WanVaceToVideo's {node_input}); remove {key} or choose type = {takers}")
        if not needs and d.control_path is not None:
            raise DatasetError(f"{label}: [[directory]] {d.path!r} sets control_path, but {adapter.arch} is not an "
                               "edit model; remove control_path or choose an edit model type")
    _check_control_counts(ds, adapter, label)
    references = {d.reference_path is not None for d in ds.directory}
    if len(references) > 1:   # a reference adds a latent frame: micro-batches stack the same frame count
        raise DatasetError(f"{label}: some directories set reference_path and others do not; a reference image adds "
                           "a latent frame, so give every [[directory]] a reference_path or none")


def _check_control_counts(ds, adapter, label: str) -> None:
    """How many control folders a directory may list: the model's ``max_controls``, and (where several are
    allowed) the same number in every directory, since a micro-batch stacks its samples' reference latents."""
    from ..config.dataset import control_folders

    limit = getattr(adapter, "max_controls", 1)
    counts = {len(control_folders(d)) for d in ds.directory if d.control_path is not None}
    for d in ds.directory:
        n = len(control_folders(d))
        if n > limit:
            single = "a single folder" if limit == 1 else f"at most {limit} folders"
            raise DatasetError(f"{label}: [[directory]] {d.path!r} lists {n} control folders in control_path; "
                               f"{adapter.arch} takes {single}" + (
                                   " (for several control images a sample, use qwen_image_edit_plus or flux2_edit)"
                                   if limit == 1 else ""))
    if len(counts) > 1:
        raise DatasetError(f"{label}: the directories list different numbers of control folders in control_path "
                           f"({sorted(counts)}); give every [[directory]] the same number")

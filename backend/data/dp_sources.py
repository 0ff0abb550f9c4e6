# SPDX-License-Identifier: GPL-3.0-or-later
"""What diffusion-pipe reads from a dataset folder besides files and their ``.txt`` captions, with its meaning.

- ``captions.json`` (``{file name: [caption, ...]}``): where a folder holds one, it alone gives the captions of
  every file of the folder (``.txt`` files are not read there); each caption of a file is its own example, all on
  the file's latent. A plain file's entry is its name, an archive member's its name inside the archive. A file
  with no entry, or an empty list, has no caption (``skip_empty_caption`` decides).
- ``.tar`` archives: each image or video member is a dataset file of the folder. The archive is extracted once,
  into ``.pipetrain-tar/<archive name>/`` in the folder (again when the archive changes), since every later step
  reads files by path. The extraction trusts nothing in the archive: only regular files of a media extension are
  written, under names made of their own path parts (no absolute name, no ``..``), into a folder made here; links,
  devices and sparse members are listed as unreadable and never made; the bytes written are bounded by the
  archive's own size (a plain tar holds no more) and the members by ``MAX_MEMBERS``.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import DatasetError
from ..fsutil import UnreadableFile, read_regular

CAPTIONS_JSON = "captions.json"
MAX_CAPTIONS_JSON = 256 << 20
EXTRACTED = ".pipetrain-tar"   # hidden: the folder scan never reads it as a dataset file
MAX_MEMBERS = 1_000_000
_SOURCE = ".source.json"       # the archive's size and time the extraction was made from


def read_captions_json(folder: Path) -> dict | None:
    """The folder's ``captions.json`` as a dict, or None when it has none. Its entries are checked where a file
    of the folder uses them (``captions_for``)."""
    path = folder / CAPTIONS_JSON
    try:
        data = read_regular(path, MAX_CAPTIONS_JSON)
    except UnreadableFile as e:
        if e.missing:
            return None
        raise DatasetError(f"{path}: {e}; diffusion-pipe's captions.json must be a regular file") from None
    try:
        captions = json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 at byte {e.start}; save it as UTF-8 JSON") from None
    except json.JSONDecodeError as e:   # its message gives a position, never the text
        raise DatasetError(f"{path}: not JSON ({e.msg} at line {e.lineno}, column {e.colno}); give an object of "
                           "file name -> list of captions") from None
    if not isinstance(captions, dict):
        raise DatasetError(f"{path}: a JSON {type(captions).__name__}, where diffusion-pipe reads an object of file "
                           "name -> list of captions")
    return captions


def captions_for(captions: dict, key: str, file: Path, folder: Path) -> list[str]:
    """The captions ``captions.json`` gives ``file`` (entry ``key``): [] when it has none."""
    entry = captions.get(key)
    if entry is None:
        return []
    if not isinstance(entry, list) or not all(isinstance(c, str) for c in entry):
        raise DatasetError(f"{folder / CAPTIONS_JSON}: the entry for {file} is not a list of strings; give each "
                           "file a list of captions, e.g. [\"a photo of ...\", \"...\"]")
    return entry


@dataclass
class Extracted:
    files: list[Path] = field(default_factory=list)              # the media members, extracted
    names: dict[Path, str] = field(default_factory=dict)         # extracted file -> its name inside the archive
    unreadable: list[tuple[Path, str]] = field(default_factory=list)


def archives_of(folder: Path) -> list[Path]:
    with os.scandir(folder) as entries:
        return sorted(folder / e.name for e in entries
                      if not e.name.startswith(".") and e.name.lower().endswith(".tar") and e.is_file())


def extract_archives(folder: Path, is_media) -> Extracted:
    """Every ``.tar`` of ``folder``, extracted (or its earlier extraction, when the archive is unchanged)."""
    out = Extracted()
    archives = archives_of(folder)
    if not archives:
        return out
    root = folder / EXTRACTED
    if root.is_symlink() or (root.exists() and not root.is_dir()):
        raise DatasetError(f"{root}: not a folder PipeTrain made (a link or a file); remove it, and the .tar "
                           "archives of the folder are extracted there again")
    try:
        root.mkdir(exist_ok=True)
    except OSError as e:
        raise DatasetError(f"{root}: cannot be made ({e.strerror}); the .tar archives of {folder} are extracted "
                           "there: make the folder writable, or extract them yourself into another [[directory]]") \
            from None
    for archive in archives:
        _extract(archive, root / archive.name, is_media, out)
    return out


def _extract(archive: Path, target: Path, is_media, out: Extracted) -> None:
    try:
        fd = os.open(archive, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise DatasetError(f"{archive}: cannot be read ({e.strerror}); make it readable, or move it out of the "
                           "dataset folder") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise DatasetError(f"{archive}: not a regular file; a .tar in a dataset folder is read as an archive")
        source = {"size": info.st_size, "mtime_ns": info.st_mtime_ns}
        done = _earlier(target, source)
        if done is None:
            done = _extract_new(f, archive, target, source, is_media)
    members, problems = done["members"], done["problems"]
    for name in members:
        path = target.joinpath(*PurePosixPath(name).parts)
        out.files.append(path)
        out.names[path] = name
    out.unreadable += [(archive, f"member {index}: {why}") for index, why in problems]


def _earlier(target: Path, source: dict) -> dict | None:
    """The record of an extraction made from this same archive, or None."""
    if target.is_symlink() or not target.is_dir():
        return None
    try:
        record = json.loads(read_regular(target / _SOURCE, 64 << 20))
    except (UnreadableFile, ValueError):
        return None
    if not isinstance(record, dict) or record.get("source") != source:
        return None
    members, problems = record.get("members"), record.get("problems")
    if not isinstance(members, list) or not all(isinstance(m, str) and _member_name(m) == m for m in members):
        return None   # not a record this module wrote: extract again
    if not isinstance(problems, list) or not all(isinstance(p, list) and len(p) == 2 for p in problems):
        return None
    return record


def _member_name(name: str) -> str | None:
    """The member's path inside the extraction folder (``a/b.png``), or None where it would leave it."""
    parts = [p for p in PurePosixPath(name).parts if p not in ("", ".")]
    if not parts or name.startswith("/") or any(p == ".." or "\0" in p for p in parts):
        return None
    return "/".join(parts)


def _hidden(name: str) -> bool:
    return any(p.startswith(".") and p not in (".", "..") for p in PurePosixPath(name).parts)


def _extract_new(f, archive: Path, target: Path, source: dict, is_media) -> dict:
    temp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    members, problems, budget = [], [], source["size"]
    seen = set()
    try:
        try:
            tar = tarfile.open(fileobj=f, mode="r:")
        except tarfile.TarError:
            raise DatasetError(f"{archive}: not a plain tar archive (diffusion-pipe reads uncompressed .tar files); "
                               "extract it into the folder, or re-create it with tar -cf") from None
        with tar:
            for index, member in enumerate(tar):
                if index >= MAX_MEMBERS:
                    raise DatasetError(f"{archive}: more than {MAX_MEMBERS} members; split the archive")
                if member.isdir() or not is_media(PurePosixPath(member.name)) or _hidden(member.name):
                    continue   # only media files are dataset files, hidden ones not (as in a folder)
                name = _member_name(member.name)
                if name is None:
                    problems.append((index, "a name outside the archive's folder (absolute, or with '..'): "
                                            "not extracted"))
                elif not member.isfile() or member.issparse():
                    kind = "a link" if member.issym() or member.islnk() else "a sparse file" if member.isfile() \
                        else "a device or FIFO"
                    problems.append((index, f"{kind}, not extracted (only regular files are)"))
                elif name not in seen:
                    if member.size > budget:
                        raise DatasetError(f"{archive}: its members are larger than the archive; it is damaged")
                    budget -= member.size
                    _write_member(tar, member, temp, name)
                    members.append(name)
                    seen.add(name)
        record = {"source": source, "members": members, "problems": problems}
        (temp / _SOURCE).write_text(json.dumps(record))
        temp.chmod(0o755)   # as a folder made by hand (mkdtemp's is its owner's only)
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.exists():
            shutil.rmtree(target)
        os.rename(temp, target)
        return record
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def _write_member(tar: tarfile.TarFile, member: tarfile.TarInfo, temp: Path, name: str) -> None:
    parts = PurePosixPath(name).parts
    folder = temp
    for part in parts[:-1]:   # folders made here, in a folder made here: no link on the way
        folder = folder / part
        if not folder.is_dir():
            folder.mkdir()
    fd = os.open(folder / parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as out, tar.extractfile(member) as data:
        left = member.size
        while left:
            chunk = data.read(min(left, 1 << 20))
            if not chunk:
                break
            out.write(chunk)
            left -= len(chunk)

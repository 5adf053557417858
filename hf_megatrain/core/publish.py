"""Atomic publication of output folders, and the manifest that lets a reader check them.

Every folder hf_megatrain writes (a saved model, a Trainer checkpoint) is written complete under
a hidden name beside its target, every file and folder fsynced, its manifest written last, and
only then swapped in whole. A reader sees the old set or the new set, never a mix:

1. the new folder is built at ``.NAME.megatrain-new-PID-K`` (same parent, so renames stay on one
   file system) and ``megatrain_manifest.json`` lists every file with its size and sha256;
2. where the target exists, the two folders are exchanged in one ``renameat2(RENAME_EXCHANGE)``
   (Linux); elsewhere the old folder is renamed aside to ``.NAME.megatrain-old`` and the new one
   renamed in; the parent folder is fsynced, then the old set is deleted.

A swap killed half way is finished deterministically by :func:`recover` (called before every
publication and every verified load): when the target is missing but the aside copy exists, the
aside copy (the old set) is restored; otherwise leftovers are deleted. Nothing is rewritten in a
published folder.

Where the folder cannot be renamed (a file system without rename of folders), the files are
moved in one by one instead, with a warning: the old manifest goes first and the new one last,
so a set mixed by a kill has no manifest and ``verify`` reports it unverified. A target that is
a mount point (a container volume) is built inside itself instead (``.megatrain-inplace-PID-K``,
on its own file system) and its files moved in the same way; entries kept beside the new set
(checkpoints) are left where they are. So is a target whose parent folder is not writable (a
folder beside it cannot be made) or that holds the process's working folder (a swap would leave
the process in the old, deleted folder). A target that is a symbolic link is published where it
points (the link stays).

No transformers import here: the CLI's ``verify`` uses it without loading a model.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

from .process_status import status_field

logger = logging.getLogger(__name__)

MANIFEST_NAME = "megatrain_manifest.json"
MANIFEST_FORMAT = "hf_megatrain.manifest"
MANIFEST_VERSION = 1
_NEW = ".megatrain-new"
_OLD = ".megatrain-old"
_INPLACE = ".megatrain-inplace"
#: The most bytes a name beside a published folder adds to the folder's own name (its staging
#: folder ``.NAME.megatrain-new-PID-K``; the CLI's lock ``.NAME.hf-megatrain.lock``).
STAGED_NAME_EXTRA = 1 + len(_NEW) + 24
_LEFTOVER_RE = re.compile(r"^\.(?P<name>.+)\.megatrain-(new-\d+-\d+|old)$")
_CHUNK = 8 << 20
_counter = itertools.count()


class IntegrityError(ValueError):
    """A published folder does not match its manifest (a truncated, altered or corrupt file).

    ``rel``: the file's path inside the folder, where one file is at fault (else None)."""

    def __init__(self, message: str, rel: str | None = None) -> None:
        super().__init__(message)
        self.rel = rel


class MissingFileError(IntegrityError, FileNotFoundError):
    """A file listed in the manifest is missing."""


class DiskFullError(OSError):
    """A save its file system had no room for: nothing was published (the target is as it
    was, the partial copy removed)."""


#: Free bytes under which a failed write counts as a full disk where its error does not say so
#: (torch.save's writer reports only "file write failed").
NEARLY_FULL_BYTES = 64 << 20


def free_disk_bytes(path: str) -> int | None:
    """Free bytes (for this user) on the file system that holds ``path`` or would hold it (its
    nearest existing ancestor); None where that cannot be read."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


#: safetensors' writer reports an OS error in its own exception class, as Rust words it.
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def os_error_code(exc: BaseException) -> int | None:
    """The OS error number ``exc`` carries: an ``OSError``'s errno, or the one safetensors'
    writer puts in its text; None for other errors."""
    code = getattr(exc, "errno", None) if isinstance(exc, OSError) else None
    if code is None:
        match = _RUST_OS_ERROR.search(str(exc))
        code = int(match.group(1)) if match else None
    return code


def out_of_disk_space(exc: BaseException, path: str) -> int | None:
    """The errno (ENOSPC, EDQUOT) where the write that raised ``exc`` under ``path`` ran out of
    disk space or quota, else None: the error (or one it came from) says so (as an OSError, or
    in safetensors' words), or the file system has less than ``NEARLY_FULL_BYTES`` free now
    (ENOSPC; call before the partial files are removed)."""
    full = (errno.ENOSPC, errno.EDQUOT)
    seen: BaseException | None = exc
    while seen is not None:
        if (code := os_error_code(seen)) in full:
            return code
        text = str(seen)
        for code in full:
            if os.strerror(code) in text:
                return code
        seen = seen.__cause__ or seen.__context__
    free = free_disk_bytes(path)
    return errno.ENOSPC if free is not None and free < NEARLY_FULL_BYTES else None


def disk_full_message(target: str, code: int = errno.ENOSPC, then: str = "save again") -> str:
    """What a save that ran out of disk space (``code`` ENOSPC) or quota (EDQUOT) did and left,
    for ``target``; ``then``: what to do once there is room."""
    out_of = (
        "the disk quota was exceeded"
        if code == errno.EDQUOT
        else "its file system ran out of space"
    )
    free = free_disk_bytes(target)
    room = ""
    if free is not None:
        size = f"{free / 2**30:.2f} GiB" if free >= 2**30 else f"{free / 2**20:.1f} MiB"
        room = f" ({size} free once the partial copy went)"
    return (
        f"hf_megatrain: {target} could not be written: {out_of}{room}. "
        "Nothing was published there (an earlier copy, if any, is untouched), and the partial "
        "copy was removed. Free space (save_total_limit keeps fewer checkpoints) or write "
        f"elsewhere, and {then}."
    )


# ---- fsync ------------------------------------------------------------------------------------
def fsync_dir(path: str) -> None:
    """Make ``path``'s entries (names created, renamed or removed in it) durable."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # e.g. a platform that cannot open folders: nothing to sync
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF):  # a file system without folder fsync
            raise
    finally:
        os.close(fd)


def hash_file(path: str) -> tuple[int, str]:
    """``(size, sha256 hex)`` of ``path``, read back in chunks; the file is fsynced on the way."""
    h = hashlib.sha256()
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])  # hashlib releases the GIL: files hash in parallel threads
            size += n
        os.fsync(f.fileno())
    return size, h.hexdigest()


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _files(folder: str) -> list[str]:
    """Relative (``/``-separated) paths of the regular files under ``folder``, sorted."""
    out = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for n in names:
            p = os.path.join(root, n)
            if os.path.isfile(p) and not os.path.islink(p):
                out.append(os.path.relpath(p, folder).replace(os.sep, "/"))
    return sorted(r for r in out if r != MANIFEST_NAME)


def _sync_tree(folder: str) -> None:
    for root, _dirs, _names in sorted(os.walk(folder), key=lambda t: -len(t[0])):
        fsync_dir(root)


# ---- manifest ---------------------------------------------------------------------------------
def _umask() -> int:
    value = status_field("Umask")
    if value is not None:
        try:
            return int(value, 8)
        except ValueError:
            pass
    mask = os.umask(0o022)  # (no /proc: read it by setting it, and put it back)
    os.umask(mask)
    return mask


def _modes_by_umask(paths: list[str]) -> None:
    """Files only their owner may read (safetensors writes its files 0600) get the modes the
    process's umask gives new files, as the rest of a saved folder has: another user or a
    container under another uid must be able to load the model."""
    mode = 0o666 & ~_umask()
    for p in paths:
        if os.stat(p).st_mode & 0o077 == 0 and mode & 0o077:
            os.chmod(p, mode)


def write_manifest(folder: str, saved_from: dict | None = None) -> dict:
    """Hash and fsync every file under ``folder``, then write its manifest (fsynced, last).

    ``saved_from``: what the set was saved from (JSON values, e.g. a final model's training
    step), recorded with it in the manifest: published together, it cannot describe another set.
    """
    files = _files(folder)
    paths = [os.path.join(folder, *r.split("/")) for r in files]
    _modes_by_umask(paths)
    order = sorted(range(len(paths)), key=lambda i: -os.path.getsize(paths[i]))
    with ThreadPoolExecutor(_workers()) as pool:
        hashed = dict(zip(order, pool.map(hash_file, [paths[i] for i in order])))
    entries = {r: {"size": hashed[i][0], "sha256": hashed[i][1]} for i, r in enumerate(files)}
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "total_bytes": sum(e["size"] for e in entries.values()),
        "files": entries,
    }
    if saved_from is not None:
        manifest["saved_from"] = saved_from
    tmp = os.path.join(folder, f".{MANIFEST_NAME}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, MANIFEST_NAME))
    _sync_tree(folder)
    return manifest


def read_manifest(folder: str) -> dict | None:
    """``folder``'s manifest, or None when it has none (older saves, stock HF folders)."""
    path = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError("not an hf_megatrain manifest")
        for entry in files.values():
            int(entry["size"]), str(entry["sha256"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise IntegrityError(f"hf_megatrain: {path} is corrupt ({e})") from None
    return manifest


@dataclass
class Verified:
    """What :func:`verify_folder` checked."""

    folder: str
    manifest: bool  # False: the folder has no manifest, nothing was checked
    files: int = 0
    bytes: int = 0
    missing: list[str] = field(default_factory=list)  # allowed missing files (relative paths)
    unlisted: int = 0  # files present but not in the manifest (e.g. kept beside a saved model)
    #: Subfolders with a manifest of their own (a run's checkpoint-N beside its final model):
    #: their files are not counted in ``unlisted``, nor verified here.
    nested: list[str] = field(default_factory=list)


def verify_folder(
    folder: str,
    allow_missing: Callable[[str], bool] | None = None,
    only: Callable[[str], bool] | None = None,
) -> Verified:
    """Check every file of ``folder``'s manifest: present, of its size, of its sha256.

    A problem raises :class:`MissingFileError` / :class:`IntegrityError` naming the file (the
    first in path order); ``allow_missing(relative_path)`` lets listed files be absent (they are
    returned in ``missing``); ``only(relative_path)``: check just those. A folder without a
    manifest returns ``manifest=False``.
    """
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"hf_megatrain: {folder} is not a folder")
    manifest = read_manifest(folder)
    if manifest is None:
        return Verified(folder, manifest=False)
    where = os.path.join(folder, MANIFEST_NAME)
    entries = manifest["files"]
    if only is not None:
        entries = {rel: entry for rel, entry in entries.items() if only(rel)}
    result = Verified(folder, manifest=True)
    present = []
    for rel in sorted(entries):
        path = os.path.join(folder, *rel.split("/"))
        want = int(entries[rel]["size"])
        if not os.path.isfile(path):
            if allow_missing is not None and allow_missing(rel):
                result.missing.append(rel)
                continue
            raise MissingFileError(f"hf_megatrain: {path} is missing (listed in {where})", rel)
        have = os.path.getsize(path)
        if have != want:
            raise IntegrityError(
                f"hf_megatrain: {path} is truncated or altered: {have} bytes, {where} says {want}",
                rel,
            )
        present.append((rel, path))
    order = sorted(present, key=lambda rp: -int(entries[rp[0]]["size"]))
    with ThreadPoolExecutor(_workers()) as pool:
        digests = dict(zip([r for r, _ in order], pool.map(_sha256, [p for _, p in order])))
    for rel, path in present:
        if digests[rel] != entries[rel]["sha256"]:
            raise IntegrityError(
                f"hf_megatrain: {path} is corrupt: its sha256 differs from the one in {where}", rel
            )
    result.files = len(present)
    result.bytes = sum(int(entries[r]["size"]) for r, _ in present)
    unlisted = set(_files(folder)) - set(entries)
    result.nested = _nested_manifests(unlisted)
    result.unlisted = sum(1 for r in unlisted if not _inside(r, result.nested))
    return result


def _nested_manifests(unlisted: set[str]) -> list[str]:
    """The outermost folders among ``unlisted``'s (relative paths) holding their own manifest."""
    suffix = "/" + MANIFEST_NAME
    folders = [r.removesuffix(suffix) for r in unlisted if r.endswith(suffix)]
    outer = [f for f in folders if not _inside(f, [g for g in folders if g != f])]
    # checkpoint-500 before checkpoint-1000: numbers compared as numbers.
    return sorted(
        outer, key=lambda f: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", f)]
    )


def _inside(rel: str, folders: list[str]) -> bool:
    return any(rel.startswith(f + "/") for f in folders)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


# ---- publication ------------------------------------------------------------------------------
def _norm(target: str) -> tuple[str, str, str]:
    target = os.path.abspath(os.fspath(target))
    if os.path.islink(target):  # publish where the link points: the link itself stays
        target = os.path.realpath(target)
    return target, os.path.dirname(target), os.path.basename(target)


def _is_mount(target: str, parent: str) -> bool:
    """Whether folder ``target`` is on another file system than ``parent`` (a mount point):
    it cannot be renamed, and a folder beside it is on the wrong disk."""
    try:
        return os.path.isdir(target) and os.stat(target).st_dev != os.stat(parent).st_dev
    except OSError:
        return False


def _holds_cwd(target: str) -> bool:
    """Whether the process's working folder is ``target`` or inside it: swapping ``target``
    out would leave the process (and a calling shell) in the old, deleted folder."""
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:  # the working folder is already gone
        return False
    target = os.path.realpath(target)
    return cwd == target or cwd.startswith(target.rstrip(os.sep) + os.sep)


def _build_inside_reason(target: str, parent: str) -> str | None:
    """Why ``target``'s next version must be built inside it and its files moved in, rather
    than built beside it and swapped in (None: it can be swapped)."""
    if not os.path.isdir(target):
        return None
    if _is_mount(target, parent):
        return "mount point"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"its parent folder {parent} is not writable"
    if _holds_cwd(target):
        return "it holds the working folder"
    return None


def aside_path(target: str) -> str:
    target, parent, name = _norm(target)
    return os.path.join(parent, f".{name}{_OLD}")


def new_temp_path(target: str) -> str:
    """A fresh hidden folder name beside ``target`` for building its next version."""
    target, parent, name = _norm(target)
    return os.path.join(parent, f".{name}{_NEW}-{os.getpid()}-{next(_counter)}")


def recover(target: str) -> list[str]:
    """Finish or undo a swap of ``target`` that was killed half way; returns what was done.

    Target missing and its aside copy present: the aside copy (the complete old set) is renamed
    back. Otherwise an aside copy is deleted. Every hidden new-version folder of ``target`` is
    deleted (incomplete, or the old set after an exchange). One writer per target is assumed.
    """
    target, parent, name = _norm(target)
    if not os.path.isdir(parent):
        return []
    done = []
    aside = aside_path(target)
    if os.path.lexists(aside):
        if _empty_folder(target):  # made again since (an empty folder never beats the old set)
            os.rmdir(target)
        if not os.path.lexists(target):
            os.rename(aside, target)
            done.append(f"restored {target} from {aside} (a swap was interrupted)")
        else:
            shutil.rmtree(aside, ignore_errors=True)
            done.append(f"removed {aside}")
    prefix = f".{name}{_NEW}-"
    for n in sorted(os.listdir(parent)):
        if n.startswith(prefix) and _LEFTOVER_RE.match(n):
            shutil.rmtree(os.path.join(parent, n), ignore_errors=True)
            done.append(f"removed {os.path.join(parent, n)}")
    if os.path.isdir(target) and not os.path.islink(target):  # a mount point's own builds
        for n in sorted(os.listdir(target)):
            if n.startswith(f"{_INPLACE}-"):
                shutil.rmtree(os.path.join(target, n), ignore_errors=True)
                done.append(f"removed {os.path.join(target, n)}")
    if done:
        fsync_dir(parent)
        for line in done:
            logger.warning("hf_megatrain: %s", line)
    return done


def _empty_folder(path: str) -> bool:
    try:
        return os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)
    except OSError:
        return False


def recover_children(folder: str) -> list[str]:
    """:func:`recover` for every entry of ``folder`` with leftovers of an interrupted swap."""
    if not os.path.isdir(folder):
        return []
    names = sorted({m["name"] for n in os.listdir(folder) if (m := _LEFTOVER_RE.match(n))})
    return [line for n in names for line in recover(os.path.join(folder, n))]


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange_paths(a: str, b: str) -> bool:
    """Swap two paths in one atomic step (Linux ``renameat2``); False where unavailable."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # the same file, no copy: it stays intact whichever set survives
    except OSError:
        shutil.copy2(src, dst)


def _carry(old: str, new: str, keep: Callable[[str], bool]) -> None:
    """Entries of the old folder that ``keep`` names and the new one lacks, hard-linked into it."""
    for n in sorted(os.listdir(old)):
        if _LEFTOVER_RE.match(n) or os.path.lexists(os.path.join(new, n)) or not keep(n):
            continue
        src, dst = os.path.join(old, n), os.path.join(new, n)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        elif os.path.isdir(src):
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)
    _sync_tree(new)


def publish(temp: str, target: str, keep: Callable[[str], bool] | None = None) -> None:
    """Swap the complete folder ``temp`` in as ``target`` (see the module docstring).

    ``keep(name)``: entries of an existing ``target`` that the new set does not have and should
    still hold (hard links: a user's files beside a saved model, checkpoints in an output dir).
    """
    target, parent, _ = _norm(target)
    if not os.path.lexists(target):
        os.rename(temp, target)
        fsync_dir(parent)
        return
    if not os.path.isdir(target):
        raise NotADirectoryError(f"hf_megatrain: {target} exists and is not a folder")
    if os.path.dirname(os.path.abspath(temp)) == target or _holds_cwd(target):
        # Built inside the target (a mount point, ...), or the target holds the working
        # folder: its files move in; the folder itself and kept entries stay where they are.
        _replace_files(temp, target, keep)
        return
    if keep is not None:
        recover_children(target)
        _carry(target, temp, keep)
    if exchange_paths(temp, target):
        fsync_dir(parent)
        fsync_dir(os.path.dirname(os.path.abspath(temp)))
        shutil.rmtree(temp, ignore_errors=True)  # now the old set
        return
    aside = aside_path(target)
    shutil.rmtree(aside, ignore_errors=True)
    try:
        os.rename(target, aside)
    except OSError as e:
        logger.warning(
            "hf_megatrain: cannot rename %s (%s): replacing its files one by one instead (not "
            "atomic: a kill during the save can leave a mixed set without a manifest)",
            target,
            e.strerror,
        )
        _replace_files(temp, target, keep)
        return
    os.rename(temp, target)
    fsync_dir(parent)
    shutil.rmtree(aside, ignore_errors=True)


@contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Ctrl-C (SIGINT) held back until the block ends, then delivered: the one-by-one moves of
    ``_replace_files`` must not stop half way (a mixed set, its staging deleted). Only the
    main thread receives signals; elsewhere the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
    if received and previous is not signal.SIG_IGN:
        signal.raise_signal(signal.SIGINT)  # (to the handler it was meant for)


def _replace_files(temp: str, target: str, keep: Callable[[str], bool] | None) -> None:
    with _interrupts_deferred():
        _move_files_in(temp, target, keep)


def _move_files_in(temp: str, target: str, keep: Callable[[str], bool] | None) -> None:
    old_manifest = os.path.join(target, MANIFEST_NAME)
    if os.path.exists(old_manifest):
        os.remove(old_manifest)
        fsync_dir(target)
    own = os.path.basename(os.path.abspath(temp))  # the build itself, where it is inside
    for n in os.listdir(target):
        if n == own:
            continue
        if not os.path.lexists(os.path.join(temp, n)) and (keep is None or not keep(n)):
            p = os.path.join(target, n)
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
    names = sorted(os.listdir(temp), key=lambda n: (n == MANIFEST_NAME, n.endswith(".json"), n))
    for n in names:
        src, dst = os.path.join(temp, n), os.path.join(target, n)
        if os.path.isdir(dst) and not os.path.islink(dst):
            shutil.rmtree(dst)
        os.replace(src, dst)
    fsync_dir(target)
    shutil.rmtree(temp, ignore_errors=True)


@contextmanager
def staged_folder(
    target: str, keep: Callable[[str], bool] | None = None, saved_from: dict | None = None
) -> Iterator[str]:
    """Yield an empty hidden folder beside ``target`` to write into; when the block ends without
    an exception, its manifest (with ``saved_from``, see :func:`write_manifest`) is written and
    it is published as ``target``. On an exception (a full disk, ...) it is deleted and
    ``target`` is left as it was."""
    target, parent, _ = _norm(target)
    os.makedirs(parent, exist_ok=True)
    recover(target)
    inside = _build_inside_reason(target, parent)
    if inside is not None and inside != "mount point":
        logger.warning(
            "hf_megatrain: %s: %s, so the new set is built inside it and its files are moved "
            "in one by one (not atomic: a kill during the save can leave a mixed set without "
            "a manifest)",
            target,
            inside,
        )
    if inside is not None:
        temp = os.path.join(target, f"{_INPLACE}-{os.getpid()}-{next(_counter)}")
    else:
        temp = new_temp_path(target)
    os.makedirs(temp)
    try:
        yield temp
        write_manifest(temp, saved_from)
        publish(temp, target, keep)
    except BaseException as exc:
        code = out_of_disk_space(exc, temp) if isinstance(exc, Exception) else None
        shutil.rmtree(temp, ignore_errors=True)
        recover(target)  # a swap that failed half way: the old set goes back
        if code is not None:
            # (Found by an audit: a full disk surfaced as safetensors' or torch's own error.)
            raise DiskFullError(code, disk_full_message(target, code)) from exc
        raise

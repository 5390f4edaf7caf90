"""Who may have written a kernel cache entry: the checks before a cached cubin is loaded.

Layer 1, beside `jit` and `nvshmem_link` (their one gate to the disk cache). An entry's own
checksum only proves it is whole, not who wrote it: a cubin runs with the job's rights, so an
entry (and the NVSHMEM shim header every internode compile pre-includes) is used only when its
file and its folder belong to a trusted owner and nobody else may write them. By default that is
the current user alone: the default folder is per user and created 0700, entries are written
0600. A team cache is an explicit choice, the knob CACHE_TRUST:

- `user:NAME` (or `user:UID`): also trust what that account wrote (one account fills the cache
  with `python -m megatron_deepep.tools.precompile`, the others read it); entries are written
  0644, new folders 0755.
- `group:NAME` (or `group:GID`): trust what members of that group wrote into a folder of that
  group that is group- but not world-writable; entries are written 0640 in that group, new
  folders 2770 (set-group-ID, so new entries inherit the group).

An untrusted entry or folder is ignored with one warning (per path and process) and the kernel
is compiled again; a folder that is not trusted is neither read nor written.
"""

from __future__ import annotations

import dataclasses
import grp
import logging
import os
import pwd
import stat
import tempfile
from pathlib import Path
from typing import FrozenSet, Optional, Set

from megatron_deepep import knobs

logger = logging.getLogger(__name__)


class UntrustedError(OSError):
    """A cache file or folder someone other than a trusted owner wrote or may write."""


@dataclasses.dataclass(frozen=True)
class Trust:
    """Whose cache files are used.

    Attributes:
        uids: owners whose files are trusted (always the current user).
        gid: with `group:`, the group whose members' files are trusted (and whose members may
            write the folder and the entries); None otherwise.
        file_mode: the mode entries are written with.
        dir_mode: the mode new cache folders are created with.
        describe: the policy in words, for messages.
    """

    uids: FrozenSet[int]
    gid: Optional[int]
    file_mode: int
    dir_mode: int
    describe: str


def _lookup(kind: str, value: str) -> int:
    """A user or group name (or number) -> its id; ValueError naming the knob otherwise."""
    if value.isdigit():
        return int(value)
    try:
        return pwd.getpwnam(value).pw_uid if kind == "user" else grp.getgrnam(value).gr_gid
    except KeyError:
        raise ValueError(f"{knobs.PREFIX}CACHE_TRUST={kind}:{value}: no such {kind}") from None


def policy() -> Trust:
    """The trust policy of knob CACHE_TRUST (unset: the current user only)."""
    me = os.getuid()
    text = knobs.get("CACHE_TRUST") or ""
    if not text:
        return Trust(frozenset([me]), None, 0o600, 0o700, f"the current user (uid {me}) only")
    kind, _, value = text.partition(":")
    if kind not in ("user", "group") or not value:
        raise ValueError(f"{knobs.PREFIX}CACHE_TRUST={text!r}: expected user:NAME, user:UID, "
                         "group:NAME or group:GID")
    ident = _lookup(kind, value)
    if kind == "user":
        return Trust(frozenset([me, ident]), None, 0o644, 0o755,
                     f"uid {me} and uid {ident} ({text})")
    return Trust(frozenset([me]), ident, 0o640, 0o2770, f"uid {me} and group {ident} ({text})")


def default_cache_dir() -> Path:
    """Knob CACHE_DIR, else `~/.cache/megatron_deepep` (the current user's own)."""
    return Path(knobs.get("CACHE_DIR") or Path.home() / ".cache" / "megatron_deepep")


def untrusted_reason(info: os.stat_result, trust: Trust) -> Optional[str]:
    """Why a file or folder with this stat is not trusted under `trust`, or None if it is."""
    mode = stat.S_IMODE(info.st_mode)
    in_group = trust.gid is not None and info.st_gid == trust.gid
    if info.st_uid not in trust.uids and not in_group:
        return f"owned by uid {info.st_uid}, trusted: {trust.describe}"
    if mode & stat.S_IWOTH:
        return f"writable by others (mode {mode:04o})"
    if mode & stat.S_IWGRP and not in_group:
        return f"writable by group {info.st_gid} (mode {mode:04o})"
    return None


_warned: Set[str] = set()  # paths already warned about by this process


def warn_once(path: Path, reason: str, consequence: str) -> None:
    """One warning per path and process."""
    if str(path) in _warned:
        return
    _warned.add(str(path))
    logger.warning("megatron_deepep: kernel cache %s is not trusted (%s); %s. A shared cache "
                   "needs %sCACHE_TRUST (README, knobs)", path, reason, consequence,
                   knobs.PREFIX)


def make_dir(path: Path, trust: Trust) -> None:
    """Creates `path` (and missing parents) with the policy's folder mode; leaves an existing
    folder's mode alone (`checked_dir` judges it)."""
    if path.is_dir():
        return
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        os.mkdir(path, trust.dir_mode & 0o777)
    except FileExistsError:
        return
    if trust.gid is not None:
        os.chown(path, -1, trust.gid)
    os.chmod(path, trust.dir_mode)  # mkdir's mode passes through the umask; this does not


def checked_dir(path: Path, trust: Optional[Trust] = None, create: bool = True) -> bool:
    """Whether the cache folder `path` may be used (created when missing and `create`); an
    untrusted one is warned about once."""
    trust = trust or policy()
    if create:
        try:
            make_dir(path, trust)
        except OSError as exc:
            warn_once(path, f"cannot create it: {exc}", "compiling without the disk cache")
            return False
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return False
    reason = untrusted_reason(info, trust)
    if reason:
        warn_once(path, reason, "not reading or writing it, compiling every kernel")
        return False
    return True


def read_trusted(path: Path, trust: Optional[Trust] = None) -> Optional[bytes]:
    """The bytes of the file at `path`, or None when it does not exist.

    The file is opened without following a symbolic link and judged by the stat of the open
    descriptor, so what is read is what was checked.

    Raises:
        UntrustedError: its owner or mode is not trusted (the reason).
        OSError: it cannot be read.
    """
    trust = trust or policy()
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        if os.path.islink(path):
            raise UntrustedError(f"a symbolic link ({exc})") from None
        raise
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedError("not a regular file")
        reason = untrusted_reason(info, trust)
        if reason:
            raise UntrustedError(reason)
        return f.read()


TEMP_PREFIX = ".tmp-"  # temporary files in a cache folder (never read as entries)


def write_atomic(path: Path, data: bytes, mode: int = 0o600, gid: Optional[int] = None) -> None:
    """Writes `path` through a temporary file in its directory, fsync and a rename.

    Readers (other ranks, other nodes) see the old file, or the whole new one, never a part.

    Args:
        mode: the file's mode (mkstemp's 0600 unless a shared cache asks for more).
        gid: its group (a group-shared cache), None: left as created.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{TEMP_PREFIX}{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if gid is not None:
            os.chown(tmp, -1, gid)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_checked(path: Path, what: str, trust: Optional[Trust] = None) -> Optional[bytes]:
    """`read_trusted`, with an untrusted or unreadable file warned about (once) and None: the
    caller compiles again and replaces it."""
    try:
        return read_trusted(path, trust)
    except UntrustedError as exc:
        warn_once(path, str(exc), f"ignoring this {what} and building it again")
    except OSError as exc:
        logger.warning("megatron_deepep: cannot read %s %s (%s); building it again", what, path,
                       exc)
    return None


def write_checked(path: Path, data: bytes, trust: Optional[Trust] = None) -> bool:
    """Writes a cache file with the policy's mode and group; a folder this user may not write
    (a cache another account fills) is warned about once and left alone. Returns whether it
    was written."""
    trust = trust or policy()
    try:
        write_atomic(path, data, trust.file_mode, trust.gid)
        return True
    except OSError as exc:
        key = f"write {path.parent}"
        if key not in _warned:
            _warned.add(key)
            logger.warning("megatron_deepep: cannot write to the kernel cache %s (%s); using "
                           "the kernels compiled in memory", path.parent, exc)
        return False

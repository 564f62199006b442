"""The save directory of ``fpipe.save``: versions, the lock, the commit, and the committed save.

NOTE [the save directory]
``save`` never modifies a committed save: it writes a new version next to it and commits by
atomically replacing one small pointer file::

    directory/
      .lock                              held by the writer from choosing a version to cleaning up
      latest                             "v000008-5e6f7a8b\\n": the commit point
      v000008-5e6f7a8b/                  the committed save
        model.safetensors.index.json     written last (NOTE [sharded saves] in fpipe/_saving/_store.py)
        model-rank-00000-of-00002.safetensors      parameters written by pipeline rank 0
        model-rank-00001-of-00002.safetensors
        optimizer-rank-00000-of-00002.safetensors  optimizer state written by rank 0
      .tmp-v000009-9c0d1e2f/             a save in progress, or a killed one: never read

The commit (``commit``): write the index into ``.tmp-<version>/`` (through a temporary file and
``os.replace``), fsync; rename ``.tmp-<version>`` to ``<version>``, fsync the directory; write
``latest.tmp-<random>``, fsync, ``os.replace`` it onto ``latest`` (atomic on POSIX), fsync the
directory. Only then is what is older removed. A save killed anywhere before the last
``os.replace`` leaves ``latest`` on the previous version, complete and loadable; ``committed``
follows ``latest`` and refuses a directory without an index.

NOTE [save concurrency]
Several processes may save to one directory at once (every rank of a ``torchrun`` job calling
``save`` without ``parallel=``). The writer (pipeline rank 0) holds an exclusive ``fcntl.flock`` on
``directory/.lock`` from choosing its version (one more than any in the directory or in
``latest``) to the end of its cleanup, so saves to one directory take turns: each completes,
and the last to commit is the one ``latest`` names. Holding the lock, the writer removes only
what is numbered below its own version (older versions and the ``.tmp-`` directories of killed
saves, whose writers released the lock when they died) and stale ``latest.tmp-*`` files; the
lock file itself is never removed. A writer waits at most ``timeout`` seconds for the lock. On
a filesystem without ``flock`` (some FUSE and Lustre mounts) and on Windows ``save`` warns and
goes on unlocked. notes/saving.md says more, including what happens on NFS.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import socket
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

INDEX = "model.safetensors.index.json"
LATEST = "latest"
LOCK = ".lock"
_VERSION = re.compile(r"v(\d{6,})-[0-9a-f]{8}")
_STALE = re.compile(r"(?:\.tmp-)?v(\d{6,})-[0-9a-f]{8}")
_POINTER_TMP = re.compile(r"latest\.tmp-[0-9a-f]{8}")
# flock errors that mean "this filesystem has no locks", not "someone else holds it"
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


@contextlib.contextmanager
def locked(root: Path, timeout: float) -> Iterator[None]:
    """Hold the save lock of ``root`` (NOTE [save concurrency]), waiting at most ``timeout`` seconds."""
    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if _lock(fd, root, timeout):
            _claim(fd, root)
        yield
    finally:
        os.close(fd)  # releases the lock


def _lock(fd: int, root: Path, timeout: float) -> bool:
    """Take the lock on ``fd``; ``False``: there are no locks here (warned), goes on unlocked."""
    try:
        import fcntl  # POSIX only: imported here so that the package imports on every platform
    except ImportError:
        _unlocked(root, "this platform has no fcntl")
        return False
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"fpipe.save: another save to {root} has held its lock ({root / LOCK}) for longer than "
                    f"timeout (timeout: {timeout}). Let it finish, pass a longer timeout=, or save elsewhere."
                ) from None
            time.sleep(0.01)
        except OSError as error:
            if error.errno not in _NO_LOCKS:
                raise
            _unlocked(root, error.strerror or str(error))
            return False


def _unlocked(root: Path, why: str) -> None:
    warnings.warn(
        f"fpipe.save: {root} cannot be locked ({why}), so saves to it from several processes at once are "
        "not kept apart. Save from one process (or pass parallel=) there, or save to a filesystem with file "
        "locks (NOTE [save concurrency] in fpipe/_saving/_directory.py).",
        RuntimeWarning,
        stacklevel=_caller_outside_fpipe(),
    )


# NOTE [a second live writer]
# Two runs that save into one directory take turns under the lock, and each commit is whole, but
# a later resume takes whichever committed last: one run's state, silently, for the other's. So
# the writer, holding the lock, writes who it is into the lock file (host, process id, and the
# job: ``TORCHELASTIC_RUN_ID`` as torchrun sets it, else the address of the default process
# group's store, which every process of a job rendezvoused at whatever its ``init_method``
# (tcp://, file://, env://), else ``MASTER_ADDR:MASTER_PORT``: the environment alone does not
# name a job started with ``init_method="tcp://..."``, notes/saving.md), and warns
# (``RuntimeWarning``) when the previous writer was another process of another job (or of no
# job) on this host that is still alive: another live run writes here. Processes of one job
# saving without ``parallel=`` (NOTE [save concurrency]) share the job and are not warned; a
# resumed run's predecessor is dead. A writer on another host cannot be asked whether it lives
# and is not reported. It warns rather than refuses: a process id can be reused, and a save must
# not fail a healthy run.
_OWNER_BYTES = 4096


def _claim(fd: int, root: Path) -> None:
    """Write this process into the held lock file; warn if its last writer is another live run."""
    try:
        previous = json.loads(os.pread(fd, _OWNER_BYTES, 0) or b"null")
    except ValueError:  # an empty, older or damaged lock file: nobody to compare with
        previous = None
    me = {"host": socket.gethostname(), "pid": os.getpid(), "job": _job()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    if not (isinstance(previous, dict) and previous.get("host") == me["host"] and previous.get("pid") != me["pid"]):
        return
    pid, job = previous.get("pid"), previous.get("job")
    if isinstance(pid, int) and pid > 0 and (job is None or job != me["job"]) and _alive(pid):
        warnings.warn(
            f"fpipe.save: another run saves into {root}: its last save was written by process {pid} "
            f"(job: {job}), still alive on this host, and this one is process {me['pid']} (job: {me['job']}). "
            "Each save commits whole, but a resume takes whichever committed last. Give each run a directory "
            "of its own (NOTE [a second live writer] in fpipe/_saving/_directory.py).",
            RuntimeWarning,
            stacklevel=_caller_outside_fpipe(),
        )


def _caller_outside_fpipe() -> int:
    """The ``stacklevel`` that makes a warning raised by this function's caller point at the
    first frame outside fpipe and its ``with`` blocks' ``contextlib`` frames: the user's call to
    ``fpipe.save``, ``save_state``... (a count written by hand broke whenever a frame was added)."""
    inside = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep, contextlib.__file__)
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def _job() -> str | None:
    """The job this process belongs to (NOTE [a second live writer]): torchrun's run id, else
    where the default process group's store is (``_store_address``), else ``MASTER_ADDR:MASTER_PORT``."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run:
        return run
    store = _store_address()
    if store is not None:
        return store
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{address}:{port}" if address and port else None


def _store_address() -> str | None:
    """Where the store of the default process group is: ``host:port`` of a TCP store (as
    ``MASTER_ADDR:MASTER_PORT`` says it for env://), ``file://<path>`` of a file store; ``None``
    without one (torch.distributed not initialized, or a store of one process). Every process of a
    job has the same, whatever its ``init_method``, and two live jobs cannot share one."""
    # (imported on call: the save directory needs no torch otherwise)
    import torch.distributed as dist
    from torch.distributed import FileStore, TCPStore  # type: ignore[attr-defined]

    if not (dist.is_available() and dist.is_initialized()):
        return None
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):  # a PrefixStore
        store = store.underlying_store
    if isinstance(store, TCPStore):
        return f"{store.host}:{store.port}"
    if isinstance(store, FileStore):
        return f"file://{store.path}"  # type: ignore[attr-defined]  # (torch's stubs lack it)
    return None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a zombie counts: it has not been waited for)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, as another user's
        return True
    return True


def next_version(root: Path) -> str:
    """``v<n>-<random>``, ``n`` one more than any version in ``root`` or in its ``latest``."""
    numbers = [-1]
    names = os.listdir(root)
    with contextlib.suppress(OSError):  # a stale directory listing (NFS) still shows latest's version
        names.append(read_pointer(root / LATEST))
    for name in names:
        match = _STALE.fullmatch(name)
        if match:
            numbers.append(int(match.group(1)))
    return f"v{max(numbers) + 1:06d}-{secrets.token_hex(4)}"


def commit(root: Path, version: str, index: dict[str, Any]) -> None:
    """Write the index into ``.tmp-<version>``, commit it and clean up (NOTE [the save directory]),
    holding the lock (NOTE [save concurrency])."""
    tmp = root / f".tmp-{version}"
    write_atomic(tmp / INDEX, json.dumps(index, indent=2, sort_keys=True).encode())
    os.replace(tmp, root / version)
    fsync_directory(root)
    write_atomic(root / LATEST, f"{version}\n".encode())
    mine = _number(version)
    for name in os.listdir(root):
        match = _STALE.fullmatch(name)
        if (match and int(match.group(1)) < mine) or _POINTER_TMP.fullmatch(name):
            path = root / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _number(version: str) -> int:
    match = _VERSION.fullmatch(version)
    assert match is not None
    return int(match.group(1))


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` so that it is either the old file or the complete new one, durably."""
    tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)


def fsync_directory(path: Path) -> None:
    """Make renames and new entries in ``path`` durable."""
    if not hasattr(os, "O_DIRECTORY"):  # Windows cannot open a directory; NTFS journals renames
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- Reading ----------------------------------------------------------------------------------


def read_pointer(pointer: Path) -> str:
    """The version ``latest`` names (its first line; a pointer is a few bytes)."""
    with open(pointer, "rb") as f:
        return f.read(64).decode(errors="replace").strip()


def committed(directory: Path) -> Path:
    """The committed save in ``directory``: the version ``latest`` names, or ``directory`` itself.

    Every path followed stays inside ``directory`` (``inside``), so a hostile ``latest`` or a
    symbolic link tells nothing about files elsewhere (NOTE [trust model] in ``fpipe/_saving/_store.py``).
    """
    if os.path.lexists(directory / LATEST):
        pointer = inside(directory, LATEST)
        version = read_pointer(pointer) if pointer.is_file() else ""
        if not _VERSION.fullmatch(version) or not inside(inside(directory, version), INDEX).is_file():
            raise ValueError(
                f"fpipe.load: {pointer} names {version[:40]!r}, which is not a committed save (no {INDEX} there). "
                "Something other than fpipe.save changed the directory."
            )
        return directory / version
    if inside(directory, INDEX).is_file():
        return directory
    raise FileNotFoundError(
        f"fpipe.load: no committed save in {directory} (neither a '{LATEST}' file nor {INDEX}). A save that "
        "was interrupted leaves only a '.tmp-*' directory, which is never loaded."
    )


def inside(directory: Path, name: str) -> Path:
    """``directory / name`` (``name`` a plain name), checked to resolve to an entry of ``directory``.

    A symbolic link to another entry of ``directory`` is followed; one leading anywhere else is
    refused without saying where it leads or whether that exists.
    """
    path = directory / name
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(directory):
        raise ValueError(
            f"fpipe.load: {path} is a symbolic link leading outside {directory}; fpipe.load reads only files "
            "inside the save directory. Replace the link by the file itself."
        )
    return path

"""Swap files for ZeRO-Infinity's NVMe tiers: a per-run directory and asynchronous file I/O.

Every rank keeps its swap files in its own directory,
``<nvme_path>/hf_zero-swap-<launcher pid>/rank<r>.<host>.<pid>``, created when the engine is
built and removed when the process ends: normally or by an exception (`SwapSpace.close` runs
from ``atexit``), or by SIGTERM; a killed process's directory (SIGKILL) is removed by the next
run on the host (`hf_zero.storage.swap_folders`).

I/O runs on a small thread pool: ``os.preadv`` / ``os.pwritev`` read and write straight into
tensor memory and release the GIL, so the reads of the next tiles or units proceed while Python
computes. Files are opened with ``O_DIRECT`` where the file system allows it (ext4, xfs; not
tmpfs), so swapped bytes do not also fill the page cache - the point of NVMe offload is that the
host does not hold them. ``O_DIRECT`` needs block-aligned addresses, offsets and sizes: buffers
come from `SwapSpace.buffer` (aligned) and every file is padded to whole blocks. DeepSpeed reaches
the same through libaio (``aio`` config section); measured here, the thread pool reaches the
disk's sequential bandwidth (``benchmarks/bench_infinity.py``), so no native extension is needed.

Space is reserved with ``posix_fallocate`` when a file is created: a full disk is a clear
`ValueError` naming the path before training starts, not a failed write in the middle of a step.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import itertools
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from hf_zero.storage import swap_folders

ALIGN = 4096  # bytes: O_DIRECT alignment that every common NVMe / SSD accepts

_counter = itertools.count()
_open_spaces: dict[Path, SwapSpace] = {}


def _round_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def check_nvme_path(key: str, path: str | os.PathLike | None) -> Path:
    """The directory ``path`` for ``key`` (e.g. ``offload_param.nvme_path``), created if need be;
    a `ValueError` naming both when it is missing or not writable."""
    if not path:
        raise ValueError(
            f"zero config: '{key}' is required when the device is 'nvme' (a directory on a fast "
            "local disk, e.g. /local_nvme)"
        )
    root = Path(path)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".hf_zero_probe_{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"zero config: '{key}' = {str(path)!r} is not a writable directory ({err.strerror}); "
            "point it at a directory on a local disk this process can write"
        ) from None
    return root


def open_space(
    root: str | os.PathLike, rank: int, threads: int = 4, hold: bool = True
) -> SwapSpace:
    """This process's open swap space under ``root``, made if there is none: what
    `partitioned_init` spills while building and the engine's tiers then share one directory
    and thread pool (two spaces would share the directory, and closing one would remove it).
    ``hold``: the caller will `SwapSpace.close` it (an engine); the last holder's close removes
    it. The build's slices are removed one by one as the engine adopts them."""
    space = _open_spaces.get(Path(root))
    if space is None or space._closed:
        space = _open_spaces[Path(root)] = SwapSpace(root, rank, threads)
    space.holders += hold
    return space


class SwapSpace:
    """One rank's swap directory and I/O thread pool.

    Args:
        root: the configured ``nvme_path``.
        rank: global rank (names the sub-directory).
        threads: I/O threads (DeepSpeed ``aio.thread_count``).
        direct: use ``O_DIRECT`` where the file system supports it.
    """

    def __init__(self, root: str | os.PathLike, rank: int, threads: int = 4, direct: bool = True):
        self.root = Path(root)
        swap_folders.remove_stale(self.root)  # what killed runs left here
        # One run directory per launch (the launcher is every local rank's parent process).
        run = self.root / f"{swap_folders.RUN_PREFIX}{os.getppid()}"
        self.dir = run / swap_folders.rank_dir_name(rank)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.direct = direct and hasattr(os, "O_DIRECT") and self._direct_works()
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="hf_zero_swap")
        self.files: list[SwapFile] = []
        self.stats = {"read_bytes": 0, "write_bytes": 0}
        """Bytes moved to and from this rank's swap files (padding included)."""
        self._closed = False
        self.holders = 0
        """Callers of `open_space` that will `close` it; made directly, its one `close` ends it."""
        atexit.register(self.shutdown)
        swap_folders.remove_on_signal(self.shutdown)

    def _direct_works(self) -> bool:
        probe = self.dir / ".direct_probe"
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        except OSError:
            return False
        os.close(fd)
        probe.unlink()
        return True

    def file(self, name: str, nbytes: int) -> SwapFile:
        """A new swap file of ``nbytes`` (padded to whole blocks), its space reserved now."""
        f = SwapFile(self, self.dir / f"{next(_counter)}.{name}", nbytes)
        self.files.append(f)
        return f

    def remove(self, file: SwapFile) -> None:
        """Close ``file`` and give its disk space back now (a file only needed for a while)."""
        file.close()
        file.path.unlink(missing_ok=True)
        self.files = [f for f in self.files if f is not file]

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An aligned host buffer of ``numel`` elements (pinned when CUDA is present), sized to
        whole blocks so direct I/O may read and write it entire."""
        nbytes = _round_up(numel * torch.empty(0, dtype=dtype).element_size())
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        skip = (-raw.data_ptr()) % ALIGN
        return raw[skip : skip + nbytes].view(dtype)[:numel]

    def close(self) -> None:
        """Release the caller's hold (`open_space`); the last one closes every file and removes
        this run's directory (idempotent)."""
        self.holders -= 1
        if self.holders <= 0:
            self.shutdown()

    def shutdown(self) -> None:
        """Close every file and remove this run's directory now (at exit too; idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.pool.shutdown(wait=True)
        for f in self.files:
            f.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.dir.parent.rmdir()  # the run directory, once every rank has left it
        atexit.unregister(self.shutdown)
        swap_folders.forget(self.shutdown)


class SwapFile:
    """A fixed-size file read and written in place at byte offsets, synchronously or not."""

    def __init__(self, space: SwapSpace, path: Path, nbytes: int) -> None:
        self.space = space
        self.path = path
        self.nbytes = _round_up(max(nbytes, 1))
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if space.direct else 0)
        self.fd = os.open(path, flags, 0o600)
        try:
            os.posix_fallocate(self.fd, 0, self.nbytes)
        except OSError as err:
            os.close(self.fd)
            path.unlink(missing_ok=True)
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            free = shutil.disk_usage(space.dir).free
            others = swap_folders.describe_others(space.root, space.dir)
            raise ValueError(
                f"hf_zero: no space left for NVMe offload under nvme_path {str(space.root)!r}: "
                f"a {self.nbytes / 2**20:.1f} MiB swap file does not fit ({free / 2**20:.1f} MiB "
                f"free{others}). Free space there or point nvme_path at a larger disk"
            ) from None

    def read_async(self, into: torch.Tensor, offset: int = 0) -> Future:
        """Start reading ``into.nbytes`` (rounded up to whole blocks) from byte ``offset``."""
        return self.space.pool.submit(self._io, os.preadv, into, offset, "read_bytes")

    def write_async(self, src: torch.Tensor, offset: int = 0) -> Future:
        """Start writing ``src`` (an aligned `SwapSpace.buffer`) at byte ``offset``."""
        return self.space.pool.submit(self._io, os.pwritev, src, offset, "write_bytes")

    def read(self, into: torch.Tensor, offset: int = 0) -> torch.Tensor:
        self._io(os.preadv, into, offset, "read_bytes")
        return into

    def write(self, src: torch.Tensor, offset: int = 0) -> None:
        self._io(os.pwritev, src, offset, "write_bytes")

    def _io(self, op, tensor: torch.Tensor, offset: int, stat: str) -> None:
        nbytes = _round_up(tensor.numel() * tensor.element_size())
        if offset % ALIGN or offset + nbytes > self.nbytes:
            raise ValueError(f"hf_zero: unaligned swap I/O at {offset} (+{nbytes}) in {self.path}")
        # The aligned buffer's storage extends to the block boundary (see SwapSpace.buffer).
        view = memoryview(_bytes_of(tensor, nbytes))
        done = 0
        while done < nbytes:
            n = op(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"short {op.__name__} at {offset + done}", str(self.path))
            done += n
        self.space.stats[stat] += nbytes

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _bytes_of(tensor: torch.Tensor, nbytes: int):
    """The ``nbytes`` of memory starting at ``tensor``'s first element, as a numpy byte array."""
    storage = tensor.untyped_storage()
    start = tensor.storage_offset() * tensor.element_size()
    if start + nbytes > storage.nbytes():
        raise ValueError("hf_zero: swap I/O needs a buffer from SwapSpace.buffer (block-padded)")
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
    return flat[start : start + nbytes].numpy()

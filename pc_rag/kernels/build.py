"""Where pc-rag's kernel library comes from: built at install, else built here once.

``pip install`` (``setup.py``) compiles the C sources beside this file into ``_native*.so`` in the
package, so a wheel carries them and a machine with no compiler still gets them. That library holds
the hash of the sources it was built from (:func:`source_key`); it is used only while the sources
beside it are the same (an editable install whose C was edited builds again here).

The run-time build is the fallback: the system C compiler (``$CC``, else ``cc``/``gcc``) writes the
library, keyed by sources, flags and compiler, into pc-rag's cache folder, else (read-only home) a
folder under the system's temporary one. A file lock makes two processes starting at once build it
once; the library is written to a temporary name and renamed, so a half-written one is never loaded.
A compiler without OpenMP (clang without libomp) builds it again without: only the products' wide
(prefill) loops are parallel by OpenMP, the decode step has its own threads.

``$PC_RAG_KERNELS``: ``build`` skips the installed library (tests of the fallback), ``address`` builds
one under AddressSanitizer (for a process started with libasan preloaded), ``off`` uses none.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..paths import cache_root
from .sources import COMPILE_FLAGS, HERE, INSTALLED_NAME, LIBRARIES, OPENMP_FLAGS, SOURCE_NAMES, SOURCES, source_key

logger = logging.getLogger(__name__)


def installed_path() -> Path:
    """Where ``pip install`` puts the library it builds."""
    return HERE / f"{INSTALLED_NAME}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def compiler() -> str | None:
    """The C compiler to build with: ``$CC``, else ``cc`` or ``gcc`` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def command(cc: str, output: Path, *, openmp: bool = True, extra: tuple[str, ...] = ()) -> list[str]:
    """The compiler's command line for the shared library (``extra``: e.g. a sanitizer's flags)."""
    return [cc, *COMPILE_FLAGS, *(OPENMP_FLAGS if openmp else ()), *extra, "-shared", f"-DPC_RAG_SOURCE_KEY=\"{source_key()}\"",
            "-o", str(output), *map(str, SOURCES), *LIBRARIES]


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def cache_folders() -> list[Path]:
    """Where a run-time build may go, first choice first: pc-rag's cache folder, then one in the
    system's temporary folder (this user's own)."""
    return [cache_root() / "kernels", Path(tempfile.gettempdir()) / f"pc-rag-{os.getuid()}" / "kernels"]


def built(cc: str, *, extra: tuple[str, ...] = ()) -> Path:
    """The library for these sources, flags and compiler: found built, else built once (under a file
    lock), in the first of :func:`cache_folders` that can be written. Raises ``OSError`` or
    ``subprocess.SubprocessError`` where it cannot be built."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(repr((source_key(), COMPILE_FLAGS, OPENMP_FLAGS, extra, LIBRARIES, cc, version)).encode()).hexdigest()[:20]
    problems = []
    for index, folder in enumerate(cache_folders()):
        target = folder / f"block_kernels-{key}.so"
        try:
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            if index > 0:  # the shared temporary folder: only a folder of this user's own
                _check_own(folder)
            if target.is_file():
                return target
            with _locked(folder / f"block_kernels-{key}.lock"):
                if not target.is_file():  # another process may have built it while this one waited
                    _compile(cc, target, extra)
            return target
        except OSError as err:  # a read-only or missing home (not a failed compile: that raises): the next folder
            problems.append(f"{folder}: {err.strerror or err}")
    raise OSError("no folder to build pc-rag's kernels in (" + "; ".join(problems) + ")")


def _check_own(folder: Path) -> None:
    """Raises ``PermissionError`` unless ``folder`` and its parent belong to this user and nobody else can
    write them: a library found in a shared temporary folder could be anyone's code."""
    for path in (folder, folder.parent):
        status = path.stat()
        if status.st_uid != os.getuid() or status.st_mode & 0o022:
            raise PermissionError(f"{path} is not this user's own (owner {status.st_uid}, mode {oct(status.st_mode & 0o777)})")


def _compile(cc: str, target: Path, extra: tuple[str, ...]) -> None:
    """Compile into a temporary name beside ``target``, then rename it into place whole; without
    OpenMP where the compiler has none."""
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        partial = Path(work) / target.name
        logger.info("building pc-rag's kernels (%s) with %s into %s", ", ".join(SOURCE_NAMES), cc, target.parent)
        try:
            subprocess.run(command(cc, partial, extra=extra), check=True, capture_output=True, text=True, timeout=300)
        except subprocess.CalledProcessError as err:
            if not any(word in (err.stderr or "").lower() for word in ("openmp", "omp")):  # -fopenmp refused, omp.h or libomp missing
                raise
            _warn_once(f"{cc} cannot build with OpenMP ({(err.stderr or '').strip().splitlines()[-1:]}): "
                       "pc-rag's kernels built without it (wide products on one thread; the decode step keeps its threads)")
            subprocess.run(command(cc, partial, openmp=False, extra=extra), check=True, capture_output=True, text=True, timeout=300)
        os.replace(partial, target)
    if target.parent != cache_folders()[0]:
        _warn_once(f"pc-rag's kernels built in {target.parent}: {cache_folders()[0]} cannot be written")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (released when the process dies, so a crashed build holds nothing)."""
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

"""pc-rag's kernels compiled when the package is built (``pip install .``, a wheel), so a wheel carries
them and a machine with no compiler still has them (pc_rag/kernels/build.py finds the library).

Why setuptools and not scikit-build-core: six C files with one set of flags into one shared library
that Python reaches through ctypes; setuptools is already the build backend and needs no CMake.
The build is optional: on a machine where it fails (no compiler, not x86-64) the install still
succeeds, and pc-rag builds the kernels at run time, or runs on torch's kernels, as before.
Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import importlib.util
import platform
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


def kernel_sources():
    """pc_rag/kernels/sources.py, read by path: pc-rag itself (and torch) cannot be imported here."""
    spec = importlib.util.spec_from_file_location("pc_rag_kernel_sources", HERE / "pc_rag" / "kernels" / "sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class OptionalBuildExt(build_ext):
    """Build the kernels where this machine can; say so and go on where it cannot."""

    def run(self) -> None:  # (a failed compile is skipped by the Extension's optional=True; this catches the rest: no compiler at all)
        try:
            super().run()
        except Exception as err:  # noqa: BLE001 - the kernels are an optimisation: the package works without them
            print(f"pc-rag: kernels not built at install ({err}); they are built at first use where a compiler is", file=sys.stderr)


def extensions() -> list[Extension]:
    if platform.machine().lower() not in ("x86_64", "amd64") or sys.platform != "linux":
        return []
    sources = kernel_sources()
    return [Extension(
        f"pc_rag.kernels.{sources.INSTALLED_NAME}",
        sources=[str(Path("pc_rag") / "kernels" / name) for name in sources.SOURCE_NAMES],
        depends=[str(Path("pc_rag") / "kernels" / name) for name in sources.HEADER_NAMES],
        extra_compile_args=[*sources.COMPILE_FLAGS, *sources.OPENMP_FLAGS, f'-DPC_RAG_SOURCE_KEY="{sources.source_key()}"'],
        extra_link_args=[*sources.OPENMP_FLAGS, *sources.LIBRARIES],
        optional=True,
    )]


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})

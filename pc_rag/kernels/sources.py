"""The kernels' C sources and their hash, standard library only: ``setup.py`` reads this file by path
at install (before pc-rag or torch can be imported) and the run-time build reads it as a module."""

from __future__ import annotations

import hashlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the products (and their dequantization), the Llama decode step built on them and the step's threads
SOURCE_NAMES = ("block_kernels.c", "a8_kernels.c", "wide_kernels.c", "a16_kernels.c", "llama_step.c", "thread_pool.c")
HEADER_NAMES = ("block_kernels.h", "a8_products.h")  # what they call of each other; a8_kernels.c's products
SOURCES = tuple(HERE / name for name in SOURCE_NAMES)
HEADERS = tuple(HERE / name for name in HEADER_NAMES)
COMPILE_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-std=c11", "-pthread")
OPENMP_FLAGS = ("-fopenmp",)
LIBRARIES = ("-lm",)  # after the sources: expf and sqrtf of the decode step
INSTALLED_NAME = "_native"  # pc_rag/kernels/_native<EXT_SUFFIX>: what setup.py builds


def source_key(folder: Path = HERE) -> str:
    """The sources' and headers' hash: what a library was built from (an installed one is used only
    while the sources beside it hash the same)."""
    digest = hashlib.sha256()
    for name in (*SOURCE_NAMES, *HEADER_NAMES):
        digest.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
    return digest.hexdigest()[:20]

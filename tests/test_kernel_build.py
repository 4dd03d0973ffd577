"""Where pc-rag's kernel library comes from (``pc_rag.kernels.build``): built when the package is
installed, else built once at run time, by real compiler runs in real processes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pc_rag.errors import PromptCacheError
from pc_rag.kernels import build, loader, products

LOAD = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr); "
        "from pc_rag.kernels import loader; lib = loader.load(); assert lib is not None; print(lib._name)")
BUILDING = "building pc-rag's kernels"


def run_build(home: Path, **env: str) -> subprocess.Popen:
    """A process that loads the kernels with the run-time build only (``PC_RAG_KERNELS=build``) under ``home``."""
    return subprocess.Popen([sys.executable, "-c", LOAD], env={**os.environ, "PC_RAG_HOME": str(home), "PC_RAG_KERNELS": "build", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(process: subprocess.Popen) -> tuple[str, str]:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return out.strip(), err


def test_the_install_built_the_kernels_and_they_are_the_ones_loaded():
    """``pip install`` (the README's, editable) ran setup.py's build: the library is in the package,
    built from the sources beside it, and a process loads it without building anything."""
    assert build.installed_path().is_file()
    out, err = finished(subprocess.Popen([sys.executable, "-c", LOAD], env={k: v for k, v in os.environ.items() if k != "PC_RAG_KERNELS"},
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    assert out == str(build.installed_path()) and BUILDING not in err


def test_two_processes_starting_at_once_build_once_and_a_third_finds_it_built(tmp_path):
    first, second = run_build(tmp_path), run_build(tmp_path)
    (path_1, err_1), (path_2, err_2) = finished(first), finished(second)
    assert path_1 == path_2 and Path(path_1).parent == tmp_path / "kernels"
    assert (err_1 + err_2).count(BUILDING) == 1
    path_3, err_3 = finished(run_build(tmp_path))
    assert path_3 == path_1 and BUILDING not in err_3


def test_with_no_cache_folder_the_kernels_are_built_in_a_private_temporary_one(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    path, err = finished(run_build(blocked / "pc-rag", TMPDIR=str(temporary)))
    assert Path(path).parent == temporary / f"pc-rag-{os.getuid()}" / "kernels"
    assert err.count("cannot be written") == 1
    assert not stat.S_IMODE((temporary / f"pc-rag-{os.getuid()}" / "kernels").stat().st_mode) & 0o077


def test_a_shared_temporary_folder_someone_else_can_write_is_not_used(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    temporary = tmp_path / "tmp"
    (temporary / f"pc-rag-{os.getuid()}" / "kernels").mkdir(parents=True)
    os.chmod(temporary / f"pc-rag-{os.getuid()}", 0o777)  # as another user could have left it
    process = subprocess.run([sys.executable, "-c", "from pc_rag.kernels import loader; print(loader.load())"], capture_output=True, text=True,
                             env={**os.environ, "PC_RAG_HOME": str(blocked), "PC_RAG_KERNELS": "build", "TMPDIR": str(temporary)}, timeout=300)
    assert process.stdout.strip() == "None" and "not this user's own" in process.stderr
    assert list((temporary / f"pc-rag-{os.getuid()}" / "kernels").iterdir()) == []


def test_a_compiler_without_openmp_still_builds_the_kernels(tmp_path):
    """clang without libomp refuses ``-fopenmp``; the decode step needs none (it has its own threads)."""
    real = build.compiler()
    no_openmp = tmp_path / "cc-without-openmp"
    no_openmp.write_text("#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = -fopenmp ] && { echo \"clang: error: unsupported option '-fopenmp'\" >&2; exit 1; }; done\n"
                         f"exec {real} \"$@\"\n")
    no_openmp.chmod(0o755)
    path, err = finished(run_build(tmp_path / "home", CC=str(no_openmp)))
    assert "without it" in err and Path(path).is_file()


def test_concurrent_first_calls_check_the_library_once():
    """Threads asking for the library at once wait for one load and check (it switches kernel forms on
    the shared library while it runs), and all get the same answer."""
    from concurrent.futures import ThreadPoolExecutor

    loader.forget()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: loader.library(), range(8)))
    assert answers[0] is not None and all(answer is answers[0] for answer in answers)


def test_a_library_from_elsewhere_is_loaded_only_where_it_checks_out(tmp_path):
    """``loader.load_file`` (benchmarks alternate another commit's kernels with these): the installed
    library loads and multiplies as torch does; a file that is not a library, or none, is refused by name."""
    lib = loader.load_file(build.installed_path())
    words, scales, minimums = products.pack_nibbles(torch.full((2, 32), 3)), torch.ones(2, 1), torch.zeros(2, 1)
    assert torch.allclose(products.q4_matmul(torch.ones(1, 32), words, scales, minimums, None, lib=lib), torch.full((1, 2), 96.0))
    junk = tmp_path / "not_a_library.so"
    junk.write_bytes(b"not ELF")
    for path in (junk, tmp_path / "missing.so"):
        with pytest.raises(PromptCacheError, match=f"the kernels at {path} do not load"):
            loader.load_file(path)

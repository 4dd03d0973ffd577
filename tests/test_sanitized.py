"""The kernels' own tests run again on a separate build of the library under AddressSanitizer
(``PC_RAG_KERNELS=address``), in a process started with libasan preloaded: a read or write past
any buffer the C is handed fails the run with the sanitizer's report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pc_rag.kernels import build

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = ("tests/test_fused_step.py", "tests/test_blocks.py")


def sanitized_env(home: Path, reports: Path) -> dict[str, str]:
    """libasan first (it must be the first library loaded), then libstdc++ (torch throws C++ exceptions that
    Python catches; ASan's interceptor of ``__cxa_throw`` needs the real one already loaded)."""
    cc = build.compiler()
    if cc is None:
        pytest.skip("no C compiler: nothing to build under AddressSanitizer")
    preload = [subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
               for name in ("libasan.so", "libstdc++.so.6")]
    if not all(os.path.isabs(path) and os.path.exists(path) for path in preload):
        pytest.skip(f"{cc} has no AddressSanitizer runtime ({preload})")
    return {**os.environ, "LD_PRELOAD": " ".join(preload), "ASAN_OPTIONS": f"detect_leaks=0:log_path={reports}",
            "PC_RAG_KERNELS": "address", "PC_RAG_HOME": str(home)}


def test_the_kernels_tests_pass_under_address_sanitizer(tmp_path):
    env = sanitized_env(tmp_path / "home", tmp_path / "asan")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:nbmake", "-o", "addopts=",
                          *KERNEL_TESTS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    reports = [path.read_text() for path in tmp_path.glob("asan*")]
    assert run.returncode == 0 and reports == [], (run.stdout[-3000:], reports[:1])
    assert list((tmp_path / "home" / "kernels").glob("block_kernels-*.so")), "the sanitized library was built and used"


def test_the_sanitizer_reports_a_write_past_a_buffer_through_the_raw_library(tmp_path):
    """The harness catches what it is for: a product written into too small an output, past the checks
    of pc_rag.kernels.products, is reported and fails the process."""
    script = ("import torch; from pc_rag.kernels import loader, products; lib = loader.library(); "
              "words = products.pack_nibbles(torch.randint(0, 16, (64, 64))); scales = torch.rand(64, 2); out = torch.empty(100); "
              "lib.q4_dequantize(words.data_ptr(), scales.data_ptr(), scales.data_ptr(), 64, 0, 64, out.data_ptr(), 1)")
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=sanitized_env(tmp_path / "home", tmp_path / "asan"),
                         capture_output=True, text=True, timeout=600)
    reports = "".join(path.read_text() for path in tmp_path.glob("asan*"))
    assert run.returncode != 0 and "ERROR: AddressSanitizer" in reports and "q4_dequantize" in reports

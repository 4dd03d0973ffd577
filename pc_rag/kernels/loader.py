"""pc-rag's own CPU kernels for weights in blocks of 32, loaded once a process and checked.

torch has no kernel that streams 4-bit weights at memory speed on an AVX2 CPU without bf16
instructions (``aten._weight_int4pack_mm_for_cpu`` is bound by its arithmetic there, FBGEMM's fp16
reads 16 bits a weight), and no maintained package ships one for torch's tensors: llama.cpp's
(ggml) are built for its own graph and file format. So pc-rag carries its own C, beside this file:

- ``block_kernels.c``: float32 activations times 4-bit (Q4_1-style) or 8-bit (Q8_0-style) weights,
  every product exact in float32, and their dequantization (see its header for the layout);
- ``a8_kernels.c`` (+ ``a8_products.h``): the same weights times inputs rounded to 8 bits a block,
  for ``weights="int4-a8"`` (AVX2, and AVX512-VNNI where the CPU has it: the same bits);
- ``wide_kernels.c``: the float-input products in AVX-512 where the CPU has it (summed in 16 lanes);
- ``a16_kernels.c``: the 4-bit weights times inputs rounded to 16 bits a block, for the C decode
  step under ``weights="int4"`` where the CPU has AVX512-VNNI;
- ``llama_step.c``: a Llama-family decode step over them in one call (:mod:`pc_rag.forward.fused_step`),
  with its own threads (``thread_pool.c``).

Where the library comes from is :mod:`.build`'s job (built at install, else here once). Loaded, it
is checked before use, once a process and under a lock (two threads' first calls wait for one
check): the step's structures laid out as :mod:`.step` expects, then products of random values
against torch's (one row and several). No library, no AVX2/FMA, a failed layout or check: :func:`library`
returns None, logs why once, and ``weights="int4"`` uses torch's 4-bit kernel instead
(:mod:`pc_rag.weights.int4`). A run-time build that fails its check is deleted and built again once,
and the new file is loaded under a name of its own (the dynamic loader hands back the library already
mapped under a path it has seen).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ..errors import PromptCacheError
from . import build
from .products import BLOCK, a8_matmul, a16_matmul, pack_nibbles, q4_matmul, q8_matmul, quantized_inputs
from .step import layout_agrees

logger = logging.getLogger(__name__)

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {
    "q4_matmul": [_P, _I64, _I64, _P, _P, _P, _I64, _P, _P, _P, ctypes.c_int],
    "q8_matmul": [_P, _I64, _I64, _P, _P, _I64, _P, _P, ctypes.c_int],
    "q4a8_matmul": [_P, _I64, _I64, _P, _P, _P, _I64, _P, _P, _P, ctypes.c_int],
    "q8a8_matmul": [_P, _I64, _I64, _P, _P, _I64, _P, _P, _P, ctypes.c_int],
    "q4_dequantize": [_P, _P, _P, _I64, _I64, _I64, _P, ctypes.c_int],
    "q8_dequantize": [_P, _P, _I64, _I64, _I64, _P, ctypes.c_int],
    "a8_vnni": [ctypes.c_int],
    "wide_kernels": [ctypes.c_int],
    "a16_kernels": [ctypes.c_int],
    "a16_matmul": [_P, _I64, _I64, _P, _P, _P, _I64, _P, _P, _P, ctypes.c_int],
    "llama_step": [_P],
    "llama_step_work": [_P],
}
RESULTS = {"llama_step": ctypes.c_int, "llama_step_work": _I64, "a8_vnni": ctypes.c_int, "wide_kernels": ctypes.c_int,
           "a16_kernels": ctypes.c_int}
# PC_RAG_KERNELS=address: a separate build under AddressSanitizer (tests/test_sanitized.py runs the kernels'
# tests on it, the process started with libasan preloaded)
SANITIZED = ("-fsanitize=address", "-fno-omit-frame-pointer", "-g")
_CHECKING = threading.Lock()  # one agreement check at a time: it switches kernel forms on the shared library
_LOADED: dict[str, ctypes.CDLL | None] = {}  # "library": what library() answers, once loaded


def cpu_supported() -> bool:
    """An x86-64 CPU with AVX2 and FMA (torch's own dispatch level says so)."""
    return platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def library() -> ctypes.CDLL | None:
    """The kernels, loaded and checked once a process (:func:`load`), or None."""
    try:
        return _LOADED["library"]
    except KeyError:
        pass
    with _CHECKING:  # concurrent first calls: one loads and checks, the others wait for its answer
        if "library" not in _LOADED:
            _LOADED["library"] = load()
        return _LOADED["library"]


def forget() -> None:
    """Load again at the next :func:`library` call (tests: other settings, another cache folder)."""
    with _CHECKING:
        _LOADED.clear()


def load() -> ctypes.CDLL | None:
    """The installed library where it matches the sources, else one built here; checked; None (logged)
    where none can be had. A run-time build that fails to load or to agree is deleted and built again, once."""
    choice = os.environ.get("PC_RAG_KERNELS", "")
    if choice == "off":
        logger.info("pc-rag's kernels not used: PC_RAG_KERNELS=off")
        return None
    if not cpu_supported():
        logger.info("pc-rag's kernels not used: this CPU has no AVX2/FMA (%s)", torch.backends.cpu.get_cpu_capability())
        return None
    if choice not in ("build", "address"):
        installed = _installed()
        if installed is not None:
            return installed
    return _built(SANITIZED if choice == "address" else ())


def load_file(path: str | os.PathLike) -> ctypes.CDLL:
    """The kernels library at ``path`` (another checkout's build: benchmarks alternate it with this one's
    in one process), loaded from a private copy, typed and checked as :func:`load` checks its own; a
    library that does not load or check out raises :class:`~pc_rag.errors.PromptCacheError`."""
    try:
        lib = _load(Path(path), private_copy=True)
    except OSError as err:
        raise PromptCacheError(f"the kernels at {path} do not load: {err}") from err
    problem = _problem(lib)
    if problem is not None:
        raise PromptCacheError(f"the kernels at {path} cannot be used: {problem}")
    return lib


def _installed() -> ctypes.CDLL | None:
    """The library ``pip install`` built, where it is there, built from these sources, and checks out."""
    path = build.installed_path()
    if not path.is_file():
        return None
    try:
        lib = _load(path)
    except OSError as err:
        logger.warning("pc-rag's installed kernels at %s do not load (%s); building them here", path, err)
        return None
    source_key = getattr(lib, "pc_rag_source_key", None)
    if source_key is None:
        return None
    source_key.restype = ctypes.c_char_p
    if source_key().decode() != build.source_key():
        logger.info("pc-rag's installed kernels were built from other sources (an edited checkout): building them here")
        return None
    problem = _problem(lib)
    if problem is not None:
        logger.warning("pc-rag's installed kernels at %s rejected (%s); building them here", path, problem)
        return None
    return lib


def _built(extra: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    cc = build.compiler()
    if cc is None:
        logger.warning("pc-rag's kernels not built: no C compiler (set $CC) and no installed library; "
                       "weights=\"int4\" uses torch's 4-bit kernel")
        return None
    problem = ""
    for attempt in range(2):
        target = None
        try:
            target = build.built(cc, extra=extra)
            lib = _load(target, private_copy=attempt > 0)
            problem = _problem(lib)
            if problem is None:
                return lib
        except (OSError, subprocess.SubprocessError) as err:
            problem = getattr(err, "stderr", None) or str(err)
        if attempt == 0 and target is not None:
            logger.warning("pc-rag's kernels at %s rejected (%s); building them again", target, problem)
            target.unlink(missing_ok=True)
    logger.warning("pc-rag's kernels not used (%s); weights=\"int4\" uses torch's 4-bit kernel", problem)
    return None


def _load(path: Path, *, private_copy: bool = False) -> ctypes.CDLL:
    """``path`` loaded, its functions typed. ``private_copy``: from a copy under a new name, so a file
    rebuilt at a path this process loaded before is the one that runs."""
    if private_copy:
        folder = Path(tempfile.mkdtemp(prefix="pc-rag-kernels-"))
        copy = folder / path.name
        shutil.copyfile(path, copy)
        path = copy
    lib = ctypes.CDLL(str(path))
    for name, arguments in SIGNATURES.items():
        getattr(lib, name).argtypes = arguments
        getattr(lib, name).restype = RESULTS.get(name)
    return lib


def _problem(lib: ctypes.CDLL) -> str | None:
    """Why ``lib`` cannot be used (None: it can): its step structures' layout, then its products."""
    if not hasattr(lib, "llama_step_layout"):
        return "it reports no layout of the step's structures"
    return layout_agrees(lib) or (None if _agrees(lib) else "it disagrees with torch on a random product")


def _agrees(lib: ctypes.CDLL) -> bool:
    """4-bit and 8-bit products of random values against torch's, to float rounding, at one row and at
    several (the kernels take other paths for each): the AVX2 forms, then the AVX-512 ones
    (``wide_kernels.c``) and the C step's 16-bit-input 4-bit product (``a16_kernels.c``, against torch on
    the inputs as it rounds them) where the CPU has them, each kept only if it agrees too."""
    generator = torch.Generator().manual_seed(0)
    q4 = torch.randint(0, 16, (6, 64), generator=generator)
    d, m = torch.rand(6, 2, generator=generator), torch.randn(6, 2, generator=generator)
    weight = q4.float() * d.repeat_interleave(BLOCK, 1) + m.repeat_interleave(BLOCK, 1)
    q8 = torch.randint(-127, 128, (6, 64), generator=generator, dtype=torch.int8)
    weight8 = q8.float() * d.repeat_interleave(BLOCK, 1)
    words = pack_nibbles(q4)
    inputs = [torch.randn(rows, 64, generator=generator) for rows in (1, 3, 9)]

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.allclose(a, b, rtol=1e-4, atol=1e-4)

    def float_inputs_agree() -> bool:
        return all(close(q4_matmul(x, words, d, m, None, lib=lib), x @ weight.t()) and close(q8_matmul(x, q8, d, None, lib=lib), x @ weight8.t())
                   for x in inputs)

    lib.wide_kernels(0)
    if not float_inputs_agree() or not all(  # the 8-bit-input kernels: exact products of the inputs as they round them
            close(a8_matmul(x, words, d, m, None, lib=lib), quantized_inputs(x) @ weight.t())
            and close(a8_matmul(x, q8, d, None, None, lib=lib), quantized_inputs(x) @ weight8.t()) for x in inputs):
        return False
    if lib.wide_kernels(1) and not float_inputs_agree():
        logger.warning("pc-rag's kernels: the AVX-512 products disagree with torch on a random product; using the AVX2 ones")
        lib.wide_kernels(0)
    if lib.a16_kernels(1) and not all(close(a16_matmul(x, words, d, m, None, lib=lib), quantized_inputs(x, bits=16) @ weight.t())
                                      for x in inputs):
        logger.warning("pc-rag's kernels: the 16-bit-input products disagree with torch on a random product; the C step keeps float inputs")
        lib.a16_kernels(0)
    return True

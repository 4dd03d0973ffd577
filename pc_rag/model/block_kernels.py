"""pc-rag's own CPU kernels for weights in blocks of 32 (``block_kernels.c``), built on first use.

torch has no kernel that streams 4-bit weights at memory speed on an AVX2 CPU without bf16
instructions (``aten._weight_int4pack_mm_for_cpu`` is bound by its arithmetic there, FBGEMM's fp16
reads 16 bits a weight), and no maintained package ships one for torch's tensors: llama.cpp's
(ggml) are built for its own graph and file format. So pc-rag carries ~200 lines of C: float32
activations times 4-bit (Q4_1-style) or 8-bit (Q8_0-style) weights, every product exact in
float32, and their dequantization (see the C file's header for the layout); ~150 more
(``a8_kernels.c``): the same weights times inputs rounded to 8 bits a block, for ``weights="int4-a8"``
(AVX2, and AVX512-VNNI where the CPU has it: the same bits); ~200 more (``wide_kernels.c``): the
float-input products in AVX-512 where the CPU has it (the same products, summed in 16 lanes); ~150
more (``a16_kernels.c``): the 4-bit weights times inputs rounded to 16 bits a block, for the C decode
step under ``weights="int4"`` where the CPU has AVX512-VNNI; and ~300 more (``llama_step.c``): a
Llama-family decode step over them in one call (:mod:`pc_rag.model.fused_step`), with its own
threads (``thread_pool.c``).

The source is compiled once per source, flags and compiler with the system C compiler (``$CC``,
else ``cc``/``gcc``) into pc-rag's cache folder, written to a temporary name and renamed (so a
half-written library is never loaded), and checked on load against torch on a random product. No
compiler, no AVX2/FMA, a failed build or a failed check: :func:`library` returns None, logs why,
and ``weights="int4"`` uses torch's 4-bit kernel instead (:mod:`pc_rag.model.int4`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .loading import cache_root

logger = logging.getLogger(__name__)

# the products (and their dequantization), the Llama decode step built on them (pc_rag.model.fused_step)
# and the step's threads
SOURCES = tuple(Path(__file__).with_name(name) for name in ("block_kernels.c", "a8_kernels.c", "wide_kernels.c", "a16_kernels.c",
                                                                  "llama_step.c", "thread_pool.c"))
# what they call of each other; a8_kernels.c's products, included once per instruction set
HEADERS = tuple(Path(__file__).with_name(name) for name in ("block_kernels.h", "a8_products.h"))
# a16_kernels.c's prepared input, a block of 32: its 16-bit values as two signed bytes each (64) and 5 floats
A16_BYTES_PER_BLOCK = 84
FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-std=c11", "-fopenmp", "-pthread")
LIBRARIES = ("-lm",)  # after the sources: expf and sqrtf of the decode step
BLOCK = 32  # weights per scale (and minimum): GGUF's Q4_1 and Q8_0 blocks
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


def cpu_supported() -> bool:
    """An x86-64 CPU with AVX2 and FMA (torch's own dispatch level says so)."""
    return platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def compiler() -> str | None:
    """The C compiler to build with: ``$CC``, else ``cc`` or ``gcc`` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels (built and checked once a process: :func:`load`), or None."""
    return load()


def load() -> ctypes.CDLL | None:
    """Build (or find built) and load the kernels, checked against torch; None (logged) where they
    cannot be built or fail their check. A cached library that fails to load or to agree is
    deleted and built again, once."""
    if not cpu_supported():
        logger.info("block kernels not used: this CPU has no AVX2/FMA (%s)", torch.backends.cpu.get_cpu_capability())
        return None
    cc = compiler()
    if cc is None:
        logger.warning("block kernels not built: no C compiler (set $CC); weights=\"int4\" uses torch's 4-bit kernel")
        return None
    problem = ""
    for attempt in range(2):
        target = None
        try:
            target = _built(cc)
            lib = _load(target)
            if _agrees(lib):
                return lib
            problem = f"{target} disagrees with torch on a random product"
        except (OSError, subprocess.SubprocessError) as err:
            problem = getattr(err, "stderr", None) or str(err)
        if attempt == 0 and target is not None:
            logger.warning("block kernels at %s rejected (%s); building them again", target, problem)
            target.unlink(missing_ok=True)
    logger.warning("block kernels not used (%s); weights=\"int4\" uses torch's 4-bit kernel", problem)
    return None


def _built(cc: str) -> Path:
    """The shared library for this source, flags and compiler: built once, renamed into place whole."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS)) + repr((FLAGS, LIBRARIES, cc, version)).encode()).hexdigest()[:20]
    folder = cache_root() / "kernels"
    target = folder / f"block_kernels-{key}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        partial = Path(work) / target.name
        logger.info("building %s with %s", ", ".join(source.name for source in SOURCES), cc)
        subprocess.run([cc, *FLAGS, "-o", str(partial), *map(str, SOURCES), *LIBRARIES], check=True, capture_output=True, text=True, timeout=300)
        os.replace(partial, target)
    return target


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, arguments in SIGNATURES.items():
        getattr(lib, name).argtypes = arguments
        getattr(lib, name).restype = RESULTS.get(name)
    return lib


def _agrees(lib: ctypes.CDLL) -> bool:
    """A 4-bit and an 8-bit product of random values against torch's, to float rounding: the AVX2
    forms, then the AVX-512 ones (``wide_kernels.c``) and the C step's 16-bit-input 4-bit product
    (``a16_kernels.c``, against torch on the inputs as it rounds them) where the CPU has them, each kept
    only if it agrees too."""
    generator = torch.Generator().manual_seed(0)
    q4 = torch.randint(0, 16, (6, 64), generator=generator)
    d, m = torch.rand(6, 2, generator=generator), torch.randn(6, 2, generator=generator)
    x = torch.randn(3, 64, generator=generator)
    weight = q4.float() * d.repeat_interleave(BLOCK, 1) + m.repeat_interleave(BLOCK, 1)
    q8 = torch.randint(-127, 128, (6, 64), generator=generator, dtype=torch.int8)
    weight8 = q8.float() * d.repeat_interleave(BLOCK, 1)

    def float_inputs_agree() -> bool:
        return all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in (
            (q4_matmul(x, pack_nibbles(q4), d, m, None, lib=lib), x @ weight.t()), (q8_matmul(x, q8, d, None, lib=lib), x @ weight8.t())))

    lib.wide_kernels(0)
    x8 = quantized_inputs(x)  # the 8-bit-input kernels: exact products of the inputs as they round them
    if not float_inputs_agree() or not all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in (
            (a8_matmul(x, pack_nibbles(q4), d, m, None, lib=lib), x8 @ weight.t()),
            (a8_matmul(x, q8, d, None, None, lib=lib), x8 @ weight8.t()))):
        return False
    if lib.wide_kernels(1) and not float_inputs_agree():
        logger.warning("block kernels: the AVX-512 products disagree with torch on a random product; using the AVX2 ones")
        lib.wide_kernels(0)
    if lib.a16_kernels(1) and not torch.allclose(a16_matmul(x, pack_nibbles(q4), d, m, None, lib=lib),
                                                 quantized_inputs(x, bits=16) @ weight.t(), rtol=1e-4, atol=1e-4):
        logger.warning("block kernels: the 16-bit-input products disagree with torch on a random product; the C step keeps float inputs")
        lib.a16_kernels(0)
    return True


def quantized_inputs(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """``x [rows, in]`` as the 8-bit-input kernels (``bits=16``: the 16-bit-input ones) read it: each
    block of 32 rounded (half to even) to ``round(x / s) * s``, ``s`` = its largest magnitude / 127
    (16 bits: / 32512, that is 127 * 256), in the kernels' float32 steps."""
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / {8: 127, 16: 32512}[bits]
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (torch.round(blocks * inverse) * scale).reshape(x.shape)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit values ``q [out, in]`` (0..15) as the kernels' words ``[out, in / 8]`` (int32 bits):
    weight ``8k + i`` of a block in bits ``4i..4i+3`` of its word ``k``, the top nibble stored ``q ^ 8``."""
    lanes = q.to(torch.int32).reshape(q.shape[0], -1, 8)
    words = lanes[..., 7] ^ 8
    for lane in range(6, -1, -1):  # int32 throughout (a quarter of int64's memory at install)
        words = (words << 4) | lanes[..., lane]
    return words.contiguous()


def q4_matmul(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor,
              bias: torch.Tensor | None, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x [rows, in] @ W^T (+ bias)`` for a 4-bit ``W`` (contiguous float32 inputs)."""
    lib = lib or library()
    rows, features = x.shape
    out = torch.empty(rows, scales.shape[0])
    scratch = torch.empty(rows * (features + 2 * features // BLOCK))
    lib.q4_matmul(x.data_ptr(), rows, features, words.data_ptr(), scales.data_ptr(), minimums.data_ptr(),
                  scales.shape[0], None if bias is None else bias.data_ptr(), out.data_ptr(), scratch.data_ptr(), torch.get_num_threads())
    return out


def q8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, *,
              lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x [rows, in] @ W^T (+ bias)`` for an 8-bit ``W`` (contiguous float32 inputs)."""
    lib = lib or library()
    rows, features = x.shape
    out = torch.empty(rows, q.shape[0])
    lib.q8_matmul(x.data_ptr(), rows, features, q.data_ptr(), scales.data_ptr(), q.shape[0],
                  None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def a8_matmul(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor | None,
              bias: torch.Tensor | None, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """:func:`q4_matmul` (``minimums`` given) or :func:`q8_matmul` on ``x`` rounded to 8 bits a block
    (:func:`quantized_inputs`), in integers: what the C decode step computes under ``weights="int4-a8"``."""
    lib = lib or library()
    rows, features = x.shape
    out = torch.empty(rows, scales.shape[0])
    scratch = torch.empty(rows * (features + 8 * features // BLOCK), dtype=torch.uint8)
    ends = (None if bias is None else bias.data_ptr(), out.data_ptr(), scratch.data_ptr(), torch.get_num_threads())
    if minimums is not None:
        lib.q4a8_matmul(x.data_ptr(), rows, features, values.data_ptr(), scales.data_ptr(), minimums.data_ptr(), scales.shape[0], *ends)
    else:
        lib.q8a8_matmul(x.data_ptr(), rows, features, values.data_ptr(), scales.data_ptr(), scales.shape[0], *ends)
    return out


def a16_matmul(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor,
               bias: torch.Tensor | None, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """:func:`q4_matmul` on ``x`` rounded to 16 bits a block (:func:`quantized_inputs` with ``bits=16``),
    in integers: what the C decode step computes under ``weights="int4"`` where ``a16_kernels`` says so
    (AVX512-VNNI; not to be called elsewhere)."""
    lib = lib or library()
    rows, features = x.shape
    out = torch.empty(rows, scales.shape[0])
    scratch = torch.empty(rows * A16_BYTES_PER_BLOCK * (features // BLOCK), dtype=torch.uint8)
    lib.a16_matmul(x.data_ptr(), rows, features, words.data_ptr(), scales.data_ptr(), minimums.data_ptr(), scales.shape[0],
                   None if bias is None else bias.data_ptr(), out.data_ptr(), scratch.data_ptr(), torch.get_num_threads())
    return out


def dequantize_into(out: torch.Tensor, start: int, stop: int, values: torch.Tensor, scales: torch.Tensor,
                    minimums: torch.Tensor | None) -> torch.Tensor:
    """Rows ``[start, stop)`` of a 4-bit (``minimums`` given) or 8-bit weight, float32, written into ``out``."""
    lib = library()
    features = scales.shape[1] * BLOCK
    if minimums is not None:
        lib.q4_dequantize(values.data_ptr(), scales.data_ptr(), minimums.data_ptr(), features, start, stop, out.data_ptr(),
                          torch.get_num_threads())
    else:
        lib.q8_dequantize(values.data_ptr(), scales.data_ptr(), features, start, stop, out.data_ptr(), torch.get_num_threads())
    return out

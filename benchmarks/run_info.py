"""What a benchmark result was measured with: the engine's settings, the device and the machine."""

from __future__ import annotations

import platform
import time
from typing import Any

import torch

from pc_rag import PromptCache


def cpu_name() -> str:
    """The CPU's model name and torch's instruction level on it (results from two hosts differ by both)."""
    try:
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.processor() or platform.machine()}, {torch.backends.cpu.get_cpu_capability()}"


def run_info(engine: PromptCache, model: str) -> dict[str, Any]:
    """The header of a result file (``model`` names the model as the result should show it)."""
    return {
        "model": model,
        "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads",
        "dtype": str(engine.dtype),
        "weights": getattr(engine, "weights", "float32"),  # commits before weights= read "float32"
        "encoding": engine.encoding,
        "recompute": engine.recompute,
        "recompute_tail": engine.recompute_tail,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }

"""Every architecture transformers builds as ``AutoModelForCausalLM``: served exactly, or refused.

For each model type in transformers' causal-LM mapping, a tiny random checkpoint is built from its
config class (sizes shrunk, norm weights and biases drawn away from their defaults so a skipped
layer or a wrong rotation shows) and handed to ``PromptCache``; then ``PromptCache.check()`` runs
every path the engine serves it by (a module in place with decode steps, every token recomputed,
batch rows sharing a moved module, a request joining running ones, each recovery strategy)
against what must equal it. Each type ends as one of:

- ``exact``: every path within 1e-3 in logits (or cleanly refused when the engine was built);
- ``refused``: ``PromptCache(model, tokenizer)`` raised a ``PromptCacheError`` that says why;
- ``not built``: no tiny checkpoint could be built from the config class alone (a vision, audio
  or encoder-decoder model, or a config this script does not know how to shrink);
- ``WRONG`` or ``RAISED``: a path differs, or a raw exception reached the caller (a bug).

    python benchmarks/architectures.py                  # every type (~15 minutes on 2 cores)
    python benchmarks/architectures.py llama gemma4_text
    python benchmarks/architectures.py --json benchmarks/results/architectures.json

Exits 1 when any type ends WRONG or RAISED.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from pc_rag import PromptCache, PromptCacheError
from pc_rag.model.loading import default_model_dir

# sizes every config gets where it has the attribute (through its attribute_map too)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=1024, n_positions=1024, moe_intermediate_size=32, num_experts=4,
             num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, shared_expert_intermediate_size=32,
             intermediate_size_mlp=128, sliding_window=8, attention_chunk_size=512, first_k_dense_replace=1,
             global_head_dim=32, hidden_size_per_layer_input=16, num_kv_shared_layers=0,
             bos_token_id=None, eos_token_id=None, use_cache=True, tie_word_embeddings=False, is_decoder=True)
MAX_PARAMETERS = 150_000_000


def tiny_config(model_type: str, vocab: int) -> Any:
    """The model type's config with every size shrunk (given to its constructor, so that what it
    derives from them follows); its ``text_config`` too where it has one."""
    config_class = CONFIG_MAPPING[model_type]
    text_config = getattr(config_class(), "text_config", None)
    if text_config is not None:
        return config_class(text_config=_shrunk(type(text_config), vocab).to_dict())
    return _shrunk(config_class, vocab)


# where the shared sizes would hide what the family is about
OVERRIDES = {"gemma3n_text": dict(num_hidden_layers=4, num_kv_shared_layers=2)}  # its last 2 layers read earlier layers' KV


def _shrunk(config_class: Any, vocab: int) -> Any:
    defaults = config_class().to_dict()
    aliases = getattr(config_class, "attribute_map", {}) or {}
    kwargs: dict[str, Any] = {}
    for key, value in {**SMALL, "vocab_size": vocab, "vocab_size_per_layer_input": vocab}.items():
        key = aliases.get(key, key)
        if key in defaults:
            kwargs[key] = value
    kwargs.update(OVERRIDES.get(defaults.get("model_type", ""), {}))
    layers_key = aliases.get("num_hidden_layers", "num_hidden_layers")
    old_layers, layers = defaults.get(layers_key), kwargs.get(layers_key)
    for key, old in defaults.items():
        if isinstance(old, list) and old_layers and len(old) == old_layers and layers:  # one entry per layer
            kwargs[key] = [kwargs[key]] * layers if key in kwargs else _spread(old, layers)
    if defaults.get("multi_query"):  # GPT-BigCode: one KV head, which its config states twice
        kwargs.pop("num_key_value_heads", None)
    if isinstance(defaults.get("pad_token_id"), int) and defaults["pad_token_id"] >= vocab:
        kwargs["pad_token_id"] = 0
    if "rotary_dim" in defaults:
        kwargs["rotary_dim"] = 8
    try:
        return config_class(**kwargs)
    except Exception:  # noqa: BLE001 - a config that validates its fields: its own token ids, every head a KV head
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            kwargs.pop(key, None)
        if "num_key_value_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
        return config_class(**kwargs)


def _spread(values: list, count: int) -> list:
    """``count`` entries of a per-layer list keeping each distinct kind it had (a local and a global layer)."""
    kinds = list(dict.fromkeys(map(str, values)))
    picked = [next(v for v in values if str(v) == kind) for kind in kinds][:count]
    return (picked * count)[:count]


def tiny(model_type: str, vocab: int) -> torch.nn.Module:
    config = tiny_config(model_type, vocab)
    with torch.device("meta"):  # sizes this script does not know how to shrink: counted before anything is allocated
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"{size / 1e6:.0f}M parameters after shrinking the sizes this script knows")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model


def run_one(model_type: str, tokenizer: Any) -> dict[str, Any]:
    started = time.perf_counter()
    row: dict[str, Any] = {"type": model_type}
    try:
        model = tiny(model_type, len(tokenizer))
    except Exception as err:  # noqa: BLE001 - a type this script cannot build is reported, not fatal
        return {**row, "outcome": "not built", "why": f"{type(err).__name__}: {str(err)[:160]}"}
    row["class"] = type(model).__name__
    try:
        engine = PromptCache(model, tokenizer)
    except PromptCacheError as err:
        return {**row, "outcome": "refused", "why": str(err)[:240], "s": round(time.perf_counter() - started, 1)}
    except Exception as err:  # noqa: BLE001 - a raw exception at build is the bug this script looks for
        return {**row, "outcome": "RAISED", "why": f"at build: {type(err).__name__}: {str(err)[:200]}"}
    try:
        report = engine.check(fidelity=False)
    finally:
        engine.scheduler.close(timeout=10.0)
        engine.background.close(timeout=10.0)
    failed = [f"{p.path}: {p.max_diff:.2g} {p.note}".strip() for p in report.paths if not p.passed]
    raised = any("raised" in p.note for p in report.paths if not p.passed)
    outcome = "exact" if report.exact else ("RAISED" if raised else "WRONG")
    notes = [f"{p.path}: {p.note}" for p in report.paths if p.passed and p.note]
    return {**row, "outcome": outcome, "why": "; ".join(failed or notes)[:400], "split": engine.split,
            "position_kind": engine.position_kind, "s": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("types", nargs="*", help="model types (default: every causal-LM type transformers knows)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore")
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    rows = []
    for model_type in args.types or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        rows.append(run_one(model_type, tokenizer))
        row = rows[-1]
        print(f"{row['type']:<28} {row['outcome']:<10} {row.get('class', ''):<36} {row.get('why', '')}", flush=True)
    counts = {outcome: sum(r["outcome"] == outcome for r in rows) for outcome in dict.fromkeys(r["outcome"] for r in rows)}
    print("summary:", counts)
    if args.json:
        args.json.write_text(json.dumps({"counts": counts, "rows": rows}, indent=1))
    return 1 if any(r["outcome"] in ("WRONG", "RAISED") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Answer fidelity of cached inference against full prefill, on real multi-document QA, in one run.

Every question becomes ``build_prompt(question + instruction, its passages)``: each passage a
document module, imported in the dataset's order; the question is the uncached text. Every
variant (a recovery strategy and budget) is compared with full prefill of the very same tokens,
on the same model object, record by record (full prefill and every variant of a record run
back to back, so machine noise hits them alike):

- first-token agreement with full prefill (all questions, and the *decisive* ones, where full
  prefill's first token leads the runner-up by >= 0.1 probability), the first token's KL
  divergence KL(full || cached) in nats;
- whole-answer agreement (greedy, up to 16 tokens, stop at a newline) and the token-F1 between
  the cached and the full answer; EM/F1 against the gold answers (SQuAD normalisation);
- mean time to first token and the speedup over full prefill's.

Sets (``benchmarks/data``, or ``--data DIR``; see its README): ``hotpotqa53`` (10 paragraphs), ``hotpotqa_more``
(190 more records), ``nq`` (NaturalQuestions-Open, 10 retrieved passages, Lost in the Middle),
``musique`` (20 paragraphs), ``squad10`` and ``squad3`` (SQuAD "Super_Bowl_50": each question
retrieves its top 10 / top 3 of the article's 54 paragraphs with ``FaissModuleRetriever``).

A variant is ``head_tail:H:T`` (recompute the first H and last T tokens of every moved module),
``query:B[:H:T][@L]`` or ``deviation:B[:H:T]`` (recompute the fraction B of the moved tokens that
the strategy scores highest, plus H head and T tail tokens per module; ``@L``: the question's
attention is read from the first L layers); any of them ``~T,S`` adds APE's attention temperature
T and scale S; ``default`` is the engine's.

    python benchmarks/quality.py --sets hotpotqa_more --first 40 --variants head_tail:0:0 query:0.05 ...   # the sweep
    python benchmarks/quality.py                                                                            # the report
    python benchmarks/quality.py --merge a.json b.json --out merged.json --plot                             # runs merged

Writes ``benchmarks/results/quality.json`` and ``quality.md`` (and with ``--plot``, the
frontier plot ``quality_frontier.png``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import platform
import re
import statistics
import string
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from pc_rag import PromptCache, build_prompt
from pc_rag.prefill.recovery import Recovery
from pc_rag.prompt.documents import module_name
from pc_rag.weights.choice import WEIGHTS

INSTRUCTION = "\nAnswer with only the answer, in a few words."
DECISIVE = 0.1  # full prefill's first token leads the runner-up by this much probability
ROOT = Path(__file__).resolve().parents[1]
SETS = ("hotpotqa53", "hotpotqa_more", "nq", "musique", "squad10", "squad3")


# --- SQuAD metrics ---------------------------------------------------------------------------
def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation, articles and extra whitespace (the official SQuAD script's rule)."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred and not ref:
        return 1.0
    common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def best(metric: Any, prediction: str, golds: list[str]) -> float:
    return max(float(metric(prediction, g)) for g in golds)


def exact(prediction: str, gold: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(gold)


# --- data --------------------------------------------------------------------------------------
@dataclass
class Record:
    question: str
    passages: list[str]
    answers: list[str]


def load(name: str, data: Path, first: int | None, skip: int) -> Iterator[Record] | list[Record]:
    if name == "hotpotqa53":
        rows = [json.loads(line) for line in (data / "hotpotqa_dev_distractor_53.jsonl").read_text().splitlines()]
        records = [Record(r["question"], [f"{t}: {''.join(s).strip()}" for t, s in r["context"]], [r["answer"]]) for r in rows]
    elif name in ("hotpotqa_more", "nq", "musique"):
        file = {"hotpotqa_more": "hotpotqa_dev_distractor_more.jsonl", "nq": "nq_open_10docs_dev.jsonl",
                "musique": "musique_ans_dev_20docs.jsonl"}[name]
        rows = [json.loads(line) for line in (data / file).read_text().splitlines()]
        records = [Record(r["question"], [f"{p['title']}: {p['text']}".strip() for p in r["passages"]], list(r["answers"])) for r in rows]
    else:
        raise ValueError(name)
    return records[skip:][:first] if first else records[skip:]


def squad_records(engine: PromptCache, data: Path, k: int, first: int | None, skip: int, spread: int) -> tuple[list[Record], float, list[str]]:
    """SQuAD questions spread over the article, each with its top-``k`` paragraphs; recall@k; the
    article's paragraphs (the corpus neighbours come from)."""
    from pc_rag.retrievers import FaissModuleRetriever

    article = json.loads((data / "squad_v1.1_dev_super_bowl_50.json").read_text())["data"]
    paragraphs = [p for a in article for p in a["paragraphs"]]
    pairs = [(i, qa) for i, p in enumerate(paragraphs) for qa in p["qas"]]
    pairs = pairs[:: max(1, len(pairs) // spread)][:spread]  # deterministic, over the whole article
    pairs = pairs[skip:][:first] if first else pairs[skip:]
    retriever = FaissModuleRetriever(engine=None)  # search only: each variant encodes the article as it needs (timed)
    retriever.add([p["context"] for p in paragraphs], progress=False)
    records, hits = [], 0
    for index, qa in pairs:
        texts = [h.text for h in retriever.search(qa["question"], k=k)]
        hits += paragraphs[index]["context"] in texts
        records.append(Record(qa["question"], texts, [a["text"] for a in qa["answers"]]))
    return records, 100 * hits / max(1, len(pairs)), [p["context"] for p in paragraphs]


# --- variants ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Documents:
    """How a variant's documents are encoded and placed: behind ``neighbours`` neighbours (whole,
    or first ``sentences``), and (``reorder``) the prompt reordered to follow them."""

    neighbours: int = 0
    sentences: bool = False
    reorder: bool = False
    traffic: bool = False  # neighbours from traffic: the paragraphs other questions' prompts put right before each one

    @property
    def collection(self) -> str:
        if self.traffic:
            return f"tr{self.neighbours}"
        return "docs" if not self.neighbours else f"nb{self.neighbours}{'s' if self.sentences else ''}"

    @property
    def label(self) -> str:
        if not self.neighbours:
            return ""
        if self.traffic:
            return f" + {self.neighbours} neighbours from traffic"
        form = "first sentences" if self.sentences else "whole"
        return f" + {self.neighbours} neighbours ({form}){' reordered' if self.reorder else ''}"


def variant(spec: str, engine: PromptCache) -> tuple[str, tuple[Recovery, Documents]]:
    """``head_tail:H:T``, ``query:B[:H:T]``, ``deviation:B[:H:T]`` or ``default``; ``#nbK[s][r]``:
    documents encoded behind K neighbours (``s``: their first sentences; ``r``: prompt reordered)."""
    spec, _, mode = spec.partition("#")
    documents = Documents()
    if mode:
        m = re.fullmatch(r"nb(\d+)(s?)(r?)", mode)
        t = re.fullmatch(r"tr(\d+)", mode)
        if m is None and t is None:
            raise argparse.ArgumentTypeError(f"bad documents mode {mode!r}: nbK, nbKs, nbKr, nbKsr or trK (SQuAD only)")
        documents = Documents(int(t.group(1)), traffic=True) if t else Documents(int(m.group(1)), bool(m.group(2)), bool(m.group(3)))
    name, recovery = _recovery(spec, engine)
    return name + documents.label, (recovery, documents)


def _recovery(spec: str, engine: PromptCache) -> tuple[str, Recovery]:
    if spec == "default":
        r = engine.recovery
        return f"default ({describe(r)})", r
    spec, _, ape = spec.partition("~")  # ~T,S: APE's attention temperature and scale on top
    spec, _, layers = spec.partition("@")  # query:B@L reads the question's attention in the first L layers
    parts = spec.split(":")
    try:
        if parts[0] == "head_tail" and len(parts) == 3:
            r = Recovery("head_tail", 0, int(parts[1]), int(parts[2]))
        elif parts[0] in ("query", "deviation") and len(parts) in (2, 4):
            head, tail = (int(parts[2]), int(parts[3])) if len(parts) == 4 else (0, 0)
            r = Recovery(parts[0], float(parts[1]), head, tail, query_layers=int(layers) if layers else None)  # type: ignore[arg-type]
        else:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad variant {spec!r}: head_tail:H:T, query:B[:H:T], deviation:B[:H:T] or default") from None
    if ape:
        temperature, scale = (float(x) for x in ape.split(","))
        r = dataclasses.replace(r, temperature=temperature, scale=scale)
    return describe(r), r


def describe(r: Recovery) -> str:
    if r.strategy == "head_tail":
        return ("paper (no recovery)" if not (r.head or r.tail) else f"head_tail {r.head}+{r.tail}") + _ape(r)
    extra = f" +{r.head}/{r.tail}" if r.head or r.tail else ""
    layers = f" @{r.query_layers} layers" if r.strategy == "query" and r.query_layers else ""
    return f"{r.strategy} {100 * float(r.budget):g}%{extra}{layers}{_ape(r)}"


def _ape(r: Recovery) -> str:
    return f", APE T={r.temperature:g} S={r.scale:g}" if r.adjusts_attention else ""


# --- runs --------------------------------------------------------------------------------------
def answer(engine: PromptCache, prompt: str, *, use_cache: bool, max_new_tokens: int) -> dict[str, Any]:
    result = engine.generate(prompt, max_new_tokens=max_new_tokens, use_cache=use_cache, stop=["\n"], output_logits=True)
    assert result.logits
    return {"text": result.text.strip(), "tokens": result.token_ids, "ttft_s": result.stats.ttft_s,
            "logprobs": result.logits[0].log_softmax(-1), "computed": result.stats.computed_tokens,
            "prompt": result.stats.cached_tokens + result.stats.computed_tokens}


def margin(logprobs: torch.Tensor) -> float:
    """How much probability the top token has over the runner-up."""
    first, second = logprobs.exp().topk(2).values
    return float(first - second)


def compare(got: dict[str, Any], full: dict[str, Any], golds: list[str]) -> dict[str, Any]:
    f = full["logprobs"]
    return {
        "agree": got["tokens"][:1] == full["tokens"][:1],
        "decisive": margin(f) >= DECISIVE,
        "kl": float((f.exp() * (f - got["logprobs"])).sum()),
        "answer_agree": got["tokens"] == full["tokens"],
        "answer_f1": f1_score(got["text"], full["text"]),
        "em": best(exact, got["text"], golds),
        "f1": best(f1_score, got["text"], golds),
        "ttft_s": got["ttft_s"],
        "computed": got["computed"],
        "prompt": got["prompt"],
        "text": got["text"],
    }


def summarize(rows: list[dict[str, Any]], full_ttft: float) -> dict[str, Any]:
    n = len(rows)
    decisive = [r for r in rows if r["decisive"]]
    ttft = statistics.mean(r["ttft_s"] for r in rows)
    return {
        "questions": n,
        "first_token_agreement": 100 * sum(r["agree"] for r in rows) / n,
        "decisive_questions": len(decisive),
        "decisive_agreement": 100 * sum(r["agree"] for r in decisive) / max(1, len(decisive)),
        "first_token_kl": statistics.mean(r["kl"] for r in rows),
        "answer_agreement": 100 * sum(r["answer_agree"] for r in rows) / n,
        "answer_f1_vs_full": 100 * statistics.mean(r["answer_f1"] for r in rows),
        "em": 100 * statistics.mean(r["em"] for r in rows),
        "f1": 100 * statistics.mean(r["f1"] for r in rows),
        "computed_fraction": 100 * statistics.mean(r["computed"] / r["prompt"] for r in rows),
        "mean_ttft_ms": 1000 * ttft,
        "speedup": full_ttft / ttft,
    }


def traffic_neighbours(traffic: list[Record], k: int) -> dict[str, list[str]]:
    """Context from traffic: each paragraph's ``k`` most frequent predecessors in the prompts of
    ``traffic`` (other questions over the same article, their passages in retrieval order),
    by text, the most frequent last (right before it)."""
    before: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for record in traffic:
        for previous, text in zip(record.passages, record.passages[1:]):
            before[text][previous] += 1
    return {text: [p for p, _ in counts.most_common(k)][::-1] for text, counts in before.items()}


def run_set(engine: PromptCache, records: list[Record], variants: list[tuple[str, tuple[Recovery, Documents]]], max_new: int, desc: str,
            *, drop: bool, corpus: list[str] | None = None, traffic: list[Record] | None = None) -> dict[str, Any]:
    """Each record: its passages registered, full prefill, every variant; then (``drop``) its KV
    dropped, to bound memory (a corpus shared by the records, SQuAD's, stays).

    With a ``corpus`` (SQuAD's article), every documents mode encodes the whole corpus once (timed),
    neighbour modes each paragraph behind its nearest paragraphs of the article, as a deployment
    would; a record's retrieved passages are then looked up in it. Without one, a record's passages are the pool
    their neighbours come from (the distractor setting's)."""
    per_variant: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in variants}
    full_rows: list[dict[str, Any]] = []
    lengths = []
    encode_s: dict[str, list[float]] = collections.defaultdict(list)  # per document, per documents mode
    modes = {Documents(): None, **{documents: None for _, (_, documents) in variants}}
    in_corpus: dict[str, dict[str, str]] = {}  # collection -> paragraph text -> its name there
    for documents in modes if corpus else ():
        if documents.collection not in in_corpus:
            started = time.perf_counter()
            context = {"context": "neighbour_sentences" if documents.sentences else "neighbours",
                       "neighbours": documents.neighbours} if documents.neighbours else {}
            if documents.traffic:  # the same encoding, behind the paragraphs traffic put before each one
                ids = [module_name(None, text) for text in corpus]
                chosen = traffic_neighbours(traffic or [], documents.neighbours)
                context["neighbours"] = {module_name(None, t): [module_name(None, p) for p in chosen[t]] for t in corpus if chosen.get(t)}
            names = engine.add_documents(corpus, progress=False, schema=documents.collection, **context,
                                         **({"ids": ids} if documents.traffic else {}))
            encode_s[documents.collection].append((time.perf_counter() - started) / len(corpus))
            in_corpus[documents.collection] = dict(zip(corpus, names))
    for record in tqdm(records, desc=desc, unit="question"):
        named: dict[str, list[str]] = {}
        for documents in modes:
            if documents.collection in named:
                continue
            if documents.collection in in_corpus:
                named[documents.collection] = [in_corpus[documents.collection][text] for text in record.passages]
                continue
            started = time.perf_counter()
            if documents.neighbours:
                # the record's passages are the corpus its neighbours come from (the distractor
                # setting's retrieval pool): the previous record's are deleted first
                held = engine.schemas.get(documents.collection)
                if held is not None and held.documents:
                    engine.delete_documents(list(held.documents), schema=documents.collection)
                named[documents.collection] = engine.add_documents(
                    record.passages, progress=False, schema=documents.collection,
                    context="neighbour_sentences" if documents.sentences else "neighbours", neighbours=documents.neighbours)
            else:
                named[documents.collection] = engine.add_documents(record.passages, progress=False)
            encode_s[documents.collection].append((time.perf_counter() - started) / len(record.passages))
        names = named["docs"]
        prompt = build_prompt(record.question + INSTRUCTION, names)
        full = answer(engine, prompt, use_cache=False, max_new_tokens=max_new)
        full_rows.append(compare(full, full, record.answers))
        lengths.append(full["prompt"])
        fulls = {str(prompt): full}
        for name, (recovery, documents) in variants:
            engine.recovery = recovery
            asked = build_prompt(record.question + INSTRUCTION, named[documents.collection], schema=documents.collection,
                                 reorder=documents.reorder, engine=engine)
            # the same tokens as the baseline's prompt unless reordered: then full prefill of the reordered prompt
            key = str(asked).replace(f'schema="{documents.collection}"', 'schema="docs"')
            if key not in fulls:
                fulls[key] = answer(engine, asked, use_cache=False, max_new_tokens=max_new)
            per_variant[name].append(compare(answer(engine, asked, use_cache=True, max_new_tokens=max_new), fulls[key], record.answers))
        if drop:
            engine.store.clear_memory()  # this record's passages are not read again
    full_ttft = statistics.mean(r["ttft_s"] for r in full_rows)
    result = {"questions": len(records), "mean_prompt_tokens": statistics.mean(lengths),
              "variants": {"full prefill": summarize(full_rows, full_ttft)},
              "encode_ms_per_document": {mode: 1000 * statistics.mean(times) for mode, times in encode_s.items()}}
    for name, rows in per_variant.items():
        result["variants"][name] = summarize(rows, full_ttft)
    result["outputs"] = {"full prefill": [r["text"] for r in full_rows], **{n: [r["text"] for r in rows] for n, rows in per_variant.items()}}
    result["gold"] = [r.answers for r in records]
    return result


def pool(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One set's runs over disjoint records (``--skip``/``--first`` ranges), pooled as if one run:
    every mean weighted by its questions (decisive agreement by its decisive questions), the
    speedup from the pooled mean TTFTs."""
    parts = sorted(parts, key=lambda part: part.get("skip") or 0)
    total = sum(part["questions"] for part in parts)

    def mean(values: list[tuple[float, int]]) -> float:
        weight = sum(w for _, w in values)
        return sum(v * w for v, w in values) / weight if weight else 0.0

    variants: dict[str, dict[str, Any]] = {}
    for name in [name for name in parts[0]["variants"] if all(name in part["variants"] for part in parts)]:  # run in every part
        rows = [part["variants"][name] for part in parts]
        pooled = {key: mean([(row[key], row["questions"]) for row in rows])
                  for key in ("first_token_agreement", "first_token_kl", "answer_agreement", "answer_f1_vs_full", "em", "f1",
                              "computed_fraction", "mean_ttft_ms")}
        pooled["questions"] = total
        pooled["decisive_questions"] = sum(row["decisive_questions"] for row in rows)
        pooled["decisive_agreement"] = mean([(row["decisive_agreement"], row["decisive_questions"]) for row in rows])
        variants[name] = pooled
    for pooled in variants.values():
        pooled["speedup"] = variants["full prefill"]["mean_ttft_ms"] / pooled["mean_ttft_ms"]
    modes = {mode for part in parts for mode in part.get("encode_ms_per_document", {})}
    return {"questions": total, "skip": parts[0].get("skip"), "first": total,
            "mean_prompt_tokens": mean([(part["mean_prompt_tokens"], part["questions"]) for part in parts]),
            "encode_ms_per_document": {mode: mean([(part["encode_ms_per_document"][mode], part["questions"])
                                                   for part in parts if mode in part.get("encode_ms_per_document", {})])
                                       for mode in modes},
            "variants": variants,
            "outputs": {name: [text for part in parts for text in part["outputs"][name]] for name in variants},
            "gold": [answers for part in parts for answers in part["gold"]],
            **({"recall": mean([(part["recall"], part["questions"]) for part in parts])} if "recall" in parts[0] else {})}


# --- report ------------------------------------------------------------------------------------
def markdown(report: dict[str, Any]) -> str:
    lines = []
    for name, part in report["sets"].items():
        extra = f", recall@k {part['recall']:.0f}%" if "recall" in part else ""
        if part.get("skip") or part.get("first"):
            skip = part.get("skip") or 0
            extra += f", records {skip + 1}-{skip + part['questions']}"
        lines += [f"**{name}** ({part['questions']} questions, {part['mean_prompt_tokens']:.0f} prompt tokens on average{extra})", "",
                  "| variant | first token = full | decisive | first-token KL | answer = full | answer F1 vs full | EM | F1 | computed | mean TTFT | speedup |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for variant_name, v in part["variants"].items():
            lines.append(f"| {variant_name} | {v['first_token_agreement']:.1f}% | {v['decisive_agreement']:.1f}% "
                         f"({v['decisive_questions']}) | {v['first_token_kl']:.3f} | {v['answer_agreement']:.1f}% | "
                         f"{v['answer_f1_vs_full']:.1f} | {v['em']:.1f} | {v['f1']:.1f} | {v['computed_fraction']:.1f}% | "
                         f"{v['mean_ttft_ms']:.0f} ms | {v['speedup']:.1f}x |")
        lines.append("")
    lines.append(f"decisive: agreement on the questions (count in brackets) where full prefill's first token leads the runner-up "
                 f"by >= {DECISIVE} probability; KL: mean KL(full || cached) of the first token, nats; computed: share of the "
                 f"prompt's tokens computed (question, recovery).")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Per set: decisive agreement and KL against speedup, one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(report["sets"].items())
    fig, axes = plt.subplots(2, len(sets), figsize=(5 * len(sets), 7), squeeze=False)
    for column, (name, part) in enumerate(sets):
        families: dict[str, list[tuple[float, float, float]]] = collections.defaultdict(list)
        labels: list[tuple[float, float, float, str]] = []  # neighbour points: their k written beside them
        for variant_name, v in part["variants"].items():
            if variant_name == "full prefill":
                continue
            if variant_name.startswith("default (") and " neighbours (" not in variant_name:
                families["default (documents encoded alone)"].append((v["speedup"], v["decisive_agreement"], v["first_token_kl"]))
                continue
            family = variant_name.split(" ")[0]
            family = {"paper": "head_tail"}.get(family, family)
            if "/" in variant_name and family in ("query", "deviation"):
                family += " +head/tail"
            layers = re.search(r"@(\d+) layers", variant_name)
            if layers:
                family += f" @{layers.group(1)} layers"
            if "APE" in variant_name:
                family += " +APE (T, S varied)"
            context = re.search(r" \+ \d+ neighbours \((\w+ ?\w*)\)( reordered)?", variant_name)
            if context:  # documents encoded behind neighbours: a family per form (k varies along it)
                family = f"{family.split(' +')[0]} + neighbour context ({context.group(1)}{', reordered' if context.group(2) else ''})"
                k = re.search(r" \+ (\d+) neighbours", variant_name).group(1)  # type: ignore[union-attr]
                labels.append((v["speedup"], v["decisive_agreement"], v["first_token_kl"], f"k={k}"))
            families[family].append((v["speedup"], v["decisive_agreement"], v["first_token_kl"]))
            if family == "head_tail" and variant_name == "paper (no recovery)":
                for other in ("query", "deviation"):  # budget 0 of every strategy is the paper's scheme
                    families[other].append((v["speedup"], v["decisive_agreement"], v["first_token_kl"]))
        for family, points in sorted(families.items()):
            points.sort()
            xs = [p[0] for p in points]
            style = {"linestyle": "none", "marker": "*", "markersize": 9} if "APE" in family else {"marker": "o"}
            axes[0][column].plot(xs, [p[1] for p in points], label=family, **style)
            axes[1][column].plot(xs, [p[2] for p in points], label=family, **style)
        for x, decisive, kl, text in labels:
            axes[0][column].annotate(text, (x, decisive), fontsize=7, xytext=(3, 3), textcoords="offset points")
            axes[1][column].annotate(text, (x, kl), fontsize=7, xytext=(3, 3), textcoords="offset points")
        axes[0][column].set_title(f"{name} ({part['questions']} q.)")
        axes[0][column].set_ylabel("decisive first-token agreement (%)")
        axes[1][column].set_ylabel("first-token KL (nats)")
        for row in (0, 1):
            axes[row][column].set_xlabel("TTFT speedup over full prefill (x)")
            axes[row][column].axvline(10, color="grey", linestyle=":", linewidth=1)
            axes[row][column].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "data")
    parser.add_argument("--model", default=None, help="hub id or folder (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--sets", nargs="+", choices=SETS, default=list(SETS))
    parser.add_argument("--first", type=int, default=None, help="questions per set (default: all)")
    parser.add_argument("--skip", type=int, default=0, help="questions skipped at the start of each set")
    parser.add_argument("--squad-questions", type=int, default=100, help="SQuAD questions spread over the article")
    parser.add_argument("--variants", nargs="+", default=["head_tail:0:0", "head_tail:4:1", "default"])
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--kv-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="the engine's kv_dtype= (KV buffers and module KV; default: the model's dtype)")
    parser.add_argument("--weights", choices=WEIGHTS, default=None,
                        help="the engine's weights=, cached and full alike (default: from_pretrained's: int4 for the embedded model on a CPU)")
    parser.add_argument("--plot", action="store_true", help="also draw the frontier plot")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                        help="merge earlier runs (variants per set) into --out and its tables (and the plot with --plot), then exit")
    parser.add_argument("--pool", type=Path, nargs="+", metavar="JSON",
                        help="pool runs of the same sets over disjoint records (e.g. --skip 0 --first 20 and --skip 20 "
                             "--first 40) into --out and its tables, then exit")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quality.json")
    args = parser.parse_args()
    if args.pool:
        reports = [json.loads(file.read_text()) for file in args.pool]
        pooled: dict[str, Any] = {"pooled_from": [str(f) for f in args.pool], "sets": {}}
        for key in ("model", "device", "dtype", "machine", "greedy_max_new_tokens", "variants"):
            pooled[key] = reports[0].get(key)
        for name in reports[0]["sets"]:
            pooled["sets"][name] = pool([{**report["sets"][name], "skip": report["sets"][name].get("skip", report.get("skip"))}
                                         for report in reports if name in report["sets"]])
        args.out.write_text(json.dumps(pooled, indent=1))
        args.out.with_suffix(".md").write_text(markdown(pooled))
        print(markdown(pooled))
        return
    if args.merge:
        merged: dict[str, Any] = {"merged_from": [str(f) for f in args.merge], "sets": {}}
        for file in args.merge:
            report = json.loads(file.read_text())
            for key in ("model", "device", "dtype", "machine", "greedy_max_new_tokens"):
                merged.setdefault(key, report.get(key))
            for name, part in report["sets"].items():
                into = merged["sets"].setdefault(name, {**part, "variants": {}, "skip": report.get("skip"), "first": report.get("first")})
                into["variants"].update(part["variants"])
        args.out.write_text(json.dumps(merged, indent=1))
        if all(part.get("mean_prompt_tokens") for part in merged["sets"].values()):
            args.out.with_suffix(".md").write_text(markdown(merged))
        if args.plot:
            plot(merged, args.out.with_name(args.out.stem + "_frontier.png"))
        return

    engine = PromptCache.from_pretrained(args.model, device=args.device, weights=args.weights, kv_dtype=args.kv_dtype)
    variants = list(dict(variant(v, engine) for v in args.variants).items())
    started = time.time()
    report: dict[str, Any] = {
        "model": str(getattr(engine.model.config, "_name_or_path", "")),
        "device": str(engine.model.device),
        "dtype": str(engine.model.dtype),
        "weights": engine.weights,
        "kv_dtype": str(engine.spec.kv_dtype),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "greedy_max_new_tokens": args.max_new_tokens,
        "first": args.first,
        "skip": args.skip,
        "variants": args.variants,
        "sets": {},
    }
    warm = build_prompt("Warm-up?", engine.add_documents(["A warm-up passage.", "Another one."], progress=False))
    engine.generate(warm, max_new_tokens=2)
    for name in args.sets:
        recall, corpus = None, None
        traffic = None
        if name.startswith("squad"):
            records, recall, corpus = squad_records(engine, args.data, int(name[len("squad"):]), args.first, args.skip,
                                                    args.squad_questions)
            # repeated-topic traffic: the other questions over the same article (never the evaluated ones)
            every, _, _ = squad_records(engine, args.data, int(name[len("squad"):]), None, 0, args.squad_questions)
            asked = {r.question for r in records}
            traffic = [r for r in every if r.question not in asked]
        else:
            records = load(name, args.data, args.first, args.skip)
        part = run_set(engine, list(records), variants, args.max_new_tokens, name, drop=recall is None, corpus=corpus, traffic=traffic)
        part.update(skip=args.skip, first=args.first)
        if recall is not None:
            part["recall"] = recall
        report["sets"][name] = part
        report["wall_s"] = time.time() - started
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))  # after every set: a long run keeps what it measured
    table = markdown(report)
    args.out.with_suffix(".md").write_text(table)
    if args.plot:
        plot(report, args.out.with_name(args.out.stem + "_frontier.png"))
    print(table)


if __name__ == "__main__":
    main()

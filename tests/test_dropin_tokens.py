"""Drop-in reuse never changes the prompt's tokens: a plain prompt is tokenised once, as the
tokenizer would, and a stored module's KV is reused only where the prompt's tokens are its tokens.

The oracle is the model's own forward of ``tokenizer(prompt)``: full prefill through the engine
(``use_cache=False``) must equal it for every common way a RAG template puts documents in a
prompt, and the cache must still reuse most of each document."""

from __future__ import annotations

import pytest
import torch

from pc_rag import PromptCache

DOCS = [
    "Super Bowl 50 was an American football game to determine the champion of the National Football League for the 2015 season.",
    "Denver Broncos defeated the Carolina Panthers 24 to 10 to earn their third Super Bowl title, at Levi's Stadium.",
    "Levi's Stadium is in Santa Clara, California, in the San Francisco Bay Area, and opened in 2014.",
]
QUESTION = "Who won Super Bowl 50?"

SHAPES = {
    "context prefix": lambda: "Context: " + DOCS[0] + "\n\nQuestion: " + QUESTION,
    "joined by blank lines": lambda: "\n\n".join(DOCS) + "\n\n" + QUESTION,
    "quoted": lambda: 'Document: "' + DOCS[1] + '"\nQuestion: ' + QUESTION,
    "document first": lambda: DOCS[2] + " " + QUESTION,
    "document last": lambda: QUESTION + " " + DOCS[1],
    "glued to a word": lambda: "See:" + DOCS[0] + "and" + DOCS[2],
}


@pytest.fixture(scope="module")
def engine(make_tiny, tokenizer):
    engine = PromptCache(make_tiny("llama", seed=4), tokenizer, recompute=0, recompute_tail=0)
    engine.add_documents(DOCS, progress=False)
    return engine


@pytest.mark.parametrize("shape", SHAPES)
def test_full_prefill_is_the_models_forward_of_the_tokenizers_tokens(engine, tokenizer, shape):
    prompt = SHAPES[shape]()
    ids = tokenizer(prompt)["input_ids"]
    plan = engine.plan(prompt)
    assert plan.input_ids == ids and plan.position_ids == list(range(len(ids)))
    with torch.no_grad():
        reference = engine.model(torch.tensor([ids])).logits[0, -1]
    assert (engine.next_token_logits(prompt, use_cache=False) - reference).abs().max().item() <= 1e-4
    # and the documents are still reused: all but the few tokens that merged with the text around
    # them (' Denver' for 'Den', 'ver') and a prompt's last token, which is always computed
    quoted = [d for d in DOCS if d in prompt]
    reusable = sum(len(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in quoted)
    assert plan.cached_tokens >= reusable - 3 * len(quoted) > 0


def test_a_merged_first_token_is_computed_and_the_rest_reused(engine, tokenizer):
    prompt = SHAPES["context prefix"]()
    plan = engine.plan(prompt)
    doc = [s for s in plan.segments if s.cached][0]
    alone = tokenizer(DOCS[0], add_special_tokens=False)["input_ids"]
    # alone the document starts with 'Super'; after "Context:" the tokenizer gives ' Super'
    assert tokenizer(prompt)["input_ids"][doc.position - 1] != alone[0]
    assert doc.offset == 1 and doc.token_ids == tuple(alone[1 : 1 + len(doc)])
    assert (engine.next_token_logits(prompt) - engine.next_token_logits(prompt, use_cache=False)).abs().max().item() < 1.0


def test_head_recovery_counts_from_the_modules_first_token(make_tiny, tokenizer):
    engine = PromptCache(make_tiny("llama"), tokenizer, recompute=4, recompute_tail=0)
    engine.add_documents(DOCS, progress=False)
    plan = engine.plan(SHAPES["context prefix"]())
    assert [s.offset for s in plan.segments if s.cached and s.owner != "#0"] == [4]  # token 0 merged, 1-3 recomputed

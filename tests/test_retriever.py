"""FaissModuleRetriever on real data: SQuAD "Super_Bowl_50" paragraphs, real FAISS, real MiniLM."""

from __future__ import annotations

import pytest

from pc_rag import PromptCacheError
from pc_rag.prompt.documents import default_name
from pc_rag.retrievers import FaissModuleRetriever, Hit


@pytest.fixture(scope="module")
def corpus_retriever(squad_paragraphs):
    retriever = FaissModuleRetriever()
    retriever.add([p["context"] for p in squad_paragraphs], progress=False)
    return retriever


def test_recall_at_4_on_squad(corpus_retriever, squad_paragraphs):
    assert len(corpus_retriever) == 54
    hits = total = 0
    for paragraph in squad_paragraphs:
        gold = default_name(paragraph["context"])
        for qa in paragraph["qas"]:
            total += 1
            hits += gold in [h.module for h in corpus_retriever.search(qa["question"], k=4)]
    assert total > 500
    assert hits / total >= 0.8


def test_hits_are_ranked_cosine_scores(corpus_retriever):
    hits = corpus_retriever.search("Which team won Super Bowl 50?", k=5)
    assert len(hits) == 5 and all(isinstance(h, Hit) for h in hits)
    scores = [h.score for h in hits]
    assert scores == sorted(scores, reverse=True) and -1.0 <= scores[-1] <= scores[0] <= 1.0 + 1e-6
    assert len(corpus_retriever.search("anything", k=500)) == 54
    with pytest.raises(PromptCacheError, match="k must be a positive int"):
        corpus_retriever.search("q", k=0)


def test_add_is_incremental_and_save_load_round_trips(corpus_retriever, tmp_path, squad_paragraphs):
    small = FaissModuleRetriever(embedding=corpus_retriever.embedder)
    texts = [p["context"] for p in squad_paragraphs[:5]]
    small.add(texts[:3], metadatas=[{"i": i} for i in range(3)], progress=False)
    small.add(texts, progress=False)  # the first three are skipped
    assert len(small) == 5 and small.index.ntotal == 5
    folder = small.save(tmp_path / "idx")
    loaded = FaissModuleRetriever.load(folder, embedding=corpus_retriever.embedder)
    query = "Where was the game played?"
    assert [(h.module, round(h.score, 5), h.metadata) for h in loaded.search(query)] == [
        (h.module, round(h.score, 5), h.metadata) for h in small.search(query)
    ]
    # a corrupted index file is rejected, not used
    data = bytearray((folder / "index.faiss").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / "index.faiss").write_bytes(bytes(data))
    with pytest.raises(PromptCacheError, match="corrupt"):
        FaissModuleRetriever.load(folder, embedding=corpus_retriever.embedder)


def test_from_engine_indexes_the_engines_documents(smollm, squad_retriever):
    rebuilt = FaissModuleRetriever.from_engine(smollm, embedding=squad_retriever.embedder)
    assert sorted(rebuilt.names) == sorted(smollm.schemas["docs"].modules)
    hit = rebuilt.search("Who won Super Bowl 50?", k=1)[0]
    assert hit.module in smollm.schemas["docs"].documents

"""Shared fixtures: the embedded tokenizer and tiny randomly-initialised models of every position scheme."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BloomConfig,
    Cohere2Config,
    CohereConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    GptOssConfig,
    GraniteConfig,
    Llama4TextConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
)

from pc_rag import PromptCache
from pc_rag.kernels import loader
from pc_rag.model.loading import default_model_dir

ARCHS = ("llama", "qwen2", "gemma2", "gemma3", "smollm3", "cohere2", "llama4", "olmo2", "granite", "qwen3_moe", "gpt_oss", "gpt2",
         "bloom")


@pytest.fixture(scope="session")
def model_dir():
    return default_model_dir()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def tiny_config(arch: str, vocab: int, **overrides):
    if arch in ("llama", "qwen2"):
        settings = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
        return (LlamaConfig if arch == "llama" else Qwen2Config)(**{**settings, **overrides})
    if arch == "mistral":  # sliding_window= in overrides
        return MistralConfig(**{**dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024), **overrides})
    if arch == "gemma3":  # RoPE frequencies per layer type: local (sliding window) and global layers
        return Gemma3TextConfig(**{**dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                                          sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
                                    **overrides})
    if arch == "smollm3":  # a layer without RoPE (no_rope_layers 0): its keys carry no position
        return SmolLM3Config(**{**dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                       no_rope_layers=[1, 0], pad_token_id=None, bos_token_id=None, eos_token_id=None), **overrides})
    if arch == "cohere":  # RoPE on interleaved pairs of dims, every layer alike
        return CohereConfig(**{**dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, logit_scale=1.0,
                                      pad_token_id=None, bos_token_id=None, eos_token_id=None), **overrides})
    if arch == "cohere2":  # RoPE on interleaved pairs of dims, in sliding-window layers only (layer 3: global, no RoPE)
        return Cohere2Config(**{**dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, sliding_window=8,
                                       logit_scale=1.0, pad_token_id=None, bos_token_id=None, eos_token_id=None), **overrides})
    if arch == "llama4":  # mixture of experts; RoPE on complex pairs of dims, L2-normed after it; chunked
        # attention in layers 0-2 (chunks of 512: pc-rag serves within one), layer 3 global without RoPE
        return Llama4TextConfig(**{**dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
                                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          max_position_embeddings=1024, num_local_experts=2, num_experts_per_tok=1,
                                          attention_chunk_size=512, no_rope_layers=[1, 1, 1, 0], pad_token_id=None,
                                          bos_token_id=None, eos_token_id=None), **overrides})
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if arch == "gemma2":  # attention logits soft-capped; local and global layers alternate
        return Gemma2Config(**{**common, "head_dim": 16, "sliding_window": 8, **overrides})
    if arch == "olmo2":  # queries and keys RMS-normed over the whole projection, before RoPE
        return Olmo2Config(**{**common, **overrides})
    if arch == "granite":  # attention, residual, embedding and logit multipliers
        return GraniteConfig(**{**common, "attention_multiplier": 0.3, "residual_multiplier": 0.5, "embedding_multiplier": 2.0,
                                "logits_scaling": 4.0, **overrides})
    if arch == "phi3":  # one projection for q, k and v, one for gate and up
        return Phi3Config(**{**common, **overrides})
    if arch == "qwen3":  # per-head RMS norm of queries and keys before RoPE
        return Qwen3Config(**{**common, "head_dim": 16, **overrides})
    if arch == "qwen3_moe":  # mixture of experts; per-head RMS norm of queries and keys before RoPE
        return Qwen3MoeConfig(**{**common, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                 **overrides})
    if arch == "gpt_oss":  # a learned attention sink per head; experts; local and global layers alternate
        return GptOssConfig(**{**common, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                               "layer_types": ["sliding_attention", "full_attention"], **overrides})
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=1024,
                          bos_token_id=None, eos_token_id=None, **overrides)
    if arch == "bloom":
        return BloomConfig(vocab_size=vocab, hidden_size=64, n_layer=2, n_head=4, **overrides)
    raise ValueError(arch)


@pytest.fixture(scope="session")
def make_tiny(tokenizer) -> Callable[..., torch.nn.Module]:
    def build(arch: str, seed: int = 0, **overrides):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tokenizer), **overrides), dtype=torch.float32)
        return model.eval()

    return build


@pytest.fixture
def saved_model(make_tiny, tokenizer, tmp_path):
    """A tiny Llama saved to a folder, for tests that start other processes."""
    folder = tmp_path / "tiny-llama"
    make_tiny("llama").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def make_engine(make_tiny, tokenizer) -> Callable[..., PromptCache]:
    def build(arch: str = "llama", **kwargs) -> PromptCache:
        # these tests check reuse itself, on modules a few tokens long that the default recovery
        # (recompute the first 16 tokens of each module) would recompute whole; tests/test_recovery.py covers it
        kwargs.setdefault("recompute", 0)
        kwargs.setdefault("attention_temperature", 1.0)  # and no APE adjustment: reuse must be exact
        kwargs.setdefault("attention_scale", 1.0)
        return PromptCache(make_tiny(arch), tokenizer, **kwargs)

    return build


@pytest.fixture(params=["avx2", "avx512"])
def kernel_form(request) -> str:
    """Each form of the float-input block kernels in turn: AVX2, and AVX-512 (``wide_kernels.c``)
    where this CPU has AVX-512F (the machines pc-rag is tested on do)."""
    lib = loader.library()
    before = lib.wide_kernels(-1)
    if lib.wide_kernels(int(request.param == "avx512")) != (request.param == "avx512"):
        lib.wide_kernels(before)
        pytest.skip("this CPU has no AVX-512F")
    yield request.param
    lib.wide_kernels(before)


@contextlib.contextmanager
def avx2_float_kernels() -> Iterator[None]:
    """The float-input block kernels in their AVX2 form, on any CPU (the form every CPU without
    AVX512-VNNI decodes on), for what is built and run inside."""
    lib = loader.library()
    before = lib.wide_kernels(-1)
    lib.wide_kernels(0)
    try:
        yield
    finally:
        lib.wide_kernels(before)


def sixteen_bit_inputs_here() -> None:
    """Skip where the C step cannot take 16-bit inputs (no AVX512-VNNI): test_blocks'
    test_the_kernels_build_and_load_here asserts they are used wherever the CPU has it."""
    if not loader.library().a16_kernels(-1):
        pytest.skip("this CPU has no AVX512-VNNI (test_the_kernels_build_and_load_here asserts it is used where it has)")


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)


def drawn_away(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its norm weights and biases moved off their defaults (ones, zeros), in place:
    a norm skipped, a bias dropped or a wrong rotation changes the logits."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model


def staggered(engine: PromptCache, prompts: list, **settings) -> list:
    """Each prompt's stream opened once the one before it has its first token (arrivals while
    the others decode), then every stream read to its end: their results, in order."""
    streams = []
    for prompt in prompts:
        streams.append(engine.stream(prompt, **settings))
        next(streams[-1])
    for stream in streams:
        for _ in stream:
            pass
    return [stream.result for stream in streams]


DATA = Path(__file__).resolve().parent / "data"  # tests/data/README.md: each file's source and licence
SQUAD = DATA / "squad_v1.1_dev_super_bowl_50.json"


@pytest.fixture(scope="session")
def squad_paragraphs() -> list[dict]:
    """The 54 paragraphs of SQuAD v1.1 dev "Super_Bowl_50", each with its questions."""
    data = json.loads(SQUAD.read_text())["data"]
    return [p for article in data for p in article["paragraphs"]]


@pytest.fixture(scope="session")
def smollm() -> PromptCache:
    """The embedded SmolLM2-135M-Instruct engine, shared by the end-to-end tests."""
    return PromptCache.from_pretrained()


@pytest.fixture
def smollm_streams(smollm, monkeypatch) -> list:
    """The SmolLM2 engine's streams during the test, in order (a LlamaIndex query engine hides the
    stats: read each one's ``.result`` after)."""
    streams = []
    original = smollm.stream

    def spy(*args, **kwargs):
        streams.append(original(*args, **kwargs))
        return streams[-1]

    monkeypatch.setattr(smollm, "stream", spy)
    return streams


@pytest.fixture(scope="session")
def squad_retriever(smollm, squad_paragraphs):
    """A FAISS retriever bound to the SmolLM2 engine, holding the first 8 SQuAD paragraphs as modules."""
    from pc_rag.retrievers import FaissModuleRetriever

    retriever = FaissModuleRetriever(engine=smollm)
    retriever.add([p["context"] for p in squad_paragraphs[:8]], progress=False)
    return retriever


class RedisServer:
    """A real ``redis-server`` process on a free loopback port, data in a temporary folder; it
    can be stopped and started again on the same port (an outage and a recovery)."""

    def __init__(self, folder: Path) -> None:
        import shutil
        import socket

        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: apt-get install redis-server (README's test command does)")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.binary, self.folder = binary, folder
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = None

    def start(self) -> RedisServer:
        import subprocess
        import time

        import redis

        # no snapshots: a restart starts empty, like a replaced cache node
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder), "--save", "",
             "--appendonly", "no", "--maxmemory-policy", "allkeys-lru", "--enable-debug-command", "local"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 20
        while True:  # readiness poll (not a timing assertion): the server accepts commands
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def client(self):
        import redis

        return redis.Redis(port=self.port)


@pytest.fixture
def redis_server(tmp_path):
    """A running redis-server (see :class:`RedisServer`), stopped after the test."""
    folder = tmp_path / "redis"
    folder.mkdir()
    server = RedisServer(folder).start()
    yield server
    server.stop()


class ThrottledProxy:
    """A TCP proxy in front of a real redis-server that forwards at ``bytes_per_s`` in each
    direction (a distant or congested Redis): replies arrive slowly, commands still reach the
    real server. ``bytes_per_s`` may be changed while it runs."""

    def __init__(self, target_port: int, bytes_per_s: float) -> None:
        import socket
        import threading

        self.target_port = target_port
        self.bytes_per_s = bytes_per_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._closed = threading.Event()
        # one rate for the whole link (every connection, both directions), as a slow network has
        self._lock = threading.Lock()
        self._free_at = 0.0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source, sink) -> None:
        import time

        piece = 16384
        try:
            while not self._closed.is_set():
                data = source.recv(piece)
                if not data:
                    break
                # pacing, not an assertion: each piece waits for its share of the link's rate
                with self._lock:
                    now = time.monotonic()
                    self._free_at = max(now, self._free_at) + len(data) / self.bytes_per_s
                    pause = self._free_at - now
                time.sleep(pause)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        self.listener.close()


@pytest.fixture
def slow_redis(redis_server):
    """``redis_server`` behind a :class:`ThrottledProxy` at ~2 MB/s."""
    proxy = ThrottledProxy(redis_server.port, 2e6)
    yield proxy
    proxy.close()


@pytest.fixture(autouse=True)
def _tiers_always_load(monkeypatch):
    """Tests that count tier hits or compare cached answers need loads to stay loads: a tiny
    model computes a module faster than a disk read, and the load-or-compute choice
    (pc_rag.kv.load_or_compute) would rightly compute it. tests/test_costs.py sets the saving back."""
    import pc_rag.kv.load_or_compute

    monkeypatch.setattr(pc_rag.kv.load_or_compute, "MIN_SAVING_S", 3600.0)


@pytest.fixture(scope="session")
def pcrag_server(tmp_path_factory):
    """A single-user ``pc-rag serve`` of the embedded model (the server tests and LangChain's
    standard suite against it share it)."""
    from .servers import ServerProcess

    # a buffer budget that every test's requests fit (tests/test_server.py: one that does not is refused)
    server = ServerProcess(tmp_path_factory.mktemp("server"), "--body-timeout-s", "2", "--buffer-budget-mb", "320")
    yield server
    server.close()


def assert_same_logits_joined_and_apart(joined, apart, tokenizer) -> None:
    """Two copies of a model, one with its sibling layers joined: bitwise the same logits over a
    prompt and over the decode step after it."""
    ids = torch.tensor([tokenizer("The tower stands in Paris and was finished in")["input_ids"]])
    with torch.inference_mode():
        assert torch.equal(joined(ids).logits, apart(ids).logits)
        first, second = joined(ids, use_cache=True), apart(ids, use_cache=True)
        step = ids[:, -1:]
        assert torch.equal(joined(step, cache=first.past_key_values).logits, apart(step, cache=second.past_key_values).logits)


def assert_answers_as_float32(engine, kl_bound: float, max_new_tokens: int) -> None:
    """``engine`` (the embedded model at other weights) against the float32 checkpoint as loaded:
    a first-token KL under ``kl_bound`` and the same greedy answer, cached and by full prefill."""
    from pc_rag.prompt.documents import build_prompt

    as_loaded = PromptCache.from_pretrained(weights="float32")
    documents = ["Super Bowl 50 was won by the Denver Broncos, who beat the Carolina Panthers 24-10.",
                 "Super Bowl 50 was played at Levi's Stadium in Santa Clara, California."]
    engines = (engine, as_loaded)
    prompts = [build_prompt("Who won Super Bowl 50, and where was it played?", each.add_documents(documents, progress=False))
               for each in engines]
    for use_cache in (True, False):
        other, full = (each.next_token_logits(prompt, use_cache=use_cache).log_softmax(-1) for each, prompt in zip(engines, prompts))
        assert float((full.exp() * (full - other)).sum()) < kl_bound
        answers = [each.generate(prompt, max_new_tokens=max_new_tokens, use_cache=use_cache).token_ids
                   for each, prompt in zip(engines, prompts)]
        assert answers[0] == answers[1]

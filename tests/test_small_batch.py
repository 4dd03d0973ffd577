"""Decode-sized linear layers as ``W @ x^T`` (pc_rag.weights.small_batch): the same products, the
same answers, only where they are wanted, and undone on request."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from pc_rag.model.loading import load_model
from pc_rag.weights import small_batch

from .test_scheduler import check_same, mixed_requests


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (3, 1), (8, 1), (16, 1), (17, 1), (1, 5), (4, 4), (2, 40)])
def test_w_x_t_computes_what_f_linear_computes(shape, bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96, bias=bias)
    x = torch.randn(*shape, 64)
    want = F.linear(x, layer.weight, layer.bias)
    assert small_batch.install(torch.nn.Sequential(layer), enabled=True)
    got = layer(x)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    got.view(*shape, 8, 12)  # model code views a projection's output: it must be laid out in row order


def test_install_routes_plain_linear_layers_and_undoes_it():
    class Quantized(torch.nn.Linear):  # a subclass computes its own way: left alone
        pass

    plain, sub = torch.nn.Linear(8, 8), Quantized(8, 8)
    model = torch.nn.Sequential(plain, sub)
    assert small_batch.install(model, enabled=True)
    assert plain.forward.__func__ is small_batch.linear and sub.forward.__func__ is Quantized.forward
    small_batch.install(model, enabled=True)  # twice: still routed once
    assert plain.forward.__func__ is small_batch.linear
    assert small_batch.install(model, enabled=False) is False
    assert plain.forward.__func__ is torch.nn.Linear.forward and "forward" not in vars(plain)


def test_the_default_takes_it_for_large_float32_cpu_models_only(make_tiny, smollm):
    assert small_batch.wanted(make_tiny("llama")) is False  # weights that stay in cache
    model, _ = load_model(None)  # SmolLM2-135M in float32 on a CPU: 538 MB of linear weights
    assert small_batch.wanted(model) is True and small_batch.install(model) is True
    assert model.lm_head.forward.__func__ is small_batch.linear
    assert smollm.weights == "int4" and smollm.small_batch_linear is False  # the default: pc-rag's 4-bit kernels, no nn.Linear left
    assert small_batch.wanted(make_tiny("llama").to(torch.bfloat16)) is False


def test_batched_callers_with_w_x_t_still_see_a_lone_call(make_engine):
    engine = make_engine("llama", small_batch_linear=True)
    assert engine.small_batch_linear and engine.model.model.layers[0].mlp.up_proj.forward.__func__ is small_batch.linear
    docs = [f"Harbour {i} handles {i * 11} ships a day and lies {i * 3} km from the old town." for i in range(12)]
    engine.names = engine.add_documents(docs, progress=False)  # type: ignore[attr-defined]
    requests = mixed_requests(engine)
    alone = [engine.generate(p, **kw) for p, kw in requests]
    start = threading.Barrier(len(requests))

    def call(item):
        prompt, kwargs = item
        start.wait()
        return engine.generate(prompt, **kwargs)

    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(call, requests))
    for got, want, (_, kwargs) in zip(together, alone, requests):
        check_same(got, want, kwargs)
    assert max(engine.scheduler._stats.step_rows) >= 4  # decode steps of several rows: W @ x^T ran

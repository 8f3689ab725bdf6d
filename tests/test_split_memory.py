"""What a split step holds beyond vLLM's profile run (``vllm_pcp.pcp.memory``), against
the bytes the plugin's own code allocates, counted on the CPU.

The count: every tensor storage an op creates while the code runs, alive until it is
freed (a torch dispatch mode per rank thread). The stand-ins of FlashInfer's kernels and
vLLM's cache write count only the tensors they return, since the real kernels allocate
nothing else; a collective counts its output, as NCCL's would. The layers run as vLLM's
runner drives them (``tests/layer_harness.py``, ``tests/split_harness.py``).
"""
import threading
import weakref
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fake_flashinfer
from test_dcp_attention_cpu import float32_flashinfer  # noqa: F401  (the fixture)
from vllm_pcp.pcp.memory import (StepShape, dcp_layer_bytes, kv_gather_bytes, restore_bytes,
                                 split_step_reserve_bytes, step_bytes)

_thread = threading.local()


def _storages(tree) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_flatten(tree)[0]
            if isinstance(t, torch.Tensor)}


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes of storages created under the mode and not freed yet."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.paused = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            self.track(out, _storages((args, kwargs)))
        return out

    def track(self, out, inputs: set[int]) -> None:
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self._seen or key in inputs:  # a view or in place
                continue
            self._seen.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.discard(key)

    def __enter__(self):
        _thread.mode = self
        return super().__enter__()

    def __exit__(self, *exc):
        _thread.mode = None
        return super().__exit__(*exc)


def kernel(fn):
    """``fn`` (a stand-in of a kernel) counted by its results only."""
    def run(*args, **kwargs):
        mode = getattr(_thread, "mode", None)
        if mode is None:
            return fn(*args, **kwargs)
        mode.paused += 1
        try:
            out = fn(*args, **kwargs)
        finally:
            mode.paused -= 1
        mode.track(out, _storages((args, kwargs)))
        return out
    return run


def test_live_bytes_counts_new_storages_until_freed_and_skips_views():
    base = torch.zeros(1000)
    with LiveBytes() as mode:
        a = torch.empty(1000)  # 4,000 bytes
        view = base.view(10, 100)  # none
        b = torch.empty(500)
        del a
        c = torch.empty(2000)
    assert (mode.peak, mode.live) == (10000, 10000) and view.shape == (10, 100)
    del b, c


def _count_fake_kernels_by_results(monkeypatch) -> None:
    """The stand-in FlashInfer of ``float32_flashinfer``: its wrappers' runs and its merges
    counted by :func:`kernel`."""
    import sys

    fake = sys.modules["flashinfer"]
    for name in ("BatchPrefillWithRaggedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
                 "BatchDecodeWithPagedKVCacheWrapper"):
        cls = getattr(fake, name)
        monkeypatch.setattr(cls, "run", kernel(cls.run))
    for name in ("merge_state", "merge_states", "merge_state_in_place"):
        monkeypatch.setattr(fake, name, kernel(getattr(fake, name)))


class _Group:
    """``world_size`` ranks whose all-gather returns every rank's tensor as this one's."""

    def __init__(self, world_size):
        self.world_size = world_size

    def all_gather(self, x, dim=0):
        return torch.cat([x] * self.world_size, dim=dim)


def _shape(rows, pcp, dcp=1, context_rows=0, exchange="auto", tokens=None):
    return StepShape(tokens=tokens or rows * pcp, rows=rows, context_rows=context_rows,
                     pcp=pcp, dcp=dcp, num_q_heads=8, num_kv_heads=2, head_dim=16,
                     hidden_size=128, dtype_bytes=4, exchange=exchange)


def _vllm_restore(monkeypatch, group, restore_indices):
    """vLLM's ``PCPManager.restore_hidden_states`` over ``group``, restoring from the
    gathered rows ``restore_indices``."""
    import vllm.v1.worker.gpu.pcp_manager as pcp_manager

    monkeypatch.setattr(pcp_manager, "get_pcp_group", lambda: group)
    manager = object.__new__(pcp_manager.PCPManager)
    manager._hidden_restore_idx = restore_indices
    return manager.restore_hidden_states


@pytest.mark.parametrize("pcp", [2, 4])
@pytest.mark.parametrize("local", [37, 40])  # fewer rows than P: padded first
def test_kv_gather_and_restore_hold_what_the_bound_counts(monkeypatch, pcp, local):
    """The K/V exchange of a layer (the plugin's) and the restore of the hidden states
    (vLLM's manager's, of the model's ``P`` output rows) each hold at most their bound
    and at least 0.7 of it."""
    from vllm_pcp.pcp.exchange import gather_kv

    s = _shape(rows=40, pcp=pcp)
    key, value = torch.randn(local, 2, 16), torch.randn(local, 2, 16)
    with LiveBytes() as mode:
        k, v = gather_kv(_Group(pcp), key, value, s.rows)
        del k, v
    assert 0.7 * kv_gather_bytes(s) <= mode.peak <= kv_gather_bytes(s)
    hidden = torch.randn(s.rows, 128)
    restore = _vllm_restore(monkeypatch, _Group(pcp), torch.randperm(s.tokens))
    with LiveBytes() as mode:
        out = restore(hidden)
    assert out.shape == (s.tokens, 128)
    assert 0.7 * restore_bytes(s) <= mode.peak <= restore_bytes(s)


# (computed, scheduled) of PCP x DCP steps: fresh prompts beside chunks over context and
# a decode (every split context may be written in the step: all take the queries road),
# and split chunks that fetch their context beside one that sends its queries
DCP_STEPS = {"queried": (None, None), "mixed": ([64, 300, 80, 64], [96, 200, 1, 50])}


@pytest.mark.parametrize("world,interleave,exchange,step", [
    (2, 1, "queries", "queried"), (4, 8, "queries", "queried"), (2, 8, "auto", "mixed"),
    (3, 8, "auto", "queried"), (2, 8, "keys", "mixed"), (3, 8, "keys", "mixed"),
    (2, 8, "keys", "queried")])
def test_a_dcp_layer_holds_at_most_the_bound(float32_flashinfer, monkeypatch, world,
                                             interleave, exchange, step):
    """The plugin's layer on a PCP x DCP step (``tests/layer_harness.py``), each rank
    counted: its two calls hold no more than the layer part of the reserve for the
    configured ``pcp_dcp_context_exchange`` (:func:`step_bytes` of the step's P and Pc,
    the restore left out), and no less than 0.4 of it (the bound counts every buffer as
    live at once). Under every exchange a split chunk whose context the step may write
    sends its queries (``context_maybe_written_in_step``), so the bound must cover the
    queries exchange whatever the knob."""
    import vllm.v1.attention.backends.flashinfer as vllm_flashinfer

    from layer_harness import run_dcp_layer_step
    from vllm_pcp.dcp.plan import build_dcp_plan

    _count_fake_kernels_by_results(monkeypatch)
    monkeypatch.setattr(vllm_flashinfer.FlashInferImpl, "do_kv_cache_update",
                        kernel(fake_flashinfer.torch_cache_write))
    computed, scheduled = DCP_STEPS[step]
    batch = {} if computed is None else dict(computed=computed, scheduled=scheduled)
    modes = {}
    results, _ = run_dcp_layer_step(
        monkeypatch, world, interleave, exchange, "cpu", torch.float32, hq=8, dim=16,
        around_forward=lambda rank: modes.setdefault(rank, LiveBytes()), **batch)
    for rank, mode in modes.items():
        plan = build_dcp_plan(results[rank][3], interleave, context_exchange=exchange,
                              kv_to_q_heads=2 / 8)
        assert len(plan.ctx_split.req) and (plan.ctx_gather is not None) == (step == "mixed")
        context_rows = plan.ctx_gather.num_padded if plan.ctx_gather is not None else 0
        shape = _shape(plan.pcp.num_padded_tokens_per_rank, world, world, context_rows,
                       exchange)
        bound = step_bytes(replace(shape, hidden_size=0))  # the reserve's layer part
        # a step that may fetch is held to both exchanges' buffers at once: looser
        floor = 0.4 if exchange == "queries" else 0.3
        assert floor * bound <= mode.peak <= bound, (rank, mode.peak, bound)


@pytest.mark.parametrize("exchange", ["keys", "auto"])
def test_a_step_of_many_cached_contexts_fits_the_reserve(float32_flashinfer, monkeypatch,
                                                          exchange):
    """16 split requests of a step that share a cached 224-token prefix (``-pcp 2 -dcp 2``,
    ``max_model_len`` 256, 64 tokens a step): the context rows fetched are those the
    reserve holds (one context's), the other requests send their queries, and each rank's
    layer holds no more than the reserve's layer part."""
    import vllm.v1.attention.backends.flashinfer as vllm_flashinfer

    from layer_harness import run_dcp_layer_step

    _count_fake_kernels_by_results(monkeypatch)
    monkeypatch.setattr(vllm_flashinfer.FlashInferImpl, "do_kv_cache_update",
                        kernel(fake_flashinfer.torch_cache_write))
    modes = {}
    results, expect = run_dcp_layer_step(
        monkeypatch, 2, 1, exchange, "cpu", torch.float32, hq=8, dim=16, page=16,
        computed=[224] * 16, scheduled=[4] * 16, max_model_len=256,
        around_forward=lambda rank: modes.setdefault(rank, LiveBytes()))
    reserve = _shape(64, 2, 2, context_rows=-(-256 // 2) + 1, exchange=exchange, tokens=64)
    bound = step_bytes(replace(reserve, hidden_size=0))  # the reserve's layer part
    for rank, mode in modes.items():
        assert mode.peak <= bound, (rank, mode.peak, bound)
        torch.testing.assert_close(results[rank][0], expect, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("world,scheduled", [(2, [37, 2, 100, 16, 5]), (4, [64, 9]),
                                             (8, [200, 1, 33])])
def test_a_fresh_split_layer_holds_at_most_the_bound(float32_flashinfer, monkeypatch, world,
                                                     scheduled):
    """The plugin's layer on a fresh split step, the ragged kernel (``tests/split_harness.py``):
    each rank's forward holds no more than :func:`ragged_layer_bytes` of the step's P and T,
    and no less than 0.4 of it."""
    import vllm.v1.attention.backends.flashinfer as vllm_flashinfer

    from split_harness import run_ragged_split_step
    from vllm_pcp.pcp.memory import ragged_layer_bytes

    _count_fake_kernels_by_results(monkeypatch)
    monkeypatch.setattr(vllm_flashinfer.FlashInferImpl, "do_kv_cache_update",
                        kernel(fake_flashinfer.torch_cache_write))
    modes = {}
    results, _ = run_ragged_split_step(
        monkeypatch, world, scheduled, "cpu", torch.float32, hq=8, hkv=2, dim=16,
        around_forward=lambda rank: modes.setdefault(rank, LiveBytes()))
    for rank, mode in modes.items():
        shape = _shape(results[rank].plan.num_padded_tokens_per_rank, world,
                       tokens=sum(scheduled))
        bound = ragged_layer_bytes(replace(shape, ragged=True))
        assert step_bytes(replace(shape, ragged=True, hidden_size=1)) == bound
        assert 0.4 * bound <= mode.peak <= bound, (rank, mode.peak, bound)


def test_the_reserve_takes_the_widest_step_and_both_exchanges_where_keys_may_be_fetched():
    """P = T (short prefills beside one split chunk), Pc = max_model_len / N and the
    interleave's padding; at PCP = 1 nothing, with or without DCP."""
    from types import SimpleNamespace

    def config(pcp, dcp, exchange="auto", tokens=8192, max_model_len=131072):
        model = SimpleNamespace(
            max_model_len=max_model_len, dtype=torch.bfloat16, get_head_size=lambda: 128,
            get_num_attention_heads=lambda p: 32 // p.tensor_parallel_size,
            get_num_kv_heads=lambda p: 8 // p.tensor_parallel_size, get_hidden_size=lambda: 4096)
        parallel = SimpleNamespace(prefill_context_parallel_size=pcp,
                                   decode_context_parallel_size=dcp, tensor_parallel_size=1,
                                   cp_kv_cache_interleave_size=8)
        return SimpleNamespace(model_config=model, parallel_config=parallel,
                               scheduler_config=SimpleNamespace(max_num_batched_tokens=tokens),
                               additional_config={"pcp_dcp_context_exchange": exchange})

    assert split_step_reserve_bytes(config(1, 1)) == 0
    assert split_step_reserve_bytes(config(1, 2)) == 0  # DCP inside TP: vLLM's own
    shape = StepShape(tokens=8192, rows=8192, context_rows=0, pcp=2, dcp=1, num_q_heads=32,
                      num_kv_heads=8, head_dim=128, hidden_size=4096, dtype_bytes=2)
    assert split_step_reserve_bytes(config(2, 1)) == step_bytes(shape) == restore_bytes(shape)
    assert restore_bytes(shape) == 4096 * 2 * (8192 * 3 + 8192)  # 256 MiB
    dcp = StepShape(**{**shape.__dict__, "dcp": 2, "context_rows": 65536 + 8})
    keys, queries = dcp_layer_bytes(dcp, "keys"), dcp_layer_bytes(dcp, "queries")
    both = dcp_layer_bytes(dcp, "both")  # some context fetched, other queries sent
    assert both > max(keys, queries)
    assert split_step_reserve_bytes(config(2, 2, "queries")) == queries
    assert split_step_reserve_bytes(config(2, 2, "keys")) == both
    assert split_step_reserve_bytes(config(2, 2)) == both
    assert split_step_reserve_bytes(config(2, 2, "keys", max_model_len=262144)) > both


def test_the_profile_run_holds_the_reserve_and_the_worker_reports_it(monkeypatch):
    """vLLM measures its profile run's peak of torch allocations: the reserve is
    allocated through the whole run, then freed; the worker's ``pcp_memory`` reports
    the run's peak above its start, the reserve, and resets the peak when asked."""
    from types import SimpleNamespace

    import vllm_pcp.runner as runner_mod
    from vllm_pcp.runner import GPUModelRunner
    from vllm_pcp.worker import PCPWorker

    stats = {"allocated": 1000, "peak": 1000, "resets": 0}
    held, seen_alive = [], []
    real_empty = torch.empty

    def empty(nbytes, dtype, device):
        t = real_empty(0, dtype=dtype)
        held.append((nbytes, dtype, device, weakref.ref(t)))
        return t

    def stock_profile_run(self):  # what vLLM's run would peak at, with the reserve held
        seen_alive.append(held[-1][3]() is not None)
        stats["peak"] = stats["allocated"] + held[-1][0] + 500

    cuda = SimpleNamespace(memory_allocated=lambda d: stats["allocated"],
                           max_memory_allocated=lambda d: stats["peak"],
                           reset_peak_memory_stats=lambda d: stats.update(
                               resets=stats["resets"] + 1))
    monkeypatch.setattr(runner_mod.torch, "empty", empty)
    monkeypatch.setattr(runner_mod.torch, "cuda", cuda)
    monkeypatch.setattr(GPUModelRunner, "profile_run", stock_profile_run)
    monkeypatch.setattr(runner_mod, "split_step_reserve_bytes", lambda config: 4096)
    runner = object.__new__(runner_mod.PCPModelRunner)
    runner.vllm_config, runner.device = object(), torch.device("cpu")
    runner.profile_run()
    assert held[0][:2] == (4096, torch.uint8) and seen_alive == [True]
    assert held[0][3]() is None  # freed after the run
    assert runner.pcp_profile_peak_bytes == 4096 + 500 and stats["resets"] == 1

    import vllm_pcp.worker as worker_mod

    monkeypatch.setattr(worker_mod, "split_step_reserve_bytes", lambda config: 4096)
    worker = object.__new__(PCPWorker)
    worker.model_runner, worker.vllm_config, worker.device = runner, object(), "cpu"
    assert worker.pcp_memory(reset=True) == {
        "allocated_bytes": 1000, "peak_allocated_bytes": 1000 + 4096 + 500,
        "profile_peak_bytes": 4096 + 500, "split_step_reserve_bytes": 4096}
    assert stats["resets"] == 2


def test_the_reserve_of_vllms_own_config(tmp_path, monkeypatch):
    """On a real VllmConfig (a small Qwen2: 8 query and 2 KV heads of 8, hidden 64, bf16)
    the step is read from vLLM's fields: the scheduler's token budget, the model's heads."""
    from helpers import real_vllm_config
    from vllm.config import SchedulerConfig

    config = real_vllm_config(tmp_path, monkeypatch, dict(prefill_context_parallel_size=2),
                              scheduler_config=SchedulerConfig(
                                  max_num_batched_tokens=4096, max_model_len=4096,
                                  is_encoder_decoder=False))
    shape = StepShape(tokens=4096, rows=4096, context_rows=0, pcp=2, dcp=1, num_q_heads=8,
                      num_kv_heads=2, head_dim=8, hidden_size=64, dtype_bytes=2)
    assert split_step_reserve_bytes(config) == step_bytes(shape) == restore_bytes(shape)

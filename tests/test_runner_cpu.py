"""The PCP runner and backend on the CPU: two ranks as threads, fake model and builder.

Without CP vs with CP: the restored hidden states and the written K/V must be
what one process computes for the whole batch.
"""
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.attention.backends.flashinfer import FlashInferImpl
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

import vllm_pcp.backend as backend_mod
import vllm_pcp.runner as runner_mod
from helpers import ThreadGroup
from vllm_pcp.backend import (KVExchange, PCPDCPMetadata, PCPFlashInferImpl,
                              PCPFlashInferMetadataBuilder, PCPSplitMetadata)
from vllm_pcp.pcp.exchange import gathered_slot_mapping
from vllm_pcp.pcp.partition import build_pcp_metadata
from vllm_pcp.runner import PCPModelRunner, PCPStep, PCPStepCounts

COMPUTED = [30, 0, 0, 12]
SCHEDULED = [1, 37, 2, 9]  # decode, long prompt, short prompt, continuation
PROMPTS = [30, 37, 2, 21]
BLOCKS = torch.arange(4 * 6, dtype=torch.int32).reshape(4, 6) + 100


class _RecordingBuilder(PCPFlashInferMetadataBuilder):
    def can_attend_ragged(self):  # the ragged kernel's choice: tests/test_ragged_split.py
        return False

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return SimpleNamespace(cm=common_attn_metadata)

    def build_dcp(self, plan, block_table, group, heads_gathered, exchange=None,
                  slot_mapping=None, graph_rows=None):
        return SimpleNamespace(plan=plan, block_table=block_table, group=group,
                               heads_gathered=heads_gathered, exchange=exchange,
                               slot_mapping=slot_mapping, graph_rows=graph_rows)


def _global_positions():
    return torch.cat([c + torch.arange(s) for c, s in zip(COMPUTED, SCHEDULED)])


def _make_runner(group, rank):
    r = object.__new__(PCPModelRunner)
    r.device = torch.device("cpu")
    r.pcp_group = group.rank(rank)
    r.pcp_world_size, r.pcp_rank = group.world_size, rank
    r.pcp_min_split_tokens = 2 * group.world_size
    r.pcp_dcp_context_exchange = "auto"
    r.pcp_split_attention = "auto"
    r.num_query_heads, r.parallel_config = 16, None
    r.model_config = SimpleNamespace(get_num_kv_heads=lambda parallel_config: 2)
    r.reorder_batch_threshold = 1
    r.pcp_dcp, r.cp_kv_cache_interleave_size = False, 1
    r.dcp_group, r.dcp_heads_gathered = r.pcp_group, False
    r._step, r.pcp_step_counts = None, PCPStepCounts()
    table = SimpleNamespace(get_device_tensor=lambda n: BLOCKS[:n],
                            get_numpy_array=lambda: BLOCKS.numpy(), block_size=16)
    r.input_batch = SimpleNamespace(num_reqs=len(SCHEDULED), block_table=[table],
                                    num_computed_tokens_cpu=np.array(COMPUTED, np.int32),
                                    num_prompt_tokens=np.array(PROMPTS, np.int32))
    r.kv_cache_config = SimpleNamespace(kv_cache_groups=[object()])
    builder = object.__new__(_RecordingBuilder)
    r.attn_groups = [[SimpleNamespace(layer_names=["l0", "l1"],
                                      get_metadata_builder=lambda i: builder)]]
    r.positions = _global_positions()
    return r


def _global_slots():
    return torch.arange(sum(SCHEDULED), dtype=torch.int64) * 3 + 5


def test_split_metadata_has_local_rows_and_gathered_slots():
    group = ThreadGroup(2)
    for rank in range(2):
        runner = _make_runner(group, rank)
        plan = build_pcp_metadata(COMPUTED, SCHEDULED, 2, rank, min_split_tokens=4)
        metadata, inputs = runner._build_split_metadata(plan, {0: _global_slots()})
        cm = metadata["l0"].local.cm
        assert metadata["l1"] is metadata["l0"]
        local = plan.local_token_indices
        assert torch.equal(cm.block_table_tensor, BLOCKS[plan.row_req_indices.long()])
        assert torch.equal(cm.slot_mapping, _global_slots()[local])
        assert torch.equal(cm.positions, _global_positions()[local])
        assert torch.equal(cm.seq_lens, plan.seq_lens)
        assert cm.num_reqs == plan.num_rows and cm.num_actual_tokens == len(local)
        assert metadata["l0"].exchange.num_padded_tokens_per_rank == \
            plan.num_padded_tokens_per_rank
        assert torch.equal(inputs.restore_indices, plan.restore_indices)
        gathered = metadata["l0"].slot_mapping
        idx = plan.gathered_token_indices
        assert gathered.shape == (2 * plan.num_padded_tokens_per_rank,)
        assert torch.equal(gathered[idx >= 0], _global_slots()[idx[idx >= 0]])
        assert (gathered[idx < 0] == -1).all()
        # Every global slot is written exactly once across the gathered rows.
        assert sorted(gathered[gathered >= 0].tolist()) == _global_slots().tolist()


def test_model_forward_restores_the_single_process_result(monkeypatch):
    group = ThreadGroup(2)
    contexts = threading.local()
    monkeypatch.setattr(runner_mod, "get_forward_context", lambda: contexts.ctx)
    input_ids = torch.arange(sum(SCHEDULED)) * 7 + 1
    positions = _global_positions()

    def fake_model(input_ids, positions, intermediate_tensors, inputs_embeds):
        return torch.stack([input_ids.float(), positions.float() * 0.5], dim=1)

    def rank_fn(rank):
        contexts.ctx = SimpleNamespace(slot_mapping=None, cudagraph_runtime_mode=None,
                                       batch_descriptor="captured", is_padding="mask")
        runner = _make_runner(group, rank)
        runner.model = fake_model
        plan = build_pcp_metadata(COMPUTED, SCHEDULED, 2, rank, min_split_tokens=4)
        runner._step = PCPStep(plan)
        metadata, _ = runner._build_attention_metadata(slot_mappings={0: _global_slots()})
        padded_ids = torch.cat([input_ids, torch.zeros(3, dtype=input_ids.dtype)])
        padded_pos = torch.cat([positions, torch.zeros(3, dtype=positions.dtype)])
        out = runner._model_forward(padded_ids, padded_pos)
        assert runner._step is None  # consumed
        assert contexts.ctx.batch_descriptor is None and contexts.ctx.is_padding is None
        # the gathered slot mapping reaches both layers through their metadata
        assert set(metadata) == {"l0", "l1"} and contexts.ctx.slot_mapping is None
        assert all(md.slot_mapping.shape == (2 * plan.num_padded_tokens_per_rank,)
                   for md in metadata.values())
        return out

    outs = group.run(rank_fn)
    expect = fake_model(input_ids, positions, None, None)
    for out in outs:
        assert out.shape == (len(input_ids) + 3, 2)
        torch.testing.assert_close(out[: len(input_ids)], expect)
        assert (out[len(input_ids):] == 0).all()


def test_non_split_steps_run_stock(monkeypatch):
    group = ThreadGroup(2)
    runner = _make_runner(group, 0)
    calls = []
    monkeypatch.setattr(GPUModelRunner, "_build_attention_metadata",
                        lambda self, *a, **k: calls.append("stock") or ("md", None))
    monkeypatch.setattr(GPUModelRunner, "_model_forward",
                        lambda self, *a, **k: calls.append("forward") or "hidden")
    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", lambda self, so, n: ("idx", None))
    runner.input_batch.num_reqs = 2  # two decodes: nothing to split, no step
    runner.input_batch.num_computed_tokens_cpu = np.array([5, 9], np.int32)
    runner.input_batch.num_prompt_tokens = np.array([5, 9], np.int32)
    runner._prepare_inputs(None, np.array([1, 1], np.int32))
    assert runner._build_attention_metadata(slot_mappings={0: _global_slots()}) == ("md", None)
    assert runner._model_forward(torch.zeros(2), torch.zeros(2)) == "hidden"
    # A split plan is ignored while capturing CUDA graphs.
    runner._step = PCPStep(build_pcp_metadata([0], [16], 2, 0, min_split_tokens=4))
    runner._build_attention_metadata(for_cudagraph_capture=True, slot_mappings={})
    assert calls == ["stock", "forward", "stock"] and runner._step is None


def test_prepare_inputs_plans_from_the_persistent_batch(monkeypatch):
    runner = _make_runner(ThreadGroup(2), 1)
    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", lambda self, so, n: ("idx", None))
    assert runner._prepare_inputs(None, np.array(SCHEDULED, np.int32)) == ("idx", None)
    expect = build_pcp_metadata(COMPUTED, SCHEDULED, 2, 1, min_split_tokens=4)
    assert torch.equal(runner._step.plan.local_token_indices, expect.local_token_indices)
    assert runner._step.plan.num_split_requests == 2  # the 37- and 9-token prefills


@pytest.mark.parametrize("world", [2, 3])
def test_kv_update_writes_every_ranks_tokens(monkeypatch, world):
    group = ThreadGroup(world)
    written = {}
    monkeypatch.setattr(FlashInferImpl, "do_kv_cache_update",
                        lambda self, layer, k, v, cache, slots: written.__setitem__(
                            self.rank, (k.clone(), v.clone(), slots)))
    plans = [build_pcp_metadata(COMPUTED, SCHEDULED, world, r, min_split_tokens=2)
             for r in range(world)]
    padded = plans[0].num_padded_tokens_per_rank
    monkeypatch.setattr(backend_mod, "_layer_metadata", lambda layer: layer.metadata)
    k_all = torch.randn(sum(SCHEDULED), 2, 8)
    v_all = torch.randn(sum(SCHEDULED), 2, 8)

    def rank_fn(rank):
        impl = object.__new__(PCPFlashInferImpl)
        impl.rank, impl.pcp_world_size = rank, world
        layer = SimpleNamespace(metadata=PCPSplitMetadata(KVExchange(group.rank(rank), padded),
                                                          "slots", None))
        local = plans[rank].local_token_indices
        impl.do_kv_cache_update(layer, k_all[local], v_all[local], None, "vllm's slots")

    group.run(rank_fn)
    idx = plans[0].gathered_token_indices
    for rank in range(world):
        k, v, slots = written[rank]
        assert k.shape == (world * padded, 2, 8) and slots == "slots"
        torch.testing.assert_close(k[idx >= 0], k_all[idx[idx >= 0]])
        torch.testing.assert_close(v[idx >= 0], v_all[idx[idx >= 0]])


def test_kv_update_without_exchange_is_stock(monkeypatch):
    seen = []
    monkeypatch.setattr(FlashInferImpl, "do_kv_cache_update",
                        lambda self, layer, k, v, cache, slots: seen.append(k))
    monkeypatch.setattr(backend_mod, "_layer_metadata", lambda layer: None)
    key = torch.randn(3, 1, 4)
    impl = object.__new__(PCPFlashInferImpl)
    impl.pcp_world_size = 2
    impl.do_kv_cache_update(None, key, key, None, None)
    assert seen[0] is key
    # PCP = 1 never looks for an exchange.
    monkeypatch.setattr(backend_mod, "_layer_metadata", lambda layer: 1 / 0)
    impl.pcp_world_size = 1
    impl.do_kv_cache_update(None, key, key, None, None)
    assert seen[1] is key


def test_layer_metadata_reads_the_layers_entry(monkeypatch):
    split = PCPSplitMetadata(KVExchange(object(), 8), torch.zeros(16), None)
    stock = SimpleNamespace()
    ctx = SimpleNamespace(attn_metadata={"l0": split, "l1": stock})
    monkeypatch.setattr(backend_mod, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(backend_mod, "get_forward_context", lambda: ctx)
    assert backend_mod._layer_metadata(SimpleNamespace(layer_name="l0")) is split
    assert backend_mod._layer_metadata(SimpleNamespace(layer_name="l1")) is stock
    monkeypatch.setattr(backend_mod, "is_forward_context_available", lambda: False)
    assert backend_mod._layer_metadata(SimpleNamespace(layer_name="l0")) is None


def test_prepare_inputs_skips_planning_without_a_split(monkeypatch):
    runner = _make_runner(ThreadGroup(2), 0)
    runner.input_batch.num_computed_tokens_cpu = np.array([30, 0, 0, 0], np.int32)
    runner.input_batch.num_prompt_tokens = np.array([30, 3, 1, 2], np.int32)
    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", lambda self, so, n: ("idx", None))
    runner._prepare_inputs(None, np.array([1, 3, 1, 2], np.int32))  # prompts below 2N = 4
    assert runner._step is None and runner.pcp_step_counts.split_steps == 0
    # a preempted request recomputing prompt and output: its prefill is the whole length;
    # a chunk of it with rows of 1 token (vLLM's decode kernel) is computed whole
    runner.input_batch.num_computed_tokens_cpu = np.array([30, 0, 0, 12], np.int32)
    runner._prepare_inputs(None, np.array([1, 3, 1, 7], np.int32))
    assert runner._step is None and runner.pcp_step_counts.split_steps == 0
    runner._prepare_inputs(None, np.array([1, 3, 1, 8], np.int32))  # 2N rows of 2 tokens
    assert runner._step.plan.num_split_requests == 1
    assert runner.pcp_step_counts.split_steps == 1  # the split step is counted


def test_every_chunk_of_a_long_prompt_is_split(monkeypatch):
    """A 40-token chunk of a 20,000-token prompt (vLLM's token budget minus the
    decodes running beside it) is split at the default threshold of 8192: the
    prompt's length decides, not the chunk's."""
    runner = _make_runner(ThreadGroup(2), 1)
    runner.pcp_min_split_tokens = 8192
    runner.input_batch.num_computed_tokens_cpu = np.array([30, 8000, 0, 12], np.int32)
    runner.input_batch.num_prompt_tokens = np.array([30, 20000, 4000, 21], np.int32)
    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", lambda self, so, n: ("idx", None))
    runner._prepare_inputs(None, np.array([1, 40, 4000, 9], np.int32))
    plan = runner._step.plan
    assert plan.num_split_requests == 1 and plan.is_split  # the 4000-token prompt: whole
    expect = build_pcp_metadata([30, 8000, 0, 12], [1, 40, 4000, 9], 2, 1,
                                min_split_tokens=8192,
                                prefill_lens=[30, 20000, 4000, 21])
    assert torch.equal(plan.local_token_indices, expect.local_token_indices)


def test_dcp_steps_plan_every_step_with_the_sharded_layout(monkeypatch):
    runner = _make_runner(ThreadGroup(2), 1)
    runner.pcp_dcp, runner.cp_kv_cache_interleave_size = True, 8
    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", lambda self, so, n: ("idx", None))
    runner._prepare_inputs(None, np.array([1, 1, 1, 1], np.int32))  # decodes only
    plan = runner._step.plan
    assert plan.dcp_rank == 1 and plan.interleave == 8
    # vLLM's DCP slot mapping: -1 where another rank owns the token.
    slots = _global_slots().clone()
    slots[::2] = -1
    metadata = runner._build_attention_metadata(slot_mappings={0: slots})[0]
    md = metadata["l0"]
    assert md.plan is plan and torch.equal(md.block_table, BLOCKS[:4])
    assert md.exchange.num_context_rows == 0 and not md.heads_gathered
    gathered = md.slot_mapping
    idx = plan.pcp.gathered_token_indices
    assert torch.equal(gathered[idx >= 0], slots[idx[idx >= 0]])


@pytest.mark.parametrize("exchange,fetched", [("auto", True), ("keys", True),
                                              ("queries", False)])
def test_the_context_exchange_knob_reaches_the_plan(monkeypatch, exchange, fetched):
    """Request 3 (12 tokens of context, split): its context K/V is fetched, or its
    queries travel; "auto" fetches at 2 kv heads per 16 query heads."""
    runner = _make_runner(ThreadGroup(2), 0)
    runner.pcp_dcp, runner.cp_kv_cache_interleave_size = True, 8
    runner.pcp_dcp_context_exchange = exchange
    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", lambda self, so, n: ("idx", None))
    runner._prepare_inputs(None, np.array(SCHEDULED, np.int32))
    plan = runner._step.plan
    if fetched:
        assert plan.ctx_gather.req.tolist() == [3] and not len(plan.ctx_split.query_index)
    else:
        assert plan.ctx_gather is None and plan.ctx_split.req.tolist() == [3, 3, 3, 3]
    # the cache write's slot mapping follows the exchange's buffer: context rows -1
    md = runner._build_attention_metadata(slot_mappings={0: _global_slots()})[0]["l0"]
    slots = md.slot_mapping
    padded = plan.pcp.num_padded_tokens_per_rank
    assert md.exchange.num_context_rows == (plan.ctx_gather.num_padded if fetched else 0)
    blocks = slots.view(2, padded + (plan.ctx_gather.num_padded if fetched else 0))
    assert (blocks[:, padded:] == -1).all()
    assert torch.equal(blocks[:, :padded].reshape(-1), gathered_slot_mapping(
        _global_slots(), plan.pcp.gathered_token_indices))


def test_dcp_decode_steps_run_stock_with_the_plugins_attention(monkeypatch):
    runner = _make_runner(ThreadGroup(2), 1)
    runner.pcp_dcp, runner.cp_kv_cache_interleave_size = True, 8
    runner.input_batch.num_computed_tokens_cpu = np.array([30, 9, 17, 12], np.int32)
    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", lambda self, so, n: ("idx", None))
    runner._prepare_inputs(None, np.array([1, 1, 1, 1], np.int32))
    plan = runner._step.plan
    assert plan.decode is not None
    metadata = runner._build_attention_metadata(slot_mappings={0: _global_slots()})[0]
    md = metadata["l0"]
    assert metadata["l1"] is md and md.plan is plan and torch.equal(md.block_table, BLOCKS[:4])
    # no K/V exchange (stock cache write) and no step to restore (stock forward)
    assert md.exchange is None and runner._step.inputs is None and not runner._step.eager
    assert md.group is runner.pcp_group and md.graph_rows is None


def _dcp_decode_runner(monkeypatch, computed):
    runner = _make_runner(ThreadGroup(2), 1)
    runner.pcp_dcp, runner.cp_kv_cache_interleave_size = True, 8
    runner.input_batch.num_computed_tokens_cpu = np.array(computed, np.int32)
    runner.input_batch.num_prompt_tokens = np.array(computed, np.int32)
    runner.input_batch.num_reqs = len(computed)
    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", lambda self, so, n: ("idx", None))
    runner._prepare_inputs(None, np.ones(len(computed), np.int32))
    return runner


def test_dcp_decode_steps_replay_the_padded_graph(monkeypatch):
    """vLLM pads a decode batch of 3 to the graph of 4 (num_reqs_padded): the plan
    keeps the 3 requests, the attention runs the graph of 4 rows."""
    runner = _dcp_decode_runner(monkeypatch, [30, 9, 17])
    plan = runner._step.plan
    md = runner._build_attention_metadata(num_reqs=3, num_reqs_padded=4,
                                          slot_mappings={0: _global_slots()})[0]["l0"]
    assert md.plan is plan and len(plan.decode.req) == 3 and md.graph_rows == 4
    assert torch.equal(md.block_table, BLOCKS[:4]) and runner._step.inputs is None


def test_dcp_non_folded_decode_in_a_graph_batch_runs_eagerly(monkeypatch):
    """A uniform decode batch vLLM would replay, with a request too short for every
    rank to hold a token: the general path, whose forward switches graphs off."""
    runner = _dcp_decode_runner(monkeypatch, [30, 2, 17, 12])  # 3 tokens, interleave 8
    assert runner._step.plan.decode is None
    metadata = runner._build_attention_metadata(num_reqs=4, num_reqs_padded=4,
                                                slot_mappings={0: _global_slots()})[0]
    assert metadata["l0"].graph_rows is None and runner._step.inputs is not None


def test_dcp_graph_capture_plans_vllms_dummy_decode_batch():
    """Capture: no _prepare_inputs; vLLM's dummy batch (sequence 1 + N * I) is planned
    as a folded decode of num_reqs rows from the runner's sequence lengths."""
    runner = _make_runner(ThreadGroup(2), 1)
    runner.pcp_dcp, runner.cp_kv_cache_interleave_size = True, 8
    runner.optimistic_seq_lens_cpu = torch.tensor([17, 17, 17, 0, 0], dtype=torch.int32)
    md = runner._build_attention_metadata(num_reqs=3, for_cudagraph_capture=True,
                                          slot_mappings={0: _global_slots()})[0]["l1"]
    assert md.graph_rows == 3 and md.exchange is None
    assert md.plan.decode.kv_len.tolist() == [8, 8, 8]  # rank 1 holds tokens 8..15
    runner.optimistic_seq_lens_cpu[:] = torch.tensor([17, 17, 0, 0, 0])
    md = runner._build_attention_metadata(num_reqs=3, for_cudagraph_capture=True,
                                          slot_mappings={0: _global_slots()})[0]["l1"]
    assert md.graph_rows == 3 and len(md.plan.decode.req) == 2  # row 3: padding
    # vLLM's memory profiling: 16-token rows (8192 / 512), interleave 16 -> rank 1 of 2
    # would hold none of them; the rows are lengthened so every rank holds a token
    runner.cp_kv_cache_interleave_size = 16
    runner.optimistic_seq_lens_cpu[:] = torch.tensor([16, 16, 1, 0, 0])
    md = runner._build_attention_metadata(num_reqs=3, for_cudagraph_capture=True,
                                          slot_mappings={0: _global_slots()})[0]["l1"]
    assert md.graph_rows == 3 and md.plan.decode.kv_len.tolist() == [1, 1, 1]
    runner.optimistic_seq_lens_cpu[:] = 0  # nothing to capture
    with pytest.raises(RuntimeError, match="--enforce-eager"):
        runner._build_attention_metadata(num_reqs=3, for_cudagraph_capture=True,
                                         slot_mappings={0: _global_slots()})


class _FakeDCPAttention:
    """Records what a layer's forward hands the planned attention."""

    def __init__(self):
        self.calls = []

    def run(self, step, group, q, k, v, cache, out=None):
        self.calls.append((step, group, q.shape, k, v, getattr(cache[0], "shape", cache[0])))
        self.out = out
        return q * 2 if out is None else out.copy_(q * 2)

    def run_heads_gathered(self, step, group, q, k, v, cache):
        self.calls.append(("heads", group, q.shape, k.shape, v.shape))
        return q * 3


def test_dcp_forward_gathers_the_step_kv_for_attention(monkeypatch):
    """The forward all-gathers the step's K/V (gathered layout, not restored), writes
    it with the gathered slot mapping and hands the same buffer to the attention; with
    context to fetch, each rank's stored rows ride after its block. The layer's
    separate cache-write hook writes nothing."""
    group = ThreadGroup(2)
    written = []
    monkeypatch.setattr(FlashInferImpl, "do_kv_cache_update",
                        lambda self, layer, k, v, cache, slots: written.append(
                            (k.shape[0], slots)))
    plans = [build_pcp_metadata(COMPUTED, SCHEDULED, 2, r, min_split_tokens=4) for r in range(2)]
    padded, restore = plans[0].num_padded_tokens_per_rank, plans[0].restore_indices
    k_all = torch.randn(sum(SCHEDULED), 1, 4)
    stored = [torch.randn(n, 2, 1, 4) for n in (3, 2)]  # each rank's context rows

    def rank_fn(rank, context_rows):
        attention = _FakeDCPAttention()
        step = SimpleNamespace(read_context=lambda kv: (
            stored[rank] if context_rows and kv == ("views", "views") else None))
        local = plans[rank].local_token_indices
        md = PCPDCPMetadata(attention, step, group.rank(rank),
                            KVExchange(group.rank(rank), padded, context_rows),
                            len(local), slot_mapping="gathered slots")
        impl = object.__new__(PCPFlashInferImpl)
        impl.pcp_world_size, impl.dcp_world_size = 2, 2
        monkeypatch.setattr(backend_mod, "_layer_metadata", lambda layer: md)
        impl.do_kv_cache_update(None, k_all[local], -k_all[local], "cache", "vllm's slots")
        q = torch.randn(padded, 2, 4)
        output = torch.ones(padded, 2, 4)
        impl.forward(None, q, k_all[local], -k_all[local], "cache", md, output)
        # the attention writes the layer's output rows in place
        assert attention.out.data_ptr() == output.data_ptr()
        assert attention.out.shape == (len(local), 2, 4)
        torch.testing.assert_close(output[:len(local)], q[:len(local)] * 2)
        assert (output[len(local):] == 0).all()  # pad rows zeroed
        (_, _, _, k_buf, v_buf, _), = attention.calls
        return k_buf, v_buf

    monkeypatch.setattr(PCPFlashInferImpl, "_kv_views", lambda self, kv: ("views", "views"))
    for k_buf, v_buf in group.run(lambda r: rank_fn(r, 0)):
        assert k_buf.shape[0] == 2 * padded
        assert torch.equal(k_buf.index_select(0, restore), k_all)
        assert torch.equal(v_buf.index_select(0, restore), -k_all)
    for k_buf, v_buf in group.run(lambda r: rank_fn(r, 4)):
        blocks = k_buf.view(2, padded + 4, 1, 4)
        for rank in range(2):
            assert torch.equal(blocks[rank, padded:padded + len(stored[rank])], stored[rank][:, 0])
        rows = restore // padded * (padded + 4) + restore % padded
        assert torch.equal(k_buf.index_select(0, rows), k_all)
        assert torch.equal(v_buf.view(2, padded + 4, 1, 4)[1, padded:padded + 2], stored[1][:, 1])
    assert written == [(2 * padded, "gathered slots")] * 2 + \
        [(2 * (padded + 4), "gathered slots")] * 2


def test_dcp_forward_runs_the_planned_attention(monkeypatch):
    written = []
    monkeypatch.setattr(FlashInferImpl, "do_kv_cache_update",
                        lambda self, layer, k, v, cache, slots: written.append(slots))
    monkeypatch.setattr(backend_mod.FlashInferBackend, "get_kv_cache_stride_order",
                        staticmethod(lambda: (0, 2, 1, 3)))
    impl = object.__new__(PCPFlashInferImpl)
    impl.head_size, impl.dcp_world_size, impl.pcp_world_size = 4, 2, 2
    attention, step = _FakeDCPAttention(), SimpleNamespace(read_context=lambda kv: None)
    one = ThreadGroup(1).rank(0)
    md = PCPDCPMetadata(attention, step, "group", KVExchange(one, 8), num_local_tokens=3,
                        slot_mapping="gathered slots")
    query = torch.randn(5, 2, 4)
    key, value = torch.randn(5, 1, 4), torch.randn(5, 1, 4)
    output = torch.zeros(5, 2, 4)
    kv_cache = torch.zeros(6, 1, 16, 8)  # (blocks, kv heads, block size, 2 * head size)
    assert impl.forward(None, query, key, value, kv_cache, md, output) is output
    torch.testing.assert_close(output[:3], query[:3] * 2)
    assert (output[3:] == 0).all()
    (got_step, group, q_shape, k, v, cache_shape), = attention.calls
    assert (got_step, group, q_shape, cache_shape) == (step, "group", (3, 2, 4), (6, 16, 1, 4))
    assert torch.equal(k[:5], key) and k.shape == (8, 1, 4) and written == ["gathered slots"]
    # A decode step has no exchange: the attention reads no step K/V, writes nothing.
    impl.forward(None, query, None, None, kv_cache,
                 PCPDCPMetadata(attention, step, "group", None, 3), output)
    assert attention.calls[-1] == (step, "group", (3, 2, 4), None, None, (6, 16, 1, 4))
    assert written == ["gathered slots"]
    # DCP inside TP: the layer's own K/V (every rank has the step's), heads gathered
    output.zero_()
    impl.forward(None, query, key, value, kv_cache,
                 PCPDCPMetadata(attention, step, "group", None, 3, heads_gathered=True), output)
    assert attention.calls[-1] == ("heads", "group", (3, 2, 4), (3, 1, 4), (3, 1, 4))
    torch.testing.assert_close(output[:3], query[:3] * 3)
    # Any other metadata under DCP is a warm-up run: zeros, no stock DCP path.
    output.fill_(1)
    impl.forward(None, query, None, None, kv_cache, SimpleNamespace(), output)
    assert (output == 0).all()


def test_builder_plans_one_dcp_attention_per_builder(monkeypatch):
    import vllm_pcp.dcp.attention as dcp_mod

    made = []

    class FakeDCPAttention:
        def __init__(self, *args, **kwargs):
            made.append((args, kwargs))

        def plan(self, plan, table, graph_rows=None, kv_gathered=True):
            self.planned = (plan, table, graph_rows)
            self.kv_gathered = kv_gathered
            return ("planned", table)

    import vllm.v1.attention.backends.utils as vllm_utils

    monkeypatch.setattr(dcp_mod, "DCPAttention", FakeDCPAttention)
    monkeypatch.setattr(vllm_utils, "get_kv_cache_layout", lambda: "HND")
    builder = object.__new__(PCPFlashInferMetadataBuilder)
    builder._get_workspace_buffer = lambda: "ws"
    builder.num_qo_heads, builder.num_kv_heads, builder.head_dim = 8, 2, 64
    builder.page_size, builder.q_data_type_prefill = 16, torch.bfloat16
    builder.global_hyperparameters = SimpleNamespace(sm_scale=0.125)
    builder.vllm_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=8),
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=16),
        parallel_config=SimpleNamespace(prefill_context_parallel_size=2))
    builder.dcp_world_size = 2
    plan = SimpleNamespace(num_local_tokens=7, ctx_gather=None)
    first = builder.build_dcp(plan, "table", "group", False, "exchange", "slots")
    second = builder.build_dcp(plan, "table2", "group", False)
    assert made == [(("ws", 8, 2, 64, 16, torch.bfloat16, 0.125, "HND"),
                     {"max_graph_rows": 16})]
    assert first.attention is second.attention
    assert second.attention.planned == (plan, "table2", None)
    assert first.step == ("planned", "table") and second.step == ("planned", "table2")
    assert first.exchange == "exchange" and second.exchange is None
    assert first.slot_mapping == "slots" and second.slot_mapping is None
    assert second.num_local_tokens == 7 and second.group == "group"
    graph = builder.build_dcp(plan, "table3", "group", False, graph_rows=4)
    assert graph.num_local_tokens == 4 and graph.attention.planned == (plan, "table3", 4)
    assert not graph.heads_gathered and graph.attention.kv_gathered
    # DCP inside TP (PCP = 1): the attention takes the DCP group's query heads
    builder._dcp_attention = None
    tp = builder.build_dcp(plan, "table", "group", True)
    assert made[-1][0][1] == 16 and tp.heads_gathered and not tp.attention.kv_gathered


def _tp_dcp_runner(monkeypatch, computed, scheduled):
    """Rank 1 of -tp 2 -dcp 2 at PCP = 1: the DCP group is vLLM's, inside TP."""
    group = ThreadGroup(2)
    runner = _make_runner(group, 1)
    runner.pcp_group = ThreadGroup(1).rank(0)
    runner.pcp_world_size, runner.pcp_rank = 1, 0
    runner.pcp_dcp, runner.cp_kv_cache_interleave_size = True, 8
    runner.dcp_group, runner.dcp_heads_gathered = group.rank(1), True
    runner.input_batch.num_computed_tokens_cpu = np.array(computed, np.int32)
    runner.input_batch.num_prompt_tokens = np.array(computed, np.int32) + 1
    runner.input_batch.num_reqs = len(computed)
    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", lambda self, so, n: ("idx", None))
    runner._prepare_inputs(None, np.array(scheduled, np.int32))
    return runner


def test_dcp_inside_tp_plans_over_the_dcp_group_and_splits_nothing(monkeypatch):
    runner = _tp_dcp_runner(monkeypatch, COMPUTED, SCHEDULED)
    plan = runner._step.plan
    assert plan.dcp_rank == 1 and plan.dcp_world_size == 2
    assert len(plan.ctx_split.query_index) == 0  # every row replicated: nothing split
    assert sorted(plan.pcp.local_token_indices.tolist()) == list(range(sum(SCHEDULED)))
    metadata = runner._build_attention_metadata(num_reqs=4, num_reqs_padded=4,
                                                slot_mappings={0: _global_slots()})[0]
    md = metadata["l0"]
    # stock forward and cache write (every rank has the step's K/V), never a graph
    assert md.exchange is None and runner._step.inputs is None and runner._step.eager
    assert md.group is runner.dcp_group and md.graph_rows is None


def test_dcp_inside_tp_decode_steps_replay_graphs(monkeypatch):
    runner = _tp_dcp_runner(monkeypatch, [30, 9, 17], [1, 1, 1])
    md = runner._build_attention_metadata(num_reqs=3, num_reqs_padded=4,
                                          slot_mappings={0: _global_slots()})[0]["l0"]
    assert md.plan.decode is not None and md.graph_rows == 4 and not runner._step.eager


def test_an_eager_dcp_step_switches_the_graph_off(monkeypatch):
    runner = _tp_dcp_runner(monkeypatch, COMPUTED, SCHEDULED)
    runner._build_attention_metadata(num_reqs=4, slot_mappings={0: _global_slots()})
    seen = {}
    ctx = SimpleNamespace(cudagraph_runtime_mode="FULL", batch_descriptor="bd")
    monkeypatch.setattr(runner_mod, "get_forward_context", lambda: ctx)
    monkeypatch.setattr(GPUModelRunner, "_model_forward",
                        lambda self, *a, **k: seen.update(mode=ctx.cudagraph_runtime_mode))
    runner._model_forward(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long))
    from vllm.config import CUDAGraphMode

    assert seen["mode"] == CUDAGraphMode.NONE and ctx.batch_descriptor is None
    assert runner._step is None  # one step only


def test_row_buffers_hold_two_rows_per_request():
    """8 split requests at max_num_seqs 8 are 16 rows per rank: the builder's
    per-row buffers must take them (the stock size failed on 2 x H200)."""
    import numpy as np
    from vllm.v1.utils import CpuGpuBuffer

    from vllm_pcp.backend import grow_row_buffers
    from vllm_pcp.pcp.partition import build_pcp_metadata

    builder = object.__new__(PCPFlashInferMetadataBuilder)
    builder.pin_memory = False
    builder._make_buffer = lambda *size: CpuGpuBuffer(*size, dtype=torch.int32,
                                                      device="cpu", pin_memory=False,
                                                      with_numpy=True)
    max_num_seqs, pages_per_req = 8, 5
    builder.paged_kv_indptr = builder._make_buffer(max_num_seqs + 1)
    builder.paged_kv_indices = builder._make_buffer(max_num_seqs * pages_per_req)
    builder.paged_kv_last_page_len = builder._make_buffer(max_num_seqs)
    plan = build_pcp_metadata([0] * 8, [64] * 8, 2, 0)
    assert plan.num_rows == 16
    with pytest.raises(ValueError):
        np.cumsum(np.ones(plan.num_rows), out=builder.paged_kv_indptr.np[1:plan.num_rows + 1])
    grow_row_buffers(builder, 2 * max_num_seqs)
    np.cumsum(np.ones(plan.num_rows, dtype=np.int32),
              out=builder.paged_kv_indptr.np[1:plan.num_rows + 1])
    assert builder.paged_kv_indptr_cpu_buffer.shape == (2 * max_num_seqs + 1,)
    assert builder.paged_kv_indices.cpu.shape == (2 * max_num_seqs * pages_per_req,)
    assert builder.paged_kv_last_page_len.cpu.shape == (2 * max_num_seqs,)
    grow_row_buffers(builder, 4)  # never shrinks
    assert builder.paged_kv_last_page_len.cpu.shape == (2 * max_num_seqs,)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_split_rows_keep_the_kernel_one_gpu_attends_them_with(monkeypatch, world):
    """vLLM's FlashInfer attends a row of at most ``reorder_batch_threshold`` query
    tokens with its decode kernel (``split_decodes_and_prefills``), a longer one with its
    prefill kernel; on SM90 with an fp8 cache the two take bf16 and fp8 queries. Every
    local row must be in the class one GPU puts its whole chunk in: the 3-token chunk of
    a 6,003-token prompt (a prefix hit) and a 7-token one stay whole, the 40-token one
    is split into rows of at least 2 tokens, decodes stay decodes."""
    import vllm.v1.attention.backends.utils as attn_utils

    from helpers import local_attention_metadata

    computed, prompts = [30, 6000, 6000, 8000], [30, 6003, 6007, 20000]
    scheduled = np.array([1, 3, 7, 40], np.int32)
    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", lambda self, so, n: ("idx", None))
    group = ThreadGroup(world)
    for rank in range(world):
        runner = _make_runner(group, rank)
        runner.input_batch.num_computed_tokens_cpu = np.array(computed, np.int32)
        runner.input_batch.num_prompt_tokens = np.array(prompts, np.int32)
        runner.input_batch.num_reqs = 4
        runner._prepare_inputs(None, scheduled)
        plan = runner._step.plan
        assert plan.num_split_requests == 1
        cm = local_attention_metadata(plan, torch.zeros((plan.num_rows, 1), dtype=torch.int32))
        num_decodes, _, _, _ = attn_utils.split_decodes_and_prefills(cm, decode_threshold=1)
        one_gpu_decode = scheduled[plan.row_req_indices.numpy()] <= 1
        assert list(one_gpu_decode) == [i < num_decodes for i in range(plan.num_rows)], rank

"""The plugin's FlashInfer layer and builder on the CPU, call by call: where the cache write
all-gathers the step's K/V, which metadata each step's layer reads, what a rank without
tokens and the pad rows return, and the builder's per-row buffers. (Whole steps through
vLLM's manager: test_dcp_attention_cpu.py, test_ragged_split.py, test_uneven_ranks.py.)"""
import threading
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.attention.backends.flashinfer import FlashInferImpl

import vllm_pcp.backend as backend_mod
from helpers import ThreadGroup
from vllm_pcp.backend import (PCPDCPMetadata, PCPEmptyMetadata, PCPFlashInferImpl,
                              PCPRaggedMetadata)


def _impl(pcp, dcp=1, head_size=4):
    impl = object.__new__(PCPFlashInferImpl)
    impl.pcp_world_size, impl.dcp_world_size, impl.head_size = pcp, dcp, head_size
    return impl


@pytest.fixture
def stock_writes(monkeypatch):
    """What vLLM's cache write gets, call by call: ``(key, value, slot mapping)``."""
    writes = []
    monkeypatch.setattr(FlashInferImpl, "do_kv_cache_update",
                        lambda self, layer, k, v, cache, slots: writes.append((k, v, slots)))
    return writes


@pytest.mark.parametrize("world", [2, 3])
def test_a_slot_mapping_of_every_ranks_rows_all_gathers_the_kv_first(monkeypatch, world,
                                                                     stock_writes):
    """vLLM's manager lays a gathered step's slot mapping out for every rank's ``P``
    rows (``[N * P]``); the layer's cache write all-gathers the ``P`` local K/V rows
    first, rank 0's block first, and writes them with that slot mapping."""
    group, local = ThreadGroup(world), threading.local()
    monkeypatch.setattr(backend_mod, "_layer_metadata", lambda layer: SimpleNamespace())
    monkeypatch.setattr(backend_mod, "get_pcp_group", lambda: group.rank(local.rank))
    keys = torch.randn(world, 5, 2, 4)

    def rank_fn(rank):
        local.rank = rank
        _impl(world).do_kv_cache_update(None, keys[rank], -keys[rank], None,
                                        torch.arange(world * 5))

    group.run(rank_fn)
    assert len(stock_writes) == world
    for k, v, slots in stock_writes:
        assert torch.equal(k, keys.reshape(world * 5, 2, 4)) and torch.equal(v, -k)
        assert torch.equal(slots, torch.arange(world * 5))


def test_a_step_every_rank_writes_itself_is_vllms_write(monkeypatch, stock_writes):
    """A step whose slot mapping covers the local rows only (nothing split, every rank
    computes every token) and every PCP = 1 layer: vLLM's write, no collective."""
    monkeypatch.setattr(backend_mod, "get_pcp_group", lambda: 1 / 0)
    monkeypatch.setattr(backend_mod, "_layer_metadata", lambda layer: SimpleNamespace())
    key = torch.randn(3, 1, 4)
    _impl(2).do_kv_cache_update(None, key, key, None, torch.arange(3))
    monkeypatch.setattr(backend_mod, "_layer_metadata", lambda layer: 1 / 0)
    _impl(1).do_kv_cache_update(None, key, key, None, torch.arange(5))  # never looks
    assert [k is key for k, _, _ in stock_writes] == [True, True]


@pytest.mark.parametrize("metadata", [
    PCPRaggedMetadata(torch.arange(4), ragged=None),
    PCPDCPMetadata(None, None, True, 2, 0, torch.arange(4), 2, (0, 1, 2, 3))])
def test_layers_whose_forward_writes_skip_the_cache_write(monkeypatch, stock_writes,
                                                          metadata):
    """Fresh split steps (the ragged kernel) and gathered -dcp steps write the cache in
    the layer's forward, after the one all-gather that also feeds the attention."""
    monkeypatch.setattr(backend_mod, "_layer_metadata", lambda layer: metadata)
    _impl(2).do_kv_cache_update(None, torch.randn(2, 1, 4), None, None, torch.arange(4))
    assert stock_writes == []


def test_an_unsplit_dcp_step_writes_its_own_tokens(monkeypatch, stock_writes):
    metadata = PCPDCPMetadata(None, None, False, 2, 0, torch.arange(2), 2, (0, 1, 2, 3))
    monkeypatch.setattr(backend_mod, "_layer_metadata", lambda layer: metadata)
    key = torch.randn(2, 1, 4)
    _impl(2, 2).do_kv_cache_update(None, key, key, None, torch.arange(2))
    assert stock_writes[0][0] is key


def test_layer_metadata_reads_the_layers_entry(monkeypatch):
    split, stock = object(), SimpleNamespace()
    ctx = SimpleNamespace(attn_metadata={"l0": split, "l1": stock})
    monkeypatch.setattr(backend_mod, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(backend_mod, "get_forward_context", lambda: ctx)
    assert backend_mod._layer_metadata(SimpleNamespace(layer_name="l0")) is split
    assert backend_mod._layer_metadata(SimpleNamespace(layer_name="l1")) is stock
    ctx.attn_metadata = split  # one metadata for every layer
    assert backend_mod._layer_metadata(SimpleNamespace(layer_name="l1")) is split
    monkeypatch.setattr(backend_mod, "is_forward_context_available", lambda: False)
    assert backend_mod._layer_metadata(SimpleNamespace(layer_name="l0")) is None


def _stock_forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                   output_scale=None, output_block_scale=None):
    output.fill_(float("nan"))  # vLLM's output buffer is torch.empty: pad rows hold anything
    output[:attn_metadata.num_actual_tokens] = 2 * query[:attn_metadata.num_actual_tokens]
    return output


def test_pad_rows_of_a_pcp_step_are_zero(monkeypatch):
    """vLLM's manager pads every rank to ``P`` rows; the layer's output of the pad rows is
    zero (finite through the rest of the model, MoE routing included). A rank without
    tokens attends nothing and returns zeros. At PCP = 1 the output is vLLM's."""
    monkeypatch.setattr(FlashInferImpl, "forward", _stock_forward)
    query = torch.randn(5, 2, 4)
    out = _impl(2).forward(None, query, None, None, None,
                           SimpleNamespace(num_actual_tokens=3), torch.empty(5, 2, 4))
    torch.testing.assert_close(out[:3], 2 * query[:3])
    assert (out[3:] == 0).all()
    out = _impl(2).forward(None, query, None, None, None, PCPEmptyMetadata(torch.arange(5)),
                           torch.full((5, 2, 4), float("nan")))
    assert (out == 0).all()
    out = _impl(1).forward(None, query, None, None, None,
                           SimpleNamespace(num_actual_tokens=3), torch.empty(5, 2, 4))
    assert out[3:].isnan().all()


@pytest.mark.parametrize("metadata,message", [
    (PCPRaggedMetadata(torch.arange(4), ragged=None), "pcp_split_attention"),
    (PCPDCPMetadata(None, None, True, 2, 0, torch.arange(4), 2, (0, 1, 2, 3)),
     "PCP x DCP does not fuse output quantization")])
def test_plugin_attention_refuses_fused_output_quantization(metadata, message):
    with pytest.raises(NotImplementedError, match=message):
        _impl(2).forward(None, None, None, None, None, metadata, torch.empty(2, 1, 4),
                         output_scale=torch.ones(1))


def test_dummy_runs_of_a_dcp_group_build_no_plan():
    """Dummy and profile runs carry no step: the layers see no metadata and write zeros,
    and no full CUDA graph can replay a -dcp step."""
    from vllm_pcp.backend import PCPFlashInferMetadataBuilder

    builder = object.__new__(PCPFlashInferMetadataBuilder)
    builder.__dict__.update(pcp_dcp=True, pcp_world_size=2)
    assert builder.build(0, SimpleNamespace(num_actual_tokens=4)) is None
    with pytest.raises(RuntimeError, match="full CUDA graphs cannot replay it"):
        builder.build_for_cudagraph_capture(None)


@pytest.fixture
def builder_of(tmp_path, monkeypatch):
    """``make(pcp, max_num_seqs)``: the plugin's builder of a real config, made by its
    own ``__init__``."""
    from vllm.config import SchedulerConfig

    from helpers import real_vllm_config
    from layer_harness import make_builder, make_impl

    def make(pcp, max_num_seqs):
        config = real_vllm_config(
            tmp_path, monkeypatch, dict(prefill_context_parallel_size=pcp),
            scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                             max_num_batched_tokens=4096,
                                             max_model_len=4096, is_encoder_decoder=False))
        config.cache_config.kv_cache_layout = "LBNHC"
        impl = make_impl(monkeypatch, pcp, 0, 8, 2, 8, dcp=1)
        return make_builder(monkeypatch, config, impl, 16, torch.bfloat16, "cpu")

    return make


def test_row_buffers_hold_two_rows_per_request(builder_of, monkeypatch):
    """8 split requests at max_num_seqs 8 are 16 rows per rank: vLLM's FlashInfer plan of
    them must fit the builder's per-row buffers (vLLM sizes them for 8 rows; a stock
    builder fails on such a step)."""
    from helpers import plan_split_rows

    builder = builder_of(2, 8)
    assert builder.paged_kv_last_page_len.np.shape == (16,)
    assert builder.paged_kv_indptr.np.shape == (17,)
    plan, metadata, planned = plan_split_rows(builder, monkeypatch, 0, scheduled=[64] * 8)
    assert plan.num_rows == 16 and metadata.num_prefills == 16
    assert planned["qo_indptr"].tolist() == list(range(0, 16 * 16 + 1, 16))  # 16-token rows
    monkeypatch.setattr(backend_mod, "grow_row_buffers", lambda builder, rows: None)
    with pytest.raises((ValueError, RuntimeError, IndexError)):
        plan_split_rows(builder_of(2, 8), monkeypatch, 0, scheduled=[64] * 8)


def test_row_buffers_never_shrink(builder_of):
    from vllm_pcp.backend import grow_row_buffers

    builder = builder_of(2, 8)
    pages = builder.paged_kv_indices.shape[0]
    grow_row_buffers(builder, 4)
    assert builder.paged_kv_last_page_len.np.shape == (16,)
    assert builder.paged_kv_indices.shape[0] == pages
    grow_row_buffers(builder, 32)
    assert builder.paged_kv_last_page_len.np.shape == (32,)
    assert builder.paged_kv_indices.shape[0] == 2 * pages  # the same pages per row
    assert builder_of(1, 8).paged_kv_last_page_len.np.shape == (8,)  # PCP = 1: vLLM's


def test_the_kv_exchange_pads_each_rank_to_the_same_rows():
    """``gather_kv``: every rank sends ``P`` new rows (fewer padded with zeros) and
    ``Pc`` context rows, K and V in one all-gather; rank 0's block first."""
    from vllm_pcp.pcp.exchange import gather_kv, with_context_rows

    group, keys = ThreadGroup(2), [torch.randn(n, 2, 4) for n in (3, 1)]
    context = [torch.randn(n, 2, 2, 4) for n in (2, 0)]

    def rank_fn(rank):
        return gather_kv(group.rank(rank), keys[rank], -keys[rank], 3,
                         context[rank] if len(context[rank]) else None, 2)

    for k, v in group.run(rank_fn):
        blocks_k, blocks_v = k.view(2, 5, 2, 4), v.view(2, 5, 2, 4)
        assert torch.equal(blocks_k[0, :3], keys[0]) and torch.equal(blocks_v[1, :1], -keys[1])
        assert (blocks_k[1, 1:3] == 0).all() and (blocks_v[1, 1:3] == 0).all()
        assert torch.equal(blocks_k[0, 3:], context[0][:, 0])
        assert torch.equal(blocks_v[0, 3:], context[0][:, 1])
    gathered = torch.tensor([0, 1, 2, 3, -1, -1])
    assert with_context_rows(gathered, 3, 2).tolist() == [0, 1, 2, -1, -1, 3, -1, -1, -1, -1]


def test_the_layer_configs_build_on_a_host_with_fewer_gpus_than_ranks(monkeypatch):
    """vLLM 0.33.0 refuses a world larger than the host's GPUs when no executor is named;
    the GPU layer tests build -pcp 2 configs on a one-GPU host."""
    import vllm.config.parallel as parallel_module
    from vllm.config import ParallelConfig

    from helpers import parallel_config_of

    platform = type(parallel_module.current_platform)
    monkeypatch.setattr(platform, "is_cuda", lambda self: True)
    monkeypatch.setattr(platform, "device_count", lambda *args: 1, raising=False)
    with pytest.raises(ValueError, match="larger than the number of available GPUs"):
        ParallelConfig(prefill_context_parallel_size=2)
    assert parallel_config_of(dict(prefill_context_parallel_size=2)).world_size == 2

"""Steps whose ranks hold unequal or no local tokens, through vLLM's PCP manager and the
plugin's layer at DCP = 1.

A decode beside a split prefill gives ranks unequal counts; under ``pcp_decode_policy
shard`` a step of fewer decodes than ranks leaves ranks without tokens. vLLM's manager
runs every rank on ``P`` rows (its local tokens, then pad rows), so that the collectives
inside the model line up: the plugin's K/V all-gather before the cache write, and vLLM's
fused MoE over the PCP group (``fused_moe/runner/moe_runner.py``: all-gather the rows,
reduce-scatter the expert sums).

Without CP vs with CP: a one-layer model (the cache write and attention through
``PCPFlashInferImpl`` with vLLM's FlashInfer kernels replaced by plain torch, a MoE whose
experts are sharded over the ranks) must restore, on every rank, what one process
computes, and write every token's K/V exactly once on every rank.
"""
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.attention.backends.flashinfer import FlashInferImpl, FlashInferMetadataBuilder

from helpers import ThreadGroup, pcp_settings
from manager_harness import SLOT_BASE

STEPS = {  # (computed, scheduled, decode policy, N): what the ranks get
    "shard-decodes": ([10, 20], [1, 1], "shard", 3),  # rank 2: no token
    "shard-decodes-4": ([10, 20, 30], [1, 1, 1], "shard", 4),  # rank 3: no token
    "decode-beside-split": ([30, 0], [1, 17], "replicate", 2),  # 10 and 9 tokens
    "shard-beside-split": ([30, 12, 40], [1, 24, 1], "shard", 3),  # 9, 9, 8 tokens
    "replicated-decodes": ([30, 12, 40], [1, 1, 1], "replicate", 3),  # no collective
}


def _expert(h: torch.Tensor, expert: int) -> torch.Tensor:
    return torch.tanh(h * (expert + 1) / 100)


def _moe(group, x: torch.Tensor) -> torch.Tensor:
    """vLLM's MoE over the PCP group: all-gather the rows, this rank's expert over all of
    them, reduce-scatter the sums (blocks of ``len(x)`` rows, rank order)."""
    rank = group.rank_in_group
    mine = _expert(group.all_gather(x, dim=0), rank)
    summed = group.all_gather(mine.unsqueeze(0), dim=0).sum(0)
    return summed[rank * len(x):(rank + 1) * len(x)]


def _one_process(batch, world):
    x = torch.stack([batch.input_ids.float(), batch.positions.float()], dim=1)
    return sum(_expert(3 * x, e) for e in range(world))  # attention is 2 x, plus x


def _stock_forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                   output_scale=None, output_block_scale=None):
    """vLLM's FlashInfer forward stand-in: ``2 * query`` on the batch's rows; its output
    buffer is torch.empty, so the pad rows hold anything (NaN here)."""
    n = attn_metadata.num_actual_tokens
    output.fill_(float("nan"))
    output[:n] = 2 * query[:n]
    return output


def _run_step(monkeypatch, name):
    """Every rank's restored output, written slots, local batch and manager."""
    import vllm.v1.worker.gpu.pcp_manager as pcp_manager

    import vllm_pcp.backend as backend
    from layer_harness import _RankContext, make_impl
    from manager_harness import descriptor, global_batch, managers
    from vllm_pcp.backend import PCPFlashInferMetadataBuilder

    computed, scheduled, policy, world = STEPS[name]
    group, ctx, written = ThreadGroup(world), _RankContext(), {}
    monkeypatch.setattr(FlashInferImpl, "forward", _stock_forward)
    monkeypatch.setattr(FlashInferImpl, "do_kv_cache_update",
                        lambda self, layer, k, v, cache, slots: written.setdefault(
                            cache, []).extend(zip(slots.tolist(), k[:len(slots), 0].tolist())))
    monkeypatch.setattr(FlashInferMetadataBuilder, "build", lambda self, prefix, cm, fast=False:
                        SimpleNamespace(num_actual_tokens=cm.num_actual_tokens))
    monkeypatch.setattr(backend, "get_pcp_group", lambda: ctx.group)
    monkeypatch.setattr(pcp_manager, "get_pcp_group", lambda: ctx.group)
    monkeypatch.setattr(backend, "_layer_metadata", lambda layer: ctx.metadata)
    impls = [make_impl(monkeypatch, world, r, 1, 1, 2, dcp=1) for r in range(world)]
    ranks = managers(world, pcp_settings(world, decode_policy=policy))
    builder = object.__new__(PCPFlashInferMetadataBuilder)
    builder.__dict__.update(pcp_dcp=False, pcp_world_size=world, pcp_settings=ranks[0].settings)

    def rank_fn(rank):
        ctx.set(group=group.rank(rank))
        manager, impl = ranks[rank], impls[rank]
        batch = global_batch(computed, scheduled)
        local = manager.partition_batch(batch, descriptor())
        slots = SLOT_BASE + torch.arange(batch.num_tokens, dtype=torch.int64).unsqueeze(0)
        slot_mapping = manager._convert_to_gathered_slot_mappings(slots)[0].clone()
        metadata = builder.build(0, SimpleNamespace(num_actual_tokens=local.num_tokens,
                                                    slot_mapping=slot_mapping),
                                 pcp_step=local.pcp.step)
        ctx.set(metadata=metadata)
        x = torch.stack([local.input_ids.float(), local.positions.float()], dim=1)  # [P, 2]
        kv = x.unsqueeze(1)
        impl.do_kv_cache_update(SimpleNamespace(), kv, kv, rank, slot_mapping)
        out = impl.forward(SimpleNamespace(), kv, kv, kv, rank, metadata,
                           torch.empty_like(kv))[:, 0]
        assert torch.isfinite(out).all()  # pad rows included: MoE routing reads them
        hidden = _moe(group.rank(rank), out + x)
        return manager.restore_hidden_states(hidden), local, manager, batch

    return group.run(rank_fn), written


@pytest.mark.parametrize("name", sorted(STEPS))
def test_every_rank_restores_one_process_and_writes_every_token_once(monkeypatch, name):
    computed, scheduled, policy, world = STEPS[name]
    results, written = _run_step(monkeypatch, name)
    batch = results[0][3]
    expect = _one_process(batch, world)
    rows = {local.num_tokens_after_padding for _, local, _, _ in results}
    assert len(rows) == 1  # every rank's model input has the same length
    x = torch.stack([batch.input_ids.float(), batch.positions.float()], dim=1)
    for rank, (out, local, manager, _) in enumerate(results):
        torch.testing.assert_close(out, expect)
        kept = [(slot, k) for slot, k in written[rank] if slot >= 0]
        assert sorted(slot for slot, _ in kept) == list(range(SLOT_BASE,
                                                              SLOT_BASE + len(x)))
        assert dict(kept) == dict(zip((SLOT_BASE + torch.arange(len(x))).tolist(), x.tolist()))
    counts = [local.num_tokens for _, local, _, _ in results]
    if name.startswith("shard-decodes"):
        assert 0 in counts
    elif name.endswith("split"):
        assert len(set(counts)) > 1
    else:
        assert not results[0][1].pcp.step.gathered


def test_step_counts_tell_which_steps_left_ranks_without_tokens(monkeypatch):
    """The evidence the engine checks read (``collective_rpc("pcp_step_counts")``): a
    step without local tokens is counted by the ranks that had none; a step every rank
    computes alone is not gathered under ``replicate``, every step is under ``shard``."""
    from dataclasses import asdict

    from manager_harness import descriptor, global_batch, managers

    for policy, gathered in (("shard", 3), ("replicate", 1)):
        ranks = managers(3, pcp_settings(3, decode_policy=policy))
        for computed, scheduled in (([10, 20], [1, 1]), ([0], [64]), ([30, 0], [1, 5])):
            for manager in ranks:
                manager.partition_batch(global_batch(computed, scheduled), descriptor())
        counts = [asdict(m.step_counts) for m in ranks]
        for rank, c in enumerate(counts):
            assert (c["steps"], c["split_steps"], c["fresh_split_steps"]) == (3, 1, 1)
            assert c["gathered_steps"] == gathered
            assert c["steps_without_local_tokens"] == int(policy == "shard" and rank == 2)

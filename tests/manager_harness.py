"""vLLM's own PCP machinery on the CPU: a global ``InputBatch`` of a scheduler step and
:class:`vllm_pcp.manager.GQAPCPManager` on every rank of a simulated PCP group."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import torch
from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

from vllm_pcp.knobs import PCPSettings
from vllm_pcp.manager import GQAPCPManager

MAX_REQS, MAX_TOKENS = 16, 4096
SLOT_BASE = 100_000  # global token t is written to slot SLOT_BASE + t


def settings(pcp: int, dcp: int = 1, min_split_tokens: int = 2, policy: str = "replicate",
             **kw) -> PCPSettings:
    return PCPSettings(pcp_world_size=pcp, dcp_world_size=dcp,
                       min_split_tokens=max(min_split_tokens, 2 * pcp),
                       min_chunk_tokens=4 * pcp if dcp == 1 else 2 * pcp,
                       decode_threshold=1, decode_policy=policy,
                       split_attention=kw.get("split_attention", "auto"),
                       dcp_context_exchange=kw.get("dcp_context_exchange", "auto"))


def global_batch(computed, scheduled, prefill_lens=None) -> InputBatch:
    """The scheduler's batch: token t of the step has id ``7 * t + 3``, its request's
    position ``computed + i``. Without ``prefill_lens`` a request of one token over
    computed ones decodes, any other is a prompt that ends with this step."""
    computed = np.asarray(computed, dtype=np.int32)
    scheduled = np.asarray(scheduled, dtype=np.int32)
    decodes = (scheduled == 1) & (computed > 0)
    prefill = (np.where(decodes, computed, computed + scheduled) if prefill_lens is None
               else np.asarray(prefill_lens, dtype=np.int32))
    num_reqs, num_tokens = len(scheduled), int(scheduled.sum())
    batch = InputBatch.make_dummy(num_reqs, num_tokens,
                                  InputBuffers(MAX_REQS, MAX_TOKENS, torch.device("cpu")))
    qsl = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(scheduled, out=qsl[1:])
    positions = np.concatenate([c + np.arange(s) for c, s in zip(computed, scheduled)])
    seq_lens = computed + scheduled
    return replace(
        batch, num_scheduled_tokens=scheduled, query_start_loc_np=qsl,
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq_lens),
        seq_lens_cpu_upper_bound=torch.from_numpy(seq_lens.copy()),
        positions=torch.from_numpy(positions.astype(np.int64)),
        input_ids=torch.arange(num_tokens, dtype=torch.int32) * 7 + 3,
        num_computed_tokens_np=computed, prefill_len_np=prefill,
        num_computed_prefill_tokens_np=np.minimum(computed, prefill),
        is_prefilling_np=computed < prefill, has_prefill=bool((computed < prefill).any()))


def managers(pcp: int, s: PCPSettings) -> list[GQAPCPManager]:
    """One manager per rank, with a one-group block table stand-in."""
    tables = SimpleNamespace(num_kv_cache_groups=1, cp_interleave=1,
                             input_block_tables=(torch.zeros(MAX_REQS, 8, dtype=torch.int32),))
    return [GQAPCPManager(pcp_world_size=pcp, pcp_rank=r, device=torch.device("cpu"),
                          shard_decode_requests=s.shard_decodes, max_num_reqs=MAX_REQS,
                          max_num_tokens=MAX_TOKENS, block_tables=tables,
                          dcp_world_size=s.dcp_world_size, settings=s)
            for r in range(pcp)]


def descriptor(num_tokens: int | None = None, num_reqs: int | None = None):
    """vLLM's batch descriptor: eager, or a CUDA graph of ``num_tokens`` rows."""
    mode = CUDAGraphMode.NONE if num_tokens is None else CUDAGraphMode.PIECEWISE
    return SimpleNamespace(cg_mode=mode, num_tokens=num_tokens, num_reqs=num_reqs)


def slot_mappings(manager: GQAPCPManager, batch: InputBatch) -> torch.Tensor:
    """The manager's slot mapping of the step, from a global one writing token t to
    ``SLOT_BASE + t``: ``[N * P]`` gathered, or ``[P]`` local."""
    slots = SLOT_BASE + torch.arange(batch.num_tokens, dtype=torch.int64).unsqueeze(0)
    return manager._convert_to_gathered_slot_mappings(slots)[0]

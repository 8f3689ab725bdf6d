"""Scheduler steps for the benchmarks, split by the plugin's PCP manager as an engine splits them.

A step is ``(computed, scheduled, prompt lengths)`` per request. :func:`partition` builds
vLLM's global ``InputBatch`` of it on a device and runs
:meth:`vllm_pcp.manager.GQAPCPManager.partition_batch` for one rank of a PCP group that
exists only in numbers (no process group): the local batch and the step's split
(:class:`vllm_pcp.manager.PCPStep`), as the model runner gets them. The KV block table is
a stand-in (one group), which the split never reads.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import torch

from vllm_pcp.knobs import PCPSettings


def unpin_host_memory_without_cuda() -> None:
    """vLLM stages host-to-device copies in pinned memory, which needs a CUDA driver:
    without one (a CPU run of a benchmark) its copies go unpinned."""
    if torch.cuda.is_available():
        return
    import vllm.utils.flashinfer as vllm_flashinfer
    import vllm.utils.torch_utils as torch_utils

    torch_utils.PIN_MEMORY = False
    vllm_flashinfer.PIN_MEMORY = False


def settings(pcp: int, dcp: int = 1, min_split_tokens: int = 2, policy: str = "auto",
             context_exchange: str = "auto", is_moe: bool = False) -> PCPSettings:
    """What an engine at ``-pcp pcp -dcp dcp`` with these knobs resolves to.

    Parameters
    ----------
    pcp, dcp : int
        The PCP and DCP sizes.
    min_split_tokens : int
        ``pcp_min_split_tokens``.
    policy, context_exchange : str
        ``pcp_decode_policy`` and ``pcp_dcp_context_exchange``.
    is_moe : bool
        A mixture-of-experts model (``auto`` policy).

    Returns
    -------
    PCPSettings
        :meth:`vllm_pcp.knobs.PCPSettings.from_vllm_config` of the engine's config (the
        parts it reads).
    """
    knobs = {"pcp_min_split_tokens": min_split_tokens, "pcp_decode_policy": policy,
             "pcp_dcp_context_exchange": context_exchange}
    return PCPSettings.from_vllm_config(SimpleNamespace(
        parallel_config=SimpleNamespace(prefill_context_parallel_size=pcp,
                                        decode_context_parallel_size=dcp),
        model_config=SimpleNamespace(is_moe=is_moe), additional_config=knobs))


def global_batch(computed, scheduled, prefill_lens, device) -> "InputBatch":
    """vLLM's global batch of a step on ``device``: token t has id ``7 * t + 3``, its
    request's position ``computed + i``; a request with ``computed >= prefill_len``
    decodes."""
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    computed, scheduled, prefill = (np.asarray(a, dtype=np.int32)
                                    for a in (computed, scheduled, prefill_lens))
    num_reqs, num_tokens = len(scheduled), int(scheduled.sum())
    batch = InputBatch.make_dummy(num_reqs, num_tokens,
                                  InputBuffers(num_reqs, num_tokens, torch.device(device)))
    qsl = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(scheduled, out=qsl[1:])
    positions = np.concatenate([c + np.arange(s) for c, s in zip(computed, scheduled)])
    seq_lens = computed + scheduled

    def on_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)
    return replace(
        batch, num_scheduled_tokens=scheduled, query_start_loc_np=qsl,
        query_start_loc=on_device(qsl), seq_lens=on_device(seq_lens),
        seq_lens_cpu_upper_bound=torch.from_numpy(seq_lens.copy()),
        positions=on_device(positions.astype(np.int64)),
        input_ids=on_device(np.arange(num_tokens, dtype=np.int32) * 7 + 3),
        num_computed_tokens_np=computed, prefill_len_np=prefill,
        num_computed_prefill_tokens_np=np.minimum(computed, prefill),
        is_prefilling_np=computed < prefill, has_prefill=bool((computed < prefill).any()))


def manager(s: PCPSettings, rank: int, device, max_reqs: int, max_tokens: int,
            interleave: int = 1):
    """Rank ``rank``'s :class:`vllm_pcp.manager.GQAPCPManager` for steps of at most
    ``max_reqs`` requests and ``max_tokens`` tokens, with a one-group block table
    stand-in (KV interleave ``interleave``)."""
    from vllm_pcp.manager import GQAPCPManager

    tables = SimpleNamespace(
        num_kv_cache_groups=1, cp_interleave=interleave,
        input_block_tables=(torch.zeros(max_reqs, 1, dtype=torch.int32, device=device),))
    return GQAPCPManager(pcp_world_size=s.pcp_world_size, pcp_rank=rank,
                         device=torch.device(device), shard_decode_requests=s.shard_decodes,
                         max_num_reqs=max_reqs, max_num_tokens=max_tokens,
                         block_tables=tables, dcp_world_size=s.dcp_world_size, settings=s)


def eager() -> SimpleNamespace:
    """vLLM's batch descriptor of an eager step (no CUDA graph, no padding)."""
    from vllm.config import CUDAGraphMode

    return SimpleNamespace(cg_mode=CUDAGraphMode.NONE, num_tokens=None, num_reqs=None)


@dataclass
class Partitioned:
    """One rank's view of a partitioned step.

    manager : the rank's manager.
    batch : the global batch.
    local : the rank's local batch.
    step : the step's split (``local.pcp.step``).
    """

    manager: object
    batch: object
    local: object
    step: object


def partition(s: PCPSettings, rank: int, computed, scheduled, prefill_lens,
              device="cpu", interleave: int = 1) -> Partitioned:
    """Rank ``rank``'s partition of a step by its manager (an eager step).

    Parameters
    ----------
    s : PCPSettings
        The engine's settings (:func:`settings`).
    rank : int
        The PCP rank seen.
    computed, scheduled, prefill_lens : sequence of int
        Per request: tokens in the cache, tokens of this step, prompt length.
    device : str or torch.device
        Where the batch and the manager's buffers live (``cuda`` on a GPU host).
    interleave : int
        The KV interleave (``--cp-kv-cache-interleave-size``) under ``-dcp``.

    Returns
    -------
    Partitioned
        The manager, the global and local batches, the step's split.
    """
    batch = global_batch(computed, scheduled, prefill_lens, device)
    m = manager(s, rank, device, max_reqs=len(computed),
                max_tokens=max(int(np.sum(scheduled)), 1), interleave=interleave)
    local = m.partition_batch(batch, eager())
    return Partitioned(m, batch, local, local.pcp.step)


def dcp_slots(computed, scheduled, table: torch.Tensor, page_size: int, world: int = 1,
              interleave: int = 1) -> torch.Tensor:
    """``[T]`` int64 on the table's device: the cache slot of each step token on DCP rank 0
    of ``world`` (-1: another rank stores it), as vLLM's slot mapping of the global batch
    gives it; ``table`` is ``[requests, pages]``, a request's pages of its shard."""
    from vllm_pcp.dcp.layout import dcp_local_offset, dcp_owner

    scheduled_t = torch.tensor(scheduled)
    req = torch.repeat_interleave(torch.arange(len(scheduled)), scheduled_t)
    first = torch.cumsum(scheduled_t, 0) - scheduled_t
    positions = torch.tensor(computed)[req] + torch.arange(int(scheduled_t.sum())) - first[req]
    offset = dcp_local_offset(positions, world, interleave)
    page = table.cpu()[req, offset // page_size].long()
    slots = torch.where(dcp_owner(positions, world, interleave) == 0,
                        page * page_size + offset % page_size, -1)
    return slots.to(table.device)


def cache_write(device: torch.device):
    """vLLM's cache write, ``write(k, v, (k_cache, v_cache), slots)``: its
    ``reshape_and_cache_flash`` on a GPU, the same in plain torch elsewhere."""
    if device.type == "cuda":
        from vllm import _custom_ops as ops

        one = torch.ones(1, device=device)
        return lambda k, v, cache, slots: ops.reshape_and_cache_flash(
            k, v, cache[0], cache[1], slots, "auto", one, one)

    def write(k, v, cache, slots):
        keep = slots >= 0
        for view, x in zip(cache, (k, v)):
            view.view(-1, *x.shape[1:])[slots[keep]] = x[keep]
    return write

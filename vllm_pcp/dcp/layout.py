"""Which decode-context-parallel (DCP) rank stores which KV token.

vLLM's interleaved layout: with DCP size D and interleave size I, token t belongs to rank
``(t // I) % D`` at local offset ``(t // (I * D)) * I + t % I`` of its shard::

    D = 2, I = 2     token  0 1 2 3 4 5 6 7 8
                     rank   0 0 1 1 0 0 1 1 0
                     local  0 1 0 1 2 3 2 3 4

Arithmetic on tensors, arrays or ints. Local lengths are vLLM's ``get_dcp_local_seq_lens``;
owners and offsets have no vLLM helper (vLLM computes them in its slot-mapping kernel).
"""
from __future__ import annotations

import numpy as np
import torch
from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens


def _check(dcp_world_size: int, interleave: int) -> None:
    if dcp_world_size < 1 or interleave < 1:
        raise ValueError(f"need dcp_world_size >= 1 and interleave >= 1, "
                         f"got {dcp_world_size} and {interleave}")


def dcp_owner(positions, dcp_world_size: int, interleave: int):
    """DCP rank that stores each token position."""
    _check(dcp_world_size, interleave)
    return (positions // interleave) % dcp_world_size


def dcp_local_offset(positions, dcp_world_size: int, interleave: int):
    """Offset of each token inside its owner's local KV shard."""
    _check(dcp_world_size, interleave)
    return (positions // (interleave * dcp_world_size)) * interleave + positions % interleave


def dcp_local_seq_len(seq_lens: torch.Tensor, dcp_rank: int, dcp_world_size: int,
                      interleave: int) -> torch.Tensor:
    """How many of a request's first ``seq_lens`` tokens ``dcp_rank`` stores."""
    _check(dcp_world_size, interleave)
    return get_dcp_local_seq_lens(seq_lens, dcp_world_size, dcp_rank,
                                  interleave).to(seq_lens.dtype)


def dcp_local_seq_lens_all_ranks(seq_lens: np.ndarray, dcp_world_size: int,
                                 interleave: int) -> np.ndarray:
    """``[R, dcp_world_size]`` int64: :func:`dcp_local_seq_len` of every rank at once."""
    _check(dcp_world_size, interleave)
    lens = torch.from_numpy(np.asarray(seq_lens, dtype=np.int64))
    return get_dcp_local_seq_lens(lens, dcp_world_size, None,
                                  interleave).numpy().astype(np.int64)

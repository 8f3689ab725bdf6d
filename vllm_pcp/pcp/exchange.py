"""The collectives of vllm-pcp's attention: the K/V all-gather before the cache write
(with DCP's ``keys`` context rows) and DCP's query and partial-state exchanges, each moving
``num_padded_tokens_per_rank`` (or ``Pc``) rows per rank, alike on every rank. ``group``
has ``world_size`` and ``all_gather(tensor, dim)``: vLLM's ``GroupCoordinator``, or a gloo
adapter in the CPU tests.
"""
from __future__ import annotations

import torch


def _pad_rows(x: torch.Tensor, num_rows: int) -> torch.Tensor:
    if x.shape[0] == num_rows:
        return x.contiguous()
    padded = x.new_zeros((num_rows, *x.shape[1:]))
    padded[: x.shape[0]] = x
    return padded


def all_gather_padded(group, x: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Pad ``x [L, ...]`` to ``num_rows`` rows and all-gather it: ``[N * num_rows, ...]``."""
    return group.all_gather(_pad_rows(x, num_rows), dim=0)


def gather_kv(group, key: torch.Tensor, value: torch.Tensor, num_padded_tokens_per_rank: int,
              context: torch.Tensor | None = None,
              num_context_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather this rank's new K/V (``[L <= P, Hkv, D]``) and the context it stores
    (``[Lc <= Pc, 2, Hkv, D]``) in one collective: K and V ``[N * (P + Pc), Hkv, D]``, each
    rank's ``P`` new rows (the gathered layout) then its ``Pc`` context rows. New rows are
    padded with zeros, context rows left unset: the write skips both, attention too."""
    num_new = num_padded_tokens_per_rank
    send = key.new_empty((num_new + num_context_rows, 2, *key.shape[1:]))
    send[:len(key), 0], send[:len(key), 1] = key, value
    send[len(key):num_new].zero_()
    if context is not None:
        send[num_new:num_new + len(context)] = context
    gathered = group.all_gather(send, dim=0)
    return gathered[:, 0], gathered[:, 1]


def with_context_rows(gathered_token_indices: torch.Tensor, num_padded_tokens_per_rank: int,
                      num_context_rows: int) -> torch.Tensor:
    """``gathered_token_indices [N * P]`` in :func:`gather_kv`'s ``[N * (P + Pc)]`` layout,
    the context rows -1."""
    blocks = gathered_token_indices.view(-1, num_padded_tokens_per_rank)
    pad = blocks.new_full((blocks.shape[0], num_context_rows), -1)
    return torch.cat((blocks, pad), dim=1).reshape(-1)


def all_to_all(group, x: torch.Tensor) -> torch.Tensor:
    """Block q of ``x [N * B, ...]`` goes to rank q; returns the blocks received. vLLM's
    GroupCoordinator has none: ``all_to_all_single`` on its ``device_group``, unless the
    group has its own ``all_to_all`` (the tests' thread group)."""
    import torch.distributed as dist

    own = getattr(group, "all_to_all", None)
    if own is not None:
        return own(x)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group.device_group)
    return out

"""The collectives of vllm-pcp's attention: the K/V all-gather before the cache write
(with the context rows of DCP's ``keys`` exchange) and DCP's query and partial-state
exchanges. Each moves ``num_padded_tokens_per_rank`` rows per rank (or ``Pc``), sizes
every rank computes from the same scheduler output; vLLM's PCP manager restores the
hidden states.

``group`` is anything with ``world_size`` and ``all_gather(tensor, dim)``:
vLLM's ``GroupCoordinator`` in the engine, a gloo adapter in the CPU tests.
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
    """Pad ``x`` (``[L, ...]``, ``L <= num_rows``) to ``num_rows`` rows and
    all-gather it: ``[N * num_rows, ...]``, rank 0's block first."""
    return group.all_gather(_pad_rows(x, num_rows), dim=0)


def gather_kv(group, key: torch.Tensor, value: torch.Tensor, num_padded_tokens_per_rank: int,
              context: torch.Tensor | None = None,
              num_context_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather this rank's new K/V, and the context rows it stores, in one collective.

    Parameters
    ----------
    key, value : torch.Tensor
        ``[L, Hkv, D]`` for this rank's ``L <= P`` local tokens.
    num_padded_tokens_per_rank : int
        ``P``, identical on every rank.
    context : torch.Tensor, optional
        ``[Lc, 2, Hkv, D]``, K and V of the context tokens this rank stores for
        the step's split chunks (PCP x DCP, ``Lc <= Pc``).
    num_context_rows : int
        ``Pc``, identical on every rank; 0 without ``context``.

    Returns
    -------
    tuple of torch.Tensor
        ``[N * (P + Pc), Hkv, D]`` each: rank r's ``P`` new rows (the gathered
        layout of :class:`vllm_pcp.pcp.partition.PrefillContextParallelMetadata`)
        then its ``Pc`` context rows, rank 0 first. The padding of the new rows is
        zero, that of the context rows unset: the cache write skips both (slot -1)
        and attention indexes past them. One send buffer, ``[P + Pc, 2, Hkv, D]``.
    """
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
    """``gathered_token_indices`` (``[N * P]``) laid out as :func:`gather_kv`'s
    buffer with ``Pc`` context rows after each rank's block, those marked -1
    (nothing to write): ``[N * (P + Pc)]``."""
    blocks = gathered_token_indices.view(-1, num_padded_tokens_per_rank)
    pad = blocks.new_full((blocks.shape[0], num_context_rows), -1)
    return torch.cat((blocks, pad), dim=1).reshape(-1)


def all_to_all(group, x: torch.Tensor) -> torch.Tensor:
    """Block q of ``x`` (``[N * B, ...]``) goes to rank q; returns the N blocks
    received, from rank 0 first. ``B`` must be the same on every rank.

    vLLM's GroupCoordinator has no all-to-all: this runs
    ``torch.distributed.all_to_all_single`` on its ``device_group``. A group
    object with an ``all_to_all`` method of its own (the tests' thread group)
    is used as it is.
    """
    import torch.distributed as dist

    own = getattr(group, "all_to_all", None)
    if own is not None:
        return own(x)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group.device_group)
    return out

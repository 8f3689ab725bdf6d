"""The two exchanges of a PCP step: K/V before the cache write, hidden states
before sampling. Both move ``num_padded_tokens_per_rank`` rows per rank, a
size every rank computes from the same scheduler output.

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


def gather_kv(group, key: torch.Tensor, value: torch.Tensor,
              num_padded_tokens_per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather this rank's new K/V in one collective.

    Parameters
    ----------
    key, value : torch.Tensor
        ``[L, Hkv, D]`` for this rank's ``L <= P`` local tokens.
    num_padded_tokens_per_rank : int
        ``P``, identical on every rank.

    Returns
    -------
    tuple of torch.Tensor
        ``[N * P, Hkv, D]`` each, in the gathered layout of
        :class:`vllm_pcp.partition.PrefillContextParallelMetadata`.
    """
    gathered = all_gather_padded(group, torch.stack((key, value), dim=1),
                                 num_padded_tokens_per_rank)
    return gathered[:, 0], gathered[:, 1]


def restore_hidden_states(group, hidden_states: torch.Tensor,
                          num_padded_tokens_per_rank: int,
                          restore_indices: torch.Tensor,
                          num_output_rows: int | None = None) -> torch.Tensor:
    """Gather every rank's hidden states and put them back in scheduler order.

    Parameters
    ----------
    hidden_states : torch.Tensor
        ``[L, H]``, this rank's local tokens.
    restore_indices : torch.Tensor
        ``[T]`` int64, gathered row of each global token.
    num_output_rows : int, optional
        Rows of the result (``>= T``); rows past ``T`` are zero, as the
        runner's padded batch expects. Defaults to ``T``.

    Returns
    -------
    torch.Tensor
        ``[num_output_rows, H]``, identical on every rank.
    """
    gathered = all_gather_padded(group, hidden_states, num_padded_tokens_per_rank)
    num_tokens = restore_indices.shape[0]
    rows = num_tokens if num_output_rows is None else num_output_rows
    if rows == num_tokens:
        return gathered.index_select(0, restore_indices)
    out = gathered.new_zeros((rows, *gathered.shape[1:]))
    out[:num_tokens] = gathered.index_select(0, restore_indices)
    return out


def gathered_slot_mapping(slot_mapping: torch.Tensor,
                          gathered_token_indices: torch.Tensor) -> torch.Tensor:
    """Cache slot of each gathered row: ``[N * P]`` int64, -1 where nothing is written.

    ``slot_mapping`` is the step's global ``[>= T]`` slot mapping.
    """
    valid = gathered_token_indices >= 0
    slots = slot_mapping.index_select(0, gathered_token_indices.clamp(min=0))
    return torch.where(valid, slots, torch.full_like(slots, -1))


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

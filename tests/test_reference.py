"""The reference math against brute force: attention, LSE merge, DCP ownership."""
import math

import pytest
import torch

from vllm_pcp.dcp.layout import dcp_local_offset, dcp_local_seq_len, dcp_owner
from reference import (causal_attention, dcp_partial_decode, merge_state,
                                merge_states)


def _naive_attention(q, k, v):
    """Loop form: query i of Tq attends to keys 0 .. i + Tk - Tq, GQA by head group."""
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    out = torch.zeros(tq, hq, d, dtype=torch.float64)
    lse = torch.zeros(tq, hq, dtype=torch.float64)
    for i in range(tq):
        last = i + tk - tq
        for h in range(hq):
            kh = h // (hq // hkv)
            s = (k[: last + 1, kh].double() @ q[i, h].double()) / math.sqrt(d)
            lse[i, h] = torch.logsumexp(s, 0) / math.log(2)
            out[i, h] = torch.softmax(s, 0) @ v[: last + 1, kh].double()
    return out, lse


@pytest.mark.parametrize("tq,tk,hq,hkv", [(5, 5, 4, 2), (3, 11, 8, 1), (1, 9, 16, 2)])
def test_causal_attention_matches_loop(tq, tk, hq, hkv):
    g = torch.Generator().manual_seed(tq * 100 + tk)
    q = torch.randn(tq, hq, 16, generator=g)
    k = torch.randn(tk, hkv, 16, generator=g)
    v = torch.randn(tk, hkv, 16, generator=g)
    out, lse = causal_attention(q, k, v)
    ref_out, ref_lse = _naive_attention(q, k, v)
    torch.testing.assert_close(out, ref_out.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-5, rtol=1e-5)


def test_merge_state_equals_attention_over_the_union():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 32, generator=g)
    k = torch.randn(40, 2, 32, generator=g)
    v = torch.randn(40, 2, 32, generator=g)
    full_out, full_lse = causal_attention(q, k, v)
    out_a, lse_a = causal_attention(q, k[:13], v[:13])
    out_b, lse_b = causal_attention(q, k[13:], v[13:])
    out, lse = merge_state(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, full_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse, atol=1e-5, rtol=1e-5)
    # Base 2: a state merged with itself doubles its mass, i.e. lse + 1.
    torch.testing.assert_close(merge_state(out_a, lse_a, out_a, lse_a)[1], lse_a + 1)


def test_merge_state_ignores_an_empty_side():
    v = torch.randn(2, 3, 4)
    s = torch.randn(2, 3)
    empty_v, empty_s = torch.zeros(2, 3, 4), torch.full((2, 3), float("-inf"))
    out, lse = merge_state(v, s, empty_v, empty_s)
    torch.testing.assert_close(out, v)
    torch.testing.assert_close(lse, s)


@pytest.mark.parametrize("dcp,interleave", [(2, 1), (2, 8), (4, 16), (3, 1), (8, 8)])
def test_dcp_ownership_matches_round_robin_of_blocks(dcp, interleave):
    positions = torch.arange(1000)
    owner = dcp_owner(positions, dcp, interleave)
    offset = dcp_local_offset(positions, dcp, interleave)
    for rank in range(dcp):
        mine = positions[owner == rank]
        # Each rank stores its tokens densely, in order, at offsets 0, 1, 2, ...
        assert torch.equal(offset[owner == rank], torch.arange(len(mine)))
        # Interleave blocks of I consecutive tokens go to ranks round robin.
        assert torch.equal((mine // interleave) % dcp, torch.full_like(mine, rank))
        for seq_len in (0, 1, interleave, interleave * dcp + 1, 999):
            expect = int((owner[:seq_len] == rank).sum())
            got = dcp_local_seq_len(torch.tensor([seq_len]), rank, dcp, interleave)
            assert int(got) == expect


@pytest.mark.parametrize("dcp,interleave", [(2, 1), (2, 16), (4, 8)])
def test_dcp_partial_decodes_merge_to_full_attention(dcp, interleave):
    g = torch.Generator().manual_seed(dcp * interleave)
    q = torch.randn(1, 8, 16, generator=g)
    k = torch.randn(77, 1, 16, generator=g)
    v = torch.randn(77, 1, 16, generator=g)
    parts = [dcp_partial_decode(q, k, v, r, dcp, interleave) for r in range(dcp)]
    out, lse = merge_states(torch.stack([p[0] for p in parts], 1),
                            torch.stack([p[1] for p in parts], 1))
    full_out, full_lse = causal_attention(q, k, v)
    torch.testing.assert_close(out, full_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse, atol=1e-5, rtol=1e-5)


def test_rejects_bad_dcp_sizes():
    with pytest.raises(ValueError):
        dcp_owner(torch.arange(3), 0, 1)
    with pytest.raises(ValueError):
        dcp_local_offset(torch.arange(3), 2, 0)

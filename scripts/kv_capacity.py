"""The KV capacity entry of an exactness result: how many tokens the KV pool of
``-pcp 2 -dcp 2`` holds against ``-pcp 2`` (issue goal: at least 1.9x), and which
runs held a prompt longer than one rank's pool. Also the formulas the benchmarks and
the exactness worker size and read a KV pool with, defined here once."""
from __future__ import annotations

import re

from layouts import LAYOUTS

BF16_BYTES = 2


def pool_tokens(cache_config, dcp: int) -> int:
    """Tokens an engine's KV pool holds: ``num_gpu_blocks * block_size * dcp``.

    ``cache_config`` is the engine's (``llm.llm_engine.vllm_config.cache_config``):
    ``num_gpu_blocks`` pages of ``block_size`` tokens on each rank. DCP multiplies
    because the ``dcp`` ranks shard a request's tokens (each token's K/V is on one rank
    only): vLLM's scheduler block is one page on each of them, ``block_size * dcp``
    tokens, so the same pages hold ``dcp`` times the tokens one rank alone would."""
    return cache_config.num_gpu_blocks * cache_config.block_size * dcp


def per_rank_tokens(tokens: int, dcp: int) -> int:
    """One rank's share of a pool of ``tokens`` (:func:`pool_tokens`) over ``dcp``
    ranks: the longest prompt a rank could hold alone."""
    return tokens // dcp


def kv_bytes_per_token_layer(kv_heads: int, head_dim: int) -> int:
    """Bytes of one token's bf16 K and V in one attention layer:
    ``2 * kv_heads * head_dim * 2`` (K and V, 2 bytes each)."""
    return 2 * kv_heads * head_dim * BF16_BYTES


def kv_bytes_per_token(hf: dict) -> int:
    """Bytes of one token's bf16 K and V over all layers, on one rank (TP = 1);
    ``hf``: a model's config.json."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return hf["num_hidden_layers"] * kv_bytes_per_token_layer(hf["num_key_value_heads"],
                                                              head_dim)


def kv_capacity(runs: dict, bench_runs: list | None = None,
                 serve_logs: list[str] | None = None) -> dict:
    """KV pool (tokens) of pcp2 and pcp2-dcp2: from two ``vllm serve`` logs (vLLM's
    own "GPU KV cache size", both at vLLM's default gpu_memory_utilization), else a
    bench_pcp.py raw run (both at its gpu_memory_utilization), else the first pair
    of exactness runs of the same model and variant (the fixed pool of
    ``--kv-cache-gib``). ``beyond_one_gpu``: each small-pool run, with its per-rank
    pool and longest prompt."""
    bench = {r["config"]: r["kv_capacity_tokens"] for r in bench_runs or []
             if "kv_capacity_tokens" in r}
    # pcp2-min8k differs from pcp2 only in which prefills it splits: the same pool
    pcp2 = next((c for c in ("pcp2", "pcp2-min8k") if c in bench), None)
    # and the pcp2-dcp2 variants only in how a split chunk reaches its context
    dcp = next((c for c in ("pcp2-dcp2", "pcp2-dcp2-keys", "pcp2-dcp2-queries")
                if c in bench), None)
    if serve_logs:
        tokens = [kv_pool_in_log(path) for path in serve_logs]
        out = {"source": "vllm serve logs (pcp2, pcp2-dcp2): vLLM's 'GPU KV cache size', "
                         "default gpu_memory_utilization",
               "pcp2_tokens": tokens[0], "pcp2_dcp2_tokens": tokens[1],
               "ratio": round(tokens[1] / tokens[0], 4)}
    elif pcp2 and dcp:
        out = {"source": f"bench_pcp.py ({pcp2}, {dcp}), gpu_memory_utilization 0.85",
               "pcp2_tokens": bench[pcp2], "pcp2_dcp2_tokens": bench[dcp],
               "ratio": round(bench[dcp] / bench[pcp2], 4)}
    else:
        out = _fixed_pool_capacity(runs)
    small = [{"model": model, "variant": variant, "config": config,
              "per_rank_pool_tokens": per_rank_tokens(run["kv_capacity_tokens"],
                                                      _dcp_size(config)),
              "longest_prompt": max(n for r in run["results"] for n in r["prompt_lens"])}
             for (model, variant, config), run in sorted(runs.items())
             if config.endswith("-smallpool") and run.get("results")
             and "kv_capacity_tokens" in run]
    if small:
        out["beyond_one_gpu"] = small
    return out


def _dcp_size(config: str) -> int:
    """The DCP size of a configuration of scripts/layouts.py; 2 for one it does not
    name (the small-pool runs are ``-dcp 2``)."""
    return LAYOUTS[config].dcp if config in LAYOUTS else 2


def kv_pool_in_log(path: str) -> int:
    """The KV pool in tokens that a ``vllm serve`` log reports."""
    with open(path) as f:
        found = re.findall(r"GPU KV cache size: ([\d,]+) tokens", f.read())
    if not found:
        raise ValueError(f"{path}: no 'GPU KV cache size' line")
    return int(found[-1].replace(",", ""))


def _fixed_pool_capacity(runs: dict) -> dict:
    """The first pcp2-dcp2 run and the pcp2 run of its model and variant, both at
    the fixed pool of ``--kv-cache-gib``."""
    for (model, variant, config), run in sorted(runs.items()):
        base = runs.get((model, variant, "pcp2"), {})
        if config.startswith("pcp2-dcp2") and "kv_capacity_tokens" in run and \
                "kv_capacity_tokens" in base:
            ratio = run["kv_capacity_tokens"] / base["kv_capacity_tokens"]
            return {"model": model, "variant": variant,
                    "pcp2_tokens": base["kv_capacity_tokens"],
                    "pcp2_dcp2_tokens": run["kv_capacity_tokens"], "ratio": round(ratio, 4)}
    return {}

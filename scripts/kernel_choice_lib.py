"""The pure parts of scripts/bench_kernel_choice.py, no GPU library: how ``-pcp N``
splits a prompt into one rank's rows, the paged and ragged KV layouts of those rows,
the K/V exchange's size, the timing spread, and the per-case summary of the rows."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
from dataclasses import dataclass

import numpy as np

from kv_capacity import kv_bytes_per_token_layer

HERE = os.path.dirname(os.path.abspath(__file__))
# the attention shape of the bench model (bench_pcp.py's), read from its config
BENCH_MODEL_CONFIG = os.path.join(os.path.dirname(HERE), "configs", "models",
                                  "qwen2.5-3b-shape.json")
with open(BENCH_MODEL_CONFIG) as _f:
    _HF = json.load(_f)
HEADS = (_HF["num_attention_heads"], _HF["num_key_value_heads"])  # (query heads, kv heads)
HEAD_DIM = _HF["head_dim"]
PAGE = 16  # vLLM's default block size: the page size of its FlashInfer cache
ATTENTION_KERNELS = ("paged", "ragged")


@dataclass(frozen=True)
class RankRows:
    """One rank's rows of a split prompt with no context, in the plugin's local order.

    ``chunks``: ``(first, end)`` prompt tokens of each row (head chunk, then tail);
    ``qo_indptr`` ``[R + 1]`` cumulative query lengths; ``kv_lens`` ``[R]`` keys of
    each row (the prompt's first ``end`` tokens)."""

    chunks: tuple[tuple[int, int], ...]
    qo_indptr: np.ndarray
    kv_lens: np.ndarray

    @property
    def local_tokens(self) -> np.ndarray:
        """``[L]`` int64 prompt positions of the rank's queries, row after row."""
        return np.concatenate([np.arange(lo, hi, dtype=np.int64) for lo, hi in self.chunks])


def parse_cases(text: str) -> list[tuple[int, int]]:
    """``"2x32768,4x32768"`` -> ``[(2, 32768), (4, 32768)]``: (N, prompt length)."""
    cases = []
    for item in text.split(","):
        world, length = (int(x) for x in item.strip().lower().split("x"))
        if world < 2 or length < 4 * world:
            raise ValueError(f"case {item!r}: need N >= 2 and a prompt of >= 4N tokens")
        cases.append((world, length))
    return cases


def rank_rows(prompt_len: int, world: int, rank: int) -> RankRows:
    """Rank ``rank``'s rows of a ``prompt_len``-token prompt split over ``world`` ranks:
    2N chunks (chunk c is tokens ``[P*c // 2N, P*(c+1) // 2N)``), chunks ``rank`` and
    ``2N-1-rank``, each attending to the prompt up to its end."""
    num_chunks = 2 * world
    chunks = tuple((prompt_len * c // num_chunks, prompt_len * (c + 1) // num_chunks)
                   for c in (rank, num_chunks - 1 - rank))
    q_lens = [hi - lo for lo, hi in chunks]
    return RankRows(chunks=chunks,
                    qo_indptr=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                    kv_lens=np.array([hi for _, hi in chunks], dtype=np.int32))


def whole_prompt_rows(prompt_len: int) -> RankRows:
    """The one-GPU layout: the whole prompt as one row."""
    return RankRows(chunks=((0, prompt_len),), qo_indptr=np.array([0, prompt_len], np.int32),
                    kv_lens=np.array([prompt_len], np.int32))


def paged_layout(kv_lens: np.ndarray, page_size: int = PAGE):
    """Paged-KV arguments of rows over one request whose cache is pages 0, 1, ...:
    ``(indptr [R + 1], indices, last_page_len [R])`` int32."""
    pages = -(-kv_lens.astype(np.int64) // page_size)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = np.concatenate([np.arange(n, dtype=np.int32) for n in pages])
    last = (kv_lens - (pages - 1) * page_size).astype(np.int32)
    return indptr, indices, last


def ragged_layout(kv_lens: np.ndarray):
    """Ragged-KV arguments: ``(kv_indptr [R + 1] int32, kv_index [sum kv_lens] int64)``,
    row j's keys being the prompt's first ``kv_lens[j]`` tokens, rows one after another."""
    indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    index = np.concatenate([np.arange(n, dtype=np.int64) for n in kv_lens])
    return indptr, index


def kv_exchange_bytes(padded_tokens: int, kv_heads: int = HEADS[1],
                      head_dim: int = HEAD_DIM) -> int:
    """Bytes of one rank's K and V rows in the exchange: ``P * 2 * kv_heads * head_dim * 2``."""
    return padded_tokens * kv_bytes_per_token_layer(kv_heads, head_dim)


def spread(times_ms: list[float]) -> dict:
    """``median_ms``, ``p10_ms``, ``p90_ms`` of one timing's runs."""
    deciles = statistics.quantiles(times_ms, n=10, method="inclusive")
    return {"median_ms": round(statistics.median(times_ms), 4),
            "p10_ms": round(deciles[0], 4), "p90_ms": round(deciles[-1], 4)}


def _slowest(rows: list[dict], kernel: str, backend: str) -> float | None:
    """The largest median over ranks of one (kernel, backend), or None if not timed."""
    medians = [r["median_ms"] for r in rows if (r["kernel"], r["backend"]) == (kernel, backend)]
    return max(medians) if medians else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num is not None and den else None


def summarize_case(rows: list[dict], one_gpu_ms: float | None) -> dict:
    """The summary of one case's rows: each choice on its slowest rank, the fastest
    choice of which every rank is exact, its speed-up over paged auto."""
    first = rows[0]
    choices, exact = {}, {}
    for kernel in ATTENTION_KERNELS:
        for backend in sorted({r["backend"] for r in rows if r["kernel"] == kernel}):
            choice = f"{kernel}-{backend}"
            choices[choice] = _slowest(rows, kernel, backend)
            exact[choice] = all(r["exact"] is True for r in rows
                                if (r["kernel"], r["backend"]) == (kernel, backend))
    exact_choices = [c for c in choices if exact[c]]
    best = min(exact_choices, key=choices.get) if exact_choices else None
    best_ms = choices[best] if best else None
    ragged = [c for c in exact_choices if c.startswith("ragged-")]
    gather_ms = _slowest(rows, "kv_gather", "torch")
    best_ragged_ms = min(choices[c] for c in ragged) if ragged else None
    paged_auto_ms = choices.get("paged-auto")
    return {
        "N": first["N"], "prompt_len": first["prompt_len"],
        "slowest_rank_ms": choices, "exact": exact,
        "best": None if best is None else {"kernel": best.split("-")[0],
                                           "backend": best.split("-", 1)[1], "ms": best_ms},
        "paged_auto_ms": paged_auto_ms,
        "speedup_over_paged_auto": _ratio(paged_auto_ms, best_ms),
        "kv_gather_ms": gather_ms,
        "best_ragged_with_gather_ms": (None if best_ragged_ms is None or gather_ms is None
                                       else round(best_ragged_ms + gather_ms, 4)),
        "kv_copy_ms": _slowest(rows, "kv_copy", "torch"),
        "one_gpu_ms": one_gpu_ms,
        "one_gpu_over_best": _ratio(one_gpu_ms, best_ms),
        "one_gpu_over_paged_auto": _ratio(one_gpu_ms, paged_auto_ms),
    }


def summarize(rows: list[dict]) -> list[dict]:
    """One summary per (N, prompt) with N > 1, in the rows' order; N = 1 rows are the
    one-GPU times of their prompts."""
    one_gpu = {r["prompt_len"]: r["median_ms"] for r in rows if r["N"] == 1}
    cases: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        if r["N"] > 1:
            cases.setdefault((r["N"], r["prompt_len"]), []).append(r)
    return [summarize_case(case_rows, one_gpu.get(length))
            for (_, length), case_rows in cases.items()]


def git_rev() -> str:
    """GIT_REV, else the checkout's HEAD, else "unknown"."""
    rev = os.environ.get("GIT_REV")
    if rev:
        return rev
    try:
        return subprocess.run(["git", "-C", HERE, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def build_result(rows: list[dict], meta: dict) -> dict:
    """The output file: ``meta``, ``rows`` and their ``summary``."""
    return {"meta": meta, "rows": rows, "summary": summarize(rows)}

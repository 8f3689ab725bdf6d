"""A decode-only step under the two decode policies (``pcp_decode_policy``) at DCP = 1:
its collectives and bytes, counted, and the busiest rank's GPU work, timed on one GPU.

    python benchmarks/decode_policy.py --out decode-policy.json [--cases 8x32768,...]
        [--worlds 2,4] [--model-config configs/models/qwen2.5-3b-shape.json] [--counts-only]

A case ``BxC`` is a step of B requests, each decoding one token over C tokens of context, at
``-pcp N`` for each N of ``--worlds``. The plugin's PCP manager splits the step (on the CPU)
as an engine's does:

- ``replicate``: every rank computes every decode. The step splits nothing, so at DCP = 1
  it runs no collective: each rank writes its own K/V and keeps its own hidden states.
- ``shard``: decode i is computed by rank i % N. Each layer all-gathers the K/V of the P
  padded rows of every rank before the cache write, and the step all-gathers the P rows of
  hidden states before sampling (vLLM's restore); P = ceil(B / N).

Mixture-of-experts models all-gather each expert layer's tokens (hidden states and router
logits) over the PCP ranks and reduce-scatter after (vLLM's MoE runner), under both
policies, over each rank's padded rows (B under ``replicate``, P under ``shard``).

``collectives`` lists each collective with its count per step and, per call, each rank's
``send_bytes`` and ``out_bytes`` and the ``wire_bytes_per_rank`` a ring moves; the step's
totals follow. ``gpu_ms`` (dense models, on a GPU) times the busiest rank's GPU work with
CUDA events, per layer, then per step: FlashInfer's decode kernel over its decodes
(``attention``), the layer's GEMMs, norms and activation on its P rows (``gemms``), vLLM's
cache write of the rows it writes (``write``: B under ``replicate``, the N x P gathered
rows under ``shard``), and once per step the logits of all B rows (``logits``: every rank
samples the whole batch under both policies). A ``replicate`` rank's GPU work is one GPU's.
Collectives are not timed: one GPU has no link to time them on.
"""
from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
from argparse import ArgumentParser, RawDescriptionHelpFormatter
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_steps import (cache_write, partition, settings,  # noqa: E402
                         unpin_host_memory_without_cuda)
import kernel_choice as kc  # noqa: E402
import results  # noqa: E402  (kernel_choice put tests/engine on the path)

POLICIES = ("replicate", "shard")
MODEL_CONFIG = os.path.join("configs", "models", "qwen2.5-3b-shape.json")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class Shape:
    """What a decode step's collectives and GPU work depend on, from a HF config."""

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    dtype_bytes: int = 2
    experts: int = 0  # 0: a dense model
    moe_layers: int = 0

    @classmethod
    def from_config(cls, hf: dict) -> Shape:
        layers, experts = hf["num_hidden_layers"], int(hf.get("num_experts") or 0)
        return cls(layers=layers, q_heads=hf["num_attention_heads"],
                   kv_heads=hf["num_key_value_heads"],
                   head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
                   hidden=hf["hidden_size"], vocab=hf["vocab_size"],
                   dtype_bytes=DTYPE_BYTES[hf.get("torch_dtype", "bfloat16")],
                   experts=experts, moe_layers=_moe_layers(hf) if experts else 0)


def _moe_layers(hf: dict) -> int:
    """Expert layers of a Qwen-MoE-style config: every ``decoder_sparse_step``-th layer
    not in ``mlp_only_layers``."""
    step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or ())
    return sum(1 for i in range(hf["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def split_decodes(batch: int, context: int, world: int, policy: str,
                  is_moe: bool = False) -> dict:
    """The plugin manager's split of a decode-only step, seen from rank 0.

    Parameters
    ----------
    batch, context : int
        B requests, each decoding one token after C computed tokens (its prompt).
    world : int
        N, the PCP size (DCP = 1).
    policy : str
        ``replicate`` or ``shard`` (``pcp_decode_policy``).
    is_moe : bool
        A mixture-of-experts model (``auto`` would shard at N > 2).

    Returns
    -------
    dict
        ``gathered``: whether the step's layers all-gather (the step is not kept local);
        ``decodes_per_rank``: every rank's decodes; ``padded_rows``: P, the rows each
        rank's model runs.
    """
    s = settings(world, 1, policy=policy, is_moe=is_moe)
    p = partition(s, 0, [context] * batch, [1] * batch, [context] * batch)
    return {"gathered": p.step.gathered,
            "decodes_per_rank": list(p.step.plan.num_tokens_per_rank),
            "padded_rows": p.local.num_tokens_after_padding}


def collective(name: str, kind: str, count: int, rows: int, row_bytes: int,
               world: int) -> dict:
    """One collective of a step.

    Parameters
    ----------
    name, kind : str
        What it moves; ``all_gather`` or ``reduce_scatter``.
    count : int
        Calls per step.
    rows, row_bytes : int
        Rows per rank of each call (P), and bytes per row.
    world : int
        N, the ranks taking part.

    Returns
    -------
    dict
        Per call: ``send_bytes`` and ``out_bytes``, each rank's input and output, and
        ``wire_bytes_per_rank``, what a ring sends over each rank's link ((N - 1) P rows).
    """
    chunk = rows * row_bytes
    send, out = (chunk, world * chunk) if kind == "all_gather" else (world * chunk, chunk)
    return {"name": name, "kind": kind, "count": count, "rows_per_rank": rows,
            "send_bytes": send, "out_bytes": out, "wire_bytes_per_rank": (world - 1) * chunk}


def step_collectives(shape: Shape, world: int, split: dict) -> list[dict]:
    """Every collective of a decode step over the PCP group.

    Parameters
    ----------
    shape : Shape
        The model.
    world : int
        N.
    split : dict
        :func:`split_decodes` of the step.

    Returns
    -------
    list of dict
        :func:`collective` of each: under a gathered step the K/V all-gather of every
        layer and the hidden states' all-gather before sampling; for a mixture-of-experts
        model (without expert parallelism) each expert layer's all-gathers of hidden
        states and router logits and its reduce-scatter. Empty for a dense model's step
        that is kept local.
    """
    rows, b = split["padded_rows"], shape.dtype_bytes
    out = []
    if split["gathered"]:
        out += [collective("kv_all_gather", "all_gather", shape.layers, rows,
                           2 * shape.kv_heads * shape.head_dim * b, world),
                collective("hidden_restore", "all_gather", 1, rows, shape.hidden * b, world)]
    if shape.experts:
        out += [collective("moe_hidden", "all_gather", shape.moe_layers, rows,
                           shape.hidden * b, world),
                collective("moe_router_logits", "all_gather", shape.moe_layers, rows,
                           shape.experts * b, world),
                collective("moe_combine", "reduce_scatter", shape.moe_layers, rows,
                           shape.hidden * b, world)]
    return out


def totals(collectives: list[dict]) -> dict:
    """A step's collectives, output bytes and ring bytes per rank."""
    return {"collectives_per_step": sum(c["count"] for c in collectives),
            "out_bytes_per_step": sum(c["count"] * c["out_bytes"] for c in collectives),
            "wire_bytes_per_rank_per_step": sum(c["count"] * c["wire_bytes_per_rank"]
                                                for c in collectives)}


def count_row(shape: Shape, batch: int, context: int, world: int, policy: str) -> dict:
    """A case's row: the split, its collectives and their totals, no GPU times.

    Parameters
    ----------
    shape : Shape
        The model.
    batch, context, world : int
        B, C and N.
    policy : str
        ``replicate`` or ``shard``.

    Returns
    -------
    dict
        ``batch``, ``context``, ``N``, ``policy``, :func:`split_decodes`'s keys,
        ``collectives``, :func:`totals`' keys, ``gpu_ms`` None.
    """
    split = split_decodes(batch, context, world, policy, is_moe=bool(shape.experts))
    coll = step_collectives(shape, world, split)
    return {"batch": batch, "context": context, "N": world, "policy": policy, **split,
            "collectives": coll, **totals(coll), "gpu_ms": None}


def _ms(fn) -> float:
    return round(statistics.median(kc.time_ms(fn)), 4)


class StepTimer:
    """The GPU pieces of one case's decode step (the bench model's shape, bf16), timed on
    this GPU: a paged cache of B requests of C tokens, made once per case."""

    def __init__(self, batch: int, context: int):
        import projection

        hkv, d = kc.HEADS[1], kc.HEAD_DIM
        self.batch, self.context, self.pages = batch, context, -(-context // kc.PAGE)
        self.cache = torch.randn(batch * self.pages, kc.PAGE, hkv, 2 * d, device="cuda",
                                 dtype=torch.bfloat16).split(d, -1)
        self.workspace = torch.empty(kc.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        self.weights, self.projection = projection.layer_weights(), projection
        self.write = cache_write(torch.device("cuda"))
        self.timed: dict = {}  # (piece, its size): ms, each piece timed once per case

    def _piece_ms(self, piece: str, size: int, make) -> float:
        """The median ms of ``make()``'s function, timed the first time only."""
        if (piece, size) not in self.timed:
            self.timed[(piece, size)] = _ms(make())
        return self.timed[(piece, size)]

    def attention(self, decodes: int):
        """FlashInfer's decode kernel (vLLM's wrapper: tensor cores) over ``decodes``
        requests of C keys each."""
        import flashinfer

        (hq, hkv), d, pages = kc.HEADS, kc.HEAD_DIM, self.pages
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                use_tensor_cores=True)
        last = self.context - (pages - 1) * kc.PAGE
        wrapper.plan(torch.arange(decodes + 1, dtype=torch.int32) * pages,
                     torch.arange(decodes * pages, dtype=torch.int32, device="cuda"),
                     torch.full((decodes,), last, dtype=torch.int32), hq, hkv, d, kc.PAGE,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                     o_data_type=torch.bfloat16, sm_scale=d ** -0.5)
        q = torch.randn(decodes, hq, d, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        return lambda: wrapper.run(q, self.cache, out=out)

    def cache_write(self, rows: int, written: int):
        """vLLM's cache write of ``rows`` K/V rows, the first ``written`` to a slot each,
        the rest padding (slot -1)."""
        hkv, d = kc.HEADS[1], kc.HEAD_DIM
        k, v = (torch.randn(rows, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        slots = torch.full((rows,), -1, dtype=torch.int64, device="cuda")
        slots[:written] = torch.arange(written, device="cuda") * self.pages * kc.PAGE
        return lambda: self.write(k, v, self.cache, slots)

    def logits(self):
        """The logits of the step's B rows (the LM head; every rank samples the batch)."""
        vocab, hidden = kc.HF["vocab_size"], kc.HF["hidden_size"]
        head = torch.randn(hidden, vocab, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(self.batch, hidden, device="cuda", dtype=torch.bfloat16)
        return lambda: x @ head

    def step_ms(self, decodes: int, rows: int, written_rows: int, layers: int) -> dict:
        """The busiest rank's pieces (ms): a layer's, then the step's."""
        ms = {"attention": self._piece_ms("attention", decodes,
                                          lambda: self.attention(decodes)),
              "gemms": self._piece_ms("gemms", rows,
                                      lambda: self.projection.gemms(rows, self.weights)),
              "write": self._piece_ms("write", written_rows,
                                      lambda: self.cache_write(written_rows, self.batch)),
              "logits": self._piece_ms("logits", self.batch, self.logits)}
        ms["layer"] = round(ms["attention"] + ms["gemms"] + ms["write"], 4)
        ms["step"] = round(layers * ms["layer"] + ms["logits"], 4)
        return ms


def time_row(timer: StepTimer, row: dict, layers: int) -> dict:
    """``gpu_ms`` of a count row: the busiest rank's decodes, its P rows through the GEMMs,
    the rows it writes (each rank's own under ``replicate``, the gathered N x P under
    ``shard``)."""
    written = row["padded_rows"] * (row["N"] if row["gathered"] else 1)
    return timer.step_ms(max(row["decodes_per_rank"]), row["padded_rows"], written, layers)


def summarize(rows: list[dict]) -> list[dict]:
    """Per case and N: each policy's GPU step (ms, the busiest rank; ``replicate`` is one
    GPU's), ``shard`` over ``replicate``, and each policy's collectives and bytes."""
    by = {(r["batch"], r["context"], r["N"], r["policy"]): r for r in rows}
    out = []
    for b, c, n in dict.fromkeys((r["batch"], r["context"], r["N"]) for r in rows):
        rep, shard = by[(b, c, n, "replicate")], by[(b, c, n, "shard")]
        ms = {p: r["gpu_ms"]["step"] if r["gpu_ms"] else None
              for p, r in (("replicate", rep), ("shard", shard))}
        out.append({"batch": b, "context": c, "N": n, "gpu_step_ms": ms,
                    "shard_over_replicate": (round(ms["shard"] / ms["replicate"], 3)
                                             if ms["shard"] and ms["replicate"] else None),
                    **{f"{p}_{k}": r[k] for p, r in (("replicate", rep), ("shard", shard))
                       for k in ("collectives_per_step", "out_bytes_per_step",
                                 "wire_bytes_per_rank_per_step")}})
    return out


def measure(shape: Shape, cases: list[tuple[int, int]], worlds: list[int],
            timed: bool) -> list[dict]:
    """A row per case, N and policy; ``timed``: with the busiest rank's GPU times (one
    timer per case, its cache freed after)."""
    out = []
    for batch, context in cases:
        timer = StepTimer(batch, context) if timed else None
        for world in worlds:
            for policy in POLICIES:
                row = count_row(shape, batch, context, world, policy)
                if timer is not None:
                    row["gpu_ms"] = time_row(timer, row, shape.layers)
                out.append(row)
        del timer
        if timed:
            torch.cuda.empty_cache()
    return out


def parse_cases(text: str) -> list[tuple[int, int]]:
    """``"8x32768,64x4096"`` as ``[(B, C), ...]``; exits on a value below 1."""
    cases = [tuple(int(x) for x in c.lower().split("x")) for c in text.split(",")]
    if bad := [c for c in cases if len(c) != 2 or min(c) < 1]:
        raise SystemExit(f"cases {bad}: need BxC with B, C >= 1")
    return cases


def main(argv: list[str]) -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="1x32768,8x32768,32x32768,64x32768,128x8192",
                    help="BATCHxCONTEXT,...")
    ap.add_argument("--worlds", default="2,4", help="-pcp sizes")
    ap.add_argument("--model-config", default=MODEL_CONFIG)
    ap.add_argument("--counts-only", action="store_true", help="no GPU times")
    args = ap.parse_args(argv)
    unpin_host_memory_without_cuda()
    with open(os.path.join(kc.ROOT, args.model_config)) as f:
        shape = Shape.from_config(json.load(f))
    timed = (not args.counts_only and torch.cuda.is_available() and not shape.experts
             and shape == Shape.from_config(kc.HF))
    rows = measure(shape, parse_cases(args.cases), [int(n) for n in args.worlds.split(",")],
                   timed)
    meta = results.meta(
        shlex.join(["python", "benchmarks/decode_policy.py", *argv]), shape=asdict(shape),
        model_config=args.model_config, runs=kc.RUNS if timed else None, timed=timed,
        note=("GPU work of the busiest rank on one GPU (CUDA events, median of runs); "
              "collectives counted, not timed"))
    results.write(os.path.dirname(os.path.abspath(args.out)), os.path.basename(args.out),
                  {"meta": meta, "rows": rows, "summary": summarize(rows)})


if __name__ == "__main__":
    main(sys.argv[1:])

"""Turn a bench_pcp.py raw run into results files, ratios and a plot (pure, CPU-testable)."""
from __future__ import annotations

import json
import os
import statistics


def _rows(raw: dict, kind: str, fields: tuple[str, ...], samples: str) -> list[dict]:
    """Rows of one ``kind`` from every successful run, with the median of ``samples``."""
    return [{"config": run["config"], **{k: row[k] for k in fields}, samples: row[samples],
             "median_s": statistics.median(row[samples])}
            for run in raw["runs"] for row in run.get("rows", []) if row["kind"] == kind]


def _ttft_rows(raw: dict) -> list[dict]:
    return _rows(raw, "ttft", ("prompt_len",), "ttft_s")


def _itl_rows(raw: dict) -> list[dict]:
    return _rows(raw, "itl", ("context", "batch"), "itl_s")


TTFT_PAIRS = (("pcp1", "pcp2"), ("pcp1", "pcp2-dcp2"), ("tp2", "pcp2"),
              ("pcp1-stock", "pcp1"), ("pcp2", "pcp1"),
              ("pcp1", "pcp2-min8k"), ("pcp2-min8k", "pcp1"), ("pcp2-dcp2", "pcp1"),
              ("pcp2-split-all", "pcp2"),
              # the two context exchanges of PCP x DCP's chunked steps
              ("pcp1", "pcp2-dcp2-keys"), ("pcp1", "pcp2-dcp2-queries"),
              ("pcp2-dcp2-queries", "pcp2-dcp2-keys"), ("pcp2-dcp2-keys", "pcp2"))
ITL_PAIRS = (("pcp2", "pcp1"), ("pcp2-dcp2", "pcp1"), ("pcp1", "pcp1-stock"),
             ("pcp2-min8k", "pcp1"), ("pcp2-dcp2-keys", "pcp1"), ("pcp2-dcp2-queries", "pcp1"))


def ratios(rows: list[dict], key: str = "prompt_len", pairs=TTFT_PAIRS) -> dict:
    """median(a) / median(b) per ``key`` value, for the pairs the goals name."""
    med = {(r["config"], r[key]): r["median_s"] for r in rows}
    out = {}
    for num, den in pairs:
        for (cfg, n), value in med.items():
            if cfg == num and (den, n) in med:
                out[f"{num}/{den}@{n}"] = round(value / med[(den, n)], 4)
    return out


def plot(ttft_rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for config in sorted({r["config"] for r in ttft_rows}):
        pts = sorted((r["prompt_len"], r["median_s"]) for r in ttft_rows if r["config"] == config)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=config)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT, median (s)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SERVE_KEYS = [f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl")
              for stat in ("mean", "p50", "p90", "p99")]


def serve_rows(result_files: list[str]) -> list[dict]:
    """One row per ``vllm bench serve`` result file named ``CONFIG-cN.json``."""
    rows = []
    for path in sorted(result_files):
        name = os.path.basename(path).removesuffix(".json")
        config, _, conc = name.rpartition("-c")
        with open(path) as f:
            res = json.load(f)
        rows.append({"config": config, "max_concurrency": int(conc),
                     "num_prompts": res.get("num_prompts"),
                     **{k: res[k] for k in SERVE_KEYS if k in res}})
    return rows


GSM8K_TOLERANCE_POINTS = 1.5


def gsm8k_rows(result_files: list[str], baseline: str = "pcp1") -> dict:
    """Rows from scripts/eval_gsm8k.sh outputs named ``gsm8k-CONFIG.json``: exact
    match (strict, flexible) in points, and each one's distance from ``baseline``."""
    rows = []
    for path in sorted(result_files):
        config = os.path.basename(path).removesuffix(".json").removeprefix("gsm8k-")
        with open(path) as f:
            res = json.load(f)
        rows.append({"config": config, "questions": res["lm_eval_results"].get("sample_len"),
                     "strict": round(100 * res["exact_match_strict"], 2),
                     "flexible": round(100 * res["exact_match_flexible"], 2)})
    base = next((r for r in rows if r["config"] == baseline), None)
    for row in rows:
        if base is not None and row is not base:
            row["delta_strict"] = round(row["strict"] - base["strict"], 2)
            row["delta_flexible"] = round(row["flexible"] - base["flexible"], 2)
            row["within_tolerance"] = max(abs(row["delta_strict"]),
                                          abs(row["delta_flexible"])) <= GSM8K_TOLERANCE_POINTS
    return {"tolerance_points": GSM8K_TOLERANCE_POINTS, "rows": rows}


def write_reports(raw: dict, meta: dict, out_dir: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    ttft, itl = _ttft_rows(raw), _itl_rows(raw)
    failed = {r["config"]: r.get("log_tail", "")[-800:] for r in raw["runs"] if r["returncode"]}
    summary = {"ratios": ratios(ttft), "itl_ratios": ratios(itl, "batch", ITL_PAIRS),
               "kv_capacity_tokens": {r["config"]: r["kv_capacity_tokens"]
                                      for r in raw["runs"] if "kv_capacity_tokens" in r},
               "failed_configs": failed}
    with open(os.path.join(out_dir, "ttft.json"), "w") as f:
        json.dump({"meta": meta, "summary": summary, "rows": ttft}, f, indent=1)
    with open(os.path.join(out_dir, "itl.json"), "w") as f:
        json.dump({"meta": meta, "rows": itl}, f, indent=1)
    if ttft:
        plot(ttft, os.path.join(out_dir, "ttft.png"))
    return summary

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


LABELS = {"pcp1-stock": "stock vLLM, 1 GPU", "pcp1": "plugin, 1 GPU", "pcp2": "`-pcp 2`",
          "pcp2-dcp2": "`-pcp 2 -dcp 2`", "tp2": "`-tp 2`"}


def _label(config: str) -> str:
    return LABELS.get(config, f"`{config}`")


def _k(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def timing_table(ttft: dict, itl: dict | None = None, baseline: str = "pcp1") -> str:
    """A markdown table of one run's medians in ms, a row per configuration.

    TTFT columns (per prompt length) carry the speed-up over ``baseline``
    (``baseline / config``); ITL columns (per batch) the ratio to it
    (``config / baseline``), the form of the goals they answer."""
    itl_rows = (itl or {}).get("rows", [])
    configs = list(dict.fromkeys(r["config"] for r in ttft["rows"] + itl_rows))
    cols = ([("ttft", n) for n in sorted({r["prompt_len"] for r in ttft["rows"]})]
            + [("itl", b) for b in sorted({r["batch"] for r in itl_rows})])
    med = {(r["config"], "ttft", r["prompt_len"]): r["median_s"] for r in ttft["rows"]}
    med.update({(r["config"], "itl", r["batch"]): r["median_s"] for r in itl_rows})
    head = [f"TTFT {_k(n)} (speed-up)" if kind == "ttft" else f"ITL batch {n} (x 1 GPU)"
            for kind, n in cols]
    lines = ["| ms | " + " | ".join(head) + " |", "| --- " * (len(cols) + 1) + "|"]
    for config in configs:
        cells = []
        for kind, n in cols:
            value, base = med.get((config, kind, n)), med.get((baseline, kind, n))
            if value is None:
                cells.append("")
                continue
            precision = ".0f" if value * 1e3 >= 100 else ".1f" if value * 1e3 >= 10 else ".2f"
            cell = f"{value * 1e3:{precision}}"
            if base is not None and config != baseline:
                cell += f" ({(base / value if kind == 'ttft' else value / base):.2f}x)"
            cells.append(cell)
        lines.append(f"| {_label(config)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def serve_table(docs: list[dict]) -> str:
    """A markdown table of ``vllm bench serve`` percentiles (ms) from serve.json files,
    a row per configuration, each cell ``concurrency 4 / 16`` (as many as were run)."""
    rows = [(r, doc["meta"]["git_rev"][:7]) for doc in docs for r in doc["rows"]]
    configs = list(dict.fromkeys((r["config"], rev) for r, rev in rows))
    keys = ("p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms", "p50_itl_ms", "p99_itl_ms")
    concs = sorted({r["max_concurrency"] for r, _ in rows})
    lines = ["| ms, concurrency " + " / ".join(map(str, concs)) + " | "
             + " | ".join(k.removesuffix("_ms").replace("_", " ").upper() for k in keys)
             + " | revision |", "| --- " * (len(keys) + 2) + "|"]
    for config, rev in configs:
        by_conc = {r["max_concurrency"]: r for r, v in rows if (r["config"], v) == (config, rev)}
        cells = [" / ".join(_ms(by_conc[c].get(k)) if c in by_conc else "-" for c in concs)
                 for k in keys]
        lines.append(f"| {_label(config)} | " + " | ".join(cells) + f" | {rev} |")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"

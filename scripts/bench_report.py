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
          "pcp2-dcp2": "`-pcp 2 -dcp 2`", "tp2": "`-tp 2`", "tp2-pcp2": "`-tp 2 -pcp 2`"}


def _label(config: str) -> str:
    return LABELS.get(config, f"`{config}`")


def _k(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def _table(rows: list[list[str]], headers: list[str], text_columns: int = 1) -> str:
    """A GitHub markdown table of preformatted cells: the first ``text_columns`` columns
    left-aligned, the numbers after them right-aligned."""
    from tabulate import tabulate

    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True,
                    colalign=("left",) * text_columns
                    + ("right",) * (len(headers) - text_columns))


def _ms(value: float | None) -> str:
    """A time in ms to three significant figures or so; ``-`` where none was measured."""
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def timing_table(ttft: dict, itl: dict | None = None, baseline: str = "pcp1") -> str:
    """A markdown table of one run's medians, a row per configuration, one number a cell.

    Each prompt length gives a TTFT column in ms and the speed-up over ``baseline``
    (``baseline / config``); each ITL batch an ITL column in ms and its ratio to
    ``baseline`` (``config / baseline``), the form of the goals they answer."""
    itl_rows = (itl or {}).get("rows", [])
    configs = list(dict.fromkeys(r["config"] for r in ttft["rows"] + itl_rows))
    cols = ([("ttft", n) for n in sorted({r["prompt_len"] for r in ttft["rows"]})]
            + [("itl", b) for b in sorted({r["batch"] for r in itl_rows})])
    med = {(r["config"], "ttft", r["prompt_len"]): r["median_s"] for r in ttft["rows"]}
    med.update({(r["config"], "itl", r["batch"]): r["median_s"] for r in itl_rows})
    head = []
    for kind, n in cols:
        head += ([f"TTFT {_k(n)} (ms)", f"{_k(n)} speed-up"] if kind == "ttft"
                 else [f"ITL batch {n} (ms)", f"batch {n} / 1 GPU"])
    rows = []
    for config in configs:
        cells = [_label(config)]
        for kind, n in cols:
            value, base = med.get((config, kind, n)), med.get((baseline, kind, n))
            ratio = None if value is None or base is None else \
                base / value if kind == "ttft" else value / base
            cells += [_ms(None if value is None else value * 1e3), _x(ratio)]
        rows.append(cells)
    return _table(rows, ["configuration", *head])


SERVE_TABLE_KEYS = ("p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms", "p50_itl_ms", "p99_itl_ms")
HEADLINE_SERVE_KEYS = ("p50_ttft_ms", "p50_tpot_ms")


def serve_table(docs: list[dict], keys: tuple[str, ...] = SERVE_TABLE_KEYS,
                baseline: str | None = "pcp1", revision: bool = False) -> str:
    """A markdown table of ``vllm bench serve`` percentiles (ms) from serve.json files: a
    row per concurrency and configuration (concurrency first), a column per percentile.

    ``baseline``, where its rows are there: after the P50 TTFT column, its speed-up over
    that configuration at the same concurrency (``baseline / config``). ``revision``: a
    last column naming each row's revision (rows of several files)."""
    rows = [(r, doc["meta"]["git_rev"][:7]) for doc in docs for r in doc["rows"]]
    configs = list(dict.fromkeys((r["config"], rev) for r, rev in rows))
    by = {(r["config"], rev, r["max_concurrency"]): r for r, rev in rows}
    base_rev = next((rev for config, rev in configs if config == baseline), None)
    baseline = baseline if base_rev is not None else None
    head = []
    for key in keys:
        head.append(key.removesuffix("_ms").replace("_", " ").upper() + " (ms)")
        if baseline and key == "p50_ttft_ms":
            head.append("TTFT speed-up")
    out = []
    for conc in sorted({r["max_concurrency"] for r, _ in rows}):
        for config, rev in configs:
            row = by.get((config, rev, conc))
            if row is None:
                continue
            cells = [_label(config), str(conc)]
            for key in keys:
                cells.append(_ms(row.get(key)))
                if baseline and key == "p50_ttft_ms":
                    base = by.get((baseline, base_rev, conc), {}).get(key)
                    mine = row.get(key)
                    cells.append(_x(None if mine is None or base is None else base / mine))
            out.append(cells + ([rev] if revision else []))
    return _table(out, ["configuration", "concurrency", *head,
                        *(["revision"] if revision else [])])


def gsm8k_table(doc: dict) -> str:
    """A markdown table of a gsm8k.json: exact match in points, strict and flexible, and
    each configuration's distance from the baseline's (0.00 for the baseline itself)."""
    order = {config: i for i, config in enumerate(LABELS)}
    rows = sorted(doc["rows"], key=lambda r: (order.get(r["config"], len(order)), r["config"]))
    return _table([[_label(r["config"]), f"{r['strict']:.2f}", f"{r['flexible']:.2f}",
                    f"{r.get('delta_strict', 0.0):+.2f}", f"{r.get('delta_flexible', 0.0):+.2f}"]
                   for r in rows],
                  ["configuration", "strict (%)", "flexible (%)", "strict vs 1 GPU",
                   "flexible vs 1 GPU"])


EXACTNESS_FILES = ("exactness-pcp.json", "exactness-dcp.json")


def exactness_table(doc: dict) -> str:
    """A markdown table of a check_exactness.py result file: per comparison and model (its
    cases, then the one-GPU noise floor's), how many cases pass vLLM's top-5 rule, how many
    have no divergence at all, and the widest margin of the baseline's own token at a
    divergence."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for kind, key in (("plugin", "cases"), ("noise floor", "noise_floor_cases")):
        for case in doc.get(key, []):
            groups.setdefault((kind, case["config"], case["model"]), []).append(case)
    rows = []
    for (kind, config, model), cases in groups.items():
        margins = [c["max_baseline_margin"] for c in cases if "max_baseline_margin" in c]
        rows.append([config, model, kind, str(len(cases)),
                     str(sum(c["passed"] for c in cases)),
                     str(sum(c["first_divergence"] is None for c in cases)),
                     f"{max(margins):.4g}" if margins else "-"])
    return _table(rows, ["comparison", "model", "kind", "cases", "pass", "no divergence",
                         "widest margin"], text_columns=3)


def features_table(doc: dict) -> str:
    """A markdown table of exactness-features.json: per case name, the comparisons that ran
    it, how many pass (vLLM's top-5 rule and the case's own rule), how many are token for
    token; then the refusals."""
    rows = [[name, str(s["cases"]), str(s["passed"]), str(s["no_divergence"])]
            for name, s in doc["summary"]["by_case"].items()]
    refusals = doc["summary"]["refusals"]
    rows.append(["refusals at start-up", str(refusals["cases"]), str(refusals["passed"]), "-"])
    return _table(rows, ["case", "comparisons", "pass", "no divergence"])


def teacher_table(doc: dict) -> str:
    """A markdown table of exactness-teacher.json: per model and configuration (the model's
    floors first) the scored positions, the |logprob difference| at max and p99, positions
    over 1, and whether the configuration meets its goal (``-``: no verdict)."""
    rows = []
    for model, summary in doc["summary"]["models"].items():
        goal = summary["goal"]
        for kind, group in (("noise floor", summary["noise_floor"]),
                            ("plugin", summary["configs"])):
            for label, stats in group.items():
                verdict = goal.get(label.split(" vs ")[0]) if kind == "plugin" else None
                rows.append([label, model, kind] + (["failed"] * 4 if stats is None else [
                    str(stats["positions"]), f"{stats['max_abs_logprob_diff']:.4g}",
                    f"{stats['p99_abs_logprob_diff']:.4g}", str(stats["positions_over_1"])])
                    + [{True: "yes", False: "no"}.get(verdict, "-")])
    return _table(rows, ["comparison", "model", "kind", "positions", "max", "p99", "over 1.0",
                         "goal"], text_columns=3)


def generated_tables(root: str) -> dict[str, list[str]]:
    """Every table the docs print from the committed result files, by the markdown file
    (relative to ``root``) that holds it; tests/test_bench_report.py keeps them equal."""
    def load(name):
        with open(os.path.join(root, "benchmarks", "results", name)) as f:
            return json.load(f)

    def result(name):
        with open(os.path.join(root, "tests", "gpu", "results", name)) as f:
            return json.load(f)

    ttft, serve, gsm8k = load("ttft.json"), load("serve.json"), load("gsm8k.json")
    return {
        "README.md": [timing_table(ttft), serve_table([serve], HEADLINE_SERVE_KEYS),
                      gsm8k_table(gsm8k)],
        os.path.join("docs", "benchmarks.md"): [
            timing_table(ttft), timing_table(load("ttft-chunked.json"), load("itl.json")),
            serve_table([serve]), gsm8k_table(gsm8k)],
        os.path.join("docs", "exactness.md"): [
            *(exactness_table(result(name)) for name in EXACTNESS_FILES),
            features_table(result("exactness-features.json")),
            teacher_table(result("exactness-teacher.json"))],
    }


def main() -> None:
    """Print every generated table under the name of the file that holds it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for doc, tables in generated_tables(root).items():
        for table in tables:
            print(f"<!-- {doc} -->\n{table}\n")


if __name__ == "__main__":
    main()

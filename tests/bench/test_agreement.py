"""bench/agreement.py: vLLM's own benchmark client through the gateway, joined to the ledger's rows and
set beside vLLM's /metrics.

The end-to-end test starts the real stack (ledger, vLLM's OpenAI server with LedgerScheduler on the
tiny model, gateway) in the bench's own subprocess: about 40 s here, most of it vLLM starting.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from bench.agreement import FIGURES, MISSING, SUMS, compare, ledger_sum, parse_prometheus
from tests.support import ROOT

# Client TTFT - ledger client_ttft_s, |diff| p50 over 8 requests (32 in / 8 out at 4/s): 1.4-1.7 ms
# measured on the 2-core host; against the engine's first token (ttft_s) instead: 11-19 ms (vLLM's API
# server, its stream and the gateway's relay lie between). 5 ms keeps a margin on a busy machine and
# still fails a ledger that took the engine's first token for the client's.
P50_BOUND_S = 0.005


def _client(i: int, ttft: float, latency: float, tokens: int = 8) -> dict:
    return {
        "id": f"r-{i}",
        "ok": True,
        "error": "",
        "ttft": ttft,
        "latency": latency,
        "send_ts": 1000.0 + i,
        "output_tokens": tokens,
        "input_tokens": 32,
        "chunks": tokens,
        "mean_itl": (latency - ttft) / (tokens - 1),
    }


def test_compare_joins_requests_and_says_which_columns_are_missing():
    clients = [_client(0, 0.010, 0.080), _client(1, 0.020, 0.090), _client(2, 0.030, 0.100)]
    rows = {
        "r-0": {
            "request_id": "r-0",
            "ttft_s": 0.008,
            "e2e_s": 0.079,
            "output_tokens": 8,
            "prompt_tokens": 32,
        },
        "r-1": {
            "request_id": "r-1",
            "ttft_s": 0.018,
            "e2e_s": 0.089,
            "output_tokens": 7,
            "prompt_tokens": 32,
        },
    }
    columns = {"request_id", "ttft_s", "e2e_s", "output_tokens", "prompt_tokens"}
    before = {"vllm:request_success_total": 5.0, "vllm:generation_tokens_total": 40.0}
    after = {"vllm:request_success_total": 7.0, "vllm:generation_tokens_total": 55.0}
    out = compare(clients, rows, columns, before, after, {"GET /v1/itl n": 13})
    c = out["counts"]
    assert (c["missing_rows"], c["missing_row_ids"], c["output_token_mismatches"]) == (1, ["r-2"], 1)
    e2e = out["per_request"]["e2e_vs_e2e"]
    assert e2e["n"] == 2 and e2e["p50"] == pytest.approx(0.001)
    assert out["per_request"]["ttft_vs_engine_ttft"]["max"] == pytest.approx(0.002)
    assert out["per_request"]["ttft_vs_client_ttft"]["missing"] == f"{MISSING}: client_ttft_s"
    sums = {s["name"]: s for s in out["sums"]}
    assert sums["requests"]["vllm"] == 2 and sums["requests"]["rel"] == 0
    assert sums["generation_tokens"]["ledger"] == 15 and sums["generation_tokens"]["rel"] == 0
    assert sums["queue_s"]["ledger"] == f"{MISSING}: engine_queue_s"
    assert sums["preemptions"]["vllm"] is None  # not in the scrape
    goals = {g["name"]: g["ok"] for g in out["goals"]}
    assert not goals["|TTFT diff| p99 (s)"]  # n/a fails its goal
    assert not goals["missing ledger rows"] and not out["ok"]
    assert len(out["per_request"]) == len(FIGURES) and len(out["sums"]) == len(SUMS)


def test_prometheus_text_and_ledger_sums():
    text = (
        "# HELP vllm:num_preemptions_total x\n"
        'vllm:num_preemptions_total{engine="0",model_name="tiny"} 3.0\n'
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 4.0\n'
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 1.0\n'
        "process_open_fds 12\n"
    )
    m = parse_prometheus(text)
    assert m["vllm:num_preemptions_total"] == 3 and m["vllm:request_success_total"] == 5
    assert m["process_open_fds"] == 12
    rows = [{"a": 1.0, "b": 0.25, "n": 8}, {"a": 2.0, "b": None, "n": 4}]
    assert ledger_sum(rows, "a - b", {"a", "b"}) == 2.75
    assert ledger_sum(rows, "n - 1", {"n"}) == 10
    assert ledger_sum(rows, "a + c", {"a"}) == f"{MISSING}: c"


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_agreement_bench_end_to_end():
    args = ["--num-prompts", "8", "--input-len", "32", "--output-len", "8", "--request-rate", "4", "--json"]
    t0 = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "bench.agreement", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    elapsed = time.monotonic() - t0
    assert run.returncode == 0, run.stderr[-5000:]
    summary = json.loads(run.stdout)
    report = run.stderr
    c = summary["counts"]
    assert c["client_requests"] == 8 and c["client_failed"] == 0, c
    assert c["missing_rows"] == 0 and c["ledger_rows"] == 8, c
    assert c["output_token_mismatches"] == 0 and c["client_output_tokens"] == 64, c

    # the header names the exact commands; every figure, sum and goal is printed
    header = next(line for line in report.splitlines() if line.startswith("command: "))
    assert header.endswith("bench/agreement.py " + " ".join(args)), header
    for name in ("ledger", "vllm", "gateway", "client-short"):
        assert f"\n{name}: " in report, name
    assert "vllm.benchmarks.serve" in summary["commands"]["client-short"]
    for label, _, _ in FIGURES.values():
        assert label in report, label
    for name, _, _ in SUMS:
        assert f"\n{name} " in report, name
    for g in summary["goals"]:
        assert f"goal {g['name']}: " in report, g
    assert "all goals met: " in report

    sums = {s["name"]: s for s in summary["sums"]}
    for name in ("requests", "generation_tokens", "prompt_tokens", "itl_samples_tokens", "queue_count"):
        assert sums[name]["rel"] == 0, sums[name]
    assert sums["itl_samples"]["vllm"] == 56  # 8 requests x (8 - 1)

    per = summary["per_request"]
    for key in ("ttft_vs_client_ttft", "e2e_vs_e2e"):
        if "missing" in per[key]:  # the ledger has no client-side columns yet
            assert per[key]["missing"].startswith(MISSING)
            continue
        assert per[key]["n"] == 8, per[key]
        assert per[key]["abs_p50"] < P50_BOUND_S, (key, per[key], report)
    print(f"agreement bench took {elapsed:.1f} s")

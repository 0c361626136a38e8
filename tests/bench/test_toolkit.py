"""The bench toolkit: a bench's p99 is the ledger's p99, and vLLM's server starts one way everywhere."""

from __future__ import annotations

import math
import sys

from bench.toolkit import percentile, vllm_server_cmd
from ledger.analytics.common import percentile as ledger_percentile


def test_a_bench_percentile_is_the_ledgers_interpolated_one_on_any_order():
    values = [40.0, 10.0, 30.0, 20.0]
    assert percentile(values, 0.5) == 25.0  # nearest-rank would say 20
    assert percentile(values, 0.99) == ledger_percentile(sorted(values), 0.99)
    assert percentile(iter(values), 0.0) == 10.0 and percentile(values, 1.0) == 40.0
    assert math.isnan(percentile([], 0.99))


def test_vllm_server_cmd_gives_options_as_flags_and_the_plugin_unless_told_not_to():
    cmd = vllm_server_cmd(
        "/m",
        8123,
        served_name="tiny",
        engine_args=["--dtype", "float32"],
        max_num_seqs=16,
        kv_cache_memory_bytes=8 << 20,
        no_scheduler_reserve_full_isl=True,
        num_gpu_blocks_override=None,
        enable_prefix_caching=False,
        extra=["--seed", "3"],
    )
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    text = " ".join(cmd[3:])
    assert text == (
        "--model /m --served-model-name tiny --port 8123 --enforce-eager --dtype float32 "
        "--max-num-seqs 16 --kv-cache-memory-bytes 8388608 --no-scheduler-reserve-full-isl "
        "--scheduler-cls engine_hooks.vllm.LedgerScheduler --seed 3"
    )
    assert "--scheduler-cls" not in vllm_server_cmd("/m", 1, served_name="t", plugin=False)

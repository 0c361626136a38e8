"""The what-if against real vLLM bench's pure pieces: the relative errors, the tolerance, the best
configuration and the medians over runs (bench/whatif_compare.py), the settings handed to the what-if
model (bench/whatif_vllm.py) and the changed step costs (bench/whatif_variants.py)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.whatif_compare import aggregate, best, compare, rel_error, spread
from bench.whatif_variants import loop_gap_s, with_work, work_shape
from bench.whatif_vllm import settings_of, unmodelled
from ledger.advice.terms import StepData
from ledger.whatif.types import StepShape

ENGINE = {
    "max_num_batched_tokens": 2048,
    "long_prefill_token_threshold": 0,
    "enable_chunked_prefill": True,
    "max_num_seqs": 128,
    "num_kv_blocks": 4096,
    "block_size": 128,
    "reserve_full_isl": True,
    "adaptive_threshold": False,
}


def test_rel_error_is_predicted_over_measured_minus_one_and_none_without_a_measure():
    assert rel_error(1.15, 1.0) == pytest.approx(0.15)
    assert rel_error(0.5, 1.0) == pytest.approx(-0.5)
    assert rel_error(None, 1.0) is None
    assert rel_error(1.0, None) is None
    assert rel_error(1.0, 0.0) is None


def test_compare_marks_each_tail_within_the_tolerance_or_not():
    out = compare(
        {"short_ttft_p99_s": 1.1, "long_ttft_max_s": 2.5, "itl_p99_s": None},
        {"short_ttft_p99_s": 1.0, "long_ttft_max_s": 2.0, "itl_p99_s": 0.01},
        0.15,
    )
    assert out["short_ttft_p99_s"]["within"] is True
    assert out["long_ttft_max_s"]["error"] == pytest.approx(0.25)
    assert out["long_ttft_max_s"]["within"] is False
    assert out["itl_p99_s"] == {"predicted": None, "measured": 0.01, "error": None, "within": False}


def test_best_is_the_lowest_short_ttft_among_those_meeting_the_itl_target():
    tails: dict[str, dict[str, float | None]] = {
        "a": {"short_ttft_p99_s": 0.05, "itl_p99_s": 0.2},  # fastest, but over the ITL target
        "b": {"short_ttft_p99_s": 0.10, "itl_p99_s": 0.02},
        "c": {"short_ttft_p99_s": 0.30, "itl_p99_s": 0.01},
        "d": {"short_ttft_p99_s": None, "itl_p99_s": 0.01},
    }
    assert best(tails, 0.05) == "b"
    assert best(tails, None) == "a"
    assert best(tails, 0.001) is None


def _row(config: str, predicted: dict[str, float], measured: dict[str, float]) -> dict[str, Any]:
    return {
        "config": config,
        "recorded": config == "chunk-2048",
        "settings": {},
        "unmodelled": [],
        "self": None,
        "predicted_all": predicted,
        "measured_all": measured,
    }


def _run(measured_short: float) -> dict[str, Any]:
    return {
        "recorded": "chunk-2048",
        "long_prompt_tokens": 1024,
        "itl_target_ms": 50.0,
        "fit": {},
        "rows": [
            _row(
                "chunk-2048",
                {"short_ttft_p99_s": 1.0, "itl_p99_s": 0.01},
                {"short_ttft_p99_s": 1.0, "itl_p99_s": 0.01},
            ),
            _row(
                "thr",
                {"short_ttft_p99_s": 0.1, "itl_p99_s": 0.04},
                {"short_ttft_p99_s": measured_short, "itl_p99_s": 0.06},
            ),
        ],
    }


def test_repeated_runs_aggregate_to_medians_with_the_measured_spread():
    ev = aggregate([_run(0.08), _run(0.10), _run(0.20)], 0.15, 0.05)
    thr = ev["rows"][1]
    assert thr["measured_all"]["short_ttft_p99_s"] == pytest.approx(0.10)
    assert thr["tails"]["short_ttft_p99_s"]["within"] is True
    assert thr["spread"]["short_ttft_p99_s"] == pytest.approx((0.20 - 0.08) / 2 / 0.10)
    assert thr["spread"]["long_ttft_max_s"] is None
    # thr's ITL p99 is predicted under the 50 ms target, measured over it
    assert ev["best"]["target"] == {"predicted": "thr", "measured": "chunk-2048", "same": False}
    assert ev["best"]["no_target"]["same"] is True
    assert spread([0.1]) is None


def test_settings_are_vllms_plus_the_modelled_plugin_options():
    values = settings_of("reserve", ENGINE)
    assert values["admission_reserve"] == 0.25
    assert values["block_size"] == 128 and values["num_kv_blocks"] == 4096
    assert "adaptive_threshold" not in values
    assert "admission_reserve" not in settings_of("chunk-2048", ENGINE)
    assert unmodelled("reserve", ENGINE) == []
    assert unmodelled("reserve-step-50", ENGINE) == ["admission_step_target_s", "admission_min_chunk"]
    assert unmodelled("chunk-512", {**ENGINE, "adaptive_threshold": True}) == [
        "long_prefill_token_threshold_adaptive"
    ]


def _steps(**cols: list[float]) -> StepData:
    return StepData.from_columns(cols)


def test_the_work_variant_adds_the_chunks_own_triangle_to_the_depth_term_in_data_and_shapes_alike():
    data = _steps(
        duration_s=[0.01, 0.02],
        prefill_tokens=[100, 300],
        prefill_depth_tokens=[0, 300 * 1000],
        max_prefill_depth=[0, 1000],
        num_prefill_reqs=[1, 3],
        num_decode_reqs=[0, 2],
        kv_usage=[0.0, 0.1],
    )
    assert list(with_work(data).prefill_depth_tokens) == [100 * 100 / 2, 300 * 1000 + 300 * 300 / 3 / 2]
    shape = StepShape(300, 300 * 1000, 1000, 3, 2, 0.1)
    assert work_shape(shape).prefill_depth_tokens == 300 * 1000 + 15_000
    assert work_shape(StepShape(0, 0, 0, 0, 5, 0.1)) == StepShape(0, 0, 0, 0, 5, 0.1)


def test_the_loop_gap_is_the_median_time_between_consecutive_steps():
    data = _steps(
        duration_s=[0.010, 0.010, 0.010, 0.010],
        interval_s=[float("nan"), 0.011, 0.012, 5.0],  # the last came after an idle spell: no decodes
        prefill_tokens=[10, 0, 0, 10],
        prefill_depth_tokens=[0, 0, 0, 0],
        max_prefill_depth=[0, 0, 0, 0],
        num_prefill_reqs=[1, 0, 0, 1],
        num_decode_reqs=[0, 1, 1, 0],
        kv_usage=[0.0, 0.0, 0.0, 0.0],
    )
    assert loop_gap_s(data) == pytest.approx(0.0015)

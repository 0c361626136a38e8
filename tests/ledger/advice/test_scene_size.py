"""Sizing the head-of-line scene from a step-time fit (ledger.advice.scene), and the bench's summary of
a run (bench/head_of_line.py): ratios, the best plugin setting against vLLM's knobs, the refusal to
report ratios over an overloaded baseline."""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from bench.head_of_line import summary
from ledger.advice.fit import fit_step_time
from ledger.advice.profile import ProfileResult
from ledger.advice.scene import SIZING_PLAN, SceneSize, overloaded, prefill_s, size_from_profile, size_scene
from ledger.advice.terms import StepData
from ledger.records import as_json
from tools.synthetic_steps import LinearCost, synthetic_steps

# a CPU-like engine: 5 ms a step, 40 us a prefill token, 50 ns per token of depth, 0.1 ms a decode
CPU = LinearCost(a_ms=5.0, b_ms_per_token=0.04, c_ms_per_token_depth=5e-5, d_ms_per_decode=0.1)


@pytest.fixture(scope="module")
def fit():
    steps = synthetic_steps(
        CPU, n=2000, chunk_sizes=(64, 128, 256), max_depth=2048, decode_batches=(1, 4, 8), seed=0
    )
    return fit_step_time(StepData.from_steps(steps))


def test_the_shorts_keep_the_engine_half_busy_even_served_one_at_a_time(fit):
    size = size_scene(fit, short_prompt=48, short_output=16)
    one_short = CPU.cost_s(48, 0, 0) + 16 * CPU.cost_s(0, 0, 1)
    assert size.short_cost_s == pytest.approx(one_short, rel=0.05)
    assert size.short_rps * one_short == pytest.approx(0.5, rel=0.05)
    low, high = size.gap_ms
    assert (low + high) / 2 == pytest.approx(1e3 / size.short_rps, rel=0.01) and low < high
    assert "50% busy" in size.describe()


def test_the_long_prompt_is_the_shortest_whose_prefill_takes_the_time_asked(fit):
    size = size_scene(fit, long_prefill_s=3.0, round_to=1000)
    truth = sum(CPU.cost_s(256, d, 0) for d in range(0, size.long_tokens, 256))
    assert truth >= 2.8 and size.predicted_long_prefill_s >= 3.0 and not size.capped
    assert prefill_s(fit, size.long_tokens - 1000) < 3.0  # a thousand fewer would not do
    assert size_scene(fit, long_prefill_s=3.0, max_long_tokens=4000).capped


def test_a_scene_size_printed_as_json_reads_back_as_the_same_size(fit):
    # the bench sizes the scene in a subprocess that prints it, then reads it back
    size = size_scene(fit)
    assert msgspec.convert(json.loads(json.dumps(as_json(size))), SceneSize) == size


def test_a_scene_sized_from_a_profile_carries_the_fit_and_the_steps_it_was_sized_from():
    steps = synthetic_steps(
        CPU, n=400, chunk_sizes=(64, 128, 256), max_depth=2048, decode_batches=(1, 4), seed=1
    )
    sized = size_from_profile(ProfileResult(plan=SIZING_PLAN, model="tiny", steps=steps, phases=[]))
    fit = fit_step_time(StepData.from_steps(steps))
    assert sized.size == size_scene(fit)
    assert sized.fit == fit.summary() and sized.steps == 400
    assert list(as_json(sized)) == ["size", "fit", "steps"]


def test_a_baseline_above_ten_step_times_is_overloaded():
    assert overloaded(0.2, 0.01) and not overloaded(0.05, 0.01) and overloaded(float("nan"), 0.01)


def _r(config, p99, long=None, step=0.004):
    return {"config": config, "ttft_p99": p99, "long_ttft": long, "step_p50": step, "busy": 0.4}


def test_summary_names_the_best_plugin_setting_and_the_vllm_knob_that_beats_it():
    results = [
        _r("no-long", 0.02),
        _r("unchunked", 2.0, 6.0),
        _r("chunk-256", 2.2, 6.3),
        _r("chunk-2048-thr256", 0.24, 11.0),
        _r("reserve-step-100", 0.20, 7.2),
        _r("reserve-step-30", 0.10, 12.5),
    ]
    text = "\n".join(summary(results))
    assert re.search(
        r"reserve-step-100 +short TTFT p99 = +10\.0x baseline, long TTFT = +1\.20x unchunked", text
    )
    # best: the nearest to the goal (3x, 1.2x) in the worse of its two ratios, among those no knob beats
    assert "best plugin setting: reserve-step-30 (5.0x, 2.08x): no vLLM knob tried" in text
    assert "not met by any setting" in text
    # a knob as good on both axes as reserve-step-30 only: reserve-step-100 becomes the best
    results.append(_r("chunk-512", 0.09, 12.0))
    assert "best plugin setting: reserve-step-100 (10.0x, 1.20x): no vLLM knob" in "\n".join(summary(results))
    # a knob that beats every plugin setting is named next to the best of them
    results.append(_r("chunk-1024", 0.05, 7.0))
    assert "reserve-step-30 (5.0x, 2.08x): matched or beaten on both axes by chunk-512, chunk-1024" in (
        "\n".join(summary(results))
    )


def test_summary_says_when_the_goal_is_met():
    results = [_r("no-long", 0.02), _r("unchunked", 2.0, 6.0), _r("reserve-step-50", 0.05, 7.0)]
    assert any("met by reserve-step-50" in line for line in summary(results))


def test_summary_refuses_ratios_over_an_overloaded_baseline():
    lines = summary([_r("no-long", 0.5, step=0.004), _r("unchunked", 3.0, 6.0)])
    assert len(lines) == 1 and "baseline is overloaded" in lines[0] and "x baseline" not in lines[0]

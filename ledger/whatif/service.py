"""What-if: the window's own traffic replayed under the recorded setting and under the asked ones.

1. Read the window (:mod:`ledger.whatif.trace`) and fit its steps' duration (:mod:`ledger.advice.fit`).
2. **Calibrate**: replay the recorded setting and compare its tails with the measured ones; the
   relative error of each is printed next to every prediction, and the answer is refused
   (``calibration_failed``) when the largest is over ``max_error``, unless ``force``.
3. Replay each candidate; report its predicted tails, their ratio to the recorded setting's
   predicted tails (the model's bias cancels in it), whether it meets the targets, and which
   candidates are on the frontier (no other is as good on short TTFT p99, long TTFT and ITL p99 and
   better on one).

The recorded setting is what the caller states (``recorded``), the rest inferred from the window's
steps: the token budget as the most tokens one step ran, ``max_num_seqs`` as the most requests
running, chunked prefill on when a prompt was longer than any step. The KV cache size cannot be read
off the steps: without it, a window with preemptions is refused (``recorded_setting_needed``), one
without is replayed with a KV cache that never runs out.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, get_type_hints

import numpy as np
import sqlalchemy as sa

from ledger.advice.advisor import AdviceError
from ledger.advice.fit import FitError, StepTimeFit, fit_step_time
from ledger.advice.query import read_steps
from ledger.advice.terms import CANDIDATE_TERMS, TERMS, Term
from ledger.refusal import Refusal
from ledger.whatif.cost import fitted_cost
from ledger.whatif.model import ReplayTimeout, replay
from ledger.whatif.noise import StepNoise, draws_for, window_noise
from ledger.whatif.results import Replay
from ledger.whatif.trace import Recorded, read_recorded
from ledger.whatif.types import POLICIES, EngineSettings, StepCost, StepShape, TraceRequest

MIN_REQUESTS = 50  # fewer finished requests in the window: refuse (the tails would be noise)
MAX_CALIBRATION_ERROR = 0.25  # refuse when replaying the recorded setting misses a tail by more
UNBOUNDED_KV_BLOCKS = 1 << 30  # "the KV cache never ran out" when its size is not known
METRICS = ("ttft_p50_s", "ttft_p99_s", "itl_p99_s", "e2e_p99_s", "short_ttft_p99_s", "long_ttft_max_s")
CALIBRATED = ("ttft_p99_s", "itl_p99_s", "e2e_p99_s", "short_ttft_p99_s", "long_ttft_max_s")
FRONTIER = ("short_ttft_p99_s", "long_ttft_max_s", "itl_p99_s")  # lower is better on each
EXTRAPOLATION = 1.25  # a replay asking the fit for steps beyond this x what its data covered: flagged
_HINTS = get_type_hints(EngineSettings)
SETTABLE: dict[str, type] = {f.name: _HINTS[f.name] for f in dataclasses.fields(EngineSettings)}


class WhatIfError(Refusal):
    """No answer: ``reason`` is a short code, ``status`` the HTTP status the API answers with."""


# -- settings as users write them --------------------------------------------------------------------
def parse_setting(text: str, *, where: str = "set") -> dict[str, Any]:
    """``"max_num_batched_tokens=512,long_prefill_token_threshold=256"`` -> typed values; a
    WhatIfError (422) names the key and why otherwise."""
    out: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, eq, raw = part.partition("=")
        key, raw = key.strip(), raw.strip()
        if not eq or not key:
            raise WhatIfError("bad_setting", f"{where}: {part!r} is not key=value", status=422)
        out[key] = _value(key, raw, where)
    if not out:
        raise WhatIfError("bad_setting", f"{where}: empty: give key=value[,key=value]", status=422)
    return out


def parse_sweep(text: str) -> list[dict[str, Any]]:
    """``"max_num_batched_tokens=256,512,1024"`` -> one setting per value."""
    key, eq, raw = text.partition("=")
    key = key.strip()
    values = [v.strip() for v in raw.split(",") if v.strip()]
    if not eq or not key or not values:
        raise WhatIfError("bad_setting", f"sweep: {text!r} is not key=v1,v2,...", status=422)
    return [{key: _value(key, v, "sweep")} for v in values]


def _value(key: str, raw: str, where: str) -> Any:
    kind = SETTABLE.get(key)
    if kind is None:
        raise WhatIfError(
            "bad_setting",
            f"{where}: unknown setting {key!r}; known: {', '.join(SETTABLE)}",
            status=422,
        )
    if key == "policy" and raw not in POLICIES:  # checked here, before any replay runs
        raise WhatIfError(
            "bad_setting", f"{where}: unknown policy {raw!r} (known: {', '.join(POLICIES)})", status=422
        )
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0", "on", "off"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1", "on")
        return kind(raw)
    except ValueError:
        raise WhatIfError(
            "bad_setting", f"{where}: {key}={raw!r} is not a {kind.__name__}", status=422
        ) from None


def _settings(values: Mapping[str, Any], where: str) -> EngineSettings:
    try:
        return EngineSettings(**values)
    except ValueError as exc:
        raise WhatIfError("bad_setting", f"{where}: {exc}", status=422) from None


def recorded_settings(recorded: Recorded, given: Mapping[str, Any]) -> tuple[EngineSettings, list[str]]:
    """The recorded setting: ``given`` plus what the window shows (the names inferred are returned)."""
    observed = recorded.observed
    values = dict(given)
    inferred: list[str] = []
    longest = max(
        (r.prompt_tokens - r.cached_tokens for rs in recorded.requests.values() for r in rs), default=0
    )
    if "max_num_batched_tokens" not in values:
        values["max_num_batched_tokens"] = max(observed.max_step_tokens, 1)
        inferred.append("max_num_batched_tokens")
    if "enable_chunked_prefill" not in values:
        values["enable_chunked_prefill"] = longest > values["max_num_batched_tokens"]
        inferred.append("enable_chunked_prefill")
    if "max_num_seqs" not in values:
        values["max_num_seqs"] = max(observed.max_running, 1)
        inferred.append("max_num_seqs")
    if "num_kv_blocks" not in values:
        if recorded.preemptions:
            raise WhatIfError(
                "recorded_setting_needed",
                f"the window has {recorded.preemptions} preemptions, so its KV cache ran out, and its size "
                "cannot be read off the steps: give recorded num_kv_blocks (and block_size if not 16)",
                status=422,
            )
        values["num_kv_blocks"] = UNBOUNDED_KV_BLOCKS
        inferred.append("num_kv_blocks")
    return _settings(values, "recorded"), inferred


# -- replay over the window's engines -----------------------------------------------------------------
def pooled_replay(
    requests: Mapping[str, Sequence[TraceRequest]],
    settings: EngineSettings,
    cost: StepCost,
    noise: StepNoise | None = None,
    draws: int = 1,
    deadline: float | None = None,
) -> Replay:
    """Each engine's requests through its own scheduler model, the results pooled (engines in the
    order of ``requests``); ``noise``: each step's factor and loop time (:mod:`ledger.whatif.noise`),
    drawn anew (its seed, + 1, ...) in each of ``draws`` replays, pooled one after the other."""
    if draws < 1 or (draws > 1 and noise is None):
        raise ValueError(f"draws must be 1, or more with step noise (got {draws})")
    parts = []
    bs = settings.block_size
    # a prefix hit counts in whole blocks of the replayed block size
    blocked = {
        sid: [
            r
            if r.cached_tokens % bs == 0
            else replace(r, cached_tokens=r.cached_tokens - r.cached_tokens % bs)
            for r in reqs
        ]
        for sid, reqs in requests.items()
    }
    for draw in range(draws):
        drawn = noise.reseeded(noise.seed + draw) if noise is not None else None
        for sid, reqs in blocked.items():
            try:
                parts.append(replay(reqs, settings, cost, noise=drawn, deadline=deadline))
            except ValueError as exc:
                raise WhatIfError("cannot_replay", f"engine {sid}: {exc}", status=422) from None
            except ReplayTimeout:
                raise WhatIfError(
                    "timeout",
                    "the replays did not finish within the what-if time limit (whatif_timeout_s); ask "
                    "for fewer settings or a shorter window",
                    status=408,
                    limit="whatif_timeout_s",
                ) from None
    return Replay(
        request_id=[i for p in parts for i in p.request_id],
        prompt_tokens=np.concatenate([p.prompt_tokens for p in parts]),
        ttft_s=np.concatenate([p.ttft_s for p in parts]),
        e2e_s=np.concatenate([p.e2e_s for p in parts]),
        preemptions=np.concatenate([p.preemptions for p in parts]),
        itl_gap_s=np.concatenate([p.itl_gap_s for p in parts]),
        itl_count=np.concatenate([p.itl_count for p in parts]),
        steps=sum(p.steps for p in parts),
        simulated_s=max(p.simulated_s for p in parts),
        draws=draws,
    )


class Coverage:
    """A step cost that remembers the largest step shapes it was asked for, to tell a prediction
    inside the fit's data from one outside it (a 16k-token chunk from a fit that saw 2k ones)."""

    def __init__(self, cost: StepCost) -> None:
        self._cost = cost
        self.prefill_tokens = 0
        self.max_prefill_depth = 0
        self.num_decode_reqs = 0

    def __call__(self, shape: StepShape) -> float:
        if shape.prefill_tokens > self.prefill_tokens:
            self.prefill_tokens = shape.prefill_tokens
        if shape.max_prefill_depth > self.max_prefill_depth:
            self.max_prefill_depth = shape.max_prefill_depth
        if shape.num_decode_reqs > self.num_decode_reqs:
            self.num_decode_reqs = shape.num_decode_reqs
        return self._cost(shape)

    def outside(self, fit: StepTimeFit, attention: StepTimeFit | None = None) -> list[str]:
        """What the replay asked of the fit beyond EXTRAPOLATION x what the fit's steps covered (and,
        for the prefill's size and depth, the steps ``attention``, the in-chunk term's fit, covered)."""
        r = fit.ranges
        tokens, depth = r.prefill_tokens[1], r.max_prefill_depth[1]
        if attention is not None:
            tokens = max(tokens, attention.ranges.prefill_tokens[1])
            depth = max(depth, attention.ranges.max_prefill_depth[1])
        out = []
        for name, asked, covered in (
            ("prefill tokens per step", self.prefill_tokens, tokens),
            ("prefill depth", self.max_prefill_depth, depth),
            ("decoding requests per step", self.num_decode_reqs, r.num_decode_reqs[1]),
        ):
            if asked > EXTRAPOLATION * max(covered, 1):
                out.append(f"{name} up to {asked:,} (the fit's steps: up to {int(covered):,})")
        return out


_SQ = TERMS["prefill_tokens_sq"]


def _attention_term(
    engine: sa.Engine, source_id: str | None, now: float | None
) -> tuple[StepTimeFit | None, float]:
    """The fit of ``source_id``'s steps and its in-chunk attention coefficient (s per token²); (None,
    0) without a source. Refused when those steps do not show it."""
    if source_id is None:
        return None, 0.0
    try:
        steps = read_steps(engine, model=None, source_id=source_id, since=None, until=None, now=now)
        fit = fit_step_time(steps.data)
    except AdviceError as exc:
        raise WhatIfError(exc.reason, f"attention_source: {exc}", status=exc.status, **exc.details) from None
    except FitError as exc:
        raise WhatIfError(
            exc.reason, f"attention_source: cannot fit {source_id}'s steps: {exc}", status=409
        ) from None
    value = {c.term: c.value_s for c in fit.coefficients}.get(_SQ.name)
    if value is None or value <= 0:
        raise WhatIfError(
            "attention_not_measured",
            f"attention_source: the steps of {source_id!r} do not show attention inside a chunk (the fit "
            "kept no tokens² term): profile larger chunk sizes (chunkledger profile --chunk-sizes "
            "256,1024,4096,8192,16384 --max-depth 32768)",
            status=409,
            terms=list(fit.terms),
        )
    return fit, value


def _plus_attention(cost: StepCost, per_token2: float) -> StepCost:
    """``cost`` plus the in-chunk attention: ``per_token2`` x tokens² per chunk."""

    def with_attention(shape: StepShape) -> float:
        return cost(shape) + per_token2 * float(shape.prefill_tokens) ** 2 / max(shape.num_prefill_reqs, 1)

    return with_attention


def _rel(predicted: Any, measured: Any) -> float | None:
    if predicted is None or measured is None or measured <= 0:
        return None
    return float(predicted) / float(measured) - 1.0


def default_long_prompt(recorded: Recorded) -> int | None:
    """Prompts of at least 8x the median (and 1,024 tokens) are the long ones; None when there are none."""
    if not recorded.count:
        return None
    cut = max(1024, int(8 * float(np.median(recorded.prompt_tokens))))
    return cut if bool((recorded.prompt_tokens >= cut).any()) else None


def _dominates(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    keys = [k for k in FRONTIER if a.get(k) is not None and b.get(k) is not None]
    return bool(keys) and all(a[k] <= b[k] for k in keys) and any(a[k] < b[k] for k in keys)


def _name(setting: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in setting.items()) or "recorded"


def what_if(
    engine: sa.Engine,
    *,
    candidates: Sequence[Mapping[str, Any]],
    recorded: Mapping[str, Any] | None = None,
    model: str | None = None,
    source_id: str | None = None,
    since: str | float | None = None,
    until: str | float | None = None,
    long_prompt_tokens: int | None = None,
    itl_target_ms: float | None = None,
    ttft_target_ms: float | None = None,
    max_error: float = MAX_CALIBRATION_ERROR,
    force: bool = False,
    min_requests: int = MIN_REQUESTS,
    fit_source: str | None = None,
    fit_since: str | float | None = None,
    fit_until: str | float | None = None,
    attention_source: str | None = None,
    step_noise: bool = True,
    now: float | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """The what-if answer (the module docstring says what it holds); WhatIfError when there is none.

    ``fit_source`` / ``fit_since`` / ``fit_until``: fit the step time on other steps than the
    window's: one engine's (e.g. a ``chunkledger profile`` run sent to the ledger, which measures
    chunk sizes x depths x decode batches: a window that ran one chunk size cannot tell a per-chunk
    cost from a per-token one), over all its steps unless a fit window is given; or the window's own
    engines over another window. ``attention_source``: the one cost a window of one chunk size cannot
    show, the attention inside a chunk (tokens² per chunk), fitted on that engine's steps (a profile
    over chunk sizes), the rest on the window's steps at the window's own level; what a one-step 16k
    prefill costs is then known though the window never ran one. ``step_noise``: each replayed
    decode-only step's fitted time times a factor drawn from the window's own decode-only steps'
    ``actual / fitted``, and each step that follows another the engine loop's time the window measured
    before such a step (:mod:`ledger.whatif.noise`): the ITL tail comes from the steps that ran long. A
    small window is replayed several times with the noise drawn anew and the draws pooled
    (:func:`ledger.whatif.noise.draws_for`), so that its tails do not rest on one draw. ``timeout_s``:
    the replays stop past it (WhatIfError ``timeout``, 408)."""
    t0 = time.perf_counter()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        steps = read_steps(
            engine,
            model=model,
            source_id=source_id,
            since=since,
            until=until,
            now=now,
            previous_prefills=True,
        )
        fit_steps = steps
        if fit_source is not None or fit_since is not None or fit_until is not None:
            fit_steps = read_steps(
                engine,
                model=None if fit_source is not None else model,
                source_id=fit_source if fit_source is not None else source_id,
                since=fit_since if fit_since is not None or fit_source is not None else since,
                until=fit_until if fit_until is not None or fit_source is not None else until,
                now=now,
            )
    except AdviceError as exc:
        raise WhatIfError(exc.reason, str(exc), status=exc.status, **exc.details) from None
    attention, in_chunk = _attention_term(engine, attention_source, now)
    data = fit_steps.data
    terms: tuple[Term, ...] = CANDIDATE_TERMS
    if attention is not None:
        # the window's steps less the in-chunk attention the other engine measured; the rest fitted here
        data = dataclasses.replace(data, duration_s=data.duration_s - in_chunk * _SQ.column(data))
        terms = tuple(t for t in CANDIDATE_TERMS if t is not _SQ)
    try:
        fit: StepTimeFit = fit_step_time(data, candidates=terms)
    except FitError as exc:
        raise WhatIfError(exc.reason, f"cannot fit the step time: {exc}", status=409, **exc.details) from None
    with engine.connect() as conn:
        rec = read_recorded(
            conn, model=steps.model, source_ids=steps.source_ids, since=steps.since, until=steps.until
        )
    window = {
        "model": steps.model,
        "source_ids": sorted(rec.requests),
        "since": steps.since,
        "until": steps.until,
        "requests": rec.count,
        "skipped": rec.skipped,
        "observed": rec.observed.as_dict(),
    }
    if rec.count < min_requests:
        raise WhatIfError(
            "too_little_data",
            f"the window holds {rec.count} finished requests; a replay needs at least {min_requests}",
            window=window,
        )
    base, inferred = recorded_settings(rec, recorded or {})
    base_values = dataclasses.asdict(base)
    long_tokens = long_prompt_tokens if long_prompt_tokens is not None else default_long_prompt(rec)
    cost = fitted_cost(fit)
    if attention is not None:
        cost = _plus_attention(cost, in_chunk)
    noise = window_noise(fit, steps.data, prev_prefills=steps.prev_prefill_reqs) if step_noise else None
    draws = draws_for(rec.count) if noise is not None else 1

    measured = rec.summary(long_tokens)
    predicted = pooled_replay(rec.requests, base, cost, noise, draws, deadline).summary(long_tokens)
    error = {k: _rel(predicted.get(k), measured.get(k)) for k in CALIBRATED}
    worst = max((abs(v) for v in error.values() if v is not None), default=None)
    calibration = {
        "settings": base_values,
        "inferred": inferred,
        "measured": _tails(measured),
        "predicted": _tails(predicted),
        "error": error,
        "max_error": worst,
        "max_error_allowed": max_error,
    }
    if worst is not None and worst > max_error and not force:
        raise WhatIfError(
            "calibration_failed",
            f"replaying the recorded setting misses a measured tail by {worst:.0%} (more than "
            f"{max_error:.0%}): the model does not describe this window; state the recorded settings "
            "(recorded=...) or pass force",
            status=409,
            window=window,
            calibration=calibration,
        )
    rows: list[dict[str, Any]] = []
    for asked in candidates:
        values = {**base_values, **asked}
        coverage = Coverage(cost)
        summary = pooled_replay(
            rec.requests, _settings(values, _name(asked)), coverage, noise, draws, deadline
        ).summary(long_tokens)
        rows.append(
            {
                "name": _name(asked),
                "set": dict(asked),
                "settings": values,
                "predicted": _tails(summary),
                "relative": {k: _rel(summary.get(k), predicted.get(k)) for k in METRICS},
                "meets": _meets(summary, itl_target_ms, ttft_target_ms),
                "extrapolated": coverage.outside(fit, attention),
            }
        )
    everyone: list[dict[str, Any]] = [{"name": "recorded", "predicted": _tails(predicted)}, *rows]
    for row in rows:
        row["frontier"] = not any(
            _dominates(o["predicted"], row["predicted"]) for o in everyone if o is not row
        )
    _mark_best(rows, predicted)
    return {
        "window": window,
        "fit": {
            "r2": fit.r2,
            "cv_rel_error": fit.cv_rel_error,
            "terms": list(fit.terms),
            "source_ids": fit_steps.source_ids,
            "since": fit_steps.since,
            "until": fit_steps.until,
            "steps": len(fit_steps.data),
            "attention": None
            if attention is None
            else {
                "source_id": attention_source,
                "ms_per_token2_per_chunk": in_chunk * 1e3,
                "steps": attention.ranges.steps,
                "prefill_tokens": list(attention.ranges.prefill_tokens),
            },
        },
        "step_noise": _noise_figures(noise, step_noise, draws),
        "long_prompt_tokens": long_tokens,
        "targets": {"itl_p99_ms": itl_target_ms, "short_ttft_p99_ms": ttft_target_ms},
        "calibration": calibration,
        "candidates": rows,
        "elapsed_s": time.perf_counter() - t0,
    }


def _noise_figures(noise: StepNoise | None, asked: bool, draws: int) -> dict[str, Any]:
    """What the replay's step noise was drawn from: the window's decode-only steps' ``actual / fitted``
    and the engine loop's time before its steps (ms); how many replays with it were pooled."""
    if noise is None:
        return {"applied": False, "why": "off" if not asked else "too few steps in the window"}
    r = np.asarray(noise.ratios)

    def ms(values: list[float]) -> dict[str, float]:
        v = np.asarray(values) * 1e3
        q50, q99 = np.quantile(v, [0.5, 0.99])
        return {"p50": float(q50), "p99": float(q99), "mean": float(v.mean())}

    return {
        "applied": True,
        "draws": draws,
        "decode_steps": len(r),
        "mean": float(r.mean()),
        "p50": float(np.quantile(r, 0.5)),
        "p99": float(np.quantile(r, 0.99)),
        "loop_ms": {
            "decode": ms(noise.decode_gaps),
            "prefill": ms(noise.prefill_gaps),
            "per_first_token": noise.per_first_token * 1e3,
        },
    }


def _tails(summary: Mapping[str, Any]) -> dict[str, Any]:
    return {k: summary.get(k) for k in (*METRICS, "preemptions", "requests")}


def _meets(summary: Mapping[str, Any], itl_ms: float | None, ttft_ms: float | None) -> dict[str, bool] | None:
    out: dict[str, bool] = {}
    if itl_ms is not None and summary.get("itl_p99_s") is not None:
        out["itl"] = summary["itl_p99_s"] * 1e3 <= itl_ms
    ttft = summary.get("short_ttft_p99_s") or summary.get("ttft_p99_s")
    if ttft_ms is not None and ttft is not None:
        out["ttft"] = ttft * 1e3 <= ttft_ms
    return out or None


def _mark_best(rows: list[dict[str, Any]], recorded: Mapping[str, Any]) -> None:
    """``best``: among the candidates that meet every target given and stay inside the fit's data, the
    lowest short TTFT p99 (TTFT p99 when there are no long prompts)."""
    key = "short_ttft_p99_s" if recorded.get("short_ttft_p99_s") is not None else "ttft_p99_s"
    ok = [
        r
        for r in rows
        if r["predicted"].get(key) is not None and all((r["meets"] or {}).values()) and not r["extrapolated"]
    ]
    best = min(ok, key=lambda r: r["predicted"][key], default=None)
    for r in rows:
        r["best"] = r is best


MAX_CANDIDATES = 32  # settings replayed in one answer at most


def candidates_from(
    sets: Sequence[str] = (), sweep: str | None = None, policy: str | None = None
) -> list[dict[str, Any]]:
    """The settings asked for: one per ``set`` ("k=v[,k=v]"), one per value of ``sweep``
    ("k=v1,v2,..."); ``policy`` joins each of them (or is the one asked when there are none)."""
    asked = [parse_setting(s) for s in sets]
    if sweep:
        asked += parse_sweep(sweep)
    if policy is not None:
        _value("policy", policy, "policy")
        asked = [{**a, "policy": policy} for a in asked] or [{"policy": policy}]
    if not asked:
        raise WhatIfError("nothing_asked", "set, sweep or policy: say which settings to replay", status=422)
    if len(asked) > MAX_CANDIDATES:
        raise WhatIfError(
            "too_many_settings",
            f"{len(asked)} settings asked; at most {MAX_CANDIDATES} per answer",
            status=422,
        )
    return asked


def what_if_request(
    engine: sa.Engine,
    *,
    set: Sequence[str] = (),
    sweep: str | None = None,
    policy: str | None = None,
    recorded: str | None = None,
    **options: Any,
) -> dict[str, Any]:
    """:func:`what_if` with the settings as users write them (the API's and the CLI's parameters)."""
    candidates = candidates_from(set, sweep, policy)
    given = parse_setting(recorded, where="recorded") if recorded else {}
    return what_if(engine, candidates=candidates, recorded=given, **options)

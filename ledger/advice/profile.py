"""``chunkledger profile``: measure step time on the real engine before production traffic does.

The plan (:class:`ProfilePlan`), the in-process recorder of the plugin's ``step`` events
(:class:`StepRecorder`) and what is made of them (:class:`ProfileResult`) are here; the driver that runs
the plan on vLLM with chunkledger's scheduler plugin is :mod:`engine_hooks.vllm.profile` (its
docstring says what runs).

The result is the measured table (per chunk size and decode batch: the step time at depth 0 and its
growth per 1k tokens of depth, as in issue 5; per decode batch: the decode-only step) and the same fit
``chunkledger advise`` makes (``ledger.advice.fit``), plus advice when a target is given.

The engine's budget is ``max(chunk) + max(batch) * decode_prompt_tokens`` so the first step (the
decoders' prefills plus the first chunk) fits.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine_hooks import events as ev
from ledger.advice.advisor import Advisor
from ledger.advice.answer import AdviceQuery
from ledger.advice.fit import FitError, fit_step_time
from ledger.advice.terms import StepData
from ledger.records import as_json


class ProfileError(RuntimeError):
    """The profile cannot run (bad plan, no vLLM, the plugin missing); the message says what to do."""


@dataclass(frozen=True)
class ProfilePlan:
    chunk_sizes: tuple[int, ...] = (256, 512, 1024, 2048)
    max_depth: int = 8192  # deepest chunk start of the long prompts
    decode_batches: tuple[int, ...] = (1, 8, 32)
    decode_prompt_tokens: int = 16  # prompt length of the decoding requests
    tail_steps: int = 8  # decode-only steps after each long prefill
    repeats: int = 1  # runs of the whole plan (more steps, tighter fit)
    seed: int = 0

    def check(self) -> None:
        problems = []
        if not self.chunk_sizes or min(self.chunk_sizes) < 1:
            problems.append("chunk_sizes: give one or more sizes >= 1")
        elif len(set(self.chunk_sizes)) < 3:
            problems.append("chunk_sizes: the fit needs at least 3 different sizes")
        if self.max_depth < 1:
            problems.append("max_depth: must be >= 1")
        elif self.chunk_sizes and self.max_depth < 2 * max(self.chunk_sizes):
            problems.append(
                f"max_depth ({self.max_depth}) must be at least twice the largest chunk "
                f"({max(self.chunk_sizes)}) so every size runs at 3 or more depths"
            )
        if not self.decode_batches or min(self.decode_batches) < 1:
            problems.append("decode_batches: give one or more batch sizes >= 1")
        elif len(set(self.decode_batches)) < 2:
            problems.append("decode_batches: the fit needs at least 2 different decode batches")
        if self.decode_prompt_tokens < 1 or self.tail_steps < 1 or self.repeats < 1:
            problems.append("decode_prompt_tokens, tail_steps and repeats must be >= 1")
        if problems:
            raise ProfileError("; ".join(problems))

    @property
    def max_num_batched_tokens(self) -> int:
        return max(self.chunk_sizes) + max(self.decode_batches) * self.decode_prompt_tokens

    @property
    def max_model_len(self) -> int:
        return self.max_depth + max(self.chunk_sizes) + 8

    def decode_tokens_for(self, chunk: int) -> int:
        """Output tokens a decoding request needs to outlast the long prompt's prefill, plus the tail."""
        return math.ceil((self.max_depth + chunk) / chunk) + self.tail_steps + 2


@dataclass
class Phase:
    chunk: int
    decodes: int
    first_step: int  # index into ProfileResult.steps
    end_step: int
    wall_s: float


class StepRecorder:
    """An in-process sink with the exporter's ``emitter`` interface: keeps the ``step`` events and
    hands every event on to ``forward`` (the plugin's own exporter, sending to a ledger) if given."""

    def __init__(self, forward: Any = None) -> None:
        self.forward = forward
        self.steps: list[ev.Step] = []
        self.paused = False  # while True nothing is kept or sent (the warm-up run)
        self._seq = 0
        self.config = getattr(forward, "config", None)

    def emitter(self, kind: type[Any], *fields: str) -> Any:
        send = self.forward.emitter(kind, *fields) if self.forward is not None else None
        keep = kind is ev.Step
        steps = self.steps

        def emit(*values: Any) -> None:
            if self.paused:
                return
            if keep:
                self._seq += 1
                steps.append(ev.Step(seq=self._seq, **dict(zip(fields, values, strict=True))))
            if send is not None:
                send(*values)

        def many(rows: Any) -> None:
            for row in rows:
                emit(*row)

        emit.many = many  # type: ignore[attr-defined]
        return emit

    def shutdown(self, timeout: float | None = None) -> bool:
        return self.forward.shutdown(timeout) if self.forward is not None else True


@dataclass
class ProfileResult:
    plan: ProfilePlan
    model: str
    steps: list[ev.Step]
    phases: list[Phase]
    source_id: str | None = None
    sent: dict[str, Any] = field(default_factory=dict)

    def data(self) -> StepData:
        return StepData.from_steps(self.steps)

    def chunk_table(self) -> list[dict[str, Any]]:
        """Per (chunk, decode batch): step time at depth 0 and per 1k depth, from the long prompt's
        chunk steps (one chunk of exactly T tokens, next to the decodes)."""
        rows = []
        for chunk in sorted(set(self.plan.chunk_sizes)):
            for batch in sorted(set(self.plan.decode_batches)):
                depth, dur = [], []
                for p in self.phases:
                    if p.chunk != chunk or p.decodes != batch:
                        continue
                    for s in self.steps[p.first_step : p.end_step]:
                        if s.num_prefill_reqs == 1 and s.prefill_tokens == chunk:
                            depth.append(s.max_prefill_depth)
                            dur.append(s.duration_s * 1e3)
                if len(set(depth)) < 2:
                    continue
                slope, base = theil_sen(np.asarray(depth) / 1000.0, np.asarray(dur))
                rows.append(
                    {
                        "chunk_tokens": chunk,
                        "decode_batch": batch,
                        "steps": len(dur),
                        "max_depth": int(max(depth)),
                        "ms_at_depth_0": float(base),
                        "ms_per_1k_depth": float(slope),
                    }
                )
        return rows

    def decode_table(self) -> list[dict[str, Any]]:
        rows = []
        for batch in sorted(set(self.plan.decode_batches)):
            dur = [
                s.duration_s * 1e3 for s in self.steps if s.prefill_tokens == 0 and s.num_decode_reqs == batch
            ]
            if dur:
                rows.append(
                    {
                        "decode_batch": batch,
                        "steps": len(dur),
                        "p50_ms": float(np.quantile(dur, 0.5)),
                        "p99_ms": float(np.quantile(dur, 0.99)),
                    }
                )
        return rows

    def report(self, itl_target_ms: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "source_id": self.source_id,
            "plan": {
                "chunk_sizes": list(self.plan.chunk_sizes),
                "max_depth": self.plan.max_depth,
                "decode_batches": list(self.plan.decode_batches),
                "repeats": self.plan.repeats,
            },
            "steps": len(self.steps),
            "wall_s": sum(p.wall_s for p in self.phases),
            "chunks": self.chunk_table(),
            "decode": self.decode_table(),
        }
        if self.sent:
            out["ledger"] = self.sent
        data = self.data()
        try:
            fit = fit_step_time(data)
        except FitError as exc:
            out["fit_error"] = {"reason": exc.reason, "detail": str(exc)}
            return out
        out["fit"] = as_json(fit.summary())
        if itl_target_ms is not None:
            from ledger.advice.advisor import AdviceError

            try:
                advice = Advisor(data, fit).advise(AdviceQuery(itl_target_ms=itl_target_ms))
                out["advice"] = as_json(advice)
                out["advice"].pop("fit", None)
            except AdviceError as exc:
                out["advice_error"] = {"reason": exc.reason, "detail": str(exc)}
        return out


def theil_sen(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(slope, intercept) of the Theil-Sen line: the median of the pairwise slopes, then the median
    intercept. A few stalled steps (up to ~29%) do not move it, unlike least squares."""
    i, j = np.triu_indices(len(x), k=1)
    dx = x[j] - x[i]
    ok = dx != 0
    slope = float(np.median((y[j] - y[i])[ok] / dx[ok]))
    return slope, float(np.median(y - slope * x))


def run_profile(
    model: str,
    plan: ProfilePlan,
    *,
    served_model_name: str | None = None,
    ledger_url: str | None = None,
    source_id: str | None = None,
    ingest_token: str | None = None,
    kv_cache_bytes: int = 512 << 20,
    engine_kwargs: dict[str, Any] | None = None,
    progress: Any = None,
) -> ProfileResult:
    """Run ``plan`` on vLLM in this process and return the recorded steps (see the module docstring).

    ``model`` is a model directory or name vLLM can load offline. With ``ledger_url`` the plugin's
    exporter also sends every event there as source ``source_id``. ``progress(phase)`` is called after
    each :class:`Phase`.
    """
    plan.check()
    name = served_model_name or os.path.basename(os.path.normpath(model)) or model
    # The vLLM side, loaded only to run: the command line and ledger.advice.scene profile in process.
    from engine_hooks.vllm.profile import DriverError, drive

    phases: list[Phase] = []

    def on_phase(chunk: int, decodes: int, first: int, end: int, wall_s: float) -> None:
        phases.append(Phase(chunk, decodes, first, end, wall_s))
        if progress is not None:
            progress(phases[-1])

    try:
        run = drive(
            model,
            plan,
            name=name,
            recorder=StepRecorder,
            on_phase=on_phase,
            ledger_url=ledger_url,
            source_id=source_id,
            ingest_token=ingest_token,
            kv_cache_bytes=kv_cache_bytes,
            engine_kwargs=engine_kwargs,
        )
    except DriverError as exc:
        raise ProfileError(str(exc)) from exc.__cause__
    return ProfileResult(
        plan=plan, model=name, steps=run.steps, phases=phases, source_id=run.source_id, sent=run.sent
    )

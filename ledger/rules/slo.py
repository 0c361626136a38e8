"""The SLO watch: per model, p99 TTFT and mean ITL of finished requests against the policy's targets."""

from __future__ import annotations

from collections import deque
from typing import Any

from ledger.alerts import SloBreachAlert, SloMetric, SloState


def itl_of(row: dict[str, object]) -> float | None:
    """Mean inter-token latency of a request: decode time over the gaps between its output tokens."""
    decode, n = row.get("decode_s"), row.get("output_tokens")
    if isinstance(decode, (int, float)) and isinstance(n, int) and n > 1 and decode >= 0:
        return float(decode) / (n - 1)
    return None


class SloMonitor:
    """Per model, p99 TTFT and mean-ITL over a sliding window of finished requests, with hysteresis.

    Fires when the p99 exceeds the target (with at least ``min_samples`` requests in the window) and
    resolves only when it drops below ``target * clear_ratio``: a p99 hovering at the target does not
    flap.
    """

    def __init__(self) -> None:
        self.samples: dict[str, deque[tuple[float, float | None, float | None]]] = {}
        self.firing: set[tuple[str, str]] = set()

    def add(self, model: str, now: float, ttft: float | None, itl: float | None) -> None:
        dq = self.samples.get(model)
        if dq is None:
            dq = self.samples[model] = deque(maxlen=50_000)
        dq.append((now, ttft, itl))

    def check(self, policy: Any, now: float) -> list[SloBreachAlert]:
        alerts = policy.alerts
        out = []
        metric: SloMetric
        for model, dq in self.samples.items():
            while dq and dq[0][0] < now - alerts.slo_window_s:
                dq.popleft()
            slo = policy.slo_for(model)
            for metric, target, idx in (("ttft", slo.ttft_p99_s, 1), ("itl", slo.itl_p99_s, 2)):
                key = (model, metric)
                if target is None:
                    self.firing.discard(key)
                    continue
                values = sorted(x for v in dq if (x := v[idx]) is not None)
                if len(values) < alerts.slo_min_samples:
                    continue
                p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
                state: SloState | None = None
                if key not in self.firing and p99 > target:
                    self.firing.add(key)
                    state = "firing"
                elif key in self.firing and p99 < target * alerts.slo_clear_ratio:
                    self.firing.discard(key)
                    state = "resolved"
                if state is not None:
                    out.append(
                        SloBreachAlert(
                            model=model,
                            metric=metric,
                            state=state,
                            p99_s=p99,
                            target_s=target,
                            samples=len(values),
                            window_s=alerts.slo_window_s,
                        )
                    )
        return out

"""The plugin's admission reserve as a per-step chunk cap (``Policies._cl_admission_cap``).

With a reserve share r > 0, running prefill chunks leave ``min(r x budget, demand)`` of the token
budget to the other requests that can run in the step. ``demand`` is walked in vLLM's order: the
running requests' next tokens (a decode's 1, another prefill's remaining prompt), then the waiting
requests, in the queue's order, while a running slot is free, the walk has not gathered
``budget + r x budget`` tokens, and their first chunk fits the free KV left after the running
requests' allocations (stopping at the first that does not). The largest prefill among them is the
one the cap is for and is not counted. The cap is then ``budget - demand``, but never below 64 tokens
(the plugin's ``admission_min_chunk``) nor below a short prompt (at most half the budget) that runs
whole in the step. It is applied as vLLM's ``long_prefill_token_threshold`` (the smaller of the two
when both are set), so it caps every prefill chunk of the step.

Not modelled: the plugin's depth cap, step-time target and arrivals-first options.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

MIN_CHUNK = 64  # the plugin's admission_min_chunk default


def admission_cap(
    budget: int,
    share: float,
    free_tokens: int,
    slots: int,
    run_need: np.ndarray,
    run_prefill: np.ndarray,
    waiting_need: Iterable[int],
) -> int | None:
    """This step's chunk cap, None for none.

    ``run_need``: the running requests' remaining tokens (running order); ``run_prefill``: which of
    them are in a chunked prefill (vLLM's ``is_prefill_chunk``); ``waiting_need``: the waiting
    requests' tokens (prompt plus output so far), in admission order; ``free_tokens``: free KV blocks
    x block size; ``slots``: free running slots.
    """
    most = int(budget * share)
    n = len(run_need)
    big, big_at = -1, -1
    if n and np.count_nonzero(run_prefill):
        masked = np.where(run_prefill, run_need, -1)
        big_at = int(masked.argmax())  # the first of the largest, as the plugin's strict ">"
        big = int(masked[big_at])
    extra: list[int] = []
    if slots > 0:
        free = free_tokens - min(int(run_need.sum()) if n else 0, budget)
        room = budget + most
        for need in waiting_need:
            if slots <= 0 or room <= 0:
                break
            chunk = min(need, budget)
            if chunk > free:
                break
            free -= chunk
            slots -= 1
            room -= chunk
            if need > big:
                big, big_at = need, n + len(extra)
            extra.append(need)
    if extra:
        needs = np.concatenate((run_need, np.asarray(extra, dtype=np.int64)))
        prefill = np.concatenate((run_prefill, np.ones(len(extra), dtype=bool)))
    else:
        needs, prefill = run_need, run_prefill
    if big_at >= 0:
        needs = np.delete(needs, big_at)
        prefill = np.delete(prefill, big_at)
    if not len(needs):
        return None
    cum = np.cumsum(needs)
    reach = int(np.searchsorted(cum, most, side="left"))  # the first item that brings demand to most
    if reach < len(cum):
        demand, upto = most, reach + 1
    else:
        demand, upto = int(cum[-1]), len(cum)
    if demand <= 0:
        return None
    head = needs[:upto]
    short = head[prefill[:upto] & (head <= budget // 2)]
    whole = int(short.max()) if len(short) else 0
    return max(MIN_CHUNK, budget - demand, whole)


__all__ = ["MIN_CHUNK", "admission_cap"]

"""Replay a recorded run (``tools/record_vllm_run.py``) into a ledger through ``POST /v1/events``.

The recording is gzip JSON lines, one event batch per line exactly as the vLLM plugin and the gateway
POSTed it. Replaying shifts every timestamp (``ts`` and the ``*_ts`` fields) by one offset, so that the
run ends at ``end_at`` (the present, or some minutes ago: inside the dashboard's default window), and
posts the batches in their recorded order.

Cutoffs: the replay ledger decides them again from the same events (the loop rule on the runaway's
tokens, the preemption limit), under new command ids; a recorded ``cutoff_applied`` event carries the
recording ledger's id, so it is rewritten to the id the replay ledger gave the same (request, rule),
taken from the commands in its answers (or from ``GET /v1/cutoffs``). The decisions then read
"applied", as they did in the recording.
"""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path
from typing import Any

import httpx

DATA = Path(__file__).resolve().parent / "data"
VLLM_RUN = DATA / "vllm_run.jsonl.gz"


def load(path: Path = VLLM_RUN) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def time_span(batches: list[dict[str, Any]]) -> tuple[float, float]:
    ts = [e["ts"] for b in batches for e in b["events"]]
    return min(ts), max(ts)


def _shift(event: dict[str, Any], dt: float) -> dict[str, Any]:
    out = dict(event)
    for k, v in event.items():
        if (k == "ts" or k.endswith("_ts")) and isinstance(v, int | float) and not isinstance(v, bool):
            out[k] = v + dt
    return out


def replay(url: str, batches: list[dict[str, Any]], end_at: float) -> dict[str, Any]:
    """Post ``batches`` to the ledger at ``url`` with the run moved to end at ``end_at`` (unix s)."""
    _, last = time_span(batches)
    dt = end_at - last
    ids: dict[tuple[str, str], str] = {}
    accepted = rewritten = 0
    with httpx.Client(base_url=url, timeout=60) as client:

        def command_id(request_id: str, rule: str) -> str | None:
            if (request_id, rule) not in ids:
                rows = client.get("/v1/cutoffs", params={"request_id": request_id}).json()["cutoffs"]
                for c in rows:
                    ids.setdefault((c["request_id"], c["rule"]), c["command_id"])
            return ids.get((request_id, rule))

        for batch in batches:
            body = copy.deepcopy(batch)
            body["events"] = [_shift(e, dt) for e in batch["events"]]
            for e in body["events"]:
                if e.get("kind") == "cutoff_applied":
                    new = command_id(e["request_id"], e["rule"])
                    if new is not None and new != e["command_id"]:
                        e["command_id"] = new
                        rewritten += 1
            r = client.post("/v1/events", json=body)
            r.raise_for_status()
            answer = r.json()
            accepted += answer["accepted"]
            for c in answer.get("commands", []):
                ids.setdefault((c["request_id"], c["rule"]), c["id"])
    return {"batches": len(batches), "accepted": accepted, "shift_s": dt, "rewritten": rewritten}

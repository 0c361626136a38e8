"""What a run of ``chunkledger profile``'s plan leaves: the recorded steps, the phases they fall into,
and what was delivered to a ledger.

The vLLM driver (:mod:`engine_hooks.vllm.profile`) returns a :class:`ProfileRun`; the ledger
(:mod:`ledger.advice.profile`) makes its tables and fit from it. Both import these classes from here, the
one place they are defined: the ledger may not import the vLLM plugin, and this module imports only the
event contract and msgspec.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from engine_hooks import events as ev


@dataclass
class Phase:
    """One run of a plan's cell: a long prompt chunked by ``chunk`` next to ``decodes`` decoding requests,
    recorded as steps ``first_step:end_step`` of the run's."""

    chunk: int
    decodes: int
    first_step: int  # index into ProfileRun.steps
    end_step: int
    wall_s: float


class Delivery(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What the plugin's exporter delivered to a ledger during the run (after its shutdown)."""

    url: str  # the ledger's
    source_id: str  # the source the events were sent as
    sent: int  # events the ledger acknowledged
    dropped: dict[str, int]  # events dropped, by reason (empty: none)


@dataclass
class ProfileRun:
    """What a run of the plan left: the recorded steps, the phases they fall into, where they were sent."""

    model: str  # the served model name
    steps: list[ev.Step]
    phases: list[Phase]
    source_id: str | None = None  # the plugin exporter's source id, with a ledger URL
    sent: Delivery | None = None  # with a ledger URL


__all__ = ["Delivery", "Phase", "ProfileRun"]

"""Commands from the ledger (``abort``, ``non_preemptible``, ``slow_pool``, ``promote``), applied inside
the engine.

They arrive on the exporter's worker thread (:meth:`Commands.submit_command`, the exporter's
``on_command``), are queued, and are applied on the engine thread at the start of the next
``schedule()``; each applied command is confirmed with a ``cutoff_applied`` event, once per command
id. A command for a request this engine does not know (yet) is kept for a minute, and applied if the
request arrives. An abort frees the request's KV (``finish_requests``) and sends the client an output
with ``finish_reason=abort`` and ``stop_reason="chunkledger:<rule>"``. The marks (``non_preemptible``,
``slow_pool``, ``promote``) are acted on by :mod:`.policies`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

from engine_hooks.events import Command
from engine_hooks.vllm import compat
from engine_hooks.vllm.state import HookState

_APPLIED_MEMORY = 4096  # command ids remembered for idempotency
_UNMATCHED_TTL_S = 60.0  # how long a command for a request not (yet) in this engine is kept


class Commands(HookState):
    """The commands, a mixin of the scheduler classes (their state lives on the scheduler)."""

    _cl_unmatched: dict[str, list[tuple[float, Command]]]  # external id -> (received, command)
    _cl_applied: OrderedDict[str, None]  # ids of the commands applied, oldest first
    _cl_abort_outputs: list[tuple[int, Any]]  # (client index, EngineCoreOutput) not yet sent

    def _cl_init_commands(self) -> None:
        self._cl_inbox = deque()
        self._cl_unmatched = {}
        self._cl_applied = OrderedDict()
        self._cl_abort_outputs = []
        self._cl_marked = 0
        self._cl_protected = 0

    def submit_command(self, command: Command) -> None:
        """Queue a ledger command; applied at the next ``schedule()``. Safe from any thread."""
        self._cl_inbox.append(command)

    def _cl_take_commands(self, now: float, ts: float) -> None:
        """Before ``schedule()``: apply the commands received, and now and then forget old unmatched
        ones."""
        if self._cl_inbox:
            self._cl_apply_commands(now, ts)
        if self._cl_unmatched and self._cl_step % 256 == 0:
            self._cl_expire_unmatched(now)

    def _cl_release_parked(self, ext: str) -> None:
        """A request keyed ``ext`` arrived: the commands kept for it are applied at the next step."""
        parked = self._cl_unmatched.pop(ext, None)
        if parked:
            self._cl_inbox.extendleft(cmd for _, cmd in reversed(parked))

    def _cl_apply_commands(self, now: float, ts: float) -> None:
        inbox = self._cl_inbox
        while inbox:
            command = inbox.popleft()
            if command.id in self._cl_applied:
                continue
            targets = [
                rid
                for rid in self._cl_by_ext.get(command.request_id, ())
                if (req := self.requests.get(rid)) is not None and not req.is_finished()
            ]
            if not targets:
                parked = self._cl_unmatched.setdefault(command.request_id, [])
                if len(parked) < 16 and len(self._cl_unmatched) < 1024:
                    parked.append((now, command))
                continue
            self._cl_applied[command.id] = None
            if len(self._cl_applied) > _APPLIED_MEMORY:
                self._cl_applied.popitem(last=False)
            self._e_cutoff(ts, command.request_id, command.id, command.action, command.rule)
            for rid in targets:
                self._cl_apply(rid, command)

    def _cl_apply(self, rid: str, command: Command) -> None:
        st = self._cl_states.get(rid)
        if st is None:
            return
        action = command.action
        if action == "abort":
            request = self.requests[rid]
            reason = f"chunkledger:{command.rule}"
            st.cutoff = reason
            client = request.client_index
            self.finish_requests([rid], compat.ABORTED)
            self._cl_abort_outputs.append((client, compat.abort_output(rid, reason)))
        elif action == "non_preemptible":
            if not st.non_preemptible:
                st.non_preemptible = True
                self._cl_protected += 1
        elif action in ("slow_pool", "promote"):
            was = st.slow or st.promoted
            st.slow, st.promoted = action == "slow_pool", action == "promote"
            if not was:
                self._cl_marked += 1

    def _cl_expire_unmatched(self, now: float) -> None:
        for ext in list(self._cl_unmatched):
            kept = [(t, c) for t, c in self._cl_unmatched[ext] if now - t < _UNMATCHED_TTL_S]
            if kept:
                self._cl_unmatched[ext] = kept
            else:
                del self._cl_unmatched[ext]

    def _cl_deliver_aborts(self, outputs: dict[int, Any]) -> None:
        """After ``update_from_output()``: the aborted requests' outputs go to their front ends."""
        compat.add_outputs(outputs, self._cl_abort_outputs)
        self._cl_abort_outputs = []


__all__ = ["Commands"]

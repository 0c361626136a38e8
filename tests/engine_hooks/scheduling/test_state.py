"""The scheduler's state as the simulator uses it: requests added as they come, their indices reused
once they end, and requests that end where they are (aborted while waiting or running)."""

from __future__ import annotations

import numpy as np
import pytest

from engine_hooks.scheduling.queues import FcfsQueue, PriorityQueue, ReserveQueue, WaitingQueue
from engine_hooks.scheduling.schedule import advance, schedule
from engine_hooks.scheduling.settings import EngineSettings
from engine_hooks.scheduling.state import SchedulerState


def run_step(st: SchedulerState) -> None:
    s = schedule(st)
    advance(st, s.idx, s.new, s.before, 0.0)


def test_requests_added_past_the_columns_grow_them() -> None:
    st = SchedulerState(EngineSettings(4096, 64, 1000))
    ids = [st.add(10 + k, 0, float(k), request_id=f"r{k}") for k in range(40)]
    assert ids == list(range(40)) and len(st.queue) == 40
    assert st.prompt[:40].tolist() == [10 + k for k in range(40)] and st.request_id[39] == "r39"
    run_step(st)
    assert sorted(st.run.tolist()) == ids and st.comp[:40].tolist() == st.prompt[:40].tolist()


def test_a_finished_requests_index_is_reused_clean() -> None:
    st = SchedulerState(EngineSettings(64, 8, 100))
    i = st.add(40, 0, 0.0)
    run_step(st)
    st.release(np.asarray([i]))
    assert st.used == 0 and not len(st.run)
    j = st.add(8, 0, 5.0, request_id="next")
    assert j == i
    assert (int(st.comp[j]), int(st.ntok[j]), int(st.preempts[j]), st.arrival_list[j]) == (0, 8, 0, 5.0)
    run_step(st)
    assert st.run.tolist() == [j] and st.used == 1


def test_an_aborted_request_leaves_the_queue_or_frees_its_kv() -> None:
    st = SchedulerState(EngineSettings(64, 1, 100))  # one running slot: b waits
    a, b = st.add(40, 0, 0.0), st.add(8, 0, 1.0)
    run_step(st)
    assert st.running(a) and not st.running(b) and st.used == 3
    st.abort(b)
    assert not len(st.queue) and st.used == 3
    st.abort(a)
    assert not len(st.run) and st.used == 0
    assert {st.add(8, 0, 2.0), st.add(8, 0, 3.0)} == {a, b}  # both indices free again


def _queues() -> dict[str, WaitingQueue]:
    prompt, arrival, priority, rid = [30, 10, 20], [0.0, 1.0, 2.0], [1, 0, 0], ["a", "b", "c"]
    return {
        "fcfs": FcfsQueue(),
        "priority": PriorityQueue(priority, arrival, rid),
        "reserve": ReserveQueue(prompt, arrival, aging_s=10.0),
    }


@pytest.mark.parametrize(
    ("name", "order"), [("fcfs", [0, 1, 2]), ("priority", [1, 2, 0]), ("reserve", [1, 2, 0])]
)
def test_each_waiting_queue_takes_a_request_out_and_keeps_the_others_order(name, order) -> None:
    q = _queues()[name]
    for i in range(3):
        q.add(i)
    assert list(q) == order
    q.remove(order[1])
    assert list(q) == [order[0], order[2]] and len(q) == 2
    q.add_preempted(order[1])  # a preempted one can be taken out too
    q.remove(order[1])
    assert list(q) == [order[0], order[2]]
    with pytest.raises(ValueError):
        q.remove(order[1])


def test_a_reused_index_ages_in_the_reserve_queue_from_its_new_arrival() -> None:
    prompt, arrival = [10], [0.0]
    q = ReserveQueue(prompt, arrival, aging_s=2.0)
    q.add(0)
    assert q.pop() == 0  # admitted; it finishes and its index goes to a request arriving at 100 s
    prompt[0], arrival[0] = 5, 100.0
    q.add(0)
    assert not q.would_change(5.0)  # not aged by the first request's arrival
    assert q.would_change(102.0)

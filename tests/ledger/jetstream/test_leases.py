"""Partition leases as PostgreSQL advisory locks: workers share the partitions evenly, and a worker
that leaves (or whose connection dies) frees its partitions for the others at once."""

from __future__ import annotations

from ledger.jetstream.leases import Leases


def test_two_workers_split_the_partitions_and_one_takes_them_all_when_the_other_leaves(pg_url):
    a = Leases(pg_url, "LEASETEST", 8)
    b = Leases(pg_url, "LEASETEST", 8)
    try:
        a.join()
        assert a.live_workers() == 1
        assert sorted(a.balance().taken) == list(range(8))
        b.join()
        assert a.live_workers() == 2 and a.share() == 4
        change = a.balance()
        assert len(change.released) == 4 and not change.taken
        a.release(change.released)
        assert sorted(b.balance().taken) == sorted(change.released)
        assert a.held.isdisjoint(b.held) and a.held | b.held == set(range(8))
        assert set(a.owners()) == set(range(8))
        b.close()  # as when its process dies: the connection ends, the locks go with it
        assert a.live_workers() == 1
        assert len(a.balance().taken) == 4 and a.held == set(range(8))
    finally:
        a.close()
        b.close()


def test_another_stream_in_the_same_database_has_leases_of_its_own(pg_url):
    a = Leases(pg_url, "LEASE_ONE", 4)
    b = Leases(pg_url, "LEASE_TWO", 4)
    try:
        a.join()
        b.join()
        assert a.live_workers() == 1 and b.live_workers() == 1
        assert len(a.balance().taken) == 4 and len(b.balance().taken) == 4
    finally:
        a.close()
        b.close()

"""The JetStream contract between exporters and ledger workers: the stream, its subjects, the headers.

An exporter with ``nats_url`` set publishes each batch (the body it would POST to ``/v1/events``: JSON or
the columnar message) to the stream (``STREAM`` unless named otherwise) under the subject
``<stream>.events.<partition>.<source>``; the ledger workers (``chunkledger serve`` with ``nats_url``)
share the partitions out among themselves, each consuming its partitions' subjects. A source's
partition is a hash of its id, so all of one source's batches, and with them each request's events and
its rule state, go to one worker (a request is served by one engine). The number of partitions is a
fact of the stream, written in its description by the worker that creates it (``describe``), and read
from there by the exporters (``partitions_of``): the two sides never disagree on it.

Each message carries ``Nats-Msg-Id`` (the source and a digest of the body: a batch published again
within the stream's duplicate window is stored once; the ledger's own idempotence covers the rest),
``Content-Type`` (which of the two bodies) and the source's producer key. Commands go the other way on
``<stream>.commands.<source>`` (core NATS: the owner re-sends them until the source confirms).

Imports only the standard library: the plugin's hot path loads none of NATS unless it is used.
"""

from __future__ import annotations

import hashlib
import re
import zlib

STREAM = "CHUNKLEDGER"
STREAM_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # a JetStream stream name, also the subjects' root
DEFAULT_PARTITIONS = 16
MAX_PARTITIONS = 1024
MSG_ID = "Nats-Msg-Id"
CONTENT_TYPE = "Content-Type"
_DESCRIPTION = re.compile(r"\bpartitions=(\d+)\b")


def partition_of(source_id: str, partitions: int) -> int:
    """The partition of a source: CRC-32 of its id, modulo the stream's partitions."""
    return zlib.crc32(source_id.encode()) % partitions


def token(source_id: str) -> str:
    """A source id as one subject token: source ids may hold ``.`` (a token separator in NATS), never
    ``~`` (``engine_hooks.config``), so the mapping is one to one."""
    return source_id.replace(".", "~")


def events_subjects(stream: str) -> str:
    """Every subject of the stream's events (the stream's own subjects)."""
    return f"{stream}.events.>"


def events_subject(stream: str, source_id: str, partitions: int) -> str:
    return f"{stream}.events.{partition_of(source_id, partitions)}.{token(source_id)}"


def partition_subjects(stream: str, partition: int) -> str:
    """The subjects of one partition (a consumer's filter)."""
    return f"{stream}.events.{partition}.>"


def commands_subject(stream: str, source_id: str) -> str:
    return f"{stream}.commands.{token(source_id)}"


def message_id(source_id: str, body: bytes) -> str:
    """The message's id for JetStream's de-duplication: the same body from the same source is one."""
    return f"{source_id}:{hashlib.blake2b(body, digest_size=16).hexdigest()}"


def describe(partitions: int) -> str:
    """The stream's description, which carries its number of partitions."""
    return f"chunkledger events, partitions={partitions}"


def partitions_of(description: str | None) -> int | None:
    """The number of partitions a stream's description names (None: not a chunkledger stream's)."""
    found = _DESCRIPTION.search(description or "")
    if found is None:
        return None
    n = int(found.group(1))
    return n if 1 <= n <= MAX_PARTITIONS else None

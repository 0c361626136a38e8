"""The loop-detector corpus: legitimate repetition that must not be cut, and degenerate loops that must be.

Everything is built deterministically (fixed seeds) from the texts below and tokenised with a simple
word-level tokenizer (a word with its leading space is one token, as in BPE vocabularies; punctuation
and newlines are tokens of their own; ids are CRC-32 of the token text), so the test, the bench and the
defaults in ``ledger.rules.policy`` all measure the same thing.

Legitimate samples (``legit_corpus``): markdown tables (also feature matrices full of the same mark and
wide separator rows), code with repeated and near-repeated lines, closing braces, enumerations, JSON
arrays of zeros, of repeated flags and of records, small matrices, CSV, log lines, prose. Degenerate
samples (``loop_corpus``): a legitimate prefix, then a block of 1..K tokens cut from real-looking text
repeated far past any legitimate length; ``onset`` is the index of the block's first token.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass

_TOKEN = re.compile(r"\n| ?\w+| ?[^\w\s]| +")


def tokenize(text: str) -> list[int]:
    """Word-level token ids: stable across runs and machines."""
    return [zlib.crc32(t.encode()) & 0x7FFFFFFF for t in _TOKEN.findall(text)]


@dataclass(frozen=True)
class Sample:
    id: str
    tokens: list[int]
    onset: int | None = None  # degenerate samples: index of the loop's first token
    period: int | None = None  # degenerate samples: tokens per repeat


_WORDS = [
    "latency",
    "throughput",
    "request",
    "prefill",
    "decode",
    "batch",
    "token",
    "scheduler",
    "cache",
    "block",
    "queue",
    "model",
    "engine",
    "gateway",
    "replica",
    "budget",
    "chunk",
    "depth",
    "window",
    "policy",
    "source",
    "ledger",
    "metric",
    "alert",
    "timeout",
    "stall",
    "preemption",
    "admission",
    "backend",
    "region",
    "tenant",
    "shard",
    "version",
    "build",
    "deploy",
    "rollback",
    "config",
    "cluster",
    "node",
    "memory",
    "kernel",
    "thread",
    "socket",
    "buffer",
    "stream",
    "record",
    "column",
    "index",
    "value",
    "status",
    "owner",
    "team",
]
_NAMES = [
    "Alice",
    "Bob",
    "Carol",
    "Dave",
    "Erin",
    "Frank",
    "Grace",
    "Heidi",
    "Ivan",
    "Judy",
    "Mallory",
    "Niaj",
    "Olivia",
    "Peggy",
    "Rupert",
    "Sybil",
]
_CITIES = [
    "Berlin",
    "Lisbon",
    "Osaka",
    "Nairobi",
    "Quito",
    "Oslo",
    "Austin",
    "Lyon",
    "Porto",
    "Seoul",
    "Lima",
    "Perth",
    "Cork",
    "Turin",
]

_PROSE = """Chunked prefill splits a long prompt into pieces that fit the step's token budget, so decodes of
running requests keep their pace while the long prompt is computed. The price is paid by the long
request itself, and by arrivals that wait behind it when the scheduler serves running requests first.
To see why a request was slow, the ledger records when it arrived, when it was admitted, when it was
first scheduled, and every step it sat out while holding memory. Operators then compare the layers:
entry, admission, backend wait and the batch itself. In practice most of the tail comes from waiting,
not from computing, and the fix is a scheduling setting rather than a faster kernel."""

_CODE_PY = '''class RingBuffer:
    """A fixed-size buffer that overwrites its oldest entries."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items = [None] * size
        self.start = 0
        self.count = 0

    def push(self, item):
        self.items[(self.start + self.count) % self.size] = item
        if self.count < self.size:
            self.count += 1
        else:
            self.start = (self.start + 1) % self.size


def test_ring_buffer_overwrites():
    buf = RingBuffer(3)
    buf.push(1)
    buf.push(2)
    buf.push(3)
    buf.push(4)
    assert buf.count == 3
    assert buf.count == 3
    assert buf.items == [4, 2, 3]
'''

_CODE_C = """static int parse(const char *s, struct config *cfg) {
    for (int i = 0; s[i]; i++) {
        if (s[i] == '#') {
            while (s[i] && s[i] != '\\n') {
                if (s[i] == '\\\\') {
                    i++;
                }
                i++;
            }
        }
    }
    return 0;
}
"""

_LOG = """2026-11-30T10:00:01Z INFO scheduler step=1201 running=31 waiting=4 kv_usage=0.71
2026-11-30T10:00:01Z INFO scheduler step=1202 running=31 waiting=4 kv_usage=0.71
2026-11-30T10:00:01Z INFO scheduler step=1203 running=32 waiting=3 kv_usage=0.72
2026-11-30T10:00:02Z WARN scheduler preempted request=abc123 reason=kv_pressure
2026-11-30T10:00:02Z INFO scheduler step=1204 running=31 waiting=4 kv_usage=0.69
"""


def _table(rng: random.Random, rows: int, cols: int) -> str:
    head = "| " + " | ".join(rng.choice(_WORDS).title() for _ in range(cols)) + " |"
    sep = "|" + "|".join("---" for _ in range(cols)) + "|"
    body = [
        "| " + " | ".join(str(rng.randint(0, 999)) if c else rng.choice(_NAMES) for c in range(cols)) + " |"
        for _ in range(rows)
    ]
    return "\n".join([head, sep, *body])


def _feature_matrix(rng: random.Random, rows: int, cols: int) -> str:
    head = "| feature | " + " | ".join(f"v{i}" for i in range(cols)) + " |"
    sep = "|---" * (cols + 1) + "|"
    body = []
    for _ in range(rows):
        marks = ["✓" if rng.random() < 0.85 else "✗" for _ in range(cols)]
        body.append(f"| {rng.choice(_WORDS)} {rng.choice(_WORDS)} | " + " | ".join(marks) + " |")
    return "\n".join([head, sep, *body])


def _enumeration(rng: random.Random, n: int) -> str:
    return "\n".join(
        f"{i}. {rng.choice(_WORDS).title()} {rng.choice(_WORDS)} in {rng.choice(_CITIES)}"
        for i in range(1, n + 1)
    )


def _bullets(rng: random.Random, n: int) -> str:
    return "\n".join(f"- [ ] check the {rng.choice(_WORDS)} {rng.choice(_WORDS)}" for _ in range(n))


def _json_zeros(n: int) -> str:
    return '{"counts": [' + ", ".join("0" for _ in range(n)) + '], "total": 0}'


def _json_flags(rng: random.Random, n: int) -> str:
    return "[" + ", ".join("true" if rng.random() < 0.9 else "false" for _ in range(n)) + "]"


def _json_records(rng: random.Random, n: int) -> str:
    recs = [
        f'  {{"id": {i}, "name": "{rng.choice(_NAMES)}", "city": "{rng.choice(_CITIES)}", "active": true}}'
        for i in range(n)
    ]
    return "[\n" + ",\n".join(recs) + "\n]"


def _matrix(n: int, identity: bool) -> str:
    rows = ["[" + ", ".join("1" if identity and i == j else "0" for j in range(n)) + "]" for i in range(n)]
    return "[" + ",\n ".join(rows) + "]"


def _csv(rng: random.Random, n: int) -> str:
    lines = ["date,region,requests,errors"]
    lines += [f"2026-11-{1 + i % 30:02d},{rng.choice(_CITIES)},{rng.randint(100, 9999)},0" for i in range(n)]
    return "\n".join(lines)


def _repeated_lines(rng: random.Random, line: str, n: int) -> str:
    return "def setup():\n" + "".join(f"    {line}\n" for _ in range(n)) + "    return state\n"


def _closing(depth: int) -> str:
    opening = "".join("    " * d + f"if (x{d}) {{\n" for d in range(depth))
    closing = "".join("    " * d + "}\n" for d in reversed(range(depth)))
    return opening + "    " * depth + "run();\n" + closing


def _dashes(n: int) -> str:
    return "Results\n" + "- " * n + "\nAll " + "good " * 3 + "!"


def legit_corpus() -> list[Sample]:
    """Outputs with legitimate repetition (none must be flagged)."""
    rng = random.Random(20261201)
    texts: list[tuple[str, str]] = [
        ("prose", _PROSE),
        ("code-py", _CODE_PY),
        ("code-c", _CODE_C),
        ("log", _LOG),
    ]
    for i, (rows, cols) in enumerate([(10, 4), (30, 6), (60, 8), (20, 12), (40, 16)]):
        texts.append((f"table-{i}", _table(rng, rows, cols)))
    for i, (rows, cols) in enumerate([(12, 6), (25, 10), (15, 20), (40, 8)]):
        texts.append((f"feature-matrix-{i}", _feature_matrix(rng, rows, cols)))
    for i, n in enumerate([10, 50, 120]):
        texts.append((f"enumeration-{i}", _enumeration(rng, n)))
    texts.append(("bullets", _bullets(rng, 40)))
    for n in (8, 16, 24, 32):
        texts.append((f"json-zeros-{n}", _json_zeros(n)))
    for i, n in enumerate([16, 40]):
        texts.append((f"json-flags-{i}", _json_flags(rng, n)))
    texts.append(("json-records", _json_records(rng, 30)))
    for n in (4, 6, 8):
        texts.append((f"identity-{n}", _matrix(n, True)))
    texts.append(("zeros-4x4", _matrix(4, False)))
    texts.append(("csv", _csv(rng, 60)))
    for i, (line, n) in enumerate([("state.append(None)", 6), ("x += 1", 8), ("print()", 5), ("pass", 4)]):
        texts.append((f"repeated-lines-{i}", _repeated_lines(rng, line, n)))
    for depth in (4, 8):
        texts.append((f"closing-braces-{depth}", _closing(depth)))
    texts.append(("dashes", _dashes(24)))
    samples = [
        Sample(id=f"legit-{name}", tokens=tokenize(f"{_PROSE[:200]}\n\n{text}\n\nThat is all."))
        for name, text in texts
    ]
    return samples


def loop_corpus(max_period: int = 64, per_period: int = 3, loop_tokens: int = 1500) -> list[Sample]:
    """Degenerate outputs: a legitimate prefix, then a block of ``p`` tokens repeated (p = 1..max_period)."""
    rng = random.Random(7)
    pool = [t for s in legit_corpus() for t in [s.tokens]]
    prose = tokenize(_PROSE + "\n" + _CODE_PY + "\n" + _LOG)
    out = []
    for p in range(1, max_period + 1):
        for k in range(per_period):
            prefix = rng.choice(pool)[: rng.randint(20, 300)]
            start = rng.randrange(0, len(prose) - p)
            block = prose[start : start + p]
            reps = max(loop_tokens // p, 12)
            out.append(
                Sample(
                    id=f"loop-p{p}-{k}",
                    tokens=prefix + block * reps,
                    onset=len(prefix),
                    period=p,
                )
            )
    return out

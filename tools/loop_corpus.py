"""The loop-detector corpus: legitimate repetition that must not be cut, and degenerate loops that must be.

Everything is built deterministically (fixed seeds) from the texts below and tokenised with a simple
word-level tokenizer (a word with its leading space is one token, as in BPE vocabularies; punctuation
and newlines are tokens of their own; ids are CRC-32 of the token text), so the test, the bench and the
defaults in ``ledger.rules.policy`` all measure the same thing.

Legitimate samples (``legit_corpus``, 300): markdown tables (also feature matrices full of the same mark
and wide separator rows), code with repeated and near-repeated lines and blocks, closing braces,
numbered lists, checklists, JSON arrays of zeros, of repeated flags and of records, small matrices, CSV,
log lines, songs with refrains, separators and banners, emphatic repetition ("no, no, no"), a code block
shown twice with one change, and prose; short and long (up to about 2,500 tokens).

Degenerate samples (``loop_corpus``, 400): a legitimate prefix (0 to about 3,000 tokens), then a block of
``p`` tokens cut from real-looking text repeated far past any legitimate length; ``onset`` is the index
of the block's first token. Periods are log-uniform over 1..512 (40 per octave: 1, 2-3, 4-7, ...,
256-511, and 512), as degenerate loops in the wild are mostly short (a token, a phrase) and sometimes a
sentence or a paragraph. Every fourth loop drifts: now and then one repeat carries an extra token.
``near_loop_corpus``: the same block repeated with one token changed per repeat (a counter).
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

# A run of one punctuation mark is one token of up to 16 marks, as BPE vocabularies merge "----" or "====".
_TOKEN = re.compile(r"\n| ?\w+| ?([^\w\s])\1{1,15}| ?[^\w\s]| +")


def tokenize(text: str) -> list[int]:
    """Word-level token ids: stable across runs and machines."""
    return [zlib.crc32(m.group().encode()) & 0x7FFFFFFF for m in _TOKEN.finditer(text)]


@dataclass(frozen=True)
class Sample:
    id: str
    tokens: list[int]
    onset: int | None = None  # degenerate samples: index of the loop's first token
    period: int | None = None  # degenerate samples: tokens per repeat (the base period when it drifts)
    kind: str = "legit"  # legit | exact | drift (the period grows by one now and then) | near


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


_SENTENCES = [
    s.strip() + "."
    for s in (
        _PROSE.replace("\n", " ")
        + " The gateway admits a request when the backend has room, and otherwise holds it in a queue."
        + " A preempted request gives its memory back and is computed again when it is resumed."
        + " Every step is recorded with its duration, the tokens it computed and the requests it served."
        + " Alerts are sent as signed webhooks, and every cutoff names the rule that decided it."
        + " The advice compares the inter-token latency target with the measured decode step."
        + " When the cache is full, the newest request is preempted first unless the policy says otherwise."
        + " Long prompts are split into chunks, and each chunk takes part of the step's token budget."
        + " A runaway request is cut back inside the engine, and the client sees why it ended."
    ).split(".")
    if s.strip()
]


def _prose(rng: random.Random, sentences: int) -> str:
    out: list[str] = []
    para: list[str] = []
    recent: list[str] = []
    for _ in range(sentences):
        s = rng.choice([x for x in _SENTENCES if x not in recent])
        recent = [*recent[-7:], s]  # prose does not say the same sentence twice in a row
        para.append(s)
        if len(para) >= rng.randint(3, 6):
            out.append(" ".join(para))
            para = []
    out.append(" ".join(para))
    return "\n\n".join(x for x in out if x)


def _song(rng: random.Random, verses: int) -> str:
    chorus = (
        "Oh the queue is long tonight, and the tokens flow like rain,\n"
        "we will wait until the light, and then we start again."
    )
    parts, lines = [], rng.sample(_SENTENCES, 2 * verses)
    for v in range(verses):
        parts.append(f"Verse {v + 1}:\n" + "\n".join(lines[2 * v : 2 * v + 2]))
        parts.append("Chorus:\n" + chorus)
    return "\n\n".join(parts)


def _banner(rng: random.Random, width: int) -> str:
    line = rng.choice("=-*#~") * width
    return f"{line}\n  {rng.choice(_WORDS).upper()} REPORT\n{line}\n" + rng.choice(_SENTENCES)


def _emphasis(rng: random.Random) -> str:
    word = rng.choice(["no", "very", "ha", "go", "yes", "more"])
    n = rng.randint(3, 8)
    return (
        f"{rng.choice(_SENTENCES)} {', '.join([word.title()] + [word] * (n - 1))}! {rng.choice(_SENTENCES)}"
    )


def _setters(rng: random.Random, n: int) -> str:
    names = rng.sample(_WORDS, n)
    return (
        "    def __init__(self, "
        + ", ".join(names)
        + "):\n"
        + "".join(f"        self.{x} = {x}\n" for x in names)
    )


def _near_blocks(rng: random.Random, n: int) -> str:
    """Test functions that differ in a name and a value: boilerplate, not a loop."""
    out = []
    for _ in range(n):
        w, v = rng.choice(_WORDS), rng.randint(0, 99)
        out.append(
            f"def test_{w}_{v}():\n    cfg = Config({w}={v})\n"
            f"    result = run(cfg)\n    assert result.{w} == {v}\n"
        )
    return "\n".join(out)


def _shown_twice(rng: random.Random) -> str:
    before = _CODE_C
    after = _CODE_C.replace("return 0;", "return -1;")
    return f"Before:\n```c\n{before}```\nAfter the fix:\n```c\n{after}```\n{rng.choice(_SENTENCES)}"


def _switch(rng: random.Random, n: int) -> str:
    cases = "".join(
        f"    case {i}:\n        handle_{rng.choice(_WORDS)}(ctx);\n        break;\n" for i in range(n)
    )
    return "switch (kind) {\n" + cases + "    default:\n        break;\n}\n"


def _numbered(rng: random.Random, n: int) -> str:
    verb = rng.choice(["Check", "Restart", "Drain", "Measure"])
    return "\n".join(
        f"{i}. {verb} the {rng.choice(_WORDS)} on node {rng.randint(1, 64)}" for i in range(1, n + 1)
    )


def _zero_matrix(rng: random.Random, n: int) -> str:
    return (
        "["
        + ",\n ".join("[" + ", ".join("0" for _ in range(n)) + "]" for _ in range(rng.randint(2, 3)))
        + "]"
    )


def _log(rng: random.Random, n: int) -> str:
    lines = []
    for k in range(n):
        lines.append(
            f"2026-11-30T10:{k // 60:02d}:{k % 60:02d}Z INFO scheduler step={1200 + k} "
            f"running={rng.randint(28, 34)} waiting={rng.randint(0, 6)} kv_usage=0.{rng.randint(60, 80)}"
        )
    return "\n".join(lines)


_KINDS = (
    ("prose", lambda r: _prose(r, r.randint(3, 40))),
    ("table", lambda r: _table(r, r.randint(5, 60), r.randint(3, 16))),
    ("feature-matrix", lambda r: _feature_matrix(r, r.randint(8, 40), r.randint(4, 20))),
    ("enumeration", lambda r: _enumeration(r, r.randint(5, 120))),
    ("numbered", lambda r: _numbered(r, r.randint(5, 60))),
    ("bullets", lambda r: _bullets(r, r.randint(5, 50))),
    ("json-zeros", lambda r: _json_zeros(r.randint(4, 32))),
    ("json-flags", lambda r: _json_flags(r, r.randint(8, 48))),
    ("json-records", lambda r: _json_records(r, r.randint(5, 40))),
    # an n x n zero matrix repeats its row n times: past 4 x 4 no token-level rule can tell it from a
    # loop (nor can vLLM's), so the corpus holds identities up to 8 x 8 and zero matrices up to 4 x 4
    (
        "matrix",
        lambda r: _matrix(r.randint(3, 8), True) if r.random() < 0.7 else _matrix(r.randint(2, 4), False),
    ),
    ("zero-matrix", lambda r: _zero_matrix(r, r.randint(3, 8))),
    ("csv", lambda r: _csv(r, r.randint(10, 80))),
    ("log", lambda r: _log(r, r.randint(5, 40))),
    (
        "repeated-lines",
        lambda r: _repeated_lines(
            r, r.choice(["state.append(None)", "x += 1", "print()", "pass"]), r.randint(3, 8)
        ),
    ),
    ("closing-braces", lambda r: _closing(r.randint(3, 10))),
    ("dashes", lambda r: _dashes(r.randint(8, 40))),
    ("song", lambda r: _song(r, r.randint(2, 5))),
    ("banner", lambda r: _banner(r, r.randint(20, 80))),
    ("emphasis", _emphasis),
    ("setters", lambda r: _setters(r, r.randint(3, 12))),
    ("near-blocks", lambda r: _near_blocks(r, r.randint(2, 8))),
    ("shown-twice", _shown_twice),
    ("switch", lambda r: _switch(r, r.randint(3, 12))),
    ("code", lambda r: r.choice([_CODE_PY, _CODE_C])),
)


# Rows or lines that differ from the one before in a single token: to a token-level rule, the same shape
# as a counter loop ("Item 7 is red. Item 8 is red."), told apart only by how long they go on.
_VALUES = ["yes", "no", "ok", "0", "n/a", "true", "read", "none", "TBD", "enabled"]


def _one_cell_table(rng: random.Random, rows: int, cols: int) -> str:
    """A table whose rows share every cell but the first (users with the same permissions)."""
    keys = rng.sample(_NAMES + _CITIES + _WORDS, rows)
    cells = [rng.choice(_VALUES) for _ in range(cols)]
    head = "| name | " + " | ".join(rng.choice(_WORDS) for _ in range(cols)) + " |"
    sep = "|---" * (cols + 1) + "|"
    body = [f"| {k} | " + " | ".join(cells) + " |" for k in keys]
    return "\n".join([head, sep, *body])


def _constant_csv(rng: random.Random, days: int) -> str:
    """A CSV of daily counts that never moved: only the date changes (its day, one token)."""
    value = rng.choice(["0", "0,0", "100", "1,ok"])
    month = rng.randint(1, 12)
    return "date,errors\n" + "\n".join(f"2026-{month:02d}-{d:02d},{value}" for d in range(1, days + 1))


def _heartbeat_log(rng: random.Random, lines: int) -> str:
    """Log lines the same but for their timestamp's seconds (a health check every second)."""
    msg = rng.choice(["INFO health check ok", "DEBUG heartbeat sent", "INFO 200 GET /healthz"])
    m, s0 = rng.randint(0, 59), rng.randint(0, 59 - min(lines, 59))
    return "\n".join(f"2026-11-30 10:{m:02d}:{s0 + k:02d} {msg}" for k in range(min(lines, 60)))


def _numbered_placeholders(rng: random.Random, n: int) -> str:
    """A worksheet or form: the same line under an increasing number."""
    line = rng.choice(["Question {}: ________", "{}. TBD", "Step {}: (fill in)", "- [ ] Task {}"])
    return "\n".join(line.format(i) for i in range(1, n + 1))


def _unrolled(rng: random.Random, n: int) -> str:
    """Unrolled code: the same statement with its index going up."""
    stmt = rng.choice(["    buf[{}] = 0;", "    regs[{}] = None", "    assert out[{}] == expected"])
    return "def reset(buf):\n" + "\n".join(stmt.format(i) for i in range(n)) + "\n    return buf"


def _same_status_lines(rng: random.Random, n: int) -> str:
    """A status report of many hosts in the same state: only the host's name changes."""
    state = rng.choice(["is up", "responded in 2 ms", "has no pending updates", "OK"])
    hosts = rng.sample(_WORDS, min(n, len(_WORDS)))
    return "\n".join(f"{h}: {state}" for h in hosts)


_NEAR_KINDS = (
    ("one-cell-table", lambda r: _one_cell_table(r, r.randint(3, 30), r.randint(1, 8))),
    ("constant-csv", lambda r: _constant_csv(r, r.randint(7, 31))),
    ("heartbeat-log", lambda r: _heartbeat_log(r, r.randint(5, 30))),
    ("numbered-placeholders", lambda r: _numbered_placeholders(r, r.randint(5, 20))),
    ("unrolled", lambda r: _unrolled(r, r.randint(4, 16))),
    ("same-status", lambda r: _same_status_lines(r, r.randint(5, 30))),
)


def legit_corpus(per_kind: int = 12, kinds: tuple = _KINDS + _NEAR_KINDS) -> list[Sample]:
    """Outputs with legitimate repetition (none must be flagged): ``per_kind`` of each kind, some long."""
    rng = random.Random(20261201)
    samples = []
    for name, make in kinds:
        for k in range(per_kind):
            parts = [make(rng) for _ in range(1 if k % 3 else rng.randint(2, 4))]
            # several parts (some the same) are told apart by a sentence, as an answer would
            text = _prose(rng, rng.randint(1, 4))
            for part, said in zip(parts, rng.sample(_SENTENCES, len(parts)), strict=True):
                text += f"\n\n{said}\n\n{part}"
            text += "\n\nThat is all."
            samples.append(Sample(id=f"legit-{name}-{k}", tokens=tokenize(text)))
    return samples


def _loop_text(rng: random.Random) -> list[int]:
    return tokenize(_prose(rng, 200) + "\n" + _CODE_PY + "\n" + _LOG)


def loop_periods(per_octave: int = 40, max_period: int = 512) -> list[int]:
    """Log-uniform periods: ``per_octave`` in each of 1, 2-3, 4-7, ..., and ``max_period`` itself."""
    rng = random.Random(11)
    out = [1] * per_octave
    lo = 2
    while lo < max_period:
        hi = min(2 * lo, max_period)
        out += [rng.randrange(lo, hi) for _ in range(per_octave)]
        lo = hi
    out += [max_period] * (per_octave // 4 or 1)
    return out


def loop_corpus(per_octave: int = 40, max_period: int = 512, loop_tokens: int = 1500) -> list[Sample]:
    """Degenerate outputs: a legitimate prefix, then a block of ``p`` tokens repeated; every fourth drifts."""
    rng = random.Random(7)
    legit = legit_corpus(kinds=_KINDS)  # prefixes from the kinds it was first built with
    text = _loop_text(rng)
    out = []
    for k, p in enumerate(loop_periods(per_octave, max_period)):
        src = rng.choice(legit).tokens
        prefix = src[: int(2 ** rng.uniform(0, 11.5))]  # 1 to ~2,900 tokens of normal text
        start = rng.randrange(0, len(text) - p - 1)
        block = text[start : start + p]
        reps = max(loop_tokens // p, 6)
        drift = k % 4 == 3
        tail: list[int] = []
        for r in range(reps):
            if drift and r > 0 and rng.random() < min(0.3, p / 200):  # about one per 200 tokens
                j = rng.randrange(p)
                tail += block[: j + 1] + block[j:]  # one token doubled: this repeat is p + 1 long
            else:
                tail += block
        out.append(
            Sample(
                id=f"loop-p{p}-{k}",
                tokens=prefix + tail,
                onset=len(prefix),
                period=p,
                kind="drift" if drift else "exact",
            )
        )
    return out


_COUNTER_SHAPES = ("\nStep {i}: {body}", " Item {i} is {body}.", "\n{i}. {body}")


def near_loop_corpus(n: int = 120, loop_tokens: int = 1500) -> list[Sample]:
    """A block with a counter in it, repeated with the counter going up (one token changed per repeat):
    steps ("Step 7: ..."), items in a sentence ("Item 7 is red. Item 8 is red."; short blocks) and
    numbered lines, in turn."""
    rng = random.Random(13)
    out = []
    for k in range(n):
        words = [rng.choice(_SENTENCES) for _ in range(rng.randint(1, 4))]
        words = " ".join(words).split()
        shape = _COUNTER_SHAPES[k % 3]
        cut = rng.randint(2, len(words)) if k % 3 != 1 else rng.randint(1, 3)
        body = " ".join(words[:cut]).rstrip(".,")
        p = len(tokenize(shape.format(i=1, body=body)))
        reps = max(loop_tokens // p, 8)
        prefix = tokenize(_prose(rng, rng.randint(1, 8)))
        tail = tokenize("".join(shape.format(i=i, body=body) for i in range(1, reps + 1)))
        out.append(
            Sample(id=f"near-p{p}-{k}", tokens=prefix + tail, onset=len(prefix), period=p, kind="near")
        )
    return out


# Paraphrase loops: a reasoning model going over the same steps again and again, re-worded each time
# ("Wait, let me check that again: ..."). Each step has a few wordings; every round picks one per step,
# now and then skips a step or swaps two, and opens with a filler.
_STEPS = (
    (
        "the prompt has {a} tokens and the budget is {b}, so it needs {c} chunks",
        "with a budget of {b} tokens, a prompt of {a} tokens takes {c} chunks",
        "{a} tokens split by a budget of {b} gives {c} chunks",
    ),
    (
        "each chunk waits one step, so the first token comes after {c} steps",
        "so the first token is out after {c} steps, one per chunk",
        "that means {c} steps before the first token, since every chunk is a step",
    ),
    (
        "a step takes {d} ms, so the time to first token is about {e} ms",
        "at {d} ms per step that is roughly {e} ms to the first token",
        "{c} steps of {d} ms each make {e} ms before the first token",
    ),
    (
        "but the decodes of the running requests also share the budget",
        "however the running requests decode in the same steps and take part of the budget",
        "the other requests are decoding too, and their tokens count against the budget",
    ),
    (
        "so the real number of chunks could be higher than {c}",
        "which means it may need more than {c} chunks in practice",
        "so {c} chunks is a lower bound, not the real count",
    ),
    (
        "the answer should be about {e} ms unless the queue is long",
        "so my estimate stays at {e} ms if nothing waits in front",
        "I think the answer is {e} ms, assuming an empty queue",
    ),
)
_FILLERS = (
    "Wait,",
    "Hmm,",
    "Let me check that again.",
    "Actually,",
    "Let me recompute.",
    "So,",
    "Let me verify:",
    "Okay,",
    "But wait,",
    "Let me think again.",
)


def _paraphrase_round(rng: random.Random, steps: Sequence[Sequence[str]], v: dict[str, int]) -> str:
    order = list(range(len(steps)))
    if rng.random() < 0.3:
        j = rng.randrange(len(order) - 1)
        order[j], order[j + 1] = order[j + 1], order[j]
    parts = [rng.choice(_FILLERS)]
    for k in order:
        if rng.random() < 0.15:
            continue  # this round skips a step
        parts.append(rng.choice(steps[k]).format(**v) + ".")
    return " ".join(parts)


def paraphrase_loop_corpus(n: int = 120, loop_tokens: int = 2000) -> list[Sample]:
    """A legitimate prefix, then the same 3-6 reasoning steps re-worded round after round; ``period`` is
    the mean tokens per round, ``onset`` the first token of the second round (where it starts to loop)."""
    rng = random.Random(17)
    out = []
    for k in range(n):
        steps = rng.sample(_STEPS, rng.randint(3, 6))
        a, b, d = rng.randint(2000, 30000), rng.choice((256, 512, 1024, 2048)), rng.randint(20, 90)
        c = -(-a // b)
        v = {"a": a, "b": b, "c": c, "d": d, "e": c * d}
        prefix = tokenize(_prose(rng, rng.randint(1, 8)) + "\n\n")
        first = tokenize(_paraphrase_round(rng, steps, v))
        tail: list[int] = []
        rounds = 1
        while len(tail) < loop_tokens:
            tail += tokenize(" " + _paraphrase_round(rng, steps, v))
            rounds += 1
        out.append(
            Sample(
                id=f"paraphrase-{k}",
                tokens=prefix + first + tail,
                onset=len(prefix) + len(first),
                period=(len(first) + len(tail)) // rounds,
                kind="paraphrase",
            )
        )
    return out

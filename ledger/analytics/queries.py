"""Named analytics queries, shared by the API, the CLI and the dashboard.

Written once in SQLAlchemy Core and run on DuckDB and PostgreSQL alike (both speak
``percentile_cont(q) WITHIN GROUP (ORDER BY x)`` and ``x = ANY(array)``). Every summary carries the
tails (p50, p90, p99, max) with the count; a mean is only ever shown next to them.

* ``attribution``  per-layer tails over a window, grouped (model, source, finish reason) and optionally
  bucketed over time;
* ``list_requests`` filter, sort by any column of the ``requests`` view, paginate;
* ``decode_itl``   inter-token latency tails over a window, from ``steps``;
* ``request_itl``  one request's inter-token gaps, rebuilt from the steps it took part in;
* ``why``          what delayed one request, biggest first;
* ``kv_stalls``    live requests ranked by how long their KV has sat without a new token;
* ``engine_load``  the engines over a window: by model, the worst right now on their own, the rest
  per model.

The queries live one concept per module (``tails``, ``itl``, ``why``, ``stalls``, ``fleet``, and ``common``
for what they share); this module names them for the API, the CLI, the dashboard and the tests.
"""

from ledger.analytics.common import MAX_PAGE, QUANTILES, QueryError
from ledger.analytics.fleet import TOP_DEFAULT, TOP_MAX, engine_load
from ledger.analytics.itl import decode_itl, request_itl
from ledger.analytics.stalls import kv_stalls
from ledger.analytics.tails import GROUPS, METRICS, SORTABLE, attribution, list_requests
from ledger.analytics.why import why
from ledger.analytics.why_answer import Why, WhyQuery

__all__ = [
    "GROUPS",
    "MAX_PAGE",
    "METRICS",
    "QUANTILES",
    "SORTABLE",
    "TOP_DEFAULT",
    "TOP_MAX",
    "QueryError",
    "Why",
    "WhyQuery",
    "attribution",
    "decode_itl",
    "engine_load",
    "kv_stalls",
    "list_requests",
    "request_itl",
    "why",
]

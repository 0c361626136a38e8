"""OTLP export of finished requests as spans (``spans``: what a request's spans are; ``export``: the
bounded, batched, retried sender beside ingest). Off unless an OTLP traces endpoint is configured."""

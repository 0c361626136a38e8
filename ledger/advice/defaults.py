"""Defaults of the advice that the CLI's options and the API's parameters show (imports nothing heavy)."""

DEFAULT_ARRIVAL_SHARE = 0.25  # share of each step's prefill budget kept for arriving prompts
MIN_USEFUL_CHUNK = 64  # prefill tokens per step below which the advice refuses (ledger/advice/advisor.py)
DEFAULT_MAX_STEPS = 100_000  # newest steps in the window that a fit reads

"""What the tests share: fakes (a ledger, an upstream engine), event factories, server processes."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository

"""Policy versions: every accepted policy is a row in ``policy_versions``; the newest is live.

At start the service loads the newest stored version; a policy file (``CHUNKLEDGER_POLICY_FILE``) that
is new or changed since it was last loaded becomes a new version (origin ``file``), while an unchanged
file does not undo later ``PUT``s; with neither, the defaults are stored as version 1.
``PUT /v1/policy`` stores a new version (origin ``api``). Replicas on one PostgreSQL pick up a newer
version within a few seconds (``refresh`` on the service's ticker).
"""

from __future__ import annotations

import json
import threading
import time

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field

from ledger.rules.policy import Policy, PolicyError, load_policy_file, parse_policy, policy_json


class PolicyVersion(BaseModel):
    """A policy version: ``GET /v1/policy`` answers the live one, ``PUT /v1/policy`` the one it stored."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(description="one more with every accepted policy")
    created_ts: float
    origin: str = Field(description="where it came from: default, file or api")
    policy: Policy


class PolicyStore:
    def __init__(self, engine: sa.Engine | None, file: str | None = None) -> None:
        self.engine = engine
        self.file = file
        self._lock = threading.Lock()
        self.policy = Policy()
        self.version = 0
        self.created_ts = time.time()
        self.origin = "default"

    def get(self) -> Policy:
        return self.policy

    def load(self) -> None:
        file_policy = load_policy_file(self.file) if self.file else None
        latest = self._latest()
        if latest is not None:
            self._set(*latest)
        if file_policy is not None and policy_json(file_policy) != self._last_file_json():
            self.put(file_policy, origin="file")  # a new or edited file wins; an unchanged one does not
        elif latest is None:
            self.put(Policy(), origin="default")

    def _last_file_json(self) -> str | None:
        """The newest version that came from the file, as ``policy_json`` writes it now (None: there is
        none, or it no longer validates)."""
        if self.engine is None:
            return None
        with self.engine.connect() as conn:
            body = conn.execute(
                sa.text(
                    "SELECT body FROM policy_versions WHERE origin = 'file' ORDER BY version DESC LIMIT 1"
                )
            ).scalar()
        if body is None:
            return None
        try:
            return policy_json(parse_policy(json.loads(body)))
        except PolicyError:
            return None

    def _latest(self) -> tuple[int, float, str, Policy] | None:
        if self.engine is None:
            return None
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.text(
                    "SELECT version, created_ts, origin, body FROM policy_versions ORDER BY "
                    "version DESC LIMIT 1"
                )
            ).first()
        if row is None:
            return None
        return int(row.version), float(row.created_ts), str(row.origin), parse_policy(json.loads(row.body))

    def _set(self, version: int, created_ts: float, origin: str, policy: Policy) -> None:
        with self._lock:
            self.version, self.created_ts, self.origin, self.policy = version, created_ts, origin, policy

    def put(self, policy: Policy, *, origin: str = "api") -> int:
        """Store ``policy`` as the next version and make it live; returns the version."""
        now = time.time()
        if self.engine is None:
            self._set(self.version + 1, now, origin, policy)
            return self.version
        body = policy_json(policy)
        for _ in range(5):  # another replica may take the same number: take the next one
            with self.engine.connect() as conn:
                top = conn.execute(sa.text("SELECT max(version) FROM policy_versions")).scalar()
            version = int(top or 0) + 1
            try:
                with self.engine.begin() as conn:
                    conn.execute(
                        sa.text(
                            "INSERT INTO policy_versions (version, created_ts, origin, body) "
                            "VALUES (:v, :t, :o, :b)"
                        ),
                        {"v": version, "t": now, "o": origin, "b": body},
                    )
            except sa.exc.IntegrityError:
                continue
            self._set(version, now, origin, policy)
            return version
        raise RuntimeError("could not store the policy: version numbers kept colliding")

    def refresh(self) -> bool:
        """Pick up a newer version stored by another replica; True when it changed."""
        latest = self._latest()
        if latest is None or latest[0] <= self.version:
            return False
        self._set(*latest)
        return True

    def describe(self) -> PolicyVersion:
        with self._lock:
            return PolicyVersion(
                version=self.version, created_ts=self.created_ts, origin=self.origin, policy=self.policy
            )

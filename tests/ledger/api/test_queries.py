"""Query objects as a route's parameters (``ledger.api.queries``): the bounds, defaults and descriptions
the object declares are the parameters FastAPI checks and the document shows."""

from __future__ import annotations

from typing import Annotated

import msgspec
import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient

from ledger.advice.answer import AdviceQuery
from ledger.api.queries import query_dependency
from ledger.app import create_app
from ledger.config import Settings


class Ask(msgspec.Struct, kw_only=True, frozen=True):
    n: Annotated[int, msgspec.Meta(ge=1, le=10, description="how many")]
    name: Annotated[str, msgspec.Meta(min_length=2, description="who")] | None = None
    share: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.5


@pytest.fixture
def client() -> TestClient:
    app = FastAPI()

    @app.get("/ask")
    def ask(q: Annotated[Ask, Depends(query_dependency(Ask))]) -> dict[str, object]:
        return msgspec.structs.asdict(q)

    return TestClient(app)


def test_the_query_object_is_built_from_the_query_string_with_its_defaults(client):
    assert client.get("/ask", params={"n": 3}).json() == {"n": 3, "name": None, "share": 0.5}
    assert client.get("/ask", params={"n": 3, "name": "ab", "share": 0}).json()["name"] == "ab"


@pytest.mark.parametrize(
    "params", [{}, {"n": 0}, {"n": 11}, {"n": 3, "name": "a"}, {"n": 3, "share": 1}, {"n": "x"}]
)
def test_a_value_outside_the_query_objects_bounds_is_refused(client, params):
    assert client.get("/ask", params=params).status_code == 422


def test_the_document_shows_the_query_objects_bounds_and_descriptions(client):
    (op,) = client.app.openapi()["paths"]["/ask"].values()
    by_name = {p["name"]: p for p in op["parameters"]}
    assert by_name["n"]["required"] and by_name["n"]["schema"]["minimum"] == 1
    assert by_name["n"]["schema"]["maximum"] == 10 and by_name["n"]["description"] == "how many"
    assert not by_name["share"]["required"] and by_name["share"]["schema"]["exclusiveMaximum"] == 1


def test_the_advice_routes_parameters_are_the_advice_querys_fields():
    doc = create_app(Settings(db_url="duckdb:///:memory:")).openapi()
    params = doc["paths"]["/v1/advice/chunk-size"]["get"]["parameters"]
    assert [p["name"] for p in params] == list(AdviceQuery.__struct_fields__)
    share = next(p for p in params if p["name"] == "arrival_share")["schema"]
    assert share["default"] == 0.25 and share["exclusiveMaximum"] == 1

"""Withdrawing every replica record of one holder (``DELETE holders/{holder_id}/replicas``;
spec §6.1, used by the PC for an instance it declared failed or that ended its epoch, §6.3):
over both replica stores, the holder's records go in every scope and compat id and nobody
else's do, the count and the holder's quota follow, a holder id with glob characters is
matched literally in Redis, and only the holder itself, the PC and admin may ask."""

from __future__ import annotations

import dataclasses

import pytest

from kvsp.ids import uri_id
from kvsp.index import holder_id_of
from tests.services.index.test_index_app import (
    DRIFTED,
    DRIFTED_DESCRIPTOR,
    H1,
    H2,
    SCOPE_A,
    SCOPE_B,
    Env,
    auth,
    bare_env,
    lookup_body,
    record,
)

__all__ = ["bare_env"]  # the fixture, over both replica stores


def _withdraw(env: Env, holder: str, who: str) -> tuple[int, object]:
    answer = env.client.request("DELETE", f"/holders/{uri_id(holder)}/replicas", headers=auth(who))
    return answer.status_code, answer.json()


def _holders(env: Env, *indices: int, scope: bytes = SCOPE_A, compat: bytes | None = None) -> list:
    kw = {} if compat is None else {"compat": compat}
    answer = env.lookup(lookup_body(*indices, scope=scope, **kw))
    assert answer.status_code == 200, answer.text
    return [sorted(r["holder"] for r in found) for found in answer.json()["replicas"]]


def test_every_record_of_the_holder_goes_and_only_its(bare_env: Env) -> None:
    env = bare_env
    env.registry.add(DRIFTED_DESCRIPTOR)
    for i in range(3):
        assert env.put(record(i)).status_code == 200
        assert env.put(record(i, H2), "h2").status_code == 200
    assert env.put(record(5, scope=SCOPE_B, holder=H2), "h2").status_code == 200
    assert env.put(record(7, compat=DRIFTED), "h1").status_code == 200
    assert env.put(dataclasses.replace(record(8, H2), scope_id=SCOPE_B), "h2").status_code == 200
    before = env.run(env.store.count())
    assert _withdraw(env, H1, "h1") == (200, {"withdrawn": 4})
    assert env.run(env.store.count()) == before - 4
    assert _holders(env, 0, 1, 2) == [[H2], [H2], [H2]]
    assert _holders(env, 7, compat=DRIFTED) == []
    assert _holders(env, 5, scope=SCOPE_B) == [[H2]]
    assert _withdraw(env, H1, "pc") == (200, {"withdrawn": 0})  # nothing left: idempotent
    # the holder starts afresh: its records are counted from zero again
    assert env.put(record(0)).status_code == 200
    assert _holders(env, 0) == [[H1, H2]]


def test_a_holder_id_with_glob_octets_is_matched_literally(bare_env: Env) -> None:
    env = bare_env
    tricky = next(
        f"https://g{i}.example/kvsp/"
        for i in range(10_000)
        if holder_id_of(f"https://g{i}.example/kvsp/")[-1:] in (b"*", b"?", b"[", b"\\")
    )
    assert env.put(record(0, tricky), "admin").status_code == 200
    assert env.put(record(0)).status_code == 200
    assert _withdraw(env, tricky, "admin") == (200, {"withdrawn": 1})
    assert _holders(env, 0) == [[H1]]


@pytest.mark.parametrize(
    ("who", "status"), [("h2", 403), ("ca", 403), ("i7", 403), ("pc", 200), ("admin", 200)]
)
def test_only_the_holder_the_pc_and_admin_may_withdraw_a_holder(
    bare_env: Env, who: str, status: int
) -> None:
    env = bare_env
    assert env.put(record(0)).status_code == 200
    code, body = _withdraw(env, H1, who)
    assert code == status, body
    assert _holders(env, 0) == ([] if status == 200 else [[H1]])


def test_before_keeps_what_was_published_since(bare_env: Env) -> None:
    env = bare_env
    assert env.put(record(0)).status_code == 200
    env.clock.advance(10_000)
    assert env.put(record(1)).status_code == 200  # published (or refreshed) later
    env.clock.advance(10_000)
    bound = env.clock.now_ms() - 15_000
    answer = env.client.request(
        "DELETE", f"/holders/{uri_id(H1)}/replicas?before={bound}", headers=auth("pc")
    )
    assert answer.json() == {"withdrawn": 1}, answer.text
    assert _holders(env, 0) == [] and _holders(env, 1) == [[H1]]
    assert env.run(env.store.count()) == 1
    assert env.put(record(0)).status_code == 200  # a refresh counts as a new publication
    answer = env.client.request(
        "DELETE", f"/holders/{uri_id(H1)}/replicas?before={bound}", headers=auth("pc")
    )
    assert answer.json() == {"withdrawn": 0}


@pytest.mark.parametrize("query", ["", "?before=x", "?before=-1", "?before=18446744073709551616"])
def test_a_bad_holder_id_or_bound_is_a_400_naming_it(bare_env: Env, query: str) -> None:
    holder = "xyz" if not query else uri_id(H1)
    answer = bare_env.client.request(
        "DELETE", f"/holders/{holder}/replicas{query}", headers=auth("admin")
    )
    assert answer.status_code == 400
    assert answer.json()["path"] == ("holder_id" if not query else "before")

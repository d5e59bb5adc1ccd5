"""Request reading and HTTP field parsing: bodies, JSON, §6.7 parameters, Repr-Digest."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.errors import BadRequest, InvalidIdentifier
from kvsp.web.http import (
    json_depth,
    json_depth_exceeds,
    media_type,
    parse_codec_param,
    parse_json,
    parse_layers_param,
    parse_repr_digest,
    repr_digest,
)
from kvsp.web.testing import InProcessClient

DIGEST = hashlib.sha256(b"block").digest()
B64 = base64.b64encode(DIGEST).decode()
OTHER = base64.b64encode(hashlib.sha512(b"block").digest()).decode()
KVSP = {"content-type": "application/kvsp+json"}


# --- JSON -------------------------------------------------------------------------------------


def test_parse_json_accepts_plain_json() -> None:
    assert parse_json(b'{"a":[1,"x",null,true,1.5]}') == {"a": [1, "x", None, True, 1.5]}


@pytest.mark.parametrize("body", [b"NaN", b"[Infinity]", b'{"x":-Infinity}'])
def test_parse_json_refuses_non_finite(body: bytes) -> None:
    with pytest.raises(BadRequest) as info:
        parse_json(body)
    assert info.value.path == "$"


@pytest.mark.parametrize("body", [b"", b"{", b'{"a":1,}', b"\xef\xbb\xbf{}", b'"\xff"', b"[1]x"])
def test_parse_json_refuses_malformed(body: bytes) -> None:
    with pytest.raises(BadRequest) as info:
        parse_json(body)
    assert info.value.path == "$"


def test_depth_limit_is_exact() -> None:
    assert parse_json(b"[" * 64 + b"]" * 64) is not None
    with pytest.raises(BadRequest, match="deeper than 64"):
        parse_json(b"[" * 65 + b"]" * 65)
    mixed = b'{"a":[' * 32 + b"0" + b"]}" * 32
    assert parse_json(mixed) is not None
    with pytest.raises(BadRequest, match="deeper"):
        parse_json(b'{"a":[' * 33 + b"0" + b"]}" * 33)


def test_brackets_inside_strings_do_not_count() -> None:
    body = json.dumps(["[[[[" * 100, '\\"{{{{' * 100, {"k": "]]]"}]).encode()
    assert not json_depth_exceeds(body)
    assert parse_json(body)[2] == {"k": "]]]"}


@pytest.mark.parametrize("body", [b"[" * 200_000, b"[" * 200_000 + b"]", b"]" * 100 + b"[" * 100])
def test_unbalanced_deep_input_is_a_bad_request_without_blowing_up(body: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_json(body)


_JSON_VALUES = st.recursive(
    st.none() | st.integers() | st.text(alphabet='[]{}"\\ab\u00e9\n'),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3),
)


@given(_JSON_VALUES, st.booleans())
def test_depth_prescan_is_exact(value: object, ascii_only: bool) -> None:
    def depth(v: object) -> int:
        if isinstance(v, dict):
            v = list(v.values())
        return 1 + max(map(depth, v), default=0) if isinstance(v, list) else 0

    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert json_depth(body) == depth(value)
    assert json_depth_exceeds(body, max_depth=2) == (depth(value) > 2)


def test_media_type_parsing() -> None:
    assert media_type("Application/KVSP+JSON; charset=utf-8") == "application/kvsp+json"
    assert media_type(None) is None
    assert media_type(";") is None


def test_read_json_checks_media_type(client: InProcessClient) -> None:
    ok = client.post("/json", content=b'{"a":1}', headers=KVSP)
    assert ok.status_code == 200
    assert ok.json() == {"got": {"a": 1}}
    plain = client.post("/json", content=b"[]", headers={"content-type": "application/json"})
    assert plain.status_code == 200
    for headers in ({"content-type": "text/plain"}, {}):
        response = client.post("/json", content=b"{}", headers=headers)
        assert response.status_code == 415
        assert response.json()["type"].endswith("kvsp-bad-request")
    latin = {"content-type": "application/json; charset=latin-1"}
    assert client.post("/json", content=b"{}", headers=latin).status_code == 415


def test_read_json_errors_are_problems(client: InProcessClient) -> None:
    bad = client.post("/json", content=b"{nope", headers=KVSP)
    assert bad.status_code == 400
    assert bad.json()["path"] == "$"
    deep = client.post("/json", content=b"[" * 100 + b"]" * 100, headers=KVSP)
    assert deep.status_code == 400
    assert "deeper" in deep.json()["detail"]
    big = client.post("/json", content=b"[" + b"1," * 3000 + b"1]", headers=KVSP)
    assert big.status_code == 413


def test_read_body_limits(client: InProcessClient) -> None:
    assert client.post("/body", content=b"x" * 1000).json() == {"octets": 1000}
    assert client.post("/body", content=b"x" * 1001).status_code == 413

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(5):
            yield b"y" * 300

    streamed = client.post("/body", content=chunks())
    assert streamed.status_code == 413
    assert client.post("/body", content=b"", headers={"content-length": "x"}).status_code == 400


# --- §6.7 query parameters -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"), [("0-0", (0, 0)), ("2-5", (2, 5)), ("0-4294967295", (0, 2**32 - 1))]
)
def test_layers_param(text: str, expected: tuple[int, int]) -> None:
    assert parse_layers_param(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", "3", "5-2", "-1-2", "+1-2", "1-+2", "01-2", "1-4294967296", "1--2", "a-b", "1-2-3",
     "1 -2", "１-２", "1-99999999999999999999"],
)  # fmt: skip
def test_layers_param_refuses(text: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_layers_param(text)
    assert info.value.path == "layers"


def test_codec_param() -> None:
    assert parse_codec_param("1") == 1
    assert parse_codec_param("65535") == 65535
    for text in ("", "65536", "-1", "0x1", "01", "1.0"):
        with pytest.raises(BadRequest) as info:
            parse_codec_param(text)
        assert info.value.path == "codec"


def test_query_params_in_a_handler(client: InProcessClient) -> None:
    assert client.get("/layers?layers=1-3&codec=1").json() == {"layers": [1, 3], "codec": 1}
    response = client.get("/layers?layers=3-1")
    assert response.status_code == 400
    assert response.json()["path"] == "layers"


# --- Repr-Digest ------------------------------------------------------------------------------


def test_repr_digest_round_trip() -> None:
    header = repr_digest(DIGEST)
    assert header == f"sha-256=:{B64}:"
    assert parse_repr_digest(header) == DIGEST
    with pytest.raises(InvalidIdentifier):
        repr_digest(DIGEST[:31])


@pytest.mark.parametrize(
    "header",
    [
        f"sha-512=:{OTHER}:, sha-256=:{B64}:",
        f"sha-256=:{B64}:,sha-512=:{OTHER}:",
        f"  sha-256=:{B64}:;note=1  ",
        f'unixsum=3, id-sha-256=?0, x=("a" 1);p=tok, sha-256=:{B64}:',
        f"sha-256=:{OTHER}:, sha-256=:{B64}:",
    ],
)
def test_parse_repr_digest_picks_sha256(header: str) -> None:
    assert parse_repr_digest(header) == DIGEST


@pytest.mark.parametrize("header", [None, "", f"sha-512=:{OTHER}:"])
def test_parse_repr_digest_absent(header: str | None) -> None:
    assert parse_repr_digest(header) is None


@pytest.mark.parametrize(
    "header",
    [
        f"sha-256={B64}",
        f"sha-256=:{B64}",
        "sha-256=:AAAA:",
        f"sha-256=:{B64[:-1]}*:",
        f"sha-256=:{B64}:,",
        f"SHA-256=:{B64}:",
        f"sha-256=:{B64}: sha-512=:{OTHER}:",
        "sha-256",
        "sha-256=:!!!!:",
    ],
)
def test_parse_repr_digest_malformed(header: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_repr_digest(header)
    assert info.value.path == "Repr-Digest"


@given(st.text(max_size=60))
def test_parse_repr_digest_garbage_parses_or_raises_bad_request(header: str) -> None:
    try:
        result = parse_repr_digest(header)
    except BadRequest:
        return
    assert result is None or len(result) == 32

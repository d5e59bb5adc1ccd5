"""One flag name per concept across ``kvsp serve index|pc|control|holder|instance|relay``,
``python -m relay.app`` and the operator commands: every parser is walked, and a concept spelled
two ways, a help text shared by two names, or an older spelling that is visible or stores
elsewhere than its canonical option fails. Older spellings keep working, hidden, with one
warning."""

from __future__ import annotations

import argparse
import logging
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsp.cli import build_parser
from kvsp.web import cliargs
from kvsp.web.cliargs import DeprecatedAlias, warn_deprecated

CONCEPTS: dict[str, tuple[str, set[str], set[str]]] = {
    # concept: (canonical flag, the parsers that have it, older spellings of it)
    "the token a process presents to the IS": (
        "--index-token-file",
        {"serve pc", "serve holder", "serve relay", "relay"},
        {"--token-file"},
    ),
    "the PC a process reports to or asks": (
        "--pc",
        {"serve instance", "generate", "status", "instance list", "prefetch"},
        {"--control"},
    ),
    "the IS a process publishes at or asks": (
        "--index",
        {"serve pc", "serve holder", "serve instance", "serve relay", "replicas", "holders"},
        set(),
    ),
    "what outbound TLS trusts": (
        "--cafile",
        {"serve index", "serve pc", "serve holder", "serve instance", "serve relay"},
        {"--relay-cafile", "--upstream-cafile"},
    ),
    "outbound TLS unverified": (
        "--insecure",
        {"serve relay", "serve instance"},
        {"--upstream-insecure"},
    ),
    "the QUIC library of MOQT sessions": (
        "--moqt-backend",
        {"serve instance", "serve relay", "relay"},
        {"--backend", "--quic-backend"},
    ),
    "the largest QUIC datagram sent": (
        "--moqt-datagram-size",
        {"serve instance", "serve relay", "relay"},
        {"--quic-datagram-size"},
    ),
    "the URL named in records": (
        "--public-url",
        {"serve holder", "serve instance", "serve relay"},
        set(),
    ),
    "the TTL asked for each Replica Record": (
        "--record-ttl-ms",
        {"serve holder", "serve instance", "serve relay"},
        set(),
    ),
    "the holder face's address": ("--holder-listen", {"serve relay", "relay"}, {"--http-listen"}),
}
OWN_TOKEN = {"serve instance", "generate", "status", "token-audience", "instance list"}
"""Parsers whose ``--token-file`` is the caller's own token (for the PC and IS alike), a concept
of its own: it is an older spelling of ``--index-token-file`` only where a process presents a
token to the IS and nothing else."""


def _parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    from relay.app import DEFAULT_PORT, configure_parser

    def walk(
        name: str, parser: argparse.ArgumentParser
    ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    yield from walk(f"{name} {sub}".strip(), child)

    yield from walk("", build_parser())
    relay = argparse.ArgumentParser(prog="relay")
    cliargs.add_common_arguments(relay, DEFAULT_PORT)
    configure_parser(relay)
    yield "relay", relay


PARSERS = dict(_parsers())


def _visible(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        name: action
        for action in parser._actions
        if action.help is not argparse.SUPPRESS
        for name in action.option_strings
        if name.startswith("--")
    }


def _hidden(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        name: action
        for action in parser._actions
        if action.help is argparse.SUPPRESS and action.option_strings
        for name in action.option_strings
    }


@pytest.mark.parametrize("concept", sorted(CONCEPTS))
def test_each_concept_has_one_name_everywhere(concept: str) -> None:
    canonical, having, older = CONCEPTS[concept]
    for name in sorted(having):
        visible = _visible(PARSERS[name])
        assert canonical in visible, f"{name}: no {canonical} ({concept})"
        for old in older - ({"--token-file"} if name in OWN_TOKEN else set()):
            assert old not in visible, f"{name}: {old} is spelled for {concept}; use {canonical}"
            alias = _hidden(PARSERS[name]).get(old)
            if isinstance(alias, DeprecatedAlias):
                assert alias.canonical is visible[canonical]
                assert alias.dest == visible[canonical].dest


def test_no_parser_spells_a_concept_the_old_way() -> None:
    for name, parser in PARSERS.items():
        visible = _visible(parser)
        for concept, (canonical, _, older) in CONCEPTS.items():
            for old in older:
                if old == "--token-file" and (name in OWN_TOKEN or canonical not in visible):
                    continue  # the caller's own token, or a parser that never meets the IS
                assert old not in visible, f"{name}: {old} ({concept}); the name is {canonical}"


def test_one_help_text_has_one_name() -> None:
    names: dict[str, set[str]] = defaultdict(set)
    for parser in PARSERS.values():
        for option, action in _visible(parser).items():
            if action.help and option != "--help" and option == action.option_strings[-1]:
                names[" ".join(action.help.split())].add(option)
    twice = {text: sorted(opts) for text, opts in names.items() if len(opts) > 1}
    assert not twice, f"one meaning, several names: {twice}"


def test_every_alias_is_hidden_and_stores_as_its_canonical_option() -> None:
    seen = 0
    for name, parser in PARSERS.items():
        for action in parser._actions:
            if isinstance(action, DeprecatedAlias):
                seen += 1
                assert action.help is argparse.SUPPRESS, name
                assert action.dest == action.canonical.dest, name
                assert action.canonical.help is not argparse.SUPPRESS, name
    assert seen >= 5  # relay: four, instance: one


@pytest.mark.parametrize(
    ("argv", "dest", "value"),
    [
        (["serve", "relay", "--token-file", "t"], "index_token_file", Path("t")),
        (["serve", "relay", "--http-listen", "127.0.0.1:9"], "holder_listen", "127.0.0.1:9"),
        (["serve", "relay", "--backend", "aioquic"], "moqt_backend", "aioquic"),
        (["serve", "relay", "--quic-datagram-size", "1300"], "moqt_datagram_size", 1300),
        (
            ["serve", "instance", "--control", "http://pc/", "--token-file", "t"],
            "control",
            ["http://pc/"],
        ),
    ],
)
def test_older_spellings_still_work_with_one_warning(
    argv: list[str], dest: str, value: object, caplog: pytest.LogCaptureFixture
) -> None:
    cliargs._warned.clear()
    args = build_parser().parse_args(argv)
    assert getattr(args, dest) == value
    with caplog.at_level(logging.WARNING, logger="kvsp.web.cliargs"):
        warn_deprecated(args)
        warn_deprecated(build_parser().parse_args(argv))  # a second parse: no second warning
    warnings = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(f"{argv[2]} is deprecated; use --")


def test_the_canonical_spelling_warns_of_nothing(caplog: pytest.LogCaptureFixture) -> None:
    cliargs._warned.clear()
    args = build_parser().parse_args(["serve", "relay", "--index-token-file", "t"])
    with caplog.at_level(logging.WARNING, logger="kvsp.web.cliargs"):
        warn_deprecated(args)
    assert args.index_token_file is not None and not caplog.records


def test_a_bad_value_under_an_old_spelling_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "relay", "--backend", "nosuch"])
    assert exited.value.code == 2

"""``--site`` and ``--zone``: where an instance, holder or relay runs (spec §4.4 extension
members, §6.4 placement inputs).

The labels go into the records the process publishes, as the extension members ``site`` and
``zone`` of its Instance Status Record or Replica Records (a peer that does not know them
ignores them, §4.4), and placement (:mod:`kvsp.placement`) prefers sources in an instance's own
site and assumes a link only to those. One module, so that every service spells and checks
the flags the same way.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvsp.errors import BadRequest
from kvsp.records_common import LABEL_PATTERN, check_label


def label(text: str) -> str:
    """An argparse ``type``: a site or zone label (:data:`~kvsp.records_common.LABEL_PATTERN`).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    try:
        return check_label(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_site_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--site NAME`` and ``--zone NAME`` (both optional)."""
    add = parser.add_argument
    add(
        "--site",
        type=label,
        metavar="NAME",
        help=f"the site it runs in ({LABEL_PATTERN}); placement prefers same-site sources",
    )
    add("--zone", type=label, metavar="NAME", help="the zone within --site (optional)")


@dataclass(frozen=True, slots=True)
class SiteLabels:
    """The ``site``/``zone`` a process carries in its records (``None``: unlabelled)."""

    site: str | None = None
    zone: str | None = None


def site_labels(args: argparse.Namespace) -> SiteLabels:
    """The labels the options give.

    Raises:
        BadRequest: ``--zone`` without ``--site`` (a zone is a part of a site).
    """
    site = getattr(args, "site", None)
    zone = getattr(args, "zone", None)
    if zone is not None and site is None:
        raise BadRequest("--zone needs --site: a zone is a part of a site")
    return SiteLabels(site, zone)

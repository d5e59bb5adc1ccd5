"""A block holder (spec §6.6-6.7): blocks by key over HTTP, leases, and the Replica Records it
publishes for what it stores.

The names below are the part's surface: an inference instance embeds a holder face (its
computed blocks served and leased as a holder's), built from these and nothing else of the
part.
"""

from kvsp.services.holder.app import holder_routes
from kvsp.services.holder.service import Holder, HolderConfig

__all__ = ["Holder", "HolderConfig", "holder_routes"]

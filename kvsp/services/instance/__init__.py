"""The inference instance's agent: an engine behind status reports (§6.3), prefetch directives
(§6.5), a holder face for what it computed (§6.7), sessions (§6.8) and resharding (§6.9).

The part's surface is the request its clients send, :class:`GenerateRequest` (``POST
generate``); the app and the agent are reached through ``kvsp serve instance``.
"""

from kvsp.services.instance.requests import GenerateRequest

__all__ = ["GenerateRequest"]

"""HTTP plumbing shared by every KVSP service and the relay (DESIGN.md §3).

Problem details (RFC 9457), bearer-token authentication and roles, request parsing with
limits, the injectable clock, logs, metrics, OpenAPI documents, the uvicorn runner, the
service CLI arguments and the base of every HTTP client. Nothing here knows which service it
serves; the services in :mod:`kvsp.services` and :mod:`relay` are built on it.
"""

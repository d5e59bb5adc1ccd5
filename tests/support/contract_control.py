"""A tiny control plane (IS + PC) that implements exactly what an instance calls, including
the graceful-leave routes of the two-sites contract (``DELETE instances/{id}?epoch=E`` at the
PC, ``DELETE holders/{holder_id}/replicas`` at the IS), and records every call in order.

It stands in for ``kvsp serve control`` where a test needs those routes before the real
control plane has them, and lets a test read what an instance sent and when. It keeps no
authorization: every request is taken. Served by a real uvicorn on 127.0.0.1 in a thread
(:func:`serve_contract_control`)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvsp.ids import uri_id
from kvsp.web.runner import bind_socket
from tests.support.polling import eventually

KVSP_JSON = "application/kvsp+json"
PROBLEM = "urn:ietf:params:kvsp:problem:"


def _answer(body: Any, status: int = 200) -> Response:
    return JSONResponse(body, status_code=status, media_type=KVSP_JSON)


def _problem(kind: str, status: int, detail: str) -> Response:
    body = {"type": PROBLEM + kind, "title": kind, "status": status, "detail": detail}
    return JSONResponse(body, status_code=status, media_type="application/problem+json")


@dataclass
class ContractControl:
    """What the instance sent: ``calls`` as ``(monotonic time, text)``, the latest status
    record per instance id, the replica records per path, the epochs ended."""

    base: str = ""
    calls: list[tuple[float, str]] = field(default_factory=list)
    statuses: dict[str, dict[str, Any]] = field(default_factory=dict)
    replicas: dict[str, dict[str, Any]] = field(default_factory=dict)
    ended: list[tuple[str, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _log(self, text: str) -> None:
        with self.lock:
            self.calls.append((time.monotonic(), text))

    def replicas_of(self, holder: str) -> list[str]:
        """The paths of the records of ``holder`` (a URI) held now."""
        hid = uri_id(holder)
        with self.lock:
            return [path for path in self.replicas if path.endswith("/" + hid)]

    def texts(self) -> list[str]:
        """The calls so far, without their times."""
        with self.lock:
            return [text for _, text in self.calls]

    # -- routes --------------------------------------------------------------------------------

    async def put_descriptor(self, request: Request) -> Response:
        self._log("PUT descriptor")
        return _answer({"compat_id": request.path_params["cid"]})

    async def put_status(self, request: Request) -> Response:
        record = json.loads(await request.body())
        iid = request.path_params["iid"]
        self._log(f"status {record['state']} epoch {record['epoch']}")
        with self.lock:
            self.statuses[iid] = record
        return _answer({"state": record["state"]})

    async def delete_instance(self, request: Request) -> Response:
        iid = request.path_params["iid"]
        epoch = int(request.query_params["epoch"])
        self._log(f"DELETE instance epoch {epoch}")
        with self.lock:
            record = self.statuses.get(iid)
            if record is None:
                return _problem("kvsp-not-found", 404, "unknown instance")
            if epoch < record["epoch"]:
                return _problem("kvsp-stale-epoch", 409, "a higher epoch is registered")
            del self.statuses[iid]
            self.ended.append((iid, epoch))
        return Response(status_code=204)

    async def put_replica(self, request: Request) -> Response:
        record = json.loads(await request.body())
        with self.lock:
            self.replicas[request.url.path] = record
        return _answer({"ttl_ms": record.get("ttl_ms", 60_000)})

    async def post_replicas(self, request: Request) -> Response:
        body = json.loads(await request.body())
        results = []
        for record in body["records"]:
            path = "/replicas/" + "/".join(
                (
                    record["compat_id"],
                    record["scope_id"],
                    record["block_key"],
                    uri_id(record["holder"]),
                )
            )
            with self.lock:
                self.replicas[path] = record
            results.append({"ok": True, "ttl_ms": record.get("ttl_ms", 60_000)})
        return _answer({"results": results})

    async def delete_replica(self, request: Request) -> Response:
        with self.lock:
            found = self.replicas.pop(request.url.path, None)
        return Response(status_code=204 if found is not None else 404)

    async def delete_holder_replicas(self, request: Request) -> Response:
        hid = request.path_params["hid"]
        with self.lock:
            gone = [p for p in self.replicas if p.endswith("/" + hid)]
            for path in gone:
                del self.replicas[path]
        self._log(f"DELETE holder replicas {len(gone)}")
        return _answer({"withdrawn": len(gone)})

    async def lookup(self, request: Request) -> Response:
        return _answer({"matched": 0, "replicas": []})

    def app(self) -> Starlette:
        """The routes as a Starlette app."""
        replica = "/replicas/{c}/{s}/{k}/{h}"
        return Starlette(
            routes=[
                Route("/descriptors/{cid}", self.put_descriptor, methods=["PUT"]),
                Route("/instances/{iid}/status", self.put_status, methods=["PUT"]),
                Route("/instances/{iid}", self.delete_instance, methods=["DELETE"]),
                Route(replica, self.put_replica, methods=["PUT"]),
                Route(replica, self.delete_replica, methods=["DELETE"]),
                Route("/replicas", self.post_replicas, methods=["POST"]),
                Route("/holders/{hid}/replicas", self.delete_holder_replicas, methods=["DELETE"]),
                Route("/lookup", self.lookup, methods=["POST"]),
            ]
        )


@contextmanager
def serve_contract_control() -> Iterator[ContractControl]:
    """A :class:`ContractControl` served on 127.0.0.1 (its ``base`` set) until the end."""
    control = ContractControl()
    sock = bind_socket("127.0.0.1", 0)
    config = uvicorn.Config(control.app(), log_level="warning", lifespan="off")
    config.timeout_graceful_shutdown = 1
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    eventually(lambda: server.started, 10, "the contract control plane to start", interval=0.01)
    control.base = f"http://127.0.0.1:{sock.getsockname()[1]}/"
    try:
        yield control
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()

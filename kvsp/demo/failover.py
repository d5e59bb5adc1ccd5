"""Step 4 of ``kvsp demo``: an instance killed mid-generation and the session continued
elsewhere (spec §6.3 failure by status expiry, §6.8 checkpoints and resume).

The front end places a session (``POST place`` with ``session``), reads its token stream from
``POST generate``, and SIGKILLs the serving instance once it has seen ``kill_after`` tokens
(past the first checkpoint). Then, as far as the build offers:

* **front end** (§6.8): the front-end library :class:`~kvsp.services.frontend.FrontEnd` does
  all of the client's part below by itself: it notices the broken stream, asks the PC where
  the session lives now and reattaches there; the demo only reads its tokens and kills;
* **resume** (§6.8, the same over plain HTTP calls when the library is not in the build): the
  PC sees the instance's status expire, advances the session's epoch
  and resumes it on another instance from the latest checkpoint; the front end asks the PC
  where the session lives now (``GET sessions/{session}``) and reattaches there (``GET
  sessions/{session}/tokens?from=N``), keeping each index once and dropping lower epochs;
* **restart**, when the PC keeps no sessions or could not move this one: the front end waits
  until the PC marks the instance failed (§6.3), places the request again and discards by
  index the tokens it already has (greedy decoding on one machine is deterministic,
  DESIGN.md §6, so the rerun repeats them).

Either way the delivered stream must equal an uninterrupted run of the same prompt, token for
token, with no index missing or repeated; the failover time runs from the kill to the first
new token at the front end.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
import uuid
from typing import TYPE_CHECKING, Any

from kvsp.demo.client import DemoClient, StateWatcher, wait_for
from kvsp.demo.summary import FailoverOutcome

if TYPE_CHECKING:
    from kvsp.demo.scenario import Scenario


FRONTEND = "kvsp.services.frontend"


class Stream:
    """What the front end delivers: each index once, lower epochs than seen dropped (§6.8)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.epochs: list[int] = []
        self.duplicates = 0
        self.first_new_at: float | None = None
        self.mismatched = 0

    def offer(self, line: dict[str, Any]) -> None:
        """Take one ``{"index", "epoch", "token"}`` line (others are ignored)."""
        if "token" not in line:
            return
        index, epoch, token = int(line["index"]), int(line.get("epoch", 1)), int(line["token"])
        if self.epochs and epoch < max(self.epochs):
            self.duplicates += 1
            return
        if epoch not in self.epochs:
            self.epochs.append(epoch)
        if index < len(self.tokens):
            self.duplicates += 1
            self.mismatched += self.tokens[index] != token
            return
        if index > len(self.tokens):
            return  # a gap: never delivered out of order; the check below reports it
        self.tokens.append(token)
        if self.first_new_at is None:
            self.first_new_at = time.perf_counter()


def run_failover(scenario: Scenario, watcher: StateWatcher) -> None:
    """Step 4: kill the serving instance mid-generation and continue the session."""
    console = scenario.console
    console.heading("4. An instance is killed mid-generation; the session continues (§6.8)")
    prompt = scenario.next_prompt()
    reference = _reference(scenario, prompt)
    console.line(f"uninterrupted run: {len(reference)} tokens (the expected output)")
    outcome = Failover(scenario, watcher, prompt, reference).run()
    scenario.figures.failover = outcome
    verdict = "equal to the uninterrupted run" if outcome.gap_free else "DIFFERENT from it"
    console.line(
        f"delivered {outcome.tokens} tokens, {verdict}; {outcome.duplicates_dropped} duplicates "
        f"dropped; failover took {outcome.failover_s * 1000:,.0f} ms"
    )


def _reference(scenario: Scenario, prompt: list[int]) -> list[int]:
    """The output of an uninterrupted run, where the PC places it."""
    client, total = scenario.client, scenario.options.failover_tokens
    placed = client.place(prompt)
    _settle_directive(client, placed)
    with scenario.console.progress("uninterrupted run", total) as bar:
        done = client.generate(placed["instance"], prompt, total, on_line=lambda _: bar.advance())
    if done.status != 200 or done.broken or done.problem:
        raise RuntimeError(f"the uninterrupted run failed: {done.problem or done.broken}")
    scenario.figures.count(done)
    return done.tokens


def _settle_directive(client: DemoClient, placed: dict[str, Any]) -> None:
    directive = placed.get("directive")
    if directive is not None:
        client.directive_outcome(placed["instance"], directive)


class Failover:
    """One session through a kill: placed, streamed, killed, continued."""

    def __init__(
        self, scenario: Scenario, watcher: StateWatcher, prompt: list[int], reference: list[int]
    ) -> None:
        self.scenario = scenario
        self.client = scenario.client
        self.console = scenario.console
        self.watcher = watcher
        self.prompt = prompt
        self.reference = reference
        self.total = scenario.options.failover_tokens
        self.session = str(uuid.uuid4())
        self.stream = Stream()
        self.killed_at = 0.0
        self.victim = ""

    def run(self) -> FailoverOutcome:
        """Place, stream, kill, then resume (or restart); what was measured."""
        if importlib.util.find_spec(FRONTEND) is not None:
            return self._with_frontend()
        self.scenario.figures.missing.append(
            f"the front-end library ({FRONTEND}) is not in this build: the demo made the "
            "front end's §6.8 calls itself"
        )
        placed = self.client.place(self.prompt, session=self.session)
        self.victim = placed["instance"]
        _settle_directive(self.client, placed)
        sessions = self.client.session(self.session) is not None
        extra = {"session": self.session} if sessions else {}
        self._kill_mid_stream(**extra)
        failed = self.watcher.wait_state(self.victim, "failed", 30)
        self.console.line(
            f"the PC marked {self.name(self.victim)} failed when its status expired "
            f"({failed.at_s:.1f} s into the step, §6.3)"
        )
        moved = self._moved() if sessions else None
        if moved is not None:
            method, resumed_on = "resume", self._reattach(moved)
        else:
            method, resumed_on = "restart", self._restart()
        return self._outcome(method, resumed_on, self.stream.duplicates)

    def _outcome(self, method: str, resumed_on: str, dropped: int) -> FailoverOutcome:
        history = self.watcher.history(self.victim)
        self.scenario.figures.lifecycle.append((f"{self.name(self.victim)}, killed", history))
        first_new = self.stream.first_new_at or time.perf_counter()
        return FailoverOutcome(
            method=method,
            killed=self.victim,
            resumed_on=resumed_on,
            killed_after_tokens=self.scenario.options.kill_after,
            failover_s=first_new - self.killed_at,
            tokens=len(self.stream.tokens),
            gap_free=self.stream.tokens == self.reference and not self.stream.mismatched,
            duplicates_dropped=dropped,
            epochs=self.stream.epochs,
        )

    def _with_frontend(self) -> FailoverOutcome:
        """The front-end library places, streams and reattaches; the demo kills."""
        dropped, resumed_on = asyncio.run(self._frontend_tokens())
        failed = self.watcher.wait_state(self.victim, "failed", 30)
        self.console.line(
            f"the PC had marked {self.name(self.victim)} failed when its status expired "
            f"({failed.at_s:.1f} s into the step, §6.3) and moved the session to "
            f"{self.name(resumed_on)} (epochs seen: {self.stream.epochs})"
        )
        return self._outcome("resume, front-end library", resumed_on, dropped)

    async def _frontend_tokens(self) -> tuple[int, str]:
        """Stream through :class:`~kvsp.services.frontend.FrontEnd`, killing the instance
        that serves once ``kill_after`` tokens arrived; (tokens dropped, the last server)."""
        from kvsp.services.frontend import FrontEnd

        cluster, kill_after = self.scenario.cluster, self.scenario.options.kill_after
        resumed_at: list[float] = []  # tokens the victim sent before the kill may follow it
        front = FrontEnd(
            cluster.running().control,
            cluster.files.read_token("client"),
            scope_id=cluster.scope,
            compat_id=cluster.compat,
            block_tokens=cluster.config.block_tokens,
            scope_key=cluster.scope_key,
        )
        async with front:
            with self.console.progress("front end", self.total) as bar:
                async for t in front.generate(self.prompt, self.total):
                    self.stream.offer({"index": t.index, "epoch": t.epoch, "token": t.token})
                    bar.set(len(self.stream.tokens))
                    if not self.killed_at and len(self.stream.tokens) >= kill_after:
                        self.victim = t.instance
                        cluster.kill(self.name(self.victim))
                        self.killed_at = time.perf_counter()
                    elif self.killed_at and t.instance != self.victim and not resumed_at:
                        resumed_at.append(time.perf_counter())  # the first from elsewhere
            stats = front.stats
        if not self.killed_at or not resumed_at:
            raise RuntimeError("the front end's stream ended before the kill or never resumed")
        self.stream.first_new_at = resumed_at[0]
        self.console.line(
            f"{self.name(self.victim)} was SIGKILLed after {kill_after} tokens; the front end "
            f"reattached {stats.reattached} time(s), started over {stats.restarted} time(s)"
        )
        return stats.duplicates + stats.stale, str(front.current)

    def name(self, url: str) -> str:
        """The short name of an instance."""
        return self.scenario.name(url)

    def _kill_mid_stream(self, **extra: Any) -> None:
        kill_after = self.scenario.options.kill_after

        def on_line(line: dict[str, Any]) -> None:
            self.stream.offer(line)
            if not self.killed_at and len(self.stream.tokens) >= kill_after:
                self.scenario.cluster.kill(self.name(self.victim))
                self.killed_at = time.perf_counter()

        first = self.client.generate(self.victim, self.prompt, self.total, on_line, **extra)
        if not self.killed_at:
            raise RuntimeError(f"the stream at {self.name(self.victim)} ended before the kill")
        self.console.line(
            f"{self.name(self.victim)} SIGKILLed after {kill_after} tokens; the stream broke "
            f"({first.broken or 'ended'}) with {len(self.stream.tokens)} tokens delivered"
        )
        self.stream.first_new_at = None

    def _moved(self) -> dict[str, Any] | None:
        """Where the PC resumed the session (§6.8), or ``None`` when it could not."""

        def settled() -> dict[str, Any] | None:
            view = self.client.session(self.session)
            if view is None or view["state"] == "failed":
                return view or {}
            moved = view["instance"] != self.victim and int(view["epoch"]) > 1
            return view if moved and view["state"] == "serving" else None

        view = wait_for(settled, 60, f"the PC to move session {self.session}")
        if not view or view.get("state") == "failed":
            why = (view or {}).get("detail", "the PC keeps no sessions")
            self.scenario.figures.missing.append(
                f"session resume (§6.8): the PC could not move the session ({why}); the front "
                "end placed the request again instead"
            )
            return None
        self.console.line(
            f"the PC resumed session {self.session[:8]} on {self.name(view['instance'])} at "
            f"epoch {view['epoch']} from its checkpoint at output offset "
            f"{view['output_offset']} (§6.8)"
        )
        return view

    def _reattach(self, view: dict[str, Any]) -> str:
        """Read the session's tokens at its new instance from the first one not delivered."""
        instance = view["instance"]
        with self.console.progress(f"reattached at {self.name(instance)}", self.total) as bar:

            def resumed(line: dict[str, Any]) -> None:
                self.stream.offer(line)
                bar.set(len(self.stream.tokens))

            for _ in range(3):  # a broken read is read again from where it stopped
                got = self.client.tokens(instance, self.session, len(self.stream.tokens), resumed)
                if len(self.stream.tokens) >= self.total or got.problem:
                    break
        if got.status != 200 or got.problem:
            raise RuntimeError(f"reattaching at {self.name(instance)} failed: {got.problem}")
        return str(instance)

    def _restart(self) -> str:
        """Place the request again and deliver only the indices not delivered yet."""
        again = self.client.place(self.prompt)
        _settle_directive(self.client, again)
        instance = again["instance"]
        with self.console.progress(f"continuing on {self.name(instance)}", self.total) as bar:

            def resumed(line: dict[str, Any]) -> None:
                self.stream.offer(line)
                bar.set(len(self.stream.tokens))

            done = self.client.generate(instance, self.prompt, self.total, on_line=resumed)
        if done.status != 200 or done.broken or done.problem:
            raise RuntimeError(f"the continued run failed: {done.problem or done.broken}")
        self.scenario.figures.count(done)
        return str(instance)

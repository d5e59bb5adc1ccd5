"""``kvsp demo``: a scenario that shows the protocol working on a local cluster (spec §6.2
lookup, §6.3 lifecycle, §6.4 placement, §6.5 prefetch, §6.8 failover; DESIGN.md §4 MOQT).

1. Requests sharing a long system prompt: the first is computed, its blocks are published, and
   the PC places the next where the cache is (matched blocks, plan, TTFT).
2. Prefetch: directives move the prefix into the other instances, one from the relay's
   ``moqt://`` replicas over MOQT, one from the computing instance's holder face over HTTP
   (:mod:`kvsp.demo.moqt_step`).
3. A drain and a sleep: an instance drains while a session is in flight there (it refuses new
   ones), the PC places new work elsewhere, the instance goes to sleep when its session ends,
   and is woken again.
4. An instance killed mid-generation and the session continued elsewhere
   (:mod:`kvsp.demo.failover`).

Then :func:`~kvsp.demo.summary.print_report` prints the figures.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvsp.demo.client import DemoClient, Generation, StateWatcher, wait_for
from kvsp.demo.cluster import Cluster
from kvsp.demo.console import Console
from kvsp.demo.summary import Figures, Placement, states_line
from kvsp.ids import BlockKey

SYSTEM_PROMPTS = (
    "You are the KVSP demo assistant. Answer in one sentence, name the spec section you rely "
    "on, and never share a cache outside its scope. ",
    "You are a terse reviewer of placement decisions. Compare fetch and recompute costs and "
    "say which one wins, with numbers. ",
)
QUESTIONS = (
    "what is a Block Key?",
    "why chain the keys?",
    "who owns a lease?",
    "when to drain?",
    "what is an epoch?",
    "may I sleep now?",
    "tell me a story.",
)


def text_prompt(text: str, tokens: int) -> list[int]:
    """``tokens`` byte tokens of ``text`` repeated (the seeded model's tokenizer is bytes)."""
    data = text.encode("utf-8")
    return [data[i % len(data)] for i in range(tokens)]


def question(index: int) -> list[int]:
    """The byte tokens of question ``index``, numbered so that no two requests are alike, and
    shorter than a block: prompts sharing a system prompt share all of its blocks and no
    more."""
    return list(f" Q{index}: {QUESTIONS[index % len(QUESTIONS)]}".encode())


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoOptions:
    """Sizes of the scenario."""

    prompt_tokens: int = 2048
    """The shared system prompt, in tokens (rounded down to whole blocks)."""
    answer_tokens: int = 16
    drain_tokens: int = 120
    """Tokens of the session in flight while its instance drains."""
    failover_tokens: int = 120
    kill_after: int = 48
    """Output tokens the front end has seen when the instance is killed."""


class Scenario:
    """The scenario's steps over one cluster; :meth:`run` plays them all."""

    def __init__(
        self, cluster: Cluster, client: DemoClient, console: Console, options: DemoOptions
    ) -> None:
        self.cluster = cluster
        self.client = client
        self.console = console
        self.options = options
        self.figures = Figures()
        b = cluster.config.block_tokens
        self.system = text_prompt(SYSTEM_PROMPTS[0], options.prompt_tokens // b * b)
        self.figures.prompt_tokens = len(self.system)
        self.system_keys: list[BlockKey] = client.keys(self.system)
        self.other_system = text_prompt(SYSTEM_PROMPTS[1], len(self.system))
        """System prompt B (step 1 computes it, step 2 loads it over HTTP)."""
        self.holder_of_prefix = ""
        self.holder_of_other = ""
        """The instance that computed system prompt B in step 1."""
        self._asked = 0

    # -- helpers --------------------------------------------------------------------------------

    def name(self, url: str) -> str:
        """A short name for an instance or holder URL."""
        endpoints = self.cluster.running()
        if url in (endpoints.relay_moqt, endpoints.relay_http):
            return "relay"
        return self.cluster.instance_name(url)

    def names(self) -> dict[str, str]:
        """Every URL of the cluster with its short name."""
        endpoints = self.cluster.running()
        found = {url: name for name, url in endpoints.instances.items()}
        for url in (endpoints.relay_moqt, endpoints.relay_http):
            if url:
                found[url] = "relay"
        return found

    def next_prompt(self, system: Sequence[int] | None = None) -> list[int]:
        """The shared system prompt (or ``system``) followed by the next question."""
        self._asked += 1
        return [*(self.system if system is None else system), *question(self._asked)]

    def await_published(self, holder: str, keys: Sequence[BlockKey], timeout_s: float = 30) -> None:
        """Wait until the IS names ``holder`` for every key (publication is asynchronous)."""

        def done() -> bool | None:
            found = self.client.holders(keys)
            ok = len(found) == len(keys) and all(holder in h for h in found)
            return True if ok else None

        wait_for(done, timeout_s, f"{len(keys)} replicas of {self.name(holder)} at the IS")

    def serve(self, label: str, prompt: Sequence[int], max_tokens: int) -> Placement:
        """POST place, then POST generate where the PC said (after any directive finished)."""
        placed = self.client.place(prompt)
        instance, directive = placed["instance"], placed.get("directive")
        if directive is not None:
            outcome = self.client.directive_outcome(instance, directive)
            self.count_directive(instance, outcome)
        matched = int(placed["matched"])
        placement = self._generate(label, instance, prompt, max_tokens, matched, directive)
        placement.prefetched = directive is not None
        return placement

    def serve_at(self, label: str, instance: str, system: Sequence[int] | None = None) -> Placement:
        """POST generate the next question after ``system`` (default: the shared prompt) at
        ``instance`` directly (no placement), right after a directive loaded it there."""
        prompt = self.next_prompt(system)
        matched = len(self.client.lookup(self.client.keys(prompt)))
        answer_tokens = self.options.answer_tokens
        placement = self._generate(label, instance, prompt, answer_tokens, matched, None)
        placement.prefetched = True
        return placement

    def _generate(
        self,
        label: str,
        instance: str,
        prompt: Sequence[int],
        max_tokens: int,
        matched: int,
        directive: str | None,
    ) -> Placement:
        generation = self.client.generate(instance, prompt, max_tokens)
        if generation.status != 200 or generation.broken or generation.problem:
            why = generation.problem or generation.broken
            raise RuntimeError(f"{label}: generation at {self.name(instance)} failed: {why}")
        self.figures.count(generation)
        placement = Placement(
            label=label,
            instance=instance,
            matched=matched,
            blocks=len(prompt) // self.cluster.config.block_tokens,
            directive=directive,
            generation=generation,
        )
        self.figures.placements.append(placement)
        return placement

    def ask(self, label: str, system: Sequence[int] | None = None) -> Placement:
        """:meth:`serve` the next question after ``system`` (default: the shared prompt)."""
        return self.serve(label, self.next_prompt(system), self.options.answer_tokens)

    def count_directive(self, instance: str, outcome: dict[str, Any]) -> None:
        """Add the blocks a finished PC directive loaded to the bytes moved. The PC chose the
        sources, so a block counts under a transport only when every other holder of it uses
        that transport (else under "HTTP or MOQT"); octets are the records' sizes."""
        loaded = [BlockKey(bytes.fromhex(k)) for k in outcome.get("loaded") or []]
        for records in self.client.lookup(loaded) if loaded else []:
            sources = [r for r in records if r["holder"] != instance]
            kinds = {"MOQT" if str(r["holder"]).startswith("moqt:") else "HTTP" for r in sources}
            if sources:
                transport = kinds.pop() if len(kinds) == 1 else "HTTP or MOQT"
                self.figures.moved(transport, 1, int(sources[0]["size"]))

    def placement_table(self, placements: Sequence[Placement]) -> None:
        """Print where requests went, what matched, and how fast the first token came."""
        rows = []
        for p in placements:
            if p.directive is not None:
                plan = "PC prefetch, then serve"
            elif p.prefetched:
                plan = "prefetched: reuse"
            elif p.generation.loaded_blocks:
                plan = "resident: reuse"
            else:
                plan = "recompute"
            rows.append(
                [
                    p.label,
                    f"{p.matched}/{p.blocks}",
                    self.name(p.instance),
                    plan,
                    p.generation.loaded_blocks,
                    p.generation.computed_blocks,
                    f"{p.ttft_ms:,.0f} ms" if p.ttft_ms is not None else "-",
                ]
            )
        headers = ["request", "matched", "placed on", "plan", "loaded", "computed", "TTFT"]
        self.console.table(headers, rows)

    # -- the steps ------------------------------------------------------------------------------

    def run(self) -> Figures:
        """Play every step; the figures for the report."""
        from kvsp.demo.failover import run_failover
        from kvsp.demo.moqt_step import run_moqt_prefetch

        self.shared_prefix()
        run_moqt_prefetch(self)
        with StateWatcher(self.client) as watcher:
            self.drain_and_sleep(watcher)
        with StateWatcher(self.client) as watcher:
            run_failover(self, watcher)
        return self.figures

    def shared_prefix(self) -> None:
        """Step 1: the first request computes the system prompt, the next reuse it."""
        n = len(self.system_keys)
        self.console.heading(
            f"1. Requests sharing a {len(self.system)}-token system prompt ({n} blocks) are "
            "placed where the cache is (§6.2 lookup, §6.4 placement)"
        )
        first = self.ask("R1: system prompt A")
        self.await_published(first.instance, self.system_keys)
        self.holder_of_prefix = first.instance
        self.console.line(
            f"{self.name(first.instance)} computed the prompt and published {n} replicas at "
            "the IS (§6.1)"
        )
        second = self.ask("R2: system prompt A")
        third = self.ask("R3: system prompt B", self.other_system)
        self.holder_of_other = third.instance
        self.placement_table([first, second, third])
        for placement in (first, second, third):
            self.file_ttft(placement)

    def file_ttft(self, placement: Placement) -> None:
        ttft = placement.ttft_ms
        if ttft is None:
            return
        g = placement.generation
        if placement.prefetched and g.loaded_blocks:
            self.figures.ttft_prefetched_ms.append(ttft)
        elif g.loaded_blocks:
            self.figures.ttft_cached_ms.append(ttft)
        elif g.computed_blocks:
            self.figures.ttft_recomputed_ms.append(ttft)

    def drain_and_sleep(self, watcher: StateWatcher) -> None:
        """Step 3: drain the instance holding the prefix while a session runs there."""
        target = self.holder_of_prefix
        name = self.name(target)
        self.console.heading(
            f"3. Drain and sleep: {name} drains with a session in flight, the PC places new "
            "work elsewhere (§6.3)"
        )
        session = BackgroundGeneration(
            self.client, target, self.next_prompt(), self.options.drain_tokens
        )
        with session:
            wait_for(session.streaming, 30, f"a session at {name}")
            asked = watcher.now()
            answer = self.client.set_state(target, "draining")
            self.console.line(f"PUT state draining at the PC -> {answer['state']}")
            watcher.note(target, answer["state"], asked)
            watcher.wait_state(target, "draining", 10, after=asked)
            moved = self.ask("R4: system prompt A")
            self.placement_table([moved])
            self.file_ttft(moved)
            refused = self.client.generate(target, self.next_prompt(), 1)
            self.console.line(
                f"a request sent straight to {name} while it drains: {refused.status} "
                f"{refused.problem or ''} (§6.3: MUST NOT accept new ones)"
            )
            total = self.options.drain_tokens
            with self.console.progress("the session in flight there", total) as bar:
                while not session.wait(0.1):
                    bar.set(session.seen)
                bar.set(session.seen)
        done = session.result()
        self.figures.count(done)
        self.console.line(f"the in-flight session completed with {len(done.tokens)} tokens")
        watcher.wait_state(target, "sleeping", 30)
        self.console.line(f"{name} had no session left and went to sleep")
        woken = watcher.now()
        answer = self.client.set_state(target, "active")
        watcher.note(target, answer["state"], woken)
        watcher.wait_state(target, "active", 10, after=woken)
        self.console.line(f"PUT state active at the PC -> {answer['state']}: {name} is woken")
        history = watcher.history(target)
        self.figures.lifecycle.append((f"{name}, drained and woken", history))
        self.console.line(f"{name} at the PC: {states_line(history)}")


class BackgroundGeneration:
    """A ``POST generate`` read on its own thread; :attr:`seen` counts its lines so far."""

    def __init__(
        self, client: DemoClient, instance: str, prompt: Sequence[int], max_tokens: int
    ) -> None:
        self.seen = 0
        self._outcome: list[Generation] = []
        self._thread = threading.Thread(
            target=lambda: self._outcome.append(
                client.generate(instance, prompt, max_tokens, on_line=self._count)
            ),
            name="kvsp-demo-generation",
            daemon=True,
        )

    def _count(self, line: dict[str, object]) -> None:
        self.seen += 1

    def __enter__(self) -> BackgroundGeneration:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:  # on an error or Ctrl-C the cluster's stop ends the stream
            self._thread.join()

    def streaming(self) -> bool | None:
        """True once the instance has sent a line of the answer (the session is admitted and
        running there), None before that.

        Raises:
            RuntimeError: the generation ended without a line (refused, broken) or failed.
        """
        if self.seen:
            return True
        if self.wait(0):
            self.result()  # raises with why when it failed
            raise RuntimeError("the background generation ended before its first line")
        return None

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s``; whether the generation has ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def result(self) -> Generation:
        """The finished generation.

        Raises:
            RuntimeError: it failed or broke off.
        """
        self._thread.join()
        if not self._outcome:
            raise RuntimeError("the background generation raised")
        done = self._outcome[0]
        if done.status != 200 or done.broken or done.problem:
            raise RuntimeError(f"the background generation failed: {done.problem or done.broken}")
        return done

"""Token samplers whose randomness is a pure function of (seed, step) (spec §6.8).

§6.8 restores a sampler "with the given method, parameters, seed, and step". Here the random
draw of step s is ``u = torch.rand`` from a ``torch.Generator`` seeded with the first 8 octets
(top bit cleared) of ``SHA-256("KVSP-SAMPLER-1" || 0x00 || uint64(seed) || uint64(step))``,
so nothing but (seed, step) is state. Selection is done in float64 on the CPU by inverse CDF
over the stably sorted distribution, so a sampler restored at step k makes the same choices as
the uninterrupted run whenever it sees the same logits.

Methods: ``greedy`` (no params; ties go to the lowest id), ``temperature`` (``temperature``),
``top-k`` (``k``, optional ``temperature``), ``top-p`` (``p``, optional ``temperature``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self

import torch

from kvsp.engine.api import SAMPLING_METHODS, check_sampling_param, step_draw
from kvsp.errors import RecordError
from kvsp.fields import Fields

_UINT64 = 2**64 - 1


def step_seed(seed: int, step: int) -> int:
    """The 63-bit ``torch.Generator`` seed of one step: a pure function of (seed, step)."""
    return int.from_bytes(step_draw(seed, step)[:8], "big") & (2**63 - 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampler:
    """A sampling method with its parameters and seed; :meth:`sample` takes the step.

    Raises:
        RecordError: unknown method, unknown or out-of-range parameter, seed not a uint64.
    """

    method: str = "greedy"
    params: Mapping[str, float] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        allowed = SAMPLING_METHODS.get(self.method)
        if allowed is None:
            raise RecordError(f"unknown sampler method {self.method!r}", path="$.method")
        if type(self.seed) is not int or not 0 <= self.seed <= _UINT64:
            raise RecordError("seed must be an integer in 0..2^64-1", path="$.seed")
        for key, value in self.params.items():
            if key not in allowed:
                raise RecordError(f"{self.method}: unknown parameter", path=f"$.params.{key}")
            check_sampling_param(key, value, f"$.params.{key}")
        needed = {"temperature": "temperature", "top-k": "k", "top-p": "p"}.get(self.method)
        if needed is not None and needed not in self.params:
            raise RecordError(f"{self.method} needs {needed}", path=f"$.params.{needed}")

    @property
    def deterministic(self) -> bool:
        """Whether equal logits alone fix the output (§6.8 ``sampler.deterministic`` also
        needs bit-identical logits across instances, which only the deployment can assert)."""
        return self.method == "greedy"

    def uniform(self, step: int) -> float:
        """The step's uniform draw in [0, 1)."""
        generator = torch.Generator(device="cpu").manual_seed(step_seed(self.seed, step))
        return float(torch.rand((), dtype=torch.float64, generator=generator))

    def sample(self, logits: torch.Tensor, step: int) -> int:
        """The token chosen at ``step`` from ``logits [vocab]`` (or ``[1, vocab]``)."""
        scores = logits.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
        if self.method == "greedy":
            return int(torch.argmax(scores))
        probs = torch.softmax(scores / float(self.params.get("temperature", 1.0)), dim=0)
        probs, order = torch.sort(probs, descending=True, stable=True)
        keep = probs.numel()
        if self.method == "top-k":
            keep = min(keep, int(self.params["k"]))
        elif self.method == "top-p":
            # the smallest head of the sorted distribution whose mass reaches p
            cumulative = torch.cumsum(probs, dim=0)
            keep = min(keep, int(torch.searchsorted(cumulative, float(self.params["p"]))) + 1)
        cumulative = torch.cumsum(probs[:keep], dim=0)
        target = self.uniform(step) * float(cumulative[-1])
        index = min(int(torch.searchsorted(cumulative, target, right=True)), keep - 1)
        return int(order[index])

    def checkpoint(self, step: int, *, deterministic: bool = False) -> dict[str, Any]:
        """The Session Checkpoint's ``sampler`` member at ``step`` (§4.4, §6.8).

        ``deterministic`` is the deployment's claim that every eligible instance produces
        bit-identical tokens from this state (e.g. greedy on identical software and hardware).
        """
        return {
            "method": self.method,
            "params": dict(self.params),
            "seed": self.seed,
            "step": step,
            "deterministic": deterministic,
        }

    @classmethod
    def from_checkpoint(cls, obj: object, path: str = "$") -> tuple[Self, int]:
        """Restore (sampler, step) from a checkpoint's ``sampler`` member (§6.8 step 3).

        Raises:
            RecordError: a member is missing or invalid; ``path`` names it.
        """
        f = Fields(obj, path)
        params = f.nested("params", optional=True)
        values: dict[str, float] = {}
        if params is not None:
            for key, value in params.obj.items():
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise RecordError("expected a number", path=params.at(key))
                values[key] = value
        try:
            sampler = cls(
                method=f.string("method"), params=values, seed=f.integer("seed", maximum=_UINT64)
            )
        except RecordError as exc:
            raise RecordError(exc.detail, path=path + (exc.path or "$")[1:]) from None
        return sampler, f.integer("step", maximum=_UINT64)

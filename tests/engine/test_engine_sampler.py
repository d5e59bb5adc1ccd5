"""Samplers restore from (method, params, seed, step) exactly (spec §6.8 step 3)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the reference engine needs the torch extra")
pytest.importorskip("safetensors", reason="the reference engine needs the engine extra")

from kvsp.engine.checkpoint import init_model  # noqa: E402
from kvsp.engine.engine import Engine  # noqa: E402
from kvsp.engine.sampler import Sampler, step_seed  # noqa: E402
from kvsp.errors import RecordError  # noqa: E402

torch.set_num_threads(1)
PROMPT = list(b"The KV cache of a transformer model holds")
SAMPLERS = [
    Sampler(),
    Sampler(method="top-p", params={"p": 0.9}, seed=7),
    Sampler(method="top-p", params={"p": 0.8, "temperature": 1.5}, seed=2**64 - 1),
    Sampler(method="top-k", params={"k": 5, "temperature": 0.7}, seed=3),
    Sampler(method="temperature", params={"temperature": 1.0}, seed=0),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    folder: Path = init_model(
        tmp_path_factory.mktemp("sampler"), seed=3, layers=2, hidden=64, heads=4, kv_heads=2
    )
    return Engine(folder, num_pages=16, block_tokens=8)


@pytest.mark.parametrize("sampler", SAMPLERS, ids=lambda s: s.method)
def test_resume_reproduces_the_tail(engine: Engine, sampler: Sampler) -> None:
    run = list(engine.generate(PROMPT, 14, sampler))
    assert len(run) == 14
    for k in (1, 6, 13):
        restored, step = Sampler.from_checkpoint(sampler.checkpoint(k))
        assert (restored, step) == (sampler, k)
        tail = list(engine.generate(PROMPT, 14 - k, restored, generated=run[:k]))
        assert tail == run[k:]
    assert engine.cache.used_pages == 0


def test_sampling_differs_from_greedy(engine: Engine) -> None:
    greedy = list(engine.generate(PROMPT, 14, Sampler()))
    sampled = list(engine.generate(PROMPT, 14, SAMPLERS[2]))
    assert greedy != sampled  # the restore test above is not vacuous


def test_draws_are_a_pure_function_of_seed_and_step() -> None:
    s = Sampler(method="top-p", params={"p": 0.95}, seed=42)
    draws = [s.uniform(step) for step in range(50)]
    assert draws == [
        Sampler(method="top-p", params={"p": 0.5}, seed=42).uniform(i) for i in range(50)
    ]
    assert len(set(draws)) == 50 and all(0 <= u < 1 for u in draws)
    assert step_seed(42, 3) != step_seed(43, 3) != step_seed(42, 4)
    assert 0 <= step_seed(2**64 - 1, 2**64 - 1) < 2**63


def test_selection_rules() -> None:
    logits = torch.log(torch.tensor([0.05, 0.6, 0.3, 0.05]))
    assert Sampler().sample(logits, 0) == 1
    assert all(
        Sampler(method="top-k", params={"k": 1}, seed=s).sample(logits, 9) == 1 for s in range(20)
    )
    nucleus = {
        Sampler(method="top-p", params={"p": 0.85}, seed=s).sample(logits, 0) for s in range(200)
    }
    assert nucleus == {1, 2}  # 0.6 + 0.3 reaches 0.85; the 0.05 tails never appear
    ties = torch.tensor([1.0, 3.0, 3.0])
    assert Sampler().sample(ties, 0) == 1  # greedy ties go to the lowest id


@pytest.mark.parametrize(
    ("obj", "path"),
    [
        ({"method": "beam", "seed": 1, "step": 0}, "$.method"),
        ({"method": "top-p", "params": {}, "seed": 1, "step": 0}, "$.params.p"),
        ({"method": "top-p", "params": {"p": 1.5}, "seed": 1, "step": 0}, "$.params.p"),
        ({"method": "top-k", "params": {"k": 2.5}, "seed": 1, "step": 0}, "$.params.k"),
        ({"method": "greedy", "params": {"p": 0.5}, "seed": 1, "step": 0}, "$.params.p"),
        ({"method": "greedy", "seed": -1, "step": 0}, "$.seed"),
        ({"method": "greedy", "seed": 1}, "$.step"),
        ({"method": "top-p", "params": {"p": "0.9"}, "seed": 1, "step": 0}, "$.params.p"),
    ],
)
def test_bad_checkpoints_name_the_member(obj: dict[str, object], path: str) -> None:
    with pytest.raises(RecordError) as info:
        Sampler.from_checkpoint(obj)
    assert info.value.path == path


def test_checkpoint_member_shape() -> None:
    s = Sampler(method="top-p", params={"p": 0.9}, seed=7)
    assert s.checkpoint(3) == {
        "method": "top-p",
        "params": {"p": 0.9},
        "seed": 7,
        "step": 3,
        "deterministic": False,
    }
    assert Sampler().deterministic and not s.deterministic

"""The torch reference engine behind the instance agent (DESIGN.md §5–6; an
:class:`~kvsp.engine.api.InferenceEngine`).

:class:`TorchEngine` is the shared :class:`~kvsp.engine.adapter.CoreEngine` over
:class:`kvsp.engine.engine.Engine`: loaded containers (verified by the agent against their
Replica Records, §6.7) go into fresh KV pages, the engine computes the rest of the prompt with
the loaded pages as its prefix, and the complete blocks it computed come back as KVB1
containers for the agent to publish (§4.3, §6.1). A session resumed at ``output_offset``
(§6.8) loads the checkpoint's blocks, computes the rest of the prompt in the same
position-aligned chunks as the original prefill and replays the output tokens by single decode
steps, as the original run computed them, so on one machine the logits and the tokens are
bit-identical. The rates in :meth:`TorchEngine.stats` are the engine's measured tokens per
second and its KV pages in use.

Threading is the toy engine's: the one engine thread of :mod:`kvsp.engine.worker` owns the
model and the paged cache (see :mod:`kvsp.engine.adapter`).

torch is imported only by this module and the torch engine's own submodules of
:mod:`kvsp.engine`; nothing imports this module unless ``--engine reference`` is chosen.
"""

from __future__ import annotations

from pathlib import Path

from kvsp.engine.adapter import CoreEngine, CoreSequence

TorchSequence = CoreSequence
"""One prompt in the reference engine (an :class:`~kvsp.engine.api.EngineSequence`)."""


class TorchEngine(CoreEngine):
    """The reference engine behind the instance agent.

    Raises:
        CheckpointError: the model folder cannot be loaded.
        BadRequest: an unsupported ``kv_dtype`` or ``dtype``.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        num_pages: int = 1024,
        block_tokens: int = 16,
        kv_dtype: str = "fp32",
        dtype: str = "fp32",
        prefill_chunk: int | None = None,
        held_blocks: int | None = None,
    ) -> None:
        from kvsp.engine.engine import Engine

        engine = Engine(
            model_dir,
            device=device,
            num_pages=num_pages,
            block_tokens=block_tokens,
            kv_dtype=kv_dtype,
            dtype=dtype,
            prefill_chunk=prefill_chunk,
        )
        super().__init__(
            engine,
            vocab=engine.config.vocab_size,
            held_blocks=held_blocks if held_blocks is not None else num_pages,
            thread_name="kvsp-torch-engine",
        )

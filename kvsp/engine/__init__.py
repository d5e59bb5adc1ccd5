"""The engines an inference instance drives (DESIGN.md §1, §5–6): the interface, a toy engine,
the torch reference engine with paged KV buffers and device sinks, and any Hugging Face
transformers decoder-only checkpoint.

torch is an optional extra, so this package file imports nothing. :mod:`kvsp.engine.api`
(the interface), :mod:`kvsp.engine.worker` (the one engine thread) and :mod:`kvsp.engine.toy`
(the deterministic CPU engine) run without it; so do ``config``, ``tokenizer`` and ``shards``
(numpy only). :mod:`kvsp.engine.reference` adapts the torch engine built from:

* :mod:`kvsp.engine.config` — ``config.json`` of a Llama checkpoint, its §4.1 ``positional``;
* :mod:`kvsp.engine.tokenizer` — the byte-level tokenizer and its definition file;
* :mod:`kvsp.engine.checkpoint` — load any Llama checkpoint, write a small seeded one, and
  build its Compatibility Descriptor from the real files (§4.1);
* :mod:`kvsp.engine.rope`, :mod:`kvsp.engine.model` — RoPE and the decoder;
* :mod:`kvsp.engine.kvcache` — the paged KV tensor and per-(page, layer) readiness;
* :mod:`kvsp.engine.sink` — :class:`DeviceSink` and the verifying block loaders (§4.3, §6.7);
* :mod:`kvsp.engine.blocks` — pages out as KVB1 containers and back in;
* :mod:`kvsp.engine.sampler` — samplers restorable from (method, params, seed, step) (§6.8);
* :mod:`kvsp.engine.engine` — the :class:`Engine` facade.

:mod:`kvsp.engine.adapter` is what both torch engines share behind the instance agent (the
engine thread, sampling, held blocks, resume); :mod:`kvsp.engine.transformers_engine` runs a
transformers ``AutoModelForCausalLM`` on it, with :mod:`kvsp.engine.hf_checkpoint` describing
the checkpoint's files (§4.1) and refusing what it would describe wrongly.
"""

"""Loading Llama-family checkpoints and describing them (spec §4.1 digests over real files)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the reference engine needs the torch extra")
pytest.importorskip("safetensors", reason="the reference engine needs the engine extra")

from safetensors.torch import load_file, save_file  # noqa: E402

from kvsp.compat import compat_id  # noqa: E402
from kvsp.engine.checkpoint import descriptor_for, init_model, weight_files  # noqa: E402
from kvsp.engine.config import CheckpointError, RopeScaling, read_config  # noqa: E402
from kvsp.engine.engine import Engine  # noqa: E402
from kvsp.engine.tokenizer import ByteTokenizer, load_tokenizer  # noqa: E402
from kvsp.errors import BadRequest  # noqa: E402

torch.set_num_threads(1)
LLAMA3 = RopeScaling(
    kind="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
SMALL = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2}


def _sharded(folder: Path) -> Path:
    return init_model(folder, seed=9, shards=3, rope_theta=500000.0, rope_scaling=LLAMA3, **SMALL)


def test_sharded_llama3_checkpoint_loads(tmp_path: Path) -> None:
    folder = _sharded(tmp_path)
    files = weight_files(folder)
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert (folder / "model.safetensors.index.json").is_file()
    engine = Engine(folder, num_pages=8, block_tokens=4)
    d = engine.descriptor
    assert d.positional == "rope;factor=8;scaling=llama3;theta=500000"
    assert (d.layers, d.kv_heads, d.head_dim, d.kv_dtype, d.block_tokens) == (2, 2, 16, "fp32", 4)
    # §4.1: weight files concatenated in ascending byte order of their names
    joined = b"".join(f.read_bytes() for f in sorted(files, key=lambda p: p.name.encode()))
    assert d.model_digest == hashlib.sha256(joined).digest()
    assert d.tokenizer_digest == hashlib.sha256((folder / "tokenizer.json").read_bytes()).digest()
    assert d.model == "kvsp-tiny-llama-s9-l2-h64"
    assert engine.model.rope.scaling == LLAMA3
    seq = engine.new_sequence()
    logits = engine.prefill(seq, list(b"hello, world"))
    assert logits.shape == (259,) and torch.isfinite(logits).all()


def test_init_model_is_reproducible(tmp_path: Path) -> None:
    a = descriptor_for(init_model(tmp_path / "a", seed=1, **SMALL))
    b = descriptor_for(init_model(tmp_path / "b", seed=1, **SMALL))
    c = descriptor_for(init_model(tmp_path / "c", seed=2, **SMALL))
    assert a == b and compat_id(a) == compat_id(b)
    assert a.model_digest != c.model_digest
    assert descriptor_for(tmp_path / "a", kv_dtype="bf16").kv_dtype == "bf16"


def test_tied_embeddings_and_bf16_weights(tmp_path: Path) -> None:
    folder = init_model(tmp_path, seed=4, tie_embeddings=True, weights_dtype="bf16", **SMALL)
    assert "lm_head.weight" not in load_file(str(folder / "model.safetensors"))
    engine = Engine(folder, num_pages=4, block_tokens=4)
    assert engine.model.weights.lm_head is engine.model.weights.embed


def _config(folder: Path) -> dict[str, object]:
    obj: dict[str, object] = json.loads((folder / "config.json").read_text())
    return obj


def _write_config(folder: Path, obj: object) -> None:
    (folder / "config.json").write_text(json.dumps(obj))


@pytest.mark.parametrize(
    ("change", "path"),
    [
        ({"hidden_size": None}, "$.hidden_size"),
        ({"hidden_size": "64"}, "$.hidden_size"),
        ({"num_hidden_layers": 0}, "$.num_hidden_layers"),
        ({"num_key_value_heads": 3}, "$.num_key_value_heads"),
        ({"rope_theta": -1}, "$.rope_theta"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "$.rope_scaling.rope_type"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "$.rope_scaling.low_freq_factor",
        ),
        ({"tie_word_embeddings": "yes"}, "$.tie_word_embeddings"),
        ({"head_dim": 15}, "$.head_dim"),
    ],
)
def test_malformed_config_names_file_and_key(
    tmp_path: Path, change: dict[str, object], path: str
) -> None:
    folder = init_model(tmp_path, seed=1, **SMALL)
    obj = _config(folder)
    for key, value in change.items():
        if value is None:
            del obj[key]
        else:
            obj[key] = value
    _write_config(folder, obj)
    with pytest.raises(CheckpointError) as info:
        Engine(folder, num_pages=4, block_tokens=4)
    assert isinstance(info.value, BadRequest)
    assert info.value.path == path
    assert "config.json" in str(info.value)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""])
def test_config_that_is_not_an_object(tmp_path: Path, text: str) -> None:
    folder = init_model(tmp_path, seed=1, **SMALL)
    (folder / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match="config.json"):
        read_config(folder)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="config.json"):
        read_config(tmp_path)


def test_missing_tensor_names_it(tmp_path: Path) -> None:
    folder = _sharded(tmp_path)
    shard = folder / "model-00002-of-00003.safetensors"
    tensors = load_file(str(shard))
    victim = sorted(tensors)[0]
    del tensors[victim]
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError) as info:
        Engine(folder, num_pages=4, block_tokens=4)
    assert info.value.path == victim and victim in str(info.value)


def test_untied_checkpoint_without_lm_head(tmp_path: Path) -> None:
    folder = init_model(tmp_path, seed=1, **SMALL)
    obj = _config(folder)
    obj["tie_word_embeddings"] = False
    _write_config(folder, obj)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        Engine(folder, num_pages=4, block_tokens=4)
    assert info.value.path == "lm_head.weight"


def test_misshapen_tensor_names_file_and_tensor(tmp_path: Path) -> None:
    folder = init_model(tmp_path, seed=1, **SMALL)
    obj = _config(folder)
    obj["intermediate_size"] = 96
    _write_config(folder, obj)
    with pytest.raises(CheckpointError) as info:
        Engine(folder, num_pages=4, block_tokens=4)
    assert info.value.path == "model.layers.0.mlp.gate_proj.weight"
    assert "model.safetensors" in str(info.value) and "(96, 64)" in str(info.value)


def test_bad_weight_files(tmp_path: Path) -> None:
    folder = init_model(tmp_path, seed=1, **SMALL)
    (folder / "model.safetensors").rename(folder / "weights.bin")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        Engine(folder, num_pages=4, block_tokens=4)
    (folder / "broken.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="broken.safetensors"):
        Engine(folder, num_pages=4, block_tokens=4)


def test_duplicate_tensor_across_shards(tmp_path: Path) -> None:
    folder = _sharded(tmp_path)
    first = load_file(str(folder / "model-00001-of-00003.safetensors"))
    name = sorted(first)[0]
    save_file({name: first[name]}, str(folder / "model-00004-of-00003.safetensors"))
    with pytest.raises(CheckpointError) as info:
        Engine(folder, num_pages=4, block_tokens=4)
    assert info.value.path == name


def test_byte_tokenizer(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    ids = tok.encode("héllo", bos=True)
    assert ids[0] == tok.bos and tok.decode(ids) == "héllo".encode()
    assert tok.decode([tok.eos, 104, tok.pad]) == b"h"
    with pytest.raises(ValueError):
        tok.decode([259])
    tok.save(tmp_path)
    assert load_tokenizer(tmp_path) == tok
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_engine_package_imports_without_torch() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import kvsp.engine, kvsp.engine.config, kvsp.engine.tokenizer\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr

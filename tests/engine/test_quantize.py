"""Quantization: convert → load round trip, accuracy against float32, the published MLX 8-bit
layout, per-layer overrides, strict errors, and the activation dtype over quantized weights."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest

from salabatch.engine.cache import LightningCache
from salabatch.engine.checkpoint import read_weights, write_weights
from salabatch.engine.load import load_model
from salabatch.engine.quantize import convert, quantize_model
from salabatch.engine.tokenizer_files import TOKENIZER_FILES
from salabatch.errors import CheckpointError, ConfigError, OutputError
from tests.tiny import tiny_config_dict, write_tiny_checkpoint

# Relative RMS of the logits against float32, by bits.
# 8 bits: the 2%; measured 1.2-1.4% over 8 seeds (bf16 scales), 0.9% with float32 scales.
# 4 bits: the issue asks 8%, which affine 4-bit cannot reach on these weights: min-max rounding
# of a Gaussian group of 64 leaves 9.1% RMS weight error, so lm_head alone gives 9.1% logit error
# (8.2% at group size 32) and the layers add theirs. Measured 14.5-15.6% over 8 seeds.
REL_RMS = {8: 0.02, 4: 0.20}
GREEDY_AGREEMENT_8BIT = 0.9
PROMPT = mx.array([[(7 * i + 3) % 256 for i in range(8)]], dtype=mx.int32)
IDS = mx.array([[(5 * i + 1) % 256 for i in range(40)]], dtype=mx.int32)
LINEARS = 4 * 8 + 1  # 8 per layer (q k v o + o_gate or z_proj, 3 MLP) and lm_head


def rel_rms(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.sqrt(mx.mean((a - b) ** 2)) / mx.sqrt(mx.mean(b**2))).item()


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """The tiny float32 checkpoint with (placeholder) tokenizer and generation files."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("q") / "src")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (path / name).write_text('{"placeholder": true}\n')
    return path


@pytest.fixture(scope="module")
def converted(src):
    """bits → (checkpoint dir, convert summary), with the default bf16 scales."""
    out = {}
    for bits in (8, 4):
        dst = src.parent / f"q{bits}"
        out[bits] = dst, convert(src, dst, bits=bits, progress=False)
    return out


@pytest.fixture(scope="module")
def reference(src):
    return load_model(src, dtype="float32")


@pytest.mark.parametrize("bits", [8, 4])
def test_logits_within_tolerance_of_float32(converted, reference, bits):
    model = load_model(converted[bits][0], dtype="float32")
    err = rel_rms(model(IDS), reference(IDS))
    print(f"{bits}-bit logits: relative RMS {err:.4f} vs float32")
    assert err < REL_RMS[bits]


def test_greedy_choices_agree_at_8_bits(converted, reference):
    """The 8-bit model's greedy choice at each of 32 decode steps along float32's greedy
    continuation. Both are fed float32's tokens: a random model's top-2 logits are often near
    ties, and one early flip would make two free-running continuations unrelated."""
    model = load_model(converted[8][0], dtype="float32")
    ref_cache, q_cache = reference.make_cache(), model.make_cache()
    ref_logits, q_logits = reference(PROMPT, ref_cache), model(PROMPT, q_cache)
    agree = []
    for _ in range(32):
        tok = mx.argmax(ref_logits[:, -1], axis=-1)
        agree.append(tok.item() == mx.argmax(q_logits[:, -1], axis=-1).item())
        ref_logits, q_logits = reference(tok[:, None], ref_cache), model(tok[:, None], q_cache)
    print(f"8-bit greedy agreement {sum(agree) / len(agree):.3f}")
    assert sum(agree) / len(agree) >= GREEDY_AGREEMENT_8BIT


def test_free_running_greedy_generation_agrees_at_8_bits(converted, reference):
    """convert → load → generate: 32 greedy tokens from the 8-bit model, each run on its own,
    against float32's (the literal reading; the test above isolates per-step choices)."""
    from salabatch.engine.generate import Generator, Request

    request = Request("r", tuple(PROMPT[0].tolist()), max_tokens=32)
    model = load_model(converted[8][0], dtype="float32")
    (ref,) = Generator(reference, batch_size=1).generate([request])
    (got,) = Generator(model, batch_size=1).generate([request])
    same = sum(a == b for a, b in zip(ref.tokens, got.tokens, strict=True)) / 32
    print(f"8-bit free-running greedy agreement {same:.3f}")
    assert len(got.tokens) == 32 and same >= GREEDY_AGREEMENT_8BIT


def test_convert_round_trip(src, converted):
    for bits, (dst, summary) in converted.items():
        print(f"{bits}-bit: {summary['bytes_after']} bytes, {summary['ratio']:.3f} of float32")
        assert summary["quantized"] == LINEARS
        assert summary["kept"] == len(read_weights(src)) - LINEARS
        assert summary["ratio"] < {8: 0.35, 4: 0.25}[bits]  # embeddings stay bf16 in both
        assert summary["copied"] == [n for n in TOKENIZER_FILES if (src / n).is_file()]
        assert len(summary["copied"]) == 3
        for name in summary["copied"]:
            assert (dst / name).read_text() == (src / name).read_text()
        raw = json.loads((dst / "config.json").read_text())
        assert raw["quantization"] == {"group_size": 64, "bits": bits}
        model = load_model(dst, dtype="float32")
        assert isinstance(model.lm_head, nn.QuantizedLinear) and model.lm_head.bits == bits
        assert type(model.model.embed_tokens) is nn.Embedding  # full precision
        cache = model.make_cache()  # generate: prefill, then 4 greedy steps
        tok = mx.argmax(model(PROMPT, cache)[:, -1], axis=-1)
        for _ in range(4):
            tok = mx.argmax(model(tok[:, None], cache)[:, -1], axis=-1)
        assert 0 <= tok.item() < 256


def test_sharded_output_loads_like_one_file(src, converted):
    one = load_model(converted[8][0], dtype="float32")
    dst = src.parent / "q8-sharded"
    summary = convert(src, dst, bits=8, max_shard_bytes=40_000, progress=False)
    assert len(summary["files"]) > 1 and (dst / "model.safetensors.index.json").is_file()
    assert mx.array_equal(load_model(dst, dtype="float32")(IDS), one(IDS))


def test_quantize_model_matches_convert(src, reference):
    """In-memory quantization (the benchmark's) gives the same model as convert → load."""
    dst = src.parent / "q4-f32"
    convert(src, dst, bits=4, dtype="float32", progress=False)
    model = load_model(src, dtype="float32")
    assert quantize_model(model, bits=4, group_size=64) == LINEARS
    assert mx.array_equal(model(IDS), load_model(dst, dtype="float32")(IDS))


def test_quantizing_a_loaded_model_quantizes_its_decode_step(src, monkeypatch):
    """A loaded model's decode step runs fused buffers of its projections; quantizing it in
    memory fuses the quantized layers again (the step kept the float weights: logits 0.04
    off on the GPU path)."""
    from salabatch.engine.decode import decode

    monkeypatch.setenv("SALABATCH_GPU_PATH", "1")  # where the step takes the fused buffers
    model = load_model(src, dtype="float32")
    assert model.is_fused
    quantize_model(model, bits=4, group_size=64)
    assert model.is_fused
    token = IDS[:, 30]
    per_layer, stepped = model.make_cache(), model.make_cache()
    model(IDS[:, :30], per_layer)
    model(IDS[:, :30], stepped)
    want = model(token[:, None], per_layer)[:, -1]
    assert mx.allclose(decode(model, token, stepped), want, atol=1e-5, rtol=0).item()


@pytest.mark.parametrize(("bits", "group_size"), [(2, 32), (3, 64), (5, 64), (6, 128)])
def test_other_bit_widths_and_group_sizes_load_and_run(src, tmp_path, bits, group_size):
    """Every bit width MLX packs converts, loads and generates; convert → load equals quantizing
    in memory. Group size 128 leaves the linears with 64 inputs (all but down_proj) as they are."""
    dst = tmp_path / f"q{bits}"
    summary = convert(src, dst, bits=bits, group_size=group_size, dtype="float32", progress=False)
    model = load_model(dst, dtype="float32")
    layers = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert len(layers) == summary["quantized"] == (4 if group_size == 128 else LINEARS)
    assert all(m.bits == bits and m.group_size == group_size for m in layers)
    in_memory = load_model(src, dtype="float32")
    quantize_model(in_memory, bits=bits, group_size=group_size)
    logits = model(IDS)
    assert mx.array_equal(logits, in_memory(IDS)) and mx.isfinite(logits).all().item()
    cache = model.make_cache()  # generate: prefill, then 4 greedy steps
    tok = mx.argmax(model(PROMPT, cache)[:, -1], axis=-1)
    for _ in range(4):
        tok = mx.argmax(model(tok[:, None], cache)[:, -1], axis=-1)
    assert 0 <= tok.item() < 256


def test_head_bits_give_lm_head_its_own_width(src, converted, reference, tmp_path):
    """`head_bits`: lm_head at 8 bits, the rest at 4, listed per module as mlx-lm's mixed
    checkpoints list it; it loads as written and lies between plain 4-bit and 8-bit."""
    dst = tmp_path / "q4h8"
    summary = convert(src, dst, bits=4, head_bits=8, progress=False)
    raw = json.loads((dst / "config.json").read_text())
    assert raw["quantization"] == {
        "group_size": 64,
        "bits": 4,
        "lm_head": {"group_size": 64, "bits": 8},
    }
    assert summary["quantized"] == LINEARS and (summary["bits"], summary["head_bits"]) == (4, 8)
    model = load_model(dst, dtype="float32")
    bits = {p: m.bits for p, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert bits.pop("lm_head") == 8 and set(bits.values()) == {4} and len(bits) == LINEARS - 1
    q4, q8 = (load_model(converted[b][0], dtype="float32") for b in (4, 8))
    err = {
        name: rel_rms(m(IDS), reference(IDS)) for name, m in [("4", q4), ("4h8", model), ("8", q8)]
    }
    print(f"logit relative RMS vs float32: {err}")
    assert err["8"] < err["4h8"] < err["4"]
    with pytest.raises(ConfigError, match="bit width"):
        convert(src, tmp_path / "bad", bits=4, head_bits=7, progress=False)


def test_convert_refuses_to_overwrite(src, converted, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    with pytest.raises(OutputError, match="not empty"):
        convert(src, dst, bits=8, progress=False)
    convert(src, dst, bits=8, force=True, progress=False)  # and removes the stale shard
    assert sorted(p.name for p in dst.glob("*.safetensors")) == ["model.safetensors"]
    with pytest.raises(OutputError, match="is the source"):
        convert(src, src, bits=8, force=True, progress=False)
    # an output path that cannot be used is bad input (exit 2), as everywhere: it was exit 1,
    # under a file after the whole conversion with "is the disk full?"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputError, match="is not a directory") as e:
        convert(src, tmp_path / "afile", bits=8, progress=False)
    assert e.value.exit_code == 2
    with pytest.raises(OutputError, match="afile is a file"):
        convert(src, tmp_path / "afile" / "sub" / "q8", bits=8, progress=False)
    with pytest.raises(CheckpointError, match="already quantized"):
        convert(converted[8][0], tmp_path / "again", bits=4, progress=False)


def test_a_full_disk_leaves_no_partial_checkpoint(src, tmp_path, monkeypatch):
    """MLX's writer fails with a bare RuntimeError naming no file, and left a partial shard
    that made the next convert refuse DST as not empty."""
    from salabatch.engine import quantize

    def full(path, weights, max_shard_bytes=None):
        path.mkdir(parents=True, exist_ok=True)
        (path / "model.safetensors").write_bytes(b"\0" * 1000)
        raise RuntimeError("[write] Unable to write 1335 bytes to file.")

    dst = tmp_path / "full"
    monkeypatch.setattr(quantize, "write_weights", full)
    with pytest.raises(CheckpointError, match="is the disk full") as info:
        convert(src, dst, bits=8, progress=False)
    assert str(dst) in str(info.value) and list(dst.iterdir()) == []
    monkeypatch.undo()
    assert convert(src, dst, bits=8, progress=False)["quantized"] > 0  # no --force needed


def test_force_leaves_exactly_the_new_checkpoint(src, tmp_path):
    """--force over an older checkpoint removes its tokenizer-side files the source lacks (a
    stale generation_config.json would add stop ids, a stale chat_template.jinja replace the
    template) along with its weights; files that are no checkpoint's stay."""
    dst = tmp_path / "out"
    dst.mkdir()
    stale = ("generation_config.json", "chat_template.jinja", "special_tokens_map.json")
    for name in (*stale, "model.safetensors.index.json", "model-00002-of-00002.safetensors"):
        (dst / name).write_text("{}")
    (dst / "NOTES.md").write_text("mine")
    source = tmp_path / "src"
    shutil.copytree(src, source)
    (source / "generation_config.json").unlink()
    summary = convert(source, dst, bits=8, force=True, progress=False)
    assert summary["copied"] == ["tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in dst.iterdir()) == [
        "NOTES.md",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def published_layout(src, path, quantized_as=lambda name: (64, 8), overrides=None):
    """A checkpoint laid out like the published MLX 8-bit model (SPEC §7.3): every linear incl.
    lm_head as uint32 `.weight` + bf16 `.scales` / `.biases` under HF names, embeddings and norms
    in bf16, one model.safetensors; `quantized_as(module)` gives (group, bits) or None."""
    out = {}
    for name, w in read_weights(src).items():
        module = name.removesuffix(".weight")
        spec = None if "embed_tokens" in name or "norm" in name else quantized_as(module)
        if w.ndim == 2 and spec is not None:
            q, scales, biases = mx.quantize(w.astype(mx.bfloat16), *spec)
            out |= {name: q, f"{module}.scales": scales, f"{module}.biases": biases}
        else:
            out[name] = w.astype(mx.bfloat16)
    write_weights(path, out)
    raw = tiny_config_dict()
    raw["quantization"] = {"group_size": 64, "bits": 8, **(overrides or {})}
    raw["quantization_config"] = raw["quantization"]
    (path / "config.json").write_text(json.dumps(raw))
    return path


def test_published_8bit_layout_loads(src, reference, tmp_path):
    path = published_layout(src, tmp_path / "mlx-8bit")
    weights = read_weights(path)
    assert weights["lm_head.weight"].dtype == mx.uint32
    assert weights["lm_head.weight"].shape == (256, 64 * 8 // 32)
    assert weights["lm_head.scales"].shape == (256, 1)
    model = load_model(path, dtype="float32")
    assert rel_rms(model(IDS), reference(IDS)) < REL_RMS[8]


def test_per_layer_overrides(src, reference, tmp_path):
    down, z = "model.layers.1.mlp.down_proj", "model.layers.2.self_attn.z_proj"
    specs = {down: (32, 4), z: None}
    path = published_layout(
        src,
        tmp_path / "mixed",
        lambda module: specs.get(module, (64, 8)),
        {down: {"group_size": 32, "bits": 4}, z: False},
    )
    model = load_model(path, dtype="float32")
    layers = model.model.layers
    assert (layers[1].mlp.down_proj.group_size, layers[1].mlp.down_proj.bits) == (32, 4)
    assert not isinstance(layers[2].self_attn.z_proj, nn.QuantizedLinear)  # kept full precision
    assert layers[0].mlp.down_proj.bits == 8
    assert rel_rms(model(IDS), reference(IDS)) < REL_RMS[4]  # one 4-bit layer adds ~2.5%


def test_missing_scales_and_wrong_shapes_are_named(converted, tmp_path):
    dst = converted[8][0]
    weights = read_weights(dst)
    del weights["model.layers.0.self_attn.q_proj.scales"]
    weights["model.layers.3.mlp.up_proj.biases"] = mx.zeros((128, 2), dtype=mx.bfloat16)
    bad = tmp_path / "bad"
    write_weights(bad, weights)
    (bad / "config.json").write_text((dst / "config.json").read_text())
    with pytest.raises(CheckpointError) as e:
        load_model(bad)
    assert e.value.missing == ["model.layers.0.self_attn.q_proj.scales"]
    assert e.value.mismatched == ["model.layers.3.mlp.up_proj.biases (128, 2) != (128, 1)"]
    assert "model.layers.0.self_attn.q_proj.scales" in str(e.value)


def test_packed_weights_and_scales_of_the_wrong_dtype_are_named(converted, tmp_path):
    """A quantized layer keeps its packed uint32 `.weight` and float scales/biases; a packed
    weight stored as int32, or scales stored as ints, are refused by name."""
    dst = converted[8][0]
    weights = read_weights(dst)
    q_proj = "model.layers.0.self_attn.q_proj"
    weights[f"{q_proj}.weight"] = weights[f"{q_proj}.weight"].astype(mx.int32)
    weights[f"{q_proj}.scales"] = weights[f"{q_proj}.scales"].astype(mx.uint32)
    bad = tmp_path / "bad"
    write_weights(bad, weights)
    (bad / "config.json").write_text((dst / "config.json").read_text())
    with pytest.raises(CheckpointError) as e:
        load_model(bad)
    assert e.value.path == str(bad / "model.safetensors")
    assert f"{q_proj}.weight is int32 (expected uint32)" in str(e.value)
    assert f"{q_proj}.scales is uint32 (expected a floating dtype)" in str(e.value)


def test_bf16_activations_keep_lightning_state_float32(converted):
    model = load_model(converted[8][0], dtype="bfloat16")
    assert model.lm_head.scales.dtype == mx.bfloat16
    cache = model.make_cache()
    logits = model(PROMPT, cache)
    logits = model(mx.argmax(logits[:, -1:], axis=-1), cache)
    assert logits.dtype == mx.bfloat16
    states = [c.state for c in cache if isinstance(c, LightningCache)]
    assert len(states) == 2 and all(s.dtype == mx.float32 for s in states)


def test_quantized_embeddings_load(src, reference, tmp_path):
    """mlx-lm quantizes embeddings too: their `.scales` make a QuantizedEmbedding."""
    path = published_layout(src, tmp_path / "q-embed")
    weights = read_weights(path)
    w = read_weights(src)["model.embed_tokens.weight"].astype(mx.bfloat16)
    q, scales, biases = mx.quantize(w, 64, 8)
    module = "model.embed_tokens"
    weights |= {f"{module}.weight": q, f"{module}.scales": scales, f"{module}.biases": biases}
    write_weights(path, weights)
    model = load_model(path, dtype="float32")
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert rel_rms(model(IDS), reference(IDS)) < REL_RMS[8]


def test_quantization_config_errors_are_named(src, tmp_path):
    lm_head = "quantization.lm_head"
    path = published_layout(src, tmp_path / "conflict", overrides={"lm_head": False})
    with pytest.raises(CheckpointError, match=f"{lm_head} = false"):
        load_model(path)
    path = published_layout(src, tmp_path / "bad-entry", overrides={"lm_head": {"bits": 7}})
    with pytest.raises(ConfigError, match=lm_head):
        load_model(path)
    path = published_layout(src, tmp_path / "mxfp4", overrides={"mode": "mxfp4"})
    with pytest.raises(ConfigError, match="quantization.mode"):
        load_model(path)
    with pytest.raises(ConfigError, match="bits"):
        convert(src, tmp_path / "q7", bits=7, progress=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_quantized_checkpoint_is_counted_as_it_loads(converted, dtype):
    """The dry run's weights (`memory.checkpoint_weights_bytes`, from the safetensors headers
    alone) are what loading takes: bf16 scales and unquantized tensors load in the model's
    dtype (their file sizes were ~20 % under a float32 load)."""
    from salabatch.engine import memory
    from salabatch.engine.config import ModelConfig

    path = converted[4][0]
    model = load_model(path, dtype=dtype)
    cfg = ModelConfig.from_file(path / "config.json")
    counted = memory.checkpoint_weights_bytes(path, cfg, model.dtype.size)
    assert counted == memory.weights_bytes(model)


def test_the_count_takes_what_loading_reads_and_keeps(src, tmp_path):
    """The index's shards only (not a stray file beside them), less what `Model.sanitize`
    drops (a rotary buffer); a header that is no header counts its file's size, never a
    crash or a negative figure."""
    import struct

    from salabatch.engine import memory
    from salabatch.engine.config import ModelConfig

    sharded = tmp_path / "sharded"
    convert(src, sharded, bits=8, max_shard_bytes=20_000, progress=False)
    shutil.copy(sorted(sharded.glob("model-*.safetensors"))[0], sharded / "stray.safetensors")
    buffered = tmp_path / "buffered"
    convert(src, buffered, bits=8, progress=False)
    weights = read_weights(buffered)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = mx.zeros((4,), mx.float32)
    write_weights(buffered, weights)
    for path in (sharded, buffered):
        counted = memory.checkpoint_weights_bytes(
            path, ModelConfig.from_file(path / "config.json"), 4
        )
        assert counted == memory.weights_bytes(load_model(path, dtype="float32")), path.name
    headers = [
        b"[" * 100_000,
        b'{"a": {"dtype": "U32", "shape": [-5, 4]}}',
        b'{"a": {"dtype": "F32", "shape": [1.5]}}',
        b"not json",
    ]
    for i, header in enumerate(headers):
        file = tmp_path / f"bad{i}.safetensors"
        file.write_bytes(struct.pack("<Q", len(header)) + header)
        assert memory._loaded_bytes(file, 4, lambda names: names) == file.stat().st_size

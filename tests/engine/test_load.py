"""Checkpoint loading: single file, HF shards + index, strict errors naming tensors."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from salabatch.engine.checkpoint import read_weights, write_weights
from salabatch.engine.load import check_checkpoint, load_model
from salabatch.errors import CheckpointError, ConfigError
from tests.tiny import write_tiny_checkpoint

IDS = mx.array([[5, 9, 17, 33, 65, 129]], dtype=mx.int32)


def test_two_shards_load_like_one_file(tmp_path, tiny_dir):
    weights = read_weights(tiny_dir)
    sharded = tmp_path / "sharded"
    total = sum(w.nbytes for w in weights.values())
    files = write_weights(sharded, weights, max_shard_bytes=total // 2 + 1)
    assert len(files) >= 2
    (sharded / "config.json").write_text((tiny_dir / "config.json").read_text())
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(weights)
    a = load_model(tiny_dir, dtype="float32")(IDS)
    b = load_model(sharded, dtype="float32")(IDS)
    assert mx.array_equal(a, b)


def test_missing_unexpected_and_misshaped_tensors_are_named(tmp_path, tiny_dir):
    weights = read_weights(tiny_dir)
    del weights["model.layers.1.self_attn.z_proj.weight"]
    weights["model.layers.0.self_attn.q_norm.weight"] = mx.ones((8,))
    weights["model.layers.2.mlp.up_proj.weight"] = mx.zeros((128, 63))
    bad = tmp_path / "bad"
    write_weights(bad, weights)
    (bad / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(CheckpointError) as e:
        load_model(bad)
    assert e.value.missing == ["model.layers.1.self_attn.z_proj.weight"]
    assert e.value.unexpected == ["model.layers.0.self_attn.q_norm.weight"]
    assert e.value.mismatched[0].startswith("model.layers.2.mlp.up_proj.weight (128, 63)")
    assert "model.layers.1.self_attn.z_proj.weight" in str(e.value)


def test_tensors_of_the_wrong_dtype_are_named_with_their_file(tmp_path, tiny_dir):
    """A float parameter stored as int32 (or bool) would load as such and run silently: loading
    and validate refuse it, naming the tensor, the dtype it needs and the file that holds it."""
    weights = read_weights(tiny_dir)
    weights["model.norm.weight"] = weights["model.norm.weight"].astype(mx.int32)
    bad = write_tiny_checkpoint(tmp_path / "one")
    write_weights(bad, weights)
    with pytest.raises(CheckpointError) as e:
        load_model(bad)
    assert e.value.path == str(bad / "model.safetensors")
    assert str(e.value).endswith("model.norm.weight is int32 (expected a floating dtype)")
    assert check_checkpoint(bad).problems[0] == str(e.value)

    first = "model.embed_tokens.weight"  # the first tensor of the first shard
    weights[first] = mx.zeros(weights[first].shape, dtype=mx.bool_)
    total = sum(w.nbytes for w in weights.values())
    files = write_weights(tmp_path / "shards", weights, max_shard_bytes=total // 2 + 1)
    (tmp_path / "shards" / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path / "shards")
    assert e.value.path == str(tmp_path / "shards")
    assert f"{first} in {files[0].name} is bool (expected a floating dtype)" in str(e.value)
    assert f"model.norm.weight in {files[-1].name} is int32" in str(e.value)


def test_missing_shard_and_bad_files(tmp_path, tiny_dir):
    weights = read_weights(tiny_dir)
    sharded = write_tiny_checkpoint(
        tmp_path / "s", max_shard_bytes=sum(w.nbytes for w in weights.values()) // 2 + 1
    )
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_model(sharded)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(empty)
    (empty / "model.safetensors").write_bytes(b"\x10\x00garbage")
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        load_model(empty)
    with pytest.raises(ConfigError, match="no such folder") as info:
        load_model(tmp_path / "nowhere")
    assert info.value.exit_code == 2  # bad input, as a folder without config.json is
    with pytest.raises(ConfigError, match="not a folder"):
        load_model(empty / "model.safetensors")


def test_rotary_buffers_some_exports_carry_are_ignored(tmp_path, tiny_dir):
    """A checkpoint with HF's rotary inv_freq buffers loads (the strict key check does not
    trip on them) and gives the same logits as the one without."""
    weights = read_weights(tiny_dir)
    weights["model.layers.1.self_attn.rotary_emb.inv_freq"] = mx.ones((4,))
    path = tmp_path / "rot"
    write_weights(path, weights)
    (path / "config.json").write_text((tiny_dir / "config.json").read_text())
    got = load_model(path, dtype="float32")(IDS)
    want = load_model(tiny_dir, dtype="float32")(IDS)
    assert mx.array_equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtype(tiny_dir, dtype):
    model = load_model(tiny_dir, dtype=dtype)
    assert model.model.embed_tokens.weight.dtype == getattr(mx, dtype)
    assert model(IDS).dtype == getattr(mx, dtype)


def test_check_checkpoint_reads_only_headers(tmp_path, tiny_dir):
    """`salabatch validate FOLDER` checks names and shapes without reading weight data, and
    reports every problem: here the tokenizer, then also the weights."""
    data = (tiny_dir / "model.safetensors").stat().st_size
    mx.reset_peak_memory()
    held = mx.get_active_memory()  # arrays earlier tests still hold
    report = check_checkpoint(tiny_dir)
    assert mx.get_peak_memory() - held < data // 100  # reading the data would allocate it all
    assert report.problems == [f"{tiny_dir}: missing tokenizer.json"]
    assert report.config.vocab_size == 256 and report.weight_files == [
        tiny_dir / "model.safetensors"
    ]

    bad = tmp_path / "bad"
    weights = read_weights(tiny_dir)
    weights["model.norm.weight"] = mx.ones((3,))
    write_weights(bad, weights)
    (bad / "config.json").write_text((tiny_dir / "config.json").read_text())
    problems = check_checkpoint(bad).problems
    assert len(problems) == 2 and "wrong shape: model.norm.weight (3,) != (64,)" in problems[0]
    assert check_checkpoint(tmp_path / "nowhere").problems == [
        f"{tmp_path / 'nowhere'}: not a directory"
    ]


def test_ids_past_the_tokenizer_of_a_padded_vocabulary_are_never_drawn(tmp_path):
    """A vocab_size that pads the embedding table past the tokenizer (1024 -> 1100), its head
    rows making a padded id the likeliest: the model drew ids that decode to nothing (a run's
    rows failed, `generate` printed nothing). Loaded with its tokenizer, their logits are -inf
    and the answer is the unpadded model's."""
    import shutil

    import salabatch
    from salabatch.models import resolve_model

    source = resolve_model("builtin:tiny", tmp_path / "models")
    padded = tmp_path / "padded"
    shutil.copytree(source, padded)
    weights = read_weights(padded)
    model, tok = salabatch.load(str(source), dtype="float32")
    prompt = tok.chat_prompt_ids([{"role": "user", "content": "Who is the provider?"}], think=False)
    first = int(mx.argmax(model(mx.array([prompt]))[0, -1]).item())
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = weights[name]
        extra = mx.broadcast_to(w[first] * (4 if name == "lm_head.weight" else 0), (76, w.shape[1]))
        weights[name] = mx.concatenate([w, extra.astype(w.dtype)])
    write_weights(padded, weights)
    config = json.loads((padded / "config.json").read_text())
    (padded / "config.json").write_text(json.dumps(config | {"vocab_size": 1100}))
    bare = load_model(padded, dtype="float32")  # without its tokenizer: the padded id wins
    assert int(mx.argmax(bare(mx.array([prompt]))[0, -1]).item()) >= 1024
    model_p, tok_p = salabatch.load(str(padded), dtype="float32")
    logits = model_p(mx.array([prompt]))[0, -1]
    assert logits.shape == (1100,) and bool(mx.all(mx.isinf(logits[1024:])))
    want = salabatch.generate(model, tok, "Who is the provider?", max_tokens=8)
    assert salabatch.generate(model_p, tok_p, "Who is the provider?", max_tokens=8) == want
    hot = {"temperature": 3.0, "seed": 1, "max_tokens": 24}
    document = "The Provider is Acme Corp. The Client is Beta LLC."
    answers = salabatch.batch_generate(model_p, tok_p, document, ["Who is it?"] * 4, **hot)
    assert len(answers) == 4  # drawn, and no id past the tokenizer to decode


def test_a_damaged_index_or_template_is_one_problem_line_not_a_crash(tmp_path):
    """A weight_map value that is no file name, and a chat template that is not UTF-8, escaped
    as a bare TypeError / UnicodeDecodeError (exit 1, "run with --debug"); a config saying
    quantized over float weights was taken as quantized."""
    import shutil

    from salabatch.models import resolve_model

    source = resolve_model("builtin:tiny", tmp_path / "models")
    for name, damage, said in (
        ("index", lambda d: (d / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"lm_head.weight": 5}})), "names a shard that is no file"),
        ("template", lambda d: (d / "chat_template.jinja").write_bytes(b"{{ bos }}\xff"),
         "cannot read the chat template"),
        # said 8-bit (in validate, and every row's quant_bits) over float weights
        ("quant", lambda d: (d / "config.json").write_text(json.dumps(json.loads(
            (d / "config.json").read_text()) | {"quantization": {"bits": 8, "group_size": 64}})),
         "config.json says 8-bit quantized, but no weight is"),
    ):  # fmt: skip
        folder = tmp_path / name
        shutil.copytree(source, folder)
        damage(folder)
        (problem,) = check_checkpoint(folder).problems
        assert said in problem, problem


def test_a_config_json_that_is_not_json_is_one_model_config_error(tmp_path):
    """config.json not JSON: a ConfigError (exit 2, as the README's "model config" says) from
    every loader, the tokenizer's (which reads its ids there) too, and `validate FOLDER` says
    so once (it was a TokenizerError, exit 1, from `generate`/`serve`/`load`, and twice)."""
    from salabatch.api import load
    from salabatch.models import resolve_model

    bad = tmp_path / "bad"
    shutil.copytree(resolve_model("builtin:tiny"), bad)
    (bad / "config.json").write_text("{bad")
    with pytest.raises(ConfigError, match="not valid JSON") as e:
        load(bad)
    assert e.value.exit_code == 2 and e.value.path == str(bad / "config.json")
    assert check_checkpoint(bad).problems == [str(e.value)]

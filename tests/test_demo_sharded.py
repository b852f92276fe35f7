"""Random checkpoints written as Hugging Face shards: the same tensors as one file, read by our loaders."""

import dataclasses
import json
import re

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from klein.io import demo
from klein.io.safetensors import TensorSource
from klein.io.text_encoder_checkpoint import load_text_encoder
from klein.io.transformer_checkpoint import load_transformer
from klein.io.vae_checkpoint import load_vae

SPEC = dataclasses.replace(demo.DEMO, dtype="bfloat16")
LIMIT = 48 * 1024  # tensor bytes per shard: every component of SPEC takes several
PREFIXES = {
    "transformer": "diffusion_pytorch_model",
    "vae": "diffusion_pytorch_model",
    "text_encoder": "model",
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(one file per component, sharded) folders of SPEC, same seed; the sharded one drawn in blocks of rows
    far smaller than its tensors."""
    one = tmp_path_factory.mktemp("one-file")
    sharded = tmp_path_factory.mktemp("sharded")
    demo.write_checkpoint(one, SPEC, seed=3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(demo, "DRAW_BYTES", 1000)
        calls = []
        demo.write_checkpoint(sharded, SPEC, seed=3, shard_bytes=LIMIT, progress=lambda *a: calls.append(a))
    return one, sharded, calls


@pytest.mark.parametrize("component", list(PREFIXES))
def test_shards_follow_the_hugging_face_layout(written, component):
    one, sharded, _ = written
    prefix = PREFIXES[component]
    assert (one / component / f"{prefix}.safetensors").is_file()
    assert not list((one / component).glob("*.index.json"))  # small components stay one file
    assert not (sharded / component / f"{prefix}.safetensors").exists()
    index = json.loads((sharded / component / f"{prefix}.safetensors.index.json").read_text())
    keys = TensorSource.from_file(one / component / f"{prefix}.safetensors").keys()
    assert set(index["weight_map"]) == keys
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    assert sorted(p.name for p in (sharded / component).glob("*.safetensors")) == files
    assert files == [f"{prefix}-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    total = 0
    for name in files:
        source = TensorSource.from_file(sharded / component / name)
        assert source.keys() == {k for k, v in index["weight_map"].items() if v == name}
        sizes = [int(np.prod(source.shape(k))) * 2 for k in source.keys()]
        assert sum(sizes) <= LIMIT or len(sizes) == 1  # a tensor over the limit gets a shard of its own
        assert all(source.dtype(k) == "BF16" for k in source.keys())
        total += sum(sizes)
    assert index["metadata"] == {"total_size": total}


def test_sharded_tensors_equal_the_one_file_ones(written):
    one, sharded, _ = written
    for component, prefix in PREFIXES.items():
        a, b = (
            TensorSource.from_folder(one / component, prefix),
            TensorSource.from_folder(sharded / component, prefix),
        )
        assert a.keys() == b.keys()
        for key in sorted(a.keys()):
            assert np.array_equal(a.get(key).view(np.uint16), b.get(key).view(np.uint16)), key
    for path in one.rglob("*.json"):  # configs, tokenizer and model_index alike
        assert (sharded / path.relative_to(one)).read_bytes() == path.read_bytes()


@pytest.mark.parametrize("load", [load_transformer, load_text_encoder, load_vae])
def test_loaders_read_the_shards(written, load):
    one, sharded, _ = written
    component = {load_transformer: "transformer", load_text_encoder: "text_encoder", load_vae: "vae"}[load]
    a, b = nnx.state(load(one / component)), nnx.state(load(sharded / component))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_progress_is_reported_per_file(written):
    _, sharded, calls = written
    for component, prefix in PREFIXES.items():
        mine = [(path, done, total) for path, done, total in calls if path.parent.name == component]
        index = json.loads((sharded / component / f"{prefix}.safetensors.index.json").read_text())
        assert [path.name for path, _, _ in mine] == sorted(set(index["weight_map"].values()))
        assert mine[-1][1] == mine[-1][2] == index["metadata"]["total_size"]
        assert all(a[1] < b[1] for a, b in zip(mine, mine[1:], strict=False))


def test_streamed_file_is_laid_out_as_save_file(tmp_path, monkeypatch):
    """Byte for byte what safetensors writes for the same draws: header, padding, order, data."""
    shapes = {
        "b.weight": (5, 3),
        "a.weight": (7,),
        "c.bias": (2,),
        "d.weight": (9, 2, 2),
        "e.running_var": (3,),
    }
    ordered = dict(sorted(shapes.items()))
    for dtype in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)):
        rng = np.random.default_rng(0)
        tensors = {
            key: np.concatenate(list(demo._random(key, shape, rng, dtype, 2**30)))
            for key, shape in ordered.items()
        }
        save_file(tensors, str(tmp_path / "saved.safetensors"), metadata={"format": "pt"})
        monkeypatch.setattr(demo, "DRAW_BYTES", 20)  # blocks of one or two rows
        demo._write_streamed(tmp_path / "streamed.safetensors", ordered, np.random.default_rng(0), dtype)
        assert (tmp_path / "streamed.safetensors").read_bytes() == (
            tmp_path / "saved.safetensors"
        ).read_bytes()


def test_shards_split_like_transformers():
    sizes = {"a": 3, "b": 3, "c": 9, "d": 2, "e": 2, "f": 5}
    assert demo._shards(list(sizes), sizes, 6) == [["a", "b"], ["c"], ["d", "e"], ["f"]]


def test_vocabulary_override_and_untied_head(tmp_path):
    text = dict(SPEC.text_encoder, tie_word_embeddings=False)
    spec = dataclasses.replace(SPEC, text_encoder=text, vocab_size=151936)
    demo.write_checkpoint(tmp_path, spec, shard_bytes=8 * 2**20)
    config = json.loads((tmp_path / "text_encoder" / "config.json").read_text())
    assert config["vocab_size"] == 151936
    source = TensorSource.from_folder(tmp_path / "text_encoder", "model")
    hidden = text["hidden_size"]
    assert source.shape("model.embed_tokens.weight") == source.shape("lm_head.weight") == (151936, hidden)
    assert (tmp_path / "text_encoder" / "model.safetensors.index.json").is_file()  # 2 x 9.7 MB: sharded
    tokenizer = json.loads((tmp_path / "tokenizer" / "tokenizer.json").read_text())
    assert max(tokenizer["model"]["vocab"].values()) < 320  # every id the tiny tokenizer makes is a row
    encoder = load_text_encoder(tmp_path / "text_encoder")  # lm_head is skipped, as in Qwen3-8B
    assert encoder.model.embed_tokens.embedding.shape == (151936, hidden)
    assert not re.search("lm_head", str(jax.tree.structure(nnx.state(encoder))))


def test_an_interrupted_write_leaves_nothing_behind(tmp_path):
    def interrupt(path, done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        demo.ensure_checkpoint(tmp_path / "ckpt", SPEC, shard_bytes=LIMIT, progress=interrupt)
    assert list(tmp_path.iterdir()) == []


def test_a_tiled_checkpoint_has_every_tensor_at_its_shape_finite_and_repeated(written, tmp_path):
    """`tiled`: the same keys, shapes and dtypes as a drawn checkpoint, finite, each weight one block of
    rows repeated (here blocks of 2 rows, far smaller than the weights)."""
    one, _, _ = written
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(demo, "TILE_BYTES", 2 * 4 * 64)  # two float32 rows of 64
        demo.write_checkpoint(tmp_path, SPEC, seed=3, tiled=True)
    repeated = 0
    for component, prefix in PREFIXES.items():
        drawn = TensorSource.from_file(one / component / f"{prefix}.safetensors")
        tiled = TensorSource.from_file(tmp_path / component / f"{prefix}.safetensors")
        assert tiled.keys() == drawn.keys()
        for key in drawn.keys():
            assert (tiled.shape(key), tiled.dtype(key)) == (drawn.shape(key), drawn.dtype(key)), key
            value = tiled.get(key).astype(np.float32)  # get refuses NaN and infinities
            if value.ndim >= 2 and value.shape[1:] == (64,) and value.shape[0] > 2:
                assert np.array_equal(value[2:4], value[: len(value[2:4])]), key
                assert not np.array_equal(value[0], value[1]), key
                repeated += 1
    assert repeated

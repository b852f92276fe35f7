"""The Qwen3 text encoder from a GGUF in llama.cpp's naming (`--text-encoder FILE.gguf`): its prompt embeddings
equal those of the same (dequantised) weights as a folder, its tokenizer rebuilt from the metadata equals the
folder's and transformers', and wrong files are refused before a weight is read."""

import math

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest
from flax import nnx

from klein.cli import main as cli
from klein.errors import CheckpointError, InputError
from klein.io import demo
from klein.io.gguf_header import read_header
from klein.io.text_encoder_checkpoint import abstract_text_encoder, load_text_encoder, read_config
from klein.io.text_encoder_gguf import gguf_names, kept_forms, load_text_encoder_gguf, read_gguf_config
from klein.memory import stored
from klein.models import gguf_blocks, stacks, variants
from klein.models.layers import Linear
from klein.models.qwen3 import prompt_embeddings
from klein.models.qwen3_config import Qwen3Config
from klein.pipeline import components
from klein.pipeline.loading import load_pipeline
from klein.pipeline.prompts import load_tokenizer, tokenize_prompts
from klein.pipeline.reading import locate
from klein.request.loading import LoadOptions
from tests.support.qwen3_gguf import MIXED, T, dequantised_folder, write_qwen3_gguf
from tests.support.tiny_text_encoder import build_text_encoder, build_tokenizer, hf_chat_tokens
from tests.test_plan_stored import TINY_TEXT, files
from tests.test_quantised_forms import random_blocks

PROMPTS = ["A red fox in fresh snow at dawn, 1024 x 768.", "Ünïcödé 東京 🐱 <think> <|im_end|> it's\n\n ok"]
TOKENS = 64
_embeddings = nnx.jit(prompt_embeddings, static_argnames="layers")
_rows = jax.jit(stacks.rows, static_argnums=(2, 3))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, transformers tokenizer) of a tiny Qwen3 text encoder 32 wide: the demo transformer's."""
    folder = tmp_path_factory.mktemp("qwen3-folder")
    tokenizer = build_tokenizer(folder)
    build_text_encoder(folder)
    return folder, tokenizer


@pytest.fixture(scope="module")
def mixed(tiny, tmp_path_factory):
    """(GGUF of mixed F32 / F16 / Q8_0 / Q4_0 tensors, folder of the values it holds)."""
    root = tmp_path_factory.mktemp("qwen3-gguf")
    path = write_qwen3_gguf(root / "Qwen3-tiny-Q4_0.gguf", tiny[0], MIXED)
    return path, dequantised_folder(path, tiny[0], root / "dequantised")


@pytest.fixture(scope="module")
def ids(tiny):
    folder, _ = tiny
    return tokenize_prompts(load_tokenizer(folder / "tokenizer"), PROMPTS, TOKENS)


def embed(encoder, ids) -> np.ndarray:
    return np.asarray(_embeddings(encoder, *ids))


@pytest.fixture(scope="module")
def reference(mixed, ids):
    return embed(load_text_encoder(mixed[1] / "text_encoder"), ids)


def test_config_from_metadata_equals_config_json(tiny, mixed):
    assert read_gguf_config(mixed[0]) == read_config(tiny[0] / "text_encoder")


def test_embeddings_equal_the_dequantised_folder(mixed, ids, reference):
    ours = embed(load_text_encoder_gguf(mixed[0]), ids)
    assert ours.shape == (2, TOKENS, 3 * 32)
    assert np.max(np.abs(ours - reference)) <= 1e-5
    assert np.abs(reference).max() > 1  # not a comparison of zeros


@pytest.fixture(scope="module", params=[T.Q8_0, T.Q4_0], ids=lambda kind: kind.name)
def uniform(request, tiny, tmp_path_factory):
    """(GGUF whose every Linear is of one quantised type, embedding Q8_0; that type)."""
    types = {name: request.param for name in MIXED} | {"embed_tokens": T.Q8_0}
    return write_qwen3_gguf(
        tmp_path_factory.mktemp("qwen3-uniform") / "q.gguf", tiny[0], types
    ), request.param


def test_blocks_kept_equal_dequantised_at_load(uniform, ids):
    """Each Linear and the token table stay as the file's blocks (uint8, the bytes of the file, widened
    inside the product or as rows are gathered) and the embeddings equal those of the weights widened at
    load."""
    path, kind = uniform
    kept, widened = load_text_encoder_gguf(path), load_text_encoder_gguf(path, dequantize=True)
    data = {tensor.name: tensor.data for tensor in gguf.GGUFReader(path).tensors}
    blocks = {key: data[name] for key, name in gguf_names(kept.config).items()}
    linears = {p: m for p, m in nnx.iter_modules(kept) if isinstance(m, Linear)}
    assert len(linears) == 7
    for module_path, linear in linears.items():
        assert linear.blocks == kind.name and linear.kernel is None
        name = ".".join(module_path[2:])
        stored = [blocks[f"model.layers.{i}.{name}.weight"] for i in range(27)]
        assert linear.weight[...].dtype == jnp.uint8
        assert np.array_equal(np.asarray(linear.weight[...]), np.stack(stored))
    assert kept.model.embedding_blocks == "Q8_0" and widened.model.embedding_blocks is None
    assert np.array_equal(np.asarray(kept.model.embed_tokens.embedding[...]), data["token_embd.weight"])
    assert widened.model.embed_tokens.embedding[...].dtype == jnp.float32
    assert all(m.blocks is None for _, m in nnx.iter_modules(widened) if isinstance(m, Linear))
    ours, reference = embed(kept, ids), embed(widened, ids)
    assert np.max(np.abs(ours - reference)) <= 1e-5 and np.abs(reference).max() > 1


def q4_k_m_like(layers: int, low: T, middle: T, high: T) -> dict[int, dict[str, T]]:
    """Layer -> llama.cpp name -> type of llama.cpp's Q4_K_M mix in three types: `attn_v` `high` in the first
    and last eighth of the layers and every third between ("more bits"), else `low`; `ffn_down` cycling
    `low` / `middle` / `high` (a stack of three types)."""
    more = {i for i in range(layers) if i < layers // 8 or i >= layers - layers // 8 or i % 3 == 2}
    return {
        i: {"attn_v": high if i in more else low, "ffn_down": (low, middle, high)[i % 3]}
        for i in range(layers)
    }


def _q4_0_mix(layers: int) -> dict[str, T]:
    """The Q4_K_M mix in types 32 values wide (Q4_0 / Q5_0 / Q8_0), the other Linears Q4_0, by HF key."""
    types = {name: T.Q4_0 for name in MIXED} | {"embed_tokens": T.Q8_0}
    modules = {"attn_v": "self_attn.v_proj", "ffn_down": "mlp.down_proj"}
    for i, kinds in q4_k_m_like(layers, T.Q4_0, T.Q5_0, T.Q8_0).items():
        types |= {f"model.layers.{i}.{modules[name]}.weight": kind for name, kind in kinds.items()}
    return types


def test_stacks_of_mixed_types_are_kept_as_padded_blocks(tiny, ids, tmp_path):
    """`v_proj` (two types) and `down_proj` (three) stay blocks: each layer's file rows zero-padded to the
    widest type's width and tagged with its type's index in the stack's `blocks`, the bytes per weight the
    planner counts; the embeddings equal those of the weights widened at load."""
    path = write_qwen3_gguf(tmp_path / "Qwen3-tiny-Q4_K_M.gguf", tiny[0], _q4_0_mix(28))
    kept, widened = load_text_encoder_gguf(path), load_text_encoder_gguf(path, dequantize=True)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    planned = stored.rates(abstract_text_encoder(kept.config, 27), kept_forms(path, kept.config))
    modules = dict(nnx.iter_modules(kept))
    for name, module, blocks in [
        ("attn_v", ("self_attn", "v_proj"), ("Q8_0", "Q4_0")),
        ("ffn_down", ("mlp", "down_proj"), ("Q8_0", "Q4_0", "Q5_0")),  # in `gguf_blocks.TYPES` order
    ]:
        linear = modules[("model", "layers", *module)]
        assert linear.blocks == blocks and linear.kernel is None
        weight = np.asarray(linear.weight[...])
        layers = [tensors[f"blk.{i}.{name}.weight"] for i in range(27)]
        width = max(layer.data.shape[1] for layer in layers)
        assert weight.dtype == np.uint8 and weight.shape == (27, layers[0].data.shape[0], width + 1)
        for rows, layer in zip(weight, layers, strict=True):
            np.testing.assert_array_equal(rows[:, : layer.data.shape[1]], layer.data)
            assert not rows[:, layer.data.shape[1] : -1].any()
            assert set(rows[:, -1].tolist()) == {blocks.index(layer.tensor_type.name)}
        assert planned[("model", "layers", *module)] * math.prod(layers[0].shape) == weight[0].nbytes
    ours, reference = embed(kept, ids), embed(widened, ids)
    assert np.max(np.abs(ours - reference)) <= 1e-5 and np.abs(reference).max() > 1


def test_a_k_quant_mix_embeds_as_its_weights_widened_at_load(tmp_path):
    """K-quants, at a width whose rows are whole 256-value super-blocks (random blocks, llama.cpp's
    names and metadata): `attn_v` Q6_K in the "more bits" layers among Q4_K, `ffn_down` Q4_K / Q5_K / Q6_K;
    both kept as blocks, and the embeddings equal those of the file widened at load."""
    cfg = TINY_TEXT
    tensors = files.qwen3_types(cfg, T.Q4_K)
    for i, kinds in q4_k_m_like(cfg.num_hidden_layers, T.Q4_K, T.Q5_K, T.Q6_K).items():
        for name, kind in kinds.items():
            tensors[f"blk.{i}.{name}.weight"] = (tensors[f"blk.{i}.{name}.weight"][0], kind)
    path = tmp_path / "Qwen3-wide-Q4_K_M.gguf"
    files.write_gguf_qwen3(path, cfg, T.Q4_K, tensors)
    kept, widened = load_text_encoder_gguf(path), load_text_encoder_gguf(path, dequantize=True)
    modules = dict(nnx.iter_modules(kept))
    assert modules[("model", "layers", "self_attn", "v_proj")].blocks == ("Q4_K", "Q6_K")
    assert modules[("model", "layers", "mlp", "down_proj")].blocks == ("Q4_K", "Q5_K", "Q6_K")
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 16))
    ours, reference = (embed(encoder, (ids, np.ones_like(ids))) for encoder in (kept, widened))
    scale = np.abs(reference).max()
    assert np.isfinite(scale) and scale > 0 and np.max(np.abs(ours - reference)) <= 1e-5 * scale


@pytest.mark.parametrize("ggml_type", gguf_blocks.TYPES)
def test_rows_gathered_from_blocks_are_the_table_widened_at_load(ggml_type):
    """A token table kept as blocks gives, for the rows a prompt gathers, the bits of the table widened at
    load (`gguf.quants.dequantize`, then cast to the compute dtype): in bfloat16 and float32."""
    table = random_blocks(ggml_type, 48, 2, np.random.default_rng(3))
    ids = jnp.asarray([[0, 5, 47, 5], [46, 1, 2, 3]])
    widened = gguf.quants.dequantize(table, T[ggml_type])
    for dtype in (jnp.bfloat16, jnp.float32):
        got = np.asarray(_rows(jnp.asarray(table), ids, ggml_type, dtype))
        want = widened.astype(dtype)[np.asarray(ids)]
        assert got.dtype == want.dtype and np.isfinite(want).all()
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_a_bf16_embedding_from_blocks_is_the_widened_ones_bits(uniform, ids):
    """Loaded in bfloat16, the rows the kept table gives a prompt are those of the table widened at load,
    bit for bit; the comparison tells rows apart (the next id's rows differ)."""
    path, _ = uniform
    kept = load_text_encoder_gguf(path, jnp.bfloat16)
    table = np.asarray(
        load_text_encoder_gguf(path, jnp.bfloat16, dequantize=True).model.embed_tokens.embedding[...]
    )
    tokens = jnp.asarray(ids[0])
    got = np.asarray(_rows(kept.model.embed_tokens.embedding[...], tokens, "Q8_0", jnp.bfloat16))
    assert got.dtype == table.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got.view(np.uint16), table[np.asarray(tokens)].view(np.uint16))
    shifted = table[(np.asarray(tokens) + 1) % table.shape[0]]
    assert not np.array_equal(got.view(np.uint16), shifted.view(np.uint16))


def _llama_permuted(tensors):
    """What llama.cpp's converter does to a Llama's Q/K rows (and must not be undone for Qwen3)."""
    for key in tensors:
        n = {"q_proj": 4, "k_proj": 2}.get(key.split(".")[-2])  # the tiny model's heads
        if n:
            w = tensors[key]
            tensors[key] = w.reshape(n, 2, w.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(w.shape)


def _gate_up_swapped(tensors):
    for key in [k for k in tensors if k.endswith("gate_proj.weight")]:
        up = key.replace("gate_proj", "up_proj")
        tensors[key], tensors[up] = tensors[up], tensors[key]


@pytest.mark.parametrize("edit", [_llama_permuted, _gate_up_swapped])
def test_parity_catches_a_wrong_layout(tiny, ids, reference, tmp_path, edit):
    """The parity above fails when rows are in llama's order or gate and up are exchanged."""
    path = write_qwen3_gguf(tmp_path / "wrong.gguf", tiny[0], MIXED, edit=edit)
    assert np.max(np.abs(embed(load_text_encoder_gguf(path), ids) - reference)) > 1e-2


def test_gguf_names_follow_llama_cpp():
    names = gguf_names(Qwen3Config.qwen3_8b())
    assert len(names) == 2 + 1 + 36 * 11 and names["lm_head.weight"] == "output.weight"
    assert names["model.embed_tokens.weight"] == "token_embd.weight"
    layer = {k.split(".", 3)[3]: v for k, v in names.items() if k.startswith("model.layers.35.")}
    assert layer == {
        f"{module}.weight": f"blk.35.{name}.weight"
        for module, name in {
            "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
            "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
            "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down",
        }.items()
    }  # fmt: skip


def test_tokenizer_from_metadata_equals_folder_and_transformers(tiny, tmp_path):
    folder, hf = tiny
    # As llama.cpp writes a vocabulary smaller than the embedding: filled with UNUSED [PAD...] ids.
    path = write_qwen3_gguf(tmp_path / "padded.gguf", folder, pad_vocab_to=len(hf) + 7)
    ours = tokenize_prompts(load_tokenizer(path), PROMPTS, TOKENS)
    from_folder = tokenize_prompts(load_tokenizer(folder / "tokenizer"), PROMPTS, TOKENS)
    _, ids, mask = hf_chat_tokens(hf, PROMPTS, TOKENS)
    for got in (ours, from_folder):
        np.testing.assert_array_equal(got[0], ids)
        np.testing.assert_array_equal(got[1], mask)
    assert {hf.convert_tokens_to_ids(t) for t in ("<think>", "<|im_end|>")} <= set(ours[0][1])


def test_a_gguf_of_another_model_is_refused(tmp_path):
    path = tmp_path / "flux-2-klein-4b-Q4_0.gguf"
    writer = gguf.GGUFWriter(str(path), "flux")
    writer.add_tensor("double_blocks.0.img_attn.qkv.weight", np.zeros((6, 4), np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="holds a 'flux' model, not a Qwen3 text encoder"):
        load_pipeline("demo", text_encoder=path)


def test_a_truncated_gguf_is_refused(mixed, tmp_path):
    path, data = tmp_path / "cut.gguf", mixed[0].read_bytes()
    for cut, message in (
        (len(data) - 1000, "cut short .* the download is incomplete"),
        (100, "not a readable"),
    ):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=message):
            load_pipeline("demo", text_encoder=path)


def test_header_equals_gguf_s_reader(mixed):
    """`klein.io.gguf_header` reads what `gguf.GGUFReader` reads (metadata, tensor shapes, types, where each
    tensor's data lies and its size): the one reader for every GGUF klein opens."""
    header, reader = read_header(mixed[0]), gguf.GGUFReader(mixed[0])
    assert header.metadata == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert len(header.metadata["tokenizer.ggml.merges"]) > 100
    assert header.shapes == {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    assert header.types == {t.name: t.tensor_type for t in reader.tensors}
    assert set(header.types.values()) == {T.F32, T.F16, T.Q8_0, T.Q4_0}
    assert header.offsets == {t.name: int(t.data_offset) for t in reader.tensors}
    assert {name: header.nbytes(name) for name in header.types} == {
        t.name: int(t.n_bytes) for t in reader.tensors
    }
    assert {n: header.stored_shape(n) for n in header.types if header.types[n] not in (T.F32, T.F16)} == {
        t.name: tuple(t.data.shape) for t in reader.tensors if t.tensor_type not in (T.F32, T.F16)
    }


def test_too_few_layers_or_no_tokenizer_are_refused(tiny, tmp_path):
    short = write_qwen3_gguf(tmp_path / "short.gguf", tiny[0], metadata={"block_count": 27}, tokenizer=False)
    with pytest.raises(CheckpointError, match="has 27 decoder layers.*needs at least 28"):
        read_gguf_config(short)
    path = write_qwen3_gguf(tmp_path / "bare.gguf", tiny[0], tokenizer=False)
    with pytest.raises(CheckpointError, match="no tokenizer in its metadata.*--tokenizer"):
        load_tokenizer(path)
    parts = dict(transformer=demo.ensure_demo(), vae=demo.ensure_demo(), text_encoder=path)
    with pytest.raises(InputError, match="bare.gguf holds no tokenizer in its metadata: name the tokenizer"):
        locate(LoadOptions(**parts))
    # A model folder named too: its tokenizer is taken, as for a text encoder folder.
    assert locate(LoadOptions("demo", text_encoder=str(path))).tokenizer == demo.ensure_demo() / "tokenizer"


def test_a_text_encoder_of_another_size_is_refused(tiny, tmp_path):
    """Before a weight is read: a Qwen3 size other than the variant's, or a width the transformer can't take."""
    with pytest.raises(CheckpointError, match="klein-9b-kv takes one of hidden size 4096, 36 layers"):
        components._check_text_encoder(
            tmp_path,
            Qwen3Config.qwen3_4b(),
            variants.SIZES["9b"].transformer,
            variants.VARIANTS["klein-9b-kv"],
        )
    path = write_qwen3_gguf(tmp_path / "wide.gguf", tiny[0], metadata={"embedding_length": 40})
    with pytest.raises(CheckpointError, match="hidden size 40; this transformer takes .* 32 wide"):
        load_pipeline(transformer=demo.ensure_demo(), vae=demo.ensure_demo(), text_encoder=path)


def test_cli_generates_with_a_gguf_text_encoder(mixed, tmp_path):
    """`klein generate --text-encoder FILE.gguf` (its tokenizer too) draws the image of the same weights and
    tokenizer as a folder."""
    model = demo.ensure_demo()
    images = []
    for encoder in (mixed[0], mixed[1]):
        out = tmp_path / f"{encoder.name}.png"
        args = ["--transformer", model, "--vae", model, "--text-encoder", encoder, "--prompt", PROMPTS[0]]
        args += ["--steps", "1", "--height", "32", "--width", "32", "--seed", "3", "--out", out]
        assert cli.main(["generate", *map(str, args)]) == 0
        images.append(np.asarray(PIL.Image.open(out), np.int16))
    assert images[0].shape == (32, 32, 3)
    assert np.abs(images[0] - images[1]).max() <= 1

"""GGUF files loaded natively, against transformers' own GGUF loading of the same files: the same logits, the same
greedy tokens, the same token ids, the same chat template rendering; the weights as the reader hands them over
(blocks kept, Q and K rows in Hugging Face's order); and every broken file refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGML
from numpy.lib.array_utils import byte_bounds
from tokenizers import Regex, Tokenizer, pre_tokenizers

from gguf_files import CHATML, SHIPPED_TOKENIZER, USER_DEFINED, bpe_vocab, by_name, gguf_config, spm_vocab, write_gguf
from verispec import generate, kernels
from verispec.bench.gguf_export import write_gguf as export_folder
from verispec.checkpoints.blocks import QuantizedWeight
from verispec.checkpoints.chat_template import load_chat_template
from verispec.checkpoints.gguf_checkpoint import read_gguf
from verispec.checkpoints.gguf_file import GGUFFile
from verispec.checkpoints.gguf_tokenizer import read_vocab
from verispec.checkpoints.mapped import forget_pages
from verispec.checkpoints.random_init import random_checkpoint, random_weights, tiny_config
from verispec.errors import CheckpointError, UnsupportedArchitectureError
from verispec.models.native import load_model

TEXTS = [
    "Hello, world!",
    "def f(x):\n    return x ** 2  # square\n",
    "  two leading spaces",
    "trailing  ",
    "a\nb\n\nc  d   e",
    "year 2024: 12/31 23:59, x1 y22 z333",
    "I'M YOU'RE we'll it's",
    "über naïve café",
    "日本語 中文 Привет",
    "emoji 😀🎉",
    "<|im_start|>user\nhi<|im_end|>\n",
    f"call {USER_DEFINED} now",
    "the quick brown fox jumps over the lazy dog",
]
# Every type read, somewhere in the model: kept blocks, floats, and the block formats dequantized on reading.
MIXED = by_name(
    {
        "embed": GGML.Q8_0,
        "lm_head": GGML.Q6_K,
        "layers.0.self_attn.q": GGML.Q4_0,
        "layers.0.self_attn.k": GGML.Q4_1,
        "layers.0.self_attn.v": GGML.Q8_0,
        "layers.0.self_attn.o": GGML.F16,
        "layers.0.mlp.gate": GGML.Q4_K,
        "layers.0.mlp.up": GGML.Q6_K,
        "layers.0.mlp.down": GGML.BF16,
        "layers.1.self_attn.q": GGML.Q5_K,
        "layers.1.self_attn.k": GGML.Q6_K,
        "layers.1.self_attn.v": GGML.Q3_K,
        "layers.1.self_attn.o": GGML.Q2_K,
        "layers.1.mlp.gate": GGML.Q5_0,
        "layers.1.mlp.up": GGML.Q5_1,
    }
)
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def _transformers(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = dict(pretrained_model_name_or_path=path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(**source)


def _file(tmp_path_factory, folder: str, config, types=MIXED, **options) -> Path:
    return write_gguf(tmp_path_factory.mktemp(folder) / "model.gguf", config, types, **options)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    bpe, spm = len(bpe_vocab()[0]), len(spm_vocab()[0])
    return {
        "llama": _file(tmp_path_factory, "llama", gguf_config(bpe), add_bos=False),
        "spm": _file(
            tmp_path_factory,
            "spm",
            gguf_config(spm, tie_word_embeddings=True),
            by_name({}, GGML.F16),
            tokenizer="llama",
        ),
        "qwen2": _file(
            tmp_path_factory,
            "qwen2",
            gguf_config(bpe, model_type="qwen2", qkv_bias=True, tie_word_embeddings=True),
            by_name({"q_proj": GGML.Q4_0, "k_proj": GGML.Q4_1}, GGML.Q8_0),
            pre="qwen2",
        ),
    }


@pytest.mark.parametrize("kind", ["llama", "spm", "qwen2"])
def test_same_logits_greedy_tokens_and_ids_as_transformers(files, kind, single_thread) -> None:
    ours, (theirs, tokenizer) = load_model(files[kind], dtype="float32"), _transformers(files[kind])
    assert type(theirs).__name__ == {"qwen2": "Qwen2ForCausalLM"}.get(kind, "LlamaForCausalLM")
    texts = TEXTS if kind != "spm" else [t for t in TEXTS if not t.startswith(" ") and "<|" not in t]
    for text in texts:
        assert ours.tokenizer.encode(text).ids == tokenizer(text)["input_ids"], text
    prompt = ours.tokenizer.encode(TEXTS[1]).ids
    logits = ours(torch.tensor([prompt]), ours.new_cache())
    expected = theirs(torch.tensor([prompt])).logits
    assert torch.allclose(logits, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    with torch.inference_mode():
        greedy = theirs.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert generate(ours, prompt, max_new_tokens=16, ignore_eos=True).tokens == greedy
    assert load_chat_template(files[kind]).render(MESSAGES) == tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )


def test_sentencepiece_text_gets_llama_cpps_space_prefix(files) -> None:
    """llama.cpp puts a space before every stretch of text that starts the input or follows a special token, even
    one that starts with a space (transformers' Metaspace does neither)."""
    tokenizer = load_model(files["spm"]).tokenizer
    assert tokenizer.encode(" the dog").tokens == ["<s>", "\u2581", "\u2581the", "\u2581dog"]
    assert tokenizer.encode("the<s>dog</s>").tokens == ["<s>", "\u2581the", "<s>", "\u2581dog", "</s>"]
    assert tokenizer.decode(tokenizer.encode("the quick fox").ids, skip_special_tokens=True) == "the quick fox"


def test_the_reader_hands_over_blocks_floats_and_huggingface_rows(files) -> None:
    checkpoint, config = read_gguf(files["llama"]), gguf_config(len(bpe_vocab()[0]))
    weights, hf = checkpoint.weights, random_weights(config)
    q, k = weights["model.layers.0.self_attn.q_proj.weight"], weights["model.layers.0.self_attn.k_proj.weight"]
    assert isinstance(q, QuantizedWeight) and q.format == "q4_0" and k.format == "q4_1"
    for name, weight in (("q_proj", q), ("k_proj", k)):  # quantizing works row by row: the rows' order commutes
        of = QuantizedWeight.of(torch.from_numpy(hf[f"model.layers.0.self_attn.{name}.weight"]), weight.format)
        assert torch.equal(weight.blocks, of.blocks)
    assert isinstance(weights["model.embed_tokens.weight"], QuantizedWeight)
    assert weights["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float16
    assert weights["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    up = weights["model.layers.0.mlp.up_proj.weight"]  # Q6_K: its blocks, untouched
    blocks = GGUFFile(files["llama"]).tensors["blk.0.ffn_up.weight"].data
    assert isinstance(up, QuantizedWeight) and up.format == "q6_k" and np.array_equal(up.blocks.numpy(), blocks)
    assert np.array_equal(up.dequantize().numpy(), gguf.quants.dequantize(blocks, GGML.Q6_K))
    norm = weights["model.layers.1.input_layernorm.weight"]
    assert torch.equal(norm, torch.from_numpy(hf["model.layers.1.input_layernorm.weight"].astype(np.float32)))
    assert not checkpoint.config.tie_word_embeddings and "lm_head.weight" in weights


def test_tensors_are_views_of_the_memory_mapped_file(files) -> None:
    """Nothing is read at opening: each tensor is a view of the file's map, and its pages, dropped once packed,
    come back from the file when read again."""
    file = GGUFFile(files["llama"])
    low, high = byte_bounds(np.frombuffer(file.map.buffer, np.uint8))
    data = file.tensors["blk.0.ffn_up.weight"].data
    assert low <= byte_bounds(data)[0] and byte_bounds(data)[1] <= high
    before = data.copy()
    forget_pages(torch.from_numpy(data))
    assert np.array_equal(data, before)
    up = read_gguf(files["llama"]).weights["model.layers.0.mlp.up_proj.weight"]
    assert not up.blocks.numpy().flags.owndata and np.array_equal(up.blocks.numpy(), before)


def test_the_embedding_stays_in_its_blocks_and_a_lookup_dequantizes_its_rows(files, single_thread) -> None:
    model = load_model(files["llama"], dtype="auto")  # token_embd in Q8_0
    table = model.module.model.embed_tokens
    if kernels.available(torch.float32):
        assert table.quantized.format == "q8_0" and "model.embed_tokens.weight" not in model.module.state_dict()
    else:  # the PyTorch fallback keeps no blocks: the table dequantized whole, the same rows
        assert table.weight.dtype == torch.float32
    blocks = GGUFFile(files["llama"]).tensors["token_embd.weight"].data
    tokens = torch.tensor([[5, 17, 5, len(blocks) - 1]])
    whole = torch.from_numpy(gguf.quants.dequantize(blocks, GGML.Q8_0))
    assert torch.equal(model.embed(tokens).view(torch.int32), whole[tokens].view(torch.int32))
    with pytest.raises(IndexError):
        model.embed(torch.tensor([[len(blocks)]]))


def test_a_wrong_tensor_count_is_refused(small, tmp_path) -> None:
    data = bytearray(small.read_bytes())
    count = int.from_bytes(data[8:16], "little")
    for wrong in (count + 1, count - 1):
        data[8:16] = wrong.to_bytes(8, "little")
        (tmp_path / "m.gguf").write_bytes(data)
        with pytest.raises(CheckpointError, match="GGUF file|checkpoint is broken"):
            load_model(tmp_path / "m.gguf")


def test_without_output_weight_the_head_is_the_embedding(files) -> None:
    model = load_model(files["qwen2"], dtype="float32")
    assert model.config.tie_word_embeddings and model.lm_head_weight is model.module.model.embed_tokens.weight
    assert model.config.qkv_bias and model.config.model_type == "qwen2"


def test_a_folder_written_as_gguf_loads_bitwise_as_the_folder(tmp_path, single_thread) -> None:
    """The bench's GGUF writer permutes Q and K for llama.cpp; the reader undoes it exactly."""
    folder = random_checkpoint(tmp_path / "m", tiny_config(vocab_size=8192))
    shutil.copy(SHIPPED_TOKENIZER, folder)  # a tokenizer with merges (llama.cpp needs them)
    ours, back = load_model(folder, dtype="float32"), load_model(export_folder(folder, tmp_path / "m.gguf"))
    tokens = torch.tensor([[5, 17, 200, 3, 99, 64]])
    assert torch.equal(ours(tokens, ours.new_cache()), back(tokens, back.new_cache()))
    assert ours.eos_token_ids == {256} and back.name == "m.gguf"
    assert back.eos_token_ids == {0, 256}  # and <|endoftext|>, which llama.cpp ends a generation on by its text


def test_pre_tokenizers_split_as_llama_cpp_does(tmp_path) -> None:
    """smollm splits every digit off first (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM, SmolLM's own tokenizer.json:
    Digits then ByteLevel); llama-bpe adds BOS where the file does not say otherwise, and takes a whole piece that is
    a token as that token."""
    config = gguf_config(len(bpe_vocab()[0]), num_hidden_layers=1)
    smollm = read_vocab(GGUFFile(write_gguf(tmp_path / "s.gguf", config, MIXED, pre="smollm"))).tokenizer
    reference = Tokenizer.from_str(smollm.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    for text in TEXTS:
        assert smollm.encode(text).ids == reference.encode(text).ids, text
    assert smollm.encode("x 2024").tokens[-4:] == ["2", "0", "2", "4"]
    llama3 = read_vocab(GGUFFile(write_gguf(tmp_path / "l.gguf", config, MIXED, pre="llama-bpe"))).tokenizer
    assert llama3.encode("hi").ids[0] == 0 and llama3.encode("hi", add_special_tokens=False).ids[0] != 0
    split = pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated")
    assert [p for p, _ in split.pre_tokenize_str("1234567")] == ["123", "456", "7"]


def test_end_of_generation_ids_and_special_tokens(tmp_path) -> None:
    tokens = bpe_vocab()[0]
    eot = tokens.index("<|endoftext|>")
    path = write_gguf(
        tmp_path / "m.gguf",
        gguf_config(len(tokens), num_hidden_layers=1),
        MIXED,
        extra=lambda writer: writer.add_eot_token_id(eot),
    )
    vocab = read_vocab(GGUFFile(path))
    assert vocab.eos_ids == {tokens.index("<|im_end|>"), eot}
    assert vocab.special_tokens == {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
    assert vocab.chat_template == CHATML
    assert vocab.tokenizer.encode("<|im_start|>x").ids[0] == tokens.index("<|im_start|>")
    assert vocab.tokenizer.encode(f"a{USER_DEFINED}b").ids[1] == tokens.index(USER_DEFINED)


def test_a_file_without_a_template_has_none(tmp_path, capsys) -> None:
    from verispec.cli import main

    path = write_gguf(tmp_path / "m.gguf", gguf_config(len(bpe_vocab()[0]), num_hidden_layers=1), MIXED, template=None)
    assert load_chat_template(path) is None
    assert main(["chat", "--target", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no chat template" in err and "--chat-template FILE" in err


def test_a_template_given_for_a_file_without_one(tmp_path, capsys) -> None:
    """`--chat-template FILE` (llama.cpp's Gemma 3 files ship none): rendered with the file's own special tokens, in
    `generate --chat`; a file that cannot be read is one line of error before anything loads."""
    from verispec.cli import main

    path = write_gguf(tmp_path / "m.gguf", gguf_config(len(bpe_vocab()[0]), num_hidden_layers=1), MIXED, template=None)
    given = tmp_path / "turns.jinja"
    given.write_text("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    template = load_chat_template(path, template=given.read_text())
    assert template.render([{"role": "user", "content": "hi"}]) == "<|endoftext|><|im_start|>hi<|im_end|>"
    argv = ["generate", "hi", "--target", str(path), "--chat", "--max-new-tokens", "2", "--ignore-eos"]
    assert main([*argv, "--chat-template", str(given)]) == 0
    assert "2 tokens" in capsys.readouterr().out
    assert main([*argv, "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--chat-template" in err and "unreadable" in err
    plain = ["generate", "hi", "--target", str(path), "--chat-template", str(given)]
    assert main(plain) == 2 and "--chat-template goes with --chat" in capsys.readouterr().err


def _rewritten(path: Path, out: Path, **changes) -> Path:
    """A copy of the GGUF at `path` with metadata dropped (value None), replaced or added (a string), tensors as
    they are."""
    reader = gguf.GGUFReader(path)
    arch = changes.get("general.architecture") or reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or changes.get(key, ...) is None:
            continue
        value = changes.get(key, field.contents())
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub)
    for key, value in changes.items():  # new keys: strings
        if key not in reader.fields and key != "general.architecture":
            writer.add_string(key, value)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return _file(tmp_path_factory, "small", gguf_config(len(bpe_vocab()[0]), num_hidden_layers=1))


def test_broken_files_are_refused_by_name(small, tmp_path) -> None:
    data = small.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated GGUF file"):
        load_model(tmp_path / "cut.gguf")
    (tmp_path / "head.gguf").write_bytes(data[:100])
    with pytest.raises(CheckpointError, match="truncated GGUF file"):
        load_model(tmp_path / "head.gguf")
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_model(tmp_path / "text.gguf")
    with pytest.raises(CheckpointError, match="no such GGUF file"):
        load_model(tmp_path / "missing.gguf")


def test_an_unknown_architecture_is_refused(small, tmp_path) -> None:
    with pytest.raises(UnsupportedArchitectureError, match="unsupported architecture 'gemma2'"):
        load_model(_rewritten(small, tmp_path / "m.gguf", **{"general.architecture": "gemma2"}))
    scaled = _rewritten(small, tmp_path / "s.gguf", **{"llama.rope.scaling.type": "yarn"})
    with pytest.raises(UnsupportedArchitectureError, match="RoPE scaling 'yarn'"):
        load_model(scaled)


def test_an_unsupported_tensor_type_is_refused(tmp_path) -> None:
    config = gguf_config(len(bpe_vocab()[0]), num_hidden_layers=1)
    path = write_gguf(tmp_path / "m.gguf", config, by_name({"mlp.up": GGML.IQ4_NL}, GGML.Q8_0))
    with pytest.raises(CheckpointError, match=r"tensor blk.0.ffn_up.weight is IQ4_NL, a type verispec does not read"):
        load_model(path)


def test_a_missing_tokenizer_is_refused(small, tmp_path) -> None:
    with pytest.raises(CheckpointError, match="no tokenizer in its metadata"):
        load_model(_rewritten(small, tmp_path / "m.gguf", **{"tokenizer.ggml.tokens": None}))
    with pytest.raises(CheckpointError, match="pre-tokenizer 'made-up'"):
        load_model(_rewritten(small, tmp_path / "p.gguf", **{"tokenizer.ggml.pre": "made-up"}))


def test_a_vocabulary_larger_than_the_embedding_is_refused(small, tmp_path) -> None:
    tokens, types, _ = bpe_vocab()
    more = {"tokenizer.ggml.tokens": tokens + ["<extra>"], "tokenizer.ggml.token_type": types + [1]}
    with pytest.raises(
        CheckpointError,
        match=f"the tokenizer has {len(tokens) + 1} tokens but the model's embedding table only {len(tokens)} rows",
    ):
        load_model(_rewritten(small, tmp_path / "m.gguf", **more))


def test_missing_tensors_are_refused(small, tmp_path) -> None:
    with pytest.raises(CheckpointError, match="9 tensors missing: blk.1"):
        load_model(_rewritten(small, tmp_path / "m.gguf", **{"llama.block_count": 2}))


def test_generate_chat_serve_and_both_backends_take_a_gguf(files, capsys, single_thread) -> None:
    """`--target FILE.gguf` for generate --chat and the server's chat endpoint; `verispec.load` on either backend."""
    import openai

    from verispec import load
    from verispec.cli import main
    from verispec.serve.app import serving_app
    from verispec.serve.server import ServerThread

    path, messages = files["llama"], [{"role": "user", "content": "hi there"}]
    target = load(path)
    ids = target.tokenizer.encode(load_chat_template(path).render(messages), add_special_tokens=False).ids
    expected = generate(target, ids, max_new_tokens=8, ignore_eos=True)
    assert (
        main(
            [
                "generate",
                "--chat",
                "hi there",
                "--target",
                str(path),
                "--max-new-tokens",
                "8",
                "--ignore-eos",
                "--color",
                "never",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith(expected.text + "\n\n")
    with ServerThread(serving_app(target, None, path, name="g")) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="g", messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
    assert reply.choices[0].message.content == expected.text and reply.usage.prompt_tokens == len(ids)
    assert generate(load(path, "transformers"), ids, max_new_tokens=8, ignore_eos=True).tokens == expected.tokens


def test_generation_ends_where_llama_cpp_ends_it(tmp_path) -> None:
    """The ids the file names, the tokens llama.cpp ends a generation on by their text (Gemma's <end_of_turn>,
    which its files do not name), and the fill-in-the-middle ends: the file's own id, else found by text. <|end|>
    beside <|call|> and <|return|> ends a message, not the turn (harmony), as llama.cpp has it."""
    controls = ("<start_of_turn>", "<end_of_turn>", "<|fim_pad|>", "<|file_sep|>", "<REPO>", "<|repo_name|>")
    harmony = ("<|end|>", "<|call|>", "<|return|>")

    def tokens_of(path: Path) -> set[str]:
        vocab = read_vocab(GGUFFile(path))
        return {vocab.tokenizer.id_to_token(i) for i in vocab.eos_ids}

    def spm(name: str, extra=None, more: tuple[str, ...] = ()) -> Path:
        config = gguf_config(len(spm_vocab(controls + more)[0]), model_type="llama")
        return write_gguf(
            tmp_path / name, config, by_name({}), tokenizer="llama", controls=controls + more, extra=extra
        )

    found = tokens_of(spm("a.gguf"))
    assert found == {"</s>", "<end_of_turn>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>"}  # one repository token
    named = tokens_of(spm("b.gguf", lambda writer: writer.add_uint32("tokenizer.ggml.fim_rep_token_id", 7)))
    assert named == found - {"<|repo_name|>"} | {"<REPO>"}  # id 7: the file's own
    assert tokens_of(spm("c.gguf", more=harmony)) == found | {"<|call|>", "<|return|>"}
    assert tokens_of(spm("d.gguf", more=harmony[:2])) == found | {"<|end|>", "<|call|>"}
    qwen_like = write_gguf(tmp_path / "e.gguf", gguf_config(len(bpe_vocab()[0])), by_name({}))
    assert tokens_of(qwen_like) == {"<|im_end|>", "<|endoftext|>"}

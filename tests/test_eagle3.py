"""EAGLE-3 heads: greedy identity through the loop (chains, trees, a GGUF target), the training-time test computing
exactly what drafting computes, saving and loading in EAGLE-3's layout, and the training plumbing on a tiny target."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from tests.gguf_files import by_name, gguf_config, write_gguf
from verispec import generate
from verispec.bench.methods import our_methods
from verispec.checkpoints.fingerprint import gguf_fingerprint
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.checkpoints.shipped import shipped_head_for
from verispec.cli import main
from verispec.drafters.eagle import Eagle
from verispec.drafters.registry import Method, Resources, build_drafter
from verispec.errors import CheckpointError, InvalidArgumentError
from verispec.heads.eagle import EagleHead, head_config
from verispec.heads.eagle3 import ARCHITECTURE, feature_layers, is_eagle3, load_eagle3, save_eagle3
from verispec.models.native import load_model
from verispec.threads import torch_threads
from verispec.train.eagle3 import agreement_evaluator, eagle3_loss, new_head, unrolled
from verispec.train.loop import TrainConfig, train

PROMPT = [100, 101, 102, 40, 120, 41, 58, 10, 32, 32]
N = 30
VOCAB = torch.arange(0, 257, 2)  # the even ids: the head drafts over these only

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A random target with enough blocks for three distinct feature layers."""
    return load_model(
        random_checkpoint(tmp_path_factory.mktemp("deep"), tiny_config(num_hidden_layers=8), seed=3), dtype="float32"
    )


def random_head(target, seed: int = 0):
    torch.manual_seed(seed)
    head = new_head(target.module, VOCAB)
    for p in head.parameters():  # away from the init's ones and zeros, so every part of the layer matters
        p.data += 0.05 * torch.randn_like(p)
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def head(deep):
    return random_head(deep)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("tree", [None, (2, 6), (3, 12)])
def test_greedy_identity(deep, head, k, tree) -> None:
    truth = generate(deep, PROMPT, max_new_tokens=N, ignore_eos=True).tokens
    result = generate(deep, PROMPT, Eagle(head, k, tree=tree), max_new_tokens=N, ignore_eos=True)
    assert result.tokens == truth
    assert all(t % 2 == 0 for t, drafted in zip(result.tokens, result.drafted) if drafted)


def test_it_reads_the_fused_blocks_and_takes_no_other_vocabulary(deep, head) -> None:
    assert feature_layers(8) == (1, 3, 4) and head.feature_layers == (1, 3, 4)
    assert Eagle(head, 4).needs.hidden_states == (1, 3, 4)
    with pytest.raises(InvalidArgumentError, match="its own 129-token vocabulary"):
        Eagle(head, 4, torch.arange(10))


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_training_time_test_is_what_drafting_computes(deep, head, kind) -> None:
    """Step j of the unrolled head at position i equals drafting j tokens after the true features up to i - j: the
    head's cache fed with the target's features (fused, or the final one for an EAGLE-1 head), then its own outputs
    fed back one by one."""
    if kind == "eagle1":
        torch.manual_seed(2)
        head = EagleHead(head_config(deep.config)).eval().requires_grad_(False)
    tokens = torch.tensor([PROMPT + [7, 8, 9, 10, 11, 12]])
    _, hidden = deep(tokens[:, :-1], deep.new_cache(), hidden=list(head.feature_layers))
    features = hidden[:, :, :].flatten(2)[:, :-1]  # (1, T, 3D): g_i for i < T
    embeddings = deep.embed(tokens[:, 1:-1])  # x_{i+1}
    outputs = unrolled(head, features, embeddings, 4)
    for i, j in ((9, 0), (9, 2), (12, 3), (5, 1), (3, 3)):
        cache = head.new_cache(64, torch.float32)
        predicted = head(features[:, : i - j + 1], embeddings[:, : i - j + 1], cache)[:, -1:]
        for m in range(1, j + 1):
            predicted = head(predicted, embeddings[:, i - j + m : i - j + m + 1], cache)
        torch.testing.assert_close(predicted[0, -1], outputs[j][0, i], atol=1e-5, rtol=1e-4)


def test_save_and_load_in_eagle3s_layout(deep, head, tmp_path) -> None:
    folder = save_eagle3(head, tmp_path / "h", deep.name, {"draft_vocab": 0}, dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] and config["draft_vocab_size"] == len(VOCAB)
    assert not config["tie_word_embeddings"] and is_eagle3(folder)
    loaded = load_eagle3(folder, deep.config, torch.float32)
    assert torch.equal(loaded.own_vocab, VOCAB) and int(loaded.t2d.sum()) == len(VOCAB)
    keys = set(loaded.state_dict())
    assert {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "midlayer.hidden_norm.weight",
        "midlayer.self_attn.q_proj.weight",
    } <= keys
    assert loaded.midlayer.self_attn.q_proj.weight.shape == (64, 128)  # [embedding; feature] in
    truth = generate(deep, PROMPT, Eagle(head, 3), max_new_tokens=N, ignore_eos=True)
    again = generate(deep, PROMPT, Eagle(loaded, 3), max_new_tokens=N, ignore_eos=True)
    assert again.tokens == truth.tokens and again.drafted == truth.drafted
    small = load_model(random_checkpoint(tmp_path / "small", tiny_config(num_hidden_layers=2)))
    with pytest.raises(CheckpointError, match="not made for this target"):
        load_eagle3(folder, small.config, torch.float32)


def test_the_loss_falls_and_a_run_resumes(deep, tmp_path) -> None:
    torch.manual_seed(0)
    tokens = np.tile(np.arange(40, 90, dtype=np.uint32), 40)  # a repeating text the head can learn
    cfg = TrainConfig(
        hours=8 / 3600, batch_size=2, seq_len=32, lr=3e-3, warmup_steps=2, eval_every_minutes=1 / 60, bf16=False
    )
    head = new_head(deep.module, VOCAB)
    frozen = deep.module.eval().requires_grad_(False)
    loss = eagle3_loss(frozen, steps=2)
    batch = torch.from_numpy(tokens[:66].astype(np.int64)).view(2, 33)
    with torch.no_grad():
        before = float(loss(head, batch))
    evaluate = agreement_evaluator(frozen, tokens, 32, windows=4)
    first = train(head, cfg, tmp_path, tokens, loss, evaluate)
    with torch.no_grad():
        assert float(loss(head, batch)) < before
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert {f"val_top1_depth{d}" for d in range(1, 6)} <= set(log[-1])
    resumed = train(
        head, TrainConfig(**{**cfg.__dict__, "hours": cfg.hours + 2 / 3600}), tmp_path, tokens, loss, evaluate
    )
    assert resumed["step"] > first["step"] and resumed["tokens_seen"] > first["tokens_seen"]


def _names(finetune: str):
    def extra(writer) -> None:
        writer.add_basename("tinyllm")
        writer.add_size_label("1M")
        writer.add_finetune(finetune)

    return extra


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """The same tiny model in Q8_0 and in Q4_1 under other file names, and a fine-tune of it (another finetune name)."""
    folder = tmp_path_factory.mktemp("gguf")
    config = gguf_config(1027, num_hidden_layers=8)
    q8 = write_gguf(folder / "a.gguf", config, by_name({}, GGML.Q8_0), extra=_names("instruct"))
    q4 = write_gguf(folder / "other-name.gguf", config, by_name({}, GGML.Q4_1), extra=_names("instruct"))
    tuned = write_gguf(folder / "tuned.gguf", config, by_name({}, GGML.Q8_0), extra=_names("chat"))
    return q8, q4, tuned


@pytest.mark.parametrize("tree", [None, (2, 6)])
def test_greedy_identity_on_a_gguf_target_in_its_own_formats(gguf_files, tree) -> None:
    target = load_model(gguf_files[1], dtype="auto", exact=True)
    torch.manual_seed(1)
    head = new_head(target.module, torch.arange(0, 1027, 3)).eval().requires_grad_(False)
    truth = generate(target, PROMPT, max_new_tokens=N, ignore_eos=True).tokens
    assert generate(target, PROMPT, Eagle(head, 4, tree=tree), max_new_tokens=N, ignore_eos=True).tokens == truth


def test_the_shipped_head_is_found_by_the_files_metadata_not_its_path(gguf_files, tmp_path) -> None:
    q8, q4, tuned = gguf_files
    target = load_model(q8)
    models = tmp_path / "models"
    folder = save_eagle3(
        new_head(target.module, torch.arange(50)),
        models / "tiny-eagle",
        target.name,
        {"target_match": gguf_fingerprint(q8), "method": {"k": 5, "tree_top_k": 2, "tree_tokens": 8}},
    )
    (models / "unrelated").mkdir()
    assert shipped_head_for(q4, "eagle", models) == folder  # another file name and quantization, the same model
    assert shipped_head_for(tuned, "eagle", models) is None
    assert shipped_head_for(q4, "medusa", models) is None
    default = build_drafter(Method("eagle"), Resources(target=target, head_dir=folder))
    assert (default.k, default.tree) == (5, (2, 8))  # the folder's measured best
    chain = build_drafter(Method("eagle", 3), Resources(target=target, head_dir=folder))
    assert (chain.k, chain.tree) == (3, None)
    assert Method("eagle") in our_methods(None, eagle=True, eagle_default=True)  # the bench's row for the default
    assert Method("eagle") not in our_methods(None, eagle=True)
    with pytest.raises(InvalidArgumentError, match="its own 50-token vocabulary"):
        build_drafter(Method("eagle", 3, {"draft_vocab": 20}), Resources(target=target, head_dir=folder))


def test_no_head_made_for_a_file_reads_no_fingerprint(gguf_files, tmp_path, monkeypatch) -> None:
    """A start looks for a shipped head (`--method auto`); the fingerprint reads the file's whole vocabulary, so
    only a head made for some file's model (its `target_match`) makes it read one."""
    import verispec.checkpoints.shipped as shipped

    q8, _, _ = gguf_files
    target = load_model(q8)
    models = tmp_path / "models"
    save_eagle3(new_head(target.module, torch.arange(50)), models / "no-match", target.name, {"method": {"k": 3}})
    read = []
    monkeypatch.setattr(shipped, "gguf_fingerprint", lambda path: read.append(path) or gguf_fingerprint(path))
    assert shipped_head_for(q8, "eagle", models) is None
    assert read == []
    save_eagle3(
        new_head(target.module, torch.arange(50)), models / "match", target.name, {"target_match": gguf_fingerprint(q8)}
    )
    assert shipped_head_for(q8, "eagle", models) == models / "match"
    assert read == [q8]


def test_generate_with_method_eagle_alone_finds_the_head_for_the_files_model(
    gguf_files, tmp_path, monkeypatch, capsys
) -> None:
    """`verispec generate --target FILE.gguf --method eagle`: the head under models/ made for that file's model, by
    its metadata, drafting its folder's default; a file of another model is told to pass --head."""
    import verispec.checkpoints.shipped as default

    q8, q4, tuned = gguf_files
    target = load_model(q8)
    save_eagle3(
        new_head(target.module, torch.arange(200)),
        tmp_path / "tiny-eagle3",
        target.name,
        {"target_match": gguf_fingerprint(q8), "method": {"k": 3}},
    )
    monkeypatch.setattr(default, "MODELS", tmp_path)
    argv = [
        "generate",
        "hello",
        "--method",
        "eagle",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--compare",
        "--color",
        "never",
    ]
    with torch_threads(1):
        assert main([*argv, "--target", str(q4)]) == 0
        out = capsys.readouterr().out
        assert "identical to autoregressive: yes" in out
        assert len(next(line for line in out.splitlines() if "by position:" in line).split(":")[-1].split()) == 3
        assert main([*argv, "--target", str(tuned)]) == 2
    assert "--head DIR" in capsys.readouterr().err


def test_the_card_of_a_real_targets_head_is_measured_on_questions(tmp_path, capsys) -> None:
    """`train eagle-card --target DIR --questions FILE`: every draft measured on the questions' turns through the
    target's chat template, identical to plain decoding; the fastest recorded as the folder's default draft."""
    target_dir = random_checkpoint(
        tmp_path / "target", tiny_config(num_hidden_layers=8, max_position_embeddings=1024), seed=3
    )
    config = json.loads((target_dir / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    (target_dir / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    target = load_model(target_dir, dtype="float32")
    runs = tmp_path / "runs"
    folder = save_eagle3(random_head(target), runs / "eagle3" / "model", target.name, {"training_time_test_steps": 3})
    log = {"step": 1, "tokens_seen": 64, "hours": 0.01} | {f"val_top1_depth{d}": 0.1 for d in range(1, 6)}
    (runs / "eagle3" / "log.jsonl").write_text(json.dumps(log) + "\n")
    questions = tmp_path / "question.jsonl"
    questions.write_text(
        "".join(
            json.dumps(q) + "\n"
            for q in [
                {"question_id": 1, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
                {"question_id": 2, "category": "writing", "turns": ["Name a colour."]},
                {"question_id": 3, "category": "qa", "turns": ["Who wrote Hamlet?"]},
            ]
        )
    )
    args = [
        "train",
        "eagle-card",
        "--runs",
        str(runs),
        "--target",
        str(target_dir),
        "--questions",
        str(questions),
        "--per-category",
        "1",
        "--max-new-tokens",
        "12",
        "--threads",
        "1",
    ]
    assert main(args) == 0
    numbers = json.loads(capsys.readouterr().out)
    assert numbers["questions"] == 2 and numbers["turns"] == 3  # the first of each category, both turns of one
    drafts = [name for name in numbers if name.startswith(("chain", "tree"))]
    assert drafts and all(numbers[name]["identical_to_autoregressive"] == 1.0 for name in drafts)
    method = json.loads((folder / "config.json").read_text())["verispec"]["method"]
    assert numbers["default"] in drafts and method["k"] >= 4
    card = (folder / "README.md").read_text()
    assert "--per-category 1 --max-new-tokens 12" in card and f"| {numbers['default']} |" in card
    assert main(args[:6]) == 2  # no --questions: one line, exit 2
    assert "give --questions FILE" in capsys.readouterr().err
    assert main([*args, "--per-category", "0"]) == 2  # refused before the target loads
    assert "--per-category must be an integer >= 1" in capsys.readouterr().err

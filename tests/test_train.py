"""Training plumbing on tiny data: corpus split and manifest, tokenizer, a resumable loop, export. No real training."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from verispec import generate, load_model
from verispec.checkpoints.draft_vocab import save_draft_vocab
from verispec.checkpoints.tokenizer import EOT, save_tokenizer
from verispec.models.llama import LlamaForCausalLM
from verispec.train.card import write_cards
from verispec.train.corpus import MANIFEST, build_manifest, load_split, read_manifest, split_of, write_manifest
from verispec.train.draft import agreement_evaluator, kl_loss
from verispec.train.loop import TrainConfig, init_weights, train
from verispec.train.target import TARGET_CONFIG, export, lm_loss
from verispec.train.tokenizer import train_tokenizer

SOURCES = {f"pkg/mod{i}.py": f"def f{i}(x):\n    return x * {i}\n" for i in range(40)}


def fake_stdlib(root: Path) -> Path:
    for rel, text in (SOURCES | {"site-packages/other.py": "x = 1\n", "notes.txt": "not python"}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_split_is_a_deterministic_hash_of_the_path() -> None:
    splits = Counter(split_of(f"lib/file{i}.py") for i in range(4000))
    assert split_of("json/decoder.py") == split_of("json/decoder.py")
    assert 0.87 < splits["train"] / 4000 < 0.93 and splits["validation"] > 140 and splits["benchmark"] > 140


def test_manifest_lists_python_files_outside_site_packages(tmp_path) -> None:
    root = fake_stdlib(tmp_path / "lib")
    entries = build_manifest(root)
    assert sorted(e.path for e in entries) == sorted(SOURCES)
    write_manifest(entries, tmp_path / "manifest.jsonl")
    assert read_manifest(tmp_path / "manifest.jsonl") == entries
    (root / entries[0].path).write_text("changed")  # a file that no longer matches its sha256 is skipped
    texts = {
        split: load_split(split, tmp_path / "manifest.jsonl", root) for split in ("train", "validation", "benchmark")
    }
    assert sum(len(t) for t, _ in texts.values()) == len(SOURCES) - 1
    assert sum(skipped for _, skipped in texts.values()) == 1


def test_committed_manifest_keeps_benchmark_files_out_of_training() -> None:
    entries = read_manifest(MANIFEST)
    by_split = {s: {e.path for e in entries if e.split == s} for s in ("train", "validation", "benchmark")}
    assert len(entries) > 1000 and all(by_split.values())
    assert not by_split["train"] & by_split["benchmark"] and not by_split["train"] & by_split["validation"]
    assert all(e.split == split_of(e.path) for e in entries)


def test_tokenizer_round_trips_and_loads_in_transformers(tmp_path) -> None:
    tok = train_tokenizer(SOURCES.values(), vocab_size=300)
    assert tok.get_vocab_size() <= 300 and tok.token_to_id(EOT) == 0
    text = "def f7(x):\n    return x * 7  # é\n"
    assert tok.decode(tok.encode(text).ids) == text
    save_tokenizer(tok, tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert auto(text).input_ids == tok.encode(text).ids and auto.eos_token_id == 0


def tiny_run(run_dir: Path, seconds: float) -> tuple[LlamaForCausalLM, dict]:
    config = replace(
        TARGET_CONFIG,
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    init_weights(model)
    tokens = np.random.default_rng(0).integers(0, 300, 5000).astype(np.uint16)
    cfg = TrainConfig(
        hours=seconds / 3600, batch_size=2, seq_len=16, warmup_steps=2, eval_every_minutes=1e-4, bf16=False
    )
    return model, train(model, cfg, run_dir, tokens, lm_loss, lambda m: {"val_loss": 0.0})


def test_training_resumes_from_its_state(tmp_path) -> None:
    model, first = tiny_run(tmp_path, 0.5)
    assert first["step"] > 0 and (tmp_path / "state.pt").exists()
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == first["step"] and {"train_loss", "lr", "tokens_seen", "hours"} <= log[-1].keys()
    resumed, again = tiny_run(tmp_path, 0.5)  # budget already spent: loads the state and stops
    assert again["step"] == first["step"]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), resumed.state_dict().values()))
    _, longer = tiny_run(tmp_path, 1.0)  # a larger budget continues from the saved step
    assert longer["step"] > first["step"] and longer["tokens_seen"] > first["tokens_seen"]


def test_a_paused_step_does_not_spend_the_budget(tmp_path, monkeypatch) -> None:
    """A step during which the process was stopped (SIGSTOP) for an hour counts as a usual step."""
    import verispec.train.loop as loop

    clock, steps = [0.0], [0]

    def perf_counter() -> float:  # each call a tenth of a second later; the end of the fourth step an hour later
        clock[0] += 3600.0 if steps[0] == 7 else 0.1
        steps[0] += 1
        return clock[0]

    monkeypatch.setattr(loop.time, "perf_counter", perf_counter)
    _, result = tiny_run(tmp_path, 2.0)  # a budget of two seconds: far less than the pause
    assert result["step"] > 10 and result["hours"] < 3 / 3600


def test_export_loads_natively_and_in_transformers(tmp_path) -> None:
    model, _ = tiny_run(tmp_path / "run", 0.2)
    tok = train_tokenizer(SOURCES.values(), vocab_size=300)
    save_tokenizer(tok, tmp_path / "tok")
    folder = export(model, tmp_path / "tok", tmp_path / "model")
    native = load_model(folder, dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode("def f1(x):").ids])
    torch.testing.assert_close(native(ids, native.new_cache()), hf(ids).logits, atol=1e-4, rtol=0)
    assert generate(native, "def f1(x):", max_new_tokens=5, ignore_eos=True).stats.new_tokens == 5


def test_distillation_loss_and_agreement(tmp_path) -> None:
    teacher, _ = tiny_run(tmp_path / "teacher", 0.2)
    batch = torch.randint(0, 300, (2, 17))
    with torch.no_grad():
        assert float(kl_loss(teacher)(teacher, batch)) < 1e-6  # the target is its own perfect draft
    tokens = np.random.default_rng(1).integers(0, 300, 2000).astype(np.uint16)
    evaluate = agreement_evaluator(teacher, tokens, seq_len=16, windows=4)
    assert evaluate(teacher) == {"val_kl": pytest.approx(0.0, abs=1e-6), "val_top1_agreement": 1.0}
    student, _ = tiny_run(tmp_path / "student", 0.0)
    with torch.no_grad():
        for p in student.parameters():  # far from the teacher (a fresh init would share its copy-the-input bias)
            p.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(p.numel()))
        assert evaluate(student)["val_top1_agreement"] < 0.5 and float(kl_loss(teacher)(student, batch)) > 0.01


def test_cards_state_measured_numbers(tmp_path, pair_dirs) -> None:
    target, draft = load_model(pair_dirs[0]), load_model(pair_dirs[1])
    for run, extra in (("t", {"val_loss": 2.0, "val_bpb": 0.9}), ("d", {"val_kl": 0.5, "val_top1_agreement": 0.6})):
        (tmp_path / run).mkdir()
        (tmp_path / run / "log.jsonl").write_text(
            json.dumps({"tokens_seen": 10**6, "hours": 2.0, "train_loss": 2.1} | extra)
        )
    dirs = [tmp_path / "target", tmp_path / "draft"]
    for d in dirs:
        d.mkdir()
    save_draft_vocab(dirs[1], torch.arange(draft.vocab_size))  # as `verispec train draft` writes them
    (dirs[1] / "config.json").write_text(json.dumps({"verispec": {"draft_vocab": 50}}))
    numbers = write_cards(target, draft, *dirs, tmp_path / "t", tmp_path / "d", num_prompts=3)
    pair = numbers["pair"]
    assert pair["prompts"] == 3 and 0 < pair["acceptance_rate"] < 1 and pair["identical_to_autoregressive"] == 1.0
    card = (dirs[0] / "README.md").read_text()
    assert f"tau {pair['tau']:.2f}" in card and "0.900 bits per byte" in card and card.count("```python") == 3
    draft_card = (dirs[1] / "README.md").read_text()
    assert f"{numbers['draft_cost_ratio']:.3f} of the target's" in draft_card
    assert "among the 50 most frequent" in draft_card and f"tau {numbers['draft_vocab']['tau']:.2f}" in draft_card

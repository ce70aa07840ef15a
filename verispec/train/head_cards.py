"""Model cards for drafting heads (EAGLE, Medusa): every number in them is measured here, rerunnable by anyone."""

from __future__ import annotations

import json
import os
from pathlib import Path

from verispec.checkpoints.draft_vocab import default_size, head_draft_vocab, load_draft_vocab
from verispec.drafters.eagle import EAGLE_TREE, EAGLE_TREE_DEPTH, Eagle
from verispec.drafters.medusa import TREE_TOKENS, Medusa
from verispec.heads.eagle import load_head
from verispec.heads.eagle3 import load_eagle3
from verispec.heads.medusa import load_heads
from verispec.models.native import NativeModel
from verispec.models.timing import head_step_seconds, medusa_step_seconds
from verispec.train.card import decode_step_time, last_log, measure, validation_prompts
from verispec.train.eagle3 import STEPS
from verispec.train.question_measure import first_of_each_category, measure_questions

EAGLE_VOCAB = 2048  # the reduced draft vocabulary a card measures: the most frequent quarter of the shipped tokenizer


def _by_position(numbers: dict) -> str:
    return " ".join(f"{rate:.2f}" for rate in numbers["acceptance_by_position"])


def write_eagle_card(target: NativeModel, head_dir: Path, run_dir: Path, num_prompts: int = 20) -> dict:
    """Measure an EAGLE head for the card (acceptance by position and tau, chain and tree, identity with plain
    decoding, the cost of a drafting step relative to a target step) and write README.md into its folder."""
    log, head = last_log(run_dir), load_head(head_dir, target.config, target.dtype, target.device)
    prompts = validation_prompts(target, num_prompts)
    chain = measure(target, Eagle(head, 4), prompts)
    tree = measure(
        target, Eagle(head, EAGLE_TREE_DEPTH, tree=(EAGLE_TREE["tree_top_k"], EAGLE_TREE["tree_tokens"])), prompts
    )
    size = default_size(head_dir) or EAGLE_VOCAB  # the folder's own reduced vocabulary where it chooses one
    reduced = measure(target, Eagle(head, 4, load_draft_vocab(head_dir, size)), prompts)
    default = reduced if default_size(head_dir) else chain  # what `--method eagle` runs: k = 4, its vocabulary
    step = decode_step_time(target)
    cost, reduced_cost = head_step_seconds(target, head) / step, head_step_seconds(target, head, size) / step
    numbers = {
        "head": log,
        "chain": chain,
        "tree": tree,
        "reduced_vocab_chain": reduced,
        "default": default,
        "draft_cost_ratio": cost,
        "reduced_vocab_cost_ratio": reduced_cost,
    }
    by_position = _by_position(chain)
    (head_dir / "README.md").write_text(
        f"# verispec EAGLE head for {target.name}\n\nEAGLE-1/2 draft head (Li et al. 2024): fc over [embedding; "
        f"feature] ({2 * head.config.hidden_size} -> {head.config.hidden_size}), one Llama decoder layer without its "
        f"input norm, and the target's own embedding and LM head (not stored); "
        f"{sum(p.numel() for p in head.parameters()) / 1e6:.1f}M parameters, bf16. Keys as in EAGLE's checkpoints: "
        f"`fc.weight`, `layers.0.*`. vLLM's `eagle` method loads this folder as it is and drafts over the full "
        f"vocabulary (so expect the full-vocabulary row below); for SGLang, `verispec export eagle --for sglang OUT` "
        f"(with its token map, the reduced-vocabulary row; docs/scale-out.md).\n\n"
        f"Training: `verispec train eagle --hours {log['hours']:.2f}` on the frozen target's final-normed features, "
        f"computed on the fly over the standard library's train split: {log['tokens_seen'] / 1e6:.2f}M tokens in "
        f"{log['hours']:.2f} h of training steps on {os.cpu_count()} CPU cores (one thread, beside other work); loss "
        f"smooth-L1 on the next feature + 0.1 x cross-entropy to the target's next-token distribution. Validation "
        f"top-1 agreement with the target: {log['val_top1_depth1']:.1%} at depth 1 (from the target's features), "
        f"{log['val_top1_depth2']:.1%} at depth 2 (from its own predicted feature).\n\n"
        f"Measured (`verispec train eagle-card --threads 1`; {chain['prompts']} validation prompts of 64 tokens, "
        "64 new tokens, greedy):\n"
        f"- the default, `--method eagle`, is the chain at k = 4 over {_default_vocab(head_dir)}: tau "
        f"{default['tau']:.2f} (below)\n"
        f"- chain, k = 4, full vocabulary: acceptance {chain['acceptance_rate']:.1%} (by position {by_position}), tau "
        f"{chain['tau']:.2f}; token-identical to plain decoding on {chain['identical_to_autoregressive']:.0%}\n"
        f"- EAGLE-2 tree ({EAGLE_TREE_DEPTH} deep, {EAGLE_TREE['tree_top_k']} expanded per depth, "
        f"{EAGLE_TREE['tree_tokens']} nodes "
        f"verified): tau {tree['tau']:.2f}; identical on {tree['identical_to_autoregressive']:.0%}\n"
        f"- chain, k = 4, drafting over the {size} most frequent training tokens (`--draft-vocab "
        f"{size}`): acceptance {reduced['acceptance_rate']:.1%}, tau {reduced['tau']:.2f}; identical on "
        f"{reduced['identical_to_autoregressive']:.0%}\n"
        f"- one drafting step costs {cost:.3f} of a target decoding step with the full {target.config.vocab_size}-wide "
        f"LM head, {reduced_cost:.3f} with the {size}-token one (one thread)\n"
    )
    return numbers


def write_medusa_card(target: NativeModel, head_dir: Path, run_dir: Path, num_prompts: int = 20) -> dict:
    """Measure Medusa heads for the card (acceptance by depth and tau of the default tree, over the full and the
    reduced draft vocabulary, identity with plain decoding, the drafting step's cost) and write README.md."""
    log = last_log(run_dir)
    heads, accuracy = load_heads(
        head_dir, target.hidden_size, target.lm_head_weight.shape[0], target.dtype, target.device
    )
    prompts, vocab = validation_prompts(target, num_prompts), load_draft_vocab(head_dir, EAGLE_VOCAB)
    full = measure(target, Medusa(heads, accuracy), prompts)
    reduced = measure(target, Medusa(heads, accuracy, vocab=vocab), prompts)
    step = decode_step_time(target)
    cost, reduced_cost = medusa_step_seconds(target, heads) / step, medusa_step_seconds(target, heads, vocab) / step
    numbers = {
        "heads": log,
        "tree": full,
        "reduced_vocab_tree": reduced,
        "draft_cost_ratio": cost,
        "reduced_vocab_cost_ratio": reduced_cost,
    }
    top1 = ", ".join(f"{rate:.1%}" for rate in log["val_top1_by_head"])
    (head_dir / "README.md").write_text(
        f"# verispec Medusa heads for {target.name}\n\nMedusa-1 heads (Cai et al. 2024): {heads.num_heads} heads "
        "on the target's final-normed feature, head i guessing the token i + 2 positions ahead; each a residual SiLU "
        f"block ({heads.hidden} -> {heads.hidden}) and its own LM head ({heads.vocab} rows, initialised from the "
        f"target's); {sum(p.numel() for p in heads.parameters()) / 1e6:.1f}M parameters, bf16. Keys as in the Medusa "
        f"reference repository's model: `medusa_head.{{i}}.0.linear.weight`/`.bias`, `medusa_head.{{i}}.1.weight`; "
        f"`verispec/medusa_accuracy.json` holds the measured accuracy by head and rank that shapes the tree (not "
        f"Medusa's `medusa_choices`, a list of tree paths). No current serving engine serves these heads (SGLang "
        f"has no Medusa algorithm, vLLM's Medusa model reads other names and would run its heads uninitialised): they "
        f"run in verispec only.\n\n"
        f"Training: `verispec train medusa --hours {log['hours']:.2f}` on the frozen target's features, computed "
        f"on the fly over the standard library's train split: {log['tokens_seen'] / 1e6:.2f}M tokens in "
        f"{log['hours']:.2f} h of training steps on {os.cpu_count()} CPU cores (one thread, beside other work); loss: "
        "KL to the target's own next-token distribution at each head's position (self-distillation), head i weighted "
        f"0.8**i. Validation top-1 agreement with the target's choice, by head: {top1}.\n\n"
        f"Measured (`verispec train medusa-card --threads 1`; {full['prompts']} validation prompts of 64 tokens, 64 "
        f"new tokens, greedy), the default tree of {TREE_TOKENS} nodes shaped by that table (`--method medusa` drafts "
        f"over {_default_vocab(head_dir)}):\n"
        f"- full vocabulary: acceptance by depth {_by_position(full)}, tau {full['tau']:.2f}; token-identical to plain "
        f"decoding on {full['identical_to_autoregressive']:.0%}\n"
        f"- drafting over the {EAGLE_VOCAB} most frequent training tokens (`--draft-vocab {EAGLE_VOCAB}`): acceptance "
        f"by depth {_by_position(reduced)}, tau {reduced['tau']:.2f}; identical on "
        f"{reduced['identical_to_autoregressive']:.0%}\n"
        f"- one drafting step (all heads, once per target step) costs {cost:.3f} of a target decoding step with full "
        f"LM heads, {reduced_cost:.3f} with {EAGLE_VOCAB}-row ones (one thread)\n"
    )
    return numbers


def _default_vocab(head_dir: Path) -> str:
    """The draft vocabulary a head's folder chooses (config.json's verispec.draft_vocab), in words."""
    vocab = head_draft_vocab(head_dir, None)
    return "the full vocabulary" if vocab is None else f"its {len(vocab)} most frequent training tokens"


# The drafts an EAGLE-3 card measures: a chain of 4 (the issue's), and EAGLE-2 trees (depth, nodes expanded per
# depth, nodes verified); the best measured becomes the folder's default (`--method eagle` alone).
EAGLE3_DRAFTS = {
    "chain k=4": (4, None),
    "chain k=6": (6, None),
    "tree 6/2/10": (6, (2, 10)),
    "tree 6/3/16": (6, (3, 16)),
    "tree 8/4/24": (8, (4, 24)),
}


def write_eagle3_card(
    target: NativeModel,
    render,
    head_dir: Path,
    run_dir: Path,
    questions: list[dict],
    questions_file: str,
    per_category: int = 4,
    max_new_tokens: int = 128,
) -> dict:
    """Measure an EAGLE-3 head on Spec-Bench questions (the first `per_category` of each category; every draft in
    EAGLE3_DRAFTS: acceptance by position, tau, identity, speedup) and the cost of its drafting step; record the
    fastest draft as the folder's default (config.json verispec.method) and write README.md."""
    log, head = last_log(run_dir), load_eagle3(head_dir, target.config, target.dtype, target.device)
    chosen = first_of_each_category(questions, per_category)
    drafters = {name: Eagle(head, k, tree=tree) for name, (k, tree) in EAGLE3_DRAFTS.items()}
    numbers = measure_questions(target, render, chosen, drafters, max_new_tokens)
    step = decode_step_time(target)
    cost = head_step_seconds(target, head) / step
    best = max(EAGLE3_DRAFTS, key=lambda name: numbers[name]["speedup"])
    k, tree = EAGLE3_DRAFTS[best]
    config = json.loads((head_dir / "config.json").read_text())
    config["verispec"]["method"] = {"k": k} | ({} if tree is None else {"tree_top_k": tree[0], "tree_tokens": tree[1]})
    (head_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    numbers |= {"head": log, "draft_cost_ratio": cost, "default": best}
    rows = "\n".join(
        f"| {name} | {n['tau']:.2f} | {_by_position(n)} | {n['speedup']:.2f} | {n['identical_to_autoregressive']:.0%} |"
        for name in EAGLE3_DRAFTS
        for n in [numbers[name]]
    )
    depths = ", ".join(f"{log[key]:.1%}" for key in sorted(log) if key.startswith("val_top1_depth"))
    sizes = config["verispec"].get("training_tokens", {})
    (head_dir / "README.md").write_text(
        f"# verispec EAGLE-3 head for {target.name}\n\n"
        f"EAGLE-3 draft head (Li et al. 2025): fc over the target's fused low, middle and high features (the residual "
        f"streams entering blocks {', '.join(str(i + 1) for i in head.feature_layers)}; "
        f"{3 * head.config.hidden_size} -> {head.config.hidden_size}), one decoder layer over [norm(embedding); "
        f"norm(feature)], its own final norm and LM head over the {len(head.own_vocab)} tokens most frequent in its "
        f"training text (`d2t`, `t2d`); {sum(p.numel() for p in head.parameters()) / 1e6:.1f}M parameters, bf16. "
        f"EAGLE-3's checkpoint layout "
        f'(`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`; `architectures: ["LlamaForCausalLMEagle3"]`), which '
        f"vLLM's `eagle3` method and SGLang's `EAGLE3` load as it is (docs/scale-out.md). verispec finds it for a GGUF "
        f"file of this model by the file's metadata (config.json's `verispec.target_match`).\n\n"
        f"Training: `verispec train eagle --target FILE.gguf --hours {log['hours']:.2f}` (after `verispec train "
        f"distill`), features computed on the fly by the frozen target in bfloat16, training-time test over "
        f"{config['verispec'].get('training_time_test_steps', STEPS)} steps, cross-entropy to the target's next-token "
        "distribution over the draft vocabulary: "
        f"{log['tokens_seen'] / 1e6:.2f}M tokens in {log['hours']:.2f} h of training steps on {os.cpu_count()} CPU "
        f"cores (one thread, beside other work). Training text, tokens by source (train / validation): "
        f"{json.dumps(sizes)}; the target's own greedy answers to instruction prompts written for it "
        f"(verispec/train/prompts.py), prose and dialogue from Debian documentation packages (verispec/train/prose.py, "
        f"licences there), the standard library's code. Validation top-1 agreement with the target by draft depth: "
        f"{depths}.\n\n"
        f"Measured on the Spec-Bench dev questions ({questions_file}: the first {per_category} of each category, "
        f"{numbers['questions']} questions, {numbers['turns']} turns, each answered up to {max_new_tokens} tokens as "
        f"the target answers it; greedy, one thread; `verispec train eagle-card --target FILE.gguf --questions "
        f"{questions_file} --per-category {per_category} --max-new-tokens {max_new_tokens} --threads 1`). "
        f"Depth/expanded/verified for trees; speedup is wall-clock against plain decoding, interleaved turn by turn "
        f"on a shared machine (the bench's report is the place for speed):\n\n"
        f"| draft | tau | acceptance by position | speedup | identical |\n| --- | --- | --- | --- | --- |\n{rows}\n\n"
        f"`--method eagle` alone drafts the fastest of these, {best} (config.json verispec.method). One drafting step "
        f"(the head and its LM head, one token) costs c = {cost:.3f} of a target decoding step (one thread).\n"
    )
    return numbers

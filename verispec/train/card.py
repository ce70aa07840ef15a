"""Model cards for the default pair: every number in them is measured by this script, rerunnable by anyone."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from verispec.checkpoints.draft_vocab import default_size, load_draft_vocab
from verispec.drafters import Drafter, DraftModel
from verispec.generate import generate
from verispec.models.forward_options import VocabHead
from verispec.models.native import NativeModel
from verispec.stats import GenerationStats
from verispec.train.corpus import load_split

SAMPLE_PROMPTS = (
    "def parse_header(line):",
    "class LRUCache:\n    def __init__(self, capacity):",
    "import os\n\ndef walk(",
)


def validation_prompts(target: NativeModel, count: int = 20, length: int = 64) -> list[list[int]]:
    """The first `length` tokens of the first `count` validation files that are long enough."""
    texts, _ = load_split("validation")
    prompts = [ids[:length] for text in texts if len(ids := target.tokenizer.encode(text).ids) > 2 * length]
    return prompts[:count]


def decode_step_time(model: NativeModel, tokens: int = 32, repeats: int = 5, head: VocabHead | None = None) -> float:
    """Median seconds per one-token forward after a 64-token prefill (batch 1); `head`: by an LM head over part of the
    vocabulary."""
    times = []
    for _ in range(repeats):
        cache = model.new_cache()
        model(torch.arange(64, device=model.device)[None], cache)
        start = time.perf_counter()
        for i in range(tokens):
            model(torch.tensor([[i]], device=model.device), cache, head=head)
        times.append((time.perf_counter() - start) / tokens)
    return statistics.median(times)


def measure(target: NativeModel, drafter: Drafter, prompts: list[list[int]], max_new_tokens: int = 64) -> dict:
    """Greedy speculative decoding on each prompt: acceptance (overall and by position), tau, and identity with
    plain decoding."""
    total, identical = GenerationStats(), 0
    for prompt in prompts:
        spec = generate(target, prompt, drafter, max_new_tokens=max_new_tokens, ignore_eos=True)
        plain = generate(target, prompt, max_new_tokens=max_new_tokens, ignore_eos=True)
        s = spec.stats
        total.new_tokens, total.target_calls = total.new_tokens + s.new_tokens, total.target_calls + s.target_calls
        total.proposed, total.accepted = total.proposed + s.proposed, total.accepted + s.accepted
        for i, (p, a) in enumerate(zip(s.proposed_by_position, s.accepted_by_position)):
            total.record_position(i, p, a)
        identical += spec.tokens == plain.tokens
    return {
        "k": drafter.k,
        "prompts": len(prompts),
        "acceptance_rate": total.acceptance_rate,
        "tau": total.tau,
        "acceptance_by_position": total.acceptance_by_position,
        "identical_to_autoregressive": identical / len(prompts),
    }


def measure_pair(
    target: NativeModel, draft: NativeModel, prompts: list[list[int]], k: int = 4, max_new_tokens: int = 64
) -> dict:
    """The draft model at k (see `measure`)."""
    return measure(target, DraftModel(draft, k), prompts, max_new_tokens)


def last_log(run_dir: Path) -> dict:
    lines = (run_dir / "log.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


def samples(target: NativeModel, draft: NativeModel) -> list[str]:
    out = []
    for prompt in SAMPLE_PROMPTS:
        result = generate(target, prompt, DraftModel(draft, 4), max_new_tokens=80)
        out.append(
            f"```python\n{prompt}{result.text}\n```\n(tau {result.stats.tau:.2f}, "
            f"acceptance {result.stats.acceptance_rate:.0%})"
        )
    return out


def _params(model: NativeModel) -> float:
    return sum(p.numel() for p in model.module.parameters()) / 1e6


def write_cards(
    target: NativeModel,
    draft: NativeModel,
    target_dir: Path,
    draft_dir: Path,
    target_run: Path,
    draft_run: Path,
    num_prompts: int = 20,
) -> dict:
    """Measure everything the cards state and write README.md into both model folders; returns the numbers."""
    t_log, d_log = last_log(target_run), last_log(draft_run)
    pair = measure_pair(target, draft, validation_prompts(target, num_prompts))
    cost = decode_step_time(draft) / decode_step_time(target)
    numbers = {"target": t_log, "draft": d_log, "pair": pair, "draft_cost_ratio": cost}
    shared = (
        f"Data: the `.py` files of the Python {'.'.join(map(str, __import__('sys').version_info[:3]))} standard "
        f"library, train split of `data/stdlib_manifest.jsonl` (90 / 5 / 5 by a hash of the path).\n"
        f"Reproduce: `verispec train target --hours {t_log['hours']:.2f}`, `verispec train draft --hours "
        f"{d_log['hours']:.2f}`, then `verispec train card --threads 1` (training hours count training steps only, "
        f"so the token counts below depend on the machine).\n"
    )
    speculation = (
        f"Greedy speculative decoding at k = {pair['k']} on {pair['prompts']} validation prompts "
        f"(64-token prompts, 64 new tokens): acceptance rate {pair['acceptance_rate']:.1%}, "
        f"tau {pair['tau']:.2f} tokens per target call, token-identical to plain decoding on "
        f"{pair['identical_to_autoregressive']:.0%} of prompts.\n"
    )
    size = default_size(draft_dir)
    vocabulary = ""
    if size:  # the draft vocabulary it drafts among by default (`verispec train draft` writes it)
        drafter = DraftModel(draft, pair["k"], vocab=load_draft_vocab(draft_dir, size))
        numbers["draft_vocab"] = measure(target, drafter, validation_prompts(target, num_prompts))
        numbers["draft_vocab_cost_ratio"] = decode_step_time(draft, head=drafter.head) / decode_step_time(target)
        v = numbers["draft_vocab"]
        vocabulary = (
            f"Draft vocabulary: by default (`verispec.draft_vocab` in config.json) it drafts among the {size} "
            f"most frequent tokens of the train split (`verispec/draft_vocab.safetensors`), by an LM head over them "
            f"alone: one decoding step then costs {numbers['draft_vocab_cost_ratio']:.3f} of the target's; "
            f"on the same prompts, acceptance rate {v['acceptance_rate']:.1%}, tau {v['tau']:.2f}, "
            f"token-identical on {v['identical_to_autoregressive']:.0%} (`--draft-vocab 0`: every token, as "
            f"above).\n\n"
        )
    sample_text = "\n\n".join(samples(target, draft))
    (target_dir / "README.md").write_text(
        f"# verispec default target\n\nLlama architecture, {_params(target):.1f}M parameters, "
        f"{target.context_length} positions, {target.config.vocab_size}-token byte-level BPE.\n\n{shared}\n"
        f"Training: {t_log['tokens_seen'] / 1e6:.2f}M tokens seen in {t_log['hours']:.2f} h of training steps on "
        f"{os.cpu_count()} CPU cores; "
        f"final train loss {t_log['train_loss']:.3f}, validation loss {t_log['val_loss']:.3f} nats/token, "
        f"{t_log['val_bpb']:.3f} bits per byte.\n\n{speculation}\n"
        f"## Samples (with the default draft, k = 4)\n\n{sample_text}\n"
    )
    (draft_dir / "README.md").write_text(
        f"# verispec default draft\n\nLlama architecture, {_params(draft):.1f}M parameters, same tokenizer as the "
        f"target; one decoding step costs {cost:.3f} of the target's (measured).\n\n{shared}\n"
        f"Training: distilled from the target by KL divergence to its logits, {d_log['tokens_seen'] / 1e6:.2f}M tokens "
        f"in {d_log['hours']:.2f} h; validation KL {d_log['val_kl']:.3f}, top-1 agreement with the target "
        f"{d_log['val_top1_agreement']:.1%}.\n\n{speculation}\n{vocabulary}"
    )
    return numbers

"""Training an EAGLE-3 head on a frozen target, with training-time test: features computed on the fly, nothing stored.

For a window x_0..x_L the target gives, at each position i < L, its fused features g_i (the outputs of the blocks
`head.feature_layers`) and its next-token logits over the draft vocabulary. Step 0 of the head reads (g_i, embedding
of x_{i+1}) at every position, causally, as drafting's first token does. Step j > 0 then reads, at position i, step
j - 1's output at i - 1 with the same embedding, and attends as drafting would after j tokens of its own: to step 0's
keys at positions <= i - j (built from the target's features) and to step m's key at i - j + m for m = 1..j (its
own drafts' entries, on the diagonal). Every step's output at i is held to the target's distribution for x_{i+2}
(cross-entropy, over the draft vocabulary), step j weighted DECAY**j; positions i < j have no such history and are
left out. There is no regression on features: the head's own feature space is free (EAGLE-3).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from verispec.heads.eagle import EagleHead, head_config
from verispec.heads.eagle3 import Eagle3Head, feature_layers, save_eagle3
from verispec.models.forward_options import ForwardOptions
from verispec.models.layout import apply_rotary, rotary
from verispec.models.llama import LlamaForCausalLM
from verispec.models.protocol import FINAL
from verispec.train.loop import TrainConfig, even_windows, init_weights, train

DECAY = 0.8  # EAGLE-3's weight of step j's loss: DECAY ** j
STEPS = 3  # training-time test steps; 1: none (the head only ever sees the target's features in training)
EVAL_STEPS = 5  # depths the validation reports, whatever the training unrolled


def target_view(
    target: LlamaForCausalLM, batch: torch.Tensor, layers: tuple[int, ...], vocab: torch.Tensor, full: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target over the windows' inputs: fused features (B, L, len(layers) * D) and next-token logits
    (B, L, N) over the draft vocabulary `vocab` (N,) only (the rest of the LM head is never computed), or over the
    whole vocabulary where `full`."""
    with torch.no_grad():
        _, states = target(batch[:, :-1], options=ForwardOptions(hidden=[*layers, FINAL], logits_from=batch.shape[1]))
        weight = target.lm_head.weight if full else target.lm_head.weight[vocab]
        logits = F.linear(states[-1], weight)
    return torch.cat(states[:-1], dim=-1).float(), logits.float()  # float32: the head's dtype outside autocast


def _shift(x: torch.Tensor, s: int) -> torch.Tensor:
    """x (..., T, C) moved s positions later along T: out[..., i, :] = x[..., i - s, :], zeros before."""
    return x if s == 0 else F.pad(x[..., : x.shape[-2] - s, :], (0, 0, s, 0))


def _attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Step j = len(keys) - 1's attention: to step 0's keys at t <= i - j and to step m's key at i - j + m."""
    j, T = len(keys) - 1, q.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    first = (q @ keys[0].transpose(-1, -2)) * scale  # (B, H, T, T)
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril(-j)
    scores = [first.masked_fill(~allowed, float("-inf"))]
    for m in range(1, j + 1):
        key = _shift(keys[m], j - m)
        diagonal = (q * key).sum(-1, keepdim=True) * scale  # (B, H, T, 1)
        valid = torch.arange(T, device=q.device) >= j - m  # the entry exists
        scores.append(diagonal.masked_fill(~valid[:, None], float("-inf")))
    weights = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
    out = weights[..., :T] @ values[0]
    for m in range(1, j + 1):
        out = out + weights[..., T + m - 1 : T + m] * _shift(values[m], j - m)
    return out


def unrolled(
    head: Eagle3Head | EagleHead, features: torch.Tensor, embeddings: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """The head's outputs (B, T, D) at each of `steps` training-time-test steps, from the target's features (B, T,
    3D fused for an EAGLE-3 head, D final-normed for an EAGLE-1 one) and the next tokens' embeddings (B, T, D) (see
    the module's docstring)."""
    layer = head.layer
    attn = layer.self_attn
    B, T, _ = embeddings.shape
    H, Hkv, d = attn.heads, attn.kv_heads, attn.head_dim
    cos, sin = rotary(
        torch.arange(T, device=embeddings.device), d, head.config.rope_theta, embeddings.dtype, head.config.rope_factors
    )
    h, keys, values, outputs = features, [], [], []
    for _ in range(steps):
        x, residual = head.step_inputs(h, embeddings)
        q = apply_rotary(attn.q_proj(x).view(B, T, H, d).transpose(1, 2), cos, sin)
        k = apply_rotary(attn.k_proj(x).view(B, T, Hkv, d).transpose(1, 2), cos, sin)
        v = attn.v_proj(x).view(B, T, Hkv, d).transpose(1, 2)
        keys.append(k.repeat_interleave(H // Hkv, dim=1))
        values.append(v.repeat_interleave(H // Hkv, dim=1))
        y = _attend(q, keys, values).transpose(1, 2).reshape(B, T, H * d)
        mid = residual + attn.o_proj(y)
        out = layer.mlp(layer.post_attention_layernorm(mid), residual=mid)
        outputs.append(out)
        h = _shift(out, 1)  # step j + 1 at position i reads step j's output at i - 1
    return outputs


def _inputs(head: Eagle3Head, target: LlamaForCausalLM, batch: torch.Tensor, full: bool = False):
    features, logits = target_view(target, batch, head.feature_layers, head.own_vocab, full)
    with torch.no_grad():
        embeddings = target.model.embed_tokens(batch[:, 1:-1]).float()  # x_{i+1} for i < L - 1
    return features[:, :-1], embeddings, logits[:, 1:]  # logits[:, i]: the target's guess of x_{i+2}


def ttt_loss(
    head: Eagle3Head | EagleHead,
    features: torch.Tensor,
    embeddings: torch.Tensor,
    p: torch.Tensor,
    steps: int,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The training-time test's loss: each step's cross-entropy to the target's distribution `p` (B, T, N) over the
    draft vocabulary, by the logits `logits_of` gives its outputs, step j weighted DECAY**j."""
    total = 0.0
    for j, out in enumerate(unrolled(head, features, embeddings, steps)):
        log_q = F.log_softmax(logits_of(out[:, j:]).float(), -1)
        total = total + DECAY**j * -(p[:, j:] * log_q).sum(-1).mean()
    return total / sum(DECAY**j for j in range(steps))


def eagle3_loss(target: LlamaForCausalLM, steps: int = STEPS):
    def loss(head: Eagle3Head, batch: torch.Tensor) -> torch.Tensor:
        features, embeddings, logits = _inputs(head, target, batch)
        return ttt_loss(head, features, embeddings, F.softmax(logits, -1), steps, head.logits)

    return loss


def agreement_evaluator(target: LlamaForCausalLM, tokens: np.ndarray, seq_len: int, windows: int = 8):
    """Top-1 agreement of the head's draft with the target's own choice (over the whole vocabulary) at each depth of
    drafting, on fixed validation windows: depth d is step d - 1 of the training-time test."""
    batch = even_windows(tokens, windows, seq_len)

    @torch.no_grad()
    def evaluate(head: Eagle3Head) -> dict:
        agree = [[] for _ in range(EVAL_STEPS)]
        for i in range(0, windows, 4):
            features, embeddings, logits = _inputs(head, target, batch[i : i + 4], full=True)
            choice = logits.argmax(-1)
            for j, out in enumerate(unrolled(head, features, embeddings, EVAL_STEPS)):
                drafted = head.own_vocab[head.logits(out[:, j:]).argmax(-1)]
                agree[j].append((drafted == choice[:, j:]).float().mean())
        return {f"val_top1_depth{j + 1}": float(torch.stack(v).mean()) for j, v in enumerate(agree)}

    return evaluate


def new_head(target: LlamaForCausalLM, draft_ids: torch.Tensor) -> Eagle3Head:
    """A freshly initialised head for `target`, drafting over `draft_ids` (most frequent first): its LM head and final
    norm start as the target's rows and norm (a start the head's own feature space can move away from)."""
    head = Eagle3Head(head_config(target.config), draft_ids, feature_layers(target.config.num_hidden_layers))
    init_weights(head)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight[draft_ids])
        head.norm.weight.copy_(target.model.norm.weight)
    return head


def train_eagle3(
    run_dir: Path,
    target: LlamaForCausalLM,
    target_name: str,
    train_tokens: np.ndarray,
    val_tokens: np.ndarray,
    draft_ids: torch.Tensor,
    cfg: TrainConfig,
    steps: int = STEPS,
    extra: dict | None = None,
) -> Path:
    """Train a head for the frozen module `target` on the token windows of `train_tokens`; saved in run_dir/model."""
    torch.manual_seed(cfg.seed)
    head = new_head(target, draft_ids)
    print(
        f"eagle-3 head: {sum(p.numel() for p in head.parameters()) / 1e6:.1f}M parameters, {len(draft_ids)} draft "
        f"tokens, {steps} training-time-test steps",
        flush=True,
    )
    train(
        head,
        cfg,
        run_dir,
        train_tokens,
        eagle3_loss(target, steps),
        agreement_evaluator(target, val_tokens, cfg.seq_len),
    )
    return save_eagle3(head, run_dir / "model", target_name, extra)

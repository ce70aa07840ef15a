"""A resumable, time-budgeted training loop (AdamW, warmup + cosine over the time budget), logging to JSONL."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from verispec.models.llama import LlamaForCausalLM


@dataclass
class TrainConfig:
    hours: float = 2.0  # time spent in training steps (not evaluation); the schedule runs over it, across resumes
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1
    eval_every_minutes: float = 10.0
    seed: int = 0
    bf16: bool = True  # autocast matmuls to bfloat16 for the CPU's AMX units (weights and optimizer stay float32)


PAUSED = 5.0  # a step that takes this many times the usual counts as the usual: the run was paused, not training


def init_weights(model: LlamaForCausalLM) -> None:
    """GPT-2 style: N(0, 0.02), residual projections scaled down by the depth, norms at one."""
    depth = model.config.num_hidden_layers
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
        elif name.endswith(".bias"):
            torch.nn.init.zeros_(p)
        else:
            std = 0.02 / math.sqrt(2 * depth) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            torch.nn.init.normal_(p, 0.0, std)


def windows_at(tokens: np.ndarray, starts, length: int) -> torch.Tensor:
    """(len(starts), length + 1) windows of a 1-D token array: inputs and their next-token targets."""
    return torch.stack([torch.from_numpy(tokens[s : s + length + 1].astype(np.int64)) for s in starts])


def random_windows(tokens: np.ndarray, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    return windows_at(
        tokens, torch.randint(0, len(tokens) - length - 1, (batch,), generator=generator).tolist(), length
    )


def even_windows(tokens: np.ndarray, count: int, length: int) -> torch.Tensor:
    """Fixed, evenly spaced windows: the same validation batch at every evaluation."""
    return windows_at(tokens, np.linspace(0, len(tokens) - length - 2, count).astype(int), length)


def learning_rate(cfg: TrainConfig, step: int, progress: float) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def train(
    model: LlamaForCausalLM,
    cfg: TrainConfig,
    run_dir: Path,
    train_tokens: np.ndarray,
    loss_fn: Callable[[LlamaForCausalLM, torch.Tensor], torch.Tensor],
    evaluate: Callable[[LlamaForCausalLM], dict],
) -> dict:
    """Train until `cfg.hours` of training time have passed in total, resuming from `run_dir/state.pt`. A step
    that takes more than PAUSED times the usual (the process was stopped with SIGSTOP, or starved) counts as that, so
    that pausing a run does not spend its budget.

    Every `eval_every_minutes` it evaluates, appends a line to `run_dir/log.jsonl` and saves its state
    (model, optimizer, step, time, tokens seen), so a killed run loses at most that much work.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    state_file, log_file = run_dir / "state.pt", run_dir / "log.jsonl"
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    step, elapsed, seen = 0, 0.0, 0
    # Heads trained side by side in one ModuleDict (sharing a target's forward) each clip their own gradient, as alone
    parts = list(model.values()) if isinstance(model, torch.nn.ModuleDict) else [model]
    clip_groups = [list(part.parameters()) for part in parts]
    generator = torch.Generator().manual_seed(cfg.seed)
    if state_file.exists():
        state = torch.load(state_file, weights_only=False)
        if state["train_config"] != asdict(cfg):
            changed = {k: v for k, v in asdict(cfg).items() if state["train_config"].get(k) != v}
            print(f"resuming with changed settings {changed}", flush=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, elapsed, seen = state["step"], state["elapsed"], state["tokens_seen"]
        if "generator" in state:  # states written before it was saved draw their batches from a fresh seed
            generator.set_state(state["generator"])
        else:
            generator.manual_seed(cfg.seed + step)
    budget, last_eval, loss_sum, loss_steps = cfg.hours * 3600, elapsed, 0.0, 0
    typical = None  # a step's usual seconds: a step far longer was paused (SIGSTOP) or stalled, not training
    model.train()
    while elapsed < budget:
        t0 = time.perf_counter()
        lr = learning_rate(cfg, step, elapsed / budget)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = random_windows(train_tokens, cfg.batch_size, cfg.seq_len, generator)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = loss_fn(model, batch)
        loss.backward()
        for group in clip_groups:
            torch.nn.utils.clip_grad_norm_(group, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        typical = seconds if typical is None else 0.9 * typical + 0.1 * min(seconds, PAUSED * typical)
        step, seen, elapsed = step + 1, seen + batch[:, 1:].numel(), elapsed + min(seconds, PAUSED * typical)
        loss_sum, loss_steps = loss_sum + float(loss.detach()), loss_steps + 1
        if elapsed - last_eval >= cfg.eval_every_minutes * 60 or elapsed >= budget:
            model.eval()
            record = {
                "step": step,
                "tokens_seen": seen,
                "hours": elapsed / 3600,
                "lr": lr,
                "train_loss": loss_sum / loss_steps,
            } | evaluate(model)
            model.train()
            tmp = state_file.with_suffix(".tmp")
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "step": step,
                    "elapsed": elapsed,
                    "tokens_seen": seen,
                    "train_config": asdict(cfg),
                    "generator": generator.get_state(),
                },
                tmp,
            )
            os.replace(tmp, state_file)  # atomic: a kill mid-save keeps the previous state
            with log_file.open("a") as log:  # after the state, so the log never runs ahead of it
                log.write(json.dumps(record) + "\n")
            print(json.dumps(record), flush=True)
            last_eval, loss_sum, loss_steps = elapsed, 0.0, 0
    model.eval()
    return {"step": step, "tokens_seen": seen, "hours": elapsed / 3600}

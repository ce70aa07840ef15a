"""Medusa heads (Cai et al. 2024): M heads on the target's last feature, head i guessing the token i + 2 steps ahead.

The target's own LM head predicts the token after a feature f_t; Medusa head i (0-based) reads the same f_t and
predicts the token after that one by i + 1 more: a residual SiLU block (`linear`, added back) followed by its own LM
head, initialised from the target's. Key names follow the Medusa reference repository's model (`medusa_head.{i}.0.
linear.weight`/`.bias`, `medusa_head.{i}.1.weight`), but the folder is verispec's own: no current serving engine
serves these heads (SGLang has no Medusa algorithm; vLLM's Medusa model reads other names and drops the rest, so it
would run its heads uninitialised), and the reference repository's own files (`medusa_lm_head.safetensors`,
`base_model_name_or_path`) are not written.

The tree the heads draft is built from their measured accuracy (`choices`): each path is a tuple of ranks, (r1, r2,
...) meaning head 0's r1-th best token, then head 1's r2-th best, and so on; the paths with the highest product of
per-rank accuracies make the tree, as Medusa's own trees are made. That table is saved as
`verispec/medusa_accuracy.json`: it is not Medusa's `medusa_choices` (a list of tree paths), so not named so.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from verispec.checkpoints.folder import fill_head, read_head
from verispec.errors import CheckpointError

ACCURACY_FILE = "verispec/medusa_accuracy.json"  # beside verispec's other extras (checkpoints/draft_vocab.py)


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # starts as the identity: each head starts as the target's LM head
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, hidden: int, vocab: int, heads: int = 4) -> None:
        super().__init__()
        self.hidden, self.vocab = hidden, vocab
        self.medusa_head = nn.ModuleList(
            nn.Sequential(ResBlock(hidden), nn.Linear(hidden, vocab, bias=False)) for _ in range(heads)
        )

    @classmethod
    def from_target(cls, lm_head_weight: torch.Tensor, heads: int = 4) -> MedusaHeads:
        """Heads whose LM heads start as copies of the target's (as Medusa initialises them)."""
        module = cls(lm_head_weight.shape[1], lm_head_weight.shape[0], heads)
        with torch.no_grad():
            for head in module.medusa_head:
                head[1].weight.copy_(lm_head_weight)
        return module

    @property
    def num_heads(self) -> int:
        return len(self.medusa_head)

    def lm_head_rows(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Each head's LM head over the token ids `rows` only (a reduced draft vocabulary), copied once: gathering
        the rows at every step would cost as much as the product it saves."""
        return [head[1].weight[rows].contiguous() for head in self.medusa_head]

    def forward(self, features: torch.Tensor, lm_heads: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Logits (..., heads, V) of every head from features (..., D); `lm_heads` (from `lm_head_rows`) replaces
        the heads' own LM heads."""
        out = []
        for i, (block, lm_head) in enumerate(self.medusa_head):
            weight = lm_head.weight if lm_heads is None else lm_heads[i]
            out.append(nn.functional.linear(block(features), weight))
        return torch.stack(out, dim=-2)


def best_paths(accuracy: list[list[float]], size: int) -> list[tuple[int, ...]]:
    """The `size` rank paths with the highest products of per-head, per-rank accuracies (accuracy[i][r]: how often
    head i's r-th best token is the right one); greedy, so every path's prefixes come first."""
    chosen: list[tuple[int, ...]] = []
    value = {(): 1.0}
    frontier = {(r,): accuracy[0][r] for r in range(len(accuracy[0]))}
    while frontier and len(chosen) < size:
        path = max(frontier, key=lambda p: (frontier[p], [-r for r in p]))
        value[path] = frontier.pop(path)
        chosen.append(path)
        if len(path) < len(accuracy):  # its children become candidates
            frontier |= {path + (r,): value[path] * accuracy[len(path)][r] for r in range(len(accuracy[len(path)]))}
    return sorted(chosen, key=lambda p: (len(p), p))


def save_heads(
    heads: MedusaHeads,
    folder: str | Path,
    target_name: str,
    accuracy: list[list[float]] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """model.safetensors in the reference layout, config.json with `medusa_num_heads` and `medusa_num_layers`, and
    the measured accuracy by head and rank that shapes the tree."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().to(dtype).contiguous() for k, v in heads.state_dict().items()}, str(folder / "model.safetensors")
    )
    config = {
        "medusa_num_heads": heads.num_heads,
        "medusa_num_layers": 1,
        "hidden_size": heads.hidden,
        "vocab_size": heads.vocab,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "verispec": {"drafter": "medusa", "target": target_name},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if accuracy is not None:
        (folder / ACCURACY_FILE).parent.mkdir(exist_ok=True)
        (folder / ACCURACY_FILE).write_text(json.dumps({"accuracy": accuracy}, indent=1) + "\n")
    return folder


def load_heads(
    folder: str | Path, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[MedusaHeads, list[list[float]] | None]:
    """Heads saved by `save_heads` (and their accuracy table, where measured), checked against the target's sizes."""
    folder = Path(folder)
    config, weights = read_head(folder, "a Medusa heads")
    try:
        table = folder / ACCURACY_FILE
        accuracy = json.loads(table.read_text())["accuracy"] if table.is_file() else None
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{folder}: not a Medusa heads folder ({err})") from None
    if (config.get("hidden_size"), config.get("vocab_size")) != (hidden, vocab):
        raise CheckpointError(
            f"{folder}: these Medusa heads were not made for this target (features "
            f"{config.get('hidden_size')} and vocabulary {config.get('vocab_size')}, not {hidden} "
            f"and {vocab})"
        )
    heads = MedusaHeads(hidden, vocab, int(config["medusa_num_heads"]))
    return fill_head(heads, weights, folder, "Medusa heads", dtype, device), accuracy

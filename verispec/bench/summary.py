"""From a bench run's raw records to the report's numbers (speed, speedup, tau, acceptance, exactness, the predicted
speedup); every formula here is checked against the counts in the tests. The records carry each generation's counters
(stats.py); the predictions price steps with the bench's cost model (bench/costs.py)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Callable

BASELINE = "autoregressive"


def per_prompt(records: list[dict]) -> dict[tuple[str, str], dict]:
    """(method, prompt id) -> median times over repeats, and the counts of the first repeat (deterministic)."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[r["method"], r["id"]].append(r)
    times = ("seconds", "prefill_seconds", "draft_seconds", "verify_seconds")
    return {key: runs[0] | {t: statistics.median(r[t] for r in runs) for t in times} for key, runs in groups.items()}


def summarize(
    records: list[dict],
    c: dict[str, float],
    r: dict[int, float],
    detokenize: Callable[[list[int]], str] | None = None,
    trees: dict[str, dict] | None = None,
) -> dict:
    """Per method and per category ("all" included, and the groups records name): speed, speedup, tau, acceptance,
    exactness, prediction.

    c[method]: a chain's draft step time / target step time; r[n]: target time for n new tokens / for 1. `detokenize`:
    token ids to text, for the exactness of peers that print text (a record with `text`), which counts the baseline's
    tokens. `trees[method]`: a tree's step cost by depth (bench/costs.py). The prediction prices each step at the depth
    actually drafted (proposals are often shorter than k), and efficiency compares it with the decoding-only speedup,
    since the model does not cover the prompt's prefill.
    """
    rows = per_prompt(records)
    methods = list(dict.fromkeys(r_["method"] for r_ in records))
    # Each prompt's category, and the report's groups it belongs to besides (a Spec-Bench multi-turn question's turn)
    categories = [
        "all",
        *dict.fromkeys(r_["category"] for r_ in records),
        *dict.fromkeys(group for r_ in records for group in r_.get("groups", ())),
    ]
    out: dict = {}
    for method in methods:
        out[method] = {}
        for category in categories:
            ids = [
                i
                for (m, i), row in rows.items()
                if m == method and (category in ("all", row["category"]) or category in row.get("groups", ()))
            ]
            mine, base = [rows[method, i] for i in ids], [rows[BASELINE, i] for i in ids]
            new = sum(_new_tokens(x, b) for x, b in zip(mine, base))
            calls = sum(x["target_calls"] for x in mine)
            proposed = _sum_lists(x["proposed_by_position"] for x in mine)
            accepted = _sum_lists(x["accepted_by_position"] for x in mine)
            entry = {
                "prompts": len(ids),
                "tokens_per_second": new / sum(x["seconds"] for x in mine),
                "speedup_mean": statistics.mean(b["seconds"] / x["seconds"] for x, b in zip(mine, base)),
                "speedup_total": sum(b["seconds"] for b in base) / sum(x["seconds"] for x in mine),
                "exact_match": sum(_same(x, b, detokenize) for x, b in zip(mine, base)) / len(ids),
            }
            total, prefill = sum(x["seconds"] for x in mine), sum(x["prefill_seconds"] for x in mine)
            if prefill:  # ours and llama.cpp's rows time their prefill apart (transformers' do not)
                entry["decode_tokens_per_second"] = new / (total - prefill)
            if calls:  # our loop: counts and a split of its time exist
                split = {
                    part: sum(x[f"{part}_seconds"] for x in mine) / total for part in ("prefill", "draft", "verify")
                }
                entry |= {
                    "tau": new / calls,
                    "time_split": split | {"other": 1 - sum(split.values())},
                    "steps_by_depth": _width_histogram(proposed, calls),
                }  # [d]: steps that verified d drafts
            if sum(proposed):
                entry |= {
                    "acceptance_rate": sum(accepted) / sum(proposed),
                    "acceptance_by_position": [a / p for a, p in zip(accepted, proposed)],
                }
                price = _step_price(method, c, trees or {}, r)
                if price is not None:
                    widths = _width_histogram(proposed, calls)  # widths[j]: steps that verified j drafts
                    step_cost = sum(w * price(j) for j, w in enumerate(widths)) / calls
                    decode = lambda rows: sum(x["seconds"] - x["prefill_seconds"] for x in rows)
                    entry |= {
                        "mean_draft_width": sum(j * w for j, w in enumerate(widths)) / calls,
                        "predicted_speedup": entry["tau"] / step_cost,
                        "decode_speedup": decode(base) / decode(mine),
                    }
                    entry["efficiency"] = entry["decode_speedup"] / entry["predicted_speedup"]
            out[method][category] = entry
    return out


def _step_price(
    method: str, c: dict[str, float], trees: dict[str, dict], r: dict[int, float]
) -> Callable[[int], float] | None:
    """A step's cost in target steps by the depth j recorded for it: j c + r(j + 1) for a chain; for a tree, its
    drafting at depth j and r of the tokens its forward verifies; None where there is no model of the method."""
    if method in c:
        return lambda j: j * c[method] + r[j + 1]
    if method in trees:
        tree = trees[method]
        return lambda j: tree["draft"][j] + r[tree["tokens"][j]]
    return None


def _new_tokens(run: dict, base: dict) -> int:
    """How many tokens a run wrote; a peer that prints text is counted as writing as many as the baseline, since
    every method is asked for the same max_new_tokens with EOS ignored."""
    return len(base["tokens"] if run.get("text") is not None else run["tokens"])


def _same(run: dict, base: dict, detokenize: Callable[[list[int]], str] | None) -> bool:
    """Token-identical to the baseline; for a peer that prints text, its text begins with the baseline's (a
    speculative binary may write past max_new_tokens; a character that the baseline's last token leaves unfinished
    is left out)."""
    if run.get("text") is None:
        return run["tokens"] == base["tokens"]
    if detokenize is None:
        raise ValueError("a record with text needs `detokenize` to compare it with the baseline")
    return run["text"].startswith(detokenize(base["tokens"]).rstrip("\ufffd"))


def _width_histogram(proposed_by_position: list[int], calls: int) -> list[int]:
    """Steps by number of tokens verified: proposed_by_position[i] counts the steps with more than i."""
    at_least = [calls, *proposed_by_position, 0]
    return [at_least[j] - at_least[j + 1] for j in range(len(at_least) - 1)]


def _sum_lists(lists) -> list[int]:
    total: list[int] = []
    for values in lists:
        total += [0] * (len(values) - len(total))
        for i, v in enumerate(values):
            total[i] += v
    return total

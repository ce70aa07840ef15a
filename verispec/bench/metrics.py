"""From raw runs to the report's numbers; every formula here is checked against the counts in the tests."""

from __future__ import annotations

import statistics
from collections import defaultdict

BASELINE = "autoregressive"


def per_prompt(records: list[dict]) -> dict[tuple[str, str], dict]:
    """(method, prompt id) -> median seconds over repeats, and the counts of the first repeat (deterministic)."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[r["method"], r["id"]].append(r)
    return {key: runs[0] | {"seconds": statistics.median(r["seconds"] for r in runs)} for key, runs in groups.items()}


def summarize(records: list[dict], c: dict[str, float], r: dict[int, float]) -> dict:
    """Per method and per category ("all" included): speed, speedup, tau, acceptance, exactness, prediction.

    c[method]: draft step time / target step time; r[n]: target time for n new tokens / for 1.
    """
    rows = per_prompt(records)
    methods = list(dict.fromkeys(r_["method"] for r_ in records))
    categories = ["all", *dict.fromkeys(r_["category"] for r_ in records)]
    out: dict = {}
    for method in methods:
        out[method] = {}
        for category in categories:
            ids = [i for (m, i), row in rows.items() if m == method and category in ("all", row["category"])]
            mine, base = [rows[method, i] for i in ids], [rows[BASELINE, i] for i in ids]
            new = sum(len(x["tokens"]) for x in mine)
            calls = sum(x["target_calls"] for x in mine)
            proposed = _sum_lists(x["proposed_by_position"] for x in mine)
            accepted = _sum_lists(x["accepted_by_position"] for x in mine)
            entry = {
                "prompts": len(ids),
                "tokens_per_second": new / sum(x["seconds"] for x in mine),
                "speedup_mean": statistics.mean(b["seconds"] / x["seconds"] for x, b in zip(mine, base)),
                "speedup_total": sum(b["seconds"] for b in base) / sum(x["seconds"] for x in mine),
                "exact_match": sum(x["tokens"] == b["tokens"] for x, b in zip(mine, base)) / len(ids),
            }
            if calls:  # our loop: counts exist
                entry["tau"] = new / calls
            if sum(proposed):
                entry |= {"acceptance_rate": sum(accepted) / sum(proposed),
                          "acceptance_by_position": [a / p for a, p in zip(accepted, proposed)]}
                gamma = _gamma(method)
                if gamma and method in c:
                    entry["predicted_speedup"] = entry["tau"] / (gamma * c[method] + r[gamma + 1])
                    entry["efficiency"] = entry["speedup_total"] / entry["predicted_speedup"]
            out[method][category] = entry
    return out


def _gamma(method: str) -> int | None:
    """Tokens drafted per step, from a name such as "draft k=4"."""
    return int(method.split("k=")[1]) if "k=" in method else None


def _sum_lists(lists) -> list[int]:
    total: list[int] = []
    for values in lists:
        total += [0] * (len(values) - len(total))
        for i, v in enumerate(values):
            total[i] += v
    return total

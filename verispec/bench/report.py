"""The report: results.json (everything), report.md (tables and the goals), and PNG plots."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

from verispec.bench.costs import NO_PRICE
from verispec.kernels.build import cpu_flags

LLAMA_CPP_NOTE = (
    " llama.cpp rows (`--llama-cpp`, docs/bench/llama-cpp.md): its binaries on the same checkpoints (a GGUF file as "
    "it is, a folder as a GGUF copy in this dtype), one process per prompt, greedy, EOS banned, at this thread count: "
    "llama-completion, llama-speculative-simple with the draft model and llama-lookup (up to 4 drafted). Their time "
    "is llama.cpp's own timing: its prefill of the prompt (completion's `prompt eval time` line, the others' `encoded "
    "N tokens` line) and its decoding (completion's `eval time` line, the others' `decoded N tokens` line); their "
    "exact match compares their text with our autoregressive output's."
)


# The instruction sets that decide which kernels run (kernels/build.py) and how fast: a VM's CPU name often does not
# say which generation it is ("Intel(R) Xeon(R) Processor"), its /proc/cpuinfo flags do
INSTRUCTIONS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


def machine() -> dict:
    """The CPU (its name and the instruction sets of INSTRUCTIONS it has), cores, threads and library versions."""
    import transformers

    cpu = platform.processor()
    if Path("/proc/cpuinfo").exists():
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            cpu,
        )
    flags = cpu_flags()
    return {
        "cpu": cpu,
        "instructions": [name for name in INSTRUCTIONS if name in flags],
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def cpu_line(m: dict) -> str:
    """The CPU as a report's Machine line names it: "AMD EPYC (avx2, avx512f, ...)"."""
    return (
        f"{m['cpu']} ({', '.join(m['instructions']) or 'none of ' + ', '.join(INSTRUCTIONS)})"
        if "instructions" in m
        else m["cpu"]
    )


def floor_line(timing: dict) -> str:
    """The target step against the time to read its weights once (the floor under a step at batch one)."""
    read = timing["weight_bytes"] / timing["read_bandwidth"]
    return (
        f"Weight-read time: {timing['weight_bytes'] / 1e6:.0f} MB of target weights at "
        f"{timing['read_bandwidth'] / 1e9:.1f} GB/s read bandwidth (a timed sum over 256 MB, at the run's "
        f"threads) = {read * 1e3:.2f} ms; the target step takes {timing['target_step_seconds'] * 1e3:.2f} ms, "
        f"{timing['target_step_seconds'] / read:.1f}x that (both medians over rounds that measure them in turns)."
    )


def _mode(info: dict) -> str:
    """The dtype, the linears' formats where any is a block format ("float32, linears q4_1 x 210, q8_0 x 1"), and
    exact mode."""
    blocks = {name: n for name, n in (info.get("formats") or {}).items() if name.startswith("q")}
    kept = ", linears " + ", ".join(f"{name} x {n}" for name, n in blocks.items()) if blocks else ""
    return info["dtype"] + kept + (" exact mode" if info.get("exact") else "")


def _table(summary: dict, category: str) -> list[str]:
    head = (
        "| method | tok/s | decode tok/s | speedup (mean of ratios) | speedup (total) | tau | acceptance | "
        "drafted per step | exact match | predicted | efficiency |"
    )
    lines = [head, "|" + "---|" * 11]
    for method, by_category in summary.items():
        e = by_category.get(category)
        if e is None:
            continue
        fmt = lambda key, spec=".2f", e=e: format(e[key], spec) if key in e else "-"
        decode = e.get("decode_tokens_per_second")
        lines.append(
            f"| {method} | {e['tokens_per_second']:.1f} | {'-' if decode is None else format(decode, '.1f')} | "
            f"{e['speedup_mean']:.2f}x | {e['speedup_total']:.2f}x | "
            f"{fmt('tau')} | {fmt('acceptance_rate', '.1%')} | {_drafted(e)} | {e['exact_match']:.0%} | "
            f"{fmt('predicted_speedup')} | "
            f"{fmt('efficiency')} |"
        )
    return lines


def _by_category(summary: dict, categories: list[str]) -> list[str]:
    """Spec-Bench's leaderboard: each method's speedup (ratio of total times) per category, and overall, with tau and
    the acceptance rate over all prompts."""
    lines = [
        "| method | " + " | ".join(categories) + " | overall | tau | acceptance |",
        "|" + "---|" * (len(categories) + 4),
    ]
    for method, by_category in summary.items():
        cells = [f"{by_category[c]['speedup_total']:.2f}x" if c in by_category else "-" for c in categories]
        e = by_category["all"]
        tau = format(e["tau"], ".2f") if "tau" in e else "-"
        acceptance = format(e["acceptance_rate"], ".1%") if "acceptance_rate" in e else "-"
        lines.append(f"| {method} | {' | '.join(cells)} | {e['speedup_total']:.2f}x | {tau} | {acceptance} |")
    return lines


def _spec_bench_note(info: dict) -> str:
    """How a Spec-Bench suite became the prompts (empty for another suite)."""
    spec = info.get("spec_bench")
    if not spec:
        return ""
    skipped = spec["skipped"]
    ids = ", ".join(map(str, skipped))
    skipped = f"; left out, a turn not fitting the context or answered by EOS at once: {ids}" if skipped else ""
    return (
        f" Spec-Bench suite: {spec['questions']} questions, {spec['turns']} turns, each a prompt rendered by the "
        "target's chat template; a second turn follows the target's own first answer, decoded once by plain "
        "greedy decoding (the same for every lossless method) and reused by all; each turn's max_new_tokens is "
        f"the length of its plain greedy answer, to EOS or at most {spec['max_new_tokens']} tokens, so every "
        f"method writes that answer and nothing past it{skipped}." + _parses_note(spec.get("parses", {}))
    )


def _parses_note(parses: dict[str, list[int]]) -> str:
    """How many of the target's answers to coding questions parse as Python (empty where none was asked)."""
    if not parses:
        return ""
    counts = "; ".join(f"{category} {ok} of {n}" for category, (ok, n) in parses.items())
    return (
        f" The target's answers whose code block parses as Python (the model's, the same for every method; a "
        f"broken chat template would show here): {counts}."
    )


def _overlap_note(info: dict) -> str:
    """The vocabularies of a draft with another tokenizer (empty for the same one)."""
    o = info.get("vocab_overlap")
    if not o:
        return ""
    return (
        f" The draft has another tokenizer than the target's ({o['draft_vocab']} tokens against "
        f"{o['target_vocab']}): they share {o['shared']} tokens, {o['share_of_target']:.1%} of the target's "
        f"vocabulary; {o['answer_tokens_shared']:.1%} of the tokens of the target's own answers here (the "
        "autoregressive rows') are shared tokens, the most that drafting among them (vocab_map=intersection) could "
        "propose; vocab_map=reencode re-encodes the draft's text into the target's tokens. transformers' assisted "
        "rows are then its universal assisted generation, given both tokenizers."
    )


def _drafted(entry: dict) -> str:
    """Mean tokens drafted per step, and the share of plain steps (k = 0) where there were any (adaptive k)."""
    steps = entry.get("steps_by_depth")
    if not steps or len(steps) < 2:
        return "-"
    mean = sum(d * n for d, n in enumerate(steps)) / sum(steps)
    return f"{mean:.2f}" + (f" ({steps[0] / sum(steps):.0%} plain)" if steps[0] else "")


def format_summary(summary: dict) -> str:
    """The all-prompts table, for the terminal."""
    return "\n".join(_table(summary, "all"))


def _family(info: dict, label: str) -> str | None:
    """The method family of a report row (None for a transformers peer)."""
    method = info["methods"].get(label)
    return None if method is None else method["family"]


def _goals(summary: dict, info: dict) -> list[str]:
    drafts = {
        m: e for m, e in summary.items() if _family(info, m) == "draft" and not info["methods"][m].get("unrelated")
    }
    if not drafts:
        return ["No draft model in this run: the draft-model goals are not measured."]
    best = max(drafts, key=lambda m: drafts[m]["all"]["speedup_total"])
    e = drafts[best]
    lines = [f"Best draft setting: **{best}**."]
    for category in ("code", "docstring"):
        if category in e:
            value = e[category]["speedup_total"]
            lines.append(f"- speedup on {category}: {value:.2f}x (goal 1.5x: {'met' if value >= 1.5 else 'not met'})")
    if "efficiency" in e["all"]:
        value = e["all"]["efficiency"]
        lines.append(f"- efficiency: {value:.2f} (goal 0.85: {'met' if value >= 0.85 else 'not met'})")
    if "transformers assisted" in summary:
        ratio = e["all"]["tokens_per_second"] / summary["transformers assisted"]["all"]["tokens_per_second"]
        lines.append(
            f"- tokens/s against transformers assisted generation: {ratio:.2f}x "
            f"(goal 1.5x: {'met' if ratio >= 1.5 else 'not met'})"
        )
    lines.append(f"- exact match with our autoregressive greedy output ({_mode(info)}): {e['all']['exact_match']:.0%}")
    for m, method in info["methods"].items():  # adaptive k on a draft that never agrees must not cost much
        if method and method.get("unrelated") and method["k"] == "auto" and m in summary:
            value, steps = summary[m]["all"]["speedup_total"], summary[m]["all"].get("steps_by_depth", [])
            plain = steps[0] / sum(steps) if steps else 0.0
            lines.append(
                f"- {m} against autoregressive: {value:.2f}x, {plain:.0%} of its steps plain "
                f"(goal >= 0.95x: {'met' if value >= 0.95 else 'not met'})"
            )
    return lines


def _tree_costs(timing: dict, info: dict) -> str:
    """Each tree's full-size step (its drafting in target steps, and the tokens of its one target forward), and why
    lookahead and some suffix rows have no prediction."""
    trees = "".join(
        f"; {label}: {t['draft'][-1]:.3f} + r({t['tokens'][-1]}) per step {len(t['draft']) - 1} deep"
        for label, t in timing["trees"].items()
    )
    unpriced = [
        (label, NO_PRICE[family])
        for label in info["methods"]
        if (family := _family(info, label)) in NO_PRICE and label not in timing["c"] and label not in timing["trees"]
    ]
    return trees + "".join(f"; {label}: {note}" for label, note in unpriced)


def _float64_line(check: dict | None) -> str:
    if check is None:
        return "- float64 check: not run (--float64-prompts 0)"
    return (
        f"- float64 check ({check['method']} against autoregressive, every model in float64, the "
        f"{check['prompts']} shortest prompts): exact match {check['exact_match']:.0%} (goal 100%)"
    )


def write_report(out: Path, summary: dict, records: list[dict], timing: dict, info: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # One line per record: the token lists would otherwise take a line per token.
    head = json.dumps({"info": info, "timing": timing, "summary": summary}, indent=1)[:-2]
    rows = ",\n".join(json.dumps(record, separators=(",", ":")) for record in records)
    (out / "results.json").write_text(f'{head},\n "records": [\n{rows}\n]}}\n')
    categories = [c for c in next(iter(summary.values())) if c != "all"]
    m = info["machine"]
    drafts = {label: v for label, v in timing["c"].items() if _family(info, label) == "draft"}
    c_draft = next(iter(drafts.values()), None)  # the first draft row's; others that differ (a draft vocabulary) below
    md = [
        "# verispec bench\n",
        f"Command: `{info['command']}`  ",
        f"Machine: {cpu_line(m)}, {m['cores']} cores, {m['torch_threads']} thread(s); torch {m['torch']}, "
        f"transformers {m['transformers']}, Python {m['python']}  ",
        f"Target step: {timing['target_step_seconds'] * 1e3:.2f} ms; c (draft step / target step) = "
        + (f"{c_draft:.3f}" if c_draft is not None else "-")
        + " (prompt lookup and suffix decoding's chains: 0, they run no model"
        + "".join(f"; {label}: {v:.3f}" for label, v in drafts.items() if abs(v - c_draft) > 0.1 * c_draft)
        + "".join(f"; {label}: {v:.3f}" for label, v in timing["c"].items() if _family(info, label) == "eagle")
        + _tree_costs(timing, info)
        + "); "
        "r(n) (target time for n tokens / for 1): "
        + ", ".join(f"r({n}) = {v:.2f}" for n, v in timing["r"].items())
        + "  ",
        floor_line(timing) + "  ",
        f"Peak resident memory: {info['peak_rss_mb']:.0f} MB\n",
        f"Greedy decoding in {_mode(info)}, "
        + (
            "under each prompt's JSON schema for every method, the baseline included (constrained plain decoding), "
            "up to the end of the schema's JSON or max_new_tokens, "
            if info.get("constrained")
            else "EOS ignored by every method (each prompt gets exactly its max_new_tokens), "
        )
        + f"{info['prompts']} prompts, {info['repeats']} repeats; each time is a per-prompt median over repeats, with "
        "the methods in a fresh random order for every prompt. tok/s counts the whole generation, the prompt's "
        "prefill included; decode tok/s leaves the prefill out (each row's own measure of it taken off: ours timed, "
        "llama.cpp's as it prints it; transformers' rows are not split). Speedup is against our autoregressive "
        "baseline: the mean of per-prompt ratios, and the ratio of total times. Predicted speedup prices each step at "
        "the number of tokens it actually drafted (a tree's step: its drafting plus r of the tokens its one forward "
        "verifies, bench/costs.py); efficiency divides the decoding-only speedup (prompt prefill excluded) by it. "
        "Peers: transformers greedy; assisted with its defaults (adaptive number of assistant tokens) and at k = 4 "
        "(constant schedule, no confidence cut-off); prompt lookup with 4 tokens and n-grams up to 3. Peak memory is "
        "the whole process's."
        + (LLAMA_CPP_NOTE if any(label.startswith("llama.cpp") for label in summary) else "")
        + _spec_bench_note(info)
        + _overlap_note(info)
        + "\n",
        *(f"Note: {note}\n" for note in info.get("notes", [])),
        "## Speedup by category\n",
        *_by_category(summary, categories),
        "",
        "## All prompts\n",
        *_table(summary, "all"),
    ]
    for category in categories:
        md += [f"\n## {category}\n", *_table(summary, category)]
    md += [
        "\n## Where the time goes (all prompts)\n",
        "| method | prefill | draft | verify | other |",
        "|---|---|---|---|---|",
    ]
    md += [
        f"| {m} | "
        + " | ".join(f"{e['all']['time_split'][p]:.0%}" for p in ("prefill", "draft", "verify", "other"))
        + " |"
        for m, e in summary.items()
        if "time_split" in e["all"]
    ]
    md += [
        "\n## Goals\n",
        *_goals(summary, info),
        _float64_line(info["float64_check"]),
        "",
        "![speedup](speedup_vs_k.png) ![acceptance](acceptance_by_position.png) "
        "![tokens per second](tokens_per_second.png)",
    ]
    (out / "report.md").write_text("\n".join(md) + "\n")
    _plots(out, summary, categories, info["methods"])


def _plots(out: Path, summary: dict, categories: list[str], methods: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the draft model's chains; a tree is no point on this curve
    drafts = [
        m
        for m in summary
        if methods.get(m)
        and methods[m]["family"] == "draft"
        and set(methods[m]["options"]) <= {"draft_vocab"}
        and methods[m]["options"].get("draft_vocab") != 0
        and isinstance(methods[m]["k"], int)
        and not methods[m].get("unrelated")
    ]
    fig, ax = plt.subplots(figsize=(6, 4))
    for category in ["all", *categories]:
        ax.plot(
            [methods[m]["k"] for m in drafts],
            [summary[m][category]["speedup_total"] for m in drafts],
            marker="o",
            label=category,
        )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="k (tokens drafted per step)", ylabel="speedup over autoregressive", title="Draft-model speculation")
    ax.legend()
    fig.savefig(out / "speedup_vs_k.png", dpi=110, bbox_inches="tight")
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, by_category in summary.items():
        rates = by_category["all"].get("acceptance_by_position")
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker=".", label=method)
    ax.set(xlabel="position in the proposal", ylabel="acceptance rate", title="Acceptance by position", ylim=(0, 1))
    ax.legend(fontsize=7)
    fig.savefig(out / "acceptance_by_position.png", dpi=110, bbox_inches="tight")
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(summary)
    ax.barh(names, [summary[m]["all"]["tokens_per_second"] for m in names])
    ax.set(xlabel="tokens per second", title="Throughput (all prompts)")
    fig.savefig(out / "tokens_per_second.png", dpi=110, bbox_inches="tight")
    plt.close("all")

"""`verispec bench --quick`: the report's structure, and its numbers recomputed from the logged runs."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from verispec import kernels
from verispec.bench.harness import BenchOptions, quick_suite, run_bench, run_quick
from verispec.bench.report import INSTRUCTIONS, cpu_line
from verispec.bench.summary import per_prompt, summarize
from verispec.cli import main
from verispec.drafters.medusa import TREE_TOKENS
from verispec.drafters.registry import AUTO, Method, method_named
from verispec.errors import InvalidArgumentError
from verispec.kernels.build import cpu_flags


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    run_quick(out, progress=False)
    return out, json.loads((out / "results.json").read_text())


def test_report_files_and_structure(quick) -> None:
    out, results = quick
    assert {p.name for p in out.iterdir()} >= {
        "report.md",
        "results.json",
        "speedup_vs_k.png",
        "acceptance_by_position.png",
        "tokens_per_second.png",
    }
    summary = results["summary"]
    expected = {
        "autoregressive",
        "ngram k=4",
        "layerskip k=4",
        "lookahead window=5 ngram=4 candidates=5",
        "transformers greedy",
        "transformers assisted",
        "transformers assisted k=4",
        "transformers prompt lookup",
        "draft k=4 branch=2",
        "eagle k=4",
        "eagle k=6 tree_top_k=2 tree_tokens=10",
        "draft k=auto",
        "ngram k=auto",
        "eagle k=auto",
        "medusa",
        "suffix k=8",
        "suffix k=8 tree_tokens=8",
        "suffix k=auto",
        "suffix k=4 eagle_below=3",
        "draft (unrelated) k=4",
        "draft (unrelated) k=auto",
    } | {f"draft k={k}" for k in (1, 2, 3, 4, 6, 8)}
    if kernels.available(torch.float32):  # a quantized twin runs on verispec's kernels: its default, and without
        # the layers of the quick bench's layer-skip plan
        selfquant = {label for label in summary if label.startswith("selfquant ")}
        assert "selfquant k=auto" in selfquant and len(selfquant) == 2
        assert (selfquant - {"selfquant k=auto"}).pop().startswith("selfquant k=auto skip=")
        expected |= selfquant
    assert set(summary) == expected
    methods = results["info"]["methods"]  # each row's record, so that nothing parses a label back
    assert methods["draft k=4 branch=2"] == {"family": "draft", "k": 4, "options": {"branch": 2}}
    assert methods["lookahead window=5 ngram=4 candidates=5"]["k"] is None and methods["transformers greedy"] is None
    assert methods["draft (unrelated) k=auto"] == {"family": "draft", "k": "auto", "options": {}, "unrelated": True}
    assert all(set(by_category) == {"all", "code", "docstring", "repetition"} for by_category in summary.values())
    machine = results["info"]["machine"]
    assert {"cpu", "instructions", "cores", "torch", "transformers", "torch_threads"} <= machine.keys()
    assert machine["instructions"] == [name for name in INSTRUCTIONS if name in cpu_flags()]
    report = (out / "report.md").read_text()
    assert f"Machine: {cpu_line(machine)}, {machine['cores']} cores" in report
    assert (
        "## Goals" in report
        and "## Where the time goes" in report
        and "| draft k=4 |" in report
        and "## repetition" in report
    )
    assert len(results["records"]) == 2 * 6 * len(expected)  # repeats x prompts x methods
    assert all(entry["all"]["exact_match"] == 1.0 for entry in summary.values())  # peers decode the same tokens
    check = results["info"]["float64_check"]
    assert check["exact_match"] == 1.0 and check["prompts"] == 6
    assert "exact match 100% (goal 100%)" in report
    assert "- draft (unrelated) k=auto against autoregressive:" in report


def test_a_reports_machine_line_names_the_cpus_instruction_sets() -> None:
    """A VM's CPU name may not say its generation: the line names the instruction sets that decide the kernels."""
    assert (
        cpu_line({"cpu": "Intel(R) Xeon(R) Processor", "instructions": ["avx2", "avx512f", "amx_int8"]})
        == "Intel(R) Xeon(R) Processor (avx2, avx512f, amx_int8)"
    )
    none = cpu_line({"cpu": "QEMU Virtual CPU", "instructions": []})
    assert none == f"QEMU Virtual CPU (none of {', '.join(INSTRUCTIONS)})"
    assert cpu_line({"cpu": "AMD EPYC"}) == "AMD EPYC"  # a results.json written before the instructions were recorded


def test_auto_stops_drafting_on_the_unrelated_pair(quick) -> None:
    """Counted, not timed: on the never-agreeing pair, k=auto drafts on a few steps; k=4 on all but the last."""
    summary = quick[1]["summary"]
    auto, fixed = summary["draft (unrelated) k=auto"]["all"], summary["draft (unrelated) k=4"]["all"]
    assert auto["steps_by_depth"][0] >= 0.5 * sum(auto["steps_by_depth"])  # 16-token answers: a few steps to learn
    assert fixed["steps_by_depth"][0] <= 6 and auto["exact_match"] == 1.0


def test_formulas_agree_with_logged_counts(quick) -> None:
    _, results = quick
    records, summary, timing = results["records"], results["summary"], results["timing"]
    for method in ("draft k=4", "ngram k=4", "layerskip k=4", "eagle k=4"):
        runs = [r for r in records if r["method"] == method and r["repeat"] == 0]
        base = {r["id"]: r for r in records if r["method"] == "autoregressive" and r["repeat"] == 0}
        entry = summary[method]["all"]
        tau = sum(len(r["tokens"]) for r in runs) / sum(r["target_calls"] for r in runs)
        assert entry["tau"] == pytest.approx(tau)
        accepted = sum(sum(r["accepted_by_position"]) for r in runs)
        assert entry["acceptance_rate"] == pytest.approx(accepted / sum(sum(r["proposed_by_position"]) for r in runs))
        assert entry["exact_match"] == 1.0 and all(r["tokens"] == base[r["id"]]["tokens"] for r in runs)
        median = lambda m, i: statistics.median(r["seconds"] for r in records if r["method"] == m and r["id"] == i)
        ids = list(base)
        total = sum(median("autoregressive", i) for i in ids) / sum(median(method, i) for i in ids)
        assert entry["speedup_total"] == pytest.approx(total)
        # Each step priced at the width it verified: a step with w drafts costs w*c + r(w+1) target steps.
        calls = sum(r["target_calls"] for r in runs)
        widths = _steps_by_depth(runs)
        cost = sum(n * (w * timing["c"][method] + timing["r"][str(w + 1)]) for w, n in enumerate(widths) if n) / calls
        assert entry["predicted_speedup"] == pytest.approx(tau / cost)
        decode = lambda m: sum(
            median(m, i) - statistics.median(r["prefill_seconds"] for r in records if r["method"] == m and r["id"] == i)  # noqa: B023 (called within this iteration)
            for i in ids  # noqa: B023
        )
        assert entry["decode_speedup"] == pytest.approx(decode("autoregressive") / decode(method))
        assert entry["efficiency"] == pytest.approx(entry["decode_speedup"] / (tau / cost))
        split = entry["time_split"]
        assert sum(split.values()) == pytest.approx(1.0) and split["verify"] > 0 and split["other"] >= -1e-9


def _steps_by_depth(runs: list[dict]) -> list[int]:
    """[d]: the runs' steps whose proposal was d deep, from their per-position counts."""
    depths = [0] * (max(len(r["proposed_by_position"]) for r in runs) + 1)
    for r in runs:
        steps_at_least = [r["target_calls"], *r["proposed_by_position"], 0]
        for d in range(len(steps_at_least) - 1):
            depths[d] += steps_at_least[d] - steps_at_least[d + 1]
    return depths


def test_tree_rows_are_priced_by_their_own_steps(quick) -> None:
    """A tree's step costs its drafting at the depth recorded plus r of the tokens its forward verifies; r(n) is
    measured up to the widest forward (the EAGLE tree's 10 nodes and the root); lookahead has no model."""
    out, results = quick
    records, summary, timing = results["records"], results["summary"], results["timing"]
    trees = timing["trees"]
    assert set(trees) == {"draft k=4 branch=2", "eagle k=6 tree_top_k=2 tree_tokens=10", "medusa"}
    assert trees["draft k=4 branch=2"]["tokens"] == [1, 3, 5, 7, 9] and trees["medusa"]["tokens"][-1] == TREE_TOKENS + 1
    assert set(timing["r"]) == {str(n) for n in range(1, 12)}
    for method, tree in trees.items():
        runs = [r for r in records if r["method"] == method and r["repeat"] == 0]
        calls = sum(r["target_calls"] for r in runs)
        tau = sum(len(r["tokens"]) for r in runs) / calls
        cost = (
            sum(
                n * (tree["draft"][d] + timing["r"][str(tree["tokens"][d])])
                for d, n in enumerate(_steps_by_depth(runs))
            )
            / calls
        )
        assert summary[method]["all"]["predicted_speedup"] == pytest.approx(tau / cost)
    report = (out / "report.md").read_text()
    table = report[report.index("## All prompts") : report.index("\n## code")]
    cells = {line.split(" | ")[0][2:]: line.split(" | ") for line in table.splitlines() if line.startswith("| ")}
    assert all(cells[method][-2] != "-" and cells[method][-1] != "- |" for method in trees)  # predicted, efficiency
    assert cells["lookahead window=5 ngram=4 candidates=5"][-2] == "-" and cells["suffix k=8 tree_tokens=8"][-2] == "-"
    assert cells["suffix k=8"][-2] != "-"  # a chain that runs no model: c = 0
    assert "lookahead window=5 ngram=4 candidates=5: no prediction: its forward holds the Jacobi window" in report
    assert "medusa: " in report and f" + r({TREE_TOKENS + 1}) per step" in report


def test_summary_of_a_hand_made_log() -> None:
    records = [
        {
            "method": m,
            "id": i,
            "category": cat,
            "repeat": rep,
            "tokens": [1, 2, 3, 4],
            "seconds": s,
            "prefill_seconds": 0.5,
            "draft_seconds": 0.0,
            "verify_seconds": 0.0,
            "target_calls": calls,
            "proposed_by_position": prop,
            "accepted_by_position": acc,
        }
        for rep in range(3)
        for i, cat, draft_seconds in (("a", "code", 1.0), ("b", "docstring", 3.0))
        for m, s, calls, prop, acc in (
            ("autoregressive", 2.0 + rep, 4, [], []),
            ("draft k=2", draft_seconds, 2, [2, 2], [2, 0]),
        )
    ]
    assert per_prompt(records)["autoregressive", "a"]["seconds"] == 3.0  # the median of 2, 3 and 4
    summary = summarize(records, {"draft k=2": 0.5}, {1: 1.0, 2: 1.5, 3: 2.0})["draft k=2"]
    entry = summary["all"]
    assert entry["speedup_mean"] == 2.0 and entry["speedup_total"] == 1.5  # ratios 3 and 1; totals 6 / 4
    assert summary["code"]["speedup_total"] == 3.0 and summary["docstring"]["speedup_total"] == 1.0
    assert entry["tau"] == 2.0 and entry["acceptance_rate"] == 0.5
    assert entry["acceptance_by_position"] == [1.0, 0.0]
    assert entry["mean_draft_width"] == 2.0  # both steps of each prompt verified two drafts
    assert entry["predicted_speedup"] == pytest.approx(2.0 / (2 * 0.5 + 2.0))
    assert entry["decode_tokens_per_second"] == pytest.approx(8 / (4.0 - 2 * 0.5))  # 8 tokens, prefills taken off


def test_methods_filter_and_dtype(tmp_path, pair_dirs) -> None:
    target_dir, draft_dir = pair_dirs
    summary = run_bench(
        target_dir,
        draft_dir,
        tmp_path,
        quick_suite(per_category=1, max_new_tokens=8),
        BenchOptions(repeats=1, peers=False, progress=False, dtype="bfloat16", only=["autoregressive", "draft k=2"]),
    )
    assert set(summary) == {"autoregressive", "draft k=2"}
    assert json.loads((tmp_path / "results.json").read_text())["info"]["dtype"] == "bfloat16"
    assert "(bfloat16)" in (tmp_path / "report.md").read_text()


def test_the_float64_check_can_be_left_out(tmp_path, pair_dirs, capsys) -> None:
    """--float64-prompts 0 (a model whose float64 copy would not fit in memory): no check, and the report says so."""
    target_dir, draft_dir = pair_dirs
    run_bench(
        target_dir,
        draft_dir,
        tmp_path,
        quick_suite(per_category=1, max_new_tokens=4),
        BenchOptions(repeats=1, peers=False, progress=False, only=["autoregressive"], float64_prompts=0),
    )
    assert json.loads((tmp_path / "results.json").read_text())["info"]["float64_check"] is None
    assert "- float64 check: not run (--float64-prompts 0)" in (tmp_path / "report.md").read_text()
    assert main(["bench", "--target", str(target_dir), "--float64-prompts", "-1", "--out", str(tmp_path)]) == 2
    assert "--float64-prompts must be >= 0, got -1" in capsys.readouterr().err


def test_what_methods_leaves_out_is_never_built(tmp_path, pair_dirs, monkeypatch) -> None:
    """--methods builds only the rows it names: selfquant's quantized twin and transformers' copy of the target are
    gigabytes on a real model."""
    from verispec.bench import harness, methods

    built, peers = [], []
    real = methods.build_drafter
    monkeypatch.setattr(methods, "build_drafter", lambda method, res: built.append(method.family) or real(method, res))
    monkeypatch.setattr(harness, "transformers_methods", lambda *a, **k: peers.append(a) or [])
    target_dir, draft_dir = pair_dirs
    only = ["autoregressive", "ngram k=4", "suffix min_prob=0.3"]
    summary = run_bench(
        target_dir,
        draft_dir,
        tmp_path,
        quick_suite(per_category=1, max_new_tokens=4),
        BenchOptions(repeats=1, progress=False, only=only, float64_prompts=0),
    )
    assert list(summary) == ["autoregressive", "ngram k=4", "suffix k=auto min_prob=0.3"]
    assert sorted(built) == ["autoregressive", "ngram", "suffix"] and peers == []
    quick = quick_suite(per_category=1, max_new_tokens=4)
    for wrong, message in (("llama.cpp plian", "llama.cpp's rows are"), ("llama.cpp plain", "--llama-cpp DIR")):
        with pytest.raises(InvalidArgumentError, match=message):  # a typo, or no binaries: refused, not dropped
            run_bench(target_dir, None, tmp_path, quick, BenchOptions(repeats=1, only=["autoregressive", wrong]))


def test_methods_filter_needs_the_baseline_and_methods_it_can_run(tmp_path, pair_dirs, capsys) -> None:
    target_dir, draft_dir = pair_dirs
    args = ["bench", "--target", str(target_dir), "--draft", str(draft_dir), "--no-peers", "--out", str(tmp_path)]
    assert main([*args, "--methods", "draft k=4"]) == 2
    assert main([*args, "--methods", "autoregressive,draft k=five"]) == 2
    assert main([*args, "--methods", "autoregressive,ngram window=3"]) == 2
    assert main([*args, "--methods", "autoregressive,beam k=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and "autoregressive" in err[0]
    assert "'k=five' is not k=N" in err[1] and "ngram takes no option window" in err[2]
    assert "unknown method 'beam'" in err[3]
    assert not (tmp_path / "report.md").exists()


def test_methods_beyond_the_default_rows_run_by_their_labels(tmp_path, pair_dirs) -> None:
    """Any method and options, written as a row's label is ("suffix k=auto min_prob=0.5", in any order), gets its
    row, named as the registry names it, with its family's defaults filled in: "ngram" is the row "ngram k=auto"."""
    target_dir, draft_dir = pair_dirs
    summary = run_bench(
        target_dir,
        draft_dir,
        tmp_path,
        quick_suite(per_category=1, max_new_tokens=8),
        BenchOptions(
            repeats=1,
            peers=False,
            progress=False,
            only=["autoregressive", "draft k=5", "suffix min_prob=0.5 k=auto", "ngram k=4", "ngram"],
        ),
    )
    assert set(summary) == {"autoregressive", "draft k=5", "suffix k=auto min_prob=0.5", "ngram k=4", "ngram k=auto"}
    assert all(entry["all"]["exact_match"] == 1.0 for entry in summary.values())


def test_a_method_label_names_its_record() -> None:
    assert method_named("suffix k=auto min_prob=0.3 spec_factor=2") == Method(
        "suffix", AUTO, {"min_prob": 0.3, "spec_factor": 2.0}
    )
    assert method_named("selfquant skip=3,4 format=q4_0").options == {"skip": [3, 4], "format": "q4_0"}
    assert method_named("draft k=4 branch=2").label == "draft k=4 branch=2"
    for bad in ("draft k=", "draft k=-1", "suffix min_prob", "suffix min_prob=high", ""):
        with pytest.raises(InvalidArgumentError):
            method_named(bad)


def test_exact_mode_rows_match_autoregressive_in_bfloat16(tmp_path, pair_dirs) -> None:
    """`verispec bench --exact`: every method's greedy output is our autoregressive one, token for token."""
    target_dir, draft_dir = pair_dirs
    summary = run_bench(
        target_dir,
        draft_dir,
        tmp_path,
        quick_suite(per_category=1, max_new_tokens=8),
        BenchOptions(
            repeats=1,
            peers=False,
            progress=False,
            dtype="bfloat16",
            exact=True,
            only=["autoregressive", "draft k=4", "draft k=4 branch=2", "ngram k=4"],
        ),
    )
    assert all(entry["all"]["exact_match"] == 1.0 for entry in summary.values())
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["info"]["exact"] is True
    assert "(bfloat16 exact mode): 100%" in (tmp_path / "report.md").read_text()


def test_a_draft_with_another_tokenizer_gets_both_ways_and_the_overlap(tmp_path, pair_dirs, twin_dir) -> None:
    """The draft-model rows of a draft with another tokenizer draft among the shared tokens and by re-encoding, both
    exact; the report gives the vocabularies' overlap and the float64 check runs the intersection."""
    rows = [
        "draft k=4 vocab_map=intersection",
        "draft k=auto vocab_map=reencode",
        "draft k=4 vocab_map=intersection branch=2",
    ]
    summary = run_bench(
        pair_dirs[0],
        twin_dir,
        tmp_path,
        quick_suite(per_category=1, max_new_tokens=8),
        BenchOptions(repeats=1, peers=False, progress=False, only=["autoregressive", *rows]),
    )
    assert list(summary) == ["autoregressive", *rows]
    assert all(entry["all"]["exact_match"] == 1.0 for entry in summary.values())
    info = json.loads((tmp_path / "results.json").read_text())["info"]
    assert info["vocab_overlap"] == {
        "shared": 257,
        "target_vocab": 257,
        "draft_vocab": 260,
        "share_of_target": 1.0,
        "answer_tokens_shared": 1.0,
    }  # (every token of the target's is the twin's too)
    assert info["float64_check"]["method"] == "draft k=4 vocab_map=intersection"
    assert "they share 257 tokens, 100.0% of the target's vocabulary" in (tmp_path / "report.md").read_text()


def test_the_report_gives_the_weight_read_time(quick) -> None:
    out, results = quick
    timing = results["timing"]
    assert timing["weight_bytes"] > 0 and timing["read_bandwidth"] > 1e8  # more than 0.1 GB/s on any machine
    assert "Weight-read time:" in (out / "report.md").read_text()

"""llama.cpp as a bench peer, without llama.cpp: its command lines, the reading of its real output (captured from the
shipped pair in tests/data/llamacpp), stand-in binaries that replay that output, and no rows without it."""

from __future__ import annotations

import json
import shutil
import stat
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as GGML

from gguf_files import bpe_vocab, by_name, gguf_config, spm_vocab
from gguf_files import write_gguf as write_random_gguf
from verispec.bench import harness
from verispec.bench.harness import BenchOptions, quick_suite, run_bench
from verispec.bench.llamacpp import (
    BINARIES,
    ENV,
    TRIES,
    LlamaCppPeer,
    Setup,
    command,
    find_llama_cpp,
    llama_cpp_methods,
    parse_output,
)
from verispec.bench.summary import summarize
from verispec.cli import main
from verispec.errors import InvalidArgumentError, PeerError
from verispec.models.native import load_model

DATA = Path(__file__).parent / "data" / "llamacpp"
PROMPT = b"def parse_header(line):\n"  # what the captured runs were given, 16 new tokens each
GENERATED = b'\ndef _get_header(text):\n    """Return a string of the'  # the first 16, as verispec writes them too


def captured(kind: str) -> tuple[bytes, str]:
    return (DATA / f"{kind}.stdout").read_bytes(), (DATA / f"{kind}.stderr").read_text()


# The captured runs' timings: decoded tokens, their seconds, and the prompt's prefill
TIMES = {
    "plain": (15, 0.12140, 0.02800),  # eval time = 121.40 ms / 15 runs (the first token comes out of the
    # prefill), prompt eval time = 28.00 ms
    "speculative": (21, 21 / 198.005, 0.024),  # decoded 21 tokens ..., speed: 198.005 t/s (it overshoots 16),
    # encoded 8 tokens in 0.024 seconds (not its perf print's prompt eval time, which counts verifying batches)
    "lookup": (17, 17 / 123.008, 0.017),
}


@pytest.mark.parametrize("kind", BINARIES)
def test_captured_output_is_read(kind) -> None:
    tokens, seconds, prefill = TIMES[kind]
    out = parse_output(kind, *captured(kind), PROMPT)
    assert out.tokens == tokens and out.seconds == pytest.approx(seconds, rel=1e-9)
    assert out.prefill_seconds == pytest.approx(prefill, rel=1e-9)
    assert out.text.startswith(GENERATED) and not out.text.endswith(b"\n\n")
    assert out.text == GENERATED if kind == "plain" else len(out.text) > len(GENERATED)


@pytest.mark.parametrize("kind", BINARIES)
def test_output_cut_short_before_its_timing_is_none(kind) -> None:
    """llama.cpp's logger thread can lose the last lines at exit: no timing, so the run is repeated."""
    stdout, stderr = captured(kind)
    lines = stderr.splitlines(keepends=True)
    cut = "".join(lines[: next(i for i, line in enumerate(lines) if "threadpool init" in line) + 1])
    assert parse_output(kind, stdout[:20], cut, PROMPT) is None


@pytest.mark.parametrize("kind, line", [("plain", "prompt eval time"), ("lookup", "encoded")])
def test_output_without_its_prefill_timing_is_none(kind, line) -> None:
    """A run whose prompt timing is missing cannot be charged its prefill: it is repeated like one cut short."""
    stdout, stderr = captured(kind)
    assert (
        parse_output(kind, stdout, "".join(row for row in stderr.splitlines(keepends=True) if line not in row), PROMPT)
        is None
    )


def test_output_without_the_echoed_prompt_is_refused() -> None:
    stdout, stderr = captured("speculative")
    with pytest.raises(PeerError, match="did not echo the prompt"):
        parse_output("speculative", stdout, stderr, b"another prompt\n")


def test_command_lines() -> None:
    setup = Setup(Path("/bin/llama"), Path("t.gguf"), Path("d.gguf"), context=512, threads=1)
    plain, spec, lookup = (command(kind, setup, Path("p.txt"), 128) for kind in ("plain", "speculative", "lookup"))
    shared = [
        "-m",
        "t.gguf",
        "--binary-file",
        "p.txt",
        "--no-escape",
        "-n",
        "128",
        "-c",
        "522",
        "-t",
        "1",
        "-tb",
        "1",
        "--temp",
        "0",
        "--ignore-eos",
    ]
    assert plain == ["/bin/llama/llama-completion", *shared, "-no-cnv", "--no-display-prompt"]
    assert spec == [
        "/bin/llama/llama-speculative-simple",
        *shared,
        "-md",
        "d.gguf",
        "--spec-type",
        "draft-simple",
        "-td",
        "1",
        "-tbd",
        "1",
        "--spec-draft-n-max",
        "4",
    ]
    assert lookup == ["/bin/llama/llama-lookup", *shared, "--spec-draft-n-max", "4"]
    with pytest.raises(InvalidArgumentError, match="needs a draft"):
        command("speculative", Setup(Path("/bin/llama"), Path("t.gguf"), None, 512), Path("p.txt"), 8)


def test_llama_cpp_is_found_by_option_then_environment(monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert find_llama_cpp(None) is None
    monkeypatch.setenv(ENV, "/from/env")
    assert find_llama_cpp(None) == Path("/from/env") and find_llama_cpp("/opt") == Path("/opt")


def test_no_llama_cpp_means_no_rows_and_no_error(monkeypatch, capsys, tmp_path) -> None:
    calls = []
    monkeypatch.setattr(harness, "run_bench", lambda *args: calls.append(args[4]) or {})
    monkeypatch.setattr("verispec.bench.report.format_summary", lambda summary: "")
    monkeypatch.delenv(ENV, raising=False)
    assert main(["bench", "--target", "t", "--out", str(tmp_path)]) == 0
    monkeypatch.setenv(ENV, str(tmp_path))
    assert main(["bench", "--target", "t", "--out", str(tmp_path)]) == 0
    assert main(["bench", "--target", "t", "--out", str(tmp_path), "--llama-cpp", "/opt/bin"]) == 0
    assert [options.llama_cpp for options in calls] == [None, tmp_path, Path("/opt/bin")]


def fake_binaries(folder: Path, cut_short: int = 0, exit_code: int = 0) -> Path:
    """Stand-ins for the three binaries that replay the captured output around the prompt they are given; the
    first `cut_short` runs lose their last lines, as llama.cpp's logger can."""
    folder.mkdir()
    for kind, name in BINARIES.items():
        stdout, stderr = captured(kind)
        script = folder / name
        script.write_text(f"""#!{sys.executable}
import sys
from pathlib import Path
args, runs = sys.argv, Path(__file__).with_suffix(".runs")
n = int(runs.read_text()) + 1 if runs.exists() else 1
runs.write_text(str(n))
prompt = Path(args[args.index("--binary-file") + 1]).read_bytes()
stdout, stderr = {stdout!r}, {stderr!r}
stdout = stdout if {kind == "plain"} else stdout.replace({PROMPT!r}, prompt, 1)
if n <= {cut_short}:
    stdout, stderr = stdout[:20], stderr[:200]
sys.stdout.buffer.write(stdout)
sys.stderr.write(stderr)
sys.exit({exit_code})
""")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return folder


def test_a_run_reads_the_text_and_llama_cpps_time(pair_dirs, target, tmp_path) -> None:
    peer = LlamaCppPeer(fake_binaries(tmp_path / "bin", cut_short=2), *pair_dirs, target)
    prompt = peer.tokenizer.encode("def f(x):\n").ids
    assert peer.kinds == ["plain", "speculative", "lookup"]
    for kind, (tokens, seconds, prefill) in TIMES.items():
        run = peer.run(kind, prompt, 16)
        assert run.tokens == [] and run.text.startswith(GENERATED.decode())
        assert run.prefill_seconds == pytest.approx(prefill)
        decoded = 15 if kind == "plain" else 16  # completion's first token comes out of its prefill
        assert run.seconds == pytest.approx(prefill + decoded * seconds / tokens)  # its prefill, then its speed
        assert (tmp_path / "bin" / f"{BINARIES[kind]}.runs").read_text() == "3"  # two cut short, run again
    assert peer.setup.target.is_file() and peer.setup.draft.is_file()


def test_a_binary_that_fails_or_never_prints_its_timing_is_an_error(pair_dirs, target, tmp_path) -> None:
    failing = LlamaCppPeer(fake_binaries(tmp_path / "fails", exit_code=1), *pair_dirs, target)
    prompt = failing.tokenizer.encode("def f(x):\n").ids
    with pytest.raises(PeerError, match="llama-completion exited with 1: .*graphs reused"):
        failing.run("plain", prompt, 16)
    cut = LlamaCppPeer(fake_binaries(tmp_path / "cut", cut_short=TRIES), *pair_dirs, target)
    with pytest.raises(PeerError, match=f"llama-lookup ended {TRIES} times without its timing"):
        cut.run("lookup", prompt, 16)


def test_a_prompt_that_would_reach_llama_cpp_as_other_tokens_is_refused(pair_dirs, target, tmp_path) -> None:
    """llama.cpp takes text: ids whose text does not read back as them (here half a UTF-8 character) cannot go."""
    peer = LlamaCppPeer(fake_binaries(tmp_path / "bin"), *pair_dirs, target)
    half = peer.tokenizer.encode("é").ids[:1]
    with pytest.raises(PeerError, match="does not tokenize back"):
        peer.run("plain", peer.tokenizer.encode("x = ").ids + half, 16)
    assert not (tmp_path / "bin" / "llama-completion.runs").exists()


def test_missing_binaries_and_float64_are_refused(pair_dirs, target, tmp_path) -> None:
    with pytest.raises(PeerError, match="no llama-completion, llama-speculative-simple, llama-lookup"):
        LlamaCppPeer(tmp_path, *pair_dirs, target)
    with pytest.raises(InvalidArgumentError, match="float64"):
        LlamaCppPeer(fake_binaries(tmp_path / "bin"), *pair_dirs, target, dtype="float64")
    target_only = LlamaCppPeer(fake_binaries(tmp_path / "bin2"), pair_dirs[0], None, target)
    assert target_only.kinds == ["plain", "lookup"] and target_only.setup.draft is None


def test_text_rows_count_the_baseline_and_compare_text() -> None:
    base = {
        "method": "autoregressive",
        "id": "p",
        "category": "code",
        "repeat": 0,
        "tokens": [1, 2, 3],
        "seconds": 3.0,
        "prefill_seconds": 0.0,
        "draft_seconds": 0.0,
        "verify_seconds": 0.0,
        "target_calls": 3,
        "proposed_by_position": [],
        "accepted_by_position": [],
        "text": None,
    }
    same = base | {
        "method": "llama.cpp plain",
        "tokens": [],
        "seconds": 1.0,
        "prefill_seconds": 0.25,
        "target_calls": 0,
        "text": "abcd",
    }
    other = same | {"method": "llama.cpp lookup", "text": "abd"}
    decode = {(1, 2, 3): "abc\ufffd"}  # its last token leaves a character unfinished
    summary = summarize([base, same, other], {}, {}, lambda ids: decode[tuple(ids)])
    assert summary["llama.cpp plain"]["all"]["tokens_per_second"] == 3.0
    assert summary["llama.cpp plain"]["all"]["speedup_total"] == 3.0
    assert summary["llama.cpp plain"]["all"]["decode_tokens_per_second"] == 4.0  # its own prefill taken off
    assert summary["llama.cpp plain"]["all"]["exact_match"] == 1.0
    assert summary["llama.cpp lookup"]["all"]["exact_match"] == 0.0
    with pytest.raises(ValueError, match="detokenize"):
        summarize([base, same], {}, {})


def test_bench_adds_the_rows_as_peers(pair_dirs, tmp_path) -> None:
    suite = quick_suite(per_category=1, max_new_tokens=8)
    only = ["autoregressive", "ngram k=4", "llama.cpp plain", "llama.cpp speculative"]
    summary = run_bench(
        *pair_dirs,
        tmp_path / "out",
        suite,
        BenchOptions(repeats=1, peers=False, progress=False, only=only, llama_cpp=fake_binaries(tmp_path / "bin")),
    )
    assert set(summary) == {"autoregressive", "ngram k=4", "llama.cpp plain", "llama.cpp speculative"}
    plain = summary["llama.cpp plain"]["all"]
    assert plain["tokens_per_second"] == pytest.approx(8 / (0.028 + 7 * 0.12140 / 15))  # its prefill counts too
    assert plain["decode_tokens_per_second"] == pytest.approx(8 / (7 * 0.12140 / 15))
    assert summary["llama.cpp plain"]["all"]["exact_match"] == 0.0  # the replayed text is not the random model's
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["info"]["methods"]["llama.cpp plain"] is None
    assert "llama.cpp rows (`--llama-cpp`, docs/bench/llama-cpp.md)" in (tmp_path / "out" / "report.md").read_text()


def _refused_tokenizer(folder: Path, out: Path) -> Path:
    """A copy of a checkpoint folder whose tokenizer the GGUF writer refuses (it has a normalizer)."""
    copy = shutil.copytree(folder, out)
    spec = json.loads((copy / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "NFC"}
    (copy / "tokenizer.json").write_text(json.dumps(spec))
    return copy


def test_a_chat_prompts_special_tokens_reach_llama_cpp_as_their_text(tmp_path) -> None:
    """A chat template's markers (control tokens) go to llama.cpp as their text, which it parses back to them."""
    file = write_random_gguf(tmp_path / "target.gguf", gguf_config(len(bpe_vocab()[0])), by_name({}, GGML.Q8_0))
    model = load_model(file, dtype="float32")
    peer = LlamaCppPeer(fake_binaries(tmp_path / "bin"), file, None, model)
    prompt = model.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n").ids
    assert model.tokenizer.token_to_id("<|im_start|>") in prompt
    peer.run("plain", prompt, 16)
    assert peer.prompt_file.read_text() == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_gguf_target_runs_as_it_is_at_any_dtype(tmp_path) -> None:
    file = write_random_gguf(tmp_path / "target.gguf", gguf_config(len(bpe_vocab()[0])), by_name({}, GGML.Q8_0))
    model = load_model(file, dtype="float64")
    peer = LlamaCppPeer(fake_binaries(tmp_path / "bin"), file, None, model, dtype="float64")
    assert peer.setup.target == file and peer.setup.context == model.context_length
    assert peer.run("plain", model.tokenizer.encode("def f(x):\n").ids, 16).text.startswith(GENERATED.decode())


def test_a_folder_the_writer_refuses_leaves_its_rows_out_with_a_note(pair_dirs, target, tmp_path) -> None:
    binaries = fake_binaries(tmp_path / "bin")
    target_dir = _refused_tokenizer(pair_dirs[0], tmp_path / "target")
    rows, notes = llama_cpp_methods(binaries, target_dir, pair_dirs[1], target)
    assert rows == [] and len(notes) == 1 and "no llama.cpp rows" in notes[0] and "normalizer" in notes[0]
    assert f"convert_hf_to_gguf.py {target_dir} --outtype f32 --outfile target.gguf" in notes[0]
    draft_dir = _refused_tokenizer(pair_dirs[1], tmp_path / "draft")
    rows, notes = llama_cpp_methods(binaries, pair_dirs[0], draft_dir, target)
    assert [row.label for row in rows] == ["llama.cpp plain", "llama.cpp lookup"]
    assert len(notes) == 1 and notes[0].startswith("no llama.cpp speculative row")


def test_the_bench_runs_on_without_llama_cpp_rows_it_cannot_have(pair_dirs, tmp_path, capsys) -> None:
    target_dir = _refused_tokenizer(pair_dirs[0], tmp_path / "target")
    summary = run_bench(
        target_dir,
        None,
        tmp_path / "out",
        quick_suite(per_category=1, max_new_tokens=4),
        BenchOptions(
            repeats=1,
            peers=False,
            only=["autoregressive", "ngram k=4", "llama.cpp plain"],
            llama_cpp=fake_binaries(tmp_path / "bin"),
        ),
    )
    assert set(summary) == {"autoregressive", "ngram k=4"}
    out = capsys.readouterr().out
    assert out.count("note: no llama.cpp rows") == 1 and "convert_hf_to_gguf.py" in out
    assert "Note: no llama.cpp rows" in (tmp_path / "out" / "report.md").read_text()


def test_the_bench_takes_a_gguf_target(tmp_path) -> None:
    """Our rows, transformers' (through gguf_file=) and llama.cpp's all on the one file."""
    file = write_random_gguf(
        tmp_path / "target.gguf", gguf_config(len(bpe_vocab()[0]), num_hidden_layers=1), by_name({}, GGML.Q8_0)
    )
    only = ["autoregressive", "ngram k=4", "transformers greedy", "llama.cpp plain"]
    summary = run_bench(
        file,
        None,
        tmp_path / "out",
        quick_suite(per_category=1, max_new_tokens=4),
        # float32: the blocks dequantized, as transformers runs them, so its greedy row decodes our tokens
        BenchOptions(repeats=1, progress=False, dtype="float32", only=only, llama_cpp=fake_binaries(tmp_path / "bin")),
    )
    assert list(summary) == only and summary["transformers greedy"]["all"]["exact_match"] == 1.0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["info"]["target"] == str(file) and results["info"]["notes"] == []


def test_a_tokenizer_that_adds_a_bos_gives_llama_cpp_the_text_after_it(tmp_path) -> None:
    """A file whose tokenizer adds BOS (Llama's, Gemma's): llama.cpp adds it too, so the prompt's text is what follows
    it (with the BOS as text it would read two)."""
    config = gguf_config(len(spm_vocab()[0]))
    file = write_random_gguf(tmp_path / "target.gguf", config, by_name({}, GGML.Q8_0), tokenizer="llama", add_bos=True)
    model = load_model(file, dtype="float32")
    peer = LlamaCppPeer(fake_binaries(tmp_path / "bin"), file, None, model)
    prompt = model.tokenizer.encode("def f(x):").ids
    assert prompt[0] == model.tokenizer.encode("").ids[0]  # the BOS
    peer.run("plain", prompt, 16)
    assert model.tokenizer.encode(peer.prompt_file.read_text()).ids == prompt
    assert "<s>" not in peer.prompt_file.read_text()

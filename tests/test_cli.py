"""The command line: output, marks, --compare, and one-line errors with exit code 2 for bad input, checked before
any model loads; prompt sources, stop-string escapes, threads, bench defaults and Ctrl-C."""

from __future__ import annotations

import importlib
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch

from verispec import kernels
from verispec.bench import harness, report
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.checkpoints.shipped import default_paths
from verispec.checkpoints.tokenizer import byte_level_tokenizer
from verispec.cli import decode, inputs, loading, main
from verispec.cli.output import GREEN
from verispec.threads import torch_threads

generate_module = importlib.import_module("verispec.generate")  # `verispec.generate` the attribute is the function


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _keep_threads():
    """`generate` sets torch's thread count for the process; give the next test the count it had."""
    with torch_threads(torch.get_num_threads()):
        yield


def test_generate_prints_continuation_and_stats(capsys, pair_dirs) -> None:
    target, draft = map(str, pair_dirs)
    code, out, err = run(
        capsys,
        "generate",
        "def f(x):",
        "--target",
        target,
        "--draft",
        draft,
        "-k",
        "3",
        "--max-new-tokens",
        "24",
        "--ignore-eos",
        "--color",
        "always",
        "--compare",
    )
    assert code == 0 and err == ""
    assert out.startswith("def f(x):")
    assert GREEN in out  # accepted proposals are marked
    assert "24 tokens" in out and "tau" in out and "accepted" in out and "by position" in out
    assert "speedup" in out and "identical to autoregressive: yes" in out


def test_generate_drafts_auto_by_default_and_shows_the_lengths_chosen(capsys, pair_dirs, unrelated_dir) -> None:
    target, draft = map(str, pair_dirs)
    for given in ([], ["-k", "auto"]):
        code, out, err = run(
            capsys,
            "generate",
            "def f(x):",
            "--target",
            target,
            "--draft",
            str(unrelated_dir),
            "--max-new-tokens",
            "40",
            "--ignore-eos",
            *given,
        )
        assert code == 0 and err == ""
        lengths = dict(
            pair.split(": ") for pair in out.split("steps by tokens drafted: ")[1].splitlines()[0].split(", ")
        )
        assert int(lengths["0"]) >= 30  # an unrelated draft: plain steps after the first few
    code, out, _ = run(
        capsys,
        "generate",
        "def f(x):",
        "--target",
        target,
        "--method",
        "lookahead",
        "-k",
        "auto",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--compare",
    )
    assert code == 0 and "identical to autoregressive: yes" in out


def test_generate_exact_in_bfloat16_is_identical(capsys, pair_dirs) -> None:
    target, draft = map(str, pair_dirs)
    code, out, err = run(
        capsys,
        "generate",
        "def f(x):",
        "--target",
        target,
        "--draft",
        draft,
        "--dtype",
        "bfloat16",
        "--exact",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--compare",
    )
    assert code == 0 and err == "" and "identical to autoregressive: yes" in out
    code, _, err = run(capsys, "generate", "x", "--target", target, "--exact", "--backend", "transformers")
    assert code == 2 and "exact mode is a mode of the native runtime" in err


def loaded_target(*argv: str):
    """The target `main` loads for these arguments (it hands them to `loading.load_target` with --dtype resolved)."""
    loaded = []
    with (
        mock.patch.object(loading, "load_target", lambda args: loaded.append(ORIGINAL_LOAD_TARGET(args))),
        mock.patch.object(decode, "generate_command", lambda args: loading.load_target(args) and 0),
        mock.patch.object(decode, "serve_command", lambda args: loading.load_target(args) and 0),
    ):
        assert main(list(argv)) == 0
    return loaded[0]


ORIGINAL_LOAD_TARGET = loading.load_target


@pytest.mark.parametrize(
    "argv, dtype, exact",
    [([], "auto", "auto"), (["--no-exact"], "auto", False), (["--exact", "--dtype", "float32"], torch.float32, True)],
)
def test_generate_defaults_to_exact_bfloat16_where_the_kernels_run(pair_dirs, argv: list[str], dtype, exact) -> None:
    """Without --dtype and --exact, generate runs bfloat16 in exact mode where verispec's kernels run (there it is
    free: on one torch thread), and float32 ordinarily elsewhere."""
    here = kernels.available(torch.bfloat16)
    target = loaded_target("generate", "x", "--target", str(pair_dirs[0]), "--threads", "1", *argv)
    assert target.dtype == ((torch.bfloat16 if here else torch.float32) if dtype == "auto" else dtype)
    assert target.exact == (here if exact == "auto" else exact)


def test_the_server_is_exact_where_the_kernels_run_and_transformers_never(pair_dirs) -> None:
    """The server's batched engine is exact by construction on verispec's kernels, as generate is; transformers has
    no exact mode."""
    served = loaded_target("serve", "--target", str(pair_dirs[0]), "--threads", "1")
    assert served.exact == kernels.available(torch.float32)
    assert not loaded_target("serve", "--target", str(pair_dirs[0]), "--threads", "1", "--no-exact").exact
    on_transformers = loaded_target("generate", "x", "--target", str(pair_dirs[0]), "--backend", "transformers")
    assert not hasattr(on_transformers, "exact")
    assert next(on_transformers.model.parameters()).dtype == torch.float32  # auto: none of our kernels there


def test_generate_without_draft_is_autoregressive(capsys, pair_dirs) -> None:
    code, out, _ = run(
        capsys,
        "generate",
        "x",
        "--target",
        str(pair_dirs[0]),
        "--max-new-tokens",
        "5",
        "--ignore-eos",
        "--color",
        "never",
    )
    assert code == 0 and "tau 1.00" in out and GREEN not in out


def test_sampling_options(capsys, pair_dirs) -> None:
    target, draft = map(str, pair_dirs)
    code, out, _ = run(
        capsys,
        "generate",
        "abc",
        "--target",
        target,
        "--draft",
        draft,
        "--temperature",
        "0.8",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--seed",
        "3",
        "--max-new-tokens",
        "10",
        "--compare",
    )
    assert code == 0 and "same distribution" in out


def _gpt2_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    return folder


def _corrupt_dir(tmp_path: Path) -> Path:
    folder = random_checkpoint(tmp_path / "corrupt", tiny_config(num_hidden_layers=1))
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    return folder


def _other_tokenizer_dir(tmp_path: Path) -> Path:
    folder = random_checkpoint(tmp_path / "other", tiny_config(num_hidden_layers=1, vocab_size=258))
    other = byte_level_tokenizer()
    other.add_special_tokens(["<|pad|>"])
    other.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "no such checkpoint folder"),
        ("corrupt", "corrupt safetensors"),
        ("gpt2", "unsupported architecture GPT2LMHeadModel"),
        ("tokenizers", "different tokenizers"),
        ("k0", "k (tokens drafted per step) must be an integer >= 1"),
        ("negative_temperature", "temperature"),
        ("top_p_zero", "top_p"),
        ("top_p_big", "top_p"),
        ("empty_prompt", "prompt is empty"),
        ("long_prompt", "context holds"),
        ("bad_dtype_device", "is not usable"),
        ("unknown_method", "argument --method: invalid choice: 'bogus'"),
        ("not_a_number", "argument --max-new-tokens: invalid int value"),
        ("unknown_twin_format", "argument --format: invalid choice: 'q2_k'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, pair_dirs, case, message) -> None:
    target, draft = map(str, pair_dirs)
    args = {
        "missing": ["p", "--target", str(tmp_path / "nope"), "--draft", draft],
        "corrupt": ["p", "--target", target, "--draft", str(_corrupt_dir(tmp_path))],
        "gpt2": ["p", "--target", str(_gpt2_dir(tmp_path))],
        "tokenizers": ["p", "--target", target, "--draft", str(_other_tokenizer_dir(tmp_path))],
        "k0": ["p", "--target", target, "--draft", draft, "-k", "0"],
        "negative_temperature": ["p", "--target", target, "--temperature", "-1"],
        "top_p_zero": ["p", "--target", target, "--top-p", "0"],
        "top_p_big": ["p", "--target", target, "--top-p", "1.5"],
        "empty_prompt": ["", "--target", target],
        "long_prompt": ["x" * 300, "--target", target, "--draft", draft],
        "bad_dtype_device": ["p", "--target", target, "--device", "nosuchdevice"],
        "unknown_method": ["p", "--target", target, "--method", "bogus"],
        "not_a_number": ["p", "--target", target, "--max-new-tokens", "many"],
        "unknown_twin_format": ["p", "--target", target, "--method", "selfquant", "--format", "q2_k"],
    }[case]
    code, out, err = run(capsys, "generate", *args)
    assert code == 2
    assert out == ""  # nothing half-written
    assert err.count("\n") == 1 and err.startswith("verispec: error:") and message in err


def test_console_entry_point_has_no_traceback(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "verispec.cli", "generate", "p", "--target", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "config.json" in proc.stderr


def test_the_command_leaves_with_its_output_whole_and_its_code(tmp_path) -> None:
    """`run` ends the process without the interpreter's teardown: what was printed into a pipe is all there."""
    assert main(["init-random", str(tmp_path / "demo"), "--layers", "1", "--hidden-size", "32"]) == 0
    command = [sys.executable, "-m", "verispec.cli", "generate", "hi", "--target", str(tmp_path / "demo/target")]
    proc = subprocess.run([*command, "--max-new-tokens", "200", "--ignore-eos"], capture_output=True, text=True)
    assert proc.returncode == 0 and "200 tokens in" in proc.stdout and proc.stdout.endswith("\n")
    proc = subprocess.run([*command, "--max-new-tokens", "many"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("verispec: error:")


def test_init_random_writes_a_usable_pair(capsys, tmp_path) -> None:
    code, out, _ = run(capsys, "init-random", str(tmp_path / "demo"), "--layers", "2", "--hidden-size", "32")
    assert code == 0
    code, out, _ = run(
        capsys,
        "generate",
        "hi",
        "--target",
        str(tmp_path / "demo/target"),
        "--draft",
        str(tmp_path / "demo/draft"),
        "--max-new-tokens",
        "8",
        "--ignore-eos",
    )
    assert code == 0 and "8 tokens" in out


@pytest.fixture
def no_loading(monkeypatch):
    """Any model load fails the test: the checks under test must come first."""

    def load(*args, **kwargs):
        raise AssertionError("loaded a model before checking the options")

    monkeypatch.setattr(loading, "load", load)


def _one_error_line(code: int, out: str, err: str, message: str) -> None:
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("verispec: error:") and message in err


@pytest.mark.parametrize(
    "raw, decoded",
    [
        (r"\n\n", "\n\n"),
        (r"\t", "\t"),
        (r"a\\b", "a\\b"),
        (r"\"", '"'),
        (r"\x41\u00e9\U0001F600", "Aé😀"),
        (r"\N{BULLET}", "•"),
        (r"\0", "\0"),
        ("é\\n日本", "é\n日本"),  # non-ASCII text around an escape stays as it is
        ("plain", "plain"),
    ],
)
def test_stop_escapes(raw, decoded) -> None:
    assert inputs.unescape(raw, "--stop") == decoded


@pytest.mark.parametrize("raw", [r"\q", "ends\\", r"\x4", r"\u12", r"\N{NO SUCH NAME}", r"\U00110000", r"\ud800"])
def test_bad_stop_escape_is_one_line(capsys, no_loading, raw) -> None:
    code, out, err = run(capsys, "generate", "p", "--stop", raw)
    _one_error_line(code, out, err, "bad escape")
    assert raw in err


def test_escaped_stop_string_stops(capsys, pair_dirs) -> None:
    target = str(pair_dirs[0])
    args = ["generate", "a", "--target", target, "--max-new-tokens", "24", "--ignore-eos", "--color", "never"]
    code, out, _ = run(capsys, *args)
    text = out.split("\n\n")[0][1:]  # the continuation, after the prompt "a"
    char = next(c for c in text if c.isprintable() and c != "\ufffd")
    code, out, _ = run(capsys, *args, "--stop", f"\\U{ord(char):08x}")  # the character, written as an escape
    assert code == 0 and "stop: stop_string" in out and char not in out.split("\n\n")[0][1:]


@pytest.mark.parametrize(
    "command",
    [["generate", "p"], ["bench"], ["bench", "--quick"], ["search-layerskip", "--target", "t"], ["train", "target"]],
)
@pytest.mark.parametrize("threads", ["0", "-1", "1025"])
def test_threads_out_of_range_is_one_line(capsys, no_loading, command, threads) -> None:
    code, out, err = run(capsys, *command, "--threads", threads)
    _one_error_line(code, out, err, f"--threads must be from 1 to 1024, got {threads}")


def test_threads_option_and_environment_set_torch(capsys, monkeypatch, pair_dirs) -> None:
    args = ["generate", "p", "--target", str(pair_dirs[0]), "--max-new-tokens", "2"]
    assert run(capsys, *args, "--threads", "1")[0] == 0 and torch.get_num_threads() == 1
    monkeypatch.setenv("VERISPEC_THREADS", "2")
    assert run(capsys, *args)[0] == 0 and torch.get_num_threads() == 2
    monkeypatch.setenv("VERISPEC_THREADS", "many")
    _one_error_line(*run(capsys, *args), "$VERISPEC_THREADS must be an integer from 1 to 1024")


def test_prompt_from_a_file_and_from_stdin(capsys, monkeypatch, tmp_path, pair_dirs) -> None:
    args = ["--target", str(pair_dirs[0]), "--max-new-tokens", "4", "--ignore-eos", "--color", "never"]
    (tmp_path / "prompt.txt").write_text("def g(y):\n    é", encoding="utf-8")
    code, out, _ = run(capsys, "generate", "--prompt-file", str(tmp_path / "prompt.txt"), *args)
    assert code == 0 and out.startswith("def g(y):\n    é") and "4 tokens" in out
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin"))
    code, out, _ = run(capsys, "generate", "-", *args)
    assert code == 0 and out.startswith("from stdin") and "4 tokens" in out


@pytest.mark.parametrize(
    "case, message",
    [
        ("none", "exactly one"),
        ("both", "exactly one"),
        ("missing", "no such file"),
        ("empty_file", "the prompt is empty"),
        ("empty_stdin", "the prompt is empty (stdin)"),
        ("not_utf8", "not UTF-8"),
    ],
)
def test_bad_prompt_source_is_one_line(capsys, monkeypatch, no_loading, tmp_path, case, message) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    args = {
        "none": [],
        "both": ["p", "--prompt-file", str(tmp_path / "empty.txt")],
        "missing": ["--prompt-file", str(tmp_path / "nope.txt")],
        "empty_file": ["--prompt-file", str(tmp_path / "empty.txt")],
        "empty_stdin": ["-"],
        "not_utf8": ["--prompt-file", str(tmp_path / "latin1.txt")],
    }[case]
    _one_error_line(*run(capsys, "generate", *args), message)


@pytest.mark.parametrize(
    "options, message",
    [
        (["--backend", "transformers", "--branch", "2"], "needs the native runtime"),
        (["--backend", "transformers", "--method", "lookahead"], "needs the native runtime"),
        (["--method", "ngram", "--branch", "2"], "method ngram takes no option branch"),
        (["--method", "ngram", "--draft", "d"], "--draft is the draft model of --method draft"),
        (["--method", "ngram", "--skip", "2"], "method ngram takes no option skip"),
        (["--method", "lookahead", "-k", "3"], "method lookahead takes no k"),
        (["-k", "0"], "must be an integer >= 1"),
        (["-k", "fast"], "-k takes a whole number of tokens or auto, got 'fast'"),
        (["-k", "auto", "--target", "t"], "method autoregressive drafts nothing"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
    ],
)
def test_options_are_checked_before_loading(capsys, no_loading, options, message) -> None:
    _one_error_line(*run(capsys, "generate", "p", *options), message)


@pytest.fixture
def fake_bench(monkeypatch):
    """run_bench and run_quick record their arguments instead of running: what the CLI passes is under test."""
    calls = {}
    monkeypatch.setattr(harness, "run_bench", lambda *args, **kw: calls.setdefault("bench", args) and {})
    monkeypatch.setattr(harness, "run_quick", lambda *args, **kw: calls.setdefault("quick", args) and {})
    monkeypatch.setattr(report, "format_summary", lambda summary: "")
    return calls


def test_bench_defaults_to_the_shipped_pair_and_a_temporary_folder(capsys, fake_bench) -> None:
    code, out, _ = run(capsys, "bench")
    target, draft, folder = fake_bench["bench"][:3]
    assert code == 0 and (target, draft) == default_paths()
    assert folder.is_dir() and folder.parent == Path(tempfile.gettempdir()) and f"report: {folder}" in out
    folder.rmdir()


def test_bench_with_a_target_and_no_draft_runs_without_one(capsys, fake_bench, tmp_path) -> None:
    code, _, _ = run(capsys, "bench", "--target", "t", "--out", str(tmp_path))
    assert code == 0 and fake_bench["bench"][:3] == (Path("t"), None, tmp_path)


def test_bench_quick_writes_outside_the_current_folder(capsys, fake_bench, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "bench", "--quick")
    folder = fake_bench["quick"][0]
    assert code == 0 and not list(tmp_path.iterdir()) and f"report: {folder}" in out
    folder.rmdir()


def test_ctrl_c_prints_the_partial_stats(capsys, monkeypatch, pair_dirs) -> None:
    step, calls = generate_module.speculative_step, []

    def interrupted(*args, **kwargs):  # Ctrl-C arrives during the third step's target forward
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    monkeypatch.setattr(generate_module, "speculative_step", interrupted)
    target, draft = map(str, pair_dirs)
    code, out, err = run(
        capsys,
        "generate",
        "def f(x):",
        "--target",
        target,
        "--draft",
        draft,
        "--max-new-tokens",
        "40",
        "--ignore-eos",
        "--color",
        "never",
    )
    assert code == 130 and err == ""
    text, stats = out.split("\n\n")
    assert text.startswith("def f(x):") and "stop: interrupted" in stats and "target calls 2," in stats
    assert stats.endswith("\n") and "drafted" in stats


def test_ctrl_c_while_loading_exits_130_without_stats(capsys, monkeypatch) -> None:
    def load(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loading, "load", load)
    code, out, err = run(capsys, "generate", "p")
    assert code == 130 and out == "" and err == "\n"


def test_every_method_option_has_one_flag_made_from_the_registry() -> None:
    """A drafter option is declared once (its family's option record, drafters/options.py): each family's options
    have a flag, which fills the method record under the option's own name."""
    from dataclasses import fields

    from verispec.cli.parser import build_parser
    from verispec.drafters.registry import FAMILIES, OPTIONS

    assert {f.name for family in FAMILIES.values() for f in fields(family.options)} == set(OPTIONS)
    args = build_parser().parse_args(["generate", "x", "--method", "lookahead", "--ngram-size", "3", "--window", "4"])
    assert loading.method_from(args).options == {"ngram": 3, "window": 4}
    args = build_parser().parse_args(["generate", "x", "--method", "layerskip", "--skip", "2,3"])
    assert loading.method_from(args).options == {"skip": [2, 3]}

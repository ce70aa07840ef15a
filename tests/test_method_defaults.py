"""Each method's defaults have one owner (its option record, drafters/options.py): the command line, the API, the
bench and the server build the same drafter for a method named alone. And `--method auto`: a head given or shipped
for the target's model, a draft model given, else suffix decoding; the default on a GGUF target without --draft."""

from __future__ import annotations

import json
import shutil
from dataclasses import is_dataclass
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from gguf_files import by_name, gguf_config, write_gguf
from verispec import InvalidArgumentError, generate, kernels
from verispec.bench.methods import ours
from verispec.checkpoints.fingerprint import gguf_fingerprint
from verispec.cli import main
from verispec.cli.loading import checked_method, load_models
from verispec.cli.parser import build_parser
from verispec.drafters.adaptive import AdaptiveK
from verispec.drafters.registry import FAMILIES, Method, Resources, build_drafter, method_named, resolve_method
from verispec.drafters.suffix import SuffixDecoding
from verispec.heads.eagle import EagleHead, head_config, save_head
from verispec.heads.eagle3 import save_eagle3
from verispec.heads.medusa import MedusaHeads, save_heads
from verispec.models.native import load_model
from verispec.threads import torch_threads
from verispec.train.eagle3 import new_head
from verispec.train.loop import init_weights

PROMPT = [100, 101, 102, 40, 120, 41, 58, 10, 32, 32]
N = 16
RUN = ["--max-new-tokens", "12", "--ignore-eos", "--compare", "--color", "never"]

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory, pair_dirs) -> dict[str, Path]:
    """The pair's target (copied, with a layer-skip plan beside it), its draft, and random EAGLE and Medusa heads."""
    root = tmp_path_factory.mktemp("defaults")
    target_dir = Path(shutil.copytree(pair_dirs[0], root / "target"))
    (target_dir / "layerskip.json").write_text(json.dumps({"skip": [1], "k": 3}))
    target = load_model(target_dir)
    torch.manual_seed(0)
    head = EagleHead(head_config(target.config))
    init_weights(head)
    medusa = MedusaHeads.from_target(target.lm_head_weight.detach(), 2)
    return {
        "target": target_dir,
        "draft": pair_dirs[1],
        "eagle": save_head(head, root / "eagle", "random"),
        "medusa": save_heads(medusa, root / "medusa", "random"),
    }


def described(drafter) -> tuple | None:
    """What a drafter drafts with, in plain values (its class, k, width, sizes, options, needs), AdaptiveK's inner
    drafter included; never the models, which each entry point loads for itself."""
    if drafter is None:
        return None
    plain = (bool, int, float, str, tuple, type(None))
    values = {
        name: value
        for name, value in vars(drafter).items()
        if isinstance(value, plain) or (is_dataclass(value) and not isinstance(value, type))
    }
    return type(drafter).__name__, values, described(getattr(drafter, "drafter", None))


def _cli(command: str, family: str, folders: dict[str, Path]):
    """`verispec COMMAND --method FAMILY` with only what the family needs (its draft or head), as main runs it: the
    method it resolves and the drafter it builds."""
    given = {"draft": ["--draft", str(folders["draft"])], "eagle": ["--head", str(folders["eagle"])]}
    given["medusa"] = ["--head", str(folders["medusa"])]
    argv = [command, *(["x"] if command == "generate" else [])]
    argv += ["--target", str(folders["target"]), "--method", family, "--dtype", "float32", *given.get(family, [])]
    args = build_parser().parse_args(argv)
    args.auto_dtype = False  # (main sets it; --dtype float32 is given)
    method = checked_method(args)
    return method, load_models(args, method)[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_method_named_alone_is_one_drafter_in_the_cli_the_api_the_bench_and_the_server(folders, family) -> None:
    if family == "selfquant" and not kernels.available(torch.float32):
        pytest.skip(f"a quantized twin runs on verispec's kernels, which do not run here: {kernels.reason()}")
    target, draft = load_model(folders["target"]), load_model(folders["draft"])
    head = folders.get(family) if family in ("eagle", "medusa") else None
    resources = Resources(draft, folders["target"], target, head, folders["draft"])
    api = resolve_method(Method(family), resources)
    assert api.k == FAMILIES[family].options().default_k()  # the family's record owns the default
    drafter = described(build_drafter(Method(family), resources))
    bench = ours(target, method_named(family), resources)  # `verispec bench --methods FAMILY`'s row
    assert (bench.method, bench.label, described(bench.drafter)) == (api, api.label, drafter)
    for command in ("generate", "serve"):
        method, built = _cli(command, family, folders)
        assert (method, described(built)) == (api, drafter), command


def test_the_defaults_are_the_best_measured() -> None:
    """k=auto for the chains where the bench measured it best (docs/bench/), a fixed size for trees."""
    assert [name for name in FAMILIES if resolve_method(Method(name)).k == "auto"] == [
        "draft",
        "ngram",
        "selfquant",
        "suffix",
    ]
    assert resolve_method(Method("suffix", None, {"tree_tokens": 8})).k == 8
    assert resolve_method(Method("draft", None, {"branch": 2})).k == 4
    assert resolve_method(Method("suffix", 3)).k == 3 and resolve_method(Method("suffix")).label == "suffix k=auto"


@pytest.fixture(scope="module")
def gguf_target(tmp_path_factory) -> Path:
    def names(writer) -> None:
        writer.add_basename("tinyllm")
        writer.add_size_label("1M")

    config = gguf_config(1027, num_hidden_layers=8)  # enough blocks for an EAGLE-3 head's three feature layers
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", config, by_name({}, GGML.Q8_0), extra=names)


@pytest.fixture
def no_shipped_heads(tmp_path, monkeypatch) -> Path:
    """An empty models/ folder for the heads shipped with verispec, which the test may fill."""
    import verispec.checkpoints.shipped as default

    models = tmp_path / "models"
    models.mkdir()
    monkeypatch.setattr(default, "MODELS", models)
    return models


def test_auto_on_a_gguf_target_without_a_head_is_suffix_decoding(gguf_target, no_shipped_heads, capsys) -> None:
    target = load_model(gguf_target, dtype="auto", exact=True)
    method = resolve_method(Method("auto"), Resources(target=target, target_dir=gguf_target))
    assert (method.family, method.k) == ("suffix", "auto") and "no head ships" in method.reason
    drafter = build_drafter(Method("auto"), Resources(target=target, target_dir=gguf_target))
    assert isinstance(drafter, AdaptiveK) and isinstance(drafter.drafter, SuffixDecoding)
    truth = generate(target, PROMPT, max_new_tokens=N, ignore_eos=True).tokens
    assert generate(target, PROMPT, drafter, max_new_tokens=N, ignore_eos=True).tokens == truth
    with torch_threads(1):  # the default of generate on a GGUF target without --draft, said on stderr
        assert main(["generate", "hello", "--target", str(gguf_target), *RUN]) == 0
    out, err = capsys.readouterr()
    assert "identical to autoregressive: yes" in out
    assert err.startswith("verispec: method auto chose suffix k=auto: no head ships for this model") and (
        err.count("\n") == 1
    )


def test_auto_with_a_draft_picks_the_draft_model(pair_dirs, draft, capsys) -> None:
    method = resolve_method(Method("auto"), Resources(draft=draft))
    assert (method.family, method.k, method.reason) == ("draft", "auto", "the draft model given")
    target_dir, draft_dir = (str(folder) for folder in pair_dirs)
    argv = ["generate", "def", "--target", target_dir, "--draft", draft_dir, "--method", "auto", *RUN]
    with torch_threads(1):
        assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "identical to autoregressive: yes" in out and "method auto chose draft k=auto" in err


def test_auto_on_a_target_with_a_shipped_head_picks_the_head(gguf_target, no_shipped_heads, capsys) -> None:
    """Found by the GGUF file's metadata, as `--method eagle` finds it: the head's folder drafts its own setting."""
    target = load_model(gguf_target)
    save_eagle3(
        new_head(target.module, torch.arange(200)),
        no_shipped_heads / "tiny-eagle3",
        target.name,
        {"target_match": gguf_fingerprint(gguf_target), "method": {"k": 3}},
    )
    method = resolve_method(Method("auto"), Resources(target_dir=gguf_target))
    assert method.family == "eagle" and "tiny-eagle3 ships for this model" in method.reason
    with torch_threads(1):
        assert main(["generate", "hello", "--target", str(gguf_target), *RUN]) == 0
    out, err = capsys.readouterr()
    assert "identical to autoregressive: yes" in out and "method auto chose eagle: the eagle head" in err
    assert len(next(line for line in out.splitlines() if "by position:" in line).split(":")[-1].split()) == 3


def test_auto_takes_no_options_and_the_shipped_pair_keeps_its_draft() -> None:
    with pytest.raises(InvalidArgumentError, match="method auto chooses the method for the target; it takes no"):
        resolve_method(Method("auto", None, {"max_ngram": 2}))
    args = build_parser().parse_args(["generate", "x"])
    assert checked_method(args) == Method("draft", "auto")  # the shipped pair: its draft, as before

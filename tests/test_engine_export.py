"""What we export loads where we say it loads: each shipped or exported folder held against the files, keys and
shapes the engine's loader reads (tests/data/engine_loaders/, with the engine files they were read from), and a
round trip back into verispec that drafts the same tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from drafting import start_session
from verispec.checkpoints.draft_vocab import OLD_VOCAB_FILE, VOCAB_FILE, load_draft_vocab
from verispec.checkpoints.shipped import DEFAULT_DRAFT, MODELS
from verispec.cli import main
from verispec.drafters.eagle import Eagle
from verispec.errors import CheckpointError, InvalidArgumentError
from verispec.heads.eagle import load_head
from verispec.heads.eagle3 import is_eagle3, save_eagle3
from verispec.heads.eagle_export import TOKEN_MAP_DIR, export_eagle
from verispec.models.native import load_model
from verispec.train.eagle3 import new_head

LOADERS = Path(__file__).parent / "data" / "engine_loaders"
HEAD = MODELS / "stdlib-eagle"
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")  # what vLLM's default loader globs for
PROMPT = [300, 301, 302, 40, 41, 58, 10, 32, 32, 32]

pytestmark = pytest.mark.usefixtures("single_thread")


def loader(name: str) -> dict:
    return json.loads((LOADERS / f"{name}.json").read_text())


def top_level_weight_files(folder: Path) -> set[str]:
    return {path.name for pattern in WEIGHT_PATTERNS for path in folder.glob(pattern)}


def expected_shapes(spec: dict, config: dict) -> dict[str, tuple[int, ...]]:
    """The loader's names and shapes for this config: symbols (spec["symbols"]) evaluated, `{i}` over the layers."""
    d, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or d // heads
    symbols = {
        "D": d,
        "F": config["intermediate_size"],
        "Q": heads * head_dim,
        "V": config["vocab_size"],
        "KV": config.get("num_key_value_heads", heads) * head_dim,
        "N": config.get("draft_vocab_size"),
    }
    names = dict(spec["weights"]) | ({} if config.get("tie_word_embeddings") else spec.get("weights_untied", {}))
    shapes = {}
    for name, dims in names.items():
        shape = tuple(math.prod(int(t) if t.isdigit() else symbols[t] for t in dim.split("*")) for dim in dims)
        for i in range(config["num_hidden_layers"]) if "{i}" in name else [None]:
            shapes[name.format(i=i)] = shape
    return shapes


def folder_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}


def check_against(folder: Path, spec: dict) -> None:
    config = json.loads((folder / "config.json").read_text())
    assert top_level_weight_files(folder) == set(spec["top_level_weight_files"])
    assert config["architectures"] == spec["architectures"]
    assert folder_shapes(folder) == expected_shapes(spec, config)


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("exports")
    return {engine: export_eagle(HEAD, out / engine, engine) for engine in ("vllm", "sglang")}


def test_the_shipped_eagle_head_loads_in_vllm() -> None:
    check_against(HEAD, loader("vllm-eagle"))


def test_the_shipped_draft_loads_in_vllm() -> None:
    check_against(DEFAULT_DRAFT, loader("vllm-draft_model"))


def test_no_shipped_folder_holds_another_top_level_weights_file() -> None:
    for folder in MODELS.iterdir():
        if folder.is_dir():
            assert top_level_weight_files(folder) == {"model.safetensors"}, folder


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_each_export_holds_what_its_engine_reads(exports, engine) -> None:
    check_against(exports[engine], loader(f"{engine}-eagle"))
    with safe_open(exports[engine] / "model.safetensors", "pt") as f:
        assert {f.get_slice(key).get_dtype() for key in f.keys()} == {"BF16"}
        assert engine == "vllm" or not f.get_tensor("fc.bias").any()
    assert (exports[engine] / VOCAB_FILE).is_file()


@pytest.mark.filterwarnings("ignore:To copy construct")  # SGLang's own call copies the loaded tensor so
def test_sglangs_token_map_is_the_heads_draft_vocabulary(exports) -> None:
    """As SGLang's load_token_map reads it: torch.load(weights_only=True), then a tensor of int64 token ids."""
    (file,) = (exports["sglang"] / TOKEN_MAP_DIR).iterdir()
    ids = torch.tensor(torch.load(file, weights_only=True), dtype=torch.int64)
    config = json.loads((HEAD / "config.json").read_text())
    assert file.name == f"freq_{config['verispec']['draft_vocab']}.pt"
    assert torch.equal(ids, load_draft_vocab(HEAD, config["verispec"]["draft_vocab"]))
    assert not (exports["vllm"] / TOKEN_MAP_DIR).exists()


def test_exports_read_back_into_verispec_draft_the_same_tokens(exports) -> None:
    """Greedy drafts, chain and tree, over the full vocabulary and over the token map's."""
    target = load_model(MODELS / "stdlib-target", dtype=torch.float32)
    heads = [load_head(folder, target.config, torch.float32, fast=False) for folder in (HEAD, *exports.values())]
    (token_map,) = (exports["sglang"] / TOKEN_MAP_DIR).iterdir()
    for vocab in (None, torch.load(token_map, weights_only=True)):
        for tree in (None, (2, 6)):
            drafts = [start_session(Eagle(h, 4, vocab, tree=tree), target, PROMPT).propose(PROMPT, 4) for h in heads]
            assert all(d.tokens == drafts[0].tokens and d.parents == drafts[0].parents for d in drafts)


def test_a_head_with_a_bias_that_is_not_zero_is_refused(exports, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "biased"
    folder.mkdir()
    weights = load_file(exports["sglang"] / "model.safetensors")
    weights["fc.bias"][0] = 1.0
    save_file(weights, folder / "model.safetensors")
    (folder / "config.json").write_text((exports["sglang"] / "config.json").read_text())
    target_config = load_model(MODELS / "stdlib-target").config
    with pytest.raises(CheckpointError, match="bias that is not zero"):
        load_head(folder, target_config, torch.float32)


def test_the_cli_writes_each_export(tmp_path, capsys) -> None:
    assert main(["export", "eagle", "--for", "sglang", str(tmp_path / "s"), "--draft-vocab", "100"]) == 0
    assert (tmp_path / "s" / TOKEN_MAP_DIR / "freq_100.pt").is_file()
    assert main(["export", "eagle", "--for", "vllm", str(tmp_path / "v"), "--head", str(HEAD)]) == 0
    assert "exported" in capsys.readouterr().out
    assert main(["export", "eagle", "--for", "sglang", str(tmp_path / "n"), "--draft-vocab", "-1"]) == 2


def test_an_older_folder_keeps_its_draft_vocabulary_at_the_top_level(tmp_path) -> None:
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / OLD_VOCAB_FILE).write_bytes((HEAD / VOCAB_FILE).read_bytes())
    assert torch.equal(load_draft_vocab(folder, 10), load_draft_vocab(HEAD, 10))


@pytest.fixture(scope="module")
def eagle3_folders(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A random EAGLE-3 head for the shipped target, and every EAGLE-3 head shipped in models/."""
    target = load_model(MODELS / "stdlib-target")
    torch.manual_seed(0)
    random = save_eagle3(
        new_head(target.module, torch.arange(0, 8192, 4)), tmp_path_factory.mktemp("e3") / "h", target.name
    )
    return [random, *(folder for folder in sorted(MODELS.iterdir()) if is_eagle3(folder))]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_an_eagle3_head_loads_in_both_engines_as_it_is(eagle3_folders, engine, tmp_path) -> None:
    for folder in eagle3_folders:
        check_against(folder, loader(f"{engine}-eagle3"))
        with safe_open(folder / "model.safetensors", "pt") as f:
            dtypes = {key: f.get_slice(key).get_dtype() for key in f.keys()}
        assert dtypes.pop("d2t") == "I64" and dtypes.pop("t2d") == "BOOL" and set(dtypes.values()) == {"BF16"}
        config = json.loads((folder / "config.json").read_text())
        assert "eagle_aux_hidden_state_layer_ids" not in config  # the engines' defaults, which agree with ours
        out = export_eagle(folder, tmp_path / folder.name / engine, engine)
        assert {p.name for p in out.iterdir()} == {"model.safetensors", "config.json"}
        assert (out / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    with pytest.raises(InvalidArgumentError, match="own draft vocabulary"):
        export_eagle(eagle3_folders[0], tmp_path / "n", engine, draft_vocab=100)

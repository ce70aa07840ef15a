"""One default dtype: `load`, `load_model`, `load_default` and `load_transformers_model` without `dtype=` load what
every command loads without --dtype (precision.DEFAULT_DTYPE, auto): a GGUF file's own formats, a folder in
bfloat16 where verispec's kernels run (else float32), float32 on transformers."""

from __future__ import annotations

import inspect

import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from test_cli import _keep_threads, loaded_target  # noqa: F401  (the fixture keeps torch's thread count)
from test_hf_adapter import _gpt2
from tests.gguf_files import bpe_vocab, by_name, gguf_config, write_gguf
from verispec import kernels, load, load_default, load_model, load_transformers_model
from verispec.checkpoints.shipped import default_paths
from verispec.cli.parser import build_parser
from verispec.models.native import auto_dtype
from verispec.models.precision import DEFAULT_DTYPE, formats, parse_dtype
from verispec.models.quant import QuantizedLinear


def cli_target(target, *argv: str):
    """What `verispec generate` loads as its target without --dtype."""
    return loaded_target("generate", "x", "--target", str(target), "--threads", "1", *argv)


def test_every_loader_and_command_defaults_to_the_one_constant() -> None:
    assert DEFAULT_DTYPE == "auto"
    for loader in (load, load_model, load_default, load_transformers_model):
        assert inspect.signature(loader).parameters["dtype"].default is DEFAULT_DTYPE, loader.__name__
    for argv in (["generate", "x"], ["serve"], ["bench"], ["chat"]):
        assert build_parser().parse_args(argv).dtype is DEFAULT_DTYPE, argv


@pytest.mark.parametrize("kv_dtype", ["auto", "float16"])
def test_a_folder_loads_in_the_commands_dtype(pair_dirs, kv_dtype: str) -> None:
    """bfloat16 where verispec's kernels run, else float32; float32 beside a float16 cache."""
    folder = pair_dirs[1]
    expected = torch.float32 if kv_dtype == "float16" else parse_dtype(auto_dtype())
    assert expected == (torch.bfloat16 if kernels.available(torch.bfloat16) and kv_dtype == "auto" else torch.float32)
    api = [load_model(folder, kv_dtype=kv_dtype), load(folder, kv_dtype=kv_dtype)]
    assert [model.dtype for model in api] == [expected, expected]
    assert cli_target(folder, "--kv-dtype", kv_dtype).dtype == expected


def test_a_gguf_file_keeps_its_blocks_as_the_commands_do(tmp_path) -> None:
    config = gguf_config(len(bpe_vocab()[0]))
    path = write_gguf(tmp_path / "q.gguf", config, by_name({"proj": GGML.Q4_0}, GGML.Q8_0))
    api, through_load, cli = load_model(path), load(path), cli_target(path)
    assert api.dtype == through_load.dtype == cli.dtype == torch.float32  # the activations beside blocks
    assert formats(api.module) == formats(through_load.module) == formats(cli.module)
    kept = [module for module in api.module.modules() if isinstance(module, QuantizedLinear)]
    if kernels.available(torch.float32):  # the file's own blocks, not 4x their size in float32
        assert kept and formats(api.module).keys() >= {"q4_0", "q8_0"}
    else:  # dequantized exactly where the kernels do not run
        assert not kept and set(formats(api.module)) == {"float32"}


def test_transformers_loads_float32_asked_for_or_fallen_back_to(tmp_path, pair_dirs) -> None:
    gpt2 = _gpt2(tmp_path / "gpt2", 1, 0)  # an architecture the native runtime lacks: auto falls back
    for model in (load(gpt2), load(pair_dirs[1], "transformers"), load_transformers_model(gpt2), cli_target(gpt2)):
        assert next(model.model.parameters()).dtype == torch.float32
    bfloat16 = load(pair_dirs[1], "transformers", dtype="bfloat16")  # asked for: as asked
    assert next(bfloat16.model.parameters()).dtype == torch.bfloat16


def test_load_default_is_the_shipped_pair_as_the_commands_load_it() -> None:
    target, draft = load_default()
    expected = parse_dtype(auto_dtype())
    assert target.dtype == draft.dtype == expected == cli_target(default_paths()[0]).dtype
    assert load_default(dtype="float32")[0].dtype == torch.float32

"""Self-speculative layer skip: the partial forward, the drafter's use of the target's cache, exactness and the
target distribution end to end, the search for the skip set, and the command line."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from drafting import start_session
from verispec import CheckpointError, InvalidArgumentError, LayerSkip, TransformersModel, generate, load, load_model
from verispec.bench.layer_skip_search import search_skip, write_plan
from verispec.checkpoints.folder import save_checkpoint
from verispec.checkpoints.random_init import random_checkpoint, random_weights, tiny_config
from verispec.checkpoints.tokenizer import byte_level_tokenizer
from verispec.cli import main
from verispec.errors import IncompatibleTargetError
from verispec.models.cache import KVCache
from verispec.models.execution import Execution
from verispec.models.forward_options import ForwardOptions
from verispec.models.llama import LlamaForCausalLM
from verispec.models.native import NativeModel
from verispec.models.packed import PackedCausalLM, pack_model, packing
from verispec.sampling import SamplingParams, logits_to_probs

PROMPT = "def parse(line):\n    return"
TEXTS = [
    "import os\n\ndef main(argv):\n    for name in argv:\n        print(os.path.basename(name))\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
]


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def identity_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 3-layer model whose layer 1 writes nothing into the residual stream (o_proj and down_proj zero):
    skipping it changes no logit."""
    config = tiny_config(num_hidden_layers=3)
    weights = random_weights(config, 5)
    for name in ("model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        weights[name] = np.zeros_like(weights[name])
    return save_checkpoint(tmp_path_factory.mktemp("identity"), config, weights, byte_level_tokenizer())


# ---------------------------------------------------------------------------------------------------------------
# the forward with `layers`


def partial_model(target: NativeModel, kept: list[int]) -> LlamaForCausalLM:
    """A model of only the `kept` blocks (renumbered 0, 1, ...), with the target's embeddings, norm and head."""
    model = LlamaForCausalLM(replace(target.config, num_hidden_layers=len(kept))).eval()
    state = {}
    for name, value in target.module.state_dict().items():
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            if layer not in kept:
                continue
            name = name.replace(f"model.layers.{layer}.", f"model.layers.{kept.index(layer)}.", 1)
        state[name] = value
    model.load_state_dict(state)
    if isinstance(target.module, PackedCausalLM):  # the same kernels as the target's, so that only the layers differ
        return pack_model(model, 1, packing(target.module).kernels)
    return model


@pytest.mark.parametrize("kept", [[0], [1], [0, 2], [1, 2]])
def test_forward_with_layers_equals_a_partial_model(target: NativeModel, kept: list[int]) -> None:
    tokens = torch.tensor([[72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]])
    partial = partial_model(target, kept)
    with torch.inference_mode():
        expected = Execution(partial).forward(tokens, None)
        torch.testing.assert_close(
            target.execution.forward(tokens, None, ForwardOptions(layers=kept)), expected, rtol=0, atol=1e-6
        )
        # With a cache, fed in two chunks: the kept layers' entries are the partial model's own, in their slots.
        cache = target.new_cache(32)
        cache.k.fill_(float("nan"))
        first = target(tokens[:, :6], cache, layers=kept)
        second = target(tokens[:, 6:], cache, layers=kept)
        torch.testing.assert_close(torch.cat((first, second), 1), expected, rtol=0, atol=1e-5)
        c = partial.config
        own_cache = KVCache(len(kept), 1, c.num_key_value_heads, 32, c.dim_per_head)
        Execution(partial).forward(tokens, own_cache)
        for j, layer in enumerate(kept):
            torch.testing.assert_close(cache.k[layer, :, :, :11], own_cache.k[j, :, :, :11], rtol=0, atol=1e-5)
        skipped = [i for i in range(3) if i not in kept]
        assert cache.length == 11 and bool(cache.k[skipped].isnan().all())  # skipped layers wrote nothing


# ---------------------------------------------------------------------------------------------------------------
# the drafter


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("skip", [[1], [2], [0, 2], [1, 2]])
def test_greedy_is_identical_to_autoregressive(target: NativeModel, k: int, skip: list[int]) -> None:
    """Greedy decoding with the target drafting for itself gives the target's own tokens, whatever it skips
    (down to all layers but one)."""
    plain = generate(target, PROMPT, None, max_new_tokens=24, ignore_eos=True)
    spec = generate(target, PROMPT, LayerSkip(skip, k), max_new_tokens=24, ignore_eos=True)
    assert spec.tokens == plain.tokens
    assert spec.stats.drafter_calls > 0 and spec.stats.target_calls < 24  # drafts were made and some accepted


def test_skipping_a_layer_that_writes_nothing_accepts_every_draft(identity_dir: Path) -> None:
    target = load_model(identity_dir)
    out = generate(target, PROMPT, LayerSkip([1], k=3), max_new_tokens=16, ignore_eos=True)
    assert out.stats.accepted == out.stats.proposed > 0
    assert out.tokens == generate(target, PROMPT, None, max_new_tokens=16, ignore_eos=True).tokens


def prefilled(target: NativeModel, prompt: list[int], room: int | None = None):
    cache = target.new_cache(room)
    target(torch.tensor([prompt[:-1]]), cache)
    return cache


def test_propose_leaves_the_target_cache_as_it_found_it(target: NativeModel) -> None:
    prompt = target.tokenizer.encode(PROMPT).ids
    cache = prefilled(target, prompt)
    before = cache.k[:, :, :, : cache.length].clone(), cache.v[:, :, :, : cache.length].clone(), cache.length
    drafter = LayerSkip([2], k=4)
    proposal = start_session(drafter, target, prompt, SamplingParams(), torch.Generator(), cache).propose(prompt, 4)
    assert len(proposal.tokens) == 4 and proposal.q is None
    assert cache.length == before[2]
    assert torch.equal(cache.k[:, :, :, : cache.length], before[0])
    assert torch.equal(cache.v[:, :, :, : cache.length], before[1])
    # The first draft is the skipping forward of the last token over the full model's cache of the prefix.
    with torch.inference_mode():
        full_prefix = prefilled(target, prompt)
        first = target(torch.tensor([prompt[-1:]]), full_prefix, layers=[0, 1])[0, -1, : target.vocab_size]
    assert proposal.tokens[0] == int(first.argmax())


def test_propose_fits_a_nearly_full_cache(target: NativeModel) -> None:
    prompt = target.tokenizer.encode(PROMPT).ids
    cache = prefilled(target, prompt, room=len(prompt) + 1)  # two free slots: the last token and one draft
    drafter = LayerSkip([1], k=4)
    session = start_session(drafter, target, prompt, SamplingParams(), torch.Generator(), cache)
    assert len(session.propose(prompt, 4).tokens) == 2 and cache.length == len(prompt) - 1


def test_sampling_returns_q_and_is_reproducible(target: NativeModel) -> None:
    prompt = target.tokenizer.encode(PROMPT).ids
    sampling = SamplingParams(1.0, top_k=20)
    cache, drafter = prefilled(target, prompt), LayerSkip([1, 2], k=3)
    proposal = start_session(drafter, target, prompt, sampling, torch.Generator().manual_seed(0), cache).propose(
        prompt, 3
    )
    assert proposal.q.shape == (3, target.vocab_size)
    torch.testing.assert_close(proposal.q.sum(-1), torch.ones(3))
    assert all(proposal.q[i, t] > 0 for i, t in enumerate(proposal.tokens))
    assert int((proposal.q[0] > 0).sum()) == 20  # q is the processed draft distribution (top-k applied)

    def run(seed: int) -> list[int]:
        return generate(
            target, PROMPT, LayerSkip([1], k=3), max_new_tokens=16, temperature=1.0, seed=seed, ignore_eos=True
        ).tokens

    assert run(7) == run(7)
    assert len({tuple(run(seed)) for seed in range(4)}) > 1


# End to end under sampling: a 2-layer target over 6 tokens drafting with layer 1 skipped. With max_new_tokens = 2
# the first step drafts one token, accepted with probability sum_x min(p(x), q(x)), and the two new tokens must
# follow the target's joint distribution. About 3.5 ms per generation.
E2E_VOCAB, E2E_PROMPT, E2E_DRAWS = 6, [1, 4, 2], 2500


def test_sampling_keeps_the_target_distribution(tmp_path: Path) -> None:
    config = tiny_config(vocab_size=E2E_VOCAB, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    target = load_model(random_checkpoint(tmp_path / "t", config, seed=1))
    with torch.inference_mode():
        first = target(torch.tensor([E2E_PROMPT]), target.new_cache())[0, -1, :E2E_VOCAB].softmax(-1)
        second = torch.stack(
            [target(torch.tensor([E2E_PROMPT + [x]]), target.new_cache())[0, -1, :E2E_VOCAB] for x in range(E2E_VOCAB)]
        ).softmax(-1)
        cache = prefilled(target, E2E_PROMPT)
        q = logits_to_probs(
            target(torch.tensor([E2E_PROMPT[-1:]]), cache, layers=[0])[0, -1, :E2E_VOCAB], SamplingParams(1.0)
        )
    joint = (first[:, None] * second).double().numpy()
    acceptance = float(torch.minimum(first, q).sum())
    assert 0.3 < acceptance < 0.95  # drafts are both kept and rejected
    counts, first_accepted = np.zeros((E2E_VOCAB, E2E_VOCAB)), 0
    drafter = LayerSkip([1], k=2)
    for seed in range(E2E_DRAWS):
        out = generate(target, E2E_PROMPT, drafter, max_new_tokens=2, temperature=1.0, seed=seed, ignore_eos=True)
        counts[out.tokens[0], out.tokens[1]] += 1
        first_accepted += out.drafted[0]
    expected, counts = joint.ravel() * E2E_DRAWS, counts.ravel()
    small = expected < 5  # pooled into one cell, so that every cell is large enough for the chi-square test
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    assert stats.chisquare(observed, expected / expected.sum() * observed.sum()).pvalue > 1e-3
    sigma = (acceptance * (1 - acceptance) / E2E_DRAWS) ** 0.5
    assert abs(first_accepted / E2E_DRAWS - acceptance) < 5 * sigma


# ---------------------------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    "skip, message",
    [
        ([], "at least one layer"),
        ([1, 1], "distinct"),
        ([-1], "non-negative"),
        ([1.5], "non-negative"),
        ([True], "non-negative"),
    ],
)
def test_bad_skip_sets_are_refused(skip: list, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        LayerSkip(skip)


def test_k_below_one_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="k"):
        LayerSkip([1], k=0)


@pytest.mark.parametrize("skip, message", [([3], "cannot skip layer 3"), ([0, 1, 2], "all 3 layers")])
def test_skip_sets_out_of_the_model_are_refused(target: NativeModel, skip: list[int], message: str) -> None:
    with pytest.raises(IncompatibleTargetError, match=message):
        generate(target, PROMPT, LayerSkip(skip), max_new_tokens=4)


def test_a_transformers_target_is_refused(pair_dirs) -> None:
    target = load(pair_dirs[0], backend="transformers")
    assert isinstance(target, TransformersModel)
    with pytest.raises(IncompatibleTargetError, match="native runtime"):
        generate(target, PROMPT, LayerSkip([1]), max_new_tokens=4)
    with pytest.raises(InvalidArgumentError, match="native runtime"):
        search_skip(target, TEXTS, r=1.5, fixed_share=0.2)


def test_a_one_layer_model_has_nothing_to_skip(unrelated: NativeModel) -> None:
    with pytest.raises(InvalidArgumentError, match="none to skip"):
        search_skip(unrelated, TEXTS, r=1.5, fixed_share=0.2)


def test_missing_or_corrupt_plans_are_checkpoint_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no layer-skip plan"):
        LayerSkip.from_checkpoint(tmp_path)
    (tmp_path / "layerskip.json").write_text('{"skip": [1]}')
    with pytest.raises(CheckpointError, match="not a layer-skip plan"):
        LayerSkip.from_checkpoint(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# the search


def test_search_skips_the_layer_that_writes_nothing(identity_dir: Path, tmp_path: Path) -> None:
    target = load_model(identity_dir)
    # 15 new tokens are three steps of k + 1 = 5 when every draft is accepted.
    plan = search_skip(target, TEXTS, k=4, prompts=3, prompt_len=24, new_tokens=15, r=1.5, fixed_share=0.2)
    assert plan.steps[0]["layer"] == 1 and plan.steps[0]["agreement"] == 1.0 and plan.steps[0]["tau"] == 5
    assert 1 in plan.skip and len(plan.skip) < 3
    assert plan.predicted_speedup == pytest.approx(plan.tau / (4 * plan.c + 1.5))
    assert plan.c == pytest.approx(0.2 + 0.8 * (3 - len(plan.skip)) / 3)
    assert [s["predicted_speedup"] for s in plan.steps] == sorted(s["predicted_speedup"] for s in plan.steps)
    assert plan.data == "2 given texts: 3 prompts of 24 tokens, 15 new tokens each"
    saved = json.loads(write_plan(plan, tmp_path).read_text())
    assert saved["skip"] == plan.skip and saved["k"] == 4 and saved["predicted_speedup"] == plan.predicted_speedup
    assert {"agreement", "method", "data", "c", "r"} <= saved.keys()
    assert LayerSkip.from_checkpoint(tmp_path).skip == plan.skip and LayerSkip.from_checkpoint(tmp_path).k == 4
    assert LayerSkip.from_checkpoint(tmp_path, k=2).k == 2


def test_search_takes_token_ids_and_measures_costs(target: NativeModel) -> None:
    ids = torch.tensor([target.tokenizer.encode(text).ids[:20] for text in TEXTS])
    plan = search_skip(target, ids, k=2, new_tokens=8)
    assert plan.data == "given token ids (2 x 20), 8 new tokens each"
    assert plan.r >= 1 and 0 <= plan.fixed_share <= 1 and 0 < plan.c <= 1 and 1 <= len(plan.skip) <= 2
    assert 0 <= plan.agreement <= 1 and 1 <= plan.tau <= 3


# ---------------------------------------------------------------------------------------------------------------
# command line


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_search_then_generate(capsys, identity_dir: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(identity_dir, tmp_path / "model")
    text = tmp_path / "valid.py"
    text.write_text("\n".join(TEXTS))
    code, out, err = run(
        capsys,
        "search-layerskip",
        "--target",
        str(folder),
        "--text",
        str(text),
        "-k",
        "3",
        "--prompts",
        "2",
        "--prompt-len",
        "16",
        "--new-tokens",
        "8",
    )
    assert code == 0 and err == "" and "skip layer 1: acceptance 1.000" in out and "chosen: skip [" in out
    assert 1 in json.loads((folder / "layerskip.json").read_text())["skip"]
    code, out, err = run(
        capsys,
        "generate",
        "def f(x):",
        "--target",
        str(folder),
        "--method",
        "layerskip",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--compare",
        "--color",
        "never",
    )
    assert code == 0 and err == "" and "identical to autoregressive: yes" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--skip", "1,x"], "--skip takes comma-separated layer indices"),
        (["--skip", "7"], "cannot skip layer 7"),
        (["--skip", "0,1,2"], "cannot skip all 3 layers"),
        ([], "no layer-skip plan"),
    ],
)
def test_cli_error_lines(capsys, pair_dirs, argv: list[str], message: str) -> None:
    code, out, err = run(capsys, "generate", "x", "--target", str(pair_dirs[0]), "--method", "layerskip", *argv)
    assert code == 2 and out == "" and err.startswith("verispec: error: ") and err.count("\n") == 1
    assert message in err


def test_cli_search_refuses_a_one_layer_model(capsys, unrelated_dir: Path) -> None:
    code, out, err = run(capsys, "search-layerskip", "--target", str(unrelated_dir))
    assert code == 2 and out == "" and "none to skip" in err and err.count("\n") == 1

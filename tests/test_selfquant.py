"""Quantized self-speculation (`--method selfquant`): the twin is the target's own weights requantized (bitwise the
model `--quantize` makes, its tensors shared, no float copy), greedy output identical to plain decoding for float,
bfloat16, quantized and GGUF targets (chains k = 1..6, trees, layers skipped), the target's distribution under
sampling, the batched engine, the command line, and the refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from drafting import sampled_pairs, start_session
from gguf_files import bpe_vocab, by_name, gguf_config, write_gguf
from test_tree_draft import P_VALUE_MIN, compare, no_residual_verify_tree
from verispec import IncompatibleTargetError, InvalidArgumentError, generate, generate_batch, kernels
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.cli import main
from verispec.drafters.registry import Method, Resources, build_drafter, check_method
from verispec.drafters.selfquant import SelfQuant
from verispec.models.auto import load
from verispec.models.native import load_model
from verispec.models.precision import projections
from verispec.models.twin import SAME_HEAD, TwinFormat, quantized_twin
from verispec.sampling import SamplingParams, logits_to_probs, sample
from verispec.threads import torch_threads
from verispec.verify import verify

needs_kernels = pytest.mark.skipif(
    not kernels.available(torch.float32), reason=f"verispec's kernels do not run here: {kernels.reason()}"
)
PROMPT = [100, 101, 102, 40, 120, 41, 58, 10, 32, 32, 100, 101, 102]  # "def(x):\n  def" as byte ids
N = 24
METHODS = {
    **{f"k={k}": Method("selfquant", k) for k in range(1, 7)},
    "tree": Method("selfquant", 3, {"branch": 2, "branch_depth": 2}),
    "skip": Method("selfquant", 4, {"skip": [1], "format": "q4_1", "head_format": "q4_0"}),
    "auto": Method("selfquant", "auto", {"format": "q8_0"}),
}


@pytest.fixture(autouse=True)
def one_thread(single_thread: None) -> None:
    """One thread, for speed on a shared machine (tests/test_pool.py takes every count)."""


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    config = tiny_config(num_hidden_layers=3, tie_word_embeddings=True)
    return random_checkpoint(tmp_path_factory.mktemp("bf16") / "target", config, seed=2, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, str]:
    """Every matrix in Q8_0; and Q4_1 projections with a Q8_0 embedding tied to the output, as SmolLM2's file."""
    folder = tmp_path_factory.mktemp("gguf")
    config = gguf_config(len(bpe_vocab()[0]), num_hidden_layers=3, tie_word_embeddings=True)
    return {
        name: str(write_gguf(folder / f"{name}.gguf", config, by_name({"embed_tokens": GGML.Q8_0}, projections)))
        for name, projections in (("q8_0", GGML.Q8_0), ("q4_1", GGML.Q4_1))
    }


@pytest.fixture(scope="module")
def targets(pair_dirs, bf16_dir, gguf_files) -> dict:
    with torch_threads(1):
        return {
            "float32": load_model(pair_dirs[0], dtype="float32"),
            "float32 exact": load_model(pair_dirs[0], exact=True, dtype="float32"),
            "bfloat16": load_model(bf16_dir, dtype="bfloat16"),
            "q8_0": load_model(pair_dirs[0], quantize="q8_0"),
            **{f"gguf {name}": load_model(file, dtype="auto") for name, file in gguf_files.items()},
        }


@pytest.fixture(scope="module")
def truths(targets) -> dict[str, list[int]]:
    with torch_threads(1):
        return {name: generate(t, PROMPT, max_new_tokens=N, ignore_eos=True).tokens for name, t in targets.items()}


def both_ways(model, tokens: list[int] = PROMPT) -> torch.Tensor:
    """The logits of a prefill and of the decoding step after it (the replayed path), side by side."""
    cache = model.new_cache()
    prefill = model(torch.tensor([tokens[:-1]]), cache)[0]
    return torch.cat((prefill, model(torch.tensor([tokens[-1:]]), cache)[0]))


# ---------------------------------------------------------------------------------------------------------------
# the twin


@needs_kernels
def test_the_twin_is_the_model_quantize_makes(pair_dirs, bf16_dir) -> None:
    """Projections in q4_0 and the head in q8_0 (the defaults) are what `load_model(quantize="q4_0")` holds: the same
    logits, bitwise; a bfloat16 target's twin runs in float32 as that model loaded in float32 does (its table widened
    exactly); with layers skipped it is the quantized model run over the other layers."""
    twin, made = quantized_twin(load_model(pair_dirs[0], dtype="float32")), load_model(pair_dirs[0], quantize="q4_0")
    assert twin.dtype == torch.float32 and torch.equal(both_ways(twin), both_ways(made))
    bf16 = quantized_twin(load_model(bf16_dir, dtype="bfloat16"))
    assert bf16.module.model.embed_tokens.weight.dtype == torch.bfloat16 and bf16.dtype == torch.float32
    assert torch.equal(both_ways(bf16), both_ways(load_model(bf16_dir, dtype="float32", quantize="q4_0")))
    skipping = quantized_twin(load_model(pair_dirs[0], dtype="float32"), TwinFormat(skip=(1,)))
    assert skipping.num_layers == 2 and skipping.module.model.layers[1].self_attn.layer == 1
    x = torch.tensor([PROMPT])
    assert torch.equal(skipping(x, skipping.new_cache()), made(x, made.new_cache(), layers=[0, 2]))


@needs_kernels
def test_the_twin_shares_the_targets_tensors_and_holds_no_float_matrix(targets, bf16_dir) -> None:
    for name, target in targets.items():
        cached = {n for n, linear in projections(target.module).items() if "weight" in vars(linear)}
        twin = quantized_twin(target).module
        source = target.module
        assert twin.model.embed_tokens.weight is source.model.embed_tokens.weight, name
        norms = [(twin.model.norm, source.model.norm)] + [
            (getattr(mine, norm), getattr(theirs, norm))
            for mine, theirs in zip(twin.model.layers, source.model.layers)
            for norm in ("input_layernorm", "post_attention_layernorm")
        ]
        for mine, theirs in norms:  # the target's own, or float32 copies of a bfloat16 target's vectors
            assert (mine.weight is theirs.weight) == (target.dtype == torch.float32), name
            assert torch.equal(mine.weight, theirs.weight.float()), name
        packed = [twin.head] + [
            p
            for block in twin.model.layers
            for p in (block.self_attn.qkv, block.self_attn.o, block.mlp.gate_up, block.mlp.down)
        ]
        assert all(p.weight is None and p.kernel.kernel.startswith("linear_q") for p in packed), name  # blocks only
        shared = getattr(source.lm_head, "quantized", None) is not None and source.lm_head.quantized.format == "q8_0"
        assert (twin.lm_head is source.lm_head and twin.head is source.head) == shared, name  # a Q8_0 head as it is
        # Requantizing never left a dequantized copy of a target's blocks behind (`QuantizedLinear.weight`)
        assert {n for n, linear in projections(target.module).items() if "weight" in vars(linear)} == cached, name
    gguf = targets["gguf q8_0"]
    same = quantized_twin(gguf, TwinFormat("q8_0")).module
    assert same.model.layers[0].mlp.down_proj.quantized is gguf.module.model.layers[0].mlp.down_proj.quantized
    own_head = quantized_twin(targets["float32"], TwinFormat(head=SAME_HEAD)).module
    assert own_head.lm_head is targets["float32"].module.lm_head and own_head.head.kernel.kernel == "linear_f32"


# ---------------------------------------------------------------------------------------------------------------
# greedy identity, everywhere


@needs_kernels
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", ["float32", "float32 exact", "bfloat16", "q8_0", "gguf q8_0", "gguf q4_1"])
def test_greedy_output_is_plain_decodings(targets, truths, name, method) -> None:
    target = targets[name]
    drafter = build_drafter(METHODS[method], Resources(target=target))
    out = generate(target, PROMPT, drafter, max_new_tokens=N, ignore_eos=True)
    assert out.tokens == truths[name]
    assert method == "auto" or out.stats.accepted > 0


@needs_kernels
def test_the_batched_engine_drafts_with_the_twin(targets) -> None:
    """Greedy and seeded: each sequence of a batch as `generate` gives it alone."""
    target = targets["float32"]
    drafter = build_drafter(Method("selfquant", 3, {"skip": [2]}), Resources(target=target))
    assert drafter.batched
    prompts = [PROMPT, [7], PROMPT[2:9]]
    for options in (dict(), dict(temperature=1.0, top_k=50, seed=3)):
        batch = generate_batch(target, prompts, drafter, max_new_tokens=N, ignore_eos=True, adaptive=False, **options)
        alone = [generate(target, p, drafter, max_new_tokens=N, ignore_eos=True, **options).tokens for p in prompts]
        assert [r.tokens for r in batch] == alone
        assert sum(r.stats.accepted for r in batch) > 0


@needs_kernels
def test_the_server_drafts_with_the_twin(targets, pair_dirs) -> None:
    """`verispec serve --method selfquant`: a greedy completion is the target's own, drafted by the twin."""
    import openai

    from verispec.serve.app import serving_app
    from verispec.serve.server import ServerThread

    target = targets["float32"]
    drafter = build_drafter(Method("selfquant", 3, {"skip": [2]}), Resources(target=target))
    expected = generate(target, "def parse(line):", max_new_tokens=N, ignore_eos=True)
    with ServerThread(serving_app(target, drafter, pair_dirs[0], name="twin", adaptive=False)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        reply = client.completions.create(
            model="twin", prompt="def parse(line):", max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
        )
    assert reply.choices[0].text == expected.text
    assert reply.model_extra["verispec"]["drafted_tokens"] > 0


# ---------------------------------------------------------------------------------------------------------------
# sampling keeps the target distribution: two new tokens over a vocabulary of 6, against exact probabilities

VOCAB, E2E_PROMPT, DRAWS, BROKEN_DRAWS = 6, [1, 4, 2], 1500, 1200


@pytest.fixture(scope="module")
def enumerable(tmp_path_factory, reference_probs):
    config = tiny_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    folder = random_checkpoint(tmp_path_factory.mktemp("enumerable") / "target", config, seed=3)
    probs = reference_probs(folder, np.array([E2E_PROMPT + [x] for x in range(VOCAB)]))
    with torch_threads(1):
        target = load_model(folder)
    return target, probs[0, -2][:, None] * probs[:, -1], probs[0, -2]


def resampled_from_p(draft, q, logits, sampling, generator):
    """BROKEN: speculative sampling's acceptance, but a rejected draft's correction drawn from p, not the residual."""
    n, _ = verify(draft, q, logits, sampling, generator)
    return n, int(sample(logits_to_probs(logits[0, n], sampling), generator))


@needs_kernels
@pytest.mark.parametrize("branch", [1, 2])
def test_sampling_keeps_the_target_distribution(enumerable, branch, monkeypatch) -> None:
    """A chain of two (the first step drafts one token of the two asked for) or a tree of two candidates, from a q4_0
    twin without the target's second layer: the two new tokens follow the target's joint distribution, the first is
    drafted at speculative sampling's (or SpecInfer's) rate, and a broken rule fails the same check."""
    target, joint, p = enumerable
    drafter = SelfQuant(target, TwinFormat(skip=(1,)), k=2, branch=branch)
    proposal = start_session(
        drafter, target, E2E_PROMPT, SamplingParams(1.0), torch.Generator().manual_seed(0)
    ).propose(E2E_PROMPT, 1)
    q = proposal.q[0].double().numpy()
    twin = drafter.model
    with torch.inference_mode():
        logits = twin(torch.tensor([E2E_PROMPT]), twin.new_cache())[0, -1, :VOCAB]
    expected = logits_to_probs(logits, SamplingParams(1.0))
    np.testing.assert_allclose(q, expected.double().numpy(), rtol=1e-6, atol=1e-7)  # q is the twin's
    a1 = np.minimum(p, q).sum()
    residual = np.maximum(p - q, 0) / np.maximum(p - q, 0).sum()
    rate = a1 if branch == 1 else a1 + (1 - a1) * np.minimum(residual, q).sum()
    assert 0.3 < a1 < 0.95, a1  # drafts are both kept and rejected
    counts, drafted = sampled_pairs(target, drafter, E2E_PROMPT, DRAWS)
    pvalue, tv = compare(counts.ravel(), joint.ravel())
    assert pvalue > P_VALUE_MIN and tv < (joint.size / DRAWS) ** 0.5, (pvalue, tv)
    sigma = (rate * (1 - rate) / DRAWS) ** 0.5
    assert abs(drafted / DRAWS - rate) < 5 * sigma, (drafted / DRAWS, rate)
    import verispec.step

    if branch == 1:
        monkeypatch.setattr(verispec.step, "verify", resampled_from_p)
    else:
        monkeypatch.setattr(verispec.step, "verify_tree", no_residual_verify_tree)
    counts, _ = sampled_pairs(target, drafter, E2E_PROMPT, BROKEN_DRAWS)
    assert compare(counts.ravel(), joint.ravel())[0] < 1e-6


# ---------------------------------------------------------------------------------------------------------------
# the registry, the command line, refusals


@needs_kernels
def test_the_registry_builds_the_options(targets, tmp_path) -> None:
    target = targets["float32"]
    assert check_method(Method("selfquant")).twin and check_method(Method("selfquant", 3, {"branch": 2})).tree_masks
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"skip": [0, 2], "k": 6}))
    drafter = build_drafter(
        Method("selfquant", 3, {"skip": str(plan), "format": "q4_1", "head_format": SAME_HEAD}),
        Resources(target=target),
    )
    assert drafter.spec == TwinFormat("q4_1", SAME_HEAD, (0, 2)) and drafter.k == 3 and drafter.model.num_layers == 1
    auto = build_drafter(Method("selfquant", "auto"), Resources(target=target))
    assert auto.drafter.spec == TwinFormat() and auto.drafter.batched and auto.needs.twin


@needs_kernels
def test_cli_generate_with_selfquant(pair_dirs, tmp_path, capsys) -> None:
    plan = tmp_path / "layerskip.json"
    plan.write_text(json.dumps({"skip": [1], "k": 4}))
    base = [
        "generate",
        "abcabc",
        "--target",
        str(pair_dirs[0]),
        "--method",
        "selfquant",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--threads",
        "1",
    ]
    for extra in (
        [],
        ["--format", "q4_1", "--head-format", "q4_0", "--skip", "1", "-k", "3", "--compare"],
        ["--skip", str(plan), "--branch", "2", "--compare"],
    ):
        assert main(base + extra) == 0
        out, err = capsys.readouterr()
        assert err == "" and ("--compare" not in extra or "identical to autoregressive: yes" in out)
    for extra, message in (
        (["--format", "q6_k"], "argument --format: invalid choice: 'q6_k'"),
        (["--head-format", "f16"], "argument --head-format: invalid choice: 'f16'"),
        (["--skip", str(tmp_path / "none.json")], "no such layer-skip plan"),
        (["--skip", "3"], "cannot skip layer 3"),
        (["--skip", "0,1,2"], "cannot skip all 3"),
        (["--backend", "transformers"], "a twin of its weights"),
    ):
        assert main(base + extra) == 2
        assert message in capsys.readouterr().err
    torch.set_num_threads(1)  # (main set the count the last run asked for)


@needs_kernels
def test_a_gguf_targets_layer_skip_plan_for_selfquant(gguf_files, tmp_path, capsys) -> None:
    """`search-layerskip --out PLAN.json` (a GGUF file has no folder for layerskip.json), then `--skip PLAN.json`."""
    text, plan = tmp_path / "valid.txt", tmp_path / "plan.json"
    text.write_text("the quick brown fox jumps over the lazy dog, and then the dog runs after the fox. " * 8)
    search = [
        "search-layerskip",
        "--target",
        gguf_files["q8_0"],
        "--text",
        str(text),
        "--prompts",
        "2",
        "--prompt-len",
        "16",
        "--new-tokens",
        "4",
        "--threads",
        "1",
    ]
    assert main(search) == 2 and "give --out PLAN.json" in capsys.readouterr().err
    assert main(search + ["--out", str(plan)]) == 0 and f"wrote {plan}" in capsys.readouterr().out
    skip = json.loads(plan.read_text())["skip"]
    assert (
        main(
            [
                "generate",
                "the quick brown",
                "--target",
                gguf_files["q8_0"],
                "--method",
                "selfquant",
                "--skip",
                str(plan),
                "-k",
                "3",
                "--max-new-tokens",
                "12",
                "--ignore-eos",
                "--compare",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "identical to autoregressive: yes" in out and skip


def test_refusals(pair_dirs, bf16_dir, tmp_path) -> None:
    target = load_model(pair_dirs[0], dtype="float32")
    with pytest.raises(InvalidArgumentError, match="needs the target"):
        build_drafter(Method("selfquant", 2))
    with pytest.raises(IncompatibleTargetError, match="native model's weights"):
        build_drafter(Method("selfquant", 2), Resources(target=load(pair_dirs[0], backend="transformers")))
    if not kernels.available(torch.float32):
        with pytest.raises(IncompatibleTargetError, match="do not run here"):
            quantized_twin(target)
    with pytest.raises(InvalidArgumentError, match="distinct"):
        TwinFormat(skip=(1, 1))
    if not kernels.available(torch.float32):
        return  # (every refusal below is reached where a twin can run only)
    with pytest.raises(IncompatibleTargetError, match="cannot share"):
        quantized_twin(load_model(bf16_dir, dtype="bfloat16"), TwinFormat(head=SAME_HEAD))
    narrow = load_model(random_checkpoint(tmp_path / "narrow", tiny_config(hidden_size=48)))
    with pytest.raises(IncompatibleTargetError, match="multiple of 32"):
        quantized_twin(narrow)
    drafter = SelfQuant(target, k=2)
    with pytest.raises(IncompatibleTargetError, match="drafts for that target only"):
        generate(load_model(pair_dirs[0], dtype="float32"), PROMPT, drafter, max_new_tokens=4)

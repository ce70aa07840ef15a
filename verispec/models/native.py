"""The native runtime's model (`NativeModel`), and loading one from a Hugging Face-format folder or a GGUF file."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch
from tokenizers import Tokenizer

from verispec import kernels
from verispec.checkpoints.config import ModelConfig, read_config
from verispec.checkpoints.folder import check_finite, check_folder, load_weights
from verispec.checkpoints.gguf_checkpoint import read_gguf
from verispec.checkpoints.gguf_file import is_gguf
from verispec.checkpoints.shipped import default_paths
from verispec.checkpoints.tokenizer import check_tokenizer_fits, eos_token_ids, load_tokenizer
from verispec.errors import InvalidArgumentError
from verispec.models.batch_cache import BatchKVCache
from verispec.models.cache import KVCache
from verispec.models.device import usable_device
from verispec.models.execution import Execution
from verispec.models.forward_options import ForwardOptions, VocabHead
from verispec.models.linear import packable
from verispec.models.llama import LlamaForCausalLM
from verispec.models.packed import pack_model, packing
from verispec.models.precision import (
    DEFAULT_DTYPE,
    file_formats,
    kv_dtype_of,
    parse_dtype,
    quantize_linears,
    quantized_at_load,
)
from verispec.models.protocol import Capabilities
from verispec.models.slot_caches import SlotCaches


def own_kernels_run(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> bool:
    """Whether a native model of `dtype` ("auto" included) loaded now on `device` runs on verispec's own kernels
    (`kernels.available` here)."""
    try:
        return kernels.available(torch.float32 if dtype == "auto" else parse_dtype(dtype), device)
    except RuntimeError:  # not a device name: loading says so in its own words
        return False


def auto_dtype(
    device: str | torch.device = "cpu",
    checkpoint: str | Path | None = None,
    *,
    quantize: str | None = None,
    kv_dtype: str | torch.dtype = "auto",
) -> str:
    """`dtype="auto"` (precision.DEFAULT_DTYPE) for the native runtime, as `load_model` and every command take it:
    float32 with `quantize` (the activations a quantized model runs with); for a GGUF file "auto" itself, its own
    formats (see `load_model`); for a folder, float32 beside a float16 cache (`kv_dtype`), else bfloat16 where
    verispec's own kernels run on `device` (bfloat16 is then both the fastest and, in exact mode, exact), else
    float32."""
    if quantize:
        return "float32"
    if checkpoint is not None and is_gguf(checkpoint):
        return "auto"
    if kv_dtype in ("float16", torch.float16):  # a float16 cache goes with float32 activations
        return "float32"
    return "bfloat16" if own_kernels_run(torch.bfloat16, device) else "float32"


EXACT_ROWS = 16  # exact mode on PyTorch's kernels: the most rows of a forward (longer ones run in chunks), and of its
# score matmul (on verispec's, chunks of execution.LONG_ROWS)


class NativeModel:
    """A native Llama-family model with its tokenizer: `model(tokens, cache) -> logits`.

    `exact`: its caches are exact mode's (`KVCache(rows=EXACT_ROWS, width=context_length + EXACT_ROWS)`: static on
    PyTorch's kernels, growing on verispec's), and a position's logits are bitwise the same however many tokens share
    the forward (plain decoding, a chain, a tree, a prefill chunk): greedy speculative output is then identical to
    plain greedy decoding in any dtype. On verispec's own kernels (verispec/kernels: an AVX-512 or an AVX2 build,
    whichever the CPU has) that holds by construction: attention takes each row's own keys (`VisibleSlots`), a forward
    runs in chunks of 256 rows (memory only), and it costs nothing over ordinary decoding. On PyTorch's every forward
    attends over the same key width in chunks of at most 16 rows, each padded to 16 (at one fixed row count a row's
    bits do not depend on the others: `Execution.row_floor`), which costs the padding and attention over the whole
    context width each forward, and a token tree may be at most 32 deep (`FixedWidthKeys`).

    Its forwards run through `execution` (models/execution.py), which decides how each one runs.
    """

    def __init__(
        self,
        module: LlamaForCausalLM,
        tokenizer: Tokenizer,
        eos_ids: frozenset[int],
        name: str,
        *,
        exact: bool = False,
        kv_dtype: str | torch.dtype = "auto",
    ) -> None:
        self.module, self.config, self.tokenizer, self.eos_token_ids, self.name = (
            module,
            module.config,
            tokenizer,
            eos_ids,
            name,
        )
        self.exact = exact
        self.kv_dtype = kv_dtype_of(module, kv_dtype)  # its caches' (`kv_dtype_of`), and the batched engine's:
        self.batch_kv_dtype = kv_dtype_of(module, kv_dtype, batched=True)
        self.capabilities = Capabilities(
            tree_masks=True,
            hidden_states=True,
            layer_subsets=True,
            batching=self._batches(),
            greedy_chains=True,
            vocab_heads=True,
            twins=True,
        )
        self.vocab_size = min(module.config.vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
        self.context_length = module.config.max_position_embeddings
        self.hidden_size, self.num_layers = module.config.hidden_size, module.config.num_hidden_layers
        self.device, self.dtype = module.model.norm.weight.device, module.dtype  # (the activations')
        self.execution = Execution(module)

    def _batches(self) -> bool:
        """Whether the batched engine can run it: exact mode batches only where the kernels attend (each sequence
        over its own cache), not on PyTorch's static caches, whose fixed-shape attention holds one sequence."""
        return not self.exact or packing(self.module).attention

    def pack(self, rows: int, own_kernels: bool | None = None) -> None:
        """Pack the weights for the kernels, laid out for `rows` rows (`packed.pack_model`, whose module takes the
        plain one's place); the forwards' captures and tables, made for the weights as they were, start afresh."""
        self.module = pack_model(self.module, rows, own_kernels)
        capture, self.execution = self.execution.capture, Execution(self.module)
        self.execution.capture = capture
        self.capabilities = replace(self.capabilities, batching=self._batches())

    def new_cache(self, max_len: int | None = None) -> KVCache:
        """An empty cache for `max_len` positions (default: the context length). It grows as its tokens need, but
        in exact mode on PyTorch's kernels, whose attention takes a fixed width of keys (a static cache)."""
        c = self.config
        static = (
            dict(rows=EXACT_ROWS, width=exact_width(self.context_length), grows=packing(self.module).attention)
            if self.exact
            else {}
        )
        return KVCache(
            c.num_hidden_layers,
            1,
            c.num_key_value_heads,
            max_len or self.context_length,
            c.dim_per_head,
            self.kv_dtype,
            self.device,
            **static,
        )

    def new_batch_cache(
        self, slots: int, max_len: int | None = None, exact: bool | None = None, memory: int | None = None
    ) -> BatchKVCache | SlotCaches:
        """An empty cache for up to `slots` sequences, `max_len` positions each (default: the context length): `exact`
        (default: the model's mode) on verispec's kernels, each sequence's own cache, as `new_cache` makes it (memory
        as its tokens need; a batched forward exact by construction: `SlotCaches`); else one tensor for all of them,
        allocated at once, padded batches attending through PyTorch (`BatchKVCache`), refused where it would take
        more than `memory` bytes."""
        c, max_len = self.config, max_len or self.context_length
        per_position = c.num_hidden_layers * c.num_key_value_heads * c.dim_per_head * 2
        if (self.exact if exact is None else exact) and packing(self.module).attention:
            return SlotCaches(slots, max_len, self.new_cache, per_position * self.kv_dtype.itemsize)
        if memory is not None and slots * max_len * per_position * self.batch_kv_dtype.itemsize > memory:
            raise InvalidArgumentError(
                f"a batch cache of {slots} sequences of {max_len} positions (allocated at once "
                f"outside exact mode) would take more than {memory / 2**20:.0f} MiB; lower "
                f"--max-batch or --max-model-len, or raise --kv-cache-memory"
            )
        return BatchKVCache(
            c.num_hidden_layers, slots, c.num_key_value_heads, max_len, c.dim_per_head, self.batch_kv_dtype, self.device
        )

    @torch.inference_mode()
    def forward_batch(
        self,
        tokens: torch.Tensor,
        cache: BatchKVCache | SlotCaches,
        slots: Sequence[int],
        counts: Sequence[int],
        head: VocabHead | None = None,
        logits: bool = True,
    ) -> torch.Tensor | None:
        """Logits (B, T, vocab) for tokens (B, T), right-padded: row b continues slot slots[b] with its first
        counts[b] tokens, and only those are stored (`head`: over its tokens only, (B, T, N)). Without `logits` (a
        prefill), the LM head does not run and None comes back."""
        return self.execution.forward_batch(tokens, cache.layout(slots, counts, tokens.shape[1]), head, logits)

    @torch.inference_mode()
    def __call__(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        *,
        layers: Sequence[int] | None = None,
        hidden: Sequence[int] | None = None,
        logits_to_keep: int = 0,
        head: VocabHead | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if mask is not None and mask.dtype != torch.bool:  # a float mask's 0 would mean "seen" to SDPA only
            raise InvalidArgumentError(f"an attention mask says True where a token sees another; got {mask.dtype}")
        options = ForwardOptions(
            mask, positions, layers, hidden, ForwardOptions.keeping(logits_to_keep, tokens.shape[1]), head
        )
        return self.execution.forward(tokens, cache, options)

    @torch.inference_mode()
    def greedy_chain(self, tokens: torch.Tensor, cache: KVCache, n: int, among: VocabHead | None = None) -> list[int]:
        """n tokens of greedy decoding after `tokens` (1, T): the argmax after them, then n - 1 more, each the argmax
        after the one before (`among`: of the logits over its tokens only); the cache grows by T + n - 1 (the last
        token is not stored). On verispec's kernels the forwards run as one program (`Execution.chain`)."""
        return self.execution.chain(tokens, cache, n, self.vocab_size, among)

    @torch.inference_mode()
    def vocab_head(self, ids: torch.Tensor) -> VocabHead:
        """An LM head over the tokens `ids` only, for `greedy_chain(..., among=)`: a fraction of the whole head's cost
        (a drafter's reduced vocabulary, as in FR-Spec)."""
        if ids.dim() != 1 or not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise InvalidArgumentError(
                f"a draft vocabulary of {tuple(ids.shape)} token ids, each below {self.vocab_size}"
            )
        return self.module.vocab_head(ids)

    @torch.inference_mode()
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's token embeddings (..., D): what feature-level drafters (EAGLE) pair with its features."""
        return self.module.model.embed(tokens, self.dtype)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """(vocab, D): the LM head that turns a final-normed feature into logits (read by EAGLE and Medusa heads)."""
        return self.module.lm_head.weight


def exact_width(context_length: int) -> int:
    """The keys every row of an exact-mode forward attends over: the context and a chunk's padding, rounded up
    to a multiple of 16 for the kernels' alignment."""
    return -(-(context_length + EXACT_ROWS) // 16) * 16


def load_model(
    checkpoint: str | Path,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = DEFAULT_DTYPE,
    *,
    exact: bool = False,
    fast: bool = True,
    quantize: str | None = None,
    kv_dtype: str | torch.dtype = "auto",
) -> NativeModel:
    """Load a checkpoint folder (config.json, model.safetensors, tokenizer.json) or a GGUF file
    (checkpoints/gguf_checkpoint.py); weights are cast to `dtype` on `device`. `dtype="auto"`, the default (as the
    commands' --dtype), is `auto_dtype`'s: it keeps a GGUF file's own formats where they run
    (`precision.file_formats`: its block-quantized tensors as blocks on verispec's kernels, with float32
    activations; a BF16 file in bfloat16), and for a folder is bfloat16 where verispec's kernels run on `device`,
    else float32; float32 with `quantize` or a float16 cache. `dtype="float32"` for the upcast model.
    `quantize` (q8_0, q4_0, q4_1, q5_0 or q5_1): every projection kept in that block format and the LM head in Q8_0
    (`precision.quantized_at_load`), run on verispec's kernels with float32 activations.
    `exact`: batch-invariant forwards (see `NativeModel`). `fast`: on a CPU in float32 or bfloat16, run the
    projections and the LM head as prepacked, fused matmuls (models/packed.py): verispec's own kernels where
    this machine has them (verispec/kernels; with RMSNorm, rotary and attention too), else PyTorch's laid out for
    the row count of a decoding step (1, or exact mode's 16). It holds packed copies beside the weights (one; two in
    float32 on PyTorch's kernels outside exact mode) and they run in inference mode only: gradients and autocast get
    the plain linears. Elsewhere it changes nothing. `kv_dtype`: what its caches hold (`kv_dtype_of`: by default
    float16 in a sequence's cache beside block-quantized weights, else the activations' dtype)."""
    device = usable_device(device)
    if dtype == "auto":
        dtype = auto_dtype(device, checkpoint, quantize=quantize, kv_dtype=kv_dtype)
    if is_gguf(checkpoint):
        gguf = read_gguf(checkpoint)
        config, tokenizer, eos, name = gguf.config, gguf.vocab.tokenizer, gguf.vocab.eos_ids, Path(checkpoint).name
        torch_dtype, weights, blocks = file_formats(gguf.weights, dtype, device, fast and quantize is None)
    else:
        folder = check_folder(checkpoint)
        config: ModelConfig = read_config(folder)
        tokenizer = load_tokenizer(folder)
        check_tokenizer_fits(tokenizer.get_vocab_size(with_added_tokens=True), config.vocab_size, folder)
        weights, name, blocks = load_weights(folder, config), folder.name, {}
        eos = eos_token_ids(tokenizer, folder, config.eos_token_id)
        torch_dtype = parse_dtype(dtype)
    if quantize is not None and (torch_dtype != torch.float32 or not fast):
        raise InvalidArgumentError(
            f"a model quantized to {quantize} runs with float32 activations on verispec's "
            f"kernels; got {torch_dtype}{'' if fast else ' and fast=False'}"
        )
    if config.tie_word_embeddings and "lm_head" not in blocks:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    with torch.device("meta"):
        module = LlamaForCausalLM(config)
    quantize_linears(module, blocks)
    # Cast one tensor at a time, dropping each original as we go, so loading never holds two full copies.
    state = {key: weights.pop(key).to(device=device, dtype=torch_dtype) for key in list(weights)}
    check_finite(state.items(), checkpoint)
    module.load_state_dict(state, assign=True, strict=True)
    if config.tie_word_embeddings and "lm_head" not in blocks:  # assign=True replaced the shared parameter: tie it
        module.lm_head.weight = module.model.embed_tokens.weight
    module.eval()
    if quantize is not None:
        quantize_linears(module, quantized_at_load(module, quantize))
    if fast and packable(torch_dtype, device):
        module = pack_model(module, EXACT_ROWS if exact else 1)
    return NativeModel(module, tokenizer, eos, name, exact=exact, kv_dtype=kv_dtype)


def load_default(
    device: str | torch.device = "cpu", dtype: str | torch.dtype = DEFAULT_DTYPE, *, exact: bool = False
) -> tuple[NativeModel, NativeModel]:
    """`target, draft = verispec.load_default()`: the shipped pair, in `load_model`'s dtype (by default auto, as the
    commands run it: bfloat16 where verispec's kernels run, else float32; `dtype="float32"` upcasts). `exact` is the
    target's mode (see `NativeModel`); the draft runs ordinarily either way, since the target decides every token."""
    target_dir, draft_dir = default_paths()
    return load_model(target_dir, device, dtype, exact=exact), load_model(draft_dir, device, dtype)

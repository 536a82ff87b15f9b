"""Decode-only steps of a few tokens through the whole layer stack in one native call.

At one token a compiled CPU step spends about as long around its kernels as in them
(the compiled wrapper's Python, an op dispatch per linear and per attention, an OpenMP
region per small fused kernel), and at 64 tokens that serial work still idles the other
threads for a fifth of the step. For decode-only steps the runner hands the embedded
tokens to kernels/cpu/decode_layers.cpp instead, which runs every layer from C++ over the
same weights the compiled model reads (shared, not copied): the GEMVs' copies up to
DECODE_MAX_TOKENS tokens, the compiled model's own prepacked-linear op beyond. It returns
the normed hidden states; the compiled logits take it from there. GGUF-block projections
(`--quantization gguf` or `int8`) take their row-group GEMV at any number of tokens, so
such a model, like one whose every dense projection is a prepacked linear, takes
decode-only steps of any size (the compiled model's quantized linears keep torch's
kernels past DECODE_MAX_TOKENS rows: kernels/cpu/gemv.cpp, q4_1_linear, says why).
It is what CUDA graphs are to a GPU step, and like them it comes with compiling
(--enforce-eager turns both off); PDSERVE_NATIVE_DECODE=0 turns it off alone.

It serves Llama-shaped models: Llama, Mistral, Qwen2, Phi-3 (partial rotary included),
single rank, whose every projection has a decode GEMV (bf16 or fp32 rows, Q4_1 or Q8_0
blocks); other families (Qwen3's q/k norms, Gemma 2's extra norms and soft-capping) and
steps it does not serve take the compiled model. LoRA adapters registered with it
(register_adapter) add their deltas inside it, each row its own (kernels/cpu/lora_deltas.h).

Where a step's rows sample without a grammar (run_tokens), a model that runs its steps in
one parallel region takes the token ids in and each row's next token out of the same
region: the embedding lookup, the packed head's GEMV and the argmax (its share of the
columns on each thread) or the row's draw (temperature, top_k, top_p, min_p, the sampler's
own native passes, at a uniform the sampler drew), after its penalties and held-back stop
tokens, and its logprobs, join the layers, rather than three more calls from Python with a
region each: for greedy rows 0.05-0.14 ms less a token of the bundled model in Q4_1 (of
2.6-3.3), 0.32 ms in bf16 (of 6.9-7.2), on the 2-core Zen 5 EPYC, the two forms taking turns
in one process.
"""
from __future__ import annotations

import logging
import sys
import weakref

import torch

from common.engine.lora.adapter import LoRAAdapter
from common.engine.lora.layers import base_linear
from common.engine.models.attention import AttentionMetadata
from common.engine.models.causal_lm import DECODER_PROJECTIONS, CausalLM
from common.engine.models.layers import RMSNorm
from common.engine.models.llama import LlamaAttention, LlamaDecoderLayer
from common.engine.models.parallel_layers import VocabParallelEmbedding
from common.engine.models.prepacked_linear import PrepackedLinear
from common.engine.models.quantization.int8_linear import Int8Linear
from common.engine.models.quantization.q4_1_linear import Q4_1Linear
from kernels.cpu_attention import dtype_pair, native_attention_serves
from kernels.cpu_decode import (LINEAR_DENSE, LINEAR_PANELS, LINEAR_Q4_1, LINEAR_Q8_0, TokenLogprobs,
                                TokenHistory, TokenSampling, decode_layers,
                                decode_model_head_outputs, decode_model_max_head_tokens,
                                decode_model_max_region_tokens, decode_model_max_tokens,
                                decode_tokens, native_decode_available, native_decode_disabled,
                                register_decode_adapter, register_decode_model, release_decode_adapter,
                                release_decode_model)

logger = logging.getLogger(__name__)


class Unsupported(Exception):
    """Why a model cannot take the native loop."""


def decode_weight(linear: torch.nn.Module) -> tuple[torch.Tensor, int]:
    """What a projection's decode GEMV reads, and how (LINEAR_*)."""
    if isinstance(linear, PrepackedLinear):
        if linear._q8_0_blocks is not None:
            return linear._q8_0_blocks, LINEAR_Q8_0
        if linear._row_major is not None:
            return linear._row_major, LINEAR_DENSE
        if linear._panels is not None:
            return linear._panels, LINEAR_PANELS
    elif isinstance(linear, Q4_1Linear) and linear.uses_kernel and linear.blocks is not None:
        return linear.blocks, LINEAR_Q4_1
    elif isinstance(linear, Int8Linear) and linear.uses_kernel and linear.q8_0_blocks is not None:
        return linear.q8_0_blocks, LINEAR_Q8_0
    raise Unsupported(f"{type(linear).__name__} ({linear.extra_repr()}) has no decode GEMV")


def _check_norm(norm: torch.nn.Module, eps: float) -> torch.Tensor:
    if type(norm) is not RMSNorm or norm.weight_offset != 0.0 or norm.eps != eps:
        raise Unsupported(f"norm {norm!r} is not a plain RMSNorm with the model's eps")
    return norm.weight.detach()


def _token_head(model: CausalLM) -> dict:
    """register_decode_model's embedding and head, where compute_argmax_logits' logits can come
    from the loop: the packed head's GGUF blocks or panels, no soft-capping, the plain
    embedding of one rank's whole vocabulary; {} elsewhere."""
    head, embedding = model.prepacked_head, model.embed_tokens
    if (head is None or model.config.final_logit_softcapping is not None or type(model).embed is not CausalLM.embed
            or type(embedding) is not VocabParallelEmbedding or embedding.tp_size != 1):
        return {}
    try:
        weight, kind = decode_weight(head)
    except Unsupported:
        return {}
    if kind == LINEAR_DENSE:  # the loop's regions take GGUF blocks and column panels, not rows
        return {}
    return dict(embedding=embedding.weight.detach(), head=weight, head_kind=kind,
                head_bias=None if head.bias is None else head.bias.detach(), vocab_size=model.config.vocab_size)


# Each layer's projections as (block, name), in the library's order (register_decode_model's
# weights, register_decode_adapter's matrices).


def _model_tensors(model: CausalLM, num_layers: int | None) -> dict:
    """register_decode_model's arguments for this model's first num_layers layers (None: all);
    raises Unsupported."""
    cfg = model.config
    if not (model.is_first_stage and model.is_last_stage):
        raise Unsupported("pipeline stages")
    if cfg.hidden_act != "silu":
        raise Unsupported(f"activation {cfg.hidden_act}")
    norms, weights, kinds, biases, windows, weight_ids = [], [], [], [], [], []
    for layer in model.layers[:num_layers]:
        attn = layer.self_attn
        if (type(layer).forward is not LlamaDecoderLayer.forward or type(attn).forward is not LlamaAttention.forward
                or type(attn).normalize_qk is not LlamaAttention.normalize_qk):
            raise Unsupported(f"{type(layer).__name__} is not Llama's layer")
        if attn.logit_softcap is not None:
            raise Unsupported("attention logit soft-capping")
        norms += [_check_norm(layer.input_layernorm, cfg.rms_norm_eps),
                  _check_norm(layer.post_attention_layernorm, cfg.rms_norm_eps)]
        for block, name in DECODER_PROJECTIONS:
            # LoRA adapters' deltas the loop adds itself (lora_ids)
            linear = base_linear(getattr(getattr(layer, block), name))
            weight, kind = decode_weight(linear)
            weights.append(weight)
            kinds.append(kind)
            biases.append(None if linear.bias is None else linear.bias.detach())
            # Steps past the GEMVs' rows take the linear's native prepacked op, where it has one.
            weight_ids.append(linear.weight_id if isinstance(linear, PrepackedLinear) and linear.native else -1)
        windows.append(attn.sliding_window or 0)
    attn = model.layers[0].self_attn
    return dict(norms=norms, weights=weights, kinds=kinds, biases=biases, sliding_windows=windows,
                final_norm=_check_norm(model.norm, cfg.rms_norm_eps),
                # The tables are the model's dtype once it is cast; the loop rounds them to it anyway.
                cos=model.rope.cos.float().contiguous(), sin=model.rope.sin.float().contiguous(),
                num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                rms_norm_eps=cfg.rms_norm_eps, attention_scale=attn.scale, weight_ids=weight_ids,
                **_token_head(model))


class NativeDecodeLoop:
    """One model's layers registered with the native loop, and the KV caches it writes."""

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 num_layers: int | None = None, in_regions: bool = True):
        """num_layers: run only the first num_layers layers, then the final norm (an early
        exit, as CausalLM.forward's); None: all of them. in_regions: a model of GGUF blocks
        or column panels runs each step in one parallel region (False: a fork and
        join per projection and attention, as other models)."""
        self.model = model
        self.model_id = register_decode_model(**_model_tensors(model, num_layers), in_regions=in_regions)
        weakref.finalize(self, release_decode_model, self.model_id)
        # Past the GEMVs' rows every linear needs its prepacked op: the library says whether all have one.
        self.max_num_tokens = decode_model_max_tokens(self.model_id)
        # Steps of up to this many tokens run in one parallel region each (0: none do).
        self.max_region_tokens = decode_model_max_region_tokens(self.model_id)
        self.in_regions = self.max_region_tokens > 0
        # Steps of up to this many tokens end in the loop's head (run_tokens); 0: none do.
        self.max_head_tokens = decode_model_max_head_tokens(self.model_id)
        self.head_outputs = decode_model_head_outputs(self.model_id)  # the columns of run_tokens' logits
        self.k_caches = [k for k, _ in kv_caches[:num_layers]]
        self.v_caches = [v for _, v in kv_caches[:num_layers]]
        self.num_steps = 0  # steps run, run_tokens' included
        self.num_token_steps = 0  # steps run_tokens ran

    @classmethod
    def build(cls, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              num_layers: int | None = None, role: str = "decode") -> NativeDecodeLoop | None:
        """The loop for this model (its first num_layers layers: None, all), or None (logged)
        where it does not apply. role names the passes in the log: "decode" for the
        engine's own steps, e.g. "draft" for a proposer's."""
        if native_decode_disabled():
            logger.info("%s steps stay on the model (PDSERVE_NATIVE_DECODE=0)", role)
            return None
        if not native_decode_available():
            return None
        if not all(k.is_contiguous() and v.is_contiguous() for k, v in kv_caches):
            logger.info("%s steps stay on the model: the KV caches are not contiguous", role)
            return None
        try:
            loop = cls(model, kv_caches, num_layers)
        except Unsupported as e:
            logger.info("%s steps stay on the model: %s", role, e)
            return None
        dtype, cache_dtype = model.embed_tokens.weight.dtype, kv_caches[0][0].dtype  # a whole model: it has both
        if not native_attention_serves(dtype, cache_dtype):
            logger.info("%s steps stay on the model: the native attention has no kernel for %s here", role,
                        dtype_pair(dtype, cache_dtype))
            return None
        if loop.in_regions:
            logger.info("%s-only steps run in the native loop (kernels/cpu/decode_layers.cpp), "
                        "one parallel region a step", role)
        elif loop.max_num_tokens == sys.maxsize:
            logger.info("%s-only steps run in the native loop (kernels/cpu/decode_layers.cpp)", role)
        else:
            logger.info("%s steps of up to %d tokens run in the native loop (kernels/cpu/decode_layers.cpp)",
                        role, loop.max_num_tokens)
        return loop

    def register_adapter(self, adapter: LoRAAdapter) -> int:
        """A LoRA adapter's stacked matrices (lora/layers.py) registered for this loop's steps
        that name it (lora_ids), released with the adapter; its id."""
        a, b = [], []
        for layer in range(self.model.start_layer, self.model.start_layer + len(self.k_caches)):
            for _, linear_name in DECODER_PROJECTIONS:
                pair = adapter.stacked.get((layer, linear_name))
                a.append(None if pair is None else pair[0])
                b.append(None if pair is None else pair[1])
        adapter_id = register_decode_adapter(a, b, adapter.scaling)
        weakref.finalize(adapter, release_decode_adapter, adapter_id)
        return adapter_id

    def serves(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Decode-only steps of up to max_num_tokens tokens with the ragged batch built and
        no per-layer KV-connector work."""
        return (1 <= num_tokens <= self.max_num_tokens and meta.num_decode_tokens == num_tokens
                and meta.kv_layer_hook is None and meta.block_tables is not None)

    def serves_tokens(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Steps run_tokens takes: those serves() takes of up to max_head_tokens tokens."""
        return num_tokens <= self.max_head_tokens and self.serves(num_tokens, meta)

    def run_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   num_steps: int = 1, stop_token_ids: list[int] | None = None,
                   sampling: TokenSampling | None = None, logits: torch.Tensor | None = None,
                   logprobs: TokenLogprobs | None = None, history: TokenHistory | None = None,
                   lora_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> each row's next tokens [num_tokens, steps run]
        int64: the argmax of the model's compute_argmax_logits over run()'s hidden states, or
        for a row that draws (sampling: its temperature > 0) the token the sampler's native
        passes draw from compute_logits' logits at the row's uniform; each step's tokens the
        next one's inputs, in one call: num_steps steps (meta's block tables must hold each
        row's blocks through position + num_steps - 1), fewer once every row has taken one of
        stop_token_ids. logits [num_tokens, head_outputs] (the model's dtype; one step): receives
        the head's logits, for the caller to sample rows the loop leaves to it. logprobs: receives
        the logprobs of the rows that report them, as the sampler reports them, each step's.
        history: what each row's tokens so far do to its logits (penalties, stop tokens held
        back), applied before its argmax or draw. lora_ids [num_tokens] int64: each row's
        LoRA adapter (register_adapter's id; -1: none), whose deltas its projections add."""
        stops = torch.tensor(stop_token_ids, dtype=torch.int64) if stop_token_ids else None
        token_ids = decode_tokens(self.model_id, input_ids, positions, self.k_caches, self.v_caches,
                                  meta.slot_mapping, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                  num_steps, stops, sampling, logits, logprobs, history, lora_ids)
        self.num_steps += token_ids.shape[1]
        self.num_token_steps += token_ids.shape[1]
        return token_ids

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            lora_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> normed hidden states [num_tokens, hidden_size];
        lora_ids as run_tokens'."""
        hidden = self.model.embed(input_ids)  # [num_tokens, hidden_size]
        self.num_steps += 1
        return decode_layers(self.model_id, hidden, positions, self.k_caches, self.v_caches, meta.slot_mapping,
                             meta.block_tables, meta.query_start_loc, meta.seq_lens, lora_ids)

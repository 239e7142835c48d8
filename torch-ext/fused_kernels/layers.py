"""Hub layers: forward-only ``nn.Module`` classes that ``kernels.kernelize`` and transformers swap in.

A Hub layer has no constructor and no members of its own: its ``forward`` is bound to the module it
replaces, so it reads that module's state (declared below as bare annotations for documentation).
"""

import sys

import torch
from torch import nn

from . import _checks
from ._rope import apply_rotary_pos_emb
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .rms_norm import rms_norm
from .swiglu import gated_mlp, gelu_and_mul, silu_and_mul


class RMSNorm(nn.Module):
    """Replaces ``LlamaRMSNorm`` and its copies (Qwen2/Qwen3, Mistral, ...): ``transformers`` layer name
    ``RMSNorm``. Statistics in fp32, normalised values cast back to the input dtype before the weight."""

    weight: torch.Tensor
    variance_epsilon: float

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, mode="llama")


class OlmoRMSNorm(nn.Module):
    """Replaces ``Olmo2RMSNorm``/``Olmo3RMSNorm``/``GptOssRMSNorm``, which transformers also names ``RMSNorm`` but
    computes as ``torch.nn.RMSNorm`` does: the weight multiplies in fp32 and the output is cast to the input dtype
    once, at the end (Llama's ``RMSNorm`` rounds before the weight, and promotes to an fp32 weight's dtype)."""

    weight: torch.Tensor
    variance_epsilon: float

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, mode="plain")


class GemmaRMSNorm(nn.Module):
    """Replaces ``GemmaRMSNorm``/``Gemma2RMSNorm``/``Gemma3RMSNorm``: ``(1 + weight)`` scale, fp32 throughout."""

    weight: torch.Tensor
    eps: float

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, mode="gemma")


class SwiGLUMLP(nn.Module):
    """Replaces ``LlamaMLP`` and its copies (Qwen2/Qwen3, Mistral, ...) whose ``act_fn`` is SiLU:
    ``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the gated activation fused (forward and backward); in
    eager mode the activation's output is recomputed in the backward rather than kept (``swiglu.gated_mlp``).
    transformers does not mark these classes kernelizable: see the README for
    ``kernels.replace_kernel_forward_from_hub``."""

    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(x, self.gate_proj, self.up_proj, self.down_proj, "silu")


class GeGLUMLP(nn.Module):
    """Replaces ``GemmaMLP``/``Gemma2MLP``/``Gemma3MLP`` (``act_fn`` = ``gelu_pytorch_tanh``):
    ``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))``, as ``SwiGLUMLP``."""

    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(x, self.gate_proj, self.up_proj, self.down_proj, "gelu_tanh")


class SiluAndMul(nn.Module):
    """``(..., 2I) -> (..., I)``: ``silu(x[..., :I]) * x[..., I:]``, for models with a fused ``gate_up_proj``
    that declare ``@use_kernel_forward_from_hub("SiluAndMul")`` (transformers has no such layer)."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


class GeluAndMul(nn.Module):
    """``(..., 2I) -> (..., I)``: ``gelu(x[..., :I]) * x[..., I:]`` with the exact (erf) GELU."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_and_mul(x, approximate="none")


class GeluTanhAndMul(nn.Module):
    """``(..., 2I) -> (..., I)``: ``gelu(x[..., :I]) * x[..., I:]`` with the tanh approximation of GELU."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_and_mul(x, approximate="tanh")


class ApplyRotaryPosEmb(nn.Module):
    """Replaces transformers' ``apply_rotary_pos_emb`` (the kernelizable function ``rotary_pos_emb`` of Llama,
    Qwen, Mistral and most decoder models): half-split RoPE of q and k in one launch, out of place."""

    can_torch_compile = True
    has_backward = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        # The replaced function's cos broadcasts against q: head_dim columns. A narrower one (where the functional form
        # would rotate the first columns only) is another model's function of the same kernelizable name: gpt-oss's
        # and the OpenAI privacy filter's take each angle once, head_dim / 2 columns, and rotate the whole head,
        # half-split and interleaved respectively, which their inputs cannot tell apart.
        if cos.shape[-1] != q.shape[-1]:
            raise ValueError(f"cos must have head_dim ({q.shape[-1]}) columns, as the apply_rotary_pos_emb this layer "
                             f"replaces takes it; got {cos.shape[-1]} (gpt-oss-style tables, each angle once, are not "
                             f"supported: do not map rotary_pos_emb for such models)")
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


def _causal_lm_output_type(model: nn.Module) -> type:
    """transformers' ``CausalLMOutputWithPast``, taken from the module of the model's class (or of a base class,
    for subclasses): the package itself imports only torch."""
    for cls in type(model).__mro__:
        output_type = getattr(sys.modules.get(cls.__module__), "CausalLMOutputWithPast", None)
        if output_type is not None:
            return output_type
    raise TypeError(f"{type(model).__name__} is not a transformers causal LM (no CausalLMOutputWithPast in the "
                    "modules of its classes)")


def _keep_positions(hidden_states: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """transformers' ``slice_logits_to_keep``: an int keeps the last positions (0: all), a 1-D tensor these positions
    of every sequence, a 2-D integer tensor these positions per sequence, a 2-D bool mask its True positions
    (flattened to ``(kept, hidden)``). Indexing dim 1 with a 2-D tensor would add a dimension instead."""
    if torch.is_tensor(logits_to_keep) and logits_to_keep.ndim == 2:
        if logits_to_keep.dtype == torch.bool:
            return hidden_states[logits_to_keep]
        return torch.take_along_dim(hidden_states, logits_to_keep[..., None], dim=1)
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden_states[:, keep, :]


def _causal_lm_forward(model, low_memory, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                       labels, use_cache, logits_to_keep, kwargs):
    """The forward of the two causal-LM layers below (a Hub layer may hold no helper of its own)."""
    # The stock forward's @can_return_tuple, which the swap bypasses: return_dict (the call's, else the config's) is
    # honoured here, and the decoder always returns its output object, whose fields are read below.
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    outputs = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                          return_dict=True, **kwargs)
    hidden_states = _keep_positions(outputs.last_hidden_state, logits_to_keep)
    softcap = getattr(model.config, "final_logit_softcapping", None)
    loss = logits = None
    # The fused loss reads lm_head's weight itself: only where calling lm_head would do nothing else (plain_linear),
    # so that LoRA adapters, quantised heads and hooks on it take the stock path below instead of being skipped.
    if model.training and labels is not None and _checks.plain_linear(model.lm_head):
        ignore_index = kwargs.get("ignore_index", -100)  # ForCausalLMLoss's keyword, as the stock forward passes it
        shift_labels = kwargs.get("shift_labels")
        if shift_labels is None:
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        num_items = kwargs.get("num_items_in_batch")
        # Flattened, as ForCausalLMLoss flattens logits and labels (kept positions may be a flat (kept, hidden)).
        loss = fused_linear_cross_entropy(hidden_states.flatten(0, -2), model.lm_head.weight,
                                          shift_labels.flatten().to(hidden_states.device), model.lm_head.bias,
                                          ignore_index=ignore_index, reduction="mean" if num_items is None else "sum",
                                          softcap=softcap, low_memory=low_memory)
        if num_items is not None:
            loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    else:
        logits = model.lm_head(hidden_states)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if labels is not None:
            loss = model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size, **kwargs)
    output = _causal_lm_output_type(model)(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                           hidden_states=outputs.hidden_states, attentions=outputs.attentions)
    return output if return_dict else output.to_tuple()


class FusedLinearCrossEntropyForCausalLM(nn.Module):
    """Replaces the forward of a transformers causal LM (the ``...ForCausalLM`` of Llama, Qwen2/Qwen3, Mistral,
    OLMo-2/3 and Gemma/Gemma-2/Gemma-3): in training with ``labels``, the loss comes from
    ``fused_linear_cross_entropy`` over the decoder's final hidden states and ``lm_head``'s weight, so the
    ``(tokens, vocab)`` logits are never built (the output's ``logits`` is None). Otherwise (eval, generation,
    no labels) it computes exactly what the stock forward does.

    transformers registers no layer name for this forward: attach one with
    ``kernels.replace_kernel_forward_from_hub(LlamaForCausalLM, "FusedLinearCrossEntropyForCausalLM")``
    and kernelize (README). The loss follows transformers' ``ForCausalLMLoss``: labels shifted by one (or
    ``shift_labels``), ``ignore_index`` (-100, or the call's ``ignore_index``), the sum divided by
    ``num_items_in_batch`` when given, else the mean; ``config.final_logit_softcapping`` is applied when the config
    has it. The weight is read through ``self.lm_head`` inside the model's own forward, so hooks that gather
    parameters for the model's forward (FSDP on the whole model) have run. An ``lm_head`` that is not a plain
    ``nn.Linear`` without hooks (LoRA on it, a quantised head, hooks of its own or global ones) is called as a
    module instead and the loss computed by the model's ``loss_function``, as the stock forward does (with logits).
    """

    model: nn.Module
    lm_head: nn.Linear
    config: object

    can_torch_compile = True
    has_backward = True

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        return _causal_lm_forward(self, False, input_ids, attention_mask, position_ids, past_key_values,
                                  inputs_embeds, labels, use_cache, logits_to_keep, kwargs)


class LowMemoryFusedLinearCrossEntropyForCausalLM(nn.Module):
    """``FusedLinearCrossEntropyForCausalLM`` with ``fused_linear_cross_entropy(..., low_memory=True)``: about a
    third more LM-head GEMM work, and no fp32 ``(vocab, hidden)`` weight-gradient sum (README). Map the model's
    ``FusedLinearCrossEntropyForCausalLM`` layer name to this layer to use it."""

    model: nn.Module
    lm_head: nn.Linear
    config: object

    can_torch_compile = True
    has_backward = True

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        return _causal_lm_forward(self, True, input_ids, attention_mask, position_ids, past_key_values,
                                  inputs_embeds, labels, use_cache, logits_to_keep, kwargs)

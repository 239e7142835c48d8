"""The classes each Hub layer replaces: transformers classes, or, for a layer no transformers class
corresponds to, the reference module in `reference_layers.py` that defines its contract.

`check` runs kernels' own layer validation (`kernels.layer.layer._validate_layer`, the rules `kernelize`
applies: no `__init__`, no extra members, same forward arity and parameter kinds) for every class of the
built package's `layers` module against every class listed here, and checks that each attribute the layer
declares as a bare annotation (the state its forward reads from the replaced module, e.g. `weight`,
`variance_epsilon`) exists on an instance of that class. A layer class missing from this table is an
error, so a new layer cannot ship unchecked: add its entry when you add the layer.

A kernelizable *function* (transformers' `apply_rotary_pos_emb`, layer name `rotary_pos_emb`) is listed by
its module path too: `use_kernel_forward_from_hub` turns it into an instance of a generated `nn.Module`
class whose forward has the function's signature plus `self`, and kernelize validates a Hub layer against
that class, so `check` does the same.
"""

_CAUSAL_LMS = (
    "transformers.models.llama.modeling_llama.LlamaForCausalLM",
    "transformers.models.qwen2.modeling_qwen2.Qwen2ForCausalLM",
    "transformers.models.qwen3.modeling_qwen3.Qwen3ForCausalLM",
    "transformers.models.mistral.modeling_mistral.MistralForCausalLM",
    "transformers.models.olmo2.modeling_olmo2.Olmo2ForCausalLM",
    "transformers.models.olmo3.modeling_olmo3.Olmo3ForCausalLM",
    "transformers.models.gemma.modeling_gemma.GemmaForCausalLM",
    "transformers.models.gemma2.modeling_gemma2.Gemma2ForCausalLM",
    "transformers.models.gemma3.modeling_gemma3.Gemma3ForCausalLM",
)

LAYER_TABLE: dict[str, tuple[str, ...]] = {
    "RMSNorm": (
        "transformers.models.llama.modeling_llama.LlamaRMSNorm",
        "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm",
        "transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm",
        "transformers.models.mistral.modeling_mistral.MistralRMSNorm",
    ),
    "OlmoRMSNorm": (
        "transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm",
        "transformers.models.olmo3.modeling_olmo3.Olmo3RMSNorm",
        "transformers.models.gpt_oss.modeling_gpt_oss.GptOssRMSNorm",
    ),
    "GemmaRMSNorm": (
        "transformers.models.gemma.modeling_gemma.GemmaRMSNorm",
        "transformers.models.gemma2.modeling_gemma2.Gemma2RMSNorm",
        "transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm",
    ),
    "SwiGLUMLP": (
        "transformers.models.llama.modeling_llama.LlamaMLP",
        "transformers.models.qwen2.modeling_qwen2.Qwen2MLP",
        "transformers.models.qwen3.modeling_qwen3.Qwen3MLP",
        "transformers.models.mistral.modeling_mistral.MistralMLP",
        "transformers.models.olmo2.modeling_olmo2.Olmo2MLP",
        "transformers.models.olmo3.modeling_olmo3.Olmo3MLP",
    ),
    "GeGLUMLP": (
        "transformers.models.gemma.modeling_gemma.GemmaMLP",
        "transformers.models.gemma2.modeling_gemma2.Gemma2MLP",
        "transformers.models.gemma3.modeling_gemma3.Gemma3MLP",
    ),
    "SiluAndMul": ("fused_kernels_tools.reference_layers.SiluAndMul",),
    "GeluAndMul": ("fused_kernels_tools.reference_layers.GeluAndMul",),
    "GeluTanhAndMul": ("fused_kernels_tools.reference_layers.GeluTanhAndMul",),
    "ApplyRotaryPosEmb": (
        "transformers.models.llama.modeling_llama.apply_rotary_pos_emb",
        "transformers.models.qwen2.modeling_qwen2.apply_rotary_pos_emb",
        "transformers.models.qwen3.modeling_qwen3.apply_rotary_pos_emb",
        "transformers.models.mistral.modeling_mistral.apply_rotary_pos_emb",
        "transformers.models.olmo2.modeling_olmo2.apply_rotary_pos_emb",
        "transformers.models.olmo3.modeling_olmo3.apply_rotary_pos_emb",
        "transformers.models.gemma.modeling_gemma.apply_rotary_pos_emb",
        "transformers.models.gemma2.modeling_gemma2.apply_rotary_pos_emb",
        "transformers.models.gemma3.modeling_gemma3.apply_rotary_pos_emb",
    ),
    "FusedLinearCrossEntropyForCausalLM": _CAUSAL_LMS,
    "LowMemoryFusedLinearCrossEntropyForCausalLM": _CAUSAL_LMS,
}

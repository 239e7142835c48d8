"""The transformers classes each Hub layer replaces.

`check` runs kernels' own layer validation (`kernels.layer.layer._validate_layer`, the rules `kernelize`
applies: no `__init__`, no extra members, same forward arity and parameter kinds) for every class of the
built package's `layers` module against every class listed here, and checks that each attribute the layer
declares as a bare annotation (the state its forward reads from the replaced module, e.g. `weight`,
`variance_epsilon`) exists on an instance of that class. A layer class missing from this table is an
error, so a new layer cannot ship unchecked: add its entry when you add the layer.
"""

LAYER_TABLE: dict[str, tuple[str, ...]] = {
    "RMSNorm": (
        "transformers.models.llama.modeling_llama.LlamaRMSNorm",
        "transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm",
        "transformers.models.mistral.modeling_mistral.MistralRMSNorm",
    ),
    "GemmaRMSNorm": (
        "transformers.models.gemma.modeling_gemma.GemmaRMSNorm",
        "transformers.models.gemma2.modeling_gemma2.Gemma2RMSNorm",
        "transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm",
    ),
    "FusedLinearCrossEntropyForCausalLM": (
        "transformers.models.llama.modeling_llama.LlamaForCausalLM",
        "transformers.models.qwen2.modeling_qwen2.Qwen2ForCausalLM",
        "transformers.models.qwen3.modeling_qwen3.Qwen3ForCausalLM",
        "transformers.models.mistral.modeling_mistral.MistralForCausalLM",
    ),
}

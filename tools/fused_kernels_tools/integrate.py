"""Every kernel of myorg/fused-kernels in a stock transformers causal LM, through kernels' and transformers' own
mechanisms only (no transformers function or attribute is patched by hand).

This is the README's copy-paste helper (section "Every kernel in one call"); keep the two copies identical.
It lives here, not in the kernel package, because the package's public API is versioned per release.
"""

from kernels import (
    KernelizeFallback,
    LayerRepository,
    Mode,
    kernelize,
    replace_kernel_forward_from_hub,
    use_kernel_mapping,
)


# The layer that reproduces each supported model type's norms, which transformers names "RMSNorm" (Gemma's get that
# name below: transformers 5.22 gives them none). Other types are refused rather than guessed: one may compute
# differently under the same names (Granite scales its logits; OLMo's norms multiply the weight in fp32, Llama's
# round before it).
NORM_LAYERS = {"llama": "RMSNorm", "qwen2": "RMSNorm", "qwen3": "RMSNorm", "mistral": "RMSNorm",
               "olmo2": "OlmoRMSNorm", "olmo3": "OlmoRMSNorm",
               "gemma": "GemmaRMSNorm", "gemma2": "GemmaRMSNorm", "gemma3_text": "GemmaRMSNorm"}


def use_fused_kernels(model, repo_id="myorg/fused-kernels", revision="v2", low_memory_loss=False,
                      attention=True):
    """Swap RMSNorm, RoPE, the gated MLP, the causal-LM loss and attention of a Llama, Qwen2/Qwen3, Mistral,
    OLMo-2/3 or Gemma/Gemma-2/Gemma-3 model (on its current device: CUDA, or CPU with the torch-cpu variant) for the
    Hub layers of `repo_id` at `revision`. Loads from the Hub, or from a local build through LOCAL_KERNELS.
    `low_memory_loss`: the loss uses fused linear cross-entropy's low-memory algorithm (more compute, no fp32
    weight-gradient buffer). `attention=False` keeps the model's own attention implementation (e.g. SDPA, whose
    cuDNN backend PyTorch prefers on Hopper; a float32 model without autocast needs it: flash attention takes
    float16/bfloat16 q, k and v). Returns the model."""
    config = model.config
    norm = NORM_LAYERS.get(config.model_type)
    if norm is None:
        raise ValueError(f"{type(model).__name__}: model type {config.model_type!r} is not one whose modules the "
                         f"layers are checked against ({', '.join(NORM_LAYERS)})")
    gemma = norm == "GemmaRMSNorm"
    # Gemma-2/3 configs name the MLP's activation hidden_activation; Gemma (1), like Llama, hidden_act.
    activation = getattr(config, "hidden_activation", None) or config.hidden_act
    if activation not in (("gelu_pytorch_tanh",) if gemma else ("silu", "swish")):
        raise ValueError(f"{type(model).__name__}: no fused MLP layer for the activation {activation!r}")
    # Gemma's norms scale by (1 + weight) in fp32 and its MLPs gate with the tanh GELU.
    mlp = "GeGLUMLP" if gemma else "SwiGLUMLP"
    loss = "LowMemoryFusedLinearCrossEntropyForCausalLM" if low_memory_loss else "FusedLinearCrossEntropyForCausalLM"
    layers = {"RMSNorm": norm, "rotary_pos_emb": "ApplyRotaryPosEmb", mlp: mlp,
              "FusedLinearCrossEntropyForCausalLM": loss}  # model's name: our layer

    # transformers declares "RMSNorm" (except on Gemma/Gemma-2/Gemma-3's norms) and "rotary_pos_emb" itself; those
    # norms, the MLP and the causal-LM forward get layer names here. This sets class attributes (kernel_layer_name),
    # which only matter to kernelize: models of these classes keep their forwards until they are kernelized.
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and getattr(module, "kernel_layer_name", None) is None:
            replace_kernel_forward_from_hub(type(module), "RMSNorm")
    replace_kernel_forward_from_hub(type(model.model.layers[0].mlp), mlp)
    replace_kernel_forward_from_hub(type(model), "FusedLinearCrossEntropyForCausalLM")

    # kernels' device names are torch's ("cuda", "cpu"); transformers' KernelConfig would refuse "cpu".
    device = model.device.type
    mapping = {name: {device: LayerRepository(repo_id, layer_name=layer, revision=revision, trust_remote_code=True)}
               for name, layer in layers.items()}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        # NO_LAYER: modules nobody maps (transformers' activation layers) keep their forward; a mapped layer that
        # fails to load or validate raises instead of silently leaving the stock forward in place.
        model = kernelize(model, mode=Mode.TRAINING if model.training else Mode.INFERENCE, device=device,
                          use_fallback=KernelizeFallback.NO_LAYER)
    if attention:
        model.set_attn_implementation(f"{repo_id}@{revision}", allow_all_kernels=True)
    return model

"""The Hub layers swapped into a tiny Llama-style model with `kernels.kernelize` match the unpatched model.

On a CPU machine the layers come from the `torch-cpu` variant (as users on CPU get them) and from the
`torch-cuda` variant under the Triton interpreter; on a GPU, from the variant `kernels` selects.
"""

import copy

import pytest
import torch
from kernels import KernelizeFallback, LocalLayerRepository, Mode, kernelize, use_kernel_mapping
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import DEVICE, ON_GPU
from model_helpers import VARIANTS, assert_same_step, loss_and_grads, variant_paths


def tiny_llama(dtype):
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-5, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=DEVICE, dtype=dtype)
    # Non-trivial norm weights, so a layer that ignored them would be caught.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernelize_tiny_llama_matches_unpatched(build_dir, variant):
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    reference = tiny_llama(dtype).train()
    patched = copy.deepcopy(reference)
    mapping = {"RMSNorm": {DEVICE.type: LocalLayerRepository(variant_paths(build_dir)[variant], layer_name="RMSNorm")}}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        # Layers we do not map (rotary_pos_emb) keep their forward; everything else must load.
        patched = kernelize(patched, mode=Mode.TRAINING, device=DEVICE.type, use_fallback=KernelizeFallback.NO_LAYER)

    norms = [m for m in patched.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert norms and all(m.forward.__func__.__module__.endswith(".layers") for m in norms), \
        "kernelize did not swap in the Hub layer"

    input_ids = torch.randint(0, 128, (2, 16), device=DEVICE)
    ref_logits, ref_grads = loss_and_grads(reference, input_ids)
    logits, grads = loss_and_grads(patched, input_ids)
    assert_same_step(logits, grads, ref_logits, ref_grads, dtype)


@pytest.mark.skipif(not ON_GPU, reason="transformers' KernelConfig supports only accelerator devices (not cpu)")
def test_transformers_kernel_config_swaps_rms_norm(build_dir, monkeypatch):
    """The user path: `KernelConfig({"RMSNorm": ("myorg/fused-kernels:RMSNorm", {"revision": ...})})`, resolved
    offline through LOCAL_KERNELS, gives the unpatched model's outputs and gradients."""
    from transformers import KernelConfig

    monkeypatch.setenv("LOCAL_KERNELS", f"myorg/fused-kernels={build_dir}")
    reference = tiny_llama(torch.bfloat16).train()
    patched = copy.deepcopy(reference)
    config = KernelConfig({"RMSNorm": ("myorg/fused-kernels:RMSNorm", {"revision": "v1", "trust_remote_code": True})},
                          inherit_mapping=False)
    patched.set_use_kernels(True, config)
    norms = [m for m in patched.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert norms and all(m.forward.__func__.__module__.endswith(".layers") for m in norms)

    input_ids = torch.randint(0, 128, (2, 16), device=DEVICE)
    ref_logits, ref_grads = loss_and_grads(reference, input_ids)
    logits, grads = loss_and_grads(patched, input_ids)
    torch.testing.assert_close(logits, ref_logits, rtol=2e-2, atol=2e-2)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=2e-2, atol=2e-2, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------------------------------------
# rotary_pos_emb: a kernelizable *function*. transformers turns `apply_rotary_pos_emb` into one module-level
# instance per model file and kernelize rebinds that instance's forward, so the swap is process-wide for that
# model type: the fixture below puts the original back after each test.
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture
def restore_llama_rotary():
    from transformers.models.llama import modeling_llama

    yield modeling_llama.apply_rotary_pos_emb
    vars(modeling_llama.apply_rotary_pos_emb).pop("forward", None)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernelize_rotary_pos_emb_matches_unpatched(build_dir, variant, restore_llama_rotary):
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    reference = tiny_llama(dtype).train()
    input_ids = torch.randint(0, 128, (2, 16), device=DEVICE)
    ref_logits, ref_grads = loss_and_grads(reference, input_ids)  # before the process-wide swap

    # A fresh model, not a deepcopy: a copy's `_kernel_funcs` would hold a copy of the function module, which
    # the attention's forward (calling the module-level function) never uses.
    patched = tiny_llama(dtype).train()
    layer = LocalLayerRepository(variant_paths(build_dir)[variant], layer_name="ApplyRotaryPosEmb")
    with use_kernel_mapping({"rotary_pos_emb": {DEVICE.type: layer}}, inherit_mapping=False):
        patched = kernelize(patched, mode=Mode.TRAINING, device=DEVICE.type, use_fallback=KernelizeFallback.NO_LAYER)
    rotary = restore_llama_rotary
    assert rotary.forward.__func__.__module__.endswith(".layers"), "kernelize did not swap in the Hub layer"
    assert all(rotary in m._kernel_funcs.values() for m in patched.modules()
               if type(m).__name__ == "LlamaAttention")

    logits, grads = loss_and_grads(patched, input_ids)
    assert_same_step(logits, grads, ref_logits, ref_grads, dtype)


@pytest.mark.skipif(not ON_GPU, reason="transformers' KernelConfig supports only accelerator devices (not cpu)")
def test_transformers_kernel_config_swaps_rotary_pos_emb(build_dir, monkeypatch, restore_llama_rotary):
    """`KernelConfig({"rotary_pos_emb": ("myorg/fused-kernels:ApplyRotaryPosEmb", {"revision": ...})})`."""
    from transformers import KernelConfig

    monkeypatch.setenv("LOCAL_KERNELS", f"myorg/fused-kernels={build_dir}")
    reference = tiny_llama(torch.bfloat16).train()
    input_ids = torch.randint(0, 128, (2, 16), device=DEVICE)
    ref_logits, ref_grads = loss_and_grads(reference, input_ids)

    patched = tiny_llama(torch.bfloat16).train()
    config = KernelConfig({"rotary_pos_emb": ("myorg/fused-kernels:ApplyRotaryPosEmb",
                                              {"revision": "v1", "trust_remote_code": True})}, inherit_mapping=False)
    patched.set_use_kernels(True, config)
    assert restore_llama_rotary.forward.__func__.__module__.endswith(".layers")

    logits, grads = loss_and_grads(patched, input_ids)
    torch.testing.assert_close(logits, ref_logits, rtol=2e-2, atol=2e-2)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=2e-2, atol=2e-2, msg=lambda m: f"{name}: {m}")

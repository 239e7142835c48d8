"""transformers loads our flash attention as a Hub attention kernel (`attn_implementation="myorg/fused-kernels@v2"`,
offline through LOCAL_KERNELS) and trains tiny random-init models with it: logits, loss and gradients match the
same model on transformers' own attention (`sdpa`; `eager` for Gemma-2) within bf16 tolerance, through every path transformers takes (dense batch, padding mask
unpadded to varlen, packed sequences from restarting position_ids), with GQA, a sliding window and soft-capping.

On CPU `kernels` selects the torch-cpu variant (the portable implementation); on a GPU, the arch variant with
the Triton kernels.
"""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import DEVICE

REPO = "myorg/fused-kernels"
IMPLEMENTATION = f"{REPO}@v2"

CONFIGS = {
    # GQA (4 q heads, 2 kv heads), head_dim 16.
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128),
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=128),
    # A sliding window shorter than the sequences, so the window really masks.
    "mistral": dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128, sliding_window=6),
    # Soft-capped attention logits (Gemma-2).
    "gemma2": dict(model_type="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                   attn_logit_softcapping=5.0, sliding_window=6, query_pre_attn_scalar=16),
}


# transformers' own attention for each family: Gemma-2 has no sdpa path (soft-capping), so it runs eager.
REFERENCE_IMPLEMENTATION = {"gemma2": "eager"}


def build_pair(name):
    """Two identical bf16 models: one on transformers' own attention, one on our kernel."""
    settings = dict(CONFIGS[name])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(0)
    implementation = REFERENCE_IMPLEMENTATION.get(name, "sdpa")
    reference = AutoModelForCausalLM.from_config(config, attn_implementation=implementation, dtype=torch.bfloat16)
    ours = AutoModelForCausalLM.from_config(config, attn_implementation=implementation, dtype=torch.bfloat16)
    ours.load_state_dict(reference.state_dict())
    ours.set_attn_implementation(IMPLEMENTATION, allow_all_kernels=True)
    return reference.to(DEVICE), ours.to(DEVICE)


def batch_inputs(kind):
    generator = torch.Generator().manual_seed(1)
    if kind == "dense":
        ids = torch.randint(0, 128, (2, 13), generator=generator)
        return {"input_ids": ids, "labels": ids}
    if kind == "padding":
        ids = torch.randint(0, 128, (3, 11), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, :4] = 0  # left padding
        mask[2, 7:] = 0  # right padding
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    # packed: three documents in one row, positions restarting at each
    ids = torch.randint(0, 128, (1, 17), generator=generator)
    positions = torch.tensor([list(range(5)) + list(range(8)) + list(range(4))])
    return {"input_ids": ids, "position_ids": positions, "labels": ids}


def run(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**{k: v.to(DEVICE) for k, v in inputs.items()})
    out.loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.float().detach(), out.loss.float().detach(), grads


def _close(name, ours, ref, tolerance):
    scale = ref.abs().max().item() or 1.0
    error = (ours - ref).abs().max().item() / scale
    assert error <= tolerance, f"{name}: max error {error:.3e} of the max magnitude, allowed {tolerance}"


@pytest.mark.parametrize("kind", ["dense", "padding", "packed"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_attn_implementation_matches_transformers_attention(build_dir, monkeypatch, name, kind):
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO}={build_dir}")
    reference, ours = build_pair(name)
    assert ours.config._attn_implementation == IMPLEMENTATION
    inputs = batch_inputs(kind)
    if kind == "padding":
        # sdpa computes the padded rows too; compare only the real tokens.
        keep = inputs["attention_mask"].bool()
    else:
        keep = torch.ones(inputs["input_ids"].shape, dtype=torch.bool)
    ref_logits, ref_loss, ref_grads = run(reference, inputs)
    logits, loss, grads = run(ours, inputs)
    keep = keep.to(DEVICE)
    _close("logits", logits[keep], ref_logits[keep], 3e-2)
    assert abs(loss.item() - ref_loss.item()) <= 2e-2 * abs(ref_loss.item()), (loss.item(), ref_loss.item())
    assert grads.keys() == ref_grads.keys()
    for param, grad in grads.items():
        _close(f"grad {param}", grad, ref_grads[param], 6e-2)

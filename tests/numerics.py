"""Error measures for the numerical tests.

The rule: compare against an independent float64 reference, and require our relative error to stay within
``k`` times the error of the same computation done by PyTorch eager in the input dtype (the module we
replace), plus a small floor for float32 where both errors sit at rounding level.
"""

import torch

# Floors for the relative error (||out - ref|| / ||ref||): a few units of the dtype's rounding.
ERROR_FLOOR = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def rel_err(out: torch.Tensor, ref: torch.Tensor, scale: float = 0.0) -> float:
    """||out - ref|| / max(||ref||, scale). ``scale`` is the magnitude of the terms that cancel when ``ref``
    is a difference of large terms (e.g. the RMSNorm input gradient), so rounding there is judged against
    the size of what was rounded."""
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "non-finite values in the output (an unwritten or poisoned element?)"
    denom = max(ref.norm().item(), scale)
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def assert_close_ratio(name: str, ours: torch.Tensor, baseline: torch.Tensor, ref: torch.Tensor, k: float,
                       dtype: torch.dtype, scale: float = 0.0):
    """``rel_err(ours) <= k * rel_err(baseline) + floor`` with a message that shows both errors."""
    ours_err, base_err = rel_err(ours, ref, scale), rel_err(baseline, ref, scale)
    floor = ERROR_FLOOR[dtype]
    assert ours_err <= k * base_err + floor, (
        f"{name}: relative error {ours_err:.3e} exceeds {k} x PyTorch's {base_err:.3e} + {floor:.0e} ({dtype})")

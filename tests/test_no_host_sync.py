"""No op makes the host wait for the GPU: under DDP and FSDP2 a host synchronisation inside a layer stalls the
rank's CPU until its queued kernels drain, so the next collective and kernels launch late on every rank.

On the GPU each op's forward and backward (after a warm-up call that compiles its kernels) runs under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising CUDA call (a device-to-host copy
such as ``.item()``, a pageable host-to-device copy, a stream or device synchronisation). The one documented
exception is FlashAttention-2's API taking ``max_seqlen`` as a 0-d tensor; the varlen case passes ints here.
"""

import pytest
import torch

from conftest import ON_GPU
from op_cases import CASE_NAMES, forward_backward, op_cases

pytestmark = pytest.mark.skipif(not ON_GPU, reason="CUDA's sync debug mode needs a GPU")


@pytest.mark.parametrize("name", CASE_NAMES)
def test_forward_and_backward_never_synchronise(fk, name):
    run, _ = op_cases(fk)[name]
    forward_backward(run)  # compiles and caches the kernels, outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward_backward(run)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_the_check_catches_a_synchronisation():
    """The debug mode really raises here (so the test above can fail)."""
    value = torch.ones((), device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            value.item()
    finally:
        torch.cuda.set_sync_debug_mode("default")

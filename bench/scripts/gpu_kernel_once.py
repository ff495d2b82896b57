"""One pass of the GPU bitmask kernel against the torch path in float32, bfloat16 and float16, rows rescued: the
program gpu_device_check.sh runs under compute-sanitizer (a check on a CUDA machine, not a test of `make test`)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from serving_image.constraints import gpu  # noqa: E402
from serving_image.constraints.engine import apply_bitmask_torch  # noqa: E402
from tests.native.test_gpu_kernel import _bits, _case  # noqa: E402


def main() -> None:
    applier = gpu.GpuMaskApplier(torch.cuda.current_device())
    for dtype in ("float32", "bfloat16", "float16"):
        for seed in range(2):
            logits, bitmask, logit_rows, mask_rows = _case(seed, dtype, n_logit_rows=9, ncols=130_000)
            expected = logits.clone()
            apply_bitmask_torch(expected, bitmask, logit_rows, mask_rows)
            on_device = logits.cuda()
            applier.apply(on_device, bitmask.numpy(), logit_rows, mask_rows)
            torch.cuda.synchronize()
            np.testing.assert_array_equal(_bits(on_device.cpu(), dtype), _bits(expected, dtype))
    print(f"the kernel equals the torch path in float32, bfloat16 and float16; rows rescued: {applier.rescued()}")
    applier.close()


if __name__ == "__main__":
    main()

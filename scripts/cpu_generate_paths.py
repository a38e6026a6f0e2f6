#!/usr/bin/env python3
"""CPU: per-token cost of ``generate`` on the reference step against the fused decoder's torch path.

Random-weight ``tiny`` / ``small`` presets, 64-token prompt, 32 new tokens, one thread, process CPU time
(steadier than wall time on a shared machine), median of 7 (docs/benchmarks.md).
"""

import statistics
import time

import torch

import elastic_ssm as es
from elastic_ssm.models.essh import randomize_selective


def per_token_ms(model, x: torch.Tensor, fast: bool) -> float:
    model.generate(x, 2, fast=fast)
    t = time.process_time()
    model.generate(x, 33, fast=fast)
    whole = time.process_time() - t
    t = time.process_time()
    model.generate(x, 1, fast=fast)
    return (whole - (time.process_time() - t)) / 32 * 1e3


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    for preset in ("tiny", "small"):
        model = randomize_selective(es.ESSH(es.ESSHConfig.preset(preset)).eval(), ffn_out_std=0.1)
        x = torch.randint(0, 256, (1, 64))
        times = {"reference": [], "fused-torch": []}
        for _ in range(7):
            times["reference"].append(per_token_ms(model, x, False))
            times["fused-torch"].append(per_token_ms(model, x, True))
        print(preset, {k: f"{statistics.median(v):.3f} ms/token" for k, v in times.items()}, flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""CPU: per-token cost of generate on the reference step vs the fused decoder's torch path (process CPU time).

Random-weight tiny / small presets, 64-token prompt, 32 new tokens, one thread, median of 7 (docs/benchmarks.md)."""
import statistics
import time

import torch

import elastic_ssm as es
from elastic_ssm.models.essh import randomize_selective

torch.manual_seed(0)
torch.set_num_threads(1)
for preset in ("tiny", "small"):
    m = randomize_selective(es.ESSH(es.ESSHConfig.preset(preset)).eval(), ffn_out_std=0.1)
    x = torch.randint(0, 256, (1, 64))
    res = {False: [], True: []}
    for rep in range(7):
        for fast in (False, True):
            m.generate(x, 2, fast=fast)
            t = time.process_time(); m.generate(x, 33, fast=fast); a = time.process_time() - t
            t = time.process_time(); m.generate(x, 1, fast=fast); b = time.process_time() - t
            res[fast].append((a - b) / 32 * 1e3)
    print(preset, {("fused-torch" if k else "reference"): f"{statistics.median(v):.3f} ms/token (CPU time)" for k, v in res.items()}, flush=True)

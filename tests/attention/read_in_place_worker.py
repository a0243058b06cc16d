"""Runs the Triton backend on read_in_place_cases in the Triton interpreter and prints one JSON line
per case: the largest difference between the two-pool step and the same step over one pool, and
between the two-pool step and the torch reference (plain torch, one pool). Started in a subprocess
by test_read_in_place.py, so TRITON_INTERPRET=1 is set before triton is imported.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402

import torch  # noqa: E402

from read_in_place_cases import build, run  # noqa: E402
from cuttle.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from cuttle.attention.triton_backend import TritonAttentionBackend  # noqa: E402

for segmented in (False, True):
    for split_len in (512, 16):  # 16: decode rows split over their keys (flash-decoding)
        split, joined = build(torch.float32, segmented)
        o_s, l_s = run(TritonAttentionBackend(split_len=split_len, block_n=16), split)
        split2, joined2 = build(torch.float32, segmented)
        o_j, l_j = run(TritonAttentionBackend(split_len=split_len, block_n=16), joined2)
        _, joined3 = build(torch.float32, segmented)
        o_r, l_r = run(TorchAttentionBackend(native=False), joined3)
        print(json.dumps({
            "segmented": segmented, "split_len": split_len,
            "vs_one_pool": (o_s - o_j).abs().max().item(), "lse_vs_one_pool": (l_s - l_j).abs().max().item(),
            "vs_torch": (o_s - o_r).abs().max().item(), "lse_vs_torch": (l_s - l_r).abs().max().item(),
            "finite": bool(torch.isfinite(o_s).all()),
        }))

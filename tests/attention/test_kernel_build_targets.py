"""The kernel library builds for CPUs other than this one, and every function the Python bindings
declare exists in each build. A function defined only inside an ISA-specific block (AVX512-BF16,
GFNI) left the AVX2 build without it once: declaring the MXFP8 bindings then failed on such CPUs,
and every MXFP8 kernel with them."""
from __future__ import annotations

import glob
import os
import platform
import shutil
import subprocess

import pytest

from cuttle.attention.native import build
from cuttle.attention.native import moe as native_moe
from cuttle.attention.native import mxfp8 as native_mx

# -march targets: no AVX (baseline), AVX2 without AVX512 (Zen 2/3), AVX512 without BF16 (Ice
# Lake: VBMI and GFNI), everything (Sapphire Rapids)
TARGETS = ("x86-64-v2", "znver3", "icelake-server", "sapphirerapids")
# kernels bound outside the signature tables
OTHER = ("paged_attention_rows", "nsa_decode_rows", "topk_decode_rows", "sparse_attend_fast_available",
         "sparse_attend_set_fast_path")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the -march targets here are x86 ones")
@pytest.mark.parametrize("march", TARGETS)
def test_every_declared_kernel_exists_in_each_build(tmp_path, march: str) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    assert cc is not None, "no C compiler on PATH"
    out = str(tmp_path / f"kernels-{march}.so")
    sources = sorted(glob.glob(os.path.join(build.SRC_DIR, "*.c")))
    # -O0: only the symbols are checked here (the native build's kernels are tested elsewhere)
    r = subprocess.run([cc, "-O0", f"-march={march}", "-fopenmp", "-shared", "-fPIC", "-std=c11", *sources, "-o", out, "-lm"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    # the exported symbols read from the file, not by loading it: a build for a wider CPU than this
    # one runs its constructors' AVX512 code at load (SIGILL on an AVX2-only EPYC, seen)
    nm = shutil.which("nm")
    assert nm is not None, "no nm on PATH (binutils, installed beside the C compiler)"
    listing = subprocess.run([nm, "-D", "--defined-only", out], capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in listing.splitlines() if line.strip()}
    names = [*build.SIGNATURES, *native_mx._SIGNATURES, *native_moe._SIGNATURES, *OTHER]
    missing = [n for n in names if n not in exported]
    assert not missing, f"-march={march} build lacks {missing}"

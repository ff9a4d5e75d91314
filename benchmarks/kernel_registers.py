"""Registers and spills of the fast-step split kernel, compiled without a GPU.

Compiles ``_fast_decode_split`` (kernels/fast_decode.py, which imports torch) for an sm_90a target
with the Triton on ``sys.path``, with the divisibility hints the engine's launches get (16-byte
aligned pointers; strides divisible by 16, the log-sum-exp's split stride only where the split
count is), and assembles the PTX with the ``ptxas`` bundled with that Triton (``ptxas -v``). One
shape: bf16, 32 query / 8 KV heads, head size 128, 16-token pages, 32-key tiles, 4 warps, the
engine's slot map and query staging on, no wide tiles. One line per variant: with or without
per-row split counts (``row_splits``, balanced splits) and score frames (``scores``). A program's registers set how many
programs an SM holds (65,536 registers, 128 threads a program at 4 warps), which set a launch's
speed (benchmarks/results/balanced-splits-kernel-h100.md). ``--ptx-dir`` keeps each variant's PTX,
to compare two versions of the kernel instruction by instruction.

Use the device's Triton for figures that match the device (vLLM 0.26's is 3.6.0):

    pip install --target /tmp/triton36 --no-deps triton==3.6.0
    PYTHONPATH=/tmp/triton36 python benchmarks/kernel_registers.py [--splits 16] [--ptx-dir DIR]
"""
import argparse
import importlib.util
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

KERNEL = Path(__file__).resolve().parent.parent / "kernels" / "fast_decode.py"
BF16 = {"Q", "CK", "CV", "KC", "VC", "STAGE"}
FP32 = {"ACC", "LSE", "LOGITS", "NORMS"}


def split_kernel():
    spec = importlib.util.spec_from_file_location("fast_decode_for_registers", KERNEL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._fast_decode_split


def compile_variant(fn, constants: dict, ptx_path: Path) -> str:
    """``ptxas -v``'s register and spill lines for one variant (``constants``: its constexprs)."""
    names = fn.arg_names
    sig = {}
    for n in names:
        if n in constants:
            sig[n] = "constexpr"
        elif n in BF16:
            sig[n] = "*bf16"
        elif n in FP32:
            sig[n] = "*fp32"
        elif n == "scale":
            sig[n] = "fp32"
        elif n.isupper():
            sig[n] = "*i32"
        else:
            sig[n] = "i32"
    # the block table's row stride gets no hint (the kernel does not specialize it); the LSE's
    # stride between query heads is the split count
    unhinted = {"stride_btb"} | ({"stride_lh"} if constants["NUM_SPLITS"] % 16 else set())
    hinted = [n for n in names if sig[n].startswith("*") or (n.startswith("stride_") and n not in unhinted)]
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constants.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in hinted})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    ptx_path.write_text(kernel.asm["ptx"])
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    run = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_90a", str(ptx_path), "-o", os.devnull],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"ptxas failed:\n{run.stderr}")
    lines = (run.stdout + run.stderr).splitlines()
    return "; ".join(re.sub(r"^ptxas info\s*:\s*", "", ln).strip() for ln in lines
                     if "registers" in ln or "spill" in ln)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--splits", type=int, default=16, help="the launch's split count (NUM_SPLITS)")
    ap.add_argument("--ptx-dir", type=Path, help="keep each variant's PTX here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sfi-ptx-") as tmp:
        out_dir = args.ptx_dir or Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        report(args.splits, out_dir)


def report(splits: int, out_dir: Path) -> None:
    fn = split_kernel()
    print(f"Triton {triton.__version__}, sm_90a, 32 query / 8 KV heads, head size 128, bf16, "
          f"{splits} splits, slot map and query staging on", flush=True)
    for row_splits in (False, True):
        for scores in (False, True):
            constants = dict(G=4, G_PAD=16, D=128, BLOCK_N=32, PAGE=16, NUM_SPLITS=splits, HAS_MAP=True,
                             HAS_STAGE=True, HAS_SCORES=scores, KEY_BLOCK=32, WIDE_N=0, HAS_ROW_SPLITS=row_splits)
            ptx = out_dir / f"split-rows{int(row_splits)}-scores{int(scores)}.ptx"
            print(f"row_splits={row_splits!s:5} scores={scores!s:5}: {compile_variant(fn, constants, ptx)}", flush=True)


if __name__ == "__main__":
    main()

"""Static cost of the Triton α-entmax kernels, without a GPU: compile them for sm_90 (H100,
H200) with Triton's own ptxas, disassemble with the cuobjdump its wheel carries, and count the
SASS instructions of each loop (a loop body runs once per (query block, key block) tile). A loop
with a branch holds both paths; the branch on whole tiles (every entry an edge: no
mask select) is counted path by path by forcing it one way.

A proxy for speed where no GPU is at hand: it shows layout conversions (SHFL, shared-memory
stores), register spills (LDL/STL) and the tensor-core instructions (HGMMA) per tile.

    python scripts/triton_sass.py --out docs/results/engines/triton-sass/sm90.txt
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # the variants below share a cache key

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sparseattn.engines import _entmax_kernels as kern  # noqa: E402
from sparseattn.engines import triton_entmax  # noqa: E402
from sparseattn.engines.triton_entmax import MAX_IT  # noqa: E402

try:  # the default options (older commits: module globals)
    from sparseattn.engines.triton_entmax import DEFAULT_OPTIONS  # noqa: E402

    TOPK, SKIP_TILES = DEFAULT_OPTIONS.topk, DEFAULT_OPTIONS.skip_tiles
    LONGEST_FIRST = DEFAULT_OPTIONS.longest_first
except ImportError:
    from sparseattn.engines.triton_entmax import LONGEST_FIRST, SKIP_TILES, TOPK  # noqa: E402

try:
    from sparseattn.engines import _entmax_tiles as tile_fns  # noqa: E402
except ImportError:  # older commits: the tile functions in the kernels' module
    tile_fns = kern

TYPES = {
    **dict.fromkeys(("n_q", "n_k", "H", "HKV", "nbq", "nbk", "n_pairs"), "i32"),
    **dict.fromkeys(("mul", "scale", "AM1", "R", "m_cap", "m_scale", "m_am1"), "fp32"),
    **dict.fromkeys(("mb_b", "mb_h", "mb_i", "mb_j"), "i32"),  # a score modifier's bias strides
    **dict.fromkeys(("Q", "K", "V", "O", "DO", "DQ", "DK", "DV_"), "*bf16"),
    **dict.fromkeys(("TAU", "GV", "DELTA", "TMAX", "MB", "MSL", "MDB", "MDSL"), "*fp32"),
    **dict.fromkeys(("NZ", "KEY_OK"), "*i8"),
    # int64 row words; uint8 tiles before them (so that older commits compile for comparison)
    "MASKS": "*i64" if hasattr(triton_entmax, "pack_rows") else "*u8",
}
COUNTED = ("GMMA", "LDL", "STL", "SHFL", "STS", "LDG")
#: The forward's tile loops in program order.
TILE_LOOPS = {"forward": ["forward, pass 0", "forward, threshold pass", "forward, last pass"]}


@triton.jit
def _ALWAYS(kb, midx, n_k, rows_in, BLOCK: tl.constexpr, HAS_KEY_OK: tl.constexpr):
    return True


@triton.jit
def _NEVER(kb, midx, n_k, rows_in, BLOCK: tl.constexpr, HAS_KEY_OK: tl.constexpr):
    return False


def sass(fn, constexprs: dict, warps: int) -> list[str]:
    """The kernel's SASS instructions (text after the address), compiled for sm_90."""
    # a bias contiguous along the keys: its key stride 1 is specialised, as a launch does
    constexprs = {k: v for k, v in {**constexprs, "mb_j": 1}.items() if k in fn.arg_names}
    # a compile-time switch left out would be compiled as a pointer argument, silently
    unset = [fn.arg_names[i] for i in fn.constexprs if fn.arg_names[i] not in constexprs]
    if unset:
        raise SystemExit(f"{fn.__name__}: constexpr parameters not set here: {unset}")
    signature = {a: "constexpr" if a in constexprs else TYPES.get(a, "*i32") for a in fn.arg_names}
    # as a launch specialises them: pointers 16-byte aligned, lengths multiples of 16
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, a in enumerate(fn.arg_names)
        if a not in constexprs
        and (signature[a].startswith("*") or a in ("n_q", "n_k", "mb_b", "mb_h", "mb_i"))
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    return [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", text)]


def opcode(instruction: str) -> str:
    """The opcode of a SASS instruction, without its predicate (``@P0``) and modifiers."""
    return instruction.split()[1 if instruction.startswith("@") else 0].split(".")[0]


def loops(ins: list[str]) -> list[tuple[int, int]]:
    """(first, last) instruction index of each loop: a branch back to an earlier address."""
    out = []
    for i, t in enumerate(ins):
        m = re.search(r"BRA\s+0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) // 16 <= i:
            out.append((int(m.group(1), 16) // 16, i))
    return sorted(o for o in out if o[1] > o[0])  # (a branch to itself ends the program)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--mode", type=int, default=1, help="2 sparsemax, 1 1.5-entmax, 0 other α")
    parser.add_argument("--topk", type=int, default=TOPK, help="TritonOptions.topk")
    parser.add_argument(
        "--mod",
        type=int,
        default=0,
        help="the kernels' score-modifier code MOD (0 none; 17 a bias then a softcap, 22 ALiBi, "
        "a softcap, then a bias: triton_entmax.KernelMod); with --mod-grad, dq's MOD_GRAD",
    )
    parser.add_argument("--mod-grad", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    base = {"D": 64, "DV": 64, "BD": 64, "BDV": 64, "BLOCK": args.block, "HAS_KEY_OK": False,
            "UPCAST": False, "MODE": args.mode, "PREC": "tf32", "MOD": args.mod,
            "MOD_GRAD": args.mod_grad}  # fmt: skip
    kernels = {
        "forward": (
            kern._forward,
            {
                "NEED_GRAD": True,
                "MAX_IT": MAX_IT,
                "TOPK": args.topk,
                "SKIP": SKIP_TILES,
                "LONGEST_FIRST": LONGEST_FIRST,
            },
        ),  # fmt: skip
        "backward dq": (kern._backward_dq, {"LONGEST_FIRST": LONGEST_FIRST}),
        "backward dk dv": (kern._backward_dkdv, {"GROUP": 1}),
    }
    warps = 4 if args.block <= 64 else 8
    lines = [
        f"# python scripts/triton_sass.py --block {args.block} --mode {args.mode} "
        f"--topk {args.topk}"
        + (f" --mod {args.mod} --mod-grad {args.mod_grad}" if args.mod or args.mod_grad else "")
        + f" (triton {triton.__version__}, sm_90, bf16, d = 64, {warps} warps)"
    ]
    per_tile = {}  # (kernel, loop name) -> instructions, for partial and full pairs
    variants = [
        (True, None, "layouts with partial pairs (PARTIAL): each loop holds the branch of the "
         "mask bits and both paths of a whole tile"),
        (False, None, "the dense layout (no partial pairs): a full pair, both paths"),
        (False, True, "the dense layout, whole tiles only (inside the sequence, no padding)"),
        (False, False, "the dense layout, no whole tile (the sequence's last tiles, padding)"),
    ]  # fmt: skip
    whole = tile_fns._whole
    for partial, forced, title in variants:
        lines.append(title)
        # the tile loops branch on _whole (the tiles' and the dK/dV kernel's): forcing it
        # counts one path
        tile_fns._whole = kern._whole = whole if forced is None else (_ALWAYS if forced else _NEVER)
        for name, (fn, extra) in kernels.items():
            ins = sass(fn, {**base, **extra, "PARTIAL": partial}, warps)
            lines.append(f"{name}: {len(ins)} instructions")
            found = loops(ins)
            for first, last in found:
                body = ins[first : last + 1]
                counts = ", ".join(f"{k} {sum(k in opcode(t) for t in body)}" for k in COUNTED)
                lines.append(f"  loop {first}-{last}: {len(body)} instructions; {counts}")
            # tile loops: the innermost (the forward's threshold passes sit in a while loop)
            tiles = [(f, e) for f, e in found if not any(f < g and h < e for g, h in found)]
            names = TILE_LOOPS.get(name, [name])
            for label, (first, last) in zip(names, tiles, strict=False):
                per_tile.setdefault(label, []).append(last - first + 1)
    tile_fns._whole = kern._whole = whole
    lines += [
        "",
        "| loop (one tile) | partial pair (static) | full pair (static) | whole tile | not whole |",
        "|---|---:|---:|---:|---:|",
        *(f"| {label} | {' | '.join(map(str, n))} |" for label, n in per_tile.items()),
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

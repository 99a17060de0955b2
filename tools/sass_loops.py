"""Machine instructions in a kernel's loops (SASS), for comparing two builds of a kernel
without a GPU: the loops are the ranges closed by a backward branch.

    nvcc -std=c++17 -O3 -Ifusion/include -Iallocator/include -arch=sm_90 -cubin -o ln.cubin fusion/kernels/layer_norm.cu
    CUOBJDUMP=/path/to/cuobjdump python3 tools/sass_loops.py ln.cubin ln_bwd_warpI13__nv_bfloat16Li2

cuobjdump is in the CUDA toolkit, or the PyPI wheel nvidia-cuda-cuobjdump. Prints, per
kernel whose mangled name contains the substring, its instruction count and each loop's
range, count and most frequent opcodes.
"""
import os
import re
import subprocess
import sys
from collections import Counter


def main():
    cubin, want = sys.argv[1], sys.argv[2]
    sass = subprocess.run([os.environ.get("CUOBJDUMP", "cuobjdump"), "-sass", cubin], check=True,
                          capture_output=True, text=True).stdout
    for fn in sass.split("Function : ")[1:]:
        name = fn.split("\n", 1)[0].strip()
        if want not in name:
            continue
        ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4})\*/\s+([^;]*);", fn)]
        print(f"{name}: {len(ins)} instructions")
        for addr, text in ins:
            m = re.search(r"BRA\s+(?:`\()?0x([0-9a-f]+)", text)
            if not m or int(m.group(1), 16) > addr:
                continue
            lo = int(m.group(1), 16)
            body = [t for a, t in ins if lo <= a <= addr]
            ops = Counter(t.split()[1 if t.startswith("@") else 0].split(".")[0] for t in body)
            print(f"  loop {lo:#x}-{addr:#x}: {len(body)} instructions; " +
                  ", ".join(f"{k} {v}" for k, v in ops.most_common(8)))


if __name__ == "__main__":
    main()

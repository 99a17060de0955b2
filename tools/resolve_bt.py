"""Resolves backtrace_symbols_fd lines (KITSUNE_SEGV_BACKTRACE=1) with addr2line.

    python3 tools/resolve_bt.py < stderr.txt"""
import re
import subprocess
import sys

for line in sys.stdin:
    m = re.match(r"(\S+\.so[^(]*)\((\S*)\+(0x[0-9a-f]+)\)", line.strip())
    if not m:
        continue
    path, sym, off = m.groups()
    where = ""
    if not sym:
        r = subprocess.run(["addr2line", "-f", "-C", "-i", "-e", path, off], capture_output=True, text=True)
        where = " | ".join(x for x in r.stdout.split("\n") if x)
    else:
        where = subprocess.run(["c++filt", sym], capture_output=True, text=True).stdout.strip() + "+" + off
    print(f"{path.rsplit('/', 1)[-1]}: {where}")

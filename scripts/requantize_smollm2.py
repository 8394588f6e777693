#!/usr/bin/env python3
"""SmolLM2-135M-Instruct requantized from PyPI's Q4_1 file with llama.cpp's own quantizer
(llama-cpp-python's `llama_model_quantize`, `allow_requantize`), for the GGUF tests and
benchmarks of the other types.

    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" pip install llama-cpp-python==0.3.36
    python3 scripts/requantize_smollm2.py models/SmolLM2-135M-Instruct.Q4_1.gguf [TYPES...]

Writes models/SmolLM2-135M-Instruct.<TYPE>.gguf beside the source for each TYPE (default:
Q8_0 Q4_K_M Q5_0) and prints each file's size and sha256.
"""

import ctypes
import hashlib
import os
import sys

import llama_cpp

FTYPES = {
    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "Q5_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_0,
    "Q5_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_1,
    "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
    "Q3_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_M,
    "Q2_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K,
    "Q5_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "Q3_K_L": llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_L,
}


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    src = sys.argv[1]
    names = sys.argv[2:] or ["Q8_0", "Q4_K_M", "Q5_0"]
    base = src.rsplit(".", 2)[0]
    for name in names:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = FTYPES[name]
        params.allow_requantize = True
        out = f"{base}.{name}.gguf"
        rc = llama_cpp.llama_model_quantize(src.encode(), out.encode(), ctypes.byref(params))
        if rc != 0:
            sys.exit(f"quantizing to {name} failed ({rc})")
        sha = hashlib.sha256(open(out, "rb").read()).hexdigest()
        print(f"{out}: {os.path.getsize(out)} bytes, sha256 {sha}, llama-cpp-python {llama_cpp.__version__}")


if __name__ == "__main__":
    main()

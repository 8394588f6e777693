#!/usr/bin/env python3
"""llama.cpp's own logits on the SmolLM2 GGUF files, the reference of the 8-bit activation
mode (`set_int8_activations`, `--int8-activations`), which claims llama.cpp's precision:
llama.cpp quantizes each activation row to 8 bits (q8_0 / q8_K blocks) before its block
products, as that mode does.

    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" pip install llama-cpp-python==0.3.36
    scripts/fetch_smollm2_gguf.sh DIR
    python3 scripts/requantize_smollm2.py DIR/SmolLM2-135M-Instruct.Q4_1.gguf
    python3 scripts/gen_int8_llamacpp_fixtures.py DIR > tests/fixtures/gguf/int8_llama_cpp.json

For each of the four files (PyPI's Q4_1 and llama.cpp's Q8_0, Q4_K_M and Q5_0 of it) and
three prompts of tests/fixtures/gguf/smollm2.json: llama.cpp's greedy continuation of STEPS
tokens and, at each of the STEPS positions that predict them, its TOP largest logits (ids
and values). One thread; the KV cache in f32 and flash attention off, so that what is left
between llama.cpp and this crate is the products' precision (its default f16 cache moves the
logits as much as the 8-bit activations do).
"""

import hashlib
import json
import os
import sys

import llama_cpp
import numpy as np

FILES = ["Q4_1", "Q8_0", "Q4_K_M", "Q5_0"]
PROMPTS = [0, 1, 3]  # indices into smollm2.json's cases
STEPS = 6
TOP = 64


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    src = sys.argv[1]
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "tests", "fixtures", "gguf", "smollm2.json")) as f:
        cases = json.load(f)["files"][0]["cases"]
    out = {
        "generated_by": "scripts/gen_int8_llamacpp_fixtures.py",
        "llama_cpp_python": llama_cpp.__version__,
        "steps": STEPS,
        "kv_cache": "f32",
        "top": TOP,
        "files": [],
    }
    for ty in FILES:
        name = f"SmolLM2-135M-Instruct.{ty}.gguf"
        path = os.path.join(src, name)
        llm = llama_cpp.Llama(model_path=path, n_threads=1, n_threads_batch=1, n_ctx=256,
                              logits_all=True, verbose=False, flash_attn=False,
                              type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
        prompts = []
        for i in PROMPTS:
            ids = cases[i]["ids"]
            llm.reset()
            llm.eval(ids)
            generated, rows = [], []
            for _ in range(STEPS):
                logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
                top = np.argsort(-logits, kind="stable")[:TOP]
                rows.append({"ids": [int(t) for t in top],
                             "logits": [round(float(logits[t]), 5) for t in top]})
                token = int(top[0])
                generated.append(token)
                llm.eval([token])
            prompts.append({"text": cases[i]["text"], "ids": ids, "generated": generated,
                            "steps": rows})
        out["files"].append({"file": name, "sha256": sha256(path), "prompts": prompts})
        print(f"{name}: done", file=sys.stderr)
    json.dump(out, sys.stdout, ensure_ascii=False, separators=(",", ":"))
    print()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""transformers' greedy `generate` on a LLaMA-family model directory, the peer of
`examples/generate.rs` in benches/decode.sh.

    python3 benches/hf_generate.py MODEL_DIR [f32|f16|bf16] [--threads 2]

Prints one JSON object: decode tokens/s (64 new tokens after "The capital of France is",
EOS ignored; the time of a 1-token generate subtracted, so prefill is not counted; best of
two runs) and the time of a forward over a 512-token prompt (prefill), in ms.
"""
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    threads = 2
    if "--threads" in sys.argv:
        threads = int(sys.argv[sys.argv.index("--threads") + 1])
        args = [a for a in args if a != str(threads)]
    torch.set_num_threads(threads)
    d = args[0]
    name = args[1] if len(args) > 1 else "f32"
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[name]
    tok = AutoTokenizer.from_pretrained(d)
    m = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval()
    # generate() falls back to generation_config's EOS; clear it so that all tokens are made.
    m.generation_config.eos_token_id = None
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        m.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        best = 0.0
        for _ in range(2):
            t = time.perf_counter()
            m.generate(ids, max_new_tokens=1, do_sample=False)
            t1 = time.perf_counter() - t
            t = time.perf_counter()
            m.generate(ids, max_new_tokens=65, min_new_tokens=65, do_sample=False)
            t65 = time.perf_counter() - t
            best = max(best, 64 / (t65 - t1))
        g = torch.Generator().manual_seed(0)
        long = torch.randint(0, m.config.vocab_size, (1, 512), generator=g)
        m(long)
        t = time.perf_counter()
        m(long)
        prefill = time.perf_counter() - t
    print(json.dumps({"tool": "transformers", "torch": torch.__version__, "dtype": name,
                      "threads": threads, "decode_tokens_per_s": round(best, 2),
                      "prefill_512_ms": round(prefill * 1e3, 1)}))


if __name__ == "__main__":
    main()

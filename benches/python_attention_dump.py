#!/usr/bin/env python3
"""Python/transformers counterpart of `attention_dump --format json`, for timing.

    python3 benches/python_attention_dump.py "a sentence" [--weights weights]

Loads weights/ (tokenizer.json via transformers AutoTokenizer, BertModel with eager
attention, the shipped f16 weights upcast to f32), runs all 6 layers with
output_attentions=True and prints one compact JSON line:

    {"model": "weights", "text": ..., "tokens": [...], "shape": [6, 12, seq, seq],
     "attentions": [[[[...]]]]}        # floats rounded to 6 decimals

Uses 2 intra-op threads (torch.set_num_threads(2)) unless OMP_NUM_THREADS is set.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, BertConfig, BertModel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("text")
    ap.add_argument("--weights", default=str(Path(__file__).resolve().parent.parent / "weights"))
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))

    wdir = Path(args.weights)
    tok = AutoTokenizer.from_pretrained(str(wdir))
    cfg = BertConfig.from_pretrained(str(wdir), attn_implementation="eager")
    model = BertModel(cfg, add_pooling_layer=False)
    sd = {k: v.float() for k, v in load_file(str(wdir / "model.safetensors")).items()
          if v.is_floating_point() and not k.startswith("pooler.")}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "position_ids" not in k]
    if missing or unexpected:
        sys.exit(f"weights mismatch: missing={missing} unexpected={unexpected}")
    model.eval()

    enc = tok(args.text, return_tensors="pt")
    with torch.inference_mode():
        out = model(**enc, output_attentions=True)
    att = torch.stack([a[0] for a in out.attentions]).numpy()  # (layers, heads, seq, seq)
    doc = {
        "model": wdir.name,
        "text": args.text,
        "tokens": enc.tokens(),
        "shape": list(att.shape),
        "attentions": np.round(att.astype(np.float64), 6).tolist(),
    }
    sys.stdout.write(json.dumps(doc, ensure_ascii=False, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()

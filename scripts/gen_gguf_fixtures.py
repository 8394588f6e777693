#!/usr/bin/env python3
"""GGUF fixtures for tests/gguf.rs, written and dequantized by gguf-py (the package
transformers reads GGUF files with), never by this crate.

    python3 -m venv .venv-gguf && .venv-gguf/bin/pip install gguf==0.17.1 numpy safetensors
    .venv-gguf/bin/python scripts/gen_gguf_fixtures.py

Writes tests/fixtures/gguf/:
- types.gguf: one (2, 512) tensor per type this crate reads (F32, F16, BF16, Q4_0, Q4_1,
  Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), named after its type. The float types
  and Q4_0..Q8_0 are random values quantized by gguf-py; the K-quants (which gguf-py does
  not quantize) are random block bytes with finite scales, so that every bit of a block is
  exercised. Plus metadata of every value type (`test.*` keys) and a 3-D tensor.
- types.safetensors: each tensor dequantized to f32 by `gguf.quants.dequantize`, under the
  same name, in candle's shape (the GGUF dims reversed).
- metadata.json: the `test.*` metadata as gguf-py reads it back.
- <case>.f32.gguf, <case>.q8_0.gguf, <case>.q4_1.gguf for the tiny decoders of
  tests/fixtures/decoders/ (llama_gqa, llama_linear_rope, llama_head_dim, qwen2_tied): the
  model as llama.cpp's converter writes it (its names and metadata keys, the query and key
  rows of `llama` permuted for its rotation, norms in F32, the matrices in the file's type),
  and <case>.q8_0/ and <case>.q4_1/: config.json and model.safetensors holding the
  dequantized weights under the Hugging Face names, with the permutation undone as
  transformers undoes it (`reverse_permute_weights`): what transformers loads from the file.
"""

import json
import os
import sys

import numpy as np

try:
    import gguf
    from gguf import GGMLQuantizationType as T
    from safetensors.numpy import save_file
except ImportError as e:  # pragma: no cover
    sys.exit(f"{e}: pip install gguf==0.17.1 numpy safetensors")

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "gguf")
ROWS, COLS = 2, 512
SEED = 20261125

# gguf-py quantizes these itself.
QUANTIZED = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
# Random blocks: (type, byte offsets of the f16 scales in a block).
RANDOM_BLOCKS = [
    (T.Q2_K, [80, 82]),
    (T.Q3_K, [108]),
    (T.Q4_K, [0, 2]),
    (T.Q5_K, [0, 2]),
    (T.Q6_K, [208]),
]


DECODERS = ["llama_gqa", "llama_linear_rope", "llama_head_dim", "qwen2_tied", "llama3_rope"]
FIXTURES = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "decoders")


def permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (n_head: the heads of w)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reverse_permute(w, n_head):
    """transformers' reverse_permute_weights."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


GGUF_NAMES = [
    ("input_layernorm.", "attn_norm."),
    ("self_attn.q_proj.", "attn_q."),
    ("self_attn.k_proj.", "attn_k."),
    ("self_attn.v_proj.", "attn_v."),
    ("self_attn.o_proj.", "attn_output."),
    ("post_attention_layernorm.", "ffn_norm."),
    ("mlp.gate_proj.", "ffn_gate."),
    ("mlp.up_proj.", "ffn_up."),
    ("mlp.down_proj.", "ffn_down."),
]


def gguf_name(hf):
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    rest = hf[len("model.layers."):]
    layer, rest = rest.split(".", 1)
    for h, g in GGUF_NAMES:
        if rest.startswith(h):
            return f"blk.{layer}.{g}{rest[len(h):]}"
    raise KeyError(hf)


def llama3_rope_factors(rope, dim):
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: LLaMA 3.1's
    scaling as one divisor per rotary frequency (f32)."""
    import math

    import torch

    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_decoder(case, qtype):
    from safetensors.numpy import load_file

    src = os.path.join(FIXTURES, case)
    cfg = json.load(open(os.path.join(src, "config.json")))
    weights = load_file(os.path.join(src, "model.safetensors"))
    arch = cfg["model_type"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    suffix = qtype.name.lower() if qtype is not None else "f32"
    path = os.path.join(OUT, f"{case}.{suffix}.gguf")
    w = gguf.GGUFWriter(path, arch=arch)
    w.add_context_length(cfg.get("max_position_embeddings", 64))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    params = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_rope_dimension_count(head_dim)
    if cfg.get("head_dim"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling:
        kind = scaling.get("type") or scaling.get("rope_type")
        if kind == "llama3":
            # As llama.cpp's converter (LlamaModel.generate_extra_tensors): no scaling keys,
            # a `rope_freqs` tensor of per-frequency divisors.
            w.add_tensor("rope_freqs.weight", llama3_rope_factors(params or scaling, head_dim))
        else:
            assert kind == "linear", kind
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(scaling["factor"])
    w.add_bos_token_id(cfg.get("bos_token_id") or 1)
    w.add_eos_token_id(cfg.get("eos_token_id") or 2)
    hf_out = {}
    for name, t in sorted(weights.items()):
        t = t.astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            stored = permute(t, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            stored = permute(t, kv_heads)
        else:
            stored = t
        # Like llama.cpp's quantizer, rows that are not whole blocks stay in a float type.
        if qtype is None or stored.ndim == 1 or stored.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            w.add_tensor(gguf_name(name), stored)
            hf_out[name] = t
            continue
        q = gguf.quants.quantize(stored, qtype)
        w.add_tensor(gguf_name(name), q, raw_dtype=qtype)
        back = gguf.quants.dequantize(q, qtype).astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            back = reverse_permute(back, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            back = reverse_permute(back, kv_heads)
        hf_out[name] = np.ascontiguousarray(back)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if qtype is not None:
        out_dir = os.path.join(OUT, f"{case}.{suffix}")
        os.makedirs(out_dir, exist_ok=True)
        save_file(hf_out, os.path.join(out_dir, "model.safetensors"))
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
            f.write("\n")
    return path


def main():
    rng = np.random.default_rng(SEED)
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "types.gguf")
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4_000_000_000)
    w.add_int32("test.i32", -2_000_000_000)
    w.add_uint64("test.u64", 2**60 + 3)
    w.add_int64("test.i64", -(2**60))
    w.add_float32("test.f32", 1.5)
    w.add_float64("test.f64", -2.25e-300)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "héllo, GGUF")
    w.add_array("test.strings", ["a", "", "ünï"])
    w.add_array("test.ints", [1, -2, 3])
    expected = {}
    for ty in QUANTIZED:
        x = (rng.standard_normal((ROWS, COLS)) * rng.uniform(0.01, 2.0)).astype(np.float32)
        if ty == T.F32:
            data, raw_dtype = x, None
        elif ty == T.F16:
            data, raw_dtype = x.astype(np.float16), None
        else:
            data, raw_dtype = gguf.quants.quantize(x, ty), ty
        name = ty.name
        w.add_tensor(name, data, raw_dtype=raw_dtype)
        expected[name] = gguf.quants.dequantize(gguf.quants.quantize(x, ty), ty).astype(np.float32)
    for ty, scale_offsets in RANDOM_BLOCKS:
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[ty]
        n_blocks = ROWS * COLS // block_values
        blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
        for off in scale_offsets:
            scales = rng.uniform(-0.05, 0.05, size=n_blocks).astype(np.float16)
            blocks[:, off : off + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
        raw = blocks.reshape(ROWS, COLS // block_values * block_bytes)
        w.add_tensor(ty.name, raw, raw_dtype=ty)
        expected[ty.name] = gguf.quants.dequantize(raw, ty).astype(np.float32)
    cube = rng.standard_normal((2, 3, 32)).astype(np.float32)
    q = gguf.quants.quantize(cube, T.Q8_0)
    w.add_tensor("cube", q, raw_dtype=T.Q8_0)
    expected["cube"] = gguf.quants.dequantize(q, T.Q8_0).astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    save_file({k: np.ascontiguousarray(v) for k, v in expected.items()}, os.path.join(OUT, "types.safetensors"))

    reader = gguf.GGUFReader(path)
    meta = {}
    for field in reader.fields.values():
        if not field.name.startswith("test."):
            continue
        meta[field.name] = field.contents()
    with open(os.path.join(OUT, "metadata.json"), "w") as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes), {len(expected)} tensors")
    for case in DECODERS:
        for qtype in [None, T.Q8_0, T.Q4_1]:
            p = write_decoder(case, qtype)
            print(f"wrote {p} ({os.path.getsize(p)} bytes)")


if __name__ == "__main__":
    main()

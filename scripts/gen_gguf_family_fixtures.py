#!/usr/bin/env python3
"""GGUF fixtures for five more decoder families (gpt2, gptneox, phi3, qwen3, gemma3), written
as llama.cpp's converter (convert_hf_to_gguf.py: GPT2Model, GPTNeoXModel, Phi3MiniModel,
Qwen3Model, Gemma3Model) writes them, by gguf-py, never by this crate:

    python3 scripts/gen_gguf_family_fixtures.py    # gguf, numpy, safetensors, torch, transformers

The companion of scripts/gen_gguf_fixtures.py (the LLaMA-family cases), whose conventions it
follows: the source models are the tiny checkpoints of tests/fixtures/decoders/<case>/
(scripts/gen_decoder_family_fixtures.py), and for each case it writes, in tests/fixtures/gguf/:

- <case>.f32.gguf: every tensor F32 (general.file_type ALL_F32 where the converter writes it);
- <case>.q8_0.gguf: the 2-D matrices whose rows are whole Q8_0 blocks (32 values) in Q8_0, the
  rest F32: norms (any tensor named `*_norm.weight`), biases, 1-D tensors, and `position_embd`
  (llama.cpp's converter keeps those F32 at every file type; every matrix of these models
  has rows of 32 or 64 values, so none falls back to a float type);
- <case>.q8_0/: config.json (the source model's, unchanged) and model.safetensors holding the
  q8_0 file's tensors dequantized by gguf-py, under the family's ORIGINAL Hugging Face names and
  layout, with every re-layout of llama.cpp's converter undone (what transformers' model holds
  after loading the file): GPT-2's Conv1D weights transposed back to (in, out), GPT-NeoX's
  query_key_value rows put back from [Q; K; V] blocks into per-head [q_h; k_h; v_h] groups,
  Gemma 3's norms stored as 1 + w turned back into w (subtracting 1 in f32, as transformers
  does). Loadable by `from_pretrained` with the family's class;
- <case>.q8_0/expected.safetensors: transformers (eager, f32) on that directory, for the prompt
  of tests/fixtures/decoders/<case>/expected.safetensors:
      input_ids      I64 (1, T)
      logits         F32 (T, V)       full forward on the prompt
      generated_ids  I64 (N,)         greedy generate, EOS ignored: N = 8, or the ids before the
                                      first step whose top-1/top-2 margin is < 1e-2 (gemma3: 7;
                                      its 8th step's margin is 8e-4 after Q8_0)
      attentions     F32 (L, H, T, T) eager attention probabilities, batch dropped

Tensor names, fusions and re-layouts, metadata keys and which tensors stay F32 follow the
converter (see CASES below); values the converter would read from keys that transformers 5 no
longer writes to config.json (GPT-2's `n_ctx`, GPT-NeoX's `rotary_pct`, Phi-3's
`rope_parameters.original_max_position_embeddings`) are taken from their transformers-5
spellings (`n_positions`, `rope_parameters.partial_rotary_factor`,
`original_max_position_embeddings`).

Tokenizer: none of these WordLevel vocabularies can be written as llama.cpp's converter would
(GPT-2, GPT-NeoX, Qwen3 and, without a `tokenizer.model`, Gemma 3 go through `_set_vocab_gpt2`:
a byte-level BPE with merges and a pre-tokenizer recognised by the hash of a test encoding;
Phi-3 needs a SentencePiece `tokenizer.model`), so the files
carry only `tokenizer.ggml.bos_token_id` and `tokenizer.ggml.eos_token_id`.

Checked (asserts): every file read back by gguf-py has exactly the intended tensors (names,
types, GGML shapes) and metadata; an independent numpy Q8_0 decoder of the raw blocks, with the
re-layouts undone by separate code, reproduces the reference directory bit for bit, within
0.6 * (block scale) of the source checkpoint (and not equal to it); the f32 files hold the source
tensors exactly (gemma3's norms: (w + 1) - 1 in f32, within 1.2e-7 of w). Where transformers loads the architecture
from GGUF (gpt2, phi3, qwen3, gemma3; not gptneox), the model it loads from <case>.q8_0.gguf (with
the source config, see below) holds the reference directory's tensors exactly and gives its
logits (1e-5), and the one it loads from <case>.f32.gguf gives the source model's logits (1e-5).
The expected outputs: greedy ids == argmax of the logits they were chosen from, top-1/top-2
margin >= 1e-2 on every saved greedy step (at least 6 kept), an uncached forward over
prompt + generated[:-1] reproduces them (1e-4), attention rows sum to 1 and are 0 above the
diagonal, everything finite.

transformers cannot rebuild these models' configs from the files alone: without a vocabulary
in the file it has no `vocab_size`; for gpt2 it maps `context_length` to `n_ctx` (leaving
`n_positions` at 1024); for qwen3 it ignores `attention.key_length` (head_dim stays 128); for
gemma3 the file has no `query_pre_attn_scalar` (24 here) and no
sliding-window pattern (layer 0 sliding, layer 1 full here), which llama.cpp hard-codes (pattern
6, scale 1/sqrt(head_dim)) and transformers defaults (pattern 6, scalar 256). So the cross-checks
pass the source config.json; the script prints what transformers builds from each file alone.
"""

import copy
import json
import os
import sys

import numpy as np

try:
    import gguf
    import torch
    import transformers
    from gguf import GGMLQuantizationType as T
    from gguf import MODEL_ARCH
    from safetensors.numpy import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM
except ImportError as e:  # pragma: no cover
    sys.exit(f"{e}: pip install gguf numpy safetensors torch transformers")

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "gguf")
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "decoders")
N_NEW = 8
MIN_MARGIN = 1e-2  # top-1/top-2 logit margin every saved greedy step must have
MIN_KEPT = 6  # fewest greedy ids a case may keep (see expected_outputs)
QK8_0 = 32

# case -> the architecture of the converter class that handles the source model
CASES = {
    "gpt2": dict(arch=MODEL_ARCH.GPT2),       # GPT2Model (GPT2LMHeadModel)
    "pythia": dict(arch=MODEL_ARCH.GPTNEOX),  # GPTNeoXModel (GPTNeoXForCausalLM)
    "phi3": dict(arch=MODEL_ARCH.PHI3),       # Phi3MiniModel (Phi3ForCausalLM)
    "qwen3": dict(arch=MODEL_ARCH.QWEN3),     # Qwen3Model (Qwen3ForCausalLM)
    "gemma3": dict(arch=MODEL_ARCH.GEMMA3),   # Gemma3Model (Gemma3ForCausalLM)
}
# file name -> transformers 5's parameter name, where they differ
MODEL_KEY = {"embed_out.weight": "lm_head.weight"}
# architectures transformers' GGUF loader knows (GGUF_CONFIG_MAPPING / TENSOR_PROCESSORS)
TRANSFORMERS_LOADS = {"gpt2", "phi3", "qwen3", "gemma3"}


# ------------------------------------------------------------------- metadata
def arch_params(case, cfg):
    """`{arch}.*` keys as (writer method, value), in the order the converter class adds them
    (set_gguf_parameters; a key the class writes twice is listed once, with its value)."""
    heads = cfg.get("num_attention_heads") or cfg.get("n_head")
    if case == "gpt2":  # GPT2Model.set_gguf_parameters
        return [
            ("add_block_count", cfg["n_layer"]),
            ("add_context_length", cfg["n_positions"]),  # hparams["n_ctx"]: transformers 5 has n_positions
            ("add_embedding_length", cfg["n_embd"]),
            ("add_feed_forward_length", 4 * cfg["n_embd"]),
            ("add_head_count", cfg["n_head"]),
            ("add_layer_norm_eps", cfg["layer_norm_epsilon"]),
            ("FILE_TYPE", None),
        ]
    if case == "pythia":  # GPTNeoXModel.set_gguf_parameters (no add_file_type)
        rot_pct = cfg["rope_parameters"]["partial_rotary_factor"]  # hparams["rotary_pct"]
        return [
            ("add_context_length", cfg["max_position_embeddings"]),
            ("add_embedding_length", cfg["hidden_size"]),
            ("add_block_count", cfg["num_hidden_layers"]),
            ("add_feed_forward_length", cfg["intermediate_size"]),
            ("add_rope_dimension_count", int(rot_pct * (cfg["hidden_size"] // heads))),
            ("add_head_count", heads),
            ("add_parallel_residual", cfg.get("use_parallel_residual", True)),
            ("add_layer_norm_eps", cfg["layer_norm_eps"]),
        ]
    if case == "phi3":  # Phi3MiniModel.set_gguf_parameters
        rope = cfg["rope_parameters"]
        rot_pct = rope.get("partial_rotary_factor", 1.0)
        return [
            ("add_context_length", cfg["max_position_embeddings"]),
            ("add_rope_scaling_orig_ctx_len", cfg["original_max_position_embeddings"]),
            ("add_embedding_length", cfg["hidden_size"]),
            ("add_feed_forward_length", cfg["intermediate_size"]),
            ("add_block_count", cfg["num_hidden_layers"]),
            ("add_head_count", heads),
            ("add_head_count_kv", cfg["num_key_value_heads"]),
            ("add_layer_norm_rms_eps", cfg["rms_norm_eps"]),
            ("add_rope_dimension_count", int(rot_pct * cfg["hidden_size"]) // heads),
            ("add_rope_freq_base", rope["rope_theta"]),
            ("FILE_TYPE", None),
            # "use zero value of sliding_window to distinguish Phi-4 from other PHI3 models"
            ("add_sliding_window", cfg.get("sliding_window") or 0),
        ]
    # Qwen3Model (Qwen2Model) and Gemma3Model: TextModel.set_gguf_parameters first
    rope = cfg["rope_parameters"]
    full = rope.get("full_attention", rope)
    assert full.get("rope_type", "default") == "default"  # nothing written for it
    params = [
        ("add_block_count", cfg["num_hidden_layers"]),
        ("add_context_length", cfg["max_position_embeddings"]),
        ("add_embedding_length", cfg["hidden_size"]),
        ("add_feed_forward_length", cfg["intermediate_size"]),
        ("add_head_count", heads),
        ("add_head_count_kv", cfg["num_key_value_heads"]),
        ("add_rope_freq_base", full["rope_theta"]),
    ]
    if "sliding_attention" in rope:
        params.append(("add_rope_freq_base_swa", rope["sliding_attention"]["rope_theta"]))
    params += [
        ("add_layer_norm_rms_eps", cfg["rms_norm_eps"]),
        ("add_key_length", cfg["head_dim"]),
        ("add_value_length", cfg["head_dim"]),
        ("FILE_TYPE", None),
    ]
    if case == "gemma3":
        # Gemma3Model.set_gguf_parameters then re-adds context length, head count, rms eps,
        # key/value length and rope.freq_base (same values), and adds:
        assert cfg.get("attn_logit_softcapping") is None and not cfg.get("final_logit_softcapping")
        if cfg.get("sliding_window_pattern") != 1:
            params.append(("add_sliding_window", cfg["sliding_window"]))
    return params


def write_metadata(w, case, cfg, qtype, n_params):
    """Everything the converter writes but the tokenizer, in its order (prepare_metadata:
    general.type, the model card's general.* keys, set_gguf_parameters, quantization version),
    then the two special token ids."""
    ftype = gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == T.Q8_0 else gguf.LlamaFileType.ALL_F32
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(case)  # Metadata.load falls back to the model directory's name
    w.add_size_label(gguf.size_label(n_params, 0, 0, 0))
    for method, value in arch_params(case, cfg):
        if method == "FILE_TYPE":
            w.add_file_type(ftype)
        else:
            getattr(w, method)(value)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])


# ------------------------------------------------------------------- tensors
def to_gguf_layout(case, cfg, hf, t):
    """(GGUF name, tensor as the converter stores it) for a Hugging Face tensor."""
    name = gguf.get_tensor_name_map(CASES[case]["arch"], cfg.get("num_hidden_layers") or cfg["n_layer"]).get_name(
        hf, try_suffixes=(".weight", ".bias"))
    assert name is not None, hf
    if case == "gpt2" and hf.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
        t = t.T  # Conv1D (in, out) -> (out, in)
    elif case == "pythia" and ".attention.query_key_value." in hf:
        # per-head [q_h; k_h; v_h] rows -> [Q; K; V] (GPTNeoXModel.modify_tensors)
        heads, d = cfg["num_attention_heads"], cfg["hidden_size"]
        t = t.reshape(heads, 3, d // heads, *t.shape[1:]).swapaxes(0, 1).reshape(t.shape)
    elif case == "gemma3" and hf.endswith("norm.weight"):
        t = t + np.float32(1.0)  # Gemma3Model.norm_shift: the file stores 1 + w
    return name, np.ascontiguousarray(t, dtype=np.float32)


def from_gguf_layout(case, cfg, hf, t):
    """Undo to_gguf_layout's re-layout, as transformers does when it loads the file."""
    if case == "gpt2" and hf.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
        t = t.T  # GPT2TensorProcessor
    elif case == "pythia" and ".attention.query_key_value." in hf:
        heads, d = cfg["num_attention_heads"], cfg["hidden_size"]
        t = t.reshape(3, heads, d // heads, *t.shape[1:]).swapaxes(0, 1).reshape(t.shape)
    elif case == "gemma3" and hf.endswith("norm.weight"):
        t = t - np.float32(1.0)  # Gemma2TensorProcessor: weights - 1, in f32
    return np.ascontiguousarray(t, dtype=np.float32)


def file_type_of(name, t, qtype):
    """The type the converter gives a tensor (ModelBase.prepare_tensors) at this file type."""
    if t.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return T.F32
    if name == "position_embd.weight":  # POS_EMBD is among the always-F32 tensors
        return T.F32
    if qtype is None:
        return T.F32
    # as scripts/gen_gguf_fixtures.py (llama.cpp's converter would fall back to F16 here)
    return T.F32 if t.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] else qtype


def write_case(case, cfg, weights, qtype):
    """Write <case>.<f32|q8_0>.gguf; return (path, {hf name: what transformers loads},
    {gguf name: (type, numpy shape)}, {gguf name: hf name})."""
    suffix = qtype.name.lower() if qtype is not None else "f32"
    path = os.path.join(OUT, f"{case}.{suffix}.gguf")
    w = gguf.GGUFWriter(path, arch=gguf.MODEL_ARCH_NAMES[CASES[case]["arch"]])
    n_params = sum(v.size for v in weights.values())
    write_metadata(w, case, cfg, qtype, n_params)
    loaded, layout, names = {}, {}, {}
    # the converter adds the tensors in the checkpoint's order (safetensors: sorted names)
    for hf in sorted(weights):
        name, stored = to_gguf_layout(case, cfg, hf, weights[hf].astype(np.float32))
        ty = file_type_of(name, stored, qtype)
        if ty == T.F32:
            w.add_tensor(name, stored)
            back = stored
        else:
            q = gguf.quants.quantize(stored, ty)
            w.add_tensor(name, q, raw_dtype=ty)
            back = gguf.quants.dequantize(q, ty).astype(np.float32)
        loaded[hf] = from_gguf_layout(case, cfg, hf, back)
        layout[name] = (ty, stored.shape)
        names[name] = hf
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, loaded, layout, names


# ------------------------------------------------------------------- checks
def expected_metadata(case, cfg, qtype, n_params, n_tensors):
    """The metadata a file should hold, as gguf-py reads it back (independently of the writer calls)."""
    ftype = 7 if qtype == T.Q8_0 else 0
    a = gguf.MODEL_ARCH_NAMES[CASES[case]["arch"]]
    keys = {"GGUF.version": 3, "GGUF.tensor_count": n_tensors,
            "GGUF.kv_count": None, "general.architecture": a, "general.type": "model", "general.name": case,
            "general.size_label": gguf.size_label(n_params, 0, 0, 0)}
    spell = {"add_block_count": "block_count", "add_context_length": "context_length",
             "add_embedding_length": "embedding_length", "add_feed_forward_length": "feed_forward_length",
             "add_head_count": "attention.head_count", "add_head_count_kv": "attention.head_count_kv",
             "add_layer_norm_eps": "attention.layer_norm_epsilon",
             "add_layer_norm_rms_eps": "attention.layer_norm_rms_epsilon",
             "add_rope_dimension_count": "rope.dimension_count", "add_rope_freq_base": "rope.freq_base",
             "add_rope_freq_base_swa": "rope.freq_base_swa", "add_parallel_residual": "use_parallel_residual",
             "add_key_length": "attention.key_length", "add_value_length": "attention.value_length",
             "add_sliding_window": "attention.sliding_window",
             "add_rope_scaling_orig_ctx_len": "rope.scaling.original_context_length"}
    for method, value in arch_params(case, cfg):
        if method == "FILE_TYPE":
            keys["general.file_type"] = ftype
        else:
            keys[f"{a}.{spell[method]}"] = value
    keys["general.quantization_version"] = 2
    keys["tokenizer.ggml.bos_token_id"] = cfg["bos_token_id"]
    keys["tokenizer.ggml.eos_token_id"] = cfg["eos_token_id"]
    keys["GGUF.kv_count"] = len(keys) - 3
    return keys


def dequantize_q8_0(raw, shape):
    """Q8_0 blocks -> f32, written here from the format (f16 scale d, then 32 int8 q: d * q),
    not with gguf-py. Also returns each value's block scale."""
    blocks = np.frombuffer(raw.tobytes(), dtype=np.uint8).reshape(-1, 2 + QK8_0)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)  # (n, 1)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    return (d * q).reshape(shape), np.repeat(d, QK8_0, axis=1).reshape(shape)


def undo_layout_independently(case, cfg, hf, t):
    """from_gguf_layout written again, index by index, for the check."""
    if case == "gpt2" and hf.rsplit(".", 2)[-2] in ("c_attn", "c_proj", "c_fc") and hf.endswith(".weight"):
        return np.ascontiguousarray(np.transpose(t))
    if case == "pythia" and "query_key_value" in hf:
        h, d = cfg["num_attention_heads"], cfg["hidden_size"]
        hd = d // h
        out = np.empty_like(t)
        for head in range(h):
            for part in range(3):  # gguf rows part*d + head*hd ..  ->  hf rows (head*3 + part)*hd ..
                out[(head * 3 + part) * hd:(head * 3 + part + 1) * hd] = t[part * d + head * hd:part * d + (head + 1) * hd]
        return out
    if case == "gemma3" and hf.endswith("norm.weight"):
        return (t.astype(np.float32) - np.float32(1)).astype(np.float32)
    return t


def check_file(case, cfg, weights, path, qtype, layout, names, loaded):
    """Read the file back with gguf-py and check names, types, shapes, metadata and values."""
    r = gguf.GGUFReader(path)
    n_params = sum(v.size for v in weights.values())
    want = expected_metadata(case, cfg, qtype, n_params, len(weights))
    got = {}
    for f in r.fields.values():
        v = f.contents()
        got[f.name] = v
    assert list(got) == list(want), (list(got), list(want))
    for k, v in want.items():
        g = got[k]
        if isinstance(v, float):
            assert abs(g - v) <= 1e-6 * abs(v), (k, g, v)
        else:
            assert g == v, (k, g, v)
    assert [t.name for t in r.tensors] == list(layout), [t.name for t in r.tensors]
    for t in r.tensors:
        ty, shape = layout[t.name]
        assert t.tensor_type == ty, (t.name, t.tensor_type, ty)
        assert tuple(int(x) for x in t.shape) == tuple(reversed(shape)), (t.name, t.shape, shape)  # GGML ne
        hf = names[t.name]
        if ty == T.F32:
            dense, scale = np.asarray(t.data, dtype=np.float32).reshape(shape), None
        else:
            assert ty == T.Q8_0
            dense, scale = dequantize_q8_0(np.asarray(t.data), shape)
        back = undo_layout_independently(case, cfg, hf, dense)
        assert back.shape == weights[hf].shape and back.dtype == np.float32, (hf, back.shape)
        assert np.array_equal(back, loaded[hf]), f"{path}: {t.name} differs from the reference tensor {hf}"
        orig = weights[hf]
        if scale is None:
            if case == "gemma3" and hf.endswith("norm.weight"):
                assert np.abs(back - orig).max() <= 1.2e-7, (hf, np.abs(back - orig).max())
            else:
                assert np.array_equal(back, orig), hf
        else:
            assert not hf.endswith("norm.weight")
            s = undo_layout_independently(case, cfg, hf, scale)
            err = np.abs(back - orig)
            assert (err <= 0.6 * s + 1e-12).all(), (hf, (err / s).max())
            assert err.max() > 0, f"{hf}: Q8_0 round trip is exact?"
    return got


def transformers_checks(case, cfg, src_dir, ref_dir, paths, src_model, ref_model, ids):
    """Where transformers loads the architecture from GGUF: its model from the q8_0 file holds
    the reference tensors and gives the reference logits; from the f32 file the source logits."""
    a = gguf.MODEL_ARCH_NAMES[CASES[case]["arch"]]
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    if case not in TRANSFORMERS_LOADS:
        assert a not in GGUF_SUPPORTED_ARCHITECTURES
        try:
            AutoModelForCausalLM.from_pretrained(OUT, gguf_file=paths["q8_0"], config=AutoConfig.from_pretrained(src_dir))
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {e}"
        else:
            raise AssertionError(f"transformers loaded {a} from GGUF: add the cross-check")
        print(f"[{case}] transformers cannot load `{a}` from GGUF ({msg.splitlines()[0]}); checked the "
              f"reference directory with the independent numpy decoder only")
        return
    assert a in GGUF_SUPPORTED_ARCHITECTURES
    # what transformers builds from the file alone
    alone = AutoConfig.from_pretrained(OUT, gguf_file=paths["q8_0"]).to_dict()
    src = AutoConfig.from_pretrained(src_dir).to_dict()
    diffs = {k: (alone.get(k, "<unset>"), src[k]) for k in sorted(src)
             if k in ("vocab_size", "n_positions", "n_ctx", "max_position_embeddings", "query_pre_attn_scalar",
                      "layer_types", "sliding_window", "head_dim", "rope_parameters", "num_key_value_heads",
                      "intermediate_size", "tie_word_embeddings", "rms_norm_eps", "layer_norm_epsilon")
             and alone.get(k, "<unset>") != src[k]}
    print(f"[{case}] config transformers builds from the file alone, where it differs from config.json "
          f"(file-alone, config.json): {diffs}")
    config = AutoConfig.from_pretrained(src_dir)
    for kind, want_model, tol in (("q8_0", ref_model, 1e-5), ("f32", src_model, 1e-5)):
        m = AutoModelForCausalLM.from_pretrained(OUT, gguf_file=paths[kind], config=config, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
        assert type(m) is type(want_model), type(m)
        sd, want_sd = m.state_dict(), want_model.state_dict()
        assert sorted(sd) == sorted(want_sd), sorted(set(sd) ^ set(want_sd))
        for k, v in want_sd.items():
            if kind == "q8_0":
                assert torch.equal(sd[k], v), f"{case} {kind}: {k} differs from the reference directory"
            else:
                assert (sd[k] - v).abs().max() <= 1.2e-7, f"{case} {kind}: {k}"
        with torch.no_grad():
            got, want = m(ids).logits[0], want_model(ids).logits[0]
        err = (got - want).abs().max().item()
        assert err <= tol, f"{case} {kind}: transformers-from-GGUF logits differ by {err}"
        what = "the reference directory's" if kind == "q8_0" else "the source model's"
        print(f"[{case}] transformers from {case}.{kind}.gguf: same tensors, logits == {what} "
              f"(max |diff| {err:.1e})")


def load_model(path, config=None):
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def expected_outputs(case, ref_model, ids):
    """Prompt logits, eager attentions and 8 greedy ids of the reference directory's model."""
    T_, V = ids.shape[1], ref_model.config.vocab_size
    with torch.no_grad():
        out = ref_model(ids, output_attentions=True)
        logits = ref_model(ids).logits[0]
    assert torch.equal(out.logits[0], logits) or (out.logits[0] - logits).abs().max() <= 1e-6
    att = torch.stack([a[0] for a in out.attentions])
    c = ref_model.config
    assert att.shape == (c.num_hidden_layers, c.num_attention_heads, T_, T_), att.shape
    assert (att.sum(-1) - 1).abs().max() <= 1e-5
    assert att[:, :, torch.ones(T_, T_, dtype=torch.bool).triu(1)].abs().max() == 0
    ref_model.generation_config.eos_token_id = None
    ref_model.generation_config.pad_token_id = None
    with torch.no_grad():
        gen_out = ref_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False,
                                     eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    gen = gen_out.sequences[0, T_:]
    assert gen.shape == (N_NEW,)
    step_logits = torch.stack([l[0] for l in gen_out.logits])  # (N, V): row i chose gen[i]
    assert (step_logits[0] - logits[-1]).abs().max() <= 1e-5
    assert torch.equal(step_logits.argmax(-1), gen), (step_logits.argmax(-1), gen)
    top2 = step_logits.topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    # Keep the greedy ids up to the first step whose top-1/top-2 margin is under MIN_MARGIN (a
    # choice a port could flip by rounding): all N_NEW where every margin is large enough.
    keep = next((i for i, m in enumerate(margins) if m < MIN_MARGIN), N_NEW)
    if keep < N_NEW:
        print(f"[{case}] greedy step {keep + 1} has margin {margins[keep]:.2e} < {MIN_MARGIN} "
              f"(ids {gen.tolist()}, margins {[round(m, 4) for m in margins]}): keeping the first {keep} ids")
    assert keep >= MIN_KEPT, f"{case}: greedy margins {margins}"
    gen, step_logits = gen[:keep], step_logits[:keep]
    margin = min(margins[:keep])
    assert margin >= MIN_MARGIN
    full = torch.cat([ids[0], gen[:-1]])[None]
    with torch.no_grad():
        full_logits = ref_model(full).logits[0]
    assert full_logits[T_ - 1:].shape == step_logits.shape
    cache_err = (full_logits[T_ - 1:] - step_logits).abs().max().item()
    assert cache_err <= 1e-4, f"{case}: uncached vs cached {cache_err}"
    for v in (logits, att):
        assert torch.isfinite(v).all()
    assert logits.shape == (T_, V)
    return dict(input_ids=ids.contiguous(), logits=logits.contiguous(), generated_ids=gen.contiguous().clone(),
                attentions=att.contiguous()), margin


def gemma3_llama_cpp_note(ref_model, ids):
    """How far the model llama.cpp (pattern 6, scale 1/sqrt(head_dim)) or transformers-from-the-file
    (pattern 6, query_pre_attn_scalar 256) would run is from the reference."""
    c = ref_model.config
    out = {}
    for label, qpas in (("llama.cpp", c.head_dim), ("transformers file-alone", 256)):
        vc = copy.deepcopy(c)
        vc.layer_types = ["sliding_attention"] * c.num_hidden_layers
        vc.query_pre_attn_scalar = qpas
        m = AutoModelForCausalLM.from_config(vc, attn_implementation="eager", dtype=torch.float32).eval()
        m.load_state_dict(ref_model.state_dict())
        with torch.no_grad():
            out[label] = (m(ids).logits[0] - ref_model(ids).logits[0]).abs().max().item()
    print(f"[gemma3] NOTE: the file cannot say query_pre_attn_scalar 24 nor layer 1 being full attention; "
          f"max |logits - reference| if run as llama.cpp would (both layers sliding, scale 16^-0.5): "
          f"{out['llama.cpp']:.3f}; as transformers' defaults would (scalar 256): {out['transformers file-alone']:.3f}")


# ------------------------------------------------------------------- main
def gen_case(case):
    src_dir = os.path.join(FIXTURES, case)
    cfg = json.load(open(os.path.join(src_dir, "config.json")))
    weights = {k: v.astype(np.float32) for k, v in load_file(os.path.join(src_dir, "model.safetensors")).items()}
    ids = torch.from_numpy(load_file(os.path.join(src_dir, "expected.safetensors"))["input_ids"])
    assert ids.dtype == torch.int64 and ids.shape[0] == 1

    paths, loaded = {}, {}
    for qtype in (None, T.Q8_0):
        kind = "q8_0" if qtype else "f32"
        path, back, layout, names = write_case(case, cfg, weights, qtype)
        meta = check_file(case, cfg, weights, path, qtype, layout, names, back)
        paths[kind], loaded[kind] = path, back
        if qtype is not None:
            print(f"[{case}] metadata: " + ", ".join(f"{k}={v!r}" for k, v in meta.items() if not k.startswith("GGUF.")))
            blk0 = [(n, ty.name, tuple(reversed(s))) for n, (ty, s) in layout.items() if not n.startswith("blk.") or n.startswith("blk.0.")]
            print(f"[{case}] q8_0 tensors (block 0 and globals; GGML ne): " + ", ".join(f"{n} {t} {list(s)}" for n, t, s in blk0))

    ref_dir = os.path.join(OUT, f"{case}.q8_0")
    os.makedirs(ref_dir, exist_ok=True)
    save_file(loaded["q8_0"], os.path.join(ref_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(ref_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
        f.write("\n")

    src_model = load_model(src_dir)
    ref_model = load_model(ref_dir)
    assert type(ref_model) is type(src_model)
    rsd = ref_model.state_dict()
    for k, v in loaded["q8_0"].items():  # the directory loads as written, under the family's names
        # (transformers 5 holds GPT-NeoX's head as lm_head; save_pretrained writes embed_out)
        assert torch.equal(rsd[MODEL_KEY.get(k, k)], torch.from_numpy(v)), k
    with torch.no_grad():
        qerr = (ref_model(ids).logits[0] - src_model(ids).logits[0]).abs().max().item()
    print(f"[{case}] {type(ref_model).__name__}: max |logits(q8_0 reference) - logits(source)| = {qerr:.4f}")

    transformers_checks(case, cfg, src_dir, ref_dir, paths, src_model, ref_model, ids)
    if case == "gemma3":
        gemma3_llama_cpp_note(ref_model, ids)

    exp, margin = expected_outputs(case, ref_model, ids)
    save_file({k: v.numpy() for k, v in exp.items()}, os.path.join(ref_dir, "expected.safetensors"),
              metadata={"format": "pt"})
    print(f"[{case}] expected: T={ids.shape[1]} generated={exp['generated_ids'].tolist()} margin={margin:.3f}")
    for p in (paths["f32"], paths["q8_0"], os.path.join(ref_dir, "config.json"), os.path.join(ref_dir, "model.safetensors"),
              os.path.join(ref_dir, "expected.safetensors")):
        print(f"wrote {os.path.relpath(p, ROOT)} ({os.path.getsize(p)} bytes)")


def main():
    os.makedirs(OUT, exist_ok=True)
    print(f"gguf-py {gguf.__file__}, transformers {transformers.__version__}, torch {torch.__version__}")
    for case in CASES:
        gen_case(case)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Generate golden fixtures for tiny random decoders of five more families, from transformers'
own classes, in tests/fixtures/decoders/<case>/ beside the LLaMA-family cases of
scripts/gen_decoder_fixtures.py (whose format they reuse, plus `attentions` and a tokenizer):

    python3 scripts/gen_decoder_family_fixtures.py     # torch, transformers, safetensors, tokenizers

Cases: qwen3 (Qwen3ForCausalLM), gemma3 (Gemma3ForCausalLM, model_type gemma3_text), gpt2
(GPT2LMHeadModel), pythia (GPTNeoXForCausalLM), phi3 (Phi3ForCausalLM).

Deterministic (fixed torch.manual_seed per case), f32 compute, `attn_implementation="eager"`.
Tiny random models (2 layers, vocab 96-128, hidden 32-64).  Weights are initialised by
transformers with the case's seed and `initializer_range` 0.2 (so heads are not uniform and
the logits are not flat), then, under the same seed, every norm is perturbed: RMSNorm and
LayerNorm weights (q_norm/k_norm included) become 1 + 0.2 * N(0, 1) -- stored as 0.2 * N(0, 1)
for Gemma's RMSNorm, which multiplies by (1 + weight) and initialises weight to 0 -- and every
bias (LayerNorm biases, GPT-2's Conv1D and GPT-NeoX's Linear biases) 0.1 * N(0, 1):
transformers initialises those to 1 / 0, which would let a port that ignores them pass.
The embedding row of `pad_token_id` (gemma3, phi3: nn.Embedding's padding_idx) stays zero as
transformers initialises it; the prompts never use it.

One directory per case, `tests/fixtures/decoders/<case>/`, loadable by transformers'
`from_pretrained` as is:

    config.json          the model's config as transformers 5 saves it (`rope_parameters`,
                         `dtype`), keys sorted.  The pre-5 spellings (`rope_theta` /
                         `rope_scaling`, gemma3's `rope_local_base_freq` and
                         `sliding_window_pattern`, gpt_neox's `rotary_pct` / `rotary_emb_base`)
                         are checked to resolve to the same rope parameters.
    model.safetensors    the state dict as `save_pretrained` writes it (F32, HF names; no
                         lm_head.weight for the tied gemma3 / gpt2; GPT-NeoX's head as
                         `embed_out.weight`).
    tokenizer.json       a WordLevel tokenizer (`tokenizers`) whose vocabulary size equals the
                         model's: ids 0..16 are those of ../wordlevel_tokenizer.json (`<unk>`,
                         "the", "cat", ...), 17 `<s>` (bos_token_id), 18 `</s>` (eos_token_id),
                         19 `<pad>` (pad_token_id where the config has one), then plain words;
                         Lowercase normalizer, Whitespace pre-tokenizer, and a post-processor
                         that prepends `<s>`, so encoding the case's prompt text (README) with
                         special tokens gives `input_ids` exactly.
    tokenizer_config.json  `"tokenizer_class": "PreTrainedTokenizerFast"` and the special tokens,
                         so that transformers' AutoTokenizer reads tokenizer.json as is (without
                         it transformers 5 builds the family's own tokenizer class instead).
    expected.safetensors
        input_ids          I64 (1, T)   random prompt of word ids, first token = bos_token_id
        logits             F32 (T, V)   full (uncached) forward on the prompt
        attentions         F32 (L, H, T, T)
                                        eager attention probabilities of that forward
                                        (`output_attentions=True`), batch dimension dropped
        generated_ids      I64 (N,)     greedy `generate(max_new_tokens=N, do_sample=False)`,
                                        N = 8, EOS ignored (eos_token_id = None)
        generation_logits  F32 (T + N - 1, V)
                                        rows 0..T-1: `logits` (the prefill); rows T..: the
                                        raw logits each later token was chosen from
                                        (`output_logits` of generate, steps 2..N).  Row
                                        T - 1 + i is the one generated_ids[i] is the argmax of.

Checked by the script (asserts): prefill hidden states inside generate -> logits == full forward
(1e-5); generate really decoded with the KV cache (one token per step); greedy ids ==
argmax of generation_logits rows T-1..; an uncached forward over prompt + generated[:-1]
reproduces generation_logits (1e-4); top-1/top-2 margin >= 1e-2 on every greedy step;
at least 3 distinct greedy tokens (a continuation that is not stuck on one token);
the forward with output_attentions gives the same logits; attention rows sum to 1 and are 0
above the diagonal; the attentions (1e-5) and logits (1e-4) equal an independent float64
forward from the saved tensors following each family's recipe (as its README row says); the
resolved rope (`inv_freq` per layer type, partial rotary dims) equals an independent
computation; every
norm weight and bias is perturbed (no constant 1-D tensor, no zero bias); gemma3's window is
really applied (the sliding layer's attentions are 0 outside it, the full layer's are not,
logits differ from sliding_window=64 from row `sliding_window` on, in the prefill and in the
cached decode) and its two rope thetas both matter (logits differ with equal thetas);
the tokenizer (`tokenizers` and transformers' AutoTokenizer) encodes the prompt text to
input_ids; everything finite.
"""

import copy
import json
import math
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import safetensors
import tokenizers
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from torch import nn
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig, GPT2Config, GPTNeoXConfig,
                          Phi3Config, Qwen3Config)

transformers.utils.logging.disable_progress_bar()

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "decoders"
README = OUT / "README.md"
N_NEW = 8

VERSIONS = (f"torch {torch.__version__.split('+')[0]}, transformers {transformers.__version__}, "
            f"safetensors {safetensors.__version__}, numpy {np.__version__}, tokenizers {tokenizers.__version__}")
PROVENANCE = f"generated by scripts/gen_decoder_family_fixtures.py ({VERSIONS})"
BEGIN = "<!-- begin: scripts/gen_decoder_family_fixtures.py -->"
END = "<!-- end: scripts/gen_decoder_family_fixtures.py -->"

# ------------------------------------------------------------------- tokenizer
UNK, BOS, EOS, PAD = 0, 17, 18, 19
OLD_WORDS = ["the", "cat", "sat", "on", "mat", "and", "a", "dog", "ran", "to", "it", "was", "tired",
             "because", "street", "cross"]  # ids 1..16, as in ../wordlevel_tokenizer.json
MORE_WORDS = """
after again all also am an animal are as at away back bad be bed big bird blue boat book box boy
bread bright but by can car city cold come could day did do door down each eat eating end every
eye far fast fish for from girl go good green grass had happy has have he her here hill him his
home horse hot house i if in is just kind know last left light like little long look made make man
many may me more morning much my near never new next night no not now of old one only open or
other our out over park play put rain read red road room run said same see she ship short sky slow
small so some soon still stop sun table tall than that then there they thing this time tree under
up very walk warm water way we went what when where which white who will wind with woman word
would yellow yes you young
""".split()
assert len(set(OLD_WORDS + MORE_WORDS)) == len(OLD_WORDS) + len(MORE_WORDS)


def make_tokenizer(vocab_size):
    words = OLD_WORDS + MORE_WORDS
    n_more = vocab_size - 20
    assert 0 < n_more <= len(MORE_WORDS), vocab_size
    vocab = {"<unk>": UNK, **{w: i + 1 for i, w in enumerate(OLD_WORDS)},
             "<s>": BOS, "</s>": EOS, "<pad>": PAD,
             **{w: 20 + i for i, w in enumerate(MORE_WORDS[:n_more])}}
    assert sorted(vocab.values()) == list(range(vocab_size)) and len(words) >= vocab_size - 4
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>", "<pad>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", BOS)])
    assert tok.get_vocab_size() == vocab_size
    return tok


# ------------------------------------------------------------------- cases
SPECIALS = dict(bos_token_id=BOS, eos_token_id=EOS)

CASES = [
    dict(name="qwen3", config_cls=Qwen3Config, seed=131, T=15, family="qwen3",
         what="q_norm/k_norm (RMSNorm over head_dim, per head, before rope); explicit head_dim 16 != "
              "hidden/heads 8 (q_proj 64x32, k/v_proj 32x32, o_proj 32x64); GQA 4/2; no attention bias; "
              "untied lm_head; `sliding_window: null`, `use_sliding_window: false`",
         kw=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                 rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                 initializer_range=0.2, **SPECIALS,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
         old=dict(drop=["rope_parameters"], add={"rope_theta": 1000000.0, "rope_scaling": None})),
    dict(name="gemma3", config_cls=Gemma3TextConfig, seed=1532, T=16, family="gemma3",
         what="Gemma3: embeddings * sqrt(hidden) (an f32 scalar here), (1 + w) RMSNorms incl. q_norm/k_norm, "
              "4 norms per layer (post-attention and post-feedforward norms before the residual adds), "
              "gelu_pytorch_tanh gated MLP, scale query_pre_attn_scalar^-0.5 = 24^-0.5 (head_dim 16); "
              "layer 0 sliding (window 4 < T, rope_theta 10000), layer 1 full (rope_theta 1e6); MQA 4/1; "
              "tied embeddings (no lm_head.weight); no softcapping",
         kw=dict(vocab_size=112, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                 rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
                 sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                 sliding_window_pattern=2, final_logit_softcapping=None, attn_logit_softcapping=None,
                 tie_word_embeddings=True, initializer_range=0.2, pad_token_id=PAD, **SPECIALS,
                 rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
         old=dict(drop=["rope_parameters", "layer_types", "_sliding_window_pattern"],
                  add={"rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None})),
    dict(name="gpt2", config_cls=GPT2Config, seed=133, T=14, family="gpt2",
         what="GPT-2: learned positions (wpe), pre-LayerNorm with biases, Conv1D weights stored (in, out), "
              "fused c_attn = [q, k, v] along the output (columns), gelu_new MLP (n_inner null = 4 * n_embd), scale "
              "head_dim^-0.5, tied lm_head (no lm_head.weight in the file); MHA 4/4",
         kw=dict(vocab_size=96, n_embd=32, n_head=4, n_layer=2, n_positions=64, activation_function="gelu_new",
                 layer_norm_epsilon=1e-5, initializer_range=0.2, **SPECIALS),
         old=None),
    dict(name="pythia", config_cls=GPTNeoXConfig, seed=34, T=17, family="pythia",
         what="GPT-NeoX (Pythia): query_key_value rows grouped per head, [q_h, k_h, v_h] for each head h "
              "(view (T, H, 3*hd) then chunk), partial rotary 0.25 (4 of head_dim 16 dims, rotate_half within them), parallel "
              "residual (x + attn(ln1(x)) + mlp(ln2(x))), LayerNorms and all Linear biases, gelu (erf) MLP, "
              "untied head saved as `embed_out.weight`; MHA 4/4",
         kw=dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=64, hidden_act="gelu", rotary_pct=0.25,
                 rotary_emb_base=10000, use_parallel_residual=True, layer_norm_eps=1e-5,
                 tie_word_embeddings=False, initializer_range=0.2, **SPECIALS),
         old=dict(drop=["rope_parameters"], add={"rotary_pct": 0.25, "rotary_emb_base": 10000})),
    dict(name="phi3", config_cls=Phi3Config, seed=35, T=18, family="phi3",
         what="Phi-3: fused qkv_proj rows = [q (H*hd), k (KV*hd), v (KV*hd)] and gate_up_proj rows "
              "= [gate (I), up (I)] (silu(gate) * up); GQA 4/2; default rope over the whole head "
              "(partial_rotary_factor 1.0), `sliding_window: null` (no window); pad_token_id 19 `<pad>`; "
              "untied lm_head",
         kw=dict(vocab_size=104, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 original_max_position_embeddings=64, rms_norm_eps=1e-5, sliding_window=None,
                 tie_word_embeddings=False, initializer_range=0.2, pad_token_id=PAD, **SPECIALS,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
         old=dict(drop=["rope_parameters"], add={"rope_theta": 10000.0, "rope_scaling": None})),
]


# ------------------------------------------------------------------- helpers
def load(path):
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                attn_implementation="eager").eval()


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def close(a, b, tol, what):
    err = (a - b).abs().max().item()
    assert err <= tol, f"{what}: max abs diff {err:.3g} > {tol}"
    return err


def perturb_(model):
    """Every norm weight to 1 + 0.2 N(0, 1) (Gemma: 0.2 N(0, 1), used as 1 + w), every bias to 0.1 N(0, 1)."""
    norm_params = {}
    for mname, mod in model.named_modules():
        if isinstance(mod, nn.LayerNorm) or "RMSNorm" in type(mod).__name__:
            norm_params[f"{mname}.weight"] = "Gemma" in type(mod).__name__
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in norm_params:
                p.copy_((0.0 if norm_params[n] else 1.0) + 0.2 * torch.randn_like(p))
            elif n.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return norm_params


def head_dim(c):
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def rope_of(c, layer_type):
    """(theta, rotary dims) of a layer of this config, from the resolved rope_parameters."""
    rp = c.rope_parameters
    if "full_attention" in rp or "sliding_attention" in rp:
        rp = rp[layer_type]
    assert rp["rope_type"] == "default", rp
    return rp["rope_theta"], int(head_dim(c) * rp.get("partial_rotary_factor", 1.0))


def inv_freq64(theta, rot):
    return 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))


def rope64(x, pos, theta, rot):
    """x (T, heads, hd); rotate_half rope on the first `rot` dims, the rest passed through."""
    ang = pos[:, None] * inv_freq64(theta, rot)[None, :]                 # (T, rot/2)
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    return torch.cat([xr * cos + torch.cat([-x2, x1], -1) * sin, xp], -1)


def rms64(x, w, eps, plus_one):
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * ((1.0 + w) if plus_one else w)


def ln64(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def gelu_tanh64(x):  # gelu_new / gelu_pytorch_tanh
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def gelu_erf64(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def attend64(q, k, v, scale, window):
    """q (T, H, hd), k/v (T, KV, hd); head h reads kv head h // (H / KV). -> (T, H*hd), probs (H, T, T)."""
    T, H, hd = q.shape
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    qi, ki = torch.arange(T)[:, None], torch.arange(T)[None, :]
    masked = ki > qi
    if window is not None:
        masked |= ki <= qi - window
    p = s.masked_fill(masked, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", p, v).reshape(T, H * hd), p


def forward64(case, c, sd, ids):
    """Logits (T, V) and attentions (L, H, T, T), recomputed in float64 from the saved tensors with
    each family's recipe (as the README rows describe it) -- independent of transformers' modules."""
    sd = {k: v.double() for k, v in sd.items()}
    fam = case["family"]
    ids = ids[0]
    T = ids.shape[0]
    pos = torch.arange(T, dtype=torch.float64)
    H = c.num_attention_heads
    KV = getattr(c, "num_key_value_heads", None) or H
    hd = head_dim(c)
    L = c.num_hidden_layers
    probs = []
    if fam in ("qwen3", "gemma3", "phi3"):
        g = fam == "gemma3"                       # Gemma: (1 + w) norms, 4 norms a layer, tied head
        eps = c.rms_norm_eps
        x = sd["model.embed_tokens.weight"][ids]
        if g:
            # Gemma3TextScaledWordEmbedding: * sqrt(hidden) as a float32 scalar (cast to the weight dtype)
            x = x * float(torch.tensor(c.hidden_size ** 0.5, dtype=torch.float32))
        for i in range(L):
            p = f"model.layers.{i}."
            h = rms64(x, sd[p + "input_layernorm.weight"], eps, g)
            if fam == "phi3":
                qkv = h @ sd[p + "self_attn.qkv_proj.weight"].T
                q, k, v = qkv[:, : H * hd], qkv[:, H * hd: (H + KV) * hd], qkv[:, (H + KV) * hd:]
            else:
                q, k, v = (h @ sd[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
            q, k, v = q.view(T, H, hd), k.view(T, KV, hd), v.view(T, KV, hd)
            if fam in ("qwen3", "gemma3"):     # per head, over head_dim, before rope
                q = rms64(q, sd[p + "self_attn.q_norm.weight"], eps, g)
                k = rms64(k, sd[p + "self_attn.k_norm.weight"], eps, g)
            layer_type = c.layer_types[i] if g else None
            theta, rot = rope_of(c, layer_type)
            q, k = rope64(q, pos, theta, rot), rope64(k, pos, theta, rot)
            scale = c.query_pre_attn_scalar ** -0.5 if g else hd ** -0.5
            window = c.sliding_window if layer_type == "sliding_attention" else None
            a, pr = attend64(q, k, v, scale, window)
            probs.append(pr)
            a = a @ sd[p + "self_attn.o_proj.weight"].T
            if g:
                a = rms64(a, sd[p + "post_attention_layernorm.weight"], eps, True)
            x = x + a
            h = rms64(x, sd[p + ("pre_feedforward_layernorm.weight" if g else "post_attention_layernorm.weight")], eps, g)
            if fam == "phi3":
                gate, up = (h @ sd[p + "mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
            else:
                gate, up = h @ sd[p + "mlp.gate_proj.weight"].T, h @ sd[p + "mlp.up_proj.weight"].T
            act = gelu_tanh64(gate) if g else torch.nn.functional.silu(gate)
            m = (act * up) @ sd[p + "mlp.down_proj.weight"].T
            if g:
                m = rms64(m, sd[p + "post_feedforward_layernorm.weight"], eps, True)
            x = x + m
        x = rms64(x, sd["model.norm.weight"], eps, g)
        logits = x @ sd["model.embed_tokens.weight" if g else "lm_head.weight"].T
    elif fam == "gpt2":
        eps = c.layer_norm_epsilon
        x = sd["transformer.wte.weight"][ids] + sd["transformer.wpe.weight"][:T]
        for i in range(L):
            p = f"transformer.h.{i}."
            h = ln64(x, sd[p + "ln_1.weight"], sd[p + "ln_1.bias"], eps)
            qkv = h @ sd[p + "attn.c_attn.weight"] + sd[p + "attn.c_attn.bias"]   # Conv1D: weight (in, out)
            q, k, v = (t.reshape(T, H, hd) for t in qkv.split(c.n_embd, dim=-1))
            a, pr = attend64(q, k, v, hd ** -0.5, None)
            probs.append(pr)
            x = x + a @ sd[p + "attn.c_proj.weight"] + sd[p + "attn.c_proj.bias"]
            h = ln64(x, sd[p + "ln_2.weight"], sd[p + "ln_2.bias"], eps)
            m = gelu_tanh64(h @ sd[p + "mlp.c_fc.weight"] + sd[p + "mlp.c_fc.bias"])
            x = x + m @ sd[p + "mlp.c_proj.weight"] + sd[p + "mlp.c_proj.bias"]
        x = ln64(x, sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"], eps)
        logits = x @ sd["transformer.wte.weight"].T
    elif fam == "pythia":
        eps = c.layer_norm_eps
        x = sd["gpt_neox.embed_in.weight"][ids]
        theta, rot = rope_of(c, None)
        for i in range(L):
            p = f"gpt_neox.layers.{i}."
            h = ln64(x, sd[p + "input_layernorm.weight"], sd[p + "input_layernorm.bias"], eps)
            qkv = h @ sd[p + "attention.query_key_value.weight"].T + sd[p + "attention.query_key_value.bias"]
            qkv = qkv.view(T, H, 3 * hd)                                  # per head: [q_h, k_h, v_h]
            q, k, v = qkv[..., :hd], qkv[..., hd: 2 * hd], qkv[..., 2 * hd:]
            q, k = rope64(q, pos, theta, rot), rope64(k, pos, theta, rot)
            a, pr = attend64(q, k, v, hd ** -0.5, None)
            probs.append(pr)
            a = a @ sd[p + "attention.dense.weight"].T + sd[p + "attention.dense.bias"]
            h2 = ln64(x, sd[p + "post_attention_layernorm.weight"], sd[p + "post_attention_layernorm.bias"], eps)
            m = gelu_erf64(h2 @ sd[p + "mlp.dense_h_to_4h.weight"].T + sd[p + "mlp.dense_h_to_4h.bias"])
            m = m @ sd[p + "mlp.dense_4h_to_h.weight"].T + sd[p + "mlp.dense_4h_to_h.bias"]
            assert c.use_parallel_residual
            x = x + a + m                                                  # parallel residual
        x = ln64(x, sd["gpt_neox.final_layer_norm.weight"], sd["gpt_neox.final_layer_norm.bias"], eps)
        logits = x @ sd["embed_out.weight"].T
    else:
        raise ValueError(fam)
    return logits, torch.stack(probs)


def old_form_config(cfg, old):
    """transformers-5 config.json dict -> the pre-5 spelling of its rope fields (for a load check)."""
    cfg = {k: v for k, v in cfg.items() if k not in old["drop"]}
    cfg.update(old["add"])
    cfg["torch_dtype"] = cfg.pop("dtype")
    return cfg


# ------------------------------------------------------------------- one case
def gen_case(case):
    name = case["name"]
    d = OUT / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)

    torch.manual_seed(case["seed"])
    config = case["config_cls"](**case["kw"])
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    norm_params = perturb_(ref)
    tied = config.tie_word_embeddings
    if tied:
        assert ref.get_output_embeddings().weight.data_ptr() == ref.get_input_embeddings().weight.data_ptr()

    with tempfile.TemporaryDirectory() as tmp:
        ref.save_pretrained(tmp)
        cfg = json.loads((Path(tmp) / "config.json").read_text())
        shutil.copy(Path(tmp) / "model.safetensors", d / "model.safetensors")
    write_json(d / "config.json", cfg)
    V = config.vocab_size
    tok = make_tokenizer(V)
    tok.save(str(d / "tokenizer.json"), pretty=True)
    # without it, transformers 5's AutoTokenizer picks the family's tokenizer class (Qwen2Tokenizer,
    # GemmaTokenizer, ...), which rebuilds its own pipeline instead of reading tokenizer.json as is
    write_json(d / "tokenizer_config.json",
               {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 64})

    # ---- the state dict as saved
    sd = load_file(str(d / "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in sd.values())
    head_names = {"lm_head.weight", "embed_out.weight"}
    assert bool(head_names & set(sd)) == (not tied), sorted(sd)
    for k, v in sd.items():
        assert torch.isfinite(v).all(), k
        if v.dim() == 1:
            assert v.std() > 0.05, f"{name}: {k} looks unperturbed"
        if k.endswith(".bias"):
            assert v.abs().min() > 0, f"{name}: {k} has zero entries"
    n_norms = len(norm_params)
    assert n_norms >= 2 * config.num_hidden_layers + 1
    if case["family"] in ("qwen3", "gemma3"):
        assert all(f"{'model.layers.%d.self_attn.' % i}{n}_norm.weight" in sd for i in range(2) for n in "qk")
        assert all(not sd[k].eq(0).any() for k in sd if "norm" in k)

    # ---- reload from the fixture directory and compare to the in-memory model
    model = load(d)
    assert type(model) is type(ref)
    assert model.config._attn_implementation == "eager"
    for k, v in ref.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    c = model.config
    if case["family"] != "gpt2":
        assert c.rope_parameters == ref.config.rope_parameters, (c.rope_parameters, ref.config.rope_parameters)
        # the pre-5 spelling resolves to the same rope (and layer types)
        with tempfile.TemporaryDirectory() as tmp:
            write_json(Path(tmp) / "config.json", old_form_config(cfg, case["old"]))
            c_old = AutoConfig.from_pretrained(tmp)
        assert c_old.rope_parameters == c.rope_parameters, (c_old.rope_parameters, c.rope_parameters)
        if hasattr(c, "layer_types"):
            assert c_old.layer_types == c.layer_types, (c_old.layer_types, c.layer_types)
        print(f"[{name}] rope_parameters: {json.dumps(c.rope_parameters)} (pre-5 spelling "
              f"{json.dumps(case['old']['add'])} resolves the same)")

    # ---- rope, independently
    rot_emb = getattr(model.base_model, "rotary_emb", None)
    if case["family"] == "gemma3":
        for lt in ("sliding_attention", "full_attention"):
            theta, rot = rope_of(c, lt)
            assert rot == head_dim(c)
            close(getattr(rot_emb, f"{lt}_inv_freq").double(), inv_freq64(theta, rot), 1e-6, f"{name} {lt} inv_freq")
            assert getattr(rot_emb, f"{lt}_attention_scaling") == 1.0
        th = [rope_of(c, lt)[0] for lt in ("sliding_attention", "full_attention")]
        assert th[0] != th[1]
    elif rot_emb is not None:
        theta, rot = rope_of(c, None)
        close(rot_emb.inv_freq.double(), inv_freq64(theta, rot), 1e-6, f"{name} inv_freq")
        assert rot_emb.attention_scaling == 1.0
        if case["family"] == "pythia":
            assert rot == 4 and model.base_model.layers[0].attention.rotary_ndims == 4 and head_dim(c) == 16
        else:
            assert rot == head_dim(c)
    if case["family"] == "qwen3":
        assert head_dim(c) == 16 != c.hidden_size // c.num_attention_heads
        assert c.sliding_window is None and not c.use_sliding_window
        assert all(t == "full_attention" for t in c.layer_types)
    if case["family"] == "phi3":
        assert c.sliding_window is None and c.pad_token_id == PAD < V
    if case["family"] == "gemma3":
        assert c.final_logit_softcapping is None and c.attn_logit_softcapping is None
        assert c.query_pre_attn_scalar != head_dim(c)
        assert model.model.embed_tokens.embed_scale.dtype == torch.float32

    # ---- prompt (word ids only, so that the tokenizer round-trips it), full forward
    g = torch.Generator().manual_seed(case["seed"] * 1000 + 1)
    T = case["T"]
    assert 14 <= T <= 18
    words = torch.tensor([i for i in range(V) if i not in (UNK, BOS, EOS, PAD)])
    ids = words[torch.randint(0, len(words), (1, T), generator=g)]
    ids[0, 0] = c.bos_token_id
    assert c.bos_token_id == BOS and c.eos_token_id == EOS
    text = tok.decode(ids[0].tolist(), skip_special_tokens=True)
    assert tok.encode(text).ids == ids[0].tolist(), (text, tok.encode(text).ids)
    hf_tok = AutoTokenizer.from_pretrained(str(d))
    assert hf_tok(text).input_ids == ids[0].tolist(), (type(hf_tok).__name__, hf_tok(text).input_ids)
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (BOS, EOS, PAD)
    with torch.no_grad():
        logits = model(ids).logits[0]
        logits_ref = ref(ids).logits[0]
        out_att = model(ids, output_attentions=True)
    assert logits.shape == (T, V)
    assert torch.equal(logits, logits_ref), f"{name}: reloaded model changes the logits"
    close(out_att.logits[0], logits, 1e-6, f"{name} logits with output_attentions")
    assert logits.std(-1).min() > 0.3, f"{name}: logits too flat {logits.std(-1).min()}"
    att = torch.stack([a[0] for a in out_att.attentions])
    assert att.shape == (c.num_hidden_layers, c.num_attention_heads, T, T), att.shape
    close(att.sum(-1), torch.ones_like(att.sum(-1)), 1e-5, f"{name} attention rows sum")
    upper = torch.ones(T, T, dtype=torch.bool).triu(1)
    assert att[:, :, upper].abs().max() == 0, f"{name}: attention above the diagonal"
    # heads are not uniform: the max weight of the last row is well above 1/T
    assert att[:, :, -1].max(-1).values.min() > 1.5 / T, att[:, :, -1].max(-1).values
    logits64, att64 = forward64(case, c, sd, ids)
    att_err = close(att.double(), att64, 1e-5, f"{name} attentions vs float64 recipe")
    f64_err = close(logits.double(), logits64, 1e-4, f"{name} logits vs float64 recipe")

    # ---- greedy generate with KV cache, capturing the hidden states of every step
    seen = []
    hook = model.base_model.register_forward_hook(lambda m, a, o: seen.append(o.last_hidden_state.detach()))
    # EOS ignored: generate fills unset (None) arguments from model.generation_config
    # (eos_token_id from config.json), so clear it there, not only in the call.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW,
                             do_sample=False, eos_token_id=None, output_logits=True,
                             output_scores=True, return_dict_in_generate=True)
    hook.remove()
    gen = out.sequences[0, T:]
    assert gen.shape == (N_NEW,), gen.shape
    assert torch.equal(out.sequences[0, :T], ids[0])
    assert len(out.logits) == N_NEW
    assert [h.shape[1] for h in seen] == [T] + [1] * (N_NEW - 1), [h.shape for h in seen]
    with torch.no_grad():
        prefill_logits = model.get_output_embeddings()(seen[0][0])
    close(prefill_logits, logits, 1e-5, f"{name} generate-prefill vs forward")
    close(out.logits[0][0], logits[-1], 1e-5, f"{name} first output_logits vs forward row T-1")
    for s, l in zip(out.scores, out.logits):
        assert torch.equal(s, l)  # no logits processors in play
    gen_logits = torch.cat([logits, torch.stack([l[0] for l in out.logits[1:]])])
    assert gen_logits.shape == (T + N_NEW - 1, V)
    assert torch.equal(gen_logits[T - 1:].argmax(-1), gen), (gen_logits[T - 1:].argmax(-1), gen)
    top2 = gen_logits[T - 1:].topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    assert margin >= 1e-2, f"{name}: greedy margin {margin}"
    assert len(set(gen.tolist())) >= 3, f"{name}: degenerate greedy continuation {gen.tolist()}"
    full_seq = torch.cat([ids[0], gen[:-1]])[None]
    with torch.no_grad():
        full_logits = model(full_seq).logits[0]
    cache_err = close(full_logits, gen_logits, 1e-4, f"{name} uncached vs cached decode")
    cache = getattr(out, "cache", None) or out.past_key_values
    cache_desc = ", ".join(f"{type(layer).__name__} keys {tuple(layer.keys.shape)}" for layer in cache.layers)
    print(f"[{name}] generate cache: {cache_desc}")

    # ---- gemma3: the window and both thetas really matter
    if case["family"] == "gemma3":
        W = c.sliding_window
        assert W < T and c.layer_types == ["sliding_attention", "full_attention"]
        with torch.no_grad():
            att_full = model(full_seq, output_attentions=True).attentions
        L = full_seq.shape[1]
        qi, ki = torch.arange(L)[:, None], torch.arange(L)[None, :]
        outside = (ki > qi) | (ki <= qi - W)
        assert att_full[0][0][:, outside].abs().max() == 0, "sliding layer attends outside its window"
        assert (att_full[0][0][:, ~outside] > 0).all()
        beyond = (ki <= qi - W)
        assert (att_full[1][0][:, beyond] > 0).all(), "the full layer should attend beyond the window"

        def variant(edit):
            vc = copy.deepcopy(c)
            edit(vc)
            m = AutoModelForCausalLM.from_config(vc, attn_implementation="eager", dtype=torch.float32).eval()
            m.load_state_dict(model.state_dict())
            with torch.no_grad():
                return m(full_seq).logits[0]

        def widen(vc):
            vc.sliding_window = 64

        diff = (variant(widen) - gen_logits).abs().amax(-1)
        assert diff[:W].max() < 1e-5, diff
        assert diff[W:].min() > 1e-3, diff
        print(f"[{name}] |logits - logits(sliding_window=64)| per row: rows <{W}: {diff[:W].max():.2e}, "
              f"rows >={W} (prefill) min {diff[W:T].min():.3f}, (cached decode) min {diff[T:].min():.3f}")
        for lt, other in (("sliding_attention", "full_attention"), ("full_attention", "sliding_attention")):
            def same_theta(vc, lt=lt, other=other):
                vc.rope_parameters = copy.deepcopy(vc.rope_parameters)
                vc.rope_parameters[lt]["rope_theta"] = vc.rope_parameters[other]["rope_theta"]
            dt = (variant(same_theta) - gen_logits).abs().max().item()
            assert dt > 1e-3, (lt, dt)
            print(f"[{name}] max |logits - logits({lt} theta := {other} theta)| = {dt:.3f}")

    for v in (logits, gen_logits, att):
        assert torch.isfinite(v).all()

    save_file({"input_ids": ids.contiguous(), "logits": logits.contiguous(), "attentions": att.contiguous(),
               "generated_ids": gen.contiguous().clone(), "generation_logits": gen_logits.contiguous()},
              str(d / "expected.safetensors"), metadata={"format": "pt"})
    print(f"[{name}] T={T} prompt={text!r} generated={gen.tolist()} margin={margin:.3f} "
          f"logit std={logits.std().item():.2f} cached-vs-uncached={cache_err:.1e} vs-f64-recipe: att {att_err:.1e} logits {f64_err:.1e}")
    n_params = sum(v.numel() for v in sd.values())
    return dict(case=case, config=c, cfg=cfg, T=T, n_params=n_params, text=text, sd=sd)


# ------------------------------------------------------------------- README
def rope_desc(c, fam):
    if fam == "gpt2":
        return "none (learned `wpe` positions)"
    if fam == "gemma3":
        return ", ".join(f"{lt}: rope_theta {c.rope_parameters[lt]['rope_theta']:g}"
                         for lt in ("sliding_attention", "full_attention"))
    rp = c.rope_parameters
    s = f"{rp['rope_type']}, rope_theta {rp['rope_theta']:g}"
    if "partial_rotary_factor" in rp:
        s += f", partial_rotary_factor {rp['partial_rotary_factor']:g}"
    return s


def sizes_desc(r):
    c, fam = r["config"], r["case"]["family"]
    I = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * c.hidden_size
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return (f"V={c.vocab_size} D={c.hidden_size} L={c.num_hidden_layers} H={c.num_attention_heads} "
            f"KV={kv} hd={head_dim(c)} I={I}; T={r['T']} N={N_NEW}; {r['n_params']} params")


def write_readme(results):
    rows = []
    for r in results:
        c, case = r["config"], r["case"]
        rows.append(f"| `{case['name']}` | {r['cfg']['architectures'][0]} (`{c.model_type}`) | "
                    f"{case['what']}. Rope: {rope_desc(c, case['family'])} | new: as transformers 5 writes it | "
                    f"{sizes_desc(r)} |")
    prompts = "\n".join(f"- `{r['case']['name']}`: \"{r['text']}\"" for r in results)
    doc = "Deterministic" + __doc__.split("\nDeterministic", 1)[1].split("\nChecked by")[0].rstrip()
    checks = "Checked" + __doc__.split("\nChecked", 1)[1].rstrip()
    section = f"""{BEGIN}
## Other decoder families

Tiny random decoders of five more families and their transformers outputs, {PROVENANCE}.
Regenerate with `python3 scripts/gen_decoder_family_fixtures.py` (it rewrites only these case
directories and this section; scripts/gen_decoder_fixtures.py rewrites the whole file).

| case | model class | exercises | config form | sizes |
|---|---|---|---|---|
{chr(10).join(rows)}

Prompts (the case's tokenizer.json encodes each, special tokens added, to `input_ids`):

{prompts}

### Format

{doc}

{checks}

Gemma3's window follows transformers (as Mistral's above): in a `sliding_attention` layer query
position q attends key positions q - sliding_window + 1 ..= q.
{END}
"""
    text = README.read_text() if README.exists() else "# Decoder golden fixtures\n"
    text = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END) + r"\n?", "", text, flags=re.S)
    README.write_text(text.rstrip("\n") + "\n\n" + section)


def main():
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    results = [gen_case(c) for c in CASES]
    write_readme(results)
    total = 0
    for r in results:
        d = OUT / r["case"]["name"]
        for p in sorted(d.iterdir()):
            total += p.stat().st_size
            print(f"{str(p.relative_to(OUT)):40} {p.stat().st_size:>9}")
    print(f"{'total (these cases)':40} {total:>9}")
    assert total < 1.2 * 1024 * 1024, total
    for r in results:
        print(f"\n[{r['case']['name']}] tensors of model.safetensors (layer 0 and non-layer):")
        for k, v in sorted(r["sd"].items()):
            if not re.search(r"\.(h|layers)\.[1-9]", k):
                print(f"    {k:55} {tuple(v.shape)}")
    print(VERSIONS)


if __name__ == "__main__":
    main()

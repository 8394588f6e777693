#!/usr/bin/env python3
"""Golden fixtures of a tiny random ModernBERT encoder, from transformers' own
`ModernBertModel` (eager attention, float32):

    tests/fixtures/encoders/modernbert/     the format of scripts/gen_encoder_family_fixtures.py
    tests/fixtures/explain/modernbert.json  the format of scripts/gen_explain_fixtures.py

    python3 scripts/gen_modernbert_fixtures.py     # torch, transformers, tokenizers, safetensors

Run from anywhere (paths are resolved against the repository root); no network, no GPU.

Encoder fixture (tests/fixtures/encoders/modernbert/), exactly the layout of the other
encoder families (read gen_encoder_family_fixtures.py's docstring):

    config.json, tokenizer.json, tokenizer_config.json, model.safetensors (F32)
    expected.safetensors
        <i>.input_ids          I64 (1, T)          the tokenizer's ids (specials added)
        <i>.attentions         F32 (L, H, T, T)    eager attention, output_attentions=True
        <i>.last_hidden_state  F32 (1, T, D)       after final_norm
        batch.input_ids        I64 (S, Tmax)       all sentences, right-padded with [PAD]
        batch.attention_mask   I64 (S, Tmax)
        batch.attentions       F32 (L, S, H, Tmax, Tmax)
    expected.json              the sentences, in order

The model: hidden 32, 4 heads (head_dim 8), intermediate 48 (so the fused GeGLU `Wi` is
(96, 32)), 3 layers with `global_attn_every_n_layers` 2, i.e. layer_types
[full_attention, sliding_attention, full_attention], local_attention 4 (the sliding layer
sees |i - j| <= 4 // 2 = 2 only, far shorter than the sentences), RoPE theta 160000 for the
full layers and 10000 for the sliding one, exact-erf GELU, LayerNorms without bias (eps 1e-5),
no linear biases, max_position_embeddings 64.  Weights are drawn wider than the default init
(normal(0, 0.2) matrices and embeddings, LayerNorm weights 1 + 0.2 N(0, 1)) so that heads
are not uniform.

The tokenizer is built like ModernBERT's own: a byte-level BPE (no prefix space) trained
here on gen_encoder_family_fixtures.CORPUS, whose specials are ADDED tokens at the END of
the vocabulary in ModernBERT's order ([UNK], [CLS], [SEP], [PAD], [MASK]; [MASK] lstrip), a
TemplateProcessing post-processor "[CLS] $A [SEP]" (pair "[CLS] $A [SEP] $B:1 [SEP]:1"),
and `model_input_names` input_ids / attention_mask (no token types).  As in the released
checkpoints, config.vocab_size (320) is larger than the tokenizer (300 tokens): the extra
embedding rows are never read.

Sentences: gen_encoder_family_fixtures.SENTENCES[1:] (the first sentence tokenizes to 40+
byte-level pieces with this small vocabulary; its (L, S, H, T, T) batch would not fit the
size budget).

Checks (asserts), beyond the format's: the eager path is used; every attention row sums to 1;
the heads are not uniform; (a) in the sliding layer the weights are exactly 0 where
|i - j| > local_attention // 2 and only there, and the full layers have no zero at all;
(b) a copy with local_attention 64 gives other attentions and hidden states; (c) a copy
with the two rope thetas swapped gives other attentions in EVERY layer, and a copy with only
the sliding theta changed leaves layer 0 (full) unchanged and changes layer 1 (sliding);
(d) every padded batch row equals its sentence alone on the real tokens (attentions and last
hidden state, 1e-5); the largest differences are printed.  The config transformers writes
(layer_types + rope_parameters) is also rebuilt from the legacy Hub fields
(global_attn_every_n_layers, global_rope_theta, local_rope_theta) and must be the same.
`reference_forward` recomputes every sentence and every padded batch row from the state dict
alone with the math spelled out (embeddings LayerNorm, no position table; RoPE on q and k with
rotate_half over the whole head_dim, theta by layer type; scale head_dim**-0.5; the window
|i - j| <= local_attention // 2; GeGLU = Wo(gelu(first half of Wi x) * second half);
final_norm) and must match transformers to 1e-5 (attentions) / 1e-4 (hidden); the same
function with the GeGLU halves swapped, or with GPT-J style interleaved RoPE, must not.

Explain fixture (tests/fixtures/explain/modernbert.json): rollout, grad (cosine of the
mean-pooled, L2-normalised embeddings of `text` and `against`) and norm, as defined in
gen_explain_fixtures.py, with the same JSON layout as roberta.json / minilm.json.  The
functions of gen_explain_fixtures.py (`rollout`, `grad_relevance`, `value_norms`,
`check_results`, `check_finite_difference`, ...) and gen_explain_family_fixtures.py
(`capture`, `check_decomposition`, the two RoBERTa text / against pairs) are used as they
are.  norm (Kobayashi): f_h(x_j) = (x_j W_V^h) W_O^h with
* x_j = `layers[l].attn_norm(hidden_states[l])`, the tensor the attention reads (pre-LN;
  layer 0's attn_norm is the Identity, so there x_j is the embeddings' output
  hidden_states[0] = LayerNorm(tok_embeddings(ids)));
* W_V^h = rows 2*D + h*dh : 2*D + (h+1)*dh of `attn.Wqkv.weight` (D = hidden = heads*dh):
  the Wqkv output is viewed as (..., 3, heads, dh) and unbound into q, k, v, i.e. three
  D-row blocks [q; k; v], each head-major -- NOT GPT-NeoX's per-head interleave;
* W_O^h = `attn.Wo.weight[:, h*dh:(h+1)*dh].T`; no biases anywhere (attention_bias False).
The decomposition check (sum_h A_h x W_V^h W_O^h == the captured Wo output, 1e-5) proves the
slices, and the per-head interleaved reading of Wqkv is checked to FAIL it.

Deterministic: `torch.manual_seed`, one CPU thread, eval mode (every dropout is the
identity), float32; the float64 copy serves the finite-difference check only.
"""

import contextlib
import copy
import json
import re
import shutil
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModel, AutoTokenizer, ModernBertConfig, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_encoder_family_fixtures as enc_fx  # noqa: E402
import gen_explain_family_fixtures as fam_fx  # noqa: E402
import gen_explain_fixtures as base  # noqa: E402

transformers.utils.logging.disable_progress_bar()

ROOT = enc_fx.ROOT
NAME = "modernbert"
MODEL_DIR = f"tests/fixtures/encoders/{NAME}"
OUT = enc_fx.OUT / NAME
GENERATOR = "scripts/gen_modernbert_fixtures.py"
SEED = 34

SENTENCES = enc_fx.SENTENCES[1:]
EXPLAIN_CASES = fam_fx.ROBERTA_CASES

BPE_VOCAB = 295  # + 5 specials = 300 tokens
CONFIG_VOCAB = 320
SPECIALS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
LOCAL_ATTENTION = 4
GLOBAL_THETA = 160_000.0
LOCAL_THETA = 10_000.0
WHAT = ("byte-level BPE with [CLS]/[SEP] specials at the end of the vocab, layers "
        "[full, sliding (local_attention 4), full], rope theta 160000 / 10000, GeGLU, "
        "bias-free LayerNorms, no attn_norm in layer 0, vocab_size 320 > 300 tokens")
PAD_TOL = 1e-5


# ----------------------------------------------------------------------------- building


def modernbert_bpe():
    """A byte-level BPE as ModernBERT's: specials added after the trained vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(enc_fx.CORPUS, trainer)
    assert tok.get_vocab_size() == BPE_VOCAB
    tok.add_special_tokens([AddedToken(s, lstrip=(s == "[MASK]"), normalized=False, special=True)
                            for s in SPECIALS])
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    assert list(ids.values()) == list(range(BPE_VOCAB, BPE_VOCAB + len(SPECIALS))), ids
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]",
                                   model_input_names=["input_ids", "attention_mask"]), ids


def make_config(ids, **over):
    kw = dict(
        vocab_size=CONFIG_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, hidden_activation="gelu", max_position_embeddings=64, norm_eps=1e-5,
        norm_bias=False, attention_bias=False, mlp_bias=False, attention_dropout=0.0, embedding_dropout=0.0,
        mlp_dropout=0.0, local_attention=LOCAL_ATTENTION, global_attn_every_n_layers=2,
        global_rope_theta=GLOBAL_THETA, local_rope_theta=LOCAL_THETA, pad_token_id=ids["[PAD]"],
        cls_token_id=ids["[CLS]"], sep_token_id=ids["[SEP]"], bos_token_id=ids["[CLS]"],
        eos_token_id=ids["[SEP]"])
    kw.update(over)
    return ModernBertConfig(**kw)


def widen_(model):
    norms = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)}
    with torch.no_grad():
        for n, p in model.named_parameters():
            assert not n.endswith(".bias"), f"unexpected bias {n}"
            if n in norms:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))


def variant(model, **over):
    """A model with the same weights and an edited config (rope buffers rebuilt)."""
    cfg = copy.deepcopy(model.config)
    for k, v in over.items():
        setattr(cfg, k, v)
    m = AutoModel.from_config(cfg, attn_implementation="eager").eval()
    missing, unexpected = m.load_state_dict(model.state_dict(), strict=True)
    assert not missing and not unexpected
    return m


# ----------------------------------------------------------------------------- encoder fixture


def run(model, ids, mask=None):
    with torch.no_grad():
        o = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    return torch.stack(o.attentions, 0), o.last_hidden_state


def reference_forward(sd, cfg, ids, mask=None, gate_first=False, interleaved_rope=False):
    """ModernBERT's math from the state dict alone (see the module docstring), for one
    sequence: ids (T,), mask (T,) of 0/1.  Returns (attentions (L, H, T, T), hidden (T, D)).
    gate_first / interleaved_rope give the WRONG variants, for negative checks."""
    f = torch.nn.functional
    d, heads = cfg.hidden_size, cfg.num_attention_heads
    dh, inter, eps = d // heads, cfg.intermediate_size, cfg.norm_eps
    t = ids.shape[0]
    ln = lambda x, name: f.layer_norm(x, (d,), sd[name], None, eps)  # noqa: E731
    x = ln(sd["embeddings.tok_embeddings.weight"][ids], "embeddings.norm.weight")  # no positions
    pos = torch.arange(t, dtype=torch.float32)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    keep = torch.ones(t, t, dtype=torch.bool) if mask is None else mask.bool()[None, :].expand(t, t)
    atts = []
    for l, kind in enumerate(cfg.layer_types):
        theta = cfg.rope_parameters[kind]["rope_theta"]
        inv = 1.0 / theta ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh)
        ang = pos[:, None] * inv[None, :]  # (T, dh/2)
        cos, sin = ang.cos(), ang.sin()

        def rope(v):  # v (H, T, dh); rotate_half over the whole head_dim (NeoX halves)
            if interleaved_rope:
                a, b = v[..., 0::2], v[..., 1::2]
                return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
            a, b = v[..., : dh // 2], v[..., dh // 2:]
            return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

        p = f"layers.{l}."
        h = x if l == 0 else ln(x, p + "attn_norm.weight")  # layer 0: no attn_norm
        qkv = (h @ sd[p + "attn.Wqkv.weight"].T).view(t, 3, heads, dh)  # blocks [q; k; v]
        q, k, v = (qkv[:, s].transpose(0, 1) for s in range(3))  # (H, T, dh)
        scores = rope(q) @ rope(k).transpose(1, 2) * dh ** -0.5
        allowed = keep
        if kind == "sliding_attention":
            allowed = allowed & ((i - j).abs() <= cfg.local_attention // 2)
        # a padding query with no real key in its window has no allowed key at all: its row
        # is set to 0 here (transformers' finfo.min bias gives it a uniform row instead);
        # real rows never read it (padding keys get weight 0 from real queries)
        a = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
        atts.append(a)
        o = (a @ v).transpose(0, 1).reshape(t, d)
        x = x + o @ sd[p + "attn.Wo.weight"].T
        m = ln(x, p + "mlp_norm.weight") @ sd[p + "mlp.Wi.weight"].T
        inp, gate = m[:, :inter], m[:, inter:]
        if gate_first:
            inp, gate = gate, inp
        x = x + (f.gelu(inp) * gate) @ sd[p + "mlp.Wo.weight"].T  # exact erf GELU
    return torch.stack(atts), ln(x, "final_norm.weight")


def check_reference(model, ids, att, hid, mask=None):
    """The from-scratch math equals transformers (1e-5); the wrong variants do not."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    r_att, r_hid = reference_forward(sd, model.config, ids, mask)
    real = int(ids.shape[0] if mask is None else mask.sum())
    e_att = (r_att[..., :real, :] - att[..., :real, :]).abs().max().item()
    e_hid = (r_hid[:real] - hid[:real]).abs().max().item()
    assert e_att < 1e-5 and e_hid < 1e-4, (e_att, e_hid)
    for wrong in ({"gate_first": True}, {"interleaved_rope": True}):
        w_att, w_hid = reference_forward(sd, model.config, ids, mask, **wrong)
        assert (w_hid[:real] - hid[:real]).abs().max() > 1e-2, wrong
    return e_att, e_hid


def check_window(model, att):
    """att (L, H, T, T) of one sentence: zeros exactly outside the sliding window."""
    cfg = model.config
    t = att.shape[-1]
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    outside = (i - j).abs() > cfg.local_attention // 2
    assert outside.any(), "the sentence is not longer than the window"
    for l, kind in enumerate(cfg.layer_types):
        a = att[l]
        if kind == "sliding_attention":
            assert ((a == 0) == outside[None]).all(), f"layer {l}: zero pattern is not |i-j| > window"
        else:
            assert (a > 0).all(), f"layer {l}: a full layer has zero weights"


def check_legacy_config(model):
    """The Hub's legacy fields give the layer types and rope parameters written here."""
    cfg = model.config
    legacy = make_config({"[PAD]": cfg.pad_token_id, "[CLS]": cfg.cls_token_id, "[SEP]": cfg.sep_token_id})
    assert legacy.layer_types == cfg.layer_types == ["full_attention", "sliding_attention", "full_attention"]
    assert legacy.rope_parameters == cfg.rope_parameters, (legacy.rope_parameters, cfg.rope_parameters)
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == GLOBAL_THETA
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == LOCAL_THETA
    assert cfg.sliding_window == LOCAL_ATTENTION // 2
    # default: global_attn_every_n_layers 3 -> [full, sliding, sliding, full, ...]
    assert ModernBertConfig(num_hidden_layers=4).layer_types == [
        "full_attention", "sliding_attention", "sliding_attention", "full_attention"]


def check_config_sensitivity(model, tok):
    """(b) local_attention and (c) the rope thetas change the outputs."""
    enc = tok(SENTENCES[0], return_tensors="pt")
    att, hid = run(model, enc["input_ids"])
    report = {}

    wide = variant(model, local_attention=64)
    w_att, w_hid = run(wide, enc["input_ids"])
    assert torch.equal(w_att[0], att[0]), "local_attention changed a full layer"
    report["local_attention 64: layer 1 attentions"] = (w_att[1] - att[1]).abs().max().item()
    report["local_attention 64: hidden"] = (w_hid - hid).abs().max().item()
    assert report["local_attention 64: layer 1 attentions"] > 1e-2
    assert report["local_attention 64: hidden"] > 1e-2

    swapped = variant(model, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": LOCAL_THETA},
        "sliding_attention": {"rope_type": "default", "rope_theta": GLOBAL_THETA}})
    assert swapped.rotary_emb.full_attention_inv_freq[1] != model.rotary_emb.full_attention_inv_freq[1]
    s_att, s_hid = run(swapped, enc["input_ids"])
    for l in range(att.shape[0]):
        gap = (s_att[l] - att[l]).abs().max().item()
        report[f"thetas swapped: layer {l} attentions"] = gap
        assert gap > 1e-3, f"swapping the thetas changes layer {l} by only {gap}"
    report["thetas swapped: hidden"] = (s_hid - hid).abs().max().item()

    local_only = variant(model, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": GLOBAL_THETA},
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})
    o_att, _ = run(local_only, enc["input_ids"])
    assert torch.equal(o_att[0], att[0]), "the sliding theta changed layer 0 (full)"
    report["sliding theta 500: layer 1 attentions"] = (o_att[1] - att[1]).abs().max().item()
    assert report["sliding theta 500: layer 1 attentions"] > 1e-3
    for k, v in report.items():
        print(f"    {k}: max |diff| {v:.3e}")


def check_padding(out, singles):
    """(d) the padded batch's real blocks equal each sentence alone."""
    mask = out["batch.attention_mask"]
    worst_att, worst_hid = 0.0, 0.0
    for s, (att, hid) in enumerate(singles):
        real = int(mask[s].sum())
        assert real == att.shape[-1]
        b_att = out["batch.attentions"][:, s, :, :real, :real]
        worst_att = max(worst_att, (b_att - att).abs().max().item())
        # padded keys get exactly zero weight from real queries
        assert (out["batch.attentions"][:, s, :, :real, real:] == 0).all()
        b_hid = out["batch.last_hidden_state"][s, :real]
        worst_hid = max(worst_hid, (b_hid - hid[0]).abs().max().item())
    print(f"    padded batch vs alone: attentions max |diff| {worst_att:.3e}, "
          f"last_hidden_state max |diff| {worst_hid:.3e}")
    assert worst_att < PAD_TOL and worst_hid < PAD_TOL, (worst_att, worst_hid)


def gen_encoder():
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    tok, ids = modernbert_bpe()
    tok.save_pretrained(str(OUT))
    torch.manual_seed(SEED)
    model = AutoModel.from_config(make_config(ids), attn_implementation="eager").eval()
    widen_(model)
    model.save_pretrained(str(OUT), safe_serialization=True)
    for extra in ["special_tokens_map.json", "generation_config.json"]:
        (OUT / extra).unlink(missing_ok=True)

    model = AutoModel.from_pretrained(str(OUT), attn_implementation="eager", dtype=torch.float32).eval()
    assert type(model).__name__ == "ModernBertModel" and model.config._attn_implementation == "eager"
    tok = AutoTokenizer.from_pretrained(str(OUT))
    assert len(tok) == BPE_VOCAB + len(SPECIALS) < model.config.vocab_size
    assert tok.pad_token_id == model.config.pad_token_id
    assert tok.cls_token_id == model.config.cls_token_id and tok.sep_token_id == model.config.sep_token_id
    check_legacy_config(model)

    out, singles = {}, []
    for i, text in enumerate(SENTENCES):
        enc = tok(text, return_tensors="pt")
        assert set(enc) == {"input_ids", "attention_mask"}, set(enc)
        t_ids = enc["input_ids"][0].tolist()
        assert t_ids[0] == ids["[CLS]"] and t_ids[-1] == ids["[SEP]"]
        att, hid = run(model, enc["input_ids"], enc["attention_mask"])
        att = att[:, 0]
        assert ((att.sum(-1) - 1).abs() < 1e-5).all()
        check_window(model, att)
        out[f"{i}.input_ids"] = enc["input_ids"].to(torch.int64)
        out[f"{i}.attentions"] = att.contiguous()
        out[f"{i}.last_hidden_state"] = hid.contiguous()
        singles.append((att, hid))
        e_att, e_hid = check_reference(model, enc["input_ids"][0], att, hid[0])
        print(f"    sentence {i}: {len(t_ids)} tokens; from-scratch reference: attentions {e_att:.1e}, "
              f"hidden {e_hid:.1e}")
    check_config_sensitivity(model, tok)

    batch = tok(SENTENCES, return_tensors="pt", padding=True)
    assert tok.padding_side == "right"
    att, hid = run(model, batch["input_ids"], batch["attention_mask"])
    out["batch.input_ids"] = batch["input_ids"].to(torch.int64)
    out["batch.attention_mask"] = batch["attention_mask"].to(torch.int64)
    out["batch.attentions"] = att.contiguous()
    out["batch.last_hidden_state"] = hid  # for the check only, not saved
    check_padding(out, singles)
    for s, row in enumerate(batch["attention_mask"]):
        check_reference(model, batch["input_ids"][s], att[:, s], hid[s], row)
    del out["batch.last_hidden_state"]

    spread = max(a.max().item() for k, a in out.items() if k.endswith(".attentions"))
    assert spread > 0.5, f"the heads are nearly uniform (max weight {spread})"
    save_file({k: v.contiguous() for k, v in out.items()}, str(OUT / "expected.safetensors"))
    (OUT / "expected.json").write_text(json.dumps(
        {"sentences": SENTENCES, "what": WHAT, "provenance":
         f"generated by {GENERATOR} ({enc_fx.VERSIONS})"}, indent=2) + "\n")
    print(f"{NAME}: vocab {len(tok)} (config {model.config.vocab_size}), "
          f"{sum(p.numel() for p in model.parameters())} params")

    # tests/fixtures/encoders/README.md lists the cases; add (or refresh) this one's line.
    readme = enc_fx.OUT / "README.md"
    if readme.exists():
        text = re.sub(rf"^- `{NAME}`:.*\n", "", readme.read_text(), flags=re.M)
        if not text.endswith("\n"):
            text += "\n"
        readme.write_text(text + f"- `{NAME}`: {WHAT} (scripts/gen_modernbert_fixtures.py)\n")


# ----------------------------------------------------------------------------- explain fixture


def modernbert_family(model):
    cfg = model.config
    d = cfg.hidden_size
    layers = model.layers
    return {
        "layers": layers,
        "attn": [layer.attn for layer in layers],
        "o": [layer.attn.Wo for layer in layers],
        "norm": [layer.attn_norm for layer in layers],
        # Wqkv output viewed as (..., 3, heads, dh): the v block is rows 2*d:3*d, head-major.
        "projections": [(layer.attn.Wqkv.weight.detach()[2 * d:3 * d], None, layer.attn.Wo.weight.detach())
                        for layer in layers],
        "kv_groups": 1,
    }


def interleaved_family(model):
    """The WRONG reading (GPT-NeoX's per-head [q k v] interleave), for a negative check."""
    fam = modernbert_family(model)
    cfg = model.config
    heads, dh = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    fam["projections"] = [
        (layer.attn.Wqkv.weight.detach().reshape(heads, 3, dh, -1)[:, 2].reshape(heads * dh, -1), None,
         layer.attn.Wo.weight.detach()) for layer in model.layers]
    return fam


def explain_case(model, model64, tok, text, against):
    """base.encoder_case with ModernBERT's module names and pre-LN x_j."""
    fam = modernbert_family(model)
    enc = tok(text, return_tensors="pt")
    enc_against = tok(against, return_tensors="pt")

    def embed(m, batch):
        out = m(**batch)
        return torch.nn.functional.normalize(base.mean_pool(out.last_hidden_state, batch["attention_mask"]),
                                             p=2, dim=1)

    with torch.no_grad():
        e_against = embed(model, enc_against)
    with fam_fx.capture(fam) as (inputs, outputs):
        out = model(**enc, output_attentions=True, output_hidden_states=True)
    e_text = torch.nn.functional.normalize(base.mean_pool(out.last_hidden_state, enc["attention_mask"]),
                                           p=2, dim=1)
    y = (e_text * e_against).sum()
    grads = [g[0].detach() for g in torch.autograd.grad(y, out.attentions)]
    attentions = [a[0].detach() for a in out.attentions]
    y = float(y.detach())

    assert isinstance(model.layers[0].attn_norm, torch.nn.Identity)
    assert all(isinstance(layer.attn_norm, torch.nn.LayerNorm) for layer in model.layers[1:])
    with torch.no_grad():
        # .detach(): layer 0's Identity would hand back the graph-carrying hidden_states[0]
        layer_inputs = [norm(h)[0].detach() for norm, h in zip(fam["norm"], out.hidden_states[:-1])]
        # layer 0 reads the embeddings' output itself
        assert torch.equal(layer_inputs[0], model.embeddings(enc["input_ids"])[0])
        res = {
            "rollout": base.rollout(attentions),
            "grad": base.grad_relevance(attentions, grads),
            "norm": base.value_norms(attentions, layer_inputs, fam["projections"], 1),
        }
    base.check_results(attentions, grads, layer_inputs, fam["projections"], 1, res, causal=False)
    dec_err = fam_fx.check_decomposition(fam, attentions, layer_inputs, inputs, outputs)
    with must_raise(AssertionError):
        fam_fx.check_decomposition(interleaved_family(model), attentions, layer_inputs, inputs, outputs)
    check_window(model, torch.stack(attentions))

    with torch.no_grad():
        e_against64 = embed(model64, enc_against)

    def target64(perturb):
        with torch.no_grad(), base.attention_dropout_probe(perturb):
            return float((embed(model64, enc) * e_against64).sum())

    fd_err = base.check_finite_difference(target64, attentions, grads)

    ids = enc["input_ids"][0].tolist()
    base.summary(repr(text), len(ids), y, res, fd_err)
    print(f"    decomposition rel err {dec_err:.1e}")
    return {
        "text": text,
        "against": against,
        "input_ids": ids,
        "tokens": tok.convert_ids_to_tokens(ids),
        "rollout": base.to_list(res["rollout"]),
        "grad": {"target": "cosine", "against": against, "value": y, "matrix": base.to_list(res["grad"])},
        "norm": base.to_list(res["norm"]),
    }


@contextlib.contextmanager
def must_raise(exc):
    try:
        yield
    except exc:
        return
    raise AssertionError(f"expected {exc.__name__}")


def write_explain(cases):
    """base.write with this script's name as "generator"."""
    doc = {
        "generator": GENERATOR,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": MODEL_DIR,
        "cases": cases,
    }
    base.OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = base.OUT_DIR / f"{NAME}.json"
    path.write_text(json.dumps(doc, separators=(",", ":")))
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")


def gen_explain():
    torch.manual_seed(0)
    model = AutoModel.from_pretrained(ROOT / MODEL_DIR, attn_implementation="eager", dtype=torch.float32)
    assert model.config._attn_implementation == "eager"
    model = model.eval()
    tok = AutoTokenizer.from_pretrained(ROOT / MODEL_DIR)
    model64 = copy.deepcopy(model).double()
    print(f"ModernBERT ({MODEL_DIR})")
    write_explain([explain_case(model, model64, tok, **c) for c in EXPLAIN_CASES])


def main():
    torch.set_num_threads(1)
    print(f"ModernBERT encoder fixture ({MODEL_DIR})")
    gen_encoder()
    gen_explain()
    total = sum(p.stat().st_size for p in OUT.iterdir()) + (base.OUT_DIR / f"{NAME}.json").stat().st_size
    print(f"fixtures: {total} bytes in all")
    assert total < 600_000, total


if __name__ == "__main__":
    main()

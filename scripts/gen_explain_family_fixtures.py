#!/usr/bin/env python3
"""Generate golden EXPLAINABILITY fixtures for the model families beside BERT and LLaMA, in
exactly the JSON layout of scripts/gen_explain_fixtures.py (whose docstring defines rollout,
grad and norm; read it first):

    tests/fixtures/explain/roberta.json   ENCODER, the tiny random RoBERTa in
                                          tests/fixtures/encoders/roberta/ (RobertaModel,
                                          2 layers, 4 heads, hidden 32, byte-level BPE,
                                          positions from pad_token_id + 1 = 2)
    tests/fixtures/explain/gemma3.json    DECODER, the tiny random Gemma 3 in
                                          tests/fixtures/decoders/gemma3/ (Gemma3ForCausalLM,
                                          layer 0 sliding (window 4), layer 1 global,
                                          4 heads, 1 kv head, head_dim 16, hidden 32)
    tests/fixtures/explain/pythia.json    DECODER, the tiny random Pythia in
                                          tests/fixtures/decoders/pythia/ (GPTNeoXForCausalLM,
                                          parallel residual, partial rotary 0.25, 4 heads,
                                          hidden 64, fused query_key_value with bias)

Run from anywhere (paths are resolved against the repository root); needs torch and
transformers only, no network, no GPU:

    python3 scripts/gen_explain_family_fixtures.py

Reuse.  scripts/gen_explain_fixtures.py has a `__main__` guard, so it is imported as a module
(`base`) and its functions are used unchanged: `rollout`, `grad_relevance`, `value_norms`,
`check_results` (finite, attention rows sum to 1, grads not all zero, float64 recomputation,
rollout rows sum to 1, norms >= 0, causal => lower triangular), `attention_dropout_probe`
and `check_finite_difference` (the attention dropout is called once per layer, is the
identity on the very tensor returned with `output_attentions=True`, and a float64 central
finite difference through the point where A enters `A @ V` matches autograd's dy/dA, i.e.
the returned attentions ARE the ones multiplied with V, eager path), `to_list`, `summary`,
and, for RoBERTa, `encoder_case` as is (RobertaModel has BERT's module names:
`encoder.layer[l].attention.self.value` and `attention.output.dense`; its tokenizer gives
`input_ids` and `attention_mask` only, and the model derives the positions itself).
`base.decoder_case` hard-codes LLaMA's module names (`model.layers`, `self_attn.v_proj`,
`self_attn.o_proj`), so `decoder_case` below is the same function with the module names and
the W_V / b_V / W_O extraction taken from a per-family description; for Gemma 3 (whose names
are LLaMA's) the result is additionally asserted to be EXACTLY `base.decoder_case`'s.
`write` is re-implemented only to put this script's name in "generator".

Definitions: as in gen_explain_fixtures.py.  rollout and grad are family independent.
y: encoder, the cosine of the mean-pooled, L2-normalised embeddings of `text` and of
`against` (the latter under no_grad); decoder, logits[0, -1, t] with t the greedy next token
unless the case gives "target_token_id".

norm (Kobayashi), norms[l][h][i][j] = A_l[h][i][j] * ||f_h(x_j)||_2 with
f_h(x_j) = (x_j W_V^h + b_V^h) W_O^h, the output projection's bias NOT included, x_j the
tensor the attention of layer l actually reads, dh = head_dim:
* RoBERTa (post-LN, as BERT): x_j = hidden_states[l]; W_V^h, b_V^h = rows h*dh:(h+1)*dh of
  `attention.self.value`; W_O^h = `attention.output.dense.weight[:, h*dh:(h+1)*dh].T`.
* Gemma 3: exactly the LLaMA definition of llama_gqa.json: x_j =
  `layers[l].input_layernorm(hidden_states[l])` (Gemma's RMSNorm, scale 1 + w; the
  embedding is already multiplied by sqrt(hidden) in hidden_states[0]); head h reads kv head
  h // (heads / kv_heads) = 0, i.e. rows kv*dh:(kv+1)*dh of `self_attn.v_proj` (no bias in
  this config); W_O^h = `self_attn.o_proj.weight[:, h*dh:(h+1)*dh].T`.  Gemma 3 applies
  `post_attention_layernorm` to the o_proj output BEFORE the residual add; that norm is
  deliberately NOT part of f_h (it is not linear per token/head, and the LLaMA definition
  stops at W_O).  q_norm / k_norm only change the weights A, which are taken as returned.
* Pythia (GPT-NeoX): x_j = `gpt_neox.layers[l].input_layernorm(hidden_states[l])` (with the
  parallel residual the attention reads LayerNorm(layer input); the MLP's
  post_attention_layernorm branch is irrelevant).  `attention.query_key_value` is fused
  per head: its output is viewed as (heads, 3*dh) and chunked into q, k, v, so head h's
  value rows are h*3*dh + 2*dh : (h+1)*3*dh of its weight and of its bias (bias included,
  b_V^h); W_O^h = `attention.dense.weight[:, h*dh:(h+1)*dh].T` (its bias excluded, as in
  the definition).  Partial rotary touches q and k only.

Checks added here (asserts), beyond base's: forward hooks capture, for every layer, the
hidden states entering the attention module and the output of its output projection (RoBERTa
`attention.output.dense`, before dropout / residual / LayerNorm; Gemma 3 `o_proj`, before
post_attention_layernorm; Pythia `attention.dense`); the x_j used for norm must equal the
captured input exactly, and sum_h A_h (x W_V^h + b_V^h) W_O^h + b_O must reproduce the
captured projection output to 1e-5 of its largest entry (so the per-head W_V / b_V / W_O
slices, in particular Pythia's fused layout, are the ones the model uses).  RoBERTa: the
position ids reaching `embeddings.position_embeddings` are 2, 3, ..., seq + 1.  Gemma 3:
in the sliding layer A[h][i][j] == 0 exactly when i - j >= 4 (or j > i), in the global
layer exactly when j > i.  The greedy token must beat the runner-up by > 1e-3 (base).

Deterministic: `torch.manual_seed(0)`, one CPU thread, eval mode (every dropout is the
identity), float32; the float64 copies serve the checks only.

JSON: identical layout and keys to minilm.json (encoder) / llama_gqa.json (decoder), only
"generator" is "scripts/gen_explain_family_fixtures.py" and "model" is the fixture directory
(no trailing slash).  Cases:
* roberta: the short sentence of each pair is `text` (its (L, H, seq, seq) norm goes into the
  JSON), the long one `against` (only its embedding is used), to keep the file small:
  "A monkey is playing drums." against "The animal didn't cross the street because it was
  too tired."; "Paris is the capital of France." against "Unseen words: zebra quartz!"
  (all four are the sentences of tests/fixtures/encoders/roberta/expected.json).
* gemma3 / pythia: `input_ids` of the fixture's expected.safetensors, its first 10 ids with
  the greedy target, and its first 7 ids with "target_token_id": 5 (both longer than Gemma's
  sliding window 4).
"""

import contextlib
import copy
import json
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_explain_fixtures as base  # noqa: E402

ROOT = base.ROOT
OUT_DIR = base.OUT_DIR
GENERATOR = "scripts/gen_explain_family_fixtures.py"

ROBERTA_DIR = "tests/fixtures/encoders/roberta"
ROBERTA_CASES = [
    {
        "text": "A monkey is playing drums.",
        "against": "The animal didn't cross the street because it was too tired.",
    },
    {"text": "Paris is the capital of France.", "against": "Unseen words: zebra quartz!"},
]

# (prompt length, target_token_id or None for the greedy token)
DECODER_CASES = [(10, None), (7, 5)]

DECOMP_TOL = 1e-5


# ----------------------------------------------------------------------------- families


def _bias(linear):
    return None if linear.bias is None else linear.bias.detach()


def gemma3_family(model):
    cfg = model.config
    layers = model.model.layers
    return {
        "layers": layers,
        "attn": [layer.self_attn for layer in layers],
        "o": [layer.self_attn.o_proj for layer in layers],
        "norm": [layer.input_layernorm for layer in layers],
        "projections": [
            (
                layer.self_attn.v_proj.weight.detach(),
                _bias(layer.self_attn.v_proj),
                layer.self_attn.o_proj.weight.detach(),
            )
            for layer in layers
        ],
        "kv_groups": cfg.num_attention_heads // cfg.num_key_value_heads,
    }


def pythia_family(model):
    cfg = model.config
    heads = cfg.num_attention_heads
    dh = cfg.hidden_size // heads
    layers = model.gpt_neox.layers

    def value_rows(t):
        # query_key_value output is viewed as (..., heads, 3*dh) and chunked into q, k, v:
        # head h's v rows are h*3*dh + 2*dh : (h+1)*3*dh.
        return t.reshape(heads, 3, dh, *t.shape[1:])[:, 2].reshape(heads * dh, *t.shape[1:])

    projections = []
    for layer in layers:
        qkv = layer.attention.query_key_value
        b = _bias(qkv)
        projections.append(
            (
                value_rows(qkv.weight.detach()),
                None if b is None else value_rows(b),
                layer.attention.dense.weight.detach(),
            )
        )
    return {
        "layers": layers,
        "attn": [layer.attention for layer in layers],
        "o": [layer.attention.dense for layer in layers],
        "norm": [layer.input_layernorm for layer in layers],
        "projections": projections,
        "kv_groups": 1,
    }


def roberta_family(model):
    layers = model.encoder.layer
    return {
        "layers": layers,
        "attn": [layer.attention.self for layer in layers],
        "o": [layer.attention.output.dense for layer in layers],
        "norm": None,  # post-LN: the attention reads the layer input itself
        "projections": [
            (
                layer.attention.self.value.weight.detach(),
                _bias(layer.attention.self.value),
                layer.attention.output.dense.weight.detach(),
            )
            for layer in layers
        ],
        "kv_groups": 1,
    }


# ----------------------------------------------------------------------------- checks


@contextlib.contextmanager
def capture(fam):
    """Record each layer's attention input (hidden_states) and output-projection output."""
    inputs, outputs, handles = {}, {}, []

    def pre(l):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            inputs[l] = x.detach().clone()

        return hook

    def post(l):
        def hook(module, args, output):
            outputs[l] = output.detach().clone()

        return hook

    for l, (attn, o) in enumerate(zip(fam["attn"], fam["o"])):
        handles.append(attn.register_forward_pre_hook(pre(l), with_kwargs=True))
        handles.append(o.register_forward_hook(post(l)))
    try:
        yield inputs, outputs
    finally:
        for h in handles:
            h.remove()


def check_decomposition(fam, attentions, layer_inputs, inputs, outputs):
    """x_j is what the attention reads; sum_h A_h V_h W_O^h + b_O is the projection output."""
    assert len(inputs) == len(outputs) == len(attentions)
    worst = 0.0
    for l, (a, x, (w_v, b_v, w_o)) in enumerate(
        zip(attentions, layer_inputs, fam["projections"])
    ):
        assert torch.equal(x, inputs[l][0]), f"layer {l}: x_j is not the attention's input"
        heads = a.shape[0]
        dh = w_o.shape[1] // heads
        total = torch.zeros_like(outputs[l][0], dtype=torch.float64)
        for h in range(heads):
            kv = h // fam["kv_groups"]
            rows = slice(kv * dh, (kv + 1) * dh)
            v = x.double() @ w_v[rows].double().T
            if b_v is not None:
                v = v + b_v[rows].double()
            total += a[h].double() @ v @ w_o[:, h * dh : (h + 1) * dh].double().T
        b_o = fam["o"][l].bias
        if b_o is not None:
            total += b_o.detach().double()
        want = outputs[l][0].double()
        err = float((total - want).abs().max() / want.abs().max())
        assert err < DECOMP_TOL, (l, err)
        worst = max(worst, err)
    return worst


def check_gemma3_window(model, attentions):
    cfg = model.config
    seq = attentions[0].shape[-1]
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    for l, a in enumerate(attentions):
        masked = j > i
        if cfg.layer_types[l] == "sliding_attention":
            masked = masked | (i - j >= cfg.sliding_window)
        assert ((a == 0) == masked[None]).all(), f"layer {l}: unexpected zero pattern"


# ----------------------------------------------------------------------------- cases


def roberta_case(model, model64, tokenizer, text, against):
    case = base.encoder_case(model, model64, tokenizer, text, against)

    # Re-run the forward of `text` with hooks and check the norm decomposition and positions.
    fam = roberta_family(model)
    enc = tokenizer(text, return_tensors="pt")
    assert enc["input_ids"][0].tolist() == case["input_ids"]
    positions = []
    handle = model.embeddings.position_embeddings.register_forward_pre_hook(
        lambda m, args: positions.append(args[0].detach().clone())
    )
    try:
        with torch.no_grad(), capture(fam) as (inputs, outputs):
            out = model(**enc, output_attentions=True, output_hidden_states=True)
    finally:
        handle.remove()
    seq = enc["input_ids"].shape[1]
    pad = model.config.pad_token_id
    assert positions and positions[0][0].tolist() == list(range(pad + 1, pad + 1 + seq))
    attentions = [a[0] for a in out.attentions]
    layer_inputs = [h[0] for h in out.hidden_states[:-1]]
    err = check_decomposition(fam, attentions, layer_inputs, inputs, outputs)
    # the stored norm is the one of these attentions / inputs
    norm = base.value_norms(attentions, layer_inputs, fam["projections"], 1)
    assert base.to_list(norm) == case["norm"]
    print(f"    positions {pad + 1}..{pad + seq}, decomposition rel err {err:.1e}")
    return case


def decoder_case(model, model64, fam, input_ids, target_token_id=None, extra_check=None):
    """base.decoder_case with the family's module names (see the module docstring)."""
    input_ids = torch.tensor([input_ids], dtype=torch.long)
    with capture(fam) as (inputs, outputs):
        out = model(input_ids=input_ids, output_attentions=True, output_hidden_states=True)
    last = out.logits[0, -1]
    token_id = int(last.argmax()) if target_token_id is None else target_token_id
    y = last[token_id]
    grads = [g[0].detach() for g in torch.autograd.grad(y, out.attentions)]
    attentions = [a[0].detach() for a in out.attentions]
    y = float(y.detach())
    top2 = last.detach().topk(2).values
    assert float(top2[0] - top2[1]) > 1e-3, "greedy token is ambiguous"

    kv_groups = fam["kv_groups"]
    with torch.no_grad():
        layer_inputs = [norm(h)[0] for norm, h in zip(fam["norm"], out.hidden_states[:-1])]
    projections = fam["projections"]
    with torch.no_grad():
        res = {
            "rollout": base.rollout(attentions),
            "grad": base.grad_relevance(attentions, grads),
            "norm": base.value_norms(attentions, layer_inputs, projections, kv_groups),
        }
    base.check_results(attentions, grads, layer_inputs, projections, kv_groups, res, causal=True)
    dec_err = check_decomposition(fam, attentions, layer_inputs, inputs, outputs)
    if extra_check is not None:
        extra_check(model, attentions)

    def target64(perturb):
        with torch.no_grad(), base.attention_dropout_probe(perturb):
            return float(model64(input_ids=input_ids).logits[0, -1, token_id])

    fd_err = base.check_finite_difference(target64, attentions, grads)

    label = f"ids[:{input_ids.shape[1]}] " + (
        "greedy" if target_token_id is None else f"target {target_token_id}"
    )
    base.summary(f"{label} -> token {token_id}", input_ids.shape[1], y, res, fd_err)
    print(f"    decomposition rel err {dec_err:.1e}")
    case = {}
    if target_token_id is not None:
        case["target_token_id"] = target_token_id
    case.update(
        {
            "input_ids": input_ids[0].tolist(),
            "rollout": base.to_list(res["rollout"]),
            "grad": {
                "target": "logit",
                "token_id": token_id,
                "value": y,
                "matrix": base.to_list(res["grad"]),
            },
            "norm": base.to_list(res["norm"]),
        }
    )
    return case


# ----------------------------------------------------------------------------- main


def write(name, model_dir, cases):
    """base.write with this script's name as "generator"."""
    doc = {
        "generator": GENERATOR,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": model_dir,
        "cases": cases,
    }
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / name
    path.write_text(json.dumps(doc, separators=(",", ":")))
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")


def load_causal_lm(model_dir):
    model = AutoModelForCausalLM.from_pretrained(
        ROOT / model_dir, attn_implementation="eager", dtype=torch.float32
    )
    assert model.config._attn_implementation == "eager"
    return model.eval()


def decoder_fixture(name, model_dir, family, extra_check=None, same_as_base=False):
    model = load_causal_lm(model_dir)
    model64 = copy.deepcopy(model).double()
    fam = family(model)
    prompt = load_file(ROOT / model_dir / "expected.safetensors")["input_ids"][0].tolist()
    print(f"{type(model).__name__} ({model_dir})")
    cases = []
    for length, target in DECODER_CASES:
        case = decoder_case(
            model, model64, fam, prompt[:length], target, extra_check=extra_check
        )
        if same_as_base:
            # LLaMA's module names: the original function must give the very same fixture.
            with contextlib.redirect_stdout(None):
                assert base.decoder_case(model, model64, prompt[:length], target) == case
        cases.append(case)
    write(name, model_dir, cases)


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)

    path = ROOT / ROBERTA_DIR
    encoder = AutoModel.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    assert encoder.config._attn_implementation == "eager"
    encoder = encoder.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    encoder64 = copy.deepcopy(encoder).double()
    print(f"RoBERTa ({ROBERTA_DIR})")
    cases = [roberta_case(encoder, encoder64, tokenizer, **c) for c in ROBERTA_CASES]
    write("roberta.json", ROBERTA_DIR, cases)

    decoder_fixture(
        "gemma3.json",
        "tests/fixtures/decoders/gemma3",
        gemma3_family,
        extra_check=check_gemma3_window,
        same_as_base=True,
    )
    decoder_fixture("pythia.json", "tests/fixtures/decoders/pythia", pythia_family)


if __name__ == "__main__":
    main()

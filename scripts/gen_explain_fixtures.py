#!/usr/bin/env python3
"""Generate the golden EXPLAINABILITY fixtures in tests/fixtures/explain/ from the real
transformers models (eager attention, f32):

    tests/fixtures/explain/minilm.json      all-MiniLM-L6-v2 from weights/ (BERT encoder)
    tests/fixtures/explain/llama_gqa.json   the tiny random LLaMA in
                                            tests/fixtures/decoders/llama_gqa/ (2 layers,
                                            4 heads, 2 kv heads, hidden 64, vocab 128)

Run from anywhere (paths are resolved against the repository root); needs torch and
transformers only, no network, no GPU:

    /tmp/venv/bin/python scripts/gen_explain_fixtures.py

Deterministic (`torch.manual_seed(0)`, CPU, eval mode, so every dropout is the identity).
MiniLM's f16 checkpoint is widened to f32 on load (exact); everything below is computed in
float32.

Definitions.  A_l is layer l's attention probabilities, shape (heads, seq, seq), for the one
sentence (batch 1), exactly as eager attention returns them with `output_attentions=True`;
L is the number of layers; I is the (seq, seq) identity.

rollout (Abnar & Zuidema 2020)
    Â_l = mean_heads(A_l) + I, then every row of Â_l divided by its row sum;
    R = Â_{L-1} @ ... @ Â_1 @ Â_0   (the LAST layer's matrix leftmost).     -> R (seq, seq)

grad (Chefer, Gur & Wolf 2021, generic self-attention rule)
    y is a scalar target; G_l = dy/dA_l = `torch.autograd.grad(y, attentions)` on the very
    tensors the forward returned (checked below to be the ones multiplied by V);
    Ā_l = mean_heads(clamp(G_l * A_l, min=0));
    R = I; for l = 0, 1, ..., L-1 in order: R = R + Ā_l @ R.          -> y and R (seq, seq)
    * encoder: y = cosine similarity of the mean-pooled (mean of last_hidden_state over the
      attention mask, as sentence-transformers' Pooling) and L2-normalised embeddings of
      `text` and of `against`; `against` is embedded under torch.no_grad, so the gradient
      only flows through the forward of `text`.  Each text is tokenized alone, with its
      special tokens ([CLS] ... [SEP]), no padding.
    * decoder: y = logits[0, -1, t], t = argmax(logits[0, -1]) (the greedy next token)
      unless the case gives "target_token_id".

norm (Kobayashi et al. 2020)
    f_h(x_j) = (x_j W_V^h + b_V^h) W_O^h,   norms[l][h][i][j] = A_l[h][i][j] * ||f_h(x_j)||_2
    with dh = head_dim and, for head h:
    * encoder (BERT): x_j = hidden_states[l] (the input of layer l); W_V^h, b_V^h = rows
      h*dh:(h+1)*dh of `attention.self.value` (weight (out, in), so V_h = x @ W_rows.T + b);
      W_O^h = `attention.output.dense.weight[:, h*dh:(h+1)*dh].T` (its bias is not used).
    * decoder (LLaMA): x_j = `layers[l].input_layernorm(hidden_states[l])` (what attention
      reads); head h reads kv head h // (heads / kv_heads), i.e. those rows of
      `self_attn.v_proj` (+ its bias if the config has one);
      W_O^h = `self_attn.o_proj.weight[:, h*dh:(h+1)*dh].T`.              -> [L][H][seq][seq]

Checks (asserts): every tensor finite; attention rows sum to 1; the grads are not all zero;
the attention dropout is called once per layer on the returned tensor and is the identity
(same object) in eval; for every layer, the largest |G_l| entry matches a float64 central
finite difference obtained by perturbing that entry of A_l where it enters `A @ V` (a
wrapper around torch.nn.functional.dropout, which eager attention applies right before
that matmul; eps 1e-3, since transformers' LLaMA eager attention runs its softmax in f32
even in a float64 model), to 1e-3 of max|G_l|; a float64 recomputation of rollout / grad / norm from
the same (float32) A, G and inputs agrees with the float32 results to 1e-5 of the max
entry; rollout rows sum to 1 (1e-5); norms >= 0; for the decoder, every rollout / grad /
norm matrix is lower triangular (exact zeros above the diagonal).

JSON layout (compact, floats as json writes Python floats from float32 `.tolist()`):

    {"generator": "scripts/gen_explain_fixtures.py", "torch": VERSION,
     "transformers": VERSION, "model": "weights/" | "tests/fixtures/decoders/llama_gqa",
     "cases": [{
        "text", "against"                   encoder only
        "target_token_id"                   decoder case with an explicit target only
        "input_ids": [...],
        "tokens": [...]                     encoder only (convert_ids_to_tokens)
        "rollout": [[...]]                  (seq, seq)
        "grad": {"target": "cosine", "against": TEXT | "target": "logit", "token_id": N,
                 "value": y, "matrix": [[...]]}
        "norm": [[[[...]]]]                 (layers, heads, seq, seq)
     }, ...]}
"""

import contextlib
import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
ENCODER_DIR = "weights/"
DECODER_DIR = "tests/fixtures/decoders/llama_gqa"
OUT_DIR = ROOT / "tests" / "fixtures" / "explain"

ENCODER_CASES = [
    {"text": "The cat sat on the mat.", "against": "A kitten was resting on a rug."},
    {"text": "Paris is the capital of France.", "against": "The capital city of France is Paris."},
    {
        "text": "Transformers changed natural language processing.",
        "against": "I like cooking pasta on Sundays.",
    },
]
DECODER_PROMPT_LEN = 10
DECODER_TARGETS = [None, 5]

F64_REL_TOL = 1e-5
ROW_SUM_TOL = 1e-5
FD_EPS = 1e-3
FD_REL_TOL = 1e-3


# ----------------------------------------------------------------------------- loading


def load_encoder():
    path = ROOT / ENCODER_DIR
    model = AutoModel.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer


def load_decoder():
    path = ROOT / DECODER_DIR
    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    )
    return model.eval()


# ----------------------------------------------------------------------------- methods
# All three take per-layer (heads, seq, seq) tensors and work in the dtype they are given.


def rollout(attentions):
    """Attention rollout: product of the head-averaged, identity-augmented,
    row-normalised attention matrices, last layer leftmost."""
    seq = attentions[0].shape[-1]
    eye = torch.eye(seq, dtype=attentions[0].dtype)
    result = eye
    for a in attentions:
        a_hat = a.mean(dim=0) + eye
        a_hat = a_hat / a_hat.sum(dim=-1, keepdim=True)
        result = a_hat @ result
    return result


def grad_relevance(attentions, grads):
    """Chefer et al. relevance: R = I, then R += mean_heads(clamp(G * A, 0)) @ R per layer."""
    seq = attentions[0].shape[-1]
    result = torch.eye(seq, dtype=attentions[0].dtype)
    for a, g in zip(attentions, grads):
        a_bar = (g * a).clamp(min=0).mean(dim=0)
        result = result + a_bar @ result
    return result


def value_norms(attentions, layer_inputs, projections, kv_groups):
    """Kobayashi et al. norms: A_l[h][i][j] * ||(x_j W_V^h + b_V^h) W_O^h||.

    layer_inputs[l]: (seq, hidden) what layer l's attention reads;
    projections[l]: (w_v (kv_heads*dh, hidden), b_v or None, w_o (hidden, heads*dh)).
    """
    out = []
    for a, x, (w_v, b_v, w_o) in zip(attentions, layer_inputs, projections):
        heads = a.shape[0]
        dh = w_o.shape[1] // heads
        per_head = []
        for h in range(heads):
            kv = h // kv_groups
            rows = slice(kv * dh, (kv + 1) * dh)
            v = x @ w_v[rows].T
            if b_v is not None:
                v = v + b_v[rows]
            f = v @ w_o[:, h * dh : (h + 1) * dh].T  # (seq, hidden)
            per_head.append(a[h] * f.norm(dim=-1)[None, :])
        out.append(torch.stack(per_head))
    return torch.stack(out)


# ----------------------------------------------------------------------------- checks


@contextlib.contextmanager
def attention_dropout_probe(perturb=None):
    """Wrap torch.nn.functional.dropout (which eager attention applies to the probabilities
    right before `A @ V`).  Counts the 4-d calls (one per layer; hidden dropout is 3-d),
    asserts they are the identity, and optionally adds `delta` to the output of the
    `layer`-th call: perturb = (layer, delta (1, H, T, T))."""
    original = F.dropout
    calls = []

    def wrapper(input, *args, **kwargs):
        output = original(input, *args, **kwargs)
        if input.dim() == 4:
            assert output is input, "attention dropout is not the identity"
            if perturb is not None and perturb[0] == len(calls):
                output = output + perturb[1]
            calls.append(input.shape)
        return output

    torch.nn.functional.dropout = wrapper
    try:
        yield calls
    finally:
        torch.nn.functional.dropout = original


def check_finite_difference(target64, attentions, grads):
    """target64(perturb) -> float64 y of a float64 copy of the model, with the attention
    dropout probe active.  Checks each layer's largest |G_l| entry by central difference."""
    with attention_dropout_probe() as calls:
        target64(None)
    assert len(calls) == len(attentions), (len(calls), len(attentions))
    worst = 0.0
    for layer, g in enumerate(grads):
        idx = divmod(int(g.abs().argmax()), g.shape[-1] * g.shape[-2])
        h, (i, j) = idx[0], divmod(idx[1], g.shape[-1])
        ys = []
        for sign in (1.0, -1.0):
            delta = torch.zeros((1,) + tuple(g.shape), dtype=torch.float64)
            delta[0, h, i, j] = sign * FD_EPS
            ys.append(target64((layer, delta)))
        fd = (ys[0] - ys[1]) / (2 * FD_EPS)
        err = abs(fd - float(g[h, i, j])) / float(g.abs().max())
        assert err < FD_REL_TOL, (layer, h, i, j, fd, float(g[h, i, j]))
        worst = max(worst, err)
    return worst


def check_results(attentions, grads, layer_inputs, projections, kv_groups, res, causal):
    for a in attentions:
        assert torch.isfinite(a).all()
        assert (a.sum(dim=-1) - 1).abs().max() < ROW_SUM_TOL
    for g in grads:
        assert torch.isfinite(g).all()
    assert any(bool((g != 0).any()) for g in grads), "all attention grads are zero"
    for name, t in res.items():
        assert torch.isfinite(t).all(), name

    # float64 recomputation from the same float32 A, G and inputs
    a64 = [a.double() for a in attentions]
    ref = {
        "rollout": rollout(a64),
        "grad": grad_relevance(a64, [g.double() for g in grads]),
        "norm": value_norms(
            a64,
            [x.double() for x in layer_inputs],
            [tuple(None if p is None else p.double() for p in ps) for ps in projections],
            kv_groups,
        ),
    }
    for name, r in ref.items():
        err = (res[name].double() - r).abs().max() / r.abs().max()
        assert err < F64_REL_TOL, (name, float(err))

    assert (res["rollout"].sum(dim=-1) - 1).abs().max() < ROW_SUM_TOL
    assert (res["norm"] >= 0).all()
    if causal:
        for name, t in res.items():
            assert (torch.triu(t, diagonal=1) == 0).all(), f"{name} is not lower triangular"


def to_list(t):
    # `+ 0.0` turns any -0.0 into 0.0
    return (t.detach().float() + 0.0).tolist()


def summary(label, seq, y, res, fd_err):
    print(
        f"  {label}: seq={seq} y={y:.6f} max rollout={float(res['rollout'].max()):.4f} "
        f"grad={float(res['grad'].max()):.4f} norm={float(res['norm'].max()):.4f} "
        f"(fd rel err {fd_err:.1e})"
    )


# ----------------------------------------------------------------------------- cases


def mean_pool(last_hidden_state, attention_mask):
    mask = attention_mask.unsqueeze(-1).to(last_hidden_state.dtype)
    summed = (last_hidden_state * mask).sum(dim=1)
    return summed / mask.sum(dim=1).clamp(min=1e-9)


def encoder_case(model, model64, tokenizer, text, against):
    enc = tokenizer(text, return_tensors="pt")
    enc_against = tokenizer(against, return_tensors="pt")

    def embed(m, batch):
        out = m(**batch)
        return F.normalize(mean_pool(out.last_hidden_state, batch["attention_mask"]), p=2, dim=1)

    with torch.no_grad():
        e_against = embed(model, enc_against)
    out = model(**enc, output_attentions=True, output_hidden_states=True)
    e_text = F.normalize(mean_pool(out.last_hidden_state, enc["attention_mask"]), p=2, dim=1)
    y = (e_text * e_against).sum()
    grads = [g[0].detach() for g in torch.autograd.grad(y, out.attentions)]
    attentions = [a[0].detach() for a in out.attentions]
    y = float(y.detach())

    layer_inputs = [h[0].detach() for h in out.hidden_states[:-1]]
    projections = [
        (
            layer.attention.self.value.weight.detach(),
            layer.attention.self.value.bias.detach(),
            layer.attention.output.dense.weight.detach(),
        )
        for layer in model.encoder.layer
    ]
    with torch.no_grad():
        res = {
            "rollout": rollout(attentions),
            "grad": grad_relevance(attentions, grads),
            "norm": value_norms(attentions, layer_inputs, projections, 1),
        }
    check_results(attentions, grads, layer_inputs, projections, 1, res, causal=False)

    with torch.no_grad():
        e_against64 = embed(model64, enc_against)

    def target64(perturb):
        with torch.no_grad(), attention_dropout_probe(perturb):
            return float((embed(model64, enc) * e_against64).sum())

    fd_err = check_finite_difference(target64, attentions, grads)

    ids = enc["input_ids"][0].tolist()
    summary(repr(text), len(ids), y, res, fd_err)
    return {
        "text": text,
        "against": against,
        "input_ids": ids,
        "tokens": tokenizer.convert_ids_to_tokens(ids),
        "rollout": to_list(res["rollout"]),
        "grad": {
            "target": "cosine",
            "against": against,
            "value": y,
            "matrix": to_list(res["grad"]),
        },
        "norm": to_list(res["norm"]),
    }


def decoder_case(model, model64, input_ids, target_token_id=None):
    input_ids = torch.tensor([input_ids], dtype=torch.long)
    out = model(input_ids=input_ids, output_attentions=True, output_hidden_states=True)
    last = out.logits[0, -1]
    token_id = int(last.argmax()) if target_token_id is None else target_token_id
    y = last[token_id]
    grads = [g[0].detach() for g in torch.autograd.grad(y, out.attentions)]
    attentions = [a[0].detach() for a in out.attentions]
    y = float(y.detach())
    top2 = last.detach().topk(2).values
    assert float(top2[0] - top2[1]) > 1e-3, "greedy token is ambiguous"

    cfg = model.config
    kv_groups = cfg.num_attention_heads // cfg.num_key_value_heads
    layers = model.model.layers
    with torch.no_grad():
        layer_inputs = [
            layer.input_layernorm(h)[0] for layer, h in zip(layers, out.hidden_states[:-1])
        ]
    projections = [
        (
            layer.self_attn.v_proj.weight.detach(),
            None if layer.self_attn.v_proj.bias is None else layer.self_attn.v_proj.bias.detach(),
            layer.self_attn.o_proj.weight.detach(),
        )
        for layer in layers
    ]
    with torch.no_grad():
        res = {
            "rollout": rollout(attentions),
            "grad": grad_relevance(attentions, grads),
            "norm": value_norms(attentions, layer_inputs, projections, kv_groups),
        }
    check_results(attentions, grads, layer_inputs, projections, kv_groups, res, causal=True)

    def target64(perturb):
        with torch.no_grad(), attention_dropout_probe(perturb):
            return float(model64(input_ids=input_ids).logits[0, -1, token_id])

    fd_err = check_finite_difference(target64, attentions, grads)

    label = f"ids[:{input_ids.shape[1]}] " + (
        "greedy" if target_token_id is None else f"target {target_token_id}"
    )
    summary(f"{label} -> token {token_id}", input_ids.shape[1], y, res, fd_err)
    case = {}
    if target_token_id is not None:
        case["target_token_id"] = target_token_id
    case.update(
        {
            "input_ids": input_ids[0].tolist(),
            "rollout": to_list(res["rollout"]),
            "grad": {
                "target": "logit",
                "token_id": token_id,
                "value": y,
                "matrix": to_list(res["grad"]),
            },
            "norm": to_list(res["norm"]),
        }
    )
    return case


# ----------------------------------------------------------------------------- main


def write(name, model_dir, cases):
    doc = {
        "generator": "scripts/gen_explain_fixtures.py",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": model_dir,
        "cases": cases,
    }
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / name
    path.write_text(json.dumps(doc, separators=(",", ":")))
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")


def main():
    torch.manual_seed(0)

    encoder, tokenizer = load_encoder()
    encoder64 = copy.deepcopy(encoder).double()
    print(f"MiniLM ({ENCODER_DIR})")
    cases = [encoder_case(encoder, encoder64, tokenizer, **c) for c in ENCODER_CASES]
    write("minilm.json", ENCODER_DIR, cases)

    decoder = load_decoder()
    decoder64 = copy.deepcopy(decoder).double()
    prompt = load_file(ROOT / DECODER_DIR / "expected.safetensors")["input_ids"][0]
    prompt = prompt[:DECODER_PROMPT_LEN].tolist()
    print(f"LLaMA GQA ({DECODER_DIR})")
    cases = [decoder_case(decoder, decoder64, prompt, t) for t in DECODER_TARGETS]
    write("llama_gqa.json", DECODER_DIR, cases)


if __name__ == "__main__":
    main()

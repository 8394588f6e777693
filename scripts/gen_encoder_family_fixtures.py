#!/usr/bin/env python3
"""Golden fixtures of the encoder families beside BERT: RoBERTa, XLM-RoBERTa and DistilBERT,
from transformers' own model classes, in tests/fixtures/encoders/<case>/.

    python3 scripts/gen_encoder_family_fixtures.py     # torch, transformers, safetensors

Each case is a tiny random model (2 layers, hidden 32, 4 heads) with a tokenizer of its
family's kind trained here on a few sentences (byte-level BPE for RoBERTa, a SentencePiece
style Unigram for XLM-R, WordPiece for DistilBERT), saved by `save_pretrained` so that
transformers' `from_pretrained` and the crate load the same directory:

    config.json, tokenizer.json, tokenizer_config.json, model.safetensors (F32)
    expected.safetensors
        <i>.input_ids          I64 (1, T)          the tokenizer's ids (specials added)
        <i>.attentions         F32 (L, H, T, T)    eager attention, output_attentions=True
        <i>.last_hidden_state  F32 (1, T, D)
        batch.input_ids        I64 (S, Tmax)       all sentences, right-padded with pad id
        batch.attention_mask   I64 (S, Tmax)
        batch.attentions       F32 (L, S, H, Tmax, Tmax)
    expected.json              the sentences, in order

Weights are drawn wider than transformers' default init (normal(0, 0.2) matrices and
embeddings, LayerNorm weights 1 + 0.2 N(0, 1), biases 0.1 N(0, 1)) so that heads are not
uniform and a port that ignores a bias, a norm or a position offset fails.
RoBERTa's positions start at padding_idx + 1 (`create_position_ids_from_input_ids`): the
script checks that shifting them changes the attentions, so the fixture tells them apart.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import safetensors
import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (AutoModel, AutoTokenizer, DistilBertConfig, DistilBertTokenizerFast, RobertaConfig,
                          RobertaTokenizerFast, XLMRobertaConfig, XLMRobertaTokenizerFast)

transformers.utils.logging.disable_progress_bar()

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "encoders"
VERSIONS = (f"torch {torch.__version__.split('+')[0]}, transformers {transformers.__version__}, "
            f"safetensors {safetensors.__version__}, numpy {np.__version__}")

CORPUS = [
    "The animal didn't cross the street because it was too tired.",
    "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
    "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.", "The sky is blue and the sun is bright.",
    "Attention weights show which tokens each position reads from.", "Tokenizers split words into pieces.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "She said that the results were surprising, but nobody believed her.",
]
SENTENCES = [
    "The animal didn't cross the street because it was too tired.",
    "A monkey is playing drums.",
    "Paris is the capital of France.",
    "Unseen words: zebra quartz!",
]


def byte_level_bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), trim_offsets=True,
                                                      add_prefix_space=False)
    return RobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")


def unigram():
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.Nmt(), normalizers.NFKC(),
                                           normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=200, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                                      unk_token="<unk>", show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    return XLMRobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                   cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")


def wordpiece():
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=220, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
                                        show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return DistilBertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                                   pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")


CASES = [
    dict(name="roberta", seed=31, tokenizer=byte_level_bpe, config=lambda v: RobertaConfig(
        vocab_size=v, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=66, type_vocab_size=1, layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, hidden_act="gelu"),
        what="byte-level BPE, positions from padding_idx + 1 = 2, one token type, eps 1e-5"),
    dict(name="xlm_roberta", seed=32, tokenizer=unigram, config=lambda v: XLMRobertaConfig(
        vocab_size=v, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=50, type_vocab_size=1, layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, hidden_act="gelu_new"),
        what="SentencePiece-style Unigram, XLM-R positions, tanh GELU"),
    dict(name="distilbert", seed=33, tokenizer=wordpiece, config=lambda v: DistilBertConfig(
        vocab_size=v, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64,
        activation="gelu", pad_token_id=0, dropout=0.0, attention_dropout=0.0),
        what="q_lin/k_lin/v_lin/out_lin, sa_layer_norm, ffn.lin1/lin2, no token types"),
]


def widen_(model):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "LayerNorm.weight" in n or "layer_norm.weight" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif n.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))


def gen_case(case):
    d = OUT / case["name"]
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    tok = case["tokenizer"]()
    tok.save_pretrained(str(d))
    torch.manual_seed(case["seed"])
    model = AutoModel.from_config(case["config"](len(tok)), attn_implementation="eager").eval()
    widen_(model)
    model.save_pretrained(str(d), safe_serialization=True)
    for extra in ["special_tokens_map.json", "generation_config.json"]:
        (d / extra).unlink(missing_ok=True)
    model = AutoModel.from_pretrained(str(d), attn_implementation="eager", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(d))
    out = {}
    with torch.no_grad():
        for i, text in enumerate(SENTENCES):
            enc = tok(text, return_tensors="pt")
            o = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], output_attentions=True)
            out[f"{i}.input_ids"] = enc["input_ids"].to(torch.int64)
            out[f"{i}.attentions"] = torch.stack(o.attentions, 0)[:, 0].contiguous()
            out[f"{i}.last_hidden_state"] = o.last_hidden_state.contiguous()
            if case["name"] != "distilbert":
                # The position offset matters: ids from 0 give other attentions.
                t = enc["input_ids"].shape[1]
                shifted = model(input_ids=enc["input_ids"], position_ids=torch.arange(t)[None],
                                output_attentions=True)
                gap = (torch.stack(shifted.attentions, 0)[:, 0] - out[f"{i}.attentions"]).abs().max().item()
                assert gap > 1e-2, f"{case['name']}: positions from 0 change the attentions by only {gap}"
        batch = tok(SENTENCES, return_tensors="pt", padding=True)
        o = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_attentions=True)
        out["batch.input_ids"] = batch["input_ids"].to(torch.int64)
        out["batch.attention_mask"] = batch["attention_mask"].to(torch.int64)
        out["batch.attentions"] = torch.stack(o.attentions, 0).contiguous()
        spread = max(a.max().item() for k, a in out.items() if k.endswith(".attentions"))
        assert spread > 0.5, f"{case['name']}: the heads are nearly uniform (max weight {spread})"
    save_file({k: v.contiguous() for k, v in out.items()}, str(d / "expected.safetensors"))
    (d / "expected.json").write_text(json.dumps(
        {"sentences": SENTENCES, "what": case["what"], "provenance":
         f"generated by scripts/gen_encoder_family_fixtures.py ({VERSIONS})"}, indent=2) + "\n")
    print(f"{case['name']}: vocab {len(tok)}, {sum(p.numel() for p in model.parameters())} params")


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        gen_case(case)
    (OUT / "README.md").write_text(
        "# Encoder family fixtures\n\nTiny random RoBERTa, XLM-RoBERTa and DistilBERT models with their "
        "tokenizers and transformers' outputs,\n" f"generated by scripts/gen_encoder_family_fixtures.py "
        f"({VERSIONS}).\nSee the script's docstring for the format.\n\n"
        + "".join(f"- `{c['name']}`: {c['what']}\n" for c in CASES))


if __name__ == "__main__":
    main()

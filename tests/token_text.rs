//! Each token's text (`EncodedText::token_text`, the dump's `"token_text"`): concatenated, it
//! is the tokenizer's decoding of the ids (special tokens kept), for the four kinds of
//! tokenizer the crate meets: WordPiece, byte-level BPE, BPE with an end-of-word suffix, and
//! SentencePiece (Unigram, and BPE with byte fallback); and it reads as text, not as the
//! vocabulary's `##`, `Ġ` or `▁`.

mod common;

use candle_attention::{GgufFile, TextEncoder};
use common::repo_path;

const TEXTS: [&str; 6] = [
    "The animal didn't cross the street because it was too tired.",
    "Ünïcödé naïve café — 日本語のテキスト 🚀 emoji",
    "  leading spaces\n\n\ttabs and   runs of   spaces",
    "def f(x):\n    return x**2  # square it",
    "In 2024, 1234567 people paid $3.50 each.",
    "a",
];

/// The pieces concatenate to the decoding, one a token, and none shows `forbidden`.
fn check(name: &str, encoder: &TextEncoder, forbidden: &[&str]) -> anyhow::Result<()> {
    for text in TEXTS {
        let item = encoder.encode(text)?;
        assert!(encoder
            .clone()
            .with_token_text(false)
            .encode(text)?
            .token_text
            .is_empty());
        assert_eq!(item.token_text.len(), item.ids.len(), "{name}: {text:?}");
        let decoded = encoder
            .tokenizer()
            .decode(&item.ids, false)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        assert_eq!(item.token_text.concat(), decoded, "{name}: {text:?}");
        for piece in &item.token_text {
            for f in forbidden {
                assert!(!piece.contains(f), "{name}: {piece:?} in {text:?}");
            }
        }
        // Only the first bytes of a character split over tokens have no text of their own.
        if text.is_ascii() {
            assert!(
                item.token_text.iter().all(|p| !p.is_empty()),
                "{name}: {:?}",
                item.token_text
            );
        }
    }
    Ok(())
}

#[test]
fn wordpiece_pieces_concatenate_to_the_decoding() -> anyhow::Result<()> {
    let encoder =
        TextEncoder::from_file(repo_path("weights/tokenizer.json"))?.with_token_text(true);
    check("WordPiece", &encoder, &["##"])?;
    let item = encoder.encode("playing ball")?;
    assert_eq!(item.token_text, ["[CLS]", " playing", " ball", " [SEP]"]);
    Ok(())
}

#[test]
fn byte_level_bpe_pieces_concatenate_to_the_decoding() -> anyhow::Result<()> {
    let roberta =
        TextEncoder::from_file(repo_path("tests/fixtures/encoders/roberta/tokenizer.json"))?
            .with_token_text(true);
    check("byte-level BPE (RoBERTa's)", &roberta, &["Ġ", "Ċ"])?;
    let file = GgufFile::open(repo_path("tests/fixtures/gguf/smollm2_tokenizer.gguf"))?;
    let smollm2 = TextEncoder::from_gguf(&file)?.with_token_text(true);
    check("byte-level BPE (SmolLM2's GGUF)", &smollm2, &["Ġ", "Ċ"])?;
    let item = smollm2.encode("The capital of France")?;
    assert_eq!(item.token_text, ["The", " capital", " of", " France"]);
    Ok(())
}

#[test]
fn sentencepiece_pieces_concatenate_to_the_decoding() -> anyhow::Result<()> {
    let unigram = TextEncoder::from_file(repo_path(
        "tests/fixtures/encoders/xlm_roberta/tokenizer.json",
    ))?
    .with_token_text(true);
    check("SentencePiece Unigram (XLM-R's)", &unigram, &["▁"])?;
    // BPE with byte fallback: characters outside the vocabulary as `<0x..>` bytes.
    let file = GgufFile::open(repo_path("tests/fixtures/gguf/llama_spm_tokenizer.gguf"))?;
    let spm = TextEncoder::from_gguf(&file)?.with_token_text(true);
    check("SentencePiece BPE with byte fallback", &spm, &["▁"])?;
    Ok(())
}

/// A BPE whose words end in `</w>` (CLIP's and the original BPE's form), built here.
#[test]
fn end_of_word_bpe_pieces_concatenate_to_the_decoding() -> anyhow::Result<()> {
    let mut vocab = serde_json::Map::new();
    let chars: Vec<String> = "abcdefghijklmnopqrstuvwxyzTI0123456789.,'$"
        .chars()
        .flat_map(|c| [c.to_string(), format!("{c}</w>")])
        .chain(["th".to_string(), "th</w>".to_string(), "[UNK]".to_string()])
        .collect();
    for (i, c) in chars.iter().enumerate() {
        vocab.insert(c.clone(), i.into());
    }
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": {"type": "BPEDecoder", "suffix": "</w>"},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": "[UNK]",
            "continuing_subword_prefix": null,
            "end_of_word_suffix": "</w>",
            "fuse_unk": false,
            "byte_fallback": false,
            "vocab": vocab,
            "merges": ["t h", "t h</w>"]
        }
    });
    let dir = std::env::temp_dir().join(format!("token-text-bpe-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, serde_json::to_string(&json)?)?;
    let encoder = TextEncoder::from_file(&path)?.with_token_text(true);
    let item = encoder.encode("the cat sat.")?;
    let decoded = encoder
        .tokenizer()
        .decode(&item.ids, false)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    assert_eq!(item.token_text.concat(), decoded);
    assert!(item.token_text.iter().all(|p| !p.contains("</w>")));
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

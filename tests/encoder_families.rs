//! RoBERTa, XLM-RoBERTa, DistilBERT and ModernBERT load from a directory as transformers saves them and
//! reproduce transformers' eager attentions (within 1e-5) and hidden states, alone and in a
//! padded batch; their checkpoints' math-changing fields and stray tensors are refused.
//! Fixtures: `scripts/gen_encoder_family_fixtures.py` (tests/fixtures/encoders/).

mod common;

use std::path::{Path, PathBuf};

use candle_attention::{Checkpoint, Model, ModelResolver};
use candle_core::{DType, Device, IndexOp, Tensor};
use common::{assert_close, repo_path, TempDir};

const CASES: [&str; 4] = ["roberta", "xlm_roberta", "distilbert", "modernbert"];

fn case_dir(case: &str) -> PathBuf {
    repo_path(&format!("tests/fixtures/encoders/{case}"))
}

fn load(dir: &Path) -> anyhow::Result<Model> {
    let files = ModelResolver::new().resolve(Some(&dir.display().to_string()))?;
    Ok(Model::load(files, DType::F32, &Device::Cpu, false)?)
}

struct Expected {
    ckpt: Checkpoint,
    sentences: Vec<String>,
}

impl Expected {
    fn open(case: &str) -> anyhow::Result<Self> {
        let dir = case_dir(case);
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json"))?)?;
        let sentences = meta["sentences"]
            .as_array()
            .ok_or_else(|| anyhow::anyhow!("no sentences"))?
            .iter()
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect();
        Ok(Self {
            ckpt: Checkpoint::open(dir.join("expected.safetensors"))?,
            sentences,
        })
    }

    fn tensor(&self, name: &str) -> anyhow::Result<Tensor> {
        Ok(self.ckpt.tensor(name, &Device::Cpu)?)
    }
}

#[test]
fn each_sentence_matches_transformers() -> anyhow::Result<()> {
    for case in CASES {
        let model = load(&case_dir(case))?;
        let fx = Expected::open(case)?;
        assert!(fx.sentences.len() >= 3);
        for (i, text) in fx.sentences.iter().enumerate() {
            let batch = model.text.encode_batch(&[text.as_str()], &Device::Cpu)?;
            let ids: Vec<i64> = batch.input_ids.to_dtype(DType::I64)?.i(0)?.to_vec1()?;
            let want: Vec<i64> = fx.tensor(&format!("{i}.input_ids"))?.i(0)?.to_vec1()?;
            assert_eq!(ids, want, "{case}: tokens of {text:?}");
            let out = model.encoder.forward(
                &batch.input_ids,
                Some(&batch.token_type_ids),
                Some(&batch.attention_mask),
                true,
            )?;
            let attentions = out
                .attentions
                .ok_or_else(|| anyhow::anyhow!("no weights"))?;
            let stacked = Tensor::stack(&attentions, 0)?.squeeze(1)?; // (layers, heads, seq, seq)
            let what = format!("{case} sentence {i}");
            let want = fx.tensor(&format!("{i}.attentions"))?;
            assert_close(&stacked, &want, 1e-5, &format!("{what} attentions"))?;
            let hidden = fx.tensor(&format!("{i}.last_hidden_state"))?;
            assert_close(&out.hidden_states, &hidden, 1e-4, &format!("{what} hidden"))?;
        }
    }
    Ok(())
}

/// Right-padded batches: RoBERTa's padding tokens take position `pad_token_id` and the real
/// tokens' positions do not move; every real query row equals transformers' batch.
#[test]
fn padded_batch_matches_transformers() -> anyhow::Result<()> {
    for case in CASES {
        let model = load(&case_dir(case))?;
        let fx = Expected::open(case)?;
        let texts: Vec<&str> = fx.sentences.iter().map(String::as_str).collect();
        let batch = model.text.encode_batch(&texts, &Device::Cpu)?;
        let want_ids = fx.tensor("batch.input_ids")?;
        assert_eq!(
            batch.input_ids.to_dtype(DType::I64)?.to_vec2::<i64>()?,
            want_ids.to_vec2::<i64>()?,
            "{case}: padded ids"
        );
        let out = model.encoder.forward(
            &batch.input_ids,
            Some(&batch.token_type_ids),
            Some(&batch.attention_mask),
            true,
        )?;
        let got = Tensor::stack(&out.attentions.unwrap_or_default(), 0)?; // (l, b, h, t, t)
        let want = fx.tensor("batch.attentions")?;
        let mask: Vec<Vec<i64>> = fx.tensor("batch.attention_mask")?.to_vec2()?;
        for (s, row) in mask.iter().enumerate() {
            let real = row.iter().filter(|&&m| m == 1).count();
            let pick = |t: &Tensor| -> anyhow::Result<Tensor> {
                Ok(t.i((.., s))?.narrow(2, 0, real)?.narrow(3, 0, real)?)
            };
            assert_close(
                &pick(&got)?,
                &pick(&want)?,
                1e-5,
                &format!("{case} batch row {s}"),
            )?;
        }
    }
    Ok(())
}

/// A copy of a case with its config edited and, optionally, a tensor added.
fn edited_copy(
    case: &str,
    edit: impl FnOnce(&mut serde_json::Value),
    extra_tensor: Option<&str>,
) -> anyhow::Result<TempDir> {
    common::edited_model_copy(&case_dir(case), case, edit, extra_tensor)
}

/// A field that changes the math to a value the crate does not implement is refused with
/// its name, for each family; so is a tensor the encoder would not read.
#[test]
fn unsupported_fields_and_stray_tensors_are_refused() -> anyhow::Result<()> {
    let cases: [(&str, &str, serde_json::Value, &str); 8] = [
        (
            "roberta",
            "position_embedding_type",
            "relative_key".into(),
            "position_embedding_type",
        ),
        (
            "roberta",
            "pad_token_id",
            serde_json::Value::Null,
            "pad_token_id",
        ),
        ("xlm_roberta", "is_decoder", true.into(), "is_decoder"),
        (
            "distilbert",
            "activation",
            "gelu_erf_approx".into(),
            "gelu_erf_approx",
        ),
        ("distilbert", "model_type", "albert".into(), "albert"),
        ("modernbert", "is_causal", true.into(), "is_causal"),
        (
            "modernbert",
            "layer_types",
            serde_json::json!(["full_attention", "chunked_attention", "full_attention"]),
            "chunked_attention",
        ),
        ("modernbert", "hidden_activation", "swiglu".into(), "swiglu"),
    ];
    for (case, field, value, named) in cases {
        let dir = edited_copy(case, |cfg| cfg[field] = value.clone(), None)?;
        let err = match load(&dir.0) {
            Ok(_) => anyhow::bail!("{case}: {field} = {value} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(named), "{case} {field}: {err}");
    }
    for (case, stray) in [
        (
            "roberta",
            "encoder.layer.0.attention.self.distance_embedding.weight",
        ),
        ("distilbert", "transformer.layer.2.ffn.lin1.bias"),
        ("modernbert", "layers.0.attn_norm.weight"),
    ] {
        let dir = edited_copy(case, |_| {}, Some(stray))?;
        let err = match load(&dir.0) {
            Ok(_) => anyhow::bail!("{case}: a stray {stray} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(stray), "{case}: {err}");
    }
    Ok(())
}

/// RoBERTa's longest input is its position table less `pad_token_id + 1` rows.
#[test]
fn roberta_max_positions_leave_out_the_padding_offset() -> anyhow::Result<()> {
    let model = load(&case_dir("roberta"))?;
    assert_eq!(model.encoder.max_positions(), 66 - 2);
    let distil = load(&case_dir("distilbert"))?;
    assert_eq!(distil.encoder.max_positions(), 64);
    Ok(())
}

/// `attention_dump --model DIR --format json` on each family: the JSON's attentions over the
/// model's own tokens equal transformers' (the contract the CLI keeps for every family).
#[test]
fn attention_dump_json_matches_transformers() -> anyhow::Result<()> {
    let bin = common::example_bin("attention_dump")?;
    for case in CASES {
        let fx = Expected::open(case)?;
        let out = std::process::Command::new(&bin)
            .arg("--model")
            .arg(case_dir(case))
            .args(["--format", "json"])
            .args(&fx.sentences)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "{case}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)?
            .lines()
            .map(serde_json::from_str)
            .collect::<Result<_, _>>()?;
        assert_eq!(
            lines.len(),
            fx.sentences.len(),
            "{case}: one line per sentence"
        );
        for (i, line) in lines.iter().enumerate() {
            let want = fx.tensor(&format!("{i}.attentions"))?;
            let (l, h, t, _) = want.dims4()?;
            assert_eq!(line["shape"], serde_json::json!([l, h, t, t]), "{case} {i}");
            assert_eq!(line["tokens"].as_array().map(Vec::len), Some(t));
            let flat = common::json_floats(&line["attentions"]);
            let got = Tensor::from_vec(flat, (l, h, t, t), &Device::Cpu)?;
            assert_close(&got, &want, 1e-5, &format!("{case} dump {i}"))?;
        }
    }
    Ok(())
}

/// `embed`'s pooling is the model's: sentence-transformers' `modules.json` (here CLS, then
/// unit length) or, without one, mean pooling unnormalized; each against transformers'
/// last hidden states.
#[test]
fn embeddings_pool_as_the_model_says() -> anyhow::Result<()> {
    let fx = Expected::open("roberta")?;
    let hidden = fx.tensor("0.last_hidden_state")?.squeeze(0)?; // (seq, hidden)
    let text = fx.sentences[0].as_str();
    // No modules.json: the mean over the tokens, as it is.
    let model = load(&case_dir("roberta"))?;
    let row = model.embedder(&Device::Cpu).embed(&[text])?.remove(0);
    let mean = hidden.mean(0)?;
    let got = Tensor::new(row.as_slice(), &Device::Cpu)?;
    assert_close(&got, &mean, 1e-4, "roberta mean pooling")?;
    // CLS pooling and Normalize, as a sentence-transformers directory says.
    let dir = edited_copy("roberta", |_| {}, None)?;
    std::fs::write(
        dir.0.join("modules.json"),
        r#"[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]"#,
    )?;
    std::fs::create_dir_all(dir.0.join("1_Pooling"))?;
    std::fs::write(
        dir.0.join("1_Pooling/config.json"),
        r#"{"word_embedding_dimension": 32, "pooling_mode_cls_token": true,
            "pooling_mode_mean_tokens": false, "pooling_mode_max_tokens": false,
            "pooling_mode_mean_sqrt_len_tokens": false}"#,
    )?;
    let model = load(&dir.0)?;
    let row = model.embedder(&Device::Cpu).embed(&[text])?.remove(0);
    let cls = hidden.get(0)?;
    let unit = cls.broadcast_div(&cls.sqr()?.sum_all()?.sqrt()?)?;
    let got = Tensor::new(row.as_slice(), &Device::Cpu)?;
    assert_close(&got, &unit, 1e-4, "roberta CLS pooling, normalized")?;
    Ok(())
}

/// ModernBERT's window, rotary bases and norms come from its parsed `config.json`: a config
/// built from fields alone is refused rather than filled with defaults.
#[test]
fn modernbert_without_its_parsed_config_is_refused() -> anyhow::Result<()> {
    let dir = case_dir("modernbert");
    let text = std::fs::read_to_string(dir.join("config.json"))?;
    let from_fields: candle_attention::HfConfig = serde_json::from_str(&text)?;
    let ckpt = Checkpoint::open(dir.join("model.safetensors"))?;
    let vb = ckpt.var_builder(DType::F32, &Device::Cpu);
    let err = match candle_attention::BertEncoder::load(vb.clone(), &from_fields) {
        Ok(_) => anyhow::bail!("a ModernBERT config without its file was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("ModernBERT config"), "{err}");
    let parsed = candle_attention::HfConfig::from_json(&text)?;
    candle_attention::BertEncoder::load(vb, &parsed)?;
    Ok(())
}

//! Explanations against transformers' (scripts/gen_explain_fixtures.py: eager attention,
//! `output_attentions=True`, `torch.autograd.grad` of the target with respect to the
//! attention probabilities): rollout, grad and norm on the shipped all-MiniLM-L6-v2 and on a
//! tiny LLaMA with grouped K/V heads, each within 1e-4 of its largest entry; and their
//! invariants.

mod common;

use candle_attention::viz::{ExplainMethod, Explanation, GradTarget};
use candle_attention::{LlamaModel, Model, ModelResolver};
use candle_core::{DType, Device};
use common::{explanation_values as flat, json_floats as floats, repo_path};
use serde_json::Value;

/// Relative to the largest entry of the reference.
const TOL: f32 = 1e-4;

fn fixture(name: &str) -> anyhow::Result<Value> {
    let path = repo_path(&format!("tests/fixtures/explain/{name}"));
    Ok(serde_json::from_str(&std::fs::read_to_string(path)?)?)
}

fn close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: sizes");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        worst <= TOL * scale,
        "{what}: max difference {worst} against a largest entry of {scale}"
    );
}

#[test]
fn minilm_rollout_grad_and_norm_equal_transformers() -> anyhow::Result<()> {
    encoder_golden("minilm.json", "weights")
}

/// RoBERTa (positions from past `pad_token_id`): fixture from
/// `scripts/gen_explain_family_fixtures.py`.
#[test]
fn roberta_rollout_grad_and_norm_equal_transformers() -> anyhow::Result<()> {
    encoder_golden("roberta.json", "tests/fixtures/encoders/roberta")
}

/// ModernBERT (pre-norm, rotary, a local layer): fixture from
/// `scripts/gen_modernbert_fixtures.py`.
#[test]
fn modernbert_rollout_grad_and_norm_equal_transformers() -> anyhow::Result<()> {
    encoder_golden("modernbert.json", "tests/fixtures/encoders/modernbert")
}

fn encoder_golden(name: &str, dir: &str) -> anyhow::Result<()> {
    let fx = fixture(name)?;
    let files = ModelResolver::new().resolve(Some(&repo_path(dir).display().to_string()))?;
    let model = Model::load(files, DType::F32, &Device::Cpu, false)?;
    let cases = fx["cases"].as_array().map_or(&[][..], Vec::as_slice);
    assert!(!cases.is_empty());
    for case in cases {
        let text = case["text"].as_str().unwrap_or_default();
        let against = case["against"].as_str().unwrap_or_default();
        let item = model.text.encode(text)?;
        let ids: Vec<u32> = floats(&case["input_ids"])
            .iter()
            .map(|&v| v as u32)
            .collect();
        assert_eq!(item.ids, ids, "{text}: token ids");
        let explain = |method, against| {
            Explanation::encoder(
                &model.encoder,
                &model.text,
                &item,
                method,
                against,
                &Device::Cpu,
            )
        };
        let rollout = explain(ExplainMethod::Rollout, None)?;
        close(
            &format!("{text}: rollout"),
            &flat(&rollout),
            &floats(&case["rollout"]),
        );
        let norm = explain(ExplainMethod::Norm, None)?;
        close(
            &format!("{text}: norm"),
            &flat(&norm),
            &floats(&case["norm"]),
        );
        let grad = explain(ExplainMethod::Grad, Some(against))?;
        close(
            &format!("{text}: grad"),
            &flat(&grad),
            &floats(&case["grad"]["matrix"]),
        );
        let Explanation::Grad { target, value, .. } = &grad else {
            panic!("{text}: not a gradient explanation");
        };
        assert_eq!(
            target,
            &GradTarget::Cosine {
                against: against.to_string()
            }
        );
        let want = case["grad"]["value"].as_f64().unwrap_or(f64::NAN) as f32;
        assert!(
            (value - want).abs() < 1e-5,
            "{text}: cosine {value} vs {want}"
        );
        // An encoder's gradient explanation needs the text to compare with.
        assert!(explain(ExplainMethod::Grad, None).is_err());
    }
    Ok(())
}

#[test]
fn llama_rollout_grad_and_norm_equal_transformers() -> anyhow::Result<()> {
    decoder_golden("llama_gqa.json", "tests/fixtures/decoders/llama_gqa")
}

/// Gemma 3 (q/k norms, sandwich norms, a sliding layer) and Pythia (LayerNorms, partial
/// rotation, parallel residual): fixtures from `scripts/gen_explain_family_fixtures.py`.
#[test]
fn gemma3_and_pythia_rollout_grad_and_norm_equal_transformers() -> anyhow::Result<()> {
    decoder_golden("gemma3.json", "tests/fixtures/decoders/gemma3")?;
    decoder_golden("pythia.json", "tests/fixtures/decoders/pythia")
}

fn decoder_golden(name: &str, dir: &str) -> anyhow::Result<()> {
    let fx = fixture(name)?;
    let model = LlamaModel::from_dir(repo_path(dir), DType::F32, &Device::Cpu)?;
    for case in fx["cases"].as_array().map_or(&[][..], Vec::as_slice) {
        let ids: Vec<u32> = floats(&case["input_ids"])
            .iter()
            .map(|&v| v as u32)
            .collect();
        let target = case["target_token_id"].as_u64().map(|t| t as u32);
        let explain = |method| Explanation::decoder(&model, &ids, method, target, &Device::Cpu);
        close(
            "rollout",
            &flat(&explain(ExplainMethod::Rollout)?),
            &floats(&case["rollout"]),
        );
        close(
            "norm",
            &flat(&explain(ExplainMethod::Norm)?),
            &floats(&case["norm"]),
        );
        let grad = explain(ExplainMethod::Grad)?;
        close("grad", &flat(&grad), &floats(&case["grad"]["matrix"]));
        let Explanation::Grad {
            target: t, value, ..
        } = &grad
        else {
            panic!("not a gradient explanation");
        };
        let token = case["grad"]["token_id"].as_u64().unwrap_or(u64::MAX) as u32;
        assert_eq!(t, &GradTarget::Logit { token_id: token });
        let want = case["grad"]["value"].as_f64().unwrap_or(f64::NAN) as f32;
        assert!(
            (value - want).abs() < 1e-4 * want.abs().max(1.0),
            "logit {value} vs {want}"
        );
    }
    Ok(())
}

/// Rollout rows sum to 1; a one-layer model's grad relevance is `I + Ā` (so its diagonal is
/// at least 1 and nothing is negative); norms are zero where the causal weights are masked.
#[test]
fn explanation_invariants() -> anyhow::Result<()> {
    let model = LlamaModel::from_dir(
        repo_path("tests/fixtures/decoders/llama_gqa"),
        DType::F32,
        &Device::Cpu,
    )?;
    let ids = [1u32, 40, 7, 99, 3, 12];
    let Explanation::Rollout { matrix } =
        Explanation::decoder(&model, &ids, ExplainMethod::Rollout, None, &Device::Cpu)?
    else {
        panic!("not a rollout");
    };
    for row in &matrix {
        assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
    }
    let Explanation::Norm { norms, .. } =
        Explanation::decoder(&model, &ids, ExplainMethod::Norm, None, &Device::Cpu)?
    else {
        panic!("not norms");
    };
    for m in norms.iter().flatten() {
        for (i, row) in m.iter().enumerate() {
            assert!(
                row[i + 1..].iter().all(|&v| v == 0.0),
                "a masked key moved a query"
            );
            assert!(row.iter().all(|&v| v >= 0.0));
        }
    }
    let Explanation::Grad { matrix, .. } =
        Explanation::decoder(&model, &ids, ExplainMethod::Grad, Some(3), &Device::Cpu)?
    else {
        panic!("not a gradient explanation");
    };
    for (i, row) in matrix.iter().enumerate() {
        assert!(row[i] >= 1.0 && row.iter().all(|&v| v >= 0.0));
    }
    assert!(Explanation::decoder(
        &model,
        &ids,
        ExplainMethod::Grad,
        Some(100_000),
        &Device::Cpu
    )
    .is_err());
    Ok(())
}

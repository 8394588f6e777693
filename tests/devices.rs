//! Golden and invariant checks on every device the build has (CPU always; CUDA / Metal
//! with their features), in f32 and in half precision.
//!
//! Tolerances (max |diff| against the PyTorch fixtures, which are f32):
//! - f32: 1e-4 on weights and context.
//! - f16: 5e-3 on weights, 1e-2 on context. Inputs and weights are rounded to f16 (11-bit
//!   mantissa, relative error 4.9e-4); the projections sum `hidden` such products, the
//!   scores are scaled and exponentiated, which amplifies the rounding to ~1e-3 on the
//!   probabilities (measured on CPU: see `half_tolerances_are_not_loose`).
//! - bf16: 4e-2 on weights, 1e-1 on context: 8-bit mantissa (relative error 3.9e-3), 8x
//!   coarser than f16.

mod common;

use candle_attention::{
    AttentionConfig, AttentionMask, Checkpoint, MultiHeadSelfAttention, SingleHeadSelfAttention,
    WeightLayout,
};
use candle_core::{DType, Device};
use common::{max_abs_diff, repo_path, Fixture};

fn tolerances(dtype: DType) -> (f32, f32) {
    match dtype {
        DType::F16 => (5e-3, 1e-2),
        DType::BF16 => (4e-2, 1e-1),
        _ => (1e-4, 1e-4),
    }
}

/// Worst (weights, context) difference over every case of a module fixture.
fn fixture_error(name: &str, device: &Device, dtype: DType) -> anyhow::Result<(f32, f32)> {
    let fx = Fixture::open(name)?;
    let layout: WeightLayout = fx.meta["layout"].as_str().unwrap_or_default().parse()?;
    let heads = fx.meta["heads"].as_u64().unwrap_or(1) as usize;
    let ckpt = match fx.meta["weights_file"].as_str() {
        Some(f) => Checkpoint::open(repo_path(f))?,
        None => fx.ckpt.clone(),
    };
    let (mut worst_w, mut worst_c) = (0f32, 0f32);
    for case in fx.cases() {
        let causal = fx.case_meta(&case)["causal"].as_bool().unwrap_or(false);
        let prefix = fx.prefix(&case);
        let vb = ckpt.var_builder(dtype, device);
        let vb = if prefix.is_empty() {
            vb
        } else {
            vb.pp(&prefix)
        };
        let x = fx
            .case_tensor(&case, "x")?
            .expect("x")
            .to_dtype(dtype)?
            .to_device(device)?;
        let kv = match fx.case_tensor(&case, "kv")? {
            Some(kv) => Some(kv.to_dtype(dtype)?.to_device(device)?),
            None => None,
        };
        let mask = match fx.case_tensor(&case, "attention_mask")? {
            Some(m) => Some(AttentionMask::padding(&m.to_device(device)?)?),
            None => None,
        };
        let out = if layout == WeightLayout::Single {
            SingleHeadSelfAttention::load(vb)?
                .with_causal(causal)
                .forward_with_weights(&x, mask.as_ref())?
        } else {
            let cfg = AttentionConfig::new(layout, heads).with_causal(causal);
            MultiHeadSelfAttention::load(vb, &cfg)?.attend(&x, kv.as_ref(), mask.as_ref(), true)?
        };
        let w = out.weights.expect("weights").to_device(&Device::Cpu)?;
        assert!(
            !common::has_non_finite(&w)?,
            "{name}/{case}: non-finite weights"
        );
        let c = out.context.to_device(&Device::Cpu)?;
        assert!(
            !common::has_non_finite(&c)?,
            "{name}/{case}: non-finite context"
        );
        worst_w = worst_w.max(max_abs_diff(
            &w,
            &fx.case_tensor(&case, "weights")?.expect("w"),
        )?);
        worst_c = worst_c.max(max_abs_diff(
            &c,
            &fx.case_tensor(&case, "context")?.expect("c"),
        )?);
    }
    Ok((worst_w, worst_c))
}

fn golden_on(device: &Device) -> anyhow::Result<()> {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let (tol_w, tol_c) = tolerances(dtype);
        for name in [
            "torch_mha",
            "bert_layer",
            "gpt2_attn",
            "llama_gqa",
            "single_head",
        ] {
            let (w, c) = fixture_error(name, device, dtype)?;
            eprintln!("{name} {dtype:?} on {device:?}: weights {w:e}, context {c:e}");
            assert!(
                w <= tol_w,
                "{name} {dtype:?} on {device:?}: weights off by {w:e} > {tol_w:e}"
            );
            assert!(
                c <= tol_c,
                "{name} {dtype:?} on {device:?}: context off by {c:e} > {tol_c:e}"
            );
        }
    }
    Ok(())
}

fn fully_masked_rows_on(device: &Device) -> anyhow::Result<()> {
    let ckpt = Checkpoint::open(repo_path("weights/model.safetensors"))?;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let vb = ckpt.var_builder(dtype, device);
        let attn = MultiHeadSelfAttention::load(
            vb.pp("encoder.layer.1.attention"),
            &AttentionConfig::new(WeightLayout::Bert, 12),
        )?;
        let x = candle_core::Tensor::randn(0f32, 1.0, (2, 6, 384), device)?.to_dtype(dtype)?;
        // Second sequence: no real token at all.
        let keep = candle_core::Tensor::new(&[[1u8, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]], device)?;
        let out = attn.forward_with_weights(&x, Some(&AttentionMask::padding(&keep)?))?;
        assert!(
            !common::has_non_finite(&out.context)?,
            "{dtype:?} context has NaN/inf"
        );
        let w = out.weights.expect("weights");
        assert!(
            !common::has_non_finite(&w)?,
            "{dtype:?} weights have NaN/inf"
        );
        let dead = w.get(1)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(dead, 0.0, "{dtype:?}: fully masked rows must be zero");
    }
    Ok(())
}

test_device!(golden_on, golden_cpu, golden_cuda, golden_metal);
test_device!(
    fully_masked_rows_on,
    fully_masked_rows_cpu,
    fully_masked_rows_cuda,
    fully_masked_rows_metal
);

/// The half-precision tolerances are not so loose that they would hide a real error:
/// the measured CPU error sits well inside them and above f32's.
#[test]
fn half_tolerances_are_not_loose() -> anyhow::Result<()> {
    for dtype in [DType::F16, DType::BF16] {
        let (tol_w, _) = tolerances(dtype);
        let (w, c) = fixture_error("bert_layer", &Device::Cpu, dtype)?;
        eprintln!("bert_layer {dtype:?}: weights {w:e}, context {c:e}");
        assert!(w > 1e-5, "{dtype:?} should differ from f32 at all");
        assert!(w < tol_w, "{dtype:?} error {w:e} vs tolerance {tol_w:e}");
    }
    Ok(())
}

/// Gradients against PyTorch autograd (`tests/fixtures/grads.json`), f32, on the default
/// path of the device: the CPU kernels' backward on the CPU, candle's autograd of the explicit
/// composition elsewhere. Within 1e-4 of each case's largest gradient.
fn gradients_on(device: &Device) -> anyhow::Result<()> {
    use candle_core::Var;
    let text = std::fs::read_to_string(repo_path("tests/fixtures/grads.json"))?;
    let json: serde_json::Value = serde_json::from_str(&text)?;
    let cases = json["cases"]
        .as_object()
        .ok_or_else(|| anyhow::anyhow!("grads.json has no cases"))?;
    for (case, meta) in cases {
        let file = meta["file"].as_str().unwrap_or_default();
        let ckpt = Checkpoint::open(repo_path(&format!("tests/fixtures/{file}")))?;
        let load = |name: &str| -> anyhow::Result<candle_core::Tensor> {
            Ok(ckpt.tensor(name, &Device::Cpu)?.to_device(device)?)
        };
        let mut named = std::collections::HashMap::new();
        let mut vars = Vec::new();
        for p in meta["params"].as_array().into_iter().flatten() {
            let name = p.as_str().unwrap_or_default().to_string();
            let var = Var::from_tensor(&load(&name)?)?;
            named.insert(name.clone(), var.as_tensor().clone());
            vars.push((name, var));
        }
        let vb = candle_nn::VarBuilder::from_tensors(named, DType::F32, device)
            .pp(meta["prefix"].as_str().unwrap_or_default());
        let causal = meta["causal"].as_bool().unwrap_or(false);
        let x = Var::from_tensor(&load("x")?)?;
        let kv = if ckpt.contains("kv") {
            Some(Var::from_tensor(&load("kv")?)?)
        } else {
            None
        };
        let mask = if ckpt.contains("attention_mask") {
            Some(AttentionMask::padding(&load("attention_mask")?)?)
        } else {
            None
        };
        let layout: WeightLayout = meta["layout"].as_str().unwrap_or_default().parse()?;
        let context = if layout == WeightLayout::Single {
            SingleHeadSelfAttention::load(vb)?
                .with_causal(causal)
                .forward(x.as_tensor(), mask.as_ref())?
                .context
        } else {
            let heads = meta["heads"].as_u64().unwrap_or(1) as usize;
            let mut cfg = AttentionConfig::new(layout, heads).with_causal(causal);
            cfg.num_kv_heads = meta["kv_heads"].as_u64().map(|n| n as usize);
            let attn = MultiHeadSelfAttention::load(vb, &cfg)?;
            attn.attend(
                x.as_tensor(),
                kv.as_ref().map(Var::as_tensor),
                mask.as_ref(),
                false,
            )?
            .context
        };
        let grads = (context * load("grad_context")?)?.sum_all()?.backward()?;
        let mut checks = vec![("grad_x".to_string(), x.as_tensor().clone())];
        if let Some(kv) = &kv {
            checks.push(("grad_kv".to_string(), kv.as_tensor().clone()));
        }
        for (name, var) in &vars {
            checks.push((format!("grad.{name}"), var.as_tensor().clone()));
        }
        let mut largest = 0f32;
        for (name, _) in &checks {
            let t = ckpt.tensor(name, &Device::Cpu)?;
            largest = largest.max(t.abs()?.max_all()?.to_scalar::<f32>()?);
        }
        for (name, t) in &checks {
            let g = grads
                .get(t)
                .ok_or_else(|| anyhow::anyhow!("{case} on {device:?}: no {name}"))?
                .to_device(&Device::Cpu)?;
            let d = max_abs_diff(&g, &ckpt.tensor(name, &Device::Cpu)?)?;
            assert!(
                d <= 1e-4 * largest,
                "{case} on {device:?}: {name} off by {d:e} (largest gradient {largest:e})"
            );
        }
    }
    Ok(())
}

test_device!(gradients_on, gradients_cpu, gradients_cuda, gradients_metal);

/// The tiny GGUF decoders (Q8_0 and Q4_1, `scripts/gen_gguf_fixtures.py`) on `device` give
/// the prompt logits of the same weights as transformers dequantizes them (a dense model
/// on the CPU) within f32 rounding (1e-4 of the largest: on CUDA the blocks dequantized
/// there, the products in another order) and the same 8 greedy ids, the cache decoding
/// them on the device. On Metal, where candle's kernels multiply the blocks, within 5% and
/// without the ids.
fn gguf_models_on(device: &Device) -> anyhow::Result<()> {
    use candle_attention::LlamaModel;
    use common::{decoder_prompt, greedy_run as run, step_logits, GGUF_CASES};
    for case in GGUF_CASES {
        let prompt = decoder_prompt(case)?;
        for ty in ["q8_0", "q4_1"] {
            let path = repo_path(&format!("tests/fixtures/gguf/{case}.{ty}.gguf"));
            let dense = repo_path(&format!("tests/fixtures/gguf/{case}.{ty}"));
            let dense = LlamaModel::from_dir(&dense, DType::F32, &Device::Cpu)?;
            let on = LlamaModel::from_gguf(&path, DType::F32, device)?;
            let (want, want_ids) = run(&dense, &prompt, &Device::Cpu)?;
            let (got, ids) = run(&on, &prompt, device)?;
            let top = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = got
                .iter()
                .zip(&want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            eprintln!("{case} {ty} on {device:?}: logits within {worst:e} of {top:e}");
            if device.is_metal() {
                // Candle's kernels: half-precision products for the prompt's rows.
                assert!(worst <= 5e-2 * top, "{case} {ty}: {worst} of {top}");
                continue;
            }
            assert!(worst <= 1e-4 * top, "{case} {ty}: {worst} of {top}");
            assert_eq!(ids, want_ids, "{case} {ty}: greedy ids");
            // One decode step's row (on CUDA, the exact block kernels where the widths fit).
            let (want, got) = (
                step_logits(&dense, &prompt, &Device::Cpu)?,
                step_logits(&on, &prompt, device)?,
            );
            let top = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = got
                .iter()
                .zip(&want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            eprintln!(
                "{case} {ty} on {device:?}: a decode step's logits within {worst:e} of {top:e}"
            );
            assert!(worst <= 1e-4 * top, "{case} {ty} step: {worst} of {top}");
        }
    }
    Ok(())
}

test_device!(
    gguf_models_on,
    gguf_models_cpu,
    gguf_models_cuda,
    gguf_models_metal
);

/// The shipped encoder (all-MiniLM-L6-v2) on `device` reproduces transformers' attentions
/// (every layer and head, within 1e-4) and last hidden states (1e-3) on the sentences of
/// `tests/fixtures/encoder_golden`, as `tests/encoder_golden.rs` checks on the CPU.
fn encoder_on(device: &Device) -> anyhow::Result<()> {
    use candle_core::Tensor;
    let fx = Fixture::open("encoder_golden")?;
    let model = common::shipped_encoder(device)?;
    let sentences = fx.meta["sentences"].as_array().cloned().unwrap_or_default();
    assert!(sentences.len() >= 3, "encoder_golden has its sentences");
    for s in &sentences {
        let (key, text) = (
            s["key"].as_str().unwrap_or(""),
            s["text"].as_str().unwrap_or(""),
        );
        let batch = model.text.encode_batch(&[text], device)?;
        let out = model.encoder.forward(
            &batch.input_ids,
            Some(&batch.token_type_ids),
            Some(&batch.attention_mask),
            true,
        )?;
        let attentions = out.attentions.expect("attentions");
        // (layers, heads, seq, seq)
        let stacked = Tensor::stack(&attentions, 0)?
            .squeeze(1)?
            .to_device(&Device::Cpu)?;
        let d = max_abs_diff(&stacked, &fx.tensor(&format!("{key}.attentions"))?)?;
        assert!(d <= 1e-4, "{key} on {device:?}: attentions off by {d:e}");
        let hidden = out.hidden_states.to_device(&Device::Cpu)?;
        let d = max_abs_diff(&hidden, &fx.tensor(&format!("{key}.last_hidden_state"))?)?;
        assert!(d <= 1e-3, "{key} on {device:?}: hidden states off by {d:e}");
    }
    Ok(())
}

test_device!(encoder_on, encoder_cpu, encoder_cuda, encoder_metal);

/// The explanations (rollout, grad, norm) on `device` against transformers'
/// (`tests/fixtures/explain`, as `tests/explain_golden.rs` checks them on the CPU), within
/// 1e-4 of each one's largest entry: the shipped encoder and the tiny LLaMA with grouped K/V
/// heads. Off the CPU the gradients come from candle's autograd of the explicit route.
fn explanations_on(device: &Device) -> anyhow::Result<()> {
    use candle_attention::viz::{ExplainMethod, Explanation};
    use candle_attention::LlamaModel;
    use common::{explanation_values as flat, json_floats as floats};
    use serde_json::Value;
    let close = |what: &str, got: &Explanation, want: &Value| {
        let (got, want) = (flat(got), floats(want));
        assert_eq!(got.len(), want.len(), "{what} on {device:?}: sizes");
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        let worst = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        eprintln!("{what} on {device:?}: within {worst:e} of {scale:e}");
        assert!(
            worst <= 1e-4 * scale,
            "{what} on {device:?}: {worst} of {scale}"
        );
    };
    let read = |name: &str| -> anyhow::Result<Value> {
        let text = std::fs::read_to_string(repo_path(&format!("tests/fixtures/explain/{name}")))?;
        Ok(serde_json::from_str(&text)?)
    };

    let model = common::shipped_encoder(device)?;
    let fx = read("minilm.json")?;
    for case in fx["cases"].as_array().map_or(&[][..], Vec::as_slice) {
        let text = case["text"].as_str().unwrap_or_default();
        let against = case["against"].as_str();
        let item = model.text.encode(text)?;
        let explain = |method, against| {
            Explanation::encoder(&model.encoder, &model.text, &item, method, against, device)
        };
        let rollout = explain(ExplainMethod::Rollout, None)?;
        close(&format!("{text} rollout"), &rollout, &case["rollout"]);
        let norm = explain(ExplainMethod::Norm, None)?;
        close(&format!("{text} norm"), &norm, &case["norm"]);
        let grad = explain(ExplainMethod::Grad, against)?;
        close(&format!("{text} grad"), &grad, &case["grad"]["matrix"]);
    }

    let model = LlamaModel::from_dir(
        repo_path("tests/fixtures/decoders/llama_gqa"),
        DType::F32,
        device,
    )?;
    let fx = read("llama_gqa.json")?;
    for case in fx["cases"].as_array().map_or(&[][..], Vec::as_slice) {
        let ids: Vec<u32> = floats(&case["input_ids"])
            .iter()
            .map(|&v| v as u32)
            .collect();
        let target = case["target_token_id"].as_u64().map(|t| t as u32);
        let explain = |method| Explanation::decoder(&model, &ids, method, target, device);
        close(
            "llama rollout",
            &explain(ExplainMethod::Rollout)?,
            &case["rollout"],
        );
        close("llama norm", &explain(ExplainMethod::Norm)?, &case["norm"]);
        close(
            "llama grad",
            &explain(ExplainMethod::Grad)?,
            &case["grad"]["matrix"],
        );
    }
    Ok(())
}

test_device!(
    explanations_on,
    explanations_cpu,
    explanations_cuda,
    explanations_metal
);

//! Golden tests against the real peers: fixtures from `torch.nn.MultiheadAttention`,
//! transformers' `BertModel` and GPT-2 attention, and `F.scaled_dot_product_attention`
//! with `enable_gqa=True` (generator: `scripts/gen_fixtures.py`).
//! Tolerances (f32): weights 1e-5, context 1e-4.

mod common;

use candle_attention::{
    scaled_dot_product_attention, AttentionConfig, AttentionMask, Checkpoint,
    MultiHeadSelfAttention, SdpaOptions, SingleHeadSelfAttention, WeightLayout,
};
use candle_core::{DType, Device};
use common::{assert_close, repo_path, Fixture};

const WEIGHTS_TOL: f32 = 1e-5;
const CONTEXT_TOL: f32 = 1e-4;

/// Runs every case of a module fixture through `MultiHeadSelfAttention`.
fn check_module_fixture(name: &str) -> anyhow::Result<()> {
    let fx = Fixture::open(name)?;
    let layout: WeightLayout = fx.meta["layout"].as_str().unwrap_or_default().parse()?;
    let heads = fx.meta["heads"].as_u64().unwrap_or(1) as usize;
    let weights_ckpt = match fx.meta["weights_file"].as_str() {
        Some(f) => Checkpoint::open(repo_path(f))?,
        None => fx.ckpt.clone(),
    };
    let cases = fx.cases();
    assert!(!cases.is_empty(), "{name} has no cases");
    for case in cases {
        let meta = fx.case_meta(&case);
        let causal = meta["causal"].as_bool().unwrap_or(false);
        let prefix = fx.prefix(&case);
        let vb = weights_ckpt.var_builder(DType::F32, &Device::Cpu);
        let vb = if prefix.is_empty() {
            vb
        } else {
            vb.pp(&prefix)
        };
        let x = fx.case_tensor(&case, "x")?.expect("x");
        let kv = fx.case_tensor(&case, "kv")?;
        let mask = fx.case_mask(&case)?;
        let out = if layout == WeightLayout::Single {
            let head = SingleHeadSelfAttention::load(vb)?.with_causal(causal);
            head.forward_with_weights(&x, mask.as_ref())?
        } else {
            let cfg = AttentionConfig::new(layout, heads).with_causal(causal);
            let attn = MultiHeadSelfAttention::load(vb, &cfg)?;
            assert!(attn.is_fused(), "{name}: Q/K/V should be fused");
            attn.attend(&x, kv.as_ref(), mask.as_ref(), true)?
        };
        let what = format!("{name}/{case}");
        let expected_w = fx.case_tensor(&case, "weights")?.expect("weights");
        let weights = out.weights.expect("weights requested");
        assert_close(
            &weights,
            &expected_w,
            WEIGHTS_TOL,
            &format!("{what} weights"),
        )?;
        let expected_c = fx.case_tensor(&case, "context")?.expect("context");
        assert_close(
            &out.context,
            &expected_c,
            CONTEXT_TOL,
            &format!("{what} context"),
        )?;
    }
    Ok(())
}

#[test]
fn torch_multihead_attention() -> anyhow::Result<()> {
    check_module_fixture("torch_mha")
}

#[test]
fn bert_attention_on_shipped_weights() -> anyhow::Result<()> {
    check_module_fixture("bert_layer")
}

#[test]
fn gpt2_attention() -> anyhow::Result<()> {
    check_module_fixture("gpt2_attn")
}

#[test]
fn llama_grouped_query_attention() -> anyhow::Result<()> {
    check_module_fixture("llama_gqa")
}

#[test]
fn single_head_attention() -> anyhow::Result<()> {
    check_module_fixture("single_head")
}

#[test]
fn sdpa_function_with_grouped_heads() -> anyhow::Result<()> {
    let fx = Fixture::open("sdpa_gqa")?;
    let (q, k, v) = (fx.tensor("q")?, fx.tensor("k")?, fx.tensor("v")?);
    for case in fx.cases() {
        let meta = fx.case_meta(&case);
        let mask = match fx.case_tensor(&case, "keep")? {
            Some(keep) => Some(AttentionMask::keep(&keep)?),
            None => None,
        };
        let opts = SdpaOptions {
            scale: meta["scale_arg"].as_f64(),
            need_weights: true,
        };
        let out = scaled_dot_product_attention(&q, &k, &v, mask.as_ref(), opts)?;
        let w = fx.case_tensor(&case, "weights")?.expect("weights");
        let c = fx.case_tensor(&case, "context")?.expect("context");
        assert_close(
            out.weights.as_ref().expect("weights"),
            &w,
            WEIGHTS_TOL,
            &case,
        )?;
        assert_close(&out.context, &c, CONTEXT_TOL, &case)?;
        // The path without weights gives the same context.
        let fast = scaled_dot_product_attention(
            &q,
            &k,
            &v,
            mask.as_ref(),
            SdpaOptions {
                need_weights: false,
                ..opts
            },
        )?;
        assert!(fast.weights.is_none());
        assert_close(
            &fast.context,
            &c,
            CONTEXT_TOL,
            &format!("{case} (no weights)"),
        )?;
    }
    Ok(())
}

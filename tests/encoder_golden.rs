//! The encoder built from this crate's attention reproduces transformers' `BertModel`
//! (every layer's and head's attention within 1e-4) and sentence-transformers' embeddings
//! (cosine >= 0.99999) on the shipped all-MiniLM-L6-v2 weights (f32 compute).

mod common;

use candle_attention::{l2_normalize, mean_pool, Model, ModelResolver};
use candle_core::{DType, Device, IndexOp, Tensor};
use common::{assert_close, Fixture};

fn model() -> anyhow::Result<Model> {
    common::shipped_encoder(&Device::Cpu)
}

fn sentences(fx: &Fixture) -> Vec<(String, String)> {
    fx.meta["sentences"]
        .as_array()
        .expect("sentences")
        .iter()
        .map(|s| {
            (
                s["key"].as_str().expect("key").to_string(),
                s["text"].as_str().expect("text").to_string(),
            )
        })
        .collect()
}

#[test]
fn attentions_and_embeddings_match_transformers() -> anyhow::Result<()> {
    let fx = Fixture::open("encoder_golden")?;
    let model = model()?;
    let sents = sentences(&fx);
    assert!(sents.len() >= 3);
    for (key, text) in &sents {
        let batch = model.text.encode_batch(&[text], &Device::Cpu)?;
        let want_ids = fx.tensor(&format!("{key}.input_ids"))?;
        let ids: Vec<Vec<u32>> = batch.input_ids.to_vec2()?;
        let want: Vec<Vec<i64>> = want_ids.to_vec2()?;
        assert_eq!(
            ids[0].iter().map(|&x| x as i64).collect::<Vec<_>>(),
            want[0],
            "{text}"
        );

        let out = model.encoder.forward(
            &batch.input_ids,
            Some(&batch.token_type_ids),
            Some(&batch.attention_mask),
            true,
        )?;
        let attentions = out.attentions.expect("attentions");
        let stacked = Tensor::stack(&attentions, 0)?.squeeze(1)?; // (layers, heads, seq, seq)
        let want_att = fx.tensor(&format!("{key}.attentions"))?;
        assert_close(&stacked, &want_att, 1e-4, &format!("{key} attentions"))?;
        let want_hidden = fx.tensor(&format!("{key}.last_hidden_state"))?;
        assert_close(
            &out.hidden_states,
            &want_hidden,
            1e-3,
            &format!("{key} hidden"),
        )?;

        let emb = l2_normalize(&mean_pool(&out.hidden_states, &batch.attention_mask)?)?.i(0)?;
        let want_emb = fx.tensor(&format!("{key}.embedding"))?;
        let cos = (emb.mul(&want_emb)?.sum_all()?.to_scalar::<f32>()?)
            / (want_emb.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?);
        assert!(cos >= 0.99999, "{key}: cosine {cos}");
    }
    Ok(())
}

#[test]
fn batched_sentences_equal_each_alone() -> anyhow::Result<()> {
    let fx = Fixture::open("encoder_golden")?;
    let model = model()?;
    let sents = sentences(&fx);
    let texts: Vec<&str> = sents.iter().map(|(_, t)| t.as_str()).collect();
    let batch = model.text.encode_batch(&texts, &Device::Cpu)?;
    let out = model.encoder.forward(
        &batch.input_ids,
        Some(&batch.token_type_ids),
        Some(&batch.attention_mask),
        true,
    )?;
    let attentions = out.attentions.expect("attentions");
    for (i, item) in batch.items.iter().enumerate() {
        let n = item.len();
        let alone = model.text.encode_batch(&[&item.text], &Device::Cpu)?;
        let single = model.encoder.forward(&alone.input_ids, None, None, true)?;
        let single_att = single.attentions.expect("attentions");
        for (layer, (batched, one)) in attentions.iter().zip(&single_att).enumerate() {
            let b = batched.i(i)?.narrow(1, 0, n)?.narrow(2, 0, n)?; // (heads, n, n)
            assert_close(&b, &one.i(0)?, 1e-5, &format!("sentence {i} layer {layer}"))?;
            // Padded keys get exactly zero weight.
            if n < batched.dim(3)? {
                let pad = batched.i(i)?.narrow(2, n, batched.dim(3)? - n)?;
                assert_eq!(pad.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
            }
        }
        let h = out.hidden_states.i(i)?.narrow(0, 0, n)?;
        assert_close(
            &h,
            &single.hidden_states.i(0)?,
            1e-4,
            &format!("sentence {i} hidden"),
        )?;
    }
    Ok(())
}

#[test]
fn f16_weights_stay_close_to_f32() -> anyhow::Result<()> {
    let files = ModelResolver::new().resolve(None)?;
    let m16 = Model::load(files.clone(), DType::F16, &Device::Cpu, false)?;
    let m32 = Model::load(files, DType::F32, &Device::Cpu, false)?;
    let texts = [
        "The animal didn't cross the street because it was too tired.",
        "Hi.",
    ];
    let batch = m32.text.encode_batch(&texts, &Device::Cpu)?;
    let a = m32
        .encoder
        .forward(&batch.input_ids, None, Some(&batch.attention_mask), true)?;
    let b = m16
        .encoder
        .forward(&batch.input_ids, None, Some(&batch.attention_mask), true)?;
    for (x, y) in a
        .attentions
        .expect("a")
        .iter()
        .zip(b.attentions.expect("b").iter())
    {
        assert!(!common::has_non_finite(y)?);
        // The real tokens' rows (padding rows skip the feed-forward on the CPU kernels).
        for (i, item) in batch.items.iter().enumerate() {
            let n = item.len();
            let (xi, yi) = (x.i(i)?.narrow(1, 0, n)?, y.i(i)?.narrow(1, 0, n)?);
            assert_close(&yi, &xi, 2e-2, "f16 compute vs f32 compute")?;
        }
    }
    Ok(())
}

/// Sentences of mixed lengths (a few to ~60 tokens), with a repeat.
fn mixed_corpus() -> Vec<String> {
    let words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge \
                 boxing matches near an old harbour under grey autumn skies";
    let words: Vec<&str> = words.split_whitespace().collect();
    let mut out: Vec<String> = (0..23)
        .map(|i| {
            let n = 1 + (i * 17) % 48;
            (0..n)
                .map(|k| words[(i * 5 + k * 3) % words.len()])
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    out.push(out[3].clone());
    out
}

#[test]
fn embedder_keeps_input_order_and_no_batch_changes_an_embedding() -> anyhow::Result<()> {
    let fx = Fixture::open("encoder_golden")?;
    let model = model()?;
    // Golden sentences first: the embedder reproduces sentence-transformers on them.
    let mut corpus: Vec<String> = sentences(&fx).into_iter().map(|(_, t)| t).collect();
    let golden = corpus.len();
    corpus.extend(mixed_corpus());
    let texts: Vec<&str> = corpus.iter().map(String::as_str).collect();
    let alone: Vec<Vec<f32>> = texts
        .iter()
        .map(|t| Ok(model.embedder(&Device::Cpu).embed(&[t])?.remove(0)))
        .collect::<anyhow::Result<_>>()?;
    for batch_size in [1, 3, 8, 32] {
        let mut batches = 0;
        let rows = model
            .embedder(&Device::Cpu)
            .with_batch_size(batch_size)?
            .embed_with_progress(&texts, |n| {
                assert!(n >= 1 && n <= batch_size);
                batches += 1;
            })?;
        assert_eq!(batches, texts.len().div_ceil(batch_size));
        assert_eq!(rows.len(), texts.len());
        for (i, (row, one)) in rows.iter().zip(&alone).enumerate() {
            let d = row
                .iter()
                .zip(one)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                d <= 1e-6,
                "batch {batch_size}, sentence {i}: differs by {d}"
            );
        }
    }
    for (i, (key, _)) in sentences(&fx).iter().enumerate().take(golden) {
        let want: Vec<f32> = fx.tensor(&format!("{key}.embedding"))?.to_vec1()?;
        let cos: f32 = alone[i].iter().zip(&want).map(|(a, b)| a * b).sum::<f32>()
            / want.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!(cos >= 0.99999, "{key}: cosine {cos}");
    }
    // The repeated sentence gets the same row wherever it sits.
    assert_eq!(alone[golden + 3], alone[corpus.len() - 1]);
    assert!(model.embedder(&Device::Cpu).with_batch_size(0).is_err());
    Ok(())
}

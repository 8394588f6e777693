//! Modules are `Send + Sync`, give identical results from several threads at once, and
//! are deterministic run to run on the CPU (bit-identical outputs).

mod common;

use candle_attention::{
    AttentionConfig, BertEncoder, Checkpoint, Model, ModelResolver, MultiHeadSelfAttention,
    SingleHeadSelfAttention, TextEncoder, WeightLayout,
};
use candle_core::{DType, Device, Tensor};
use common::repo_path;

fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn public_types_are_send_and_sync() {
    assert_send_sync::<MultiHeadSelfAttention>();
    assert_send_sync::<SingleHeadSelfAttention>();
    assert_send_sync::<BertEncoder>();
    assert_send_sync::<Model>();
    assert_send_sync::<Checkpoint>();
    assert_send_sync::<TextEncoder>();
}

fn bits(t: &Tensor) -> anyhow::Result<Vec<u32>> {
    let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    Ok(v.into_iter().map(f32::to_bits).collect())
}

fn bert_layer() -> anyhow::Result<MultiHeadSelfAttention> {
    let ckpt = Checkpoint::open(repo_path("weights/model.safetensors"))?;
    let vb = ckpt.var_builder(DType::F32, &Device::Cpu);
    Ok(MultiHeadSelfAttention::load(
        vb.pp("encoder.layer.2.attention"),
        &AttentionConfig::new(WeightLayout::Bert, 12),
    )?)
}

#[test]
fn four_threads_get_the_single_threaded_result() -> anyhow::Result<()> {
    let layer = bert_layer()?;
    let x = Tensor::randn(0f32, 1.0, (3, 37, 384), &Device::Cpu)?;
    let reference = layer.forward_with_weights(&x, None)?;
    let (ref_ctx, ref_w) = (
        bits(&reference.context)?,
        bits(&reference.weights.expect("w"))?,
    );
    std::thread::scope(|s| -> anyhow::Result<()> {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| -> anyhow::Result<(Vec<u32>, Vec<u32>)> {
                    let mut last = (Vec::new(), Vec::new());
                    for _ in 0..5 {
                        let out = layer.forward_with_weights(&x, None)?;
                        last = (bits(&out.context)?, bits(&out.weights.expect("w"))?);
                    }
                    Ok(last)
                })
            })
            .collect();
        for h in handles {
            let (ctx, w) = h.join().map_err(|_| anyhow::anyhow!("thread panicked"))??;
            assert!(ctx == ref_ctx, "context differs across threads");
            assert!(w == ref_w, "weights differ across threads");
        }
        Ok(())
    })
}

#[test]
fn encoder_is_deterministic_and_thread_safe() -> anyhow::Result<()> {
    let model = Model::load(
        ModelResolver::new().resolve(None)?,
        DType::F32,
        &Device::Cpu,
        false,
    )?;
    let texts = [
        "The animal didn't cross the street because it was too tired.",
        "Hello world!",
    ];
    let run = || -> anyhow::Result<Vec<u32>> {
        let batch = model.text.encode_batch(&texts, &Device::Cpu)?;
        let out =
            model
                .encoder
                .forward(&batch.input_ids, None, Some(&batch.attention_mask), true)?;
        let mut all = bits(&out.hidden_states)?;
        for a in out.attentions.expect("attentions") {
            all.extend(bits(&a)?);
        }
        Ok(all)
    };
    let first = run()?;
    assert!(run()? == first, "two runs differ");
    std::thread::scope(|s| -> anyhow::Result<()> {
        let handles: Vec<_> = (0..4).map(|_| s.spawn(run)).collect();
        for h in handles {
            let got = h.join().map_err(|_| anyhow::anyhow!("thread panicked"))??;
            assert!(got == first, "a concurrent run differs");
        }
        Ok(())
    })
}

#[test]
fn forward_inside_a_rayon_pool_equals_forward_outside() -> anyhow::Result<()> {
    // Called from outside the pool the fused forward hands itself to the pool; from a pool
    // thread (here a pool of 3, another size than the global one) it runs where it is. Both
    // must give the same bits, with and without weights, causal or not.
    let layer = bert_layer()?;
    let x = Tensor::randn(0f32, 1.0, (2, 45, 384), &Device::Cpu)?;
    let outside = layer.forward_with_weights(&x, None)?;
    let outside_fast = layer.forward(&x, None)?;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build()?;
    let (inside, inside_fast) = pool.install(|| -> anyhow::Result<_> {
        Ok((
            layer.forward_with_weights(&x, None)?,
            layer.forward(&x, None)?,
        ))
    })?;
    assert_eq!(bits(&outside.context)?, bits(&inside.context)?);
    assert_eq!(
        bits(&outside.weights.expect("w"))?,
        bits(&inside.weights.expect("w"))?
    );
    assert_eq!(bits(&outside_fast.context)?, bits(&inside_fast.context)?);
    assert_eq!(bits(&outside_fast.context)?, bits(&outside.context)?);
    Ok(())
}

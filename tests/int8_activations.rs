//! `set_int8_activations` (process-wide, so in a test binary of its own): the tiny GGUF
//! decoders (Q8_0, Q4_1; `scripts/gen_gguf_fixtures.py`, `scripts/gen_gguf_family_fixtures.py`)
//! run prompts and decode steps with
//! 8-bit activations to logits close to the exact ones, and switching it off gives the exact ones back bit for
//! bit.

mod common;

use candle_attention::{int8_activations, set_int8_activations, LlamaModel};
use candle_core::{DType, Device, Tensor};
use common::repo_path;

/// The logits of 6 decode steps after a prompt of `prompt` ids (3: the row kernels; 30:
/// more rows than they take, the prompt's products), fed the same ids each time.
fn decode_logits(model: &LlamaModel, prompt: usize) -> anyhow::Result<Vec<f32>> {
    let dev = Device::Cpu;
    let mut caches = model.new_caches(48);
    let ids: Vec<u32> = (0..prompt as u32).map(|i| (i * 7 + 1) % 13).collect();
    let mut out = model
        .forward_last(
            &Tensor::new(ids.as_slice(), &dev)?.unsqueeze(0)?,
            &mut caches,
        )?
        .flatten_all()?
        .to_vec1::<f32>()?;
    for id in [3u32, 7, 2, 11, 4, 6] {
        let step = model.forward_last(&Tensor::new(&[[id]], &dev)?, &mut caches)?;
        out.extend(step.flatten_all()?.to_vec1::<f32>()?);
    }
    Ok(out)
}

#[test]
fn int8_activations_stay_close_and_switch_off_exactly() -> anyhow::Result<()> {
    assert!(!int8_activations(), "off by default");
    // The LLaMA-family files, and Qwen3's and Gemma 3's (q/k norms, Gemma's GeGLU and
    // sandwich norms) from scripts/gen_gguf_family_fixtures.py.
    let files = [
        ("llama_gqa", "q8_0"),
        ("llama_gqa", "q4_1"),
        ("qwen2_tied", "q8_0"),
        ("qwen2_tied", "q4_1"),
        ("qwen3", "q8_0"),
        ("gemma3", "q8_0"),
    ];
    for (case, ty) in files {
        for prompt in [3, 30] {
            let path = repo_path(&format!("tests/fixtures/gguf/{case}.{ty}.gguf"));
            let model = LlamaModel::from_gguf(&path, DType::F32, &Device::Cpu)?;
            let exact = decode_logits(&model, prompt)?;
            set_int8_activations(true);
            let int8 = decode_logits(&model, prompt);
            set_int8_activations(false);
            let int8 = int8?;
            assert_eq!(int8.len(), exact.len());
            // Close: the largest difference within 5% of the largest logit.
            let top = exact.iter().fold(0f32, |a, v| a.max(v.abs()));
            let worst = int8
                .iter()
                .zip(&exact)
                .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
            assert!(
                worst <= 0.05 * top,
                "{case} {ty} {prompt}: {worst} against {top}"
            );
            // Where the CPU has AVX-512 VNNI (and the kernels are not capped), 8-bit it was.
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx512vnni")
                && std::env::var("CANDLE_ATTENTION_ISA").is_err()
            {
                // The prompt's own logits (the first of 7 sets): its products were 8-bit.
                let vocab = exact.len() / 7;
                assert!(
                    int8[..vocab]
                        .iter()
                        .zip(&exact[..vocab])
                        .any(|(a, b)| a != b),
                    "{case} {ty} {prompt}: the same prompt logits"
                );
            }
            eprintln!(
                "{case} {ty} {prompt}: largest difference {worst:.2e}, largest logit {top:.2e}"
            );
            let again = decode_logits(&model, prompt)?;
            assert!(
                again
                    .iter()
                    .zip(&exact)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{case} {ty} {prompt}: off again is not exact"
            );
        }
    }
    Ok(())
}

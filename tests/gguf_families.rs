//! GGUF files of the decoder families beside LLaMA, written as llama.cpp's converter writes
//! them (`scripts/gen_gguf_family_fixtures.py`: GPT-2's `Conv1D` weights transposed and
//! `c_attn` as `attn_qkv`, GPT-NeoX's per-head rows reordered into Q, K, V blocks, Phi-3's
//! fused `attn_qkv` and `ffn_up`, Qwen3's q/k norms): the Q8_0 file's logits, attentions and
//! greedy ids equal transformers' on its dequantized weights, the F32 file's logits equal
//! the source checkpoint's.

mod common;

use candle_attention::{argmax_ids, Checkpoint, LlamaModel};
use candle_core::{DType, Device, Tensor};
use common::{assert_close, ids_in as u32s, largest_abs as largest, max_abs_diff, repo_path};

const CASES: [&str; 4] = ["gpt2", "pythia", "phi3", "qwen3"];

/// A GGUF file's model, its prompt (from `expected`) and the prompt's logits `(seq, vocab)`.
fn prompt_logits(
    file: &str,
    expected: &str,
) -> anyhow::Result<(LlamaModel, Checkpoint, Tensor, Tensor)> {
    let dev = Device::Cpu;
    let model = LlamaModel::from_gguf(repo_path(file), DType::F32, &dev)?;
    let exp = Checkpoint::open(repo_path(expected))?;
    let prompt = u32s(&exp, "input_ids")?;
    let ids = Tensor::new(prompt.as_slice(), &dev)?.unsqueeze(0)?;
    let mut caches = model.new_caches(prompt.len());
    let logits = model.forward(&ids, &mut caches)?.squeeze(0)?;
    let want = exp.tensor("logits", &dev)?;
    let d = max_abs_diff(&logits, &want)?;
    assert!(d <= 1e-4 * largest(&want)?, "{file}: logits off by {d:e}");
    Ok((model, exp, ids, logits))
}

#[test]
fn quantized_files_equal_transformers_on_their_dequantized_weights() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for case in CASES {
        let (model, exp, ids, _) = prompt_logits(
            &format!("tests/fixtures/gguf/{case}.q8_0.gguf"),
            &format!("tests/fixtures/gguf/{case}.q8_0/expected.safetensors"),
        )?;
        let att = Tensor::stack(&model.attentions(&ids)?, 0)?.squeeze(1)?;
        assert_close(&att, &exp.tensor("attentions", &dev)?, 1e-5, case)?;
        let want_ids = u32s(&exp, "generated_ids")?;
        let mut caches = model.new_caches(4);
        let mut got = argmax_ids(&model.forward_last(&ids, &mut caches)?)?;
        while got.len() < want_ids.len() {
            let step = Tensor::new(&[got[got.len() - 1]], &dev)?.unsqueeze(0)?;
            got.extend(argmax_ids(&model.forward_last(&step, &mut caches)?)?);
        }
        assert_eq!(got, want_ids, "{case}: greedy ids");
    }
    Ok(())
}

#[test]
fn f32_files_equal_the_source_checkpoints() -> anyhow::Result<()> {
    for case in CASES {
        prompt_logits(
            &format!("tests/fixtures/gguf/{case}.f32.gguf"),
            &format!("tests/fixtures/decoders/{case}/expected.safetensors"),
        )?;
    }
    Ok(())
}

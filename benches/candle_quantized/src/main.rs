//! `candle-quantized-bench FILE.gguf PROMPT_IDS N_DECODE`: candle-transformers' quantized
//! model for the file's architecture (`quantized_gemma3` for Gemma 3, `quantized_llama` for
//! the LLaMA family) on one GGUF file. Prints one JSON line: the prompt's prefill tokens/s
//! and, after it, `N_DECODE` greedy steps' tokens/s (EOS ignored), and the greedy ids.

use std::time::Instant;

use anyhow::Context;
use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::{quantized_gemma3, quantized_llama};

/// One of candle-transformers' quantized models.
enum Model {
    Llama(quantized_llama::ModelWeights),
    Gemma3(quantized_gemma3::ModelWeights),
}

impl Model {
    /// The logits of the last position, `(1, vocab)`.
    fn forward(&mut self, x: &Tensor, index_pos: usize) -> candle_core::Result<Tensor> {
        match self {
            Model::Llama(m) => m.forward(x, index_pos),
            Model::Gemma3(m) => m.forward(x, index_pos),
        }
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, path, ids, n] = args.as_slice() else {
        anyhow::bail!(
            "usage: candle-quantized-bench FILE.gguf PROMPT_IDS(comma-separated) N_DECODE"
        );
    };
    let ids: Vec<u32> = ids
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<Result<_, _>>()
        .context("prompt ids")?;
    let n: usize = n.parse().context("N_DECODE")?;
    let dev = Device::Cpu;
    let mut file = std::fs::File::open(path).with_context(|| path.clone())?;
    let content = gguf_file::Content::read(&mut file)?;
    let arch = content
        .metadata
        .get("general.architecture")
        .and_then(|v| v.to_string().ok().cloned())
        .unwrap_or_default();
    let (tool, mut model) = match arch.as_str() {
        "gemma3" => (
            "candle quantized_gemma3 0.11.1",
            Model::Gemma3(quantized_gemma3::ModelWeights::from_gguf(content, &mut file, &dev)?),
        ),
        _ => (
            "candle quantized_llama 0.11.1",
            Model::Llama(quantized_llama::ModelWeights::from_gguf(content, &mut file, &dev)?),
        ),
    };
    let t = Instant::now();
    let logits = model.forward(&Tensor::new(ids.as_slice(), &dev)?.unsqueeze(0)?, 0)?;
    let prefill = t.elapsed().as_secs_f64();
    let mut next = logits.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?;
    let mut out = vec![next];
    let t = Instant::now();
    for step in 0..n.saturating_sub(1) {
        let x = Tensor::new(&[next], &dev)?.unsqueeze(0)?;
        let logits = model.forward(&x, ids.len() + step)?;
        next = logits.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?;
        out.push(next);
    }
    let decode = t.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::json!({
            "tool": tool,
            "prefill_tokens_per_s": ids.len() as f64 / prefill,
            "decode_tokens_per_s": (n.saturating_sub(1)) as f64 / decode.max(1e-9),
            "generated_ids": out,
        })
    );
    Ok(())
}

//! Trains a small character-level causal language model built on this crate's attention:
//! embeddings, one pre-LayerNorm transformer block (our `MultiHeadSelfAttention`, created
//! fresh on a `VarMap`, and a candle-nn MLP), AdamW. Prints the loss per step and samples a
//! line at the end.
//!
//! ```text
//! cargo run --release --example train -- [--text FILE] [--steps 400] [--save model.safetensors]
//! ```

use std::time::Instant;

use anyhow::{bail, Context};
use candle_attention::{AttentionConfig, MultiHeadSelfAttention, WeightLayout};
use candle_core::{DType, Device, IndexOp, Module, Tensor, D};
use candle_nn::{
    embedding, layer_norm, linear, Embedding, LayerNorm, Linear, Optimizer, VarBuilder, VarMap,
};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Train a character-level causal model on a text file")]
struct Args {
    /// Training text (default: the sonnets shipped in examples/data/).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/data/sonnets.txt"))]
    text: std::path::PathBuf,
    #[arg(long, default_value_t = 400)]
    steps: usize,
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Characters per training window (and the longest context when sampling).
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    #[arg(long, default_value_t = 128)]
    hidden: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Write the trained variables here (safetensors, checkpoint names).
    #[arg(long)]
    save: Option<std::path::PathBuf>,
}

/// Embeddings, one transformer block with our attention, and the output head.
struct Model {
    tok: Embedding,
    pos: Embedding,
    ln1: LayerNorm,
    attn: MultiHeadSelfAttention,
    ln2: LayerNorm,
    fc: Linear,
    proj: Linear,
    ln_f: LayerNorm,
    head: Linear,
}

impl Model {
    fn new(vb: VarBuilder, vocab: usize, a: &Args) -> anyhow::Result<Self> {
        let d = a.hidden;
        let cfg = AttentionConfig::new(WeightLayout::Gpt2, a.heads).with_hidden_size(d); // causal
        Ok(Self {
            tok: embedding(vocab, d, vb.pp("wte"))?,
            pos: embedding(a.seq_len, d, vb.pp("wpe"))?,
            ln1: layer_norm(d, 1e-5, vb.pp("h.0.ln_1"))?,
            attn: MultiHeadSelfAttention::load(vb.pp("h.0.attn"), &cfg)?,
            ln2: layer_norm(d, 1e-5, vb.pp("h.0.ln_2"))?,
            fc: linear(d, 4 * d, vb.pp("h.0.mlp.c_fc"))?,
            proj: linear(4 * d, d, vb.pp("h.0.mlp.c_proj"))?,
            ln_f: layer_norm(d, 1e-5, vb.pp("ln_f"))?,
            head: linear(d, vocab, vb.pp("lm_head"))?,
        })
    }

    /// Logits `(batch, seq, vocab)` of token ids `(batch, seq)`.
    fn forward(&self, ids: &Tensor) -> anyhow::Result<Tensor> {
        let (_, t) = ids.dims2()?;
        let positions = Tensor::arange(0u32, t as u32, ids.device())?;
        let x = self
            .tok
            .forward(ids)?
            .broadcast_add(&self.pos.forward(&positions)?)?; // (b, t, d)
        let x = (&x + self.attn.forward(&self.ln1.forward(&x)?, None)?.context)?;
        let mlp = self
            .proj
            .forward(&self.fc.forward(&self.ln2.forward(&x)?)?.gelu_erf()?)?;
        let x = (x + mlp)?;
        Ok(self.head.forward(&self.ln_f.forward(&x)?)?) // (b, t, vocab)
    }
}

/// xorshift64*: a small deterministic generator for batches and sampling.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    // Each step allocates its gradients afresh: keep freed memory for the next one.
    candle_attention::retain_freed_memory();
    let text = std::fs::read_to_string(&a.text)
        .with_context(|| format!("reading {}", a.text.display()))?;
    let mut chars: Vec<char> = text.chars().collect();
    chars.sort_unstable();
    chars.dedup();
    let ids: Vec<u32> = text
        .chars()
        .map(|c| chars.binary_search(&c).map_or(0, |i| i as u32))
        .collect();
    if ids.len() <= a.seq_len + 1 {
        bail!(
            "{} has {} characters; it needs more than --seq-len + 1 = {}",
            a.text.display(),
            ids.len(),
            a.seq_len + 1
        );
    }
    let dev = Device::Cpu;
    let vm = VarMap::new();
    let model = Model::new(
        VarBuilder::from_varmap(&vm, DType::F32, &dev),
        chars.len(),
        &a,
    )?;
    let params: usize = vm.all_vars().iter().map(|v| v.elem_count()).sum();
    println!(
        "{} characters, vocabulary {}, {params} parameters",
        ids.len(),
        chars.len()
    );
    let mut opt = candle_nn::AdamW::new_lr(vm.all_vars(), a.lr)?;
    let mut rng = Rng(a.seed.max(1));
    let t0 = Instant::now();
    for step in 1..=a.steps {
        // Random windows: inputs and the next characters as targets.
        let (mut xs, mut ys) = (Vec::new(), Vec::new());
        for _ in 0..a.batch {
            let s = rng.below(ids.len() - a.seq_len - 1);
            xs.extend_from_slice(&ids[s..s + a.seq_len]);
            ys.extend_from_slice(&ids[s + 1..s + a.seq_len + 1]);
        }
        let x = Tensor::from_vec(xs, (a.batch, a.seq_len), &dev)?;
        let y = Tensor::from_vec(ys, a.batch * a.seq_len, &dev)?;
        let logits = model
            .forward(&x)?
            .reshape((a.batch * a.seq_len, chars.len()))?;
        let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
        opt.backward_step(&loss)?;
        println!("step {step:4}  loss {:.4}", loss.to_scalar::<f32>()?);
    }
    let per_step = t0.elapsed() / a.steps.max(1) as u32;
    println!(
        "{} steps, {per_step:.1?} per step (forward + backward + AdamW)",
        a.steps
    );

    // Sample one line from the first character of the text, temperature 0.8.
    let mut out: Vec<u32> = ids[..1].to_vec();
    while out.len() < 120 {
        let ctx = &out[out.len().saturating_sub(a.seq_len)..];
        let x = Tensor::new(ctx, &dev)?.unsqueeze(0)?;
        let logits = model.forward(&x)?.i((0, ctx.len() - 1))?; // (vocab,)
        let probs = candle_nn::ops::softmax(&(logits / 0.8)?, D::Minus1)?.to_vec1::<f32>()?;
        let (mut u, mut next) = (rng.unit(), probs.len() - 1);
        for (i, p) in probs.iter().enumerate() {
            u -= p;
            if u <= 0.0 {
                next = i;
                break;
            }
        }
        out.push(next as u32);
        if chars[next] == '\n' {
            break;
        }
    }
    println!(
        "sample: {}",
        out.iter()
            .map(|&i| chars[i as usize])
            .collect::<String>()
            .trim_end()
    );
    if let Some(path) = &a.save {
        vm.save(path)?;
        println!("saved {}", path.display());
    }
    Ok(())
}

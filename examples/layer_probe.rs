//! Applies one attention layer of a checkpoint to activations saved in a file, so a model
//! port can be diffed against PyTorch.
//!
//! ```text
//! cargo run --release --example layer_probe -- \
//!   --weights W.safetensors --layout bert|torch-mha|gpt2|llama|single \
//!   [--prefix encoder.layer.3.attention] [--heads 12] [--kv-heads 2] [--causal] \
//!   --input IN.safetensors --output OUT.safetensors [--backward]
//! ```
//!
//! `IN` holds `x` f32 `(batch, seq, hidden)`, optionally `attention_mask` `(batch, seq_k)`
//! (I64, U8 or F32; 1 = keep) and `kv` f32 `(batch, seq_k, hidden)` for cross-attention.
//! `OUT` gets F32 `context` `(batch, seq, hidden_out)` (after W_O where the layout has one)
//! and F32 `weights` `(batch, heads, seq, seq_k)`.
//!
//! With `--backward`, `IN` also holds F32 `grad_context` `(batch, seq, hidden_out)`, and `OUT`
//! also gets the gradients of `sum(context * grad_context)`, computed on the default path as
//! a user training the layer gets it (the checkpoint's tensors as variables): F32 `grad_x`,
//! `grad_kv` for cross-attention, and `grad.<full checkpoint name>` in the checkpoint's own
//! shape for every parameter the layer loaded (e.g. `grad.attn.in_proj_weight` `(3d, d)`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use candle_attention::{
    parse_dtype, select_device, AttentionConfig, AttentionMask, AttentionOutput, Checkpoint,
    HfConfig, MultiHeadSelfAttention, SingleHeadSelfAttention, WeightLayout,
};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarBuilder;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Apply one attention layer of a checkpoint to saved activations")]
struct Args {
    /// Safetensors file with the layer's weights.
    #[arg(long)]
    weights: PathBuf,
    /// Checkpoint layout: bert, torch-mha, gpt2, llama or single.
    #[arg(long)]
    layout: WeightLayout,
    /// Prefix of the attention module in the checkpoint (e.g. encoder.layer.3.attention).
    #[arg(long, default_value = "")]
    prefix: String,
    /// Query heads (default: 1 for `single`, else `num_attention_heads` of a config.json
    /// next to the weights).
    #[arg(long)]
    heads: Option<usize>,
    /// Key/value heads (default: read from the checkpoint).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Causal self-attention (GPT-2 is always causal).
    #[arg(long)]
    causal: bool,
    /// Safetensors file with `x`, optional `attention_mask` and `kv`.
    #[arg(long)]
    input: PathBuf,
    /// Where to write `context` and `weights`.
    #[arg(long)]
    output: PathBuf,
    /// cpu, cuda[:N], metal[:N] or auto.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Weights and compute dtype: f32, f16 or bf16 (outputs are written as F32).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Also write the gradients of `sum(context * grad_context)` (`grad_context` from IN).
    #[arg(long)]
    backward: bool,
}

/// The layer under test, single- or multi-head.
enum Layer {
    Single(SingleHeadSelfAttention),
    Multi(MultiHeadSelfAttention),
}

impl Layer {
    fn load(args: &Args, vb: VarBuilder, kv: Option<&Tensor>) -> anyhow::Result<Self> {
        if args.layout == WeightLayout::Single {
            if let Some(h) = args.heads.filter(|&h| h != 1) {
                bail!("the single layout has exactly one head, --heads {h} was given");
            }
            if kv.is_some() {
                bail!("the single layout is self-attention only; remove `kv` from the input");
            }
            return Ok(Self::Single(
                SingleHeadSelfAttention::load(vb)?.with_causal(args.causal),
            ));
        }
        let heads = match args.heads {
            Some(h) => h,
            None => heads_from_config(args)?,
        };
        let mut cfg = AttentionConfig::new(args.layout, heads);
        cfg.causal = cfg.causal || args.causal;
        cfg.num_kv_heads = args.kv_heads;
        Ok(Self::Multi(MultiHeadSelfAttention::load(vb, &cfg)?))
    }

    fn attend(
        &self,
        x: &Tensor,
        kv: Option<&Tensor>,
        mask: Option<&AttentionMask>,
        need_weights: bool,
    ) -> anyhow::Result<AttentionOutput> {
        Ok(match self {
            Self::Single(head) if need_weights => head.forward_with_weights(x, mask)?,
            Self::Single(head) => head.forward(x, mask)?,
            Self::Multi(attn) => attn.attend(x, kv, mask, need_weights)?,
        })
    }
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let (device, device_name) = select_device(&args.device)?;
    let dtype = parse_dtype(&args.dtype)?;
    let t0 = Instant::now();
    let ckpt = Checkpoint::open(&args.weights)?;
    ckpt.check_prefix(&args.prefix)?;
    let vb = ckpt.var_builder(dtype, &device);
    let vb = if args.prefix.is_empty() {
        vb
    } else {
        vb.pp(&args.prefix)
    };

    let inputs = Checkpoint::open(&args.input).context("reading --input")?;
    let x = float_input(&inputs, "x", &device)?.to_dtype(dtype)?;
    let kv = if inputs.contains("kv") {
        Some(float_input(&inputs, "kv", &device)?.to_dtype(dtype)?)
    } else {
        None
    };
    let mask = if inputs.contains("attention_mask") {
        Some(AttentionMask::padding(
            &inputs.tensor("attention_mask", &device)?,
        )?)
    } else {
        None
    };

    let grad_context = if args.backward {
        Some(
            float_input(&inputs, "grad_context", &device)
                .context("--backward")?
                .to_dtype(dtype)?,
        )
    } else {
        None
    };
    let layer = Layer::load(&args, vb, kv.as_ref())?;
    let load = t0.elapsed();
    let t1 = Instant::now();
    let out = layer.attend(&x, kv.as_ref(), mask.as_ref(), true)?;
    eprintln!(
        "{device_name}: loaded in {load:.1?}, ran in {:.1?}",
        t1.elapsed()
    );
    let mut tensors = HashMap::new();
    tensors.insert("context".to_string(), out.context.to_dtype(DType::F32)?);
    if let Some(w) = out.weights {
        tensors.insert("weights".to_string(), w.to_dtype(DType::F32)?);
    }
    if let Some(grad_context) = &grad_context {
        if grad_context.dims() != out.context.dims() {
            bail!(
                "input `grad_context` has shape {:?}, expected the context's {:?}",
                grad_context.dims(),
                out.context.dims()
            );
        }
        let t2 = Instant::now();
        backward(
            &args,
            &ckpt,
            (&x, kv.as_ref(), mask.as_ref()),
            grad_context,
            &mut tensors,
        )?;
        eprintln!("{device_name}: forward + backward in {:.1?}", t2.elapsed());
    }
    let tensors: HashMap<String, Tensor> = tensors
        .into_iter()
        .map(|(k, v)| Ok((k, v.to_device(&Device::Cpu)?)))
        .collect::<candle_core::Result<_>>()?;
    candle_core::safetensors::save(&tensors, &args.output)
        .with_context(|| format!("writing {}", args.output.display()))?;
    Ok(())
}

/// The gradients of `sum(context * grad_context)` on the default path, with the checkpoint's
/// tensors under the prefix as variables (as a user training the layer has them).
fn backward(
    args: &Args,
    ckpt: &Checkpoint,
    (x, kv, mask): (&Tensor, Option<&Tensor>, Option<&AttentionMask>),
    grad_context: &Tensor,
    out: &mut HashMap<String, Tensor>,
) -> anyhow::Result<()> {
    let device = x.device();
    let mut params = Vec::new();
    let mut named = HashMap::new();
    for name in ckpt.names_under(&args.prefix) {
        let t = ckpt.tensor(name, device)?;
        let t = if t.dtype().is_float() {
            t.to_dtype(x.dtype())?
        } else {
            t
        };
        let var = Var::from_tensor(&t)?;
        named.insert(name.to_string(), var.as_tensor().clone());
        params.push((name.to_string(), var));
    }
    let vb = VarBuilder::from_tensors(named, x.dtype(), device);
    let vb = if args.prefix.is_empty() {
        vb
    } else {
        vb.pp(&args.prefix)
    };
    let layer = Layer::load(args, vb, kv)?;
    let xv = Var::from_tensor(x)?;
    let kvv = kv.map(Var::from_tensor).transpose()?;
    let out_fwd = layer.attend(
        xv.as_tensor(),
        kvv.as_ref().map(Var::as_tensor),
        mask,
        false,
    )?;
    let loss = (out_fwd.context * grad_context)?.sum_all()?;
    let grads = loss.backward()?;
    let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
    let gx = grads
        .get(xv.as_tensor())
        .context("no gradient reached `x`")?;
    out.insert("grad_x".to_string(), f32_of(gx)?);
    if let Some(kvv) = &kvv {
        let gkv = grads
            .get(kvv.as_tensor())
            .context("no gradient reached `kv`")?;
        out.insert("grad_kv".to_string(), f32_of(gkv)?);
    }
    let mut loaded = 0;
    for (name, var) in &params {
        // Tensors under the prefix that the layer does not read get no gradient.
        if let Some(g) = grads.get(var.as_tensor()) {
            out.insert(format!("grad.{name}"), f32_of(g)?);
            loaded += 1;
        }
    }
    if loaded == 0 {
        bail!("no gradient reached any tensor under `{}`", args.prefix);
    }
    Ok(())
}

/// An f32 activation tensor of rank 3.
fn float_input(inputs: &Checkpoint, name: &str, device: &Device) -> anyhow::Result<Tensor> {
    let t = inputs.tensor(name, device)?;
    if t.dtype() != DType::F32 {
        bail!(
            "input `{name}` in {} has dtype {:?}, expected F32",
            inputs.paths()[0].display(),
            t.dtype()
        );
    }
    if t.rank() != 3 {
        bail!(
            "input `{name}` has shape {:?}, expected (batch, seq, hidden)",
            t.dims()
        );
    }
    Ok(t)
}

fn heads_from_config(args: &Args) -> anyhow::Result<usize> {
    let config = args
        .weights
        .parent()
        .map(|d| d.join("config.json"))
        .filter(|p| p.exists());
    match config {
        Some(path) => Ok(HfConfig::from_file(path)?.num_attention_heads),
        None => bail!(
            "--heads is required for the {} layout (no config.json next to {})",
            args.layout,
            args.weights.display()
        ),
    }
}

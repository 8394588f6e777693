//! Times one multi-head self-attention forward (projections, attention, `W_O`) at one shape,
//! so it can be set side by side with other tools (`benches/compare_pytorch.py`,
//! `benches/side_by_side.sh`).
//!
//! ```text
//! cargo run --release --example bench -- --batch 1 --seq 128 --hidden 768 --heads 12 \
//!   [--kv-heads N] [--causal] [--weights] [--dtype f32] [--iters N] [--core] [--device D] \
//!   [--impl ours|naive|candle-flash|candle-matmul] [--pool caller|detached] [--train] [--json]
//! cargo run --release --example bench -- --fma-peak | --bandwidth   # the machine's limits
//! cargo run --release --example bench -- --load [--iters N]   # loading the shipped model
//! ```
//!
//! `--load` times loading the shipped model (`weights/`) against one sentence's forward
//! through its 6 layers: each figure is the median over `--iters` (default 20) fresh
//! processes (the bench runs itself), since a process that already freed a model's memory
//! loads the next one without page faults. Parts: the weights alone
//! (`BertEncoder::load_checkpoint`), the tokenizer alone (`TextEncoder::from_file`), and both
//! as `Model::load` does them (what the main job waits for), whose process then times the
//! forward of the README's sentence (median of 10 calls after one).
//!
//! `--train` times one training step instead of a forward: the forward on variables (a fresh
//! layer on a `VarMap` in PyTorch's `nn.MultiheadAttention` layout, LLaMA's with `--kv-heads`,
//! and `x`; or Q, K and V with `--core`), then the backward of
//! `sum(context * g)` to every one of them (no optimizer update); ours only. Its `gflops`
//! count a step as 3 forwards (the backward's products are twice the forward's). It calls
//! `retain_freed_memory()` first, as a training program should (`--default-malloc` not).
//!
//! `--json` prints one JSON object `{"batch", "seq", "hidden", "heads", "median_ms",
//! "gflops", "peak_rss_mb", ...}` for the chosen `--impl` (default ours), nothing else on
//! stdout. Without it, a table shows ours, the naive candle composition (matmul,
//! `softmax_last_dim`, matmul, as candle-transformers' BERT does) and
//! `candle_nn::attention::flash_attn` (candle's CPU kernel) at the same shape, with ratios,
//! and candle's 2048 x 2048 matrix multiply as the machine's reference throughput.
//!
//! `--core` times the attention alone on random `(batch, heads, seq, hidden / heads)` Q, K
//! and V (what `F.scaled_dot_product_attention` does), without the projections.
//! Threads: the rayon pool (`RAYON_NUM_THREADS`, default one per core). By default
//! (`--pool caller`) the thread that makes the timed calls is the pool's worker 0, as
//! OpenMP's main thread is in PyTorch, so a call starts and ends on it with no hand-over;
//! `--pool detached` keeps rayon's default pool, where each call from outside it is handed
//! to the pool's threads while the caller sleeps (~10-15 µs per call on the development
//! machine, ~4% at seq 32).

use std::sync::OnceLock;
use std::time::Instant;

use anyhow::{bail, Context};
use candle_attention::{
    attention_weights_bytes, available_memory_bytes, parse_dtype, scaled_dot_product_attention,
    select_device, self_attention_cost, AttentionConfig, AttentionMask, BertEncoder, Checkpoint,
    HfConfig, LinearWeights, Model, ModelResolver, MultiHeadSelfAttention, Projections,
    SdpaOptions, TextEncoder, WeightLayout,
};
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::attention::{flash_attn, AttnMask};
use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Impl {
    /// This crate (`MultiHeadSelfAttention::forward`, or `scaled_dot_product_attention` with
    /// `--core`).
    Ours,
    /// Candle ops composed as candle-transformers' BERT does.
    Naive,
    /// `candle_nn::attention::flash_attn` for the attention, candle matmuls around it.
    CandleFlash,
    /// Candle's `seq x seq` by `seq x seq` f32 matrix multiply (the machine's reference).
    CandleMatmul,
}

impl Impl {
    fn label(&self) -> &'static str {
        match self {
            Impl::Ours => "candle-attention (ours)",
            Impl::Naive => "naive candle composition",
            Impl::CandleFlash => "candle_nn flash_attn (CPU)",
            Impl::CandleMatmul => "candle matmul",
        }
    }
    fn name(&self) -> &'static str {
        match self {
            Impl::Ours => "ours",
            Impl::Naive => "naive",
            Impl::CandleFlash => "candle-flash",
            Impl::CandleMatmul => "candle-matmul",
        }
    }
}

/// Where the timed calls run with respect to rayon's global pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Pool {
    /// The calling thread is worker 0 of the pool (`ThreadPoolBuilder::use_current_thread`):
    /// `RAYON_NUM_THREADS` threads in all, the caller one of them.
    Caller,
    /// Rayon's default pool of `RAYON_NUM_THREADS` threads; the caller hands each call over.
    Detached,
}

impl Pool {
    fn name(&self) -> &'static str {
        match self {
            Pool::Caller => "caller",
            Pool::Detached => "detached",
        }
    }
}

#[derive(Parser, Debug)]
#[command(about = "Time one multi-head self-attention forward at one shape")]
struct Args {
    #[arg(long, default_value_t = 1)]
    batch: usize,
    #[arg(long, default_value_t = 128)]
    seq: usize,
    #[arg(long, default_value_t = 768)]
    hidden: usize,
    #[arg(long, default_value_t = 12)]
    heads: usize,
    /// Key/value heads (grouped-query attention); default: `--heads`.
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Causal self-attention.
    #[arg(long)]
    causal: bool,
    /// Also return the attention weights `(batch, heads, seq, seq)`.
    #[arg(long)]
    weights: bool,
    /// f32, f16 or bf16 (weights and activations; compute is f32 on the CPU).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// auto, cpu, cuda[:N] or metal[:N]; peak RSS is the host process's on every device.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Timed iterations after one warm-up, at least 1 (default: about 2 s worth, 3 to 100).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    iters: Option<u64>,
    /// The attention alone on random Q, K, V (no projections).
    #[arg(long)]
    core: bool,
    /// Measure the machine's FMA peak instead: independent vector FMAs (AVX-512 or AVX2) on
    /// every rayon thread; prints GFLOP/s (the reference for FLOP rates in benches/).
    #[arg(long)]
    fma_peak: bool,
    /// Measure the machine's memory read bandwidth instead: every rayon thread sums its part
    /// of a 1 GiB buffer at once; prints GB/s (the bound of a decode step, which reads every
    /// weight once).
    #[arg(long)]
    bandwidth: bool,
    /// Time loading the shipped model (weights, tokenizer, both) against one sentence's
    /// forward, each in fresh processes, instead.
    #[arg(long)]
    load: bool,
    /// One load in this process: `weights`, `tokenizer` or `model` (used by `--load`).
    #[arg(long, hide = true)]
    load_once: Option<String>,
    /// Which implementation to time with `--json`.
    #[arg(long = "impl", value_enum, default_value_t = Impl::Ours)]
    implementation: Impl,
    /// Rayon's pool: `caller` makes the calling thread one of its workers (as OpenMP's
    /// main thread is), `detached` keeps rayon's default (calls are handed over to it).
    #[arg(long, value_enum, default_value_t = Pool::Caller)]
    pool: Pool,
    /// Time a training step (forward + backward to the variables) instead of a forward.
    #[arg(long)]
    train: bool,
    /// `--train` without `candle_attention::retain_freed_memory()` (glibc's default
    /// trimming of freed memory, as a program that does not call it gets).
    #[arg(long, requires = "train")]
    default_malloc: bool,
    /// One JSON object on stdout.
    #[arg(long)]
    json: bool,
}

/// What one implementation needs for one forward.
struct Setup {
    x: Tensor,
    /// Ours.
    layer: MultiHeadSelfAttention,
    /// The same weights for the candle baselines: (w_q, w_k, w_v, b_q, b_k, b_v, w_o, b_o).
    raw: [Tensor; 8],
    /// `--core` inputs: q `(b, h, t, hd)`, k and v `(b, kvh, t, hd)`; for flash_attn the
    /// same values as `(b, t, h, hd)`.
    core: Option<[Tensor; 6]>,
    /// `--train`: the gradient of the output the backward starts from.
    grad: Option<Tensor>,
}

struct Measured {
    median_ms: f64,
    iters: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.pool == Pool::Caller {
        rayon::ThreadPoolBuilder::new()
            .use_current_thread()
            .build_global()
            .context("building rayon's global pool around the calling thread")?;
    }
    if let Some(part) = &args.load_once {
        return load_once(part);
    }
    if args.load {
        return load_table(args.iters.unwrap_or(20) as usize, args.json);
    }
    // The machine's limits: one figure each, as JSON or a line.
    let limit = if args.fma_peak {
        let (gflops, isa) = fma_peak()?;
        Some((
            serde_json::json!({"fma_peak_gflops": round3(gflops), "isa": isa}),
            format!("FMA peak: {gflops:.1} GFLOP/s, {isa}"),
        ))
    } else if args.bandwidth {
        let (gbs, isa) = read_bandwidth();
        Some((
            serde_json::json!({"read_bandwidth_gb_s": round3(gbs), "isa": isa}),
            format!("read bandwidth: {gbs:.1} GB/s, {isa} loads"),
        ))
    } else {
        None
    };
    if let Some((mut json, line)) = limit {
        let threads = rayon::current_num_threads();
        if args.json {
            json["threads"] = threads.into();
            println!("{json}");
        } else {
            println!("{line} ({threads} threads)");
        }
        return Ok(());
    }
    let dtype = parse_dtype(&args.dtype)?;
    let (device, device_name) = select_device(&args.device)?;
    if !args.json {
        eprintln!("device: {device_name}");
    }
    DEVICE
        .set(device)
        .map_err(|_| anyhow::anyhow!("device chosen twice"))?;
    if args.heads == 0 || args.hidden % args.heads != 0 {
        bail!(
            "--heads {} must divide --hidden {}",
            args.heads,
            args.hidden
        );
    }
    if args.train && args.weights {
        bail!("--train times the gradients of the context; drop --weights");
    }
    let kvh = args.kv_heads.unwrap_or(args.heads);
    if kvh == 0 || args.heads % kvh != 0 {
        bail!("--kv-heads {kvh} must divide --heads {}", args.heads);
    }
    // A training program keeps freed memory for the next step (see the function's docs).
    let retained = args.train && !args.default_malloc && candle_attention::retain_freed_memory();
    let threads = rayon::current_num_threads();
    if args.json {
        let setup = setup(&args, dtype, kvh, args.implementation)?;
        let m = measure(&args, &setup, args.implementation, kvh)?;
        let m = m.context("this implementation cannot run this configuration")?;
        let flops = flops(&args, kvh, args.implementation);
        let obj = serde_json::json!({
            "batch": args.batch,
            "seq": args.seq,
            "hidden": args.hidden,
            "heads": args.heads,
            "median_ms": round3(m.median_ms),
            "gflops": round3(flops / (m.median_ms * 1e-3) / 1e9),
            "peak_rss_mb": round3(peak_rss_mib()?),
            "kv_heads": kvh,
            "causal": args.causal,
            "weights": args.weights,
            "core": args.core,
            "dtype": args.dtype,
            "impl": args.implementation.name(),
            "threads": threads,
            "pool": args.pool.name(),
            "device": args.device,
            "train": args.train,
            "retain_freed_memory": retained,
            "iters": m.iters,
        });
        println!("{obj}");
        return Ok(());
    }

    println!(
        "batch {}, seq {}, hidden {}, heads {} (kv {kvh}), {}{}, {}, {}, {threads} threads (pool: {})",
        args.batch,
        args.seq,
        args.hidden,
        args.heads,
        args.dtype,
        if args.causal { ", causal" } else { "" },
        if args.weights {
            "with weights"
        } else {
            "no weights"
        },
        if args.core {
            "attention only (--core)"
        } else {
            "projections + attention + W_O"
        },
        args.pool.name(),
    );
    let t0 = Instant::now();
    let setup = setup(&args, dtype, kvh, Impl::Ours)?;
    println!("setup {:.0} ms", t0.elapsed().as_secs_f64() * 1e3);
    println!(
        "{:<28} {:>11} {:>9} {:>13} {:>8}",
        "implementation", "median ms", "GFLOP/s", "peak RSS MiB", "ours is"
    );
    let mut ours_ms = None;
    let imps: &[Impl] = if args.train {
        &[Impl::Ours]
    } else {
        &[Impl::Ours, Impl::Naive, Impl::CandleFlash]
    };
    for &imp in imps {
        reset_peak_rss();
        let fl = flops(&args, kvh, imp);
        match measure(&args, &setup, imp, kvh)? {
            Some(m) => {
                let ours = *ours_ms.get_or_insert(m.median_ms);
                println!(
                    "{:<28} {:>11.3} {:>9.1} {:>13.0} {:>7.2}x",
                    imp.label(),
                    m.median_ms,
                    fl / (m.median_ms * 1e-3) / 1e9,
                    peak_rss_mib()?,
                    m.median_ms / ours
                );
            }
            None => println!("{:<28} {:>11}", imp.label(), "n/a"),
        }
    }
    let mm = Args {
        seq: 2048,
        iters: Some(5),
        train: false,
        ..args
    };
    let m = measure(&mm, &setup, Impl::CandleMatmul, kvh)?.context("matmul")?;
    println!(
        "reference: candle 2048x2048 f32 matmul {:.1} GFLOP/s",
        flops(&mm, kvh, Impl::CandleMatmul) / (m.median_ms * 1e-3) / 1e9
    );
    Ok(())
}

/// The device every tensor of the run lives on (`--device`).
static DEVICE: OnceLock<Device> = OnceLock::new();

fn dev() -> Device {
    DEVICE.get().cloned().unwrap_or(Device::Cpu)
}

/// One timed load in this process, printed as `{"ms": .., "forward_ms": ..}`.
fn load_once(part: &str) -> anyhow::Result<()> {
    let files = ModelResolver::new().resolve(None)?;
    let hf = HfConfig::from_file(&files.config)?;
    let t = Instant::now();
    match part {
        "weights" => {
            let ckpt = Checkpoint::open_many(&files.weights)?;
            BertEncoder::load_checkpoint(&ckpt, DType::F32, &Device::Cpu, &hf)?;
        }
        "tokenizer" => {
            TextEncoder::from_file(&files.tokenizer)?;
        }
        "model" => {
            let model = Model::load(files, DType::F32, &Device::Cpu, false)?;
            let loaded = t.elapsed();
            let batch = model
                .text
                .encode_batch(&["The cat sat on the mat."], &Device::Cpu)?;
            let mut times = Vec::new();
            for _ in 0..11 {
                let t = Instant::now();
                model.encoder.forward(
                    &batch.input_ids,
                    Some(&batch.token_type_ids),
                    Some(&batch.attention_mask),
                    true,
                )?;
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
            let ms = loaded.as_secs_f64() * 1e3;
            println!(
                "{}",
                serde_json::json!({"ms": ms, "forward_ms": median(&mut times[1..].to_vec())})
            );
            return Ok(());
        }
        other => bail!("--load-once takes weights, tokenizer or model, not {other}"),
    };
    let ms = t.elapsed().as_secs_f64() * 1e3;
    println!("{}", serde_json::json!({ "ms": ms }));
    Ok(())
}

/// `--load`: each part in `iters` fresh processes, as a table (or one JSON object).
fn load_table(iters: usize, json: bool) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let mut rows = Vec::new();
    let mut forward = Vec::new();
    for part in ["weights", "tokenizer", "model"] {
        let mut ms = Vec::new();
        for _ in 0..iters {
            let out = std::process::Command::new(&exe)
                .args(["--load-once", part])
                .output()?;
            if !out.status.success() {
                bail!(
                    "loading the {part}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
            ms.push(v["ms"].as_f64().context("no load time")?);
            if let Some(f) = v["forward_ms"].as_f64() {
                forward.push(f);
            }
        }
        rows.push((part, median(&mut ms), ms[0], ms[ms.len() - 1]));
    }
    let fwd = median(&mut forward);
    if json {
        let parts: serde_json::Map<String, serde_json::Value> = rows
            .iter()
            .map(|(p, m, _, _)| (format!("{p}_ms"), round3(*m).into()))
            .collect();
        let mut v = serde_json::Value::Object(parts);
        v["forward_ms"] = round3(fwd).into();
        v["iters"] = iters.into();
        v["threads"] = rayon::current_num_threads().into();
        println!("{v}");
        return Ok(());
    }
    println!(
        "loading the shipped model, {iters} fresh processes each ({} threads)",
        rayon::current_num_threads()
    );
    println!(
        "{:<40} {:>9} {:>7} {:>7} {:>10}",
        "part", "median ms", "min", "max", "x forward"
    );
    for (part, m, lo, hi) in &rows {
        let label = match *part {
            "weights" => "weights (BertEncoder::load_checkpoint)",
            "tokenizer" => "tokenizer (TextEncoder::from_file)",
            _ => "both (Model::load, the main job)",
        };
        println!("{label:<40} {m:>9.1} {lo:>7.1} {hi:>7.1} {:>10.1}", m / fwd);
    }
    println!("{:<40} {fwd:>9.2}", "one sentence through 6 layers (warm)");
    Ok(())
}

/// The median of `v` (sorted in place; 0 when empty).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

/// FLOPs of one call (see `candle_attention::AttentionCost`).
fn flops(args: &Args, kvh: usize, imp: Impl) -> f64 {
    if imp == Impl::CandleMatmul {
        return 2.0 * (args.seq as f64).powi(3);
    }
    let c = self_attention_cost(
        args.batch,
        args.seq,
        args.hidden,
        args.heads,
        kvh,
        args.causal,
    );
    let forward = if args.core {
        c.attention_flops as f64
    } else {
        c.flops() as f64
    };
    if args.train {
        3.0 * forward
    } else {
        forward
    }
}

fn randn(shape: &[usize], std: f64, dtype: DType) -> anyhow::Result<Tensor> {
    Ok(Tensor::randn(0f32, std as f32, shape, &dev())?.to_dtype(dtype)?)
}

fn setup(args: &Args, dtype: DType, kvh: usize, imp: Impl) -> anyhow::Result<Setup> {
    let (b, t, d, h) = (args.batch, args.seq, args.hidden, args.heads);
    let hd = d / h;
    let kv_out = kvh * hd;
    let std = 1.0 / (d as f64).sqrt();
    let raw = [
        randn(&[d, d], std, dtype)?,
        randn(&[kv_out, d], std, dtype)?,
        randn(&[kv_out, d], std, dtype)?,
        randn(&[d], 0.02, dtype)?,
        randn(&[kv_out], 0.02, dtype)?,
        randn(&[kv_out], 0.02, dtype)?,
        randn(&[d, d], std, dtype)?,
        randn(&[d], 0.02, dtype)?,
    ];
    let lin = |w: usize, bias: usize, name: &str| {
        LinearWeights::new(raw[w].clone(), Some(raw[bias].clone()), name)
    };
    let p = Projections {
        q: lin(0, 3, "q"),
        k: lin(1, 4, "k"),
        v: lin(2, 5, "v"),
        o: Some(lin(6, 7, "o")),
    };
    let cfg = AttentionConfig::new(WeightLayout::TorchMha, h)
        .with_kv_heads(kvh)
        .with_causal(args.causal);
    let layer = if args.train {
        // A fresh layer on a VarMap, as a user training one has it (PyTorch's layout, or
        // LLaMA's for grouped K/V heads).
        let layout = if kvh == h {
            WeightLayout::TorchMha
        } else {
            WeightLayout::Llama
        };
        let vm = candle_nn::VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&vm, dtype, &dev());
        let cfg = AttentionConfig::new(layout, h)
            .with_kv_heads(kvh)
            .with_causal(args.causal)
            .with_hidden_size(d)
            .with_bias(true);
        MultiHeadSelfAttention::load(vb.pp("attn"), &cfg)?
    } else {
        MultiHeadSelfAttention::new(p, &cfg)?
    };
    let core = if args.core && imp != Impl::CandleMatmul {
        let q = randn(&[b, h, t, hd], 1.0, dtype)?; // (b, h, t, hd)
        let k = randn(&[b, kvh, t, hd], 1.0, dtype)?; // (b, kvh, t, hd)
        let v = randn(&[b, kvh, t, hd], 1.0, dtype)?; // (b, kvh, t, hd)
        let bshd = |x: &Tensor| -> anyhow::Result<Tensor> { Ok(x.transpose(1, 2)?.contiguous()?) }; // (b, t, h, hd)
        let (qf, kf, vf) = (bshd(&q)?, bshd(&k)?, bshd(&v)?);
        let var = |t: Tensor| -> anyhow::Result<Tensor> {
            Ok(if args.train {
                Var::from_tensor(&t)?.as_tensor().clone()
            } else {
                t
            })
        };
        Some([var(q)?, var(k)?, var(v)?, qf, kf, vf])
    } else {
        None
    };
    let x = if args.core {
        Tensor::zeros(1, dtype, &dev())?
    } else {
        randn(&[b, t, d], 1.0, dtype)? // (b, t, d)
    };
    let (x, grad) = if args.train {
        let out = if args.core {
            [b, h, t, hd]
        } else {
            [b, t, d, 1]
        };
        let out = if args.core { &out[..] } else { &out[..3] };
        (
            Var::from_tensor(&x)?.as_tensor().clone(),
            Some(randn(out, 1.0, dtype)?),
        )
    } else {
        (x, None)
    };
    Ok(Setup {
        x,
        layer,
        raw,
        core,
        grad,
    })
}

/// Median time of `imp`, `None` when it cannot run this configuration (or would need more
/// memory than the machine has).
fn measure(args: &Args, s: &Setup, imp: Impl, kvh: usize) -> anyhow::Result<Option<Measured>> {
    let run: Box<dyn Fn() -> anyhow::Result<()>> = match imp {
        Impl::Ours => Box::new(|| ours(args, s)),
        Impl::Naive | Impl::CandleFlash | Impl::CandleMatmul if args.train => return Ok(None),
        Impl::Naive => {
            // Scores, exponentials, weights: ~3 (b, h, t, t) f32 tensors at once.
            let need = attention_weights_bytes(args.batch, args.heads, args.seq, args.seq) * 3;
            if need > available_memory_bytes().unwrap_or(u64::MAX) / 2 {
                eprintln!("naive: skipped, needs ~{} MiB for the scores", need >> 20);
                return Ok(None);
            }
            Box::new(move || naive(args, s, kvh))
        }
        Impl::CandleFlash => {
            // candle_nn::attention::flash_attn is a CPU kernel.
            if args.weights || args.batch > 1 && args.causal && args.core || !dev().is_cpu() {
                return Ok(None);
            }
            Box::new(move || candle_flash(args, s, kvh))
        }
        Impl::CandleMatmul => {
            let n = args.seq;
            let a = Tensor::randn(0f32, 1.0, (n, n), &dev())?;
            let bm = Tensor::randn(0f32, 1.0, (n, n), &dev())?;
            Box::new(move || {
                a.matmul(&bm)?;
                Ok(())
            })
        }
    };
    let t0 = Instant::now();
    let run = || -> anyhow::Result<()> {
        run()?;
        dev().synchronize()?; // GPU kernels are asynchronous: time them to completion
        Ok(())
    };
    run()?; // warm-up
    let first = t0.elapsed().as_secs_f64();
    let iters = match args.iters {
        Some(n) => usize::try_from(n)?,
        None if first > 2.0 => 1,
        None => ((2.0 / first.max(1e-6)) as usize).clamp(3, 100),
    };
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        run()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let n = times.len();
    let median_ms = if n % 2 == 1 {
        times[n / 2]
    } else {
        (times[n / 2 - 1] + times[n / 2]) / 2.0
    };
    Ok(Some(Measured { median_ms, iters }))
}

fn ours(args: &Args, s: &Setup) -> anyhow::Result<()> {
    if let Some(g) = &s.grad {
        // One training step: forward, then gradients to every variable.
        let context = match &s.core {
            Some([q, k, v, ..]) => {
                let mask = args.causal.then(AttentionMask::causal);
                scaled_dot_product_attention(q, k, v, mask.as_ref(), SdpaOptions::default())?
                    .context
            }
            None => s.layer.forward(&s.x, None)?.context,
        };
        let grads = (context * g)?.sum_all()?.backward()?;
        std::hint::black_box(grads);
        return Ok(());
    }
    if let Some([q, k, v, ..]) = &s.core {
        let mask = args.causal.then(AttentionMask::causal);
        let opts = SdpaOptions {
            scale: None,
            need_weights: args.weights,
        };
        let out = scaled_dot_product_attention(q, k, v, mask.as_ref(), opts)?;
        std::hint::black_box(out);
        return Ok(());
    }
    let out = if args.weights {
        s.layer.forward_with_weights(&s.x, None)?
    } else {
        s.layer.forward(&s.x, None)?
    };
    std::hint::black_box(out);
    Ok(())
}

/// `x W^T + b` with candle ops (as `candle_nn::Linear` does).
fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> anyhow::Result<Tensor> {
    Ok(x.broadcast_matmul(&w.t()?)?.broadcast_add(b)?)
}

/// `(b, kvh, t, hd)` repeated to `(b, h, t, hd)` (candle-transformers' `repeat_kv`).
fn repeat_kv(x: Tensor, groups: usize) -> anyhow::Result<Tensor> {
    if groups == 1 {
        return Ok(x);
    }
    let (b, kvh, t, hd) = x.dims4()?;
    Ok(Tensor::cat(&vec![&x; groups], 2)?.reshape((b, kvh * groups, t, hd))?)
}

/// The projections the candle baselines share: q `(b, h, t, hd)` and k, v `(b, kvh, t, hd)`
/// for the naive path, or `(b, t, h, hd)` for flash_attn.
fn project(args: &Args, s: &Setup, kvh: usize, bshd: bool) -> anyhow::Result<[Tensor; 3]> {
    let (b, t, h) = (args.batch, args.seq, args.heads);
    let hd = args.hidden / h;
    let [wq, wk, wv, bq, bk, bv, ..] = &s.raw;
    let split = |y: Tensor, n: usize| -> anyhow::Result<Tensor> {
        let y = y.reshape((b, t, n, hd))?; // (b, t, n, hd)
        Ok(if bshd {
            y
        } else {
            y.transpose(1, 2)?.contiguous()? // (b, n, t, hd)
        })
    };
    Ok([
        split(linear(&s.x, wq, bq)?, h)?,
        split(linear(&s.x, wk, bk)?, kvh)?,
        split(linear(&s.x, wv, bv)?, kvh)?,
    ])
}

fn causal_bias(t: usize, dtype: DType) -> anyhow::Result<Tensor> {
    let data: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Ok(Tensor::from_vec(data, (1, 1, t, t), &dev())?.to_dtype(dtype)?)
}

fn naive(args: &Args, s: &Setup, kvh: usize) -> anyhow::Result<()> {
    let (b, t, h) = (args.batch, args.seq, args.heads);
    let hd = args.hidden / h;
    let [q, k, v] = match &s.core {
        Some([q, k, v, ..]) => [q.clone(), k.clone(), v.clone()],
        None => project(args, s, kvh, false)?,
    };
    let (k, v) = (repeat_kv(k, h / kvh)?, repeat_kv(v, h / kvh)?);
    let scores = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?; // (b, h, t, t)
    let scores = if args.causal {
        scores.broadcast_add(&causal_bias(t, scores.dtype())?)?
    } else {
        scores
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?; // (b, h, t, t)
    let ctx = probs.matmul(&v)?; // (b, h, t, hd)
    if s.core.is_some() {
        std::hint::black_box((ctx, probs));
        return Ok(());
    }
    let ctx = ctx.transpose(1, 2)?.contiguous()?.reshape((b, t, h * hd))?; // (b, t, d)
    let out = linear(&ctx, &s.raw[6], &s.raw[7])?;
    std::hint::black_box((out, probs));
    Ok(())
}

fn candle_flash(args: &Args, s: &Setup, kvh: usize) -> anyhow::Result<()> {
    let (b, t, h) = (args.batch, args.seq, args.heads);
    let hd = args.hidden / h;
    let [q, k, v] = match &s.core {
        Some([_, _, _, q, k, v]) => [q.clone(), k.clone(), v.clone()],
        None => project(args, s, kvh, true)?,
    };
    let mask = if args.causal {
        AttnMask::causal()
    } else {
        AttnMask::None
    };
    let scale = 1.0 / (hd as f32).sqrt();
    let ctx = match q.dtype() {
        DType::F32 => flash_attn::<f32>(&q, &k, &v, scale, mask, None, None)?,
        DType::F16 => flash_attn::<half::f16>(&q, &k, &v, scale, mask, None, None)?,
        DType::BF16 => flash_attn::<half::bf16>(&q, &k, &v, scale, mask, None, None)?,
        other => bail!("flash_attn: unsupported dtype {other:?}"),
    }; // (b, h, t, hd)
    if s.core.is_some() {
        std::hint::black_box(ctx);
        return Ok(());
    }
    let ctx = ctx.transpose(1, 2)?.contiguous()?.reshape((b, t, h * hd))?; // (b, t, d)
    let out = linear(&ctx, &s.raw[6], &s.raw[7])?;
    std::hint::black_box(out.sum(D::Minus1)?);
    Ok(())
}

/// Peak resident memory of this process (`VmHWM`), MiB.
fn peak_rss_mib() -> anyhow::Result<f64> {
    let status = std::fs::read_to_string("/proc/self/status").context("/proc/self/status")?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .context("no VmHWM in /proc/self/status")?;
    Ok(kib / 1024.0)
}

/// Restarts the peak-RSS count (Linux: `5` into `/proc/self/clear_refs`), so each row of the
/// table shows its own peak; best effort.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// GFLOP/s of independent vector FMAs on every rayon thread at once (best of 5 runs of
/// ~0.2 s), and the instruction set used.
fn fma_peak() -> anyhow::Result<(f64, &'static str)> {
    #[cfg(target_arch = "x86_64")]
    {
        let (isa, lanes, run): (&str, usize, fn(u64) -> f32) =
            if is_x86_feature_detected!("avx512f") {
                // SAFETY: chosen after the run-time check of AVX-512F just above.
                ("avx512f", 16, |n| unsafe { fma_loop_avx512(n) })
            } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                // SAFETY: chosen after the run-time check of AVX2 and FMA just above.
                ("avx2+fma", 8, |n| unsafe { fma_loop_avx2(n) })
            } else {
                bail!("--fma-peak needs AVX-512F or AVX2 + FMA");
            };
        const ITERS: u64 = 20_000_000;
        let threads = rayon::current_num_threads();
        let mut best = 0f64;
        for _ in 0..5 {
            let t = Instant::now();
            let sink: f32 = rayon::broadcast(|_| run(ITERS)).iter().sum();
            let secs = t.elapsed().as_secs_f64();
            std::hint::black_box(sink);
            // FMA_CHAINS independent FMAs per iteration, 2 flops per lane each.
            let flops = (ITERS * FMA_CHAINS as u64 * lanes as u64 * 2 * threads as u64) as f64;
            best = best.max(flops / secs / 1e9);
        }
        Ok((best, isa))
    }
    #[cfg(not(target_arch = "x86_64"))]
    bail!("--fma-peak is implemented for x86-64 only")
}

/// GB/s of reading a 1 GiB buffer (written first, so every page is real memory: untouched
/// pages all map one zero page and would measure the cache) with every rayon thread
/// summing its share at once, with the widest vector loads this CPU has (the kernels'
/// own; the portable loop's 16-byte loads read 11-23% less on Zen 4, see
/// docs/performance-archive.md); best of 5 passes, and the loads' instruction set.
fn read_bandwidth() -> (f64, &'static str) {
    use rayon::prelude::*;
    const BYTES: usize = 1 << 30;
    const CHUNK: usize = 1 << 16;
    let mut buf = vec![0f32; BYTES / 4];
    buf.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(i, c)| c.fill(i as f32));
    let per_thread = buf.len().div_ceil(rayon::current_num_threads());
    let (isa, sum_part): (&'static str, fn(&[f32]) -> f32) = sum_kernel();
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let sum: f32 = buf.par_chunks(per_thread).map(sum_part).sum();
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(sum);
        best = best.max(BYTES as f64 / secs / 1e9);
    }
    (best, isa)
}

/// The widest summing loop for `--bandwidth`: AVX-512, else AVX2, else portable.
fn sum_kernel() -> (&'static str, fn(&[f32]) -> f32) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: chosen after the run-time check of AVX-512F just above.
            return ("avx512f", |p| unsafe { sum_avx512(p) });
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: chosen after the run-time check of AVX2 just above.
            return ("avx2", |p| unsafe { sum_avx2(p) });
        }
    }
    ("portable", sum_portable)
}

/// `part`'s sum, read as [`STREAMS`] streams at once, sixteen lanes each (kept in vector
/// registers by the compiler).
fn sum_portable(part: &[f32]) -> f32 {
    let q = part.len() / STREAMS / 16 * 16;
    let mut acc = [[0f32; 16]; STREAMS];
    for i in (0..q).step_by(16) {
        for (s, a) in acc.iter_mut().enumerate() {
            for (x, v) in a.iter_mut().zip(&part[s * q + i..s * q + i + 16]) {
                *x += v;
            }
        }
    }
    acc.iter().flatten().sum::<f32>() + part[STREAMS * q..].iter().sum::<f32>()
}

/// [`sum_portable`] with 64-byte loads.
///
/// # Safety
/// The CPU must have AVX-512F.
#[allow(clippy::incompatible_msrv)]
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_avx512(part: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let q = part.len() / STREAMS / 16 * 16;
    let p = part.as_ptr();
    let mut acc = [_mm512_setzero_ps(); STREAMS];
    for i in (0..q).step_by(16) {
        for (s, a) in acc.iter_mut().enumerate() {
            // SAFETY: `s * q + i + 16 <= STREAMS * q <= part.len()`.
            *a = _mm512_add_ps(*a, unsafe { _mm512_loadu_ps(p.add(s * q + i)) });
        }
    }
    let total = acc
        .iter()
        .fold(_mm512_setzero_ps(), |t, &a| _mm512_add_ps(t, a));
    _mm512_reduce_add_ps(total) + part[STREAMS * q..].iter().sum::<f32>()
}

/// [`sum_portable`] with 32-byte loads.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_avx2(part: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let q = part.len() / STREAMS / 8 * 8;
    let p = part.as_ptr();
    let mut acc = [_mm256_setzero_ps(); STREAMS];
    for i in (0..q).step_by(8) {
        for (s, a) in acc.iter_mut().enumerate() {
            // SAFETY: `s * q + i + 8 <= STREAMS * q <= part.len()`.
            *a = _mm256_add_ps(*a, unsafe { _mm256_loadu_ps(p.add(s * q + i)) });
        }
    }
    let mut lanes = [0f32; 8];
    let total = acc
        .iter()
        .fold(_mm256_setzero_ps(), |t, &a| _mm256_add_ps(t, a));
    // SAFETY: 8 floats to a local array.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), total) };
    lanes.iter().sum::<f32>() + part[STREAMS * q..].iter().sum::<f32>()
}

/// Streams each thread reads at once in `--bandwidth`: one keeps too few reads in flight
/// to reach a core's share (see docs/performance-archive.md).
const STREAMS: usize = 4;

/// Independent accumulator chains: enough to cover the FMA latency on two ports.
#[cfg(target_arch = "x86_64")]
const FMA_CHAINS: usize = 12;

/// # Safety
/// The CPU must have AVX-512F.
// Stable AVX-512 intrinsics (Rust 1.89), which candle-core 0.11 needs on x86-64 anyway.
#[allow(clippy::incompatible_msrv)]
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_loop_avx512(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let a = _mm512_set1_ps(0.999_999);
    let b = _mm512_set1_ps(1e-7);
    let mut acc = [_mm512_set1_ps(1.0); FMA_CHAINS];
    for _ in 0..iters {
        for c in acc.iter_mut() {
            *c = _mm512_fmadd_ps(*c, a, b);
        }
    }
    acc.iter().map(|&c| _mm512_reduce_add_ps(c)).sum()
}

/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_loop_avx2(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let a = _mm256_set1_ps(0.999_999);
    let b = _mm256_set1_ps(1e-7);
    let mut acc = [_mm256_set1_ps(1.0); FMA_CHAINS];
    for _ in 0..iters {
        for c in acc.iter_mut() {
            *c = _mm256_fmadd_ps(*c, a, b);
        }
    }
    let mut out = [0f32; 8];
    let mut sum = 0.0;
    for c in acc {
        _mm256_storeu_ps(out.as_mut_ptr(), c);
        sum += out.iter().sum::<f32>();
    }
    sum
}

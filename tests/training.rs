//! Training through the layer: golden gradients against PyTorch autograd (fixtures from
//! `scripts/gen_grad_fixtures.py`), the fast path against the explicit one, fully masked
//! rows, fresh layers on a `VarMap` and optimizer steps that the next forward sees.

mod common;

use std::collections::HashMap;

use candle_attention::{
    AttentionConfig, AttentionMask, AttentionPath, Checkpoint, MultiHeadSelfAttention,
    SingleHeadSelfAttention, WeightLayout,
};
use candle_core::{backprop::GradStore, DType, Device, Tensor, Var};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use common::{max_abs_diff, repo_path};

/// Gradients within this fraction of the largest one (the bar).
const GRAD_TOL: f32 = 1e-4;

/// A layer of either kind.
enum Layer {
    Single(SingleHeadSelfAttention),
    Multi(MultiHeadSelfAttention),
}

impl Layer {
    fn forward(
        &self,
        x: &Tensor,
        kv: Option<&Tensor>,
        mask: Option<&AttentionMask>,
    ) -> anyhow::Result<Tensor> {
        Ok(match self {
            Layer::Single(h) => h.forward(x, mask)?.context,
            Layer::Multi(m) => m.attend(x, kv, mask, false)?.context,
        })
    }
}

/// One case of `tests/fixtures/grads.json`.
struct GradCase {
    name: String,
    meta: serde_json::Value,
    ckpt: Checkpoint,
}

fn grad_cases() -> anyhow::Result<Vec<GradCase>> {
    let text = std::fs::read_to_string(repo_path("tests/fixtures/grads.json"))?;
    let json: serde_json::Value = serde_json::from_str(&text)?;
    let cases = json["cases"]
        .as_object()
        .ok_or_else(|| anyhow::anyhow!("grads.json has no cases"))?;
    cases
        .iter()
        .map(|(name, meta)| {
            let file = meta["file"].as_str().unwrap_or_default();
            Ok(GradCase {
                name: name.clone(),
                meta: meta.clone(),
                ckpt: Checkpoint::open(repo_path(&format!("tests/fixtures/{file}")))?,
            })
        })
        .collect()
}

/// Every parameter of a case as a variable, and the layer built on them.
fn trainable_layer(
    case: &GradCase,
    path: AttentionPath,
) -> anyhow::Result<(Layer, Vec<(String, Var)>)> {
    let dev = Device::Cpu;
    let mut vars = Vec::new();
    let mut named = HashMap::new();
    for p in case.meta["params"].as_array().into_iter().flatten() {
        let name = p.as_str().unwrap_or_default().to_string();
        let var = Var::from_tensor(&case.ckpt.tensor(&name, &dev)?)?;
        named.insert(name.clone(), var.as_tensor().clone());
        vars.push((name, var));
    }
    let vb = VarBuilder::from_tensors(named, DType::F32, &dev);
    let vb = vb.pp(case.meta["prefix"].as_str().unwrap_or_default());
    let causal = case.meta["causal"].as_bool().unwrap_or(false);
    let layout: WeightLayout = case.meta["layout"].as_str().unwrap_or_default().parse()?;
    let layer = if layout == WeightLayout::Single {
        Layer::Single(SingleHeadSelfAttention::load(vb)?.with_causal(causal))
    } else {
        let heads = case.meta["heads"].as_u64().unwrap_or(1) as usize;
        let mut cfg = AttentionConfig::new(layout, heads).with_causal(causal);
        cfg.num_kv_heads = case.meta["kv_heads"].as_u64().map(|n| n as usize);
        Layer::Multi(MultiHeadSelfAttention::load(vb, &cfg)?.with_path(path))
    };
    Ok((layer, vars))
}

/// What one run of a case gives.
struct CaseRun {
    context: Tensor,
    grads: GradStore,
    x: Var,
    kv: Option<Var>,
    vars: Vec<(String, Var)>,
}

/// Runs a case on `path`.
fn run_case(case: &GradCase, path: AttentionPath) -> anyhow::Result<CaseRun> {
    let dev = Device::Cpu;
    let (layer, vars) = trainable_layer(case, path)?;
    let x = Var::from_tensor(&case.ckpt.tensor("x", &dev)?)?;
    let kv = if case.ckpt.contains("kv") {
        Some(Var::from_tensor(&case.ckpt.tensor("kv", &dev)?)?)
    } else {
        None
    };
    let mask = if case.ckpt.contains("attention_mask") {
        Some(AttentionMask::padding(
            &case.ckpt.tensor("attention_mask", &dev)?,
        )?)
    } else {
        None
    };
    let context = layer.forward(
        x.as_tensor(),
        kv.as_ref().map(Var::as_tensor),
        mask.as_ref(),
    )?;
    let loss = (&context * case.ckpt.tensor("grad_context", &dev)?)?.sum_all()?;
    let grads = loss.backward()?;
    Ok(CaseRun {
        context,
        grads,
        x,
        kv,
        vars,
    })
}

/// The largest entry of every `grad*` tensor of a case.
fn largest_gradient(case: &GradCase) -> anyhow::Result<f32> {
    let mut m = 0f32;
    for name in case.ckpt.names() {
        if name.starts_with("grad.") || name == "grad_x" || name == "grad_kv" {
            let t = case.ckpt.tensor(name, &Device::Cpu)?;
            m = m.max(t.abs()?.max_all()?.to_scalar::<f32>()?);
        }
    }
    Ok(m)
}

/// `actual` within `GRAD_TOL` of `scale`, the largest gradient of the case (a gradient that
/// is zero in exact arithmetic, like a key bias's, is compared at that scale too).
fn assert_grad_close(
    actual: &Tensor,
    expected: &Tensor,
    scale: f32,
    what: &str,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        actual.dims() == expected.dims(),
        "{what}: shape {:?}, expected {:?}",
        actual.dims(),
        expected.dims()
    );
    let d = max_abs_diff(actual, expected)?;
    anyhow::ensure!(
        d <= GRAD_TOL * scale,
        "{what}: max |diff| {d:e} > {GRAD_TOL:e} x largest {scale:e}"
    );
    Ok(())
}

#[test]
fn gradients_equal_pytorch_autograd_on_every_layout_and_path() -> anyhow::Result<()> {
    let cases = grad_cases()?;
    assert!(cases.len() >= 10, "expected every layout's cases");
    for case in &cases {
        for path in [AttentionPath::Auto, AttentionPath::Explicit] {
            let what = format!("{} ({path:?})", case.name);
            let CaseRun {
                context,
                grads,
                x,
                kv,
                vars,
            } = run_case(case, path)?;
            let dev = Device::Cpu;
            let scale = largest_gradient(case)?;
            common::assert_close(
                &context,
                &case.ckpt.tensor("context", &dev)?,
                1e-5,
                &format!("{what} context"),
            )?;
            let gx = grads.get(x.as_tensor()).expect("gradient of x");
            assert_grad_close(
                gx,
                &case.ckpt.tensor("grad_x", &dev)?,
                scale,
                &format!("{what} grad_x"),
            )?;
            if let Some(kv) = &kv {
                let g = grads.get(kv.as_tensor()).expect("gradient of kv");
                assert_grad_close(
                    g,
                    &case.ckpt.tensor("grad_kv", &dev)?,
                    scale,
                    &format!("{what} grad_kv"),
                )?;
            }
            for (name, var) in &vars {
                let g = grads
                    .get(var.as_tensor())
                    .unwrap_or_else(|| panic!("{what}: no gradient reached `{name}`"));
                let expected = case.ckpt.tensor(&format!("grad.{name}"), &dev)?;
                assert_grad_close(g, &expected, scale, &format!("{what} grad.{name}"))?;
            }
        }
    }
    Ok(())
}

/// Deterministic pseudo-random values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn tensor(shape: &[usize], seed: u64, amp: f32) -> anyhow::Result<Tensor> {
    let n = shape.iter().product();
    let v: Vec<f32> = values(n, seed).into_iter().map(|x| x * amp).collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// A fresh layer on a VarMap with the given path; returns it with its VarMap.
fn fresh_layer(
    cfg: &AttentionConfig,
    path: AttentionPath,
    seed: u64,
) -> anyhow::Result<(MultiHeadSelfAttention, VarMap)> {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let attn = MultiHeadSelfAttention::load(vb.pp("attn"), cfg)?.with_path(path);
    // Deterministic, non-uniform weights (the default init is random).
    let mut names: Vec<_> = vm.data().lock().expect("varmap").keys().cloned().collect();
    names.sort();
    for (i, name) in names.iter().enumerate() {
        let var = vm.data().lock().expect("varmap")[name].clone();
        var.set(&tensor(var.dims(), seed + i as u64, 0.3)?)?;
    }
    Ok((attn, vm))
}

#[test]
fn fast_path_gradients_equal_explicit_path_gradients() -> anyhow::Result<()> {
    // Sizes past one tile of the kernels, grouped heads, dk != dv, padding and causal masks,
    // a row whose keys are all masked.
    /// (what, layer, batch, seq, kept keys per batch row)
    type Case = (
        &'static str,
        AttentionConfig,
        usize,
        usize,
        Option<Vec<Vec<u8>>>,
    );
    let cases: Vec<Case> = vec![
        (
            "gqa causal, 300 tokens",
            AttentionConfig::new(WeightLayout::Llama, 4)
                .with_kv_heads(2)
                .with_causal(true)
                .with_hidden_size(32),
            1,
            300,
            None,
        ),
        (
            "bert padding, one row fully masked",
            AttentionConfig::new(WeightLayout::Bert, 2).with_hidden_size(24),
            3,
            70,
            Some(vec![
                vec![1; 70],
                (0..70).map(|j| u8::from(j < 41)).collect(),
                vec![0; 70],
            ]),
        ),
        (
            "llama dk != dv, padding with holes",
            AttentionConfig::new(WeightLayout::Llama, 2)
                .with_hidden_size(16)
                .with_head_dim(12)
                .with_v_head_dim(5)
                .with_bias(true),
            2,
            33,
            Some(vec![
                (0..33).map(|j| u8::from(j % 5 != 3)).collect(),
                (0..33).map(|j| u8::from(j > 10)).collect(),
            ]),
        ),
    ];
    for (what, cfg, b, t, keep) in cases {
        let hidden = cfg.hidden_size.unwrap_or_default();
        let x = tensor(&[b, t, hidden], 7, 1.0)?;
        let mask = match &keep {
            Some(rows) => {
                let flat: Vec<u8> = rows.iter().flatten().copied().collect();
                Some(AttentionMask::padding(&Tensor::from_vec(
                    flat,
                    (b, t),
                    &Device::Cpu,
                )?)?)
            }
            None => None,
        };
        let mut results = Vec::new();
        for path in [AttentionPath::Auto, AttentionPath::Explicit] {
            let (attn, vm) = fresh_layer(&cfg, path, 11)?;
            let xv = Var::from_tensor(&x)?;
            let ctx = attn.forward(xv.as_tensor(), mask.as_ref())?.context;
            let g = tensor(ctx.dims(), 5, 1.0)?;
            let grads = (&ctx * &g)?.sum_all()?.backward()?;
            let mut named: Vec<(String, Tensor)> = vm
                .data()
                .lock()
                .expect("varmap")
                .iter()
                .map(|(n, v)| (n.clone(), grads.get(v.as_tensor()).cloned()))
                .map(|(n, g)| {
                    (
                        n.clone(),
                        g.unwrap_or_else(|| panic!("{what}: no grad for {n}")),
                    )
                })
                .collect();
            named.sort_by(|a, b| a.0.cmp(&b.0));
            named.push((
                "x".into(),
                grads.get(xv.as_tensor()).expect("grad x").clone(),
            ));
            named.push(("context".into(), ctx));
            results.push(named);
        }
        for ((name, fast), (_, explicit)) in results[0].iter().zip(&results[1]) {
            anyhow::ensure!(
                fast.flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .all(|v| v.is_finite()),
                "{what}: non-finite {name}"
            );
            let scale = explicit.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-6);
            let d = max_abs_diff(fast, explicit)?;
            anyhow::ensure!(
                d <= 1e-5 * scale.max(1.0),
                "{what}: {name} fast vs explicit {d:e} (largest {scale:e})"
            );
        }
        if keep
            .as_ref()
            .is_some_and(|k| k.iter().any(|r| r.iter().all(|&v| v == 0)))
        {
            // The fully masked batch row: zero context, zero gradient for its inputs.
            let gx = &results[0].iter().find(|(n, _)| n == "x").expect("x").1;
            let row = gx.narrow(0, b - 1, 1)?;
            assert_eq!(row.abs()?.max_all()?.to_scalar::<f32>()?, 0.0, "{what}");
        }
    }
    Ok(())
}

#[test]
fn fresh_layers_have_checkpoint_names_train_and_save_as_checkpoints() -> anyhow::Result<()> {
    let dir = common::TempDir::new("fresh-layers")?;
    let layouts: Vec<(AttentionConfig, Vec<&str>)> = vec![
        (
            AttentionConfig::new(WeightLayout::TorchMha, 4).with_hidden_size(16),
            vec![
                "in_proj_bias",
                "in_proj_weight",
                "out_proj.bias",
                "out_proj.weight",
            ],
        ),
        (
            AttentionConfig::new(WeightLayout::Gpt2, 4).with_hidden_size(16),
            vec![
                "c_attn.bias",
                "c_attn.weight",
                "c_proj.bias",
                "c_proj.weight",
            ],
        ),
        (
            AttentionConfig::new(WeightLayout::Bert, 4).with_hidden_size(16),
            vec![
                "output.dense.bias",
                "output.dense.weight",
                "self.key.bias",
                "self.key.weight",
                "self.query.bias",
                "self.query.weight",
                "self.value.bias",
                "self.value.weight",
            ],
        ),
        (
            AttentionConfig::new(WeightLayout::Llama, 4)
                .with_kv_heads(2)
                .with_causal(true)
                .with_hidden_size(16),
            vec![
                "k_proj.weight",
                "o_proj.weight",
                "q_proj.weight",
                "v_proj.weight",
            ],
        ),
    ];
    for (cfg, expected) in layouts {
        let what = cfg.layout.name();
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
        let attn = MultiHeadSelfAttention::load(vb.pp("attn"), &cfg)?;
        assert!(attn.is_trainable(), "{what}");
        let mut names: Vec<String> = vm.data().lock().expect("varmap").keys().cloned().collect();
        names.sort();
        let expected: Vec<String> = expected.iter().map(|n| format!("attn.{n}")).collect();
        assert_eq!(names, expected, "{what}: variable names");
        if cfg.layout == WeightLayout::Gpt2 {
            let w = vm.data().lock().expect("varmap")["attn.c_attn.weight"].clone();
            assert_eq!(w.dims(), &[16, 48], "GPT-2 Conv1D layout (in, 3 * out)");
        }

        // A few AdamW steps towards a target: the loss falls and the output moves.
        let x = tensor(&[2, 9, 16], 3, 1.0)?;
        let target = tensor(&[2, 9, 16], 4, 0.5)?;
        let mut opt = candle_nn::AdamW::new_lr(vm.all_vars(), 1e-2)?;
        let before = attn.forward(&x, None)?.context;
        let loss0 = (&before - &target)?.sqr()?.mean_all()?.to_scalar::<f32>()?;
        let mut loss = loss0;
        for _ in 0..20 {
            let out = attn.forward(&x, None)?.context;
            let l = (&out - &target)?.sqr()?.mean_all()?;
            loss = l.to_scalar::<f32>()?;
            opt.backward_step(&l)?;
        }
        let after = attn.forward(&x, None)?.context;
        assert!(loss < 0.8 * loss0, "{what}: loss {loss0} -> {loss}");
        assert!(
            max_abs_diff(&before, &after)? > 1e-3,
            "{what}: output did not move"
        );

        // Saved, it loads back as a checkpoint of the same layout, giving the same output.
        let path = dir.file(&format!("{what}.safetensors"));
        vm.save(&path)?;
        let ckpt = Checkpoint::open(&path)?;
        let frozen = MultiHeadSelfAttention::load(
            ckpt.var_builder(DType::F32, &Device::Cpu).pp("attn"),
            &AttentionConfig::new(cfg.layout, cfg.num_heads).with_causal(cfg.causal),
        )?;
        assert!(!frozen.is_trainable() && frozen.is_fused(), "{what}");
        let reloaded = frozen.forward(&x, None)?.context;
        assert!(
            max_abs_diff(&after, &reloaded)? < 1e-5,
            "{what}: reloaded output"
        );
    }
    Ok(())
}

#[test]
fn a_fresh_single_head_with_dk_not_dv_trains() -> anyhow::Result<()> {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let cfg = AttentionConfig::new(WeightLayout::Single, 1)
        .with_hidden_size(16)
        .with_head_dim(8)
        .with_v_head_dim(12)
        .with_causal(true);
    let head = SingleHeadSelfAttention::load_with(vb.pp("head"), &cfg)?;
    assert_eq!((head.d_k(), head.d_v()), (8, 12));
    let mut names: Vec<String> = vm.data().lock().expect("varmap").keys().cloned().collect();
    names.sort();
    assert_eq!(
        names,
        [
            "key.bias",
            "key.weight",
            "query.bias",
            "query.weight",
            "value.bias",
            "value.weight"
        ]
        .map(|n| format!("head.{n}"))
    );
    let x = tensor(&[2, 7, 16], 9, 1.0)?;
    let target = tensor(&[2, 7, 12], 10, 0.5)?;
    let mut opt = candle_nn::AdamW::new_lr(vm.all_vars(), 1e-2)?;
    let loss = |h: &SingleHeadSelfAttention| -> anyhow::Result<Tensor> {
        Ok((h.forward(&x, None)?.context - &target)?
            .sqr()?
            .mean_all()?)
    };
    let l0 = loss(&head)?.to_scalar::<f32>()?;
    for _ in 0..20 {
        opt.backward_step(&loss(&head)?)?;
    }
    let l1 = loss(&head)?.to_scalar::<f32>()?;
    assert!(l1 < 0.8 * l0, "loss {l0} -> {l1}");
    Ok(())
}

#[test]
fn a_checkpoint_loaded_into_a_varmap_trains() -> anyhow::Result<()> {
    let path = repo_path("tests/fixtures/grad_torch_mha_padding.safetensors");
    let ckpt = Checkpoint::open(&path)?;
    let cfg = AttentionConfig::new(WeightLayout::TorchMha, 4).with_hidden_size(16);
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let attn = MultiHeadSelfAttention::load(vb.pp("attn"), &cfg)?;
    // The fresh variables take the checkpoint's values (every variable name is in it).
    let mut file = HashMap::new();
    for (name, var) in vm.data().lock().expect("varmap").iter() {
        file.insert(name.clone(), ckpt.tensor(name, &Device::Cpu)?);
        var.set(&file[name])?;
    }
    let frozen = MultiHeadSelfAttention::load(
        ckpt.var_builder(DType::F32, &Device::Cpu).pp("attn"),
        &AttentionConfig::new(WeightLayout::TorchMha, 4),
    )?;
    let x = ckpt.tensor("x", &Device::Cpu)?;
    let start = attn.forward(&x, None)?.context;
    assert!(max_abs_diff(&start, &frozen.forward(&x, None)?.context)? < 1e-5);
    let mut opt = candle_nn::SGD::new(vm.all_vars(), 0.1)?;
    let loss = start.sqr()?.mean_all()?;
    opt.backward_step(&loss)?;
    let moved = attn.forward(&x, None)?.context;
    let after = moved.sqr()?.mean_all()?.to_scalar::<f32>()?;
    assert!(
        after < loss.to_scalar::<f32>()?,
        "one SGD step lowers the loss"
    );
    Ok(())
}

#[test]
fn stated_sizes_must_agree_with_the_checkpoint() -> anyhow::Result<()> {
    let ckpt = Checkpoint::open(repo_path(
        "tests/fixtures/grad_torch_mha_padding.safetensors",
    ))?;
    let vb = ckpt.var_builder(DType::F32, &Device::Cpu).pp("attn");
    let cfg = AttentionConfig::new(WeightLayout::TorchMha, 4).with_hidden_size(32);
    let err = MultiHeadSelfAttention::load(vb.clone(), &cfg).expect_err("wrong hidden size");
    let msg = err.to_string();
    assert!(
        msg.contains("in_proj_weight") && msg.contains("96"),
        "{msg}"
    );
    // Right sizes load, like the unsized load.
    let cfg = AttentionConfig::new(WeightLayout::TorchMha, 4).with_hidden_size(16);
    assert!(MultiHeadSelfAttention::load(vb, &cfg)?.is_fused());
    // A VarMap without sizes says what to do.
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let err = MultiHeadSelfAttention::load(vb, &AttentionConfig::new(WeightLayout::Bert, 2))
        .expect_err("no sizes");
    assert!(err.to_string().contains("with_hidden_size"), "{err}");
    Ok(())
}

#[test]
fn weights_asked_for_and_streamed_keep_the_context_differentiable() -> anyhow::Result<()> {
    let cfg = AttentionConfig::new(WeightLayout::Bert, 2).with_hidden_size(16);
    let (attn, vm) = fresh_layer(&cfg, AttentionPath::Auto, 21)?;
    let x = tensor(&[2, 9, 16], 22, 1.0)?;
    let g = tensor(&[2, 9, 16], 23, 1.0)?;
    let keep = Tensor::new(&[[1u8, 1, 1, 1, 1, 1, 1, 0, 0], [1; 9]], &Device::Cpu)?;
    let mask = AttentionMask::padding(&keep)?;
    let grads_of = |ctx: &Tensor| -> anyhow::Result<Vec<Tensor>> {
        let grads = (ctx * &g)?.sum_all()?.backward()?;
        let data = vm.data().lock().expect("varmap");
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        Ok(names
            .into_iter()
            .map(|n| grads.get(data[n].as_tensor()).expect("gradient").clone())
            .collect())
    };
    let plain = grads_of(&attn.forward(&x, Some(&mask))?.context)?;
    let with = attn.forward_with_weights(&x, Some(&mask))?;
    let weights = with.weights.clone().expect("weights");
    let mut blocks = Vec::new();
    let streamed = attn.forward_streamed(&x, Some(&mask), |blk| {
        blocks.extend_from_slice(blk.weights);
        Ok(())
    })?;
    let streamed_weights = Tensor::from_vec(blocks, weights.dims(), &Device::Cpu)?;
    assert!(max_abs_diff(&weights, &streamed_weights)? < 1e-6);
    for (what, ctx) in [
        ("with weights", &with.context),
        ("streamed", &streamed.context),
    ] {
        for (a, b) in grads_of(ctx)?.iter().zip(&plain) {
            let d = max_abs_diff(a, b)?;
            assert!(d < 1e-5, "{what}: gradients differ by {d:e}");
        }
    }
    Ok(())
}

#[test]
fn repeated_backward_and_frozen_parameters_give_exact_gradients() -> anyhow::Result<()> {
    // The layer's backward hands W_O's and the biases' gradients to a second node: a second
    // backward of the same graph must find them again, and a frozen W_O (a plain tensor)
    // must leave the other gradients unchanged.
    use candle_attention::{LinearWeights, Projections};
    let (d, heads, b, t) = (24, 3, 2, 40);
    let cfg = AttentionConfig::new(WeightLayout::TorchMha, heads);
    let lin = |seed: u64, var: bool| -> anyhow::Result<LinearWeights> {
        let w = tensor(&[d, d], seed, 0.3)?;
        let bias = tensor(&[d], seed + 100, 0.1)?;
        let (w, bias) = if var {
            (
                Var::from_tensor(&w)?.as_tensor().clone(),
                Var::from_tensor(&bias)?.as_tensor().clone(),
            )
        } else {
            (w, bias)
        };
        Ok(LinearWeights::new(w, Some(bias), format!("w{seed}")))
    };
    let x = Var::from_tensor(&tensor(&[b, t, d], 3, 1.0)?)?;
    let g = tensor(&[b, t, d], 4, 1.0)?;
    for frozen_o in [false, true] {
        let p = Projections {
            q: lin(1, true)?,
            k: lin(2, true)?,
            v: lin(3, true)?,
            o: Some(lin(4, !frozen_o)?),
        };
        let mut tracked: Vec<(String, Tensor)> = vec![("x".into(), x.as_tensor().clone())];
        for (n, l) in [("q", &p.q), ("k", &p.k), ("v", &p.v)] {
            tracked.push((format!("{n}.weight"), l.weight.clone()));
            tracked.push((format!("{n}.bias"), l.bias.clone().expect("bias")));
        }
        if let (false, Some(o)) = (frozen_o, &p.o) {
            tracked.push(("o.weight".into(), o.weight.clone()));
            tracked.push(("o.bias".into(), o.bias.clone().expect("bias")));
        }
        let mut runs = Vec::new();
        for path in [AttentionPath::Auto, AttentionPath::Explicit] {
            let attn = MultiHeadSelfAttention::new(p.clone(), &cfg)?.with_path(path);
            let ctx = attn.forward(x.as_tensor(), None)?.context;
            let loss = (&ctx * &g)?.sum_all()?;
            let first = loss.backward()?;
            let second = loss.backward()?;
            let mut grads = Vec::new();
            for (name, t) in &tracked {
                let a = first
                    .get(t)
                    .unwrap_or_else(|| panic!("{path:?}: no grad {name}"));
                let again = second.get(t).expect("second backward");
                assert_eq!(
                    max_abs_diff(a, again)?,
                    0.0,
                    "{path:?} {name}: second backward"
                );
                grads.push(a.clone());
            }
            if frozen_o {
                let o = p.o.as_ref().expect("o");
                assert!(
                    first.get(&o.weight).is_none(),
                    "{path:?}: frozen W_O got a grad"
                );
            }
            runs.push(grads);
        }
        for ((name, _), (fast, explicit)) in tracked.iter().zip(runs[0].iter().zip(&runs[1])) {
            let scale = explicit.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0);
            let diff = max_abs_diff(fast, explicit)?;
            assert!(
                diff <= 1e-5 * scale,
                "frozen W_O {frozen_o}: {name} fast vs explicit {diff:e}"
            );
        }
    }
    Ok(())
}

#[test]
fn gradients_of_an_earlier_backward_stay_as_they_were() -> anyhow::Result<()> {
    // With freed memory retained, the layer writes `x`'s and `W_qkv`'s gradients into
    // tensors kept from step to step; what an earlier backward returned must not change
    // (gradient accumulation keeps it across steps).
    let retained = candle_attention::retain_freed_memory();
    let cfg = AttentionConfig::new(WeightLayout::TorchMha, 4)
        .with_hidden_size(32)
        .with_bias(true);
    let (attn, vm) = fresh_layer(&cfg, AttentionPath::Auto, 21)?;
    let w = vm.data().lock().expect("varmap")["attn.in_proj_weight"].clone();
    let x = Var::from_tensor(&tensor(&[2, 50, 32], 8, 1.0)?)?;
    let step = |seed: u64| -> anyhow::Result<GradStore> {
        let ctx = attn.forward(x.as_tensor(), None)?.context;
        let g = tensor(ctx.dims(), seed, 1.0)?;
        Ok((&ctx * &g)?.sum_all()?.backward()?)
    };
    let first = step(1)?;
    let copy = |g: &GradStore, t: &Tensor| -> anyhow::Result<Vec<f32>> {
        Ok(g.get(t).expect("grad").flatten_all()?.to_vec1::<f32>()?)
    };
    let (fx, fw) = (copy(&first, x.as_tensor())?, copy(&first, w.as_tensor())?);
    let second = step(2)?;
    let _third = step(3)?;
    assert_eq!(copy(&first, x.as_tensor())?, fx, "retained {retained}: x");
    assert_eq!(
        copy(&first, w.as_tensor())?,
        fw,
        "retained {retained}: W_qkv"
    );
    assert_ne!(
        copy(&second, x.as_tensor())?,
        fx,
        "a different loss, other gradients"
    );
    Ok(())
}

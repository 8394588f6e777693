//! The contract of `examples/layer_probe.rs`:
//!
//! ```text
//! layer_probe --weights W.safetensors --layout bert|torch-mha|gpt2|llama|single
//!   [--prefix P] [--heads N] [--kv-heads N] [--causal]
//!   --input IN.safetensors --output OUT.safetensors
//! ```
//!
//! Every golden fixture case is written to an input file (`x`, `attention_mask`, `kv`), run
//! through the binary, and its `context` / `weights` compared with PyTorch's (weights 1e-5,
//! context 1e-4). Bad inputs exit non-zero with one `error: ...` line that names the problem
//! and no panic or backtrace.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor};
use common::{assert_close, repo_path, Fixture, TempDir};

const WEIGHTS_TOL: f32 = 1e-5;
const CONTEXT_TOL: f32 = 1e-4;

/// The example binary, built once for all tests of this file.
fn probe_bin() -> anyhow::Result<PathBuf> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(|| common::example_bin("layer_probe").map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

/// Runs the probe with `args` (strings or paths).
fn run_probe(args: &[&std::ffi::OsStr]) -> anyhow::Result<Output> {
    let out = Command::new(probe_bin()?)
        .args(args)
        // A backtrace must not leak into the message even when one is asked for.
        .env("RUST_BACKTRACE", "1")
        .current_dir(repo_path(""))
        .output()?;
    Ok(out)
}

/// Command-line arguments of one probe run, built up like the command line.
#[derive(Default, Clone)]
struct ProbeArgs {
    weights: PathBuf,
    layout: String,
    prefix: Option<String>,
    heads: Option<usize>,
    kv_heads: Option<usize>,
    causal: bool,
}

impl ProbeArgs {
    fn run(&self, input: &Path, output: &Path) -> anyhow::Result<Output> {
        let mut args: Vec<std::ffi::OsString> = vec![
            "--weights".into(),
            self.weights.clone().into(),
            "--layout".into(),
            self.layout.clone().into(),
        ];
        if let Some(p) = &self.prefix {
            args.extend(["--prefix".into(), p.into()]);
        }
        if let Some(h) = self.heads {
            args.extend(["--heads".into(), h.to_string().into()]);
        }
        if let Some(h) = self.kv_heads {
            args.extend(["--kv-heads".into(), h.to_string().into()]);
        }
        if self.causal {
            args.push("--causal".into());
        }
        args.extend([
            "--input".into(),
            input.into(),
            "--output".into(),
            output.into(),
        ]);
        let refs: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
        run_probe(&refs)
    }

    /// Runs and expects success; returns `(context, weights)` from the output file.
    fn run_ok(&self, input: &Path, output: &Path, what: &str) -> anyhow::Result<(Tensor, Tensor)> {
        let out = self.run(input, output)?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        anyhow::ensure!(
            out.status.success(),
            "{what}: layer_probe failed ({}): {stderr}",
            out.status
        );
        let mut tensors = candle_core::safetensors::load(output, &Device::Cpu)?;
        let mut take = |name: &str| -> anyhow::Result<Tensor> {
            let t = tensors
                .remove(name)
                .ok_or_else(|| anyhow::anyhow!("{what}: no `{name}` in the output"))?;
            anyhow::ensure!(
                t.dtype() == DType::F32,
                "{what}: `{name}` is {:?}",
                t.dtype()
            );
            Ok(t)
        };
        Ok((take("context")?, take("weights")?))
    }
}

fn save_input(path: &Path, tensors: &[(&str, &Tensor)]) -> anyhow::Result<()> {
    let map: HashMap<String, Tensor> = tensors
        .iter()
        .map(|(n, t)| (n.to_string(), (*t).clone()))
        .collect();
    candle_core::safetensors::save(&map, path)?;
    Ok(())
}

/// The probe arguments for a fixture case, from its JSON sidecar.
fn fixture_args(fx: &Fixture, case: &str) -> anyhow::Result<ProbeArgs> {
    let layout = fx.meta["layout"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("{}: no layout", fx.name))?
        .to_string();
    let heads = fx.meta["heads"].as_u64().unwrap_or(1) as usize;
    let kv_heads = fx.meta["kv_heads"].as_u64().unwrap_or(heads as u64) as usize;
    let weights = match fx.meta["weights_file"].as_str() {
        Some(f) => repo_path(f),
        None => repo_path(&format!("tests/fixtures/{}.safetensors", fx.name)),
    };
    let prefix = fx.prefix(case);
    Ok(ProbeArgs {
        weights,
        prefix: (!prefix.is_empty()).then_some(prefix),
        heads: (layout != "single").then_some(heads),
        kv_heads: (kv_heads != heads).then_some(kv_heads),
        causal: fx.case_meta(case)["causal"].as_bool().unwrap_or(false),
        layout,
    })
}

/// Runs every case of a fixture through the binary and compares with the fixture.
/// `mask_dtypes` are the dtypes the `attention_mask` is written in (the fixture's own I64
/// first).
fn check_fixture(name: &str, mask_dtypes: &[DType]) -> anyhow::Result<()> {
    let fx = Fixture::open(name)?;
    let dir = TempDir::new(name)?;
    let cases = fx.cases();
    anyhow::ensure!(!cases.is_empty(), "{name} has no cases");
    for case in cases {
        let args = fixture_args(&fx, &case)?;
        let x = fx
            .case_tensor(&case, "x")?
            .ok_or_else(|| anyhow::anyhow!("{name}/{case}: no x"))?;
        let kv = fx.case_tensor(&case, "kv")?;
        let mask = fx.case_tensor(&case, "attention_mask")?;
        let expected_w = fx
            .case_tensor(&case, "weights")?
            .ok_or_else(|| anyhow::anyhow!("{name}/{case}: no weights"))?;
        let expected_c = fx
            .case_tensor(&case, "context")?
            .ok_or_else(|| anyhow::anyhow!("{name}/{case}: no context"))?;
        let variants: Vec<Option<DType>> = match &mask {
            None => vec![None],
            Some(m) => std::iter::once(m.dtype())
                .chain(mask_dtypes.iter().copied())
                .map(Some)
                .collect(),
        };
        for mask_dtype in variants {
            let what = format!("{name}/{case} (mask {mask_dtype:?})");
            let mut inputs: Vec<(&str, Tensor)> = vec![("x", x.clone())];
            if let (Some(m), Some(dt)) = (&mask, mask_dtype) {
                inputs.push(("attention_mask", m.to_dtype(dt)?));
            }
            if let Some(kv) = &kv {
                inputs.push(("kv", kv.clone()));
            }
            let refs: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (*n, t)).collect();
            let input = dir.file(&format!("{case}-in.safetensors"));
            let output = dir.file(&format!("{case}-out.safetensors"));
            save_input(&input, &refs)?;
            let (context, weights) = args.run_ok(&input, &output, &what)?;
            assert_close(
                &weights,
                &expected_w,
                WEIGHTS_TOL,
                &format!("{what} weights"),
            )?;
            assert_close(
                &context,
                &expected_c,
                CONTEXT_TOL,
                &format!("{what} context"),
            )?;
        }
    }
    Ok(())
}

#[test]
fn torch_mha_fixture() -> anyhow::Result<()> {
    // The fixture's masks are I64; also write them once as U8 and as F32.
    check_fixture("torch_mha", &[DType::U8, DType::F32])
}

#[test]
fn gpt2_fixture() -> anyhow::Result<()> {
    check_fixture("gpt2_attn", &[])
}

#[test]
fn llama_gqa_fixture() -> anyhow::Result<()> {
    check_fixture("llama_gqa", &[])
}

#[test]
fn single_head_fixture() -> anyhow::Result<()> {
    check_fixture("single_head", &[])
}

#[test]
fn bert_layer_fixture_on_shipped_weights() -> anyhow::Result<()> {
    check_fixture("bert_layer", &[])
}

#[test]
fn single_layout_accepts_heads_one() -> anyhow::Result<()> {
    let fx = Fixture::open("single_head")?;
    let dir = TempDir::new("single-heads-1")?;
    let args = ProbeArgs {
        heads: Some(1),
        ..fixture_args(&fx, "plain")?
    };
    let x = fx.case_tensor("plain", "x")?.expect("x");
    let input = dir.file("in.safetensors");
    let output = dir.file("out.safetensors");
    save_input(&input, &[("x", &x)])?;
    let (context, weights) = args.run_ok(&input, &output, "single --heads 1")?;
    let expected = fx.case_tensor("plain", "context")?.expect("context");
    assert_close(&context, &expected, CONTEXT_TOL, "single --heads 1 context")?;
    assert_eq!(weights.dims(), &[2, 1, 5, 5]);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Bad inputs
// ---------------------------------------------------------------------------------------

/// Asserts a failed run: non-zero exit, stderr one `error: ...` line mentioning every
/// needle, no panic, no backtrace.
fn assert_fails(out: &Output, needles: &[&str], what: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "{what}: expected failure, exit {}; stderr: {stderr}",
        out.status
    );
    assert!(
        out.status.code().is_some_and(|c| c != 101),
        "{what}: exit {} (101 is a panic); stderr: {stderr}",
        out.status
    );
    let lower = stderr.to_lowercase();
    assert!(
        !lower.contains("panicked") && !lower.contains("backtrace"),
        "{what}: stderr shows a panic or a backtrace: {stderr}"
    );
    let text = stderr.trim_end();
    assert!(
        text.starts_with("error: "),
        "{what}: stderr does not start with `error: `: {stderr}"
    );
    assert_eq!(
        text.lines().count(),
        1,
        "{what}: stderr is not one line: {stderr}"
    );
    for needle in needles {
        assert!(
            text.contains(needle),
            "{what}: stderr does not mention `{needle}`: {stderr}"
        );
    }
}

/// torch_mha arguments (hidden 16, 4 heads) and a valid input file in `dir`.
fn torch_mha_setup(dir: &TempDir) -> anyhow::Result<(ProbeArgs, PathBuf)> {
    let fx = Fixture::open("torch_mha")?;
    let args = fixture_args(&fx, "plain")?;
    let input = dir.file("in.safetensors");
    let x = fx.case_tensor("plain", "x")?.expect("x");
    save_input(&input, &[("x", &x)])?;
    Ok((args, input))
}

#[test]
fn valid_torch_mha_setup_succeeds() -> anyhow::Result<()> {
    // The bad-input tests below change one thing each in this valid run.
    let dir = TempDir::new("valid")?;
    let (args, input) = torch_mha_setup(&dir)?;
    let output = dir.file("out.safetensors");
    let (context, weights) = args.run_ok(&input, &output, "valid torch_mha")?;
    assert_eq!(context.dims(), &[2, 5, 16]);
    assert_eq!(weights.dims(), &[2, 4, 5, 5]);
    Ok(())
}

#[test]
fn missing_input_file_fails_cleanly() -> anyhow::Result<()> {
    let dir = TempDir::new("missing-input")?;
    let (args, _) = torch_mha_setup(&dir)?;
    let input = dir.file("does-not-exist.safetensors");
    let out = args.run(&input, &dir.file("out.safetensors"))?;
    assert_fails(
        &out,
        &["--input", &input.display().to_string()],
        "missing --input",
    );
    assert!(
        !dir.file("out.safetensors").exists(),
        "no output on failure"
    );
    Ok(())
}

#[test]
fn nonexistent_prefix_fails_cleanly() -> anyhow::Result<()> {
    let dir = TempDir::new("prefix")?;
    let (args, input) = torch_mha_setup(&dir)?;
    let args = ProbeArgs {
        prefix: Some("nothing.here".into()),
        ..args
    };
    let out = args.run(&input, &dir.file("out.safetensors"))?;
    // The message names the prefix and what the checkpoint does hold.
    assert_fails(&out, &["nothing.here", "attn"], "--prefix nothing.here");
    Ok(())
}

#[test]
fn zero_heads_fails_cleanly() -> anyhow::Result<()> {
    let dir = TempDir::new("heads-0")?;
    let (args, input) = torch_mha_setup(&dir)?;
    let args = ProbeArgs {
        heads: Some(0),
        ..args
    };
    let out = args.run(&input, &dir.file("out.safetensors"))?;
    assert_fails(&out, &["heads", "found 0"], "--heads 0");
    Ok(())
}

#[test]
fn heads_not_dividing_width_fails_cleanly() -> anyhow::Result<()> {
    let dir = TempDir::new("heads-5")?;
    let (args, input) = torch_mha_setup(&dir)?;
    let args = ProbeArgs {
        heads: Some(5),
        ..args
    };
    let out = args.run(&input, &dir.file("out.safetensors"))?;
    assert_fails(&out, &["5 heads", "16"], "--heads 5 on width 16");
    Ok(())
}

#[test]
fn wrong_hidden_size_fails_cleanly() -> anyhow::Result<()> {
    let dir = TempDir::new("hidden")?;
    let (args, _) = torch_mha_setup(&dir)?;
    let input = dir.file("wide.safetensors");
    let x = Tensor::randn(0f32, 1f32, (1, 3, 15), &Device::Cpu)?;
    save_input(&input, &[("x", &x)])?;
    let out = args.run(&input, &dir.file("out.safetensors"))?;
    assert_fails(&out, &["`x`", "16", "[1, 3, 15]"], "x of width 15");
    Ok(())
}

#[test]
fn input_without_x_fails_cleanly() -> anyhow::Result<()> {
    let dir = TempDir::new("no-x")?;
    let (args, _) = torch_mha_setup(&dir)?;
    let input = dir.file("no-x.safetensors");
    let y = Tensor::zeros((1, 3, 16), DType::F32, &Device::Cpu)?;
    save_input(&input, &[("y", &y)])?;
    let out = args.run(&input, &dir.file("out.safetensors"))?;
    assert_fails(&out, &["`x`"], "input without x");
    Ok(())
}

/// `--backward` on every gradient fixture (`scripts/gen_grad_fixtures.py`): the file is both
/// the weights and the input; every gradient within 1e-4 of the case's largest one.
#[test]
fn backward_gradients_equal_pytorch_autograd() -> anyhow::Result<()> {
    let text = std::fs::read_to_string(repo_path("tests/fixtures/grads.json"))?;
    let json: serde_json::Value = serde_json::from_str(&text)?;
    let cases = json["cases"]
        .as_object()
        .ok_or_else(|| anyhow::anyhow!("grads.json has no cases"))?;
    let dir = TempDir::new("probe-backward")?;
    for (case, meta) in cases {
        let file = repo_path(&format!(
            "tests/fixtures/{}",
            meta["file"].as_str().unwrap_or_default()
        ));
        let heads = meta["heads"].as_u64().unwrap_or(1).to_string();
        let mut args: Vec<std::ffi::OsString> = vec![
            "--weights".into(),
            file.clone().into(),
            "--layout".into(),
            meta["layout"].as_str().unwrap_or_default().into(),
            "--prefix".into(),
            meta["prefix"].as_str().unwrap_or_default().into(),
            "--input".into(),
            file.clone().into(),
            "--output".into(),
            dir.file(&format!("{case}.safetensors")).into(),
            "--backward".into(),
        ];
        if meta["layout"] != "single" {
            args.extend(["--heads".into(), heads.into()]);
        }
        if let Some(kv) = meta["kv_heads"].as_u64() {
            args.extend(["--kv-heads".into(), kv.to_string().into()]);
        }
        if meta["causal"].as_bool().unwrap_or(false) {
            args.push("--causal".into());
        }
        let refs: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
        let out = run_probe(&refs)?;
        anyhow::ensure!(
            out.status.success(),
            "{case}: layer_probe --backward failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got =
            candle_core::safetensors::load(dir.file(&format!("{case}.safetensors")), &Device::Cpu)?;
        let want = candle_core::safetensors::load(&file, &Device::Cpu)?;
        let expected: Vec<&String> = want
            .keys()
            .filter(|k| k.starts_with("grad.") || *k == "grad_x" || *k == "grad_kv")
            .collect();
        let mut largest = 0f32;
        for k in &expected {
            largest = largest.max(want[*k].abs()?.max_all()?.to_scalar::<f32>()?);
        }
        for k in expected {
            let g = got
                .get(k)
                .ok_or_else(|| anyhow::anyhow!("{case}: no `{k}` in the output"))?;
            anyhow::ensure!(g.dtype() == DType::F32, "{case}: `{k}` is {:?}", g.dtype());
            assert_close(g, &want[k], 1e-4 * largest, &format!("{case} {k}"))?;
        }
        assert_close(
            &got["context"],
            &want["context"],
            CONTEXT_TOL,
            &format!("{case} context"),
        )?;
        anyhow::ensure!(got.contains_key("weights"), "{case}: no weights");
        let grads = got.keys().filter(|k| k.starts_with("grad.")).count();
        anyhow::ensure!(
            grads == meta["params"].as_array().map_or(0, Vec::len),
            "{case}: {grads} parameter gradients written"
        );
    }
    Ok(())
}

#[test]
fn backward_without_grad_context_fails_cleanly() -> anyhow::Result<()> {
    let dir = TempDir::new("probe-backward-missing")?;
    let (args, input) = torch_mha_setup(&dir)?;
    let out = run_probe(&[
        "--weights".as_ref(),
        args.weights.as_os_str(),
        "--layout".as_ref(),
        "torch-mha".as_ref(),
        "--prefix".as_ref(),
        args.prefix.as_deref().unwrap_or("").as_ref(),
        "--heads".as_ref(),
        "4".as_ref(),
        "--input".as_ref(),
        input.as_os_str(),
        "--output".as_ref(),
        dir.file("out.safetensors").as_os_str(),
        "--backward".as_ref(),
    ])?;
    assert_fails(&out, &["grad_context"], "--backward without grad_context");
    Ok(())
}

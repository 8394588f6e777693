//! The `examples/bench.rs` contract: one shape per call, `--json` prints exactly one JSON
//! object with `batch`, `seq`, `hidden`, `heads`, `median_ms`, `gflops`, `peak_rss_mb`
//! (and nothing else on stdout); without it, a table with the candle baselines. Tiny
//! shapes, so the timings themselves are not checked, only that they are measured.

mod common;

use std::process::Command;
use std::sync::OnceLock;

use anyhow::Context;
use serde_json::Value;

fn bench(args: &[&str]) -> anyhow::Result<std::process::Output> {
    static BIN: OnceLock<Result<std::path::PathBuf, String>> = OnceLock::new();
    let bin = BIN
        .get_or_init(|| common::example_bin("bench").map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)?;
    Ok(Command::new(bin)
        .args(args)
        .env("RAYON_NUM_THREADS", "2")
        .output()?)
}

fn json_of(args: &[&str]) -> anyhow::Result<Value> {
    let out = bench(args)?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(out.status.success(), "bench {args:?} failed: {stderr}");
    let stdout = String::from_utf8(out.stdout)?;
    let lines: Vec<&str> = stdout.lines().filter(|l| !l.trim().is_empty()).collect();
    anyhow::ensure!(lines.len() == 1, "expected one JSON line, got {stdout:?}");
    serde_json::from_str(lines[0]).with_context(|| format!("not JSON: {}", lines[0]))
}

fn num(v: &Value, key: &str) -> anyhow::Result<f64> {
    v.get(key)
        .and_then(Value::as_f64)
        .with_context(|| format!("`{key}` missing or not a number in {v}"))
}

#[test]
fn json_has_the_contract_fields() -> anyhow::Result<()> {
    for (extra, kv, causal, weights) in [
        (&[][..], 4.0, false, false),
        (
            &["--kv-heads", "2", "--causal", "--weights"][..],
            2.0,
            true,
            true,
        ),
    ] {
        let mut args = vec![
            "--batch", "2", "--seq", "24", "--hidden", "32", "--heads", "4", "--iters", "2",
        ];
        args.extend_from_slice(extra);
        args.push("--json");
        let v = json_of(&args)?;
        assert_eq!(num(&v, "batch")?, 2.0, "{v}");
        assert_eq!(num(&v, "seq")?, 24.0, "{v}");
        assert_eq!(num(&v, "hidden")?, 32.0, "{v}");
        assert_eq!(num(&v, "heads")?, 4.0, "{v}");
        assert_eq!(num(&v, "kv_heads")?, kv, "{v}");
        assert_eq!(v["causal"], Value::Bool(causal), "{v}");
        assert_eq!(v["weights"], Value::Bool(weights), "{v}");
        for key in ["median_ms", "gflops", "peak_rss_mb"] {
            let x = num(&v, key)?;
            assert!(x.is_finite() && x > 0.0, "{key} = {x} in {v}");
        }
    }
    Ok(())
}

#[test]
fn each_implementation_reports_its_own_json() -> anyhow::Result<()> {
    for imp in ["ours", "naive", "candle-flash"] {
        let v = json_of(&[
            "--seq", "16", "--hidden", "32", "--heads", "2", "--iters", "2", "--impl", imp,
            "--json",
        ])?;
        let name = v["impl"].as_str().context("impl")?;
        assert!(name.contains(imp), "--impl {imp} reported {name}");
        assert!(num(&v, "median_ms")? > 0.0, "{v}");
    }
    Ok(())
}

#[test]
fn both_pool_setups_run_and_are_reported() -> anyhow::Result<()> {
    for (extra, pool) in [
        (&[][..], "caller"),
        (&["--pool", "detached"][..], "detached"),
    ] {
        let mut args = vec![
            "--seq", "16", "--hidden", "32", "--heads", "2", "--iters", "2", "--json",
        ];
        args.extend_from_slice(extra);
        let v = json_of(&args)?;
        assert_eq!(v["pool"].as_str(), Some(pool), "{v}");
        assert_eq!(num(&v, "threads")?, 2.0, "{v}");
        assert!(num(&v, "median_ms")? > 0.0, "{v}");
    }
    Ok(())
}

#[test]
fn table_shows_the_candle_baselines_with_ratios() -> anyhow::Result<()> {
    let out = bench(&[
        "--seq", "16", "--hidden", "32", "--heads", "2", "--iters", "2",
    ])?;
    let stdout = String::from_utf8(out.stdout)?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "candle-attention (ours)",
        "naive candle composition",
        "candle_nn flash_attn",
        "GFLOP/s",
        "matmul",
    ] {
        assert!(stdout.contains(needle), "table lacks `{needle}`:\n{stdout}");
    }
    Ok(())
}

#[test]
fn bad_shapes_are_clear_errors() -> anyhow::Result<()> {
    for (args, needle) in [
        (
            &["--hidden", "32", "--heads", "5", "--json"][..],
            "--heads 5",
        ),
        (
            &[
                "--hidden",
                "32",
                "--heads",
                "4",
                "--kv-heads",
                "3",
                "--json",
            ][..],
            "--kv-heads 3",
        ),
        (&["--dtype", "f8", "--json"][..], "f8"),
        (&["--iters", "0", "--json"][..], "--iters"),
    ] {
        let out = bench(args)?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?} wrote to stdout");
    }
    Ok(())
}

/// `--fma-peak` and `--bandwidth` measure the machine's limits (one JSON object each).
#[test]
fn machine_limits_are_reported() -> anyhow::Result<()> {
    let peak = json_of(&["--fma-peak", "--json"])?;
    assert!(num(&peak, "fma_peak_gflops")? > 0.0);
    let bw = json_of(&["--bandwidth", "--json"])?;
    assert!(num(&bw, "read_bandwidth_gb_s")? > 0.0);
    assert!(num(&bw, "threads")? >= 1.0);
    // The loads it read with: the widest this CPU has.
    let isa = bw["isa"].as_str().unwrap_or_default();
    assert!(
        ["avx512f", "avx2", "portable"].contains(&isa),
        "isa {isa:?}"
    );
    Ok(())
}

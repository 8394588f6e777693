//! With the `cuda` feature: compiles the exact K-quant matrix-vector kernels
//! (`src/weights/exact_gemv_k.cu`) to PTX with nvcc (`NVCC`, else `nvcc` on the path), for
//! `compute_<CUDA_COMPUTE_CAP>` (candle-kernels' variable, e.g. `90`), else the first GPU's
//! capability as `nvidia-smi` reports it, else 75 (the lowest CUDA 13's nvcc takes); the
//! driver compiles the PTX for that GPU or any newer one. Without the feature it does
//! nothing.

use std::env;
use std::path::PathBuf;
use std::process::Command;

const SOURCE: &str = "src/weights/exact_gemv_k.cu";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={SOURCE}");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    // Another nvcc or nvidia-smi on the path: compile again (only with the feature).
    println!("cargo:rerun-if-env-changed=PATH");
    let out =
        PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("exact_gemv_k.ptx");
    let nvcc = env::var("NVCC").unwrap_or_else(|_| "nvcc".to_string());
    let cap = env::var("CUDA_COMPUTE_CAP")
        .ok()
        .and_then(|c| leading_number(&c))
        .or_else(smi_capability)
        .unwrap_or(75);
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "--fmad=false"])
        .arg(format!("--gpu-architecture=compute_{cap}"))
        .arg(SOURCE)
        .arg("-o")
        .arg(&out)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("`{nvcc}` failed on {SOURCE} ({s}) for compute_{cap}"),
        Err(e) => panic!(
            "the `cuda` feature compiles {SOURCE} with nvcc, and `{nvcc}` did not run ({e}); \
             put CUDA's nvcc on the path or name it in NVCC"
        ),
    }
}

/// The number at the start of `s` (`90` of `90a`), if any.
fn leading_number(s: &str) -> Option<u32> {
    let digits: String = s.trim().chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The first GPU's compute capability from `nvidia-smi` (`9.0` -> 90), where it runs.
fn smi_capability() -> Option<u32> {
    let out = Command::new("nvidia-smi")
        .args(["--query-gpu=compute_cap", "--format=csv,noheader"])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let text = String::from_utf8(out.stdout).ok()?;
    leading_number(&text.lines().next()?.replace('.', ""))
}

//! With the `cuda` feature: compiles the exact K-quant matrix-vector kernels
//! (`src/weights/exact_gemv_k.cu`) to PTX with nvcc (`NVCC`, else `nvcc` on the path), for
//! `compute_<CUDA_COMPUTE_CAP>` (candle-kernels' variable; default 75, which the driver
//! compiles for any newer GPU). Without the feature it does nothing.

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
    let out =
        PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("exact_gemv_k.ptx");
    let nvcc = env::var("NVCC").unwrap_or_else(|_| "nvcc".to_string());
    let cap: u32 = env::var("CUDA_COMPUTE_CAP")
        .ok()
        .and_then(|c| c.trim().parse().ok())
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

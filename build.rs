//! Sets `isa_*` / `cpu_*` cfgs for the unit tests of the CPU kernels ([`test_isa_cfgs`]).
//!
//! With the `cuda` feature: compiles the exact K-quant matrix-vector kernels
//! (`src/weights/exact_gemv_k.cu`) to PTX with nvcc (`NVCC`, else `nvcc` on the path), for
//! `compute_<CUDA_COMPUTE_CAP>` (candle-kernels' variable, e.g. `90`), else the first GPU's
//! capability as `nvidia-smi` reports it, else 75 (the lowest CUDA 13's nvcc takes); the
//! driver compiles the PTX for that GPU or any newer one.

use std::env;
use std::path::PathBuf;
use std::process::Command;

const SOURCE: &str = "src/weights/exact_gemv_k.cu";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    test_isa_cfgs();
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

/// The instruction sets of the machine that builds the crate, for its unit tests of kernels:
/// a test of a kernel this machine does not run is `#[ignore]`d with the reason (so a run
/// counts it as ignored, not passed). `isa_*`: as `CANDLE_ATTENTION_ISA` caps the kernels
/// (`kernels::simd::isa`); `cpu_*`: the hardware's. Nothing is set when cross-compiling.
fn test_isa_cfgs() {
    println!("cargo:rerun-if-env-changed=CANDLE_ATTENTION_ISA");
    println!("cargo::rustc-check-cfg=cfg(isa_avx2, isa_avx512, isa_vnni, cpu_avx2, cpu_avx512)");
    let native = env::var("HOST").ok() == env::var("TARGET").ok()
        && env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64");
    if !native {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let cap = env::var("CANDLE_ATTENTION_ISA")
            .unwrap_or_default()
            .to_ascii_lowercase();
        let has = |f: &str| -> bool {
            match f {
                "avx2" => is_x86_feature_detected!("avx2"),
                "fma" => is_x86_feature_detected!("fma"),
                "f16c" => is_x86_feature_detected!("f16c"),
                "avx512f" => is_x86_feature_detected!("avx512f"),
                "avx512bw" => is_x86_feature_detected!("avx512bw"),
                "avx512vl" => is_x86_feature_detected!("avx512vl"),
                "avx512vnni" => is_x86_feature_detected!("avx512vnni"),
                _ => false,
            }
        };
        let all = |fs: &[&str]| fs.iter().all(|f| has(f));
        let cpu_avx2 = all(&["avx2", "fma", "f16c"]);
        let cpu_avx512 = has("avx512f");
        let vnni = cpu_avx512 && cpu_avx2 && all(&["avx512bw", "avx512vl", "avx512vnni"]);
        let (scalar, at_most_avx2) = (cap == "scalar", cap == "scalar" || cap == "avx2");
        for (name, on) in [
            ("cpu_avx2", cpu_avx2),
            ("cpu_avx512", cpu_avx512),
            ("isa_avx2", cpu_avx2 && !scalar),
            ("isa_avx512", cpu_avx512 && !at_most_avx2),
            ("isa_vnni", vnni && !at_most_avx2),
        ] {
            if on {
                println!("cargo:rustc-cfg={name}");
            }
        }
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

//! Choosing the compute device and dtype from command-line style strings.

use candle_core::{DType, Device};

use crate::error::{Error, Result};

/// Parses `cpu`, `cuda`, `cuda:N`, `metal`, `metal:N` or `auto` and opens the device.
///
/// `auto` tries CUDA, then Metal, then the CPU. A backend this build lacks is an
/// [`Error::Device`] that names the cargo feature to enable. Returns the device and a
/// short description of what was picked.
pub fn select_device(spec: &str) -> Result<(Device, String)> {
    let spec = spec.trim().to_ascii_lowercase();
    let (kind, ordinal) = match spec.split_once(':') {
        Some((k, n)) => {
            let n: usize = n.parse().map_err(|_| Error::Device {
                requested: spec.clone(),
                reason: format!("`{n}` is not a device number"),
            })?;
            (k.to_string(), n)
        }
        None => (spec.clone(), 0),
    };
    match kind.as_str() {
        "cpu" => Ok((Device::Cpu, "cpu".to_string())),
        "cuda" => cuda(ordinal, &spec),
        "metal" => metal(ordinal, &spec),
        "auto" => {
            if candle_core::utils::cuda_is_available() {
                if let Ok(d) = cuda(ordinal, &spec) {
                    return Ok(d);
                }
            }
            if candle_core::utils::metal_is_available() {
                if let Ok(d) = metal(ordinal, &spec) {
                    return Ok(d);
                }
            }
            Ok((
                Device::Cpu,
                "cpu (auto: no CUDA or Metal device in this build/machine)".to_string(),
            ))
        }
        other => Err(Error::Device {
            requested: other.to_string(),
            reason: "expected cpu, cuda[:N], metal[:N] or auto".to_string(),
        }),
    }
}

fn cuda(ordinal: usize, spec: &str) -> Result<(Device, String)> {
    if !cfg!(feature = "cuda") {
        return Err(Error::Device {
            requested: spec.to_string(),
            reason: "this build has no CUDA support; rebuild with `--features cuda`".to_string(),
        });
    }
    let device = Device::new_cuda(ordinal).map_err(|e| Error::Device {
        requested: spec.to_string(),
        reason: e.to_string(),
    })?;
    Ok((device, format!("cuda:{ordinal}")))
}

fn metal(ordinal: usize, spec: &str) -> Result<(Device, String)> {
    if !cfg!(feature = "metal") {
        return Err(Error::Device {
            requested: spec.to_string(),
            reason: "this build has no Metal support; rebuild with `--features metal`".to_string(),
        });
    }
    let device = Device::new_metal(ordinal).map_err(|e| Error::Device {
        requested: spec.to_string(),
        reason: e.to_string(),
    })?;
    Ok((device, format!("metal:{ordinal}")))
}

/// Parses `f32`, `f16` or `bf16`.
pub fn parse_dtype(s: &str) -> Result<DType> {
    match s.trim().to_ascii_lowercase().as_str() {
        "f32" | "float32" => Ok(DType::F32),
        "f16" | "float16" | "half" => Ok(DType::F16),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        other => Err(Error::config(format!(
            "unknown dtype `{other}`; expected f32, f16 or bf16"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_and_errors() {
        assert!(matches!(select_device("cpu"), Ok((Device::Cpu, _))));
        assert!(select_device("auto").is_ok());
        let err = select_device("tpu").unwrap_err();
        assert!(err.to_string().contains("expected cpu"));
        if !cfg!(feature = "cuda") {
            let err = select_device("cuda").unwrap_err();
            assert!(err.to_string().contains("--features cuda"), "{err}");
        }
        if !cfg!(feature = "metal") {
            let err = select_device("metal:1").unwrap_err();
            assert!(err.to_string().contains("--features metal"), "{err}");
        }
        assert_eq!(parse_dtype("BF16").ok(), Some(DType::BF16));
        assert!(parse_dtype("f8").is_err());
    }
}

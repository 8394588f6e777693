//! GGUF files against gguf-py (the reader transformers loads them with): every tensor type
//! this crate reads dequantizes to gguf-py's values bit for bit, and the metadata reads back
//! as gguf-py reads it. Fixtures from `scripts/gen_gguf_fixtures.py`.

mod common;

use candle_attention::{Checkpoint, GgufFile, GgufValue, QuantType};
use candle_core::Device;
use common::repo_path;

fn fixture() -> anyhow::Result<GgufFile> {
    Ok(GgufFile::open(repo_path("tests/fixtures/gguf/types.gguf"))?)
}

#[test]
fn every_type_dequantizes_as_gguf_py_does() -> anyhow::Result<()> {
    let file = fixture()?;
    let want = Checkpoint::open(repo_path("tests/fixtures/gguf/types.safetensors"))?;
    let mut seen = Vec::new();
    for info in file.tensors() {
        let got = file.dequantize(&info.name, &Device::Cpu)?;
        let expected = want.tensor(&info.name, &Device::Cpu)?;
        assert_eq!(got.dims(), expected.dims(), "{}", info.name);
        let (g, w): (Vec<f32>, Vec<f32>) = (
            got.flatten_all()?.to_vec1()?,
            expected.flatten_all()?.to_vec1()?,
        );
        for (i, (a, b)) in g.iter().zip(&w).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{}[{i}]: {a} vs gguf-py's {b}",
                info.name
            );
        }
        if let Ok(ty) = info.dtype {
            seen.push(ty);
        }
    }
    for ty in QuantType::ALL {
        assert!(seen.contains(&ty), "no {ty} tensor in the fixture");
    }
    let cube = file.tensor_info("cube")?;
    assert_eq!(cube.ggml_dims, vec![32, 3, 2]);
    assert_eq!(cube.shape(), vec![2, 3, 32]);
    Ok(())
}

#[test]
fn metadata_reads_back_as_gguf_py_reads_it() -> anyhow::Result<()> {
    let file = fixture()?;
    let text = std::fs::read_to_string(repo_path("tests/fixtures/gguf/metadata.json"))?;
    let want: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&text)?;
    fn json(v: &GgufValue) -> serde_json::Value {
        match v {
            GgufValue::String(s) => s.clone().into(),
            GgufValue::Bool(b) => (*b).into(),
            GgufValue::F32(f) => (*f as f64).into(),
            GgufValue::F64(f) => (*f).into(),
            GgufValue::Array(a) => a.iter().map(json).collect::<Vec<_>>().into(),
            other => match other.as_i64() {
                Some(i) => i.into(),
                None => other.as_u64().map(Into::into).unwrap_or_default(),
            },
        }
    }
    for (key, value) in &want {
        let got = json(file.require(key)?);
        match (got.as_f64(), value.as_f64()) {
            // serde_json's default float parsing may be off by an ulp.
            (Some(g), Some(w)) if value.is_f64() => {
                assert!((g - w).abs() <= w.abs() * 1e-15, "{key}: {g} vs {w}")
            }
            _ => assert_eq!(&got, value, "{key}"),
        }
    }
    assert_eq!(file.require_str("general.architecture")?, "llama");
    assert!(matches!(file.require("test.u8")?, GgufValue::U8(200)));
    assert!(matches!(file.require("test.i16")?, GgufValue::I16(-30000)));
    let e = file.require_u64("test.string").err().map(|e| e.to_string());
    assert!(e.is_some_and(|e| e.contains("test.string") && e.contains("string")));
    let e = file.require("no.such.key").err().map(|e| e.to_string());
    assert!(e.is_some_and(|e| e.contains("no.such.key") && e.contains("types.gguf")));
    Ok(())
}

#[test]
fn a_truncated_file_is_an_error_that_names_the_tensor() -> anyhow::Result<()> {
    let bytes = std::fs::read(repo_path("tests/fixtures/gguf/types.gguf"))?;
    let last = fixture()?
        .tensors()
        .last()
        .map(|t| t.name.clone())
        .unwrap_or_default();
    let e = GgufFile::from_bytes(bytes[..bytes.len() - 64].to_vec(), "cut.gguf")
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        e.contains("cut.gguf") && e.contains(&last) && e.contains("truncated"),
        "{e}"
    );
    let dir = GgufFile::open(repo_path("tests/fixtures/gguf"))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(dir.contains("directory"), "{dir}");
    Ok(())
}

/// Read onto huge pages (where Linux has them), mapped, or from bytes in memory: the same
/// file, tensor for tensor.
#[test]
fn every_way_of_opening_gives_the_same_bytes() -> anyhow::Result<()> {
    let path = repo_path("tests/fixtures/gguf/types.gguf");
    let opened = GgufFile::open(&path)?;
    let mapped = GgufFile::open_mapped(&path)?;
    let for_cpu = GgufFile::open_for(&path, &Device::Cpu)?;
    let owned = GgufFile::from_bytes(std::fs::read(&path)?, &path)?;
    assert!(!opened.tensors().is_empty());
    for info in opened.tensors() {
        let want = owned.tensor_data(&info.name)?;
        for file in [&opened, &mapped, &for_cpu] {
            assert_eq!(file.tensor_data(&info.name)?, want, "{}", info.name);
        }
    }
    Ok(())
}

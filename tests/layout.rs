//! The source tree's architecture, checked: `src/` is grouped by purpose and dependencies run
//! one way (models -> attention -> weights -> kernels; `viz` above models; `error`, `memory`,
//! `device`, `text` below everything), and no two source files share a name.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

mod common;

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            rust_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// The top-level group of a file under `src/` (`attention` for `src/attention/sdpa.rs` and
/// `src/attention.rs`; the file stem for the others).
fn group(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap_or(file);
    let first = rel
        .components()
        .next()
        .map(|c| c.as_os_str().to_string_lossy().into_owned());
    first
        .unwrap_or_default()
        .trim_end_matches(".rs")
        .to_string()
}

/// The groups from the bottom up; each may import only those before it (the four at the
/// bottom from each other).
const ORDER: [&str; 9] = [
    "error",
    "memory",
    "device",
    "text",
    "kernels",
    "weights",
    "attention",
    "models",
    "viz",
];

/// Whether `group` may import `other`.
fn allowed(group: &str, other: &str) -> bool {
    let rank = |g: &str| ORDER.iter().position(|o| *o == g);
    match (rank(group), rank(other)) {
        // The four at the bottom may use each other (`text` only `error`).
        (Some(g), Some(o)) if g < 4 && o < 4 => group != "text" || other == "error",
        (Some(g), Some(o)) => o < g,
        _ => false,
    }
}

#[test]
fn dependencies_run_one_way() -> anyhow::Result<()> {
    let src = common::repo_path("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files)?;
    let mut bad = Vec::new();
    for file in &files {
        let g = group(&src, file);
        if g == "lib" {
            continue; // re-exports every group
        }
        let text = std::fs::read_to_string(file)?;
        // Test modules may reach anywhere (reference values); the library code may not.
        let code = text.split("#[cfg(test)]").next().unwrap_or(&text);
        for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
            for other in ORDER {
                if other == g {
                    continue;
                }
                let uses = line.contains(&format!("crate::{other}::"))
                    || line.contains(&format!("crate::{other};"));
                if uses && !allowed(&g, other) {
                    bad.push(format!(
                        "{}: {g} imports {other}: {}",
                        file.display(),
                        line.trim()
                    ));
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "imports against the layering:\n{}",
        bad.join("\n")
    );
    Ok(())
}

#[test]
fn no_two_source_files_share_a_name() -> anyhow::Result<()> {
    let src = common::repo_path("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files)?;
    let mut seen: HashMap<String, PathBuf> = HashMap::new();
    for file in files {
        let name = file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if let Some(first) = seen.insert(name.clone(), file.clone()) {
            panic!("{name}: {} and {}", first.display(), file.display());
        }
    }
    assert!(seen.len() > 60, "only {} files found", seen.len());
    Ok(())
}

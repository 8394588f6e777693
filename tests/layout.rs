//! The source tree's architecture, checked: `src/` is grouped by purpose and dependencies run
//! one way (models -> attention -> weights -> kernels; `viz` above models; `error`, `memory`,
//! `device`, `text` below everything), no two source files share a name, no file imports in
//! a circle, and the kernels' groups import in the order `kernels.rs` states.
//!
//! The import graph (the last two checks, as `cargo-modules` or `import-linter` check other
//! codebases): nodes are files (`src/a/b.rs` is `crate::a::b`); edges are the paths a file
//! names outside its `#[cfg(test)]` modules (`use crate::..`, `super::..`, inline
//! `crate::x::y`), each to the longest file module the path starts with. Importing from an
//! ancestor module (a folder's `a.rs` holding shared helpers) is not an edge: the ancestor
//! declares the child.

use std::collections::{BTreeMap, BTreeSet, HashMap};
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
fn dependencies_run_one_way() {
    // The import graph below (test modules left out: they may reach anywhere for reference
    // values), each file by its top-level group.
    let top = |m: &str| m.split("::").nth(1).unwrap_or_default().to_string();
    let mut bad = Vec::new();
    for (from, targets) in graph() {
        let g = top(&from);
        if g.is_empty() {
            continue; // the crate root re-exports every group
        }
        for to in targets {
            let o = top(&to);
            if o != g && !allowed(&g, &o) {
                bad.push(format!("{from} ({g}) imports {to} ({o})"));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "imports against the layering:\n{}",
        bad.join("\n")
    );
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

/// `src/a/b.rs` -> `["a", "b"]`; `src/lib.rs` -> `[]`; `src/a/mod.rs` -> `["a"]`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap_or(file).with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("lib" | "mod")) {
        parts.pop();
    }
    parts
}

/// The text without comments, string literals and `#[cfg(test)]` modules.
fn code_of(text: &str) -> String {
    // Comments and strings, character by character.
    let mut out = String::with_capacity(text.len());
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                i += 1;
            }
            i += 2;
        } else if b[i] == b'"' && !(i > 0 && b[i - 1] == b'\'') {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    // `#[cfg(test)]` (or `#[cfg(all(test, ..))]`) followed by `mod name {`: skipped to the
    // matching brace.
    let mut code = String::with_capacity(out.len());
    let mut rest = out.as_str();
    while let Some(at) = rest.find("#[cfg(") {
        let attr_end = rest[at..].find(']').map_or(rest.len(), |e| at + e + 1);
        let attr = &rest[at..attr_end];
        let after = rest[attr_end..].trim_start();
        let is_test_mod = (attr == "#[cfg(test)]" || attr.starts_with("#[cfg(all(test"))
            && (after.starts_with("mod ") || after.starts_with("pub(crate) mod "));
        if !is_test_mod {
            code.push_str(&rest[..attr_end]);
            rest = &rest[attr_end..];
            continue;
        }
        code.push_str(&rest[..at]);
        let Some(open) = rest[attr_end..].find('{').map(|o| attr_end + o) else {
            break;
        };
        let mut depth = 0;
        let mut end = rest.len();
        for (k, c) in rest[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + k + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &rest[end..];
    }
    code.push_str(rest);
    code
}

/// The paths a file names: `use` trees expanded (`a::{b, c::d}`), inline `crate::..` and
/// `super::..` paths; each as segments, `crate` and `super` resolved against `module`.
fn paths_of(code: &str, module: &[String]) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    // `use` trees: `use X;` up to its semicolon, braces expanded.
    fn expand(tree: &str, out: &mut Vec<String>) {
        let tree = tree.trim();
        let Some(open) = tree.find('{') else {
            if !tree.is_empty() {
                out.push(tree.split(" as ").next().unwrap_or(tree).trim().to_string());
            }
            return;
        };
        let head = tree[..open].trim().trim_end_matches("::").trim();
        let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
        let (mut depth, mut start, mut parts) = (0, 0, Vec::new());
        for (k, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&inner[start..k]);
                    start = k + 1;
                }
                _ => {}
            }
        }
        parts.push(&inner[start..]);
        for part in parts.into_iter().map(str::trim).filter(|p| !p.is_empty()) {
            let full = match (head.is_empty(), part) {
                (true, _) => part.to_string(),
                (false, "self") => head.to_string(),
                (false, _) => format!("{head}::{part}"),
            };
            expand(&full, out);
        }
    }
    let mut raw = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("use ") {
        let boundary = at == 0 || !is_ident(rest[..at].chars().last().unwrap_or(' '));
        let Some(end) = rest[at..].find(';').map(|e| at + e) else {
            break;
        };
        if boundary {
            expand(&rest[at + 4..end], &mut raw);
        }
        rest = &rest[end + 1..];
    }
    // Inline paths.
    for start in ["crate::", "super::"] {
        let mut from = 0;
        while let Some(k) = code[from..].find(start).map(|k| from + k) {
            let before = code[..k].chars().last().unwrap_or(' ');
            let path: String = code[k..]
                .chars()
                .take_while(|&c| is_ident(c) || c == ':')
                .collect();
            if !is_ident(before) && before != ':' {
                raw.push(path.trim_end_matches(':').to_string());
            }
            from = k + start.len();
        }
    }
    for p in raw {
        let segs: Vec<&str> = p.split("::").map(str::trim).collect();
        let resolved: Option<Vec<String>> = match segs.first() {
            Some(&"crate") => Some(segs[1..].iter().map(|s| s.to_string()).collect()),
            Some(&"super") => {
                let mut base = module.to_vec();
                let mut k = 0;
                while segs.get(k) == Some(&"super") {
                    base.pop();
                    k += 1;
                }
                base.extend(segs[k..].iter().map(|s| s.to_string()));
                Some(base)
            }
            Some(&"self") => {
                let mut base = module.to_vec();
                base.extend(segs[1..].iter().map(|s| s.to_string()));
                Some(base)
            }
            _ => None,
        };
        if let Some(r) = resolved {
            paths.push(r);
        }
    }
    paths
}

/// The import graph: file module -> the file modules it imports from.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = common::repo_path("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files).expect("src/ is readable");
    let modules: BTreeMap<Vec<String>, PathBuf> = files
        .iter()
        .map(|f| (module_of(&src, f), f.clone()))
        .collect();
    let name = |m: &[String]| format!("crate::{}", m.join("::"));
    let mut graph = BTreeMap::new();
    for (module, file) in &modules {
        let text = std::fs::read_to_string(file).expect("a source file");
        let mut edges = BTreeSet::new();
        for path in paths_of(&code_of(&text), module) {
            // The longest file module the path starts with.
            let target = (1..=path.len())
                .rev()
                .map(|n| &path[..n])
                .find(|p| modules.contains_key(*p));
            let Some(target) = target else { continue };
            let ancestor = target.len() <= module.len() && module[..target.len()] == *target;
            if !ancestor {
                edges.insert(name(target));
            }
        }
        graph.insert(name(module), edges);
    }
    graph
}

/// The strongly connected components of more than one node (Tarjan's algorithm).
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.graph.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !s.graph.contains_key(w) {
                continue;
            }
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.out.push(component);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out.sort();
    s.out
}

/// The group `kernels.rs` states for a kernels module (its first segment below `kernels`):
/// each group reads only those before it.
fn kernel_group(module: &str) -> Option<usize> {
    let first = module
        .strip_prefix("crate::kernels::")?
        .split("::")
        .next()?;
    let groups: [&[&str]; 7] = [
        &[
            "simd",
            "activation",
            "scratch",
            "pool",
            "aligned",
            "widen",
            "quant",
        ],
        &["gemm"],
        &["cpu_tensor"],
        &["decode", "encoder", "rms_norm", "residual"],
        &["attend"],
        &["train"],
        &[],
    ];
    groups.iter().position(|g| g.contains(&first))
}

#[test]
fn no_module_imports_in_a_circle() {
    let graph = graph();
    assert!(graph.len() > 50, "src/ read: {} files", graph.len());
    // The check sees edges: the crate's entry imports its modules' items.
    assert!(graph["crate::models::llama"].contains("crate::models::decode_step"));
    let found = circles(&graph);
    assert!(found.is_empty(), "import circles: {found:#?}");
}

#[test]
fn kernels_import_only_groups_before_their_own() {
    let graph = graph();
    let mut sideways = Vec::new();
    for from in graph.keys().filter(|m| m.starts_with("crate::kernels::")) {
        assert!(
            kernel_group(from).is_some(),
            "{from}: in no group of kernels.rs's order (add it there and here)"
        );
    }
    for (from, targets) in &graph {
        let Some(gf) = kernel_group(from) else {
            continue;
        };
        let own = from.split("::").nth(2).unwrap_or_default();
        for to in targets {
            let Some(gt) = kernel_group(to) else { continue };
            let other = to.split("::").nth(2).unwrap_or_default();
            if gt > gf && own != other {
                sideways.push(format!("{from} -> {to}"));
            }
        }
    }
    assert!(
        sideways.is_empty(),
        "kernels importing against kernels.rs's order: {sideways:#?}"
    );
}

//! The layers import only the ones below them (README "Layout", docs/design.md):
//! sys ← ucp ← engine ← fake_verbs ← cm ← rsocket ← capi. This test reads the sources and fails when a
//! lower layer names a higher one, so the engine never again reaches up into verbs semantics.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("source folder") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Lines of the layer's code (comments left out) that name any of `higher`.
fn upward_references(layer: &str, higher: &[&str]) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src")
        .join(layer);
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    assert!(!files.is_empty(), "no sources under {}", root.display());
    let mut found = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("readable source");
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for h in higher {
                if code.contains(&format!("crate::{h}"))
                    || code.contains(&format!("super::super::{h}"))
                {
                    found.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
                }
            }
        }
    }
    found
}

#[test]
fn the_ucx_wrappers_name_no_layer_above_them() {
    let found = upward_references(
        "ucp",
        &["engine", "fake_verbs", "cm", "rsocket", "capi", "ugdr"],
    );
    assert!(
        found.is_empty(),
        "src/ucp reaches up:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_engine_names_nothing_of_the_verbs_layer_or_above() {
    let found = upward_references("engine", &["fake_verbs", "cm", "rsocket", "capi", "ugdr"]);
    assert!(
        found.is_empty(),
        "src/engine reaches up:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_verbs_semantics_name_neither_the_connection_manager_nor_the_c_abi() {
    let found = upward_references("fake_verbs", &["cm", "rsocket", "capi"]);
    assert!(
        found.is_empty(),
        "src/fake_verbs reaches up:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_connection_manager_does_not_reach_into_the_c_abi() {
    let found = upward_references("cm", &["rsocket", "capi"]);
    assert!(found.is_empty(), "src/cm reaches up:\n{}", found.join("\n"));
}

#[test]
fn rsockets_sit_on_the_connection_manager_below_the_c_abi() {
    let found = upward_references("rsocket", &["capi"]);
    assert!(
        found.is_empty(),
        "src/rsocket reaches up:\n{}",
        found.join("\n")
    );
}

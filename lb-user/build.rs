use anyhow::{Context as _, anyhow};

/// Builds lb-ebpf for bpfel-unknown-none with the nightly toolchain; the object lands in OUT_DIR
/// and src/datapath/mod.rs embeds it.
fn main() -> anyhow::Result<()> {
    // aya-build forwards every line of the inner cargo's stderr as a cargo warning: quiet, that
    // cargo prints no progress ("Compiling ..."), only what rustc says (real warnings and errors,
    // which aya-build forwards from the JSON messages).
    // SAFETY: nothing else runs yet in this build script: no thread reads the environment.
    unsafe { std::env::set_var("CARGO_TERM_QUIET", "true") };
    let metadata = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("cargo metadata")?;
    let ebpf = metadata
        .packages
        .iter()
        .find(|p| p.name.as_str() == "lb-ebpf")
        .ok_or_else(|| anyhow!("lb-ebpf package not found"))?;
    let root_dir = ebpf
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("no parent for {}", ebpf.manifest_path))?;
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "lb-ebpf",
            root_dir: root_dir.as_str(),
            ..Default::default()
        }],
        aya_build::Toolchain::Nightly,
    )
}

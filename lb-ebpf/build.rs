/// Building this crate depends on the `bpf-linker` binary, which cargo does not know about:
/// rebuild when it changes.
fn main() {
    if let Ok(linker) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}

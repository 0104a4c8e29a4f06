//! Loading the embedded eBPF object.
use aya::{Ebpf, EbpfLoader};

/// The compiled lb-ebpf object, built by build.rs.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb"));

pub fn load() -> anyhow::Result<Ebpf> {
    Ok(EbpfLoader::new().load(EBPF_OBJECT)?)
}

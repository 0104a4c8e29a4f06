//! The IPv6 twins of the tc programs, `lb_ingress6` and `lb_egress6`, which `lb_ingress` and
//! `lb_egress` tail-call through the program array `TC_IPV6_PROGRAMS`, and of the XDP program,
//! `lb_xdp6` in `XDP_IPV6_PROGRAMS` (docs/ipv6.md). The arrays are pinned with the other maps: a
//! program array loses its entries when its last user reference goes, and the attached programs
//! outlive the agent. An agent starting on a running datapath puts its own programs in the slots
//! before it attaches anything, as it replaces the programs attached to the interfaces.
use aya::Ebpf;
use aya::maps::ProgramArray;
use lb_common::{map_name, program_name, tc_ipv6_slot, xdp_ipv6_slot};

use super::DatapathError;

/// Each IPv6 tc program and its slot in `TC_IPV6_PROGRAMS`.
pub const PROGRAMS: [(&str, u32); 2] = [
    (program_name::INGRESS6, tc_ipv6_slot::INGRESS),
    (program_name::EGRESS6, tc_ipv6_slot::EGRESS),
];

/// The IPv6 XDP program and its slot in `XDP_IPV6_PROGRAMS`.
pub const XDP_PROGRAMS: [(&str, u32); 1] = [(program_name::XDP6, xdp_ipv6_slot::XDP)];

/// Puts the loaded IPv6 tc programs of `ebpf` in their slots of its `TC_IPV6_PROGRAMS`.
pub fn fill_program_array(ebpf: &mut Ebpf) -> Result<(), DatapathError> {
    fill(ebpf, map_name::TC_IPV6_PROGRAMS, &PROGRAMS)
}

/// Puts the loaded `lb_xdp6` of `ebpf` in its slot of its `XDP_IPV6_PROGRAMS`.
pub fn fill_xdp_program_array(ebpf: &mut Ebpf) -> Result<(), DatapathError> {
    fill(ebpf, map_name::XDP_IPV6_PROGRAMS, &XDP_PROGRAMS)
}

/// Puts each loaded program of `programs` in its slot of the program array `array_name`.
fn fill(
    ebpf: &mut Ebpf,
    array_name: &'static str,
    programs: &[(&'static str, u32)],
) -> Result<(), DatapathError> {
    for &(name, slot) in programs {
        let fd = ebpf
            .program(name)
            .ok_or(DatapathError::MissingProgram(name))?
            .fd()
            .map_err(|source| DatapathError::Program { name, source })?
            .try_clone()
            .map_err(|source| DatapathError::ProgramFd { name, source })?;
        let err = |source| DatapathError::Map {
            name: array_name,
            source,
        };
        let map = ebpf
            .map_mut(array_name)
            .ok_or(DatapathError::MissingMap(array_name))?;
        ProgramArray::try_from(map)
            .and_then(|mut array| array.set(slot, &fd, 0))
            .map_err(err)?;
    }
    Ok(())
}

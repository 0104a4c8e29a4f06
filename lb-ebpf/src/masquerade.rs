//! When a connection is masqueraded (SNAT to the node address), and which source port it gets.
use lb_common::{
    Backend, CONFIG_F_MASQUERADE_ALL, Config, ConntrackKey, Counter, FRONTEND_F_MASQUERADE,
    FRONTEND_F_PRESERVE_SOURCE, Frontend,
};

use crate::{conntrack::Connection, maps};

/// Candidate ports tried per new connection: bounded for the verifier, and enough that a failure
/// means the range is nearly full for this backend.
const PORT_TRIES: u32 = 16;

/// kube-proxy's KUBE-MARK-MASQ cases: --masquerade-all, a NodePort, a client outside the cluster
/// CIDR (whose replies would not come back through this node), and hairpin (a backend talking to
/// itself would answer its own address directly, bypassing the reverse translation). An
/// externalTrafficPolicy Local NodePort keeps the client's address (its endpoints are on this
/// node, so replies come back through it): only hairpin is masqueraded.
pub fn needed(config: &Config, frontend: &Frontend, client: u32, backend: &Backend) -> bool {
    let preserve = frontend.flags & FRONTEND_F_PRESERVE_SOURCE != 0;
    client == backend.addr
        || !preserve
            && (config.flags & CONFIG_F_MASQUERADE_ALL != 0
                || frontend.flags & FRONTEND_F_MASQUERADE != 0
                || client & config.cluster_cidr_mask != config.cluster_cidr_addr)
}

/// Tracks the reply direction of `connection` from `node_addr` and a free source port of the
/// configured range, which makes the translated tuple unique. Starts at a random point of the
/// range so that concurrent connections rarely contend for the same port.
pub fn claim_source(config: &Config, connection: &Connection) -> Result<ConntrackKey, Counter> {
    let min = u32::from(config.snat_port_min);
    let span = (u32::from(config.snat_port_max) + 1)
        .checked_sub(min)
        .filter(|&span| span > 0)
        .ok_or(Counter::DropSnatPortsExhausted)?;
    let start = maps::random()
        .checked_rem(span)
        .ok_or(Counter::DropSnatPortsExhausted)?;
    for i in 0..PORT_TRIES.min(span) {
        let mut offset = start + i;
        if offset >= span {
            offset -= span;
        }
        let port = ((min + offset) as u16).to_be();
        if let Some(to) = connection.claim_reply(config.node_addr, port)? {
            return Ok(to);
        }
    }
    Err(Counter::DropSnatPortsExhausted)
}

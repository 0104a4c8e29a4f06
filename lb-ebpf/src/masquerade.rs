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

/// Tracks the reply direction of `connection` from `src_addr` and a port of the configured range
/// no live connection uses with it, which makes the translated tuple unique: the node address
/// for a masqueraded connection, the client's own for one whose translated tuple is another
/// connection's (as Linux's NAT remaps a clashing source port). Starts at a random point of the
/// range so that concurrent connections rarely contend for the same port. `Ok(None)`: no free
/// port found.
pub fn claim_source(
    config: &Config,
    connection: &Connection,
    src_addr: u32,
) -> Result<Option<ConntrackKey>, Counter> {
    let min = u32::from(config.snat_port_min);
    let Some(span) = (u32::from(config.snat_port_max) + 1)
        .checked_sub(min)
        .filter(|&span| span > 0)
    else {
        return Ok(None);
    };
    let Some(start) = maps::random().checked_rem(span) else {
        return Ok(None);
    };
    for i in 0..PORT_TRIES.min(span) {
        let mut offset = start + i;
        if offset >= span {
            offset -= span;
        }
        let port = ((min + offset) as u16).to_be();
        if let Some(to) = connection.claim_reply(src_addr, port)? {
            return Ok(Some(to));
        }
    }
    Ok(None)
}

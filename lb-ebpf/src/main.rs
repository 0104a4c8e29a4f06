//! The tc datapath: one classifier at the ingress of every interface where traffic enters the
//! node. Service traffic is translated there in both directions and forwarded to its egress
//! interface; everything else passes untouched. The node's own sockets are translated at
//! connect and send time by the cgroup socket hooks (`sock`).
#![no_std]
#![no_main]

mod affinity;
mod conntrack;
mod forward;
mod maps;
mod masquerade;
mod nat;
mod parse;
mod reject;
mod service;
mod sock;

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    macros::{cgroup_sock_addr, classifier},
    programs::{SockAddrContext, TcContext},
};
use lb_common::{CONFIG_F_READY, Config, ConntrackKey, Counter, Frontend};

use crate::{conntrack::Connection, service::Backends};

#[classifier]
pub fn lb_ingress(ctx: TcContext) -> i32 {
    match try_ingress(&ctx) {
        Ok(action) => action,
        Err(reason) => {
            maps::count(reason);
            verdict(reason)
        }
    }
}

/// `Err` carries the counter of why the packet is not translated.
fn try_ingress(ctx: &TcContext) -> Result<i32, Counter> {
    let config = maps::config()
        .filter(|config| config.flags & CONFIG_F_READY != 0)
        .ok_or(Counter::Passed)?;
    let packet = parse::packet(ctx)?;
    // The stack answers an expiring packet (ICMP time exceeded) about the address the client
    // used, so it must see the packet untranslated.
    if packet.ttl <= 1 {
        return Err(Counter::Passed);
    }
    let now = maps::now_ns();
    let to = match conntrack::lookup(&packet, now) {
        Some(to) => {
            maps::count(Counter::Translated);
            to
        }
        None => {
            let frontend = service::frontend(&packet.tuple).ok_or(Counter::Passed)?;
            let backends = service::backends(&config, &frontend, packet.tuple.src_addr);
            if backends.count == 0 {
                // kube-proxy rejects when the service has no endpoints at all, and drops when
                // traffic policy Local finds none on this node.
                if frontend.backend_count != 0 {
                    return Err(Counter::DropNoLocalBackend);
                }
                maps::count(Counter::Rejected);
                return reject::port_unreachable(ctx, &packet);
            }
            connect(&config, &frontend, &backends, &packet.tuple, now)?
        }
    };
    nat::rewrite(ctx, &packet, &to)?;
    forward::forward(ctx, &packet, &to)
}

/// A packet without a live connection to `frontend`: pick a backend of `backends` (not empty)
/// and track the new connection. Returns the tuple to rewrite the packet to.
fn connect(
    config: &Config,
    frontend: &Frontend,
    backends: &Backends,
    tuple: &ConntrackKey,
    now: u64,
) -> Result<ConntrackKey, Counter> {
    let backend = service::select_backend(frontend, backends, tuple, now)?;
    let connection = Connection::new(tuple, frontend.service_id, &backend, now);
    let masquerade = masquerade::needed(config, frontend, tuple.src_addr, &backend);
    let to = if masquerade {
        masquerade::claim_source(config, &connection)?
    } else {
        connection.track_reply()?
    };
    connection.track_original(&to, masquerade)?;
    maps::count(Counter::NewConnection);
    if masquerade {
        maps::count(Counter::Masqueraded);
    }
    Ok(to)
}

#[cgroup_sock_addr(connect4)]
pub fn lb_connect4(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn lb_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn lb_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx)
}

#[cgroup_sock_addr(getpeername4)]
pub fn lb_getpeername4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx)
}

fn verdict(reason: Counter) -> i32 {
    match reason {
        Counter::Passed | Counter::PassedUnparsed => TC_ACT_OK,
        _ => TC_ACT_SHOT,
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

//! One request to a service, from wherever this process was started (the tests start it inside
//! a network namespace and a cgroup of their own): `lb-node-client tcp|udp IP:PORT`. Prints
//! `<server> <source it saw> <peer we saw>`, or `error <kind> <milliseconds>` when it failed.
//! `lb-node-client udp-flow IP:PORT COUNT` sends COUNT requests from one unconnected UDP socket
//! and prints one such line per answer.
use std::{net::SocketAddr, time::Instant};

use anyhow::{Context as _, Result, bail};
use lb_tests::echo::{Proto, error_kind, udp_requests};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flow, to, count] = args.as_slice()
        && flow == "udp-flow"
    {
        let to: SocketAddr = to.parse().with_context(|| format!("{to:?}"))?;
        for answer in udp_requests(to, count.parse().context("COUNT")?)? {
            println!("{} {} {}", answer.server, answer.seen_source, answer.peer);
        }
        return Ok(());
    }
    let [proto, to] = args.as_slice() else {
        bail!("usage: lb-node-client tcp|udp IP:PORT, or udp-flow IP:PORT COUNT");
    };
    let proto = match proto.as_str() {
        "tcp" => Proto::Tcp,
        "udp" => Proto::Udp,
        other => bail!("{other:?}: expected tcp or udp"),
    };
    let to: SocketAddr = to.parse().with_context(|| format!("{to:?}"))?;
    let start = Instant::now();
    match proto.request(to) {
        Ok(answer) => println!("{} {} {}", answer.server, answer.seen_source, answer.peer),
        Err(err) => println!(
            "error {:?} {}",
            error_kind(&err),
            start.elapsed().as_millis()
        ),
    }
    Ok(())
}

//! One request to a service, from wherever this process was started (the tests start it inside
//! a network namespace and a cgroup of their own): `lb-node-client tcp|udp IP:PORT`. Prints
//! `<server> <source it saw> <peer we saw>`, or `error <kind> <milliseconds>` when it failed.
use std::{net::SocketAddr, time::Instant};

use anyhow::{Context as _, Result, bail};
use lb_tests::echo::{Proto, error_kind};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [proto, to] = args.as_slice() else {
        bail!("usage: lb-node-client tcp|udp IP:PORT");
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

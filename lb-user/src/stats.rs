//! `lb stats`: the datapath's counters, one `name value` line each.
use anyhow::{Context as _, Result};
use lb_common::map_name;
use lb_user::{datapath, pins};

use crate::args::StatsArgs;

pub fn run(args: StatsArgs) -> Result<()> {
    let dir = pins::locate(&args.bpffs, map_name::COUNTERS).with_context(|| {
        format!(
            "no {} pinned in {} (nor seen by an agent in this network namespace)",
            map_name::COUNTERS,
            args.bpffs.display()
        )
    })?;
    for (counter, value) in datapath::read_counters(&dir)? {
        println!("{} {value}", counter.name());
    }
    Ok(())
}

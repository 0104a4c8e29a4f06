//! `lb stats`: the datapath's counters, each with its meaning, and the drops by reason.
use anyhow::Result;
use comfy_table::{Table, presets};
use lb_common::{Counter, map_name};
use lb_user::datapath;
use lb_user::maps::pins;
use serde::Serialize;

use crate::cli::{
    args::{Output, StatsArgs},
    services::{self, PortsExhausted},
};

pub fn run(args: StatsArgs) -> Result<()> {
    let dir = pins::find(&args.bpffs, map_name::COUNTERS)?;
    let mut stats = Stats::new(&datapath::read_counters(&dir)?);
    stats.ports_exhausted = services::ports_exhausted(&dir)?;
    match args.output {
        Output::Table => print!("{}", stats.table()),
        Output::Json => println!("{}", serde_json::to_string_pretty(&stats)?),
    }
    Ok(())
}

/// What `lb stats -o json` prints.
#[derive(Debug, Serialize)]
struct Stats {
    /// Every counter, in `Counter::ALL` order.
    counters: Vec<CounterRow>,
    /// Every drop reason, in the order its first counter comes.
    drops: Vec<DropRow>,
    dropped_total: u64,
    /// The endpoints whose masquerade ports ran out (`drop_snat_ports_exhausted` per endpoint).
    ports_exhausted: Vec<PortsExhausted>,
}

#[derive(Debug, Serialize)]
struct CounterRow {
    name: &'static str,
    value: u64,
    meaning: &'static str,
}

#[derive(Debug, Serialize)]
struct DropRow {
    reason: &'static str,
    packets: u64,
    /// The counters of this reason.
    counters: Vec<&'static str>,
}

impl Stats {
    fn new(values: &[(Counter, u64)]) -> Self {
        let mut drops: Vec<DropRow> = Vec::new();
        for &(counter, value) in values {
            let Some(reason) = counter.drop_reason() else {
                continue;
            };
            match drops.iter_mut().find(|d| d.reason == reason) {
                Some(row) => {
                    row.packets += value;
                    row.counters.push(counter.name());
                }
                None => drops.push(DropRow {
                    reason,
                    packets: value,
                    counters: vec![counter.name()],
                }),
            }
        }
        Stats {
            counters: values
                .iter()
                .map(|&(counter, value)| CounterRow {
                    name: counter.name(),
                    value,
                    meaning: counter.meaning(),
                })
                .collect(),
            dropped_total: drops.iter().map(|d| d.packets).sum(),
            drops,
            ports_exhausted: Vec::new(),
        }
    }

    /// The counters, the drops by reason, and the endpoints whose masquerade ports ran out, if
    /// any.
    fn table(&self) -> String {
        let mut counters = Table::new();
        counters
            .load_style(presets::NOTHING)
            .set_header(["COUNTER", "VALUE", "MEANING"]);
        for row in &self.counters {
            counters.add_row([row.name, &row.value.to_string(), row.meaning]);
        }
        let mut drops = Table::new();
        drops
            .load_style(presets::NOTHING)
            .set_header(["DROP REASON", "PACKETS", "COUNTERS"]);
        for row in &self.drops {
            drops.add_row([
                row.reason,
                &row.packets.to_string(),
                &row.counters.join(","),
            ]);
        }
        drops.add_row(["Total", &self.dropped_total.to_string(), ""]);
        if self.ports_exhausted.is_empty() {
            return format!("{counters}\n\n{drops}\n");
        }
        let mut exhausted = Table::new();
        exhausted.load_style(presets::NOTHING).set_header([
            "MASQUERADE PORTS EXHAUSTED",
            "SERVICE",
            "CONNECTIONS DROPPED",
        ]);
        for row in &self.ports_exhausted {
            exhausted.add_row([
                row.backend.to_string(),
                row.service.clone(),
                row.connections.to_string(),
            ]);
        }
        format!("{counters}\n\n{drops}\n\n{exhausted}\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_counter_is_listed_and_drops_are_summed_by_reason() {
        let values: Vec<(Counter, u64)> = Counter::ALL
            .iter()
            .enumerate()
            .map(|(i, &c)| (c, 10 * i as u64 + 1))
            .collect();
        let stats = Stats::new(&values);
        assert_eq!(stats.counters.len(), Counter::ALL.len());
        let drop_counters: Vec<&(Counter, u64)> = values
            .iter()
            .filter(|(c, _)| c.drop_reason().is_some())
            .collect();
        assert!(!drop_counters.is_empty());
        let in_drops: usize = stats.drops.iter().map(|d| d.counters.len()).sum();
        assert_eq!(in_drops, drop_counters.len());
        let total: u64 = drop_counters.iter().map(|(_, v)| v).sum();
        assert_eq!(stats.dropped_total, total);

        let json: serde_json::Value = serde_json::to_value(&stats).unwrap();
        let first = &json["counters"][0];
        assert_eq!(first["name"], Counter::ALL[0].name());
        assert_eq!(first["value"], 1);
        assert_eq!(first["meaning"], Counter::ALL[0].meaning());
        let no_backend = Counter::DropNoBackend;
        let row = json["drops"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["reason"] == no_backend.drop_reason().unwrap())
            .unwrap();
        assert_eq!(row["packets"], 10 * no_backend as u64 + 1);

        let table = stats.table();
        for (counter, value) in &values {
            let line = table
                .lines()
                .find(|l| l.split_whitespace().next() == Some(counter.name()))
                .unwrap_or_else(|| panic!("{counter:?} in\n{table}"));
            assert!(line.contains(&format!(" {value} ")), "{line}");
            assert!(line.contains(counter.meaning()), "{line}");
        }
        assert!(table.contains(no_backend.drop_reason().unwrap()));
        assert!(!table.contains("MASQUERADE PORTS EXHAUSTED"));
    }

    #[test]
    fn endpoints_whose_masquerade_ports_ran_out_are_listed() {
        let mut stats = Stats::new(&[(Counter::DropSnatPortsExhausted, 7)]);
        stats.ports_exhausted = vec![PortsExhausted {
            service: "default/web".into(),
            backend: "10.244.1.3:8080".parse().unwrap(),
            connections: 7,
        }];
        let table = stats.table();
        let line = table
            .lines()
            .map(str::trim)
            .find(|l| l.starts_with("10.244.1.3:8080"))
            .unwrap_or_else(|| panic!("{table}"));
        assert!(
            line.contains("default/web") && line.ends_with('7'),
            "{line}"
        );
        let json = serde_json::to_value(&stats).unwrap();
        assert_eq!(json["ports_exhausted"][0]["connections"], 7);
    }
}

//! `lb conntrack` and `lb conntrack delete`: the connections of the pinned conntrack map.
use std::net::SocketAddr;

use anyhow::{Context as _, Result};
use comfy_table::{Table, presets};
use lb_common::map_name;
use lb_user::error_chain;
use lb_user::maps::connections::{
    self, Connection, ConntrackMap, Filter, datapath_now, expires_in_s, pinned_timeouts,
    protocol_name, state_name,
};
use lb_user::maps::pins;
use serde::Serialize;

use crate::cli::args::{ConntrackArgs, ConntrackCommand, ConntrackQuery, Output};

pub fn run(args: ConntrackArgs) -> Result<()> {
    match args.command {
        None => list(&args.query, false),
        Some(ConntrackCommand::Delete(query)) => list(&query, true),
    }
}

/// Prints the connections `query` selects, after deleting them if `delete`.
fn list(query: &ConntrackQuery, delete: bool) -> Result<()> {
    let dir = pins::find(&query.bpffs, map_name::CONNTRACK)?;
    let mut map = ConntrackMap::open(&dir)
        .map_err(|e| anyhow::anyhow!("opening {}: {}", map_name::CONNTRACK, error_chain(&e)))?;
    let timeouts = pinned_timeouts(&dir)
        .map_err(|e| anyhow::anyhow!("reading {}: {}", map_name::CONFIG, error_chain(&e)))?;
    let now = datapath_now().context("reading CLOCK_MONOTONIC_COARSE")?;
    let entries = map
        .entries()
        .map_err(|e| anyhow::anyhow!("reading {}: {}", map_name::CONNTRACK, error_chain(&e)))?;
    let filter = Filter {
        service: query.service,
        backend: query.backend,
        client: query.client,
    };
    let selected: Vec<Connection> = connections::join(entries, now, &timeouts)
        .into_iter()
        .filter(|c| filter.matches(c))
        .collect();
    if delete {
        for connection in &selected {
            map.delete(connection).map_err(|e| {
                anyhow::anyhow!(
                    "deleting {} → {}: {}",
                    connection.client,
                    connection.backend,
                    error_chain(&e)
                )
            })?;
        }
        tracing::info!(connections = selected.len(), "deleted");
    }
    let rows: Vec<Row> = selected.iter().map(|c| Row::new(c, now)).collect();
    match query.output {
        Output::Table => println!("{}", table(&rows)),
        Output::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
    }
    Ok(())
}

/// One connection as `-o json` prints it.
#[derive(Debug, Serialize)]
struct Row {
    protocol: String,
    client: SocketAddr,
    service: SocketAddr,
    backend: SocketAddr,
    /// The source the backend sees, when the connection is masqueraded; else null.
    masquerade: Option<SocketAddr>,
    state: &'static str,
    expires_in_s: u64,
}

impl Row {
    fn new(connection: &Connection, now: u64) -> Self {
        Row {
            protocol: protocol_name(connection.proto),
            client: connection.client,
            service: connection.service,
            backend: connection.backend,
            masquerade: connection.masquerade,
            state: state_name(connection.proto, connection.state),
            expires_in_s: expires_in_s(connection.expires_ns, now),
        }
    }
}

fn table(rows: &[Row]) -> Table {
    let mut table = Table::new();
    table.load_style(presets::NOTHING).set_header([
        "PROTO",
        "CLIENT",
        "SERVICE",
        "BACKEND",
        "MASQUERADE",
        "STATE",
        "EXPIRES(s)",
    ]);
    for row in rows {
        table.add_row([
            row.protocol.clone(),
            row.client.to_string(),
            row.service.to_string(),
            row.backend.to_string(),
            row.masquerade.map_or("-".into(), |m| m.to_string()),
            row.state.to_string(),
            row.expires_in_s.to_string(),
        ]);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::{IPPROTO_TCP, tcp};

    #[test]
    fn json_and_table_have_the_contracts_fields() {
        let connection = Connection {
            proto: IPPROTO_TCP,
            client: "198.51.100.2:40000".parse().unwrap(),
            service: "198.51.100.1:30080".parse().unwrap(),
            backend: "10.244.1.3:8080".parse().unwrap(),
            masquerade: Some("198.51.100.1:61000".parse().unwrap()),
            state: tcp::ESTABLISHED,
            expires_ns: 30_500_000_000,
            original: None,
            reply: None,
        };
        let rows = [Row::new(&connection, 500_000_000)];
        let json = serde_json::to_value(&rows).unwrap();
        assert_eq!(
            json,
            serde_json::json!([{
                "protocol": "tcp",
                "client": "198.51.100.2:40000",
                "service": "198.51.100.1:30080",
                "backend": "10.244.1.3:8080",
                "masquerade": "198.51.100.1:61000",
                "state": "established",
                "expires_in_s": 30,
            }])
        );
        let text = table(&rows).to_string();
        let mut lines = text.lines();
        assert!(lines.next().unwrap().contains("MASQUERADE"));
        let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        assert_eq!(
            row,
            [
                "tcp",
                "198.51.100.2:40000",
                "198.51.100.1:30080",
                "10.244.1.3:8080",
                "198.51.100.1:61000",
                "established",
                "30"
            ]
        );
    }
}

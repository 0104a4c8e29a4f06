//! report.md and the plots, from Results. Every number is also a ratio to `direct` at the same
//! service count in the same run: absolute numbers on a shared 2-core box are context only.
use std::{fmt::Write as _, fs, path::Path};

use anyhow::Result;

use crate::{
    plot::{Series, line_chart},
    results::{Point, Results},
    variants::Variant,
};

struct Metric {
    title: &'static str,
    unit: &'static str,
    file: &'static str,
    value: fn(&Point) -> Option<f64>,
}

const METRICS: [Metric; 4] = [
    Metric {
        title: "B2 connection rate (connect, 1-byte request/response, close)",
        unit: "connections/s",
        file: "connections.svg",
        value: |p| p.connections.map(|c| c.per_second),
    },
    Metric {
        title: "B3 request rate on one connection",
        unit: "requests/s",
        file: "requests.svg",
        value: |p| p.requests.map(|r| r.per_second),
    },
    Metric {
        title: "B3 latency p50",
        unit: "µs",
        file: "latency_p50.svg",
        value: |p| p.requests.map(|r| r.p50_us),
    },
    Metric {
        title: "B3 latency p99",
        unit: "µs",
        file: "latency_p99.svg",
        value: |p| p.requests.map(|r| r.p99_us),
    },
];

pub fn write(results: &Results, dir: &Path) -> Result<()> {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# lb benchmark {}\n\nKernel {}, {} CPUs; client on CPU 0, server on CPU 1; {} s per point; \
         the run took {:.0} s.{}\n",
        results.started_utc,
        results.kernel,
        results.cpus,
        results.point_seconds,
        results.seconds,
        if results.smoke {
            " **Smoke run: tiny counts, the numbers mean nothing.**"
        } else {
            ""
        }
    );
    write_datapath(&mut md, results);
    for metric in &METRICS {
        write_metric(&mut md, results, metric);
        line_chart(
            &dir.join(metric.file),
            metric.title,
            metric.unit,
            &series(results, metric),
        )?;
        let _ = writeln!(md, "![{}]({})\n", metric.title, metric.file);
    }
    write_bulk(&mut md, results);
    write_memory(&mut md, results);
    write_errors(&mut md, results);
    fs::write(dir.join("report.md"), md)?;
    Ok(())
}

fn ratio(results: &Results, metric: &Metric, point: &Point) -> Option<f64> {
    let base = (metric.value)(results.point(Variant::Direct, point.services)?)?;
    Some((metric.value)(point)? / base)
}

fn write_metric(md: &mut String, results: &Results, metric: &Metric) {
    let variants = results.variants();
    let _ = writeln!(
        md,
        "## {}\n\nRatio to `direct` at the same count ({} in parentheses).\n",
        metric.title, metric.unit
    );
    let _ = write!(md, "| services |");
    for v in &variants {
        let _ = write!(md, " {} |", v.name());
    }
    let _ = write!(md, "\n| ---: |");
    for _ in &variants {
        let _ = write!(md, " ---: |");
    }
    md.push('\n');
    for count in results.service_counts() {
        let _ = write!(md, "| {count} |");
        for &v in &variants {
            let cell = results.point(v, count).and_then(|p| {
                let value = (metric.value)(p)?;
                Some(match ratio(results, metric, p) {
                    Some(r) => format!("{r:.2} ({value:.1})"),
                    None => format!("({value:.1})"),
                })
            });
            let _ = write!(md, " {} |", cell.unwrap_or_else(|| "-".into()));
        }
        md.push('\n');
    }
    md.push('\n');
}

fn series(results: &Results, metric: &Metric) -> Vec<Series> {
    results
        .variants()
        .into_iter()
        .map(|v| Series {
            name: v.name().to_string(),
            points: results
                .points
                .iter()
                .filter(|p| p.variant == v)
                .filter_map(|p| Some((p.services as f64, (metric.value)(p)?)))
                .collect(),
        })
        .collect()
}

fn write_errors(md: &mut String, results: &Results) {
    let errors: Vec<&Point> = results
        .points
        .iter()
        .filter(|p| p.error.is_some())
        .collect();
    if errors.is_empty() {
        return;
    }
    md.push_str("## Failed points\n\n");
    for p in errors {
        let _ = writeln!(
            md,
            "- {} at {} services: {}",
            p.variant.name(),
            p.services,
            p.error.as_deref().unwrap_or_default()
        );
    }
    md.push('\n');
}

fn write_datapath(md: &mut String, results: &Results) {
    if results.datapath.is_empty() {
        return;
    }
    let cases = ["non-service", "new connection", "established", "reply"];
    let _ = writeln!(
        md,
        "## B1 datapath cost (BPF_PROG_TEST_RUN, {} runs per case)\n\n\
         ns per packet over an empty classifier (its own cost in the last column). Targets: \
         established ≤ 150 ns, new connection ≤ 400 ns, new connection at 50k / at 1 ≤ 1.2.\n",
        results.datapath[0].runs
    );
    let _ = writeln!(
        md,
        "| services | {} | empty program |\n| ---: |{}---: |",
        cases.join(" | "),
        " ---: |".repeat(cases.len())
    );
    let mut counts: Vec<usize> = results.datapath.iter().map(|c| c.services).collect();
    counts.dedup();
    let cost = |services: usize, case: &str| {
        results
            .datapath
            .iter()
            .find(|c| c.services == services && c.case == case)
    };
    for &count in &counts {
        let _ = write!(md, "| {count} |");
        for case in cases {
            let cell = cost(count, case).map_or("-".into(), |c| format!("{:.0}", c.net_ns));
            let _ = write!(md, " {cell} |");
        }
        let empty =
            cost(count, "empty program").map_or("-".into(), |c| format!("{:.0}", c.mean_ns));
        let _ = writeln!(md, " {empty} |");
    }
    if let (Some(first), Some(last)) = (counts.first(), counts.last())
        && let (Some(a), Some(b)) = (
            cost(*first, "new connection"),
            cost(*last, "new connection"),
        )
    {
        let _ = writeln!(
            md,
            "\nNew connection at {last} / at {first} services: {:.2}.",
            b.net_ns / a.net_ns
        );
    }
    md.push('\n');
}

fn write_bulk(md: &mut String, results: &Results) {
    if results.bulk.is_empty() {
        return;
    }
    let b = &results.bulk[0];
    let _ = writeln!(
        md,
        "## B6 programming {} Services × {} endpoints from nothing\n\n\
         | variant | seconds |\n| --- | ---: |",
        b.services, b.endpoints_per_service
    );
    for b in &results.bulk {
        let _ = writeln!(md, "| {} | {:.2} |", b.variant.name(), b.seconds);
    }
    md.push_str(
        "\nThe agent's time runs from the manifest file's rename to its \"sync done\" log line: \
         its 100 ms settle time, the parse of the whole directory and the map writes.\n\n",
    );
}

fn write_memory(md: &mut String, results: &Results) {
    if results.maps.is_empty() {
        return;
    }
    md.push_str(
        "## B7 memory\n\nThe kernel's accounting (fdinfo `memlock`) of each map at its default \
         size; hash maps are preallocated, so this is their cost whatever they hold. A Service \
         port takes one frontend per ClusterIP port and NodePort, an endpoint one backend slot, \
         a connection two conntrack entries.\n\n\
         | map | max entries | MiB | bytes per entry |\n| --- | ---: | ---: | ---: |\n",
    );
    for m in &results.maps {
        let _ = writeln!(
            md,
            "| {} | {} | {:.1} | {:.0} |",
            m.map,
            m.max_entries,
            m.bytes as f64 / 1048576.0,
            m.bytes_per_entry
        );
    }
    for b in &results.bulk {
        if let Some(rss) = b.agent_resident_bytes {
            let _ = writeln!(
                md,
                "\nAgent resident memory with {} Services × {} endpoints: {:.0} MiB.",
                b.services,
                b.endpoints_per_service,
                rss as f64 / 1048576.0
            );
        }
    }
    md.push('\n');
}

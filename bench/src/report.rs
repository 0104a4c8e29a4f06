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

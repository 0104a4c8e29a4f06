//! SVG line charts against the number of services (log scale), one line per variant.
use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

const COLORS: [RGBColor; 6] = [
    RGBColor(0x33, 0x33, 0x33),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0x2c, 0xa0, 0x2c),
];

pub struct Series {
    pub name: String,
    /// (services, value)
    pub points: Vec<(f64, f64)>,
}

pub fn line_chart(path: &Path, title: &str, y_label: &str, series: &[Series]) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow!("plot {}: {e}", path.display());
    let x_max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .fold(10.0, f64::max);
    let y_max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0, f64::max)
        * 1.1;
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d((1.0..x_max * 1.5).log_scale(), 0.0..y_max.max(1e-9))
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("services")
        .y_desc(y_label)
        .draw()
        .map_err(|e| err(&e))?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                s.points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| err(&e))?
            .label(s.name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerLeft)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_an_svg() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chart.svg");
        let series = [Series {
            name: "tc".into(),
            points: vec![(1.0, 10.0), (1000.0, 9.0)],
        }];
        line_chart(&path, "title", "per s", &series).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.contains("<svg") && svg.contains("\ntc\n"));
    }
}

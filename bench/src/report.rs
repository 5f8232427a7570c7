//! Figures and how they are printed: a human line each, or one JSON object per line
//! (`scenario`, `metric`, `value`, `unit`, `baseline`, `ratio`).

use serde::Serialize;

/// One measured figure beside its same-run baseline.
#[derive(Debug, Clone, Serialize)]
pub struct Figure {
    pub scenario: String,
    pub metric: String,
    pub value: f64,
    pub unit: String,
    /// The same quantity for the baseline, measured in the same run.
    pub baseline: Option<f64>,
    /// `value / baseline`.
    pub ratio: Option<f64>,
    /// What the baseline is.
    pub baseline_is: String,
    /// The project's goal for this figure, in words.
    pub goal: String,
}

impl Figure {
    pub fn new(scenario: &str, metric: &str, value: f64, unit: &str) -> Self {
        Self {
            scenario: scenario.into(),
            metric: metric.into(),
            value,
            unit: unit.into(),
            baseline: None,
            ratio: None,
            baseline_is: String::new(),
            goal: String::new(),
        }
    }

    pub fn against(mut self, baseline: f64, what: &str) -> Self {
        self.baseline = Some(baseline);
        self.ratio = (baseline != 0.0).then(|| self.value / baseline);
        self.baseline_is = what.into();
        self
    }

    pub fn goal(mut self, goal: &str) -> Self {
        self.goal = goal.into();
        self
    }

    pub fn print(&self, json: bool) {
        if json {
            println!(
                "{}",
                serde_json::to_string(self).expect("figure serializes")
            );
            return;
        }
        let mut line = format!(
            "{:<16} {:<28} {:>12.3} {:<4}",
            self.scenario, self.metric, self.value, self.unit
        );
        if let (Some(b), Some(r)) = (self.baseline, self.ratio) {
            line.push_str(&format!(
                "  baseline {:>10.3} {} ({})  ratio {:.2}x",
                b, self.unit, self.baseline_is, r
            ));
        }
        if !self.goal.is_empty() {
            line.push_str(&format!("  [goal: {}]", self.goal));
        }
        println!("{line}");
    }
}

/// The `p`-th percentile (0–100) of `v` (sorted in place).
pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let idx = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[idx.min(v.len() - 1)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let mut v: Vec<f64> = (1..=100).map(|x| x as f64).collect();
        assert_eq!(percentile(&mut v, 50.0), 51.0);
        assert_eq!(percentile(&mut v, 99.0), 99.0);
        assert_eq!(percentile(&mut v, 100.0), 100.0);
        assert!(percentile(&mut [], 50.0).is_nan());
    }

    #[test]
    fn ratio_against_baseline() {
        let f = Figure::new("s", "m", 30.0, "us").against(10.0, "raw");
        assert_eq!(f.ratio, Some(3.0));
    }
}

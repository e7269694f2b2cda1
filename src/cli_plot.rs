//! `arcticd plot RUN_DIR [RUN_DIR ...]`: PNG figures of training runs.
//!
//! Each run directory holds a `metrics.jsonl`, one JSON object per optimizer
//! step; any field may be absent on some steps, and a torn last line (a
//! partial write without its newline) is skipped. Several runs overlay in one
//! figure, one colour per run, the legend naming each run by its directory.
//! Figures, each 1200×900 pixels, one panel per quantity, written only when
//! some run has one of their fields:
//!
//! | file | fields |
//! |---|---|
//! | `reward.png` | `reward_mean` and `pass_rate` (thin raw, thick moving mean over `--smooth` steps), `recheck_reward` and the held-out pass@1 as markers where present, the latter with a bar of one standard error either side (from the run's `eval.jsonl`, which holds every evaluation, else `eval_pass_at_1` / `eval_std_error`) |
//! | `mismatch.png` | `mismatch_same_version_mean` / `_max` and `probe_mismatch_max` (linear axis: expected exactly 0), `lag_divergence_mean` (log axis when all positive) |
//! | `update.png` | `grad_norm` (log axis when all positive), `tail_masked` (tokens left out as sampled below `min_token_prob`), `kl_behaviour` / `kl_reference` (log axis when all positive) |
//! | `staleness.png` | `staleness_mean`, `staleness_max`, `stale_dropped` |
//! | `time.png` | `time_wait_s`, `time_train_s`, `time_update_s` |
//! | `replica_load.png` | `replica_load` (one value per replica): each replica, their mean, and max / mean |
//! | `memory.png` | `rss_mib` and `rss_peak_mib`: the process's resident memory after each update (a rising line is a buffer that grows), and below it `heap_live_mib` and `heap_free_mib`, what live allocations hold and what the allocator keeps free (resident rising while the live line stays level is freed memory the allocator kept, not a leak) |
//!
//! Text is drawn with a font compiled into the binary (Hack Regular, MIT and
//! Bitstream Vera licenses, from the `epaint_default_fonts` crate, which
//! ships their texts), so figures render the same on a machine with no
//! system fonts. The x axis is `step` (the line number where a line
//! has none).

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// Every figure's size in pixels.
pub const FIGURE_SIZE: (u32, u32) = (1200, 900);

#[derive(Args)]
pub struct PlotArgs {
    /// Run directories, each holding a metrics.jsonl; several overlay in one figure.
    #[arg(required = true, value_name = "RUN_DIR")]
    pub runs: Vec<PathBuf>,
    /// Where the PNGs are written (default: RUN_DIR/plots of the first run).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Window (in steps) of the moving mean drawn over noisy curves; 1 = raw only.
    #[arg(long, default_value_t = 10, value_name = "N", value_parser = crate::at_least_one)]
    pub smooth: usize,
}

pub fn plot(args: PlotArgs) -> Result<()> {
    let out = match args.out {
        Some(out) => out,
        None => args.runs[0].join("plots"),
    };
    for path in plot_runs(&args.runs, &out, args.smooth)? {
        outln!("{}", path.display())?;
    }
    Ok(())
}

/// Reads each run's `metrics.jsonl`, writes the figures some run has data
/// for into `out` (created if missing) and returns their paths.
pub fn plot_runs(runs: &[PathBuf], out: &Path, smooth: usize) -> Result<Vec<PathBuf>> {
    anyhow::ensure!(!runs.is_empty(), "no run directories given");
    let runs = runs
        .iter()
        .map(|d| Run::load(d))
        .collect::<Result<Vec<_>>>()?;
    let names = run_names(&runs);
    // What each figure would show, before anything is created: a run with
    // nothing to draw leaves no empty folder behind.
    let figures = figures(smooth);
    let drawn: Vec<_> = figures
        .iter()
        .map(|figure| {
            let panels: Vec<PanelData> = figure
                .panels
                .iter()
                .filter_map(|p| PanelData::collect(p, &runs, smooth))
                .collect();
            (figure, panels)
        })
        .filter(|(_, panels)| !panels.is_empty())
        .collect();
    anyhow::ensure!(
        !drawn.is_empty(),
        "none of the runs has any field that a figure shows ({})",
        runs.iter()
            .map(|r| r.file.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    crate::folder_out("--out", out)?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut written = Vec::new();
    for (figure, panels) in drawn {
        let path = out.join(figure.file);
        render(&path, figure.title, &panels, &names)
            .with_context(|| format!("drawing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

/// One run's metrics: one JSON object per step, in file order.
struct Run {
    file: PathBuf,
    dir: PathBuf,
    rows: Vec<Map<String, Value>>,
    /// `eval.jsonl`'s records where the run has one: every held-out
    /// evaluation, where `metrics.jsonl` keeps only the last of those that
    /// finished during an update.
    evals: Option<Vec<Map<String, Value>>>,
}

impl Run {
    fn load(dir: &Path) -> Result<Run> {
        if dir.is_file() {
            bail!(
                "{} is a file; give the run directory that holds metrics.jsonl",
                dir.display()
            );
        }
        anyhow::ensure!(
            dir.is_dir(),
            "run directory {} does not exist",
            dir.display()
        );
        let file = dir.join("metrics.jsonl");
        let text = match std::fs::read_to_string(&file) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                bail!(
                    "{}: no such file (is {} a run directory?)",
                    file.display(),
                    dir.display()
                )
            }
            Err(e) => return Err(anyhow!(e).context(format!("reading {}", file.display()))),
        };
        let rows = parse_metrics(&text).map_err(|e| anyhow!("{}:{e}", file.display()))?;
        anyhow::ensure!(
            !rows.is_empty(),
            "{}: no metrics (empty file)",
            file.display()
        );
        Ok(Run {
            file,
            dir: dir.to_path_buf(),
            rows,
            evals: load_evals(&dir.join("eval.jsonl")),
        })
    }

    /// (step, value) where `field` is a finite number; `step` falls back to
    /// the row's 1-based position. A frozen evaluation or recheck lands on a
    /// later row than the weights it scored: it is drawn at the update
    /// those weights came from (`eval_at_step`, `recheck_at_step`).
    fn scalar(&self, field: &str) -> Vec<(f64, f64)> {
        let from_evals = match field {
            "eval_pass_at_1" => Some("pass_at_1"),
            "eval_std_error" => Some("std_error"),
            _ => None,
        };
        if let (Some(key), Some(evals)) = (from_evals, &self.evals) {
            return evals
                .iter()
                .filter_map(|e| Some((number(e.get("step")?)?, number(e.get(key)?)?)))
                .collect();
        }
        let at = match field {
            "eval_pass_at_1" | "eval_std_error" => Some("eval_at_step"),
            "recheck_reward" => Some("recheck_at_step"),
            _ => None,
        };
        self.rows
            .iter()
            .enumerate()
            .filter_map(|(i, row)| {
                let x = at
                    .and_then(|k| row.get(k).and_then(number))
                    .unwrap_or_else(|| step_of(i, row));
                Some((x, number(row.get(field)?)?))
            })
            .collect()
    }

    /// (step, one value per replica) where `field` is an array of numbers.
    fn vector(&self, field: &str) -> Vec<(f64, Vec<f64>)> {
        self.rows
            .iter()
            .enumerate()
            .filter_map(|(i, row)| {
                let values: Vec<f64> = row
                    .get(field)?
                    .as_array()?
                    .iter()
                    .map(|v| number(v).unwrap_or(f64::NAN))
                    .collect();
                (!values.is_empty()).then(|| (step_of(i, row), values))
            })
            .collect()
    }
}

/// A run's `eval.jsonl` records, or `None` where it has none, or none that
/// reads (then the evaluations come from `metrics.jsonl`, said on stderr).
fn load_evals(path: &Path) -> Option<Vec<Map<String, Value>>> {
    let text = std::fs::read_to_string(path).ok()?;
    match parse_metrics(&text) {
        Ok(rows) if !rows.is_empty() => Some(rows),
        Ok(_) => None,
        Err(e) => {
            eprintln!(
                "note: {}:{e}; held-out evaluations are drawn from metrics.jsonl",
                path.display()
            );
            None
        }
    }
}

/// Parses JSONL text; an error reads `LINE: what` (1-based line). A last line
/// with no newline that does not parse is a torn write and is skipped.
fn parse_metrics(text: &str) -> std::result::Result<Vec<Map<String, Value>>, String> {
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let mut rows = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let body = line.trim();
        if body.is_empty() {
            continue;
        }
        match serde_json::from_str::<Value>(body) {
            Ok(Value::Object(row)) => rows.push(row),
            Ok(other) => {
                return Err(format!(
                    "{}: expected a JSON object per line, got {}",
                    i + 1,
                    kind_of(&other)
                ))
            }
            Err(_) if i + 1 == lines.len() && !line.ends_with('\n') => {
                eprintln!("note: skipping torn last line {} (no newline)", i + 1);
            }
            Err(e) => {
                // serde's "at line 1 column C" is within this one line.
                let what = e.to_string();
                let what = what.split(" at line ").next().unwrap_or_default();
                return Err(format!(
                    "{}: not valid JSON ({what} at column {})",
                    i + 1,
                    e.column()
                ));
            }
        }
    }
    Ok(rows)
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Largest magnitude drawn: a diverged run's 1e308 is drawn at this edge,
/// as values past it overflow the axis range (plotters' tick search never
/// ended) and the pixel arithmetic (an overflow panic in a debug build).
const DRAWN_LIMIT: f64 = 1e300;

fn number(v: &Value) -> Option<f64> {
    let x = match v {
        Value::Number(n) => n.as_f64()?,
        Value::Bool(b) => f64::from(u8::from(*b)),
        _ => return None,
    };
    x.is_finite().then_some(x.clamp(-DRAWN_LIMIT, DRAWN_LIMIT))
}

fn step_of(index: usize, row: &Map<String, Value>) -> f64 {
    row.get("step")
        .and_then(number)
        .unwrap_or((index + 1) as f64)
}

/// Legend names: each run's directory name, or the path as given where two
/// runs share a name.
fn run_names(runs: &[Run]) -> Vec<String> {
    let short: Vec<String> = runs
        .iter()
        .map(|r| {
            r.dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| r.dir.display().to_string())
        })
        .collect();
    short
        .iter()
        .zip(runs)
        .map(|(name, run)| {
            if short.iter().filter(|n| *n == name).count() > 1 {
                run.dir.display().to_string()
            } else {
                name.clone()
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------
// What each figure shows.

struct Figure {
    file: &'static str,
    title: &'static str,
    panels: Vec<Panel>,
}

struct Panel {
    title: String,
    y_label: &'static str,
    scale: Scale,
    series: Vec<Series>,
}

#[derive(Clone, Copy, PartialEq)]
enum Scale {
    Linear,
    /// Log when every value drawn is positive, linear otherwise.
    LogIfPositive,
}

struct Series {
    field: &'static str,
    label: &'static str,
    kind: Kind,
    /// A field with each value's standard error, drawn as a bar of one
    /// standard error either side (Circles), clipped to [0, 1]: the
    /// values are rates.
    error: Option<&'static str>,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// Thin raw line plus a thick moving mean.
    Smoothed,
    /// One medium line.
    Line,
    /// A thin line with small crosses (a max beside a mean).
    Thin,
    /// Markers only, where the field exists.
    Circles,
    Triangles,
    /// A dashed vertical line at each step where the field exists (an
    /// event, such as a rollback; its value is not drawn).
    Rule,
    /// An array field: a thin line per element plus their mean.
    PerReplica,
    /// An array field: max / mean per step.
    Imbalance,
}

fn series(field: &'static str, label: &'static str, kind: Kind) -> Series {
    Series {
        field,
        label,
        kind,
        error: None,
    }
}

impl Series {
    fn with_error(self, field: &'static str) -> Series {
        Series {
            error: Some(field),
            ..self
        }
    }
}

fn figures(smooth: usize) -> Vec<Figure> {
    let raw = if smooth > 1 {
        format!("thin: raw, thick: mean of last {smooth} steps")
    } else {
        "raw".to_string()
    };
    vec![
        Figure {
            file: "reward.png",
            title: "reward",
            panels: vec![
                Panel {
                    title: format!("reward_mean ({raw}); triangles: recheck_reward"),
                    y_label: "reward",
                    scale: Scale::Linear,
                    series: vec![
                        series("reward_mean", "reward_mean", Kind::Smoothed),
                        series("recheck_reward", "recheck_reward", Kind::Triangles),
                        series("rolled_back_to", "rolled back", Kind::Rule),
                    ],
                },
                Panel {
                    title: format!(
                        "pass_rate ({raw}); circles: eval_pass_at_1, bars: its standard error"
                    ),
                    y_label: "pass rate",
                    scale: Scale::Linear,
                    series: vec![
                        series("pass_rate", "pass_rate", Kind::Smoothed),
                        series("eval_pass_at_1", "eval pass@1", Kind::Circles)
                            .with_error("eval_std_error"),
                        series("rolled_back_to", "rolled back", Kind::Rule),
                    ],
                },
            ],
        },
        Figure {
            file: "mismatch.png",
            title: "trainer vs sampler log-prob mismatch",
            panels: vec![
                Panel {
                    title: "same-version mismatch: mean (thick), max (thin), probe max (circles); expected exactly 0, linear axis"
                        .to_string(),
                    y_label: "|logp diff|",
                    scale: Scale::Linear,
                    series: vec![
                        series("mismatch_same_version_mean", "mean", Kind::Line),
                        series("mismatch_same_version_max", "max", Kind::Thin),
                        series("probe_mismatch_max", "probe max", Kind::Circles),
                    ],
                },
                Panel {
                    title: "lag divergence mean (stale policy vs current)".to_string(),
                    y_label: "divergence",
                    scale: Scale::LogIfPositive,
                    series: vec![series("lag_divergence_mean", "lag divergence", Kind::Line)],
                },
            ],
        },
        Figure {
            file: "update.png",
            title: "what each update trained on",
            panels: vec![
                Panel {
                    title: format!("gradient norm before clipping ({raw})"),
                    y_label: "grad norm",
                    scale: Scale::LogIfPositive,
                    series: vec![series("grad_norm", "grad_norm", Kind::Smoothed)],
                },
                Panel {
                    title: "tokens left out of the loss as sampled below min_token_prob"
                        .to_string(),
                    y_label: "tokens",
                    scale: Scale::Linear,
                    series: vec![series("tail_masked", "tail_masked", Kind::Line)],
                },
                Panel {
                    title: "k3 KL to the behaviour policy (thick), to the starting model (thin)"
                        .to_string(),
                    y_label: "KL",
                    scale: Scale::LogIfPositive,
                    series: vec![
                        series("kl_behaviour", "kl_behaviour", Kind::Line),
                        series("kl_reference", "kl_reference", Kind::Thin),
                    ],
                },
            ],
        },
        Figure {
            file: "staleness.png",
            title: "staleness",
            panels: vec![
                Panel {
                    title: "staleness per update: mean (thick), max (thin)".to_string(),
                    y_label: "versions behind",
                    scale: Scale::Linear,
                    series: vec![
                        series("staleness_mean", "mean", Kind::Line),
                        series("staleness_max", "max", Kind::Thin),
                    ],
                },
                Panel {
                    title: "samples dropped as too stale, per update".to_string(),
                    y_label: "dropped",
                    scale: Scale::Linear,
                    series: vec![series("stale_dropped", "stale_dropped", Kind::Line)],
                },
            ],
        },
        Figure {
            file: "time.png",
            title: "time per update",
            panels: ["time_wait_s", "time_train_s", "time_update_s"]
                .into_iter()
                .map(|field| Panel {
                    title: format!("{field} ({raw})"),
                    y_label: "seconds",
                    scale: Scale::Linear,
                    series: vec![series(field, field, Kind::Smoothed)],
                })
                .collect(),
        },
        Figure {
            file: "replica_load.png",
            title: "replica load",
            panels: vec![
                Panel {
                    title: "load per replica (thin), mean over replicas (thick)".to_string(),
                    y_label: "load",
                    scale: Scale::Linear,
                    series: vec![series("replica_load", "replica_load", Kind::PerReplica)],
                },
                Panel {
                    title: "tokens generated per replica since the last update".to_string(),
                    y_label: "tokens",
                    scale: Scale::Linear,
                    series: vec![series("replica_tokens", "replica_tokens", Kind::PerReplica)],
                },
                Panel {
                    title: "imbalance of those tokens: max / mean over replicas (1 = even)"
                        .to_string(),
                    y_label: "max / mean",
                    scale: Scale::Linear,
                    series: vec![series("replica_tokens", "max / mean", Kind::Imbalance)],
                },
            ],
        },
        Figure {
            file: "memory.png",
            title: "memory",
            panels: vec![
                Panel {
                    title: "resident memory after each update (thick), its peak so far (thin)"
                        .to_string(),
                    y_label: "MiB",
                    scale: Scale::Linear,
                    series: vec![
                        series("rss_mib", "resident", Kind::Line),
                        series("rss_peak_mib", "peak", Kind::Thin),
                    ],
                },
                Panel {
                    title: "heap: held by live allocations (thick), free in the allocator (thin)"
                        .to_string(),
                    y_label: "MiB",
                    scale: Scale::Linear,
                    series: vec![
                        series("heap_live_mib", "live", Kind::Line),
                        series("heap_free_mib", "free", Kind::Thin),
                    ],
                },
            ],
        },
    ]
}

// ---------------------------------------------------------------------------
// Data gathered for one panel.

/// Lines of one series of one run.
struct Drawn {
    run: usize,
    label: &'static str,
    kind: Kind,
    /// Raw points (markers for Circles/Triangles; one line per replica for PerReplica).
    lines: Vec<Vec<(f64, f64)>>,
    /// The emphasised line: the moving mean (Smoothed), the replica mean (PerReplica).
    thick: Option<Vec<(f64, f64)>>,
    /// Error bars (step, low, high), for a series with an error field.
    bars: Vec<(f64, f64, f64)>,
}

struct PanelData {
    title: String,
    y_label: &'static str,
    log: bool,
    n_series: usize,
    drawn: Vec<Drawn>,
    x: (f64, f64),
    y: (f64, f64),
}

impl PanelData {
    fn collect(panel: &Panel, runs: &[Run], smooth: usize) -> Option<PanelData> {
        let mut drawn = Vec::new();
        let mut present = Vec::new();
        for spec in &panel.series {
            for (r, run) in runs.iter().enumerate() {
                let (lines, thick) = match spec.kind {
                    Kind::PerReplica => {
                        let rows = run.vector(spec.field);
                        let width = rows.iter().map(|(_, v)| v.len()).max().unwrap_or(0);
                        let lines: Vec<Vec<(f64, f64)>> = (0..width)
                            .map(|k| {
                                rows.iter()
                                    .filter_map(|(s, v)| {
                                        v.get(k).filter(|x| x.is_finite()).map(|x| (*s, *x))
                                    })
                                    .collect()
                            })
                            .collect();
                        let mean = rows
                            .iter()
                            .filter_map(|(s, v)| Some((*s, mean(v)?)))
                            .collect();
                        (lines, Some(mean))
                    }
                    Kind::Imbalance => {
                        let line = run
                            .vector(spec.field)
                            .iter()
                            .filter_map(|(s, v)| {
                                let m = mean(v)?;
                                let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                                (m > 0.0).then(|| (*s, max / m))
                            })
                            .collect();
                        (vec![line], None)
                    }
                    Kind::Smoothed => {
                        let raw = run.scalar(spec.field);
                        let thick = moving_mean(&raw, smooth);
                        (vec![raw], Some(thick))
                    }
                    _ => (vec![run.scalar(spec.field)], None),
                };
                if lines.iter().all(|l| l.is_empty()) {
                    continue;
                }
                if !present.contains(&spec.field) {
                    present.push(spec.field);
                }
                let bars = spec.error.map_or_else(Vec::new, |field| {
                    let errors = run.scalar(field);
                    lines[0]
                        .iter()
                        .filter_map(|&(x, y)| {
                            let &(_, e) = errors.iter().find(|(ex, _)| *ex == x)?;
                            Some((x, (y - e).max(0.0), (y + e).min(1.0)))
                        })
                        .collect()
                });
                drawn.push(Drawn {
                    run: r,
                    label: spec.label,
                    kind: spec.kind,
                    lines,
                    thick,
                    bars,
                });
            }
        }
        // Events alone are no panel; their values are no y.
        if drawn.iter().all(|d| d.kind == Kind::Rule) {
            return None;
        }
        let x = padded(
            drawn
                .iter()
                .flat_map(|d| d.lines.iter().chain(d.thick.iter()).flatten())
                .map(|p| p.0),
            false,
        );
        // The bars' ends are points too: they must fit.
        let ends: Vec<(f64, f64)> = drawn
            .iter()
            .flat_map(|d| d.bars.iter().flat_map(|&(x, lo, hi)| [(x, lo), (x, hi)]))
            .collect();
        let points = || {
            drawn
                .iter()
                .filter(|d| d.kind != Kind::Rule)
                .flat_map(|d| d.lines.iter().chain(d.thick.iter()).flatten())
                .chain(&ends)
        };
        let log = panel.scale == Scale::LogIfPositive && points().all(|p| p.1 > 0.0);
        let y = padded(points().map(|p| p.1), log);
        let mut title = panel.title.clone();
        if points().all(|p| p.1 == 0.0) {
            title.push_str(" - all values exactly 0");
        }
        if panel.scale == Scale::LogIfPositive {
            title.push_str(if log {
                "; log axis"
            } else {
                "; linear axis (has values <= 0)"
            });
        }
        Some(PanelData {
            title,
            y_label: panel.y_label,
            log,
            n_series: present.len(),
            drawn,
            x,
            y,
        })
    }
}

fn mean(v: &[f64]) -> Option<f64> {
    let finite: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    (!finite.is_empty()).then(|| finite.iter().sum::<f64>() / finite.len() as f64)
}

/// Mean of each point and the up to `window - 1` points before it. Each
/// mean is summed afresh (windows are short): a running sum that adds and
/// subtracts would lose the small values after a spike (1e20 then 1.1).
fn moving_mean(points: &[(f64, f64)], window: usize) -> Vec<(f64, f64)> {
    let window = window.max(1);
    (0..points.len())
        .map(|i| {
            let w = &points[(i + 1).saturating_sub(window)..=i];
            (
                points[i].0,
                w.iter().map(|p| p.1).sum::<f64>() / w.len() as f64,
            )
        })
        .collect()
}

/// A range covering the values with a margin; a single value gets a unit
/// (or 10%) margin. In log space the margin is multiplicative.
fn padded(values: impl Iterator<Item = f64>, log: bool) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let (lo, hi) = (
        lo.clamp(-DRAWN_LIMIT, DRAWN_LIMIT),
        hi.clamp(-DRAWN_LIMIT, DRAWN_LIMIT),
    );
    if log {
        let (a, b) = (lo.log10(), hi.log10());
        let pad = if b > a { (b - a) * 0.05 } else { 0.5 };
        return (10f64.powf(a - pad), 10f64.powf(b + pad));
    }
    if hi > lo {
        let pad = (hi - lo) * 0.05;
        (lo - pad, hi + pad)
    } else if lo == 0.0 {
        // All zero (same-version mismatch when all is well): the line sits
        // just above the bottom of a unit range.
        (-0.05, 1.0)
    } else {
        let pad = lo.abs() * 0.1;
        (lo - pad, hi + pad)
    }
}

// ---------------------------------------------------------------------------
// Drawing.

/// Matplotlib's "tab10" colours, one per run, repeating after ten.
const COLOURS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

const FONT: &str = "sans-serif";

/// Points of a thin line up to which each gets a cross.
const MAX_CROSSES: usize = 150;

fn register_font() -> Result<()> {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, epaint_default_fonts::HACK_REGULAR)
            .is_ok()
    });
    anyhow::ensure!(ok, "the built-in font failed to load");
    Ok(())
}

fn render(path: &Path, title: &str, panels: &[PanelData], names: &[String]) -> Result<()> {
    register_font()?;
    let (w, h) = FIGURE_SIZE;
    let mut pixels = vec![0u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let root = root
            .titled(title, (FONT, 26).into_font().color(&BLACK))
            .map_err(plot_err)?;
        let areas = root.split_evenly((panels.len(), 1));
        for (area, panel) in areas.iter().zip(panels) {
            if panel.log {
                draw_panel(area, panel, names, (panel.y.0..panel.y.1).log_scale())?;
            } else {
                draw_panel(area, panel, names, panel.y.0..panel.y.1)?;
            }
        }
        root.present().map_err(plot_err)?;
    }
    write_png(path, &pixels, w, h)
}

fn plot_err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("plotting failed: {e}")
}

fn draw_panel<Y>(
    area: &DrawingArea<BitMapBackend, Shift>,
    panel: &PanelData,
    names: &[String],
    y_range: Y,
) -> Result<()>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, (FONT, 17).into_font().color(&BLACK))
        .margin(10)
        .margin_right(25)
        .x_label_area_size(36)
        .y_label_area_size(78)
        .build_cartesian_2d(panel.x.0..panel.x.1, y_range)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .light_line_style(RGBColor(244, 244, 244))
        .bold_line_style(RGBColor(205, 205, 205))
        .x_desc("step")
        .y_desc(panel.y_label)
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .x_label_formatter(&|v| tick(*v))
        .y_label_formatter(&|v| tick(*v))
        .draw()
        .map_err(plot_err)?;

    let n_runs = panel.drawn.iter().map(|d| d.run).max().unwrap_or(0) + 1;
    for d in &panel.drawn {
        let colour = COLOURS[d.run % COLOURS.len()];
        let name = legend_name(&names[d.run], d.label, n_runs, panel.n_series);
        let thin = colour.mix(0.35).stroke_width(1);
        match d.kind {
            Kind::Smoothed | Kind::PerReplica => {
                for line in &d.lines {
                    chart
                        .draw_series(LineSeries::new(line.iter().copied(), thin))
                        .map_err(plot_err)?;
                }
                let thick = colour.stroke_width(3);
                let line = d.thick.as_ref().unwrap_or(&d.lines[0]);
                chart
                    .draw_series(LineSeries::new(line.iter().copied(), thick))
                    .map_err(plot_err)?
                    .label(name)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], thick));
            }
            Kind::Line => {
                let style = colour.stroke_width(2);
                chart
                    .draw_series(LineSeries::new(d.lines[0].iter().copied(), style))
                    .map_err(plot_err)?
                    .label(name)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
            }
            Kind::Imbalance => {
                let style = colour.stroke_width(2);
                let line = &d.lines[0];
                chart
                    .draw_series(LineSeries::new(line.iter().copied(), style))
                    .map_err(plot_err)?
                    .label(name)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
            }
            Kind::Thin => {
                let style = colour.mix(0.8).stroke_width(1);
                let line = &d.lines[0];
                chart
                    .draw_series(LineSeries::new(line.iter().copied(), style))
                    .map_err(plot_err)?;
                // Crosses mark each point while they stay apart.
                let crosses = if line.len() <= MAX_CROSSES {
                    &line[..]
                } else {
                    &[]
                };
                chart
                    .draw_series(crosses.iter().map(|&p| Cross::new(p, 3, style)))
                    .map_err(plot_err)?
                    .label(name)
                    .legend(move |(x, y)| {
                        EmptyElement::at((x, y))
                            + PathElement::new(vec![(0, 0), (24, 0)], style)
                            + Cross::new((12, 0), 3, style)
                    });
            }
            Kind::Circles => {
                let bar = BLACK.mix(0.7).stroke_width(1);
                for &(x, lo, hi) in &d.bars {
                    chart
                        .draw_series(std::iter::once(PathElement::new(
                            vec![(x, lo), (x, hi)],
                            bar,
                        )))
                        .map_err(plot_err)?;
                    // Caps: short, in pixels whatever the scale.
                    for y in [lo, hi] {
                        chart
                            .draw_series(std::iter::once(
                                EmptyElement::at((x, y))
                                    + PathElement::new(vec![(-4, 0), (4, 0)], bar),
                            ))
                            .map_err(plot_err)?;
                    }
                }
                let style = colour.filled();
                chart
                    .draw_series(d.lines[0].iter().map(|&p| Circle::new(p, 5, style)))
                    .map_err(plot_err)?
                    .label(name)
                    .legend(move |(x, y)| Circle::new((x + 12, y), 5, style));
                let edge = BLACK.stroke_width(1);
                chart
                    .draw_series(d.lines[0].iter().map(|&p| Circle::new(p, 5, edge)))
                    .map_err(plot_err)?;
            }
            Kind::Rule => {
                let style = colour.stroke_width(2);
                let (lo, hi) = panel.y;
                for (i, &(x, _)) in d.lines[0].iter().enumerate() {
                    let rule = chart
                        .draw_series(DashedLineSeries::new([(x, lo), (x, hi)], 8, 5, style))
                        .map_err(plot_err)?;
                    if i == 0 {
                        rule.label(name.clone()).legend(move |(x, y)| {
                            plotters::element::DashedPathElement::new(
                                vec![(x, y), (x + 24, y)],
                                6,
                                4,
                                style,
                            )
                        });
                    }
                }
            }
            Kind::Triangles => {
                let style = colour.filled();
                chart
                    .draw_series(d.lines[0].iter().map(|&p| TriangleMarker::new(p, 7, style)))
                    .map_err(plot_err)?
                    .label(name)
                    .legend(move |(x, y)| TriangleMarker::new((x + 12, y), 7, style));
            }
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(160, 160, 160))
        .label_font((FONT, 14))
        .draw()
        .map_err(plot_err)?;
    Ok(())
}

/// The legend text for one series of one run: the run's name when the panel
/// has one series, the series' name when the figure has one run.
fn legend_name(run: &str, label: &str, n_runs: usize, n_series: usize) -> String {
    match (n_runs, n_series) {
        (_, 1) => run.to_string(),
        (1, _) => label.to_string(),
        _ => format!("{run}: {label}"),
    }
}

/// A short tick label: up to 4 significant digits, exponent form for very
/// large or small magnitudes.
fn tick(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        return "0".to_string();
    }
    if !(1e-3..1e5).contains(&a) {
        let s = format!("{v:.1e}");
        return s.replace(".0e", "e");
    }
    let decimals = (3 - a.log10().floor() as i32).clamp(0, 6) as usize;
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// Writes RGB pixels as a PNG, through a temporary file renamed into place.
fn write_png(path: &Path, pixels: &[u8], w: u32, h: u32) -> Result<()> {
    let tmp = path.with_extension("png.tmp");
    {
        let file =
            std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), w, h);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header()?;
        writer.write_image_data(pixels)?;
        writer.finish()?;
    }
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torn_last_line_is_skipped_but_a_bad_middle_line_is_an_error() {
        let rows = parse_metrics("{\"step\":1}\n{\"step\":2}\n{\"step\":3,\"rew").unwrap();
        assert_eq!(rows.len(), 2);
        let err = parse_metrics("{\"step\":1}\nnot json\n{\"step\":3}\n").unwrap_err();
        assert!(err.starts_with("2: not valid JSON"), "{err}");
        // A complete last line (it has its newline) that does not parse is not torn.
        let err = parse_metrics("{\"step\":1}\n{oops}\n").unwrap_err();
        assert!(err.starts_with("2: "), "{err}");
        let err = parse_metrics("[1, 2]\n").unwrap_err();
        assert!(err.contains("an array"), "{err}");
        assert!(parse_metrics("\n\n").unwrap().is_empty());
    }

    #[test]
    fn moving_mean_is_trailing() {
        let pts: Vec<(f64, f64)> = (1..=5).map(|i| (i as f64, i as f64)).collect();
        let m = moving_mean(&pts, 2);
        let ys: Vec<f64> = m.iter().map(|p| p.1).collect();
        assert_eq!(ys, vec![1.0, 1.5, 2.5, 3.5, 4.5]);
        assert_eq!(moving_mean(&pts, 1), pts);
        // A spike leaves the window whole: the values after it are theirs.
        let spiky = [(1.0, 1.1), (2.0, 1e20), (3.0, 1.2), (4.0, 1.0), (5.0, 1.1)];
        let m = moving_mean(&spiky, 2);
        assert!((m[3].1 - 1.1).abs() < 1e-12, "{m:?}");
        assert!((m[4].1 - 1.05).abs() < 1e-12, "{m:?}");
    }

    fn run(lines: &str) -> Run {
        Run {
            file: PathBuf::from("metrics.jsonl"),
            dir: PathBuf::from("r"),
            rows: parse_metrics(lines).unwrap(),
            evals: None,
        }
    }

    /// Evaluations that finished during one update (the update-0 one and
    /// a later one, as a short run's last update waits for both) keep only
    /// the last in metrics.jsonl; eval.jsonl has each, and is what is drawn.
    #[test]
    fn evaluations_come_from_eval_jsonl_where_the_run_has_one() {
        let mut r = run("{\"step\":1,\"pass_rate\":0.5}\n{\"step\":2,\"pass_rate\":0.5,\"eval_pass_at_1\":0.4,\"eval_std_error\":0.1,\"eval_at_step\":2}\n");
        r.evals = Some(
            parse_metrics("{\"step\":0,\"pass_at_1\":0.1,\"std_error\":0.05}\n{\"step\":2,\"pass_at_1\":0.4,\"std_error\":0.1}\n")
                .unwrap(),
        );
        let p = pass_panel(&[r]).unwrap();
        let evals = p.drawn.iter().find(|d| d.kind == Kind::Circles).unwrap();
        assert_eq!(evals.lines, vec![vec![(0.0, 0.1), (2.0, 0.4)]]);
        assert_eq!(evals.bars.len(), 2, "{:?}", evals.bars);
        // A file that does not read falls back to metrics.jsonl.
        let dir = std::env::temp_dir().join(format!("arcticd-plot-evals-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("eval.jsonl");
        std::fs::write(&bad, "not json\n{}\n").unwrap();
        assert!(load_evals(&bad).is_none());
        assert!(load_evals(&dir.join("none.jsonl")).is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn log_axis_only_when_every_value_is_positive() {
        let panel = |runs: &[Run]| {
            let figure = figures(3)
                .into_iter()
                .find(|f| f.file == "mismatch.png")
                .unwrap();
            PanelData::collect(&figure.panels[1], runs, 3)
        };
        let positive = run("{\"step\":1,\"lag_divergence_mean\":0.01}\n{\"step\":2,\"lag_divergence_mean\":0.002}\n");
        let p = panel(&[positive]).unwrap();
        assert!(p.log && p.title.ends_with("log axis"), "{}", p.title);
        let zero = run(
            "{\"step\":1,\"lag_divergence_mean\":0.01}\n{\"step\":2,\"lag_divergence_mean\":0}\n",
        );
        let p = panel(&[zero]).unwrap();
        assert!(!p.log && p.title.contains("linear axis"), "{}", p.title);
        assert!(
            panel(&[run("{\"step\":1}\n")]).is_none(),
            "no data, no panel"
        );
    }

    #[test]
    fn replica_load_lines_and_imbalance() {
        let r = run("{\"step\":1,\"replica_load\":[1,3],\"replica_tokens\":[1,3]}\n{\"step\":2}\n{\"step\":3,\"replica_load\":[2,2],\"replica_tokens\":[2,2]}\n");
        let figure = figures(1)
            .into_iter()
            .find(|f| f.file == "replica_load.png")
            .unwrap();
        let runs = [r];
        let per = PanelData::collect(&figure.panels[0], &runs, 1).unwrap();
        assert_eq!(
            per.drawn[0].lines,
            vec![vec![(1.0, 1.0), (3.0, 2.0)], vec![(1.0, 3.0), (3.0, 2.0)]]
        );
        assert_eq!(per.drawn[0].thick, Some(vec![(1.0, 2.0), (3.0, 2.0)]));
        let imb = PanelData::collect(&figure.panels[2], &runs, 1).unwrap();
        assert_eq!(imb.drawn[0].lines, vec![vec![(1.0, 1.5), (3.0, 1.0)]]);
    }

    /// reward.png's pass-rate panel of `runs`, unsmoothed.
    fn pass_panel(runs: &[Run]) -> Option<PanelData> {
        let figure = figures(1)
            .into_iter()
            .find(|f| f.file == "reward.png")
            .unwrap();
        PanelData::collect(&figure.panels[1], runs, 1)
    }

    /// `panel` draws into a PNG (in a temporary folder named by `tag`).
    fn renders(panel: PanelData, tag: &str) {
        let dir = std::env::temp_dir().join(format!("arcticd-plot-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("reward.png");
        render(&path, "reward", &[panel], &["r".to_string()]).unwrap();
        assert!(std::fs::metadata(&path).unwrap().len() > 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A rollback is a dashed rule at its update across the pass-rate
    /// panel; the update it went back to is no y value.
    #[test]
    fn a_rollback_is_a_rule_not_a_value() {
        let r = run("{\"step\":1,\"pass_rate\":0.25}\n{\"step\":2,\"pass_rate\":0.5,\"rolled_back_to\":1}\n{\"step\":3,\"pass_rate\":0.75}\n");
        let p = pass_panel(&[r]).unwrap();
        let rule = p.drawn.iter().find(|d| d.kind == Kind::Rule).unwrap();
        assert_eq!(rule.lines, vec![vec![(2.0, 1.0)]]);
        assert!(p.y.1 < 1.0, "y range {:?}", p.y);
        renders(p, "rule");
        // Events alone make no panel.
        assert!(pass_panel(&[run("{\"step\":2,\"rolled_back_to\":1}\n")]).is_none());
    }

    /// An evaluation's standard error is a bar either side of its circle,
    /// at the update it scored, clipped to [0, 1], and inside the y range;
    /// one logged without an error has no bar.
    #[test]
    fn evaluations_have_bars_of_their_standard_error() {
        let r = run("{\"step\":1,\"pass_rate\":0.5}\n{\"step\":2,\"pass_rate\":0.5,\"eval_pass_at_1\":0.05,\"eval_std_error\":0.1,\"eval_at_step\":0}\n{\"step\":3,\"pass_rate\":0.5,\"eval_pass_at_1\":0.9,\"eval_std_error\":0.05,\"eval_at_step\":3}\n{\"step\":4,\"pass_rate\":0.5,\"eval_pass_at_1\":0.95,\"eval_at_step\":4}\n");
        let p = pass_panel(&[r]).unwrap();
        let evals = p.drawn.iter().find(|d| d.kind == Kind::Circles).unwrap();
        assert_eq!(
            evals.lines,
            vec![vec![(0.0, 0.05), (3.0, 0.9), (4.0, 0.95)]]
        );
        let want = [(0.0, 0.0, 0.15), (3.0, 0.85, 0.95)];
        assert_eq!(evals.bars.len(), want.len(), "{:?}", evals.bars);
        for (b, w) in evals.bars.iter().zip(want) {
            assert!(
                (b.0 - w.0).abs() < 1e-12 && (b.1 - w.1).abs() < 1e-12 && (b.2 - w.2).abs() < 1e-12,
                "{:?}",
                evals.bars
            );
        }
        assert!(p.y.0 <= 0.0 && p.y.1 >= 0.95, "y range {:?}", p.y);
        renders(p, "bars");
    }

    #[test]
    fn update_figure_draws_what_the_run_logged() {
        let r = run("{\"step\":1,\"grad_norm\":0.2,\"tail_masked\":3,\"kl_behaviour\":0.001}\n{\"step\":2,\"grad_norm\":0.1,\"tail_masked\":0,\"kl_behaviour\":0.002}\n");
        let figure = figures(1)
            .into_iter()
            .find(|f| f.file == "update.png")
            .unwrap();
        let runs = [r];
        let tail = PanelData::collect(&figure.panels[1], &runs, 1).unwrap();
        assert_eq!(tail.drawn[0].lines, vec![vec![(1.0, 3.0), (2.0, 0.0)]]);
        let kl = PanelData::collect(&figure.panels[2], &runs, 1).unwrap();
        assert!(kl.log, "{}", kl.title);
        // No kl_reference logged (ref_kl_coef off): only the behaviour line.
        assert_eq!(kl.drawn.len(), 1);
    }

    #[test]
    fn ranges_and_ticks() {
        assert_eq!(padded([0.0, 0.0].into_iter(), false), (-0.05, 1.0));
        assert_eq!(padded([2.0].into_iter(), false), (1.8, 2.2));
        let (lo, hi) = padded([1e-4, 1e-2].into_iter(), true);
        assert!(lo > 0.0 && lo < 1e-4 && hi > 1e-2);
        let (lo, hi) = padded([f64::MAX, -1e308].into_iter(), false);
        assert!(lo.is_finite() && hi.is_finite() && (hi - lo).is_finite());
        assert_eq!(tick(0.0), "0");
        assert_eq!(tick(0.25), "0.25");
        assert_eq!(tick(1500.0), "1500");
        assert_eq!(tick(2e-5), "2e-5");
        assert_eq!(tick(-0.5), "-0.5");
    }
}

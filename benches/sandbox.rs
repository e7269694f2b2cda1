//! Sandbox throughput: start-to-first-command latency, and commands per
//! second at 1, 8 and 32 concurrent sandboxes, for each backend.
//!
//! Needs the base image (`arcticd sandbox build-image`); a backend that is
//! unavailable is skipped with a message. `ARCTICD_BENCH_BACKENDS=docker`
//! (or `local`) limits the run to one backend. Not a correctness test.

use arcticd_sandbox::docker::DockerBackend;
use arcticd_sandbox::local::LocalBackend;
use arcticd_sandbox::{image, Backend, ExecRequest, Policy, Sandbox, Snapshot};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn repo() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("arcticd-bench-repo-{}", std::process::id()));
    let _ = std::fs::create_dir_all(d.join("pkg"));
    for i in 0..50 {
        let _ = std::fs::write(
            d.join(format!("pkg/m{i}.py")),
            format!("def f{i}():\n    return {i}\n"),
        );
    }
    d
}

fn backends(
    rt: &arcticd_sandbox::tokio::runtime::Runtime,
) -> Vec<(&'static str, Arc<dyn Backend>)> {
    let only = std::env::var("ARCTICD_BENCH_BACKENDS").unwrap_or_default();
    let want = |n: &str| only.is_empty() || only.split(',').any(|x| x == n);
    let mut out: Vec<(&'static str, Arc<dyn Backend>)> = vec![];
    if want("docker") {
        match rt.block_on(DockerBackend::new()) {
            Ok(b) => out.push(("docker", Arc::new(b))),
            Err(e) => eprintln!("skipping docker: {e}"),
        }
    }
    if want("local") {
        match rt.block_on(LocalBackend::new()) {
            Ok(b) => out.push(("local", Arc::new(b))),
            Err(e) => eprintln!("skipping local: {e}"),
        }
    }
    out
}

fn bench(c: &mut Criterion) {
    let rt = arcticd_sandbox::runtime().expect("runtime");
    let dir = repo();
    let snap = Arc::new(Snapshot::from_dir(&dir).expect("snapshot"));
    // The kernel releases a finished local command's pids up to about two
    // seconds after it ends (its pid namespace is torn down later), so
    // commands back to back at a few hundred a second, as here, reach the
    // default pids limit of 256, and a command then waits for pids to come
    // free before it starts: the burst would time the kernel, not the
    // sandbox. An agent's commands come seconds apart; the limit is raised
    // for this burst only.
    let policy = Policy {
        pids_limit: 4096,
        ..Policy::default()
    };
    let img = image::DEFAULT_TAG;
    let echo = || ExecRequest::argv(["echo", "ok"]);

    let mut g = c.benchmark_group("sandbox_start_to_first_command");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(10))
        .warm_up_time(Duration::from_secs(1));
    g.throughput(Throughput::Elements(1));
    for (name, backend) in backends(&rt) {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let t0 = Instant::now();
                        let sb = backend.start(&snap, img, &policy).await.expect("start");
                        let r = sb.exec(echo()).await.expect("exec");
                        total += t0.elapsed();
                        assert_eq!(r.stdout.text(), "ok\n");
                        sb.close().await.expect("close");
                    }
                    total
                })
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("sandbox_commands");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(8))
        .warm_up_time(Duration::from_secs(1));
    for (name, backend) in backends(&rt) {
        for n in [1usize, 8, 32] {
            let sandboxes: Vec<Arc<dyn Sandbox>> = rt.block_on(async {
                let mut v = vec![];
                for _ in 0..n {
                    v.push(Arc::from(
                        backend.start(&snap, img, &policy).await.expect("start"),
                    ));
                }
                v
            });
            // One iteration: every sandbox runs one command, concurrently.
            g.throughput(Throughput::Elements(n as u64));
            g.bench_with_input(BenchmarkId::new(name, n), &n, |b, _| {
                b.iter_custom(|iters| {
                    rt.block_on(async {
                        let t0 = Instant::now();
                        let tasks: Vec<_> = sandboxes
                            .iter()
                            .map(|sb| {
                                let sb = sb.clone();
                                arcticd_sandbox::tokio::spawn(async move {
                                    for _ in 0..iters {
                                        let r = sb
                                            .exec(ExecRequest::argv(["echo", "ok"]))
                                            .await
                                            .expect("exec");
                                        assert!(r.success(), "{r:?}");
                                    }
                                })
                            })
                            .collect();
                        for t in tasks {
                            t.await.expect("task");
                        }
                        t0.elapsed()
                    })
                })
            });
            rt.block_on(async {
                for sb in sandboxes {
                    sb.close().await.expect("close");
                }
            });
        }
    }
    g.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! `arcticd serve --model DIR`: load the model into one shared parameter
//! store, start engine replicas behind the least-loaded router, and serve
//! the OpenAI-compatible API (`server.rs`) until SIGINT/SIGTERM. On the
//! signal the server stops accepting connections and lets the requests in
//! flight finish, for at most `--shutdown-grace` seconds; then, or on a
//! second signal, the engines end every unfinished request (streams get
//! `finish_reason: "abort"`), and the process exits once the responses are
//! out.

use crate::server::{app, AppState};
use anyhow::{Context, Result};
use arcticd_engine::chat::ChatTemplate;
use arcticd_engine::engine::EngineConfig;
use arcticd_engine::model::{PrefillForm, WeightDType};
use arcticd_engine::router::Router;
use arcticd_engine::tokenizer::Tokenizer;
use arcticd_engine::{ParamStore, Qwen3_5};
use arcticd_kernels::Device;
use clap::Args;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args)]
pub struct ServeArgs {
    /// Model directory (Hugging Face layout, with tokenizer.json).
    #[arg(long)]
    pub model: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port; 0 picks a free one (printed on stderr).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Name clients use in "model" (default: the directory's name).
    #[arg(long, value_parser = crate::non_blank)]
    pub served_model_name: Option<String>,
    /// Engine replicas sharing the weights.
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// Cache memory per replica in MiB (KV blocks and recurrent-state
    /// slots). Default: --cache-fraction of the memory left after loading.
    #[arg(long, conflicts_with = "cache_fraction", value_parser = mib)]
    pub cache_memory: Option<usize>,
    /// Size the caches as this fraction (0 < F <= 0.95) of the memory
    /// available once the model is loaded, split evenly between the
    /// replicas (the default, at 0.5, when --cache-memory is not given).
    #[arg(long)]
    pub cache_fraction: Option<f64>,
    /// Most sequences running at once per replica.
    #[arg(long, default_value_t = 64, value_parser = crate::at_least_one)]
    pub max_num_seqs: usize,
    /// Most tokens in one engine step (at least --max-num-seqs + 64, the
    /// prefix cache's unit).
    #[arg(long, default_value_t = 1024, value_parser = crate::at_least_one)]
    pub max_batched_tokens: usize,
    /// Longest prompt plus completion [default: 32768, or the model's
    /// max_position_embeddings when lower; a larger value is refused].
    #[arg(long, value_parser = crate::at_least_one)]
    pub max_model_len: Option<usize>,
    /// Completion length of a chat request that sets no max_tokens.
    #[arg(long, default_value_t = 512)]
    pub default_max_tokens: usize,
    /// Turn the prefix cache off.
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// `cpu`, or `cuda:N` in a build with the `cuda` feature (one replica
    /// per GPU; the cache then lives in device memory).
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// On CUDA, the matrices' type: `bf16` (half the memory) or `f32`.
    #[arg(long, default_value = "bf16")]
    pub weights: WeightDType,
    /// How a prompt runs through the gated-delta layers: `recurrent` (token
    /// by token: a trainer's bits) or `chunked` (64 tokens at a time: faster
    /// prefill on a GPU, the same function to rounding; slower on the CPU).
    #[arg(long, default_value = "recurrent")]
    pub prefill: PrefillForm,
    /// On CUDA, the deterministic mode: the forward products on an
    /// in-order kernel instead of cuBLAS, so a request's numbers do not
    /// depend on the requests batched with it (slower prefill).
    #[arg(long)]
    pub batch_invariant: bool,
    /// On SIGINT or SIGTERM, how many seconds the requests in flight may
    /// take to finish before they are ended (`finish_reason: "abort"`); a
    /// second signal ends them at once. 0 ends them at once.
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace: u64,
}

pub fn serve(args: ServeArgs) -> Result<()> {
    anyhow::ensure!(args.replicas > 0, "--replicas must be at least 1");
    anyhow::ensure!(
        args.default_max_tokens > 0,
        "--default-max-tokens must be at least 1 (the completion length of a chat request \
         that sets no max_tokens)"
    );
    if let Device::Cuda(ordinal) = args.device {
        return serve_on_cuda(args, ordinal);
    }
    // Loaded packed for the matrix product, layer by layer, before the
    // caches are sized: each matrix is held once (in bf16 when its values
    // are bf16, as in bf16 checkpoints), the memory left is what is really
    // left, and the first request does not wait for the packing.
    let (model, packs) = Qwen3_5::load_packed(&args.model)
        .with_context(|| format!("loading model from {}", args.model.display()))?;
    eprintln!(
        "arcticd serve: weights in memory: {} MiB packed for the matrix product{}, {} MiB unpacked",
        packs.bytes() >> 20,
        if packs.all_bf16() && packs.bytes() > 0 {
            " (bf16)"
        } else {
            ""
        },
        model.held_bytes() >> 20,
    );
    let store = ParamStore::packed(model, packs);
    let cache_memory = match args.cache_memory {
        Some(mib) => {
            let bytes = cache_bytes(mib)?;
            if let Some(available) = arcticd_trainer::memory::host_memory_available() {
                let want = (bytes as u128) * args.replicas as u128;
                if want > available as u128 {
                    anyhow::bail!(
                        "--cache-memory {mib} MiB x {} replicas is more than the {} MiB of \
                         memory available",
                        args.replicas,
                        available >> 20
                    );
                }
            }
            bytes
        }
        None => {
            let f = args.cache_fraction.unwrap_or(DEFAULT_CACHE_FRACTION);
            let meminfo = std::fs::read_to_string("/proc/meminfo")
                .context("--cache-fraction reads the available memory from /proc/meminfo")?;
            cache_from_fraction(f, &meminfo, args.replicas)?
        }
    };
    run(args, store, cache_memory)
}

/// `serve --device cuda:N`: the weights go to the GPU in `--weights`, the
/// cache is sized from the device memory left beside them, and once the
/// replica holds them the host's copy is freed (a server never updates).
#[cfg(feature = "cuda")]
fn serve_on_cuda(args: ServeArgs, ordinal: usize) -> Result<()> {
    use arcticd_engine::model::cuda::CudaModel;
    use arcticd_kernels::cuda::device::CudaDevice;
    if args.replicas > 1 {
        anyhow::bail!(
            "--device cuda:{ordinal} runs one replica (one per GPU); got --replicas {}",
            args.replicas
        );
    }
    let model = Qwen3_5::load(&args.model)
        .with_context(|| format!("loading model from {}", args.model.display()))?;
    let weights = CudaModel::upload_bytes(&model, args.weights);
    eprintln!(
        "arcticd serve: weights on cuda:{ordinal}: {} MiB ({:?} matrices)",
        weights >> 20,
        args.weights
    );
    let cache_memory = match args.cache_memory {
        Some(mib) => cache_bytes(mib)?,
        None => {
            // The fraction is of what the weights and a step's working
            // memory leave.
            let f = args.cache_fraction.unwrap_or(DEFAULT_CACHE_FRACTION);
            let (free, _) = CudaDevice::new(ordinal)?.memory_info()?;
            let step = EngineConfig {
                max_num_seqs: args.max_num_seqs,
                max_batched_tokens: args.max_batched_tokens,
                ..EngineConfig::default()
            }
            .step_scratch_bytes(&model.config);
            fraction_of(f, free.saturating_sub(weights).saturating_sub(step), 1)?
        }
    };
    run(args, ParamStore::new(model), cache_memory)
}

#[cfg(not(feature = "cuda"))]
fn serve_on_cuda(_args: ServeArgs, ordinal: usize) -> Result<()> {
    crate::cli_model::no_cuda(ordinal)
}

/// Starts the engines over `store` and serves until a signal.
fn run(args: ServeArgs, store: std::sync::Arc<ParamStore>, cache_memory: usize) -> Result<()> {
    let tokenizer = Arc::new(Tokenizer::from_dir(&args.model)?);
    let template = ChatTemplate::from_dir(&args.model)?;
    let name = args.served_model_name.clone().unwrap_or_else(|| {
        args.model
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    });
    let max_positions = store.read().config.max_positions;
    let max_model_len = match (args.max_model_len, max_positions) {
        (Some(n), Some(p)) if n > p => anyhow::bail!(
            "--max-model-len {n} is past the {p} positions the model was trained for \
             (max_position_embeddings in its config.json)"
        ),
        (Some(n), _) => n,
        // The engine lowers it to the model's positions.
        (None, _) => EngineConfig::default().max_model_len,
    };
    let config = EngineConfig {
        cache_memory,
        max_num_seqs: args.max_num_seqs,
        max_batched_tokens: args.max_batched_tokens,
        max_model_len,
        enable_prefix_cache: !args.no_prefix_cache,
        device: args.device,
        weights: args.weights,
        prefill: args.prefill,
        batch_invariant: args.batch_invariant,
        ..Default::default()
    };
    let router = Router::start(
        args.replicas,
        store.clone(),
        Some(tokenizer.clone()),
        config,
    )?;
    if args.device != Device::Cpu {
        // Every replica uploaded its copy when it started.
        let freed = store.release_host_weights();
        eprintln!(
            "arcticd serve: the host's copy of the weights freed ({} MiB)",
            freed >> 20
        );
    }
    if let Some(first) = router.replicas().first() {
        let info = first.info();
        let (limit, bound) = info.context_limit();
        eprintln!(
            "arcticd serve: {} MiB of cache per replica: up to {} sequences at once{}, \
             {} positions of K/V; a prompt and its completion up to {} tokens{}",
            cache_memory >> 20,
            info.max_num_seqs,
            if info.max_num_seqs < args.max_num_seqs {
                format!(
                    " (--max-num-seqs {}: the cache holds the state of only {})",
                    args.max_num_seqs, info.max_num_seqs
                )
            } else {
                String::new()
            },
            info.capacity_tokens,
            limit,
            bound.map(|b| format!(" ({b})")).unwrap_or_default(),
        );
    }
    let state = AppState::new(
        router.clone(),
        tokenizer,
        template,
        name,
        args.default_max_tokens,
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let stopper = router.clone();
    runtime.block_on(async move {
        // Listening for signals before the port opens: none is missed.
        let mut first = signal_count()?;
        let mut second = first.clone();
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("binding {}:{}", args.host, args.port))?;
        let addr = listener.local_addr()?;
        eprintln!("arcticd serve: listening on http://{addr}");
        let grace = std::time::Duration::from_secs(args.shutdown_grace);
        serve_http(
            listener,
            app(state),
            HEADER_TIMEOUT,
            async move {
                let _ = first.wait_for(|&n| n >= 1).await;
                eprintln!(
                    "arcticd serve: shutting down: no new connections; the requests in flight \
                     may finish for {} s (a second signal ends them now)",
                    grace.as_secs()
                );
            },
            async move {
                tokio::select! {
                    _ = tokio::time::sleep(grace) => eprintln!(
                        "arcticd serve: the {} s grace is over: ending the requests still \
                         in flight",
                        grace.as_secs()
                    ),
                    _ = second.wait_for(|&n| n >= 2) => eprintln!(
                        "arcticd serve: second signal: ending the requests still in flight"
                    ),
                }
                // Ends every in-flight request, so open streams finish.
                stopper.shutdown();
            },
        )
        .await;
        anyhow::Ok(())
    })?;
    router.shutdown();
    Ok(())
}

/// How long a connection may take to send a request's headers, counted
/// from when it is ready for one, so also how long it may sit idle between
/// requests: then it is closed. Without it, connections that sent nothing
/// held the server's file descriptors until it could accept no more.
const HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Serves `app` on `listener` (HTTP/1.1) until `shutdown` completes, then
/// accepts no more connections, closes idle ones and lets the others finish
/// their response (the keep-alive ends with it). If they are not all done
/// when `cut_short` (first polled once `shutdown` completed) completes, it
/// is up to `cut_short` to end them (the engines end every request), and
/// this returns once their responses are out, or `LAST_WRITES` later. An accept that fails (no
/// file descriptors left) is retried after a pause instead of ending the
/// server.
async fn serve_http(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    header_timeout: std::time::Duration,
    shutdown: impl std::future::Future<Output = ()>,
    cut_short: impl std::future::Future<Output = ()>,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        // Small SSE writes must not wait for ACKs (Nagle).
        let _ = tcp.set_nodelay(true);
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(header_timeout)
            .serve_connection(TokioIo::new(tcp), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection: {e}");
            }
        });
    }
    drop(listener);
    let drained = graceful.shutdown();
    tokio::pin!(drained);
    tokio::select! {
        _ = &mut drained => {}
        _ = cut_short => {
            // A client that reads nothing could hold its response open
            // forever: the server ends anyway.
            if tokio::time::timeout(LAST_WRITES, drained).await.is_err() {
                tracing::warn!(
                    "connections still open {} s after their requests ended; closing them",
                    LAST_WRITES.as_secs()
                );
            }
        }
    }
}

/// How long, once the requests in flight are ended, their responses may
/// take to go out before the server closes their connections.
const LAST_WRITES: std::time::Duration = std::time::Duration::from_secs(10);

/// Counts the SIGINTs and SIGTERMs that arrive from now on. Its listeners
/// live as long as the runtime, so no signal falls between two of them
/// (a listener made after a signal never sees it).
fn signal_count() -> Result<tokio::sync::watch::Receiver<u32>> {
    let (tx, rx) = tokio::sync::watch::channel(0u32);
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut int = signal(SignalKind::interrupt()).context("listening for SIGINT")?;
        let mut term = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
                tx.send_modify(|n| *n += 1);
            }
        });
    }
    #[cfg(not(unix))]
    tokio::spawn(async move {
        while tokio::signal::ctrl_c().await.is_ok() {
            tx.send_modify(|n| *n += 1);
        }
    });
    Ok(rx)
}

/// The share of the memory left after loading that the caches take when
/// neither --cache-memory nor --cache-fraction is given.
const DEFAULT_CACHE_FRACTION: f64 = 0.5;

/// Cache bytes per replica for `--cache-fraction`: `fraction` of
/// `MemAvailable` in `meminfo` (the text of /proc/meminfo), split between
/// `replicas`.
fn cache_from_fraction(fraction: f64, meminfo: &str, replicas: usize) -> Result<usize> {
    let available = arcticd_trainer::memory::parse_mem_available(meminfo)
        .context("no MemAvailable line in /proc/meminfo")?;
    fraction_of(fraction, available as usize, replicas)
}

/// clap's parser of `--cache-memory` (serve, bench-decode): a count of
/// MiB, no unit, whose bytes a `usize` holds.
pub(crate) fn mib(s: &str) -> std::result::Result<usize, String> {
    const MAX: usize = usize::MAX >> 20;
    match s.parse::<usize>() {
        Ok(n) if (1..=MAX).contains(&n) => Ok(n),
        _ => Err(format!(
            "{s} is not a whole number of MiB from 1 to {MAX} (no unit: 4096 is 4 GiB)"
        )),
    }
}

/// `--cache-memory` in bytes.
fn cache_bytes(mib: usize) -> Result<usize> {
    mib.checked_mul(1 << 20)
        .filter(|&b| b > 0)
        .with_context(|| format!("--cache-memory {mib} MiB: give a size from 1 MiB up"))
}

/// `fraction` of `available` bytes, split between `replicas`.
fn fraction_of(fraction: f64, available: usize, replicas: usize) -> Result<usize> {
    if !(fraction > 0.0 && fraction <= 0.95) {
        anyhow::bail!("--cache-fraction must be in (0, 0.95], got {fraction}");
    }
    let bytes = (available as f64 * fraction / replicas as f64) as usize;
    if bytes < 1 << 20 {
        anyhow::bail!("--cache-fraction {fraction} leaves under 1 MiB of cache per replica");
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::{cache_from_fraction, serve_http};
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};

    /// `serve_http` of `app` on a free local port, in a runtime of its own:
    /// the runtime, the address, the sender that stops it and its task.
    fn start(
        app: axum::Router,
        header_timeout: Duration,
        cut_short: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> (
        tokio::runtime::Runtime,
        std::net::SocketAddr,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    ) {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = rt.spawn(serve_http(
            listener,
            app,
            header_timeout,
            async {
                let _ = stopped.await;
            },
            cut_short,
        ));
        (rt, addr, stop, server)
    }

    /// A connection that sends no request, or half a header, or sits idle
    /// after its response, is closed after the header timeout; requests are
    /// served meanwhile; shutdown ends the server.
    #[test]
    fn idle_and_silent_connections_are_closed() {
        let app = axum::Router::new().route("/health", axum::routing::get(|| async { "ok" }));
        let (rt, addr, stop, server) =
            start(app, Duration::from_millis(300), std::future::pending());
        // Closed by the server: the read ends (0 bytes, or a reset) well
        // before the client's own 20 s limit.
        let closed_within = |mut c: std::net::TcpStream| {
            c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let t = Instant::now();
            let mut buf = [0u8; 4096];
            loop {
                match c.read(&mut buf) {
                    Ok(0) | Err(_) => return t.elapsed(),
                    Ok(_) => continue,
                }
            }
        };
        let silent = std::net::TcpStream::connect(addr).unwrap();
        assert!(closed_within(silent) < Duration::from_secs(10));
        let mut half = std::net::TcpStream::connect(addr).unwrap();
        half.write_all(b"GET /health HTTP/1.1\r\nHo").unwrap();
        assert!(closed_within(half) < Duration::from_secs(10));
        let mut kept = std::net::TcpStream::connect(addr).unwrap();
        kept.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        kept.set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut buf = [0u8; 4096];
        let n = kept.read(&mut buf).unwrap();
        let head = String::from_utf8_lossy(&buf[..n]).to_string();
        assert!(
            head.starts_with("HTTP/1.1 200") && head.ends_with("ok"),
            "{head}"
        );
        assert!(closed_within(kept) < Duration::from_secs(10));
        stop.send(()).unwrap();
        rt.block_on(server).unwrap();
    }

    /// A client that reads nothing of an endless response cannot keep the
    /// server from ending: once the requests were cut short, the server
    /// returns `LAST_WRITES` later.
    #[test]
    fn a_client_that_reads_nothing_cannot_hold_the_server() {
        let endless = || async {
            let chunk = axum::body::Bytes::from(vec![b'x'; 1 << 16]);
            let chunks = futures_util::stream::repeat_with(move || {
                Ok::<_, std::convert::Infallible>(chunk.clone())
            });
            axum::body::Body::from_stream(chunks)
        };
        let app = axum::Router::new().route("/endless", axum::routing::get(endless));
        let (rt, addr, stop, server) = start(app, Duration::from_secs(30), async {});
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.write_all(b"GET /endless HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut first = [0u8; 64];
        c.read_exact(&mut first).unwrap();
        assert!(first.starts_with(b"HTTP/1.1 200"));
        // The socket buffers fill; the response never ends.
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        stop.send(()).unwrap();
        rt.block_on(server).unwrap();
        let took = t.elapsed();
        assert!(
            took >= super::LAST_WRITES && took < super::LAST_WRITES + Duration::from_secs(5),
            "the server ended after {took:?}"
        );
        drop(c);
    }

    #[test]
    fn cache_fraction_of_available_memory() {
        let meminfo =
            "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   16777216 kB\n";
        // 16 GiB available, half of it, two replicas: 4 GiB each.
        assert_eq!(cache_from_fraction(0.5, meminfo, 2).unwrap(), 4 << 30);
        assert!(cache_from_fraction(0.0, meminfo, 1).is_err());
        assert!(cache_from_fraction(0.99, meminfo, 1).is_err());
        assert!(cache_from_fraction(f64::NAN, meminfo, 1).is_err());
        assert!(cache_from_fraction(0.5, "MemTotal: 1 kB\n", 1).is_err());
        assert!(cache_from_fraction(1e-9, meminfo, 1).is_err());
    }
}

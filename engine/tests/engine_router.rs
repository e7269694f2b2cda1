//! Replicas sharing one parameter store behind the least-loaded router: an
//! uneven workload (a few long requests among many short ones) ends with no
//! replica holding more than its share plus one request's worth of work,
//! and every request is answered; on an idle router, ties rotate, so
//! one-at-a-time requests spread over the replicas.

use arcticd_engine::engine::{self, Choice, EngineConfig, EngineHandle, Request};
use arcticd_engine::router::Router;
use arcticd_engine::sampler::SamplingParams;
use arcticd_engine::{ParamStore, Qwen3_5};

#[test]
fn least_loaded_routing_balances_an_uneven_workload() {
    let dir = std::env::temp_dir().join(format!("arcticd-engine-router-{}", std::process::id()));
    arcticd_engine::init::init_model(arcticd_engine::init::TINY, &dir, 7).unwrap();
    let store = ParamStore::new(Qwen3_5::load(&dir).unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    let config = EngineConfig {
        cache_memory: 8 << 20,
        max_num_seqs: 16,
        max_batched_tokens: 256,
        max_model_len: 4096,
        ..Default::default()
    };
    let replicas = 3;
    let router = Router::start(replicas, store, None, config).unwrap();
    assert_eq!(router.loads(), vec![0; replicas]);

    // Every 7th request is 20x longer than the rest.
    let reqs: Vec<Request> = (0..42u32)
        .map(|i| {
            let long = i % 7 == 0;
            let len = if long { 300 } else { 15 };
            Request {
                prompt: (0..len).map(|j| (i * 31 + j * 7) % 900 + 5).collect(),
                params: SamplingParams {
                    max_tokens: if long { 40 } else { 4 },
                    ignore_eos: true,
                    ..SamplingParams::greedy(4)
                },
            }
        })
        .collect();
    let mut assigned = vec![0u64; replicas];
    let mut subs = Vec::new();
    let mut biggest = 0;
    for (i, r) in reqs.iter().enumerate() {
        let w = EngineHandle::request_load(r);
        biggest = biggest.max(w);
        let (replica, sub) = router.submit(r.clone()).unwrap();
        assigned[replica] += w;
        subs.push(sub);
        // Let some work finish between waves, so load also goes down.
        if i % 14 == 13 {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    let total: u64 = assigned.iter().sum();
    let share = total / replicas as u64;
    eprintln!("assigned load per replica {assigned:?} (share {share}, largest request {biggest})");
    for &a in &assigned {
        assert!(a <= share + biggest, "{assigned:?}");
    }
    for mut s in subs {
        let mut ch = vec![Choice::default()];
        while engine::apply_event(&mut ch, s.events.blocking_recv().unwrap()).unwrap() == 0 {}
        assert!(!ch[0].tokens.is_empty());
    }
    // All work done: every replica's load is back to zero.
    for _ in 0..100 {
        if router.loads().iter().all(|&l| l == 0) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(router.loads(), vec![0; replicas]);
    router.shutdown();
}

#[test]
fn ties_rotate_so_one_at_a_time_requests_spread() {
    let dir = std::env::temp_dir().join(format!("arcticd-engine-ties-{}", std::process::id()));
    arcticd_engine::init::init_model(arcticd_engine::init::TINY, &dir, 8).unwrap();
    let store = ParamStore::new(Qwen3_5::load(&dir).unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    let router = Router::start(2, store, None, EngineConfig::default()).unwrap();
    let mut served = [0usize; 2];
    for i in 0..6u32 {
        let (replica, mut sub) = router
            .submit(Request {
                prompt: vec![5 + i, 6, 7],
                params: SamplingParams {
                    ignore_eos: true,
                    ..SamplingParams::greedy(2)
                },
            })
            .unwrap();
        let mut ch = vec![Choice::default()];
        while engine::apply_event(&mut ch, sub.events.blocking_recv().unwrap()).unwrap() == 0 {}
        // Finished: every load is 0 again before the next request.
        for _ in 0..100 {
            if router.loads().iter().all(|&l| l == 0) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        served[replica] += 1;
    }
    assert_eq!(served, [3, 3]);
    router.shutdown();
}

//! Shared by the fuzz harnesses (included with `#[path]`): seeds from `fuzz/corpus/<target>/`,
//! a proptest strategy of mutated seeds and arbitrary bytes, and the bounded-time runner.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};

/// The seed files of one target, in a stable order.
pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    let dir = corpus_dir(target);
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().is_some_and(|n| n != "regressions.txt"))
        .collect();
    paths.sort();
    assert!(!paths.is_empty(), "no seeds in {}", dir.display());
    paths.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

fn corpus_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target)
}

/// One edit applied to a seed.
#[derive(Debug, Clone)]
enum Edit {
    Flip(usize, u8),
    Set(usize, u8),
    Truncate(usize),
    Splice(usize, Vec<u8>),
    Repeat(usize, usize),
}

fn apply(mut data: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    for e in edits {
        let n = data.len().max(1);
        match e {
            Edit::Flip(at, bit) => {
                if let Some(b) = data.get_mut(at % n) {
                    *b ^= 1 << (bit % 8);
                }
            }
            Edit::Set(at, v) => {
                if let Some(b) = data.get_mut(at % n) {
                    *b = *v;
                }
            }
            Edit::Truncate(at) => data.truncate(at % n),
            Edit::Splice(at, bytes) => {
                let at = at % n.min(data.len() + 1);
                data.splice(at..at, bytes.iter().copied());
            }
            Edit::Repeat(at, len) => {
                let at = at % n;
                let end = (at + len % 64).min(data.len());
                let piece: Vec<u8> = data.get(at..end).unwrap_or(&[]).to_vec();
                data.splice(at..at, piece);
            }
        }
    }
    data
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(a, b)| Edit::Flip(a, b)),
        (
            any::<usize>(),
            prop_oneof![
                Just(0u8),
                Just(0xFF),
                Just(b'"'),
                Just(b'}'),
                Just(b'\n'),
                any::<u8>()
            ]
        )
            .prop_map(|(a, v)| Edit::Set(a, v)),
        any::<usize>().prop_map(Edit::Truncate),
        (
            any::<usize>(),
            proptest::collection::vec(any::<u8>(), 0..16)
        )
            .prop_map(|(a, b)| Edit::Splice(a, b)),
        (any::<usize>(), any::<usize>()).prop_map(|(a, l)| Edit::Repeat(a, l)),
    ]
}

/// Mutated seeds (most cases) and arbitrary bytes.
pub fn inputs(seeds: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    let n = seeds.len();
    prop_oneof![
        4 => (0..n, proptest::collection::vec(edit(), 1..6))
            .prop_map(move |(i, edits)| apply(seeds[i].clone(), &edits)),
        1 => proptest::collection::vec(any::<u8>(), 0..1024),
    ]
}

/// Runs `check` on every seed, then on generated inputs: one round of 256 cases, or rounds until
/// `HEADROOM_FUZZ_SECONDS` have passed. A panic or an `Err` fails the test with the input.
pub fn fuzz(target: &str, check: impl Fn(&[u8]) -> Result<(), String>) {
    let seeds = seeds(target);
    for (i, s) in seeds.iter().enumerate() {
        check(s).unwrap_or_else(|e| panic!("{target} seed {i}: {e}"));
    }
    let budget = std::env::var("HEADROOM_FUZZ_SECONDS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_secs);
    let started = Instant::now();
    let regressions = corpus_dir(target).join("regressions.txt");
    let mut rounds = 0u64;
    loop {
        let config = Config {
            cases: 256,
            failure_persistence: Some(Box::new(FileFailurePersistence::Direct(Box::leak(
                regressions.to_string_lossy().into_owned().into_boxed_str(),
            )))),
            ..Config::default()
        };
        let mut runner = TestRunner::new_with_rng(
            config,
            proptest::test_runner::TestRng::from_seed(
                proptest::test_runner::RngAlgorithm::ChaCha,
                &{
                    let mut seed = [0u8; 32];
                    seed[..8].copy_from_slice(&rounds.to_le_bytes());
                    seed[8..16]
                        .copy_from_slice(&(started.elapsed().as_nanos() as u64).to_le_bytes());
                    seed
                },
            ),
        );
        runner
            .run(&inputs(seeds.clone()), |input| {
                check(&input).map_err(TestCaseError::fail)
            })
            .unwrap_or_else(|e| panic!("{target}: {e}"));
        rounds += 1;
        match budget {
            Some(b) if started.elapsed() < b => continue,
            _ => break,
        }
    }
    eprintln!(
        "{target}: {} cases in {:?}",
        rounds * 256,
        started.elapsed()
    );
}

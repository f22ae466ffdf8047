//! Out-of-memory lines that are not failures: engines catch some allocation failures and go on,
//! and say what they did next — an autotuner skips a configuration, a buffer is retried without
//! pinned memory or in a smaller layout, a scheduler retracts requests or unloads one model to
//! load another. Also the start-up that logged an out-of-memory and then came up anyway: the
//! engine's own "ready" lines after the last out-of-memory say it went on.

use crate::facts::{Facts, record};
use crate::finding::{Cause, Finding};
use crate::text::has;

/// (words on an out-of-memory line, what the engine did next)
const CAUGHT: [(&[&str], &str); 7] = [
    (
        &["tactic"],
        "an autotuner skipped a kernel configuration that did not fit and kept tuning the others",
    ),
    (
        &["pinned memory"],
        "a host buffer could not be pinned; the engine went on with ordinary (pageable) host memory",
    ),
    (
        &["retract"],
        "the scheduler ran out of KV-cache room for running requests, moved some back to the queue (retracted) and went on; \
         occasional retractions are normal, frequent ones mean the KV pool is small for the load",
    ),
    (
        &["decode out of memory"],
        "the scheduler ran out of KV-cache room for running requests, moved some back to the queue (retracted) and went on; \
         occasional retractions are normal, frequent ones mean the KV pool is small for the load",
    ),
    (
        &["retrying", "retry with"],
        "the engine retried the allocation in a smaller layout",
    ),
    (
        &["falling back", "fall back"],
        "the engine fell back to another path and went on",
    ),
    (
        &["evict", "unloading"],
        "the scheduler unloaded a model to make room for another and went on",
    ),
];

/// True when `line` reports an out-of-memory the engine caught; records what it did next.
pub fn scan(facts: &mut Facts, line_no: u64, line: &str) -> bool {
    let says_oom = has(line, "out of memory") || has(line, "OutOfMemory") || has(line, " OOM");
    if !says_oom {
        return false;
    }
    for (words, next) in CAUGHT {
        if words.iter().any(|w| has(line, w)) {
            record(&mut facts.absorbed, next, line_no);
            return true;
        }
    }
    false
}

/// Notes a line that shows the engine serving or past its start-up.
pub fn ready(facts: &mut Facts, line_no: u64) {
    if facts.ready_lines.len() < 64 {
        facts.ready_lines.push(line_no);
    } else if let Some(last) = facts.ready_lines.last_mut() {
        *last = line_no;
    }
}

/// The engine came up after every out-of-memory the rules recorded.
fn came_up_after(facts: &Facts) -> Option<u64> {
    let last_oom = facts.last_oom_line?;
    facts.ready_lines.iter().copied().find(|r| *r > last_oom)
}

pub fn conclude(facts: &Facts, findings: &mut Vec<Finding>) {
    let memory: Vec<&Finding> = findings
        .iter()
        .filter(|f| f.cause != Cause::NotOutOfMemory)
        .collect();
    if let Some(seen) = &facts.absorbed
        && memory.is_empty()
    {
        findings.push(
            Finding::new(Cause::NotOutOfMemory, 0.9)
                .count("times", Some(seen.count))
                .fix(format!(
                    "the out-of-memory here did not stop the engine: {}; look elsewhere in the log for what did",
                    seen.value
                ))
                .lines(seen.lines.iter().copied()),
        );
        return;
    }
    if memory.is_empty() {
        return;
    }
    if let Some(up) = came_up_after(facts) {
        let first = memory
            .iter()
            .filter_map(|f| f.evidence_lines.first().copied())
            .min()
            .unwrap_or(up);
        findings.push(
            Finding::new(Cause::NotOutOfMemory, 0.99)
                .fix(format!(
                    "the engine logged an out-of-memory (line {first}) and then came up and served (line {up}): it caught the \
                     failure and went on (a warm-up or tuning step that retried smaller, or a start-up retried with other settings); \
                     the readings below are what that failure would mean if it recurs"
                ))
                .lines([first, up]),
        );
    }
}

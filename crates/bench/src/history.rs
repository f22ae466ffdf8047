//! The soak history: one SQLite row per round, kept across invocations so a slow leak over days
//! shows up. Rounds are grouped by a workload key (scenario, URL and load), since floors of
//! different workloads cannot be compared.

use std::path::Path;

use rusqlite::{Connection, params};

use crate::BenchError;

/// One stored round.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredRound {
    pub invocation: String,
    pub round: u32,
    pub started_at_ms: u64,
    pub idle_floor_bytes: Option<u64>,
    pub peak_bytes: Option<u64>,
    pub request_throughput_rps: f64,
    pub output_token_throughput_tps: f64,
    pub max_in_flight: u64,
    pub requests_sent: u64,
    pub ok: u64,
}

/// An open history file.
#[derive(Debug)]
pub struct History {
    conn: Connection,
}

fn err(e: rusqlite::Error) -> BenchError {
    BenchError::History(e.to_string().replace('\n', " "))
}

impl History {
    /// Opens or creates the file and its table.
    pub fn open(path: &Path) -> Result<History, BenchError> {
        let conn = Connection::open(path).map_err(|e| {
            BenchError::BadInput(format!("cannot open history {}: {e}", path.display()))
        })?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS soak_rounds (
                id INTEGER PRIMARY KEY,
                workload TEXT NOT NULL,
                invocation TEXT NOT NULL,
                round INTEGER NOT NULL,
                started_at_ms INTEGER NOT NULL,
                idle_floor_bytes INTEGER,
                peak_bytes INTEGER,
                request_throughput_rps REAL NOT NULL,
                output_token_throughput_tps REAL NOT NULL,
                max_in_flight INTEGER NOT NULL,
                requests_sent INTEGER NOT NULL,
                ok INTEGER NOT NULL
            );
            CREATE INDEX IF NOT EXISTS soak_rounds_workload ON soak_rounds (workload, started_at_ms);",
        )
        .map_err(|e| {
            BenchError::BadInput(format!(
                "history {} is not a usable SQLite file: {}",
                path.display(),
                e.to_string().replace('\n', " ")
            ))
        })?;
        Ok(History { conn })
    }

    /// Appends one round.
    pub fn append(&self, workload: &str, r: &StoredRound) -> Result<(), BenchError> {
        self.conn
            .execute(
                "INSERT INTO soak_rounds (workload, invocation, round, started_at_ms, idle_floor_bytes,
                 peak_bytes, request_throughput_rps, output_token_throughput_tps, max_in_flight,
                 requests_sent, ok) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
                params![
                    workload,
                    r.invocation,
                    r.round,
                    r.started_at_ms as i64,
                    r.idle_floor_bytes.map(|b| b as i64),
                    r.peak_bytes.map(|b| b as i64),
                    r.request_throughput_rps,
                    r.output_token_throughput_tps,
                    r.max_in_flight as i64,
                    r.requests_sent as i64,
                    r.ok as i64
                ],
            )
            .map(|_| ())
            .map_err(err)
    }

    /// Every round of `workload`, oldest first.
    pub fn rounds(&self, workload: &str) -> Result<Vec<StoredRound>, BenchError> {
        let mut stmt = self
            .conn
            .prepare(
                "SELECT invocation, round, started_at_ms, idle_floor_bytes, peak_bytes,
                 request_throughput_rps, output_token_throughput_tps, max_in_flight, requests_sent, ok
                 FROM soak_rounds WHERE workload = ?1 ORDER BY started_at_ms, id",
            )
            .map_err(err)?;
        let rows = stmt
            .query_map(params![workload], |row| {
                Ok(StoredRound {
                    invocation: row.get(0)?,
                    round: row.get(1)?,
                    started_at_ms: row.get::<_, i64>(2)? as u64,
                    idle_floor_bytes: row.get::<_, Option<i64>>(3)?.map(|b| b as u64),
                    peak_bytes: row.get::<_, Option<i64>>(4)?.map(|b| b as u64),
                    request_throughput_rps: row.get(5)?,
                    output_token_throughput_tps: row.get(6)?,
                    max_in_flight: row.get::<_, i64>(7)? as u64,
                    requests_sent: row.get::<_, i64>(8)? as u64,
                    ok: row.get::<_, i64>(9)? as u64,
                })
            })
            .map_err(err)?;
        rows.collect::<Result<Vec<_>, _>>().map_err(err)
    }

    /// Distinct invocations recorded for `workload`.
    pub fn invocations(&self, workload: &str) -> Result<u64, BenchError> {
        self.conn
            .query_row(
                "SELECT COUNT(DISTINCT invocation) FROM soak_rounds WHERE workload = ?1",
                params![workload],
                |row| row.get::<_, i64>(0),
            )
            .map(|n| n as u64)
            .map_err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(inv: &str, n: u32, floor: u64) -> StoredRound {
        StoredRound {
            invocation: inv.into(),
            round: n,
            started_at_ms: 1000 + n as u64,
            idle_floor_bytes: Some(floor),
            peak_bytes: None,
            request_throughput_rps: 10.0,
            output_token_throughput_tps: 100.0,
            max_in_flight: 2,
            requests_sent: 10,
            ok: 10,
        }
    }

    #[test]
    fn rounds_survive_reopening_and_stay_per_workload() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.sqlite");
        {
            let h = History::open(&path).unwrap();
            h.append("w", &round("a", 0, 5)).unwrap();
            h.append("other", &round("a", 0, 9)).unwrap();
        }
        let h = History::open(&path).unwrap();
        h.append("w", &round("b", 1, 6)).unwrap();
        let rounds = h.rounds("w").unwrap();
        assert_eq!(
            rounds
                .iter()
                .map(|r| r.idle_floor_bytes)
                .collect::<Vec<_>>(),
            vec![Some(5), Some(6)]
        );
        assert_eq!(h.invocations("w").unwrap(), 2);
    }

    #[test]
    fn a_file_that_is_not_sqlite_is_bad_input() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.sqlite");
        std::fs::write(&path, vec![b'x'; 4096]).unwrap();
        let e = History::open(&path).unwrap_err();
        assert!(matches!(e, BenchError::BadInput(_)), "{e}");
    }
}

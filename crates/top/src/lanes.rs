//! Lanes as `GET /admin/lanes` of `headroom serve` reports them:
//! `{"lanes":[{"name":..,"inflight":..,"queued":..,"rejected":..,"max_inflight":..,"max_queue":..}]}`.
//! Parsing is lenient: a lane with missing or non-numeric fields is still shown with what is there.

use serde::Serialize;
use serde_json::Value;

/// One lane of the gateway.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Lane {
    pub name: String,
    pub inflight: Option<u64>,
    pub queued: Option<u64>,
    pub rejected: Option<u64>,
    pub max_inflight: Option<u64>,
    pub max_queue: Option<u64>,
}

/// Parses the lanes document. Errors only when the body is not JSON or has no `lanes` array.
pub fn parse_lanes(body: &str) -> Result<Vec<Lane>, String> {
    let doc: Value =
        serde_json::from_str(body).map_err(|e| format!("lanes reply is not JSON: {e}"))?;
    let lanes = doc
        .get("lanes")
        .and_then(Value::as_array)
        .ok_or_else(|| "lanes reply has no \"lanes\" array".to_string())?;
    Ok(lanes
        .iter()
        .enumerate()
        .map(|(i, lane)| Lane {
            name: lane
                .get("name")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| format!("lane {}", i + 1)),
            inflight: number(lane, "inflight"),
            queued: number(lane, "queued"),
            rejected: number(lane, "rejected"),
            max_inflight: number(lane, "max_inflight"),
            max_queue: number(lane, "max_queue"),
        })
        .collect())
}

fn number(lane: &Value, key: &str) -> Option<u64> {
    let value = lane.get(key)?;
    value
        .as_u64()
        .or_else(|| value.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_and_partial_lanes_parse() {
        let body = r#"{"lanes":[
            {"name":"audio","inflight":2,"queued":1,"rejected":7,"max_inflight":4,"max_queue":8},
            {"name":"text","inflight":"busy"},
            {"queued":3}
        ],"other":true}"#;
        let lanes = parse_lanes(body).expect("parse");
        assert_eq!(lanes.len(), 3);
        assert_eq!(lanes[0].rejected, Some(7));
        assert_eq!(lanes[0].max_queue, Some(8));
        assert_eq!(lanes[1].name, "text");
        assert_eq!(lanes[1].inflight, None, "a non-number is shown as missing");
        assert_eq!(lanes[2].name, "lane 3");
        assert_eq!(lanes[2].queued, Some(3));
    }

    #[test]
    fn non_lane_documents_are_errors() {
        assert!(parse_lanes("<html>").unwrap_err().contains("not JSON"));
        assert!(
            parse_lanes("{\"error\":{}}")
                .unwrap_err()
                .contains("no \"lanes\"")
        );
        assert_eq!(parse_lanes("{\"lanes\":[]}").expect("empty"), vec![]);
    }
}

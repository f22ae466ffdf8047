//! Which process listens on a TCP port: the LISTEN sockets of `/proc/net/tcp` and `/proc/net/tcp6`
//! on that port, their socket inodes matched against the `socket:[INODE]` links under
//! `/proc/*/fd`. This is how `serve`'s `[memory] watch = [URLs]` finds the process trees of the
//! upstreams it admits on; [`tree_listens`] re-checks a listener found before for a fraction of
//! the cost. The `/proc/net` tables are small fixed-format text that no maintained
//! crate parses without pulling in a whole process-inspection library, so it is read here.

use std::collections::HashSet;
use std::fs;

/// Why no listening process could be named.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ListenError {
    #[error("`{0}` has no port (expected http://HOST:PORT)")]
    NoPort(String),
    #[error("nothing listens on port {0}")]
    NotListening(u16),
    #[error(
        "a socket listens on port {0}, but no process of ours holds it (another user's or container's?)"
    )]
    NoOwner(u16),
}

/// The port of an `http://HOST:PORT` URL.
pub fn url_port(url: &str) -> Result<u16, ListenError> {
    let rest = url
        .trim_end_matches('/')
        .split_once("://")
        .map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or("");
    authority
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .filter(|p| *p != 0)
        .ok_or_else(|| ListenError::NoPort(url.to_string()))
}

/// Socket inodes of LISTEN entries for `port` in one `/proc/net/tcp`-format table.
pub fn listen_inodes(table: &str, port: u16) -> Vec<u64> {
    const LISTEN: &str = "0A";
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            let local = fields.get(1)?;
            let state = fields.get(3)?;
            let inode = fields.get(9)?.parse::<u64>().ok()?;
            let local_port = u16::from_str_radix(local.rsplit_once(':')?.1, 16).ok()?;
            (*state == LISTEN && local_port == port && inode != 0).then_some(inode)
        })
        .collect()
}

/// Whether process `pid` holds one of `inodes` open (false when it has gone or is not ours).
fn holds(pid: u32, inodes: &HashSet<u64>) -> bool {
    let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        fs::read_link(fd.path()).ok().is_some_and(|target| {
            target
                .to_str()
                .and_then(|t| t.strip_prefix("socket:["))
                .and_then(|t| t.strip_suffix(']'))
                .and_then(|t| t.parse::<u64>().ok())
                .is_some_and(|inode| inodes.contains(&inode))
        })
    })
}

/// PIDs holding one of `inodes` open, in ascending order.
fn holders(inodes: &HashSet<u64>) -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| holds(*pid, inodes))
        .collect();
    pids.sort_unstable();
    pids
}

/// Socket inodes listening on `port` (IPv4 and IPv6).
fn port_inodes(port: u16) -> HashSet<u64> {
    let mut inodes = HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        if let Ok(text) = fs::read_to_string(table) {
            inodes.extend(listen_inodes(&text, port));
        }
    }
    inodes
}

/// Whether a process of `root`'s tree still listens on `port`. Reads only that tree's file
/// descriptors, so a listener found once can be checked every second for little; finding one
/// ([`listening_pid`]) reads every process's.
pub fn tree_listens(root: u32, port: u16) -> bool {
    let inodes = port_inodes(port);
    !inodes.is_empty()
        && crate::host::process_tree(root)
            .into_iter()
            .any(|pid| holds(pid, &inodes))
}

fn parent(pid: u32) -> Option<u32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: the fields start after the last ')'.
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(1)?.parse().ok()
}

/// The process listening on `port`. When several hold the socket (a server that forks workers
/// after binding), the one whose parent does not hold it: the root of their tree.
pub fn listening_pid(port: u16) -> Result<u32, ListenError> {
    let inodes = port_inodes(port);
    if inodes.is_empty() {
        return Err(ListenError::NotListening(port));
    }
    let pids = holders(&inodes);
    pids.iter()
        .copied()
        .find(|pid| parent(*pid).is_none_or(|pp| !pids.contains(&pp)))
        .ok_or(ListenError::NoOwner(port))
}

/// The process listening on the port of an `http://HOST:PORT` URL.
pub fn url_listener(url: &str) -> Result<u32, ListenError> {
    listening_pid(url_port(url)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1 0000000000000000 100 0 0 10 0
   1: 0100007F:1F90 0100007F:D2A4 01 00000000:00000000 00:00000000 00000000  1000        0 777 1 0000000000000000 20 4 30 10 -1
   2: 00000000:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 99 1 0000000000000000 100 0 0 10 0
";

    #[test]
    fn only_listen_rows_on_the_port_count() {
        assert_eq!(listen_inodes(TABLE, 8080), vec![4242]);
        assert_eq!(listen_inodes(TABLE, 80), vec![99]);
        assert!(listen_inodes(TABLE, 81).is_empty());
        assert!(listen_inodes("header only\n", 8080).is_empty());
    }

    #[test]
    fn ports_come_from_urls() {
        assert_eq!(url_port("http://127.0.0.1:8001"), Ok(8001));
        assert_eq!(url_port("http://[::1]:9000/"), Ok(9000));
        assert!(url_port("http://localhost").is_err());
    }

    #[test]
    fn finds_this_process_listening_and_nobody_on_a_closed_port() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        assert_eq!(listening_pid(port), Ok(std::process::id()));
        assert!(tree_listens(std::process::id(), port));
        drop(listener);
        assert_eq!(listening_pid(port), Err(ListenError::NotListening(port)));
        assert!(!tree_listens(std::process::id(), port));
    }
}

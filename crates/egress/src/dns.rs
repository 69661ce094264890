//! Just enough of the DNS wire format (RFC 1035) to filter queries: read a query's question, build
//! NXDOMAIN/REFUSED/empty answers, and read the addresses (and their TTLs) out of an upstream answer.

use std::net::IpAddr;

pub const TYPE_A: u16 = 1;
pub const TYPE_CNAME: u16 = 5;
pub const TYPE_AAAA: u16 = 28;

pub const RCODE_NOERROR: u8 = 0;
pub const RCODE_SERVFAIL: u8 = 2;
pub const RCODE_NXDOMAIN: u8 = 3;
pub const RCODE_REFUSED: u8 = 5;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Question {
    /// Lower-case, dot-separated, no trailing dot.
    pub name: String,
    pub qtype: u16,
    pub qclass: u16,
    /// Where the question section ends in the message (answers built from the query copy up to it).
    pub end: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub name: String,
    pub rtype: u16,
    pub ttl: u32,
    pub addr: Option<IpAddr>,
}

fn u16_at(b: &[u8], i: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*b.get(i)?, *b.get(i + 1)?]))
}

/// Reads a (possibly compressed) name at `pos`; returns it and the position after it.
fn read_name(msg: &[u8], mut pos: usize) -> Option<(String, usize)> {
    let mut labels: Vec<String> = Vec::new();
    let mut end = None;
    let mut jumps = 0;
    loop {
        let len = *msg.get(pos)? as usize;
        if len & 0xC0 == 0xC0 {
            let ptr = (u16_at(msg, pos)? & 0x3FFF) as usize;
            end.get_or_insert(pos + 2);
            jumps += 1;
            if jumps > 32 || ptr >= msg.len() {
                return None;
            }
            pos = ptr;
            continue;
        }
        if len & 0xC0 != 0 {
            return None;
        }
        pos += 1;
        if len == 0 {
            break;
        }
        let label = msg.get(pos..pos + len)?;
        // A dot inside a label would make `a.b` (one label) read as two, so a name could match a
        // rule for another (`evil\.allowed.test` under `*.allowed.test`); bytes outside printable
        // ASCII have no place in a host name either. Such a name is refused, not escaped.
        if label.iter().any(|b| *b == b'.' || !b.is_ascii_graphic()) {
            return None;
        }
        labels.push(String::from_utf8_lossy(label).to_ascii_lowercase());
        pos += len;
        if labels.len() > 127 {
            return None;
        }
    }
    Some((labels.join("."), end.unwrap_or(pos)))
}

/// Whether the name written at the start of `labels` (up to where its reading ended) uses a pointer.
fn has_pointer(labels: &[u8]) -> bool {
    let mut i = 0;
    while let Some(&len) = labels.get(i) {
        if len & 0xC0 != 0 {
            return true;
        }
        i += usize::from(len) + 1;
    }
    false
}

/// The single question of a query (`None` for anything that is not a plain one-question query).
/// The question's name must be written out, not compressed: there is nothing before it to point at,
/// and a reply echoes the question section alone (a pointer past it would dangle there).
pub fn parse_query(msg: &[u8]) -> Option<Question> {
    if msg.len() < 12 || msg[2] & 0x80 != 0 || u16_at(msg, 4)? != 1 {
        return None;
    }
    let (name, pos) = read_name(msg, 12)?;
    if has_pointer(&msg[12..pos]) {
        return None;
    }
    let qtype = u16_at(msg, pos)?;
    let qclass = u16_at(msg, pos + 2)?;
    Some(Question {
        name,
        qtype,
        qclass,
        end: pos + 4,
    })
}

/// An answer to `query` with no records and the given code (NXDOMAIN for denied names).
pub fn reply_empty(query: &[u8], q: &Question, rcode: u8) -> Vec<u8> {
    let mut out = query[..q.end].to_vec();
    out[2] = 0x80 | (query[2] & 0x01); // QR, keep RD
    out[3] = 0x80 | (rcode & 0x0F); // RA
    out[6..12].fill(0); // no answer, authority or additional records
    out
}

/// The question (name, type) an answer is for.
pub fn parse_query_of_answer(msg: &[u8]) -> Option<(String, u16)> {
    if msg.len() < 12 || msg[2] & 0x80 == 0 || msg[2] & 0x78 != 0 || u16_at(msg, 4)? != 1 {
        return None;
    }
    let (name, pos) = read_name(msg, 12)?;
    Some((name, u16_at(msg, pos)?))
}

/// The records of an upstream answer's answer section.
pub fn parse_answers(msg: &[u8]) -> Option<(u8, Vec<Answer>)> {
    if msg.len() < 12 {
        return None;
    }
    let rcode = msg[3] & 0x0F;
    let qd = u16_at(msg, 4)?;
    let an = u16_at(msg, 6)?;
    let mut pos = 12;
    for _ in 0..qd {
        let (_, p) = read_name(msg, pos)?;
        pos = p + 4;
    }
    let mut answers = Vec::new();
    for _ in 0..an {
        let (name, p) = read_name(msg, pos)?;
        let rtype = u16_at(msg, p)?;
        let ttl = u32::from_be_bytes(msg.get(p + 4..p + 8)?.try_into().ok()?);
        let rdlen = u16_at(msg, p + 8)? as usize;
        let rdata = msg.get(p + 10..p + 10 + rdlen)?;
        let addr = match (rtype, rdlen) {
            (TYPE_A, 4) => Some(IpAddr::from(<[u8; 4]>::try_from(rdata).ok()?)),
            (TYPE_AAAA, 16) => Some(IpAddr::from(<[u8; 16]>::try_from(rdata).ok()?)),
            _ => None,
        };
        answers.push(Answer {
            name,
            rtype,
            ttl,
            addr,
        });
        pos = p + 10 + rdlen;
    }
    Some((rcode, answers))
}

/// Builds a query (used by tests and by health checks).
pub fn build_query(id: u16, name: &str, qtype: u16) -> Vec<u8> {
    let mut m = Vec::with_capacity(32 + name.len());
    m.extend_from_slice(&id.to_be_bytes());
    m.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.trim_end_matches('.').split('.') {
        m.push(label.len() as u8);
        m.extend_from_slice(label.as_bytes());
    }
    m.push(0);
    m.extend_from_slice(&qtype.to_be_bytes());
    m.extend_from_slice(&1u16.to_be_bytes());
    m
}

/// Builds an answer with A/AAAA records for `query` (used by test DNS servers).
pub fn build_answer(query: &[u8], q: &Question, addrs: &[IpAddr], ttl: u32) -> Vec<u8> {
    let mut out = reply_empty(query, q, RCODE_NOERROR);
    let mut n = 0u16;
    for a in addrs {
        let (rtype, data): (u16, Vec<u8>) = match a {
            IpAddr::V4(v4) if q.qtype == TYPE_A => (TYPE_A, v4.octets().to_vec()),
            IpAddr::V6(v6) if q.qtype == TYPE_AAAA => (TYPE_AAAA, v6.octets().to_vec()),
            _ => continue,
        };
        out.extend_from_slice(&[0xC0, 12]); // the question's name
        out.extend_from_slice(&rtype.to_be_bytes());
        out.extend_from_slice(&1u16.to_be_bytes());
        out.extend_from_slice(&ttl.to_be_bytes());
        out.extend_from_slice(&(data.len() as u16).to_be_bytes());
        out.extend_from_slice(&data);
        n += 1;
    }
    out[6..8].copy_from_slice(&n.to_be_bytes());
    out
}

/// Sends `query` on `upstream` (a socket connected to the resolver, so only it can answer) and
/// returns the answer to it — same id, same question, nothing else — or SERVFAIL after 5 s.
pub async fn ask(upstream: &tokio::net::UdpSocket, query: &[u8], q: &Question) -> Vec<u8> {
    let servfail = || reply_empty(query, q, RCODE_SERVFAIL);
    if upstream.send(query).await.is_err() {
        return servfail();
    }
    let mut buf = vec![0u8; 4096];
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match tokio::time::timeout_at(deadline, upstream.recv(&mut buf)).await {
            Ok(Ok(n))
                if n >= 12
                    && buf[..2] == query[..2]
                    && parse_query_of_answer(&buf[..n]) == Some((q.name.clone(), q.qtype)) =>
            {
                return buf[..n].to_vec()
            }
            Ok(Ok(_)) => continue,
            _ => return servfail(),
        }
    }
}

/// The IPv4 addresses an answer holds, with their TTLs.
pub fn ipv4_answers(reply: &[u8]) -> Vec<(std::net::Ipv4Addr, u32)> {
    parse_answers(reply)
        .map(|(_, answers)| {
            answers
                .iter()
                .filter_map(|a| match a.addr {
                    Some(IpAddr::V4(v4)) => Some((v4, a.ttl)),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_round_trip() {
        let q = build_query(0x1234, "Api.Example.com.", TYPE_A);
        let parsed = parse_query(&q).expect("query");
        assert_eq!(parsed.name, "api.example.com");
        assert_eq!(
            (parsed.qtype, parsed.qclass, parsed.end),
            (TYPE_A, 1, q.len())
        );
        let nx = reply_empty(&q, &parsed, RCODE_NXDOMAIN);
        assert_eq!(&nx[..2], &[0x12, 0x34]);
        assert_eq!(nx[3] & 0x0F, RCODE_NXDOMAIN);
        assert!(nx[2] & 0x80 != 0, "a response");
        assert_eq!(parse_answers(&nx), Some((RCODE_NXDOMAIN, vec![])));
    }

    #[test]
    fn answers_with_compression() {
        let q = build_query(7, "a.test", TYPE_A);
        let parsed = parse_query(&q).expect("query");
        let ips: Vec<IpAddr> = vec![
            "198.18.0.2".parse().expect("ip"),
            "::1".parse().expect("ip"),
        ];
        let ans = build_answer(&q, &parsed, &ips, 30);
        let (rcode, answers) = parse_answers(&ans).expect("answers");
        assert_eq!(rcode, RCODE_NOERROR);
        assert_eq!(answers.len(), 1, "only the A record for an A query");
        assert_eq!(answers[0].name, "a.test");
        assert_eq!(answers[0].addr, Some(ips[0]));
        assert_eq!(answers[0].ttl, 30);
    }

    #[test]
    fn a_dot_inside_a_label_is_refused() {
        // "evil.allowed" as ONE label, then "test": joined naively it reads evil.allowed.test.
        let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        q.push(12);
        q.extend_from_slice(b"evil.allowed");
        q.push(4);
        q.extend_from_slice(b"test");
        q.extend_from_slice(&[0, 0, 1, 0, 1]);
        assert!(parse_query(&q).is_none());
        let mut nul = build_query(1, "a.test", TYPE_A);
        nul[13] = 0;
        assert!(parse_query(&nul).is_none());
        assert_eq!(
            parse_query(&build_query(1, "ok-1_x.test", TYPE_A))
                .expect("plain")
                .name,
            "ok-1_x.test"
        );
    }

    #[test]
    fn garbage_is_rejected() {
        assert!(parse_query(&[0u8; 5]).is_none());
        let mut loop_ptr = build_query(1, "x", TYPE_A);
        loop_ptr[12] = 0xC0;
        loop_ptr[13] = 12; // points at itself
        assert!(parse_query(&loop_ptr).is_none());
        // found by fuzzing: a question whose name points past the question section
        let forward = [
            0x3f, 0xff, 0x0e, 0x00, 0x00, 0x01, 0x2b, 0x0e, 0x00, 0x00, 0x00, 0x01, 0xc0, 0x12,
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x09, 0x01, 0x00, 0x01, 0x25, 0x2b, 0x6a,
            0x6b,
        ];
        assert!(parse_query(&forward).is_none());
    }
}

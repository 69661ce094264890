//! The egress DNS filter's parser: every query a sandbox sends and every answer upstream returns.
//! Besides never panicking, what it builds from a query it accepted must read back as an answer to
//! that question.
#![no_main]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use libfuzzer_sys::fuzz_target;
use warren_egress::dns;

fuzz_target!(|data: &[u8]| {
    let _ = dns::parse_answers(data);
    let _ = dns::parse_query_of_answer(data);
    let Some(q) = dns::parse_query(data) else {
        return;
    };
    assert!(q.end <= data.len());
    assert!(!q.name.contains(".."), "an empty label inside {:?}", q.name);
    let refused = dns::reply_empty(data, &q, dns::RCODE_NXDOMAIN);
    let (rcode, answers) = dns::parse_answers(&refused).expect("our NXDOMAIN reads back");
    assert_eq!((rcode, answers.len()), (dns::RCODE_NXDOMAIN, 0));
    let addrs = [
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)),
        IpAddr::V6(Ipv6Addr::LOCALHOST),
    ];
    let answer = dns::build_answer(data, &q, &addrs, 30);
    let (_, answers) = dns::parse_answers(&answer).expect("our answer reads back");
    let wanted = usize::from(q.qtype == dns::TYPE_A || q.qtype == dns::TYPE_AAAA);
    assert_eq!(answers.len(), wanted);
    assert!(answers.iter().all(|a| a.name == q.name && a.ttl == 30));
});

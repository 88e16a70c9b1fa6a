use super::*;
use crate::kv::events::{KvEventBatch, KvEventLog};

const BS: usize = 2;

/// Device blocks stored (a chain of two under adapter key 77, one more), one removed, a
/// clear; then the host tier stores two and removes one.
fn sample() -> KvEventBatch {
    let mut device = KvEventLog::default();
    device.set_enabled(true, BS);
    device.stored(10, ROOT_HASH, &[1, 2], 77);
    device.stored(11, 10, &[3, 70_000], 77);
    device.stored(12, ROOT_HASH, &[5, 6], 0);
    device.removed(10);
    device.all_cleared();
    let mut host = KvEventLog::for_medium(Medium::Host);
    host.set_enabled(true, BS);
    host.stored_in_tier(20);
    host.stored_in_tier(21);
    host.removed(20);
    let mut b = device.drain();
    b.append(host.drain());
    b
}

fn options() -> EncodeOptions<'static> {
    EncodeOptions {
        block_size: BS,
        lora: &[(77, 3)],
        device_medium: Some("GPU"),
        data_parallel_rank: Some(1),
    }
}

#[test]
fn a_batch_decodes_to_the_records_it_was_encoded_from() {
    let b = sample();
    let bytes = encode(2.5, &Records::of(&b), &options()).unwrap();
    let d = decode(&bytes).unwrap();
    assert_eq!((d.ts, d.data_parallel_rank), (2.5, Some(1)));
    assert_eq!(d.kinds, b.kinds);
    assert_eq!(d.starts, b.starts);
    assert_eq!(d.hashes, b.hashes);
    assert!(d.hash_is_int.iter().all(|&i| i));
    let (dev, host) = (Medium::Device as u8, Medium::Host as u8);
    assert_eq!(d.media, vec![dev, dev, dev, dev, host, host]);
    assert_eq!(d.parents[..3], [None, None, None]);
    assert_eq!(d.lora_ids[..2], [Some(3), None]);
    assert_eq!(d.record_tokens(0), &[1, 2, 3, 70_000]);
    assert_eq!(d.record_tokens(1), &[5, 6]);
    assert!(
        d.record_tokens(4).is_empty(),
        "a tier's blocks list no tokens"
    );
    assert_eq!(d.block_sizes[0], Some(BS as u32));
    assert!(d.plain.iter().all(|&p| p));
}

#[test]
fn a_chain_continued_in_a_later_step_names_its_parent() {
    let mut log = KvEventLog::default();
    log.set_enabled(true, BS);
    log.stored(11, 10, &[3, 4], 0);
    let b = log.drain();
    let d = decode(&encode(0.0, &Records::of(&b), &options()).unwrap()).unwrap();
    assert_eq!(d.parents, vec![Some(10)]);
}

#[test]
fn a_batch_without_tokens_decodes_with_none() {
    let b = sample();
    let records = Records {
        tokens: &[],
        ..Records::of(&b)
    };
    let d = decode(&encode(0.0, &records, &options()).unwrap()).unwrap();
    assert!(d.tokens.is_empty() && d.token_starts.iter().all(|&s| s == 0));
    assert_eq!(d.hashes, b.hashes);
}

#[test]
fn records_that_do_not_add_up_are_refused_when_encoding() {
    let b = sample();
    let short = Records {
        starts: &b.starts[1..],
        ..Records::of(&b)
    };
    assert!(encode(0.0, &short, &options()).is_err());
    let bad_medium = [9u8; 6];
    let records = Records {
        media: &bad_medium,
        ..Records::of(&b)
    };
    let e = encode(0.0, &records, &options()).unwrap_err();
    assert!(e.0.contains("medium code 9"), "{e}");
}

/// msgpack by hand: an array header, a map header, a short string, an unsigned int.
fn arr(n: u8) -> u8 {
    0x90 | n
}

fn s(text: &str) -> Vec<u8> {
    let mut v = vec![0xa0 | text.len() as u8];
    v.extend_from_slice(text.as_bytes());
    v
}

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

#[test]
fn vllms_array_form_events_and_digest_hashes_are_read() {
    // [1, [["BlockStored", [bin 32 bytes, 5], nil, [1, 2, 3, 4], 2, nil, "CPU"]]]
    let digest: Vec<u8> = (0..32).collect();
    let mut bin = vec![0xc4, 32];
    bin.extend_from_slice(&digest);
    let payload = cat(&[
        &[arr(2), 1, arr(1), arr(7)],
        &s("BlockStored"),
        &[arr(2)],
        &bin,
        &[5, 0xc0, arr(4), 1, 2, 3, 4, 2, 0xc0],
        &s("CPU"),
    ]);
    let d = decode(&payload).unwrap();
    let low = u64::from_be_bytes(digest[24..].try_into().unwrap());
    assert_eq!(d.hashes, vec![low, 5]);
    assert_eq!(d.hash_is_int, vec![false, true]);
    assert_eq!(d.media, vec![Medium::Host as u8]);
    let own = d.own_records();
    assert_eq!((own.hashes, own.starts), (vec![5], vec![0, 1]));
}

#[test]
fn a_map_form_batch_and_unknown_events_are_read_and_skipped() {
    // {"ts": 1, "events": [["Weird"], ["AllBlocksCleared"]]}
    let payload = cat(&[
        &[0x82],
        &s("ts"),
        &[1],
        &s("events"),
        &[arr(2), arr(1)],
        &s("Weird"),
        &[arr(1)],
        &s("AllBlocksCleared"),
    ]);
    let d = decode(&payload).unwrap();
    assert_eq!(d.kinds, vec![KvEventKind::AllCleared as u8]);
    assert_eq!(d.starts, vec![0, 0]);
}

fn err(payload: &[u8]) -> DecodeError {
    decode(payload).expect_err("malformed")
}

#[test]
fn malformed_payloads_are_typed_errors_naming_what_is_wrong() {
    assert!(matches!(err(&[]), DecodeError::NotMsgpack(_)));
    assert!(matches!(err(&[0xc1]), DecodeError::NotMsgpack(_)));
    assert!(matches!(
        err(&[0xdd, 0xff, 0xff, 0xff, 0xff]),
        DecodeError::NotMsgpack(_)
    ));
    assert!(
        matches!(err(&[arr(2), 1, arr(0), 7]), DecodeError::NotMsgpack(m) if m.contains("after"))
    );
    assert!(matches!(err(&[0xa1, 0xff]), DecodeError::NotMsgpack(m) if m.contains("UTF-8")));
    assert!(matches!(err(&[arr(1), 1]), DecodeError::NotABatch(_)));
    assert!(matches!(err(&[arr(2), 0xc3, arr(0)]), DecodeError::NotABatch(m) if m.contains("ts")));
    assert!(matches!(err(&[arr(2), 1, 5]), DecodeError::NotABatch(m) if m.contains("events")));
    // an event that is an int, a tag that is not a name, hashes that are not hashes
    assert!(matches!(
        err(&[arr(2), 1, arr(1), 5]),
        DecodeError::BadEvent(_)
    ));
    assert!(
        matches!(err(&[arr(2), 1, arr(1), arr(1), 5]), DecodeError::BadEvent(m) if m.contains("type"))
    );
    let neg_hash = cat(&[
        &[arr(2), 1, arr(1), arr(2)],
        &s("BlockRemoved"),
        &[arr(1), 0xff],
    ]);
    assert!(matches!(err(&neg_hash), DecodeError::BadEvent(m) if m.contains("block_hashes")));
    let big_token = cat(&[
        &[arr(2), 1, arr(1), arr(4)],
        &s("BlockStored"),
        &[arr(0), 0xc0, arr(1), 0xcf, 0, 0, 0, 1, 0, 0, 0, 0],
    ]);
    assert!(matches!(err(&big_token), DecodeError::BadEvent(m) if m.contains("token_ids")));
    let zero_size = cat(&[
        &[arr(2), 1, arr(1), arr(5)],
        &s("BlockStored"),
        &[arr(0), 0xc0, arr(0), 0],
    ]);
    assert!(matches!(err(&zero_size), DecodeError::BadEvent(m) if m.contains("block_size")));
    let medium_int = cat(&[
        &[arr(2), 1, arr(1), arr(3)],
        &s("BlockRemoved"),
        &[arr(0), 3],
    ]);
    assert!(matches!(err(&medium_int), DecodeError::BadEvent(m) if m.contains("medium")));
}

#[test]
fn nesting_past_the_bound_is_refused_not_a_stack_overflow() {
    let deep = vec![arr(1); 100_000];
    assert!(matches!(err(&deep), DecodeError::NotMsgpack(m) if m.contains("nested")));
}

#[test]
fn any_prefix_or_byte_flip_of_a_batch_decodes_or_errs_and_never_panics() {
    let b = sample();
    let bytes = encode(1.0, &Records::of(&b), &options()).unwrap();
    for n in 0..bytes.len() {
        assert!(decode(&bytes[..n]).is_err(), "a prefix of {n} bytes");
    }
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..20_000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let mut flipped = bytes.clone();
        let at = (state % flipped.len() as u64) as usize;
        flipped[at] = (state >> 32) as u8;
        let _ = decode(&flipped);
    }
}
